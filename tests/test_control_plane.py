"""The control-plane benchmark's code path at 64 simulated ranks, so that it cannot rot.

``benchmarks/control_plane.py`` measures 64, 256 and 1,000 ranks; this runs its
:func:`measure` once at 64 with a short window: a real scheduler process with dask-ddp's
plugin, 64 Dask workers hosted by two lane processes (:mod:`dask_ddp._rank.lanes`), one job
through the real supervisor and rank task (``report()``, status, checkpoints through the
job's store), a rank failure and the abort of the others. It checks what the benchmark's
table reports, never how fast.
"""

from __future__ import annotations

import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import control_plane  # noqa: E402

pytestmark = pytest.mark.slow


def test_64_simulated_ranks_deliver_every_record_and_stop_on_a_failure() -> None:
    result = control_plane.measure(64, processes=2, settle=0.5, window=2.0, store_processes=0)
    assert result.records > 64 * 20  # every rank reported through the window
    assert (result.lost, result.unaccounted) == (0, 0), result
    assert result.state == "failed" and result.failed_rank == 32, result
    assert result.failure_to_stopped == result.failure_to_stopped  # not NaN: its record came
    assert result.page_kb > 0  # the /ddp/ page answered for the job
    assert result.delay_p50 > 0 and result.scheduler_cpu > 0

"""Cancel and kill storms on a real cluster.

The small round of ``benchmarks/storms.py`` (which runs 200 cancel rounds and 50 kill
rounds): a job cancelled at a random moment (placed, gathering, training, importing)
gives its workers back and the next job runs on them, inheriting nothing; a job whose
rank's worker is SIGKILLed at a random moment restarts from its last checkpoint, trains
every step exactly once, and the next job runs on the same workers.

The suite runs them on a quiet machine; ``benchmarks/storms.py`` runs them beside two
CPU-busy processes (``storms.cpu_load``), with many more rounds (BENCHMARKS.md).
"""

from __future__ import annotations

import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import storms  # noqa: E402


@pytest.mark.slow
def test_a_cancel_storm_never_strands_the_cluster_nor_restarts_a_worker() -> None:
    said: list[str] = []
    # The default configuration; the storm itself checks the workers' pids, their
    # persisted data and that no rank process is left, and fails if not.
    results = storms.run_cancel_storm(6, seed=1, say=said.append)  # each kind once
    assert len(results) == 6, said
    assert {r["kind"] for r in results} == set(storms.KINDS), said


@pytest.mark.slow
def test_a_kill_storm_restarts_and_trains_every_step_once() -> None:
    said: list[str] = []
    results = storms.run_kill_storm(3, seed=1, say=said.append)
    assert len(results) == 3, said
    assert sum(r["restarts"] for r in results) >= 1, said  # a kill landed while it trained

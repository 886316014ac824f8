"""The process-level measures of a rank (dask_ddp._rank.process), each on the real thing."""

from __future__ import annotations

import multiprocessing

import pytest
import torch.distributed as dist

from dask_ddp._rank import process


@pytest.mark.parametrize(
    ("exc", "lost"),
    [
        (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"), True),
        (dist.DistError("Connection reset by peer"), True),
        (RuntimeError("Broken pipe"), True),
        (RuntimeError("Timed out waiting 1800000ms for recv operation"), False),
        (OSError("Connection closed by peer"), False),
    ],
)
def test_is_peer_loss(exc: BaseException, lost: bool) -> None:
    assert process.is_peer_loss(exc) is lost


def _start_methods(results) -> None:
    before = multiprocessing.get_start_method()
    with process.platform_start_method():
        inside = multiprocessing.get_start_method()
    results.put((before, inside, multiprocessing.get_start_method()))


def test_platform_start_method_undoes_what_a_spawned_worker_inherits() -> None:
    # A Dask worker is a spawned process: its own default is spawn, not the platform's.
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_start_methods, args=(results,))
    proc.start()
    outcome = results.get(timeout=60)
    proc.join(60)
    default = multiprocessing.get_all_start_methods()[0]
    assert outcome == ("spawn", default, "spawn")

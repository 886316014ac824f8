"""The command line's own LocalCluster, built as ``python -m dask_ddp`` builds it
(``cli._start_local_cluster``): it keeps its workers through kills that a plain
LocalCluster does not survive."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import dask
import pytest
from distributed import Client

import dask_ddp
from dask_ddp._client import cli

LOST_WORKER_TIMEOUT = "distributed.deploy.lost-worker-timeout"


def _pid_of(client: Client, name: object, not_at: str | None = None) -> tuple[str, int]:
    """The address and process id of the worker named ``name`` once one has joined at an
    address other than ``not_at`` (a killed process's)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for address, info in client.scheduler_info(n_workers=-1)["workers"].items():
            if info["name"] == name and address != not_at:
                return address, client.run(os.getpid, workers=[address])[address]
        time.sleep(0.1)
    raise TimeoutError(f"worker {name!r} did not join within 120 s")


def _rank_and_size() -> tuple[int, int]:
    ctx = dask_ddp.get_context()
    return ctx.rank, ctx.world_size


@pytest.mark.slow
def test_own_cluster_keeps_a_worker_killed_twice_within_the_lost_worker_timeout(
    tmp_path: Path,
) -> None:
    # SpecCluster arms a lost-worker-timeout timer (15 s) at each removal and never cancels
    # it: the first kill's timer fires while the worker restarts from the second kill, and
    # on a plain LocalCluster it closes that worker's nanny for good.
    assert dask.config.get(LOST_WORKER_TIMEOUT) == "15s"  # the race this test times
    with dask.config.set({LOST_WORKER_TIMEOUT: "15s"}):  # undoes what the command sets
        cluster = cli._start_local_cluster(2, str(tmp_path), dashboard=False, verbose=False)
        with cluster, Client(cluster) as client:
            client.wait_for_workers(2, timeout=120)
            name = next(iter(cluster.workers))
            first_address, first = _pid_of(client, name)
            os.kill(first, signal.SIGKILL)
            killed = time.monotonic()
            # The nanny starts a new worker process under the same name; kill it too, half
            # a second before the first kill's timer fires, so that it fires mid-restart.
            second_address, second = _pid_of(client, name, not_at=first_address)
            time.sleep(max(0.0, killed + 14.5 - time.monotonic()))
            os.kill(second, signal.SIGKILL)
            time.sleep(max(0.0, killed + 20 - time.monotonic()))  # past the first timer
            client.wait_for_workers(2, timeout=60)
            assert len(cluster.workers) == 2, cluster.workers
            _, third = _pid_of(client, name, not_at=second_address)
            assert third not in (first, second)
            out = dask_ddp.launch(client, _rank_and_size, workers=2).result(timeout=120)
            assert out == [(0, 2), (1, 2)]
    assert dask.config.get(LOST_WORKER_TIMEOUT) == "15s"

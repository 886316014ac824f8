"""Jobs on adaptive clusters (``cluster.adapt()``): a job's missing workers are demand that
Dask's adaptive scaling sees, so the first job scales the cluster up to its size and an
elastic job grows to its most as workers arrive; workers that hold a job's ranks are never
chosen for scale-down."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from distributed import Client, LocalCluster
from test_elastic import _final_state, _placements, counted

import dask_ddp


def _cluster(n_workers: int) -> LocalCluster:
    return LocalCluster(
        n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0"
    )


def _rank() -> int:
    return dask_ddp.get_context().rank


@pytest.mark.slow
def test_a_job_scales_an_empty_adaptive_cluster_up_to_its_size() -> None:
    with _cluster(0) as cluster, Client(cluster) as client:
        cluster.adapt(minimum=0, maximum=2, interval="200ms")
        job = dask_ddp.launch(client, _rank, workers=2)  # waits for workers, never raises
        assert job.result(timeout=180) == [0, 1]
        assert [t.state.value for t in job.history][-2:] == ["running", "succeeded"]


@pytest.mark.slow
def test_an_elastic_job_grows_to_its_most_on_an_adaptive_cluster(tmp_path: Path) -> None:
    with _cluster(1) as cluster, Client(cluster) as client:
        client.wait_for_workers(1, timeout=60)
        cluster.adapt(minimum=1, maximum=3, interval="200ms")
        job = dask_ddp.launch(
            # At most 2,400 steps (2 minutes): it ends 20 steps after it reached 3 ranks,
            # however long the cluster took to start them.
            client, counted, args=(2400, 10, 0.05, True, (3, 20)), workers=3, min_workers=1,
            checkpoint_dir=str(tmp_path),
        )  # fmt: skip
        results = job.result(timeout=240)
        assert max(t.world_size for t in job.history) == 3
        assert [t.world_size for t in _placements(job)][-1] == 3
        assert [r["world_size"] for r in results] == [3, 3, 3]
        trained = _final_state(tmp_path)["trained"].tolist()  # each step once, in order
        assert trained == list(range(len(trained))) and len(trained) > 20


@pytest.mark.slow
def test_workers_that_hold_a_job_are_not_scaled_down() -> None:
    # Adaptive scale-down sees no demand beyond the running ranks (whose tasks look short),
    # yet the job's workers stay until it ends.
    with _cluster(2) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        job = dask_ddp.launch(client, time.sleep, args=(4,), workers=2)
        cluster.adapt(minimum=0, maximum=2, interval="200ms", wait_count=1)
        assert job.result(timeout=120) == [None, None]
        assert job.attempts == 1  # never lost a worker

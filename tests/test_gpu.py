"""GPU paths: nccl chosen on GPU workers, one GPU per rank. Skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import Client, LocalCluster

import dask_ddp

pytestmark = pytest.mark.gpu


def _on_gpu() -> dict:
    import torch.distributed as dist

    ctx = dask_ddp.get_context()
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    return {
        "device": str(ctx.device),
        "backend": dist.get_backend(),
        "sum": t.item(),
        "first_visible": os.environ["CUDA_VISIBLE_DEVICES"].split(",")[0],
    }


def test_one_rank_per_gpu_with_nccl() -> None:
    n = torch.cuda.device_count()
    with (
        LocalCluster(n_workers=n, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        job = dask_ddp.launch(client, _on_gpu)
        out = job.result(timeout=300)
    assert job.backend == "nccl"
    assert [o["device"] for o in out] == ["cuda:0"] * n  # its own GPU comes first
    assert {o["backend"] for o in out} == {"nccl"}
    assert [o["sum"] for o in out] == [float(n)] * n
    assert sorted(o["first_visible"] for o in out) == [str(i) for i in range(n)]


def test_more_ranks_than_gpus_falls_back_to_gloo() -> None:
    n = torch.cuda.device_count() + 1
    with (
        LocalCluster(n_workers=n, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        job = dask_ddp.launch(client, dask_ddp.get_context)
        assert job.backend == "gloo"
        with pytest.raises(dask_ddp.BackendUnavailableError, match="GPU of its own"):
            dask_ddp.launch(client, dask_ddp.get_context, backend="nccl")
        assert len(job.result(timeout=300)) == n

"""GPU paths: nccl on GPU workers, one GPU per rank, checkpoints of CUDA tensors, DCP.
Skipped without CUDA (tests/conftest.py). Needs no other fixture: benchmarks/gpu.py runs
this file with ``--noconftest`` on a machine that lacks the S3 test servers' packages.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch
from distributed import Client, Event, LocalCluster

import dask_ddp

pytestmark = pytest.mark.gpu


def _cluster(n: int) -> LocalCluster:
    return LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0")


def _on_gpu() -> dict:
    import torch.distributed as dist

    ctx = dask_ddp.get_context()
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    return {
        "device": str(ctx.device),
        "local_rank": ctx.local_rank,
        "LOCAL_RANK": os.environ["LOCAL_RANK"],
        "current": torch.cuda.current_device(),
        "uuid": str(torch.cuda.get_device_properties(ctx.device).uuid),
        "backend": dist.get_backend(),
        "sum": t.item(),
    }


def test_one_rank_per_gpu_with_nccl() -> None:
    n = torch.cuda.device_count()
    with _cluster(n) as cluster, Client(cluster) as client:
        job = dask_ddp.launch(client, _on_gpu)
        out = job.result(timeout=300)
    assert job.backend == "nccl"
    # Each rank's own GPU is cuda:LOCAL_RANK, and the current device.
    assert [o["device"] for o in out] == [f"cuda:{i}" for i in range(n)]
    assert [o["current"] for o in out] == [o["local_rank"] for o in out] == list(range(n))
    assert [o["LOCAL_RANK"] for o in out] == [str(i) for i in range(n)]
    assert len({o["uuid"] for o in out}) == n  # n different GPUs
    assert {o["backend"] for o in out} == {"nccl"}
    assert [o["sum"] for o in out] == [float(n)] * n


def _hold(event: str) -> int:
    Event(event).wait(timeout=120)
    return dask_ddp.get_context().rank


def test_more_ranks_than_gpus_falls_back_to_gloo() -> None:
    n = torch.cuda.device_count() + 1
    with _cluster(n) as cluster, Client(cluster) as client:
        job = dask_ddp.launch(client, _hold, args=("release",))
        assert job.backend == "gloo"  # backend=None: gloo, the reason in the log
        # nccl asked for while the first job holds every worker: the job waits for them
        # (launch returns at once), and fails once it has them, before any rank runs.
        waiting = dask_ddp.launch(client, dask_ddp.get_context, backend="nccl")
        Event("release", client).set()
        assert job.result(timeout=300) == list(range(n))
        with pytest.raises(dask_ddp.errors.BackendUnavailableError, match="GPU of its own") as info:
            waiting.result(timeout=300)
        assert f"ranks but {n - 1} GPU" in str(info.value)
        # With the workers free, launch itself raises.
        with pytest.raises(dask_ddp.errors.BackendUnavailableError, match="GPU of its own"):
            dask_ddp.launch(client, dask_ddp.get_context, backend="nccl")


def _all_reduce() -> str:
    ctx = dask_ddp.get_context()
    t = torch.ones(1, device=ctx.device)
    torch.distributed.all_reduce(t)
    return ctx.worker


def _own_process_group() -> tuple[bool, float]:
    """A plain Dask task that sets up a process group of its own, as users do."""
    import torch.distributed as dist

    before = dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        t = torch.ones(1, device="cuda")
        dist.all_reduce(t)
        return before, t.item()
    finally:
        dist.destroy_process_group()


def test_a_plain_task_after_a_job_on_the_same_worker_sees_no_process_group() -> None:
    with _cluster(1) as cluster, Client(cluster) as client:
        worker = dask_ddp.launch(client, _all_reduce, backend="nccl").result(timeout=300)[0]
        # Submitted right after the job's result: the worker is handed back clean.
        task = client.submit(_own_process_group, workers=[worker], pure=False)
        assert task.result(timeout=120) == (False, 1.0)


def _save_and_reload() -> dict:
    """Two saves of CUDA tensors (the first has no pinned buffers yet), then the state
    loaded back onto the rank's device."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    saving = logging.getLogger("dask_ddp._rank.saving")
    handler, level = Keep(), saving.level
    saving.addHandler(handler)
    saving.setLevel(logging.DEBUG)
    try:
        ctx = dask_ddp.get_context()
        gen = torch.Generator(device=ctx.device).manual_seed(0)
        w = torch.randn(1024, 1024, device=ctx.device, generator=gen)
        state = {
            "w": w,
            "view": w[3:7],  # shares w's storage
            "b": torch.arange(10, device=ctx.device, dtype=torch.bfloat16),
            "step": torch.tensor(1),  # a CPU tensor beside them, as Adam keeps its steps
        }
        expected = {k: v.clone() for k, v in state.items()}
        first = dask_ddp.save_checkpoint(state, step=1)
        w.add_(1)  # the next step, before the first save is written
        url = first.wait(120).url
        dask_ddp.save_checkpoint(state, step=2).wait(120)
        loaded = dask_ddp.get_checkpoint()  # the second, onto the rank's device
        with fsspec.open(url, "rb") as f:
            first_saved = torch.load(f, weights_only=True)
        return {
            "device": str(ctx.device),
            "devices": {k: str(v.device) for k, v in loaded.items()},
            "equal": {k: torch.equal(v.cpu(), state[k].cpu()) for k, v in loaded.items()},
            "first_equal": {
                k: torch.equal(v.cpu(), expected[k].cpu()) for k, v in first_saved.items()
            },
            "view_shares": loaded["view"].untyped_storage().data_ptr()
            == loaded["w"].untyped_storage().data_ptr(),
            "staged": [r for r in records if "staged" in r],
            "moved": [r for r in records if "moved off" in r],
        }
    finally:
        saving.removeHandler(handler)
        saving.setLevel(level)


def test_cuda_tensors_saved_load_back_onto_the_rank_s_device(tmp_path: Path) -> None:
    with _cluster(1) as cluster, Client(cluster) as client:
        out = dask_ddp.launch(client, _save_and_reload, checkpoint_dir=str(tmp_path)).result(
            timeout=300
        )[0]
    assert out["device"] == "cuda:0"
    assert set(out["devices"].values()) == {"cuda:0"}  # every tensor on the rank's device
    assert all(out["equal"].values()) and len(out["equal"]) == 4, out["equal"]
    assert all(out["first_equal"].values()), out["first_equal"]  # w as it was at the call
    assert out["view_shares"]
    # The first save had no pinned buffers: copied on the GPU, moved by the writer. The
    # second reused the pinned buffers.
    assert ["(partly on its devices)" in r for r in out["staged"]] == [True, False]
    assert len(out["moved"]) == 1


def _dcp_async_save(path: str) -> tuple[bool, str]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    ctx = dask_ddp.get_context()
    torch.manual_seed(0)  # the same on every rank, as DDP keeps it (DCP writes one copy)
    model = torch.nn.Linear(256, 256).to(ctx.device)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    future = dcp.async_save({"model": model.state_dict()}, checkpoint_id=path)
    with torch.no_grad():
        model.weight.add_(1)  # training goes on while it is written
    future.result()
    into = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
    dcp.load(into, checkpoint_id=path)
    same = all(torch.equal(into["model"][k], v) for k, v in saved.items())
    return same, dist.get_backend()


def test_dcp_async_save_with_gloo_beside_nccl(tmp_path: Path) -> None:
    n = torch.cuda.device_count()
    with _cluster(n) as cluster, Client(cluster) as client:
        job = dask_ddp.launch(
            client, _dcp_async_save, args=(str(tmp_path / "dcp"),), backend="cpu:gloo,cuda:nccl"
        )
        out = job.result(timeout=300)
    assert [same for same, _ in out] == [True] * n
    assert all("nccl" in backend and "gloo" in backend for _, backend in out), out


def test_the_driver_check_sees_cuda_start() -> None:
    # A fresh process: no CUDA until torch starts it; the check itself starts nothing.
    code = (
        "from dask_ddp._rank import cuda as _cuda; import torch; "
        "print(_cuda.driver_initialised()); torch.cuda.init(); print(_cuda.driver_initialised())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["False", "True"]


def test_a_checkpoint_copy_on_the_gpu_leaves_training_s_memory_alone() -> None:
    from dask_ddp._rank.saving import room_on_gpu

    free, _ = torch.cuda.mem_get_info()
    assert room_on_gpu(torch.device("cuda", 0), 1 << 20)
    assert not room_on_gpu(torch.device("cuda", 0), free)  # a tenth of the GPU stays free
    # Memory torch reserved at its peak counts as taken, even once it is given back.
    big = torch.empty(int(free * 0.5), dtype=torch.uint8, device="cuda")
    del big
    torch.cuda.empty_cache()
    assert not room_on_gpu(torch.device("cuda", 0), int(free * 0.45))

"""The dispatcher on a real LocalCluster (worker processes, gloo)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

import dask
import pytest
import torch
import torch.distributed as dist
from distributed import Client, Event
from distributed.utils_test import poll_for

import dask_ddp
from dask_ddp import dispatch


def _seen_by_rank(tag: str, *, local_rank: int | None = None) -> dict:
    ctx = dask_ddp.get_context()
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return {
        "tag": tag,
        "local_rank_kwarg": local_rank,
        "ctx": ctx,
        "env": {
            k: os.environ.get(k)
            for k in (
                "MASTER_ADDR",
                "MASTER_PORT",
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "CUDA_VISIBLE_DEVICES",
            )
        },
        "initialized": dist.is_initialized(),
        "backend": dist.get_backend(),
        "sum": t.item(),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }


async def _worker_state() -> dict:
    import asyncio
    import multiprocessing

    from dask_ddp._rank.slot import PROCESS

    def daemon() -> bool:
        return multiprocessing.current_process().daemon

    # The last rank's teardown ends just after its task (the worker's loop runs meanwhile).
    assert await asyncio.to_thread(PROCESS.wait_idle, 30)
    return {
        "rank_env": {k: os.environ.get(k) for k in ("RANK", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")},
        "initialized": dist.is_initialized(),
        "threads": torch.get_num_threads(),
        "daemon": await asyncio.to_thread(daemon),
    }


def test_ranks_env_and_context(client: Client) -> None:
    before = client.run(_worker_state)
    job = dask_ddp.launch(client, _seen_by_rank, args=("a",))
    out = job.result(timeout=120)
    assert [o["ctx"].rank for o in out] == [0, 1]
    workers = job.workers
    for rank, o in enumerate(out):
        ctx = o["ctx"]
        assert ctx.world_size == 2 and ctx.local_world_size == 2
        assert ctx.local_rank == rank and ctx.node_rank == 0
        assert ctx.backend == "gloo" == o["backend"] == job.backend
        assert ctx.device == torch.device("cpu")
        assert ctx.attempt == 0 and ctx.worker == workers[rank]
        assert o["initialized"] and o["sum"] == 3.0
        env = o["env"]
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == str(rank) and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" == ctx.master_addr
        assert env["MASTER_PORT"] == str(ctx.master_port) != "23456"
        assert env["CUDA_VISIBLE_DEVICES"] is None  # no GPUs: nothing rotated
        assert o["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
    assert out[0]["pid"] != out[1]["pid"]
    # The worker is left as it was: environment, process group, threads, daemon flag.
    assert client.run(_worker_state) == before


def test_run_is_dask_pytorch_ddp_compatible(client: Client) -> None:
    futures = dispatch.run(client, _seen_by_rank, "positional", pass_local_rank=True)
    assert len(futures) == 2
    out = [f.result(timeout=120) for f in futures]
    assert [o["tag"] for o in out] == ["positional", "positional"]
    assert [o["local_rank_kwarg"] for o in out] == [0, 1]
    assert [o["ctx"].rank for o in out] == [0, 1]
    assert all(f.key.startswith("ddp_") for f in futures)


def test_identical_arguments_train_again(client: Client) -> None:
    first = dask_ddp.launch(client, time.time_ns)
    first_result = first.result(timeout=60)
    second = dask_ddp.launch(client, time.time_ns)
    assert first_result != second.result(timeout=60)
    assert {f.key for f in first.futures}.isdisjoint(f.key for f in second.futures)
    assert first.job_id != second.job_id


def _ddp_train(batches: torch.Tensor, targets: torch.Tensor, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    half = batches.shape[1] // ctx.world_size
    for step in range(steps):
        x = batches[step, ctx.rank * half : (ctx.rank + 1) * half]
        y = targets[step, ctx.rank * half : (ctx.rank + 1) * half]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def test_ddp_matches_single_process_on_the_whole_batch(client: Client) -> None:
    steps, b = 6, 8
    g = torch.Generator().manual_seed(1)
    batches = torch.randn(steps, 2 * b, 8, generator=g)
    targets = torch.randn(steps, 2 * b, 1, generator=g)
    per_rank = dask_ddp.launch(client, _ddp_train, args=(batches, targets, steps)).result(
        timeout=120
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(batches[step]), targets[step]).backward()
        opt.step()
    for name, value in model.state_dict().items():
        for rank in (0, 1):
            torch.testing.assert_close(per_rank[rank][name], value, rtol=1e-5, atol=1e-6)


def _hold(name: str) -> int:
    Event(name).wait(timeout=60)
    return dask_ddp.get_context().master_port


def test_two_concurrent_jobs_on_disjoint_workers(client: Client) -> None:
    w0, w1 = sorted(client.scheduler_info(n_workers=-1)["workers"])
    release = Event("release-concurrent", client=client)
    a = dask_ddp.launch(client, _hold, args=("release-concurrent",), workers=[w0])
    b = dask_ddp.launch(client, _hold, args=("release-concurrent",), workers=[w1])
    # Both ranks run at the same time: each waits on the same event.
    _wait_until_processing(client, [a.futures[0].key, b.futures[0].key])
    release.set()
    (port_a,), (port_b,) = a.result(timeout=60), b.result(timeout=60)
    assert port_a != port_b


def _running(client: Client, keys: list[str]) -> bool:
    processing = client.processing()
    return set(keys) <= {k for on_worker in processing.values() for k in on_worker}


def _wait_until_processing(client: Client, keys: list[str]) -> None:
    poll_for(lambda: _running(client, keys), timeout=60)


def _stamp() -> tuple[float, float]:
    return time.time(), time.time()


def test_job_on_a_busy_worker_waits_for_it(client: Client) -> None:
    w0, _ = sorted(client.scheduler_info(n_workers=-1)["workers"])
    release = Event("release-busy", client=client)
    first = dask_ddp.launch(client, _hold, args=("release-busy",), workers=[w0])
    _wait_until_processing(client, [first.futures[0].key])
    second = dask_ddp.launch(client, _stamp, workers=[w0])
    assert not second.wait(timeout=1)  # queued behind the first job's rank
    released_at = time.time()
    release.set()
    assert first.result(timeout=60)
    ((started, _),) = second.result(timeout=60)
    assert started >= released_at


def _fail_at_step(bad_rank: int, fail_step: int) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10_000):
        if ctx.rank == bad_rank and step == fail_step:
            raise ValueError(f"bad batch at step {step}")
        opt.zero_grad()
        model(torch.randn(4, 4)).sum().backward()
        opt.step()
    return step


@pytest.mark.slow
def test_failing_rank_fails_the_job_fast(client: Client) -> None:
    job = dask_ddp.launch(client, _fail_at_step, args=(1, 5))
    with pytest.raises(dask_ddp.RankFailedError) as info:
        job.result(timeout=60)
    err = info.value
    assert err.rank == 1 and err.worker == job.workers[1] and err.key == job.futures[1].key
    assert "bad batch at step 5" in str(err)
    assert "_fail_at_step" in err.rank_traceback  # the rank's own frames
    assert "_rank/tasks.py" not in err.rank_traceback  # not ours, nor distributed's
    assert "distributed" not in err.rank_traceback
    assert "^^^" not in err.rank_traceback  # columns do not survive the trip
    assert err.rank_traceback.startswith("Traceback (most recent call last):")
    assert isinstance(err.__cause__, ValueError)
    # result() raised once the failure was decided; the job ends once its workers are free.
    assert job.wait_stopped(60)
    assert job.state == dask_ddp.JobState.FAILED
    # The same cluster runs the next job.
    client.wait_for_workers(2, timeout="60s")
    assert (
        dask_ddp.launch(client, _seen_by_rank, args=("after",)).result(timeout=120)[1]["sum"] == 3.0
    )


@pytest.mark.slow
def test_gathering_the_drop_in_futures_shows_the_failing_ranks_error(client: Client) -> None:
    # dask-pytorch-ddp's users gather the futures in rank order: rank 0's future, stopped
    # by rank 1's failure, must carry rank 1's error, not only "connection closed".
    futures = dask_ddp.dispatch.run(client, _fail_at_step, 1, 5)
    with pytest.raises(Exception, match="bad batch at step 5"):
        client.gather(futures)  # whichever future raises first
    stopped = futures[0].exception(timeout=60)
    assert isinstance(stopped, dask_ddp.RankStoppedError)
    assert (stopped.rank, stopped.failed_rank) == (0, 1)
    assert stopped.reason == "ValueError: bad batch at step 5"
    assert str(stopped).startswith(
        "rank 0 stopped because rank 1 failed first (ValueError: bad batch at step 5)"
    )
    assert isinstance(futures[1].exception(timeout=60), ValueError)


def _spin_forever() -> None:
    while True:
        time.sleep(0.01)


def test_cancel_stops_every_rank(client: Client) -> None:
    job = dask_ddp.launch(client, _spin_forever)
    _wait_until_processing(client, [f.key for f in job.futures])
    job.cancel()  # its ranks never reach a safe point: their workers are restarted
    assert job.state == dask_ddp.JobState.CANCELLED
    with pytest.raises(dask_ddp.JobCancelledError):
        job.result()
    assert (
        dask_ddp.launch(client, _seen_by_rank, args=("after",)).result(timeout=120)[0]["sum"] == 3.0
    )


def _device_choices(gpu_count: int) -> dict:
    """The GPU (as CUDA_VISIBLE_DEVICES names it) that each way of choosing a device picks
    in this rank. With ``ddp.gpu-count`` no GPU exists, so each framework's own code gives
    the CUDA ordinal it would use, and the rank's CUDA_VISIBLE_DEVICES turns it into a GPU."""
    from accelerate.state import PartialState
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.fabric.utilities.device_parser import _normalize_parse_gpu_input_to_list

    ctx = dask_ddp.get_context()
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = value.split(",") if value is not None else [str(i) for i in range(gpu_count)]
    # accelerate (PartialState.set_device): cuda:(local_process_index % device_count()).
    # Without CUDA it takes the CPU path, which reads the same LOCAL_RANK. Its state is a
    # per-process singleton: an earlier job's rank on this worker may have left one.
    PartialState._reset_state()
    state = PartialState(cpu=True)
    try:
        accelerate = state.local_process_index % len(visible)
    finally:
        PartialState._reset_state()
    # Lightning (Trainer(strategy="ddp", devices=local_world_size) under torchrun, which
    # dask_ddp's environment makes it detect): root_device = parallel_devices[local_rank]
    assert TorchElasticEnvironment.detect()
    ids = _normalize_parse_gpu_input_to_list(ctx.local_world_size, True, False)
    lightning = ids[TorchElasticEnvironment().local_rank()]
    return {
        "worker": ctx.worker,
        "visible": value,
        "get_context().device": visible[ctx.device.index],
        "cuda:LOCAL_RANK (torchrun scripts, DeepSpeed)": visible[int(os.environ["LOCAL_RANK"])],
        "accelerate": visible[accelerate],
        "Lightning": visible[lightning],
    }


def _chosen(out: list[dict]) -> list[str]:
    """The one GPU every way picks in each rank (fails if two ways pick differently)."""
    picks = [{v for k, v in o.items() if k not in ("worker", "visible")} for o in out]
    assert all(len(p) == 1 for p in picks), out
    return [p.pop() for p in picks]


def test_gpu_count_override_puts_every_framework_on_the_rank_s_own_gpu(client: Client) -> None:

    with dask.config.set({"ddp.gpu-count": 4}):
        job = dask_ddp.launch(client, _device_choices, args=(4,), backend="gloo")
        out = job.result(timeout=120)
    # Workers without a CUDA_VISIBLE_DEVICES of their own keep none (as under torchrun):
    # rank k's GPU is cuda:k, whatever picks it.
    assert [o["visible"] for o in out] == [None, None]
    assert _chosen(out) == ["0", "1"]
    assert all(
        v["rank_env"]["CUDA_VISIBLE_DEVICES"] is None for v in client.run(_worker_state).values()
    )


def _visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.slow
def test_dask_cuda_workers_keep_their_gpu_for_every_framework() -> None:
    from distributed import Nanny, Scheduler, SpecCluster

    # dask-cuda's LocalCUDACluster on a 4-GPU host: worker i's list is rotated by i, so
    # its own GPU leads. Three workers, in whatever address order their ports give.
    rotated = ["0,1,2,3", "1,2,3,0", "2,3,0,1"]
    spec = {
        f"cuda-{i}": {"cls": Nanny, "options": {"nthreads": 1, "env": {"CUDA_VISIBLE_DEVICES": v}}}
        for i, v in enumerate(rotated)
    }
    with (
        SpecCluster(
            spec, scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}}
        ) as cluster,
        Client(cluster) as c,
        dask.config.set({"ddp.gpu-count": 4}),
    ):
        c.wait_for_workers(3, timeout="60s")
        own = {a: v.split(",")[0] for a, v in c.run(_visible_devices).items()}
        out = dask_ddp.launch(c, _device_choices, args=(4,), backend="gloo").result(timeout=120)
        assert _chosen(out) == [own[o["worker"]] for o in out]  # the GPU dask-cuda gave it
        assert len({o["visible"] for o in out}) == 1  # one list for the whole host
        # A job on two of them: the same; the host's other GPUs stay visible, after theirs.
        two = sorted(own)[1:]
        out = dask_ddp.launch(c, _device_choices, args=(4,), workers=two, backend="gloo")
        out = out.result(timeout=120)
        assert _chosen(out) == [own[o["worker"]] for o in out]
        (visible,) = {o["visible"] for o in out}
        assert visible.split(",")[:2] == _chosen(out)
        assert set(visible.split(",")[2:]) == {"0", "1", "2", "3"} - set(_chosen(out))
        # Each worker's own list is back once its rank ended.
        assert {a: v for a, v in c.run(_visible_devices).items()} == {
            a: rotated[["0", "1", "2"].index(g)] for a, g in own.items()
        }


def test_nccl_without_gpus_fails_before_launch(client: Client) -> None:
    with pytest.raises(dask_ddp.errors.BackendUnavailableError, match="backend='gloo'"):
        dask_ddp.launch(client, _seen_by_rank, args=("x",), backend="nccl")


def test_errors_before_anything_runs(client: Client) -> None:
    lock = threading.Lock()
    with pytest.raises(dask_ddp.errors.NotPicklableError, match="lock"):
        dask_ddp.launch(client, lambda: lock.locked())
    with pytest.raises(dask_ddp.errors.NotPicklableError, match="its args"):
        dask_ddp.launch(client, _seen_by_rank, args=(lock,))
    with pytest.raises(
        dask_ddp.errors.PlacementError, match="more ranks than the cluster has workers"
    ):
        dask_ddp.launch(client, _seen_by_rank, args=("x",), workers=3)
    assert client.run(_worker_state)  # nothing was started


def test_a_refused_launch_leaves_no_log_with_the_payload(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    # The LocalCluster's scheduler runs in this process: whatever it logs, a notebook shows.
    with caplog.at_level(logging.DEBUG), pytest.raises(dask_ddp.errors.PlacementError):
        dask_ddp.launch(client, _seen_by_rank, args=("x",), workers=["tcp://nowhere:1"])
    logged = caplog.text
    assert "Run Failed" not in logged and "payload" not in logged and "JobSpec" not in logged


def test_no_workers() -> None:
    from distributed import LocalCluster

    with (
        LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as empty,
        Client(empty) as c,
        pytest.raises(dask_ddp.errors.NoWorkersError, match="no workers"),
    ):
        dask_ddp.launch(c, _seen_by_rank, args=("x",))


def test_get_context_outside_a_rank() -> None:
    with pytest.raises(dask_ddp.errors.NotInRankError, match="inside a function started by"):
        dask_ddp.get_context()


def _dump_on_crash(worker_id: int) -> None:
    """A forked loader worker segfaulted twice in CI (in its first collection, before ranks
    froze what a forked child inherits): its stack, if again."""
    import faulthandler

    faulthandler.enable(all_threads=True)


def _load_with_workers(context: str | None) -> list[int]:
    import multiprocessing

    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(32))
    mp = multiprocessing.get_context(context) if context else None
    # a spawned child would have to import this test module to run it
    init = None if context == "spawn" else _dump_on_crash
    loader = DataLoader(
        data, batch_size=8, num_workers=2, multiprocessing_context=mp, worker_init_fn=init
    )
    return sorted(int(v) for (batch,) in loader for v in batch)


@pytest.mark.parametrize("context", [None, "fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_dataloader_workers_inside_a_daemonic_worker(client: Client, context: str | None) -> None:
    def daemonic() -> bool:  # the worker's flag is never lifted: its template forks the ranks
        return all(s["daemon"] for s in client.run(_worker_state).values())

    assert daemonic()
    out = dask_ddp.launch(client, _load_with_workers, args=(context,)).result(timeout=120)
    assert out == [list(range(32))] * 2
    assert daemonic()


class _ParentPids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return os.getppid()


def _rank_and_loader_pids() -> tuple[int, list[int]]:
    from torch.utils.data import DataLoader

    loader = DataLoader(_ParentPids(), batch_size=1, num_workers=2)  # forked on Linux
    return os.getpid(), [int(b) for b in loader]


def test_a_rank_runs_in_a_process_of_its_own_with_its_loader_workers_under_it(
    client: Client,
) -> None:
    workers = client.run(os.getpid)
    job = dask_ddp.launch(client, _rank_and_loader_pids)
    pids = job.result(timeout=120)
    for (rank_pid, loader_parents), worker in zip(pids, job.workers, strict=True):
        assert rank_pid != workers[worker]  # the worker never runs the user's code
        assert set(loader_parents) == {rank_pid}
    second = dask_ddp.launch(client, _rank_and_loader_pids).result(timeout=120)
    assert {p for p, _ in second}.isdisjoint(p for p, _ in pids)  # fresh for each job
    assert client.run(os.getpid) == workers  # and the workers are the same processes


def test_public_names() -> None:
    import types

    # The package loads its modules on first use: dir() lists every public name anyway.
    public = {
        name
        for name in dir(dask_ddp)
        if not name.startswith("_") and not isinstance(getattr(dask_ddp, name), types.ModuleType)
    }
    assert public == set(dask_ddp.__all__) - {"__version__"}
    assert dask_ddp.dispatch.run is dask_ddp.run


def test_cancel_releases_a_rank_waiting_for_its_peers(client: Client) -> None:
    _, w1 = sorted(client.scheduler_info(n_workers=-1)["workers"])
    blocker = Event("cancel-blocker", client=client)
    busy = client.submit(_hold_plain, "cancel-blocker", workers=[w1], pure=False)
    pids = client.run(os.getpid)
    job = dask_ddp.launch(client, _spin_forever)
    waiting = 1 - job.workers.index(w1)  # in the C++ store wait, for the rank that cannot start
    job.view_state(lambda s: s["ranks"][waiting]["status"] == "joining", timeout=60)
    job.cancel()
    blocker.set()
    assert busy.result(timeout=60) == "held"
    assert client.run(os.getpid) == pids  # stopped without restarting its worker


def _hold_plain(name: str) -> str:
    Event(name).wait(timeout=60)
    return "held"


def test_submodules_after_a_bare_import() -> None:
    # dask_ddp loads its names on first use; dask_ddp.<submodule> works as it always did.
    code = (
        "import dask_ddp; assert dask_ddp.dispatch.run is dask_ddp.run; dask_ddp.data.S3ImageFolder"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_every_rank_future_of_a_failed_job_says_why(client: Client, tmp_path) -> None:
    # dask-pytorch-ddp's pattern: wait, then read each future (or process the results with
    # raise_errors=False first). Each says why, however and whenever it is read: never a
    # bare "cancelled for reason: unknown".
    from distributed import as_completed, wait

    from dask_ddp.results import DaskResultsHandler

    futures = dask_ddp.dispatch.run(client, _fail_at_step, 1, 5)
    wait(futures, timeout=60)
    DaskResultsHandler("unused").process_results(tmp_path, futures, raise_errors=False)
    (job,) = [dask_ddp.attach(client, j.job_id) for j in dask_ddp.jobs(client)[:1]]
    assert job.wait_stopped(timeout=60)  # the ranks are stopped, the workers freed

    def kinds(errors: Any) -> list[str]:
        return sorted(type(e).__name__ for e in errors)

    expected = ["RankStoppedError", "ValueError"]
    assert kinds(f.exception(timeout=10) for f in futures) == expected
    assert kinds(f.exception() for f in as_completed(futures)) == expected
    stopped, failed = futures[0].exception(), futures[1].exception()
    assert isinstance(failed, ValueError) and "bad batch at step 5" in str(failed)
    assert isinstance(stopped, dask_ddp.RankStoppedError) and stopped.failed_rank == 1
    with pytest.raises((ValueError, dask_ddp.RankStoppedError), match="bad batch at step 5"):
        client.gather(futures)  # the first future in the list that failed
    with pytest.raises(dask_ddp.RankStoppedError, match="rank 1 failed first"):
        futures[0].result()
    with pytest.raises(ValueError, match="bad batch at step 5"):
        futures[1].result()


def _as_after_a_failed_init() -> int:
    """What an init_process_group that failed (a peer died while the mesh connected) leaves
    in a worker process: torch's group counter one ahead, and no group."""
    from torch.distributed import distributed_c10d as c10d

    c10d._world.group_count += 1
    return c10d._world.group_count


def test_a_worker_after_a_failed_init_runs_the_next_job(client: Client) -> None:
    # Without naming each new group as a fresh process does, this job's ranks would wait
    # for each other under different names until the process group's timeout.
    first = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
    assert client.run(_as_after_a_failed_init, workers=[first])[first] >= 1
    job = dask_ddp.launch(client, _seen_by_rank, args=("after",), timeout=30)
    assert [o["sum"] for o in job.result(timeout=120)] == [3.0, 3.0]


def _report_forever() -> None:
    step = 0
    while True:  # a safe point each step: report() raises once the job is stopped
        dask_ddp.report({"step": step}, step=step)
        step += 1
        time.sleep(0.01)


def test_a_rank_stopped_at_a_safe_point_says_why_on_its_future(client: Client) -> None:
    job = dask_ddp.launch(client, _report_forever)
    job.view_state(lambda s: all(r["step"] is not None for r in s["ranks"]), timeout=60)
    pids = client.run(os.getpid)
    job.cancel("stopped by the test")
    for future in job.futures:  # each one says why, whichever is read (never a pickling error)
        error = future.exception(timeout=30)
        assert isinstance(error, dask_ddp.RankStoppedError), repr(error)
        assert "stopped by the test" in str(error)
    assert client.run(os.getpid) == pids  # stopped in place: no worker was restarted


def _rank() -> int:
    return dask_ddp.get_context().rank


@pytest.mark.usefixtures("slow_publish")
def test_a_job_that_ends_before_its_futures_are_published_has_its_values(client: Client) -> None:
    # Its outcome reaches the client only with its futures: before, result() returned [].
    job = dask_ddp.launch(client, _rank)
    assert job.result(timeout=60) == [0, 1]
    assert [f.result(timeout=10) for f in job.futures] == [0, 1]

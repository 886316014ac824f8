"""Several ranks behind one Dask worker (``launch(ranks_per_worker=)``): each its own
process forked from the worker's template, with torchrun's variables, stopped, sampled
and restarted as a rank of its own, on a real LocalCluster and on ``dask worker``
processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import dask
import distributed
import pytest
import torch
import torch.distributed as dist
from distributed import Client, LocalCluster

import dask_ddp

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import storms  # noqa: E402  (its kinds of stuck ranks, and its checks)
from test_restart import resumable  # noqa: E402


def _where() -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    torch.manual_seed(ctx.rank)  # each rank starts from its own weights: DDP makes them one
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        dask_ddp.report({"loss": float(step)}, step=step)
    return {
        "rank": ctx.rank,
        "world": (ctx.world_size, dist.get_world_size(), int(os.environ["WORLD_SIZE"])),
        "local": (ctx.local_rank, int(os.environ["LOCAL_RANK"])),
        "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "worker": distributed.get_worker().address,
        "pid": os.getpid(),
        "params": [p.detach().clone() for p in model.parameters()],
    }


@pytest.mark.smoke
def test_two_ranks_on_each_of_two_workers(client: Client) -> None:
    job = dask_ddp.launch(client, _where, workers=2, ranks_per_worker=2)
    out = job.result(timeout=120)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert {o["world"] for o in out} == {(4, 4, 4)}
    # One host (this machine): its four ranks count as torchrun counts a host's.
    assert [o["local"] for o in out] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert {o["local_world"] for o in out} == {4} and {o["group_rank"] for o in out} == {0}
    workers = [o["worker"] for o in out]
    assert workers[0] == workers[1] != workers[2] == workers[3]
    assert workers == job.workers
    assert len({o["pid"] for o in out}) == 4  # four processes
    worker_pids = set(client.run(os.getpid).values())
    assert not {o["pid"] for o in out} & worker_pids
    for o in out[1:]:  # DDP kept the parameters equal
        for mine, first in zip(o["params"], out[0]["params"], strict=True):
            torch.testing.assert_close(mine, first)
    assert sorted({m.rank for m in job.metrics}) == [0, 1, 2, 3]
    assert len(job.metrics) == 12
    # The next job on the same workers, one rank each as before.
    assert dask_ddp.launch(client, dist.get_world_size).result(timeout=60) == [2, 2]


def test_two_ranks_on_each_of_two_dask_worker_processes(dask_processes: Any) -> None:
    def where() -> tuple[int, int, str, int]:  # pickled by value: `dask worker` has no tests/
        import distributed
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        rank = dist.get_rank()
        return rank, int(os.environ["LOCAL_RANK"]), distributed.get_worker().address, int(t)

    with Client(dask_processes.address) as client:
        client.wait_for_workers(2, timeout=120)
        out = dask_ddp.launch(client, where, workers=2, ranks_per_worker=2).result(timeout=180)
        pids = client.run(os.getpid)
    assert [rank for rank, *_ in out] == [0, 1, 2, 3]
    assert [local for _, local, *_ in out] == [0, 1, 2, 3]  # one host: its four ranks
    workers = [w for _, _, w, _ in out]
    assert workers[0] == workers[1] != workers[2] == workers[3]
    assert sorted(set(workers)) == sorted(pids)
    assert {total for *_, total in out} == {4}


def test_dispatch_run_takes_ranks_per_worker(client: Client) -> None:
    futures = dask_ddp.dispatch.run(client, dist.get_rank, ranks_per_worker=2)
    assert [f.result(timeout=120) for f in futures] == [0, 1, 2, 3]


def test_ranks_per_worker_is_checked_before_anything_starts(client: Client) -> None:
    for bad in (0, -1, 1.5, True, "gpus"):
        with pytest.raises(ValueError, match="ranks_per_worker takes a whole number"):
            dask_ddp.launch(client, dist.get_rank, ranks_per_worker=bad)


def test_ranks_per_worker_gpu_on_workers_without_one_says_so(client: Client) -> None:
    # Raised by launch() itself: the workers are free, so the job is placed before it returns.
    with pytest.raises(dask_ddp.errors.PlacementError, match=r"ranks_per_worker='gpu'.*has none"):
        dask_ddp.launch(client, dist.get_rank, ranks_per_worker="gpu")


def test_ranks_per_worker_gpu_runs_a_rank_per_gpu(client: Client) -> None:
    with dask.config.set({"ddp.gpu-count": 3}):  # each worker pretends to have 3 GPUs
        job = dask_ddp.launch(
            client, lambda: (dask_ddp.get_context().local_rank, str(dask_ddp.get_context().device)),
            ranks_per_worker="gpu", backend="gloo",
        )  # fmt: skip
        out = job.result(timeout=120)
    assert len(out) == 6
    # Six ranks on one host of 3 GPUs: local ranks 0..5 share them, cuda:LOCAL_RANK % 3.
    assert [local for local, _ in out] == [0, 1, 2, 3, 4, 5]
    assert [device for _, device in out] == ["cuda:0", "cuda:1", "cuda:2"] * 2


@pytest.mark.smoke
def test_a_cancel_while_one_rank_spins_frees_the_workers_and_keeps_them(
    own_cluster: LocalCluster,
) -> None:
    with Client(own_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        pids = client.run(os.getpid)
        job = dask_ddp.launch(
            client, storms.train_until_stopped, args=("spins",), ranks_per_worker=2
        )
        started = set()
        for record in job.iter_metrics(timeout=120):
            started.add(record.rank)
            if len(started) == 4:
                break
        time.sleep(0.3)  # the spinner in Python, the others inside all_reduce
        began = time.monotonic()
        job.cancel()
        took = time.monotonic() - began
        grace = dask.utils.parse_timedelta(dask.config.get("ddp.failure-grace"))
        assert job.state is dask_ddp.JobState.CANCELLED
        assert took < grace + 1, f"cancel() took {took:.2f} s (ddp.failure-grace {grace} s)"
        assert storms.left_behind(client) == {}
        assert client.run(os.getpid) == pids  # no worker was restarted
        again = dask_ddp.launch(client, dist.get_world_size, ranks_per_worker=2)
        assert again.result(timeout=60) == [4] * 4


def _hangs_beside_a_peer() -> None:
    t = torch.ones(1)
    for i in range(10):
        if i == 3 and dist.get_rank() == 1:  # rank 1 shares its worker with rank 0
            dask_ddp.report({"hung": 1}, step=i)
            time.sleep(600)
        dist.all_reduce(t)


@pytest.mark.smoke
def test_a_rank_that_hangs_beside_another_of_its_worker_is_named(
    own_cluster: LocalCluster,
) -> None:
    with Client(own_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        job = dask_ddp.launch(client, _hangs_beside_a_peer, ranks_per_worker=2, stall_timeout=2)
        deadline = time.monotonic() + 90
        while not [t for t in job.history if t.state is dask_ddp.JobState.STALLED]:
            assert time.monotonic() < deadline, job.history
            time.sleep(0.05)
        entry = [t for t in job.history if t.state is dask_ddp.JobState.STALLED][-1]
        assert "rank 1 in _hangs_beside_a_peer (test_ranks_per_worker.py:" in entry.reason
        assert "waiting in a collective: rank(s) 0, 2, 3" in entry.reason
        stacks = job.stacks()
        assert sorted(stacks) == [0, 1, 2, 3]
        assert "in _hangs_beside_a_peer" in stacks[1] and "in all_reduce" not in stacks[1]
        assert all("in all_reduce" in stacks[r] for r in (0, 2, 3))
        job.cancel()
        assert job.stacks() == {}
        assert storms.left_behind(client) == {}


@pytest.mark.slow
def test_a_killed_worker_of_two_ranks_restarts_them_from_the_checkpoint(
    own_cluster: LocalCluster, tmp_path: Path
) -> None:
    with Client(own_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        reference = dask_ddp.launch(
            client, resumable, args=(12, 3, None), checkpoint_dir=str(tmp_path / "ref"),
            ranks_per_worker=2,
        ).result(timeout=120)  # fmt: skip
        # Rank 1 SIGKILLs its worker (ranks 0 and 1's) at step 7, in the first attempt.
        job = dask_ddp.launch(
            client, resumable, args=(12, 3, 7), max_restarts=1,
            checkpoint_dir=str(tmp_path / "run"), ranks_per_worker=2,
        )  # fmt: skip
        out = job.result(timeout=240)
    assert [o["attempt"] for o in out] == [1] * 4
    assert [o["start"] for o in out] == [6] * 4  # the checkpoint of step 5: each step once
    for name, value in reference[0]["params"].items():
        for o in out:
            torch.testing.assert_close(o["params"][name], value)
    assert [c.step for c in job.checkpoints][-1] == 11
    assert job.attempts == 2


SCRIPT = """
import os
import torch.distributed as dist

dist.init_process_group("gloo")
print(f"RANK {dist.get_rank()} OF {dist.get_world_size()} LOCAL {os.environ['LOCAL_RANK']}"
      f" PID {os.getpid()}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.smoke
def test_nproc_per_node_against_one_dask_worker_runs_its_ranks_there(tmp_path: Path) -> None:
    from processes import DaskProcesses

    script = tmp_path / "two.py"
    script.write_text(textwrap.dedent(SCRIPT))
    cluster = DaskProcesses(1)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "dask_ddp", "--scheduler", cluster.address,
             "--nproc-per-node", "2", str(script)],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    finally:
        cluster.close()
    assert done.returncode == 0, done.stdout + done.stderr
    # With --scheduler the command prints each rank's lines itself, "[rank N] ..." first.
    lines = sorted(line.split("] ", 1)[-1] for line in done.stdout.splitlines() if "RANK" in line)
    assert [line.split()[:6] for line in lines] == [
        ["RANK", "0", "OF", "2", "LOCAL", "0"],
        ["RANK", "1", "OF", "2", "LOCAL", "1"],
    ]
    assert "every rank finished: 2 ranks" in done.stdout + done.stderr


def test_nproc_per_node_without_a_scheduler_starts_one_worker_of_its_ranks(
    tmp_path: Path,
) -> None:
    script = tmp_path / "one_worker.py"
    script.write_text(
        textwrap.dedent("""
        import os
        import distributed
        import torch.distributed as dist

        dist.init_process_group("gloo")
        print(f"RANK {dist.get_rank()} WORKER {distributed.get_worker().address}", flush=True)
        dist.destroy_process_group()
        """)
    )
    done = subprocess.run(
        [sys.executable, "-m", "dask_ddp", "--nproc-per-node", "3", str(script)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # The ranks print to the same terminal at once: their lines may interleave.
    said = re.findall(r"RANK (\d) WORKER (tcp://[0-9.]+:\d+)", done.stdout)
    assert sorted(int(rank) for rank, _ in said) == [0, 1, 2], done.stdout
    assert len({worker for _, worker in said}) == 1  # one worker holds the three


def _my_device() -> tuple[int, str, str, int]:
    import torch

    ctx = dask_ddp.get_context()
    return (
        ctx.local_rank,
        str(ctx.device),
        os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        torch.cuda.device_count(),
    )


@pytest.mark.gpu
def test_the_ranks_behind_one_worker_each_have_a_gpu_and_see_them_all() -> None:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip(f"needs 2 GPUs behind one worker; this machine has {gpus}")
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        out = dask_ddp.launch(client, _my_device, ranks_per_worker="gpu").result(timeout=180)
    assert [local for local, *_ in out] == list(range(gpus))
    assert [device for _, device, *_ in out] == [f"cuda:{i}" for i in range(gpus)]
    assert {count for *_, count in out} == {gpus}  # every rank sees every GPU of the host

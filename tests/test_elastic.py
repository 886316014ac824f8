"""Elastic jobs on a real LocalCluster: shrink when a worker goes, grow when one joins, and
concurrent jobs that take their workers whole (no hold-and-wait)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dask
import pytest
import torch
from distributed import Client, Event, LocalCluster

import dask_ddp
from dask_ddp.errors import PlacementError


def make_cluster(n_workers: int) -> LocalCluster:
    """A cluster of its own: these tests remove, add or fill up workers."""
    return LocalCluster(
        n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0"
    )


def counted(
    steps: int,
    ckpt_every: int,
    step_seconds: float,
    every_rank_saves: bool = True,
    until: tuple[int, int] | None = None,
) -> dict:
    """DDP training that records, in its checkpoints, every step it trained and at which
    world size, so the test can check each step was trained exactly once. With
    ``every_rank_saves=False`` only rank 0 calls save_checkpoint, as much torchrun code does.
    ``until=(size, n)``: it ends (a checkpoint, then return) once it trained ``n`` steps at
    world size ``size``, before ``steps`` if that comes first: a grow is checked as soon as it
    has been trained through, not after a fixed number of steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trained: list[int] = []
    sizes: list[int] = []
    start = 0
    state = dask_ddp.get_checkpoint()
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        trained, sizes = state["trained"].tolist(), state["sizes"].tolist()
        start = state["step"] + 1
    for step in range(start, steps):
        g = torch.Generator().manual_seed(1000 * step + ctx.rank)
        opt.zero_grad()
        loss = model(torch.randn(16, 8, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        trained.append(step)
        sizes.append(ctx.world_size)
        dask_ddp.report({"loss": loss.item(), "world_size": ctx.world_size}, step=step)
        done = until is not None and sizes.count(until[0]) >= until[1]
        at_checkpoint = step % ckpt_every == ckpt_every - 1 or step == steps - 1 or done
        if at_checkpoint and (every_rank_saves or ctx.rank == 0):
            dask_ddp.save_checkpoint(
                {
                    "model": model.module.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step,
                    "trained": torch.tensor(trained),
                    "sizes": torch.tensor(sizes),
                },
                step=step,
            )
        if done:
            break
        time.sleep(step_seconds)
    return {"world_size": ctx.world_size, "attempt": ctx.attempt, "start": start}


def _final_state(directory: Path) -> dict:
    from dask_ddp._rank import checkpoint

    found = checkpoint.latest(str(directory))
    assert found is not None
    return found[1]


class _Logged(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _logged_to(handler: logging.Handler) -> Iterator[None]:
    """What the dask_ddp logger says at INFO, whatever the Dask logging config does."""
    log = logging.getLogger("dask_ddp")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _wait_for_step(job: dask_ddp.Job, step: int) -> None:
    for rec in job.iter_metrics(timeout=120):
        if rec.step is not None and rec.step >= step:
            return


@pytest.mark.slow
def test_job_shrinks_when_a_worker_leaves_then_grows_when_one_joins(tmp_path: Path) -> None:
    logged = _Logged()
    with _logged_to(logged), make_cluster(3) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=60)
        dask_ddp.launch(client, time.time).result()  # warm: the workers import torch

        # (1) 3 workers, workers=3, min_workers=2: one is retired mid-run, none replaces it.
        # A shrink, not a failure: the default max_restarts=0 does not end the job.
        shrink_dir = tmp_path / "shrink"
        job = dask_ddp.launch(
            client, counted, args=(120, 10, 0.05), workers=3, min_workers=2,
            checkpoint_dir=str(shrink_dir),
        )  # fmt: skip
        assert job.world_size == 3
        _wait_for_step(job, 25)
        cluster.scale(2)  # the adaptive scale-down of a real cluster: no replacement
        results = job.result(timeout=180)
        assert [r["world_size"] for r in results] == [2, 2]
        assert all(r["attempt"] == 1 and r["start"] > 0 for r in results)
        state = _final_state(shrink_dir)
        assert state["trained"].tolist() == list(range(120))  # each step once, in order
        sizes = state["sizes"].tolist()
        assert sizes[0] == 3 and sizes[-1] == 2 and sorted(set(sizes)) == [2, 3]
        first, second = _placements(job)
        assert (first.world_size, second.world_size) == (3, 2)
        assert [t.state.value for t in job.history] == [
            "running",
            "resizing",
            "running",
            "succeeded",
        ]
        assert job.history[1].reason.startswith("shrink: rank ")
        assert "left the cluster" in job.history[1].reason
        assert second.seconds_to_first_step is not None
        assert any("resized from 3 to 2 ranks" in n for n in job.view_state()["notes"])
        assert any("resized from 3 to 2 ranks" in m for m in logged.messages), logged.messages

        # (2) A job that may use 3 starts on the 2 there are and grows when a third joins.
        grow_dir = tmp_path / "grow"
        job = dask_ddp.launch(
            client, counted, args=(300, 10, 0.05, True, (3, 20)), workers=3, min_workers=2,
            checkpoint_dir=str(grow_dir),
        )  # fmt: skip
        assert job.world_size == 2
        _wait_for_step(job, 15)
        cluster.scale(3)
        results = job.result(timeout=180)
        assert [r["world_size"] for r in results] == [3, 3, 3]
        state = _final_state(grow_dir)
        trained = state["trained"].tolist()
        assert trained == list(range(len(trained)))  # each step once, in order
        sizes = state["sizes"].tolist()
        assert sizes[0] == 2 and sizes[-1] == 3 and sizes.count(3) == 20
        assert [t.world_size for t in _placements(job)] == [2, 3]
        assert job.history[1].state is dask_ddp.JobState.RESIZING
        assert job.history[1].reason.startswith("grow at the checkpoint of step ")
        assert _placements(job)[1].seconds_to_first_step is not None
        assert any("resized from 2 to 3 ranks" in n for n in job.view_state()["notes"])
        assert any("resized from 2 to 3 ranks" in m for m in logged.messages), logged.messages

        # (3) Workers another job gives back grow a job too, whose ranks other than 0 never
        # call save_checkpoint: they stop one collective after rank 0 does.
        holder = dask_ddp.launch(client, _hold, args=("elastic-holder",), workers=1)
        assert holder.world_size == 1
        late_dir = tmp_path / "late"
        job = dask_ddp.launch(
            client, counted, args=(300, 10, 0.05, False, (3, 20)), workers=3, min_workers=2,
            checkpoint_dir=str(late_dir),
        )  # fmt: skip
        assert job.world_size == 2 and not set(job.workers) & set(holder.workers)
        _wait_for_step(job, 15)
        Event("elastic-holder", client=client).set()
        assert holder.result(timeout=60) == [True]
        assert [r["world_size"] for r in job.result(timeout=180)] == [3, 3, 3]
        trained = _final_state(late_dir)["trained"].tolist()
        assert trained == list(range(len(trained))) and len(trained) > 20
        assert [t.world_size for t in _placements(job)] == [2, 3]


def _placements(job: dask_ddp.Job) -> list[dask_ddp.Transition]:
    """The job's ``running`` entries: one per placement, with its size."""
    return [t for t in job.history if t.state is dask_ddp.JobState.RUNNING]


def _hold(name: str) -> bool:
    return Event(name).wait(timeout=120)


def _three_allreduces(tag: int) -> int:
    import torch.distributed as dist

    t = torch.ones(1)
    for _ in range(3):
        dist.all_reduce(t)
        time.sleep(0.2)
    return tag


@pytest.mark.slow
def test_concurrent_jobs_take_their_workers_whole() -> None:
    # 6 jobs of 3 ranks launched at once (from 6 threads, so their rank tasks would reach
    # the workers interleaved) on 4 workers: each job takes 3 free workers at once or
    # none, so no two jobs each hold a part of what the other needs. The short rendezvous
    # timeout shows that no rank waited there for a peer queued behind another job.
    with (
        dask.config.set({"ddp.rendezvous-timeout": "15s"}),
        make_cluster(4) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(4, timeout=60)
        dask_ddp.launch(client, time.time).result()  # warm: the workers import torch
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            jobs = list(
                pool.map(
                    lambda i: dask_ddp.launch(client, _three_allreduces, args=(i,), workers=3),
                    range(6),
                )
            )
        assert any(j.state is dask_ddp.JobState.WAITING for j in jobs)  # 4 workers fit one
        for i, job in enumerate(jobs):
            assert job.result(timeout=240) == [i, i, i]
        assert all(len(_placements(job)) == 1 for job in jobs)  # placed once, never again


def test_min_workers_is_checked_before_anything_starts(client: Client, tmp_path: Path) -> None:
    with pytest.raises(PlacementError, match="more than workers=2"):
        dask_ddp.launch(client, time.time, workers=2, min_workers=3, checkpoint_dir=str(tmp_path))
    with pytest.raises(PlacementError, match="no checkpoint_dir"):
        dask_ddp.launch(client, time.time, workers=2, min_workers=1)
    with pytest.raises(PlacementError, match="needs workers= as a number"):
        dask_ddp.launch(client, time.time, min_workers=1, checkpoint_dir=str(tmp_path))
    with pytest.raises(PlacementError, match="at least 1"):
        dask_ddp.launch(client, time.time, workers=2, min_workers=0, checkpoint_dir=str(tmp_path))


def test_too_few_workers_for_too_long_fails_with_scale_timeout(
    client: Client, tmp_path: Path
) -> None:
    with dask.config.set({"ddp.scale-timeout": "2s"}):
        job = dask_ddp.launch(
            client, time.time, workers=4, min_workers=3, checkpoint_dir=str(tmp_path)
        )
    assert job.state is dask_ddp.JobState.WAITING
    snap = job.view_state(lambda s: "grow" in (s["waiting"] or ""), timeout=30)
    assert "waiting for the cluster to grow: 2 of at least 3 workers there" in snap["waiting"]
    with pytest.raises(dask_ddp.ScaleTimeoutError, match="needs at least 3 workers"):
        job.result(timeout=60)


def test_a_waiting_job_can_be_cancelled(client: Client, tmp_path: Path) -> None:
    job = dask_ddp.launch(client, time.time, workers=5, min_workers=3, checkpoint_dir=str(tmp_path))
    assert job.state is dask_ddp.JobState.WAITING and job.workers == []
    assert not job.wait_placed(timeout=0.5)
    job.cancel()
    with pytest.raises(dask_ddp.JobCancelledError):
        job.result(timeout=10)


def test_an_elastic_job_with_room_runs_at_its_most(client: Client, tmp_path: Path) -> None:
    job = dask_ddp.launch(
        client, counted, args=(6, 3, 0.0), workers=2, min_workers=1, checkpoint_dir=str(tmp_path)
    )
    assert [r["world_size"] for r in job.result(timeout=60)] == [2, 2]
    assert _final_state(tmp_path)["trained"].tolist() == list(range(6))


DOC = Path(__file__).resolve().parents[1] / "docs" / "elastic.md"


@pytest.mark.slow
def test_the_docs_example_shrinks_and_grows(tmp_path: Path) -> None:
    block = next(
        b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if "__main__" in b
    )
    script = tmp_path / "elastic_example.py"
    script.write_text(block)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "[3, 3, 3]"
    sizes = [line.split()[0] for line in lines[1:] if not line.startswith(" ")]
    reasons = [line.strip() for line in lines[1:] if line.startswith(" ")]
    assert sizes == ["3", "2", "3"]
    assert reasons[0].startswith("shrink: rank ") and "was lost: its worker" in reasons[0]
    assert reasons[1].startswith("grow at the checkpoint of step ")


def _rank0_fails_before_its_checkpoint() -> int:
    """Rank 1 saves a checkpoint and waits there for rank 0's word (the job may grow);
    rank 0 fails once rank 1 waits, before its own checkpoint."""
    from datetime import timedelta

    from dask_ddp._rank.slot import this_slot

    ctx = dask_ddp.get_context()
    if ctx.rank == 0:  # rank 1 says in the job's store which step it waits at, then waits
        this_slot().current().store.wait(["dask-ddp/grow-waiting"], timedelta(seconds=60))
        raise ValueError("rank 0 fails before its checkpoint")
    dask_ddp.save_checkpoint({"step": 1}, step=1)
    return ctx.rank


def test_a_rank_waiting_at_a_checkpoint_is_stopped_without_a_restart(tmp_path: Path) -> None:
    # Rank 1 waits inside the C++ store wait, where the stop cannot reach it; without its
    # release it would wait out the collective timeout and its worker would be restarted.
    with make_cluster(2) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        pids = client.run(os.getpid)
        job = dask_ddp.launch(
            client, _rank0_fails_before_its_checkpoint,
            workers=3, min_workers=2, checkpoint_dir=str(tmp_path), max_restarts=0,
        )  # fmt: skip
        error = job.exception(timeout=120)
        assert isinstance(error, dask_ddp.RankFailedError) and error.rank == 0, error
        job.wait_stopped(timeout=60)
        assert client.run(os.getpid) == pids  # no worker was restarted

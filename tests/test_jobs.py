"""A job lives in the cluster: it outlives the client that launched it, any client finds it
(``dask_ddp.jobs``) and follows it (``dask_ddp.attach``), and a job nobody follows ends
after ``ddp.orphan-timeout`` unless it was launched detached.

The launching client runs in a subprocess of its own, which the tests SIGKILL as a dying
kernel would die; the cluster (a LocalCluster over TCP: worker processes, gloo) is the
test's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import pytest
import torch
from distributed import Client, LocalCluster

import dask_ddp
from dask_ddp._shared import dask_internals

# The training function, as the killed client's script defines it (so it is sent by value,
# as a notebook's function is) and as the tests define it for an uninterrupted reference.
TRAIN = textwrap.dedent(
    '''
    import time

    import torch
    import dask_ddp


    def train(steps, step_seconds):
        """Deterministic DDP training that resumes from its checkpoints."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        ctx = dask_ddp.get_context()
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        start, state = 0, dask_ddp.get_checkpoint()
        if state is not None:
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            start = state["step"] + 1
        for step in range(start, steps):
            g = torch.Generator().manual_seed(1000 * step + ctx.rank)
            opt.zero_grad()
            loss = model(torch.randn(16, 8, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            dask_ddp.report({"loss": loss.item()}, step=step)
            if step % 10 == 9:
                state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}
                dask_ddp.save_checkpoint(state, step=step)
            time.sleep(step_seconds)
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    '''
)


def _train_function() -> Any:
    namespace: dict[str, Any] = {"__name__": "killed_clients_script"}
    exec(compile(TRAIN, "killed_clients_script.py", "exec"), namespace)
    return namespace["train"]


LAUNCH = textwrap.dedent(
    """
    import sys
    import dask
    from distributed import Client

    import dask_ddp

    address, checkpoint_dir, name, detach, orphan_timeout = sys.argv[1:6]
    with dask.config.set({"ddp.orphan-timeout": orphan_timeout}):
        client = Client(address)
        job = dask_ddp.launch(
            client, train, args=(150, 0.05), checkpoint_dir=checkpoint_dir, name=name,
            detach=detach == "detach",
        )
    print(job.job_id, flush=True)
    if detach == "detach":
        client.close()  # a clean exit: the job runs on with no client at all
    else:
        sys.stdin.read()  # until killed
    """
)


@pytest.fixture
def tcp_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, protocol="tcp", dashboard_address=":0"
    ) as cluster:
        yield cluster


def _launch_elsewhere(
    cluster: LocalCluster,
    tmp_path: Path,
    name: str,
    *,
    detach: bool = False,
    orphan_timeout: str = "10 minutes",
) -> tuple[subprocess.Popen, str]:
    """A client in a process of its own launches ``train``; returns it and the job's id."""
    script = tmp_path / f"client_{name}.py"
    script.write_text(TRAIN + LAUNCH)
    proc = subprocess.Popen(
        [sys.executable, str(script), cluster.scheduler_address, str(tmp_path / name), name,
         "detach" if detach else "follow", orphan_timeout],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    job_id = proc.stdout.readline().strip()
    assert job_id, "the client process printed no job id"
    return proc, job_id


def _page(cluster: LocalCluster, job_id: str) -> dict[str, Any]:
    base = cluster.dashboard_link.rsplit("/status", 1)[0]
    with urllib.request.urlopen(f"{base}/ddp/api/jobs/{job_id}", timeout=10) as response:
        return json.loads(response.read())


def _wait(check: Any, timeout: float = 120.0) -> Any:
    """Ask ``check`` until it returns something true (polling, as the tests poll the page)."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.2)
    return got


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key])


def _uninterrupted(cluster: LocalCluster, tmp_path: Path) -> list[dict[str, torch.Tensor]]:
    """What the training function returns when nothing interrupts it."""
    with Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        return dask_ddp.launch(
            client, _train_function(), args=(150, 0.0), checkpoint_dir=str(tmp_path / "ref")
        ).result(timeout=120)


@pytest.mark.slow
def test_a_job_outlives_its_client_and_any_client_attaches(tcp_cluster, tmp_path: Path) -> None:
    reference = _uninterrupted(tcp_cluster, tmp_path)
    with Client(tcp_cluster) as client:
        proc, job_id = _launch_elsewhere(tcp_cluster, tmp_path, "nightly")
        _wait(lambda: min(r["step"] or 0 for r in _page(tcp_cluster, job_id)["ranks"]) >= 15)
        proc.kill()  # SIGKILL: the kernel dies mid-training
        proc.wait(30)

        # The ranks train on, and the page shows it.
        step_at_kill = max(r["step"] for r in _page(tcp_cluster, job_id)["ranks"])
        _wait(lambda: max(r["step"] for r in _page(tcp_cluster, job_id)["ranks"]) > step_at_kill)
        assert _page(tcp_cluster, job_id)["state"] == "running"

        # Any client finds it, by id and by name.
        (found,) = [j for j in dask_ddp.jobs(client) if j.job_id == job_id]
        assert (found.name, found.state) == ("nightly", dask_ddp.JobState.RUNNING)
        assert "@" in found.launched_by and found.followers == 0 and not found.detached
        by_name = dask_ddp.attach(client, "nightly")
        by_id = dask_ddp.attach(client, job_id)
        assert by_name.job_id == by_id.job_id == job_id
        assert by_id.state is dask_ddp.JobState.RUNNING and by_id.world_size == 2
        assert [t.state.value for t in by_id.history] == ["running"]
        state = by_id.view_state()
        assert all(r["step"] >= 15 for r in state["ranks"])  # the summary so far
        assert len(state["ranks"][0]["curve"]) >= 2
        steps = [r.step for r in by_id.metrics]
        assert steps and min(steps) <= 20  # the records the cluster still held
        assert [j.followers for j in dask_ddp.jobs(client) if j.job_id == job_id] == [1]

        # Then the live stream, and the result an uninterrupted run gives.
        out = by_id.result(timeout=120)
        _same(out[0], reference[0])
        _same(out[1], reference[1])
        assert max(r.step for r in by_id.metrics) == 149
        assert [c.step for c in by_id.checkpoints][-1] == 149
        _same(by_name.result(timeout=60)[0], reference[0])
        assert _page(tcp_cluster, job_id)["state"] == "succeeded"
        assert [t.state.value for t in by_id.history] == ["running", "succeeded"]


@pytest.mark.slow
def test_a_detached_job_runs_to_its_end_with_no_client(tcp_cluster, tmp_path: Path) -> None:
    reference = _uninterrupted(tcp_cluster, tmp_path)
    # No client at all for three orphan timeouts: the launching one exits, this test's
    # closed above; a job that was not detached would have been cancelled after the first.
    proc, job_id = _launch_elsewhere(
        tcp_cluster, tmp_path, "detached", detach=True, orphan_timeout="1s"
    )
    assert proc.wait(60) == 0
    time.sleep(3)  # the point of the test: time passing with nobody there (3 x 1 s)
    with Client(tcp_cluster) as client:
        (found,) = [j for j in dask_ddp.jobs(client) if j.job_id == job_id]
        assert found.detached and found.followers == 0
        assert found.state in (dask_ddp.JobState.RUNNING, dask_ddp.JobState.SUCCEEDED)
        job = dask_ddp.attach(client, job_id)  # to its end, which nobody cancelled
        _same(job.result(timeout=60)[0], reference[0])
        assert [t.state.value for t in job.history] == ["running", "succeeded"]


@pytest.mark.slow
def test_a_job_nobody_follows_is_cancelled_after_the_orphan_timeout(
    tcp_cluster, tmp_path: Path
) -> None:
    proc, job_id = _launch_elsewhere(tcp_cluster, tmp_path, "orphan", orphan_timeout="2s")
    with Client(tcp_cluster) as client:
        job = dask_ddp.attach(client, job_id)
        job.view_state(lambda s: all(r["step"] is not None for r in s["ranks"]), timeout=120)
        # A client that attached follows it: killing the launching one does not orphan it
        # until this one leaves too.
        client.close()
    proc.kill()
    proc.wait(30)
    with Client(tcp_cluster) as client:
        # Listing jobs follows none: nobody follows this one now.
        _wait(lambda: _state_of(client, job_id) is dask_ddp.JobState.CANCELLED, timeout=60)
        job = dask_ddp.attach(client, job_id)
        assert job.wait(timeout=60)
        last = job.history[-1]
        assert last.state is dask_ddp.JobState.CANCELLED
        assert "ddp.orphan-timeout" in last.reason
        with pytest.raises(dask_ddp.JobCancelledError, match="orphan-timeout"):
            job.result()
        # Its workers are free at once for the next job.
        quick = dask_ddp.launch(client, time.time)
        assert len(quick.result(timeout=30)) == 2


def _state_of(client: Client, job_id: str) -> dask_ddp.JobState | None:
    return next((j.state for j in dask_ddp.jobs(client) if j.job_id == job_id), None)


def _failing_once(tag: int) -> int:
    ctx = dask_ddp.get_context()
    time.sleep(0.3)
    if ctx.attempt == 0:
        raise dask_ddp.RetryableError(f"job {tag} fails once")
    return tag


def test_the_scheduler_s_loop_never_blocks_while_jobs_start_run_and_restart(
    client: Client,
) -> None:
    client.run_on_scheduler(dask_internals.reset_max_tick)
    jobs = [
        dask_ddp.launch(client, _failing_once, args=(i,), workers=1, max_restarts=1)
        for i in range(8)
    ]
    assert [job.result(timeout=240) for job in jobs] == [[i] for i in range(8)]
    assert all(job.attempts == 2 for job in jobs)
    # How long the loop's ticks were is for benchmarks/control_plane.py; here: it was read.
    assert client.run_on_scheduler(dask_internals.max_tick_seconds) >= 0


def _hold_for(seconds: float) -> int:
    time.sleep(seconds)
    return dask_ddp.get_context().rank


def test_a_name_is_unique_among_running_jobs(client: Client) -> None:
    first = dask_ddp.launch(client, _hold_for, args=(3,), name="unique-name")
    with pytest.raises(dask_ddp.errors.JobNameTakenError, match="unique-name"):
        dask_ddp.launch(client, _hold_for, args=(0,), name="unique-name")
    with pytest.raises(dask_ddp.errors.JobStillRunningError, match="still"):
        first.forget()
    assert first.result(timeout=60) == [0, 1]
    again = dask_ddp.launch(client, _hold_for, args=(0,), name="unique-name")  # it ended
    assert again.result(timeout=60) == [0, 1]
    assert dask_ddp.attach(client, "unique-name").job_id == again.job_id  # the newest
    first.forget()
    assert first.job_id not in {j.job_id for j in dask_ddp.jobs(client)}
    with pytest.raises(dask_ddp.JobNotFoundError, match="forgotten"):
        dask_ddp.attach(client, first.job_id)


def test_a_job_launched_with_dask_config_settings_uses_them_on_the_scheduler(
    client: Client,
) -> None:
    # Configuration is resolved on the launching client and travels with the job: the
    # scheduler's own config does not decide how long a rank may take to join.
    with dask.config.set({"ddp.rendezvous-timeout": "7s"}):
        job = dask_ddp.launch(client, _hold_for, args=(0,))
    assert job.result(timeout=60) == [0, 1]
    spec = client.run_on_scheduler(_spec_of, job.job_id)
    assert spec == 7.0


def _spec_of(job_id: str, dask_scheduler: Any = None) -> float:
    return dask_scheduler.plugins["dask-ddp"].jobs[job_id].settings.rendezvous_timeout


def test_attaching_to_a_job_the_cluster_does_not_know_says_so(client: Client) -> None:
    with pytest.raises(dask_ddp.JobNotFoundError, match="never ran here"):
        dask_ddp.attach(client, "no-such-job")


class _OnlyOnAWorker:
    """Unpickles in a Dask worker only: anywhere else (the scheduler, the client) it raises."""

    def __reduce__(self) -> tuple:
        return (_only_on_a_worker, ())


def _only_on_a_worker() -> str:
    from distributed import get_worker

    get_worker()  # ValueError outside a worker
    return "unpickled on a worker"


def _describe(thing: object) -> str:
    return str(thing)


def test_the_scheduler_never_unpickles_the_function_or_its_arguments(client: Client) -> None:
    # The supervisor keeps the bytes the client sent: only the ranks unpickle them, so the
    # scheduler needs none of the user's code (and runs none of it).
    job = dask_ddp.launch(client, _describe, args=(_OnlyOnAWorker(),), max_restarts=1)
    assert job.result(timeout=60) == ["unpickled on a worker"] * 2

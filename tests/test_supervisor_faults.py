"""The supervisor's own failures are facts its job's life acts on (issue 57): an action
that raises (injected here, in the scheduler's process: a LocalCluster's scheduler runs in
the test's) ends the job with a clear error, or closes it, never leaving it waiting forever
or unforgettable."""

from __future__ import annotations

import pytest
from distributed import Client

import dask_ddp
from dask_ddp._scheduler.pool import WorkerPool
from dask_ddp.errors import SupervisorError


def _rank() -> int:
    return dask_ddp.get_context().rank


def _retry_once() -> int:
    ctx = dask_ddp.get_context()
    if ctx.attempt == 0 and ctx.rank == 1:
        raise dask_ddp.RetryableError("once")
    return ctx.rank


def _raising_at(call: int, original):
    calls = []

    def replaced(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError("injected: the pool is broken")
        return original(self, *args, **kwargs)

    return replaced


def test_a_request_the_pool_could_not_take_fails_the_job_and_forget_works(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A job's first request failing makes launch() raise (the job is not kept); one made
    # for a restart ends the job that runs, instead of leaving it waiting for ever.
    monkeypatch.setattr(WorkerPool, "ask", _raising_at(1, WorkerPool.ask))
    with pytest.raises(SupervisorError, match="could not take the job's request") as failed:
        dask_ddp.launch(client, _rank, timeout=60)
    assert "RuntimeError: injected" in str(failed.value)
    monkeypatch.setattr(WorkerPool, "ask", _raising_at(2, WorkerPool.ask))
    job = dask_ddp.launch(client, _retry_once, max_restarts=1)
    with pytest.raises(SupervisorError, match="RuntimeError: injected"):
        job.result(timeout=120)
    assert job.state.value == "failed"
    job.forget()
    assert job.job_id not in [j.job_id for j in dask_ddp.jobs(client)]
    monkeypatch.undo()
    assert dask_ddp.launch(client, _rank).result(timeout=120) == [0, 1]


def test_an_end_that_raised_still_closes_the_job(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pool's forget() runs in the job's Finish: a failure there left Life.closed false,
    # and forget() refused for good (JobStillRunningError).
    monkeypatch.setattr(WorkerPool, "forget", _raising_at(1, WorkerPool.forget))
    job = dask_ddp.launch(client, _rank)
    assert job.result(timeout=120) == [0, 1]
    job.forget()
    assert job.job_id not in [j.job_id for j in dask_ddp.jobs(client)]

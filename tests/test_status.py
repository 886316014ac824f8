"""What a user sees while a job waits: each rank's phase, and what it says it is busy with."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from distributed import Client, Event

import dask_ddp
from dask_ddp import _status
from dask_ddp.view import progress_line, render_html


def _hold(name: str) -> str:
    Event(name).wait(timeout=60)
    return "held"


def _busy_then(name: str) -> int:
    _status.activity("warming up the model")
    texts = iter(["probe 1", "probe 2"])
    _status.watch(lambda: next(texts, "probe done"))
    Event(name).wait(timeout=60)
    dask_ddp.report({"loss": 1.0}, step=0)
    return dask_ddp.get_context().rank


def _wait_for(job: dask_ddp.Job, what: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The job's view state once ``what`` holds for it (checked at each status change)."""
    return job.view_state(what, timeout=60)


def test_waiting_ranks_show_their_phase(client: Client) -> None:
    _, w1 = sorted(client.scheduler_info(n_workers=-1)["workers"])
    blocker = Event("status-blocker", client=client)
    busy = client.submit(_hold, "status-blocker", workers=[w1], pure=False)
    job = dask_ddp.launch(client, _busy_then, args=("status-go",))
    blocked = job.workers.index(w1)
    other = 1 - blocked

    snap = _wait_for(job, lambda s: s["ranks"][other]["status"] == "joining")
    assert snap["ranks"][blocked]["status"] == "submitted"  # its worker runs another task
    assert "waiting for the other ranks (1 of 2 joined)" in snap["ranks"][other]["activity"]
    page = render_html(snap)
    assert "starting (0 of 2 ranks in the process group)" in page
    assert "waiting for its worker to start the task" in page
    assert f"r{blocked} submitted" in progress_line(job.view_state())

    blocker.set()
    assert busy.result(timeout=60) == "held"
    snap = _wait_for(job, lambda s: all(r["activity"] == "probe done" for r in s["ranks"]))
    assert [r["status"] for r in snap["ranks"]] == ["running", "running"]
    assert ": running, 2 ranks" in render_html(snap)
    Event("status-go", client=client).set()
    assert job.result(timeout=60) == [0, 1]


def test_watch_prints_phases_and_activity(client: Client) -> None:
    out = io.StringIO()
    go = Event("status-watch-go", client=client)
    job = dask_ddp.launch(client, _busy_then, args=("status-watch-go",))
    _wait_for(job, lambda s: all(r["activity"] == "probe done" for r in s["ranks"]))
    go.set()
    job.watch(file=out)
    assert job.result(timeout=60) == [0, 1]
    assert "succeeded" in out.getvalue()


def test_status_calls_outside_a_rank_only_log(caplog) -> None:
    with caplog.at_level("INFO", logger="dask_ddp._status"):
        _status.activity("listing s3://bucket/train")
        _status.phase(_status.RUNNING)
        _status.watch(lambda: "never sampled")()
    assert "listing s3://bucket/train" in caplog.text

"""What a user sees while a job waits: each rank's phase, and what it says it is busy with."""

from __future__ import annotations

import io
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from distributed import Client, Event
from distributed.utils_test import poll_for

import dask_ddp
from dask_ddp._rank import channel as events
from dask_ddp._rank import status
from dask_ddp._rank.slot import PROCESS, RankRun
from dask_ddp._shared import protocol
from dask_ddp._shared.view import progress_line, render_html

_FILLED = "2 files in the cache"


def _hold(name: str) -> str:
    Event(name).wait(timeout=60)
    return "held"


def _busy_then(name: str) -> int:
    status.activity("warming up the model")
    with tempfile.TemporaryDirectory() as cache:
        stop = status.follow(cache, lambda: f"{len(os.listdir(cache))} files in the cache")
        for i in range(2):  # each change wakes the follower; the last text says 2
            with open(os.path.join(cache, f"f{i}"), "w") as f:
                f.write("x")
        Event(name).wait(timeout=60)
        stop()
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
    snap = _wait_for(job, lambda s: all(r["activity"] == _FILLED for r in s["ranks"]))
    assert [r["status"] for r in snap["ranks"]] == ["running", "running"]
    assert ": running, 2 ranks" in render_html(snap)
    Event("status-go", client=client).set()
    assert job.result(timeout=60) == [0, 1]


def test_watch_prints_phases_and_activity(client: Client) -> None:
    out = io.StringIO()
    go = Event("status-watch-go", client=client)
    job = dask_ddp.launch(client, _busy_then, args=("status-watch-go",))
    watcher = threading.Thread(target=job.watch, kwargs={"file": out}, daemon=True)
    watcher.start()  # watching while the ranks start, work and wait
    waiting = f"r0 running ({_FILLED}) | r1 running ({_FILLED})"  # phase and activity
    try:
        _wait_for(job, lambda s: all(r["activity"] == _FILLED for r in s["ranks"]))
        poll_for(lambda: waiting in out.getvalue(), timeout=30)  # drawn while they wait
    finally:
        go.set()
    watcher.join(60)
    assert job.result(timeout=60) == [0, 1]
    drawn = out.getvalue()
    assert waiting in drawn
    assert "succeeded; r0 step 0 loss 1 | r1 step 0 loss 1" in drawn[drawn.index(waiting) :]


def test_status_calls_outside_a_rank_only_log(caplog) -> None:
    with caplog.at_level("INFO", logger="dask_ddp._rank.status"):
        status.activity("listing s3://bucket/train")
        status.phase(status.RUNNING)
        status.follow(".", lambda: "never said")()
    assert "listing s3://bucket/train" in caplog.text


class _Said:
    """Stands in for a RankChannel: records the statuses put on it."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.changed = threading.Condition()

    def put_status(self, phase: str | None, detail: str = "") -> None:
        with self.changed:
            self.texts.append(detail)
            self.changed.notify_all()

    def wait_for(self, text: str) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: text in self.texts, timeout=10)


def test_follow_says_the_text_when_the_path_changes(tmp_path) -> None:
    said = _Said()
    run = RankRun("job", "key", 0, channel=said)  # type: ignore[arg-type]
    assert PROCESS.claim(run, timeout=1)
    target = tmp_path / "fill-log"  # does not exist yet: followed from its creation
    try:
        stop = status.follow(str(target), lambda: f"{target.stat().st_size} bytes")
        target.write_bytes(b"x")
        assert said.wait_for("1 bytes")
        with target.open("ab") as f:
            f.write(b"yz")
        assert said.wait_for("3 bytes")
        stop()
        stop()  # a second stop is harmless
        target.write_bytes(b"abcd")
    finally:
        PROCESS.release(run)
    assert "4 bytes" not in said.texts  # stopped: no longer said


def test_follow_ends_with_the_run(tmp_path) -> None:
    said = _Said()
    run = RankRun("job", "key", 0, channel=said)  # type: ignore[arg-type]
    assert PROCESS.claim(run, timeout=1)
    status.follow(str(tmp_path), lambda: f"{len(list(tmp_path.iterdir()))} files")
    assert said.wait_for("0 files")
    PROCESS.release(run)  # ends the follower without its stop being called
    (tmp_path / "a").write_text("x")
    assert run.on_end == [] and "1 files" not in said.texts


class _Sink:
    """Stands in for the worker: keeps what the channel logs, and wakes a waiter."""

    address = "tcp://127.0.0.1:1"

    def __init__(self) -> None:
        self.logged: list[dict[str, Any]] = []
        self.times: list[float] = []  # time.time() of each event logged
        self.changed = threading.Condition()

    def log_event(self, topic: str, msg: dict[str, Any]) -> None:
        with self.changed:
            self.times.append(time.time())
            self.logged.append(msg)
            self.changed.notify_all()


def test_a_status_alone_waits_for_company_and_a_newer_one_replaces_an_unsent_one() -> None:
    # A launch passes its phases (queued, joining, running) milliseconds apart: they reach
    # the supervisor as one event, and a short job's with its final marker.
    sink = _Sink()
    channel = events.RankChannel(
        sink, "3f2a", 0, interval=60, idle_interval=0.5, max_event_bytes=65536
    )
    channel.put_status(status.QUEUED, "waiting for job 1a2b")
    channel.put_status(status.JOINING, "1 of 2 joined")  # replaces it, unsent
    with sink.changed:
        assert not sink.changed.wait_for(lambda: sink.logged, timeout=0.25)  # it waits ...
        assert sink.changed.wait_for(lambda: sink.logged, timeout=30)  # ... then goes alone
    channel.put_status(status.RUNNING, "step 0")  # waits for the interval ...
    channel.put_status(None, "listing s3://bucket/train")  # ... and is replaced, phase kept
    channel.put_status(None, "listing s3://bucket/train")  # unchanged: not queued
    channel.put(protocol.METRICS, [0, 0.0, {"loss": 1.0}])
    assert channel.close() is None
    channel.put_status(status.RUNNING)  # after close: ignored, never raises
    sent = [msg for event in sink.logged if "packed" in event for msg in protocol.decode(event)]
    statuses = [body[:2] for kind, body in sent if kind == protocol.STATUS]
    assert statuses == [
        [status.JOINING, "1 of 2 joined"],
        [status.RUNNING, "listing s3://bucket/train"],
    ]
    assert [kind for kind, _ in sent] == [protocol.STATUS, protocol.METRICS, protocol.STATUS]
    # The final marker rides on the last batch: two events in all.
    assert len(sink.logged) == 2 and "packed" in sink.logged[-1]
    assert sink.logged[-1]["end"] == 3


def test_a_rank_reporting_a_few_times_a_second_sends_each_record_at_once() -> None:
    # Nagle's algorithm in reverse: an idle line sends at once (at most every idle
    # interval), a busy one batches every interval.
    sink = _Sink()
    channel = events.RankChannel(
        sink, "3f2a", 0, interval=1.0, idle_interval=0.05, max_event_bytes=65536
    )
    for step in range(5):  # 5 reports a second: each goes at once, not after the interval
        channel.put(protocol.METRICS, [step, time.time(), {"loss": 1.0}])
        with sink.changed:
            assert sink.changed.wait_for(lambda n=step: len(sink.logged) > n, timeout=0.5)
        time.sleep(0.2)
    before = len(sink.logged)
    start = time.monotonic()
    while time.monotonic() - start < 0.5:  # every millisecond: batched, an interval apart
        channel.put(protocol.METRICS, [9, time.time(), {"loss": 1.0}])
        time.sleep(0.001)
    assert len(sink.logged) - before <= 3
    assert channel.close() is None


def test_a_rank_reporting_once_an_interval_sends_each_record_at_once() -> None:
    # A rank that reports exactly once an interval (a loss every 50 ms, the default) is
    # idle: each record goes at once. The next flush counts from when the last was due:
    # counted from when the sending thread woke for it (a training loop holds the GIL, so
    # up to 5 ms late), each flush came a wake-up later than the one before, and the
    # records waited longer and longer, up to an interval (22 ms of a 28 ms median delay).
    # What is checked is the loop's own schedule, when each flush is due against when its
    # first record was put (both its monotonic clock), not the machine's wake-up latency:
    # a loaded machine (two pytest processes) wakes the thread late whatever it computed.
    sink = _Sink()
    interval = 0.05
    channel = events.RankChannel(sink, "3f2a", 0, interval=interval, max_event_bytes=65536)
    scheduled = []  # for each time the loop asks with records waiting: due - first put

    def due(next_flush: float, ask: Callable[[float], float | None] = channel._due) -> Any:
        when = ask(next_flush)
        if channel._buffer:  # then it is due at a time, never None
            scheduled.append(when - channel._buffer_since)
        return when

    channel._due = due  # the sending loop calls it with the channel's lock held
    for step in range(40):  # a step of an interval, spinning, then its report
        next_at = time.monotonic() + interval
        while time.monotonic() < next_at:
            pass
        channel.put(protocol.METRICS, [step, time.time(), {"loss": 1.0}])
    assert channel.close() is None
    assert len(sink.logged) >= 39, "records were batched"
    # Each flush due the moment its record was put (exactly 0 s after: the records come an
    # interval or more apart), never a wake-up later (with the drift: 5 ms and more, the
    # interpreter's switch interval while the loop spins).
    assert max(scheduled) < 0.001, scheduled

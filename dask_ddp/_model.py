"""The state of a job as the client knows it, read by :class:`~dask_ddp.job.Job` and the views.

:class:`JobModel` is written by the job's supervisor (:mod:`dask_ddp.supervise`) and its
event reader (:mod:`dask_ddp._reader`), and read by the :class:`~dask_ddp.job.Job` handle
and the live views. One :class:`threading.Condition` guards it and wakes the readers
waiting for a change (:meth:`Job.iter_metrics`, :meth:`Job.watch`,
:meth:`Job.view_state`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from . import checkpoint, events, view

logger = logging.getLogger(__name__)

_VIEW_PERIOD = 0.25  # seconds between live-view refreshes while records stream in
_CURVE_POINTS = 400  # points kept per rank for the loss curve (older ones thinned)
_OUTPUT_LINES = 10_000  # printed lines kept in Job.output (the oldest go first)
_VIEW_LINES = 8  # printed lines the live view shows


class JobState(str, enum.Enum):
    """RUNNING -> SUCCEEDED | FAILED | CANCELLED; RUNNING -> RESTARTING -> RUNNING.

    A job that waits for free workers is WAITING first (and may be CANCELLED there).

    Examples
    --------
    >>> JobState("succeeded") is JobState.SUCCEEDED
    True
    >>> job.state  # doctest: +SKIP
    <JobState.RUNNING: 'running'>
    """

    WAITING = "waiting"
    RUNNING = "running"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class MetricRecord(NamedTuple):
    """One :func:`dask_ddp.report` call, as the client received it.

    Attributes
    ----------
    rank : int
        The rank that reported it.
    step : int or None
        The ``step=`` it was reported with.
    time : float
        When the rank called ``report()``, in seconds since the epoch (``time.time()`` on
        the rank's host).
    metrics : dict of str to int or float
        The reported values.

    Examples
    --------
    >>> MetricRecord(rank=0, step=3, time=1.7e9, metrics={"loss": 0.25}).metrics["loss"]
    0.25
    """

    rank: int
    step: int | None
    time: float
    metrics: dict[str, float]


@dataclasses.dataclass(frozen=True)
class AttemptInfo:
    """One placement of a job: how many ranks, why it started, when it trained.

    An elastic job (``launch(..., min_workers=)``) that shrinks after a lost worker or
    grows at a checkpoint has one entry per size it ran at; :attr:`Job.history
    <dask_ddp.Job.history>` lists them.

    Attributes
    ----------
    attempt : int
        0 for the first placement, then one more per restart or resize.
    world_size : int
        The attempt's number of ranks.
    reason : str
        Why it started: ``"started"``, the failure it restarts after, or the grow.
    started : float
        When the job began moving to it: the launch, or when the attempt before stopped
        (``time.time()`` on the client), so that :attr:`seconds_to_first_step` is the time
        without training.
    first_step : float or None
        When its first :func:`dask_ddp.report` record arrived; None before.

    Examples
    --------
    >>> a = AttemptInfo(1, 2, "worker tcp://10.0.0.7:4031 lost", 1.7e9, 1.7e9 + 4.5)
    >>> a.seconds_to_first_step
    4.5
    """

    attempt: int
    world_size: int
    reason: str
    started: float
    first_step: float | None = None

    @property
    def seconds_to_first_step(self) -> float | None:
        """From :attr:`started` to the first reported step; None before it."""
        return None if self.first_step is None else self.first_step - self.started


class OutputLine(NamedTuple):
    """One line a rank printed (``print()``, ``sys.stdout``/``sys.stderr``), on the client.

    Examples
    --------
    >>> OutputLine(rank=1, stream="stdout", text="epoch 3 done")
    OutputLine(rank=1, stream='stdout', text='epoch 3 done')
    """

    rank: int
    stream: str
    text: str


class _RankProgress:
    """What the live view shows for one rank."""

    def __init__(self) -> None:
        self.count = 0
        self.step: int | None = None
        self.last: dict[str, float] = {}
        self.first_time: float | None = None
        self.first_step: int | None = None
        self.last_time: float | None = None
        self.curve: list[tuple[float, float]] = []
        self._stride = 1

    def add(self, rec: MetricRecord, metric: str | None) -> None:
        self.count += 1
        self.step = rec.step if rec.step is not None else self.step
        self.first_step = self.step if self.first_step is None else self.first_step
        self.last = rec.metrics
        self.first_time = rec.time if self.first_time is None else self.first_time
        self.last_time = rec.time
        if metric is None or metric not in rec.metrics or self.count % self._stride:
            return
        y = float(rec.metrics[metric])
        if math.isfinite(y):
            self.curve.append((float(rec.step if rec.step is not None else self.count), y))
            if len(self.curve) >= 2 * _CURVE_POINTS:
                del self.curve[1::2]
                self._stride *= 2

    @property
    def rate(self) -> float | None:
        if self.first_time is None or self.last_time is None or self.last_time <= self.first_time:
            return None
        return (self.count - 1) / (self.last_time - self.first_time)

    @property
    def step_rate(self) -> float | None:
        """Steps per second between the first and the latest report with a step."""
        if self.step is None or self.first_step is None or self.rate is None:
            return None
        return (self.step - self.first_step) / (self.last_time - self.first_time)


class _RankStatus:
    """A rank's phase in the current attempt, and what it last said it was busy with."""

    def __init__(self) -> None:
        self.phase: str | None = None  # None: submitted, its task has not started yet
        self.detail = ""
        self.time = 0.0  # when the rank said it (the rank's clock, as record times)

    def fresh(self, prog: _RankProgress) -> bool:
        """Whether what the rank last said it was busy with is still news: said before it
        reported anything, or at most a couple of seconds before its latest report."""
        return bool(self.detail) and self.time >= (prog.last_time or 0.0) - 2.0


def _text(error: BaseException | None) -> str | None:
    return str(error) if error is not None else None


def _pick_curve_metric(values: dict[str, float]) -> str:
    if "loss" in values:
        return "loss"
    return next((k for k in values if "loss" in k.lower()), next(iter(values)))


class JobModel:
    """A job's state: attempts, ranks, phases, metrics, output, errors and outcome.

    Writers (the supervisor and the event reader) change it under :attr:`cond` and
    notify; readers take :attr:`cond` and read, or wait for a change.
    """

    def __init__(self, job_id: str, workers: list[str], backend: str) -> None:
        self.job_id = job_id
        self.cond = threading.Condition()
        self.done = threading.Event()  # set once the outcome is known
        self.state = JobState.RUNNING if workers else JobState.WAITING
        self.wait_reason: str | None = None
        self.total_steps: int | None = None  # launch(total_steps=): bars show n/total, ETA
        self.moving_since: float | None = time.time()  # launch, or the last attempt's end
        self.history: list[AttemptInfo] = []
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.finished: float | None = None
        self.metrics: list[MetricRecord] = []
        self.output: collections.deque[OutputLine] = collections.deque(maxlen=_OUTPUT_LINES)
        self.checkpoints: list[checkpoint.CheckpointInfo] = []
        self.results: dict[str, collections.deque[tuple[int, str, Any]]] = {}
        self.status_changes = 0  # rank status messages seen (wakes Job.watch)
        self.closed = False  # the channel is closed: nothing more arrives
        self.progress: list[_RankProgress] = []
        self.curve_metric: str | None = None
        self.rank_errors: dict[int, str] = {}
        self.notes: list[str] = []
        self.views: list[Any] = []
        self.view_due: float | None = None
        self._last_view = 0.0
        self.new_attempt(0, "", workers, backend, "")

    def new_attempt(
        self, attempt: int, topic: str, workers: list[str], backend: str, reason: str
    ) -> None:
        """Take a new placement: its ranks' phases start again, their futures are pending.

        A resized job keeps the progress of the ranks it still has. ``reason`` (empty for
        the model's initial state) starts an entry of :attr:`history`.
        """
        with self.cond:
            self.attempt, self.topic = attempt, topic
            self.workers, self.backend = list(workers), backend
            self.futures: list[Any] = []
            self.status = [_RankStatus() for _ in self.workers]
            del self.progress[len(self.workers) :]
            self.progress += [_RankProgress() for _ in self.workers[len(self.progress) :]]
            self.rank_errors.clear()
            self.wait_reason = None
            if reason:
                since = self.moving_since or time.time()
                self.history.append(AttemptInfo(attempt, len(workers), reason, since))
                self.moving_since = None
            self.cond.notify_all()
        self.mark_views()

    def waiting(self, reason: str) -> None:
        """The job waits for workers: say why (the live view and the log show it)."""
        with self.cond:
            changed = reason.split(":")[0] != (self.wait_reason or "").split(":")[0]
            self.wait_reason = reason
            self.cond.notify_all()
        if changed:
            logger.info("job %s: %s", self.job_id, reason)
        self.mark_views()

    def _first_step(self, when: float) -> None:
        """The current attempt's first record arrived (called with :attr:`cond` held)."""
        info = self.history[-1]
        self.history[-1] = dataclasses.replace(info, first_step=when)
        if len(self.history) > 1 and self.history[-2].world_size != info.world_size:
            text = (
                f"resized from {self.history[-2].world_size} to {info.world_size} ranks "
                f"({info.reason}); training again {when - info.started:.1f} s after it stopped"
            )
            logger.info("job %s: %s", self.job_id, text)
            self.notes.append(text)

    def notify(self) -> None:
        """Wake the readers: something they may wait for changed (a future's status)."""
        with self.cond:
            self.cond.notify_all()
        self.mark_views()

    def add(self, rank: int, msgs: list[list[Any]]) -> tuple[list, list]:
        """Take a rank's decoded messages; return the new records and printed lines."""
        records: list[MetricRecord] = []
        printed: list[OutputLine] = []
        with self.cond:
            for kind, body in msgs:
                if kind == events.METRICS:
                    step, when, values = body
                    rec = MetricRecord(rank, step, when, values)
                    if self.curve_metric is None and values:
                        self.curve_metric = _pick_curve_metric(values)
                    self.progress[rank].add(rec, self.curve_metric)
                    records.append(rec)
                    if self.history and self.history[-1].first_step is None:
                        self._first_step(time.time())
                elif kind == events.CHECKPOINT:
                    url, step, nbytes, when = body
                    self.checkpoints.append(
                        checkpoint.CheckpointInfo(url, step, nbytes, rank, when)
                    )
                elif kind == events.RESULT:
                    key, path, data = body
                    self.results.setdefault(key, collections.deque()).append((rank, path, data))
                elif kind == events.OUTPUT:
                    stream, text = body
                    printed += [OutputLine(rank, stream, line) for line in text.split("\n")]
                elif kind == events.STATUS:
                    self.set_status(rank, *body)
            self.metrics.extend(records)
            self.output.extend(printed)
            self.cond.notify_all()
        self.mark_views()
        return records, printed

    def set_status(self, rank: int, phase: str | None, detail: Any, when: Any) -> None:
        """A rank's phase (None: unchanged, activity only) and what it is busy with."""
        with self.cond:
            status = self.status[rank]
            if phase is not None:
                status.phase = phase
            status.detail = str(detail or "")
            status.time = float(when or time.time())
            self.status_changes += 1
            self.cond.notify_all()
        self.mark_views()

    def note(self, text: str) -> None:
        with self.cond:
            self.notes.append(text)
        self.mark_views()

    def show_rank_error(self, rank: int, text: str) -> None:
        with self.cond:
            self.rank_errors.setdefault(rank, text)
        self.refresh_views()

    def close(self) -> None:
        """Nothing more arrives: wake every reader for the last time."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.refresh_views()

    # -- views ------------------------------------------------------------------------
    def mark_views(self) -> None:
        if self.views and self.view_due is None:
            self.view_due = max(time.monotonic(), self._last_view + _VIEW_PERIOD)

    def refresh_views(self) -> None:
        self.view_due = None
        self._last_view = time.monotonic()
        if not self.views:
            return
        state = self.snapshot()
        for shown in list(self.views):
            try:
                again = shown.update(state)
            except Exception:  # a closed notebook must not stop the supervisor
                logger.debug("job %s: live view update failed", self.job_id, exc_info=True)
                continue
            if again is not None:  # a view that skipped this state asks to be called later
                due = time.monotonic() + again
                self.view_due = due if self.view_due is None else min(self.view_due, due)

    def snapshot(self) -> dict[str, Any]:
        """The state the views draw (see :meth:`dask_ddp.Job.view_state`)."""
        with self.cond:
            ranks = []
            for r, (worker, prog) in enumerate(zip(self.workers, self.progress, strict=True)):
                fut = self.futures[r] if r < len(self.futures) else None
                status = self.status[r]
                if fut is None or fut.status != "pending":
                    phase = fut.status if fut is not None else "pending"
                else:
                    phase = status.phase or "submitted"
                error = self.rank_errors.get(r) or ""
                if error.startswith(("failed", "stopped")):
                    phase = error.split(":", 1)[0]  # not "cancelled": why it ended
                fresh = status.fresh(prog)
                ranks.append(
                    {
                        "rank": r,
                        "worker": worker,
                        "status": phase,
                        "activity": status.detail if fresh and phase != "finished" else "",
                        "count": prog.count,
                        "step": prog.step,
                        "last": dict(prog.last),
                        "rate": prog.rate,
                        "step_rate": prog.step_rate,
                        "error": self.rank_errors.get(r),
                        "curve": list(prog.curve),
                    }
                )
            end = self.finished if self.finished is not None else time.monotonic()
            return {
                "job": self.job_id,
                "state": self.state.value,
                "waiting": self.wait_reason,
                "total": self.total_steps,
                "backend": self.backend,
                "elapsed": end - self.started,
                "attempts": self.attempt + 1,
                "records": len(self.metrics),
                "ranks": ranks,
                "metric": self.curve_metric,
                "error": getattr(self.error, "summary", None) or _text(self.error),
                "traceback": getattr(self.error, "rank_traceback", None) or None,
                "notes": list(self.notes),
                "output": [
                    f"[rank {o.rank}] {o.text}"
                    for o in itertools.islice(reversed(self.output), _VIEW_LINES)
                ][::-1],
            }

    def progress_line(self) -> str:
        """One line for a terminal: each rank's step and latest metrics."""
        return view.progress_line(self.snapshot())

    def wait_state(
        self, until: Callable[[dict[str, Any]], bool] | None, timeout: float | None
    ) -> dict[str, Any]:
        """:meth:`snapshot`, once ``until(snapshot)`` holds (see ``Job.view_state``)."""
        if until is None:
            return self.snapshot()
        with self.cond:
            if not self.cond.wait_for(lambda: until(self.snapshot()) or self.closed, timeout):
                raise TimeoutError(f"job {self.job_id}: the state did not come within {timeout} s")
            state = self.snapshot()
        if not until(state):
            raise TimeoutError(f"job {self.job_id}: the job ended before the state came")
        return state

    # -- readers ----------------------------------------------------------------------
    def iter_metrics(self, timeout: float | None = None) -> Iterator[MetricRecord]:
        """Every record from the first, as it arrives, until the channel closes."""
        seen = 0
        while True:
            with self.cond:
                if not self.cond.wait_for(
                    lambda n=seen: len(self.metrics) > n or self.closed, timeout
                ):
                    raise TimeoutError(f"job {self.job_id}: no record arrived within {timeout} s")
                new = self.metrics[seen:]
                closed = self.closed
            seen += len(new)
            yield from new
            if closed and not new:
                return

    def progress_lines(self) -> Iterator[tuple[int, str]]:
        """(record count, progress line) at each new record or status, until closed."""
        shown, changes = -1, -1
        while True:
            with self.cond:
                self.cond.wait_for(
                    lambda n=shown, c=changes: (
                        len(self.metrics) > n or self.status_changes != c or self.closed
                    )
                )
                shown, changes, closed = len(self.metrics), self.status_changes, self.closed
                line = self.progress_line()
            yield shown, line
            if closed:
                return

    def take_results(self, key: str) -> Iterator[tuple[int, str, Any]]:
        """Pop results sent with ``key`` as they arrive, until the channel closes."""
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.results.get(key) or self.closed)
                pending = self.results.get(key)
                if not pending:
                    return
                item = pending.popleft()
            yield item

"""The client's handle on a running job: its futures, its state, its outcome, its reports.

A :class:`Job` watches its rank futures and its event topic from a background thread. The
first rank to fail decides the job's error; the other ranks are stopped at once (an
exception raised in their thread, then, for ranks stuck inside a C++ collective, a
restart of their worker after ``ddp.failure-grace``), so no rank waits out the collective
timeout.

Everything the ranks send (:func:`dask_ddp.report` records, results) arrives through the
job's channel (:mod:`dask_ddp.events`). The subscription is in place before any rank
starts; the watcher thread puts each rank's messages back in order, fetches large ones
directly from the rank's worker, and keeps the records in :attr:`Job.metrics`. Before
:meth:`Job.result` returns, every rank's final marker has arrived, so every record a rank
reported before its function returned is there. Event handlers only queue: all work runs
on the watcher thread, never on the client's event loop.

The live view (``job`` as the last line of a notebook cell, or :meth:`Job.watch` in a
terminal) runs on the client only.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import math
import os
import queue
import re
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any, NamedTuple

import distributed
from distributed import Client, Future, KilledWorker

from . import bootstrap, checkpoint, events, view
from .errors import (
    JobCancelledError,
    JobNotFoundError,
    PeerFailedError,
    RankAbortedError,
    RankFailedError,
    RetryableError,
    WorkerLostError,
)

if TYPE_CHECKING:
    import pandas

logger = logging.getLogger(__name__)

__all__ = ["Job", "JobState", "MetricRecord", "OutputLine"]

_VIEW_PERIOD = 0.25  # seconds between live-view refreshes while records stream in
_CURVE_POINTS = 400  # points kept per rank for the loss curve (older ones thinned)
_OUTPUT_LINES = 10_000  # printed lines kept in Job.output (the oldest go first)
_VIEW_LINES = 8  # printed lines the live view shows


class JobState(str, enum.Enum):
    """RUNNING -> SUCCEEDED | FAILED | CANCELLED; RUNNING -> RESTARTING -> RUNNING.

    Examples
    --------
    >>> JobState("succeeded") is JobState.SUCCEEDED
    True
    >>> job.state  # doctest: +SKIP
    <JobState.RUNNING: 'running'>
    """

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


# Rank task key -> its job. Weak: a job lives as long as the user holds it or one of its
# rank futures (each future refers to its job, see Job._start), so that
# DaskResultsHandler.process_results(prefix, futures) finds the job behind run()'s list.
_jobs_by_key: weakref.WeakValueDictionary[str, Job] = weakref.WeakValueDictionary()


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


_JOB_ATTR = "_dask_ddp_job"


def _job_for(futures: Job | Sequence[Future]) -> Job:
    """The job behind ``futures`` (a Job, or its rank futures)."""
    if isinstance(futures, Job):
        return futures
    keys = [str(getattr(f, "key", f)) for f in futures]
    jobs = {id(j): j for j in (_jobs_by_key.get(k) for k in keys) if j is not None}
    if not keys or len(jobs) != 1 or any(k not in _jobs_by_key for k in keys):
        raise JobNotFoundError(keys)
    return next(iter(jobs.values()))


class _RankProgress:
    """What the live view shows for one rank; written by the watcher thread only."""

    def __init__(self) -> None:
        self.count = 0
        self.step: int | None = None
        self.last: dict[str, float] = {}
        self.first_time: float | None = None
        self.last_time: float | None = None
        self.curve: list[tuple[float, float]] = []
        self._stride = 1

    def add(self, rec: MetricRecord, metric: str | None) -> None:
        self.count += 1
        self.step = rec.step if rec.step is not None else self.step
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


class _RankStatus:
    """A rank's phase in the current attempt, and what it last said it was busy with."""

    def __init__(self) -> None:
        self.phase: str | None = None  # None: submitted, its task has not started yet
        self.detail = ""
        self.time = 0.0  # when the rank said it (the rank's clock, as record times)


class Job:
    """Handle on a job started by :func:`dask_ddp.launch`.

    Attributes
    ----------
    job_id : str
        Identifier; rank task keys are ``dask-ddp-<job_id>-rank-<rank>``.
    futures : list of distributed.Future
        One per rank, in rank order. Each resolves to the rank's return value.
    workers : list of str
        The worker address of each rank, in rank order.
    backend : str
        The torch.distributed backend in use.
    topic : str
        The Dask event topic the job's ranks report on (``dask-ddp-<job_id>``).

    Examples
    --------
    >>> job = dask_ddp.launch(client, train, args=(cfg,))  # doctest: +SKIP
    >>> job                                                 # doctest: +SKIP
    (live view in Jupyter: per-rank progress, loss curve, errors)
    >>> job.result()                                        # doctest: +SKIP
    [0.31, 0.31]
    >>> job.metrics_frame().groupby("rank").loss.last()     # doctest: +SKIP
    """

    def __init__(
        self,
        client: Client,
        job_id: str,
        attempt: Any,
        *,
        failure_grace: float,
        drain_timeout: float = 10.0,
        on_report: Callable[[MetricRecord], Any] | None = None,
        on_output: Callable[[OutputLine], Any] | None = None,
        max_restarts: int = 0,
        relaunch: Callable[[int], Any] | None = None,
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.workers: list[str] = []
        self.futures: list[Future] = []
        self.backend = attempt.backend
        self._grace = failure_grace
        self._drain_timeout = drain_timeout
        self._on_report = on_report
        self._on_output = on_output
        self._restarts_left = max_restarts
        self._relaunch = relaunch
        self._state = JobState.RUNNING
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._started = time.monotonic()
        self._finished: float | None = None
        self._cancel_reason = "cancelled by the user"
        # Channel state: written by the watcher thread; readers take _cond.
        self._cond = threading.Condition()
        self._metrics: list[MetricRecord] = []
        self._output: collections.deque[OutputLine] = collections.deque(maxlen=_OUTPUT_LINES)
        self._status_changes = 0  # rank status messages seen (wakes Job.watch)
        self._checkpoints: list[checkpoint.CheckpointInfo] = []
        self._results: dict[str, collections.deque[tuple[int, str, Any]]] = {}
        self._streams_closed = False
        self._progress = [_RankProgress() for _ in attempt.workers]
        self._curve_metric: str | None = None
        self._rank_errors: dict[int, str] = {}
        self._notes: list[str] = []
        self._views: list[Any] = []
        self._view_due: float | None = None
        self._last_view = 0.0
        self._unsubscribe: list[Callable[[], None]] = []
        self._begin(attempt)
        self._watcher = threading.Thread(
            target=self._watch, name=f"dask-ddp-job-{job_id}", daemon=True
        )

    def _begin(self, attempt: Any) -> None:
        """Take a new placement (the first, or a restart): per-attempt state and
        subscriptions, before any of its ranks is submitted."""
        self._attempt = attempt
        self._run_id: str = attempt.run_id
        self.topic = events.job_topic(self._run_id)
        self.workers = list(attempt.workers)
        self.backend = attempt.backend
        self.futures = []
        self._store_worker = attempt.store_worker
        self._ended: set[int] = set()  # ranks whose task ended (not lost)
        self._silent: set[int] = set()  # ended ranks whose process died: no final marker
        self._streams = [events.RankStream() for _ in self.workers]
        self._status = [_RankStatus() for _ in self.workers]
        # Subscribe before any rank is submitted: the subscription reaches the scheduler
        # first, so no event of this attempt is published before it has a subscriber.
        self._unsubscribe.append(events.subscribe(self.client, self.topic, self._on_job_event))
        for rank, worker in enumerate(self.workers):
            self._unsubscribe.append(
                events.subscribe(
                    self.client,
                    worker,
                    lambda ev, r=rank, w=worker: self._on_worker_event(r, w, ev),
                )
            )

    def _submit(self) -> None:
        futures = self._attempt.submit()
        self.futures = list(futures)
        for rank, fut in enumerate(self.futures):
            _jobs_by_key[str(fut.key)] = self
            setattr(fut, _JOB_ATTR, self)  # keeps the job (its results) alive with its futures
            fut.add_done_callback(
                lambda f, r=rank: self._inbox.put(("done", r)) if f in self.futures else None
            )

    def _start(self) -> None:
        """Submit the first attempt's ranks and start watching them."""
        try:
            self._submit()
        except BaseException:
            self._abandon()
            raise
        self._watcher.start()

    def _abandon(self) -> None:
        """Undo the subscriptions of a job whose ranks could not be submitted."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()

    # -- public API -------------------------------------------------------------------
    @property
    def state(self) -> JobState:
        """The job's state (a :class:`JobState`)."""
        return self._state

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.workers)

    def done(self) -> bool:
        """True once every rank has finished, or the job failed or was cancelled."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job is done; False if ``timeout`` seconds passed first."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> list[Any]:
        """Every rank's return value, in rank order.

        When it returns, :attr:`metrics` holds every record the ranks reported.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait; ``None`` waits for the job to finish.

        Raises
        ------
        RankFailedError
            A rank raised; the rank's exception is chained as ``__cause__``.
        WorkerLostError
            A rank's worker left the cluster while it ran.
        JobCancelledError
            The job was cancelled.
        TimeoutError
            ``timeout`` passed first.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"job {self.job_id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self.client.gather(self.futures)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The job's error once it is done, or None if it succeeded."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"job {self.job_id} did not finish within {timeout} s")
        return self._error

    def cancel(self, reason: str = "cancelled by the user") -> None:
        """Stop every rank and release their workers; :meth:`result` then raises.

        Returns once the ranks have stopped (their workers are restarted if a rank does not
        stop within ``ddp.failure-grace``).
        """
        self._cancel_reason = reason
        self._inbox.put(("cancel", -1))
        self._done.wait()

    @property
    def checkpoints(self) -> list[checkpoint.CheckpointInfo]:
        """Every checkpoint the ranks saved (:func:`dask_ddp.save_checkpoint`), as it lands.

        Each is a :class:`~dask_ddp.checkpoint.CheckpointInfo` (url, step, nbytes, rank,
        time), in the order they were written, across restarts.
        """
        with self._cond:
            return list(self._checkpoints)

    @property
    def attempts(self) -> int:
        """How many times the job was placed: 1, plus one per restart."""
        return self._attempt.attempt + 1

    @property
    def metrics(self) -> list[MetricRecord]:
        """Every :func:`dask_ddp.report` record received so far, in arrival order.

        Each rank's records are in the order the rank reported them. Returns a copy.

        Examples
        --------
        >>> job.result()                          # doctest: +SKIP
        >>> [r.metrics["loss"] for r in job.metrics if r.rank == 0][-3:]  # doctest: +SKIP
        [0.34, 0.33, 0.31]
        """
        with self._cond:
            return list(self._metrics)

    @property
    def output(self) -> list[OutputLine]:
        """The lines the ranks printed, as they arrived (the last 10,000; a copy).

        Each rank's ``print()`` and writes to ``sys.stdout``/``sys.stderr`` while its
        function runs reach the client line by line; they also stay in the worker's own log.
        The live view shows the latest few; ``launch(on_output=...)`` gets each one.

        Examples
        --------
        >>> job.result()                            # doctest: +SKIP
        >>> [line.text for line in job.output if line.rank == 0][-1]  # doctest: +SKIP
        'epoch 3: loss 0.31'
        """
        with self._cond:
            return list(self._output)

    def metrics_frame(self) -> pandas.DataFrame:
        """:attr:`metrics` as a pandas DataFrame: columns rank, step, time, then one per
        metric name (missing values are NaN). ``time`` is seconds since the epoch.

        Raises
        ------
        ImportError
            pandas is not installed.

        Examples
        --------
        >>> df = job.metrics_frame()              # doctest: +SKIP
        >>> df.pivot_table(index="step", columns="rank", values="loss")  # doctest: +SKIP
        """
        try:
            import pandas as pd
        except ImportError as exc:
            raise ImportError(
                "Job.metrics_frame() needs pandas; install it (pip install pandas) or use "
                "job.metrics, a list of records."
            ) from exc
        records = self.metrics
        names: dict[str, None] = {}
        for rec in records:
            names.update(dict.fromkeys(rec.metrics))
        columns = ["rank", "step", "time", *(n for n in names if n not in {"rank", "step", "time"})]
        rows = [{**r.metrics, "rank": r.rank, "step": r.step, "time": r.time} for r in records]
        frame = pd.DataFrame.from_records(rows, columns=columns)
        return frame.astype({"rank": "int64", "step": "Int64", "time": "float64"})

    def iter_metrics(self, timeout: float | None = None) -> Iterator[MetricRecord]:
        """Yield every record as it arrives, from the first one; stop when the job is done
        and its last record has been yielded.

        Parameters
        ----------
        timeout : float, optional
            Longest wait for the next record, in seconds; ``None`` waits as long as the job
            runs.

        Raises
        ------
        TimeoutError
            No record arrived within ``timeout`` while the job was still running.

        Examples
        --------
        >>> for rec in job.iter_metrics():        # doctest: +SKIP
        ...     writer.add_scalar(f"loss/rank{rec.rank}", rec.metrics["loss"], rec.step)
        """
        seen = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(
                    lambda n=seen: len(self._metrics) > n or self._streams_closed, timeout
                ):
                    raise TimeoutError(f"job {self.job_id}: no record arrived within {timeout} s")
                new = self._metrics[seen:]
                closed = self._streams_closed
            seen += len(new)
            yield from new
            if closed and not new:
                return

    def watch(self, *, file: IO[str] | None = None) -> None:
        """Show a progress line (tqdm) until the job is done, then return.

        In a terminal it is one line with the record count, rate and each rank's step and
        latest metrics; in Jupyter ``tqdm.auto`` draws a notebook bar (displaying the job
        itself gives the full live view). Call :meth:`result` afterwards for the outcome.

        Parameters
        ----------
        file : file-like, optional
            Where to draw the line (default: standard error).

        Examples
        --------
        >>> job = dask_ddp.launch(client, train)  # doctest: +SKIP
        >>> job.watch()                           # doctest: +SKIP
        job 3f2a9c: 1200 records [00:12, 98.1 records/s, r0 step 599 loss 0.31 | r1 ...]
        """
        from tqdm.auto import tqdm

        shown, changes = 0, -1
        with tqdm(desc=f"job {self.job_id}", unit=" records", file=file) as bar:
            while True:
                with self._cond:
                    self._cond.wait_for(
                        lambda n=shown, c=changes: (
                            len(self._metrics) > n
                            or self._status_changes != c
                            or self._streams_closed
                        )
                    )
                    count, closed = len(self._metrics), self._streams_closed
                    changes = self._status_changes
                    line = self._progress_line()
                bar.set_postfix_str(line, refresh=False)
                bar.update(count - shown)
                shown = count
                if closed:
                    break
            self._done.wait()  # set right after the channel closes
            bar.set_postfix_str(f"{self.state.value}; {line}")

    # -- watching ---------------------------------------------------------------------
    def _on_job_event(self, event: Any) -> None:
        # Runs on the client's event loop: only queue.
        self._inbox.put(("event", event[1]))

    def _on_worker_event(self, rank: int, worker: str, event: Any) -> None:
        # Runs on the client's event loop: only queue.
        _, msg = event
        if (
            isinstance(msg, dict)
            and msg.get("action") == "remove-worker"
            and rank < len(self.workers)
            and self.workers[rank] == worker
        ):
            self._inbox.put(("lost", rank))

    def _get(self, timeout: float | None = None) -> tuple[str, int]:
        """The next control message (done, lost, cancel); channel events queued before it
        are handled on the way. Raises ``queue.Empty`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            now = time.monotonic()
            wait = None if deadline is None else max(0.0, deadline - now)
            if self._view_due is not None:
                wait = max(0.0, min(self._view_due - now, wait if wait is not None else 1e9))
            try:
                kind, payload = self._inbox.get(timeout=wait)
            except queue.Empty:
                if self._view_due is not None and time.monotonic() >= self._view_due:
                    self._refresh_views()
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue
            if kind == "event":
                self._handle(payload)
                continue
            return kind, payload

    def _watch(self) -> None:
        try:
            self._watch_until_done()
        except Exception:  # the watcher must never die silently: fail the job with it
            logger.exception("job %s: watcher failed", self.job_id)
            if self._error is None:
                self._error = RuntimeError(f"dask_ddp job {self.job_id}: watcher failed")
                self._state = JobState.FAILED
        finally:
            self._finished = time.monotonic()
            try:
                if self._state is not JobState.SUCCEEDED:
                    # The outcome is known: result() raises now, while the records that the
                    # stopped ranks sent on their way out are still collected. A rank's last
                    # events reach the client before its task's outcome does, so they are
                    # normally queued already; a rank stopped before its function started
                    # sent none, hence the short bound.
                    self._done.set()
                    bound = min(self._drain_timeout, 1.0)
                    self._drain(self._ended - self._silent, bound, warn=False)
            finally:
                self._end_streams()
                self._done.set()
        events.forget_topic(self.client, self.topic)

    def _watch_until_done(self) -> None:
        while True:
            self._watch_attempt()
            if self._state is not JobState.FAILED or not self._will_restart():
                return
            self._restart()
            if self._state is JobState.FAILED:
                return

    def _will_restart(self) -> bool:
        """Whether the job's current error leads to another attempt."""
        return self._restarts_left > 0 and self._relaunch is not None and _retryable(self._error)

    def _restart(self) -> None:
        """Place the job again after a retryable failure and submit its ranks."""
        cause = self._error
        self._restarts_left -= 1
        attempt = self._attempt.attempt + 1
        logger.warning(
            "job %s: %s; restarting from the last checkpoint (attempt %d, %d restarts left)",
            self.job_id, cause, attempt + 1, self._restarts_left,
        )  # fmt: skip
        self._note(f"attempt {attempt + 1} after: {cause}")
        self._drain(self._ended - self._silent, min(self._drain_timeout, 1.0), warn=False)
        for unsubscribe in self._unsubscribe:
            try:
                unsubscribe()
            except Exception:
                logger.debug("job %s: unsubscribe failed", self.job_id, exc_info=True)
        self._unsubscribe.clear()
        events.forget_topic(self.client, self.topic)
        self._state = JobState.RESTARTING
        self._error = None
        with self._cond:
            self._rank_errors.clear()
        try:
            placed = self._relaunch(attempt)  # type: ignore[misc]
            self._begin(placed)
            self._submit()
        except Exception as exc:
            logger.warning("job %s: could not restart: %s", self.job_id, exc)
            exc.__cause__ = exc.__cause__ or cause
            self._error = exc
            self._state = JobState.FAILED
            return
        self._state = JobState.RUNNING
        self._refresh_views()

    def _watch_attempt(self) -> None:
        finished = self._ended
        while len(finished) < self.world_size:
            kind, rank = self._get()
            if kind == "cancel":
                self._stop(self._cancel_reason, set(range(self.world_size)) - finished, finished)
                self._error = JobCancelledError(self.job_id)
                self._state = JobState.CANCELLED
                return
            if kind == "lost" and rank not in finished:
                self._fail(
                    WorkerLostError(rank, self.workers[rank], self.futures[rank].key), finished
                )
                return
            if kind != "done" or rank in finished:
                continue
            finished.add(rank)
            if self.futures[rank].status == "error":
                self._fail(self._rank_error(rank), finished)
                return
            if self.futures[rank].status == "cancelled":
                self._stop(
                    "a rank's task was cancelled", set(range(self.world_size)) - finished, finished
                )
                self._error = JobCancelledError(self.job_id)
                self._state = JobState.CANCELLED
                return
        # Every rank sent its final marker before its task finished: wait for the markers
        # (normally already here), so that metrics are complete when result() returns.
        self._drain(range(self.world_size), self._drain_timeout, warn=True)
        self._state = JobState.SUCCEEDED
        logger.info("job %s: %d ranks finished", self.job_id, self.world_size)

    def _rank_error(self, rank: int) -> BaseException:
        fut = self.futures[rank]
        exc = fut.exception()
        if isinstance(exc, KilledWorker):
            self._silent.add(rank)
        self._show_rank_error(rank, f"{type(exc).__name__}: {exc}")
        if isinstance(exc, (PeerFailedError, RankAbortedError)):
            return exc
        text = _user_traceback(exc, fut.traceback())
        error = RankFailedError(
            rank, self.workers[rank], fut.key, f"{type(exc).__name__}: {exc}", text
        )
        error.__cause__ = exc
        return error

    def _fail(self, error: BaseException, finished: set[int]) -> None:
        """Find the first-failing rank's error, stop the rest, and record the outcome."""
        deadline = time.monotonic() + self._grace
        while (
            isinstance(error, (PeerFailedError, RankAbortedError))
            and len(finished) < self.world_size
        ):
            try:
                kind, rank = self._get(max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if kind == "lost" and rank not in finished:
                error = WorkerLostError(rank, self.workers[rank], self.futures[rank].key)
                self._show_rank_error(rank, str(error))
            elif kind == "done" and rank not in finished:
                finished.add(rank)
                if self.futures[rank].status == "error":
                    candidate = self._rank_error(rank)
                    if not isinstance(candidate, (PeerFailedError, RankAbortedError)):
                        error = candidate
        self._error = error
        self._state = JobState.FAILED
        self._refresh_views()
        # One line: the whole error, traceback included, is what result() raises.
        logger.warning("job %s failed: %s", self.job_id, str(error).split("\n", 1)[0])
        if not self._will_restart():
            # The outcome is known: result() raises now, while the peers are stopped (a
            # stuck one only after ddp.failure-grace and a restart of its worker).
            self._done.set()
        self._stop(
            f"another rank failed ({type(error).__name__})",
            set(range(self.world_size)) - finished,
            finished,
        )

    def _stop(self, reason: str, running: set[int], finished: set[int]) -> None:
        """Stop the ranks in ``running``: abort in place, then restart stuck workers.

        Ranks whose worker has left the cluster are only cancelled: there is nothing to
        stop, and a call to a gone worker would wait for its connect timeout.
        """
        client = self.client
        alive = set(client.scheduler_info(n_workers=-1)["workers"])
        gone = {r for r in running if self.workers[r] not in alive}
        finished |= gone
        self._silent |= gone  # no final marker will come from them
        targets = sorted({self.workers[r] for r in running - gone})
        idle: set[str] = set()  # workers where no rank of this job runs (queued, or done)
        if targets:
            try:
                aborted = client.run(
                    bootstrap.abort_rank, self._run_id, reason, workers=targets, on_error="ignore"
                )
                idle = {w for w, stopped in aborted.items() if stopped is False}
            except Exception:
                logger.debug("job %s: abort request failed", self.job_id, exc_info=True)
        deadline = time.monotonic() + self._grace
        while running - finished:
            try:
                kind, rank = self._get(max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if kind == "done":
                finished.add(rank)
        # A rank whose task has not started (queued behind other tasks on its worker) is
        # only cancelled: restarting its worker would kill the tasks it waits for.
        stuck = sorted({self.workers[r] for r in running - finished} - idle)
        client.cancel(self.futures)
        if stuck:
            logger.warning(
                "job %s: ranks on %s did not stop within %.0f s (blocked in a collective); "
                "restarting those workers",
                self.job_id,
                stuck,
                self._grace,
            )
            try:
                client.restart_workers(stuck, raise_for_error=False)
            except Exception:
                logger.warning("job %s: could not restart %s", self.job_id, stuck, exc_info=True)
        if self._store_worker in stuck or self._store_worker not in alive:
            return  # the store went with its worker's process; a call would wait for it
        try:
            client.run(
                bootstrap.drop_store, self._run_id, workers=[self._store_worker], on_error="ignore"
            )
        except Exception:
            logger.debug("job %s: store cleanup failed", self.job_id, exc_info=True)

    # -- the channel ------------------------------------------------------------------
    def _handle(self, msg: Any, *, fill: bool = True) -> None:
        """Take one event of the job's topic (watcher thread)."""
        if not isinstance(msg, dict) or msg.get("job") != self._run_id:
            return
        rank = msg.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            return
        if "status" in msg:  # unnumbered: the rank's phase or activity (dask_ddp._status)
            self._set_status(rank, msg)
            return
        stream = self._streams[rank]
        for event in stream.add(msg):
            self._deliver(rank, event)
        if fill and stream.has_gap and not stream.complete:
            self._fill_gaps()

    def _set_status(self, rank: int, msg: dict[str, Any]) -> None:
        status = self._status[rank]
        with self._cond:
            if msg["status"] is not None:
                status.phase = msg["status"]
            status.detail = str(msg.get("detail") or "")
            status.time = float(msg.get("time") or time.time())
            self._status_changes += 1
            self._cond.notify_all()
        self._mark_views()

    def _fill_gaps(self) -> None:
        """Recover missed events from the scheduler's history of the topic; give up on
        what it no longer holds (it keeps the last 1000 events)."""
        try:
            history = self.client.get_events(self.topic)
        except Exception:
            logger.debug("job %s: could not read the event history", self.job_id, exc_info=True)
            history = ()
        for _, msg in history:
            self._handle(msg, fill=False)
        for rank, stream in enumerate(self._streams):
            while stream.blocked:
                missing, ready = stream.skip_gap()
                logger.warning(
                    "job %s: %d messages from rank %d were lost on the way (the scheduler "
                    "no longer holds them)",
                    self.job_id,
                    missing,
                    rank,
                )
                self._note(f"rank {rank}: {missing} messages lost on the way")
                for event in ready:
                    self._deliver(rank, event)

    def _deliver(self, rank: int, event: dict[str, Any]) -> None:
        if "blob" in event:
            ref = event["blob"]
            try:
                msgs = events.fetch_blob(self.client, ref)
            except Exception as exc:  # the worker or the client is gone: shown, not raised
                logger.exception(
                    "job %s: a %d-byte message from rank %d could not be fetched from %s",
                    self.job_id,
                    ref["nbytes"],
                    rank,
                    ref["worker"],
                )
                self._note(f"rank {rank}: a {ref['nbytes']}-byte message was lost ({exc})")
                return
        else:
            msgs = events.decode(event)
        records = []
        printed: list[OutputLine] = []
        with self._cond:
            for kind, body in msgs:
                if kind == events.METRICS:
                    step, when, values = body
                    rec = MetricRecord(rank, step, when, values)
                    if self._curve_metric is None and values:
                        self._curve_metric = _pick_curve_metric(values)
                    self._progress[rank].add(rec, self._curve_metric)
                    records.append(rec)
                elif kind == events.CHECKPOINT:
                    url, step, nbytes, when = body
                    self._checkpoints.append(
                        checkpoint.CheckpointInfo(url, step, nbytes, rank, when)
                    )
                elif kind == events.RESULT:
                    key, path, data = body
                    self._results.setdefault(key, collections.deque()).append((rank, path, data))
                elif kind == events.OUTPUT:
                    stream, text = body
                    printed += [OutputLine(rank, stream, line) for line in text.split("\n")]
                elif kind == events.STATUS:
                    phase, detail, when = body
                    self._set_status(rank, {"status": phase, "detail": detail, "time": when})
            self._metrics.extend(records)
            self._output.extend(printed)
            self._cond.notify_all()
        if self._on_report is not None and records:
            self._call_back("on_report", records, "job.metrics")
        if self._on_output is not None and printed:
            self._call_back("on_output", printed, "job.output")
        self._mark_views()

    def _call_back(self, name: str, items: list[Any], kept_in: str) -> None:
        """Call the user's ``on_report``/``on_output`` with each item; stop at its first error."""
        callback = getattr(self, f"_{name}")
        for item in items:
            try:
                callback(item)
            except Exception as exc:
                logger.exception(
                    "job %s: %s raised on an item from rank %d; it is not called again "
                    "for this job (everything stays in %s)",
                    self.job_id,
                    name,
                    item.rank,
                    kept_in,
                )
                setattr(self, f"_{name}", None)
                self._note(f"{name} raised {type(exc).__name__}: {exc}; no longer called")
                return

    def _drain(self, ranks: Iterable[int], timeout: float, *, warn: bool) -> None:
        """Wait until ``ranks`` have sent their final marker and everything before it."""
        ranks = sorted(ranks)
        deadline = time.monotonic() + timeout
        filled = False
        while not all(self._streams[r].complete for r in ranks):
            try:
                self._get(max(0.0, deadline - time.monotonic()))  # control messages: ignored
            except queue.Empty:
                if filled:
                    break
                self._fill_gaps()
                filled = True
        for r in ranks:
            stream = self._streams[r]
            if stream.complete or not warn:
                continue
            if stream.end is None:
                what = "its final marker never arrived, so its last records may be missing"
            else:
                what = f"{stream.end - stream.next} of its {stream.end} messages never arrived"
            logger.warning(
                "job %s: rank %d: %s after waiting %.0f s (ddp.event-drain-timeout)",
                self.job_id,
                r,
                what,
                timeout,
            )
            self._note(f"rank {r}: {what}")

    def _end_streams(self) -> None:
        for unsubscribe in self._unsubscribe:
            try:
                unsubscribe()
            except Exception:
                logger.debug("job %s: unsubscribe failed", self.job_id, exc_info=True)
        with self._cond:
            self._streams_closed = True
            self._cond.notify_all()
        leftovers = [r for r, stream in enumerate(self._streams) if not stream.complete]
        if leftovers:  # some large messages of these ranks were not fetched
            try:
                alive = set(self.client.scheduler_info(n_workers=-1)["workers"])
            except Exception:
                alive = set()
            # A worker that left or was restarted took them along; a call to its old
            # address would wait for the connect timeout.
            leftovers = [r for r in leftovers if self.workers[r] in alive]
        for rank in leftovers:
            try:
                events.drop_blobs(self.client, self.workers[rank], self._run_id)
            except Exception:
                logger.debug("job %s: could not release rank %d's leftovers", self.job_id, rank)
        self._refresh_views()

    def _take_results(self, key: str) -> Iterator[tuple[int, str, Any]]:
        """Pop results sent with ``key`` as they arrive, until the job's channel closes."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._results.get(key) or self._streams_closed)
                pending = self._results.get(key)
                if not pending:
                    return
                item = pending.popleft()
            yield item

    # -- display ----------------------------------------------------------------------
    def _note(self, text: str) -> None:
        with self._cond:
            self._notes.append(text)
        self._mark_views()

    def _show_rank_error(self, rank: int, text: str) -> None:
        with self._cond:
            self._rank_errors.setdefault(rank, text)
        self._refresh_views()

    def _wait_stopped(self, timeout: float | None = None) -> bool:
        """Wait until the job's ranks are stopped and its resources released (after
        ``result()`` raised for a failure, that can take ``ddp.failure-grace`` and a worker
        restart longer); False if ``timeout`` passed first."""
        self._watcher.join(timeout)
        return not self._watcher.is_alive()

    def _mark_views(self) -> None:
        if self._views and self._view_due is None:
            self._view_due = max(time.monotonic(), self._last_view + _VIEW_PERIOD)

    def _refresh_views(self) -> None:
        self._view_due = None
        self._last_view = time.monotonic()
        if not self._views:
            return
        snap = self._snapshot()
        for shown in list(self._views):
            try:
                shown.update(snap)
            except Exception:  # a closed notebook must not stop the watcher
                logger.debug("job %s: live view update failed", self.job_id, exc_info=True)

    def _snapshot(self) -> dict[str, Any]:
        with self._cond:
            ranks = []
            for r, (worker, prog) in enumerate(zip(self.workers, self._progress, strict=True)):
                fut = self.futures[r] if r < len(self.futures) else None
                status = self._status[r]
                if fut is None or fut.status != "pending":
                    phase = fut.status if fut is not None else "pending"
                else:
                    phase = status.phase or "submitted"
                fresh = self._fresh(status, prog)
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
                        "error": self._rank_errors.get(r),
                        "curve": list(prog.curve),
                    }
                )
            end = self._finished if self._finished is not None else time.monotonic()
            return {
                "job": self.job_id,
                "state": self._state.value,
                "backend": self.backend,
                "elapsed": end - self._started,
                "records": len(self._metrics),
                "ranks": ranks,
                "metric": self._curve_metric,
                "error": str(self._error) if self._error is not None else None,
                "notes": list(self._notes),
                "output": [
                    f"[rank {o.rank}] {o.text}"
                    for o in itertools.islice(reversed(self._output), _VIEW_LINES)
                ][::-1],
            }

    @staticmethod
    def _fresh(status: _RankStatus, prog: _RankProgress) -> bool:
        """Whether what the rank last said it was busy with is still news: said before it
        reported anything, or at most a couple of seconds before its latest report (a
        probe such as a cache filling keeps it fresh while training reports flow)."""
        return bool(status.detail) and status.time >= (prog.last_time or 0.0) - 2.0

    def _progress_line(self) -> str:
        parts = []
        for r, prog in enumerate(self._progress):
            status = self._status[r]
            activity = f" ({status.detail})" if self._fresh(status, prog) else ""
            if prog.count == 0:
                parts.append(f"r{r} {status.phase or 'submitted'}{activity}")
                continue
            step = f" step {prog.step}" if prog.step is not None else f" {prog.count} rec"
            shown = ", ".join(f"{k} {view.fmt(v)}" for k, v in list(prog.last.items())[:2])
            parts.append(f"r{r}{step}" + (f" {shown}" if shown else "") + activity)
        return " | ".join(parts)

    def __repr__(self) -> str:
        return (
            f"<dask_ddp.Job {self.job_id}: {self.state.value}, {self.world_size} ranks, "
            f"{self.backend}, {len(self._metrics)} records>"
        )

    def _repr_html_(self) -> str:
        return view.render_html(self._snapshot())

    def _ipython_display_(self) -> None:
        """The live view: ipywidgets progress bars per rank, a loss curve and errors,
        refreshed by the watcher thread while the job runs (a self-updating HTML display
        when ipywidgets is not installed)."""
        from IPython.display import display

        shown: view.WidgetView | view.HandleView
        try:
            shown = view.WidgetView(self.world_size)
        except ImportError:
            shown = view.HandleView()
        shown.show(display, self._snapshot())
        self._views.append(shown)
        if self._streams_closed:
            shown.update(self._snapshot())


_LIBRARY_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (sys.modules["dask_ddp"], distributed)
)
_CARETS = re.compile(r"^\s*[\^~]+\s*$")


def _user_traceback(exc: BaseException, tb: Any) -> str:
    """The rank's traceback as its author wants it: their own frames, no dask_ddp or
    distributed frames around them, and no ``^^^`` markers (the column positions do not
    survive the trip from the worker, so they would point at the wrong place)."""
    te = traceback.TracebackException(type(exc), exc, tb, compact=True)
    seen: set[int] = set()
    part: traceback.TracebackException | None = te
    while part is not None and id(part) not in seen:
        seen.add(id(part))
        kept = [f for f in part.stack if not f.filename.startswith(_LIBRARY_DIRS)]
        part.stack = traceback.StackSummary.from_list(kept or list(part.stack))
        part = part.__cause__ or part.__context__
    lines = "".join(te.format()).splitlines(keepends=True)
    return "".join(line for line in lines if not _CARETS.match(line))


def _retryable(error: BaseException | None) -> bool:
    """Worker loss, and RetryableError raised by a rank, earn a restart."""
    if isinstance(error, WorkerLostError):
        return True
    if isinstance(error, PeerFailedError):
        return error.failed_rank < 0  # a peer's process died without an error of its own
    return isinstance(error, RankFailedError) and isinstance(error.__cause__, RetryableError)


def _pick_curve_metric(values: dict[str, float]) -> str:
    if "loss" in values:
        return "loss"
    return next((k for k in values if "loss" in k.lower()), next(iter(values)))

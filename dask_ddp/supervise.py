"""A job's life on the client: submit its ranks, watch them, stop, restart, clean up.

:class:`Supervisor` owns what happens to a job after :func:`dask_ddp.launch` placed it.
It submits the ranks, watches their futures and the scheduler's worker events, and the
first rank to fail decides the job's error: the other ranks are stopped at once (an
exception raised in their thread, then, for ranks stuck inside a C++ collective, a restart
of their worker after ``ddp.failure-grace``), so no rank waits out the collective timeout.
A retryable failure (a lost worker, :class:`~dask_ddp.RetryableError`) places the job
again through the launcher (:mod:`dask_ddp.dispatch`) while restarts are left. At the end
it drops the rendezvous store, releases the job's datasets and the scheduler's copy of
its events.

Event handlers (on the client's event loop) only queue; the supervisor's thread does the
work and feeds the :class:`~dask_ddp._model.JobModel` that the :class:`~dask_ddp.Job`
handle and the views read.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import distributed
from distributed import Client, KilledWorker

from . import bootstrap, events
from ._model import JobModel, JobState
from ._reader import EventReader
from .errors import (
    JobCancelledError,
    RankFailedError,
    RankStoppedError,
    RetryableError,
    WorkerLostError,
)
from .job import Job, _register

if TYPE_CHECKING:
    from .dispatch import _Attempt, _Launcher

logger = logging.getLogger(__name__)


class Supervisor:
    """Runs one job, attempt after attempt, on a thread of its own.

    Parameters
    ----------
    client : distributed.Client
        The job's client.
    job_id : str
        The job's identifier.
    launcher : dask_ddp.dispatch._Launcher
        Places the job again for a restart (``launcher.relaunch(attempt)``).
    first : dask_ddp.dispatch._Attempt
        The first placement, not yet submitted.
    failure_grace, drain_timeout : float
        Seconds a stopped rank has before its worker is restarted; seconds to wait for
        the ranks' last events once their tasks ended.
    max_restarts : int
        Retryable failures the job may restart after.
    on_report, on_output : callable, optional
        The user's callbacks (see :func:`dask_ddp.launch`).
    datasets : optional
        The job's persisted Dask collections, released when the job is over.
    """

    def __init__(
        self,
        client: Client,
        job_id: str,
        launcher: _Launcher,
        first: _Attempt,
        *,
        failure_grace: float,
        drain_timeout: float = 10.0,
        max_restarts: int = 0,
        on_report: Callable[[Any], Any] | None = None,
        on_output: Callable[[Any], Any] | None = None,
        datasets: Any = None,
    ) -> None:
        self.client, self.launcher, self.attempt = client, launcher, first
        self.grace, self.drain_timeout = failure_grace, drain_timeout
        self.restarts_left, self.datasets = max_restarts, datasets
        self.model = JobModel(job_id, first.workers, first.backend)
        self.reader = EventReader(client, self.model, on_report=on_report, on_output=on_output)
        self.job = Job(client, job_id, self.model, self)
        self.ended: set[int] = set()  # ranks whose task ended (not lost)
        self.silent: set[int] = set()  # ended ranks whose process died: no final marker
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._cancel_reason = "cancelled by the user"
        self._thread = threading.Thread(
            target=self._run, name=f"dask-ddp-job-{job_id}", daemon=True
        )

    @property
    def job_id(self) -> str:
        return self.model.job_id

    def start(self) -> Job:
        """Subscribe to the first attempt's channel, submit its ranks, start watching."""
        try:
            self._begin(self.attempt)
            self._submit()
        except BaseException:
            self.reader.unsubscribe()
            raise
        self._thread.start()
        return self.job

    def cancel(self, reason: str) -> None:
        """Ask for the job to stop; returns once its outcome is known."""
        self._cancel_reason = reason
        self._inbox.put(("cancel", -1))
        self.model.done.wait()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the ranks are stopped and everything released; False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- attempts ---------------------------------------------------------------------
    def _begin(self, attempt: _Attempt) -> None:
        """Take a placement; subscribe to its channel before any of its ranks is submitted
        (the subscription reaches the scheduler first, so no event is missed)."""
        self.attempt = attempt
        self.ended, self.silent = set(), set()
        self.model.new_attempt(
            attempt.attempt, events.job_topic(attempt.run_id), attempt.workers, attempt.backend
        )
        self.reader.subscribe(attempt.run_id, attempt.workers, self._put)

    def _submit(self) -> None:
        futures = self.attempt.submit()
        with self.model.cond:
            self.model.futures = list(futures)
        _register(self.job, futures)
        for rank, fut in enumerate(futures):
            fut.add_done_callback(
                lambda f, r=rank: self._put("done", r) if f in self.model.futures else None
            )

    def _put(self, kind: str, payload: Any) -> None:
        # Runs on the client's event loop: only queue.
        self._inbox.put((kind, payload))

    def _get(self, timeout: float | None = None) -> tuple[str, int]:
        """The next control message (done, lost, cancel); channel events queued before it
        are handled on the way. Raises ``queue.Empty`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        model = self.model
        while True:
            now = time.monotonic()
            wait = None if deadline is None else max(0.0, deadline - now)
            if model.view_due is not None:
                wait = max(0.0, min(model.view_due - now, wait if wait is not None else 1e9))
            try:
                kind, payload = self._inbox.get(timeout=wait)
            except queue.Empty:
                if model.view_due is not None and time.monotonic() >= model.view_due:
                    model.refresh_views()
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue
            if kind == "event":
                self.reader.handle(payload)
                continue
            if kind == "done":
                model.notify()
            return kind, payload

    def _run(self) -> None:
        model = self.model
        try:
            self._watch_until_done()
        except Exception:  # the supervisor must never die silently: fail the job with it
            logger.exception("job %s: supervisor failed", self.job_id)
            if model.error is None:
                model.error = RuntimeError(f"dask_ddp job {self.job_id}: supervisor failed")
                model.state = JobState.FAILED
        finally:
            model.finished = time.monotonic()
            try:
                if model.state is not JobState.SUCCEEDED:
                    # The outcome is known: result() raises now, while the records the
                    # stopped ranks sent on their way out are still collected.
                    model.done.set()
                    self._drain(self.ended - self.silent, min(self.drain_timeout, 1.0))
            finally:
                self.reader.unsubscribe()
                model.close()
                self.reader.drop_leftovers()
                model.done.set()
        events.forget_topic(self.client, self.reader.topic)
        if self.datasets is not None:
            try:
                self.datasets.release()
            except Exception:
                logger.warning("job %s: could not release its datasets", self.job_id, exc_info=True)

    def _watch_until_done(self) -> None:
        while True:
            self._watch_attempt()
            if self.model.state is not JobState.FAILED or not self._will_restart():
                return
            self._restart()
            if self.model.state is JobState.FAILED:
                return

    def _will_restart(self) -> bool:
        return self.restarts_left > 0 and _retryable(self.model.error)

    def _restart(self) -> None:
        """Place the job again after a retryable failure and submit its ranks."""
        model = self.model
        cause = model.error
        self.restarts_left -= 1
        attempt = self.attempt.attempt + 1
        logger.warning(
            "job %s: %s; restarting from the last checkpoint (attempt %d, %d restarts left)",
            self.job_id, cause, attempt + 1, self.restarts_left,
        )  # fmt: skip
        model.note(f"attempt {attempt + 1} after: {cause}")
        self._drain(self.ended - self.silent, min(self.drain_timeout, 1.0))
        self.reader.unsubscribe()
        events.forget_topic(self.client, self.reader.topic)
        with model.cond:
            model.state, model.error = JobState.RESTARTING, None
            model.rank_errors.clear()
        try:
            self._begin(self.launcher.relaunch(attempt))
            self._submit()
        except Exception as exc:
            logger.warning("job %s: could not restart: %s", self.job_id, exc)
            exc.__cause__ = exc.__cause__ or cause
            model.error, model.state = exc, JobState.FAILED
            return
        model.state = JobState.RUNNING
        model.refresh_views()

    # -- one attempt ------------------------------------------------------------------
    def _watch_attempt(self) -> None:
        finished, model, world = self.ended, self.model, len(self.attempt.workers)
        while len(finished) < world:
            kind, rank = self._get()
            if kind == "cancel":
                self._stop(self._cancel_reason, set(range(world)) - finished, finished)
                model.error, model.state = JobCancelledError(self.job_id), JobState.CANCELLED
                return
            if kind == "lost" and rank not in finished:
                key = model.futures[rank].key
                self._fail(WorkerLostError(rank, self.attempt.workers[rank], key), finished)
                return
            if kind != "done" or rank in finished:
                continue
            finished.add(rank)
            if model.futures[rank].status == "error":
                self._fail(self._rank_error(rank), finished)
                return
            if model.futures[rank].status == "cancelled":
                self._stop("a rank's task was cancelled", set(range(world)) - finished, finished)
                model.error, model.state = JobCancelledError(self.job_id), JobState.CANCELLED
                return
        # Every rank sent its final marker before its task finished: wait for the markers
        # (normally already here), so that metrics are complete when result() returns.
        self._drain(range(world), self.drain_timeout, warn=True)
        model.state = JobState.SUCCEEDED
        logger.info("job %s: %d ranks finished", self.job_id, world)

    def _rank_error(self, rank: int) -> BaseException:
        fut = self.model.futures[rank]
        exc = fut.exception()
        if isinstance(exc, KilledWorker):
            self.silent.add(rank)
        self.model.show_rank_error(rank, f"{type(exc).__name__}: {exc}")
        return _job_error(rank, self.attempt.workers[rank], fut, exc)

    def _fail(self, error: BaseException, finished: set[int]) -> None:
        """Find the first-failing rank's error, stop the rest, and record the outcome."""
        model, world = self.model, len(self.attempt.workers)
        deadline = time.monotonic() + self.grace
        while isinstance(error, RankStoppedError) and len(finished) < world:
            try:
                kind, rank = self._get(max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if kind == "lost" and rank not in finished:
                key = model.futures[rank].key
                error = WorkerLostError(rank, self.attempt.workers[rank], key)
                model.show_rank_error(rank, str(error))
            elif kind == "done" and rank not in finished:
                finished.add(rank)
                if model.futures[rank].status == "error":
                    candidate = self._rank_error(rank)
                    if not isinstance(candidate, RankStoppedError):
                        error = candidate
        model.error, model.state = error, JobState.FAILED
        model.refresh_views()
        # One line: the whole error, traceback included, is what result() raises.
        logger.warning("job %s failed: %s", self.job_id, str(error).split("\n", 1)[0])
        if not self._will_restart():
            # The outcome is known: result() raises now, while the peers are stopped.
            model.done.set()
        failed_rank, reason = _failure_of(error)
        self._stop(reason, set(range(world)) - finished, finished, failed_rank)

    def _stop(
        self, reason: str, running: set[int], finished: set[int], failed: int | None = None
    ) -> None:
        """Stop the ranks in ``running``: abort in place, then restart stuck workers.

        Ranks whose worker has left the cluster are only cancelled: there is nothing to
        stop, and a call to a gone worker would wait for its connect timeout.
        """
        client, workers, run_id = self.client, self.attempt.workers, self.attempt.run_id
        alive = set(client.scheduler_info(n_workers=-1)["workers"])
        gone = {r for r in running if workers[r] not in alive}
        finished |= gone
        self.silent |= gone  # no final marker will come from them
        targets = sorted({workers[r] for r in running - gone})
        idle = _abort_ranks(client, run_id, reason, failed, targets)
        deadline = time.monotonic() + self.grace
        while running - finished:
            try:
                kind, rank = self._get(max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if kind == "done":
                finished.add(rank)
        # A rank whose task has not started (queued behind other tasks on its worker) is
        # only cancelled: restarting its worker would kill the tasks it waits for.
        stuck = sorted({workers[r] for r in running - finished} - idle)
        client.cancel(self.model.futures)
        if stuck:
            _restart_stuck(client, run_id, stuck, self.grace)
        store = self.attempt.store_worker
        if store not in stuck and store in alive:  # else the store went with its process
            _drop_store(client, run_id, store)

    def _drain(self, ranks: Iterable[int], timeout: float, *, warn: bool = False) -> None:
        """Wait until ``ranks`` have sent their final marker and everything before it."""
        self.reader.drain(ranks, timeout, self._get, warn=warn)


def _failure_of(error: BaseException) -> tuple[int | None, str]:
    """The rank that failed first and its error, for the RankStoppedError of the others:
    so that gathering their futures (dispatch.run's users) shows the real cause."""
    if isinstance(error, RankStoppedError):
        return error.failed_rank, error.reason
    if isinstance(error, RankFailedError):
        return error.rank, error.cause
    first_line = str(error).split("\n", 1)[0]
    return getattr(error, "rank", None), f"{type(error).__name__}: {first_line}"


def _abort_ranks(
    client: Client, run_id: str, reason: str, failed_rank: int | None, targets: list[str]
) -> set[str]:
    """Ask the ranks of ``run_id`` on ``targets`` to stop; return the workers where none
    of its ranks runs (queued, or done)."""
    if not targets:
        return set()
    try:
        aborted = client.run(
            bootstrap.abort_rank, run_id, reason, failed_rank, workers=targets, on_error="ignore"
        )
    except Exception:
        logger.debug("job %s: abort request failed", run_id, exc_info=True)
        return set()
    return {w for w, stopped in aborted.items() if stopped is False}


def _restart_stuck(client: Client, run_id: str, stuck: list[str], grace: float) -> None:
    logger.warning(
        "job %s: ranks on %s did not stop within %.0f s (blocked in a collective); "
        "restarting those workers",
        run_id, stuck, grace,
    )  # fmt: skip
    try:
        client.restart_workers(stuck, raise_for_error=False)
    except Exception:
        logger.warning("job %s: could not restart %s", run_id, stuck, exc_info=True)


def _drop_store(client: Client, run_id: str, store: str) -> None:
    """Close the rendezvous store of ``run_id`` on its worker ``store``."""
    try:
        client.run(bootstrap.drop_store, run_id, workers=[store], on_error="ignore")
    except Exception:
        logger.debug("job %s: store cleanup failed", run_id, exc_info=True)


_LIBRARY_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (sys.modules["dask_ddp"], distributed)
)
_CARETS = re.compile(r"^\s*[\^~]+\s*$")


def _job_error(rank: int, worker: str, fut: Any, exc: BaseException) -> BaseException:
    """The job's error for rank ``rank`` whose future ``fut`` raised ``exc``."""
    if isinstance(exc, RankStoppedError):
        return exc
    text = _user_traceback(exc, fut.traceback())
    error = RankFailedError(rank, worker, fut.key, f"{type(exc).__name__}: {exc}", text)
    error.__cause__ = exc
    return error


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
    if isinstance(error, RankStoppedError) and error.failed_rank is not None:
        return error.failed_rank < 0  # a peer's process died without an error of its own
    return isinstance(error, RankFailedError) and isinstance(error.__cause__, RetryableError)

"""A job's life on the client: wait for workers, submit its ranks, restart, resize, clean up.

:class:`Supervisor` owns what happens to a job after :func:`dask_ddp.launch` checked it.
It places the job through the launcher (:mod:`dask_ddp._launcher`), waiting for free
workers when other jobs hold them, submits the ranks and has each attempt watched
(:mod:`dask_ddp._watch`: the first rank to fail decides, the others are stopped at once). A
retryable failure (a lost worker, :class:`~dask_ddp.RetryableError`) places the job again
while restarts are left, on fewer workers for an elastic job; ranks that stopped together
at a checkpoint to grow are placed again on more workers, without using a restart. Workers
that join or are given back wake it to grow. At the end it gives the workers back, drops
the rendezvous store, releases the job's datasets and the scheduler's copy of its events.

Event handlers (on the client's event loop) only queue; the supervisor's thread does the
work and feeds the :class:`~dask_ddp._model.JobModel` that the :class:`~dask_ddp.Job`
handle and the views read.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from distributed import Client

from . import _dashboard, events
from ._model import JobModel, JobState
from ._reader import EventReader
from ._watch import AttemptWatch
from .errors import (
    JobCancelledError,
    RankFailedError,
    RankStoppedError,
    ResizeStopError,
    RetryableError,
    WorkerLostError,
)
from .job import Job, _register

if TYPE_CHECKING:
    from ._launcher import Attempt, Launcher

logger = logging.getLogger(__name__)


class Supervisor:
    """Runs one job, attempt after attempt, on a thread of its own.

    Parameters
    ----------
    client : distributed.Client
        The job's client.
    job_id : str
        The job's identifier.
    launcher : dask_ddp._launcher.Launcher
        Places the job: its first attempt when it had to wait, and every restart or
        resize (``launcher.place(attempt)``); holds its workers (``launcher.claims``).
    first : dask_ddp._launcher.Attempt or None
        The first placement, not yet submitted; None while the job waits for workers (the
        supervisor's thread places it when they are free).
    failure_grace, drain_timeout : float
        Seconds a stopped rank has before its worker is restarted; seconds to wait for
        the ranks' last events once their tasks ended.
    max_restarts : int
        Retryable failures the job may restart after.
    on_report, on_output : callable, optional
        The user's callbacks (see :func:`dask_ddp.launch`).
    datasets : optional
        The job's persisted Dask collections, released when the job is over.
    total_steps : int, optional
        The steps the job trains, for the live view's bars (``launch(total_steps=)``).
    """

    def __init__(
        self,
        client: Client,
        job_id: str,
        launcher: Launcher,
        first: Attempt | None,
        *,
        failure_grace: float,
        drain_timeout: float = 10.0,
        max_restarts: int = 0,
        on_report: Callable[[Any], Any] | None = None,
        on_output: Callable[[Any], Any] | None = None,
        datasets: Any = None,
        total_steps: int | None = None,
    ) -> None:
        self.client, self.launcher, self.attempt = client, launcher, first
        self.grace, self.drain_timeout = failure_grace, drain_timeout
        self.restarts_left, self.datasets = max_restarts, datasets
        self.model = (
            JobModel(job_id, first.workers, first.backend) if first else JobModel(job_id, [], "")
        )
        self.model.total_steps = total_steps
        self.reader = EventReader(client, self.model, on_report=on_report, on_output=on_output)
        self.job = Job(client, job_id, self.model, self)
        _dashboard.attach(client, self.model, launcher.name)
        self.watch: AttemptWatch | None = None  # the current attempt's, once placed
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._cancel_reason = "cancelled by the user"
        self._cancelled = False
        self._thread = threading.Thread(
            target=self._run, name=f"dask-ddp-job-{job_id}", daemon=True
        )

    @property
    def job_id(self) -> str:
        return self.model.job_id

    def start(self) -> Job:
        """Subscribe to the first attempt's channel, submit its ranks, start watching."""
        if self.attempt is not None:
            try:
                self._begin(self.attempt, "started")
                self._submit()
            except BaseException:
                self.reader.unsubscribe()
                raise
        else:
            self.model.waiting("waiting for free workers")
        # Workers that join or are given back may let the job start, or grow it.
        self.launcher.claims.on_change = lambda: self._put("workers", -1)
        self._thread.start()
        return self.job

    def cancel(self, reason: str) -> None:
        """Ask for the job to stop; returns once its outcome is known."""
        self._cancel_reason, self._cancelled = reason, True
        self.launcher.claims.wake()  # in case the job still waits for workers
        self._inbox.put(("cancel", -1))
        self.model.done.wait()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the ranks are stopped and everything released; False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- attempts ---------------------------------------------------------------------
    def _begin(self, attempt: Attempt, why: str) -> None:
        """Take a placement; subscribe to its channel before any of its ranks is submitted
        (the subscription reaches the scheduler first, so no event is missed)."""
        self.attempt = attempt
        self.watch = AttemptWatch(
            self.client,
            self.model,
            attempt,
            get=self._get,
            drain=lambda ranks, warn=False: self._drain(ranks, self.drain_timeout, warn=warn),
            will_restart=lambda error: self._will_restart(),
            on_outcome=self._outcome_known,
            grace=self.grace,
        )
        self.model.new_attempt(
            attempt.attempt,
            events.job_topic(attempt.run_id),
            attempt.workers,
            attempt.backend,
            why,
        )
        self.reader.subscribe(
            attempt.run_id,
            attempt.workers,
            lambda kind, payload: self._put(
                kind, payload, None if kind == "event" else attempt.run_id
            ),
        )

    def _submit(self) -> None:
        futures = self.attempt.submit()
        with self.model.cond:
            self.model.futures = list(futures)
            self.model.cond.notify_all()  # Job.wait_placed
        _register(self.job, futures)
        run_id = self.attempt.run_id
        for rank, fut in enumerate(futures):
            fut.add_done_callback(lambda f, r=rank: self._put("done", r, run_id))

    def _put(self, kind: str, payload: Any, run_id: str | None = None) -> None:
        # Runs on the client's event loop: only queue. A rank's done or lost carries its
        # attempt: one that arrives after the job moved on to the next is dropped.
        self._inbox.put((kind, payload if run_id is None else (run_id, payload)))

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
            if kind == "workers":  # workers joined or were given back: grow onto them?
                if self.attempt is not None and model.state is JobState.RUNNING:
                    self._try_grow()
                continue
            if kind in ("done", "lost"):
                run_id, payload = payload
                if self.attempt is None or run_id != self.attempt.run_id:
                    continue  # from an attempt before this one
            if kind == "done":
                model.notify()
            return kind, payload

    def _run(self) -> None:
        model = self.model
        try:
            if self.attempt is None:
                self._place_first()
            if self.attempt is not None:
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
                    self._outcome_known()
                    self._drain_stopped()
            finally:
                self.reader.unsubscribe()
                self.launcher.claims.close()
                model.close()
                self.reader.drop_leftovers()
                self._outcome_known()
        if self.reader.topic:
            events.forget_topic(self.client, self.reader.topic)
        if self.datasets is not None:
            try:
                self.datasets.release()
            except Exception:
                logger.warning("job %s: could not release its datasets", self.job_id, exc_info=True)

    def _outcome_known(self) -> None:
        """The job will not run again: its workers go back (a rank still stopping there
        holds up the next job's rank for ``ddp.failure-grace`` at most, and nothing waits
        on this job), then :meth:`Job.result` returns, so that a job launched after it
        starts at once."""
        self.launcher.claims.release()
        self.model.done.set()

    def _watch_until_done(self) -> None:
        while True:
            self.watch.run(lambda: self._cancel_reason)
            if self.model.state is not JobState.FAILED or not self._will_restart():
                return
            self._restart()
            if self.model.state is not JobState.RUNNING:
                return

    def _will_restart(self) -> bool:
        if isinstance(self.model.error, ResizeStopError):
            return True  # a grow, not a failure
        return self.restarts_left > 0 and _retryable(self.model.error)

    def _restart(self) -> None:
        """Place the job again, after a retryable failure or to grow, and submit its ranks."""
        model = self.model
        cause = model.error
        grow = isinstance(cause, ResizeStopError)
        attempt = self.attempt.attempt + 1
        if grow:
            why = f"grow at the checkpoint of step {cause.step}"
        else:
            self.restarts_left -= 1
            why = str(cause).split("\n", 1)[0]
            logger.warning(
                "job %s: %s; restarting from the last checkpoint (attempt %d, %d restarts left)",
                self.job_id, cause, attempt + 1, self.restarts_left,
            )  # fmt: skip
            model.note(f"attempt {attempt + 1} after: {why}")
        self._drain_stopped()
        self.reader.unsubscribe()
        events.forget_topic(self.client, self.reader.topic)
        with model.cond:
            model.state, model.error = JobState.RESTARTING, None
            model.rank_errors.clear()
        try:
            if self._place(attempt, why):
                self._submit()
        except Exception as exc:
            logger.warning("job %s: could not restart: %s", self.job_id, exc)
            if not grow:
                exc.__cause__ = exc.__cause__ or cause
            model.error, model.state = exc, JobState.FAILED
            return
        model.refresh_views()

    def _try_grow(self) -> None:
        try:
            self.launcher.try_grow(self.attempt)
        except Exception:  # growing is an optimisation: the job goes on at its size
            logger.warning("job %s: could not claim more workers", self.job_id, exc_info=True)

    def _place_first(self) -> None:
        """Place a job that waited for workers; its placement errors are its outcome."""
        try:
            if self._place(0, "started"):
                self._submit()
        except Exception as exc:
            logger.warning("job %s could not start: %s", self.job_id, exc)
            self.attempt = None
            self.model.error, self.model.state = exc, JobState.FAILED

    def _place(self, attempt: int, why: str) -> bool:
        """Claim workers and begin ``attempt`` on them, waiting for enough to be free;
        False (and the job cancelled) if it was cancelled while it waited."""
        placed = self.launcher.place(
            attempt, on_wait=self.model.waiting, cancelled=lambda: self._cancelled
        )
        if placed is None:
            self.model.error = JobCancelledError(self.job_id)
            self.model.state = JobState.CANCELLED
            return False
        self._begin(placed, why)
        self.model.state = JobState.RUNNING
        return True

    def _drain_stopped(self) -> None:
        """The records the stopped ranks sent on their way out (a second at most)."""
        if self.watch is not None:
            self._drain(self.watch.ended - self.watch.silent, min(self.drain_timeout, 1.0))

    def _drain(self, ranks: Iterable[int], timeout: float, *, warn: bool = False) -> None:
        """Wait until ``ranks`` have sent their final marker and everything before it."""
        self.reader.drain(ranks, timeout, self._get, warn=warn)


def _retryable(error: BaseException | None) -> bool:
    """Worker loss, and RetryableError raised by a rank, earn a restart."""
    if isinstance(error, WorkerLostError):
        return True
    if isinstance(error, RankStoppedError) and error.failed_rank is not None:
        return error.failed_rank < 0  # a peer's process died without an error of its own
    return isinstance(error, RankFailedError) and isinstance(error.__cause__, RetryableError)

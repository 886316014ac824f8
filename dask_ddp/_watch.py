"""One attempt of a job, watched from its submission to the end of its last rank.

:class:`AttemptWatch` reads the supervisor's control messages (a rank's task done, its
worker lost, the user's cancel). The first rank to fail decides the attempt's error: the
other ranks are stopped at once (an exception raised in their thread, then, for ranks stuck
inside a C++ collective, a restart of their worker after ``ddp.failure-grace``), so no rank
waits out the collective timeout. Ranks that stop together at a checkpoint to grow the job
(:class:`~dask_ddp.errors.ResizeStopError`) end the attempt without a failure.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distributed import Client, KilledWorker

from . import _traceback, bootstrap
from ._model import JobModel, JobState
from .errors import (
    JobCancelledError,
    RankFailedError,
    RankStoppedError,
    ResizeStopError,
    WorkerLostError,
)

if TYPE_CHECKING:
    from ._launcher import Attempt

logger = logging.getLogger(__name__)


class AttemptWatch:
    """Watches one attempt's ranks and stops them when one fails.

    Parameters
    ----------
    client : distributed.Client
        The job's client.
    model : JobModel
        Where the outcome goes.
    attempt : dask_ddp._launcher.Attempt
        The placement being watched (its ranks submitted).
    get : callable
        ``get(timeout)``: the supervisor's next control message ``(kind, rank)``, raising
        ``queue.Empty`` after ``timeout`` seconds.
    drain : callable
        ``drain(ranks, warn=)``: wait for those ranks' last events.
    will_restart : callable
        ``will_restart(error)``: whether the job is placed again after ``error``.
    on_outcome : callable
        Called once the job's outcome is final (its error, no restart), before the other
        ranks are stopped: :meth:`Job.result` raises from then on.
    grace : float
        Seconds a stopped rank has before its worker is restarted (``ddp.failure-grace``).
    """

    def __init__(
        self,
        client: Client,
        model: JobModel,
        attempt: Attempt,
        *,
        get: Callable[[float | None], tuple[str, int]],
        drain: Callable[..., None],
        will_restart: Callable[[BaseException], bool],
        on_outcome: Callable[[], None],
        grace: float,
    ) -> None:
        self.client, self.model, self.attempt = client, model, attempt
        self._get, self._drain, self._will_restart = get, drain, will_restart
        self._on_outcome = on_outcome
        self.grace = grace
        self.ended: set[int] = set()  # ranks whose task ended (not lost)
        self.silent: set[int] = set()  # ended ranks whose process died: no final marker

    def run(self, cancel_reason: Callable[[], str]) -> None:
        """Watch until every rank finished, one failed (the rest are stopped), or the job
        was cancelled; the outcome is in the model (its state and error)."""
        finished, model, world = self.ended, self.model, len(self.attempt.workers)
        while len(finished) < world:
            kind, rank = self._get()
            if kind == "cancel":
                self._cancel(cancel_reason(), finished)
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
                self._cancel("a rank's task was cancelled", finished)
                return
        # Every rank sent its final marker before its task finished: wait for the markers
        # (normally already here), so that metrics are complete when result() returns.
        self._drain(range(world), warn=True)
        model.state = JobState.SUCCEEDED
        logger.info("job %s: %d ranks finished", self.model.job_id, world)

    def _cancel(self, reason: str, finished: set[int]) -> None:
        """Stop the ranks still running; the job's outcome is cancelled."""
        model = self.model
        self._stop(reason, set(range(len(self.attempt.workers))) - finished, finished)
        model.error, model.state = JobCancelledError(model.job_id), JobState.CANCELLED

    def _rank_error(self, rank: int) -> BaseException:
        fut = self.model.futures[rank]
        exc = fut.exception()
        if isinstance(exc, KilledWorker):
            self.silent.add(rank)
        failed_first = getattr(exc, "failed_rank", None)
        if isinstance(exc, RankStoppedError) and failed_first is not None and failed_first >= 0:
            self.model.show_rank_error(rank, f"stopped: rank {failed_first} failed")
        elif not isinstance(exc, ResizeStopError):
            self.model.show_rank_error(rank, f"failed: {type(exc).__name__}: {exc}")
        return _job_error(rank, self.attempt.workers[rank], fut, exc, self.attempt.sources)

    def _fail(self, error: BaseException, finished: set[int]) -> None:
        """Find the first-failing rank's error, stop the rest, and record the outcome."""
        model, world = self.model, len(self.attempt.workers)
        model.moving_since = time.time()  # training stopped here, for AttemptInfo.started
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
                    # A rank's own error, or the ranks stopping at a checkpoint to grow.
                    if not isinstance(candidate, RankStoppedError) or (
                        isinstance(candidate, ResizeStopError)
                        and not isinstance(error, ResizeStopError)
                    ):
                        error = candidate
        model.error, model.state = error, JobState.FAILED
        model.refresh_views()
        if not isinstance(error, ResizeStopError):
            # One INFO line: result() raises the error itself, and the live view shows it;
            # a WARNING would print it a second time in a notebook (logging's last resort).
            logger.info("job %s failed: %s", self.model.job_id, str(error).split("\n", 1)[0])
        if not self._will_restart(error):
            # The outcome is known: result() raises now, while the peers are stopped.
            self._on_outcome()
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


def _job_error(
    rank: int, worker: str, fut: Any, exc: BaseException, sources: _traceback.Sources | None
) -> BaseException:
    """The job's error for rank ``rank`` whose future ``fut`` raised ``exc``."""
    if isinstance(exc, RankStoppedError):
        return exc
    own = _traceback.rebuild(exc, sources)  # the rank's own frames
    text = _traceback.user_traceback(own)
    error = RankFailedError(rank, worker, fut.key, f"{type(exc).__name__}: {exc}", text)
    error.__cause__ = own
    return error

"""The client's handle on a running job: its futures, its state, its outcome.

A :class:`Job` watches its rank futures from a background thread. The first rank to fail
decides the job's error; the other ranks are stopped at once (an exception raised in their
thread, then, for ranks stuck inside a C++ collective, a restart of their worker after
``ddp.failure-grace``), so no rank waits out the collective timeout.
"""

from __future__ import annotations

import enum
import html
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from distributed import Client, Future

from . import bootstrap, events
from .errors import (
    JobCancelledError,
    PeerFailedError,
    RankAbortedError,
    RankFailedError,
    WorkerLostError,
)

logger = logging.getLogger(__name__)

__all__ = ["Job", "JobState"]


class JobState(str, enum.Enum):
    """PENDING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


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

    Examples
    --------
    >>> job = dask_ddp.launch(client, train, args=(cfg,))  # doctest: +SKIP
    >>> job.result()                                        # doctest: +SKIP
    [0.31, 0.31]
    """

    def __init__(
        self,
        client: Client,
        job_id: str,
        futures: Sequence[Future],
        workers: Sequence[str],
        backend: str,
        store_worker: str,
        failure_grace: float,
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.futures = list(futures)
        self.workers = list(workers)
        self.backend = backend
        self._store_worker = store_worker
        self._grace = failure_grace
        self._state = JobState.RUNNING
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._inbox: queue.Queue[tuple[str, int]] = queue.Queue()
        self._unsubscribe: list[Callable[[], None]] = []
        self._started = time.monotonic()
        self._finished: float | None = None
        self._cancel_reason = "cancelled by the user"
        for rank, worker in enumerate(self.workers):
            self._unsubscribe.append(
                events.subscribe(client, worker, lambda ev, r=rank: self._on_worker_event(r, ev))
            )
        for rank, fut in enumerate(self.futures):
            fut.add_done_callback(lambda _f, r=rank: self._inbox.put(("done", r)))
        self._watcher = threading.Thread(
            target=self._watch, name=f"dask-ddp-job-{job_id}", daemon=True
        )
        self._watcher.start()

    # -- public API -------------------------------------------------------------------
    @property
    def state(self) -> JobState:
        """The job's state (a :class:`JobState`)."""
        return self._state

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.futures)

    def done(self) -> bool:
        """True once every rank has finished, or the job failed or was cancelled."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job is done; False if ``timeout`` seconds passed first."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> list[Any]:
        """Every rank's return value, in rank order.

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

    # -- watching ---------------------------------------------------------------------
    def _on_worker_event(self, rank: int, event: Any) -> None:
        # Runs on the client's event loop: only queue.
        _, msg = event
        if isinstance(msg, dict) and msg.get("action") == "remove-worker":
            self._inbox.put(("lost", rank))

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
            for unsubscribe in self._unsubscribe:
                try:
                    unsubscribe()
                except Exception:
                    logger.debug("job %s: unsubscribe failed", self.job_id, exc_info=True)
            self._done.set()

    def _watch_until_done(self) -> None:
        finished: set[int] = set()
        while len(finished) < self.world_size:
            kind, rank = self._inbox.get()
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
        self._state = JobState.SUCCEEDED
        logger.info("job %s: %d ranks finished", self.job_id, self.world_size)

    def _rank_error(self, rank: int) -> BaseException:
        fut = self.futures[rank]
        exc = fut.exception()
        if isinstance(exc, (PeerFailedError, RankAbortedError)):
            return exc
        text = "".join(traceback.format_exception(type(exc), exc, fut.traceback()))
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
                kind, rank = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if kind == "lost" and rank not in finished:
                error = WorkerLostError(rank, self.workers[rank], self.futures[rank].key)
            elif kind == "done" and rank not in finished:
                finished.add(rank)
                if self.futures[rank].status == "error":
                    candidate = self._rank_error(rank)
                    if not isinstance(candidate, (PeerFailedError, RankAbortedError)):
                        error = candidate
        self._error = error
        self._state = JobState.FAILED
        logger.warning("job %s failed: %s", self.job_id, error)
        self._stop(
            f"another rank failed ({type(error).__name__})",
            set(range(self.world_size)) - finished,
            finished,
        )

    def _stop(self, reason: str, running: set[int], finished: set[int]) -> None:
        """Stop the ranks in ``running``: abort in place, then restart stuck workers."""
        client = self.client
        targets = sorted({self.workers[r] for r in running})
        if targets:
            try:
                client.run(
                    bootstrap.abort_rank, self.job_id, reason, workers=targets, on_error="ignore"
                )
            except Exception:
                logger.debug("job %s: abort request failed", self.job_id, exc_info=True)
        deadline = time.monotonic() + self._grace
        while running - finished:
            try:
                kind, rank = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if kind == "done":
                finished.add(rank)
        stuck = sorted({self.workers[r] for r in running - finished})
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
        try:
            client.run(
                bootstrap.drop_store, self.job_id, workers=[self._store_worker], on_error="ignore"
            )
        except Exception:
            logger.debug("job %s: store cleanup failed", self.job_id, exc_info=True)

    # -- display ----------------------------------------------------------------------
    def __repr__(self) -> str:
        return (
            f"<dask_ddp.Job {self.job_id}: {self.state.value}, {self.world_size} ranks, "
            f"{self.backend}>"
        )

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{r}</td><td>{html.escape(w)}</td><td>{html.escape(f.status)}</td></tr>"
            for r, (w, f) in enumerate(zip(self.workers, self.futures, strict=True))
        )
        error = f"<pre>{html.escape(str(self._error))}</pre>" if self._error else ""
        return (
            f"<div><b>dask_ddp job {html.escape(self.job_id)}</b>: {self.state.value}, "
            f"backend {html.escape(self.backend)}<table><tr><th>rank</th><th>worker</th>"
            f"<th>status</th></tr>{rows}</table>{error}</div>"
        )

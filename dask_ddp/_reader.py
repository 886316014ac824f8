"""A job's channel on the client: its ranks' events, back in order, into the job's model.

:class:`EventReader` subscribes to an attempt's topic (:func:`dask_ddp.events.job_topic`)
and to its workers' scheduler events before any rank is submitted. Event handlers run on
the client's event loop and only hand the event on (``sink``); the supervisor's thread
then calls :meth:`EventReader.handle`, which puts each rank's messages back in order
(:class:`dask_ddp.events.RankStream`), fills gaps from the scheduler's history, fetches
large messages from the rank's worker, and delivers the decoded messages to the
:class:`~dask_ddp._model.JobModel` and the user's callbacks.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterable
from typing import Any

from distributed import Client

from . import events
from ._model import JobModel

logger = logging.getLogger(__name__)


class EventReader:
    """Reads one job's channel, attempt after attempt, into ``model``.

    Parameters
    ----------
    client : distributed.Client
        The job's client.
    model : JobModel
        Where decoded messages go.
    on_report, on_output : callable, optional
        Called with each :class:`~dask_ddp.MetricRecord` / :class:`~dask_ddp.OutputLine`;
        the first exception stops the calls (it is logged and noted in the view).
    """

    def __init__(
        self,
        client: Client,
        model: JobModel,
        *,
        on_report: Callable[[Any], Any] | None = None,
        on_output: Callable[[Any], Any] | None = None,
    ) -> None:
        self.client, self.model = client, model
        self.callbacks: dict[str, Callable[[Any], Any] | None] = {
            "on_report": on_report,
            "on_output": on_output,
        }
        self.run_id = ""
        self.topic = ""
        self.workers: list[str] = []
        self.streams: list[events.RankStream] = []
        self._unsubscribe: list[Callable[[], None]] = []

    def subscribe(
        self,
        run_id: str,
        workers: list[str],
        sink: Callable[[str, Any], None],
    ) -> None:
        """Start reading a new attempt: ``sink("event", msg)`` for each event of its topic,
        ``sink("lost", rank)`` when a rank's worker leaves the cluster."""
        self.run_id, self.topic, self.workers = run_id, events.job_topic(run_id), list(workers)
        self.streams = [events.RankStream() for _ in self.workers]
        self._unsubscribe.append(
            events.subscribe(self.client, self.topic, lambda ev: sink("event", ev[1]))
        )

        def on_worker_event(rank: int, worker: str, event: Any) -> None:
            msg = event[1]
            current = rank < len(self.workers) and self.workers[rank] == worker
            if isinstance(msg, dict) and msg.get("action") == "remove-worker" and current:
                sink("lost", rank)

        for rank, worker in enumerate(self.workers):
            self._unsubscribe.append(
                events.subscribe(
                    self.client, worker, lambda ev, r=rank, w=worker: on_worker_event(r, w, ev)
                )
            )

    def unsubscribe(self) -> None:
        """Stop the attempt's subscriptions (the events already queued are still handled)."""
        for unsubscribe in self._unsubscribe:
            try:
                unsubscribe()
            except Exception:
                logger.debug("job %s: unsubscribe failed", self.model.job_id, exc_info=True)
        self._unsubscribe.clear()

    def complete(self, ranks: Iterable[int]) -> bool:
        """Whether ``ranks`` sent their final marker and everything before it arrived."""
        return all(self.streams[r].complete for r in ranks)

    def missing(self, rank: int) -> str | None:
        """What is missing from ``rank``'s stream, in words; None when it is complete."""
        stream = self.streams[rank]
        if stream.complete:
            return None
        if stream.end is None:
            return "its final marker never arrived, so its last records may be missing"
        return f"{stream.end - stream.next} of its {stream.end} messages never arrived"

    def drain(
        self,
        ranks: Iterable[int],
        timeout: float,
        pump: Callable[[float], Any],
        *,
        warn: bool = False,
    ) -> None:
        """Wait until ``ranks`` have sent their final marker and everything before it.

        ``pump(seconds)`` handles the events queued meanwhile, raising ``queue.Empty``
        when none came in time; then the gaps are filled from the scheduler once, and
        what is still missing is given up (logged and noted when ``warn``).
        """
        ranks = sorted(ranks)
        deadline = time.monotonic() + timeout
        filled = False
        while not self.complete(ranks):
            try:
                pump(max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                if filled:
                    break
                self.fill_gaps()
                filled = True
        for r in ranks:
            what = self.missing(r)
            if what is None or not warn:
                continue
            logger.warning(
                "job %s: rank %d: %s after waiting %.0f s (ddp.event-drain-timeout)",
                self.model.job_id, r, what, timeout,
            )  # fmt: skip
            self.model.note(f"rank {r}: {what}")

    def handle(self, msg: Any, *, fill: bool = True) -> None:
        """Take one event of the attempt's topic."""
        if not isinstance(msg, dict) or msg.get("job") != self.run_id:
            return
        rank = msg.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < len(self.streams):
            return
        stream = self.streams[rank]
        for event in stream.add(msg):
            self._deliver(rank, event)
        if fill and stream.has_gap and not stream.complete:
            self.fill_gaps()

    def fill_gaps(self) -> None:
        """Recover missed events from the scheduler's history of the topic; give up on
        what it no longer holds (it keeps the last 1000 events)."""
        try:
            history = self.client.get_events(self.topic)
        except Exception:
            logger.debug("job %s: could not read the event history", self.run_id, exc_info=True)
            history = ()
        for _, msg in history:
            self.handle(msg, fill=False)
        for rank, stream in enumerate(self.streams):
            while stream.blocked:
                missing, ready = stream.skip_gap()
                logger.warning(
                    "job %s: %d messages from rank %d were lost on the way (the scheduler "
                    "no longer holds them)",
                    self.model.job_id,
                    missing,
                    rank,
                )
                self.model.note(f"rank {rank}: {missing} messages lost on the way")
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
                    self.model.job_id,
                    ref["nbytes"],
                    rank,
                    ref["worker"],
                )
                self.model.note(f"rank {rank}: a {ref['nbytes']}-byte message was lost ({exc})")
                return
        else:
            msgs = events.decode(event)
        records, printed = self.model.add(rank, msgs)
        if records:
            self._call_back("on_report", records, "job.metrics")
        if printed:
            self._call_back("on_output", printed, "job.output")

    def _call_back(self, name: str, items: list[Any], kept_in: str) -> None:
        """Call the user's ``on_report``/``on_output`` with each item; stop at its first error."""
        callback = self.callbacks[name]
        if callback is None:
            return
        for item in items:
            try:
                callback(item)
            except Exception as exc:
                logger.exception(
                    "job %s: %s raised on an item from rank %d; it is not called again "
                    "for this job (everything stays in %s)",
                    self.model.job_id,
                    name,
                    item.rank,
                    kept_in,
                )
                self.callbacks[name] = None
                self.model.note(f"{name} raised {type(exc).__name__}: {exc}; no longer called")
                return

    def drop_leftovers(self) -> None:
        """Release the large messages the ranks still hold for the client (never fetched)."""
        leftovers = [r for r, stream in enumerate(self.streams) if not stream.complete]
        if not leftovers:
            return
        try:
            alive = set(self.client.scheduler_info(n_workers=-1)["workers"])
        except Exception:
            alive = set()
        # A worker that left or was restarted took them along; a call to its old address
        # would wait for the connect timeout.
        for rank in leftovers:
            if self.workers[rank] not in alive:
                continue
            try:
                events.drop_blobs(self.client, self.workers[rank], self.run_id)
            except Exception:
                logger.debug("job %s: could not release rank %d's leftovers", self.run_id, rank)

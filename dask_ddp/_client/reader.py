"""A client's reading of one job: its event topic, back in order, into the job's model.

:class:`EventReader` follows a job's topic (:func:`dask_ddp._shared.protocol.job_topic`) on the
client's event loop, the way ``distributed``'s progress bars follow the scheduler: a
handler that only queues, and one coroutine, :meth:`EventReader.listen`, that takes the
events in order. The supervisor's messages (state, placement, history, error) go to
:meth:`JobModel.apply_state <dask_ddp._client.model.JobModel.apply_state>`; each rank's messages
are put back in order (:class:`RankStream`, one per rank and placement),
gaps filled from the scheduler's history, large messages fetched from the rank's worker,
and delivered to the model. The user's ``on_report``/``on_output`` callbacks run on a
thread of their own, in order, never on the loop; the job's outcome is set only after the
callbacks for every record before it ran.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from distributed import Client

from .._shared import dask_internals
from .._shared.protocol import BLOB_HANDLER, Entry, StateMessage, Told, call, decode, job_topic
from ..errors import ChannelError
from . import topics
from .model import JobModel

logger = logging.getLogger(__name__)


def _count(event: dict[str, Any]) -> int:
    if "n" in event:
        return int(event["n"])
    return 1 if "blob" in event else 0


class RankStream:
    """One rank's events back in the order it sent them.

    >>> s = RankStream()
    >>> [e["seq"] for e in s.add({"seq": 2, "n": 1})]
    []
    >>> [e["seq"] for e in s.add({"seq": 0, "n": 2})]
    [0, 2]
    >>> s.add({"seq": 3, "end": 3}), s.complete
    ([], True)
    """

    def __init__(self, *, resume: bool = False) -> None:
        self.next = 0  # sequence number of the next message to deliver
        self.end: int | None = None  # number of messages the rank sent, once it said so
        self.lost = 0
        self._pending: dict[int, dict[str, Any]] = {}
        # A client that attaches to a running job starts where its first event starts.
        self._resume = resume

    def add(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one event; return the events that are now deliverable, in order."""
        if self._resume:
            self.next, self._resume = int(event["seq"]), False
        if "end" in event:
            self.end = int(event["end"])
        seq, count = int(event["seq"]), _count(event)
        if count and seq >= self.next and seq not in self._pending:
            self._pending[seq] = event
        ready = []
        while self.next in self._pending:
            ready.append(self._pending.pop(self.next))
            self.next += _count(ready[-1])
        return ready

    @property
    def complete(self) -> bool:
        """True once the final marker arrived and every message before it."""
        return self.end is not None and self.next >= self.end

    @property
    def has_gap(self) -> bool:
        """True when a message is missing before one that arrived, or before the end."""
        return bool(self._pending) or (self.end is not None and self.next < self.end)

    @property
    def blocked(self) -> bool:
        """True when messages that arrived wait behind a missing one."""
        return bool(self._pending)

    def skip_gap(self) -> tuple[int, list[dict[str, Any]]]:
        """Give up on the first missing messages: return how many, and what follows."""
        target = min(self._pending) if self._pending else (self.end or self.next)
        missing = max(0, target - self.next)
        self.lost += missing
        self.next = target
        ready = []
        while self.next in self._pending:
            ready.append(self._pending.pop(self.next))
            self.next += _count(ready[-1])
        return missing, ready


# Clients that reach the workers only through the scheduler: a proxy stands between them
# (dask-gateway's, for notebooks outside the cluster's network), or the client was made
# with direct_to_workers=False, or a worker could not be reached from it once.
_through_scheduler: weakref.WeakSet[Client] = weakref.WeakSet()


def _reaches_workers(client: Client) -> bool:
    if client in _through_scheduler or client.direct_to_workers is False:
        return False
    return not str(client.scheduler.address).startswith("gateway://")


async def fetch_blob(client: Client, ref: dict[str, Any]) -> list[list[Any]]:
    """Fetch a message sent by reference from the rank's worker (on the client's event
    loop), which forgets it as it hands it over.

    Directly from the worker, without the scheduler, where this client reaches the
    workers; through the scheduler (``Client.run``, as Dask's own ``gather`` goes for a
    client that does not connect to workers) where a proxy stands between them
    (``gateway://``), the client was made with ``direct_to_workers=False``, or a worker
    could not be reached once (then for the rest of the client's life).

    Raises
    ------
    ChannelError
        The worker no longer holds it (it restarted, or the job was forgotten).
    OSError
        The worker cannot be reached, even through the scheduler.
    """
    reply = None
    if _reaches_workers(client):
        try:
            reply = await dask_internals.call_worker(
                client, ref["worker"], BLOB_HANDLER, key=ref["key"]
            )
        except OSError as exc:
            logger.info(
                "dask-ddp: %s cannot be reached from this client (%s): large rank messages "
                "come through the scheduler from now on", ref["worker"], exc,
            )  # fmt: skip
            _through_scheduler.add(client)
    if reply is None:
        replies = await client.run(
            call, Entry.TAKE_BLOB, ref["key"], workers=[ref["worker"]], asynchronous=True
        )
        reply = replies[ref["worker"]]
    if reply.get("status") != "OK":
        job, rank, _ = ref["key"].split("/")
        raise ChannelError(int(rank), job, f"{ref['worker']} no longer holds {ref['key']}")
    return [[kind, list(body)] for kind, body in reply["msgs"]]  # the comm made tuples


class EventReader:
    """Reads one job's topic, placement after placement, into ``model``.

    Parameters
    ----------
    client : distributed.Client
        The client following the job.
    model : JobModel
        Where the job's state and the ranks' messages go.
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
        self.topic = job_topic(model.job_id)
        self.callbacks: dict[str, Callable[[Any], Any] | None] = {
            "on_report": on_report,
            "on_output": on_output,
        }
        self._queue: asyncio.Queue[Any] | None = None
        self._early: list[Any] = []  # events that came before the loop's queue existed
        self._streams: dict[str, list[RankStream]] = {}  # run id -> one per rank
        self._resumed: set[str] = set()  # run ids that began before this client followed
        self._unfollow: Callable[[], None] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: asyncio.Future[None] | None = None
        self.caught_up = threading.Event()  # what the scheduler held from before was read
        # Any thread may ask for a refresh; it happens on the client's loop.
        model.schedule = lambda delay, fn: client.loop.add_callback(
            client.loop.call_later, delay, fn
        )

    def follow(self) -> None:
        """Subscribe to the job's topic; from now on no event is missed. Call it before
        the job is launched (the launching client) or attached to."""
        self._unfollow = topics.follow(self.client, self.topic, self._receive)

    def start(self, *, resumed: tuple[str, ...] = ()) -> None:
        """Start reading, on the client's loop; ``resumed``: the placements that began
        before this client followed the job (read from their first event seen)."""
        self._resumed.update(resumed)
        self.client.loop.add_callback(self._begin, bool(resumed))

    def _receive(self, event: Any) -> None:
        # On the client's loop: only queue.
        msg = event[1] if isinstance(event, tuple) else event
        if self._queue is None:
            self._early.append(msg)
        else:
            self._queue.put_nowait(msg)

    async def _begin(self, history: bool) -> None:
        self._queue = asyncio.Queue()
        await self.fetch_futures()  # placed before this client followed it (or at launch)
        for msg in self._early:
            self._queue.put_nowait(msg)
        self._early.clear()
        self._task = asyncio.ensure_future(self.listen(history))

    async def listen(self, history: bool = False) -> None:
        """Take the job's events in order until the supervisor says it has stopped."""
        try:
            if history:  # what the scheduler keeps of the job's events from before
                for _, msg in await dask_internals.topic_history(self.client, self.topic):
                    if isinstance(msg, dict) and "rank" in msg:
                        await self._rank_event(msg, history=True)
            self.caught_up.set()
            while not self.model.closed:
                msg = await self._queue.get()
                if not isinstance(msg, dict):
                    continue
                if StateMessage.is_one(msg, self.model.job_id):
                    await self._state(msg)
                elif "rank" in msg:
                    await self._rank_event(msg)
        except Exception:  # the job goes on in the cluster; this client stops following
            logger.exception("job %s: reading its events failed", self.model.job_id)
            self.model.note("this client stopped following the job's events (see the log)")
            self.model.close()
        finally:
            self.caught_up.set()
            self.stop()

    async def _state(self, msg: dict[str, Any]) -> None:
        self.model.apply_state(msg)
        await self.fetch_futures()
        if self.model.outcome is not None:  # decided: final, or stopping on the way there
            await self._callbacks_done()
            if StateMessage.from_wire(msg).stopped:
                self._warn_missing()
                self.model.close()
            else:
                self.model.finish()

    async def fetch_futures(self) -> None:
        """Bind the current placement's published rank futures to this client as soon as
        the supervisor announces them (``Job.futures`` and ``result()`` then wait for
        nothing more)."""
        name = self.model.dataset
        if name is None or self.model.futures[0] == name:
            return
        try:
            futures = await self.client.get_dataset(name, asynchronous=True)
        except KeyError:  # forgotten meanwhile: Job.futures says so when asked
            return
        self.model.set_futures(name, list(futures))

    async def _rank_event(self, msg: dict[str, Any], *, history: bool = False) -> None:
        run_id, rank = msg.get("run"), msg.get("rank")
        if not isinstance(rank, int) or rank < 0 or not self._ours(run_id):
            return
        streams = self._streams.setdefault(run_id, [])
        while len(streams) <= rank:
            streams.append(RankStream(resume=run_id in self._resumed or history))
        stream = streams[rank]
        for event in stream.add(msg):
            await self._deliver(run_id, rank, event, history=history)
        if not history and stream.has_gap and not stream.complete:
            await self._fill_gaps()

    def _ours(self, run_id: Any) -> bool:
        """Whether ``run_id`` is one of this job's placements (``<job id>[-<attempt>]``)."""
        job = self.model.job_id
        return isinstance(run_id, str) and (run_id == job or run_id.startswith(f"{job}-"))

    async def _fill_gaps(self) -> None:
        """Recover missed events from the scheduler's history of the topic; give up on
        what it no longer holds (it keeps the last 1000 events)."""
        try:
            held = await dask_internals.topic_history(self.client, self.topic)
        except Exception:
            logger.debug(
                "job %s: could not read the event history", self.model.job_id, exc_info=True
            )
            held = ()
        for _, msg in held:
            run_id, rank = msg.get("run"), msg.get("rank")
            streams = self._streams.get(run_id, [])
            if isinstance(rank, int) and 0 <= rank < len(streams):
                for event in streams[rank].add(msg):
                    await self._deliver(run_id, rank, event)
        for run_id, streams in self._streams.items():
            for rank, stream in enumerate(streams):
                while stream.blocked:
                    missing, ready = stream.skip_gap()
                    logger.warning(
                        "job %s: %d messages from rank %d were lost on the way (the scheduler "
                        "no longer holds them)", self.model.job_id, missing, rank,
                    )  # fmt: skip
                    self.model.note(f"rank {rank}: {missing} messages lost on the way")
                    for event in ready:
                        await self._deliver(run_id, rank, event)

    async def _deliver(
        self, run_id: str, rank: int, event: dict[str, Any], *, history: bool = False
    ) -> None:
        current = run_id == self.model.run_id and not history
        if current and event.get("told"):
            try:
                told = Told.from_wire(event["told"])
            except (KeyError, TypeError, ValueError) as exc:
                self.model.note(f"rank {rank}: an event could not be read ({exc})")
            else:
                self.model.told(rank, told)  # the job's progress, as the supervisor takes it
        if "blob" in event:
            ref = event["blob"]
            try:
                msgs = await fetch_blob(self.client, ref)
            except Exception as exc:  # the worker is gone, or another client took it
                logger.warning(
                    "job %s: a %d-byte message from rank %d could not be fetched from %s: %s",
                    self.model.job_id, ref["nbytes"], rank, ref["worker"], exc,
                )  # fmt: skip
                self.model.note(f"rank {rank}: a {ref['nbytes']}-byte message was lost ({exc})")
                return
        else:
            msgs = decode(event)
        records, printed = self.model.add(rank, msgs)
        if records:
            self._call_back("on_report", records, "job.metrics")
        if printed:
            self._call_back("on_output", printed, "job.output")

    def _call_back(self, name: str, items: list[Any], kept_in: str) -> None:
        """Run the user's ``on_report``/``on_output`` on each item, on the callbacks' own
        thread, in order."""
        if self.callbacks[name] is None:
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"dask-ddp-callbacks-{self.model.job_id}"
            )
        self._executor.submit(self._run_callback, name, items, kept_in)

    def _run_callback(self, name: str, items: list[Any], kept_in: str) -> None:
        for item in items:
            callback = self.callbacks[name]
            if callback is None:
                return
            try:
                callback(item)
            except Exception as exc:
                logger.exception(
                    "job %s: %s raised on an item from rank %d; it is not called again for "
                    "this job (everything stays in %s)", self.model.job_id, name, item.rank,
                    kept_in,
                )  # fmt: skip
                self.callbacks[name] = None
                self.model.note(f"{name} raised {type(exc).__name__}: {exc}; no longer called")
                return

    async def _callbacks_done(self) -> None:
        if self._executor is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, lambda: None)

    def _warn_missing(self) -> None:
        """The job stopped: say which ranks' last records never arrived (this client's
        subscription came late, or the scheduler dropped them)."""
        streams = self._streams.get(self.model.run_id or "", [])
        for rank, stream in enumerate(streams):
            if stream.end is not None and not stream.complete:
                text = f"{stream.end - stream.next} of its {stream.end} messages never arrived"
                logger.warning("job %s: rank %d: %s", self.model.job_id, rank, text)
                self.model.note(f"rank {rank}: {text}")

    def stop(self) -> None:
        """Stop following the job (it goes on in the cluster)."""
        if self._unfollow is not None:
            try:
                self._unfollow()
            except Exception:
                logger.debug("job %s: unsubscribe failed", self.model.job_id, exc_info=True)
            self._unfollow = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)

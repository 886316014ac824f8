"""The one channel from every rank to the job's supervisor and its clients, over Dask's
event stream.

Everything a rank says (``report()`` records, printed lines, status, checkpoints,
``submit_result()`` payloads, and how it ended) goes through a :class:`RankChannel`:
numbered messages, buffered on the rank and sent in batches by a background thread as
``Worker.log_event`` events on the job's own topic (:func:`job_topic`, one for all its
attempts). The scheduler hands each event to the job's supervisor (the plugin's
``log_event`` hook) and relays it to every client following the job, where a
stream per rank puts the messages back in order (:mod:`dask_ddp._client.reader`). What the
messages and events hold is the wing's contract, defined in :mod:`dask_ddp._shared.protocol`.

Why it is built this way (measured on the real stack):

- ``Worker.log_event`` costs 15-50 µs a call, so records are batched, one event per batch,
  packed (msgpack) into one opaque value. Each event also says in the clear what the
  supervisor needs (``told``: how many records, the last one, the rank's status, the
  checkpoints that landed), so the scheduler never unpacks a batch.
- The scheduler relays events and keeps the last 1000 per topic, so a message larger than
  ``ddp.max-event-bytes`` never travels through it: the rank keeps it in its worker's
  memory and sends a reference; a client fetches it directly from that worker (a handler
  that :class:`BlobHandler`, a worker plugin the scheduler plugin installs, adds to every
  worker), which releases it on delivery.
- Events can be missed, so messages are numbered per rank, each rank ends with a marker
  holding its count and how it ended (the supervisor decides on it), and gaps are filled
  from the scheduler's history of the topic.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgpack
from distributed.diagnostics.plugin import WorkerPlugin

from .._shared import dask_internals, preload
from .._shared.protocol import (
    BLOB_HANDLER,
    DONE,
    METRICS,
    RESULT,
    STATUS,
    VERSION,
    RankOutcome,
    Told,
    job_topic,
    pick_curve_metric,
)
from ..errors import ChannelError, NotInRankError

logger = logging.getLogger(__name__)

_EVENT_OVERHEAD = 256  # bytes an event's envelope may take besides its messages


# -- the worker plugin serving large messages --------------------------------------------
class BlobHandler(WorkerPlugin):
    """Serves large rank messages held on a worker to the client (see :func:`fetch_blob`).

    Registered once per client by :func:`register_blob_handler`; the scheduler installs it
    on every worker, and on workers that join later.
    """

    name = "dask-ddp-blob-handler"
    idempotent = True  # a second client's registration leaves the installed one alone

    def setup(self, worker: Any) -> None:
        dask_internals.add_worker_handler(worker, BLOB_HANDLER, _serve_blob)
        preload.quiet_rank_failures()  # the client shows a rank's failure, once

    def teardown(self, worker: Any) -> None:
        dask_internals.remove_worker_handler(worker, BLOB_HANDLER)


# -- rank: the buffered, numbered channel ------------------------------------------------
# Large messages waiting on this worker for their client, keyed "<job>/<rank>/<seq>". Keys
# start with the job id, so two jobs never see each other's entries.
_blobs: dict[str, list[list[Any]]] = {}
_blobs_lock = threading.Lock()


def _result_size(body: list[Any]) -> int:
    """Upper estimate of a result message's packed size, without packing it."""
    data = body[2]
    size = len(data) if isinstance(data, bytes) or data.isascii() else 4 * len(data)
    return 32 + 4 * (len(body[0]) + len(body[1])) + size


_channels: weakref.WeakSet[RankChannel] = weakref.WeakSet()  # this process's open channels


class _ForkedProcess(RuntimeError):
    def __str__(self) -> str:
        return (
            "this process was forked from the rank (a DataLoader worker?), and only the "
            "rank's own process can send; call report() and submit_result() from the "
            "training loop"
        )


def _after_fork_in_child() -> None:
    # The flusher thread does not exist in a forked child: fail loudly instead of
    # buffering records nobody sends.
    for channel in list(_channels):
        channel._error = _ForkedProcess()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class RankChannel:
    """A rank's side of the channel: ordered, numbered, buffered, never blocking.

    :meth:`put` appends to a buffer; a background thread sends what gathered as events of
    at most ``max_event_bytes``: at once while the rank sends few messages (at most once
    per ``idle_interval``), at most once per ``interval`` seconds under load, and at once
    when the buffer fills an event. A single message larger than that
    stays in this worker's memory and only a reference travels (see the module docstring).
    :meth:`close` sends what is left and the final marker (the number of messages, on the
    last batch), from the calling thread, so it reaches the scheduler before the rank's task
    finishes.

    Parameters
    ----------
    worker : distributed.Worker
        The worker running the rank (``distributed.get_worker()``).
    job_id : str
        The placement's run id (every event carries it).
    rank : int
        The rank sending.
    interval : float
        Shortest time between two flushes under load, in seconds: how long a message may
        wait in the buffer for others to batch with while the rank sends more than two
        messages per ``idle_interval``.
    idle_interval : float, optional
        Shortest time between two flushes while the rank sends few messages (by default
        ``interval``): a message then goes at once, or after at most this long.
    max_event_bytes : int
        Largest event sent through the scheduler.
    topic : str, optional
        Where events go: the job's topic (:func:`job_topic` of the job's id, the same for
        all its placements); by default that of ``job_id``.
    relay : dask_ddp._rank.rankproc.RankLink, optional
        In a rank's own process: where its events go (``relay.emit``) and where a large
        message is held (``relay.hold_blob``), both in its worker; ``worker`` then only
        names the worker (``worker.address``).
    turn : tuple, optional
        What :meth:`hand_over` of the rank task's channel returned: this channel goes on
        from there, in the rank's process.
    start : callable, optional
        Runs the sending loop (a callable taking no argument) in a thread of its own; by
        default a new daemon thread. A rank's process passes a thread started ahead: a
        new thread's ``start()`` waits until it runs, milliseconds on a busy machine. The
        loop starts with the first message: a channel that has nothing to say before it
        closes costs no thread.

    Examples
    --------
    >>> worker = get_worker()  # doctest: +SKIP
    >>> ch = RankChannel(worker, "3f2a", 0, interval=0.05, max_event_bytes=64000)  # doctest: +SKIP
    >>> ch.put(METRICS, [1, time.time(), {"loss": 0.5}])  # doctest: +SKIP
    >>> ch.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        worker: Any,
        job_id: str,
        rank: int,
        *,
        interval: float,
        max_event_bytes: int,
        topic: str | None = None,
        relay: Any = None,
        turn: tuple[int, tuple[str | None, str], list[Any] | None] | None = None,
        idle_interval: float | None = None,
        start: Callable[[Callable[[], None]], Any] | None = None,
        watch: str | None = None,
    ) -> None:
        self._worker = worker
        self._relay = relay
        self._ended = False  # its rank's process closed it (see relayed)
        self._job = job_id
        self._rank = rank
        self._topic = topic or job_topic(job_id)
        self._interval = interval
        self._idle_interval = min(interval, interval if idle_interval is None else idle_interval)
        self._budget = max(1, max_event_bytes - _EVENT_OVERHEAD)
        self._lock = threading.Lock()
        # The sending loop waits on it for what put(), put_status() and close() change.
        self._changed = threading.Condition(self._lock)
        self._buffer: list[tuple[str, list[Any]]] = []
        self._buffer_since = 0.0  # monotonic time the buffer's first message was put
        self._urgent = False  # the buffer fills an event, or holds an urgent message
        self._full = max(64, self._budget // 32)  # records that fill an event, roughly
        self._closed = False  # nothing more is put
        self._closing = False  # the sending loop stops
        # Held while a batch is sent: the sending loop's flushes, and close()'s last flush
        # and final marker, never interleave (close() needs no join of the loop's thread).
        self._send_lock = threading.Lock()
        # Number of messages sent so far; only a holder of _send_lock touches it.
        self._seq = 0 if turn is None else turn[0]
        self._packer = msgpack.Packer(use_bin_type=True, autoreset=True)  # likewise
        self._error: BaseException | None = None
        self._pid = os.getpid()
        # The newest status not yet sent, and since when one waits (monotonic).
        self._status: list[Any] | None = None if turn is None else turn[2]
        self._status_since = time.monotonic()
        # The last status put: phase, detail.
        self._said: tuple[str | None, str] = (None, "") if turn is None else turn[1]
        self._metric: str | None = None  # the curve's metric, as the views pick it
        self._watch = watch  # a sweep's metric (EventPlan.watch): each value told
        self._start = start or self._thread
        self._looping = False  # the sending loop started
        _channels.add(self)

    def put(
        self, kind: str, body: list[Any], caller: str = "report", *, urgent: bool = False
    ) -> None:
        """Queue one message; returns at once. Any thread may call it. An ``urgent`` one
        (a checkpoint that landed: a restart depends on the supervisor knowing it) is sent
        at once, with what else is buffered.

        Raises
        ------
        NotInRankError
            The rank's function has returned (``caller`` names the function called).
        ChannelError
            An earlier batch could not be sent.
        """
        if self._error is not None:
            raise ChannelError(self._rank, self._job, str(self._error)) from self._error
        with self._lock:
            if self._closed:
                raise NotInRankError(caller)
            self._buffer.append((kind, body))
            n = len(self._buffer)
            if n == 1:
                self._buffer_since = time.monotonic()
            if n == self._full or urgent:
                self._urgent = True
            if n == 1 or self._urgent:
                self._wake_loop()

    def put_status(self, phase: str | None, detail: str = "") -> None:
        """Queue the rank's phase (None: unchanged) and activity; never raises or blocks.

        Only a change is queued, and it replaces a status not yet sent (keeping that one's
        phase when this one has none), so status never floods the channel. A status alone
        waits ``idle_interval`` for company (records, the next status, the final marker):
        the phases a launch passes through in milliseconds (queued, joining, running) reach
        the supervisor as one event, or with the rank's end. Ignored once the channel
        closed, or in a process forked from the rank.
        """
        if self._error is not None or os.getpid() != self._pid:
            return
        with self._lock:
            said = (phase or self._said[0], detail)
            if self._closed or said == self._said:
                return
            self._said = said
            if self._status is not None and phase is None:
                phase = self._status[0]
            elif self._status is None:
                self._status_since = time.monotonic()
                self._wake_loop()
            self._status = [phase, detail, time.time()]

    def _wake_loop(self) -> None:
        """(With the lock held.) The sending loop has something new to send: wake it, or
        start it the first time (a status handed over by the task's channel waits for the
        next message: waking a thread costs the caller the GIL for milliseconds on a busy
        machine)."""
        if self._looping:
            self._changed.notify()
        else:
            self._looping = True
            self._start(self._run)

    def _thread(self, target: Callable[[], None]) -> None:
        name = f"dask-ddp-events-{self._job}-rank-{self._rank}"
        threading.Thread(target=target, name=name, daemon=True).start()

    def hand_over(self) -> tuple[int, tuple[str | None, str], list[Any] | None]:
        """Send what is buffered and stop, without the final marker: the rank's own process
        goes on with a channel of its own (``turn=`` what this returns: the sequence
        number, the last status put, and a status not sent yet, which that channel sends),
        whose events come back through :meth:`relayed`. Never raises: an error is
        :meth:`close`'s to say."""
        with self._lock:
            status, self._status = self._status, None
        self._stop_sending()
        with self._send_lock:
            return self._seq, self._said, status

    def relayed(self, topic: str, event: dict[str, Any]) -> None:
        """An event of the rank's own channel, sent on by the rank's task: counted, so
        that :meth:`close` ends the stream where it stopped if the rank's process died
        first, and says nothing if that channel sent the final marker itself."""
        if "end" in event:
            self._ended = True
        with self._send_lock:
            self._seq = _seq_after(event)
        self._worker.log_event(topic, event)

    def _stop_sending(self, end: RankOutcome | None = None) -> None:
        """Stop the sending loop and send what is left from the calling thread, after a
        batch the loop may be sending (the loop then finds nothing more to send); with
        ``end``, the final marker too, on the last batch."""
        with self._lock:
            self._closed = self._closing = True
            self._changed.notify()
        with contextlib.suppress(Exception):  # kept: reported to the rank's caller
            self._flush(end)

    def close(self, outcome: RankOutcome | None = None) -> ChannelError | None:
        """Send everything still buffered and the final marker; never raises.

        Parameters
        ----------
        outcome : RankOutcome, optional
            How the rank ended (see :func:`dask_ddp._rank.tasks.outcome_of`), carried by the
            final marker for the job's supervisor.

        Returns
        -------
        ChannelError or None
            Why some messages could not be sent, if they could not.
        """
        # Unless the rank's process sent the final marker, in its own channel.
        self._stop_sending(None if self._ended else outcome or DONE)
        if self._error is None:
            return None
        error = ChannelError(self._rank, self._job, f"{type(self._error).__name__}: {self._error}")
        error.__cause__ = self._error
        return error

    def _run(self) -> None:
        # Nagle's algorithm in reverse: while the rank sends few messages (no more than two
        # per idle interval), each goes at once, at most one event per idle interval; under
        # load (a rank reporting every step) the flushes are an interval apart, so the rank
        # sends a few events a second (each costs the worker, the scheduler and the client
        # about a millisecond of CPU). A buffer that fills an event goes at once (bursts
        # are not rate-limited).
        last = -float("inf")
        gap = self._idle_interval
        while True:
            with self._lock:
                while True:
                    if self._closing:
                        return  # close() sends the rest from the rank's own thread
                    due, now = self._due(last + gap), time.monotonic()
                    if due is not None and due <= now:
                        break
                    self._changed.wait(None if due is None else due - now)
            try:
                sent = self._flush()
            except Exception:  # kept: put() and close() raise it in the rank's thread
                return
            busy = sent * self._idle_interval > 2 * (now - last)
            gap = self._interval if busy else self._idle_interval
            # The next flush is a gap after this one was due, not after the thread woke
            # for it: counted from the wake-up, each flush of a rank reporting once an
            # interval came a wake-up later than the one before (a training loop holds
            # the GIL: up to 5 ms), until its records waited most of an interval.
            last = now if due == -float("inf") else due

    def _due(self, next_flush: float) -> float | None:
        """When the loop sends next (None: nothing to send): at once when urgent; records
        at the next flush, or when the first of them was put if that is later (the flush
        is due then: the next one counts from there); a status alone once it waited
        ``idle_interval`` too."""
        if self._urgent:
            return -float("inf")
        if self._buffer:
            return max(next_flush, self._buffer_since)
        if self._status is not None:
            return max(next_flush, self._status_since + self._idle_interval)
        return None

    def _flush(self, end: RankOutcome | None = None) -> int:
        """Send what is buffered (and, with ``end``, the final marker: on the last batch,
        else alone); how many messages that was. A failure is kept (the rank's next put()
        and close() say it) and ends the sending."""
        with self._send_lock:
            if self._error is not None and end is None:
                return 0
            try:
                if self._error is not None:  # the batches are lost: the marker says so
                    self._emit({"end": self._seq, "outcome": end.to_wire()})
                    return 0
                return self._flush_held(end)
            except Exception as exc:
                self._error = self._error or exc
                raise

    def _flush_held(self, end: RankOutcome | None) -> int:
        with self._lock:
            items, self._buffer = self._buffer, []
            if self._status is not None:
                items.append((STATUS, self._status))
                self._status = None
            self._urgent = False
        pack = self._packer.pack
        parts: list[bytes] = []
        told = Told()
        size = 0
        for kind, body in items:
            if kind == RESULT and _result_size(body) > self._budget:
                packed = None  # large: never packed here, sent by reference
                n = _result_size(body)
            else:
                packed = pack([kind, body])
                n = len(packed)
            if parts and size + n > self._budget:
                self._send(parts, told)
                parts, size, told = [], 0, Told()
            if kind == METRICS and self._metric is None and body[2]:
                self._metric = pick_curve_metric(body[2])
            if packed is None or n > self._budget:
                self._send_by_reference([kind, body], n)
            else:
                parts.append(packed)
                size += n
                told.add(kind, body, self._metric, self._watch)
        final = {} if end is None else {"outcome": end.to_wire()}
        if parts:
            if final:  # the marker counts this batch's messages too
                final["end"] = self._seq + len(parts)
            self._send(parts, told, final)
        elif final:
            self._emit({"end": self._seq, **final})
        return len(items)

    def _emit(self, fields: dict[str, Any]) -> None:
        event = {"v": VERSION, "run": self._job, "rank": self._rank, "seq": self._seq, **fields}
        if self._relay is not None:
            self._relay.emit(self._topic, event)
        else:
            self._worker.log_event(self._topic, event)
        self._seq = _seq_after(event)

    def _send(self, parts: list[bytes], told: Told, final: dict[str, Any] | None = None) -> None:
        packed = b"".join(parts)
        self._emit({"n": len(parts), "packed": packed, "told": told.to_wire(), **(final or {})})

    def _send_by_reference(self, msg: list[Any], nbytes: int) -> None:
        """A large message, held here for the clients to fetch; its event tells in the
        clear what it is (a large record counts for the job's progress as any other)."""
        told = Told()
        told.add(msg[0], msg[1], self._metric, self._watch)
        key = f"{self._job}/{self._rank}/{self._seq}"
        if self._relay is not None:
            self._relay.hold_blob(key, msg)
        else:
            hold_blob(key, msg)
        ref = {"worker": self._worker.address, "key": key, "nbytes": nbytes}
        try:
            self._emit({"blob": ref, "told": told.to_wire()})
        except BaseException:
            with _blobs_lock:
                _blobs.pop(key, None)
            raise


def _seq_after(event: dict[str, Any]) -> int:
    """The number of the message after ``event``'s: a batch counts its messages, a large
    message held by reference one, the final marker none."""
    if "packed" in event:
        return event["seq"] + event["n"]
    if "blob" in event:
        return event["seq"] + 1
    return event["seq"]


def hold_blob(key: str, msg: list[Any]) -> None:
    """Keep ``msg`` in this worker for its client, under ``key`` (``"<job>/<rank>/<seq>"``)."""
    with _blobs_lock:
        _blobs[key] = [msg]


async def _serve_blob(key: str | None = None, drop_job: str | None = None) -> dict[str, Any]:
    """Worker handler: hand one large message to the client (and forget it), or drop a
    job's leftovers. ``bytes`` travel as their own frames, without a copy into msgpack."""
    from distributed.protocol import to_serialize

    with _blobs_lock:
        if drop_job is not None:
            keys = [k for k in _blobs if k.startswith(f"{drop_job}/")]
            for k in keys:
                del _blobs[k]
            return {"status": "OK", "dropped": len(keys)}
        msgs = _blobs.pop(key, None) if key is not None else None
    if msgs is None:
        return {"status": "missing"}
    framed = [
        [kind, [to_serialize(v) if type(v) is bytes else v for v in body]] for kind, body in msgs
    ]
    return {"status": "OK", "msgs": framed}


def blobs_held(job_id: str | None = None) -> int:
    """How many large messages wait in this process for their client (for tests)."""
    with _blobs_lock:
        return sum(1 for k in _blobs if job_id is None or k.startswith(f"{job_id}/"))


def take_blob(key: str, dask_worker: Any = None) -> dict[str, Any]:
    """Run on a worker (``Client.run``, through the scheduler): hand over one large message
    and forget it."""
    with _blobs_lock:
        msgs = _blobs.pop(key, None)
    return {"status": "missing"} if msgs is None else {"status": "OK", "msgs": msgs}


def drop_held(job_id: str, dask_worker: Any = None) -> int:
    """Run on a worker (``Client.run``): release every large message of ``job_id`` (all its
    attempts) that no client fetched; the job was forgotten."""
    with _blobs_lock:
        keys = [k for k in _blobs if k.startswith(f"{job_id}/") or k.startswith(f"{job_id}-")]
        for key in keys:
            del _blobs[key]
    return len(keys)

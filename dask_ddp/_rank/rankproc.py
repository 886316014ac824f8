"""A rank's own process: started fresh for each attempt from its worker's template, linked
to its Dask task by a pipe, stopped by ending its process tree, never its worker.

The rank task (:func:`dask_ddp._rank.tasks.run_rank`) stays a Dask task on its worker: it
starts the rank's process (:func:`run`), relays what the process sends and returns its
value. The worker never runs, or even unpickles, the user's function.

- **The template.** Each worker forks its ranks from a fork server of dask-ddp's own that
  has imported torch and dask-ddp and runs no threads (:mod:`dask_ddp._rank.template`: its
  nanny's, which outlives the worker, or its own), found as the worker joins by its host
  (:class:`dask_ddp._rank.host.ProcessHost`), which keeps spare processes forked from it
  ahead of the next ranks (:func:`fork_spare`; a fork of a torch process costs about 12
  ms, its exit about 10: the next spare is forked once the last rank's process is gone).
  The template works out once what every rank would (:mod:`dask_ddp._rank.template`), and
  freezes its objects before each fork. A spare that waits rehearses a rank's start (a
  rendezvous on a store in memory, a one-rank gloo group; nothing over the network), the
  one-time costs of a process's first ``init_process_group``. Nothing a job
  leaves in a process (a half import, torch's group counter, CUDA started under another
  ``CUDA_VISIBLE_DEVICES``) reaches the next, and the worker never starts CUDA.
- **The link.** One socket pair, carrying the typed records of :mod:`dask_ddp._rank.link`
  both ways. The rank's :class:`~dask_ddp._rank.channel.RankChannel` runs in
  its process and batches and packs its records (``report()``, output lines, status,
  checkpoint notes) as it did in the worker; each event it sends crosses the pipe and the
  task hands it to the worker's ``log_event``, counting it, so that the stream of a rank
  killed mid-way still ends (the task's channel handed over where it stopped,
  :meth:`~dask_ddp._rank.channel.RankChannel.hand_over`, and closes it then). What the process
  needs of its worker (the replica stores of peers, the worker's partitions of a Dask
  collection, a grow request, a large message held for its client) it asks over the same
  pipe (:meth:`RankLink.call`); the task answers from a thread pool.
- **The stop.** :meth:`RankProcess.stop` tells the process why, then sends SIGTERM to its
  process group (the rank leads a group of its own: DataLoader workers and ``--no-python``
  programs are in it); the rank's main thread turns it into
  :class:`~dask_ddp._rank.slot.StopRequested` at once. Whatever still lives after
  ``ddp.failure-grace`` is killed (SIGKILL of the whole group). A peer waiting for a
  killed rank in a collective fails at once: the rank's sockets are gone. A rank whose
  worker dies kills its own group (the pipe closes).
- **Stacks.** The process registers :mod:`faulthandler` on SIGUSR1, writing to a pipe its
  task reads: :meth:`RankProcess.stacks` works while the rank is blocked in C++.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import faulthandler
import itertools
import logging
import os
import pickle
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import cloudpickle

from .._shared.protocol import RankOutcome, RankSpec
from . import link as wire

logger = logging.getLogger(__name__)

__all__ = [
    "RankLink",
    "RankProcess",
    "Spare",
    "WorkerStandIn",
    "count_gpus",
    "fork_helper",
    "fork_spare",
    "group_alive",
    "run",
]


# -- the task's side, in the worker ---------------------------------------------------------


class RankProcess:
    """The worker's handle on a rank's process: stop it, ask its stacks.

    Parameters
    ----------
    process : dask_ddp._rank.forkserver.ForkedProcess
        The rank's process (forked ahead from the template).
    conn : multiprocessing.connection.Connection
        The task's end of the link.
    stacks_fd : int
        The read end of the pipe faulthandler writes the rank's stacks into.
    grace : float
        Seconds between SIGTERM and SIGKILL (``ddp.failure-grace``).
    """

    def __init__(self, process: Any, conn: Any, stacks_fd: int, grace: float) -> None:
        self.process, self.conn, self.grace = process, conn, grace
        self.pid: int = process.pid
        self.group: int | None = None  # its process group, once the process leads one
        self.stop_reason: str | None = None
        # Whether the rank started CUDA (its end message says): the next rank on this
        # worker waits for its process to be gone, its GPU memory freed.
        self.used_cuda = True
        self._stacks_fd = stacks_fd
        self._stacks_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def send(self, message: tuple[Any, ...]) -> None:
        """Send one record (:mod:`dask_ddp._rank.link`) to the process; nothing if it is
        gone."""
        with self._send_lock, contextlib.suppress(OSError, ValueError):
            self.conn.send(message)

    def send_many(self, message: tuple[Any, ...], buffers: list[Any]) -> None:
        """Send a header, then each of ``buffers`` as raw bytes, together."""
        with self._send_lock, contextlib.suppress(OSError, ValueError):
            self.conn.send(message)
            for data in buffers:
                self.conn.send_bytes(data)

    def _signal(self, sig: int) -> None:
        with self._lock:
            group = self.group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group is not None and group != os.getpgid(0):
                os.killpg(group, sig)
            else:  # not yet the leader of a group of its own: the process alone
                os.kill(self.pid, sig)

    def stop(self, reason: str, failed_rank: int | None) -> None:
        """Stop the rank: tell it why, SIGTERM its process group, and SIGKILL the group
        ``grace`` seconds later if anything of it still runs."""
        with self._lock:
            if self.stop_reason is not None:
                return
            self.stop_reason = reason
        self.send(wire.Stop(reason, failed_rank))
        self._signal(signal.SIGTERM)
        timer = threading.Timer(self.grace, self.kill)
        timer.daemon = True
        with self._lock:
            self._timer = timer
        timer.start()

    def kill(self) -> None:
        """SIGKILL whatever is left of the rank's process group."""
        self._signal(signal.SIGKILL)

    def ended(self) -> None:
        """The rank's process ended: end what it left in its group, stop the timer."""
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self._signal(signal.SIGKILL)  # DataLoader workers, a program's children: gone too
        with self._stacks_lock, contextlib.suppress(OSError):
            if self._stacks_fd >= 0:
                os.close(self._stacks_fd)
                self._stacks_fd = -1
        with self._send_lock:
            self.conn.close()

    def stacks(self, timeout: float = 2.0) -> str:
        """Every thread's Python stack in the rank's process, as :mod:`faulthandler`
        writes them ("" once it ended). Works while the rank is blocked in C++."""
        with self._stacks_lock:
            if self.process.exitcode is not None or self._stacks_fd < 0:
                return ""
            fd = self._stacks_fd
            with contextlib.suppress(OSError):
                while select.select([fd], [], [], 0)[0] and os.read(fd, 65536):
                    pass  # what an earlier, timed-out call left
            try:
                os.kill(self.pid, signal.SIGUSR1)
            except ProcessLookupError:
                return ""
            chunks: list[bytes] = []
            deadline = time.monotonic() + timeout
            wait = timeout
            while True:
                ready = select.select(
                    [fd], [], [], max(0.0, min(wait, deadline - time.monotonic()))
                )
                if not ready[0]:
                    break
                data = os.read(fd, 65536)
                if not data:
                    break
                chunks.append(data)
                wait = 0.1  # the dump is written at once: it ended once the pipe is quiet
            return b"".join(chunks).decode("utf-8", "replace")


Handler = Callable[..., Any]


class RankBody(NamedTuple):
    """What runs in a rank's process, given to it with its rank (module-level functions,
    pickled by name: this module never imports the rank's code)."""

    # (payload, spec, link, turn) -> the value; turn: what the task's channel handed over
    run: Callable[[bytes, RankSpec, Any, Any], Any]
    outcome: Callable[..., RankOutcome]  # (value, error) -> how the rank ended
    finish: Callable[[], None]  # after a success, once its end was told (the group's teardown)


def run(
    payload: bytes,
    spec: RankSpec,
    worker: Any,
    body: RankBody,
    *,
    host: Any,
    channel: Any,
    handlers: dict[str, Handler],
    on_start: Callable[[RankProcess], None],
    grace: float,
) -> tuple[Any, BaseException | None, RankOutcome]:
    """Run one rank in a process of its own and relay what it sends; return its value,
    its error (None on success) and how it ended.

    Parameters
    ----------
    payload : bytes
        ``(fn, args, kwargs)`` as the client pickled them: unpickled in the rank's process.
    spec : RankSpec
        The rank's plan.
    worker : distributed.Worker
        The rank's worker (what its process's ``get_worker()`` stands in for).
    body : RankBody
        What the process runs.
    host : dask_ddp._rank.host.ProcessHost
        The worker's host: its spares, and its reaper of ended ranks.
    channel : RankChannel
        Where the rank's records go.
    handlers : dict
        What the process may ask of its worker, by name (:meth:`RankLink.call`).
    on_start : callable
        Called with the :class:`RankProcess` once it started (the slot records it, so
        that a stop reaches it).
    grace : float
        Seconds between a stop's SIGTERM and SIGKILL.
    """
    from .._shared import dask_internals

    spare = host.take_spare(spec.placement.worker_ranks)
    handle = RankProcess(spare.process, spare.conn, spare.stacks_fd, grace)
    pool = concurrent.futures.ThreadPoolExecutor(
        2,
        thread_name_prefix=f"dask-ddp-link-{spec.key}",
        initializer=dask_internals.act_for_worker,  # the handlers run as the rank's task
        initargs=(worker,),
    )
    ended: tuple[Any, BaseException | None, RankOutcome] | None = None
    try:
        on_start(handle)
        turn = channel.hand_over()  # the rank's process goes on with the channel's stream
        handle.send(wire.Go(payload, spec, WorkerStandIn.of(worker), body, turn))
        ended = _relay(handle, channel, handlers, pool)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if ended is not None:
            host.end_later(handle)
        else:  # it died, or this task was interrupted: nothing of it may outlive the task
            handle.process.join(0)
            if handle.process.exitcode is None:
                handle.kill()
                handle.process.join()
            handle.ended()
            threading.Thread(
                target=host.refill_quietly, name="dask-ddp-refill", daemon=True
            ).start()
    if ended is not None:
        return ended
    return _lost(handle, spec, body)


class Spare:
    """A rank process forked ahead, waiting for its rank (:func:`_rank_main`): its process,
    the worker's end of its link, and where its stacks come out."""

    def __init__(self, process: Any, conn: Connection, stacks_fd: int) -> None:
        self.process, self.conn, self.stacks_fd = process, conn, stacks_fd


def fork_spare(template: Any) -> Spare:
    """(A thread of the worker's.) A spare rank process, forked from ``template`` with the
    worker's environment; it leads a process group of its own (named by its pid)."""
    task_end, rank_end = link_pair()
    stacks_r, stacks_w = os.pipe()
    try:
        process = template.fork(_rank_main, (), [rank_end.fileno(), stacks_w], worker_environ())
    except BaseException:
        task_end.close()
        os.close(stacks_r)
        raise
    finally:
        rank_end.close()
        os.close(stacks_w)
    return Spare(process, task_end, stacks_r)


def link_pair() -> tuple[Connection, Connection]:
    """Two connected ends of a link (a Unix socket pair as ``multiprocessing.connection``
    connections): this process's, and the one a forked process is handed (by descriptor)."""
    ours, theirs = socket.socketpair()
    return Connection(ours.detach()), Connection(theirs.detach())


def worker_environ() -> dict[str, str]:
    """The worker's environment, for a process forked from its template, whichever process
    that belongs to (its nanny's has the nanny's: not the nanny's ``env``, nor dask-cuda's
    CUDA_VISIBLE_DEVICES)."""
    return dict(os.environ)


def fork_helper(
    template: Any, target: Callable[..., None], args: tuple, conns: Sequence[Connection] = ()
) -> Any:
    """(In a thread of the worker's.) Start ``target(*conns, *args)`` in a helper process
    forked from ``template``, with the worker's environment (:func:`worker_environ`) and a
    terminal's Ctrl-C left to the worker; ``conns`` are the helper's ends of links
    (:func:`link_pair`), for the caller to close once it has them (a failed fork may be
    tried again)."""
    fds = [conn.fileno() for conn in conns]
    return template.fork(_helper_main, (target, args), fds, worker_environ())


def _helper_main(fds: list[int], target: Callable[..., None], args: tuple) -> None:
    """A helper process of a worker's (:func:`fork_helper`): a terminal's Ctrl-C (SIGINT to
    the command line's process group) is its worker's to take, and the job's stop that
    follows ends what the helper serves."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    target(*[Connection(fd) for fd in fds], *args)


def count_gpus(fork: Callable[..., Any]) -> int:
    """(In a thread of the worker's.) The GPUs its ranks see: ``torch.cuda.device_count()``
    in a helper process ``fork(target, args, conns)`` starts from the worker's template,
    which then exits. The worker never imports torch to count (1.5-3 s of CPU on a fresh
    worker, beside its template's own import)."""
    reader, writer = link_pair()
    try:
        process = fork(_count_gpus, (), [writer])
        try:
            count = reader.recv()
        except EOFError:
            process.join()
            raise RuntimeError(
                f"the process counting this worker's GPUs ended without a count (exit code "
                f"{process.exitcode})"
            ) from None
        process.join()
        return int(count)
    finally:
        reader.close()


def _count_gpus(conn: Any) -> None:
    import torch

    conn.send(torch.cuda.device_count())
    conn.close()


def group_alive(group: int) -> bool:
    """Whether the process group ``group`` still has a process in it."""
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):  # (another user's took the number)
        return False
    return True


def _relay(
    handle: RankProcess,
    channel: Any,
    handlers: dict[str, Handler],
    pool: concurrent.futures.ThreadPoolExecutor,
) -> tuple[Any, BaseException | None, RankOutcome] | None:
    """Read the process's messages until its end message (returned) or until the link
    closes without one (None: it died)."""
    conn = handle.conn
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return None
        if isinstance(message, wire.Emit):  # an event of the rank's channel
            channel.relayed(message.topic, message.event)
        elif isinstance(message, wire.Blob):  # a large message, kept here for its client
            handlers["hold_blob"](message.key, message.message)
        elif isinstance(message, wire.LogEvent):  # the rank's get_worker().log_event
            handlers["log_event"](message.topic, message.message)
        elif isinstance(message, wire.Call):
            args = message.args
            if message.has_data:  # its buffer follows at once
                try:
                    args = (*args, conn.recv_bytes())
                except (EOFError, OSError):
                    return None
            pool.submit(_answer, handle, handlers, message.call_id, message.name, args)
        elif isinstance(message, wire.Hello):
            with handle._lock:
                handle.group = message.group
            if handle.stop_reason is not None:  # stopped before it led its group
                handle._signal(signal.SIGTERM)
        elif isinstance(message, wire.End):
            handle.used_cuda = message.used_cuda
            outcome = RankOutcome.from_wire(message.outcome)
            return _loaded(message.value), _loaded(message.error), outcome


def _answer(
    handle: RankProcess, handlers: dict[str, Handler], call_id: int, name: str, args: tuple
) -> None:
    try:
        value = handlers[name](*args)
    except BaseException as exc:  # sent to the rank, which raises it
        handle.send(wire.Reply(call_id, False, cloudpickle.dumps(_picklable(exc))))
        return
    if isinstance(value, RawBytes):
        handle.send_many(wire.ReplyBytes(call_id, len(value.data)), [value.data])
    elif isinstance(value, OutOfBand):
        buffers: list[Any] = []
        head = cloudpickle.dumps(value.value, protocol=5, buffer_callback=buffers.append)
        raw = [b.raw() for b in buffers]
        handle.send_many(wire.ReplyOutOfBand(call_id, head, [r.nbytes for r in raw]), raw)
    else:
        handle.send(wire.Reply(call_id, True, cloudpickle.dumps(value)))


class RawBytes:
    """A handler's answer sent as raw bytes, which the rank reads into a buffer of its own
    (a replica: one copy, into memory the rank's tensors may share)."""

    def __init__(self, data: Any) -> None:
        self.data = data


class OutOfBand:
    """A handler's answer whose large buffers (numpy arrays, a DataFrame's columns) travel
    beside its pickle (protocol 5), each read by the rank straight into the buffer its
    array then uses: the pipe's copy, and no second one."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _loaded(data: bytes | None) -> Any:
    return None if data is None else cloudpickle.loads(data)


def _lost(
    handle: RankProcess, spec: RankSpec, body: RankBody
) -> tuple[Any, BaseException, RankOutcome]:
    """How a rank ended whose process died before it said so: stopped, if it was asked to
    stop; else :class:`~dask_ddp.errors.RankDiedError`, which names the signal or exit
    code (and earns a restart, as a worker process's death does under torchrun)."""
    from ..errors import RankDiedError, RankStoppedError

    rank = spec.placement.rank
    error: BaseException
    if handle.stop_reason is not None:
        error = RankStoppedError(rank, handle.stop_reason, job=spec.run_id)
    else:
        error = RankDiedError(rank, spec.placement.worker, spec.key, handle.process.exitcode)
    return None, error, body.outcome(None, error)


def _picklable(error: BaseException) -> BaseException:
    """``error`` if it pickles (with its traceback, and those of its causes: the client
    shows the rank's own frames), else a RuntimeError that says what it was."""
    from tblib import pickling_support

    pickling_support.install(error)
    try:
        cloudpickle.loads(cloudpickle.dumps(error))
        return error
    except Exception:
        text = "".join(traceback.format_exception(error)).rstrip()
        return RuntimeError(f"{type(error).__name__}: {error} (not picklable)\n{text}")


# -- the rank's side, in its own process -----------------------------------------------------


class RankLink:
    """The rank's process's end of the link: events out, calls answered, stops in.

    The rank's :class:`~dask_ddp._rank.channel.RankChannel` runs in its process, as it ran in its
    worker's before: it batches and packs the rank's records (``report()``, output, status,
    checkpoint notes) and hands each event to :meth:`emit`, which its task gives to the
    worker's ``log_event`` at once. The channel takes over from the task's at the event the
    task's stopped at (:meth:`~dask_ddp._rank.channel.RankChannel.hand_over`), and closes with the
    rank's end marker before :meth:`end`; a SIGKILL loses at most the records its channel
    had not yet sent, and the task closes the task's channel then.
    """

    def __init__(self, conn: Any, reader: _ThreadAhead, threads: list[_ThreadAhead]) -> None:
        self.conn = conn
        self.rank, self.job_id = -1, ""  # the rank's, from its go (begin)
        self._reader = reader  # reads from the go on (next_go)
        self._ahead = list(threads)
        self._begun = False
        self._pid = os.getpid()
        self._lock = threading.Lock()  # the pipe's writing end
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._closed = False
        self.channel: Any = None  # the rank's RankChannel, once it opened
        self.stop_told = threading.Event()
        self.stop: tuple[str, int | None] | None = None
        self.on_stop: Callable[[str, int | None], None] | None = None

    def next_go(self, timeout: float | None = None) -> wire.Go | None:
        """The rank's go (:class:`~dask_ddp._rank.link.Go`), once it came (None: the worker
        let this spare go, or stopped it first). The spare's own thread reads it: the rank's
        start waits for no other thread's wake-up. The link's reader takes over from there.

        Raises
        ------
        queue.Empty
            ``timeout`` passed first.
        """
        conn = self.conn
        try:
            if not conn.poll(timeout):
                raise queue.Empty
            message = conn.recv()
        except (EOFError, OSError):
            return None
        if not isinstance(message, wire.Go):  # a stop (all a spare may get before its go)
            return None
        self._reader.run(self._read)
        return message

    def begin(self, rank: int, job_id: str) -> None:
        """The spare became rank ``rank`` of ``job_id``: from now on, if its worker goes
        (the link closes before :meth:`end`), so does the rank's process group."""
        self.rank, self.job_id, self._begun = rank, job_id, True

    def thread(self, target: Callable[[], None]) -> None:
        """Run ``target`` in a thread of its own: one the spare started ahead while one
        is left (a new thread's ``start()`` waits until it runs: milliseconds, on a busy
        machine, of the rank's start), else a new daemon thread."""
        if self._ahead:
            self._ahead.pop().run(target)
        else:
            threading.Thread(target=target, name="dask-ddp-rank", daemon=True).start()

    def _check_process(self) -> None:
        """Only the rank's own process writes on the link: a process forked from it (a
        DataLoader worker) would interleave its writes with the rank's and wait forever for
        answers the rank's reader thread takes."""
        if os.getpid() != self._pid:
            from ..errors import ChannelError

            why = (
                "this process was forked from the rank (a DataLoader worker?): only the "
                "rank's own process talks to its worker"
            )
            raise ChannelError(self.rank, self.job_id, why)

    def _send(self, message: tuple[Any, ...], data: Any = None) -> None:
        """Send ``message`` (and ``data`` after it, as raw bytes, if given), together."""
        from ..errors import ChannelError

        self._check_process()
        with self._lock:
            try:
                self.conn.send(message)
                if data is not None:
                    self.conn.send_bytes(data)
            except (OSError, ValueError) as exc:
                why = f"the link to its worker closed ({exc})"
                raise ChannelError(self.rank, self.job_id, why) from exc

    def emit(self, topic: str, event: dict[str, Any]) -> None:
        """One event of the rank's channel, for its worker's ``log_event``."""
        self._send(wire.Emit(topic, event))

    def hold_blob(self, key: str, msg: list[Any]) -> None:
        """Keep a large message in the worker, for the client that fetches it."""
        self._send(wire.Blob(key, msg))

    def log_event(self, topic: str | list[str], msg: Any) -> None:
        """The rank's own ``get_worker().log_event``."""
        self._send(wire.LogEvent(topic, msg))

    def call(self, name: str, *args: Any, data: Any = None, timeout: float | None = None) -> Any:
        """Ask the rank's worker to run its handler ``name`` on ``args`` (and ``data``, a
        buffer sent as raw bytes and passed last: a checkpoint's); its answer."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)  # atomic under the GIL: no lock needed
        self._calls[call_id] = future
        try:
            self._send(wire.Call(call_id, name, args, data is not None), data)
        except BaseException:
            self._calls.pop(call_id, None)
            raise
        return future.result(timeout)

    def end(self, value: bytes | None, error: bytes | None, outcome: RankOutcome) -> None:
        """The rank's last message, after its channel's last event: its value or error, and
        how it ended."""
        with self._lock:
            self._closed = True
            self.conn.send(wire.End(value, error, outcome.to_wire(), _cuda_started()))

    def _read(self) -> None:
        conn = self.conn
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, wire.Stop):
                self.stop = (message.reason, message.failed_rank)
                if self.on_stop is not None:
                    self.on_stop(message.reason, message.failed_rank)
                self.stop_told.set()
            elif isinstance(message, wire.Reply):
                future = self._calls.pop(message.call_id, None)
                if future is not None:
                    value = cloudpickle.loads(message.data)
                    future.set_result(value) if message.ok else future.set_exception(value)
            elif isinstance(message, wire.ReplyBytes):
                import torch

                buffer = torch.empty(message.nbytes, dtype=torch.uint8)
                conn.recv_bytes_into(buffer.numpy())
                future = self._calls.pop(message.call_id, None)
                if future is not None:
                    future.set_result(buffer)
            elif isinstance(message, wire.ReplyOutOfBand):
                buffers = []
                for nbytes in message.sizes:
                    buffer = bytearray(nbytes)
                    conn.recv_bytes_into(buffer)
                    buffers.append(buffer)
                future = self._calls.pop(message.call_id, None)
                if future is not None:
                    future.set_result(cloudpickle.loads(message.head, buffers=buffers))
        # The worker is gone (killed, or its task ended before this process): so is the rank.
        with self._lock:
            ending = self._closed or not self._begun
        if not ending:
            with contextlib.suppress(OSError):
                os.killpg(0, signal.SIGKILL)


class WorkerStandIn:
    """What ``distributed.get_worker()`` returns in a rank's own process: the rank's worker
    as far as user code needs one: its ``address``, ``name``, ``pid`` (the worker's
    process: the rank's parent is its template), ``scheduler.address``,
    ``log_event`` (sent by the worker, in order with the rank's records), and a client
    (``get_client()``, and Dask objects unpickled in the rank: ``Event``, ``Variable``,
    ``Future``), connected to the scheduler with the worker's own security on first use.
    """

    def __init__(
        self, address: str, name: Any, scheduler: str, security: Any, pid: int | None = None
    ) -> None:
        import types

        self.address, self.name, self.security = address, name, security
        self.pid = pid  # the worker's process (not the rank's parent: the template is)
        self.scheduler = types.SimpleNamespace(address=scheduler)
        self._client: Any = None
        self._lock = threading.Lock()
        self.link: RankLink | None = None  # set in the rank's process

    def log_event(self, topic: str | list[str], msg: Any) -> None:
        """``Worker.log_event``, through the rank's worker."""
        if self.link is None:
            raise RuntimeError("log_event is only available in a rank's process")
        self.link.log_event(topic, msg)

    def __reduce__(self) -> tuple:
        return (
            WorkerStandIn,
            (self.address, self.name, self.scheduler.address, self.security, self.pid),
        )

    @classmethod
    def of(cls, worker: Any) -> WorkerStandIn:
        from ..config import client_security

        security = client_security(worker.security, "worker")  # the worker's own certificate
        return cls(worker.address, worker.name, worker.scheduler.address, security, os.getpid())

    def _get_client(self, timeout: float | None = None) -> Any:
        with self._lock:
            if self._client is None:
                from distributed import Client

                self._client = Client(
                    self.scheduler.address, security=self.security, timeout=timeout,
                    set_as_default=True,
                )  # fmt: skip
            return self._client


def _reset_in_forked_child() -> None:
    # A DataLoader worker forked from the rank: the rank's SIGTERM and SIGUSR1 handlers
    # are not its own (SIGTERM ends it, as it would under torchrun).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(RuntimeError, ValueError):
        faulthandler.unregister(signal.SIGUSR1)


#: Seconds a new spare waits for its rank before it makes its first process group ahead:
#: the spares of a job that just ended do not take the CPU its results need.
_QUIET = 0.1


def _rehearse_start() -> None:
    """Rehearse a rank's start: make and destroy a one-rank gloo group on loopback, through
    a store in memory, and open and close a channel. A process's first group costs about
    5 ms more than any later one (gloo's one-time set-up, and 1,000 pages it shares with its
    template copied), which a spare pays while it waits instead of its rank. Destroying the
    default group resets torch's group counter: the rank's group gets the name its peers'
    get. A failure here is the rank's to meet, and report.

    Nothing here goes over the network: torch looks each store connection's address up by
    name, at both ends, and the spares of a job rehearsing a connection each (four queries
    a spare, all at once) made the resolver lose queries here, the ranks' own among them:
    each such loss held a rank's connection 5 s, glibc's timeout."""
    import torch.distributed as dist

    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        store = dist.HashStore()
        store.add("joined", 1)  # what a rendezvous asks (bootstrap._rendezvous)
        store.compare_set("ready", "", "1")
        store.get("ready")
        dist.init_process_group("gloo", store=dist.PrefixStore("0", store), rank=0, world_size=1)
        dist.destroy_process_group()
        _rehearse_channel()
    except Exception:
        logger.debug("a one-rank group ahead of the rank failed", exc_info=True)
    finally:
        if interface is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = interface


class _Unsent:
    """A rehearsal channel's link: what it sends is pickled as the pipe pickles it
    (:meth:`RankLink.emit`), and goes nowhere."""

    def emit(self, topic: str, event: dict[str, Any]) -> None:
        pickle.dumps(wire.Emit(topic, event), protocol=pickle.HIGHEST_PROTOCOL)

    def hold_blob(self, key: str, msg: list[Any]) -> None:
        pass


def _rehearse_channel() -> None:
    """Open a channel, put a status and close it, as a rank does, sent nowhere."""
    from . import channel as events

    channel = events.RankChannel(
        None, "rehearsal", 0, interval=1.0, max_event_bytes=64_000, relay=_Unsent(),
        start=lambda loop: None,
    )  # fmt: skip
    channel.put_status("running", "rehearsal")
    channel.close(events.DONE)


class _ThreadAhead:
    """A thread a spare starts while it waits, which runs the function it is given later
    (:meth:`run` returns at once)."""

    def __init__(self) -> None:
        self._target: Callable[[], None] | None = None
        self._given = threading.Event()
        threading.Thread(target=self._main, name="dask-ddp-rank", daemon=True).start()

    def _main(self) -> None:
        self._given.wait()
        assert self._target is not None
        self._target()

    def run(self, target: Callable[[], None]) -> None:
        self._target = target
        self._given.set()


def _cuda_started() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def _rank_main(fds: list[int]) -> None:
    """A rank's process, forked from its worker's template ahead of its rank, with its
    worker's environment (``fds``: its end of the link, and where its stacks go): it waits
    for its :class:`~dask_ddp._rank.link.Go`, then runs the rank and says how it ended.
    Its template is a plain interpreter (no ``multiprocessing`` parent): it may start
    DataLoader workers as torchrun's processes do."""
    link_fd, stacks_fd = fds
    conn = Connection(link_fd)
    os.setpgid(0, 0)  # the rank leads a group: a stop ends everything it started
    faulthandler.register(signal.SIGUSR1, file=stacks_fd, all_threads=True, chain=False)
    os.register_at_fork(after_in_child=_reset_in_forked_child)
    link = RankLink(conn, _ThreadAhead(), [_ThreadAhead()])  # and the rank's channel's
    try:
        conn.send(wire.Hello(os.getpgid(0)))
    except OSError:  # the worker went, or let this spare go
        return
    try:
        go = link.next_go(_QUIET)
    except queue.Empty:  # a spare has time: what a first process group costs, now
        _rehearse_start()
        go = link.next_go()
    if go is None:
        return
    payload, spec, worker, body, turn = go
    from .._shared import dask_internals

    dask_internals.act_for_worker(worker)
    link.begin(spec.placement.rank, spec.run_id)
    worker.link = link
    value: Any = None
    error: BaseException | None = None
    try:
        value = body.run(payload, spec, link, turn)
    except BaseException as exc:
        error = exc
    outcome = body.outcome(value, error)
    # Ending: a stop changes nothing now, and no handler (ours, or a DataLoader's SIGCHLD
    # one) may run in the middle of the last message. Blocking the signals in this thread
    # would not do: the kernel hands them to another one (the link's reader), and Python
    # runs the handler in this one all the same.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        sent_value = None if error is not None else cloudpickle.dumps(value)
    except Exception as exc:
        from ..errors import NotPicklableError

        error = NotPicklableError(
            f"rank {spec.placement.rank}'s return value", f"{type(exc).__name__}: {exc}"
        )
        outcome = body.outcome(None, error)
        sent_value = None
    # A small value also rides on the final marker: the supervisor holds it, for a
    # result() after this worker left.
    outcome = outcome.holding(sent_value, spec.events.result_limit)
    sys.stdout.flush()
    sys.stderr.flush()
    if link.channel is not None:  # its last records and the final marker, then the end
        undelivered = link.channel.close(outcome)
        if undelivered is not None and error is None:
            error, sent_value = undelivered, None
    sent_error = None if error is None else cloudpickle.dumps(_picklable(error))
    link.end(sent_value, sent_error, outcome)
    # Its word is out: a stop now just ends the process, and one that came while signals
    # were ignored skips the teardown (a group's destroy may wait for a stopped peer).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if link.stop_told.is_set():
        os._exit(0)
    with contextlib.suppress(OSError):  # what is left (its teardown, its exit) yields the CPU
        os.nice(19)
    if error is None:
        with contextlib.suppress(Exception):  # its task returned: nobody to tell
            body.finish()
    # At once: Python's own shutdown would wait for every thread the rank left (a saver's
    # pool, a client's loop) while its task and the next attempt wait for this process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

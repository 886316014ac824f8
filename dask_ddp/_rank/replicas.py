"""Checkpoints kept in other workers' memory: each worker's replica store, and a rank's way
to it.

A rank that saves a checkpoint asynchronously (:mod:`dask_ddp._rank.saving`) also sends the bytes
``torch.save`` made of it to another worker, its *holder* (chosen by the job's supervisor:
a worker on another host when the job spans several, see
:func:`dask_ddp._shared.placement.replica_holders`), once the durable copy has landed. A restart
after a lost worker then loads the state from the holder's memory over the network, with no
storage round trip; the supervisor decides, attempt by attempt, which copy each rank reads
(:mod:`dask_ddp._scheduler.ledger`), and the durable copy stays the fallback.

- :class:`ReplicaStore` is one worker process's store: the newest checkpoint of each
  (job, writer) only, bounded by a fraction of the worker's memory limit, cleared when the
  job ends (:func:`drop_job`, run by the supervisor). It keeps bytes and never unpickles.
- :class:`ReplicaPlugin`, a worker plugin the scheduler plugin installs on every worker,
  serves it to other workers through one RPC handler (added as the events' large-message
  handler is, :func:`dask_ddp._shared.dask_internals.add_worker_handler`).
- :class:`PeerLink` is a rank's side: reserve room, send, fetch; worker to worker, never
  through the scheduler.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from .._shared import dask_internals

logger = logging.getLogger(__name__)

__all__ = ["STORE", "PeerLink", "ReplicaPlugin", "ReplicaStore", "drop_job", "held_for"]

_HANDLER = "dask_ddp_replica"
#: A replica travels to a restarted rank in pieces of this many bytes: each lands in the
#: rank's buffer before the next is read, and stays under glibc's largest mmap threshold,
#: so that the pieces' memory is reused rather than mapped and faulted in afresh.
PIECE = 16 * 2**20
#: A store refuses a replica that would take its worker's memory past this fraction of the
#: worker's memory limit (the fraction at which Dask pauses a worker by default).
HEADROOM = 0.8

Key = tuple[str, int, "int | None"]  # job, writer rank, world size (per-rank state) or None


@dataclasses.dataclass
class _Entry:
    step: int | None  # None: room reserved, the bytes are on their way
    nbytes: int
    data: Any = None
    serial: int = 0  # which put: pieces of one replica all come from the same


def process_memory() -> int:
    """This process's resident memory, in bytes."""
    import psutil

    return psutil.Process().memory_info().rss


def memory_limit(worker: Any) -> int:
    """``worker``'s memory limit in bytes; the machine's memory for a worker without one."""
    limit = getattr(worker, "memory_limit", None)
    if limit:
        return int(limit)
    import psutil

    return int(psutil.virtual_memory().total)


class ReplicaStore:
    """The replicas one worker process holds for other workers' ranks.

    One entry per (job, writer rank, world size): a newer checkpoint replaces the older,
    and what all entries hold together stays under a budget the caller gives.

    Examples
    --------
    >>> store = ReplicaStore()
    >>> store.reserve(("3f2a", 0, None), 3, budget=10, memory=None)
    >>> store.put(("3f2a", 0, None), 5, b"abc")
    True
    >>> data, serial = store.get(("3f2a", 0, None), 5)
    >>> bytes(data), store.get(("3f2a", 0, None), 4)
    (b'abc', None)
    >>> store.reserve(("9c1d", 0, None), 8, budget=10, memory=None)
    'it holds 3 bytes of replicas already, and 8 more would pass its 10 bytes'
    >>> store.drop("3f2a"), store.nbytes
    (1, 0)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Key, _Entry] = {}
        self._serials = itertools.count(1)

    @property
    def nbytes(self) -> int:
        """Bytes held and reserved."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def reserve(
        self, key: Key, nbytes: int, *, budget: int, memory: tuple[int, int] | None
    ) -> str | None:
        """Make room for a replica of ``nbytes`` under ``key`` (dropping the older one it
        replaces); return why not, if it does not fit ``budget`` or the worker's memory
        (``memory``: its process's bytes now and its limit)."""
        with self._lock:
            old = self._entries.pop(key, None)
            held = sum(e.nbytes for e in self._entries.values())
            if held + nbytes > budget:
                why = (
                    f"it holds {held} bytes of replicas already, and {nbytes} more would "
                    f"pass its {budget} bytes"
                )
            elif memory is not None and memory[0] - (old.nbytes if old else 0) + nbytes > (
                HEADROOM * memory[1]
            ):
                why = (
                    f"its worker uses {memory[0]} of {memory[1]} bytes, and {nbytes} more "
                    f"would pass {HEADROOM:.0%} of its memory limit"
                )
            else:
                self._entries[key] = _Entry(None, nbytes)
                return None
            return why

    def put(self, key: Key, step: int, data: Any) -> bool:
        """Keep ``data`` as ``key``'s replica of ``step`` in the room reserved for it."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.step is not None:
                return False  # not reserved (dropped meanwhile: the job ended)
            entry.step, entry.data, entry.nbytes = step, data, len(data)
            entry.serial = next(self._serials)
            return True

    def get(self, key: Key, step: int) -> tuple[Any, int] | None:
        """``key``'s replica of ``step`` and which put it came from, or None if it holds
        another step or none."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.step != step:
                return None
            return entry.data, entry.serial

    def drop(self, job: str, key: tuple[int, int | None] | None = None) -> int:
        """Forget ``job``'s replicas (only that of ``key``, ``(writer, world size)``, if
        given); return how many."""
        with self._lock:
            keys = [k for k in self._entries if k[0] == job and key in (None, k[1:])]
            for k in keys:
                del self._entries[k]
            return len(keys)

    def held(self) -> dict[Key, int | None]:
        """Each key held and its step (None: reserved), for tests and diagnostics."""
        with self._lock:
            return {k: e.step for k, e in self._entries.items()}


#: This worker process's store.
STORE = ReplicaStore()


def _handle(
    worker: Any,
    action: str,
    job: str = "",
    writer: int = 0,
    world_size: int | None = None,
    step: int = 0,
    nbytes: int = 0,
    fraction: float = 0.0,
    data: Any = None,
    offset: int = 0,
    length: int | None = None,
    *,
    remote: bool = True,
) -> dict[str, Any]:
    """``reserve``, ``put``, ``get`` or ``drop`` a replica of this process's store, for
    another worker (``remote``: bytes travel as their own frames) or a rank of this one.
    ``get`` answers ``length`` bytes from ``offset`` (all by default) and the replica's
    size."""
    key = (job, writer, world_size)
    if action == "reserve":
        limit = memory_limit(worker)
        why = STORE.reserve(
            key, nbytes, budget=int(fraction * limit), memory=(process_memory(), limit)
        )
        return {"status": "OK"} if why is None else {"status": "refused", "why": why}
    if action == "put":
        return {"status": "OK" if STORE.put(key, step, data) else "missing"}
    if action == "get":
        held = STORE.get(key, step)
        if held is None:
            return {"status": "missing"}
        found, serial = held
        size = len(found)
        if offset or (length is not None and length < size):
            end = size if length is None else offset + length
            found = memoryview(found).cast("B")[offset:end]
        if remote:
            from distributed.protocol import to_serialize

            found = to_serialize(found)
        return {"status": "OK", "data": found, "nbytes": size, "serial": serial}
    if action == "drop":
        return {"status": "OK", "dropped": STORE.drop(job)}
    return {"status": "error", "why": f"unknown action {action!r}"}


class ReplicaPlugin(WorkerPlugin):
    """Serves this worker's :data:`STORE` to the other workers.

    Registered by dask-ddp's scheduler plugin; the scheduler installs it on every worker,
    and on workers that join later.
    """

    name = "dask-ddp-replicas"
    idempotent = True

    def setup(self, worker: Any) -> None:
        async def dask_ddp_replica(**kwargs: Any) -> dict[str, Any]:
            return _handle(worker, **kwargs)

        dask_internals.add_worker_handler(worker, _HANDLER, dask_ddp_replica)

    def teardown(self, worker: Any) -> None:
        dask_internals.remove_worker_handler(worker, _HANDLER)


def drop_job(job: str, key: tuple[int, int | None] | None = None, dask_worker: Any = None) -> int:
    """Run on a worker (``Client.run``): forget every replica of ``job`` (it ended), or the
    one of ``key``, ``(writer, world size)`` (it moved to another worker)."""
    return STORE.drop(job, None if key is None else (key[0], key[1]))


def held_for(job: str, dask_worker: Any = None) -> list[tuple[int, int | None, int]]:
    """Run on a worker (``Client.run``): ``(writer, world size, step)`` of each replica of
    ``job`` it keeps."""
    return [
        (writer, world, step)
        for (held_job, writer, world), step in STORE.held().items()
        if held_job == job and step is not None
    ]


#: Seconds a holder has to answer a replica's reservation before the put counts as failed.
RESERVE_TIMEOUT = 5.0


class PeerLink:
    """A rank's way to the replica stores: its own holder's, and any other's on restore.

    Parameters
    ----------
    worker : distributed.Worker
        The rank's worker (its connections and event loop carry the calls).
    job : str
        The job's id (the same for all its attempts).
    timeout : float
        Seconds one call may take before it counts as failed.
    piece : int
        Bytes a fetched replica travels in, a call each (:data:`PIECE`).
    """

    def __init__(
        self, worker: Any, job: str, *, timeout: float = 300.0, piece: int = PIECE
    ) -> None:
        self.worker, self.job, self.timeout, self.piece = worker, job, timeout, piece

    def _call(self, holder: str, timeout: float | None = None, **kwargs: Any) -> dict[str, Any]:
        if holder == self.worker.address:  # this process's own store: no connection
            return _handle(self.worker, remote=False, **kwargs)
        within = self.timeout if timeout is None else min(timeout, self.timeout)
        return dask_internals.call_peer(self.worker, holder, _HANDLER, within, **kwargs)

    def put(
        self,
        holder: str,
        writer: int,
        world_size: int | None,
        step: int,
        data: Any,
        fraction: float,
    ) -> str | None:
        """Keep ``data`` (a checkpoint's bytes) in ``holder``'s memory; return why not."""
        from distributed.protocol import to_serialize

        local = holder == self.worker.address
        key = {"job": self.job, "writer": writer, "world_size": world_size}
        # The reservation is small: a holder that does not answer it soon has left (a
        # connection to a gone worker is tried again until distributed's connect timeout,
        # 30 s, while the rank's next save waits).
        reply = self._call(
            holder, RESERVE_TIMEOUT, action="reserve", nbytes=len(data), fraction=fraction, **key
        )
        if reply.get("status") != "OK":
            return str(reply.get("why") or reply)
        sent = data if local else to_serialize(data)
        reply = self._call(holder, action="put", step=step, data=sent, **key)
        return None if reply.get("status") == "OK" else "the job's replicas were dropped"

    def fetch(self, holder: str, writer: int, world_size: int | None, step: int) -> Any:
        """The bytes of ``writer``'s checkpoint of ``step`` held by ``holder``, or None.

        From this process's own store: the store's bytes themselves (read them, never
        write). From another worker: a ``torch.uint8`` tensor of this rank's own, filled
        piece by piece (``piece`` bytes, two in flight), so that the pieces land in
        one aligned buffer that loaded tensors may share (:func:`dask_ddp._rank.checkpoint.load`)
        and at most two pieces are held twice.
        """
        key = {"job": self.job, "writer": writer, "world_size": world_size, "step": step}
        local = holder == self.worker.address
        piece = self.piece
        first = self._call(holder, action="get", length=None if local else piece, **key)
        if first.get("status") != "OK":
            return None
        if local:
            return first["data"]
        import torch

        size = first["nbytes"]
        buffer = torch.empty(size, dtype=torch.uint8)
        into = buffer.numpy()

        def land(index: int, reply: dict[str, Any]) -> bool:
            if reply.get("status") != "OK" or reply["serial"] != first["serial"]:
                return False  # dropped or put again meanwhile
            data = memoryview(reply["data"]).cast("B")
            into[index * piece : index * piece + len(data)] = data
            return True

        calls = [dict(key, action="get", offset=at, length=piece) for at in range(0, size, piece)]
        land(0, first)
        complete = dask_internals.call_peer_each(
            self.worker, holder, _HANDLER, self.timeout, calls[1:],
            lambda i, reply: land(i + 1, reply),
        )  # fmt: skip
        return buffer if complete else None

"""A worker's host for its ranks: one object per Dask worker that owns everything the
worker keeps for them.

:class:`RankHost` is the interface the rank task and the worker's handlers
(:mod:`dask_ddp._rank.tasks`) use, whatever runs the ranks; :func:`host_for` finds a
worker's. Two implementations:

- :class:`ProcessHost` (every real worker): each rank is a process of its own forked from
  the worker's template (:mod:`dask_ddp._rank.template`). It owns the template it forks
  from (its nanny's, or its own), the spare rank processes forked ahead (as many as its
  last job ran ranks here), the reaper of ended ranks' processes, their process groups,
  the GPU count (counted once, in a process forked for it), the store host that holds
  rank 0's stores (:mod:`dask_ddp._rank.storehost`) and the store opened ahead for the next
  rank 0.
- ``dask_ddp._rank.lanes.LaneHost`` (benchmarks of the control plane at scale): many
  workers in one process, each rank a thread of its worker's (:func:`use_lanes`).

Each also owns its worker's :class:`~dask_ddp._rank.slot.ProcessSlot`: the ranks that run
there, their stops, the stores waiting for a rank 0, grow requests. No module global holds
a worker's or a job's state: the registry maps each worker to its host, and the host holds
the rest.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .._shared.protocol import RankOutcome, RankSpec
from . import rankproc, storehost, template
from .slot import LEFTOVER_DELAY, PROCESS, ProcessSlot, RankRun

logger = logging.getLogger(__name__)

__all__ = ["ProcessHost", "RankHost", "RankWork", "dask_setup", "host_for", "use_lanes"]

Ending = tuple[Any, "BaseException | None", RankOutcome]


@dataclasses.dataclass
class RankWork:
    """One rank to run, as the rank task hands it to its worker's host: what a host of
    either kind needs (the task's own functions, so that hosts never import the task).

    Attributes
    ----------
    payload : bytes
        ``(fn, args, kwargs)`` as the client pickled them.
    spec : RankSpec
        The rank's plan.
    run : RankRun
        The rank's run in the worker (its channel; its process, once started).
    worker : distributed.Worker
        The rank's worker.
    body : dask_ddp._rank.rankproc.RankBody
        What a rank's own process runs.
    handlers : callable
        Builds what a rank's process may ask of its worker, by name.
    in_thread : callable
        Runs the rank in the calling thread (a lane) and returns its value.
    """

    payload: bytes
    spec: RankSpec
    run: RankRun
    worker: Any
    body: Any
    handlers: Callable[[], dict[str, Callable[..., Any]]]
    in_thread: Callable[[], Any]


class RankHost(abc.ABC):
    """What runs a worker's ranks, and everything it keeps for them (its ``slot``)."""

    def __init__(self, worker: Any, slot: ProcessSlot) -> None:
        self.worker = weakref.proxy(worker) if worker is not None else None
        self.slot = slot

    @abc.abstractmethod
    def get_ready(self) -> None:
        """As the worker joins, in the background: be ready for its first rank."""

    @abc.abstractmethod
    async def warm(self) -> None:
        """(On the worker's loop, for the probe.) Be ready for a rank now; returns at once
        when it is."""

    @abc.abstractmethod
    def gpu_count(self) -> int:
        """The GPUs the worker's ranks see (counted once; a thread of the worker's)."""

    @property
    def gpus_counted(self) -> bool:
        """Whether :meth:`gpu_count` answers at once (the worker's loop may call it)."""
        return False

    @abc.abstractmethod
    def open_store(self, job_id: str, timeout: float) -> int:
        """(A thread of the worker's.) Open ``job_id``'s store on the worker's address and
        keep it in the slot for the job's rank 0; its port."""

    def store_ready(self, job_id: str, timeout: float) -> int | None:
        """The port of a store opened ahead and given to ``job_id`` (kept in the slot), if
        one waits; never blocks."""
        return None

    @abc.abstractmethod
    def run(self, work: RankWork) -> Ending:
        """Run the rank; its value, its error (None on success) and how it ended."""

    def rank_ended(self, spec: RankSpec) -> None:  # noqa: B027 (a hook: nothing by default)
        """The rank task of ``spec`` ended (its process may still tear down)."""

    @abc.abstractmethod
    def release_waits(self, active: list[RankRun], unclaimed: Any) -> None:
        """Release the stopped job's ranks that wait in C++ at the rendezvous or at a
        checkpoint (in the background): ``active`` its runs here, ``unclaimed`` its store,
        opened here for a rank 0 that never started (or None)."""


class ProcessHost(RankHost):
    """A worker whose ranks are processes of their own, forked from its template."""

    def __init__(self, worker: Any) -> None:
        super().__init__(worker, PROCESS)  # the worker's own process holds its ranks
        self.template: template.Template = template.own()
        self.stores = storehost.StoreHost(self.fork_helper)
        self.store_ahead = _StoreAhead(self)
        self._gpus: int | None = None
        self._lock = threading.Lock()  # the spares, the groups, the ranks exiting
        self._refilling = threading.Lock()  # one fork of a spare at a time
        self._spares: list[rankproc.Spare] = []  # a rank process is never reused
        self._wanted = 1  # spares kept: the most ranks a job ran here at once
        self._groups: set[int] = set()  # the process groups of the rank processes forked here
        self._exiting: set[rankproc.RankProcess] = set()  # ended ranks still tearing down
        self._reaper: queue.SimpleQueue[rankproc.RankProcess] | None = None
        self._getting_ready: set[asyncio.Future[None]] = set()

    # -- the template ---------------------------------------------------------------------
    async def find_template(self) -> None:
        """Ask the worker's nanny for its process's template (:func:`template.find`), unless
        the one it has still forks."""
        self.template = await template.find(self.worker, self.template)

    def _again_if_lost(self, start: Callable[[], Any]) -> Any:
        """``start()``, and once more after finding the template again if it failed because
        the template went (its nanny's, which starts another)."""
        try:
            return start()
        except OSError:
            if self.template.alive():
                raise
        from .._shared import dask_internals

        dask_internals.on_worker_loop(self.worker, self.find_template)
        return start()

    def fork_helper(self, target: Callable[..., None], args: tuple, conns: list[Any]) -> Any:
        """(A thread of the worker's.) A helper process forked from the template
        (:func:`dask_ddp._rank.rankproc.fork_helper`); ``conns``, the helper's ends of its
        links, are closed here once it has them."""
        try:
            return self._again_if_lost(
                lambda: rankproc.fork_helper(self.template, target, args, conns)
            )
        finally:
            for conn in conns:
                conn.close()

    # -- getting ready ----------------------------------------------------------------------
    def get_ready(self) -> None:
        """On the worker's event loop, in the background: find its template (its nanny's,
        which answers once the worker has started: awaited here, the worker's start would
        wait for itself), then, in a thread, start it if it is the worker's own and fork the
        first spare. A failure is left to the next probe, which does both again and says
        why."""

        def ready() -> None:
            try:
                self._warm_now()
            except Exception:
                logger.debug("the rank template did not start ahead of the rank", exc_info=True)

        async def find_then_fork() -> None:
            await self.find_template()
            threading.Thread(target=ready, name="dask-ddp-ready", daemon=True).start()

        task = asyncio.ensure_future(find_then_fork())
        self._getting_ready.add(task)  # held until done (the loop keeps a weak reference)
        task.add_done_callback(self._getting_ready.discard)

    def _warm_now(self) -> None:
        """(A thread of the worker's.) Start the template if it is the worker's own and not
        running, and fork the spares: the next rank then waits for neither the template's
        imports (1-3 s) nor a fork (tens of milliseconds)."""
        self.template.start()
        self.refill(find=True)

    async def warm(self) -> None:
        if not self.spare_waits():
            await self.find_template()
            await asyncio.get_running_loop().run_in_executor(None, self._warm_now)

    def gpu_count(self) -> int:
        """Counted once, in a process forked from the template for it: the worker never
        imports torch, the template never starts CUDA (its forks could not use it), nor
        does a spare before its rank's CUDA_VISIBLE_DEVICES is set."""
        if self._gpus is None:
            self._gpus = rankproc.count_gpus(self.fork_helper)
        return self._gpus

    @property
    def gpus_counted(self) -> bool:
        return self._gpus is not None

    # -- rank 0's stores --------------------------------------------------------------------
    def open_store(self, job_id: str, timeout: float) -> int:
        store = self.stores.open(self.worker.ip, timeout)
        self.slot.put_store(job_id, store)
        return store.port

    def store_ready(self, job_id: str, timeout: float) -> int | None:
        return self.store_ahead.take(job_id, self.worker.ip, timeout)

    def rank_ended(self, spec: RankSpec) -> None:
        if spec.placement.rank == 0:  # its job's store was taken: the next one's, ahead
            self.store_ahead.open_later()

    # -- spares -------------------------------------------------------------------------------
    def groups_alive(self) -> set[int]:
        """The process groups of the rank processes forked here that still have a process
        in them: its spares', its running ranks', and any a stop left behind. (They are
        not the worker's children: the template's, which may be its nanny's.)"""
        with self._lock:
            self._groups = {g for g in self._groups if rankproc.group_alive(g)}
            return set(self._groups)

    def spare_groups(self) -> set[int]:
        """The process groups of the spares that wait (each leads its own)."""
        with self._lock:
            return {spare.process.pid for spare in self._spares}

    def spare_waits(self) -> bool:
        """Whether a spare rank process waits for the next rank (the template, then, runs)."""
        with self._lock:
            return any(spare.process.exitcode is None for spare in self._spares)

    def _fork(self, find: bool) -> rankproc.Spare:
        def fork() -> rankproc.Spare:
            return rankproc.fork_spare(self.template)

        spare = self._again_if_lost(fork) if find else fork()
        self.groups_alive()  # (the ones gone forgotten)
        with self._lock:
            self._groups.add(spare.process.pid)  # it leads a group of its own
        return spare

    def refill(self, find: bool = False) -> None:
        """Fork spares until as many wait as the host keeps (the worker plugin and a first
        probe both ask on a fresh worker: one fork at a time); ``find`` (a thread of the
        worker's): find the template again if it went."""
        with self._refilling:
            while True:
                with self._lock:
                    self._spares = [s for s in self._spares if s.process.exitcode is None]
                    if len(self._spares) >= self._wanted:
                        return
                spare = self._fork(find)
                with self._lock:
                    self._spares.append(spare)

    def refill_quietly(self) -> None:
        """:meth:`refill` in the background: a failure only means the next rank forks its
        own."""
        try:
            self.refill()
        except Exception:  # the worker is closing
            logger.debug("could not fork a spare rank process", exc_info=True)

    def take_spare(self, ranks_here: int) -> rankproc.Spare:
        """A spare rank process (forked now if none waits), once the ranks that ended here
        before it and started CUDA are gone (their GPU memory freed; each within its
        grace). ``ranks_here``: the ranks of its job on this worker, which keeps as many
        spares from now on."""
        with self._lock:
            self._wanted = max(1, ranks_here)
            spare = self._spares.pop(0) if self._spares else None
            exiting = [handle for handle in self._exiting if handle.used_cuda]
        for handle in exiting:
            handle.process.join(handle.grace)
            handle.ended()
        if spare is None or spare.process.exitcode is not None:
            spare = self._fork(find=True)
        return spare

    def end_later(self, handle: rankproc.RankProcess) -> None:
        """The rank said how it ended: its process tears down (its group destroyed) and
        exits while its task returns; what is left of its group after its grace is killed.
        The next spare is forked once it is gone: the forks and exits of a job's ranks
        (about 20 ms of CPU each) come after its results, not among them. The host's one
        reaper thread waits for it: the task returns without starting a thread."""
        with self._lock:
            self._exiting.add(handle)
            if self._reaper is None:
                self._reaper = queue.SimpleQueue()
                threading.Thread(
                    target=self._reap, args=(self._reaper,), name="dask-ddp-rank-exit",
                    daemon=True,
                ).start()  # fmt: skip
            self._reaper.put(handle)

    def _reap(self, ended: queue.SimpleQueue[rankproc.RankProcess]) -> None:
        while True:
            handle = ended.get()
            handle.process.join(handle.grace)
            handle.ended()
            with self._lock:
                self._exiting.discard(handle)
            self.refill_quietly()

    # -- a rank ---------------------------------------------------------------------------------
    def run(self, work: RankWork) -> Ending:
        """The rank in a process of its own (:func:`dask_ddp._rank.rankproc.run`), served by
        this worker; rank 0's store stays here, in the worker, until the rank ends."""
        spec, run, slot = work.spec, work.run, self.slot
        if spec.placement.rank == 0:
            store = run.store = slot.store_for(spec)
            # Rank 0's store outlives its task by a moment (its peers may still read the last
            # rendezvous word): let go with the run's leftovers.
            run.leftover = store

        def on_start(process: rankproc.RankProcess) -> None:
            with slot.lock:
                run.process = process
                reason, failed_rank = run.stop_reason, run.stop_failed_rank
            if reason is not None:  # stopped while it started
                process.stop(reason, failed_rank)

        return rankproc.run(
            work.payload, spec, work.worker, work.body, host=self, channel=run.channel,
            handlers=work.handlers(), on_start=on_start, grace=spec.failure_grace,
        )  # fmt: skip

    def release_waits(self, active: list[RankRun], unclaimed: Any) -> None:
        """Through the job's store, held here (rank 0's, or one its rank 0 never took): no
        connection to a store that may be gone, whose failed tries c10d logs for seconds."""
        held = [r.store for r in active if r.store is not None]
        store = unclaimed if unclaimed is not None else (held[0] if held else None)
        if store is not None:
            threading.Thread(
                target=release_waiters_in, args=(store,), name="dask-ddp-release", daemon=True
            ).start()


class _StoreAhead:
    """A store opened on this worker ahead of the next job whose rank 0 it hosts: a warm
    worker's probe hands it over at once, without a thread hop or the open (on 2 cores with
    8 ranks starting, 2-4 ms of every launch). Opened once a rank 0 ended here (its job's
    store taken), not while a launch needs the CPU; a probe that finds none opens one."""

    def __init__(self, host: ProcessHost) -> None:
        self._host = host
        self._lock = threading.Lock()
        self._ahead: tuple[str, Any] | None = None  # (address, store)

    def take(self, job_id: str, address: str, timeout: float) -> int | None:
        """Give the store opened ahead on ``address`` to ``job_id`` (kept in the slot); its
        port, or None if none waits."""
        with self._lock:
            ahead, self._ahead = self._ahead, None
        if ahead is None or ahead[0] != address:
            return None
        store = ahead[1]
        try:
            store.set_timeout(timedelta(seconds=timeout))
        except ConnectionError:  # its store host went (the probe opens another)
            logger.debug("the store opened ahead on %s is gone", address, exc_info=True)
            return None
        self._host.slot.put_store(job_id, store)
        return store.port

    def open_later(self) -> None:
        """Open the next one :data:`~dask_ddp._rank.slot.LEFTOVER_DELAY` from now, on a
        timer's thread (the task that ended has reported its end by then)."""
        timer = threading.Timer(LEFTOVER_DELAY, self._open)
        timer.daemon = True
        timer.start()

    def _open(self) -> None:
        with self._lock:
            if self._ahead is not None:
                return
        address = self._host.worker.ip
        try:
            store = self._host.stores.open(address, _STORE_AHEAD_TIMEOUT)
        except Exception:  # the next probe opens one, and says what fails
            logger.debug("could not open a store ahead on %s", address, exc_info=True)
            return
        with self._lock:
            if self._ahead is None:
                self._ahead, store = (address, store), None
        del store  # one opened meanwhile: this one closes


_STORE_AHEAD_TIMEOUT = 300.0  # seconds: replaced by the job's rendezvous timeout when taken

#: A stopped job's rendezvous word: ranks waiting for it stop.
ABORTED = b"aborted"
STAGES = ("joined", "initialised")


def release_waiters_in(store: Any) -> None:
    """Wake every rank of a job that waits in the rendezvous or for rank 0's word at a
    checkpoint (:func:`dask_ddp._rank.resize.at_checkpoint`), marked as aborted, through
    ``store`` (the job's store or a connection to it).

    A thread inside a C++ store wait (``get``) sees no stop until it returns; without
    this a stopped job's ranks would wait out the rendezvous timeout and cost their
    workers a restart.
    """
    from . import resize

    try:
        for stage in STAGES:
            store.compare_set(f"dask-ddp/{stage}-ready", "", ABORTED)
        resize.release_waiters(store, ABORTED)  # or at a checkpoint of an elastic job
    except Exception:  # the store is gone: nobody waits on it
        logger.debug("could not release the rendezvous", exc_info=True)


def release_waiters_at(master: tuple[str, int], timeout: float = 5.0) -> None:
    """:func:`release_waiters_in` through a new connection to the job's store at
    ``master`` (host, port); nothing if it is gone (nobody waits on it)."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(*master, is_master=False, timeout=timedelta(seconds=timeout))
    except Exception:  # the store is gone: nobody waits on it
        logger.debug("could not release the rendezvous at %s:%d", *master, exc_info=True)
        return
    release_waiters_in(store)


# -- which host a worker has ------------------------------------------------------------------


class _Registry:
    """Each worker's host, made on first use (of the kind this process hosts)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hosts: weakref.WeakKeyDictionary[Any, RankHost] = weakref.WeakKeyDictionary()
        self.kind: Callable[[Any], RankHost] = ProcessHost
        self.unattached: RankHost | None = None  # for calls made outside any worker


_registry = _Registry()


def host_for(worker: Any) -> RankHost:
    """``worker``'s host (a ``distributed.Worker``), made on first use; None (a handler
    called outside a worker, as the tests call them): this process's own."""
    with _registry.lock:
        if worker is None:
            if _registry.unattached is None:
                _registry.unattached = _registry.kind(None)
            return _registry.unattached
        host = _registry.hosts.get(worker)
        if host is None:
            host = _registry.hosts[worker] = _registry.kind(worker)
        return host


def use_lanes(kind: Callable[[Any], RankHost]) -> None:
    """From now on, this process's workers get hosts of ``kind`` (``lanes.LaneHost``: many
    workers in one process, each rank a thread)."""
    with _registry.lock:
        _registry.kind = kind


def dask_setup(worker: Any) -> None:
    """Dask's preload hook (the command line's own LocalCluster preloads this module): the
    worker's host gets ready for its ranks as the worker starts."""
    host_for(worker).get_ready()

"""The per-process state of the rank side: one slot per worker process, one run in it.

One rank runs per worker process at a time: the default process group, the environment and
the torch thread count are per process. :data:`PROCESS` is that process's
:class:`ProcessSlot`; a rank task claims it for its :class:`RankRun` (queuing behind another
job's rank, as Dask queues tasks on a single-threaded worker) and releases it when it ends.
Everything the rank side used to keep in module globals lives here: the running rank (for
:func:`dask_ddp.bootstrap.abort_rank`), the job stores opened before launch, and what the
user's function sees through :mod:`dask_ddp.context` (context, channel, checkpoints,
datasets).

A process that hosts many Dask workers to simulate ranks (:mod:`dask_ddp._lanes`, which
measures the control plane at 1,000 ranks on a few processes) gives each worker a slot of
its own instead, a *lane* (:func:`host_lanes`): rank code finds its slot with
:func:`slot_for` (a worker's handlers) and :func:`this_slot` (the rank's own thread), which
are :data:`PROCESS` everywhere else.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .events import RankChannel

__all__ = [
    "PROCESS",
    "CheckpointSettings",
    "ProcessSlot",
    "RankContext",
    "RankRun",
    "Restore",
    "host_lanes",
    "slot_for",
    "this_slot",
]

logger = logging.getLogger(__name__)

_STOPPED_KEPT = 64  # jobs remembered as stopped before their rank started


@dataclasses.dataclass(frozen=True)
class RankContext:
    """What a rank knows about itself, in torchrun's terms.

    Attributes
    ----------
    rank : int
        Global rank, ``0 <= rank < world_size``. Not stable across restarts.
    local_rank : int
        Rank among the ranks on this host, from 0.
    world_size : int
        Number of ranks in the job.
    local_world_size : int
        Number of ranks on this host.
    node_rank : int
        Index of this host among the job's hosts, from 0.
    device : torch.device
        The rank's own GPU, ``cuda:<local_rank>`` (every rank of a host sees the same
        ``CUDA_VISIBLE_DEVICES``, its own GPU at index ``LOCAL_RANK``, as under torchrun),
        else ``cpu``. It is the current CUDA device while the rank runs.
    backend : str
        The torch.distributed backend of the process group (``"gloo"`` or ``"nccl"``).
    attempt : int
        0 for the first run of the job, incremented on every restart.
    job_id : str
        The job's identifier; task keys are ``ddp_<name>_<id[:6]>_rank<rank>-<job_id>``.
    worker : str
        Address of the Dask worker running this rank.
    master_addr, master_port
        Where the process group's store listens (rank 0's host).

    Examples
    --------
    >>> def train():                                # doctest: +SKIP
    ...     ctx = dask_ddp.get_context()
    ...     model = DDP(make_model().to(ctx.device))
    ...     if ctx.rank == 0:
    ...         print(f"{ctx.world_size} ranks on {ctx.backend}, attempt {ctx.attempt}")
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str
    attempt: int
    job_id: str
    worker: str
    master_addr: str
    master_port: int


@dataclasses.dataclass(frozen=True)
class Restore:
    """Where a rank of a new attempt finds a checkpoint, as the job's supervisor decided.

    Attributes
    ----------
    step : int
        The checkpoint's step.
    source : str
        ``"peer"``: a replica held in the memory of the worker ``holder``; ``"store"``: the
        durable copy at ``url``.
    writer : int
        Whose checkpoint: 0 for the job's state, the rank for per-rank state.
    world_size : int or None
        For per-rank state, the number of ranks that wrote it; None for the job's state.
    holder : str or None
        The worker holding the replica (``source="peer"``).
    url : str or None
        The durable copy, the fallback when the replica cannot be read.

    Examples
    --------
    >>> Restore(40, "peer", 0, holder="tcp://10.0.0.2:4242").describe()
    'the replica of step 40 in the memory of tcp://10.0.0.2:4242'
    """

    step: int
    source: str
    writer: int = 0
    world_size: int | None = None
    holder: str | None = None
    url: str | None = None

    def describe(self) -> str:
        """Where it is, in words."""
        if self.source == "peer":
            return f"the replica of step {self.step} in the memory of {self.holder}"
        return f"{self.url or 'the store'} (step {self.step})"


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """Where a rank's checkpoints go (``launch(checkpoint_dir=...)``), resolved on the client,
    and where the rank's state comes from on a restart (decided by the supervisor)."""

    directory: str | None
    keep_last: int | None = None
    storage_options: dict[str, Any] | None = None
    # an elastic job below its size: its ranks may stop at a checkpoint to grow, waiting
    # at most this long for rank 0's decision (None: the job cannot grow)
    grow_timeout: float | None = None
    # "async": save_checkpoint() returns once the state is copied, the write runs in the
    # background; "sync": it returns once the checkpoint is durable
    mode: str = "async"
    # the job's id (the same for all its attempts): replicas are kept under it
    job: str = ""
    # the worker that keeps this rank's replicas in memory (None: no replicas)
    replica_holder: str | None = None
    # the most of its worker's memory limit a replica store may fill
    replica_fraction: float = 0.25
    # where this rank's state comes from: the job's state, and its own (per-rank) state
    restore: tuple[Restore, ...] = ()


@dataclasses.dataclass
class RankRun:
    """One rank task's state in its worker process, from its start to its end.

    Attributes
    ----------
    job_id, key : str
        The job's run id and the rank task's key.
    rank : int
        The global rank.
    thread_id : int
        The thread running the rank (where an abort is raised).
    channel : RankChannel or None
        The rank's channel to the client; status travels on it from the task's start.
    master : tuple of (str, int) or None
        The job's store, to release its rendezvous on abort.
    running : bool
        True while the user's function (or the set-up before it) may still be stopped.
    abort_reason : str or None
        Why the client stopped the rank, once it did.
    abort_failed_rank : int or None
        The rank whose failure made the client stop this one, if one did.
    links : frozenset of int
        Socket fds the process group opened (gloo), shut down on failure or abort.
    store : torch.distributed.TCPStore or None
        The job's store as this rank holds it (rank 0's listens): kept while the task runs.
    context : RankContext or None
        What :func:`dask_ddp.get_context` returns, while the user's function runs.
    checkpointing : CheckpointSettings or None
        Where :func:`dask_ddp.save_checkpoint` writes, while the user's function runs.
    dataset_plans, dataset_shards : dict
        This rank's share of ``launch(datasets=)``, and the shards opened from it.
    saver : dask_ddp._saving.Saver or None
        Writes the checkpoints the user's function saves, while it runs.
    resumer : dask_ddp._resume.Resumer or None
        Loads the checkpoints the user's function asks for, while it runs.
    on_end : list of callable
        Called when the run releases the slot (background helpers that end with the rank).
    pid : int
        The process the run belongs to (a forked DataLoader worker is another).
    """

    job_id: str
    key: str
    rank: int
    thread_id: int = dataclasses.field(default_factory=threading.get_ident)
    channel: RankChannel | None = None
    master: tuple[str, int] | None = None
    running: bool = True
    abort_reason: str | None = None
    abort_failed_rank: int | None = None
    links: frozenset[int] = frozenset()
    store: Any = None
    context: RankContext | None = None
    checkpointing: CheckpointSettings | None = None
    saver: Any = None
    resumer: Any = None
    dataset_plans: dict[str, Any] = dataclasses.field(default_factory=dict)
    dataset_shards: dict[str, Any] = dataclasses.field(default_factory=dict)
    on_end: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    pid: int = dataclasses.field(default_factory=os.getpid)


class ProcessSlot:
    """The one place per process where a rank runs.

    Examples
    --------
    >>> slot = ProcessSlot()
    >>> run = RankRun("3f2a", "dask-ddp-3f2a-rank-0", 0)
    >>> slot.claim(run, timeout=1.0)
    True
    >>> slot.current() is run
    True
    >>> slot.release(run); slot.current() is None
    True
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards run, stores and a run's running/abort fields
        self._free = threading.Condition(self.lock)
        self.run: RankRun | None = None
        self._stores: dict[str, Any] = {}
        self._grow_requests: set[str] = set()
        # Jobs stopped before their rank here started (the task was on its way): job id ->
        # (reason, failed rank). The newest few only: a rank starts within seconds or never.
        self._stopped: collections.OrderedDict[str, tuple[str, int | None]] = (
            collections.OrderedDict()
        )

    def current(self) -> RankRun | None:
        """The rank running in this process, if any (None in a process forked from it
        whose run has ended)."""
        return self.run

    def claim(
        self,
        run: RankRun,
        timeout: float,
        on_wait: Callable[[RankRun], None] | None = None,
    ) -> bool:
        """Make ``run`` the process's rank once the slot is free, within ``timeout`` s.

        ``on_wait(holder)`` is called (with the lock held) when another rank holds the slot.
        Returns False if it stayed taken.
        """
        with self._free:
            if self.run is not None and on_wait is not None:
                on_wait(self.run)
            if not self._free.wait_for(lambda: self.run is None, timeout=timeout):
                return False
            self.run = run
        return True

    def release(self, run: RankRun, after: Callable[[], None] | None = None) -> None:
        """End ``run``: its helpers stop, and the next rank may claim the slot.

        With ``after`` (the process group's teardown, which gloo makes take about 20 ms),
        that runs first, on a thread of its own: the rank's task returns at once, and the
        slot stays taken until the process is clean for the next rank.
        """
        with self.lock:
            run.running = False
        if after is None:
            self._free_slot(run)
            return

        def finish() -> None:
            try:
                after()
            except Exception:  # the next rank starts anyway: its own init says what is wrong
                logger.warning("job %s: rank %d's teardown failed", run.job_id, run.rank,
                               exc_info=True)  # fmt: skip
            finally:
                self._free_slot(run)

        threading.Thread(target=finish, name=f"dask-ddp-teardown-{run.job_id}", daemon=True).start()

    def _free_slot(self, run: RankRun) -> None:
        with self._free:
            if self.run is run:
                self.run = None
                self._free.notify_all()
        self.take_grow_request(run.job_id)  # a request that came too late dies with the run
        while run.on_end:
            run.on_end.pop()()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no rank holds this process (its teardown included); False on timeout.

        >>> ProcessSlot().wait_idle(0)
        True
        """
        with self._free:
            return self._free.wait_for(lambda: self.run is None, timeout=timeout)

    def stop_running(self, run: RankRun) -> None:
        """Mark ``run`` past the point where an abort may be raised in it."""
        with self.lock:
            run.running = False

    def put_store(self, job_id: str, store: Any) -> None:
        """Keep the TCPStore opened for ``job_id`` until its rank 0 takes it."""
        with self.lock:
            self._stores[job_id] = store

    def take_store(self, job_id: str) -> Any:
        """Hand over (and forget) the store of ``job_id``; None if there is none."""
        with self.lock:
            return self._stores.pop(job_id, None)

    def stop_before_start(self, job_id: str, reason: str, failed_rank: int | None) -> None:
        """Remember that ``job_id`` was stopped while no rank of it ran here: a rank of it
        that starts afterwards stops at once (see :meth:`stopped_before_start`).
        Call with :attr:`lock` held."""
        self._stopped[job_id] = (reason, failed_rank)
        while len(self._stopped) > _STOPPED_KEPT:
            self._stopped.popitem(last=False)

    def stopped_before_start(self, job_id: str) -> tuple[str, int | None] | None:
        """Why ``job_id`` was stopped before its rank started here, if it was."""
        with self.lock:
            return self._stopped.get(job_id)

    def request_grow(self, job_id: str) -> None:
        """Note that the client has workers for ``job_id`` to grow onto (on its rank 0's
        worker); its rank 0 takes the request at its next checkpoint."""
        with self.lock:
            self._grow_requests.add(job_id)

    def take_grow_request(self, job_id: str) -> bool:
        """Whether a grow was requested for ``job_id`` since the last call."""
        with self.lock:
            if job_id in self._grow_requests:
                self._grow_requests.discard(job_id)
                return True
            return False


#: This process's slot.
PROCESS = ProcessSlot()

# Worker -> its own slot, in a process that hosts lanes (None everywhere else).
_lanes: weakref.WeakKeyDictionary[Any, ProcessSlot] | None = None
_lanes_lock = threading.Lock()


def host_lanes() -> None:
    """Give each Dask worker of this process a slot of its own (a lane), from now on.

    For simulated ranks only (:mod:`dask_ddp._lanes`): the ranks of one process then run at
    once, sharing its environment, thread count and streams, so the rank task leaves those
    alone, and a rank must not start a process group (two in one process fail in torch).
    """
    global _lanes
    with _lanes_lock:
        if _lanes is None:
            _lanes = weakref.WeakKeyDictionary()


def slot_for(worker: Any) -> ProcessSlot:
    """The slot a rank on ``worker`` (a ``distributed.Worker``) runs in: :data:`PROCESS`,
    unless this process hosts lanes."""
    if _lanes is None:
        return PROCESS
    with _lanes_lock:
        slot = _lanes.get(worker)
        if slot is None:
            slot = _lanes[worker] = ProcessSlot()
        return slot


def this_slot() -> ProcessSlot:
    """The slot of the rank calling (from its own thread, in a process hosting lanes)."""
    if _lanes is None:
        return PROCESS
    from distributed import get_worker

    try:
        return slot_for(get_worker())
    except ValueError:  # not in a worker at all
        return PROCESS

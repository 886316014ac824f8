"""The per-process state of the rank side: one slot per worker process, one run in it.

One job's ranks run per worker process at a time (each rank in a process of its own, or
a rank in the rank's own process): :data:`PROCESS` is that process's :class:`ProcessSlot`;
a rank task claims it for its :class:`RankRun` (queuing behind another job's ranks, as Dask
queues tasks on a single-threaded worker; beside the other ranks of its own job on the
worker, ``launch(ranks_per_worker=)``) and releases it when it ends.
Everything the rank side used to keep in module globals lives here: the running rank (for
:func:`dask_ddp._rank.tasks.abort_rank`), the job stores opened before launch, and what the
user's function sees through :mod:`dask_ddp._rank.context` (context, channel, checkpoints,
datasets).

Each worker's host (:mod:`dask_ddp._rank.host`) holds its slot: :data:`PROCESS` for a real
worker. A process that hosts many Dask workers to simulate ranks (:mod:`dask_ddp._rank.lanes`,
which measures the control plane at 1,000 ranks on a few processes) gives each worker a
slot of its own instead, a *lane*, bound to the thread that runs its rank (:func:`bind`):
rank code finds its slot with :func:`this_slot`, :data:`PROCESS` everywhere else.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._shared.protocol import CheckpointPlan
from ..errors import RankStoppedError

if TYPE_CHECKING:
    import torch

    from .channel import RankChannel

__all__ = [
    "PROCESS",
    "CheckpointSettings",
    "ProcessSlot",
    "RankContext",
    "RankRun",
    "StopRequested",
    "bind",
    "this_slot",
]

logger = logging.getLogger(__name__)

_STOPPED_KEPT = 64  # jobs remembered as stopped before their rank started
#: Seconds after a rank's task ends before its destroyed process group is let go.
LEFTOVER_DELAY = 0.1


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
class CheckpointSettings(CheckpointPlan):
    """Where a rank's checkpoints go and where its state comes from (the supervisor's
    :class:`~dask_ddp._shared.protocol.CheckpointPlan`), and what the rank adds to it."""

    # the job's id (the same for all its attempts): replicas are kept under it
    job: str = ""
    # an elastic job below its size: its ranks may stop at a checkpoint to grow, waiting
    # at most this long for rank 0's decision (None: the job cannot grow)
    grow_timeout: float | None = None

    @classmethod
    def of(cls, plan: CheckpointPlan, job: str, grow_timeout: float | None) -> CheckpointSettings:
        fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
        return cls(**fields, job=job, grow_timeout=grow_timeout)


class StopRequested(BaseException):
    """Raised at a rank's safe point once the supervisor asked it to stop
    (:meth:`RankRun.check_stop`). A BaseException, so that ``except Exception`` in training
    code lets it through; the rank task ends with the :class:`~dask_ddp.RankStoppedError`
    it describes (:meth:`stopped`: a new one, which holds nothing of this one, so that it
    pickles back to the client without a cycle through its context)."""

    def __init__(self, rank: int, reason: str, job: str, failed_rank: int | None) -> None:
        super().__init__(rank, reason, job, failed_rank)
        self.rank, self.reason, self.job, self.failed_rank = rank, reason, job, failed_rank

    def stopped(self) -> RankStoppedError:
        return RankStoppedError(self.rank, self.reason, job=self.job, failed_rank=self.failed_rank)


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
        The thread running the rank.
    channel : RankChannel or None
        The rank's channel to the client; status travels on it from the task's start.
    master : tuple of (str, int) or None
        The job's store, to release its rendezvous on a stop.
    stop_reason : str or None
        Why the supervisor asked the rank to stop, once it did (:meth:`ProcessSlot.stop`):
        the rank raises :class:`~dask_ddp.RankStoppedError` at its next safe point.
    stop_failed_rank : int or None
        The rank whose failure made the supervisor stop this one, if one did.
    store : torch.distributed.TCPStore or None
        The job's store as this rank holds it (rank 0's listens): kept while the task runs.
    context : RankContext or None
        What :func:`dask_ddp.get_context` returns, while the user's function runs.
    checkpointing : CheckpointSettings or None
        Where :func:`dask_ddp.save_checkpoint` writes, while the user's function runs.
    dataset_plans, dataset_shards : dict
        This rank's share of ``launch(datasets=)``, and the shards opened from it.
    saver : dask_ddp._rank.saving.Saver or None
        Writes the checkpoints the user's function saves, while it runs.
    resumer : dask_ddp._rank.resume.Resumer or None
        Loads the checkpoints the user's function asks for, while it runs.
    on_end : list of callable
        Called when the run releases the slot (background helpers that end with the rank).
    leftover : object or None
        The rank's process group once destroyed, until :meth:`ProcessSlot.release` lets it
        go (its C++ teardown is slow).
    pid : int
        The process the run belongs to (a forked DataLoader worker is another).
    process : dask_ddp._rank.rankproc.RankProcess or None
        In the worker: the rank's own process, which a stop ends.
    relay : dask_ddp._rank.rankproc.RankLink or None
        In the rank's process: its link to its task in the worker.
    """

    job_id: str
    key: str
    rank: int
    thread_id: int = dataclasses.field(default_factory=threading.get_ident)
    channel: RankChannel | None = None
    master: tuple[str, int] | None = None
    stop_reason: str | None = None
    stop_failed_rank: int | None = None
    stop_raised: bool = False
    store: Any = None
    context: RankContext | None = None
    checkpointing: CheckpointSettings | None = None
    saver: Any = None
    resumer: Any = None
    dataset_plans: dict[str, Any] = dataclasses.field(default_factory=dict)
    dataset_shards: dict[str, Any] = dataclasses.field(default_factory=dict)
    on_end: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    pid: int = dataclasses.field(default_factory=os.getpid)
    leftover: Any = None  # the rank's destroyed process group, let go by release()
    process: Any = None  # in the worker: the rank's own process (_rankproc.RankProcess)
    relay: Any = None  # in the rank's process: its link to the task (_rankproc.RankLink)

    def check_stop(self) -> None:
        """A safe point: raise :class:`StopRequested` if the supervisor asked this rank to
        stop, the first time only (cleanup code that reports on its way out, in a
        ``finally``, is not stopped again). In a rank's own process the SIGTERM of a stop
        calls it from the main thread, wherever the rank is (the process ends anyway); a
        lane is only stopped at dask-ddp's own calls."""
        if self.stop_reason is not None and not self.stop_raised:
            self.stop_raised = True
            raise StopRequested(self.rank, self.stop_reason, self.job_id, self.stop_failed_rank)


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
    >>> slot.claim(RankRun("3f2a", "dask-ddp-3f2a-rank-1", 1), timeout=1.0)  # its job's too
    True
    >>> [r.rank for r in slot.running("3f2a")]
    [0, 1]
    >>> slot.release(run); [r.rank for r in slot.running()]
    [1]
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards runs, stores, and a run's stop
        self._free = threading.Condition(self.lock)
        self.runs: list[RankRun] = []  # one job's ranks in this process
        self._stores: dict[str, Any] = {}
        self._grow_requests: set[str] = set()
        self._leftovers: list[Any] = []  # destroyed process groups, to let go (release())
        # Jobs stopped before their rank here started (the task was on its way): job id ->
        # (reason, failed rank). The newest few only: a rank starts within seconds or never.
        self._stopped: collections.OrderedDict[str, tuple[str, int | None]] = (
            collections.OrderedDict()
        )

    def current(self) -> RankRun | None:
        """A rank running in this process, if any (the rank in its own process; the first
        of its job's ranks in a worker; None in a process forked from it whose run has
        ended)."""
        runs = self.runs
        return runs[0] if runs else None

    def running(self, job_id: str | None = None) -> list[RankRun]:
        """The ranks running in this process (of ``job_id``, or of any attempt of that
        job, if given), in rank order."""
        with self.lock:
            runs = list(self.runs)
        if job_id is not None:
            runs = [r for r in runs if r.job_id == job_id or r.job_id.startswith(f"{job_id}-")]
        return sorted(runs, key=lambda r: r.rank)

    def claim(
        self,
        run: RankRun,
        timeout: float,
        on_wait: Callable[[RankRun], None] | None = None,
    ) -> bool:
        """Make ``run`` one of the process's ranks once no other job's rank holds the
        slot, within ``timeout`` s (the ranks of one job hold it together).

        ``on_wait(holder)`` is called (with the lock held) when another job's rank holds
        the slot. Returns False if it stayed taken. A rank whose job was stopped while it
        waited (:meth:`stop`) takes the slot at once, to end there (its caller checks
        :meth:`stopped_before_start`).
        """
        if self._leftovers:  # the last rank's group is let go now, beside this rank's start
            threading.Thread(target=self._let_go, name="dask-ddp-let-go", daemon=True).start()

        def others() -> list[RankRun]:
            return [r for r in self.runs if r.job_id != run.job_id]

        with self._free:
            if others() and on_wait is not None:
                on_wait(others()[0])
            if not self._free.wait_for(
                lambda: not others() or run.job_id in self._stopped, timeout=timeout
            ):
                return False
            if others():  # stopped while it waited: it ends without the slot
                return True
            self.runs.append(run)
        return True

    def release(self, run: RankRun, leftover: Any = None) -> None:
        """End ``run``: its helpers stop, and once its job's last rank here ended the next
        job's may claim the slot. Call it once the process is clean (the rank's process
        group destroyed): the rank's task returns after it, and only then may the
        scheduler give its worker other work.

        ``leftover`` (the destroyed group's object, already unregistered from torch) is let
        go :data:`LEFTOVER_DELAY` later on a timer's thread, or as soon as the next rank
        claims the slot, on a thread of its own: its C++ teardown (gloo's: 20 ms of closing
        connections and joining threads, without the GIL) then runs once the task's end has
        been reported (begun at once, it delayed that report by 25-35 ms on 2 cores).
        """
        self.take_grow_request(run.job_id)  # a request that came too late dies with the run
        while run.on_end:
            run.on_end.pop()()
        if leftover is not None:
            with self._free:
                self._leftovers.append(leftover)
            del leftover
            timer = threading.Timer(LEFTOVER_DELAY, self._let_go)
            timer.daemon = True
            timer.start()
        with self._free:
            if any(r is run for r in self.runs):  # (runs compare by value: this one only)
                self.runs = [r for r in self.runs if r is not run]
                self._free.notify_all()

    def _let_go(self) -> None:
        """Let the destroyed process groups of the ranks before go: their C++ teardown runs
        on this thread; nothing if that was done already."""
        with self._free:
            leftovers, self._leftovers = self._leftovers, []
        leftovers.clear()  # the last references

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no rank holds this process (its teardown included); False on timeout.

        >>> ProcessSlot().wait_idle(0)
        True
        """
        with self._free:
            return self._free.wait_for(lambda: not self.runs, timeout=timeout)

    def stop(self, job_id: str, reason: str, failed_rank: int | None) -> list[RankRun]:
        """The supervisor asks ``job_id``'s ranks in this process to stop: the runs that
        are asked, those of that job that hold the slot (each stops at its next safe point,
        its own process is ended); none if none does (then a rank of that job that starts
        later ends at once).

        Nothing is raised into the rank's thread: see :meth:`RankRun.check_stop`.
        """
        with self._free:
            active = [r for r in self.runs if r.job_id == job_id]
            # Recorded in any case: a rank of the job still on its way here ends at once.
            self._stopped[job_id] = (reason, failed_rank)
            while len(self._stopped) > _STOPPED_KEPT:
                self._stopped.popitem(last=False)
            self._free.notify_all()  # a rank of that job waiting for the slot ends now
            for run in active:
                if run.stop_reason is None:
                    run.stop_reason, run.stop_failed_rank = reason, failed_rank
            processes = [r.process for r in active]
        for process in processes:
            if process is not None:  # its own process: SIGTERM, then SIGKILL after the grace
                process.stop(reason, failed_rank)
        return active

    def put_store(self, job_id: str, store: Any) -> None:
        """Keep the TCPStore opened for ``job_id`` until its rank 0 takes it."""
        with self.lock:
            self._stores[job_id] = store

    def take_store(self, job_id: str) -> Any:
        """Hand over (and forget) the store of ``job_id``; None if there is none."""
        with self.lock:
            return self._stores.pop(job_id, None)

    def store_for(self, spec: Any) -> Any:
        """The store the probe opened here for rank 0 of ``spec`` (a RankSpec), taken.

        Raises
        ------
        RendezvousTimeoutError
            It is gone: the worker restarted after launch, or the job was cancelled.
        """
        store = self.take_store(spec.run_id)
        if store is None:
            from ..errors import RendezvousTimeoutError

            raise RendezvousTimeoutError(
                0, spec.placement.worker, spec.key, 0,
                "the job's store is gone from this worker "
                "(the worker restarted after launch, or the job was cancelled)",
            )  # fmt: skip
        return store

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


#: This process's slot: a worker's (its ranks, each in a process of its own), or a rank's own
#: process's (its one run).
PROCESS = ProcessSlot()

_bound = threading.local()  # a lane's thread: the slot of its worker


def bind(slot: ProcessSlot | None) -> None:
    """From now on (None: no longer), the calling thread's rank runs in ``slot``: a lane's
    (:mod:`dask_ddp._rank.lanes`), many of which share one process."""
    _bound.slot = slot


def this_slot() -> ProcessSlot:
    """The slot of the rank calling: its lane's (bound to the thread), else :data:`PROCESS`."""
    slot = getattr(_bound, "slot", None)
    return PROCESS if slot is None else slot

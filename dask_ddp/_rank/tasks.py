"""What runs on the workers: the probe before launch, and the rank task itself.

The rank task (:func:`run_rank`) starts the rank's own process (:mod:`dask_ddp._rank.rankproc`)
and serves it; in that process (:func:`run_in_process`) the torchrun environment is set,
the rank joins the process group and calls the user's function. The worker's own process
is never changed by a rank. (In a process hosting lanes, simulated ranks, the rank runs in
the task's thread.)

A rank is stopped (:func:`abort_rank`): its process group gets SIGTERM, which its main
thread turns into :class:`~dask_ddp._rank.slot.StopRequested` wherever it is in Python, and
SIGKILL after ``ddp.failure-grace``; a rendezvous it waits in is released. Its outcome
(:func:`outcome_of`) is decided in its process, from the exception object.

Rendezvous: the probe opens the job's ``TCPStore`` on rank 0's worker (port 0, so the OS
picks a free port; on the worker's own address, not every interface) before any rank task
is submitted. The store therefore listens before any rank connects, and two jobs never
share a port.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import numbers
import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import cloudpickle

from .._shared import tracebacks
from .._shared.protocol import Fault, RankOutcome, RankSpec, Verdict
from ..errors import (
    InfrastructureError,
    RankStoppedError,
    RendezvousTimeoutError,
    RetryableError,
    StorageAccessError,
    WorkerBusyError,
)
from . import channel as events
from . import cuda, malloc, output, rankproc, replicas, resize, resume, saving, status
from . import process as _process
from .context import _activated
from .host import ABORTED, RankWork, host_for
from .slot import (
    PROCESS,
    CheckpointSettings,
    ProcessSlot,
    RankContext,
    RankRun,
    StopRequested,
)

logger = logging.getLogger(__name__)

_FAILURES = "dask-ddp/failures"
_FIRST_FAILURE = "dask-ddp/first-failure"
_FIRST_ERROR = "dask-ddp/first-error"
_MAX_ERROR_CHARS = 2000


@dataclasses.dataclass(frozen=True)
class Resized:
    """What a rank task returns when its elastic job stopped at the checkpoint of ``step``
    to change size: the task ended without an error, and the job goes on in a new
    placement (its supervisor reads the rank's final marker, never this value)."""

    step: int


def _call_of(payload: bytes, spec: RankSpec) -> tuple[Any, tuple, dict[str, Any]]:
    """The rank's call: ``(fn, args, kwargs)`` as the launching client pickled them, with a
    sweep's trial arguments (``spec.trial_kwargs``) and ``local_rank=`` where asked."""
    fn, args, kwargs = cloudpickle.loads(payload)
    if spec.trial_kwargs:
        kwargs = {**kwargs, **spec.trial_kwargs}
    if spec.pass_local_rank:
        kwargs = {**kwargs, "local_rank": spec.placement.local_rank}
    return fn, args, kwargs


def _number(value: Any) -> float | None:
    """``value`` as a number if it is one (a sweep's objective), else None; a tensor or an
    array of one element counts.

    >>> _number(3), _number(0.5), _number(True), _number("1"), _number([1.0])
    (3.0, 0.5, None, None, None)
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    numel = getattr(value, "numel", None)  # torch.Tensor.numel(), numpy's size
    count = numel() if callable(numel) else getattr(value, "size", None)
    item = getattr(value, "item", None)
    if count == 1 and callable(item):
        try:
            number = item()
        except (TypeError, ValueError, RuntimeError):
            return None
        return _number(number) if isinstance(number, numbers.Real) else None
    return None


def outcome_of(value: Any = None, error: BaseException | None = None) -> RankOutcome:
    """How a rank ended, decided here, on the rank, from the exception object itself: what
    its final marker tells the supervisor (which never reads an exception's text).

    A failure tells what failed (:func:`fault_of`); whether that restarts the job is the
    supervisor's decision (``lifecycle.RESTARTS``), not the rank's.

    >>> outcome_of(Resized(40)).verdict.value
    'grow'
    >>> o = outcome_of(error=RankStoppedError(0, "ValueError: x", failed_rank=1))
    >>> o.verdict.value, o.failed_rank
    ('stopped', 1)
    >>> o = outcome_of(error=ValueError("bad batch"))
    >>> o.verdict.value, o.error_class, o.summary, o.fault.value
    ('fail', 'builtins.ValueError', 'ValueError: bad batch', 'code')
    >>> outcome_of(error=RendezvousTimeoutError(1, "tcp://a:1", "k", 60.0, "x")).fault.value
    'infrastructure'
    """
    if error is None:
        if isinstance(value, Resized):
            return RankOutcome(Verdict.GROW, step=value.step)
        return RankOutcome(Verdict.DONE, number=_number(value))
    if isinstance(error, RankStoppedError):
        peer_lost = error.failed_rank is not None and error.failed_rank < 0
        return RankOutcome(
            Verdict.STOPPED,
            _class_path(error),
            error.reason[:_MAX_ERROR_CHARS],
            failed_rank=None if peer_lost else error.failed_rank,
            peer_lost=peer_lost,
        )
    return RankOutcome(
        Verdict.FAIL,
        _class_path(error),
        f"{type(error).__name__}: {error}"[:_MAX_ERROR_CHARS],
        tracebacks.plain_text(error),
        fault=fault_of(error),
    )


def fault_of(error: BaseException) -> Fault:
    """What failed, from the exception's class and typed fields (never its text).

    >>> fault_of(ValueError("x")).value, fault_of(RetryableError("x")).value
    ('code', 'asked')
    >>> from dask_ddp.errors import StorageAccessError
    >>> fault_of(StorageAccessError("s3://b/k", "http://s3", "credentials", "denied")).value
    'credentials'
    >>> fault_of(StorageAccessError("s3://b/k", "http://s3", "unreachable", "timeout")).value
    'infrastructure'
    """
    if isinstance(error, StorageAccessError) and error.problem == "credentials":
        return Fault.CREDENTIALS
    if isinstance(error, RetryableError):
        return Fault.ASKED
    if isinstance(error, InfrastructureError):
        return Fault.INFRASTRUCTURE
    return Fault.CODE


def _class_path(error: BaseException) -> str:
    cls = type(error)
    return f"{cls.__module__}.{cls.__qualname__}"


async def probe_worker(
    job_id: str, store_worker: str, store_timeout: float, dask_worker: Any = None
) -> dict[str, Any]:
    """Run by ``client.run`` on each chosen worker before launch.

    Reports the worker's GPUs, its own ``CUDA_VISIBLE_DEVICES`` and the rank it is running,
    if any; on rank 0's worker (``store_worker``) also opens the job's store. What takes
    long (a fresh worker's template, the count of its GPUs, the store) runs in threads so
    the worker's event loop stays responsive.
    """
    loop = asyncio.get_running_loop()
    host = host_for(dask_worker)
    # A warm worker answers at once: its GPUs counted before, its spare rank processes
    # waiting. A fresh one finds its template, forks its spares and counts its GPUs in a
    # process forked from that template, in threads; the worker itself never imports torch.
    await host.warm()
    gpus = host.gpu_count() if host.gpus_counted else await loop.run_in_executor(
        None, host.gpu_count
    )  # fmt: skip
    port = None
    if dask_worker.address == store_worker:
        port = host.store_ready(job_id, store_timeout)
        if port is None:
            port = await loop.run_in_executor(None, host.open_store, job_id, store_timeout)
    active = host.slot.current()
    return {
        "gpu_count": gpus,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "busy": active.key if active is not None else None,
        "store_port": port,
    }


class TemplatePlugin:
    """Gets a worker ready for its ranks as it joins (registered by dask-ddp's scheduler
    plugin through :class:`~dask_ddp._shared.protocol.NamedWorkerPlugin`): its host
    (:meth:`~dask_ddp._rank.host.ProcessHost.get_ready`) finds its nanny's template and forks
    its spares. A restart's replacement, or a grown job's new worker, finds the template its
    nanny kept, its imports done; a fresh cluster's first job waits for what is left of
    them, not for all. A worker hosting
    lanes (:mod:`dask_ddp._rank.lanes`) runs its ranks in threads."""

    def setup(self, worker: Any) -> None:
        host_for(worker).get_ready()

    def teardown(self, worker: Any) -> None:
        pass  # the spares end with the worker (their links close), the template with its own


def drop_store(job_id: str, dask_worker: Any = None) -> bool:
    """Close the job's store if no rank took it (the job failed or was cancelled first)."""
    return host_for(dask_worker).slot.take_store(job_id) is not None


def request_grow(job_id: str, dask_worker: Any = None) -> bool:
    """Ask ``job_id``'s rank 0 (on this worker) to stop at its next checkpoint to grow."""
    host_for(dask_worker).slot.request_grow(job_id)
    return True


def abort_rank(
    job_id: str, reason: str, failed_rank: int | None = None, dask_worker: Any = None
) -> bool:
    """Ask this process's rank of ``job_id`` (an attempt's run id) to stop; return whether
    one runs here.

    Each rank of the job here in its own process gets SIGTERM (its process group), then
    SIGKILL after ``ddp.failure-grace`` (:meth:`dask_ddp._rank.rankproc.RankProcess.stop`);
    a rank waiting in the rendezvous or at a checkpoint is released. A lane stops at its
    next safe point (:meth:`~dask_ddp._rank.slot.RankRun.check_stop`).

    A rank of the job that starts here later ends at once, and the store opened for it (on
    rank 0's worker) that its rank 0 did not take is closed: once none of its ranks runs
    here (False), the worker is clean.
    """
    host = host_for(dask_worker)
    active = host.slot.stop(job_id, reason, failed_rank)
    # The store opened for its rank 0 here, if that rank has not started (it never will).
    unclaimed = None if any(r.rank == 0 for r in active) else host.slot.take_store(job_id)
    # In case its ranks wait at the rendezvous, in C++ (a SIGTERM does not end that wait).
    host.release_waits(active, unclaimed)
    del unclaimed
    if not active:
        return False
    logger.info(
        "job %s: stopping rank %s: %s", job_id, ", ".join(str(r.rank) for r in active), reason
    )
    return True


def rank_stacks(job_id: str, dask_worker: Any = None) -> list[tuple[int, str]]:
    """Run on a worker (``Client.run``): each rank of ``job_id`` (any attempt) running here,
    and every thread's Python stack in its process, as :mod:`faulthandler` dumps them
    (it works while the rank is blocked in C++), in rank order; empty if none runs here."""
    return [
        (run.rank, run.process.stacks())
        for run in host_for(dask_worker).slot.running(job_id)
        if run.process is not None
    ]


@contextlib.contextmanager
def _claim_slot(spec: RankSpec, run: RankRun, slot: ProcessSlot) -> Iterator[RankRun]:
    def queued(holder: RankRun) -> None:
        # Another job's rank in this process (a worker with several threads): queue behind
        # it, as Dask queues tasks on a single-threaded worker.
        status.send(
            run,
            status.QUEUED,
            f"waiting for job {holder.job_id} (rank {holder.rank}) to finish on this worker",
        )

    def check_stopped() -> None:
        stopped = slot.stopped_before_start(spec.run_id)
        if stopped is not None:  # the supervisor stopped the job while this task started
            reason, failed_rank = stopped
            raise RankStoppedError(
                spec.placement.rank, reason, job=spec.run_id, failed_rank=failed_rank
            )

    check_stopped()
    if not slot.claim(run, spec.rendezvous.rendezvous_timeout, on_wait=queued):
        holder = slot.current()
        raise WorkerBusyError(spec.placement.worker, holder.key if holder else "?")
    check_stopped()
    yield run


def _torchrun_env(spec: RankSpec) -> dict[str, str]:
    p = spec.placement
    env = {
        "MASTER_ADDR": spec.rendezvous.master_addr,
        "MASTER_PORT": str(spec.rendezvous.master_port),
        "RANK": str(p.rank),
        "WORLD_SIZE": str(p.world_size),
        "LOCAL_RANK": str(p.local_rank),
        "LOCAL_WORLD_SIZE": str(p.local_world_size),
        "GROUP_RANK": str(p.node_rank),
        "NODE_RANK": str(p.node_rank),
        # torchrun's elastic agent runs one worker group per host, in one role ("default"),
        # so a rank's role rank and role world size are its global ones.
        "GROUP_WORLD_SIZE": str(p.node_count),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(p.rank),
        "ROLE_WORLD_SIZE": str(p.world_size),
        "TORCHELASTIC_RESTART_COUNT": str(spec.attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        # As torchrun sets it (constant across restarts): torch.distributed's
        # is_torchelastic_launched() is then true, and Lightning takes its TorchElastic
        # environment, which reads the variables above.
        "TORCHELASTIC_RUN_ID": spec.job_id,
    }
    if p.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = p.cuda_visible_devices
    # "gloo", and "cpu:gloo,cuda:nccl" too
    if "gloo" in spec.rendezvous.backend and "GLOO_SOCKET_IFNAME" not in os.environ:
        ifname = _process.interface_of(p.host)
        if ifname is not None:
            # gloo otherwise advertises the address the machine's hostname resolves to, often
            # 127.0.x.1, which ranks on other hosts cannot reach. The Dask worker's own
            # address is reachable by its peers: the scheduler and the other workers use it.
            env["GLOO_SOCKET_IFNAME"] = ifname
    if not spec.rendezvous.init_process_group:
        # The script calls init_process_group("env://") itself; as under torchrun, every
        # rank (rank 0 too) then connects to the store that already listens on MASTER_PORT.
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return env


@contextlib.contextmanager
def _thread_share(spec: RankSpec) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    wanted = spec.threads_per_rank
    if wanted is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        wanted = max(1, (cores or 1) // spec.placement.local_world_size)
    if wanted:  # 0 leaves the worker's setting alone
        torch.set_num_threads(wanted)
        logger.debug("job %s rank %d: %d torch threads", spec.run_id, spec.placement.rank, wanted)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _connect_store(spec: RankSpec, run: RankRun, slot: ProcessSlot, lane: bool) -> Any:
    """The job's store, for this rank: a lane's rank 0 takes the one its worker opened (a
    rank 0 in its own process connects to the one its worker holds); the others connect to
    it, within the rendezvous timeout.

    The connection is tried in slices of :data:`_CONNECT_SLICE` seconds, with a safe point
    (:meth:`~dask_ddp._rank.slot.RankRun.check_stop`) between them: a rank of a job stopped
    while it connects (its store closed by the abort, or gone with rank 0's worker) stops
    within a slice, instead of sitting in C++ until the rendezvous timeout and costing its
    worker a restart.
    """
    import torch.distributed as dist

    rdzv = spec.rendezvous
    if spec.placement.rank == 0 and lane:
        return slot.store_for(spec)
    deadline = time.monotonic() + rdzv.rendezvous_timeout
    while True:
        left = deadline - time.monotonic()
        try:
            store = dist.TCPStore(
                rdzv.master_addr,
                rdzv.master_port,
                is_master=False,
                timeout=timedelta(seconds=max(min(_CONNECT_SLICE, left), 0.1)),
            )
        except (RuntimeError, TimeoutError) as exc:  # DistStoreError subclasses RuntimeError
            run.check_stop()
            if time.monotonic() < deadline:
                continue
            raise RendezvousTimeoutError(
                spec.placement.rank,
                spec.placement.worker,
                spec.key,
                rdzv.rendezvous_timeout,
                f"could not reach rank 0's store at {rdzv.master_addr}:{rdzv.master_port} ({exc})",
            ) from exc
        store.set_timeout(timedelta(seconds=rdzv.rendezvous_timeout))  # its waits' default
        return store


_CONNECT_SLICE = 1.0  # seconds per try to reach rank 0's store (then a safe point)


def _rendezvous(store: Any, spec: RankSpec, run: RankRun, stage: str = "joined") -> None:
    """Wait until every rank has reached ``stage``, within the rendezvous timeout.

    Stages: "joined" before ``init_process_group`` (every rank's task has started), and
    "initialised" after it: no rank runs ``fn`` (which may fail at once and sever its
    connections) while a peer's gloo is still connecting its mesh, which would fail that
    peer with gloo's own "Connection closed by peer" instead of the real error.
    """
    world = spec.placement.world_size
    count, ready = f"dask-ddp/{stage}", f"dask-ddp/{stage}-ready"
    reached = store.add(count, 1)
    if reached == world:
        # Unless an abort released the waiters first: every rank reads the same word, so
        # that all of them go on, or all stop.
        store.compare_set(ready, "", "1")
    elif stage == "joined":
        status.send(
            run, status.JOINING, f"waiting for the other ranks ({reached} of {world} joined)"
        )
    try:
        # One round trip: a get waits for the key (within the store's timeout, the
        # rendezvous timeout) and reads the word.
        word = store.get(ready)
    except (RuntimeError, TimeoutError) as exc:  # DistStoreError subclasses RuntimeError
        with contextlib.suppress(RuntimeError, TimeoutError):  # unless rank 0's store is gone
            reached = store.add(count, 0)
        raise RendezvousTimeoutError(
            spec.placement.rank,
            spec.placement.worker,
            spec.key,
            spec.rendezvous.rendezvous_timeout,
            f"only {reached} of {world} ranks {stage}",
        ) from exc
    if word == ABORTED:  # abort_rank released the waiters
        run.check_stop()
        raise RankStoppedError(spec.placement.rank, "stopped while ranks gathered", job=spec.run_id)


def _first_failure(
    store: Any, rank: int, error: BaseException, *, peer_lost: bool = False
) -> tuple[int, str] | None:
    """Record this rank's failure; return the rank that failed first, and its error
    (``"ValueError: bad batch"``), if it was another.

    The first rank to fail stores its error's type and message before its rank, so that a
    peer stopped by it reports the real cause, whichever rank's future a caller reads
    first. A rank whose collective failed because a peer's connection closed, when no rank
    has recorded a failure, did not fail first: a peer's process died (killed, out of
    memory). It returns -1 (unknown) then, and the client names the lost worker.
    """
    summary = f"{type(error).__name__}: {error}"[:_MAX_ERROR_CHARS]
    try:
        if peer_lost:
            # A failing rank records its error before it severs its connections, so a peer's
            # closed connection with no error recorded means its process died: no wait (a
            # timed-out wait prints c10d's warning on every surviving rank).
            if not store.check([_FIRST_FAILURE]):
                return (-1, summary)
        elif store.add(_FAILURES, 1) == 1:
            store.set(_FIRST_ERROR, summary)
            store.set(_FIRST_FAILURE, str(rank))
            return None
        store.wait([_FIRST_FAILURE], timedelta(seconds=2))
        first = int(store.get(_FIRST_FAILURE))
        cause = store.get(_FIRST_ERROR).decode("utf-8", "replace")
    except (RuntimeError, TimeoutError, ValueError):
        # Nobody recorded a failure (or rank 0's store is gone with its process).
        return (-1, summary) if peer_lost else None
    return None if first == rank else (first, cause)


def _recorded_failure(store: Any, rank: int | None) -> str | None:
    """The error ``rank`` recorded as the job's first failure (``"ValueError: ..."``), if it
    did; never waits."""
    if rank is None:
        return None
    try:
        if not store.check([_FIRST_FAILURE]) or int(store.get(_FIRST_FAILURE)) != rank:
            return None
        return store.get(_FIRST_ERROR).decode("utf-8", "replace")
    except (RuntimeError, TimeoutError, ValueError):  # rank 0's store is gone
        return None


def run_rank(payload: bytes, spec: RankSpec) -> Any:
    """The rank task: start the rank's own process, relay what it sends, return its value.

    ``payload`` is ``(fn, args, kwargs)`` as the launching client pickled it; it is
    unpickled in the rank's process and nowhere else (the scheduler only holds the bytes,
    and the worker never runs the user's code). Re-raises the function's own exception on
    the rank that failed first; a rank that fails because another one did raises
    :class:`~dask_ddp.errors.RankStoppedError`. In a process hosting lanes (simulated
    ranks, :mod:`dask_ddp._rank.lanes`) the rank runs in the task's thread instead.
    """
    from distributed import get_worker, secede

    p = spec.placement
    worker = get_worker()
    if p.worker_ranks > 1:
        # The job's other ranks on this worker run beside this one (each in a process of
        # its own): the task leaves the worker's thread pool, as Dask's long-running tasks
        # do, so that a worker of one thread starts them all.
        secede()
    # The channel opens first: the rank's phases (queued, joining) travel on it too.
    channel = events.RankChannel(
        worker,
        spec.run_id,
        p.rank,
        interval=spec.events.flush_interval,
        max_event_bytes=spec.events.max_event_bytes,
        topic=spec.events.topic,
        watch=spec.events.watch,
    )
    run = RankRun(
        spec.run_id,
        spec.key,
        p.rank,
        channel=channel,
        master=(spec.rendezvous.master_addr, spec.rendezvous.master_port),
    )
    host = host_for(worker)
    slot = host.slot
    peer = replicas.PeerLink(worker, spec.job_id)

    def memory() -> tuple[int, int]:
        return replicas.process_memory(), replicas.memory_limit(worker)

    def in_thread() -> Any:  # a lane: the rank in this thread
        fn, args, kwargs = _call_of(payload, spec)
        return _run_in_slot(fn, args, kwargs, spec, run, peer, memory, slot, lane=True)

    def handlers() -> dict[str, Callable[..., Any]]:  # what a rank's process may ask
        from . import rankproc

        return {
            "grow": lambda: slot.take_grow_request(spec.run_id),
            "memory": memory,
            "replica_put": lambda holder, writer, world, step, fraction, data: peer.put(
                holder, writer, world, step, data, fraction
            ),
            "replica_fetch": lambda *args: rankproc.RawBytes(_as_bytes(peer.fetch(*args))),
            "dataset_load": _load_dataset_window,
            "log_event": worker.log_event,
            "hold_blob": events.hold_blob,
        }

    work = RankWork(payload, spec, run, worker, _BODY, handlers, in_thread)
    value, error, outcome = None, None, None
    try:
        with _claim_slot(spec, run, slot):
            value, error, outcome = host.run(work)
    except StopRequested as exc:  # at a safe point before fn (or between its stages)
        error = exc.stopped()
    except BaseException as exc:
        error = exc
        raise
    finally:
        # Sends what fn reported, the final count and how the rank ended before the task
        # finishes, so the supervisor and the clients have every record when they see the
        # result. Never raises: on success its error is raised below, after a failure the
        # rank's own error wins.
        undelivered = channel.close(outcome or _lane_outcome(value, error, spec))
        leftover, run.leftover = run.leftover, None
        slot.release(run, leftover)
        host.rank_ended(spec)
    if error is not None:  # raised here, out of the handler
        raise error
    if undelivered is not None:
        raise undelivered
    return value


def _lane_outcome(value: Any, error: BaseException | None, spec: RankSpec) -> RankOutcome:
    """How a lane's rank ended (a rank's own process says it for its rank), with its small
    return value, as a rank's process sends it."""
    outcome = outcome_of(value, error)
    if outcome.verdict is not Verdict.DONE:
        return outcome
    try:
        data = cloudpickle.dumps(value)
    except Exception:  # its task's own pickling says so
        return outcome
    return outcome.holding(data, spec.events.result_limit)


def _as_bytes(data: Any) -> Any:
    """A fetched replica (bytes, or a uint8 tensor) as a buffer to send; empty if missing."""
    if data is None:
        return b""
    if hasattr(data, "numpy"):
        return data.numpy()
    return data


def _load_dataset_window(plan: Any, pieces: Any, fmt: str) -> Any:
    """A window of a Dask collection's partitions, read in the worker for its rank's
    process, and the counts the read made; its arrays travel out of band (no copy into
    a pickle)."""
    from ..data import _collection_shard
    from . import rankproc

    counts: dict[str, float] = {}

    def count(name: str, n: float) -> None:
        counts[name] = counts.get(name, 0) + n

    data, _ = _collection_shard._Fetcher(plan, count).load(pieces, fmt)
    return rankproc.OutOfBand((data, counts))


def run_in_process(payload: bytes, spec: RankSpec, link: Any, turn: Any) -> Any:
    """The rank, in its own process (:func:`dask_ddp._rank.rankproc._rank_main`): the torchrun
    environment and thread share set before anything starts, then :func:`_run_in_slot`.
    The rank's channel goes on from where its task's stopped (``turn``); its events go
    through ``link`` to the worker's ``log_event``."""
    from distributed import get_worker

    os.environ.update(_torchrun_env(spec))
    malloc.tune(spec.tune_malloc)
    channel = link.channel = events.RankChannel(
        get_worker(),  # the worker's stand-in: its address names where large messages wait
        spec.run_id,
        spec.placement.rank,
        interval=spec.events.flush_interval,
        max_event_bytes=spec.events.max_event_bytes,
        topic=spec.events.topic,
        relay=link,
        turn=turn,
        start=link.thread,
        watch=spec.events.watch,
    )
    run = RankRun(
        spec.run_id,
        spec.key,
        spec.placement.rank,
        channel=channel,
        master=(spec.rendezvous.master_addr, spec.rendezvous.master_port),
    )
    run.relay = link

    def told(reason: str, failed_rank: int | None) -> None:
        with PROCESS.lock:
            if run.stop_reason is None:
                run.stop_reason, run.stop_failed_rank = reason, failed_rank

    def on_sigterm(signum: int, frame: Any) -> None:
        # The task tells why before it signals; a SIGTERM from elsewhere stops it too.
        link.stop_told.wait(1.0)
        told(f"the rank's process received signal {signum} (SIGTERM)", None)
        run.check_stop()

    link.on_stop = told
    signal.signal(signal.SIGTERM, on_sigterm)
    if link.stop is not None:
        told(*link.stop)
    PROCESS.claim(run, 0)
    from ..data import _collection_shard

    _collection_shard.load_through_worker(functools.partial(link.call, "dataset_load"))
    try:
        run.check_stop()
        fn, args, kwargs = _call_of(payload, spec)
        peer = _RelayedPeer(link)
        with _thread_share(spec), _process.platform_start_method():
            value = _run_in_slot(
                fn, args, kwargs, spec, run, peer, lambda: link.call("memory"), PROCESS,
            )  # fmt: skip
        _cuda_finished()  # the rank's kernels ran before it says it ended
        return value
    except StopRequested as exc:
        raise exc.stopped() from None


class _RelayedPeer:
    """:class:`~dask_ddp._rank.replicas.PeerLink` for a rank in its own process: the calls go to
    its worker, which holds the connections (and this process's replica store)."""

    def __init__(self, link: Any) -> None:
        self._link = link

    def put(
        self, holder: str, writer: int, world_size: int | None, step: int, data: Any,
        fraction: float,
    ) -> str | None:  # fmt: skip
        return self._link.call("replica_put", holder, writer, world_size, step, fraction, data=data)

    def fetch(self, *args: Any) -> Any:
        buffer = self._link.call("replica_fetch", *args)
        return buffer if len(buffer) else None


def _cuda_finished() -> None:
    """Wait for the rank's CUDA work, if it started CUDA."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def end_process_group() -> None:
    """A rank's process that said how it ended destroys its group (nccl's communicators
    flushed, gloo's pairs closed: 20 ms) before it exits, as torchrun's workers end; its
    task has returned meanwhile. After a failure the process just exits."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


#: What a rank's own process runs (pickled by name, with its go).
_BODY = rankproc.RankBody(run_in_process, outcome_of, end_process_group)


def _run_in_slot(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    spec: RankSpec,
    run: RankRun,
    peer: Any,
    memory: Callable[[], tuple[int, int]],
    slot: ProcessSlot,
    lane: bool = False,
) -> Any:
    """Join the process group and run ``fn`` in ``run``, which holds ``slot``; ``peer``
    reaches the replica stores, ``memory()`` is the worker's memory and its limit.
    ``lane``: the rank is a thread of its worker's, sharing its process (rank 0 takes the
    store its worker opened; the process's streams are not the rank's to forward), not a
    process of its own (whose rank 0 connects to the store its worker holds)."""
    import torch.distributed as dist

    p = spec.placement
    # kept until the task ends, for slow peers
    store = run.store = _connect_store(spec, run, slot, lane)
    _rendezvous(store, spec, run)
    device = cuda.rank_device(p, spec.run_id)  # cuda:LOCAL_RANK when the plan took effect
    if spec.rendezvous.init_process_group:
        # No safe point between the rendezvous and the group: once all ranks joined, all
        # make it, even if a stop came meanwhile (they stop at the next rendezvous). A rank
        # that stopped here would leave a peer already inside init_process_group waiting
        # in C++ for it until the group's timeout, and cost that worker a restart.
        dist.init_process_group(
            spec.rendezvous.backend,
            store=dist.PrefixStore(f"dask-ddp/{spec.attempt}", store),
            rank=p.rank,
            world_size=p.world_size,
            timeout=timedelta(seconds=spec.rendezvous.timeout),
        )
        _rendezvous(store, spec, run, "initialised")
    run.check_stop()
    status.send(run, status.RUNNING)
    ctx = RankContext(
        rank=p.rank,
        local_rank=p.local_rank,
        world_size=p.world_size,
        local_world_size=p.local_world_size,
        node_rank=p.node_rank,
        device=device,
        backend=spec.rendezvous.backend,
        attempt=spec.attempt,
        job_id=spec.run_id,
        worker=p.worker,
        master_addr=spec.rendezvous.master_addr,
        master_port=spec.rendezvous.master_port,
    )
    logger.debug("job %s: rank %d joined on %s", spec.run_id, p.rank, p.worker)
    checkpointing = CheckpointSettings.of(
        spec.checkpoint, spec.job_id, spec.rendezvous.timeout if spec.can_grow else None
    )
    saver, resumer = _checkpointing(checkpointing, ctx, run, peer, memory)
    try:
        with (
            _activated(run, ctx, checkpointing, spec.datasets, saver, resumer),
            # A lane shares its process's streams with the other lanes: nothing to forward.
            contextlib.nullcontext() if lane else output.forwarded(run.channel),
        ):
            return fn(*args, **kwargs)
    except BaseException as exc:
        if run.stop_reason is not None:  # its stop, or a collective with a peer gone
            if isinstance(exc, RankStoppedError):
                raise
            # Stopped because a rank failed: that rank's own error, as it recorded it.
            reason = _recorded_failure(store, run.stop_failed_rank) or run.stop_reason
            stopped = RankStoppedError(
                p.rank, reason, job=spec.run_id, failed_rank=run.stop_failed_rank
            )
            if isinstance(exc, StopRequested):
                raise stopped from None
            raise stopped from exc
        first = _first_failure(store, p.rank, exc, peer_lost=_process.is_peer_loss(exc))
        if isinstance(exc, resize.GrowAtCheckpoint):
            # Every rank stops here (rank 0 recorded it first, for a rank that skipped the
            # checkpoint call: its next collective fails once the others' processes end).
            return Resized(exc.step)
        if first is not None:
            raise RankStoppedError(p.rank, first[1], failed_rank=first[0]) from exc
        raise


def _checkpointing(
    settings: CheckpointSettings,
    ctx: RankContext,
    run: RankRun,
    peer: Any,
    memory: Callable[[], tuple[int, int]],
) -> tuple[saving.Saver | None, resume.Resumer | None]:
    """What saves and loads the rank's checkpoints (None without ``checkpoint_dir``)."""
    if settings.directory is None:
        return None, None
    channel = run.channel

    def announce(kind: str, body: list[Any]) -> None:
        if channel is not None:
            channel.put(kind, body, "save_checkpoint", urgent=True)

    saver = saving.Saver(
        settings,
        rank=ctx.rank,
        world_size=ctx.world_size,
        announce=announce,
        peer=peer,
        memory=memory,
        status=lambda text: status.send(run, None, text),
    )
    resumer = resume.Resumer(
        settings,
        rank=ctx.rank,
        world_size=ctx.world_size,
        device=ctx.device,
        peer=peer,
        announce=announce,
    )
    return saver, resumer

"""What runs on the workers: the probe before launch, and the rank task itself.

The rank task (:func:`run_rank`) sets the torchrun environment, joins the process group,
calls the user's function and always leaves the worker as it found it: environment,
thread count, daemon flag, malloc thresholds and the default process group are restored, on success,
exception or abort. The process group is destroyed just after the task returns, on a
thread of its own (gloo's teardown takes about 20 ms); the next rank on the worker waits
for it.

Rendezvous: the probe opens the job's ``TCPStore`` on rank 0's worker (port 0, so the OS
picks a free port; on the worker's own address, not every interface) before any rank task
is submitted. The store therefore listens before any rank connects, and two jobs never
share a port.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import cloudpickle

from . import (
    _malloc,
    _output,
    _process,
    _replicas,
    _resize,
    _resume,
    _saving,
    _status,
    _traceback,
    events,
)
from ._slot import (
    PROCESS,
    CheckpointSettings,
    ProcessSlot,
    RankContext,
    RankRun,
    Restore,
    slot_for,
)
from .context import _activated
from .errors import RankStoppedError, RendezvousTimeoutError, RetryableError, WorkerBusyError
from .placement import RankPlacement

logger = logging.getLogger(__name__)

_FAILURES = "dask-ddp/failures"
_FIRST_FAILURE = "dask-ddp/first-failure"
_FIRST_ERROR = "dask-ddp/first-error"
_MAX_ERROR_CHARS = 2000


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """Everything one rank task needs, resolved on the client."""

    job_id: str
    key: str
    attempt: int
    backend: str
    timeout: float
    rendezvous_timeout: float
    master_addr: str
    master_port: int
    threads_per_rank: int | None
    allow_daemon_children: bool
    pass_local_rank: bool
    placement: RankPlacement
    init_process_group: bool = True
    checkpoint_dir: str | None = None
    keep_last: int | None = None
    storage_options: dict[str, Any] | None = None
    event_flush_interval: float = 0.2  # ddp.event-flush-interval, resolved on the client
    max_event_bytes: int = 65536  # ddp.max-event-bytes, resolved on the client
    tune_malloc: bool = True  # ddp.tune-malloc
    # launch(datasets=): this rank's share of each dataset (keys and row ranges, no data)
    datasets: dict[str, Any] | None = None
    # an elastic job below its size: the ranks may stop at a checkpoint to grow
    can_grow: bool = False
    # the job's id and event topic, the same for all its placements (job_id is the
    # placement's run id), and the restarts it may make (torchrun's variables)
    job: str | None = None
    topic: str | None = None
    max_restarts: int = 0
    # ddp.checkpoint.*: "async" or "sync" saves; the worker keeping this rank's replicas
    # (None: none) and how much of its memory they may take; where the state comes from
    checkpoint_mode: str = "async"
    replica_holder: str | None = None
    replica_fraction: float = 0.25
    restore: tuple[Restore, ...] = ()


@dataclasses.dataclass(frozen=True)
class Resized:
    """What a rank task returns when its elastic job stopped at the checkpoint of ``step``
    to change size: the task ended without an error, and the job goes on in a new
    placement (its supervisor reads the rank's final marker, never this value)."""

    step: int


def outcome_of(value: Any = None, error: BaseException | None = None) -> dict[str, Any]:
    """How a rank ended, in the plain values its final marker carries to the supervisor:
    ``{"ok": True}``, ``{"grow": step}``, ``{"stopped": reason, "failed_rank": r}`` or
    ``{"failed": "ValueError: ...", "retryable": bool, "traceback": text}``.

    >>> outcome_of(Resized(40))
    {'grow': 40}
    >>> outcome_of(error=RankStoppedError(0, "ValueError: x", failed_rank=1))
    {'stopped': 'ValueError: x', 'failed_rank': 1}
    """
    if error is None:
        return {"grow": value.step} if isinstance(value, Resized) else {"ok": True}
    if isinstance(error, RankStoppedError):
        return {"stopped": error.reason, "failed_rank": error.failed_rank}
    return {
        "failed": f"{type(error).__name__}: {error}"[:_MAX_ERROR_CHARS],
        "retryable": isinstance(error, RetryableError),
        "traceback": _traceback.plain_text(error),
    }


class _Abort(BaseException):
    """Raised asynchronously in a rank's thread by :func:`abort_rank`.

    A BaseException, so that ``except Exception`` in training code does not swallow it;
    :func:`run_rank` turns it into :class:`~dask_ddp.errors.RankStoppedError`.
    """


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _open_store(job_id: str, host: str, timeout: float, slot: ProcessSlot) -> int:
    import torch.distributed as dist

    fd, port = _listen_on(host)
    try:
        store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=timeout), master_listen_fd=fd,
        )  # fmt: skip
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    slot.put_store(job_id, store)
    return store.port


def _listen_on(host: str) -> tuple[int | None, int]:
    """A socket listening on the worker's own address ``host``, on a port the OS picks, for
    the store to take (its file descriptor, and the port). A store left to itself listens
    on every interface of the machine. ``(None, 0)`` where ``host`` is not an address of
    this machine (a worker that advertises another, behind NAT): the store then listens
    on all of them, as torchrun's does."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.bind(address)
            sock.listen(socket.SOMAXCONN)
        except OSError:
            sock.close()
            raise
    except OSError as exc:
        logger.info(
            "dask-ddp: the job's store listens on every interface: it cannot bind to the "
            "worker's address %s (%s)", host, exc,
        )  # fmt: skip
        return None, 0
    port = sock.getsockname()[1]
    return sock.detach(), port


async def probe_worker(
    job_id: str, store_worker: str, store_timeout: float, dask_worker: Any = None
) -> dict[str, Any]:
    """Run by ``client.run`` on each chosen worker before launch.

    Reports the worker's GPUs, its own ``CUDA_VISIBLE_DEVICES`` and the rank it is running,
    if any; on rank 0's worker (``store_worker``) also opens the job's store. The torch
    import runs in a thread so the worker's event loop stays responsive.
    """
    loop = asyncio.get_running_loop()
    slot = slot_for(dask_worker)
    gpus = await loop.run_in_executor(None, _gpu_count)
    port = None
    if dask_worker.address == store_worker:
        port = await loop.run_in_executor(
            None, _open_store, job_id, dask_worker.ip, store_timeout, slot
        )
    active = slot.current()
    return {
        "gpu_count": gpus,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "busy": active.key if active is not None else None,
        "store_port": port,
    }


def drop_store(job_id: str, dask_worker: Any = None) -> bool:
    """Close the job's store if no rank took it (the job failed or was cancelled first)."""
    return slot_for(dask_worker).take_store(job_id) is not None


def request_grow(job_id: str, dask_worker: Any = None) -> bool:
    """Ask ``job_id``'s rank 0 (on this worker) to stop at its next checkpoint to grow."""
    slot_for(dask_worker).request_grow(job_id)
    return True


def abort_rank(
    job_id: str, reason: str, failed_rank: int | None = None, dask_worker: Any = None
) -> bool:
    """Stop this process's rank of ``job_id``, if it is still in the user's function.

    Raises :class:`~dask_ddp.errors.RankStoppedError` (with ``reason``, and the rank that
    failed first when one did) in the rank's thread at its next Python instruction. A
    rank blocked inside a C++ collective only sees it once the collective returns; the
    client restarts such workers after a grace period.
    """
    slot = slot_for(dask_worker)
    with slot.lock:
        active = slot.current()
        if active is None or active.job_id != job_id:
            # Its rank may be on its way (the task started, the rank not yet): it will stop
            # as soon as it does, instead of running after its job was stopped.
            slot.stop_before_start(job_id, reason, failed_rank)
            return False
        if not active.running:
            return False
        active.abort_reason, active.abort_failed_rank = reason, failed_rank
        _process.sever(active.links)
        _process.raise_in_thread(active.thread_id, _Abort)
    if active.master is not None:  # in case it waits at the rendezvous, in C++
        threading.Thread(
            target=_release_waiters, args=(active.master,), name="dask-ddp-release", daemon=True
        ).start()
    logger.info("job %s: stopping rank %d: %s", job_id, active.rank, reason)
    return True


@contextlib.contextmanager
def _claim_slot(spec: RankSpec, run: RankRun, slot: ProcessSlot = PROCESS) -> Iterator[RankRun]:
    def queued(holder: RankRun) -> None:
        # Another job's rank in this process (a worker with several threads): queue behind
        # it, as Dask queues tasks on a single-threaded worker.
        _status.send(
            run,
            _status.QUEUED,
            f"waiting for job {holder.job_id} (rank {holder.rank}) to finish on this worker",
        )

    if not slot.claim(run, spec.rendezvous_timeout, on_wait=queued):
        holder = slot.current()
        raise WorkerBusyError(spec.placement.worker, holder.key if holder else "?")
    try:
        stopped = slot.stopped_before_start(spec.job_id)
        if stopped is not None:  # the client stopped the job while this task was starting
            reason, failed_rank = stopped
            raise RankStoppedError(
                spec.placement.rank, reason, job=spec.job_id, failed_rank=failed_rank
            )
        yield run
    finally:
        # The process group goes after the task returns (the slot stays taken until then):
        # gloo's teardown would otherwise add about 20 ms to every job's end.
        slot.release(run, after=_release_process_group)


def _torchrun_env(spec: RankSpec) -> dict[str, str]:
    p = spec.placement
    env = {
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": str(spec.master_port),
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
        "TORCHELASTIC_RUN_ID": spec.job or spec.job_id,
    }
    if p.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = p.cuda_visible_devices
    if spec.backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        ifname = _interface_of(p.host)
        if ifname is not None:
            # gloo otherwise advertises the address the machine's hostname resolves to, often
            # 127.0.x.1, which ranks on other hosts cannot reach. The Dask worker's own
            # address is reachable by its peers: the scheduler and the other workers use it.
            env["GLOO_SOCKET_IFNAME"] = ifname
    if not spec.init_process_group:
        # The script calls init_process_group("env://") itself; as under torchrun, every
        # rank (rank 0 too) then connects to the store that already listens on MASTER_PORT.
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return env


def _interface_of(address: str) -> str | None:
    """The network interface that carries ``address`` on this machine, if any."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


@contextlib.contextmanager
def _patched_environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


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
        logger.debug("job %s rank %d: %d torch threads", spec.job_id, spec.placement.rank, wanted)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _connect_store(spec: RankSpec, slot: ProcessSlot = PROCESS) -> Any:
    import torch.distributed as dist

    if spec.placement.rank == 0:
        store = slot.take_store(spec.job_id)
        if store is None:
            raise RendezvousTimeoutError(
                0,
                spec.placement.worker,
                spec.key,
                0,
                "the job's store is gone from this worker "
                "(the worker restarted after launch, or the job was cancelled)",
            )
        return store
    try:
        return dist.TCPStore(
            spec.master_addr,
            spec.master_port,
            is_master=False,
            timeout=timedelta(seconds=spec.rendezvous_timeout),
        )
    except (RuntimeError, TimeoutError) as exc:  # DistStoreError subclasses RuntimeError
        raise RendezvousTimeoutError(
            spec.placement.rank,
            spec.placement.worker,
            spec.key,
            spec.rendezvous_timeout,
            f"could not reach rank 0's store at {spec.master_addr}:{spec.master_port} ({exc})",
        ) from exc


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
        store.set(ready, "1")
    elif stage == "joined":
        _status.send(
            run, _status.JOINING, f"waiting for the other ranks ({reached} of {world} joined)"
        )
    try:
        store.wait([ready], timedelta(seconds=spec.rendezvous_timeout))
    except (RuntimeError, TimeoutError) as exc:
        reached = store.add(count, 0)
        raise RendezvousTimeoutError(
            spec.placement.rank,
            spec.placement.worker,
            spec.key,
            spec.rendezvous_timeout,
            f"only {reached} of {world} ranks {stage}",
        ) from exc
    try:
        aborted = store.get(ready) == _ABORTED  # abort_rank released the waiters
    except (RuntimeError, TimeoutError):  # DistNetworkError subclasses RuntimeError
        # The key was set (the wait returned), and rank 0 already finished and closed its
        # store: the job went on without an abort.
        aborted = False
    if aborted:
        raise RankStoppedError(spec.placement.rank, "stopped while ranks gathered", job=spec.job_id)


_ABORTED = b"aborted"
_STAGES = ("joined", "initialised")


def _release_waiters(master: tuple[str, int], timeout: float = 5.0) -> None:
    """Wake every rank of a job that waits in :func:`_rendezvous` or for rank 0's word at a
    checkpoint (:func:`dask_ddp._resize.at_checkpoint`), marked as aborted.

    A thread inside the C++ ``store.wait`` cannot take the asynchronous exception that
    :func:`abort_rank` raises; without this a cancelled job's ranks would wait out the
    rendezvous timeout and cost their workers a restart.
    """
    import torch.distributed as dist

    try:
        store = dist.TCPStore(*master, is_master=False, timeout=timedelta(seconds=timeout))
        for stage in _STAGES:
            store.compare_set(f"dask-ddp/{stage}-ready", "", _ABORTED)
        _resize.release_waiters(store, _ABORTED)  # or at a checkpoint of an elastic job
    except Exception:  # the store is gone: nobody waits on it
        logger.debug("could not release the rendezvous at %s:%d", *master, exc_info=True)


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
            store.wait([_FIRST_FAILURE], timedelta(seconds=1))
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


def run_rank(payload: bytes, spec: RankSpec) -> Any:
    """The rank task: set up, run the job's function, tear down.

    ``payload`` is ``(fn, args, kwargs)`` as the launching client pickled it; it is
    unpickled here, on the rank, and nowhere else (the scheduler only holds the bytes).
    Re-raises the function's own exception unchanged on the rank that failed first; a rank
    that fails because another one did raises :class:`~dask_ddp.errors.RankStoppedError`.
    """
    from distributed import get_worker

    fn, args, kwargs = cloudpickle.loads(payload)
    p = spec.placement
    kwargs = {**kwargs, "local_rank": p.local_rank} if spec.pass_local_rank else kwargs
    worker = get_worker()
    # The channel opens first: the rank's phases (queued, joining) travel on it too.
    channel = events.RankChannel(
        worker,
        spec.job_id,
        p.rank,
        interval=spec.event_flush_interval,
        max_event_bytes=spec.max_event_bytes,
        topic=spec.topic,
    )
    run = RankRun(
        spec.job_id, spec.key, p.rank, channel=channel, master=(spec.master_addr, spec.master_port)
    )
    slot = slot_for(worker)
    value, error = None, None
    try:
        with (
            _claim_slot(spec, run, slot),
            _process_settings(spec) if slot is PROCESS else contextlib.nullcontext(),
        ):
            value = _run_in_slot(fn, args, kwargs, spec, run, worker, slot)
    except BaseException as exc:
        error = exc
        raise
    finally:
        # Sends what fn reported, the final count and how the rank ended before the task
        # finishes, so the supervisor and the clients have every record when they see the
        # result. Never raises: on success its error is raised below, after a failure the
        # rank's own error wins.
        undelivered = channel.close(outcome_of(value, error))
    if undelivered is not None:
        raise undelivered
    return value


@contextlib.contextmanager
def _process_settings(spec: RankSpec) -> Iterator[None]:
    """What a rank sets for its whole process while it runs, restored after it."""
    with (
        _patched_environ(_torchrun_env(spec)),
        _thread_share(spec),
        _process.children_allowed(spec.allow_daemon_children),
        _process.platform_start_method(),
        _malloc.tuned(spec.tune_malloc),
    ):
        yield


def _run_in_slot(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    spec: RankSpec,
    run: RankRun,
    worker: Any,
    slot: ProcessSlot,
) -> Any:
    """Join the process group and run ``fn`` in ``run``, which holds ``slot``."""
    import torch
    import torch.distributed as dist

    p = spec.placement
    store = run.store = _connect_store(spec, slot)  # kept until the task ends, for slow peers
    _rendezvous(store, spec, run)
    if p.use_gpu and torch.cuda.is_available():
        torch.cuda.set_device(0)
    if spec.init_process_group:
        before = _process.socket_fds()
        dist.init_process_group(
            spec.backend,
            store=dist.PrefixStore(f"dask-ddp/{spec.attempt}", store),
            rank=p.rank,
            world_size=p.world_size,
            timeout=timedelta(seconds=spec.timeout),
        )
        run.links = _process.process_group_links(before, _process.dask_ports(worker))
        _rendezvous(store, spec, run, "initialised")
    _status.send(run, _status.RUNNING)
    ctx = RankContext(
        rank=p.rank,
        local_rank=p.local_rank,
        world_size=p.world_size,
        local_world_size=p.local_world_size,
        node_rank=p.node_rank,
        device=torch.device("cuda", 0) if p.use_gpu else torch.device("cpu"),
        backend=spec.backend,
        attempt=spec.attempt,
        job_id=spec.job_id,
        worker=p.worker,
        master_addr=spec.master_addr,
        master_port=spec.master_port,
    )
    logger.debug("job %s: rank %d joined on %s", spec.job_id, p.rank, p.worker)
    checkpointing = CheckpointSettings(
        spec.checkpoint_dir,
        spec.keep_last,
        spec.storage_options,
        grow_timeout=spec.timeout if spec.can_grow else None,
        mode=spec.checkpoint_mode,
        job=spec.job or spec.job_id,
        replica_holder=spec.replica_holder,
        replica_fraction=spec.replica_fraction,
        restore=spec.restore,
    )
    saver, resumer = _checkpointing(checkpointing, ctx, run, worker)
    try:
        with (
            _activated(run, ctx, checkpointing, spec.datasets, saver, resumer),
            # A lane shares its process's streams with the other lanes: nothing to forward.
            _output.forwarded(run.channel) if slot is PROCESS else contextlib.nullcontext(),
        ):
            return fn(*args, **kwargs)
    except BaseException as exc:
        slot.stop_running(run)
        if run.abort_reason is not None:
            raise RankStoppedError(
                p.rank, run.abort_reason, job=spec.job_id, failed_rank=run.abort_failed_rank
            ) from exc
        first = _first_failure(store, p.rank, exc, peer_lost=_process.is_peer_loss(exc))
        with slot.lock:
            _process.sever(run.links)
        if isinstance(exc, _resize.GrowAtCheckpoint):
            # Every rank stops here (rank 0 recorded it first, for a rank that skipped the
            # checkpoint call: its next collective fails on the severed links).
            return Resized(exc.step)
        if first is not None:
            raise RankStoppedError(p.rank, first[1], failed_rank=first[0]) from exc
        raise
    finally:
        slot.stop_running(run)


def _checkpointing(
    settings: CheckpointSettings, ctx: RankContext, run: RankRun, worker: Any
) -> tuple[_saving.Saver | None, _resume.Resumer | None]:
    """What saves and loads the rank's checkpoints (None without ``checkpoint_dir``)."""
    if settings.directory is None:
        return None, None
    channel = run.channel

    def announce(kind: str, body: list[Any]) -> None:
        if channel is not None:
            channel.put(kind, body, "save_checkpoint", urgent=True)

    peer = _replicas.PeerLink(worker, settings.job)
    saver = _saving.Saver(
        settings,
        rank=ctx.rank,
        world_size=ctx.world_size,
        announce=announce,
        peer=peer,
        memory=lambda: (_replicas.process_memory(), _replicas.memory_limit(worker)),
        status=lambda text: _status.send(run, None, text),
    )
    resumer = _resume.Resumer(
        settings,
        rank=ctx.rank,
        world_size=ctx.world_size,
        device=ctx.device,
        peer=peer,
        announce=announce,
    )
    return saver, resumer


def _release_process_group() -> None:
    """Destroy the default process group, if the rank (or its script) left one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()

"""What runs on the workers: the probe before launch, and the rank task itself.

The rank task (:func:`run_rank`) sets the torchrun environment, joins the process group,
calls the user's function and always leaves the worker as it found it: environment,
thread count, daemon flag, malloc thresholds and the default process group are restored, on success,
exception or abort.

Rendezvous: the probe opens the job's ``TCPStore`` on rank 0's worker (port 0, so the OS
picks a free port) before any rank task is submitted. The store therefore listens before
any rank connects, and two jobs never share a port.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing
import os
import socket
import stat
import threading
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from . import _malloc, _output, _status, events
from .context import RankContext, _activated, _Checkpointing, _datasets_activated
from .errors import PeerFailedError, RankAbortedError, RendezvousTimeoutError, WorkerBusyError
from .placement import RankPlacement

logger = logging.getLogger(__name__)

_FAILURES = "dask-ddp/failures"
_FIRST_FAILURE = "dask-ddp/first-failure"


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


@dataclasses.dataclass
class _ActiveRank:
    job_id: str
    key: str
    rank: int
    thread_id: int
    running: bool = True
    abort_reason: str | None = None
    links: frozenset[int] = frozenset()  # socket fds the process group opened (gloo)
    master: tuple[str, int] | None = None  # the job's store, to release its rendezvous


# One rank per worker process at a time: the default process group, the environment and
# the torch thread count are per process. Keyed state below is per job id.
_lock = threading.Lock()
_slot_free = threading.Condition(_lock)
_active: _ActiveRank | None = None
_stores: dict[str, Any] = {}


class _Abort(BaseException):
    """Raised asynchronously in a rank's thread by :func:`abort_rank`.

    A BaseException, so that ``except Exception`` in training code does not swallow it;
    :func:`run_rank` turns it into :class:`~dask_ddp.errors.RankAbortedError`.
    """


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _open_store(job_id: str, host: str, timeout: float) -> int:
    import torch.distributed as dist

    store = dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )
    with _lock:
        _stores[job_id] = store
    return store.port


async def probe_worker(
    job_id: str, store_worker: str, store_timeout: float, dask_worker: Any = None
) -> dict[str, Any]:
    """Run by ``client.run`` on each chosen worker before launch.

    Reports the worker's GPUs, its own ``CUDA_VISIBLE_DEVICES`` and the rank it is running,
    if any; on rank 0's worker (``store_worker``) also opens the job's store. The torch
    import runs in a thread so the worker's event loop stays responsive.
    """
    loop = asyncio.get_running_loop()
    gpus = await loop.run_in_executor(None, _gpu_count)
    port = None
    if dask_worker.address == store_worker:
        port = await loop.run_in_executor(None, _open_store, job_id, dask_worker.ip, store_timeout)
    active = _active
    return {
        "gpu_count": gpus,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "busy": active.key if active is not None else None,
        "store_port": port,
    }


def drop_store(job_id: str, dask_worker: Any = None) -> bool:
    """Close the job's store if no rank took it (the job failed or was cancelled first)."""
    with _lock:
        return _stores.pop(job_id, None) is not None


def abort_rank(job_id: str, reason: str, dask_worker: Any = None) -> bool:
    """Stop this process's rank of ``job_id``, if it is still in the user's function.

    Raises :class:`~dask_ddp.errors.RankAbortedError` in the rank's thread at its next
    Python instruction. A rank blocked inside a C++ collective only sees it once the
    collective returns; the client restarts such workers after a grace period.
    """
    with _lock:
        active = _active
        if active is None or active.job_id != job_id or not active.running:
            return False
        active.abort_reason = reason
        _sever(active)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(active.thread_id), ctypes.py_object(_Abort)
        )
    if active.master is not None:  # in case it waits at the rendezvous, in C++
        threading.Thread(
            target=_release_waiters, args=(active.master,), name="dask-ddp-release", daemon=True
        ).start()
    logger.info("job %s: stopping rank %d: %s", job_id, active.rank, reason)
    return True


@contextlib.contextmanager
def _claim_slot(spec: RankSpec) -> Iterator[_ActiveRank]:
    global _active
    with _slot_free:
        # Another job's rank in this process (a worker with several threads): queue behind
        # it, as Dask queues tasks on a single-threaded worker.
        if _active is not None:
            _status.phase(
                _status.QUEUED,
                f"waiting for job {_active.job_id} (rank {_active.rank}) to finish on this worker",
            )
        if not _slot_free.wait_for(lambda: _active is None, timeout=spec.rendezvous_timeout):
            raise WorkerBusyError(spec.placement.worker, _active.key)
        _active = _ActiveRank(
            spec.job_id,
            spec.key,
            spec.placement.rank,
            threading.get_ident(),
            master=(spec.master_addr, spec.master_port),
        )
        slot = _active
    try:
        yield slot
    finally:
        _release_process_group()  # again here: an abort may have cut run_rank's cleanup short
        with _slot_free:
            slot.running = False
            _active = None
            _slot_free.notify()


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
        "TORCHELASTIC_RESTART_COUNT": str(spec.attempt),
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


@contextlib.contextmanager
def _children_allowed(allowed: bool) -> Iterator[None]:
    """Let a daemonic Dask worker start DataLoader worker processes while the rank runs.

    multiprocessing refuses children of a daemonic process because it would not wait for
    them at exit. DataLoader workers watch their parent and exit with it, so clearing the
    flag for the rank's lifetime is safe; it is restored afterwards.
    """
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    was = config.get("daemon")
    if allowed and was:
        config["daemon"] = False
    try:
        yield
    finally:
        if allowed and was:
            config["daemon"] = was


def _connect_store(spec: RankSpec) -> Any:
    import torch.distributed as dist

    if spec.placement.rank == 0:
        with _lock:
            store = _stores.pop(spec.job_id, None)
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


def _rendezvous(store: Any, spec: RankSpec, stage: str = "joined") -> None:
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
        _status.phase(_status.JOINING, f"waiting for the other ranks ({reached} of {world} joined)")
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
    if store.get(ready) == _ABORTED:  # abort_rank released the waiters: stop here
        raise RankAbortedError(spec.placement.rank, spec.job_id, "stopped while ranks gathered")


_ABORTED = b"aborted"
_STAGES = ("joined", "initialised")


def _release_waiters(master: tuple[str, int], timeout: float = 5.0) -> None:
    """Wake every rank of a job that waits in :func:`_rendezvous`, marked as aborted.

    A thread inside the C++ ``store.wait`` cannot take the asynchronous exception that
    :func:`abort_rank` raises; without this a cancelled job's ranks would wait out the
    rendezvous timeout and cost their workers a restart.
    """
    import torch.distributed as dist

    try:
        store = dist.TCPStore(*master, is_master=False, timeout=timedelta(seconds=timeout))
        for stage in _STAGES:
            store.compare_set(f"dask-ddp/{stage}-ready", "", _ABORTED)
    except Exception:  # the store is gone: nobody waits on it
        logger.debug("could not release the rendezvous at %s:%d", *master, exc_info=True)


def _socket_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        with contextlib.suppress(OSError, ValueError):
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                fds.add(int(name))
    return fds


def _pg_links(before: set[int], dask_ports: set[int]) -> frozenset[int]:
    """Sockets opened by init_process_group: new since ``before``, not Dask's own comms."""
    links = set()
    for fd in _socket_fds() - before:
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=fd)
            try:
                local, remote = sock.getsockname(), sock.getpeername()
            except OSError:
                continue  # a listening socket: no peer to release
            finally:
                sock.detach()
            if local[1] not in dask_ports and remote[1] not in dask_ports:
                links.add(fd)
    return frozenset(links)


def _sever(slot: _ActiveRank) -> None:
    """Shut down the rank's process-group connections so that peers blocked in a collective
    with this rank fail at once ("Connection closed by peer") instead of waiting for the
    collective timeout. gloo keeps its connections open as long as anything (a DDP module in
    a traceback, say) holds the group, and neither abort() nor destroy_process_group() closes
    them; a closed connection is what releases the peers, as when a process dies. The fds
    stay gloo's: they are shut down, never closed here. Call with ``_lock`` held, while the
    group is alive.
    """
    for fd in slot.links:
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=fd)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.detach()


def _dask_ports() -> set[int]:
    from distributed import get_worker
    from distributed.comm import parse_host_port

    worker = get_worker()
    ports = {worker.port}
    with contextlib.suppress(Exception):
        ports.add(parse_host_port(worker.scheduler.address.split("://")[-1])[1])
    return ports


_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Read error")


def _is_peer_loss(exc: BaseException) -> bool:
    """Did a collective fail because a peer's connection went away?"""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, (RuntimeError, dist.DistError)) and any(m in text for m in _PEER_LOSS)


def _first_failure(store: Any, rank: int, *, peer_lost: bool = False) -> int | None:
    """Record this rank's failure; return the rank that failed first if it was another.

    A rank whose collective failed because a peer's connection closed, when no rank has
    recorded a failure, did not fail first: a peer's process died (killed, out of memory).
    It returns -1 (unknown) then, and the client names the lost worker.
    """
    try:
        if peer_lost:
            store.wait([_FIRST_FAILURE], timedelta(seconds=1))
        elif store.add(_FAILURES, 1) == 1:
            store.set(_FIRST_FAILURE, str(rank))
            return None
        store.wait([_FIRST_FAILURE], timedelta(seconds=2))
        first = int(store.get(_FIRST_FAILURE))
    except (RuntimeError, TimeoutError, ValueError):
        # Nobody recorded a failure (or rank 0's store is gone with its process).
        return -1 if peer_lost else None
    return None if first == rank else first


def run_rank(fn: Callable[..., Any], args: tuple, kwargs: dict, spec: RankSpec) -> Any:
    """The rank task: set up, run ``fn(*args, **kwargs)``, tear down.

    Re-raises the function's own exception unchanged on the rank that failed first; a rank
    that fails because another one did raises :class:`~dask_ddp.errors.PeerFailedError`.
    """
    import torch
    import torch.distributed as dist
    from distributed import get_worker

    p = spec.placement
    kwargs = {**kwargs, "local_rank": p.local_rank} if spec.pass_local_rank else kwargs
    with (
        _status.reporting(get_worker(), spec.job_id, p.rank),
        _claim_slot(spec) as slot,
        _patched_environ(_torchrun_env(spec)),
        _thread_share(spec),
        _children_allowed(spec.allow_daemon_children),
        _malloc.tuned(spec.tune_malloc),
    ):
        store = _connect_store(spec)
        _rendezvous(store, spec)
        if p.use_gpu and torch.cuda.is_available():
            torch.cuda.set_device(0)
        if spec.init_process_group:
            before = _socket_fds()
            dist.init_process_group(
                spec.backend,
                store=dist.PrefixStore(f"dask-ddp/{spec.attempt}", store),
                rank=p.rank,
                world_size=p.world_size,
                timeout=timedelta(seconds=spec.timeout),
            )
            slot.links = _pg_links(before, _dask_ports())
            _rendezvous(store, spec, "initialised")
        _status.phase(_status.RUNNING)
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
        channel = _open_channel(spec)
        try:
            checkpointing = _Checkpointing(
                spec.checkpoint_dir, spec.keep_last, spec.storage_options
            )
            with (
                _activated(ctx, channel, checkpointing),
                _datasets_activated(spec.datasets),
                _output.forwarded(channel),
            ):
                value = fn(*args, **kwargs)
        except BaseException as exc:
            with _lock:
                slot.running = False
            if slot.abort_reason is not None:
                raise RankAbortedError(p.rank, spec.job_id, slot.abort_reason) from exc
            first = _first_failure(store, p.rank, peer_lost=_is_peer_loss(exc))
            with _lock:
                _sever(slot)
            if first is not None:
                raise PeerFailedError(p.rank, first, f"{type(exc).__name__}: {exc}") from exc
            raise
        finally:
            with _lock:
                slot.running = False
            # Sends what fn reported and the final count before the task finishes, so the
            # client has every record when it sees the result. Never raises: on success
            # its error is raised below, after a failure the rank's own error wins.
            undelivered = channel.close()
            _release_process_group()
        if undelivered is not None:
            raise undelivered
        return value


def _open_channel(spec: RankSpec) -> events.RankChannel:
    from distributed import get_worker

    return events.RankChannel(
        get_worker(),
        spec.job_id,
        spec.placement.rank,
        interval=spec.event_flush_interval,
        max_event_bytes=spec.max_event_bytes,
    )


def _release_process_group() -> None:
    """Destroy the default process group, if the rank (or its script) left one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def format_exception(exc: BaseException) -> str:
    """The rank-side traceback as text, for the client's error message."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))

"""Process-level measures a rank takes inside its Dask worker, in one place.

Each one reaches below Python's usual abstractions, and each was needed on the real stack:

- :func:`children_allowed`: let a daemonic Dask worker start DataLoader worker processes.
- :func:`platform_start_method`: start them the way they start under torchrun (fork on
  Linux before Python 3.14), not with the spawn that a Dask worker inherits.
- :func:`inherited_objects_frozen`: a forked child leaves the objects it inherited out of
  its garbage collection.
- :func:`socket_fds`, :func:`process_group_links`, :func:`sever`: find the sockets that
  ``init_process_group`` opened and shut them down, so gloo's peers fail in milliseconds;
  :func:`groups_watched`: find them for a group a script or a framework makes itself.
- :func:`dask_ports`: the worker's own ports, never among the sockets shut down.
- :func:`is_peer_loss`: recognise a collective that failed because a peer went away.
- :func:`fresh_group_names`: name the next default process group as a fresh process would.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import multiprocessing
import os
import socket
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "children_allowed",
    "dask_ports",
    "fresh_group_names",
    "groups_watched",
    "inherited_objects_frozen",
    "is_peer_loss",
    "platform_start_method",
    "process_group_links",
    "sever",
    "socket_fds",
]


@contextlib.contextmanager
def children_allowed(allowed: bool) -> Iterator[None]:
    """Let a daemonic Dask worker start DataLoader worker processes while the block runs.

    multiprocessing refuses children of a daemonic process because it would not wait for
    them at exit. DataLoader workers watch their parent and exit with it, so clearing the
    flag for the rank's lifetime is safe; it is restored afterwards.

    >>> with children_allowed(True):
    ...     pass
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


@contextlib.contextmanager
def platform_start_method() -> Iterator[None]:
    """Make the platform's default the default start method while the block runs.

    A Dask worker process is started with spawn, and a spawned process inherits spawn as
    its default, so ``DataLoader(num_workers=2)`` in a rank would spawn its workers and
    pickle the dataset, where under torchrun (a plain process) it forks: code whose
    dataset holds a local function (wids's notebooks do) fails with "Can't pickle local
    object". The default is restored afterwards; ``multiprocessing_context=`` still wins.

    >>> with platform_start_method():
    ...     multiprocessing.get_start_method() == multiprocessing.get_all_start_methods()[0]
    True
    """
    was = multiprocessing.get_start_method(allow_none=True)
    default = multiprocessing.get_all_start_methods()[0]
    if was != default:
        multiprocessing.set_start_method(default, force=True)
    try:
        yield
    finally:
        if was != default:
            multiprocessing.set_start_method(was, force=True)


class _ForkFreeze:
    """How many blocks want forked children frozen; the fork hook is registered once (a
    process cannot unregister one)."""

    lock = threading.Lock()
    depth = 0
    registered = False

    @classmethod
    def after_in_child(cls) -> None:
        if cls.depth:
            gc.freeze()


@contextlib.contextmanager
def inherited_objects_frozen() -> Iterator[None]:
    """Have a process forked while the block runs (a DataLoader worker) start with every
    object it inherited frozen (:func:`gc.freeze`): its garbage collector never visits them.

    A Dask worker forks from a process where other threads run (the event loop, its
    profiler, gloo's): a forked DataLoader worker of a rank died of a segmentation fault in
    two CI runs, the second in its collector, in its first batch. Python's documentation
    recommends the same for a fork without exec: the pages of the inherited objects are
    not written by the child's collector, so they stay shared with the parent. Objects the
    child makes are collected as usual; inherited ones live as long as the child.

    >>> with inherited_objects_frozen():
    ...     pass
    """
    with _ForkFreeze.lock:
        if not _ForkFreeze.registered:
            os.register_at_fork(after_in_child=_ForkFreeze.after_in_child)
            _ForkFreeze.registered = True
        _ForkFreeze.depth += 1
    try:
        yield
    finally:
        with _ForkFreeze.lock:
            _ForkFreeze.depth -= 1


def socket_fds() -> set[int]:
    """The file descriptors of this process's open sockets (empty without ``/proc``)."""
    fds = set()
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        with contextlib.suppress(OSError, ValueError):
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                fds.add(int(name))
    return fds


def process_group_links(before: set[int], dask_ports: set[int]) -> frozenset[int]:
    """Sockets opened since ``before`` (the process group's), not Dask's own comms.

    Listening sockets are left out: they have no peer to release.
    """
    links = set()
    for fd in socket_fds() - before:
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=fd)
            try:
                local, remote = sock.getsockname(), sock.getpeername()
            except OSError:
                continue
            finally:
                sock.detach()
            if local[1] not in dask_ports and remote[1] not in dask_ports:
                links.add(fd)
    return frozenset(links)


def sever(links: Iterable[int]) -> None:
    """Shut down the process group's connections so that peers blocked in a collective
    with this rank fail at once ("Connection closed by peer") instead of waiting for the
    collective timeout.

    gloo keeps its connections open as long as anything (a DDP module in a traceback, say)
    holds the group, and neither ``abort()`` nor ``destroy_process_group()`` closes them; a
    closed connection is what releases the peers, as when a process dies. The fds stay
    gloo's: they are shut down, never closed here. Call it while the group is alive.
    """
    for fd in links:
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=fd)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.detach()


@contextlib.contextmanager
def groups_watched(on_links: Callable[[frozenset[int]], None], ignore: set[int]) -> Iterator[None]:
    """While the block runs, every ``torch.distributed.init_process_group`` in this process
    (the rank's own, a script's, Lightning's or accelerate's) tells ``on_links`` the sockets
    its group opened (:func:`process_group_links`, Dask's ports ``ignore`` left out), and
    names the group as in a fresh process (:func:`fresh_group_names`); every
    ``destroy_process_group`` of the default group tells it there are none any more (their
    fds are closed then, and may be reused by other sockets). Restored afterwards.

    >>> with groups_watched(print, set()):
    ...     pass
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    init, destroy = dist.init_process_group, dist.destroy_process_group

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        before = socket_fds()
        fresh_group_names()
        result = init(*args, **kwargs)
        on_links(process_group_links(before, ignore))
        return result

    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None) -> Any:
        if group is None or group is c10d.GroupMember.WORLD:
            on_links(frozenset())
        return destroy(group)

    dist.init_process_group = c10d.init_process_group = init_process_group
    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group
    try:
        yield
    finally:
        dist.init_process_group = c10d.init_process_group = init
        dist.destroy_process_group = c10d.destroy_process_group = destroy


def dask_ports(worker: Any) -> set[int]:
    """The ports of ``worker``'s own listener and of its scheduler."""
    from distributed.comm import parse_host_port

    ports = {worker.port}
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        ports.add(parse_host_port(worker.scheduler.address.split("://")[-1])[1])
    return ports


_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Read error")


def is_peer_loss(exc: BaseException) -> bool:
    """Did a collective fail because a peer's connection went away?

    >>> is_peer_loss(RuntimeError("[gloo] Connection closed by peer [10.0.0.7]:4711"))
    True
    >>> is_peer_loss(ValueError("Connection closed by peer"))
    False
    """
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, (RuntimeError, dist.DistError)) and any(m in text for m in _PEER_LOSS)


def fresh_group_names() -> None:
    """Name the next default process group as a fresh process names it, when none exists.

    torch names a process group after a per-process counter (its gloo connections meet
    under that name in the store) and resets the counter only when a default group is
    destroyed. An ``init_process_group`` that failed (a peer's process died while the mesh
    connected, the job was stopped then) counts one more and leaves no group to destroy:
    the next job's rank in this process would then wait under another name than its peers
    (a fresh process, or one whose last init succeeded), in ``init_process_group``, until
    the collective timeout. Called before every init and after every rank.

    Private torch API: ``torch.distributed.distributed_c10d._world.group_count`` (checked
    with torch 2.14); without it nothing is done.
    """
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    if world is not None and hasattr(world, "group_count") and not c10d.is_initialized():
        world.group_count = 0

"""The job stores a worker opens for its rank 0s, held in a process forked from its template.

A job's ``TCPStore`` listens on rank 0's worker from the probe on, before any rank task is
submitted (:mod:`dask_ddp._rank.tasks`), and outlives rank 0's process: the worker releases
the ranks waiting in it when the job stops. Opened in the worker, it cost the worker a torch
import (1.5-3 s of CPU on a fresh worker, beside its template's own): the store now lives in
a small process forked from the worker's template (:mod:`dask_ddp._rank.template`, torch already
imported), one per worker (:class:`StoreHost`, its host's), and the worker holds a
:class:`RemoteStore` that forwards the
few calls it makes (``port``, ``set_timeout``, ``check``, ``get``, ``compare_set``) over a
pipe. The host exits when its worker does (its pipe closes); a host that died is forked
again for the next store.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

logger = logging.getLogger(__name__)


class _Host:
    """This worker's store host: its process and the pipe to it (one call at a time)."""

    def __init__(self, process: Any, conn: Any) -> None:
        self.process, self.conn = process, conn
        self.lock = threading.Lock()
        self.ids = itertools.count(1)  # of the stores it holds
        self._closed: list[int] = []  # stores let go, their close not sent yet

    def alive(self) -> bool:
        return self.process.exitcode is None and not self.conn.closed

    def call(self, *request: Any) -> Any:
        with self.lock:
            try:
                self._send_closes()
                self.conn.send(request)
                ok, value = self.conn.recv()
            except (EOFError, OSError) as exc:
                raise ConnectionError(
                    f"the worker's store host (pid {self.process.pid}) is gone "
                    f"(exit code {self.process.exitcode})"
                ) from exc
        if not ok:
            try:
                raise value
            finally:  # no cycle through this frame: a store in a caller's is let go at once
                del value
        return value

    def close_later(self, store_id: int) -> None:
        """Close a store let go: now if the pipe is free, else with the next call (a
        store's finalizer may run in a thread that is in the middle of a call)."""
        self._closed.append(store_id)
        if self.lock.acquire(blocking=False):
            try:
                self._send_closes()
            except (EOFError, OSError):  # the host went with its stores
                pass
            finally:
                self.lock.release()

    def _send_closes(self) -> None:
        while self._closed:
            self.conn.send(("close", self._closed.pop(), None, ()))  # no answer


class StoreHost:
    """A worker's store host, as its :class:`~dask_ddp._rank.host.ProcessHost` holds it:
    forked (``fork(target, args, conns)``, from the worker's template) on the first store,
    and again after it died."""

    def __init__(self, fork: Callable[..., Any]) -> None:
        self._fork = fork
        self._lock = threading.Lock()
        self._host: _Host | None = None

    def _current(self) -> _Host:
        with self._lock:
            if self._host is not None and self._host.alive():
                return self._host
            from . import rankproc

            ours, theirs = rankproc.link_pair()
            try:
                process = self._fork(_host_main, (), [theirs])
            except BaseException:
                ours.close()
                raise
            self._host = _Host(process, ours)
            return self._host

    @property
    def pid(self) -> int | None:
        """Its process's pid (None before its first store)."""
        host = self._host
        return host.process.pid if host is not None else None

    def open(self, address: str, timeout: float) -> RemoteStore:
        """(In a thread of the worker's.) A new store listening on ``address`` (the worker's
        own; :func:`new_store`), held by the store host."""
        host = self._current()
        store_id = next(host.ids)
        port = host.call("open", store_id, address, (timeout,))
        return RemoteStore(host, store_id, port)


class RemoteStore:
    """A job's ``TCPStore`` held by this worker's store host: its ``port``, and its methods
    called there. Closed by :meth:`close`, or once this object is let go (as a ``TCPStore``
    closes when it is)."""

    def __init__(self, host: _Host, store_id: int, port: int) -> None:
        self._host, self._id, self.port = host, store_id, port
        self._closing = weakref.finalize(self, _close_quietly, host, store_id)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any) -> Any:
            return self._host.call("call", self._id, name, args)

        return call

    def close(self) -> None:
        self._closing()


def _close_quietly(host: _Host, store_id: int) -> None:
    if host.alive():
        host.close_later(store_id)


def new_store(host: str, timeout: float) -> Any:
    """A ``TCPStore`` listening on ``host`` (its worker's own address) on a port the OS
    picks, within ``timeout`` seconds a wait."""
    import torch.distributed as dist

    fd, port = _listen_on(host)
    try:
        return dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=timeout), master_listen_fd=fd,
        )  # fmt: skip
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise


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


def _host_main(conn: Any) -> None:
    """The store host: open, call and close stores as its worker asks, until it goes (a
    terminal's Ctrl-C is not for it: the job's stop that follows releases the ranks
    through it)."""
    stores: dict[int, Any] = {}
    while True:
        try:
            kind, store_id, what, args = conn.recv()
        except (EOFError, OSError):
            return  # the worker went: its stores close with this process
        if kind == "close":
            stores.pop(store_id, None)
            continue
        try:
            if kind == "open":
                store = stores[store_id] = new_store(what, *args)
                value: Any = store.port
            else:  # call
                value = getattr(stores[store_id], what)(*args)
            reply: tuple[bool, Any] = (True, value)
        except Exception as exc:
            reply = (False, _plain(exc))
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except Exception as exc:  # an answer that does not pickle
            conn.send((False, RuntimeError(f"{kind} {what}: {type(exc).__name__}: {exc}")))


def _plain(exc: Exception) -> Exception:
    """``exc`` as its worker can take it without importing torch: torch's own store errors
    (``DistStoreError``, a ``RuntimeError``; ``DistNetworkError``) as the builtin they
    derive from, their type named in the message."""
    if type(exc).__module__ == "builtins":
        return exc
    base = TimeoutError if isinstance(exc, TimeoutError) else RuntimeError
    return base(f"{type(exc).__name__}: {exc}")

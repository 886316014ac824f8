"""A fork server of dask-ddp's own: a process that imported torch once and forks a process
on request, built on public APIs only (``subprocess``, ``socket``, ``os.fork``).

The rank template (:mod:`dask_ddp._rank.template`) is one of these. Its owner starts it
(:func:`start`) as a fresh interpreter with a listening Unix socket (bound by the owner,
so that requests queue while the server still imports) and the read end of a pipe as its
standard input: the server exits once that pipe closes (its owner stopped it, or died),
leaving what it forked to their workers. Any process that knows the socket's path asks it
for a process (:func:`fork`): a function named by reference, its arguments, file
descriptors passed beside them (``socket.send_fds``), the environment, working directory
and ``sys.path`` the new process takes. The server forks, answers the child's pid, and
writes its exit code on the same connection when it ends, which is then the requester's
handle on it (:class:`ForkedProcess`: its ``exitcode``, ``join``; readable once it ended).

Why not ``multiprocessing``'s forkserver: a forkserver of one's own there means subclassing
``ForkServer``, writing its private fields and copying ``popen_forkserver.Popen._launch``,
whose private names change between Python releases (3.12's authentication handshake). The
server here runs no thread (a fork copies only the forking thread), freezes its objects
before each fork (``gc.freeze``, as Python's documentation advises for forked workers), and
outlives a requester that vanishes mid-request (its connection is dropped).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import pickle
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["ForkedProcess", "Server", "fork", "serve", "start"]

_WORD = struct.Struct("q")
_MAX_FDS = 16  # descriptors a request may pass
_REQUEST_TIMEOUT = 10.0  # seconds a requester may take to send what it announced
_UNKNOWN_EXIT = 255  # the exit code of a process whose server went before it (multiprocessing's)

#: The server's first lines: its owner's ``sys.path``, then :func:`serve`.
_BOOT = (
    "import json, sys; config = json.loads(sys.argv[1]); sys.path[:] = config['path']; "
    "from dask_ddp._rank import forkserver; forkserver.serve(config)"
)


class ForkedProcess:
    """A process a fork server started for this one: its pid, and its exit code once it
    ended (the server writes it on the request's connection, then closes it).

    Its ``sentinel`` (a file descriptor) becomes readable when the process ended, or when
    its server went (then its exit code is 255: unknown, as multiprocessing says).
    """

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self._conn = conn
        self._exitcode: int | None = None
        self._lock = threading.Lock()

    @property
    def sentinel(self) -> int:
        return self._conn.fileno()

    @property
    def exitcode(self) -> int | None:
        """Its exit code (negative: the signal that ended it), None while it runs."""
        self.join(0)
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        """Wait until it ended, at most ``timeout`` seconds (None: as long as it runs)."""
        with self._lock:
            if self._exitcode is not None:
                return
            conn = self._conn
            try:
                conn.settimeout(timeout)
                data = _recv_exactly(conn, _WORD.size)
            except (TimeoutError, BlockingIOError):
                return
            except OSError:
                data = b""
            self._exitcode = _WORD.unpack(data)[0] if len(data) == _WORD.size else _UNKNOWN_EXIT
            conn.close()

    def is_alive(self) -> bool:
        return self.exitcode is None

    def close(self) -> None:
        """Stop following it (its exit code is then unknown here)."""
        with self._lock:
            self._conn.close()
            if self._exitcode is None:
                self._exitcode = _UNKNOWN_EXIT

    def __repr__(self) -> str:
        return f"<ForkedProcess pid={self.pid} exitcode={self._exitcode}>"


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``conn``; fewer only if it closed first."""
    chunks, left = [], n
    while left:
        chunk = conn.recv(left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def fork(
    address: str,
    target: Callable[..., Any],
    args: Sequence[Any] = (),
    fds: Sequence[int] = (),
    environ: dict[str, str] | None = None,
) -> ForkedProcess:
    """Ask the fork server at ``address`` for a process running ``target(fds, *args)``.

    ``target`` and ``args`` are pickled (``target`` by reference: a module-level function the
    server can import); ``fds`` are passed to the new process (received there as new
    descriptors, in order; this process keeps its own). The process takes ``environ``
    (default: this process's environment), this process's working directory and
    ``sys.path``. Waits while the server still imports what it preloads.

    Raises
    ------
    OSError
        The server is gone, or could not fork.
    """
    payload = pickle.dumps(
        (target, tuple(args), dict(os.environ if environ is None else environ), os.getcwd(),
         list(sys.path)),
        protocol=pickle.HIGHEST_PROTOCOL,
    )  # fmt: skip
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address)
        socket.send_fds(conn, [_WORD.pack(len(payload))], list(fds))
        conn.sendall(payload)
        answer = _recv_exactly(conn, _WORD.size)
    except BaseException:
        conn.close()
        raise
    pid = _WORD.unpack(answer)[0] if len(answer) == _WORD.size else -1
    if pid <= 0:
        conn.close()
        raise ConnectionRefusedError(f"the fork server at {address} did not fork (it is gone?)")
    return ForkedProcess(pid, conn)


class Server:
    """A fork server this process started (:func:`start`): its address (a Unix socket's
    path), its process, and the pipe whose closing stops it."""

    def __init__(self, address: str, process: subprocess.Popen, alive: int) -> None:
        self.address, self.process, self._alive = address, process, alive

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """Let it go: it exits once it sees its pipe closed (after its imports, if it is
        still importing), its children left running. Reaped by a thread of its own."""
        with contextlib.suppress(OSError):
            os.close(self._alive)
        with contextlib.suppress(OSError):
            os.unlink(self.address)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.address))
        threading.Thread(
            target=self.process.wait, name="dask-ddp-forkserver-exit", daemon=True
        ).start()


def start(preload: Sequence[str], environ: dict[str, str] | None = None) -> Server:
    """Start a fork server that imports ``preload`` before it serves: module names (one that
    fails to import is skipped), and ``module:function`` for a function it calls then.
    Returns at once: requests wait in its socket's backlog while it imports."""
    folder = tempfile.mkdtemp(prefix="dask-ddp-")
    address = os.path.join(folder, "forkserver")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    alive_r, alive_w = os.pipe()
    try:
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
        config = {
            "path": list(sys.path),
            "preload": list(preload),
            "fd": listener.fileno(),
            "address": address,
        }
        process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, json.dumps(config)],
            stdin=alive_r,
            pass_fds=(listener.fileno(),),
            env=os.environ if environ is None else environ,
        )
    except BaseException:
        os.close(alive_w)
        with contextlib.suppress(OSError):
            os.unlink(address)
        os.rmdir(folder)
        raise
    finally:
        listener.close()
        os.close(alive_r)
    return Server(address, process, alive_w)


# -- the server's side --------------------------------------------------------------------------


def serve(config: dict[str, Any]) -> None:
    """The fork server's main (run by :data:`_BOOT` in a fresh interpreter): import what it
    preloads, then fork on request until its standard input closes; then remove its socket
    and folder, which an owner killed before its :meth:`Server.stop` leaves behind."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is its owner's to take
    listener = socket.socket(fileno=config["fd"])
    for name in config["preload"]:
        module, _, function = name.partition(":")
        try:
            imported = importlib.import_module(module)
            if function:
                getattr(imported, function)()
        except ImportError:
            pass
        except Exception:  # a preload's failure costs the forks that import, never the server
            logger.debug("the fork server could not preload %s", name, exc_info=True)
    try:
        _Loop(listener).run()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(config["address"])
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(config["address"]))


class _Loop:
    """The server's one thread: accept requests, fork, tell each requester its process's
    end."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.children: dict[int, socket.socket] = {}
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, self._accept)
        self.selector.register(0, selectors.EVENT_READ, self._owner)
        self.selector.register(self.wake_r, selectors.EVENT_READ, self._reap)
        self.serving = True

    def run(self) -> None:
        while self.serving:
            for key, _ in self.selector.select():
                key.data()
        self._reap()  # what ended meanwhile; the others' requesters learn 255 (unknown)

    def _owner(self) -> None:
        try:
            data = os.read(0, 1)
        except OSError:
            data = b""
        if not data:
            self.serving = False

    def _reap(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self.wake_r, 4096):
                pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(_WORD.pack(os.waitstatus_to_exitcode(status)))
                conn.close()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            conn.settimeout(_REQUEST_TIMEOUT)
            head, fds, _, _ = socket.recv_fds(conn, _WORD.size, _MAX_FDS)
            head += _recv_exactly(conn, _WORD.size - len(head))
            payload = _recv_exactly(conn, _WORD.unpack(head)[0])
            target, args, environ, cwd, path = pickle.loads(payload)
        except Exception:  # a requester that vanished mid-request (killed), or garbage
            logger.debug("the fork server dropped a request", exc_info=True)
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        gc.freeze()  # a child's collections leave what it shares with this process alone
        pid = os.fork()
        if pid == 0:
            self._child(conn, target, args, fds, environ, cwd, path)  # never returns
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(_WORD.pack(pid))
        except OSError:  # the requester went: the child's end is nobody's to hear
            conn.close()
            return
        self.children[pid] = conn

    def _child(
        self,
        conn: socket.socket,
        target: Callable[..., Any],
        args: tuple,
        fds: list[int],
        environ: dict[str, str],
        cwd: str,
        path: list[str],
    ) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.selector.close()
            for sock in (conn, self.listener, *self.children.values()):
                sock.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)  # the owner's pipe is the server's alone
            os.close(devnull)
            os.environ.clear()
            os.environ.update(environ)
            with contextlib.suppress(OSError):
                os.chdir(cwd)
            sys.path[:] = path
            target(fds, *args)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)

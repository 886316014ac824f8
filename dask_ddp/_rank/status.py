"""What a rank is doing, for the client's live view: its phase and its current activity.

A rank passes through phases before its function trains: *queued* (another job's rank
holds its worker), *joining* (waiting for the other ranks at the rendezvous), *running*.
While it runs, library code says what it is busy with (listing a bucket, filling a cache)
through :func:`activity`, and long fills of a file or directory are followed with
:func:`follow`, which wakes when the path changes (inotify), not on a timer.

Status travels on the rank's one channel to the client
(:meth:`dask_ddp._rank.channel.RankChannel.put_status`, message kind
:data:`dask_ddp._rank.channel.STATUS`), only when it changes, and a newer status replaces one not
yet sent. It is best effort: never blocking and never raising.

Outside a rank (in the notebook, or in a DataLoader worker process, which cannot send
through the worker's connection) the same calls only log.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import select
import sys
import threading
from collections.abc import Callable
from typing import Any

from .._shared import activity as _activity
from .slot import RankRun, this_slot

logger = logging.getLogger(__name__)

__all__ = ["JOINING", "QUEUED", "RUNNING", "activity", "follow", "phase", "send"]

QUEUED = "queued"
JOINING = "joining"
RUNNING = "running"

#: Shortest time in seconds between two calls of a followed path's ``describe``: a cache
#: filled by several processes changes thousands of times a second.
FOLLOW_GAP = 0.1


def send(run: RankRun | None, phase: str | None, detail: str = "") -> None:
    """Put a status on ``run``'s channel; nothing outside that rank's own process."""
    if run is None or run.channel is None or run.pid != os.getpid():
        return
    run.channel.put_status(phase, detail)


def phase(name: str, detail: str = "") -> None:
    """Enter a phase (:data:`QUEUED`, :data:`JOINING`, :data:`RUNNING`) in this process's rank.

    >>> phase(RUNNING)  # outside a rank: nothing happens
    """
    send(this_slot().current(), name, detail)


def activity(text: str) -> None:
    """Say what the rank is busy with (logged at INFO in any case).

    >>> activity("listing s3://bucket/train")
    """
    logger.info("%s", text)
    send(this_slot().current(), None, text)


# -- following a file or directory -----------------------------------------------------
_IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE = 0x002, 0x004, 0x008
_IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x080, 0x100, 0x200
_PATH_MASK = _IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
_PARENT_MASK = _IN_CREATE | _IN_MOVED_TO


@functools.cache
def _libc() -> Any:
    """glibc with inotify, or None (not Linux, or another C library without it)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.inotify_init1, libc.inotify_add_watch  # noqa: B018 - check they exist
    except (OSError, AttributeError):
        return None
    return libc


class _Follower:
    """One thread waking on inotify events of a path (or of its parent, until it exists)."""

    def __init__(self, libc: Any, fd: int, path: str, describe: Callable[[], str | None]) -> None:
        self._libc, self._fd, self._path, self._describe = libc, fd, path, describe
        self._watching_path = False
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="dask-ddp-follow", daemon=True)
        self._stopped = threading.Event()
        self._send: Callable[[str], None] = activity

    def watch(self) -> bool:
        """Add the watches; False if neither the path nor its parent can be watched."""
        parent = os.path.dirname(os.path.abspath(self._path))
        self._watching_path = self._add(self._path, _PATH_MASK)
        return self._watching_path or self._add(parent, _PARENT_MASK)

    def _add(self, path: str, mask: int) -> bool:
        return self._libc.inotify_add_watch(self._fd, os.fsencode(path), mask) >= 0

    def start(self, send: Callable[[str], None]) -> None:
        self._send = send
        self._thread.start()

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        os.write(self._stop_w, b"x")
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        for fd in (self._fd, self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _say(self) -> None:
        try:
            text = self._describe()
        except Exception:  # the view is best effort: training must not fail for it
            logger.debug("describing %s failed", self._path, exc_info=True)
            return
        if text:
            self._send(text)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        self._say()
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._stop_r in ready:
                return
            with contextlib.suppress(BlockingIOError, OSError):
                while os.read(self._fd, 65536):
                    pass
            if not self._watching_path:
                self._watching_path = self._add(self._path, _PATH_MASK)
            self._say()
            # At most one description per FOLLOW_GAP; what changes meanwhile wakes the
            # next round. Only a stop ends the pause early.
            if select.select([self._stop_r], [], [], FOLLOW_GAP)[0]:
                return


def follow(path: str, describe: Callable[[], str | None]) -> Callable[[], None]:
    """Say ``describe()`` as the rank's activity now and whenever ``path`` changes.

    ``path`` is a file or a directory (a change of anything in it counts); one that does not
    exist yet is followed from its creation on. Changes wake a thread through inotify; where
    inotify is missing the text is said once. Following ends when the returned function is
    called or when the rank's run ends. Outside a rank it does nothing.

    Parameters
    ----------
    path : str
        The file or directory to follow.
    describe : callable
        Returns the activity text, or None to say nothing this time. Runs in a background
        thread; what it raises is logged at DEBUG and ignored.

    Returns
    -------
    callable
        Stops following; safe to call more than once.

    >>> stop = follow("/tmp", lambda: "cache: 10 of 100 files")
    >>> stop()
    """
    run = this_slot().current()
    if run is None or run.channel is None or run.pid != os.getpid():
        return lambda: None

    def say(text: str) -> None:
        logger.debug("%s", text)
        send(run, None, text)

    libc = _libc()
    fd = libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK) if libc is not None else -1
    follower = _Follower(libc, fd, path, describe) if fd >= 0 else None
    if follower is None or not follower.watch():  # no inotify here: say it once
        if follower is not None:
            follower.stop()
        text = describe()
        if text:
            say(text)
        return lambda: None
    follower.start(say)
    run.on_end.append(follower.stop)
    return follower.stop


_activity.listen(sys.modules[__name__])  # library calls in this process tell the rank's status

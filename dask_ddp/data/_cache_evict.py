"""Eviction for :class:`dask_ddp.data.cache.LocalCache`: least recently used entries go
first, one process at a time per cache directory."""

from __future__ import annotations

import fcntl
import logging
import os
import time
from contextlib import suppress
from pathlib import Path

logger = logging.getLogger("dask_ddp.data.cache")

_STALE_PART_SECONDS = 24 * 3600
"""A ``.part`` file older than this was left by a crashed download; eviction deletes it."""


def evict(directory: Path, max_bytes: int, keep: Path | None = None) -> int:
    """Delete least recently used entries under ``directory`` until they total at most
    ``max_bytes``; never ``keep``. Returns how many were deleted (0 if another process is
    evicting there right now)."""
    lock = os.open(directory / ".evict.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0  # another process is evicting right now
        entries, total = _entries(directory)
        if total <= max_bytes:
            return 0
        entries.sort()  # oldest first
        deleted = freed = 0
        for _, size, path in entries:
            if total - freed <= max_bytes:
                break
            if keep is not None and path == str(keep):
                continue
            with suppress(FileNotFoundError):
                os.unlink(path)
                deleted += 1
                freed += size
        logger.info(
            "cache %s: evicted %d least recently used entries (%d bytes) to stay under "
            "max_bytes=%d",
            directory,
            deleted,
            freed,
            max_bytes,
        )
        return deleted
    finally:
        _unlock_and_close(lock)


def _entries(directory: Path) -> tuple[list[tuple[float, int, str]], int]:
    """``(mtime, size, path)`` of every entry, and their total size."""
    entries: list[tuple[float, int, str]] = []
    total = 0
    now = time.time()
    for sub in os.scandir(directory):
        if not sub.is_dir(follow_symlinks=False):
            continue
        for entry in os.scandir(sub.path):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # evicted or replaced meanwhile
            if entry.name.endswith(".part"):
                if now - st.st_mtime > _STALE_PART_SECONDS:
                    with suppress(FileNotFoundError):
                        os.unlink(entry.path)
                continue
            if "." in entry.name:  # .lock files (never deleted: others may hold them)
                continue
            entries.append((st.st_mtime, st.st_size, entry.path))
            total += st.st_size
    return entries, total


def _unlock_and_close(fd: int) -> None:
    """Release an ``flock`` explicitly, then close the descriptor.

    Closing alone is not enough when a thread holds the lock while its process forks (a
    prefetch thread while the DataLoader starts its workers): the child's copy of the
    descriptor would keep the lock held until the child exits, and the child waits for
    that very lock when it needs the entry. ``LOCK_UN`` releases it for every copy.
    """
    try:
        with suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)

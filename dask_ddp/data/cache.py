"""A host-local disk cache for remote samples, shared by every process on the host.

Ranks and DataLoader workers on one host point at the same directory. A sample is
downloaded once per host: the process that misses holds an ``fcntl`` lock on the entry
while it fetches, writes to a temporary file in the same directory and renames it into
place with :func:`os.replace`, so a reader sees a whole file or none, and a crash leaves
only a ``.part`` file that never counts as cached. A second epoch reads local disk.

Entries are keyed by the caller (:class:`~dask_ddp.data.FileDataset` uses URL, endpoint,
size and ETag or modification time), so a changed object is fetched again under a new name.
Whole files (tar shards) go in with :meth:`LocalCache.open_file`, single samples with
:meth:`LocalCache.get_many`.

Without ``max_bytes`` the cache never evicts: clear the directory yourself when the data
set changes or the disk fills. With ``max_bytes``, the least recently used entries are
deleted once the directory holds more than that. A file another process has open stays
readable after it is deleted (POSIX keeps it until the last descriptor closes), so
eviction never breaks a reader; the next process to want it downloads it again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LocalCache"]

logger = logging.getLogger(__name__)

Fetched = bytes | BaseException
"""What a fetch returns for one sample: its bytes, or the error that stopped it."""


class LocalCache:
    """A directory of cached samples, safe to share between processes on one host.

    Parameters
    ----------
    directory : str or os.PathLike
        Where the cached files go; created if missing. Use a local disk that every
        process on the host can write (not NFS: ``fcntl`` locks are per host).
    max_bytes : int, optional
        Keep the entries' total size near this many bytes by deleting the least recently
        used ones (by modification time, which every read refreshes). Each process
        checks after it has written about 5% of ``max_bytes``, so the directory can run
        over by a few percent per writing process for a while. Default: no limit.

    Examples
    --------
    >>> import tempfile
    >>> cache = LocalCache(tempfile.mkdtemp())
    >>> cache.read("s3://b/k.jpg|12") is None
    True
    >>> out, hits = cache.get_many(["s3://b/k.jpg|12"], [12], lambda pos: [b"twelve bytes"])
    >>> out, hits
    ([b'twelve bytes'], 0)
    >>> cache.get_many(["s3://b/k.jpg|12"], [12], lambda pos: [RuntimeError("not called")])
    ([b'twelve bytes'], 1)
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int | None = None) -> None:
        if fcntl is None:  # pragma: no cover - Windows
            raise OSError(
                "cache_dir= needs fcntl file locks, which this platform lacks; "
                "leave cache_dir=None here"
            )
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes= must be a positive int or None, got {max_bytes!r}")
        self.directory = Path(directory).expanduser().absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._scan_every = max(1, max_bytes // 20) if max_bytes is not None else 0
        self._written = self._scan_every  # the first write checks the size

    def __repr__(self) -> str:
        limit = f", max_bytes={self.max_bytes}" if self.max_bytes is not None else ""
        return f"LocalCache({str(self.directory)!r}{limit})"

    def path(self, key: str) -> Path:
        """Return the file that holds ``key``.

        Examples
        --------
        >>> import tempfile
        >>> cache = LocalCache(tempfile.mkdtemp())
        >>> path = cache.path("s3://b/k.jpg|12")
        >>> path.parent.name == path.name[:2], len(path.name)
        (True, 64)
        """
        digest = hashlib.sha256(key.encode()).hexdigest()
        return self.directory / digest[:2] / digest

    def read(self, key: str, size: int | None = None) -> bytes | None:
        """Return the cached bytes of ``key``, or None when it is not cached.

        A file whose length differs from ``size`` (when given) counts as missing.
        """
        try:
            with open(self.path(key), "rb") as f:
                data = f.read()
                self._touch(f)
        except FileNotFoundError:
            return None
        if size is not None and len(data) != size:
            return None
        return data

    def write(self, key: str, data: bytes) -> Path:
        """Store ``data`` under ``key`` atomically and return its path.

        The bytes go to a temporary file in the same directory, which is then renamed
        over the final name, so no reader ever sees part of a file.
        """
        dest = self.path(key)
        dest.parent.mkdir(exist_ok=True)
        part = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}.part")
        try:
            with open(part, "wb") as f:
                f.write(data)
            os.replace(part, dest)
        except BaseException:
            with suppress(FileNotFoundError):
                part.unlink()
            raise
        self._wrote(len(data), dest)
        return dest

    def open_file(self, key: str, download: Callable[[Path], None]) -> tuple[BinaryIO, bool]:
        """Open the file cached under ``key``, downloading it first if the host lacks it.

        The first process to miss holds the entry's lock while ``download`` writes the
        whole file to a temporary path, which is then renamed into place; processes that
        miss meanwhile wait for the lock and open the finished file. An exception from
        ``download`` removes the temporary file and propagates; nothing is cached.

        Parameters
        ----------
        key : str
            The cache key, e.g. ``"http://store:9000|s3://bucket/shard-000000.tar|1048576"``.
        download : callable
            ``download(path)`` writes the file's bytes to ``path``.

        Returns
        -------
        file : binary file
            Open for reading; the caller closes it. It stays readable even if the entry
            is evicted later.
        hit : bool
            True if the file was cached already (by this or another process).

        Examples
        --------
        >>> import tempfile
        >>> cache = LocalCache(tempfile.mkdtemp())
        >>> f, hit = cache.open_file("k", lambda path: path.write_bytes(b"shard bytes"))
        >>> f.read(), hit
        (b'shard bytes', False)
        >>> f.close()
        >>> f, hit = cache.open_file("k", lambda path: path.write_bytes(b"not called"))
        >>> f.read(), hit
        (b'shard bytes', True)
        >>> f.close()
        """
        dest = self.path(key)
        f = self._open_cached(dest)
        if f is not None:
            return f, True
        with self.locked([key]):
            f = self._open_cached(dest)  # another process may have filled it meanwhile
            if f is not None:
                return f, True
            dest.parent.mkdir(exist_ok=True)
            part = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}.part")
            try:
                download(part)
                os.replace(part, dest)
            except BaseException:
                with suppress(FileNotFoundError):
                    part.unlink()
                raise
            f = open(dest, "rb")  # noqa: SIM115 - returned to the caller
        self._wrote(os.fstat(f.fileno()).st_size, dest)
        return f, False

    def discard(self, key: str) -> None:
        """Delete the entry of ``key``, if any (a corrupt copy, say).

        Examples
        --------
        >>> import tempfile
        >>> cache = LocalCache(tempfile.mkdtemp())
        >>> _ = cache.write("k", b"data")
        >>> cache.discard("k")
        >>> cache.read("k") is None
        True
        """
        with suppress(FileNotFoundError):
            self.path(key).unlink()

    def _open_cached(self, dest: Path) -> BinaryIO | None:
        try:
            f = open(dest, "rb")  # noqa: SIM115 - returned to the caller
        except FileNotFoundError:
            return None
        self._touch(f)
        return f

    def _touch(self, f: BinaryIO) -> None:
        """Mark an entry as just used (its modification time orders eviction)."""
        if self.max_bytes is not None:
            with suppress(OSError):  # read-only cache directories still serve reads
                os.utime(f.fileno())

    def _wrote(self, size: int, dest: Path) -> None:
        """Count bytes written; past about 5% of ``max_bytes``, evict down to the limit."""
        if self.max_bytes is None:
            return
        self._written += size
        if self._written >= self._scan_every:
            self._written = 0
            self.evict(keep=dest)

    def evict(self, keep: Path | None = None) -> int:
        """Delete least recently used entries until the total is at most ``max_bytes``.

        Runs in one process at a time per directory; a process that finds another one
        evicting returns at once. ``keep`` (the entry just written) is never deleted.
        Temporary files left by crashed downloads (older than a day) are deleted too.

        Returns
        -------
        int
            How many entries were deleted.

        Examples
        --------
        >>> import tempfile
        >>> cache = LocalCache(tempfile.mkdtemp(), max_bytes=10)
        >>> os.utime(cache.write("old", b"123456"), (0, 0))  # last used in 1970
        >>> _ = cache.write("new", b"abcdef")  # 12 bytes > 10: "old" goes
        >>> cache.read("old"), cache.read("new")
        (None, b'abcdef')
        """
        if self.max_bytes is None:
            return 0
        return _evict(self.directory, self.max_bytes, keep)

    @contextmanager
    def locked(self, keys: Sequence[str]) -> Iterator[None]:
        """Hold the host-wide lock of every key in ``keys``.

        Locks are taken in one global order (sorted file names), so two processes that
        lock overlapping batches cannot deadlock.
        """
        paths = sorted({self.path(k).with_suffix(".lock") for k in keys})
        fds: list[int] = []
        try:
            for lock in paths:
                lock.parent.mkdir(exist_ok=True)
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
                fds.append(fd)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            for fd in fds:
                _unlock_and_close(fd)

    def get_many(
        self,
        keys: Sequence[str],
        sizes: Sequence[int | None],
        fetch: Callable[[list[int]], list[Fetched]],
    ) -> tuple[list[Fetched], int]:
        """Return the bytes of every key, fetching the missing ones once per host.

        Parameters
        ----------
        keys : sequence of str
            Cache keys, one per sample.
        sizes : sequence of int or None
            Expected sizes (from the listing), to reject truncated files; None skips the check.
        fetch : callable
            Called with the positions (into ``keys``) that are not cached; returns one
            result per position, bytes or the exception that stopped that fetch. Errors are
            returned, not cached.

        Returns
        -------
        results : list of bytes or BaseException
            One per key, in order.
        hits : int
            How many came from the cache.
        """
        out: list[Fetched | None] = [self.read(k, s) for k, s in zip(keys, sizes, strict=True)]
        missing = [i for i, data in enumerate(out) if data is None]
        hits = len(keys) - len(missing)
        if missing:
            with self.locked([keys[i] for i in missing]):
                # Another process may have filled some while we waited for the locks.
                still = []
                for i in missing:
                    out[i] = self.read(keys[i], sizes[i])
                    if out[i] is None:
                        still.append(i)
                    else:
                        hits += 1
                if still:
                    for i, data in zip(still, fetch(still), strict=True):
                        out[i] = data
                        if isinstance(data, bytes):
                            self.write(keys[i], data)
        return out, hits  # type: ignore[return-value]


# -- eviction: least recently used entries first, one process at a time per directory --

_STALE_PART_SECONDS = 24 * 3600
"""A ``.part`` file older than this was left by a crashed download; eviction deletes it."""


def _evict(directory: Path, max_bytes: int, keep: Path | None = None) -> int:
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

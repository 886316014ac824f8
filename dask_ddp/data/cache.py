"""A host-local disk cache for remote samples, shared by every process on the host.

Ranks and DataLoader workers on one host point at the same directory. A sample is
downloaded once per host: the process that misses holds an ``fcntl`` lock on the entry
while it fetches, writes to a temporary file in the same directory and renames it into
place with :func:`os.replace`, so a reader sees a whole file or none, and a crash leaves
only a ``.part`` file that never counts as cached. A second epoch reads local disk.

The cache never evicts: clear the directory yourself when the data set changes or when
the disk fills. Entries are keyed by URL, endpoint, size and ETag (or modification time),
so a changed object is fetched again under a new name.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LocalCache"]

Fetched = bytes | BaseException
"""What a fetch returns for one sample: its bytes, or the error that stopped it."""


class LocalCache:
    """A directory of cached samples, safe to share between processes on one host.

    Parameters
    ----------
    directory : str or os.PathLike
        Where the cached files go; created if missing. Use a local disk that every
        process on the host can write (not NFS: ``fcntl`` locks are per host).

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

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        if fcntl is None:  # pragma: no cover - Windows
            raise OSError(
                "cache_dir= needs fcntl file locks, which this platform lacks; "
                "leave cache_dir=None here"
            )
        self.directory = Path(directory).expanduser().absolute()
        self.directory.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalCache({str(self.directory)!r})"

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
        return dest

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
                os.close(fd)  # closing the descriptor releases its flock

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

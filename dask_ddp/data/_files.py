"""Map-style datasets with one file (object) per sample, on S3 or any fsspec filesystem.

:class:`FileDataset` lists its samples once, at construction, and reads each batch's files
concurrently through a :class:`_FileStore`: this process's client, the host's disk cache
(:mod:`dask_ddp.data.cache`) and the read counters. :class:`dask_ddp.data.S3ImageFolder`
(:mod:`dask_ddp.data._imagefolder`) is a thin layer over it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import fsspec
import fsspec.asyn
import fsspec.core
from torch.utils.data import Dataset

from dask_ddp._shared import activity
from dask_ddp.data._errors import (
    CorruptDataError,
    CorruptSamples,
    DataNotFoundError,
    OnCorrupt,
    SampleFetchError,
    check_int,
    check_on_corrupt,
)
from dask_ddp.data._fsclient import (
    cat_concurrently,
    endpoint_of,
    filesystem_options,
    missing_reason,
    nearby,
    new_filesystem,
    protocol_of,
    storage_errors,
    storage_failure,
)
from dask_ddp.data._workers import freeze_inherited_objects
from dask_ddp.data.cache import LocalCache

logger = logging.getLogger("dask_ddp.data.s3")  # the name users configure, as before


Entry = tuple[str, "int | None", str]  # (path without protocol, size, ETag or mtime)


class FileDataset(Dataset):
    """A map-style dataset with one file (object) per sample, on any fsspec filesystem.

    Parameters
    ----------
    url : str, os.PathLike or sequence of str
        Either a prefix (``"s3://bucket/train"``, ``"/data/train"``), which is listed once,
        recursively, and every file under it is a sample in sorted order; or an explicit
        list of file URLs, used as given and not listed (for filesystems that cannot
        list, such as ``https://``). Chained URLs (``simplecache::s3://...``) are not
        supported: use ``cache_dir=``.
    decode : callable, optional
        ``decode(data: bytes) -> sample``. An exception it raises becomes a
        :class:`CorruptDataError` naming the file. Default: the raw bytes.
    transform : callable, optional
        Applied to each decoded sample.
    suffixes : sequence of str, optional
        Keep only files whose lower-cased name ends with one of these, e.g. ``(".npy",)``.
    is_valid_file : callable, optional
        ``is_valid_file(url) -> bool``; keep only files for which it returns True.
        Must pickle (a module-level function) when DataLoader workers are spawned.
    endpoint_url : str, optional
        S3 only: the endpoint of an S3-compatible store (MinIO, SeaweedFS, Ceph), e.g.
        ``"http://10.0.0.5:9000"``. Default: AWS, or ``AWS_ENDPOINT_URL`` if set.
    anon : bool, optional
        S3 only: read without credentials (public buckets). Default: s3fs's default (False).
    storage_options : mapping, optional
        Passed to the fsspec filesystem (for S3, :class:`s3fs.S3FileSystem`: ``key``,
        ``secret``, ``client_kwargs``, ``config_kwargs``, ...). They win over the options
        this class sets. They are pickled with the dataset, credentials included.
    cache_dir : str or os.PathLike, optional
        A local directory that keeps a copy of every sample read, shared by all processes
        on the host (ranks and DataLoader workers): each sample is downloaded once per
        host. Default: no cache.
    concurrency : int, default 32
        How many requests one ``__getitems__`` call (one batch) has in flight at once, per
        process. Applies to async filesystems (s3, gcs, azure, http); other filesystems
        read one file at a time.
    retries : int, default 8
        S3 only: extra attempts for a request that failed transiently (5xx, throttling,
        reset connections, timeouts), with exponential backoff and jitter.
    on_corrupt : {"raise", "skip"}, default "raise"
        What to do when ``decode`` fails. ``"raise"`` raises :class:`CorruptDataError`.
        ``"skip"`` returns the next readable sample (index + 1, + 2, ...) in its place, so
        batch sizes and epoch lengths stay the same on every rank, logs a warning once
        per corrupt file and process, and counts it in :meth:`get_stats`.
    freeze_gc : bool, default True
        In each DataLoader worker process, call :func:`gc.freeze` before the first read,
        so that Python's full garbage collections skip the ~460,000 objects the worker
        inherits with torch (each one otherwise takes 0.2-0.3 s and stalls the worker,
        about once per 2,000 objects read from S3). Never done in the rank's own process.
        (A worker a dask-ddp rank forks is frozen at the fork whatever this says.)

    Raises
    ------
    DataNotFoundError
        The bucket or path does not exist, or nothing is under the prefix.
    DataNotFoundError
        Files exist but none passes ``suffixes`` / ``is_valid_file``.
    ValueError, TypeError
        An argument is invalid.

    See Also
    --------
    S3ImageFolder : ImageFolder semantics on top of this class.

    Examples
    --------
    Arrays stored one per object, read in batches by a DataLoader:

    >>> import numpy as np
    >>> from torch.utils.data import DataLoader
    >>> def load_npy(data: bytes) -> np.ndarray:
    ...     return np.load(io.BytesIO(data))
    >>> ds = FileDataset(
    ...     "s3://my-bucket/arrays/", decode=load_npy, suffixes=(".npy",),
    ...     endpoint_url="http://minio:9000", cache_dir="/tmp/arrays-cache",
    ... )  # doctest: +SKIP
    >>> loader = DataLoader(ds, batch_size=64, num_workers=4)  # doctest: +SKIP
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | Sequence[str],
        decode: Callable[[bytes], Any] | None = None,
        *,
        transform: Callable[[Any], Any] | None = None,
        suffixes: Sequence[str] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        endpoint_url: str | None = None,
        anon: bool | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        concurrency: int = 32,
        retries: int = 8,
        on_corrupt: OnCorrupt = "raise",
        freeze_gc: bool = True,
    ) -> None:
        root_url, urls, protocol = _parse_url(url)
        if decode is not None and not callable(decode):
            raise TypeError(f"decode= takes a function bytes -> sample, got {decode!r}")
        check_int("concurrency", concurrency, 1)
        check_int("retries", retries, 0)
        check_on_corrupt(on_corrupt)

        self.decode = decode
        self.transform = transform
        self.suffixes = tuple(s.lower() for s in suffixes) if suffixes is not None else None
        self.is_valid_file = is_valid_file
        self.concurrency = concurrency
        self.retries = retries
        self.on_corrupt: OnCorrupt = on_corrupt
        self.freeze_gc = freeze_gc
        options = filesystem_options(
            protocol, endpoint_url, anon, storage_options, concurrency, retries
        )
        cache = LocalCache(cache_dir) if cache_dir is not None else None
        self._store = _FileStore(protocol, options, retries, concurrency, cache)
        self._bad = CorruptSamples(logger)

        start = time.perf_counter()
        if root_url is not None:
            self.root = root_url
            root = fsspec.core.strip_protocol(root_url).rstrip("/")
            activity.say(f"{type(self).__name__}: listing {root_url}")
            entries = self._store.list(root)
        else:
            common = os.path.commonprefix(urls)  # noqa: RUF071 - URLs, not OS paths
            self.root = common[: common.rfind("/") + 1] or common
            root = fsspec.core.strip_protocol(self.root)
            entries = [(fsspec.core.strip_protocol(u), None, "") for u in urls]
        self._paths: list[str] = []
        self._sizes: list[int | None] = []  # these two only feed cache keys: kept with a cache
        self._tokens: list[str] = []
        self._index(root, entries)
        activity.say(
            f"{type(self).__name__}: {len(self._paths)} samples under {self.root} "
            f"({len(entries)} files listed) in {time.perf_counter() - start:.2f} s"
        )
        if self._store.cache is not None:
            fill_log = self._store.log_fills(self.root)
            activity.follow(fill_log, self._cache_progress)

    # -- construction -------------------------------------------------------------------

    def _index(self, root: str, entries: list[Entry]) -> None:
        """Choose the samples among ``entries``; subclasses override this."""
        kept = [e for e in entries if not e[0].endswith("/") and self._accepts(e[0])]
        if not kept:
            raise DataNotFoundError(
                self.root,
                f"{len(entries)} files are under it but none is accepted"
                + (f" (suffixes={self.suffixes})" if self.suffixes else "")
                + (" (is_valid_file= rejected them all)" if self.is_valid_file else ""),
            )
        for path, size, token in kept:
            self._add(path, size, token)

    def _accepts(self, path: str) -> bool:
        if self.suffixes is not None and not path.lower().endswith(self.suffixes):
            return False
        return self.is_valid_file is None or bool(self.is_valid_file(self._url(path)))

    def _add(self, path: str, size: int | None, token: str) -> None:
        self._paths.append(path)
        if self._store.cache is not None:
            self._sizes.append(size)
            self._tokens.append(token)

    # -- reading ------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """The URL of every sample, in index order."""
        return [self._url(p) for p in self._paths]

    @property
    def cache_dir(self) -> str | None:
        """The local cache directory, or None."""
        return None if self._store.cache is None else str(self._store.cache.directory)

    def __len__(self) -> int:
        return len(self._paths)

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Return the samples at ``indices``, fetching their bytes concurrently.

        PyTorch's DataLoader calls this with each batch's indices when automatic batching
        is on (the default). Repeated indices are fetched once and decoded each time.
        """
        if self.freeze_gc:
            freeze_inherited_objects()
        n = len(self)
        wanted = []
        for i in indices:
            i = int(i)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of range for {n} samples")
            i %= n
            if i in self._bad:  # known corrupt (on_corrupt="skip"): read its substitute
                self._stats["skipped"] += 1
                i = self._bad.next_readable(i, n, self.root)
            wanted.append(i)
        unique = list(dict.fromkeys(wanted))
        data = dict(zip(unique, self._read(unique), strict=True))
        return [self._sample(i, data[i]) for i in wanted]

    def get_stats(self) -> dict[str, int]:
        """Counters for this process (each DataLoader worker has its own).

        ``requested`` samples, ``cache_hits``, ``fetched`` objects and ``fetched_bytes``
        from the store, ``corrupt`` files found and ``skipped`` reads replaced by the next
        readable sample.

        Examples
        --------
        >>> ds.get_stats()  # doctest: +SKIP
        {'requested': 640, 'cache_hits': 0, 'fetched': 640, 'fetched_bytes': 3276800, ...}
        """
        keys = ("requested", "cache_hits", "fetched", "fetched_bytes", "corrupt", "skipped")
        return {k: self._stats[k] for k in keys}

    @property
    def _stats(self) -> Counter[str]:
        return self._store.stats

    def _filesystem(self) -> fsspec.AbstractFileSystem:
        """This process's filesystem client, created on first use in each process."""
        return self._store.filesystem()

    def _read(self, indices: list[int]) -> list[bytes]:
        """The bytes of each sample, from the cache or the store; raises on failure."""
        paths = [self._paths[i] for i in indices]
        if self._store.cache is None:
            return self._store.read(paths)
        sizes = [self._sizes[i] for i in indices]
        tokens = [self._tokens[i] for i in indices]
        return self._store.read(paths, sizes, tokens)

    def _cache_key(self, index: int) -> str:
        """The key of sample ``index`` in the host's cache."""
        return self._store.cache_key(self._paths[index], self._sizes[index], self._tokens[index])

    def _cache_progress(self) -> str | None:
        return self._store.cache_progress(self.root, len(self))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_bad"] = CorruptSamples(logger)  # each process learns its own
        return state

    def _sample(self, index: int, data: bytes) -> Any:
        try:
            obj = self._decode(index, data)
        except CorruptDataError as err:
            if self.on_corrupt == "raise":
                raise
            self._bad.mark(index, err, self._stats)
            return self._substitute(index)
        return self._finish(index, obj)

    def _decode(self, index: int, data: bytes) -> Any:
        if self.decode is None:
            return data
        try:
            return self.decode(data)
        except Exception as err:
            raise CorruptDataError(
                self._url(self._paths[index]), f"{type(err).__name__}: {err}"
            ) from err

    def _finish(self, index: int, obj: Any) -> Any:
        """Turn a decoded object into the sample returned; subclasses override this."""
        return obj if self.transform is None else self.transform(obj)

    def _substitute(self, index: int) -> Any:
        """The next readable sample after the corrupt ``index`` (on_corrupt='skip')."""
        self._stats["skipped"] += 1
        while True:
            j = self._bad.next_readable(index, len(self), self.root)
            data = self._read([j])[0]
            try:
                obj = self._decode(j, data)
            except CorruptDataError as err:
                self._bad.mark(j, err, self._stats)
                index = j
                continue
            return self._finish(j, obj)

    # -- names --------------------------------------------------------------------------

    def _url(self, path: str) -> str:
        return self._store.url(path)

    def __repr__(self) -> str:
        cache = f", cache_dir={self.cache_dir!r}" if self._store.cache is not None else ""
        return f"{type(self).__name__}({self.root!r}, {len(self)} samples{cache})"


class _FileStore:
    """Where a file dataset's bytes come from: this process's filesystem client, the
    host's disk cache, and the counters of what was read.

    The client is created on first use in each process and dropped when the store is
    pickled (spawned DataLoader workers, Dask); a forked child, whose pid differs, makes
    its own (see :mod:`dask_ddp.data._fsclient`).
    """

    def __init__(
        self,
        protocol: str,
        options: Mapping[str, Any],
        retries: int,
        concurrency: int,
        cache: LocalCache | None,
    ) -> None:
        self.protocol, self.options = protocol, options
        self.retries, self.concurrency, self.cache = retries, concurrency, cache
        self.endpoint = endpoint_of(options)
        self.fs: fsspec.AbstractFileSystem | None = None
        self.pid: int | None = None
        self.stats: Counter[str] = Counter()
        self.fill_log: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["fs"] = None  # a client holds sockets and an event loop; rebuild it there
        state["pid"] = None
        state["stats"] = Counter()
        return state

    def filesystem(self) -> fsspec.AbstractFileSystem:
        """This process's client, created on first use in each process."""
        if self.fs is None or self.pid != os.getpid():  # a forked child: see _fsclient
            self.fs = new_filesystem(self.protocol, self.options, self.retries)
            self.pid = os.getpid()
        return self.fs

    def url(self, path: str) -> str:
        return path if self.protocol == "file" else f"{self.protocol}://{path}"

    def list(self, root: str) -> list[Entry]:
        """List every file under ``root`` once (one paginated listing on S3)."""
        fs = self.filesystem()
        url = self.url(root)
        try:
            with storage_errors(url, self.endpoint):
                found = fs.find(root, detail=True)
        except FileNotFoundError as err:
            raise DataNotFoundError(url, missing_reason(self.protocol, root, err)) from err
        if not found:
            raise DataNotFoundError(url, "nothing is under it" + nearby(fs, root, self.url))
        entries = []
        for path, info in sorted(found.items()):
            token = info.get("ETag") or info.get("mtime") or info.get("LastModified") or ""
            entries.append((path, info.get("size"), str(token)))
        return entries

    def cache_key(self, path: str, size: int | None, token: str) -> str:
        """A sample's key in the host's cache: where it is, and its size and ETag/mtime."""
        return "|".join((self.endpoint, self.url(path), str(size), token))

    def log_fills(self, root: str) -> str:
        """Start counting fills of the cache for the dataset at ``root``; returns the log.

        One byte per sample fetched into the cache, appended by whichever process fetched
        it (DataLoader workers too): the rank reads the file's size to show how far the
        host's cache has filled.
        """
        assert self.cache is not None
        digest = hashlib.sha256(f"{self.endpoint}|{root}".encode()).hexdigest()
        self.fill_log = str(self.cache.directory / f".filled-{digest[:16]}")
        return self.fill_log

    def cache_progress(self, root: str, total: int) -> str | None:
        """How far the host's cache has filled with the dataset (for the live view)."""
        if self.fill_log is None:
            return None
        try:
            filled = min(os.stat(self.fill_log).st_size, total)
        except OSError:
            return None  # nothing fetched yet
        return f"cache: {filled:,} of {total:,} samples of {root} on this host's disk"

    def read(
        self,
        paths: list[str],
        sizes: Sequence[int | None] = (),
        tokens: Sequence[str] = (),
    ) -> list[bytes]:
        """The bytes of each path, from the cache (when there is one; ``sizes`` and
        ``tokens`` key it) or the store; raises :class:`SampleFetchError` for a path that
        could not be read."""
        self.stats["requested"] += len(paths)
        if self.cache is None:
            results = self.fetch(paths)
        else:
            keys = [self.cache_key(*entry) for entry in zip(paths, sizes, tokens, strict=True)]
            results, hits = self.cache.get_many(
                keys, list(sizes), lambda pos: self.fetch([paths[p] for p in pos])
            )
            self.stats["cache_hits"] += hits
            if hits < len(paths) and self.fill_log is not None:
                _count_fills(self.fill_log, len(paths) - hits)
        for path, result in zip(paths, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                failure = storage_failure(result, self.url(path), self.endpoint)
                if failure is not None:
                    raise failure from result
                raise SampleFetchError(
                    self.url(path), f"{type(result).__name__}: {result}"
                ) from result
        return results  # type: ignore[return-value]

    def fetch(self, paths: list[str]) -> list[bytes | BaseException]:
        """Fetch ``paths`` from the store; each result is bytes or the error for that path."""
        fs = self.filesystem()
        if getattr(fs, "async_impl", False):
            results = fsspec.asyn.sync(fs.loop, cat_concurrently, fs, paths, self.concurrency)
        else:
            results = []
            for path in paths:
                try:
                    results.append(fs.cat_file(path))
                except OSError as err:
                    results.append(err)
        got = [r for r in results if isinstance(r, bytes)]
        self.stats["fetched"] += len(got)
        self.stats["fetched_bytes"] += sum(map(len, got))
        return results


def _count_fills(log: str, n: int) -> None:
    """Append ``n`` bytes to ``log``: one write with O_APPEND, atomic between processes."""
    try:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"." * n)
        finally:
            os.close(fd)
    except OSError:  # progress only: never fail a read for it
        logger.debug("could not count %d cache fills in %s", n, log, exc_info=True)


def _parse_url(
    url: str | os.PathLike[str] | Sequence[str],
) -> tuple[str | None, list[str] | None, str]:
    """``(prefix URL or None, file URLs or None, protocol)`` of a dataset's ``url=``."""
    if isinstance(url, (str, os.PathLike)):
        root_url = os.fspath(url)
        return root_url, None, protocol_of(root_url)
    urls = [os.fspath(u) for u in url]
    if not urls:
        raise ValueError("url= is an empty list; pass a prefix or at least one file URL")
    protocols = {protocol_of(u) for u in urls}
    if len(protocols) > 1:
        raise ValueError(f"every URL in url= must use one filesystem; got {sorted(protocols)}")
    return None, urls, protocols.pop()

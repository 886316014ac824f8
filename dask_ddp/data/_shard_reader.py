"""Reading shards in this process: the raw fields of a sample, by byte range.

:class:`ShardReader` holds a :class:`~dask_ddp.data._specs.ShardList` and everything that
belongs to one process: the filesystem client, the host's cache
(:class:`~dask_ddp.data.cache.LocalCache`), the shards open here (an LRU of files and
their tar indexes) and the read counters. A remote shard is downloaded whole into the
cache the first time any process on the host needs it, and indexed then (its tar headers
read once per host, :func:`~dask_ddp.data._tar.index_tar`); each sample's fields are
then read with one ``pread`` each. Its :class:`ShardOrder` keeps the next shards of the
sampler's order downloading in a background thread while the current one is read.

Nothing open crosses a fork or a pickle: each object checks the process id and starts
afresh in a new process (a DataLoader worker), keeping only what describes the files.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import fsspec
import fsspec.core

from dask_ddp.data._errors import CorruptDataError, DataNotFoundError, SampleFetchError
from dask_ddp.data._fsclient import endpoint_of, new_filesystem, storage_errors
from dask_ddp.data._prefetch import Prefetcher
from dask_ddp.data._specs import ShardList
from dask_ddp.data._tar import TarIndex, index_tar
from dask_ddp.data._workers import freeze_inherited_objects
from dask_ddp.data.cache import LocalCache

logger = logging.getLogger("dask_ddp.data.shards")

_MISS_WARN_AFTER, _MISS_WARN_RATE = 256, 0.3
"""Warn once a process has read this many samples and opened a shard for this share."""


def _default_cache_dir() -> Path:
    try:
        user = str(os.getuid())
    except AttributeError:  # pragma: no cover - Windows
        import getpass

        user = getpass.getuser()
    return Path(tempfile.gettempdir()) / f"dask-ddp-shards-{user}"


# One lock guards the per-process reset of every reader; re-created in forked children,
# where a lock held by another thread at fork time would never be released.
_PROCESS_LOCK = threading.Lock()


def _new_process_lock() -> None:
    global _PROCESS_LOCK
    _PROCESS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_new_process_lock)


class _OpenShard(NamedTuple):
    """A shard open in this process: its file and its sample index."""

    file: BinaryIO
    index: TarIndex


class ShardReader:
    """The raw fields of any sample of a shard list, read in this process.

    Parameters
    ----------
    shards : ShardList
        The shards to read.
    storage_options : mapping
        The filesystem's options (see :func:`~dask_ddp.data._fsclient.filesystem_options`).
    retries, cache_dir, cache_size, open_shards, prefetch, freeze_gc
        As ``ShardListDataset``'s (``cache_size`` in bytes); ``prefetch`` applies to
        remote shards only, through :attr:`order`.
    fs : filesystem, optional
        A client for the shards' filesystem already made in this process (the one that
        read the shard list), to go on with its connection.

    Examples
    --------
    >>> import tempfile
    >>> from dask_ddp.data import write_shards
    >>> from dask_ddp.data._specs import Shard
    >>> shard = write_shards([{"txt": "hello"}], tempfile.mkdtemp())[0]
    >>> reader = ShardReader(ShardList([Shard(**shard)], "doc"), {}, retries=0,
    ...                      cache_dir=tempfile.mkdtemp())
    >>> reader.read(0)["txt"], reader.get_stats()["shard_opens"]
    (b'hello', 1)
    """

    def __init__(
        self,
        shards: ShardList,
        storage_options: Mapping[str, Any],
        *,
        retries: int,
        cache_dir: str | None = None,
        cache_size: int | None = None,
        open_shards: int = 16,
        prefetch: int = 1,
        freeze_gc: bool = True,
        fs: fsspec.AbstractFileSystem | None = None,
    ) -> None:
        self.shards = shards
        self.storage_options = dict(storage_options)
        self.endpoint = endpoint_of(self.storage_options)
        self.retries = retries
        self._cache_dir, self._cache_size = cache_dir, cache_size
        self.open_shards = open_shards
        self.freeze_gc = freeze_gc
        self._indexes: dict[int, TarIndex] = {}  # valid in every process: same files
        depth = 0 if shards.protocol == "file" else prefetch
        self.order = ShardOrder(len(shards.shards), depth, self.fetch)
        self._reset_process_state()
        self._pid: int | None = os.getpid()
        self._fs = fs

    @property
    def cache_dir(self) -> str:
        """The directory remote shards and shard indexes are cached in."""
        directory = self._cache_dir or _default_cache_dir()
        return str(Path(directory).expanduser().absolute())

    # -- one process ----------------------------------------------------------------------

    def _reset_process_state(self) -> None:
        self._fs: fsspec.AbstractFileSystem | None = None
        self._cache: LocalCache | None = None
        self._open: OrderedDict[int, _OpenShard] = OrderedDict()
        self._lock = threading.RLock()  # the open shards and the foreground counters
        self._stats_lock = threading.Lock()  # the counters the prefetch thread moves too
        self._stats: Counter[str] = Counter()
        self._warned = False

    def _this_process(self) -> None:
        """Drop what belongs to another process (a forked DataLoader worker's parent)."""
        pid = os.getpid()
        if self._pid == pid:
            return
        with _PROCESS_LOCK:
            if self._pid == pid:
                return
            if self.freeze_gc:
                freeze_inherited_objects()
            inherited = list(self._open.values())
            self._reset_process_state()  # indexes stay: they describe the same files
            for shard in inherited:
                with suppress(OSError):
                    shard.file.close()  # this process's copy of the descriptor
            self._pid = pid

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_fs", "_cache", "_open", "_lock", "_stats_lock", "_stats", "_warned"):
            del state[name]
        state["_pid"] = None
        state["_indexes"] = {}  # rebuilt from the local files, cheaply, where needed
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    def _filesystem(self) -> fsspec.AbstractFileSystem:
        """This process's client for the shards, created on first use in each process."""
        with self._stats_lock:  # the prefetch thread may ask at the same time
            if self._fs is None:
                protocol = self.shards.protocol
                self._fs = new_filesystem(protocol, self.storage_options, self.retries)
            return self._fs

    def _local_cache(self) -> LocalCache:
        with self._stats_lock:  # the prefetch thread may ask at the same time
            if self._cache is None:
                self._cache = LocalCache(self.cache_dir, max_bytes=self._cache_size)
            return self._cache

    # -- reading --------------------------------------------------------------------------

    def read(self, i: int) -> dict[str, Any]:
        """Sample ``i``'s fields as bytes by extension (``"jpg"``, ``"cls"``), plus wids's
        ``__key__``, ``__dataset__``, ``__index__``, ``__shard__``, ``__shardindex__``."""
        self._this_process()
        s, j = self.shards.where(i)
        with self._lock:
            self._stats["requested"] += 1
            shard = self._shard(s)
            key = shard.index.keys[j]
            raw: dict[str, Any] = {
                ext: _pread(shard.file, size, offset) for ext, offset, size in shard.index.fields(j)
            }
        url = self.shards.shards[s].url  # wids's metadata; sub-datasets are not read here
        raw.update(__key__=key, __dataset__=None, __index__=i, __shard__=url, __shardindex__=j)
        return raw

    def locate(self, i: int) -> tuple[str, str]:
        """The shard URL and the key of sample ``i``."""
        self._this_process()
        s, j = self.shards.where(i)
        with self._lock:
            key = self._shard(s).index.keys[j]
        return self.shards.shards[s].url, key

    @property
    def stats(self) -> Counter[str]:
        """This process's counters, for the reader and its dataset to count in."""
        self._this_process()
        return self._stats

    def get_stats(self) -> dict[str, int]:
        """This process's counters (see ``ShardListDataset.get_stats``)."""
        names = ("requested", "shard_opens", "cache_hits", "downloads", "downloaded_bytes")
        stats = self.stats
        return {k: stats[k] for k in (*names, "corrupt", "skipped")}

    def close(self) -> None:
        """Close the shards open in this process and stop its prefetching."""
        self.order.close()
        with self._lock:
            for shard in self._open.values():
                shard.file.close()
            self._open.clear()

    def _shard(self, s: int) -> _OpenShard:
        """Shard ``s``, open in this process (call with ``self._lock`` held)."""
        shard = self._open.get(s)
        if shard is not None:
            self._open.move_to_end(s)
            return shard
        self._stats["shard_opens"] += 1
        self._check_access_pattern()
        f = self._open_file(s)
        self.order.opened(s)  # after: the next shard must not slow this one's download
        try:
            index = self._indexes.get(s)
            if index is None:
                index = self._indexes[s] = self._cached_index(s, f)
        except BaseException:
            f.close()
            raise
        shard = self._open[s] = _OpenShard(f, index)
        while len(self._open) > self.open_shards:
            _, old = self._open.popitem(last=False)
            old.file.close()
        return shard

    def _open_file(self, s: int) -> BinaryIO:
        shard = self.shards.shards[s]
        path = fsspec.core.strip_protocol(shard.url)
        if self.shards.protocol == "file":
            try:
                return open(path, "rb")
            except FileNotFoundError as err:
                raise DataNotFoundError(shard.url, _cause(err), self.shards.source) from err
        f, hit = self._local_cache().open_file(self._cache_key(s), partial(self._download, s))
        if hit:
            self._stats["cache_hits"] += 1
        return f

    def fetch(self, s: int) -> None:
        """Download shard ``s`` into the host's cache unless it is there (prefetch thread)."""
        self._this_process()  # a prefetch may start before this process's first read
        if s in self._indexes and self._local_cache().path(self._cache_key(s)).exists():
            return
        f, _ = self._local_cache().open_file(self._cache_key(s), partial(self._download, s))
        f.close()

    def _download(self, s: int, part: Path) -> None:
        """Download shard ``s`` to ``part`` and index it (under the cache entry's lock).

        The index goes into the cache before the shard does, so the processes waiting
        for the shard find both; a shard that fails to index is never cached.
        """
        shard = self.shards.shards[s]
        fs = self._filesystem()
        start = time.perf_counter()
        with storage_errors(shard.url, self.endpoint):  # botocore's, not OSErrors
            try:
                fs.get_file(fsspec.core.strip_protocol(shard.url), str(part))
            except FileNotFoundError as err:
                raise DataNotFoundError(shard.url, _cause(err), self.shards.source) from err
            except OSError as err:
                raise SampleFetchError(shard.url, _cause(err)) from err
        size = part.stat().st_size
        if shard.filesize is not None and size != shard.filesize:
            raise CorruptDataError(
                shard.url,
                f"its download has {size} bytes, but {self.shards.source} says filesize "
                f"{shard.filesize}; the shard changed or the list is out of date",
                "shard",
            )
        with open(part, "rb") as f:
            index = self._index(s, f)
        self._local_cache().write(self._index_key(s, None), index.encode())
        self._indexes[s] = index
        with self._stats_lock:
            self._stats["downloads"] += 1
            self._stats["downloaded_bytes"] += size
        logger.debug(
            "downloaded and indexed %s (%d bytes) in %.2f s",
            shard.url,
            size,
            time.perf_counter() - start,
        )

    def _cached_index(self, s: int, f: BinaryIO) -> TarIndex:
        """The index of open shard ``s``: from the host's cache, else built and cached.

        Building one reads every tar header (about 50 ms per 1,000 samples); loading it
        takes about 1 ms, so each shard is indexed once per host, not once per process.
        """
        cache = self._local_cache()
        key = self._index_key(s, f)
        data = cache.read(key)
        if data is not None:
            with suppress(ValueError, TypeError, KeyError):
                index = TarIndex.decode(data)
                if len(index) == self.shards.shards[s].nsamples:
                    return index
        try:
            index = self._index(s, f)
        except CorruptDataError:
            if self.shards.protocol != "file":
                cache.discard(self._cache_key(s))  # the next read downloads it again
            raise
        cache.write(key, index.encode())
        return index

    def _index(self, s: int, f: BinaryIO) -> TarIndex:
        shard = self.shards.shards[s]
        index = index_tar(f, shard.url)
        if len(index) != shard.nsamples:
            raise CorruptDataError.count(shard.url, self.shards.source, shard.nsamples, len(index))
        return index

    def _index_key(self, s: int, f: BinaryIO | None) -> str:
        if self.shards.protocol != "file":
            return self._cache_key(s) + "|index-v2"
        st = os.fstat(f.fileno())  # a local shard that changes gets a new key
        return f"file|{self.shards.shards[s].url}|{st.st_size}|{st.st_mtime_ns}|index-v2"

    def _cache_key(self, s: int) -> str:
        shard = self.shards.shards[s]
        size = "" if shard.filesize is None else shard.filesize
        return f"{self.endpoint}|{shard.url}|{size}"

    def _check_access_pattern(self) -> None:
        requested, opens = self._stats["requested"], self._stats["shard_opens"]
        if self._warned or requested < _MISS_WARN_AFTER or opens <= _MISS_WARN_RATE * requested:
            return
        self._warned = True
        logger.warning(
            "ShardListDataset opened a shard for %d of the %d samples read in process %d "
            "(%s): the sampler jumps between shards, and each jump may download a whole "
            "shard. Use sampler=DistributedChunkedSampler(dataset), or raise open_shards= "
            "(now %d)",
            opens,
            requested,
            os.getpid(),
            self.shards.source,
            self.open_shards,
        )


class ShardOrder:
    """Which shard is read when: the order a sampler announces, and the next ``depth``
    shards of it kept downloading (``fetch(shard)``) in a background thread of this
    process while one is read. The order pickles; the thread is per process.

    Parameters
    ----------
    count : int
        How many shards there are.
    depth : int
        How many shards ahead to download; 0: none.
    fetch : callable
        ``fetch(shard)`` puts a shard into the host's cache.

    Examples
    --------
    >>> fetched = []
    >>> order = ShardOrder(4, 1, fetched.append)
    >>> order.set([2, 0, 3])
    >>> order.start(); order.wait(10)
    True
    >>> fetched
    [2, 0]
    """

    def __init__(self, count: int, depth: int, fetch: Callable[[int], None]) -> None:
        self.count, self.depth, self._fetch = count, depth, fetch
        self.plan: tuple[int, ...] | None = None
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._pos = 0
        self._prefetcher: Prefetcher[int, None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"count": self.count, "depth": self.depth, "_fetch": self._fetch, "plan": self.plan}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def _prefetcher_here(self) -> Prefetcher[int, None]:
        """This process's prefetcher (a forked child's parent's has no thread here)."""
        if self._pid != os.getpid():
            self._reset()
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self._fetch, name="shards", keep_results=False)
        return self._prefetcher

    def set(self, order: Sequence[int] | None) -> None:
        """Shards in reading order, or None to forget it."""
        if order is None:
            self.plan = None
            return
        plan = tuple(int(k) for k in order)
        bad = [k for k in plan if not 0 <= k < self.count]
        if bad:
            raise ValueError(
                f"set_shard_order() got shard {bad[0]}, but there are shards 0 to {self.count - 1}"
            )
        self.plan = plan
        self._pos = 0

    def start(self) -> None:
        """Start downloading the order's first shards (a new epoch is starting)."""
        if self.plan is None or not self.depth:
            return
        prefetcher = self._prefetcher_here()
        self._pos = 0
        prefetcher.want(list(self.plan[: 1 + self.depth]))

    def opened(self, s: int) -> None:
        """Shard ``s`` is being opened: queue the next ones of the plan for download."""
        if self.plan is None or not self.depth:
            return
        prefetcher = self._prefetcher_here()
        try:
            pos = self.plan.index(s, self._pos)
        except ValueError:
            logger.debug(
                "process %d read shard %d, which its shard order does not list next; "
                "prefetching stops",
                os.getpid(),
                s,
            )
            self.plan = None
            prefetcher.want([])
            return
        self._pos = pos
        prefetcher.want([k for k in self.plan[pos + 1 : pos + 1 + self.depth] if k != s])

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until this process's downloads ahead are done; True at once when none are."""
        prefetcher = self._prefetcher if self._pid == os.getpid() else None
        return True if prefetcher is None else prefetcher.wait_idle(timeout)

    @property
    def busy(self) -> bool:
        """Whether this process is downloading shards ahead of its reads right now."""
        prefetcher = self._prefetcher if self._pid == os.getpid() else None
        return prefetcher is not None and prefetcher.busy

    def close(self) -> None:
        """Stop this process's downloads ahead (one under way finishes)."""
        prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None and self._pid == os.getpid():
            prefetcher.close()


def _cause(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _pread(f: BinaryIO, size: int, offset: int) -> bytes:
    if hasattr(os, "pread"):
        return os.pread(f.fileno(), size, offset)
    f.seek(offset)  # pragma: no cover - Windows; callers hold the reader's lock
    return f.read(size)  # pragma: no cover

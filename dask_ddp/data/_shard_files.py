"""The shard dataset's files in each process: the filesystem client, the host's cache of
downloaded shards and their indexes, the open shards (:class:`_ShardFiles`), and the
per-process reset after a fork or a pickle.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import fsspec.core

from dask_ddp.data._errors import (
    CorruptDataError,
    CorruptSamples,
    DataNotFoundError,
    SampleFetchError,
    ShardListError,
)
from dask_ddp.data._fsclient import (
    _endpoint_of,
    _new_filesystem,
    _protocol_of,
    _storage_options,
    storage_errors,
)
from dask_ddp.data._prefetch import Prefetcher
from dask_ddp.data._specs import _parse_description
from dask_ddp.data._tar import _Index, _index_tar, _Open, _pread
from dask_ddp.data._workers import freeze_inherited_objects
from dask_ddp.data.cache import LocalCache

logger = logging.getLogger("dask_ddp.data.shards")


_MISS_WARN_AFTER, _MISS_WARN_RATE = 256, 0.3


def _default_cache_dir() -> Path:
    try:
        user = str(os.getuid())
    except AttributeError:  # pragma: no cover - Windows
        import getpass

        user = getpass.getuser()
    return Path(tempfile.gettempdir()) / f"dask-ddp-shards-{user}"


# One lock guards the per-process reset of every dataset; re-created in forked children,
# where a lock held by another thread at fork time would never be released.
_PROCESS_LOCK = threading.Lock()


def _new_process_lock() -> None:
    global _PROCESS_LOCK
    _PROCESS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_new_process_lock)


def _cause(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


class _ShardFiles:
    """The part of :class:`~dask_ddp.data.ShardListDataset` that finds, downloads, caches,
    indexes and opens shards, and reads a sample's raw fields, in this process."""

    def _options_for(self, protocol: str) -> dict[str, Any]:
        s3 = protocol == "s3"
        return _storage_options(
            protocol,
            self._endpoint_url if s3 else None,
            self._anon if s3 else None,
            self._user_options,
            10,
            self.retries,
        )

    def _load(
        self, shards: Any, base: str | None, options: Mapping[str, Any] | None
    ) -> tuple[str, list[dict[str, Any]]]:
        """The shard list's source and entries, as wids reads them: ``options`` update the
        description, and ``base`` (else the description's, else the JSON's folder) resolves
        relative URLs."""
        if base is not None:
            base = str(base).rstrip("/")
        if isinstance(shards, (str, os.PathLike)):
            url = os.fspath(shards)
            protocol = _protocol_of(url)
            if protocol == "file":
                url = os.path.abspath(fsspec.core.strip_protocol(url))
            # The JSON may be on another filesystem than the shards (local list, S3 shards);
            # when it is on theirs, this client reads the shards too (see __init__).
            fs_options = self._options_for(protocol)
            fs = _new_filesystem(protocol, fs_options, self.retries)
            self._fs, self._fs_protocol = fs, protocol
            try:
                with storage_errors(url, _endpoint_of(fs_options)):
                    raw = fs.cat_file(fsspec.core.strip_protocol(url))
            except FileNotFoundError as err:
                raise DataNotFoundError(url, f"the shard list does not exist ({err})") from err
            try:
                desc = json.loads(raw)
            except ValueError as err:
                raise ShardListError(url, f"it is not JSON ({err})") from err
            if isinstance(desc, list):  # a bare list of entries
                desc = {"shardlist": desc}
            source, folder = url, url.rsplit("/", 1)[0]
        else:
            source, folder = "the shard list passed in", None
            desc = shards if isinstance(shards, Mapping) else {"shardlist": shards}
        desc = {**desc, **(options or {}), **({"base": base} if base else {})}
        return source, _parse_description(desc, source, folder)

    def _filesystem(self) -> fsspec.AbstractFileSystem:
        """This process's client for the shards, created on first use in each process."""
        with self._stats_lock:  # the prefetch thread may ask at the same time
            if self._fs is None or self._fs_protocol != self._protocol:
                self._fs = _new_filesystem(self._protocol, self._storage_options, self.retries)
                self._fs_protocol = self._protocol
            return self._fs

    def _local_cache(self) -> LocalCache:
        with self._stats_lock:  # the prefetch thread may ask at the same time
            if self._cache is None:
                directory = self._cache_dir or _default_cache_dir()
                self._cache = LocalCache(directory, max_bytes=self._cache_size)
            return self._cache

    def _reset_process_state(self) -> None:
        self._fs: fsspec.AbstractFileSystem | None = None
        self._fs_protocol: str | None = None
        self._cache: LocalCache | None = None
        self._open: OrderedDict[int, _Open] = OrderedDict()
        self._lock = threading.RLock()  # the open shards and the foreground counters
        self._stats_lock = threading.Lock()  # the counters the prefetch thread moves too
        self._stats: Counter[str] = Counter()
        self._bad = CorruptSamples(logger)
        self._warned = False
        self._plan_pos = 0
        self._prefetcher: Prefetcher[int, None] | None = None

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
        for name in (
            "_fs", "_fs_protocol", "_cache", "_open", "_lock", "_stats_lock", "_stats", "_bad",
            "_warned", "_plan_pos", "_prefetcher",
        ):  # fmt: skip
            del state[name]
        state["_pid"] = None
        state["_indexes"] = {}  # rebuilt from the local files, cheaply, where needed
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    def _where(self, i: int) -> tuple[int, int]:
        s = bisect.bisect_right(self.shard_offsets, i) - 1
        return s, i - self.shard_offsets[s]

    def _raw(self, i: int) -> dict[str, Any]:
        s, j = self._where(i)
        with self._lock:
            self._stats["requested"] += 1
            shard = self._shard(s)
            index = shard.samples
            key = index.keys[j]
            raw: dict[str, Any] = {
                e: _pread(shard.file, size, off) for e, off, size in index.fields(j)
            }
        url = self._shards[s].url  # wids's metadata; sub-datasets are not read here
        raw.update(__key__=key, __dataset__=None, __index__=i, __shard__=url, __shardindex__=j)
        return raw

    def _shard(self, s: int) -> _Open:
        """Shard ``s``, open in this process (call with ``self._lock`` held)."""
        shard = self._open.get(s)
        if shard is not None:
            self._open.move_to_end(s)
            return shard
        self._stats["shard_opens"] += 1
        self._check_access_pattern()
        f = self._open_file(s)
        self._advance_plan(s)  # after: the next shard must not slow this one's download
        try:
            samples = self._indexes.get(s)
            if samples is None:
                samples = self._indexes[s] = self._cached_index(s, f)
        except BaseException:
            f.close()
            raise
        shard = self._open[s] = _Open(f, samples)
        while len(self._open) > self.open_shards:
            _, old = self._open.popitem(last=False)
            old.file.close()
        return shard

    def _open_file(self, s: int) -> BinaryIO:
        shard = self._shards[s]
        path = fsspec.core.strip_protocol(shard.url)
        if self._protocol == "file":
            try:
                return open(path, "rb")
            except FileNotFoundError as err:
                raise DataNotFoundError(shard.url, _cause(err), self.source) from err
        f, hit = self._local_cache().open_file(self._cache_key(s), partial(self._download, s))
        if hit:
            self._stats["cache_hits"] += 1
        return f

    def _download(self, s: int, part: Path) -> None:
        """Download shard ``s`` to ``part`` and index it (under the cache entry's lock).

        The index goes into the cache before the shard does, so the processes waiting
        for the shard find both; a shard that fails to index is never cached.
        """
        shard = self._shards[s]
        fs = self._filesystem()
        start = time.perf_counter()
        with storage_errors(shard.url, self._endpoint):  # botocore's, not OSErrors
            try:
                fs.get_file(fsspec.core.strip_protocol(shard.url), str(part))
            except FileNotFoundError as err:
                raise DataNotFoundError(shard.url, _cause(err), self.source) from err
            except OSError as err:
                raise SampleFetchError(shard.url, _cause(err)) from err
        size = part.stat().st_size
        if shard.filesize is not None and size != shard.filesize:
            raise CorruptDataError(
                shard.url,
                f"its download has {size} bytes, but {self.source} says filesize "
                f"{shard.filesize}; the shard changed or the list is out of date",
                "shard",
            )
        with open(part, "rb") as f:
            samples = self._index(s, f)
        self._local_cache().write(self._index_key(s, None), samples.encode())
        self._indexes[s] = samples
        with self._stats_lock:
            self._stats["downloads"] += 1
            self._stats["downloaded_bytes"] += size
        logger.debug(
            "downloaded and indexed %s (%d bytes) in %.2f s",
            shard.url,
            size,
            time.perf_counter() - start,
        )

    def _cached_index(self, s: int, f: BinaryIO) -> _Index:
        """The index of open shard ``s``: from the host's cache, else built and cached.

        Building one reads every tar header (about 50 ms per 1,000 samples); loading it
        takes about 1 ms, so each shard is indexed once per host, not once per process.
        """
        cache = self._local_cache()
        key = self._index_key(s, f)
        data = cache.read(key)
        if data is not None:
            with suppress(ValueError, TypeError, KeyError):
                samples = _Index.decode(data)
                if len(samples) == self._shards[s].nsamples:
                    return samples
        try:
            samples = self._index(s, f)
        except CorruptDataError:
            if self._protocol != "file":
                cache.discard(self._cache_key(s))  # the next read downloads it again
            raise
        cache.write(key, samples.encode())
        return samples

    def _index(self, s: int, f: BinaryIO) -> _Index:
        shard = self._shards[s]
        samples = _index_tar(f, shard.url)
        if len(samples) != shard.nsamples:
            raise CorruptDataError.count(shard.url, self.source, shard.nsamples, len(samples))
        return samples

    def _index_key(self, s: int, f: BinaryIO | None) -> str:
        if self._protocol != "file":
            return self._cache_key(s) + "|index-v2"
        st = os.fstat(f.fileno())  # a local shard that changes gets a new key
        return f"file|{self._shards[s].url}|{st.st_size}|{st.st_mtime_ns}|index-v2"

    def _cache_key(self, s: int) -> str:
        shard = self._shards[s]
        size = "" if shard.filesize is None else shard.filesize
        return f"{self._endpoint}|{shard.url}|{size}"

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
            self.source,
            self.open_shards,
        )

    def locate(self, index: int) -> tuple[str, str]:
        """The shard URL and the key of sample ``index``, e.g. to find a bad sample.

        Examples
        --------
        >>> ds.locate(1234)  # doctest: +SKIP
        ('s3://my-bucket/train/shard-000001.tar', '000001234')
        """
        i = int(index) % self._len
        self._this_process()
        s, j = self._where(i)
        with self._lock:
            key = self._shard(s).samples.keys[j]
        return self._shards[s].url, key

    def get_stats(self) -> dict[str, int]:
        """Counters for this process (each DataLoader worker has its own).

        ``requested`` samples; ``shard_opens``, the shards this process had to open
        (not already among its ``open_shards``), and of those the ``cache_hits`` found on
        local disk (downloaded earlier by any process, or prefetched); ``downloads`` and
        ``downloaded_bytes`` this process fetched, prefetching included; ``corrupt``
        samples found and ``skipped`` reads replaced by the next readable sample.

        Examples
        --------
        >>> ds.get_stats()  # doctest: +SKIP
        {'requested': 5000, 'shard_opens': 5, 'cache_hits': 3, 'downloads': 2, ...}
        """
        names = ("requested", "shard_opens", "cache_hits", "downloads", "downloaded_bytes")
        return {k: self._stats[k] for k in (*names, "corrupt", "skipped")}

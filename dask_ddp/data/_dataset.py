"""ShardListDataset: map-style access to the samples of WebDataset-format tar shards."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dask.utils import parse_bytes
from torch.utils.data import Dataset

from dask_ddp.data import _shard_files
from dask_ddp.data._codecs import Decode, _SampleDecoding
from dask_ddp.data._errors import (
    CorruptDataError,
    DataNotFoundError,
    OnCorrupt,
    ShardListError,
    check_int,
    check_on_corrupt,
)
from dask_ddp.data._fsclient import (
    _endpoint_of,
    _protocol_of,
)
from dask_ddp.data._shard_files import _ShardFiles
from dask_ddp.data._shard_order import _ShardOrder
from dask_ddp.data._tar import _Index, _Shard
from dask_ddp.data._wids import Transformations

logger = logging.getLogger("dask_ddp.data.shards")


class ShardListDataset(_ShardFiles, _ShardOrder, _SampleDecoding, Dataset):
    """Map-style access to samples stored in WebDataset-format tar shards.

    ``ds[i]`` finds the shard holding sample ``i`` (the shard list gives each shard's
    sample count), makes sure the shard is on local disk, and reads the sample's members
    by byte offset. A remote shard (``s3://``, ``gs://``, ``https://``, ...) is
    downloaded whole into ``cache_dir`` the first time any process on the host needs it:
    one process downloads while the others wait for it (an ``fcntl`` lock), the file is
    written under a temporary name and renamed into place, and the least recently used
    shards are deleted when the cache outgrows ``cache_size``. Local shards are read in
    place. A shard's index (each sample's members and byte offsets, read from the tar
    headers) is built once per host, when the shard is downloaded or first opened, and kept
    in ``cache_dir`` too, so DataLoader workers load it instead of parsing the tar again.

    Each sample is a dict as wids gives it: the fields by extension (``".jpg"``,
    ``".cls"``) and ``__key__``, ``__shard__``, ``__index__``, ``__shardindex__``,
    ``__dataset__``; decoded by wids's ``transformations`` (PIL images by default), or by
    ``decode=`` with ``keys=`` choosing a tuple of fields (see docs/data.md).

    Read the samples in shard order, or close to it: with :class:`DistributedChunkedSampler`
    each process has one or two shards open at a time. A sampler that jumps between shards
    at random (``DistributedSampler``) makes a process open, and on a cold host download, a
    shard for most samples; :meth:`get_stats` counts this and a warning says so. The
    sampler also tells the dataset each epoch's shard order, so that the first shard
    downloads as the epoch starts and every reading process (each DataLoader worker)
    downloads the next shard in the background while it reads the current one.

    Parameters
    ----------
    shards : str, os.PathLike, mapping or sequence of mappings
        The shard list: the URL of a JSON file (``"s3://bucket/train/shards.json"``,
        ``"/data/train/shards.json"``) in wids's shape ``{"shardlist": [{"url": ...,
        "nsamples": N}, ...]}``, whose relative URLs are resolved against the file's
        folder (or its ``"base"``); or that dict itself; or its list of dicts. Each entry
        needs ``url`` and ``nsamples``; ``filesize`` (bytes) is checked after a download
        when present. Every shard must be on one filesystem.
    cache_size : int or str, optional
        Keep the cache near this size (``"200GB"``, or bytes) by deleting the least
        recently used shards; it must hold at least the shards open at once in every
        process on the host. Default: no limit. (wids 0.1.11 ignores its ``cache_size``.)
    cache_dir : str or os.PathLike, optional
        Where remote shards are kept, shared by every process on the host; use a local
        disk (not NFS). Default: ``<tempdir>/dask-ddp-shards-<uid>``, resolved in each
        process. For local shards, only their indexes go there.
    lru_size : int, optional
        wids's name for ``open_shards``.
    dataset_name, localname, keep
        Accepted for wids's code and unused: the cache names its files itself, and keeps
        shards until ``cache_size`` needs the room.
    transformations : "PIL", "numpy", callable or list of those, optional
        wids's decoding, used unless ``decode=`` or ``keys=`` is given: each function gets
        the sample dict (fields as ``io.BytesIO`` under ``.jpg``, ``.cls``, ...) and
        returns the next; ``"PIL"`` (the default) and ``"numpy"`` decode by extension as
        wids does (see ``dask_ddp.data._wids``); ``[]`` leaves the fields undecoded.
    base : str, optional
        The folder relative shard URLs are resolved against; default: the shard list's
        ``"base"``, else the JSON file's folder.
    options : mapping, optional
        Entries that update the shard list's JSON description, as wids's ``options``.
    decode : bool, mapping or callable, optional
        This package's decoding (default True when ``keys=`` is given). ``True``: each
        field by its extension with :data:`DEFAULT_DECODERS` (images to RGB
        ``PIL.Image``, ``cls`` to int, ``json``, ``txt``, ``pth``, ``npy``; other fields
        stay bytes). ``False``: every field stays bytes. A mapping ``{ext: fn(bytes)}``
        adds to or replaces the defaults (``None`` keeps bytes). A callable gets the raw
        sample dict and returns the decoded sample. Functions must pickle (module-level)
        for spawn-started workers.
    keys : sequence of str, optional
        Return a tuple of these fields instead of the dict, e.g. ``("jpg;png", "cls")``
        (``;`` separates alternatives: the first one present is taken; a leading dot is
        optional). A sample without any of the alternatives raises
        :class:`MissingFieldError`.
    transform : callable or sequence of callables, optional
        Applied to the decoded sample (the dict, or the tuple when ``keys`` is given). With
        ``keys``, a sequence gives one callable (or None) per key, like torchvision's
        ``transform``/``target_transform`` pair: ``(augment, None)``.
    endpoint_url : str, optional
        S3 only: an S3-compatible store (MinIO, SeaweedFS, Ceph), e.g. ``"http://10.0.0.5:9000"``.
    anon : bool, optional
        S3 only: read a public bucket without credentials.
    storage_options : mapping, optional
        Passed to the fsspec filesystem (``s3fs.S3FileSystem``: ``key``, ``secret``,
        ``client_kwargs``, ...); they win over the options this class sets. Pickled with
        the dataset, credentials included.
    open_shards : int, default 16
        How many shards each process keeps open (an LRU of file handles and indexes).
    prefetch : int, default 1
        How many shards each reading process downloads ahead, in a background thread, in
        the order :class:`DistributedChunkedSampler` announces (see
        :meth:`set_shard_order`); 0 turns this off. The cache must hold them too.
    retries : int, default 8
        S3 only: extra attempts for a transiently failed request, with backoff.
    on_corrupt : {"raise", "skip"}, default "raise"
        When a field fails to decode: raise :class:`CorruptDataError`, or return the
        next readable sample (index + 1, ...) in its place and log a warning once.
    freeze_gc : bool, default True
        In each DataLoader worker process, call :func:`gc.freeze` before the first read, so
        that full garbage collections skip the objects the worker inherits (see
        :class:`FileDataset`). Never done in the rank's own process.

    Attributes
    ----------
    shards : list of dict
        ``{"url", "nsamples", "filesize"}`` of every shard, URLs absolute.
    shard_offsets : list of int
        The index of each shard's first sample (what the sampler aligns chunks to).
    source : str
        Where the shard list came from.

    Raises
    ------
    ShardListError
        The shard list is malformed.
    DataNotFoundError
        The shard list's JSON file does not exist. (A missing shard is found when it is
        first read: :class:`DataNotFoundError` naming the list, ``ShardNotFoundError``.)
    CorruptDataError
        On reading: a shard holds another number of samples than listed
        (``ShardCountError``), or is not an uncompressed tar (``CorruptShardError``).

    See Also
    --------
    DistributedChunkedSampler : the sampler to use with this dataset.
    write_shards : write shards and their shard list.

    Examples
    --------
    wids's way (only the import differs from code written for ``wids``):

    >>> import dask_ddp.data as wids
    >>> trainset = wids.ShardListDataset("s3://my-bucket/train/shards.json",
    ...                                  cache_dir="./_cache", keep=True)  # doctest: +SKIP
    >>> trainset = trainset.add_transform(
    ...     lambda sample: (sample[".jpg"], sample[".cls"]))  # doctest: +SKIP

    Images and labels written by :func:`write_shards` from an ``ImageFolder``:

    >>> from torch.utils.data import DataLoader
    >>> from torchvision import transforms
    >>> train = ShardListDataset(
    ...     "s3://my-bucket/imagenet/train/shards.json",
    ...     keys=("jpg;png", "cls"),
    ...     transform=(transforms.Compose([transforms.RandomResizedCrop(224),
    ...                                    transforms.ToTensor()]), None),
    ...     endpoint_url="http://seaweedfs:8333", cache_dir="/local-ssd/shards",
    ...     cache_size="500GB",
    ... )  # doctest: +SKIP
    >>> sampler = DistributedChunkedSampler(train)  # doctest: +SKIP
    >>> loader = DataLoader(train, batch_size=64, sampler=sampler, num_workers=4)  # doctest: +SKIP
    >>> for epoch in range(10):  # doctest: +SKIP
    ...     sampler.set_epoch(epoch)
    ...     for images, labels in loader:
    ...         ...
    """

    def __init__(
        self,
        shards: str | os.PathLike[str] | Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        cache_size: int | str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        lru_size: int | None = None,
        dataset_name: str | None = None,
        localname: Callable[[str], str] | None = None,
        transformations: Transformations | None = None,
        keep: bool = False,
        base: str | None = None,
        options: Mapping[str, Any] | None = None,
        decode: Decode | None = None,
        keys: Sequence[str] | None = None,
        transform: Callable[[Any], Any] | Sequence[Callable[[Any], Any] | None] | None = None,
        endpoint_url: str | None = None,
        anon: bool | None = None,
        storage_options: Mapping[str, Any] | None = None,
        open_shards: int = 16,
        prefetch: int = 1,
        retries: int = 8,
        on_corrupt: OnCorrupt = "raise",
        freeze_gc: bool = True,
    ) -> None:
        self._init_decoding(decode, keys, transform, transformations)
        if lru_size is not None:  # wids's name for the shards kept open
            check_int("lru_size", lru_size, 1)
            open_shards = lru_size
        self.dataset_name = dataset_name
        del keep, localname  # wids's; the cache names and keeps its files itself
        check_int("open_shards", open_shards, 1)
        check_int("prefetch", prefetch, 0)
        check_int("retries", retries, 0)
        check_on_corrupt(on_corrupt)
        self.prefetch = prefetch
        self.open_shards = open_shards
        self.retries = retries
        self.on_corrupt: OnCorrupt = on_corrupt
        self.freeze_gc = freeze_gc
        self._endpoint_url, self._anon = endpoint_url, anon
        self._user_options = dict(storage_options or {})
        self._cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        self._cache_size = None if cache_size is None else _parse_size("cache_size", cache_size)

        start = time.perf_counter()
        self._reset_process_state()
        self._pid = os.getpid()
        self.source, entries = self._load(shards, base, options)
        protocols = {_protocol_of(e["url"]) for e in entries}
        if len(protocols) > 1:
            raise ShardListError(
                self.source, f"its shards are on several filesystems ({sorted(protocols)})"
            )
        self._protocol = protocols.pop()
        self._storage_options = self._options_for(self._protocol)
        self._endpoint = _endpoint_of(self._storage_options)
        self._shards = [_Shard(e["url"], e["nsamples"], e["filesize"]) for e in entries]
        self.shard_offsets = [0, *itertools.accumulate(s.nsamples for s in self._shards)][:-1]
        self._len = sum(s.nsamples for s in self._shards)
        if self._len == 0:
            raise DataNotFoundError(self.source, f"its {len(self._shards)} shards hold no samples")
        self._indexes: dict[int, _Index] = {}
        self._plan: tuple[int, ...] | None = None
        logger.info(
            "ShardListDataset: %d samples in %d shards from %s (%.2f s)",
            self._len,
            len(self._shards),
            self.source,
            time.perf_counter() - start,
        )

    # -- reading ------------------------------------------------------------------------

    @property
    def shards(self) -> list[dict[str, Any]]:
        """Every shard's ``url``, ``nsamples`` and ``filesize`` (a new list each time)."""
        return [s._asdict() for s in self._shards]

    @property
    def cache_dir(self) -> str:
        """The directory remote shards and shard indexes are cached in."""
        return str(
            Path(self._cache_dir or _shard_files._default_cache_dir()).expanduser().absolute()
        )

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Any:
        i = int(index)
        if not -self._len <= i < self._len:
            raise IndexError(f"index {index} is out of range for {self._len} samples")
        i %= self._len
        self._this_process()
        if i in self._bad:
            self._stats["skipped"] += 1
            i = self._bad.next_readable(i, self._len, self.source)
        while True:
            raw = self._raw(i)
            try:
                return self._finish(self._decode(raw), raw)
            except CorruptDataError as err:
                if self.on_corrupt == "raise":
                    raise
                self._bad.mark(i, err, self._stats)
                self._stats["skipped"] += 1
                i = self._bad.next_readable(i, self._len, self.source)

    def close(self) -> None:
        """Close the shards open in this process and stop its prefetching, as wids's
        ``close()``; downloaded shards stay in the cache, and a later read opens its shard
        again.

        Examples
        --------
        >>> ds.close()  # doctest: +SKIP
        """
        prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            prefetcher.close()
        with self._lock:
            for shard in self._open.values():
                shard.file.close()
            self._open.clear()

    def __repr__(self) -> str:
        shards = len(self._shards)
        return f"ShardListDataset({self.source!r}, {self._len} samples in {shards} shards)"


def _parse_size(name: str, value: int | str) -> int:
    try:
        size = parse_bytes(value) if isinstance(value, str) else value
    except ValueError as err:
        raise ValueError(f"{name}= takes bytes or a size like '200GB', got {value!r}") from err
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{name}= must be a positive size, got {value!r}")
    return size

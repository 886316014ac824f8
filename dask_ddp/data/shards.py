"""Samples stored in WebDataset-format tar shards, read by index, from any fsspec URL.

A shard is a plain (uncompressed) tar file. Its members are grouped into samples by key,
the member name up to the first dot of its base name: ``000017.jpg`` and ``000017.cls``
are the ``.jpg`` and ``.cls`` fields of sample ``000017`` (wids's sample dict). A shard
list names the shards and how many samples each holds, in the JSON shape of webdataset's
``wids``::

    {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": "train",
     "shardlist": [{"url": "shard-000000.tar", "nsamples": 1000, "filesize": 3225600},
                   ...]}

Relative URLs are resolved against the JSON file's folder (or its ``"base"``).

* :class:`ShardListDataset` gives map-style access (``ds[i]``) to the samples. A remote
  shard is downloaded whole, once per host, into a local cache directory the first time a
  sample of it is read; samples are then read from local disk by byte offset.
* :class:`DistributedChunkedSampler` gives each rank an equal share of the indices in
  contiguous chunks (a shard each, by default), shuffled per epoch, so that each process
  reads few shards at a time.
* :func:`write_shards` turns an existing dataset (a torchvision ``ImageFolder``, an
  ``S3ImageFolder``, a list of dicts, any iterable) into shards and a shard list.

Why shards: one S3 request per sample costs about 1 ms of client CPU and a round trip,
which caps a 2-core machine near 600 to 1,000 samples per second (see ``docs/data.md``).
One request per shard of a thousand samples removes that limit.

The code follows wids' seams. :class:`ShardListDataset`, here, wires three objects, each
usable alone: a :class:`~dask_ddp.data._specs.ShardList` (the shards, and which one holds
sample ``i``), a :class:`~dask_ddp.data._shard_reader.ShardReader` (this process's
shards: the host's cache, open files, byte ranges, downloads ahead) and a
:class:`~dask_ddp.data._decode.SampleDecoder` (raw fields to the sample returned). What a
tar shard holds is read by :mod:`~dask_ddp.data._tar`; the sampler is in ``_sampler``,
the writer in ``_writer``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import fsspec
from torch.utils.data import Dataset

from dask_ddp.data._decode import DEFAULT_DECODERS, Decode, SampleDecoder, Transformations
from dask_ddp.data._errors import (
    CorruptDataError,
    CorruptSamples,
    OnCorrupt,
    check_int,
    check_on_corrupt,
    parse_size,
)
from dask_ddp.data._fsclient import filesystem_options, new_filesystem
from dask_ddp.data._sampler import DistributedChunkedSampler
from dask_ddp.data._shard_reader import ShardReader
from dask_ddp.data._specs import ShardList
from dask_ddp.data._writer import write_shards

__all__ = [
    "DEFAULT_DECODERS",
    "DistributedChunkedSampler",
    "ShardListDataset",
    "write_shards",
]

logger = logging.getLogger("dask_ddp.data.shards")


class ShardListDataset(Dataset):
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
        wids does (see ``dask_ddp.data._decode.WidsDecoder``); ``[]`` leaves the fields
        undecoded.
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
        first read: :class:`DataNotFoundError` naming the list, ``DataNotFoundError``.)
    CorruptDataError
        On reading: a shard holds another number of samples than listed
        (``CorruptDataError``), or is not an uncompressed tar (``CorruptDataError``).

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
        self._decoder = SampleDecoder(decode, keys, transform, transformations)
        if lru_size is not None:  # wids's name for the shards kept open
            check_int("lru_size", lru_size, 1)
            open_shards = lru_size
        del keep, localname  # wids's; the cache names and keeps its files itself
        check_int("open_shards", open_shards, 1)
        check_int("prefetch", prefetch, 0)
        check_int("retries", retries, 0)
        check_on_corrupt(on_corrupt)
        self.dataset_name = dataset_name
        self.prefetch, self.open_shards, self.retries = prefetch, open_shards, retries
        self.on_corrupt: OnCorrupt = on_corrupt
        self.freeze_gc = freeze_gc
        size = None if cache_size is None else parse_size("cache_size", cache_size)

        start = time.perf_counter()
        storage = _Storage(endpoint_url, anon, storage_options, retries)
        listing, fs = ShardList.load(shards, base=base, options=options, connect=storage.connect)
        self._shards = listing
        self._reader = ShardReader(
            listing,
            storage.options(listing.protocol),
            retries=retries,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            cache_size=size,
            open_shards=open_shards,
            prefetch=prefetch,
            freeze_gc=freeze_gc,
            fs=fs,
        )
        self._bad = CorruptSamples(logger)  # per process: not pickled
        self.source = listing.source
        self.shard_offsets = list(listing.offsets)
        logger.info(
            "ShardListDataset: %d samples in %d shards from %s (%.2f s)",
            len(listing),
            len(listing.shards),
            self.source,
            time.perf_counter() - start,
        )

    # -- reading ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._shards)

    def __getitem__(self, index: int) -> Any:
        n = len(self._shards)
        i = int(index)
        if not -n <= i < n:
            raise IndexError(f"index {index} is out of range for {n} samples")
        i %= n
        if i in self._bad:  # known corrupt (on_corrupt="skip"): read its substitute
            self._reader.stats["skipped"] += 1
            i = self._bad.next_readable(i, n, self.source)
        while True:
            raw = self._reader.read(i)
            try:
                return self._decoder(raw)
            except CorruptDataError as err:
                if self.on_corrupt == "raise":
                    raise
                self._bad.mark(i, err, self._reader.stats)
                self._reader.stats["skipped"] += 1
                i = self._bad.next_readable(i, n, self.source)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_bad"] = CorruptSamples(logger)  # each process learns its own
        return state

    @property
    def shards(self) -> list[dict[str, Any]]:
        """Every shard's ``url``, ``nsamples`` and ``filesize`` (a new list each time)."""
        return [s._asdict() for s in self._shards.shards]

    @property
    def cache_dir(self) -> str:
        """The directory remote shards and shard indexes are cached in."""
        return self._reader.cache_dir

    def locate(self, index: int) -> tuple[str, str]:
        """The shard URL and the key of sample ``index``, e.g. to find a bad sample.

        Examples
        --------
        >>> ds.locate(1234)  # doctest: +SKIP
        ('s3://my-bucket/train/shard-000001.tar', '000001234')
        """
        return self._reader.locate(int(index) % len(self))

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
        return self._reader.get_stats()

    def close(self) -> None:
        """Close the shards open in this process and stop its prefetching, as wids's
        ``close()``; downloaded shards stay in the cache, and a later read opens its shard
        again.

        Examples
        --------
        >>> ds.close()  # doctest: +SKIP
        """
        self._reader.close()

    # -- decoding -----------------------------------------------------------------------

    @property
    def decode(self) -> Decode | None:
        """``decode=`` as resolved (None: wids's ``transformations`` decode)."""
        return self._decoder.decode

    @property
    def keys(self) -> tuple[str, ...] | None:
        """The fields returned as a tuple (``keys=``), or None for the sample dict."""
        return self._decoder.keys

    @property
    def transform(self) -> Any:
        """``transform=`` as given."""
        return self._decoder.transform

    @property
    def transformations(self) -> list[Callable[[Any], Any]]:
        """wids's transformations and the functions :meth:`add_transform` added, in order."""
        return self._decoder.transformations

    def add_transform(self, transform: Callable[[Any], Any]) -> ShardListDataset:
        """Apply ``transform`` to every sample after what is already applied, as wids's
        ``add_transform``; returns the dataset.

        Examples
        --------
        >>> ds = ShardListDataset("shards.json").add_transform(
        ...     lambda s: (s[".jpg"], s[".cls"]))  # doctest: +SKIP
        """
        self._decoder.add_transform(transform)
        return self

    # -- the shard order ------------------------------------------------------------------

    def set_shard_order(self, order: Sequence[int] | None) -> None:
        """Say in which order the shards will be read, so that workers download ahead.

        :class:`DistributedChunkedSampler` calls this for you (at construction and in
        ``set_epoch``), before the DataLoader starts its workers, and starts the
        download of the first shards in ``set_epoch`` and when the DataLoader iterates
        it (in the rank's process, while the workers start). Each process that reads
        samples (a DataLoader worker started afterwards, or the rank itself with
        ``num_workers=0``) keeps the next ``prefetch`` shards of ``order`` downloading in
        a background thread while it reads the current one. It stops prefetching when
        its reads leave the order (a stale order in ``persistent_workers``, another
        sampler).

        Parameters
        ----------
        order : sequence of int, or None
            Shard numbers (positions in :attr:`shards`), in reading order; None forgets it.

        Examples
        --------
        >>> ds.set_shard_order([4, 0, 7, 2])  # doctest: +SKIP
        """
        self._reader.order.set(order)

    @property
    def shard_order(self) -> tuple[int, ...] | None:
        """The shard order given to :meth:`set_shard_order`, or None."""
        return self._reader.order.plan

    def start_prefetch(self) -> None:
        """Start downloading the order's first shards (a new epoch is starting).

        The sampler calls this in the rank's process from ``set_epoch`` and when it is
        iterated: the downloads run on the process's warm connection while the DataLoader
        starts its workers, who find the shards on disk or being written; without
        workers, this is the reading process's own prefetch.
        """
        self._reader.order.start()

    def wait_prefetched(self, timeout: float | None = None) -> bool:
        """Wait until the shards being prefetched in this process are downloaded (or have
        failed; the read that needs one raises its error); True at once when none are.

        Examples
        --------
        >>> ds.start_prefetch(); ds.wait_prefetched(60)  # doctest: +SKIP
        True
        """
        return self._reader.order.wait(timeout)

    @property
    def prefetching(self) -> bool:
        """Whether this process is downloading shards ahead of its reads right now."""
        return self._reader.order.busy

    def __repr__(self) -> str:
        n, shards = len(self), len(self._shards.shards)
        return f"ShardListDataset({self.source!r}, {n} samples in {shards} shards)"


class _Storage:
    """The filesystem options a dataset gives each protocol (S3's own only to ``s3://``),
    and a new client with them. Used while the dataset is built, never kept."""

    def __init__(
        self,
        endpoint_url: str | None,
        anon: bool | None,
        user: Mapping[str, Any] | None,
        retries: int,
    ) -> None:
        self.endpoint_url, self.anon, self.user, self.retries = endpoint_url, anon, user, retries

    def options(self, protocol: str) -> dict[str, Any]:
        s3 = protocol == "s3"
        return filesystem_options(
            protocol,
            self.endpoint_url if s3 else None,
            self.anon if s3 else None,
            self.user,
            10,
            self.retries,
        )

    def connect(self, protocol: str) -> fsspec.AbstractFileSystem:
        return new_filesystem(protocol, self.options(protocol), self.retries)

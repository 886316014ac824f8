"""Map-style datasets that read samples from S3 or any other fsspec filesystem.

:class:`FileDataset` is the general one: one object (file) per sample, a user decode
function, any fsspec URL (``s3://``, local paths, ``gs://``, ...). :class:`S3ImageFolder` is
a thin layer over it with :class:`torchvision.datasets.ImageFolder` semantics.

What makes them fast and robust:

* The objects are listed once, at construction, with one paginated listing (S3
  ``ListObjectsV2``, any number of keys).
* The filesystem client is created lazily, once per process: it is dropped when the
  dataset is pickled (spawn-started DataLoader workers, Dask) and recreated when the
  process id changes (fork-started workers). Connections are kept alive and reused.
* ``__getitems__`` fetches a whole batch concurrently (``concurrency=`` requests at a
  time) on fsspec's IO loop, so a batched ``DataLoader`` waits for one round trip per
  batch instead of one per sample.
* Transient S3 errors (5xx, throttling, reset connections) are retried with exponential
  backoff and jitter (botocore's "standard" retry mode, ``retries=`` extra attempts).
* ``cache_dir=`` keeps a copy of each sample on local disk, shared by every process on
  the host (see :mod:`dask_ddp.data.cache`), so a second epoch reads local disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import os
import time
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import fsspec
import fsspec.asyn
import fsspec.core
from PIL import Image
from torch.utils.data import Dataset

from dask_ddp import _status
from dask_ddp.data._errors import (
    CorruptSampleError,
    CorruptSamples,
    DataNotFoundError,
    NoSamplesError,
    SampleFetchError,
    check_int,
    check_on_corrupt,
)
from dask_ddp.data._workers import freeze_inherited_objects
from dask_ddp.data.cache import LocalCache

__all__ = ["IMG_EXTENSIONS", "FileDataset", "S3ImageFolder", "decode_image"]

logger = logging.getLogger(__name__)

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""torchvision's ``IMG_EXTENSIONS`` (the tests check they agree), copied so that this
module does not import torchvision (about 1 s in every spawned worker)."""

OnCorrupt = Literal["raise", "skip"]

# Every filesystem client this module made in this process, and, in a forked child, the
# ones inherited from the parent. An inherited client belongs to the parent's event loop:
# if the child's garbage collector finalized it (s3fs clients sit in reference cycles, so
# even a dataset dropped before the fork can be collected after it), closing it would
# block about 1 s on that dead loop, or fail with "attached to a different loop" on the
# child's. The child keeps them referenced and never uses them.
# Keyed by id(): filesystems compare equal when their options are equal.
_CLIENTS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_INHERITED_CLIENTS: list[Any] = []


def _keep_inherited_clients() -> None:
    _INHERITED_CLIENTS.extend(_CLIENTS.values())
    _CLIENTS.clear()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_keep_inherited_clients)

# botocore's parsed data files (the S3 service model, endpoint rules, partitions), by
# data path. A new botocore session loads and parses them again: about 60 ms of CPU per
# S3 client, paid by every DataLoader worker on its first read (several hundred ms when
# the workers are busy decoding). Sessions made here share one loader per process, and
# a forked worker inherits it parsed, so its client is ready in about 10 ms. The files
# are botocore's own, read-only; no credentials or settings live in the loader.
_BOTOCORE_LOADERS: dict[str | None, Any] = {}


def _new_filesystem(
    protocol: str, options: Mapping[str, Any], retries: int
) -> fsspec.AbstractFileSystem:
    """A new client for ``protocol``, registered so that forked children never close it.

    For S3, botocore retries each request (``config_kwargs``) and s3fs's own loop around it
    also covers a body cut off mid-read: the product of the two is bounded here. Its
    botocore session shares this process's parsed data files (see ``_BOTOCORE_LOADERS``)
    unless ``options`` bring a ``session`` of their own.
    """
    fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
    if protocol == "s3":
        fs.retries = 1 + min(retries, 2)
        if fs.session is None:
            fs.session = _shared_loader_session(fs.kwargs)
    _CLIENTS[id(fs)] = fs
    return fs


def _shared_loader_session(kwargs: Mapping[str, Any]) -> Any:
    """The ``AioSession(**kwargs)`` s3fs would make, with this process's shared loader."""
    import aiobotocore.session
    import botocore.loaders

    session = aiobotocore.session.AioSession(**kwargs)
    data_path = session.get_config_variable("data_path")
    loader = _BOTOCORE_LOADERS.get(data_path)
    if loader is None:
        loader = _BOTOCORE_LOADERS[data_path] = botocore.loaders.create_loader(data_path)
    session.register_component("data_loader", loader)
    return session


_Entry = tuple[str, "int | None", str]  # (path without protocol, size, ETag or mtime)


def decode_image(data: bytes) -> Image.Image:
    """Decode image bytes into an RGB :class:`PIL.Image.Image`, as ImageFolder's loader does.

    Parameters
    ----------
    data : bytes
        The encoded image (JPEG, PNG, ... anything Pillow reads).

    Returns
    -------
    PIL.Image.Image
        The image, fully loaded and converted to RGB.

    Examples
    --------
    >>> buf = io.BytesIO()
    >>> Image.new("L", (4, 3), 128).save(buf, format="PNG")
    >>> img = decode_image(buf.getvalue())
    >>> img.mode, img.size
    ('RGB', (4, 3))
    """
    img = Image.open(io.BytesIO(data))
    return img.convert("RGB")


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
        :class:`CorruptSampleError` naming the file. Default: the raw bytes.
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
        What to do when ``decode`` fails. ``"raise"`` raises :class:`CorruptSampleError`.
        ``"skip"`` returns the next readable sample (index + 1, + 2, ...) in its place, so
        batch sizes and epoch lengths stay the same on every rank, logs a warning once
        per corrupt file and process, and counts it in :meth:`get_stats`.
    freeze_gc : bool, default True
        In each DataLoader worker process, call :func:`gc.freeze` before the first read,
        so that Python's full garbage collections skip the ~460,000 objects the worker
        inherits with torch (each one otherwise takes 0.2-0.3 s and stalls the worker,
        about once per 2,000 objects read from S3). Never done in the rank's own process.

    Raises
    ------
    DataNotFoundError
        The bucket or path does not exist, or nothing is under the prefix.
    NoSamplesError
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
        if isinstance(url, (str, os.PathLike)):
            root_url: str | None = os.fspath(url)
            urls = None
            protocol = _protocol_of(root_url)
        else:
            urls = [os.fspath(u) for u in url]
            if not urls:
                raise ValueError("url= is an empty list; pass a prefix or at least one file URL")
            root_url = None
            protocols = {_protocol_of(u) for u in urls}
            if len(protocols) > 1:
                raise ValueError(
                    f"every URL in url= must use one filesystem; got {sorted(protocols)}"
                )
            protocol = protocols.pop()
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
        self._protocol = protocol
        self._storage_options = _storage_options(
            protocol, endpoint_url, anon, storage_options, concurrency, retries
        )
        self._endpoint = _endpoint_of(self._storage_options)
        self._cache = LocalCache(cache_dir) if cache_dir is not None else None
        self._fs: fsspec.AbstractFileSystem | None = None
        self._pid: int | None = None
        self._stats: Counter[str] = Counter()
        self._bad = CorruptSamples(logger)

        start = time.perf_counter()
        if root_url is not None:
            self.root = root_url
            root = fsspec.core.strip_protocol(root_url).rstrip("/")
            _status.activity(f"{type(self).__name__}: listing {root_url}")
            entries = self._list(root)
        else:
            common = os.path.commonprefix(urls)  # noqa: RUF071 - URLs, not OS paths
            self.root = common[: common.rfind("/") + 1] or common
            root = fsspec.core.strip_protocol(self.root)
            entries = [(fsspec.core.strip_protocol(u), None, "") for u in urls]
        self._paths: list[str] = []
        self._sizes: list[int | None] = []  # these two only feed cache keys: kept with a cache
        self._tokens: list[str] = []
        self._index(root, entries)
        _status.activity(
            f"{type(self).__name__}: {len(self._paths)} samples under {self.root} "
            f"({len(entries)} files listed) in {time.perf_counter() - start:.2f} s"
        )
        self._fill_log: str | None = None
        if self._cache is not None:
            # One byte per sample fetched into the cache, appended by whichever process
            # fetched it (DataLoader workers too): the rank reads the file's size to show
            # how far the host's cache has filled.
            digest = hashlib.sha256(f"{self._endpoint}|{self.root}".encode()).hexdigest()
            self._fill_log = str(self._cache.directory / f".filled-{digest[:16]}")
            _status.follow(self._fill_log, self._cache_progress)

    # -- construction -------------------------------------------------------------------

    def _list(self, root: str) -> list[_Entry]:
        """List every file under ``root`` once (one paginated listing on S3)."""
        fs = self._filesystem()
        url = self._url(root)
        try:
            found = fs.find(root, detail=True)
        except FileNotFoundError as err:
            raise DataNotFoundError(url, _missing_reason(self._protocol, root, err)) from err
        if not found:
            raise DataNotFoundError(url, "nothing is under it" + _nearby(fs, root, self._url))
        entries = []
        for path, info in sorted(found.items()):
            token = info.get("ETag") or info.get("mtime") or info.get("LastModified") or ""
            entries.append((path, info.get("size"), str(token)))
        return entries

    def _index(self, root: str, entries: list[_Entry]) -> None:
        """Choose the samples among ``entries``; subclasses override this."""
        kept = [e for e in entries if not e[0].endswith("/") and self._accepts(e[0])]
        if not kept:
            raise NoSamplesError(
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
        if self._cache is not None:
            self._sizes.append(size)
            self._tokens.append(token)

    # -- per-process client -------------------------------------------------------------

    def _filesystem(self) -> fsspec.AbstractFileSystem:
        """This process's filesystem client, created on first use in each process."""
        if self._fs is None or self._pid != os.getpid():  # a forked child: see _CLIENTS
            fs = _new_filesystem(self._protocol, self._storage_options, self.retries)
            self._fs, self._pid = fs, os.getpid()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"] = None  # a client holds sockets and an event loop; rebuild it there
        state["_pid"] = None
        state["_stats"] = Counter()
        state["_bad"] = CorruptSamples(logger)
        return state

    # -- reading ------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """The URL of every sample, in index order."""
        return [self._url(p) for p in self._paths]

    @property
    def cache_dir(self) -> str | None:
        """The local cache directory, or None."""
        return None if self._cache is None else str(self._cache.directory)

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

    def _read(self, indices: list[int]) -> list[bytes]:
        """The bytes of each sample, from the cache or the store; raises on failure."""
        self._stats["requested"] += len(indices)
        paths = [self._paths[i] for i in indices]
        if self._cache is None:
            results = self._fetch(paths)
        else:
            keys = [self._cache_key(i) for i in indices]
            sizes = [self._sizes[i] for i in indices]
            results, hits = self._cache.get_many(
                keys, sizes, lambda pos: self._fetch([paths[p] for p in pos])
            )
            self._stats["cache_hits"] += hits
            if hits < len(indices) and self._fill_log is not None:
                _count_fills(self._fill_log, len(indices) - hits)
        for path, result in zip(paths, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                raise SampleFetchError(
                    self._url(path), f"{type(result).__name__}: {result}"
                ) from result
        return results  # type: ignore[return-value]

    def _fetch(self, paths: list[str]) -> list[bytes | BaseException]:
        """Fetch ``paths`` from the store; each result is bytes or the error for that path."""
        fs = self._filesystem()
        if getattr(fs, "async_impl", False):
            results = fsspec.asyn.sync(fs.loop, _cat_concurrently, fs, paths, self.concurrency)
        else:
            results = []
            for path in paths:
                try:
                    results.append(fs.cat_file(path))
                except OSError as err:
                    results.append(err)
        got = [r for r in results if isinstance(r, bytes)]
        self._stats["fetched"] += len(got)
        self._stats["fetched_bytes"] += sum(map(len, got))
        return results

    def _sample(self, index: int, data: bytes) -> Any:
        try:
            obj = self._decode(index, data)
        except CorruptSampleError as err:
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
            raise CorruptSampleError(
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
            except CorruptSampleError as err:
                self._bad.mark(j, err, self._stats)
                index = j
                continue
            return self._finish(j, obj)

    # -- names --------------------------------------------------------------------------

    def _cache_progress(self) -> str | None:
        """How far the host's cache has filled with this dataset (for the live view)."""
        try:
            filled = min(os.stat(self._fill_log).st_size, len(self))  # type: ignore[arg-type]
        except OSError:
            return None  # nothing fetched yet
        return f"cache: {filled:,} of {len(self):,} samples of {self.root} on this host's disk"

    def _url(self, path: str) -> str:
        return path if self._protocol == "file" else f"{self._protocol}://{path}"

    def _cache_key(self, index: int) -> str:
        return "|".join(
            (
                self._endpoint,
                self._url(self._paths[index]),
                str(self._sizes[index]),
                self._tokens[index],
            )
        )

    def __repr__(self) -> str:
        cache = f", cache_dir={self.cache_dir!r}" if self._cache is not None else ""
        return f"{type(self).__name__}({self.root!r}, {len(self)} samples{cache})"


class S3ImageFolder(FileDataset):
    """Images in class folders on S3, with torchvision ``ImageFolder`` semantics.

    Every folder directly under ``s3://bucket/prefix/`` is a class; classes are sorted
    and numbered from 0; every image under a class folder (at any depth, with one of
    torchvision's :data:`IMG_EXTENSIONS`) is a sample, in ImageFolder's order.
    ``dataset[i]`` is ``(transform(image), target_transform(target))`` where ``image`` is
    an RGB :class:`PIL.Image.Image`, exactly as ``ImageFolder`` gives for the same files.

    A drop-in for dask-pytorch-ddp's ``S3ImageFolder``: its positional arguments and its
    keywords ``s3_bucket=`` and ``s3_prefix=`` work unchanged. The prefix names a folder:
    ``"train"`` and ``"train/"`` both mean the keys under ``train/``.

    Parameters
    ----------
    bucket : str
        The bucket name (``"my-bucket"``; an ``s3://`` in front is accepted).
    prefix : str, default ""
        The folder holding the class folders; ``""`` is the top of the bucket.
    transform, target_transform : callable, optional
        Applied to the image and to the class index.
    anon : bool, default False
        Read a public bucket without credentials.
    s3_bucket, s3_prefix : str, optional
        The predecessor's names for ``bucket`` and ``prefix``.
    decode : callable, default :func:`decode_image`
        ``decode(data: bytes) -> image``, the counterpart of ImageFolder's ``loader``.
    is_valid_file : callable, optional
        ``is_valid_file(url) -> bool`` instead of the extension check, as in ImageFolder.
    allow_empty : bool, default False
        As in ImageFolder: if False, a class folder without any image is an error.
    **kwargs
        ``endpoint_url``, ``storage_options``, ``cache_dir``, ``concurrency``,
        ``retries``, ``on_corrupt``, ``freeze_gc``: see :class:`FileDataset`.

    Attributes
    ----------
    classes : list of str
        The class names, sorted.
    class_to_idx : dict of str to int
        Class name -> class index.
    samples : list of (str, int)
        ``(url, class_index)`` per image; ``imgs`` is the same. Read-only: select
        images with :class:`torch.utils.data.Subset`.
    targets : list of int
        The class index of each image.

    Raises
    ------
    DataNotFoundError
        The bucket does not exist, or nothing is under the prefix.
    NoSamplesError
        Objects exist but there are no class folders, no images, or (unless
        ``allow_empty``) a class folder without images.

    Examples
    --------
    >>> from torchvision import transforms
    >>> augment = transforms.Compose([transforms.RandomResizedCrop(224), transforms.ToTensor()])
    >>> ds = S3ImageFolder(
    ...     "my-bucket", "imagenet/train", transform=augment,
    ...     endpoint_url="http://seaweedfs:8333",  # any S3-compatible store; omit for AWS
    ...     cache_dir="/local-ssd/cache",          # second epoch reads local disk
    ... )  # doctest: +SKIP
    >>> ds.classes[:2], len(ds)  # doctest: +SKIP
    (['n01440764', 'n01443537'], 1281167)
    >>> old = S3ImageFolder(s3_bucket="my-bucket", s3_prefix="imagenet/train")  # doctest: +SKIP
    """

    def __init__(
        self,
        bucket: str | None = None,
        prefix: str | None = None,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        anon: bool = False,
        *,
        s3_bucket: str | None = None,
        s3_prefix: str | None = None,
        decode: Callable[[bytes], Any] = decode_image,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        endpoint_url: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        concurrency: int = 32,
        retries: int = 8,
        on_corrupt: OnCorrupt = "raise",
        freeze_gc: bool = True,
    ) -> None:
        bucket = _one_of("bucket", bucket, "s3_bucket", s3_bucket, required=True)
        prefix = _one_of("prefix", prefix, "s3_prefix", s3_prefix, required=False) or ""
        bucket = bucket.removeprefix("s3://").strip("/")
        if not bucket or "/" in bucket:
            raise ValueError(
                f"bucket= takes a bucket name such as 'my-bucket', got {bucket!r}; put the "
                "folder in prefix=, e.g. S3ImageFolder('my-bucket', 'imagenet/train')"
            )
        self.s3_bucket = bucket
        self.s3_prefix = prefix.strip("/")
        self.anon = anon
        self.target_transform = target_transform
        self.allow_empty = allow_empty
        self.extensions = IMG_EXTENSIONS if is_valid_file is None else None
        self.classes: list[str] = []
        self.class_to_idx: dict[str, int] = {}
        self.targets: list[int] = []
        url = f"s3://{bucket}/{self.s3_prefix}" if self.s3_prefix else f"s3://{bucket}"
        super().__init__(
            url,
            decode,
            transform=transform,
            suffixes=None,
            is_valid_file=is_valid_file,
            endpoint_url=endpoint_url,
            anon=anon,
            storage_options=storage_options,
            cache_dir=cache_dir,
            concurrency=concurrency,
            retries=retries,
            on_corrupt=on_corrupt,
            freeze_gc=freeze_gc,
        )

    def _accepts(self, path: str) -> bool:
        if self.is_valid_file is not None:
            return bool(self.is_valid_file(self._url(path)))
        return path.lower().endswith(IMG_EXTENSIONS)

    def _index(self, root: str, entries: list[_Entry]) -> None:
        base = root + "/"
        classes: set[str] = set()
        images = []
        for path, size, token in entries:
            rel = path[len(base) :] if path.startswith(base) else ""
            cls, sep, rest = rel.partition("/")
            if not cls or not sep:
                continue  # not inside a class folder
            classes.add(cls)
            if rest and not rest.endswith("/") and self._accepts(path):
                folder, _, name = rest.rpartition("/")
                images.append(((cls, folder, name), path, size, token))
        if not classes:
            raise NoSamplesError(
                self.root,
                f"{len(entries)} objects are under it but no class folder: S3ImageFolder "
                f"expects keys like {self.root}/<class>/<image>.jpg",
            )
        self.classes = sorted(classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        images.sort(key=lambda item: item[0])  # ImageFolder's order: class, folder, name
        for (cls, _, _), path, size, token in images:
            self._add(path, size, token)
            self.targets.append(self.class_to_idx[cls])
        wanted = (
            "is_valid_file= accepted none"
            if self.extensions is None
            else "looked for " + ", ".join(IMG_EXTENSIONS)
        )
        if not images:
            raise NoSamplesError(
                self.root, f"{len(entries)} objects are under it but no image ({wanted})"
            )
        empty = sorted(classes - {cls for (cls, _, _), *_ in images})
        if empty and not self.allow_empty:
            raise NoSamplesError(
                self.root,
                f"the class folders {', '.join(empty)} hold no image ({wanted}); delete "
                "them, or pass allow_empty=True to keep them as classes without samples",
            )

    def _finish(self, index: int, obj: Any) -> tuple[Any, Any]:
        target: Any = self.targets[index]
        if self.transform is not None:
            obj = self.transform(obj)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return obj, target

    @property
    def samples(self) -> list[tuple[str, int]]:
        """``(url, class_index)`` of every image, in index order (a new list each time).

        Read-only, unlike ImageFolder's attribute: to train on part of the images, wrap
        the dataset in :class:`torch.utils.data.Subset`.
        """
        return list(zip(self.urls, self.targets, strict=True))

    @property
    def imgs(self) -> list[tuple[str, int]]:
        """The same as :attr:`samples`, as in ImageFolder."""
        return self.samples

    @property
    def all_files(self) -> list[str]:
        """The key of every image, as dask-pytorch-ddp's ``all_files`` (bucket-relative)."""
        cut = len(self.s3_bucket) + 1
        return [p[cut:] for p in self._paths]


# -- helpers ----------------------------------------------------------------------------


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


async def _cat_concurrently(
    fs: fsspec.asyn.AsyncFileSystem, paths: list[str], limit: int
) -> list[bytes | BaseException]:
    """Read every path with at most ``limit`` requests in flight; errors are returned.

    Not ``fs.cat(paths)``: that expands glob characters (``[``, ``*``, ``?`` are legal
    in keys), drops repeated paths, and starts each chunk only when the previous one is
    done.
    """
    semaphore = asyncio.Semaphore(limit)

    async def one(path: str) -> bytes:
        async with semaphore:
            return await fs._cat_file(path)

    return await asyncio.gather(*(one(p) for p in paths), return_exceptions=True)


def _protocol_of(url: str) -> str:
    if "::" in url:
        raise ValueError(
            f"chained URLs such as {url!r} are not supported; pass the plain URL and use "
            "cache_dir= for a local cache"
        )
    protocol, _ = fsspec.core.split_protocol(url)
    if protocol in (None, "file", "local"):
        return "file"
    return "s3" if protocol in ("s3", "s3a") else protocol


def _storage_options(
    protocol: str,
    endpoint_url: str | None,
    anon: bool | None,
    user: Mapping[str, Any] | None,
    concurrency: int,
    retries: int,
) -> dict[str, Any]:
    """The filesystem options: ours for S3, then the user's on top."""
    user = dict(user or {})
    if protocol != "s3":
        if endpoint_url is not None or anon is not None:
            raise ValueError(
                f"endpoint_url= and anon= apply to s3:// URLs, not {protocol}://; pass "
                "options for this filesystem in storage_options="
            )
        return user
    options: dict[str, Any] = {
        # One GET per object: s3fs's default (10) first sends a HEAD to learn the size.
        "max_concurrency": 1,
        # The listing is read once; s3fs would otherwise keep every object's info dict.
        "use_listings_cache": False,
    }
    if endpoint_url is not None:
        options["endpoint_url"] = endpoint_url
    if anon is not None:
        options["anon"] = anon
    config = {
        "max_pool_connections": max(10, concurrency),
        "retries": {"mode": "standard", "total_max_attempts": retries + 1},
    }
    config.update(user.pop("config_kwargs", None) or {})
    options["config_kwargs"] = config
    options.update(user)
    client = dict(options.get("client_kwargs") or {})
    if _endpoint_of(options).lower().startswith("http://") and "verify" not in client:
        # No TLS to this store: spare each client (each DataLoader worker makes one)
        # loading the CA bundle into an SSL context it never uses, about 20 ms of CPU.
        client["verify"] = False
        options["client_kwargs"] = client
    return options


def _endpoint_of(options: Mapping[str, Any]) -> str:
    endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get(
        "endpoint_url"
    )
    return str(endpoint or "")


def _missing_reason(protocol: str, root: str, err: OSError) -> str:
    if protocol == "s3":
        bucket = root.split("/", 1)[0]
        if "bucket" in str(err).lower():
            return (
                f"the bucket {bucket!r} does not exist at this endpoint; check the name, "
                "and endpoint_url= for a store other than AWS"
            )
    return f"it does not exist ({err})"


def _nearby(fs: fsspec.AbstractFileSystem, root: str, to_url: Callable[[str], str]) -> str:
    """A hint naming what the parent folder holds, for a prefix with nothing under it."""
    parent = root.rsplit("/", 1)[0] if "/" in root else root
    try:
        names = sorted(fs.ls(parent, detail=False))
    except OSError:
        return ""
    if not names:
        return f"; {to_url(parent)} is empty"
    shown = ", ".join(n.rsplit("/", 1)[-1] or n for n in names[:10])
    more = f" and {len(names) - 10} more" if len(names) > 10 else ""
    return f"; {to_url(parent)} holds {shown}{more}"


def _one_of(name: str, value: Any, old_name: str, old_value: Any, *, required: bool) -> Any:
    if value is not None and old_value is not None:
        raise TypeError(f"pass {name}= or {old_name}=, not both")
    value = value if value is not None else old_value
    if value is None and required:
        raise TypeError(f"S3ImageFolder() needs {name}= (or the older {old_name}=)")
    return value

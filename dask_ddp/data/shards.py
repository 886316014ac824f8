"""Samples stored in WebDataset-format tar shards, read by index, from any fsspec URL.

A shard is a plain (uncompressed) tar file. Its members are grouped into samples by key,
the member name up to the first dot of its base name: ``000017.jpg`` and ``000017.cls``
are the ``jpg`` and ``cls`` fields of sample ``000017``. A shard list names the shards and
how many samples each holds, in the JSON shape of webdataset's ``wids``::

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
"""

from __future__ import annotations

import bisect
import concurrent.futures
import io
import itertools
import json
import logging
import mmap
import os
import posixpath
import tarfile
import tempfile
import threading
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Literal, NamedTuple

import fsspec
import fsspec.core
import numpy as np
import torch
from dask.utils import parse_bytes
from PIL import Image
from torch.utils.data import Dataset, IterableDataset, Sampler

from dask_ddp.data._errors import (
    CorruptSampleError,
    CorruptSamples,
    CorruptShardError,
    DataNotFoundError,
    MissingFieldError,
    NoSamplesError,
    SampleFetchError,
    ShardCountError,
    ShardListError,
    ShardNotFoundError,
    check_int,
    check_on_corrupt,
)
from dask_ddp.data._fsclient import (
    _endpoint_of,
    _new_filesystem,
    _protocol_of,
    _storage_options,
)
from dask_ddp.data._imagefolder import IMG_EXTENSIONS, decode_image
from dask_ddp.data._workers import freeze_inherited_objects
from dask_ddp.data.cache import LocalCache

__all__ = [
    "DEFAULT_DECODERS",
    "DistributedChunkedSampler",
    "ShardListDataset",
    "write_shards",
]

logger = logging.getLogger(__name__)

_IMAGE_EXTS = frozenset(e.lstrip(".") for e in IMG_EXTENSIONS)
_INT_EXTS = frozenset({"cls", "cls2", "index", "inx", "id"})
_TEXT_EXTS = frozenset({"txt", "text", "transcript"})
_JSON_EXTS = frozenset({"json", "jsn"})
_DEFAULT_CHUNK = 1000
"""Sampler chunk size when the dataset does not say where its shards start."""
_MISS_WARN_AFTER, _MISS_WARN_RATE = 256, 0.3

OnCorrupt = Literal["raise", "skip"]
Partition = Literal["fixed", "shuffled"]


# -- decoding ---------------------------------------------------------------------------


def _decode_int(data: bytes) -> int:
    return int(data.decode("ascii").strip())


def _decode_text(data: bytes) -> str:
    return data.decode("utf-8")


def _decode_json(data: bytes) -> Any:
    return json.loads(data)


def _decode_pth(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _decode_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


DEFAULT_DECODERS: dict[str, Callable[[bytes], Any]] = {
    **dict.fromkeys(sorted(_IMAGE_EXTS), decode_image),
    **dict.fromkeys(sorted(_INT_EXTS), _decode_int),
    **dict.fromkeys(sorted(_TEXT_EXTS), _decode_text),
    **dict.fromkeys(sorted(_JSON_EXTS), _decode_json),
    "pth": _decode_pth,
    "npy": _decode_npy,
}
"""How :class:`ShardListDataset` decodes a field by default, keyed by the last part of its
extension (``seg.png`` decodes as ``png``): images to RGB :class:`PIL.Image.Image`,
``cls``/``index``/``id`` to int, ``txt`` to str, ``json`` to Python objects, ``pth`` with
``torch.load(weights_only=True)``, ``npy`` with ``numpy.load(allow_pickle=False)``. Other
fields stay bytes (pickles are never unpickled)."""


# -- the shard list ---------------------------------------------------------------------


def _join(base: str, url: str) -> str:
    """``url`` resolved against the folder ``base`` (kept as is if absolute).

    >>> _join("s3://bucket/sets/train", "../shards/shard-000000.tar")
    's3://bucket/sets/shards/shard-000000.tar'
    >>> _join("/data/train", "s3://other/x.tar")
    's3://other/x.tar'
    """
    if "://" in url or url.startswith("/"):
        return url
    protocol, sep, path = base.rpartition("://")
    joined = posixpath.normpath(posixpath.join(path, url))
    return f"{protocol}{sep}{joined}"


def _check_entries(entries: Any, source: str) -> list[dict[str, Any]]:
    if not isinstance(entries, Sequence) or isinstance(entries, (str, bytes)):
        raise ShardListError(source, f"'shardlist' is a {type(entries).__name__}, not a list")
    if not entries:
        raise ShardListError(source, "it lists no shards")
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ShardListError(
                source, f"entry {i} is {entry!r}, not a dict with 'url' and 'nsamples'"
            )
        url, n = entry.get("url"), entry.get("nsamples")
        if not isinstance(url, (str, os.PathLike)) or not os.fspath(url):
            raise ShardListError(source, f"entry {i} has no 'url' (a string): {dict(entry)}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ShardListError(
                source, f"entry {i} ({url}) has no 'nsamples' (an int >= 0): {dict(entry)}"
            )
        size = entry.get("filesize")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)):
            raise ShardListError(source, f"entry {i} ({url}) has a non-integer 'filesize'")
        out.append({"url": os.fspath(url), "nsamples": n, "filesize": size})
    return out


def _parse_description(desc: Any, source: str, base: str | None) -> list[dict[str, Any]]:
    """The shards of a wids-style description (a dict with "shardlist"), URLs resolved."""
    if not isinstance(desc, Mapping) or "shardlist" not in desc:
        keys = sorted(desc) if isinstance(desc, Mapping) else type(desc).__name__
        raise ShardListError(source, f"it has no 'shardlist' (found {keys})")
    if desc.get("datasets"):
        raise ShardListError(
            source, "sub-datasets ('datasets') are not supported; list every shard in 'shardlist'"
        )
    base = desc.get("base", base)
    shards = _check_entries(desc["shardlist"], source)
    if base is not None:
        for shard in shards:
            shard["url"] = _join(str(base).rstrip("/"), shard["url"])
    return shards


class _Shard(NamedTuple):
    url: str
    nsamples: int
    filesize: int | None


class _Index:
    """A shard's samples in order, in flat arrays: sample ``j`` is ``keys[j]``, and its
    members are ``first[j]`` to ``first[j + 1]`` of ``exts``, ``offsets`` and ``sizes``.

    Flat, because the garbage collector walks every container that lives long: an index
    of per-sample tuples was 5,000 objects per 1,000 samples, which made the DataLoader
    workers of an epoch run full collections (about 0.3 s each, stalling the batch being
    made) that reading local files never does. This is six objects per shard.
    """

    __slots__ = ("exts", "first", "keys", "offsets", "sizes")

    def __init__(
        self, keys: list[str], first: array, exts: list[str], offsets: array, sizes: array
    ) -> None:
        if len(first) != len(keys) + 1 or not len(exts) == len(offsets) == len(sizes):
            raise ValueError("the index's arrays do not match in length")
        self.keys, self.first, self.exts, self.offsets, self.sizes = (
            keys, first, exts, offsets, sizes
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.keys)

    def fields(self, j: int) -> Iterator[tuple[str, int, int]]:
        """``(ext, offset, size)`` of each member of sample ``j``."""
        for m in range(self.first[j], self.first[j + 1]):
            yield self.exts[m], self.offsets[m], self.sizes[m]

    def encode(self) -> bytes:
        """JSON bytes for the host's cache; :meth:`decode` reads them back.

        >>> idx = _Index(["a", "b"], array("q", [0, 2, 3]), ["jpg", "cls", "jpg"],
        ...              array("q", [512, 2048, 3072]), array("q", [1000, 1, 900]))
        >>> back = _Index.decode(idx.encode())
        >>> back.keys, list(back.fields(0)), list(back.fields(1))
        (['a', 'b'], [('jpg', 512, 1000), ('cls', 2048, 1)], [('jpg', 3072, 900)])
        """
        return json.dumps(
            {
                "keys": self.keys,
                "first": self.first.tolist(),
                "exts": self.exts,
                "offsets": self.offsets.tolist(),
                "sizes": self.sizes.tolist(),
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> _Index:
        d = json.loads(data)
        return cls(
            d["keys"],
            array("q", d["first"]),
            d["exts"],
            array("q", d["offsets"]),
            array("q", d["sizes"]),
        )


class _Open(NamedTuple):
    """A shard open in this process: its file and its sample index."""

    file: BinaryIO
    samples: _Index


_ZERO_BLOCK = bytes(512)


def _scan_plain_tar(f: BinaryIO, end: int) -> tuple[list[str], array, array] | None:
    """The names, data offsets and sizes of a tar's members, if all are plain ustar headers.

    A fast path for what :func:`write_shards` and webdataset write: about 20 times
    faster than :mod:`tarfile`, which checksums and decodes every header field in Python.
    Only the walk from header to header is a Python loop (it needs each size); the other
    fields of all headers are read and checked at once with NumPy, every checksum
    included. Returns None, so that the caller falls back to :mod:`tarfile`, when a
    header is not a regular file with a plain name and an octal size (pax or GNU extension
    headers, links, directories, base-256 sizes) or its checksum fails.
    """
    if end < 512:
        return None
    starts, sizes = array("q"), array("q")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0
        try:
            while pos + 512 <= end:
                if buf[pos] == 0 and buf[pos : pos + 512] == _ZERO_BLOCK:
                    pos = end  # the end-of-archive marker
                    break
                size = int(buf[pos + 124 : pos + 135], 8)  # 11 octal digits, then NUL
                starts.append(pos)
                sizes.append(size)
                pos += 512 + -(-size // 512) * 512
        except ValueError:
            return None  # a size field in another form: let tarfile read it
        if not starts or pos != end:  # empty, or cut short: tarfile says how
            return None
        at = np.frombuffer(starts, dtype=np.int64)
        blocks = np.frombuffer(buf, dtype=np.uint8, count=end // 512 * 512).reshape(-1, 512)
        heads = blocks[at // 512]  # a copy: tar headers start on 512-byte blocks
        del blocks  # the mmap closes only when no view of it is left
    if not (
        np.isin(heads[:, 156], (0x30, 0)).all()  # typeflag "0" or NUL: a regular file
        and np.isin(heads[:, 135], (0, 0x20)).all()  # the size field ended after 11 digits
        and _checksums_match(heads)
    ):
        return None
    names = _field_strings(heads[:, :100])
    prefixed = np.flatnonzero((heads[:, 257:262] == np.frombuffer(b"ustar", np.uint8)).all(1)
                               & (heads[:, 345] != 0))  # fmt: skip
    if names is None or (len(prefixed) and (prefixes := _field_strings(heads[:, 345:500])) is None):
        return None
    for k in prefixed.tolist():
        names[k] = prefixes[k] + b"/" + names[k]
    return [n.decode("utf-8", "surrogateescape") for n in names], array("q", at + 512), sizes


def _field_strings(fields: np.ndarray) -> list[bytes] | None:
    """Each row of NUL-padded header fields as bytes; None if a NUL is followed by more."""
    nul = fields == 0
    if (nul[:, :-1] & ~nul[:, 1:]).any():
        return None  # tarfile would cut at the first NUL; let it
    return np.ascontiguousarray(fields).view(f"S{fields.shape[1]}").ravel().tolist()


def _checksums_match(heads: np.ndarray) -> bool:
    """Whether every header's checksum field (octal digits, then NUL or space) is right."""
    field = heads[:, 148:156].astype(np.int64) - 0x30
    run = np.cumprod((field >= 0) & (field <= 7), axis=1)  # 1 while the digits go on
    ndigits = run.sum(axis=1)
    if (ndigits == 0).any():
        return False  # leading spaces or the like: tarfile decides
    ends = heads[np.arange(len(heads)), 148 + np.minimum(ndigits, 7)]
    if not ((ndigits == 8) | (ends == 0) | (ends == 0x20)).all():
        return False
    power = np.clip(ndigits[:, None] - 1 - np.arange(8), 0, None)
    stored = (field * run * 8**power).sum(axis=1)
    # The sum of the header's bytes, its checksum field counted as eight spaces.
    sums = heads.sum(axis=1, dtype=np.int64) - (field + 0x30).sum(axis=1) + 8 * 0x20
    return bool((sums == stored).all())


def _index_tar(f: BinaryIO, url: str) -> _Index:
    """Group a tar file's members into samples (see :class:`_Index`).

    Members with the same key must be adjacent (as webdataset writes and reads them);
    members without an extension, and anything but regular files, are skipped.
    """
    f.seek(0)
    head = f.read(2)
    f.seek(0)
    if head == b"\x1f\x8b":
        raise CorruptShardError(
            url,
            "it is gzip-compressed; random access needs byte offsets into an uncompressed "
            "tar, so decompress it (gunzip) and list the .tar instead",
        )
    end = os.fstat(f.fileno()).st_size
    scanned = _scan_plain_tar(f, end)
    if scanned is None:  # pax or GNU extensions, links, a damaged header: let tarfile judge
        try:
            with tarfile.open(fileobj=f, mode="r:") as tar:  # leaves f open
                members = [m for m in tar if m.isreg()]
        except tarfile.TarError as err:
            raise CorruptShardError(url, f"{type(err).__name__}: {err}") from err
        scanned = (
            [m.name for m in members],
            array("q", [m.offset_data for m in members]),
            array("q", [m.size for m in members]),
        )
    names, offsets, sizes = scanned
    keys: list[str] = []
    first = array("q")
    exts: list[str] = []
    keep = array("q")  # the members that belong to a sample
    for m, name in enumerate(names):
        if offsets[m] + sizes[m] > end:
            raise CorruptShardError(
                url,
                f"it is truncated: member {name!r} needs bytes up to "
                f"{offsets[m] + sizes[m]} but the file has {end}",
            )
        folder, _, base = name.rpartition("/")
        stem, dot, ext = base.partition(".")
        if not dot or not ext:
            continue
        key = f"{folder}/{stem}" if folder else stem
        ext = ext.lower()
        if not keys or keys[-1] != key:
            keys.append(key)
            first.append(len(exts))
        elif ext in exts[first[-1] :]:
            raise CorruptShardError(url, f"sample {key!r} has two {ext!r} members")
        exts.append(ext)
        keep.append(m)
    first.append(len(exts))
    if len(keep) != len(names):
        offsets = array("q", [offsets[m] for m in keep])
        sizes = array("q", [sizes[m] for m in keep])
    return _Index(keys, first, exts, offsets, sizes)


def _pread(f: BinaryIO, size: int, offset: int) -> bytes:
    if hasattr(os, "pread"):
        return os.pread(f.fileno(), size, offset)
    f.seek(offset)  # pragma: no cover - Windows; callers hold the dataset's lock
    return f.read(size)  # pragma: no cover


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


# -- the dataset ------------------------------------------------------------------------


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
    decode : bool, mapping or callable, default True
        ``True``: decode each field by its extension with :data:`DEFAULT_DECODERS`
        (images to RGB ``PIL.Image``, ``cls`` to int, ``json``, ``txt``, ``pth``, ``npy``;
        other fields stay bytes). ``False``: every field stays bytes. A mapping
        ``{ext: fn(bytes) -> value}`` adds to or replaces the defaults (``None`` keeps
        that extension as bytes). A callable gets the whole raw sample (a dict of
        ``ext: bytes`` plus ``__key__``, ``__shard__`` and ``__index__``) and returns the
        decoded sample. Functions must pickle (module-level) for spawn-started workers.
    keys : sequence of str, optional
        Return a tuple of these fields instead of the dict, e.g. ``("jpg;png", "cls")``
        (``;`` separates alternatives: the first one present is taken). A sample
        without any of the alternatives raises :class:`MissingFieldError`.
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
    cache_dir : str or os.PathLike, optional
        Where remote shards are kept, shared by every process on the host; use a local
        disk (not NFS). Default: ``<tempdir>/dask-ddp-shards-<uid>``, resolved in each
        process. For local shards, only their indexes go there.
    cache_size : int or str, optional
        Keep the cache near this size (``"200GB"``, or bytes) by deleting the least
        recently used shards; it must hold at least the shards open at once in every
        process on the host. Default: no limit.
    open_shards : int, default 16
        How many shards each process keeps open (an LRU of file handles and indexes).
    prefetch : int, default 1
        How many shards each reading process downloads ahead, in a background thread, in
        the order :class:`DistributedChunkedSampler` announces (see
        :meth:`set_shard_order`); 0 turns this off. The cache must hold them too.
    retries : int, default 8
        S3 only: extra attempts for a transiently failed request, with backoff.
    on_corrupt : {"raise", "skip"}, default "raise"
        When a field fails to decode: raise :class:`CorruptSampleError`, or return the
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
        first read: :class:`ShardNotFoundError`.)
    ShardCountError, CorruptShardError
        On reading: a shard holds another number of samples than listed, or is not an
        uncompressed tar.

    See Also
    --------
    DistributedChunkedSampler : the sampler to use with this dataset.
    write_shards : write shards and their shard list.

    Examples
    --------
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
        decode: bool | Mapping[str, Callable[[bytes], Any] | None] | Callable[..., Any] = True,
        keys: Sequence[str] | None = None,
        transform: Callable[[Any], Any] | Sequence[Callable[[Any], Any] | None] | None = None,
        endpoint_url: str | None = None,
        anon: bool | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_size: int | str | None = None,
        open_shards: int = 16,
        prefetch: int = 1,
        retries: int = 8,
        on_corrupt: OnCorrupt = "raise",
        freeze_gc: bool = True,
    ) -> None:
        if not (isinstance(decode, (bool, Mapping)) or callable(decode)):
            raise TypeError(
                f"decode= takes True, False, a mapping {{ext: fn(bytes)}} or a function of "
                f"the raw sample dict, got {decode!r}"
            )
        if isinstance(keys, str):
            raise TypeError(f"keys= takes a sequence of field names, e.g. ({keys!r},)")
        if keys is not None and not keys:
            raise ValueError("keys= is empty; leave it None to get each sample as a dict")
        if (
            transform is not None
            and not callable(transform)
            and (keys is None or isinstance(transform, str) or len(transform) != len(keys))
        ):
            raise TypeError(
                "transform= takes a function, or (with keys=) one function or None per "
                f"key; got {transform!r} for keys={keys!r}"
            )
        check_int("open_shards", open_shards, 1)
        check_int("prefetch", prefetch, 0)
        check_int("retries", retries, 0)
        check_on_corrupt(on_corrupt)
        self.decode = decode
        self.prefetch = prefetch
        self.keys = tuple(keys) if keys is not None else None
        self.transform = transform
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
        self.source, entries = self._load(shards)
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
            raise NoSamplesError(self.source, f"its {len(self._shards)} shards hold no samples")
        self._indexes: dict[int, _Index] = {}
        self._plan: tuple[int, ...] | None = None
        logger.info(
            "ShardListDataset: %d samples in %d shards from %s (%.2f s)",
            self._len,
            len(self._shards),
            self.source,
            time.perf_counter() - start,
        )

    # -- construction -------------------------------------------------------------------

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

    def _load(self, shards: Any) -> tuple[str, list[dict[str, Any]]]:
        if isinstance(shards, (str, os.PathLike)):
            url = os.fspath(shards)
            protocol = _protocol_of(url)
            if protocol == "file":
                url = os.path.abspath(fsspec.core.strip_protocol(url))
            # The JSON may be on another filesystem than the shards (local list, S3 shards);
            # when it is on theirs, this client reads the shards too (see __init__).
            fs = _new_filesystem(protocol, self._options_for(protocol), self.retries)
            self._fs, self._fs_protocol = fs, protocol
            try:
                raw = fs.cat_file(fsspec.core.strip_protocol(url))
            except FileNotFoundError as err:
                raise DataNotFoundError(url, f"the shard list does not exist ({err})") from err
            try:
                desc = json.loads(raw)
            except ValueError as err:
                raise ShardListError(url, f"it is not JSON ({err})") from err
            if isinstance(desc, list):  # a bare list of entries
                desc = {"shardlist": desc}
            return url, _parse_description(desc, url, url.rsplit("/", 1)[0])
        source = "the shard list passed in"
        if isinstance(shards, Mapping):
            return source, _parse_description(shards, source, None)
        return source, _check_entries(shards, source)

    # -- per-process state --------------------------------------------------------------

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
        self._prefetcher: _Prefetcher | None = None

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

    # -- prefetching --------------------------------------------------------------------

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
        if order is None:
            self._plan = None
            return
        plan = tuple(int(k) for k in order)
        bad = [k for k in plan if not 0 <= k < len(self._shards)]
        if bad:
            raise ValueError(
                f"set_shard_order() got shard {bad[0]}, but there are shards 0 to "
                f"{len(self._shards) - 1}"
            )
        self._plan = plan
        self._plan_pos = 0

    def _advance_plan(self, s: int) -> None:
        """Shard ``s`` is being opened: queue the next ones of the plan for download."""
        plan = self._plan
        if plan is None or not self.prefetch or self._protocol == "file":
            return
        if self._prefetcher is None:
            self._prefetcher = _Prefetcher(self)
        try:
            pos = plan.index(s, self._plan_pos)
        except ValueError:
            logger.debug(
                "process %d read shard %d, which its shard order does not list next; "
                "prefetching stops",
                os.getpid(),
                s,
            )
            self._plan = None
            self._prefetcher.want([])
            return
        self._plan_pos = pos
        self._prefetcher.want([k for k in plan[pos + 1 : pos + 1 + self.prefetch] if k != s])

    def _start_prefetch(self) -> None:
        """Start downloading the order's first shards (a new epoch is starting).

        The sampler calls this in the rank's process from ``set_epoch`` and when it is
        iterated: the downloads run on the process's warm connection while the DataLoader
        starts its workers, who find the shards on disk or being written; without
        workers, this is the reading process's own prefetch.
        """
        plan = self._plan
        if plan is None or not self.prefetch or self._protocol == "file":
            return
        self._this_process()
        if self._prefetcher is None:
            self._prefetcher = _Prefetcher(self)
        self._plan_pos = 0
        self._prefetcher.want(list(plan[: 1 + self.prefetch]))

    def _prefetch(self, s: int) -> None:
        """Download shard ``s`` into the host's cache unless it is there (prefetch thread)."""
        if s in self._indexes and self._local_cache().path(self._cache_key(s)).exists():
            return
        f, _ = self._local_cache().open_file(self._cache_key(s), partial(self._download, s))
        f.close()

    # -- reading ------------------------------------------------------------------------

    @property
    def shards(self) -> list[dict[str, Any]]:
        """Every shard's ``url``, ``nsamples`` and ``filesize`` (a new list each time)."""
        return [s._asdict() for s in self._shards]

    @property
    def cache_dir(self) -> str:
        """The directory remote shards and shard indexes are cached in."""
        return str(Path(self._cache_dir or _default_cache_dir()).expanduser().absolute())

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
                sample = self._decode(raw)
            except CorruptSampleError as err:
                if self.on_corrupt == "raise":
                    raise
                self._bad.mark(i, err, self._stats)
                self._stats["skipped"] += 1
                i = self._bad.next_readable(i, self._len, self.source)
                continue
            return self._finish(sample, raw)

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
        raw.update(__key__=key, __shard__=self._shards[s].url, __index__=i)
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
                raise ShardNotFoundError(shard.url, self.source, _cause(err)) from err
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
        try:
            fs.get_file(fsspec.core.strip_protocol(shard.url), str(part))
        except FileNotFoundError as err:
            raise ShardNotFoundError(shard.url, self.source, _cause(err)) from err
        except OSError as err:
            raise SampleFetchError(shard.url, _cause(err)) from err
        size = part.stat().st_size
        if shard.filesize is not None and size != shard.filesize:
            raise CorruptShardError(
                shard.url,
                f"its download has {size} bytes, but {self.source} says filesize "
                f"{shard.filesize}; the shard changed or the list is out of date",
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
        except (CorruptShardError, ShardCountError):
            if self._protocol != "file":
                cache.discard(self._cache_key(s))  # the next read downloads it again
            raise
        cache.write(key, samples.encode())
        return samples

    def _index(self, s: int, f: BinaryIO) -> _Index:
        shard = self._shards[s]
        samples = _index_tar(f, shard.url)
        if len(samples) != shard.nsamples:
            raise ShardCountError(shard.url, self.source, shard.nsamples, len(samples))
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

    # -- decoding -----------------------------------------------------------------------

    def _decode(self, raw: dict[str, Any]) -> Any:
        decode = self.decode
        if decode is False:
            return dict(raw)
        if callable(decode) and not isinstance(decode, (bool, Mapping)):
            try:
                return decode(raw)
            except Exception as err:
                raise CorruptSampleError(
                    f"{raw['__shard__']}#{raw['__key__']}", f"{type(err).__name__}: {err}"
                ) from err
        table: Mapping[str, Callable[[bytes], Any] | None] = DEFAULT_DECODERS
        if isinstance(decode, Mapping):
            table = {**DEFAULT_DECODERS, **{k.lower().lstrip("."): v for k, v in decode.items()}}
        out = {}
        for ext, value in raw.items():
            fn = table.get(ext.rsplit(".", 1)[-1]) if not ext.startswith("__") else None
            if fn is None:
                out[ext] = value
                continue
            try:
                out[ext] = fn(value)
            except Exception as err:
                raise CorruptSampleError(
                    f"{raw['__shard__']}#{raw['__key__']}.{ext}", f"{type(err).__name__}: {err}"
                ) from err
        return out

    def _finish(self, sample: Any, raw: Mapping[str, Any]) -> Any:
        if self.keys is not None:
            if not isinstance(sample, Mapping):
                raise TypeError(
                    f"keys= picks fields from a dict, but decode= returned a "
                    f"{type(sample).__name__}; return a dict from decode=, or drop keys="
                )
            sample = tuple(self._field(sample, k, raw) for k in self.keys)
            if self.transform is not None and not callable(self.transform):
                return tuple(
                    v if t is None else t(v) for v, t in zip(sample, self.transform, strict=True)
                )
        if self.transform is not None:
            return self.transform(sample)  # type: ignore[operator]
        return sample

    @staticmethod
    def _field(sample: Mapping[str, Any], wanted: str, raw: Mapping[str, Any]) -> Any:
        for name in wanted.split(";"):
            if name in sample:
                return sample[name]
        available = tuple(k for k in sample if not k.startswith("__"))
        raise MissingFieldError(raw["__shard__"], raw["__key__"], wanted, available)

    def __repr__(self) -> str:
        shards = len(self._shards)
        return f"ShardListDataset({self.source!r}, {self._len} samples in {shards} shards)"


def _cause(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _parse_size(name: str, value: int | str) -> int:
    try:
        size = parse_bytes(value) if isinstance(value, str) else value
    except ValueError as err:
        raise ValueError(f"{name}= takes bytes or a size like '200GB', got {value!r}") from err
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{name}= must be a positive size, got {value!r}")
    return size


class _Prefetcher:
    """Downloads, in a background thread, the shards a process will read next.

    It holds only the cache entry's lock while it downloads (never the dataset's), so the
    process keeps reading the current shard; a reader that needs the shard being
    downloaded waits for that lock, then opens the finished file. The thread ends when
    nothing is left to download (a new one starts for the next shard), so a rank's
    process that trains job after job keeps no thread, and no dataset, of a finished job.
    """

    def __init__(self, dataset: ShardListDataset) -> None:
        self.dataset = dataset
        self.wanted: list[int] = []
        self.busy = False  # a thread is running
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None

    def want(self, shards: list[int]) -> None:
        with self.cond:
            self.wanted = list(shards)
            if self.wanted and not self.busy:
                self.busy = True
                self.thread = threading.Thread(target=self._run, name="shard-prefetch", daemon=True)
                self.thread.start()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is wanted or downloading; False on timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.busy, timeout)

    def _run(self) -> None:
        while True:
            with self.cond:
                if not self.wanted:
                    self.busy = False
                    self.cond.notify_all()
                    return
                s = self.wanted.pop(0)
            try:
                self.dataset._prefetch(s)
            except Exception as err:  # the reader's own read of it raises the error
                logger.debug("prefetching shard %d failed (the read will retry): %s", s, err)


# -- the sampler ------------------------------------------------------------------------


class DistributedChunkedSampler(Sampler[int]):
    """Give each rank an equal share of a dataset's indices, in contiguous chunks.

    The indices are cut into chunks (by default one per shard of a
    :class:`ShardListDataset`, or ``chunksize`` consecutive indices); each epoch the
    chunks are visited in a shuffled order and the indices within each chunk shuffled,
    so that a process reads one shard after another instead of jumping between them. The
    order depends only on ``seed`` and the epoch set with :meth:`set_epoch`, so every
    rank computes its share without talking to the others, and a rerun repeats it.

    Like :class:`torch.utils.data.DistributedSampler`, every rank gets the same number of
    indices: ``ceil(len / num_replicas)``, a few repeated (padding), or with
    ``drop_last=True`` ``floor(len / num_replicas)``, a few left out that epoch.

    Parameters
    ----------
    dataset : sized
        The dataset (only its length, and its ``shard_offsets`` if present, are used).
    num_replicas : int, optional
        The number of ranks. Default: the ``torch.distributed`` world size when a process
        group is initialised, else the dask_ddp context's, else 1.
    rank : int, optional
        This rank, ``0 <= rank < num_replicas``. Default: as ``num_replicas``, else 0.
    shuffle : bool, default True
        Shuffle the chunk order and the order within chunks each epoch. False: indices in
        order.
    seed : int, default 0
        The same on every rank.
    drop_last : bool, default False
        Leave out the indices that do not divide evenly instead of repeating some.
    chunksize : int, optional
        The most indices in one chunk. Default: one chunk per shard if the dataset has
        ``shard_offsets`` (a :class:`ShardListDataset`), else 1000. Given with a
        :class:`ShardListDataset`, shards are cut into pieces of at most ``chunksize``.
    partition : {"fixed", "shuffled"}, default "fixed"
        ``"fixed"``: rank ``r`` always gets the ``r``-th contiguous range of indices
        (shuffled within it each epoch, as wids's sampler does), so each host downloads
        only its share of the shards, once; the cache can be as small as that share.
        ``"shuffled"``: each epoch the chunks of the whole dataset are shuffled and dealt
        to the ranks in contiguous runs, so a rank sees different samples every epoch, as
        with ``DistributedSampler``; a host then reads about all shards over a few epochs.

    Attributes
    ----------
    num_samples : int
        Indices per rank per epoch (``len(sampler)``).
    total_size : int
        ``num_samples * num_replicas``.
    epoch : int
        The epoch the next iteration shuffles for.

    Examples
    --------
    >>> sampler = DistributedChunkedSampler(range(10), num_replicas=2, rank=1, chunksize=3)
    >>> len(sampler), sorted(sampler)
    (5, [5, 6, 7, 8, 9])
    >>> list(DistributedChunkedSampler(range(10), num_replicas=2, rank=1, shuffle=False))
    [5, 6, 7, 8, 9]
    >>> sampler.set_epoch(1)  # call before each epoch, as with DistributedSampler
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        chunksize: int | None = None,
        partition: Partition = "fixed",
    ) -> None:
        if num_replicas is None or rank is None:
            default_rank, default_world = _default_rank_and_world()
            num_replicas = default_world if num_replicas is None else num_replicas
            rank = default_rank if rank is None else rank
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas= must be an int >= 1, got {num_replicas!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank= must be an int in [0, {num_replicas - 1}] for num_replicas="
                f"{num_replicas}, got {rank!r}"
            )
        if chunksize is not None and (not isinstance(chunksize, int) or chunksize < 1):
            raise ValueError(f"chunksize= must be an int >= 1, got {chunksize!r}")
        if partition not in ("fixed", "shuffled"):
            raise ValueError(f"partition= must be 'fixed' or 'shuffled', got {partition!r}")
        n = len(dataset)
        if n < 1:
            raise ValueError("the dataset is empty; a sampler needs at least one index")
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.partition: Partition = partition
        self.epoch = 0
        self._n = n
        if drop_last:
            self.num_samples = n // num_replicas
        else:
            self.num_samples = -(-n // num_replicas)
        self.total_size = self.num_samples * num_replicas
        offsets = getattr(dataset, "shard_offsets", None)
        if chunksize is None and offsets is None:
            chunksize = _DEFAULT_CHUNK
        self._chunks = _chunks(n, list(offsets) if offsets is not None else [0], chunksize)
        self.chunksize = chunksize
        self._offsets = np.asarray(offsets if offsets is not None else [0])
        self._dataset = dataset if hasattr(dataset, "set_shard_order") else None
        self._computed: tuple[int, np.ndarray] | None = None
        self._share_order()

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which seeds this epoch's order on every rank.

        With a :class:`ShardListDataset`, this also tells the dataset the order of the
        shards this epoch (:meth:`ShardListDataset.set_shard_order`) and starts
        downloading the first of them in this process, in the background, while the
        DataLoader starts its workers; each reading process then downloads the next
        shard while it reads one. Call it in the process that trains (the rank), as
        ``DistributedSampler.set_epoch``.
        """
        self.epoch = int(epoch)
        self._share_order()
        self._start_prefetch()

    def _start_prefetch(self) -> None:
        """Have the dataset start downloading this epoch's first shards, here."""
        start_prefetch = getattr(self._dataset, "_start_prefetch", None)
        if start_prefetch is not None:
            start_prefetch()

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        order = self._order().tolist()
        self._start_prefetch()
        return iter(order)

    def _order(self) -> np.ndarray:
        """This epoch's indices for this rank (computed once per epoch)."""
        if self._computed is None or self._computed[0] != self.epoch:
            order = self._fixed() if self.partition == "fixed" else self._shuffled()
            self._computed = (self.epoch, order)
        return self._computed[1]

    def _share_order(self) -> None:
        if self._dataset is None:
            return
        shards = np.searchsorted(self._offsets, self._order(), side="right") - 1
        if len(shards):
            shards = shards[np.concatenate([[True], shards[1:] != shards[:-1]])]
        self._dataset.set_shard_order(shards.tolist())

    def _permuted(self, lo: int, hi: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(lo, hi)
        return lo + self._rng(lo).permutation(hi - lo)

    def _chunk_order(self, count: int, salt: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(count)
        return self._rng(salt).permutation(count)

    def _rng(self, salt: int) -> np.random.Generator:
        mask = 2**64 - 1  # SeedSequence takes non-negative ints; seeds may be negative
        return np.random.default_rng([self.seed & mask, self.epoch & mask, salt])

    def _fixed(self) -> np.ndarray:
        n, w, r = self._n, self.num_replicas, self.rank
        q, rem = divmod(n, w)
        lo = r * q + min(r, rem)
        hi = lo + q + (1 if r < rem else 0)
        pieces = [(max(a, lo), min(b, hi)) for a, b in self._chunks if a < hi and b > lo]
        # salt n + r: an order of this rank's pieces, unlike any chunk's own seed
        order = self._chunk_order(len(pieces), n + r)
        parts = [self._permuted(*pieces[k]) for k in order]
        mine = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if len(mine) >= self.num_samples:
            return mine[: self.num_samples]  # drop_last: leaves out this epoch's last one
        if len(mine) == 0:  # fewer indices than ranks
            return np.full(self.num_samples, r % n, dtype=np.int64)
        return np.resize(mine, self.num_samples)  # pad by repeating this epoch's first ones

    def _shuffled(self) -> np.ndarray:
        """This rank's slice of the epoch's sequence: every chunk, in a shuffled order.

        Only the chunks overlapping the slice are permuted; the sequence is the same on
        every rank because each chunk's order depends on (seed, epoch, chunk) alone.
        """
        n = self._n
        order = self._chunk_order(len(self._chunks), n)
        chunks = [self._chunks[k] for k in order]
        starts = [0, *itertools.accumulate(b - a for a, b in chunks)]
        pos, end = self.rank * self.num_samples, (self.rank + 1) * self.num_samples
        out: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        while pos < end:
            p = pos % n  # padding wraps around to the epoch's first indices
            k = bisect.bisect_right(starts, p) - 1
            a, b = chunks[k]
            offset = p - starts[k]
            take = min(b - a - offset, end - pos)
            out.append(self._permuted(a, b)[offset : offset + take])
            pos += take
        return np.concatenate(out)

    def __repr__(self) -> str:
        return (
            f"DistributedChunkedSampler({self._n} indices, rank {self.rank}/{self.num_replicas},"
            f" {len(self._chunks)} chunks, partition={self.partition!r}, seed={self.seed}, "
            f"epoch={self.epoch})"
        )


def _chunks(n: int, offsets: list[int], chunksize: int | None) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges covering ``range(n)``: cut at ``offsets``, at most ``chunksize``.

    >>> _chunks(10, [0, 4], None)
    [(0, 4), (4, 10)]
    >>> _chunks(10, [0, 4], 3)
    [(0, 3), (3, 4), (4, 7), (7, 10)]
    """
    bounds = sorted({o for o in offsets if 0 < o < n} | {0, n})
    chunks = []
    for lo, hi in itertools.pairwise(bounds):
        step = chunksize or hi - lo
        chunks.extend((a, min(a + step, hi)) for a in range(lo, hi, step))
    return chunks


def _default_rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` from torch.distributed, else the dask_ddp context, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    from dask_ddp.context import get_context
    from dask_ddp.errors import NotInRankError

    try:
        ctx = get_context()
    except NotInRankError:
        logger.info(
            "DistributedChunkedSampler: no process group and no dask_ddp rank here; "
            "reading every index as rank 0 of 1 (pass num_replicas= and rank= to choose)"
        )
        return 0, 1
    return ctx.rank, ctx.world_size


# -- writing ----------------------------------------------------------------------------


def write_shards(
    samples: Iterable[Any],
    url: str | os.PathLike[str],
    *,
    maxcount: int = 1000,
    maxsize: int | str = "256MB",
    fields: Sequence[str] | None = None,
    image_format: str = "png",
    shuffle: bool = False,
    seed: int = 0,
    name: str | None = None,
    pattern: str = "shard-{:06d}.tar",
    shardlist_name: str = "shards.json",
    endpoint_url: str | None = None,
    anon: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Write samples as WebDataset-format tar shards and a shard list, under a folder.

    Shards ``shard-000000.tar``, ``shard-000001.tar``, ... and then the shard list
    ``shards.json`` are written under ``url``, a local folder or any fsspec URL
    (``s3://bucket/train``). Each shard is built in a local temporary file and then moved
    (local) or uploaded (remote) while the next one is built; the shard list comes last,
    so a reader never sees it name a shard that is not there yet. Files of an earlier run
    are overwritten; leftover shards with higher numbers are not deleted.

    Each sample becomes tar members ``<key>.<ext>``. The key is the sample's index in
    ``samples`` (``000000042``), or its ``"__key__"``. The fields come from:

    * a torchvision ``ImageFolder`` (or any ``DatasetFolder`` with the default loader) or
      an :class:`S3ImageFolder`, without transforms: each image file's original bytes
      under its own extension (``jpg``, ``png``, ...), copied byte for byte without
      decoding, and its class index as ``cls``;
    * a dict ``{ext: value}``: one member per entry;
    * a tuple such as ImageFolder's ``(image, class_index)``: one member per element,
      named by ``fields`` (``("jpg", "cls")``) or by type: a PIL image as
      ``image_format``, an int as ``cls``, a str as ``txt``, a tensor as ``pth``, a NumPy
      array as ``npy``, a dict or list as ``json``.

    Values are encoded by extension: bytes as they are; a PIL image in the format its
    extension names (re-encoded: PNG is lossless, JPEG is written at quality 95, so a
    JPEG read back differs slightly from the image given); ints as decimal text; str as
    UTF-8; ``json`` with :func:`json.dumps`; ``pth`` with :func:`torch.save`; ``npy``
    with :func:`numpy.save`. :class:`ShardListDataset` decodes each of them back.

    Parameters
    ----------
    samples : iterable
        A map-style dataset or sequence (read by index, in order or shuffled), or any
        iterable (read once, in order).
    url : str or os.PathLike
        The folder to write to; created if needed.
    maxcount : int, default 1000
        The most samples in one shard.
    maxsize : int or str, default "256MB"
        The most bytes in one shard (a sample larger than this gets a shard of its own).
    fields : sequence of str, optional
        The extension of each element of tuple samples, e.g. ``("jpg", "cls")``.
    image_format : str, default "png"
        The extension for PIL images that ``fields`` does not name.
    shuffle : bool, default False
        Write the samples in a random order (seeded by ``seed``), for map-style
        datasets. Recommended when ``samples`` is sorted (an ImageFolder is sorted by
        class), so that each shard, and therefore each chunk a
        :class:`DistributedChunkedSampler` hands out, mixes all classes.
    seed : int, default 0
        The seed of ``shuffle``.
    name : str, optional
        The data set's name in the shard list. Default: the folder's name.
    pattern : str, default "shard-{:06d}.tar"
        The shard file names, formatted with the shard number.
    shardlist_name : str, default "shards.json"
        The shard list's file name.
    endpoint_url, anon, storage_options
        For S3 and other remote filesystems, as in :class:`ShardListDataset`.

    Returns
    -------
    list of dict
        ``{"url", "nsamples", "filesize"}`` per shard, with absolute URLs: pass it (or
        the shard list's URL, ``url + "/shards.json"``) to :class:`ShardListDataset`.

    Raises
    ------
    ValueError
        No samples, a bad argument, or shuffle=True for an iterable without length.
    TypeError
        A value cannot be encoded under its extension; the message says which.

    Examples
    --------
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> samples = [{"txt": f"sample {i}", "cls": i % 3} for i in range(5)]
    >>> shards = write_shards(samples, folder, maxcount=2)
    >>> [s["nsamples"] for s in shards]
    [2, 2, 1]
    >>> ds = ShardListDataset(folder + "/shards.json", keys=("txt", "cls"))
    >>> len(ds), ds[3]
    (5, ('sample 3', 0))

    An ImageFolder, shuffled so that every shard mixes the classes, to S3:

    >>> from torchvision.datasets import ImageFolder
    >>> write_shards(ImageFolder("/data/train"), "s3://my-bucket/train", shuffle=True,
    ...              endpoint_url="http://seaweedfs:8333")  # doctest: +SKIP
    """
    if isinstance(maxcount, bool) or not isinstance(maxcount, int) or maxcount < 1:
        raise ValueError(f"maxcount= must be an int >= 1, got {maxcount!r}")
    limit = _parse_size("maxsize", maxsize)
    if isinstance(fields, str):
        raise TypeError(f"fields= takes a sequence of extensions, e.g. ({fields!r},)")
    image_format = image_format.lower().lstrip(".")
    if image_format not in _IMAGE_EXTS:
        raise ValueError(
            f"image_format= must be one of {sorted(_IMAGE_EXTS)}, got {image_format!r}"
        )
    root = os.fspath(url).rstrip("/")
    protocol = _protocol_of(root)
    if protocol == "file":
        root = os.path.abspath(fsspec.core.strip_protocol(root))
    options = _storage_options(protocol, endpoint_url, anon, storage_options, 10, 8)
    fs = _new_filesystem(protocol, options, 8)
    base = fsspec.core.strip_protocol(root)
    if protocol == "file":
        os.makedirs(base, exist_ok=True)

    writer = _ShardWriter(fs, protocol, root, base, pattern, maxcount, limit)
    start = time.perf_counter()
    try:
        for index, item in _items(samples, shuffle, seed):
            key, members = _encode_sample(item, index, fields, image_format)
            writer.add(key, members)
        shards = writer.close()
    except BaseException:
        writer.abort()
        raise
    if not shards:
        raise ValueError(f"write_shards() got no samples to write to {root}")
    listing = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "name": name if name is not None else posixpath.basename(base),
        "shardlist": [dict(s, url=s["url"].rsplit("/", 1)[-1]) for s in shards],
    }
    data = json.dumps(listing, indent=1).encode()
    list_path = f"{base}/{shardlist_name}"
    if protocol == "file":
        _write_local(list_path, data)
    else:
        fs.pipe_file(list_path, data)
    logger.info(
        "write_shards: %d samples in %d shards (%d bytes) to %s in %.1f s; shard list %s",
        sum(s["nsamples"] for s in shards),
        len(shards),
        sum(s["filesize"] for s in shards),
        root,
        time.perf_counter() - start,
        f"{root}/{shardlist_name}",
    )
    return shards


def _write_local(path: str, data: bytes) -> None:
    part = f"{path}.{os.getpid()}.part"
    with open(part, "wb") as f:
        f.write(data)
    os.replace(part, path)


class _ShardWriter:
    """Builds one shard at a time in a temporary file; uploads it in a background thread."""

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        protocol: str,
        root: str,
        base: str,
        pattern: str,
        maxcount: int,
        maxsize: int,
    ) -> None:
        self.fs, self.protocol, self.root, self.base = fs, protocol, root, base
        self.pattern, self.maxcount, self.maxsize = pattern, maxcount, maxsize
        self.mtime = int(time.time())
        self.shards: list[dict[str, Any]] = []
        self.keys: set[str] = set()
        self.file: BinaryIO | None = None
        self.tar: tarfile.TarFile | None = None
        self.count = 0
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="write-shards")
        self.pending: concurrent.futures.Future[None] | None = None
        self.temp_dir = base if protocol == "file" else None

    def add(self, key: str, members: list[tuple[str, bytes]]) -> None:
        size = sum(512 + -(-len(d) // 512) * 512 for _, d in members)
        if self.tar is not None and (
            self.count >= self.maxcount or self.file.tell() + size + 1024 > self.maxsize
        ):
            self._finish()
        if self.tar is None:
            self._start()
        if key in self.keys:
            raise ValueError(f"two samples have the key {key!r}; keys must be unique")
        self.keys.add(key)
        for ext, data in members:
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(data), self.mtime, 0o444
            self.tar.addfile(info, io.BytesIO(data))
        self.count += 1

    def _start(self) -> None:
        self.name = self.pattern.format(len(self.shards))
        if "/" in self.name:
            raise ValueError(f"pattern= must give a file name, not a path: {self.name!r}")
        self.file = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in _finish
            prefix=f".{self.name}.", suffix=".part", dir=self.temp_dir, delete=False
        )
        self.tar = tarfile.open(  # noqa: SIM115 - closed in _finish
            fileobj=self.file, mode="w", format=tarfile.PAX_FORMAT
        )
        self.count = 0

    def _finish(self) -> None:
        self.tar.close()  # the end-of-archive blocks; leaves the file open
        self.file.flush()
        size = self.file.tell()
        self.file.close()
        temp, dest = self.file.name, f"{self.base}/{self.name}"
        shard = {"url": f"{self.root}/{self.name}", "nsamples": self.count, "filesize": size}
        self.tar = self.file = None
        self._wait()
        self.pending = self.pool.submit(self._move, temp, dest)
        self.shards.append(shard)

    def _move(self, temp: str, dest: str) -> None:
        try:
            if self.protocol == "file":
                os.replace(temp, dest)
            else:
                self.fs.put_file(temp, dest)
        finally:
            with suppress(FileNotFoundError):
                os.unlink(temp)

    def _wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> list[dict[str, Any]]:
        if self.tar is not None:
            self._finish()
        self._wait()
        self.pool.shutdown()
        return self.shards

    def abort(self) -> None:
        if self.file is not None:
            self.file.close()
            with suppress(FileNotFoundError):
                os.unlink(self.file.name)
        with suppress(Exception):
            self._wait()  # the error being raised already says what went wrong
        self.pool.shutdown()


def _items(samples: Iterable[Any], shuffle: bool, seed: int) -> Iterator[tuple[int, Any]]:
    """``(index, item)`` pairs, through a dataset's raw-bytes path when it has one."""
    sized = (
        hasattr(samples, "__len__")
        and hasattr(samples, "__getitem__")
        and not isinstance(samples, (str, bytes, Mapping, IterableDataset))
    )
    if not sized:
        if shuffle:
            raise ValueError(
                "shuffle=True needs samples with len() and indexing (a map-style dataset or "
                "a list); shuffle an iterable yourself, or pass shuffle=False"
            )
        yield from enumerate(samples)
        return
    n = len(samples)  # type: ignore[arg-type]
    order = np.random.default_rng(seed).permutation(n).tolist() if shuffle else range(n)
    read = _raw_reader(samples)
    for lo in range(0, n, 64):
        batch = list(order[lo : lo + 64])
        items = read(batch) if read is not None else [samples[i] for i in batch]  # type: ignore[index]
        yield from zip(batch, items, strict=True)


def _raw_reader(dataset: Any) -> Callable[[list[int]], list[dict[str, Any]]] | None:
    """For image folders without transforms: read each file's bytes instead of decoding."""
    from dask_ddp.data.s3 import S3ImageFolder

    if (
        isinstance(dataset, S3ImageFolder)
        and dataset.transform is None
        and dataset.target_transform is None
        and dataset.decode is decode_image
    ):

        def read_s3(indices: list[int]) -> list[dict[str, Any]]:
            data = dataset._read(indices)  # one concurrent fetch per batch
            return [
                {_ext_of(dataset._paths[i]): d, "cls": dataset.targets[i]}
                for i, d in zip(indices, data, strict=True)
            ]

        return read_s3
    try:
        from torchvision.datasets import DatasetFolder
        from torchvision.datasets.folder import default_loader
    except ImportError:  # pragma: no cover - torchvision is a dependency
        return None
    if (
        isinstance(dataset, DatasetFolder)
        and type(dataset).__getitem__ is DatasetFolder.__getitem__
        and dataset.loader is default_loader
        and dataset.transform is None
        and dataset.target_transform is None
    ):

        def read_files(indices: list[int]) -> list[dict[str, Any]]:
            out = []
            for i in indices:
                path, target = dataset.samples[i]
                with open(path, "rb") as f:
                    out.append({_ext_of(path): f.read(), "cls": target})
            return out

        return read_files
    return None


def _ext_of(path: str) -> str:
    return path.rsplit("/", 1)[-1].rsplit(".", 1)[-1].lower()


def _encode_sample(
    item: Any, index: int, fields: Sequence[str] | None, image_format: str
) -> tuple[str, list[tuple[str, bytes]]]:
    if isinstance(item, Mapping):
        key = str(item.get("__key__", f"{index:09d}"))
        values = [  # "__shard__", "__index__", ...: a ShardListDataset's metadata
            (str(k).lower().lstrip("."), v) for k, v in item.items() if not str(k).startswith("__")
        ]
    else:
        key = f"{index:09d}"
        elements = tuple(item) if isinstance(item, (tuple, list)) else (item,)
        if fields is not None:
            if len(fields) != len(elements):
                raise ValueError(
                    f"sample {index} has {len(elements)} elements but fields= names "
                    f"{len(fields)}: {tuple(fields)}"
                )
            names = [f.lower().lstrip(".") for f in fields]
        else:
            names = [_ext_for(v, index, image_format) for v in elements]
        values = list(zip(names, elements, strict=True))
    if not key or "." in key or key.startswith("/"):
        raise ValueError(
            f"sample {index}'s key {key!r} cannot name tar members: it must be non-empty, "
            "without '.', and not start with '/'"
        )
    seen: set[str] = set()
    for ext, _ in values:
        if ext in seen or not ext:
            raise ValueError(
                f"sample {index} has {'two ' + repr(ext) if ext else 'an empty'} field "
                "name; name each field with fields= (tuples) or distinct dict keys"
            )
        seen.add(ext)
    if not values:
        raise ValueError(f"sample {index} has no fields")
    return key, [(ext, _encode_value(ext, v, index)) for ext, v in values]


def _ext_for(value: Any, index: int, image_format: str) -> str:
    if isinstance(value, Image.Image):
        return image_format
    if isinstance(value, (int, np.integer)):
        return "cls"
    if isinstance(value, str):
        return "txt"
    if isinstance(value, torch.Tensor):
        return "pth"
    if isinstance(value, np.ndarray):
        return "npy"
    if isinstance(value, (dict, list)):
        return "json"
    raise TypeError(
        f"sample {index} has a {type(value).__name__}, which write_shards cannot name; "
        "pass fields= with an extension for each element (bytes are written as they are)"
    )


def _encode_value(ext: str, value: Any, index: int) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    last = ext.rsplit(".", 1)[-1]
    try:
        if last in _IMAGE_EXTS and isinstance(value, Image.Image):
            return _encode_image(value, last)
        if last in _INT_EXTS:
            if isinstance(value, torch.Tensor):
                value = value.item()
            if isinstance(value, float) or int(value) != value:
                raise TypeError(f"{type(value).__name__} {value!r} is not an integer")
            return str(int(value)).encode("ascii")
        if last in _TEXT_EXTS and isinstance(value, str):
            return value.encode("utf-8")
        if last in _JSON_EXTS:
            return json.dumps(value).encode("utf-8")
        if last == "pth":
            buf = io.BytesIO()
            torch.save(value, buf)
            return buf.getvalue()
        if last == "npy":
            buf = io.BytesIO()
            np.save(buf, np.asarray(value), allow_pickle=False)
            return buf.getvalue()
    except (TypeError, ValueError) as err:
        raise TypeError(f"sample {index}: cannot encode its {ext!r} field: {err}") from err
    raise TypeError(
        f"sample {index}: cannot encode a {type(value).__name__} as {ext!r}; pass bytes, or "
        "use an extension write_shards encodes (an image extension for PIL images, cls, "
        "txt, json, pth, npy)"
    )


def _encode_image(img: Image.Image, ext: str) -> bytes:
    fmt = Image.registered_extensions()["." + ext]
    buf = io.BytesIO()
    if fmt == "JPEG":
        if img.mode not in ("RGB", "L", "CMYK"):
            img = img.convert("RGB")
        img.save(buf, format=fmt, quality=95)
    else:
        img.save(buf, format=fmt)
    return buf.getvalue()

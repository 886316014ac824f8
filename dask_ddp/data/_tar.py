"""What is in a plain tar shard: its samples' keys, and each field's byte offset and size.

:func:`index_tar` reads a tar file's headers once and groups its members into samples, as
webdataset does; the :class:`TarIndex` it returns encodes to bytes for the host's cache.
Nothing here downloads, caches or keeps files open (see :mod:`dask_ddp.data._shard_reader`).
"""

from __future__ import annotations

import json
import mmap
import os
import tarfile
from array import array
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from dask_ddp.data._errors import CorruptDataError


class TarIndex:
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

        >>> idx = TarIndex(["a", "b"], array("q", [0, 2, 3]), ["jpg", "cls", "jpg"],
        ...              array("q", [512, 2048, 3072]), array("q", [1000, 1, 900]))
        >>> back = TarIndex.decode(idx.encode())
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
    def decode(cls, data: bytes) -> TarIndex:
        d = json.loads(data)
        return cls(
            d["keys"],
            array("q", d["first"]),
            d["exts"],
            array("q", d["offsets"]),
            array("q", d["sizes"]),
        )


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


def index_tar(f: BinaryIO, url: str) -> TarIndex:
    """Group a tar file's members into samples (see :class:`TarIndex`).

    Members with the same key must be adjacent (as webdataset writes and reads them);
    members without an extension, and anything but regular files, are skipped.
    """
    f.seek(0)
    head = f.read(2)
    f.seek(0)
    if head == b"\x1f\x8b":
        raise CorruptDataError(
            url,
            "it is gzip-compressed; random access needs byte offsets into an uncompressed "
            "tar, so decompress it (gunzip) and list the .tar instead",
            "shard",
        )
    end = os.fstat(f.fileno()).st_size
    scanned = _scan_plain_tar(f, end)
    if scanned is None:  # pax or GNU extensions, links, a damaged header: let tarfile judge
        try:
            with tarfile.open(fileobj=f, mode="r:") as tar:  # leaves f open
                members = [m for m in tar if m.isreg()]
        except tarfile.TarError as err:
            raise CorruptDataError(url, f"{type(err).__name__}: {err}", "shard") from err
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
            raise CorruptDataError(
                url,
                f"it is truncated: member {name!r} needs bytes up to "
                f"{offsets[m] + sizes[m]} but the file has {end}",
                "shard",
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
            raise CorruptDataError(url, f"sample {key!r} has two {ext!r} members", "shard")
        exts.append(ext)
        keep.append(m)
    first.append(len(exts))
    if len(keep) != len(names):
        offsets = array("q", [offsets[m] for m in keep])
        sizes = array("q", [sizes[m] for m in keep])
    return TarIndex(keys, first, exts, offsets, sizes)

"""Shard lists as wids writes them, and the index of shards built from one.

A shard list is a JSON file or URL, a dict, or a list of ``{"url", "nsamples"}``
entries; relative URLs are resolved against the list's folder or its ``base``.
:class:`ShardList` holds the shards in order and answers "which shard holds sample
``i``, at which position". It knows nothing of caches, tar files or decoding, and
pickles as plain data.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import posixpath
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import fsspec
import fsspec.core

from dask_ddp.data._errors import DataNotFoundError, ShardListError
from dask_ddp.data._fsclient import endpoint_of, protocol_of, storage_errors


class Shard(NamedTuple):
    """One entry of a shard list: an absolute URL, its sample count, its size if listed."""

    url: str
    nsamples: int
    filesize: int | None


class ShardList:
    """The shards of a data set, in order, and where each one's samples start.

    Parameters
    ----------
    shards : sequence of Shard
        The shards, URLs absolute, all on one filesystem.
    source : str
        Where the list came from (a URL, or ``"the shard list passed in"``), for messages.

    Raises
    ------
    ShardListError
        The shards are on several filesystems.
    DataNotFoundError
        The shards hold no samples.

    Examples
    --------
    >>> shards = ShardList([Shard("/d/a.tar", 3, None), Shard("/d/b.tar", 2, None)], "list")
    >>> len(shards), shards.offsets, shards.where(4), shards.protocol
    (5, [0, 3], (1, 1), 'file')
    """

    def __init__(self, shards: Sequence[Shard], source: str) -> None:
        protocols = {protocol_of(s.url) for s in shards}
        if len(protocols) > 1:
            raise ShardListError(
                source, f"its shards are on several filesystems ({sorted(protocols)})"
            )
        self.shards = list(shards)
        self.source = source
        self.protocol = protocols.pop()
        self.offsets = [0, *itertools.accumulate(s.nsamples for s in self.shards)][:-1]
        self._len = sum(s.nsamples for s in self.shards)
        if self._len == 0:
            raise DataNotFoundError(source, f"its {len(self.shards)} shards hold no samples")

    def __len__(self) -> int:
        """The number of samples in all shards."""
        return self._len

    def where(self, index: int) -> tuple[int, int]:
        """``(shard, position in the shard)`` of sample ``index`` (``0 <= index < len``)."""
        s = bisect.bisect_right(self.offsets, index) - 1
        return s, index - self.offsets[s]

    @classmethod
    def load(
        cls,
        shards: str | os.PathLike[str] | Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        base: str | None = None,
        options: Mapping[str, Any] | None = None,
        connect: Callable[[str], fsspec.AbstractFileSystem],
    ) -> tuple[ShardList, fsspec.AbstractFileSystem | None]:
        """The shard list at a URL, or given as a dict or a list, as wids reads it:
        ``options`` update the description, and ``base`` (else the description's, else
        the JSON file's folder) resolves relative URLs.

        ``connect(protocol)`` makes the filesystem client that reads a JSON file; it is
        returned too (None for a dict or list), so that the shards' reader can go on with
        its warm connection when the shards are on the same filesystem.
        """
        fs = None
        if isinstance(shards, (str, os.PathLike)):
            url = os.fspath(shards)
            protocol = protocol_of(url)
            if protocol == "file":
                url = os.path.abspath(fsspec.core.strip_protocol(url))
            fs = connect(protocol)
            desc = _read_json(fs, url)
            source, folder = url, url.rsplit("/", 1)[0]
        else:
            source, folder = "the shard list passed in", None
            desc = shards if isinstance(shards, Mapping) else {"shardlist": shards}
        if base is not None:
            base = str(base).rstrip("/")
        desc = {**desc, **(options or {}), **({"base": base} if base else {})}
        return cls(parse_description(desc, source, folder), source), fs


def _read_json(fs: fsspec.AbstractFileSystem, url: str) -> Mapping[str, Any]:
    try:
        with storage_errors(url, endpoint_of(getattr(fs, "storage_options", {}))):
            raw = fs.cat_file(fsspec.core.strip_protocol(url))
    except FileNotFoundError as err:
        raise DataNotFoundError(url, f"the shard list does not exist ({err})") from err
    try:
        desc = json.loads(raw)
    except ValueError as err:
        raise ShardListError(url, f"it is not JSON ({err})") from err
    return {"shardlist": desc} if isinstance(desc, list) else desc  # a bare list of entries


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


def _check_entries(entries: Any, source: str) -> list[Shard]:
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
        out.append(Shard(os.fspath(url), n, size))
    return out


def parse_description(desc: Any, source: str, base: str | None) -> list[Shard]:
    """The shards of a wids-style description (a dict with "shardlist"), URLs resolved.

    >>> parse_description({"shardlist": [{"url": "a.tar", "nsamples": 2}]}, "list", "s3://b/t")
    [Shard(url='s3://b/t/a.tar', nsamples=2, filesize=None)]
    """
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
        shards = [s._replace(url=_join(str(base).rstrip("/"), s.url)) for s in shards]
    return shards

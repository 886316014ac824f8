"""Shard lists as wids writes them: a JSON file or URL, a dict, or a list of
``{"url", "nsamples"}`` entries; relative URLs resolved against the list's folder or its
``base``.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from dask_ddp.data._errors import (
    ShardListError,
)

logger = logging.getLogger("dask_ddp.data.shards")


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

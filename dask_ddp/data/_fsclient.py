"""fsspec clients for the datasets: one per process, fork-safe, with shared botocore data.

s3fs/boto clients are not fork-safe, so each dataset creates its client lazily in each
process (:func:`new_filesystem`); this module keeps every client it made, and those of
fsspec's instance caches, so that a forked child never finalizes its parent's. It also
turns the datasets' URL and options into an fsspec protocol and ``storage_options``
(:func:`filesystem_options`), reads many files concurrently on fsspec's loop
(:func:`cat_concurrently`), and explains a missing prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import fsspec
import fsspec.asyn
import fsspec.core

logger = logging.getLogger(__name__)

# Every filesystem client this module made in this process, and, in a forked child, the
# ones inherited from the parent. An inherited client belongs to the parent's event loop:
# if the child's garbage collector finalized it (s3fs clients sit in reference cycles, so
# even a dataset dropped before the fork can be collected after it), closing it would
# block about 1 s on that dead loop, or fail with "attached to a different loop" on the
# child's. The child keeps them referenced and never uses them.
# Keyed by id(): filesystems compare equal when their options are equal.
_CLIENTS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_INHERITED_CLIENTS: list[Any] = []
_FORKING: list[Any] = []  # the clients a child will inherit, between fork's two halves


def _before_fork() -> None:
    """In the parent, just before a fork: every client the child inherits, ours and those
    of fsspec's instance caches (a checkpoint's ``url_to_fs``, the user's ``fsspec.open``).
    fsspec empties those caches in the child (its own fork handler, which runs first), and
    there the clients would lose their last reference and be finalized on the child's loop;
    taken now, they are in the child's copy of this list."""
    _FORKING.extend(_CLIENTS.values())
    for cls in _subclasses(fsspec.asyn.AsyncFileSystem):
        _FORKING.extend(getattr(cls, "_cache", {}).values())


def _after_fork_in_parent() -> None:
    _FORKING.clear()


def _after_fork_in_child() -> None:
    _INHERITED_CLIENTS.extend(_FORKING)
    _FORKING.clear()
    _CLIENTS.clear()


def _subclasses(cls: type) -> Iterator[type]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )

# botocore's parsed data files (the S3 service model, endpoint rules, partitions), by
# data path. A new botocore session loads and parses them again: about 60 ms of CPU per
# S3 client, paid by every DataLoader worker on its first read (several hundred ms when
# the workers are busy decoding). Sessions made here share one loader per process, and
# a forked worker inherits it parsed, so its client is ready in about 10 ms. The files
# are botocore's own, read-only; no credentials or settings live in the loader.
_BOTOCORE_LOADERS: dict[str | None, Any] = {}


def new_filesystem(
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
    session.register("needs-retry.s3", _give_up_on_refused)
    data_path = session.get_config_variable("data_path")
    loader = _BOTOCORE_LOADERS.get(data_path)
    if loader is None:
        loader = _BOTOCORE_LOADERS[data_path] = botocore.loaders.create_loader(data_path)
    session.register_component("data_loader", loader)
    return session


_REFUSED_ATTEMPTS = 3
"""Attempts at a request whose connection is refused, before it fails (a second or two):
nothing listens at the endpoint, and botocore's backoff would spend about a minute."""


def _give_up_on_refused(attempts: int, caught_exception: Any = None, **_: Any) -> None:
    """botocore ``needs-retry`` handler: stop retrying a refused connection after
    ``_REFUSED_ATTEMPTS``; every other error keeps botocore's retry decision."""
    if attempts >= _REFUSED_ATTEMPTS and _refused(caught_exception):
        raise caught_exception


def _refused(err: BaseException | None) -> bool:
    """Whether ``err`` (botocore's EndpointConnectionError) comes from a refused connection."""
    from botocore.exceptions import EndpointConnectionError

    if not isinstance(err, EndpointConnectionError):
        return False
    cause, seen = err.kwargs.get("error"), set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ConnectionRefusedError) or getattr(cause, "errno", None) == (
            errno.ECONNREFUSED
        ):
            return True
        cause = getattr(cause, "os_error", None) or cause.__cause__ or cause.__context__
    return False


def storage_failure(err: BaseException, url: str, endpoint: str) -> Exception | None:
    """The :class:`StorageAccessError` that ``err`` means, or None for any other error."""
    try:
        from botocore.exceptions import (
            EndpointConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
        )
    except ImportError:  # no S3 support installed: no botocore errors either
        return None
    from dask_ddp.data._errors import StorageAccessError

    cause = f"{type(err).__name__}: {err}"
    if isinstance(err, EndpointConnectionError):
        if _refused(err):
            cause = f"connection refused ({_REFUSED_ATTEMPTS} attempts)"
        return StorageAccessError(url, endpoint, "unreachable", cause)
    if isinstance(err, (NoCredentialsError, PartialCredentialsError)):
        return StorageAccessError(url, endpoint, "credentials", cause)
    return None


@contextlib.contextmanager
def storage_errors(url: str, endpoint: str) -> Iterator[None]:
    """Raise :class:`StorageAccessError` for a store that cannot be used at all (no
    connection, no credentials) instead of the client's bare error."""
    try:
        yield
    except Exception as err:
        failure = storage_failure(err, url, endpoint)
        if failure is None:
            raise
        raise failure from err


async def cat_concurrently(
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


def protocol_of(url: str) -> str:
    if "::" in url:
        raise ValueError(
            f"chained URLs such as {url!r} are not supported; pass the plain URL and use "
            "cache_dir= for a local cache"
        )
    protocol, _ = fsspec.core.split_protocol(url)
    if protocol in (None, "file", "local"):
        return "file"
    return "s3" if protocol in ("s3", "s3a") else protocol


def filesystem_options(
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
    if endpoint_of(options).lower().startswith("http://") and "verify" not in client:
        # No TLS to this store: spare each client (each DataLoader worker makes one)
        # loading the CA bundle into an SSL context it never uses, about 20 ms of CPU.
        client["verify"] = False
        options["client_kwargs"] = client
    return options


def endpoint_of(options: Mapping[str, Any]) -> str:
    endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get(
        "endpoint_url"
    )
    return str(endpoint or "")


def missing_reason(protocol: str, root: str, err: OSError) -> str:
    if protocol == "s3":
        bucket = root.split("/", 1)[0]
        if "bucket" in str(err).lower():
            return (
                f"the bucket {bucket!r} does not exist at this endpoint; check the name, "
                "and endpoint_url= for a store other than AWS"
            )
    return f"it does not exist ({err})"


def nearby(fs: fsspec.AbstractFileSystem, root: str, to_url: Callable[[str], str]) -> str:
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

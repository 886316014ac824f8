"""Checkpoints at any fsspec URL: atomic writes, the last N kept, safe loads.

A checkpoint is one file ``<dir>/checkpoint-<step>.pt`` written with ``torch.save``. A
reader never sees a partial file: on a file system it is written under a temporary name and
renamed into place; on an object store (S3, GCS, Azure) it is uploaded to its final key,
where it appears only once the upload completes. Loads use
``torch.load(weights_only=True)``: tensors, dicts, lists, tuples, numbers and strings
round-trip; anything that would need arbitrary unpickling is refused.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import re
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.core import url_to_fs

from .errors import DaskDDPError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["CheckpointInfo", "UnsafeCheckpointError", "latest", "list_checkpoints", "write"]

_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")


class UnsafeCheckpointError(DaskDDPError, pickle.UnpicklingError):
    """A checkpoint holds objects that ``weights_only=True`` loading refuses.

    Examples
    --------
    >>> print(UnsafeCheckpointError("s3://b/run1/checkpoint-000000000010.pt", "MyConfig"))
    ... # doctest: +ELLIPSIS
    checkpoint s3://b/run1/checkpoint-000000000010.pt holds objects that safe loading ...
    """

    def __init__(self, url: str, cause: str) -> None:
        super().__init__(url, cause)
        self.url, self.cause = url, cause

    def __str__(self) -> str:
        return (
            f"checkpoint {self.url} holds objects that safe loading (weights_only=True) refuses: "
            f"{self.cause}. Save plain state (model.state_dict(), optimizer.state_dict(), "
            "numbers, strings, lists, dicts of tensors) with dask_ddp.save_checkpoint()."
        )


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint that has landed: where, which step, how many bytes, and when.

    Examples
    --------
    >>> job.checkpoints[-1]  # doctest: +SKIP
    CheckpointInfo(url='s3://bucket/run1/checkpoint-000000000100.pt', step=100, ...)
    """

    url: str
    step: int
    nbytes: int
    rank: int
    time: float


def _fs(directory: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    return url_to_fs(directory, **dict(storage_options or {}))


_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}


def _puts_are_atomic(fs: Any) -> bool:
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool(protocols & _OBJECT_STORES)


def _url(fs: Any, path: str) -> str:
    return fs.unstrip_protocol(path)


def list_checkpoints(
    directory: str, storage_options: Mapping[str, Any] | None = None
) -> list[tuple[int, str]]:
    """``(step, url)`` of every complete-looking checkpoint under ``directory``, by step."""
    fs, root = _fs(directory, storage_options)
    try:
        names = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    found = []
    for path in names:
        match = _NAME.match(path.rstrip("/").rsplit("/", 1)[-1])
        if match:
            found.append((int(match.group(1)), _url(fs, path)))
    return sorted(found)


def write(
    state: Any,
    directory: str,
    *,
    step: int,
    keep_last: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[str, int]:
    """Save ``state`` as ``checkpoint-<step>.pt`` under ``directory``; return (url, bytes).

    Older checkpoints beyond ``keep_last`` are deleted once the new one is in place.

    >>> import tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> url, n = write({"w": torch.ones(2)}, d, step=3)
    >>> url.endswith("checkpoint-000000000003.pt")
    True
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int; got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 or None; got {keep_last!r}")
    import torch  # imported where a checkpoint is written: the client never needs it

    fs, root = _fs(directory, storage_options)
    fs.makedirs(root, exist_ok=True)
    final = f"{root.rstrip('/')}/checkpoint-{step:012d}.pt"
    if _puts_are_atomic(fs):
        # An object store shows an object only once its upload completes (a multipart
        # upload cut short leaves nothing), so the final key is written directly: a copy
        # to it would cost a second full transfer.
        with fs.open(final, "wb") as f:
            torch.save(state, f)
        nbytes = fs.size(final)
    else:
        temp = f"{root.rstrip('/')}/.checkpoint-{step:012d}.{uuid.uuid4().hex}.partial"
        try:
            with fs.open(temp, "wb") as f:
                torch.save(state, f)
            nbytes = fs.size(temp)
            fs.mv(temp, final)  # a rename: atomic on a local or network file system
        except BaseException:
            if fs.exists(temp):
                fs.rm(temp)
            raise
    if keep_last is not None:
        for _, old in list_checkpoints(directory, storage_options)[:-keep_last]:
            fs.rm(old)
    return _url(fs, final), nbytes


def latest(
    directory: str,
    *,
    map_location: torch.device | str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[int, Any] | None:
    """``(step, state)`` of the newest checkpoint that loads, or None if there is none.

    A file that does not load (truncated, corrupt) is skipped with a warning and the one
    before it is tried. A file that needs arbitrary unpickling raises
    :class:`UnsafeCheckpointError` instead: that is a decision, not damage.
    """
    import torch

    for step, url in reversed(list_checkpoints(directory, storage_options)):
        try:
            with fsspec.open(url, "rb", **dict(storage_options or {})) as f:
                return step, torch.load(f, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            if "weights_only" in str(exc) or "Weights only load failed" in str(exc):
                raise UnsafeCheckpointError(url, str(exc).splitlines()[0]) from exc
            logger.warning("checkpoint %s does not load (%s); trying the one before", url, exc)
        except (RuntimeError, EOFError, OSError, ValueError) as exc:
            logger.warning("checkpoint %s does not load (%s); trying the one before", url, exc)
    return None

"""Checkpoints at any fsspec URL: atomic writes, the last N kept, safe loads.

A checkpoint of the job's state (rank 0's, as DDP keeps every rank's model identical) is one
file ``<dir>/checkpoint-<step>.pt`` written with ``torch.save``. A checkpoint of per-rank
state (FSDP-style shards) is one file per rank, ``checkpoint-<step>.rank-<r>-of-<n>.pt``,
and counts only once all ``n`` are there. A reader never sees a partial file: on a file
system it is written under a temporary name and renamed into place; on an object store
(S3, GCS, Azure) it is uploaded to its final key, where it appears only once the upload
completes, and an upload that fails or is given up is aborted, never completed. Loads use
``torch.load(weights_only=True)``: tensors, dicts, lists, tuples, numbers and strings
round-trip; anything that would need arbitrary unpickling is refused.

:class:`PendingCheckpoint` is what an asynchronous save returns on the rank
(:mod:`dask_ddp._rank.saving` writes it in the background).
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.core import url_to_fs

from .._shared.values import CheckpointInfo
from ..errors import CheckpointShardsError, UnsafeCheckpointError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointInfo",
    "PendingCheckpoint",
    "UnsafeCheckpointError",
    "latest",
    "latest_shard",
    "list_checkpoints",
    "list_shards",
    "write",
    "write_bytes",
]

_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")
_SHARD = re.compile(r"^checkpoint-(\d+)\.rank-(\d+)-of-(\d+)\.pt$")


class PendingCheckpoint:
    """A checkpoint on its way to storage: what an asynchronous ``save_checkpoint()``
    returns once the state is copied off the live tensors.

    It becomes durable (and visible to :func:`dask_ddp.get_checkpoint`,
    ``Job.checkpoints`` and ``keep_last``) in the background, after every checkpoint saved
    before it, and is then kept in another worker's memory too. There is no need to wait
    for it: the next ``save_checkpoint()`` and the end of the training function raise if
    it failed.

    Attributes
    ----------
    step : int
        Its step.
    url : str
        Where it will be once durable.
    stall : float
        Seconds ``save_checkpoint()`` took for it on the training path.

    Examples
    --------
    >>> pending = dask_ddp.save_checkpoint(state, step=100)   # doctest: +SKIP
    >>> pending.wait(timeout=60).nbytes                          # doctest: +SKIP
    104857871
    """

    def __init__(self, step: int, url: str, stall: float = 0.0) -> None:
        self.step, self.url, self.stall = step, url, stall
        self._done = threading.Event()
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None
        self.error_seen = False  # the error reached the user (wait() raised it)

    def done(self) -> bool:
        """Whether its save is over: durable (and replicated, with replicas on), or failed."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Wait until its save is over (durable, and kept in the replica holder's memory
        when replicas are on) and return where it landed.

        Raises
        ------
        CheckpointUploadError
            Writing it failed (then the next save does not raise it again).
        TimeoutError
            It is still on its way after ``timeout`` seconds.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"the checkpoint of step {self.step} is still on its way to {self.url} "
                f"after {timeout} s"
            )
        if self._error is not None:
            self.error_seen = True
            raise self._error
        assert self._info is not None
        return self._info

    @property
    def error(self) -> BaseException | None:
        """Why writing it failed, once it did."""
        return self._error

    @property
    def info(self) -> CheckpointInfo | None:
        """Where it landed, once it is durable (before :meth:`done`, with a replica to keep)."""
        return self._info

    def landed(self, info: CheckpointInfo) -> None:
        """It is durable (called by the writer)."""
        self._info = info

    def settled(self) -> None:
        """Its save is over (called by the writer, after :meth:`landed`)."""
        self._done.set()

    def failed(self, error: BaseException) -> None:
        """Writing it failed (called by the writer)."""
        self._error = error
        self._done.set()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "durable")
        return f"PendingCheckpoint(step={self.step}, url={self.url!r}, {state})"


def _fs(directory: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    return url_to_fs(directory, **dict(storage_options or {}))


_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}


def _puts_are_atomic(fs: Any) -> bool:
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool(protocols & _OBJECT_STORES)


def _url(fs: Any, path: str) -> str:
    return fs.unstrip_protocol(path)


def file_name(step: int, rank: int | None = None, world_size: int | None = None) -> str:
    """The name of a checkpoint's file: the job's state, or one rank's own.

    >>> file_name(40), file_name(40, rank=1, world_size=4)
    ('checkpoint-000000000040.pt', 'checkpoint-000000000040.rank-00001-of-00004.pt')
    """
    if world_size is None:
        return f"checkpoint-{step:012d}.pt"
    return f"checkpoint-{step:012d}.rank-{rank:05d}-of-{world_size:05d}.pt"


def url_of(
    directory: str,
    step: int,
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """The URL a checkpoint has (or will have) under ``directory``.

    >>> url_of("/ckpt", 3).endswith("/ckpt/checkpoint-000000000003.pt")
    True
    """
    fs, root = _fs(directory, storage_options)
    return _url(fs, f"{root.rstrip('/')}/{file_name(step, rank, world_size)}")


def _names(directory: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, list[str]]:
    fs, root = _fs(directory, storage_options)
    fs.invalidate_cache(root)  # s3fs caches listings, and other processes write here
    try:
        return fs, fs.ls(root, detail=False)
    except FileNotFoundError:
        return fs, []


def list_checkpoints(
    directory: str, storage_options: Mapping[str, Any] | None = None
) -> list[tuple[int, str]]:
    """``(step, url)`` of every complete-looking checkpoint of the job's state under
    ``directory``, by step."""
    fs, names = _names(directory, storage_options)
    found = []
    for path in names:
        match = _NAME.match(path.rstrip("/").rsplit("/", 1)[-1])
        if match:
            found.append((int(match.group(1)), _url(fs, path)))
    return sorted(found)


def list_shards(
    directory: str, storage_options: Mapping[str, Any] | None = None
) -> list[tuple[int, int, dict[int, str]]]:
    """``(step, world_size, {rank: url})`` of every per-rank checkpoint under
    ``directory``, by step; complete when it has ``world_size`` files."""
    fs, names = _names(directory, storage_options)
    sets: dict[tuple[int, int], dict[int, str]] = {}
    for path in names:
        match = _SHARD.match(path.rstrip("/").rsplit("/", 1)[-1])
        if match:
            step, rank, world = (int(g) for g in match.groups())
            sets.setdefault((step, world), {})[rank] = _url(fs, path)
    return [(step, world, files) for (step, world), files in sorted(sets.items())]


def complete_shards(
    directory: str, storage_options: Mapping[str, Any] | None = None
) -> list[tuple[int, int, dict[int, str]]]:
    """The per-rank checkpoints under ``directory`` that every rank has written, by step."""
    return [s for s in list_shards(directory, storage_options) if len(s[2]) == s[1]]


def _abandon(f: Any, path: str) -> None:
    """Give up a file being written to an object store without ever completing it.

    fsspec's files complete their upload when closed, from ``__exit__`` and from
    ``__del__`` too, whatever went wrong: a checkpoint cut short would then appear whole.
    ``discard()`` aborts the multipart upload (s3fs), and a file marked closed is never
    completed afterwards.
    """
    try:
        f.discard()
    except Exception as exc:  # an incomplete upload stays invisible all the same
        logger.debug("could not abort the partial upload of %s: %s", path, exc)
    f.closed = True


@contextlib.contextmanager
def _atomic_file(fs: Any, final: str) -> Iterator[Any]:
    """A file open for writing whose content appears at ``final`` whole, or not at all."""
    if _puts_are_atomic(fs):
        # An object store shows an object only once its upload completes (a multipart
        # upload cut short leaves nothing), so the final key is written directly: a copy
        # to it would cost a second full transfer.
        f = fs.open(final, "wb")
        try:
            yield f
        except BaseException:
            _abandon(f, final)
            raise
        f.close()
        return
    root, _, name = final.rpartition("/")
    temp = f"{root}/.{name.removesuffix('.pt')}.{uuid.uuid4().hex}.partial"
    try:
        with fs.open(temp, "wb") as f:
            yield f
        fs.mv(temp, final)  # a rename: atomic on a local or network file system
    except BaseException:
        if fs.exists(temp):
            fs.rm(temp)
        raise


def _check_step(step: Any, keep_last: int | None) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int; got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 or None; got {keep_last!r}")


def write(
    state: Any,
    directory: str,
    *,
    step: int,
    keep_last: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> tuple[str, int]:
    """Save ``state`` as ``checkpoint-<step>.pt`` under ``directory`` (or as rank
    ``rank``'s own file of per-rank state saved by ``world_size`` ranks); return (url,
    bytes).

    Older checkpoints beyond ``keep_last`` are deleted once the new one is in place.

    >>> import tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> url, n = write({"w": torch.ones(2)}, d, step=3)
    >>> url.endswith("checkpoint-000000000003.pt")
    True
    """
    _check_step(step, keep_last)
    import torch  # imported where a checkpoint is written: the client never needs it

    fs, root = _fs(directory, storage_options)
    fs.makedirs(root, exist_ok=True)
    final = f"{root.rstrip('/')}/{file_name(step, rank, world_size)}"
    with _atomic_file(fs, final) as f:
        torch.save(state, f)
    nbytes = fs.size(final)
    if keep_last is not None and world_size is None:
        prune(directory, keep_last, storage_options)
    elif keep_last is not None:
        prune_shards(directory, keep_last, storage_options)
    return _url(fs, final), nbytes


def write_bytes(
    data: bytes | memoryview,
    directory: str,
    *,
    step: int,
    rank: int | None = None,
    world_size: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    check: Callable[[], None] | None = None,
    chunk: int = 16 * 2**20,
    makedirs: bool = True,
) -> tuple[str, int]:
    """Write a serialised checkpoint (``torch.save``'s bytes) atomically; return (url, bytes).

    ``check`` is called before each ``chunk`` bytes: what it raises gives the write up,
    and nothing of it is visible. ``makedirs=False`` skips making ``directory`` (a round
    trip on an object store), once a write there made it.

    >>> import tempfile
    >>> url, n = write_bytes(b"abc", tempfile.mkdtemp(), step=2, rank=0, world_size=2)
    >>> url.rsplit("/", 1)[-1], n
    ('checkpoint-000000000002.rank-00000-of-00002.pt', 3)
    """
    _check_step(step, None)
    fs, root = _fs(directory, storage_options)
    if makedirs:
        fs.makedirs(root, exist_ok=True)
    final = f"{root.rstrip('/')}/{file_name(step, rank, world_size)}"
    view = memoryview(data).cast("B")
    with _atomic_file(fs, final) as f:
        for start in range(0, max(len(view), 1), chunk):
            if check is not None:
                check()
            f.write(view[start : start + chunk])
    return _url(fs, final), len(view)


def prune(
    directory: str, keep_last: int, storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """Delete the job-state checkpoints older than the newest ``keep_last``; return them.

    Call it once the newest is in place: it never deletes that one.
    """
    fs, _ = _fs(directory, storage_options)
    old = [url for _, url in list_checkpoints(directory, storage_options)[:-keep_last]]
    for url in old:
        with contextlib.suppress(FileNotFoundError):  # another rank or run deleted it
            fs.rm(url)
    return old


def prune_shards(
    directory: str, keep_last: int, storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """Delete every per-rank file older than the newest ``keep_last`` complete per-rank
    checkpoints (complete or not); return them. Any rank may call it at any time: what it
    deletes is never needed, as ``keep_last`` complete checkpoints stay."""
    complete = complete_shards(directory, storage_options)
    if len(complete) <= keep_last:
        return []
    cutoff = complete[-keep_last][0]
    fs, _ = _fs(directory, storage_options)
    old = [
        url
        for step, _, files in list_shards(directory, storage_options)
        if step < cutoff
        for url in files.values()
    ]
    for url in old:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(url)
    return old


def load(source: Any, url: str, *, map_location: torch.device | str | None = None) -> Any:
    """``torch.load(source, weights_only=True)``: a file object, ``torch.save``'s bytes (a
    replica held in a peer's memory), or those bytes in a ``torch.uint8`` tensor the caller
    gives away (a replica fetched from a peer), from ``url``.

    Loaded from such a tensor, the state's tensors on the CPU are views of it, as
    ``torch.load(path, mmap=True)``'s are of the file: nothing is copied, and the buffer
    lives as long as any of them.

    Raises
    ------
    UnsafeCheckpointError
        It holds objects that only arbitrary unpickling could rebuild.
    """
    import torch

    if isinstance(source, torch.Tensor):
        state = _load_in_place(source, map_location)
        if state is not _NOT_IN_PLACE:
            return state
        source = source.numpy()  # torch.load copies it into storages of its own
    if not hasattr(source, "read"):
        source = _BytesReader(source)
    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights_only" in str(exc) or "Weights only load failed" in str(exc):
            raise UnsafeCheckpointError(url, str(exc).splitlines()[0]) from exc
        raise


_NOT_IN_PLACE = object()


def _load_in_place(buffer: torch.Tensor, map_location: Any) -> Any:
    """``torch.load``'s own ``mmap=True`` path with ``buffer`` in place of the mapped file:
    each storage is a slice of ``buffer``'s. :data:`_NOT_IN_PLACE` where that path is not
    there (a torch that moved it) or the bytes do not load through it; :func:`load` then
    takes the public path, which copies, and raises what it raises.

    Private: ``torch.serialization._open_zipfile_reader`` and ``_load`` (its
    ``overall_storage`` argument), and ``torch._weights_only_unpickler``, as in torch 2.14;
    ``tests/test_checkpoint.py`` checks that the storages are shared with this torch.
    """
    try:
        from torch import _weights_only_unpickler, serialization

        reader = _BytesReader(buffer.numpy())
        with serialization._open_zipfile_reader(reader) as archive:
            return serialization._load(
                archive,
                map_location,
                _weights_only_unpickler,
                overall_storage=buffer.untyped_storage(),
                weights_only=True,
            )
    except Exception as exc:  # the public path says what is wrong
        logger.debug("a replica does not load in place (%s); copying it", exc)
        return _NOT_IN_PLACE


class _BytesReader(io.RawIOBase):
    """A seekable reader over bytes in memory that copies nothing up front (``io.BytesIO``
    copies a memoryview or bytearray whole): ``torch.load`` reads each tensor's bytes
    straight into its storage (``readinto``), so a 1 GB replica is not held twice.

    >>> r = _BytesReader(memoryview(b"abcdef")[1:])
    >>> r.read(2), r.seek(-1, io.SEEK_END), r.read(), r.tell()
    (b'bc', 4, b'f', 5)
    """

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        import numpy

        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        # numpy copies without the GIL (a memoryview slice assignment holds it for the
        # whole copy: 10-13 ms per 64 MB, while the worker's event loop serves a peer)
        numpy.copyto(
            numpy.frombuffer(out, numpy.uint8, n),
            numpy.frombuffer(self._view, numpy.uint8, n, self._pos),
        )
        self._pos += n
        return n


def _first_loadable(
    candidates: list[tuple[int, str]],
    map_location: torch.device | str | None,
    storage_options: Mapping[str, Any] | None,
) -> tuple[int, Any] | None:
    for step, url in reversed(candidates):
        try:
            with fsspec.open(url, "rb", **dict(storage_options or {})) as f:
                return step, load(f, url, map_location=map_location)
        except UnsafeCheckpointError:
            raise  # a decision, not damage
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:
            logger.warning("checkpoint %s does not load (%s); trying the one before", url, exc)
    return None


def latest(
    directory: str,
    *,
    map_location: torch.device | str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[int, Any] | None:
    """``(step, state)`` of the newest checkpoint of the job's state that loads, or None
    if there is none.

    A file that does not load (truncated, corrupt) is skipped with a warning and the one
    before it is tried. A file that needs arbitrary unpickling raises
    :class:`UnsafeCheckpointError` instead: that is a decision, not damage.
    """
    return _first_loadable(
        list_checkpoints(directory, storage_options), map_location, storage_options
    )


def latest_shard(
    directory: str,
    rank: int,
    world_size: int | None,
    *,
    map_location: torch.device | str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[int, Any] | None:
    """``(step, state)`` of rank ``rank``'s own file in the newest complete per-rank
    checkpoint (written by ``world_size`` ranks; any number with None), or None.

    Raises
    ------
    CheckpointShardsError
        The newest complete one was written by another number of ranks than ``world_size``.
    """
    complete = complete_shards(directory, storage_options)
    if world_size is not None and complete and complete[-1][1] != world_size:
        step, world, _ = complete[-1]
        raise CheckpointShardsError(directory, step, world, world_size)
    candidates = [
        (step, files[rank])
        for step, world, files in complete
        if world_size in (None, world) and rank in files
    ]
    return _first_loadable(candidates, map_location, storage_options)

"""Checkpoints saved off the training path: staged in CPU memory, written in the background.

An asynchronous :func:`dask_ddp.save_checkpoint` does one thing on the training path: it
copies the state off the live tensors (:class:`Stager`: every tensor's storage into CPU
memory, pinned when it comes from a GPU, into buffers reused from the save before), so no
later optimizer step can change what is saved. Then :class:`Saver`'s thread serialises the
copy (``torch.save``), writes it atomically (:func:`dask_ddp._rank.checkpoint.write_bytes`),
prunes ``keep_last``, tells the job (a ``CHECKPOINT`` event: ``Job.checkpoints``), and sends
the same bytes to the rank's replica holder (:mod:`dask_ddp._rank.replicas`, then a ``REPLICA``
event for the supervisor).

What it guarantees, and how:

- Order: one thread writes, one checkpoint at a time, in the order they were saved; a
  checkpoint is visible (listed, loaded, counted by ``keep_last``) only once it is durable.
- Bounded memory: at most one checkpoint in flight and one staged, and never more than two
  copies of the state in CPU memory (a copy, and the bytes of the one in flight). A save
  that finds both, or finds the one in flight still being serialised, waits; that wait
  counts as the save's stall
  (:attr:`CheckpointInfo.stall <dask_ddp._rank.checkpoint.CheckpointInfo.stall>`).
- Failures are not lost: a write that fails is raised on the rank at its next save, or when
  its function ends (:meth:`Saver.finish`), as
  :class:`~dask_ddp.errors.CheckpointUploadError` naming the URL and the step.
- The end of the function waits for the last write (:meth:`Saver.finish`); a rank that
  stops on an error gives up what is not written yet (:meth:`Saver.stop`): a write in
  progress is abandoned and never becomes visible.
- A state whose copy would not fit the worker's memory limit is saved synchronously, with
  one warning.
- No save waits for pinned memory to be allocated (0.46 s per GB on an H100): a save whose
  GPU tensors have no kept buffers yet (the first) copies them on the GPU itself when it
  has room, and the writer moves that copy into pinned buffers, kept for the next save.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import io
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._shared.protocol import CHECKPOINT, REPLICA
from ..errors import CheckpointUploadError
from . import checkpoint
from .replicas import HEADROOM, PeerLink
from .slot import CheckpointSettings

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["Saver", "Staged", "Stager"]

_POLL = 0.1  # seconds between two looks while the rank waits: an abort gets through
_STOP_WAIT = 60.0  # seconds stop() waits for a write it gave up to unwind
_IMMUTABLE = (str, bytes, int, float, complex, bool, type(None), range)


_GPU_MARGIN = 0.1  # of a GPU's memory, left free by a copy staged on it


@dataclasses.dataclass
class Staged:
    """A state copied off the live tensors: the same structure, its own storages.

    ``on_device`` holds the copies made on the tensors' own devices (a first save's GPU
    tensors): :meth:`Stager.move` brings them into CPU buffers before serialising.
    """

    tree: Any
    buffers: list[Any]  # the CPU buffers holding copied storages, kept for the next copy
    nbytes: int
    on_device: list[Any] = dataclasses.field(default_factory=list)


def room_on_gpu(device: torch.device, nbytes: int) -> bool:
    """Whether a CUDA device can hold ``nbytes`` more for a moment without taking memory
    its training needs: beyond the most torch ever reserved there, a tenth of the GPU is
    still free. Other devices: no.

    >>> import torch
    >>> room_on_gpu(torch.device("cpu"), 1)
    False
    """
    import torch

    if device.type != "cuda":
        return False
    free, total = torch.cuda.mem_get_info(device)
    # Memory torch reserved at its peak and gave back may be asked for again by training.
    peak = torch.cuda.max_memory_reserved(device) - torch.cuda.memory_reserved(device)
    return nbytes + _GPU_MARGIN * total <= free - peak


@dataclasses.dataclass
class _Copy:
    """One copy of a state under way: what is copied already, and into what."""

    on_devices: set[Any]  # devices whose tensors are copied on the device itself
    memo: dict[int, Any] = dataclasses.field(default_factory=dict)
    storages: dict[tuple[Any, int], Any] = dataclasses.field(default_factory=dict)
    buffers: list[Any] = dataclasses.field(default_factory=list)
    on_device: list[Any] = dataclasses.field(default_factory=list)
    gpus: set[Any] = dataclasses.field(default_factory=set)  # copies issued asynchronously


class Stager:
    """Copies states into CPU memory, reusing the buffers of the copy before.

    A checkpoint's state has the same tensors every time, so after the first save each
    storage is copied into a buffer that already exists (no allocation, no page faults).
    Storages shared by several tensors (tied weights, views) are copied once, and the
    copies share them as the originals did, as ``torch.save`` would have seen them.

    Buffers for GPU tensors are pinned, and pinning is slow (0.46 s per GB on an H100). A
    device whose tensors are not all covered by kept buffers (the first save) has them
    copied on the device itself when ``device_first(device, nbytes)`` says it has room
    (default :func:`room_on_gpu`); :meth:`move`, on the writer's thread, then copies them
    into kept or new buffers, off the training path.

    Examples
    --------
    >>> import torch
    >>> w = torch.ones(3)
    >>> stager = Stager()
    >>> staged = stager.stage({"w": w, "view": w[1:], "step": 3})
    >>> w.add_(1); staged.tree["w"].tolist(), staged.tree["view"].tolist()
    tensor([2., 2., 2.])
    ([1.0, 1.0, 1.0], [1.0, 1.0])
    >>> staged.tree["view"].untyped_storage().data_ptr() == staged.tree["w"].data_ptr()
    True
    """

    def __init__(self, device_first: Callable[[torch.device, int], bool] | None = None) -> None:
        self._free: dict[tuple[int, bool], list[Any]] = {}
        self._device_first = room_on_gpu if device_first is None else device_first

    @property
    def free_bytes(self) -> int:
        """Bytes of buffers kept for the next copy."""
        return sum(size * len(bufs) for (size, _), bufs in self._free.items())

    def size(self, state: Any) -> int:
        """Bytes a copy of ``state`` takes (its tensors' storages, each once)."""
        seen: dict[tuple[Any, int], int] = {}
        _walk_tensors(state, lambda t: seen.setdefault(_storage_key(t), _storage_bytes(t)))
        return sum(seen.values())

    def stage(self, state: Any) -> Staged:
        """A copy of ``state`` that nothing done to ``state`` later changes; returns once
        every byte is copied (GPU copies included)."""
        import torch

        c = _Copy(self._devices_first(state))
        tree = self._copy(state, c)
        for device in c.gpus:  # the copies from a GPU were issued asynchronously
            torch.cuda.synchronize(device)
        nbytes = sum(b.numel() for b in (*c.buffers, *c.on_device))
        return Staged(tree, c.buffers, nbytes, c.on_device)

    def move(self, staged: Staged) -> Staged:
        """``staged`` with its copies on devices brought into CPU buffers (kept ones, else
        new pinned ones) on streams of their own; the device copies are let go.

        Runs on the writer's thread while the rank trains: the training thread stages
        nothing meanwhile (the save after waits until this one is serialised).
        """
        import torch

        c = _Copy(set(), buffers=list(staged.buffers))
        moving = {(b.device, b.untyped_storage().data_ptr()) for b in staged.on_device}

        def keep(t: Any) -> None:  # copied already: stays as it is
            if not _is_plain(t) or _storage_key(t) not in moving:
                c.memo[id(t)] = t

        _walk_tensors(staged.tree, keep)
        with contextlib.ExitStack() as streams:
            for device in {b.device for b in staged.on_device if b.device.type == "cuda"}:
                streams.enter_context(torch.cuda.stream(torch.cuda.Stream(device)))
            tree = self._copy(staged.tree, c)
            for device in c.gpus:  # this thread's streams only: the training goes on
                torch.cuda.current_stream(device).synchronize()
        staged.tree, staged.buffers, staged.on_device = None, [], []
        return Staged(tree, c.buffers, sum(b.numel() for b in c.buffers))

    def release(self, staged: Staged, *, keep: bool) -> None:
        """``staged`` was serialised: keep its buffers for the next copy, or let them go."""
        self._free = {}
        if keep:
            for buf in staged.buffers:
                self._free.setdefault((buf.numel(), buf.is_pinned()), []).append(buf)
        staged.buffers = []

    def clear(self) -> None:
        """Let every kept buffer go."""
        self._free = {}

    def _devices_first(self, state: Any) -> set[torch.device]:
        """The devices whose tensors to copy on the device itself: some of their storages
        have no kept buffer of their size, and the device has room for all of them."""
        sizes: dict[torch.device, list[int]] = {}
        seen: set[tuple[Any, int]] = set()

        def visit(t: Any) -> None:
            key = _storage_key(t)
            if _is_plain(t) and key not in seen:
                seen.add(key)
                sizes.setdefault(t.device, []).append(_storage_bytes(t))

        _walk_tensors(state, visit)
        kept = collections.Counter({key: len(bufs) for key, bufs in self._free.items()})
        return {
            device
            for device, ns in sizes.items()
            if collections.Counter((n, device.type == "cuda") for n in ns) - kept
            and self._device_first(device, sum(ns))
        }

    def _take(self, nbytes: int, pin: bool) -> Any:
        import torch

        free = self._free.get((nbytes, pin))
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def _copy(self, obj: Any, c: _Copy) -> Any:
        import torch

        if isinstance(obj, (*_IMMUTABLE, torch.dtype, torch.device)):
            return obj
        found = c.memo.get(id(obj))
        if found is not None:
            return found
        if isinstance(obj, torch.Tensor):
            out = self._tensor(obj, c)
        elif isinstance(obj, dict):
            # copy.copy keeps the mapping's type and its attributes (a state_dict's
            # OrderedDict and its _metadata); a plain dict is rebuilt directly.
            out = {} if type(obj) is dict else copy.copy(obj)
            c.memo[id(obj)] = out
            if getattr(obj, "__dict__", None):
                out.__dict__ = copy.deepcopy(obj.__dict__)
            for key, value in obj.items():
                out[key] = self._copy(value, c)
            return out
        elif type(obj) is list:
            out = []
            c.memo[id(obj)] = out
            out.extend(self._copy(v, c) for v in obj)
            return out
        elif isinstance(obj, tuple) and not isinstance(obj, torch.Size):
            items = [self._copy(v, c) for v in obj]
            out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        else:  # anything else that could change in place: numpy arrays, objects
            out = copy.deepcopy(obj)
        c.memo[id(obj)] = out
        return out

    def _tensor(self, t: Any, c: _Copy) -> Any:
        import torch

        if not _is_plain(t):
            # A subclass (DTensor), a sparse or quantized tensor: torch's own copy, on its
            # device (torch.save writes it as it would the original).
            return t.detach().clone()
        key = _storage_key(t)
        buf = c.storages.get(key)
        if buf is None:
            storage = t.untyped_storage()
            gpu = t.device.type == "cuda"
            if t.device in c.on_devices:  # a buffer on the tensor's own device, not kept
                buf = torch.empty(storage.nbytes(), dtype=torch.uint8, device=t.device)
                c.on_device.append(buf)
            else:
                buf = self._take(storage.nbytes(), gpu)
                c.buffers.append(buf)
            source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            buf.copy_(source, non_blocking=gpu)
            if gpu:
                c.gpus.add(t.device)
            c.storages[key] = buf
        out = torch.empty(0, dtype=t.dtype, device=buf.device).set_(
            buf.untyped_storage(), t.storage_offset(), t.size(), t.stride()
        )
        if isinstance(t, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
        return out


def _is_plain(t: Any) -> bool:
    import torch

    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and not t.is_quantized
        and t.device.type != "meta"
        and not t.is_conj()
        and not t.is_neg()
    )


def _storage_key(t: Any) -> tuple[Any, int]:
    if not _is_plain(t):
        return (id(t), 0)
    return (t.device, t.untyped_storage().data_ptr())


def _storage_bytes(t: Any) -> int:
    if not _is_plain(t):
        return t.element_size() * t.numel()
    return t.untyped_storage().nbytes()


def _walk_tensors(obj: Any, visit: Callable[[Any], Any], seen: set[int] | None = None) -> None:
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, _IMMUTABLE):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        visit(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _walk_tensors(value, visit, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _walk_tensors(value, visit, seen)


class _Stopped(Exception):
    """The rank stopped: a write in progress is given up."""


@dataclasses.dataclass
class _Write:
    """One checkpoint on its way: staged, then in flight, then durable or failed."""

    step: int
    world_size: int | None  # per-rank state: the ranks that each write their own
    staged: Staged
    pending: checkpoint.PendingCheckpoint
    serialised: bool = False  # its copy became bytes and was let go (or kept for the next)


class Saver:
    """Saves one rank's checkpoints, asynchronously or not, for one run of its function.

    Parameters
    ----------
    settings : CheckpointSettings
        Where checkpoints go, ``keep_last``, the mode, the replica holder.
    rank, world_size : int
        The rank saving, and how many ranks the job has.
    announce : callable
        ``announce(kind, body)`` tells the job (the rank's channel's ``put``).
    peer : PeerLink, optional
        The way to the replica stores (None: no replicas).
    memory : callable, optional
        Returns ``(bytes this process uses, its worker's memory limit)``; None: no check.
    status : callable, optional
        Says what the rank waits for (the live view's activity).
    device_first : callable, optional
        ``device_first(device, nbytes)``: whether a save without kept buffers may be
        staged on its tensors' device (default :func:`room_on_gpu`).

    Examples
    --------
    >>> import tempfile, torch
    >>> saver = Saver(CheckpointSettings(tempfile.mkdtemp()), rank=0, world_size=1,
    ...               announce=lambda kind, body: None)
    >>> w = torch.zeros(2)
    >>> pending = saver.save({"w": w}, step=1)
    >>> w.add_(1)   # the next step changes the live tensor, not what is saved
    tensor([1., 1.])
    >>> saver.finish(); pending.wait().step
    1
    """

    def __init__(
        self,
        settings: CheckpointSettings,
        *,
        rank: int,
        world_size: int,
        announce: Callable[[str, list[Any]], None],
        peer: PeerLink | None = None,
        memory: Callable[[], tuple[int, int]] | None = None,
        status: Callable[[str], None] | None = None,
        device_first: Callable[[torch.device, int], bool] | None = None,
    ) -> None:
        self.settings, self.rank, self.world_size = settings, rank, world_size
        self._announce, self._peer, self._memory = announce, peer, memory
        self._status = status or (lambda text: None)
        self.stager = Stager(device_first)
        self._cond = threading.Condition()
        self._staged: _Write | None = None
        self._inflight: _Write | None = None
        self._failed: list[checkpoint.PendingCheckpoint] = []
        self._closing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._durable: int | None = None  # the step of the newest checkpoint written
        self._warned_memory = False
        self._replica_said = False
        # A holder that did not answer (it left the cluster): no more puts to it in this
        # attempt, each of which would hold the next save for the connection's timeout.
        self._unreachable: set[str] = set()

    # -- the training path -------------------------------------------------------------
    def save(
        self, state: Any, step: int, *, per_rank: bool = False
    ) -> checkpoint.CheckpointInfo | checkpoint.PendingCheckpoint:
        """Save ``state`` as the checkpoint of ``step``: asynchronously (returns a
        :class:`~dask_ddp._rank.checkpoint.PendingCheckpoint` once it is staged) or, in ``sync``
        mode or when its copy would not fit in memory, synchronously (returns the
        :class:`~dask_ddp._rank.checkpoint.CheckpointInfo` once it is durable).

        Raises
        ------
        CheckpointUploadError
            An earlier checkpoint of this rank could not be written.
        """
        start = time.perf_counter()
        self._raise_failure()
        world = self.world_size if per_rank else None
        if self.settings.mode == "sync" or not self._fits(state, step):
            self._drain(step)  # what is on its way lands first: visibility in step order
            self._raise_failure()
            return self._save_now(state, step, world, start)
        self._wait_for_room(step)
        self._raise_failure()
        staged = self.stager.stage(state)
        url = checkpoint.url_of(
            self.settings.directory, step, self._writer(world), world, self.settings.storage_options
        )
        pending = checkpoint.PendingCheckpoint(step, url, time.perf_counter() - start)
        with self._cond:
            self._staged = _Write(step, world, staged, pending)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"dask-ddp-checkpoints-rank-{self.rank}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        where = " (partly on its devices)" if staged.on_device else ""
        logger.debug("rank %d: checkpoint of step %d staged in %.3f s%s", self.rank, step,
                     pending.stall, where)  # fmt: skip
        return pending

    def flush(self) -> None:
        """Wait until every checkpoint saved so far is durable; raise the first failure."""
        self._drain(None)
        self._raise_failure()

    def finish(self) -> None:
        """The function returned: wait until every checkpoint is durable, then raise the
        first failure not raised yet (:class:`~dask_ddp.errors.CheckpointUploadError`)."""
        self._drain(None)
        self._close()
        self._raise_failure()

    def stop(self) -> None:
        """The rank stops on an error: give up the checkpoint staged and the one in flight
        (nothing of them becomes visible), and wait for the writer to let go."""
        self._stop.set()
        with self._cond:
            if self._staged is not None:
                self._staged.pending.failed(_Stopped("the rank stopped before it was written"))
                self._staged = None
            self._cond.notify_all()
        self._close()

    def _close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(_STOP_WAIT)
            if self._thread.is_alive():
                logger.warning(
                    "rank %d: a checkpoint write did not give up within %.0f s; it goes on "
                    "in the background", self.rank, _STOP_WAIT,
                )  # fmt: skip
        self.stager.clear()

    def _writer(self, world: int | None) -> int | None:
        return self.rank if world is not None else None

    def _fits(self, state: Any, step: int) -> bool:
        """Whether a copy of ``state`` fits in this worker's memory; warns once if not."""
        if self._memory is None:
            return True
        used, limit = self._memory()
        need = max(0, self.stager.size(state) - self.stager.free_bytes)
        if used + need <= HEADROOM * limit:
            return True
        if not self._warned_memory:
            self._warned_memory = True
            logger.warning(
                "rank %d: copying the checkpoint of step %d (%d MB) would take this worker "
                "past %.0f%% of its memory limit (%d of %d MB in use); saving it "
                "synchronously instead, as every checkpoint that does not fit (raise the "
                "worker's memory limit, or launch with checkpoint_mode='sync' to silence this)",
                self.rank, step, need >> 20, HEADROOM * 100, used >> 20, limit >> 20,
            )  # fmt: skip
        return False

    def _full(self) -> bool:
        """Whether a new copy would be a third copy of the state in memory: one is staged,
        or the one in flight is still being serialised (its copy and its bytes both held).
        Call with ``_cond`` held."""
        inflight = self._inflight
        return self._staged is not None or (inflight is not None and not inflight.serialised)

    def _wait_for_room(self, step: int) -> None:
        """Wait while one checkpoint is in flight and another staged, or the one in flight
        is still being serialised: at most two copies of the state are held at once."""
        with self._cond:
            if not self._full():
                return
            waiting = (self._staged or self._inflight).step
        self._status(f"waiting for the checkpoint of step {waiting} to be written")
        with self._cond:
            while self._full():
                self._cond.wait(_POLL)
        self._status("")
        logger.info(
            "rank %d: the checkpoint of step %d waited for the one of step %d to be written",
            self.rank, step, waiting,
        )  # fmt: skip

    def _drain(self, step: int | None) -> None:
        """Wait until nothing is staged or in flight."""
        with self._cond:
            if self._staged is None and self._inflight is None:
                return
        self._status("waiting for the last checkpoint to be written")
        with self._cond:
            while self._staged is not None or self._inflight is not None:
                self._cond.wait(_POLL)
        self._status("")

    def _raise_failure(self) -> None:
        with self._cond:
            failed = [p for p in self._failed if not p.error_seen]
            self._failed = []
        if failed:
            try:
                failed[0].wait(0)
            finally:
                for other in failed[1:]:
                    logger.warning("rank %d: %s", self.rank, other.error)

    def _save_now(
        self, state: Any, step: int, world: int | None, start: float
    ) -> checkpoint.CheckpointInfo:
        """A synchronous save (today's path): written and pruned before it returns."""
        settings = self.settings
        url, nbytes = checkpoint.write(
            state,
            settings.directory,
            step=step,
            keep_last=settings.keep_last,
            storage_options=settings.storage_options,
            rank=self._writer(world),
            world_size=world,
        )
        self._durable = step
        info = checkpoint.CheckpointInfo(
            url, step, nbytes, self.rank, time.time(), time.perf_counter() - start, world
        )
        self._tell(info)
        return info

    # -- the writer thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._staged is None and not self._closing:
                    self._cond.wait()
                if self._staged is None:
                    return
                write = self._inflight = self._staged
                self._staged = None
                self._cond.notify_all()
            try:
                self._write(write)
            except _Stopped as exc:
                write.pending.failed(exc)
            except Exception as exc:  # raised in the rank's thread at its next save
                error = CheckpointUploadError(
                    self.rank, write.step, write.pending.url,
                    f"{type(exc).__name__}: {exc}", self._latest(write.world_size),
                )  # fmt: skip
                error.__cause__ = exc
                logger.warning("%s", error)
                write.pending.failed(error)
                with self._cond:
                    self._failed.append(write.pending)
            finally:
                with self._cond:
                    self._inflight = None
                    self._cond.notify_all()

    def _latest(self, world: int | None) -> int | None:
        """The newest durable checkpoint's step, for a failure's message: what the store
        lists (it may hold some from before this run), else the last this rank wrote."""
        settings = self.settings
        try:
            if world is None:
                steps = [s for s, _ in checkpoint.list_checkpoints(
                    settings.directory, settings.storage_options
                )]  # fmt: skip
            else:
                complete = checkpoint.complete_shards(settings.directory, settings.storage_options)
                steps = [s for s, w, _ in complete if w == world]
        except OSError:  # the store cannot be listed either
            return self._durable
        return max(steps, default=self._durable)

    def _check(self) -> None:
        if self._stop.is_set():
            raise _Stopped("the rank stopped while it was written")

    def _write(self, write: _Write) -> None:
        import torch

        settings = self.settings
        if write.staged.on_device:  # into pinned memory here, not on the training path
            start = time.perf_counter()
            write.staged = self.stager.move(write.staged)
            logger.debug("rank %d: checkpoint of step %d moved off its devices in %.3f s",
                         self.rank, write.step, time.perf_counter() - start)  # fmt: skip
            self._check()
        staged = write.staged
        buf = io.BytesIO()
        torch.save(staged.tree, buf)
        with self._cond:  # the copy is serialised: its buffers serve the next one
            self.stager.release(staged, keep=self._staged is None)
            write.serialised = True
            self._cond.notify_all()
        data = buf.getbuffer()  # no copy; a replica kept in this process keeps it alive
        self._check()
        url, nbytes = checkpoint.write_bytes(
            data,
            settings.directory,
            step=write.step,
            rank=self._writer(write.world_size),
            world_size=write.world_size,
            storage_options=settings.storage_options,
            check=self._check,
            makedirs=self._durable is None,
        )
        self._durable = write.step
        self._prune(write.world_size)
        info = checkpoint.CheckpointInfo(
            url, write.step, nbytes, self.rank, time.time(), write.pending.stall,
            write.world_size,
        )  # fmt: skip
        self._tell(info)
        write.pending.landed(info)
        self._replicate(write, data)
        write.pending.settled()

    def _prune(self, world: int | None) -> None:
        keep = self.settings.keep_last
        if keep is None:
            return
        try:
            if world is None:
                checkpoint.prune(self.settings.directory, keep, self.settings.storage_options)
            else:
                checkpoint.prune_shards(
                    self.settings.directory, keep, self.settings.storage_options
                )
        except OSError as exc:  # the checkpoint itself is durable: only old ones stay
            logger.warning("rank %d: could not delete old checkpoints (%s)", self.rank, exc)

    def _tell(self, info: checkpoint.CheckpointInfo) -> None:
        body = [info.url, info.step, info.nbytes, info.time, info.stall, info.world_size]
        self._say(CHECKPOINT, body)

    def _say(self, kind: str, body: list[Any]) -> None:
        try:
            self._announce(kind, body)
        except Exception as exc:  # the channel closed or failed: its own error is raised
            logger.debug("rank %d: could not announce %s %s: %s", self.rank, kind, body, exc)

    def _replicate(self, write: _Write, data: memoryview) -> None:
        """Keep the checkpoint's bytes in the holder's memory too, and say so."""
        holder = self.settings.replica_holder
        if self._peer is None or holder is None or holder in self._unreachable:
            return
        writer = self.rank if write.world_size is not None else 0
        try:
            why = self._peer.put(
                holder, writer, write.world_size, write.step, data, self.settings.replica_fraction
            )
        except Exception as exc:  # best effort: the holder left, or refused; the store copy stays
            why = f"{type(exc).__name__}: {exc}"
            self._unreachable.add(holder)
        if why is None:
            self._say(REPLICA, [write.step, holder, write.world_size, len(data)])
        elif not self._replica_said:
            self._replica_said = True
            logger.info(
                "rank %d: the checkpoint of step %d is not replicated in %s's memory (%s); a "
                "restart reads it from %s", self.rank, write.step, holder, why,
                self.settings.directory,
            )  # fmt: skip

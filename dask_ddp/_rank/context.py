"""The rank's view of its job: :func:`get_context` and :func:`report` inside the training
function.

The context is set by :mod:`dask_ddp._rank.tasks` for as long as the user's function runs,
in the process's rank run (:data:`dask_ddp._rank.slot.PROCESS`). One rank runs per worker
process at a time, so the context is per process: threads the training function starts,
and DataLoader workers forked from the rank, see it too.
Everything a rank says to the client goes through the rank's channel
(:class:`dask_ddp._rank.channel.RankChannel`), opened and closed by the bootstrap around the
function.
"""

from __future__ import annotations

import contextlib
import numbers
import operator
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .._shared.protocol import METRICS
from ..errors import CheckpointDirMissingError, NotInRankError
from . import channel as _events
from . import checkpoint, resize
from .slot import CheckpointSettings, RankContext, RankRun, this_slot

if TYPE_CHECKING:
    from ..data.collections import DatasetShard

__all__ = [
    "RankContext",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "report",
    "save_checkpoint",
]


def _active_run(caller: str) -> RankRun:
    """This process's rank run while the user's function runs, or NotInRankError.

    A safe point: a rank the supervisor asked to stop raises
    :class:`~dask_ddp.RankStoppedError` here (in the rank's own process).
    """
    run = this_slot().current()
    if run is None or run.context is None:
        raise NotInRankError(caller)
    if run.pid == os.getpid():
        run.check_stop()
    return run


def get_context() -> RankContext:
    """Return the running rank's :class:`RankContext`.

    Raises
    ------
    NotInRankError
        When called outside a function started by :func:`dask_ddp.launch` or
        :func:`dask_ddp.dispatch.run`.

    Examples
    --------
    >>> def train():
    ...     ctx = dask_ddp.get_context()
    ...     model = torch.nn.Linear(4, 2).to(ctx.device)
    ...     return ctx.rank
    >>> dask_ddp.launch(client, train).result()  # doctest: +SKIP
    [0, 1]
    """
    run = this_slot().current()
    if run is None or run.context is None:
        raise NotInRankError("get_context")
    return run.context


_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what msgpack carries as an integer


def _scalar(name: str, value: Any) -> int | float:
    """``value`` as a plain int or float, or TypeError naming the metric."""
    torch = sys.modules.get("torch")  # a tensor implies torch is imported; never import it here
    if (torch is not None and isinstance(value, torch.Tensor)) or getattr(value, "ndim", None) == 0:
        if getattr(value, "ndim", 0) != 0 and value.numel() != 1:
            raise TypeError(
                f"report() takes numbers or 0-d tensors; the rank got a tensor of shape "
                f"{tuple(value.shape)} for {name!r}. Reduce it first, e.g. {name}.mean().item()."
            )
        value = value.item()  # a 0-d tensor or numpy scalar; syncs the GPU, like .item()
    if isinstance(value, numbers.Integral):
        number = int(value)
        return number if _INT_MIN <= number <= _INT_MAX else float(number)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"report() takes numbers or 0-d tensors; the rank got {type(value).__name__} for "
        f"{name!r}. Pass a number, e.g. report({{{name!r}: loss.item()}})."
    )


def report(metrics: Mapping[str, Any], *, step: int | None = None) -> None:
    """Send metrics from this rank to the client; never waits for the network.

    The record is buffered on the rank and sent with others in the background. Records
    keep their order per rank, and every record reported before the training function
    returns is in :attr:`Job.metrics <dask_ddp.Job.metrics>` when ``Job.result()``
    returns. On the client they also reach the live view, ``Job.iter_metrics()`` and
    ``launch(..., on_report=...)``.

    Parameters
    ----------
    metrics : mapping of str to number
        Metric names and values: ints, floats, numpy scalars or 0-d tensors (converted
        with ``.item()`` here on the rank, which waits for the GPU as ``.item()`` does).
    step : int, optional
        The training step the metrics belong to.

    Raises
    ------
    NotInRankError
        Called outside a function started by :func:`dask_ddp.launch` or
        :func:`dask_ddp.dispatch.run`.
    TypeError
        A name is not a string, or a value is not a number or a 0-d tensor.

    Examples
    --------
    >>> def train(steps):
    ...     for step in range(steps):
    ...         loss = torch.tensor(1.0 / (step + 1))
    ...         dask_ddp.report({"loss": loss, "lr": 0.1}, step=step)
    >>> job = dask_ddp.launch(client, train, args=(100,))  # doctest: +SKIP
    >>> job.result(); job.metrics[-1].metrics              # doctest: +SKIP
    {'loss': 0.01, 'lr': 0.1}
    """
    channel = _active_run("report").channel
    if channel is None:
        raise NotInRankError("report")
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"report() takes a mapping of metric names to numbers, not "
            f"{type(metrics).__name__}; call it as report({{'loss': loss}}, step=step)."
        )
    values: dict[str, int | float] = {}
    for name, value in metrics.items():
        if type(name) is not str:
            if not isinstance(name, str):
                raise TypeError(
                    f"report() takes metric names as str; got {type(name).__name__} {name!r}."
                )
            name = str(name)
        kind = type(value)
        if kind is float or (kind is int and _INT_MIN <= value <= _INT_MAX):
            values[name] = value
        else:
            values[name] = _scalar(name, value)
    if step is not None:
        try:
            step = operator.index(step)
        except TypeError:
            raise TypeError(
                f"report() takes an integer step or None; got {type(step).__name__} {step!r}."
            ) from None
    channel.put(METRICS, [step, time.time(), values], "report")


def _rank_channel(caller: str) -> _events.RankChannel:
    """The running rank's channel, or NotInRankError naming ``caller``."""
    channel = _active_run(caller).channel
    if channel is None:
        raise NotInRankError(caller)
    return channel


def save_checkpoint(
    state: Any, *, step: int, per_rank: bool = False
) -> checkpoint.CheckpointInfo | checkpoint.PendingCheckpoint | None:
    """Save ``state`` as the job's checkpoint for ``step``, atomically, off the training path.

    By default (``checkpoint_mode="async"``) it returns as soon as ``state`` is copied off
    the live tensors into CPU memory: changing them afterwards (the next optimizer step)
    never changes what is saved. Serialising and writing happen in the background, one
    checkpoint at a time and in the order they were saved; a checkpoint is visible
    (:func:`get_checkpoint`, :attr:`Job.checkpoints <dask_ddp.Job.checkpoints>`,
    ``keep_last``) only once it is durable. At most one checkpoint is in flight and one
    more copied: a save that finds both waits for the one in flight (its stall, in
    :attr:`CheckpointInfo.stall <dask_ddp._rank.checkpoint.CheckpointInfo.stall>`). A write that
    fails raises :class:`~dask_ddp.errors.CheckpointUploadError` here at the next save, or when
    the function returns, which also waits for the last write. Each checkpoint is also kept
    in another worker's memory, from where a restart after a lost worker loads it. With
    ``checkpoint_mode="sync"`` it returns once the checkpoint is written, as before.

    Rank 0 writes the job's state (DDP keeps every rank's model identical); on other ranks
    this returns None without writing, so the same code runs everywhere. With
    ``per_rank=True`` every rank writes its own state (FSDP-style shards), and
    :func:`get_checkpoint` with ``per_rank=True`` gives each rank its own back; such a
    checkpoint counts (is loaded, kept by ``keep_last``) once every rank's file is there.
    Files land under the job's ``checkpoint_dir`` (any fsspec URL) as
    ``checkpoint-<step>.pt`` (``checkpoint-<step>.rank-<r>-of-<n>.pt``); a reader never
    sees one half-written.

    Save plain state (``model.state_dict()``, ``optimizer.state_dict()``, numbers,
    strings, lists and dicts of tensors): :func:`get_checkpoint` loads with
    ``weights_only=True``.

    In an elastic job (``launch(..., min_workers=)``) running below its size, call it on
    every rank: once the checkpoint has landed, the ranks learn from rank 0 whether the job
    stops here to grow (then it raises on every rank, and the job restarts from this
    checkpoint with more ranks; see docs/elastic.md).

    Returns
    -------
    PendingCheckpoint, CheckpointInfo or None
        On a rank that writes: a :class:`~dask_ddp._rank.checkpoint.PendingCheckpoint` (async;
        its ``wait()`` returns the ``CheckpointInfo`` once durable), or the
        :class:`~dask_ddp._rank.checkpoint.CheckpointInfo` of the written checkpoint (sync).

    Raises
    ------
    NotInRankError
        Called outside a rank.
    CheckpointDirMissingError
        The job was launched without ``checkpoint_dir``.
    CheckpointUploadError
        An earlier checkpoint of this rank could not be written.
    ValueError
        ``step`` is not an int of at least 0.

    Examples
    --------
    >>> def train(steps):
    ...     model, opt, start = make_model(), make_opt(), 0
    ...     state = dask_ddp.get_checkpoint()
    ...     if state is not None:
    ...         model.load_state_dict(state["model"]); start = state["step"] + 1
    ...     for step in range(start, steps):
    ...         ...
    ...         if step % 100 == 0:
    ...             dask_ddp.save_checkpoint({"model": model.state_dict(), "step": step}, step=step)
    >>> dask_ddp.launch(client, train, args=(1000,), checkpoint_dir="s3://bucket/run1",
    ...                 max_restarts=2)  # doctest: +SKIP
    """
    run = _active_run("save_checkpoint")
    ctx = get_context()
    settings = run.checkpointing or CheckpointSettings(None)
    if settings.directory is None or run.saver is None:
        raise CheckpointDirMissingError(ctx.rank)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save_checkpoint() takes step as an int of at least 0; got {step!r}")
    result = None
    if per_rank or ctx.rank == 0:
        result = run.saver.save(state, step, per_rank=per_rank)
    if settings.grow_timeout is not None:
        resize.at_checkpoint(run, ctx.rank, step, settings.grow_timeout)
    return result


def get_checkpoint(*, per_rank: bool = False, rank: int | None = None) -> Any:
    """The job's latest complete checkpoint, loaded onto this rank's device, or None.

    None when the job has no ``checkpoint_dir`` or nothing was saved there yet. After a
    restart it comes from where the job's supervisor found the last checkpoint: the
    replica in a surviving worker's memory when there is one (no storage round trip),
    else the store; :attr:`Job.history <dask_ddp.Job.history>` says which. A replica
    fetched from another worker is loaded in place: its CPU tensors share one buffer, which
    lives as long as any of them (copy what you keep, as ``load_state_dict`` does). A file that
    does not load (cut short by a crash) is skipped for the one before it. Loading uses
    ``torch.load(weights_only=True)``: tensors, dicts, lists, tuples, numbers and strings
    come back; anything else raises :class:`~dask_ddp._rank.checkpoint.UnsafeCheckpointError`.

    Parameters
    ----------
    per_rank : bool
        Load per-rank state (``save_checkpoint(..., per_rank=True)``): this rank's own.
    rank : int, optional
        With ``per_rank``, load that rank's state instead (to reshard it after the job's
        size changed).

    Raises
    ------
    NotInRankError
        Called outside a rank.
    CheckpointShardsError
        ``per_rank``: the newest per-rank checkpoint was written by another number of ranks.

    Examples
    --------
    >>> def train(steps):                                    # doctest: +SKIP
    ...     model, opt = make_model(), make_optimizer()
    ...     state = dask_ddp.get_checkpoint()                # None on the first attempt
    ...     start = 0 if state is None else state["step"] + 1
    ...     if state is not None:
    ...         model.load_state_dict(state["model"])
    ...     for step in range(start, steps):
    ...         ...
    """
    run = _active_run("get_checkpoint")
    if run.resumer is None:
        return None
    return run.resumer.load(per_rank=per_rank, rank=rank)


def _latest_checkpoint_url() -> str | None:
    """The URL of the job's newest checkpoint file, for libraries that load their own
    checkpoints from a path (Lightning's ``ckpt_path``); None when there is none."""
    settings = _active_run("get_checkpoint").checkpointing or CheckpointSettings(None)
    if settings.directory is None:
        return None
    found = checkpoint.list_checkpoints(settings.directory, settings.storage_options)
    return found[-1][1] if found else None


def get_dataset_shard(name: str) -> DatasetShard:
    """This rank's share of the dataset passed as ``launch(..., datasets={name: ...})``.

    Every rank gets about ``1/world_size`` of the rows, the same number on every rank;
    iterate it once per epoch with :meth:`~dask_ddp.data.DatasetShard.iter_batches` or
    :meth:`~dask_ddp.data.DatasetShard.iter_rows`. Calls with the same name return the same
    object during the rank's run.

    Parameters
    ----------
    name : str
        A key of the ``datasets=`` mapping given to :func:`dask_ddp.launch`.

    Returns
    -------
    DatasetShard

    Raises
    ------
    NotInRankError
        Called outside a function started by :func:`dask_ddp.launch`.
    DatasetNotFoundError
        The job was launched without a dataset of that name (a ``KeyError``).

    Examples
    --------
    >>> def train(epochs):
    ...     shard = dask_ddp.get_dataset_shard("train")
    ...     for epoch in range(epochs):
    ...         for batch in shard.iter_batches(256, format="torch"):
    ...             ...
    >>> dask_ddp.launch(client, train, args=(2,), datasets={"train": ddf})  # doctest: +SKIP
    """
    run = _active_run("get_dataset_shard")
    shard = run.dataset_shards.get(name)
    if shard is None:
        from ..data.collections import DatasetNotFoundError, DatasetShard

        plan = run.dataset_plans.get(name)
        if plan is None:
            raise DatasetNotFoundError(name, tuple(sorted(run.dataset_plans)), run.rank)
        shard = run.dataset_shards[name] = DatasetShard(plan)
    return shard


@contextlib.contextmanager
def _activated(
    run: RankRun,
    ctx: RankContext,
    checkpointing: CheckpointSettings | None = None,
    datasets: Mapping[str, Any] | None = None,
    saver: Any = None,
    resumer: Any = None,
) -> Iterator[RankContext]:
    """Make ``ctx`` (with its checkpoints and its share of the datasets) what the user's
    function sees in ``run`` for the block; stop the shards' background fetches after it.

    The block's end waits for the checkpoints ``saver`` still writes (and raises if one
    failed); a block that raises gives them up instead, unless it stops to grow (then the
    job goes on from the last of them).
    """
    run.context, run.checkpointing = ctx, checkpointing or CheckpointSettings(None)
    run.saver, run.resumer = saver, resumer
    run.dataset_plans, run.dataset_shards = dict(datasets or {}), {}
    try:
        yield ctx
        if saver is not None:
            saver.finish()
    except resize.GrowAtCheckpoint:
        if saver is not None:
            saver.finish()
        raise
    finally:
        if saver is not None:
            saver.stop()  # nothing left once finished; else what is left is given up
        shards = run.dataset_shards
        run.context, run.checkpointing, run.saver, run.resumer = None, None, None, None
        run.dataset_plans, run.dataset_shards = {}, {}
        for shard in shards.values():
            shard.close()

"""Dask collections as training data: ``launch(..., datasets={"train": ddf})``.

A dask.dataframe, dask.bag or dask.array passed to :func:`dask_ddp.launch` in
``datasets=`` is computed and kept in the cluster's memory (its partitions stay on the
workers that computed them) for the job's lifetime, restarts included. On the client,
before the ranks start, its rows are split into one equal share per rank, preferring
partitions that already sit on the rank's worker (:func:`_plan_pieces`). Each rank gets the
keys of its partitions, not the data: inside the rank, :func:`dask_ddp.get_dataset_shard`
returns a :class:`DatasetShard` that fetches its partitions window by window, straight from
the workers that hold them (its own worker's without a copy), never through the client or
the scheduler, and fetches the next window in a background thread while the current one
trains.

Every rank yields the same number of rows per epoch, hence the same number of batches,
which DistributedDataParallel needs: like :class:`torch.utils.data.DistributedSampler`, a
dataset whose rows do not divide evenly is padded by repeating a few rows
(``drop_last=False``, the default) or loses fewer than ``world_size`` rows
(``drop_last=True``). Each epoch visits the rank's rows in a new order, the same for the
same seed.

Client side: :class:`CollectionSource`, :func:`_persist_datasets`. Rank side:
:class:`DatasetShard`, made by :func:`dask_ddp.get_dataset_shard`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError
from typing import TYPE_CHECKING, Any

import numpy as np

from dask_ddp.data._prefetch import Prefetcher
from dask_ddp.errors import DaskDDPError

if TYPE_CHECKING:
    from distributed import Client, Future

logger = logging.getLogger(__name__)

__all__ = [
    "CollectionSource",
    "DatasetComputeError",
    "DatasetNotFoundError",
    "DatasetPartitionLostError",
    "DatasetShard",
    "DatasetTooSmallError",
    "UnsupportedCollectionError",
]

Key = Hashable  # a Dask key: str, bytes, int, float or a tuple of them

_FORMATS = {
    "dataframe": ("pandas", "numpy", "torch"),
    "array": ("numpy", "torch"),
    "bag": ("list", "torch"),
}


# -- errors -----------------------------------------------------------------------------


class UnsupportedCollectionError(DaskDDPError, TypeError):
    """A value in ``datasets=`` is not a dask.dataframe, dask.bag or dask.array collection.

    Examples
    --------
    >>> print(UnsupportedCollectionError("train", "list"))  # doctest: +ELLIPSIS
    datasets={'train': ...} is a list; launch(datasets=...) takes a dask.dataframe ...
    """

    def __init__(self, name: str, type_name: str) -> None:
        super().__init__(name, type_name)
        self.name, self.type_name = name, type_name

    def __str__(self) -> str:
        return (
            f"datasets={{{self.name!r}: ...}} is a {self.type_name}; launch(datasets=...) "
            "takes a dask.dataframe DataFrame or Series, a dask.bag Bag or a dask.array "
            "Array (or dask_ddp.data.CollectionSource(collection, ...)). Wrap in-memory data "
            "first, e.g. dask.dataframe.from_pandas(df, npartitions=8)"
        )


class DatasetTooSmallError(DaskDDPError, ValueError):
    """A dataset has fewer rows than the job has ranks, so some rank would get none.

    Examples
    --------
    >>> print(DatasetTooSmallError("train", 1, 2, True))  # doctest: +ELLIPSIS
    dataset 'train' has 1 rows, fewer than the job's 2 ranks...
    """

    def __init__(self, name: str, rows: int, world_size: int, drop_last: bool) -> None:
        super().__init__(name, rows, world_size, drop_last)
        self.name, self.rows = name, rows
        self.world_size, self.drop_last = world_size, drop_last

    def __str__(self) -> str:
        if self.rows == 0:
            return (
                f"dataset {self.name!r} has no rows: every partition is empty. Check the "
                "collection (len(ddf)) before launching"
            )
        return (
            f"dataset {self.name!r} has {self.rows} rows, fewer than the job's "
            f"{self.world_size} ranks, and drop_last=True would leave every rank without "
            "data. Pass CollectionSource(collection, drop_last=False) to pad, or use fewer "
            "workers (launch(..., workers=N))"
        )


class DatasetComputeError(DaskDDPError, RuntimeError):
    """Computing a dataset's partition on the cluster failed before the job started.

    The partition's own exception is chained as ``__cause__``.

    Examples
    --------
    >>> print(DatasetComputeError("train", 3, "('x', 3)", "ValueError: bad row"))
    ... # doctest: +ELLIPSIS
    dataset 'train': computing partition 3 (key ('x', 3)) failed: ValueError: bad row. ...
    """

    def __init__(self, name: str, partition: int, key: str, cause: str) -> None:
        super().__init__(name, partition, key, cause)
        self.name, self.partition, self.key, self.cause = name, partition, key, cause

    def __str__(self) -> str:
        return (
            f"dataset {self.name!r}: computing partition {self.partition} (key {self.key}) "
            f"failed: {self.cause}. No rank was started; fix the collection (compute one "
            "partition with ddf.partitions[i].compute() to see the error) and launch again"
        )


class DatasetPartitionLostError(DaskDDPError, RuntimeError):
    """A dataset's partition is no longer anywhere in the cluster and cannot be recomputed.

    Raised on a rank when it fetches the partition, or on the client when a restart plans
    the data again. It happens when the workers holding a partition that has no recipe (data
    from ``client.scatter``, or a collection built on scattered futures) died.

    Examples
    --------
    >>> err = DatasetPartitionLostError("train", 4, "('x', 4)", ("tcp://10.0.0.5:4000",), 1)
    >>> print(err)  # doctest: +ELLIPSIS
    dataset 'train': partition 4 (key ('x', 4)), last held by tcp://10.0.0.5:4000, is lost...
    """

    def __init__(
        self,
        name: str,
        partition: int,
        key: str,
        holders: tuple[str, ...],
        rank: int | None,
    ) -> None:
        super().__init__(name, partition, key, holders, rank)
        self.name, self.partition, self.key = name, partition, key
        self.holders, self.rank = holders, rank

    def __str__(self) -> str:
        where = ", ".join(self.holders) or "a worker that left"
        who = f" (needed by rank {self.rank})" if self.rank is not None else ""
        return (
            f"dataset {self.name!r}: partition {self.partition} (key {self.key}), last held "
            f"by {where}, is lost{who}: its worker left the cluster and Dask cannot compute "
            "it again (its data came from client.scatter or other futures without a "
            "recipe). Build the collection from a source Dask can recompute (files, "
            "from_pandas, from_array), or persist it with replicas (client.replicate), and "
            "launch again"
        )


class DatasetNotFoundError(DaskDDPError, KeyError):
    """``get_dataset_shard(name)`` names a dataset the job was not launched with.

    Examples
    --------
    >>> print(DatasetNotFoundError("valid", ("train",), 0))  # doctest: +ELLIPSIS
    rank 0 has no dataset 'valid'; this job was launched with datasets=['train']. ...
    """

    def __init__(self, name: str, available: tuple[str, ...], rank: int) -> None:
        super().__init__(name, available, rank)
        self.name, self.available, self.rank = name, available, rank

    def __str__(self) -> str:
        return (
            f"rank {self.rank} has no dataset {self.name!r}; this job was launched with "
            f"datasets={list(self.available)}. Pass it to the launch: "
            f"dask_ddp.launch(client, train, datasets={{{self.name!r}: collection}})"
        )


# -- what the user passes ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CollectionSource:
    """A Dask collection for ``launch(..., datasets=...)``, with its sharding options.

    A bare collection in ``datasets=`` means ``CollectionSource(collection)``.

    Parameters
    ----------
    collection : dask.dataframe.DataFrame, dask.dataframe.Series, dask.bag.Bag or dask.array.Array
        The data. A dataframe's rows, a bag's items and an array's slices along axis 0 are
        its rows. An array chunked along other axes is rechunked to one chunk there.
    shuffle : bool, default True
        Visit each rank's rows in a new order every epoch: its partitions in a shuffled
        order, and the rows of each window of partitions shuffled together.
    seed : int, default 0
        Seed of the shuffle; the same seed gives the same order for the same epoch.
    drop_last : bool, default False
        When the rows do not divide evenly between the ranks: ``False`` repeats a few
        (fewer than ``world_size`` in all) of a rank's own rows so that every rank has
        ``ceil(rows / world_size)``; ``True`` leaves out fewer than ``world_size`` rows so
        that every rank has ``rows // world_size``. As ``DistributedSampler(drop_last=)``.

    Examples
    --------
    >>> import dask.dataframe as dd, pandas as pd
    >>> ddf = dd.from_pandas(pd.DataFrame({"x": range(10)}), npartitions=2)
    >>> CollectionSource(ddf, seed=1, drop_last=True).kind
    'dataframe'
    >>> job = dask_ddp.launch(client, train, datasets={
    ...     "train": CollectionSource(ddf, seed=1)})  # doctest: +SKIP
    """

    collection: Any
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False

    @property
    def kind(self) -> str:
        """``"dataframe"``, ``"bag"`` or ``"array"``; anything else raises."""
        kind = _collection_kind(self.collection)
        if kind is None:
            raise UnsupportedCollectionError("?", type(self.collection).__name__)
        return kind


def _collection_kind(collection: Any) -> str | None:
    try:
        import dask.dataframe as dd

        if isinstance(collection, (dd.DataFrame, dd.Series)):
            return "dataframe"
    except ImportError:  # pragma: no cover - dask.dataframe needs pandas
        pass
    import dask.array as da
    import dask.bag as db

    if isinstance(collection, db.Bag):
        return "bag"
    if isinstance(collection, da.Array):
        return "array"
    return None


# -- the client side: persist once, plan per attempt ------------------------------------


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Rows ``start:stop`` of one partition, as a rank reads them."""

    key: Key
    partition: int
    start: int
    stop: int
    holders: tuple[str, ...] = ()  # workers that held the partition when the job was planned


@dataclasses.dataclass(frozen=True)
class _ShardPlan:
    """One rank's share of one dataset: what its :class:`DatasetShard` reads. Small: keys
    and row ranges, never data."""

    name: str
    kind: str
    rank: int
    world_size: int
    pieces: tuple[_Piece, ...]
    rows: int  # rows per epoch, the same on every rank
    total_rows: int
    shuffle: bool
    seed: int
    worker: str


def _delayed_partitions(name: str, source: CollectionSource, kind: str) -> list[Any]:
    """The collection's partitions as Delayed objects, in order along axis 0."""
    collection = source.collection
    if kind == "dataframe":
        return list(collection.to_delayed())
    if kind == "bag":
        # A bag's partition may be a lazy iterator, which a second read would find empty.
        return list(collection.map_partitions(list).to_delayed())
    if collection.ndim == 0:
        raise UnsupportedCollectionError(name, "0-dimensional dask.array (it has no rows)")
    if any(len(c) > 1 for c in collection.chunks[1:]):
        logger.info(
            "dataset %r: rechunking the array to one chunk along axes 1..%d, so that each "
            "block holds whole rows",
            name, collection.ndim - 1,
        )  # fmt: skip
        collection = collection.rechunk({axis: -1 for axis in range(1, collection.ndim)})
    return list(np.asarray(collection.to_delayed(), dtype=object).ravel())


class _PersistedDataset:
    """A dataset computed into the cluster's memory, held by the job until it ends."""

    def __init__(
        self, name: str, source: CollectionSource, kind: str, futures: list[Future]
    ) -> None:
        self.name, self.source, self.kind = name, source, kind
        self.futures = futures
        self.lengths: list[int] = []

    def check(self) -> None:
        """Wait until every partition is in memory; raise if one failed or is lost."""
        from distributed import wait

        wait(self.futures)
        for i, fut in enumerate(self.futures):
            if fut.status == "error":
                exc = fut.exception()
                raise DatasetComputeError(
                    self.name, i, str(fut.key), f"{type(exc).__name__}: {exc}"
                ) from exc
            if fut.status != "finished":  # lost, or cancelled by someone
                raise DatasetPartitionLostError(self.name, i, str(fut.key), (), None)

    def plan(
        self, workers: Sequence[str], who_has: Mapping[Key, Sequence[str]], job_id: str
    ) -> list[_ShardPlan]:
        holders = [tuple(who_has.get(f.key, ())) for f in self.futures]
        shares = _plan_pieces(self.lengths, holders, workers, drop_last=self.source.drop_last)
        if shares is None:
            raise DatasetTooSmallError(
                self.name, sum(self.lengths), len(workers), self.source.drop_last
            )
        rows = sum(stop - start for _, start, stop in shares[0])
        local = sum(
            stop - start
            for rank, share in enumerate(shares)
            for i, start, stop in share
            if workers[rank] in holders[i]
        )
        total = sum(self.lengths)
        logger.info(
            "job %s: dataset %r: %d rows in %d partitions -> %d rows per rank (%+d padded "
            "or dropped); %.0f%% of them already on their rank's worker",
            job_id, self.name, total, len(self.lengths), rows, rows * len(workers) - total,
            100.0 * local / max(1, rows * len(workers)),
        )  # fmt: skip
        return [
            _ShardPlan(
                name=self.name,
                kind=self.kind,
                rank=rank,
                world_size=len(workers),
                pieces=tuple(
                    _Piece(self.futures[i].key, i, start, stop, holders[i])
                    for i, start, stop in share
                ),
                rows=rows,
                total_rows=total,
                shuffle=self.source.shuffle,
                seed=self.source.seed,
                worker=workers[rank],
            )
            for rank, share in enumerate(shares)
        ]


class _Datasets:
    """Every dataset of one job: persisted once at launch, planned again for every attempt,
    released when the job ends."""

    def __init__(self, client: Client, job_id: str, datasets: list[_PersistedDataset]) -> None:
        self.client, self.job_id, self.datasets = client, job_id, datasets
        self._lock = threading.Lock()

    def plan(self, workers: Sequence[str]) -> list[dict[str, _ShardPlan]]:
        """Per rank (in rank order), its share of every dataset, placed on ``workers``."""
        with self._lock:
            datasets = list(self.datasets)
        if not datasets:
            return [{} for _ in workers]
        for ds in datasets:
            ds.check()
        who_has = self.client.who_has([f for ds in datasets for f in ds.futures])
        per_rank: list[dict[str, _ShardPlan]] = [{} for _ in workers]
        for ds in datasets:
            for rank, plan in enumerate(ds.plan(workers, who_has, self.job_id)):
                per_rank[rank][ds.name] = plan
        return per_rank

    def release(self) -> None:
        """Let go of the partitions (they leave the workers' memory unless held elsewhere)."""
        with self._lock:
            datasets, self.datasets = self.datasets, []
        futures = [f for ds in datasets for f in ds.futures]
        if futures:
            logger.debug("job %s: releasing %d dataset partitions", self.job_id, len(futures))
            _release(futures)


def _persist_datasets(client: Client, datasets: Mapping[str, Any], job_id: str) -> _Datasets:
    """Compute every collection into the cluster's memory and count its rows; on the client.

    Partitions stay on the workers that computed them; only their row counts come back.
    """
    from distributed import wait

    sources: list[tuple[str, CollectionSource, str]] = []
    for name, value in datasets.items():
        if not isinstance(name, str):
            raise TypeError(
                f"datasets= takes names as str, e.g. datasets={{'train': ddf}}; got "
                f"{type(name).__name__} {name!r}"
            )
        source = value if isinstance(value, CollectionSource) else CollectionSource(value)
        kind = _collection_kind(source.collection)
        if kind is None:
            raise UnsupportedCollectionError(name, type(source.collection).__name__)
        sources.append((name, source, kind))
    persisted: list[_PersistedDataset] = []
    try:
        for name, source, kind in sources:
            parts = _delayed_partitions(name, source, kind)
            futures = client.compute(parts) if parts else []
            persisted.append(_PersistedDataset(name, source, kind, futures))
            logger.info(
                "job %s: dataset %r, a dask %s of %d partitions, computing into the workers' "
                "memory",
                job_id, name, kind, len(parts),
            )  # fmt: skip
        for ds in persisted:
            ds.check()
        for ds in persisted:
            counts = client.map(
                len,
                ds.futures,
                key=[f"dask-ddp-{job_id}-{ds.name}-len-{i}" for i in range(len(ds.futures))],
                pure=False,
            )
            wait(counts)
            ds.lengths = [int(n) for n in client.gather(counts)]
    except BaseException:
        _release([f for ds in persisted for f in ds.futures])
        raise
    return _Datasets(client, job_id, persisted)


def _release(futures: Sequence[Future]) -> None:
    # Release, never cancel: a collection the user persisted shares its keys with ours, and
    # cancelling would take the user's data away too.
    for future in futures:
        future.release()


def _plan_pieces(
    lengths: Sequence[int],
    holders: Sequence[Sequence[str]],
    workers: Sequence[str],
    *,
    drop_last: bool = False,
) -> list[list[tuple[int, int, int]]] | None:
    """Split partitions of ``lengths`` rows between ranks on ``workers``, evenly by rows.

    Every rank gets the same number of rows: ``ceil(n / world)`` (a few of its rows
    repeated) or, with ``drop_last``, ``n // world`` (fewer than ``world`` rows left
    out). Partitions go whole to a rank whose worker holds them while it has room; the rest
    is cut at row boundaries, and a rank takes a piece of a partition it holds before one
    it has to fetch. Returns, per rank, ``(partition, start, stop)`` row ranges, or None
    when some rank would get no rows.

    >>> _plan_pieces([4, 4, 2], [["a"], ["b"], ["a"]], ["a", "b"])
    [[(0, 0, 4), (2, 0, 1)], [(1, 0, 4), (2, 1, 2)]]
    >>> _plan_pieces([3, 2], [["a"], ["a"]], ["a", "b"], drop_last=True)  # row 2 left out
    [[(1, 0, 2)], [(0, 0, 2)]]
    >>> _plan_pieces([3], [["a"]], ["a", "b"])  # padded: rank 1 reads its row 2 twice
    [[(0, 0, 2)], [(0, 2, 3), (0, 2, 3)]]
    """
    world = len(workers)
    total = sum(lengths)
    per = total // world if drop_last else -(-total // world)
    if world == 0 or per == 0:
        return None
    room = [per] * world
    shares: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    ranks_on: dict[str, list[int]] = {}
    for rank, worker in enumerate(workers):
        ranks_on.setdefault(worker, []).append(rank)

    def local_ranks(i: int) -> list[int]:
        return [r for w in holders[i] for r in ranks_on.get(w, ())]

    # 1. whole partitions to a rank that holds them, largest first, least-filled rank first
    leftover: list[tuple[int, int, int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] <= 0:
            continue
        fits = [r for r in local_ranks(i) if room[r] >= lengths[i]]
        if fits:
            r = max(fits, key=lambda r: (room[r], -r))
            shares[r].append((i, 0, lengths[i]))
            room[r] -= lengths[i]
        else:
            leftover.append((i, 0, lengths[i]))
    leftover.sort()
    # 2. what is left of the partitions: first to the ranks that hold them
    remote: list[tuple[int, int, int]] = []
    for i, start, stop in leftover:
        for r in local_ranks(i):
            take = min(room[r], stop - start)
            if take > 0:
                shares[r].append((i, start, start + take))
                room[r] -= take
                start += take
        if start < stop:
            remote.append((i, start, stop))
    # 3. then to any rank with room, in partition order (drop_last: the tail is left out)
    r = 0
    for i, start, stop in remote:
        while start < stop and r < world:
            take = min(room[r], stop - start)
            if take > 0:
                shares[r].append((i, start, start + take))
                room[r] -= take
                start += take
            if room[r] == 0:
                r += 1
    # 4. padding: a rank short of rows repeats its own first rows (the dataset's if none)
    padding: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    for r in range(world):
        own = sorted(shares[r]) or [(i, 0, n) for i, n in enumerate(lengths) if n > 0]
        k = 0
        while room[r] > 0:
            i, start, stop = own[k % len(own)]
            take = min(room[r], stop - start)
            padding[r].append((i, start, start + take))
            room[r] -= take
            k += 1
    return [sorted(share) + pad for share, pad in zip(shares, padding, strict=True)]


# -- the rank side ------------------------------------------------------------------------


def _concat(items: list[Any]) -> Any:
    first = items[0]
    if len(items) == 1:
        return first
    if isinstance(first, list):
        return [x for item in items for x in item]
    if isinstance(first, dict):
        return {k: np.concatenate([item[k] for item in items]) for k in first}
    if isinstance(first, np.ndarray) or not hasattr(first, "iloc"):
        return np.concatenate(items)
    import pandas as pd

    return pd.concat(items)


def _take(window: Any, order: np.ndarray) -> Any:
    if isinstance(window, list):
        return [window[i] for i in order]
    if isinstance(window, dict):
        return {k: v[order] for k, v in window.items()}
    if hasattr(window, "iloc"):
        return window.take(order)
    return window[order]


def _slice(window: Any, start: int, stop: int) -> Any:
    if isinstance(window, dict):
        return {k: v[start:stop] for k, v in window.items()}
    if hasattr(window, "iloc"):
        return window.iloc[start:stop]
    return window[start:stop]


def _rows_in(window: Any) -> int:
    if isinstance(window, dict):
        return len(next(iter(window.values()))) if window else 0
    return len(window)


def _copy(window: Any) -> Any:
    """A copy that owns its (writable) memory: torch.from_numpy warns on pandas' read-only
    views, and a batch changed in place must not change the stored partition."""
    if isinstance(window, dict):
        return {k: v.copy() for k, v in window.items()}
    return window.copy()


def _to_columns(frame: Any, name: str, fmt: str) -> Any:
    """A pandas frame as numpy views: a dict of columns (DataFrame) or one array (Series)."""
    import pandas as pd

    columns = {frame.name: frame} if isinstance(frame, pd.Series) else dict(frame.items())
    out = {}
    for column, series in columns.items():
        values = series.to_numpy()
        if fmt == "torch" and values.dtype.kind not in "biufc":
            raise TypeError(
                f"dataset {name!r}: column {column!r} has dtype {series.dtype}, which torch "
                "batches cannot hold. Select numeric and bool columns before launching "
                "(ddf[['x', 'y']]), convert it (ddf.astype(...)), or use format='pandas'"
            )
        out[column] = values
    return out[frame.name] if isinstance(frame, pd.Series) else out


def _as_batch(batch: Any, fmt: str) -> Any:
    if fmt != "torch":
        return batch
    import torch

    if isinstance(batch, dict):
        return {k: torch.from_numpy(v) for k, v in batch.items()}
    if isinstance(batch, np.ndarray):
        return torch.from_numpy(batch)
    from torch.utils.data import default_collate

    return default_collate(batch)


_DONE = object()


class DatasetShard:
    """One rank's share of a dataset passed to ``launch(..., datasets=...)``.

    Get it with :func:`dask_ddp.get_dataset_shard` inside the training function; iterate
    :meth:`iter_batches` (or :meth:`iter_rows`) once per epoch. Every rank has the same
    number of rows (``len(shard)``), hence the same number of batches per epoch. Each
    iteration is one epoch: the first is epoch 0 and each new iteration advances it by one
    unless :meth:`set_epoch` (or ``epoch=``) says which, for example after resuming from a
    checkpoint. With shuffling on (``CollectionSource(shuffle=True)``, the default) each
    epoch has its own order, the same for the same seed, epoch and plan.

    Partitions are fetched ``window`` at a time from the workers that hold them, and the
    next window is fetched in the background while the current one is consumed, so at most
    ``(1 + prefetch) * window`` partitions are in memory. Iterate in the rank's own process:
    DataLoader worker processes cannot fetch from the cluster.

    Examples
    --------
    >>> def train(epochs):
    ...     shard = dask_ddp.get_dataset_shard("train")
    ...     model = DDP(torch.nn.Linear(2, 1))
    ...     for epoch in range(epochs):
    ...         for batch in shard.iter_batches(256, format="torch"):
    ...             x = torch.stack([batch["x0"], batch["x1"]], dim=1).float()
    ...             loss = model(x).square().mean()
    ...             ...
    >>> dask_ddp.launch(client, train, args=(3,), datasets={"train": ddf})  # doctest: +SKIP
    """

    def __init__(self, plan: _ShardPlan) -> None:
        self._plan = plan
        self._next_epoch = 0
        self._open: weakref.WeakSet[Prefetcher[int, Any]] = weakref.WeakSet()
        self._stats: dict[str, float] = {}
        self._stats_lock = threading.Lock()

    # -- what it is -----------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The dataset's name in ``datasets=``."""
        return self._plan.name

    @property
    def kind(self) -> str:
        """``"dataframe"``, ``"bag"`` or ``"array"``."""
        return self._plan.kind

    @property
    def total_rows(self) -> int:
        """Rows of the whole dataset, over every rank."""
        return self._plan.total_rows

    @property
    def num_partitions(self) -> int:
        """How many partition pieces this rank reads per epoch."""
        return len(self._plan.pieces)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration will be."""
        return self._next_epoch

    def __len__(self) -> int:
        """Rows this rank yields per epoch; the same on every rank."""
        return self._plan.rows

    def __repr__(self) -> str:
        p = self._plan
        return (
            f"<DatasetShard {p.name!r} ({p.kind}): rank {p.rank}/{p.world_size}, {p.rows} of "
            f"{p.total_rows} rows in {len(p.pieces)} pieces, next epoch {self._next_epoch}>"
        )

    def num_batches(self, batch_size: int, *, drop_last: bool = False) -> int:
        """Batches per epoch for ``batch_size``; the same on every rank.

        >>> shard = DatasetShard(_ShardPlan("t", "bag", 0, 2, (), 10, 20, True, 0, "w"))
        >>> shard.num_batches(4), shard.num_batches(4, drop_last=True)
        (3, 2)
        """
        _check_batch_size(batch_size)
        n = self._plan.rows
        return n // batch_size if drop_last else -(-n // batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (as ``DistributedSampler.set_epoch``)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch() takes an int >= 0; got {epoch!r}")
        self._next_epoch = epoch

    # -- iterating ------------------------------------------------------------------------
    def iter_batches(
        self,
        batch_size: int,
        *,
        format: str | None = None,
        drop_last: bool = False,
        epoch: int | None = None,
        window: int = 2,
        prefetch: int = 1,
    ) -> Iterator[Any]:
        """Yield one epoch of batches of ``batch_size`` rows.

        Parameters
        ----------
        batch_size : int
            Rows per batch. Batches span partition and window boundaries; only the last one
            may be smaller (dropped with ``drop_last=True``).
        format : str, optional
            dataframe: ``"pandas"`` (default; a DataFrame or Series), ``"numpy"`` (a dict of
            column arrays, or one array for a Series) or ``"torch"`` (the same with
            tensors; columns must be numeric or bool). array: ``"numpy"`` (default) or
            ``"torch"``, slices along axis 0. bag: ``"list"`` (default) or ``"torch"``
            (``torch.utils.data.default_collate`` of the items).
        drop_last : bool, default False
            Leave out the last, smaller batch.
        epoch : int, optional
            This iteration's epoch; default: the one after the previous iteration (0 first).
        window : int, default 2
            Partitions fetched and shuffled together.
        prefetch : int, default 1
            Windows fetched ahead, in a background thread.

        Examples
        --------
        >>> for batch in shard.iter_batches(512, format="torch"):  # doctest: +SKIP
        ...     loss = step(batch["x"], batch["y"])
        """
        _check_batch_size(batch_size)
        fmt = self._format(format)
        windows = self._windows(fmt, epoch, window, prefetch)
        carry: Any = None
        try:
            for data in windows:
                start, rows = 0, _rows_in(data)
                if carry is not None:
                    start = min(rows, batch_size - _rows_in(carry))
                    carry = _concat([carry, _slice(data, 0, start)])
                    if _rows_in(carry) < batch_size:
                        continue
                    yield _as_batch(carry, fmt)
                    carry = None
                while rows - start >= batch_size:
                    yield _as_batch(_slice(data, start, start + batch_size), fmt)
                    start += batch_size
                if start < rows:
                    carry = _slice(data, start, rows)
            if carry is not None and not drop_last:
                yield _as_batch(carry, fmt)
        finally:
            windows.close()

    def iter_rows(
        self, *, epoch: int | None = None, window: int = 2, prefetch: int = 1
    ) -> Iterator[Any]:
        """Yield one epoch of rows: dicts for a DataFrame, values for a Series, the array's
        slices along axis 0, a bag's items.

        Examples
        --------
        >>> for row in shard.iter_rows():  # doctest: +SKIP
        ...     print(row["x"])
        """
        fmt = "pandas" if self.kind == "dataframe" else _FORMATS[self.kind][0]
        windows = self._windows(fmt, epoch, window, prefetch)
        try:
            for data in windows:
                if hasattr(data, "to_dict") and hasattr(data, "columns"):
                    yield from data.to_dict("records")
                elif hasattr(data, "iloc"):
                    yield from data.tolist()
                else:
                    yield from data
        finally:
            windows.close()

    def __iter__(self) -> Iterator[Any]:
        """Same as :meth:`iter_rows` with its defaults."""
        return self.iter_rows()

    def close(self) -> None:
        """Stop the background fetches of unfinished iterations (done when the rank ends)."""
        for prefetcher in list(self._open):
            prefetcher.close()

    # -- inside -------------------------------------------------------------------------
    def _format(self, fmt: str | None) -> str:
        allowed = _FORMATS[self.kind]
        if fmt is None:
            return allowed[0]
        if fmt not in allowed:
            raise ValueError(
                f"dataset {self.name!r} is a dask {self.kind}: format= takes one of "
                f"{', '.join(map(repr, allowed))}; got {fmt!r}"
            )
        return fmt

    def _order(self, epoch: int) -> tuple[list[_Piece], np.random.Generator | None]:
        pieces = list(self._plan.pieces)
        if not self._plan.shuffle:
            return pieces, None
        rng = np.random.default_rng([self._plan.seed, epoch, self._plan.rank])
        return [pieces[i] for i in rng.permutation(len(pieces))], rng

    def _windows(self, fmt: str, epoch: int | None, window: int, prefetch: int) -> Iterator[Any]:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window= takes an int >= 1 (partitions per window); got {window!r}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch= takes an int >= 0 (windows ahead); got {prefetch!r}")
        if epoch is None:
            epoch = self._next_epoch
        elif not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch= takes an int >= 0; got {epoch!r}")
        self._next_epoch = epoch + 1
        pieces, rng = self._order(epoch)
        groups = [pieces[i : i + window] for i in range(0, len(pieces), window)]
        # One generator per window, drawn in window order, so the order depends only on
        # (seed, epoch, rank), never on timing.
        seeds = rng.integers(0, 2**63, size=len(groups)) if rng is not None else None
        fetcher = _Fetcher(self._plan, self._count)

        def load(w: int) -> Any:
            began = time.perf_counter()
            data, shared = fetcher.load(groups[w], fmt)
            if seeds is not None:  # a shuffle copies anyway
                order = np.random.default_rng(int(seeds[w])).permutation(_rows_in(data))
                data = _take(data, order)
            elif shared:
                data = _copy(data)
            self._count("fetch_s", time.perf_counter() - began)
            return data

        if prefetch == 0:
            return self._waited((load(w) for w in range(len(groups))), None)
        prefetcher: Prefetcher[int, Any] = Prefetcher(load, name=self.name, ahead=prefetch)
        prefetcher.want(range(len(groups)))
        self._open.add(prefetcher)
        return self._waited(prefetcher.results(), prefetcher)

    def _waited(
        self, windows: Iterator[Any], prefetcher: Prefetcher[int, Any] | None
    ) -> Iterator[Any]:
        """Yield the windows, counting the time the training loop waited for each."""
        try:
            while True:
                began = time.perf_counter()
                data = next(windows, _DONE)
                self._count("wait_s", time.perf_counter() - began)
                if data is _DONE:
                    return
                self._count("windows", 1)
                yield data
        finally:
            if prefetcher is not None:
                prefetcher.close()

    def _count(self, name: str, value: float) -> None:
        with self._stats_lock:
            self._stats[name] = self._stats.get(name, 0) + value

    def get_stats(self) -> dict[str, float]:
        """This rank's counters since the shard was made, over every iteration.

        ``windows``: windows consumed; ``partitions_local``/``partitions_remote``:
        partitions read from this worker's memory or fetched from another worker;
        ``fetch_s``: seconds spent fetching, converting and shuffling windows (in the
        background unless ``prefetch=0``); ``wait_s``: seconds the
        training loop waited for a window. A ``wait_s`` close to ``fetch_s`` means
        prefetching does not keep up: raise ``prefetch=`` or ``window=``.

        >>> shard = DatasetShard(_ShardPlan("t", "bag", 0, 1, (), 0, 0, False, 0, "w"))
        >>> shard.get_stats()["partitions_remote"]
        0
        """
        with self._stats_lock:
            stats = dict(self._stats)
        for name in ("windows", "partitions_local", "partitions_remote"):
            stats[name] = int(stats.get(name, 0))
        for name in ("fetch_s", "wait_s"):
            stats[name] = float(stats.get(name, 0.0))
        return stats


def _check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size takes an int >= 1; got {batch_size!r}")


class _Fetcher:
    """Reads pieces of partitions on a rank: from its own worker's memory when the
    partition is there, else straight from the worker that holds it."""

    def __init__(self, plan: _ShardPlan, count: Callable[[str, float], None]) -> None:
        from distributed import get_client, get_worker

        self._plan, self._count = plan, count
        self._client, self._worker = get_client(), get_worker()

    def load(self, pieces: Sequence[_Piece], fmt: str) -> tuple[Any, bool]:
        """The window's rows, and whether they may share memory with a stored partition
        (a window of one piece: a view of it), so that the caller copies them before a
        training loop may modify them."""
        parts = self._gather(pieces)
        chunks = []
        for piece in pieces:
            part = parts[piece.key]
            if self._plan.kind == "bag" and not isinstance(part, list):
                part = list(part)
            chunks.append(_slice(part, piece.start, piece.stop))
        if self._plan.kind == "dataframe" and fmt != "pandas":
            # Column views of each piece, joined in one copy per column.
            chunks = [_to_columns(chunk, self._plan.name, fmt) for chunk in chunks]
        data = _concat(chunks)
        if self._plan.kind == "array":
            data = np.asarray(data)
        # A bag's window is a new list (its items are the stored objects, as in dask.bag).
        return data, len(chunks) == 1 and self._plan.kind != "bag"

    def _gather(self, pieces: Sequence[_Piece]) -> dict[Key, Any]:
        unique = {p.key: p for p in pieces}
        values = self._read_local(list(unique))
        remote = [key for key in unique if key not in values]
        self._count("partitions_local", len(values))
        self._count("partitions_remote", len(remote))
        if remote:
            values.update(self._fetch_remote(remote, unique))
        return values

    def _read_local(self, keys: list[Key]) -> dict[Key, Any]:
        """The partitions among ``keys`` that this worker holds, without a copy; read on
        the worker's event loop, which owns its data."""
        from distributed.utils import sync

        worker = self._worker

        async def read() -> dict[Key, Any]:
            data = worker.data
            return {key: data[key] for key in keys if key in data}

        return sync(worker.loop, read)

    def _fetch_remote(self, keys: list[Key], unique: Mapping[Key, _Piece]) -> dict[Key, Any]:
        """Fetch partitions straight from the workers that hold them (not via the client)."""
        from distributed import Future

        client = self._client
        # A Future for a key the scheduler has forgotten would wait forever: check first.
        states = client.sync(client.scheduler.get_task_status, keys=keys)
        for key in keys:
            if states.get(key) is None:
                self._lost(unique[key])
        futures = [Future(key, client) for key in keys]
        # A Future made from a key does not tell the scheduler that this client wants the
        # key (distributed >= 2025), so it would never hear that the data is ready: tell it,
        # as Client.get_dataset does for the futures it unpickles.
        client._send_to_scheduler({"op": "client-desires-keys", "keys": keys})
        try:
            values = client.gather(futures, direct=True)
        except CancelledError as exc:
            key = next((f.key for f in futures if f.status in ("cancelled", "lost")), keys[0])
            self._lost(unique[key], exc)
        finally:
            for future in futures:
                future.release()
        return dict(zip(keys, values, strict=True))

    def _lost(self, piece: _Piece, cause: BaseException | None = None) -> None:
        raise DatasetPartitionLostError(
            self._plan.name, piece.partition, str(piece.key), piece.holders, self._plan.rank
        ) from cause

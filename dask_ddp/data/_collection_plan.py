"""Dask collections as training data: persisted once on the client, planned per attempt.

On the client, :func:`_persist_datasets` computes each collection passed in
``launch(..., datasets=)`` into the workers' memory and counts its rows; :class:`Persisted`
publishes the partitions for the job's supervisor, which holds them for the job's lifetime
(:class:`Datasets`, on the scheduler). For each attempt, :meth:`Datasets.plan` splits each
dataset's rows into one equal share per rank (:meth:`DatasetSpec.plan`,
:func:`_plan_pieces`), preferring partitions that already sit on the rank's worker. A rank
receives its :class:`_ShardPlan` (keys and row ranges, never data); the rank's side is
:mod:`dask_ddp.data._collection_shard`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dask_ddp.data._errors import (
    DatasetComputeError,
    DatasetPartitionLostError,
    DatasetTooSmallError,
    UnsupportedCollectionError,
)

if TYPE_CHECKING:
    from distributed import Client, Future

logger = logging.getLogger(__name__)

Key = Hashable  # a Dask key: str, bytes, int, float or a tuple of them


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


# -- persisted once on the client, planned per attempt by the job's supervisor -----------


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


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What the job's supervisor needs of one persisted dataset to split it between the
    ranks of each attempt: its partitions' keys and lengths, and the options. Small and
    picklable: it travels in the job's spec; the collection itself stays on the client."""

    name: str
    kind: str
    keys: tuple[Key, ...]
    lengths: tuple[int, ...]
    shuffle: bool
    seed: int
    drop_last: bool

    def plan(
        self, workers: Sequence[str], who_has: Mapping[Key, Sequence[str]], job_id: str
    ) -> list[_ShardPlan]:
        """One share per rank (on ``workers``), preferring partitions already there."""
        holders = [tuple(who_has.get(key, ())) for key in self.keys]
        shares = _plan_pieces(self.lengths, holders, workers, drop_last=self.drop_last)
        if shares is None:
            raise DatasetTooSmallError(self.name, sum(self.lengths), len(workers), self.drop_last)
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
                    _Piece(self.keys[i], i, start, stop, holders[i]) for i, start, stop in share
                ),
                rows=rows,
                total_rows=total,
                shuffle=self.shuffle,
                seed=self.seed,
                worker=workers[rank],
            )
            for rank, share in enumerate(shares)
        ]


def published_name(job_id: str) -> str:
    """The name a job's persisted partitions are published under, for its supervisor.

    >>> published_name("3f2a")
    'dask-ddp-data-3f2a'
    """
    return f"dask-ddp-data-{job_id}"


class Persisted:
    """The client's side: every collection of ``launch(datasets=)`` computed into the
    workers' memory and counted, then published (``Client.publish_dataset``) for the job's
    supervisor, which holds them from then on, for every attempt, until the job ends."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client, self.job_id = client, job_id
        self.specs: list[DatasetSpec] = []
        self.futures: list[list[Future]] = []

    @property
    def name(self) -> str:
        return published_name(self.job_id)

    def publish(self) -> None:
        """Hand the partitions to the cluster, then let go of this client's own hold."""
        self.client.publish_dataset(self.futures, name=self.name)
        self.release()

    def release(self) -> None:
        """Let go of the partitions (they leave the workers' memory unless held elsewhere)."""
        futures, self.futures = [f for fs in self.futures for f in fs], []
        _release(futures)


class Datasets:
    """The supervisor's side: a job's persisted datasets, split between the ranks of each
    attempt (:meth:`plan`) and released when the job ends."""

    def __init__(
        self, specs: Sequence[DatasetSpec], futures: list[list[Future]], name: str, job_id: str
    ) -> None:
        self.specs, self.futures, self.name, self.job_id = list(specs), futures, name, job_id

    @classmethod
    async def take(cls, client: Client, spec: Any) -> Datasets:
        """Bind the partitions the launching client published (``spec``: a JobSpec)."""
        futures = await client.get_dataset(spec.datasets_name)
        return cls(spec.datasets, futures, spec.datasets_name, spec.job_id)

    async def plan(self, client: Client, workers: Sequence[str]) -> list[dict[str, _ShardPlan]]:
        """Per rank (in rank order), its share of every dataset, placed on ``workers``.
        Waits for partitions being recomputed (their worker left); raises if one is lost."""
        from distributed import wait

        await wait([f for fs in self.futures for f in fs])
        for spec, futures in zip(self.specs, self.futures, strict=True):
            for i, fut in enumerate(futures):
                if fut.status == "error":
                    exc = await fut.exception()
                    raise DatasetComputeError(
                        spec.name, i, str(fut.key), f"{type(exc).__name__}: {exc}"
                    )
                if fut.status != "finished":  # lost, or cancelled by someone
                    raise DatasetPartitionLostError(spec.name, i, str(fut.key), (), None)
        who_has = await client.who_has([f for fs in self.futures for f in fs])
        per_rank: list[dict[str, _ShardPlan]] = [{} for _ in workers]
        for spec in self.specs:
            for rank, plan in enumerate(spec.plan(workers, who_has, self.job_id)):
                per_rank[rank][spec.name] = plan
        return per_rank

    async def release(self, client: Client) -> None:
        """The job ended: let go of the partitions."""
        futures, self.futures = [f for fs in self.futures for f in fs], []
        with contextlib.suppress(KeyError, OSError):  # gone already, or the cluster is closing
            await client.unpublish_dataset(self.name)
        if futures:
            logger.debug("%s: releasing %d dataset partitions", self.name, len(futures))
            _release(futures)


def _persist_datasets(client: Client, datasets: Mapping[str, Any], job_id: str) -> Persisted:
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
    persisted = Persisted(client, job_id)
    try:
        for name, source, kind in sources:
            parts = _delayed_partitions(name, source, kind)
            persisted.futures.append(client.compute(parts) if parts else [])
            logger.info(
                "job %s: dataset %r, a dask %s of %d partitions, computing into the workers' "
                "memory",
                job_id, name, kind, len(parts),
            )  # fmt: skip
        for (name, _, _), futures in zip(sources, persisted.futures, strict=True):
            _check(name, futures)
        for (name, source, kind), futures in zip(sources, persisted.futures, strict=True):
            counts = client.map(
                len,
                futures,
                key=[f"dask-ddp-{job_id}-{name}-len-{i}" for i in range(len(futures))],
                pure=False,
            )
            wait(counts)
            lengths = tuple(int(n) for n in client.gather(counts))
            keys = tuple(f.key for f in futures)
            spec = DatasetSpec(name, kind, keys, lengths, *_options(source))
            persisted.specs.append(spec)
    except BaseException:
        persisted.release()
        raise
    return persisted


def _options(source: CollectionSource) -> tuple[bool, int, bool]:
    return source.shuffle, source.seed, source.drop_last


def _check(name: str, futures: Sequence[Future]) -> None:
    """Wait until every partition is in memory; raise if one failed or is lost."""
    from distributed import wait

    wait(futures)
    for i, fut in enumerate(futures):
        if fut.status == "error":
            exc = fut.exception()
            raise DatasetComputeError(
                name, i, str(fut.key), f"{type(exc).__name__}: {exc}"
            ) from exc
        if fut.status != "finished":  # lost, or cancelled by someone
            raise DatasetPartitionLostError(name, i, str(fut.key), (), None)


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

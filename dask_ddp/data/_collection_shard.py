"""The rank's side of Dask collections as training data: :class:`DatasetShard`.

A rank's :class:`DatasetShard` (made by :func:`dask_ddp.get_dataset_shard` from the
:class:`~dask_ddp.data._collection_plan._ShardPlan` the client sent) reads its partitions
window by window, straight from the workers that hold them (its own worker's without a
copy), never through the client or the scheduler, and fetches the next window in the
background (:class:`~dask_ddp.data._prefetch.Prefetcher`) while the current one trains.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError
from typing import Any

import numpy as np

from dask_ddp._shared import dask_internals
from dask_ddp.data._collection_plan import Key, _Piece, _ShardPlan
from dask_ddp.data._errors import DatasetPartitionLostError
from dask_ddp.data._prefetch import Prefetcher

logger = logging.getLogger(__name__)

_FORMATS = {
    "dataframe": ("pandas", "numpy", "torch"),
    "array": ("numpy", "torch"),
    "bag": ("list", "torch"),
}


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


#: In a rank's own process, how it asks its worker for a window's rows (the worker holds
#: the partitions and the connections): ``load(plan, pieces, fmt) -> (rows, counts)``.
#: Set once, by the rank's process for itself (:func:`dask_ddp._rank.tasks.run_in_process`).
_load_in_worker: Callable[..., tuple[Any, dict[str, float]]] | None = None


def load_through_worker(load: Callable[..., tuple[Any, dict[str, float]]]) -> None:
    """Read windows through ``load`` (a rank's link to its worker) in this process."""
    global _load_in_worker
    _load_in_worker = load


class _Fetcher:
    """Reads pieces of partitions on a rank: from its own worker's memory when the
    partition is there, else straight from the worker that holds it. In a rank's own
    process, its worker reads them for it (:func:`load_through_worker`)."""

    def __init__(self, plan: _ShardPlan, count: Callable[[str, float], None]) -> None:
        self._plan, self._count = plan, count
        if _load_in_worker is None:
            from distributed import get_client, get_worker

            self._client, self._worker = get_client(), get_worker()

    def load(self, pieces: Sequence[_Piece], fmt: str) -> tuple[Any, bool]:
        """The window's rows, and whether they may share memory with a stored partition
        (a window of one piece: a view of it), so that the caller copies them before a
        training loop may modify them."""
        if _load_in_worker is not None:  # a copy of the worker's: nothing shared
            data, counts = _load_in_worker(self._plan, list(pieces), fmt)
            for name, n in counts.items():
                self._count(name, n)
            return data, False
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
        """The partitions among ``keys`` that this worker holds, without a copy."""
        return dask_internals.read_worker_data(self._worker, keys)

    def _fetch_remote(self, keys: list[Key], unique: Mapping[Key, _Piece]) -> dict[Key, Any]:
        """Fetch partitions straight from the workers that hold them (not via the client)."""
        from distributed import Future

        client = self._client
        # A Future for a key the scheduler has forgotten would wait forever: check first.
        states = dask_internals.task_states(client, keys)
        for key in keys:
            if states.get(key) is None:
                self._lost(unique[key])
        futures = [Future(key, client) for key in keys]
        # A Future made from a key does not tell the scheduler that this client wants it.
        dask_internals.desire_keys(client, keys)
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

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

Client side: :mod:`dask_ddp.data._collection_plan` (:class:`CollectionSource`,
:func:`_persist_datasets`). Rank side: :mod:`dask_ddp.data._collection_shard`
(:class:`DatasetShard`, made by :func:`dask_ddp.get_dataset_shard`). Errors:
:mod:`dask_ddp.data._errors`.
"""

from __future__ import annotations

from dask_ddp.data._collection_plan import CollectionSource
from dask_ddp.data._collection_shard import DatasetShard
from dask_ddp.data._errors import (
    DatasetComputeError,
    DatasetNotFoundError,
    DatasetPartitionLostError,
    DatasetTooSmallError,
    UnsupportedCollectionError,
)

__all__ = [
    "CollectionSource",
    "DatasetComputeError",
    "DatasetNotFoundError",
    "DatasetPartitionLostError",
    "DatasetShard",
    "DatasetTooSmallError",
    "UnsupportedCollectionError",
]

"""The sampler and a sharded dataset talk through one protocol (data/_sampler.py)."""

from __future__ import annotations

from collections.abc import Sequence

from dask_ddp.data import DistributedChunkedSampler
from dask_ddp.data._sampler import ShardedDataset


class _Shards:
    """A dataset of three shards of 4, 3 and 5 samples that records what it is told."""

    shard_offsets = (0, 4, 7)

    def __init__(self) -> None:
        self.orders: list[list[int] | None] = []
        self.prefetches = 0

    def __len__(self) -> int:
        return 12

    def set_shard_order(self, order: Sequence[int] | None) -> None:
        self.orders.append(None if order is None else list(order))

    def start_prefetch(self) -> None:
        self.prefetches += 1


def _shard_of(i: int) -> int:
    return 0 if i < 4 else 1 if i < 7 else 2


def test_a_sharded_dataset_gets_each_epochs_order_and_a_prefetch_start() -> None:
    ds = _Shards()
    assert isinstance(ds, ShardedDataset)
    sampler = DistributedChunkedSampler(ds, num_replicas=1, rank=0, seed=5)
    assert ds.prefetches == 0  # nothing is downloaded before an epoch starts
    told = len(ds.orders)
    first = list(sampler)
    assert ds.prefetches == 1
    assert ds.orders[told - 1] == list(dict.fromkeys(_shard_of(i) for i in first))
    assert sorted(first) == list(range(12))  # every index once
    # Read to its end, the epoch is over: the dataset hears the next one's order.
    assert sampler.epoch == 1 and len(ds.orders) == told + 1
    sampler.set_epoch(1)
    assert ds.prefetches == 2
    told = len(ds.orders)
    second = list(sampler)
    assert ds.orders[told - 1] == list(dict.fromkeys(_shard_of(i) for i in second))
    # Chunks follow the shards: a shard's indices come together.
    assert len(ds.orders[told - 1]) == 3


def test_two_ranks_share_the_shards_and_each_index_once() -> None:
    seen = []
    for rank in (0, 1):
        ds = _Shards()
        sampler = DistributedChunkedSampler(ds, num_replicas=2, rank=rank, seed=1)
        told = ds.orders[-1]
        mine = list(sampler)
        seen += mine
        assert told == list(dict.fromkeys(_shard_of(i) for i in mine))
    assert sorted(seen) == list(range(12))


def test_a_plain_sized_dataset_is_not_sharded() -> None:
    plain = list(range(12))
    assert not isinstance(plain, ShardedDataset)
    sampler = DistributedChunkedSampler(plain, num_replicas=1, rank=0, chunksize=4)
    assert sorted(sampler) == list(range(12))

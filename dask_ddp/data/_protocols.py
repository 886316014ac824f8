"""What :class:`~dask_ddp.data.DistributedChunkedSampler` needs from a dataset.

The sampler works on any sized dataset. A dataset that also says where its shards start
and accepts a reading order (:class:`ShardedDataset`, as
:class:`~dask_ddp.data.ShardListDataset` does) gets chunks that follow its shards, is told
each epoch's shard order, and starts downloading the first shards when the epoch starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class ShardedDataset(Protocol):
    """A dataset stored in shards, read best in shard order.

    Examples
    --------
    >>> class Two:
    ...     shard_offsets = [0, 10]
    ...     def __len__(self): return 20
    ...     def set_shard_order(self, order): self.order = order
    ...     def start_prefetch(self): pass
    >>> isinstance(Two(), ShardedDataset)
    True
    """

    #: The index of each shard's first sample, in shard order (``[0, n0, n0 + n1, ...]``).
    shard_offsets: Sequence[int]

    def __len__(self) -> int: ...

    def set_shard_order(self, order: Sequence[int] | None) -> None:
        """The shards (positions in ``shard_offsets``) in the order they will be read."""

    def start_prefetch(self) -> None:
        """Start fetching the first shards of the order, in the background."""

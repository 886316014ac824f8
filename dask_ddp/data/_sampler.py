"""DistributedChunkedSampler: each rank's equal share of a dataset's indices, in contiguous
chunks (a shard each), shuffled per epoch.

The sampler works on any sized dataset. A dataset that also says where its shards start
and accepts a reading order (:class:`ShardedDataset`, as
:class:`~dask_ddp.data.ShardListDataset` does) gets chunks that follow its shards, is told
each epoch's shard order, and starts downloading the first shards when the epoch starts.

Rank and world size come from the caller, or from ``torch.distributed`` when a process
group is initialised (as torch's ``DistributedSampler``); the sampler knows nothing else
of dask_ddp.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Iterator, Sequence, Sized
from typing import Literal, Protocol, runtime_checkable

import numpy as np
from torch.utils.data import Sampler

logger = logging.getLogger("dask_ddp.data.shards")


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


Partition = Literal["fixed", "shuffled"]

_DEFAULT_CHUNK = 1000
"""Sampler chunk size when the dataset does not say where its shards start."""


class DistributedChunkedSampler(Sampler[int]):
    """Give each rank an equal share of a dataset's indices, in contiguous chunks.

    The indices are cut into chunks (by default one per shard of a
    :class:`ShardListDataset`, or ``chunksize`` consecutive indices); each epoch the
    chunks are visited in a shuffled order and the indices within each chunk shuffled,
    so that a process reads one shard after another instead of jumping between them. The
    order depends only on ``seed`` and the epoch set with :meth:`set_epoch`, so every
    rank computes its share without talking to the others, and a rerun repeats it.

    Like :class:`torch.utils.data.DistributedSampler`, every rank gets the same number of
    indices: ``ceil(len / num_replicas)``, a few repeated (padding), or with
    ``drop_last=True`` ``floor(len / num_replicas)``, a few left out that epoch. Call
    :meth:`set_epoch` before each epoch; as with wids's sampler, an epoch read to its end
    moves the sampler to the next one, so a loop that never calls it still reshuffles.

    Parameters
    ----------
    dataset : sized
        The dataset (only its length, and its ``shard_offsets`` if present, are used).
    num_replicas : int, optional
        The number of ranks. Default: the ``torch.distributed`` world size when a process
        group is initialised (inside a dask_ddp rank it is), else 1.
    num_samples : int, optional
        Use only the dataset's first ``num_samples`` indices (wids's argument; the
        attribute ``num_samples`` is the count per rank, as in ``DistributedSampler``).
    rank : int, optional
        This rank, ``0 <= rank < num_replicas``. Default: as ``num_replicas``, else 0.
    shuffle : bool, default True
        Shuffle the chunk order and the order within chunks each epoch. False: indices in
        order.
    shufflefirst : bool, optional
        ``False``: the first epoch (0) visits the chunks in order, shuffling only within
        them, as wids does by default. Default (None or True): chunks shuffled from the
        first epoch.
    seed : int, default 0
        The same on every rank.
    drop_last : bool, default False
        Leave out the indices that do not divide evenly instead of repeating some (None,
        wids's default, is False). Unlike wids, every rank gets the same number of
        indices, so that DDP's ranks run the same number of steps.
    chunksize : int, optional
        The most indices in one chunk. Default: one chunk per shard if the dataset has
        ``shard_offsets`` (a :class:`ShardListDataset`), else 1000. Given with a
        :class:`ShardListDataset`, shards are cut into pieces of at most ``chunksize``.
    partition : {"fixed", "shuffled"}, default "fixed"
        ``"fixed"``: rank ``r`` always gets the ``r``-th contiguous range of indices
        (shuffled within it each epoch, as wids's sampler does), so each host downloads
        only its share of the shards, once; the cache can be as small as that share.
        ``"shuffled"``: each epoch the chunks of the whole dataset are shuffled and dealt
        to the ranks in contiguous runs, so a rank sees different samples every epoch, as
        with ``DistributedSampler``; a host then reads about all shards over a few epochs.

    Attributes
    ----------
    num_samples : int
        Indices per rank per epoch (``len(sampler)``).
    total_size : int
        ``num_samples * num_replicas``.
    epoch : int
        The epoch the next iteration shuffles for.

    Examples
    --------
    >>> sampler = DistributedChunkedSampler(range(10), num_replicas=2, rank=1, chunksize=3)
    >>> len(sampler), sorted(sampler)
    (5, [5, 6, 7, 8, 9])
    >>> list(DistributedChunkedSampler(range(10), num_replicas=2, rank=1, shuffle=False))
    [5, 6, 7, 8, 9]
    >>> sampler.set_epoch(1)  # call before each epoch, as with DistributedSampler
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int | None = None,
        num_samples: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        shufflefirst: bool | None = None,
        seed: int = 0,
        drop_last: bool | None = False,
        chunksize: int | None = None,
        partition: Partition = "fixed",
    ) -> None:
        if num_replicas is None or rank is None:
            default_rank, default_world = _default_rank_and_world()
            num_replicas = default_world if num_replicas is None else num_replicas
            rank = default_rank if rank is None else rank
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas= must be an int >= 1, got {num_replicas!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank= must be an int in [0, {num_replicas - 1}] for num_replicas="
                f"{num_replicas}, got {rank!r}"
            )
        if chunksize is not None and (not isinstance(chunksize, int) or chunksize < 1):
            raise ValueError(f"chunksize= must be an int >= 1, got {chunksize!r}")
        if partition not in ("fixed", "shuffled"):
            raise ValueError(f"partition= must be 'fixed' or 'shuffled', got {partition!r}")
        n = len(dataset)
        if num_samples is not None:
            if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
                raise ValueError(f"num_samples= must be an int >= 1, got {num_samples!r}")
            n = min(n, num_samples)
        drop_last = bool(drop_last)  # wids's None: not dropping
        if n < 1:
            raise ValueError("the dataset is empty; a sampler needs at least one index")
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.shufflefirst = shufflefirst
        self.partition: Partition = partition
        self.epoch = 0
        self._n = n
        if drop_last:
            self.num_samples = n // num_replicas
        else:
            self.num_samples = -(-n // num_replicas)
        self.total_size = self.num_samples * num_replicas
        offsets = getattr(dataset, "shard_offsets", None)
        if chunksize is None and offsets is None:
            chunksize = _DEFAULT_CHUNK
        self._chunks = _chunks(n, list(offsets) if offsets is not None else [0], chunksize)
        self.chunksize = chunksize
        self._offsets = np.asarray(offsets if offsets is not None else [0])
        self._dataset = dataset if isinstance(dataset, ShardedDataset) else None
        self._computed: tuple[int, np.ndarray] | None = None
        self._share_order()

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which seeds this epoch's order on every rank.

        With a :class:`ShardListDataset`, this also tells the dataset the order of the
        shards this epoch (:meth:`ShardListDataset.set_shard_order`) and starts
        downloading the first of them in this process, in the background, while the
        DataLoader starts its workers; each reading process then downloads the next
        shard while it reads one. Call it in the process that trains (the rank), as
        ``DistributedSampler.set_epoch``.
        """
        self.epoch = int(epoch)
        self._share_order()
        self._start_prefetch()

    def _start_prefetch(self) -> None:
        """Have the dataset start downloading this epoch's first shards, here."""
        if self._dataset is not None:
            self._dataset.start_prefetch()

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        order = self._order().tolist()
        self._start_prefetch()
        return self._then_next_epoch(order)

    def _then_next_epoch(self, order: list[int]) -> Iterator[int]:
        """Yield ``order``; once all of it is read, move to the next epoch, as wids's
        sampler does (``set_epoch`` still decides: it is called before the next epoch).
        An iterator dropped unread (the DataLoader makes one it never reads) moves nothing.
        """
        yield from order
        self.epoch += 1
        self._share_order()

    def _order(self) -> np.ndarray:
        """This epoch's indices for this rank (computed once per epoch)."""
        if self._computed is None or self._computed[0] != self.epoch:
            order = self._fixed() if self.partition == "fixed" else self._shuffled()
            self._computed = (self.epoch, order)
        return self._computed[1]

    def _share_order(self) -> None:
        if self._dataset is None:
            return
        shards = np.searchsorted(self._offsets, self._order(), side="right") - 1
        if len(shards):
            shards = shards[np.concatenate([[True], shards[1:] != shards[:-1]])]
        self._dataset.set_shard_order(shards.tolist())

    def _permuted(self, lo: int, hi: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(lo, hi)
        return lo + self._rng(lo).permutation(hi - lo)

    def _chunk_order(self, count: int, salt: int) -> np.ndarray:
        if not self.shuffle or (self.epoch == 0 and self.shufflefirst is False):
            return np.arange(count)
        return self._rng(salt).permutation(count)

    def _rng(self, salt: int) -> np.random.Generator:
        mask = 2**64 - 1  # SeedSequence takes non-negative ints; seeds may be negative
        return np.random.default_rng([self.seed & mask, self.epoch & mask, salt])

    def _fixed(self) -> np.ndarray:
        n, w, r = self._n, self.num_replicas, self.rank
        q, rem = divmod(n, w)
        lo = r * q + min(r, rem)
        hi = lo + q + (1 if r < rem else 0)
        pieces = [(max(a, lo), min(b, hi)) for a, b in self._chunks if a < hi and b > lo]
        # salt n + r: an order of this rank's pieces, unlike any chunk's own seed
        order = self._chunk_order(len(pieces), n + r)
        parts = [self._permuted(*pieces[k]) for k in order]
        mine = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if len(mine) >= self.num_samples:
            return mine[: self.num_samples]  # drop_last: leaves out this epoch's last one
        if len(mine) == 0:  # fewer indices than ranks
            return np.full(self.num_samples, r % n, dtype=np.int64)
        return np.resize(mine, self.num_samples)  # pad by repeating this epoch's first ones

    def _shuffled(self) -> np.ndarray:
        """This rank's slice of the epoch's sequence: every chunk, in a shuffled order.

        Only the chunks overlapping the slice are permuted; the sequence is the same on
        every rank because each chunk's order depends on (seed, epoch, chunk) alone.
        """
        n = self._n
        order = self._chunk_order(len(self._chunks), n)
        chunks = [self._chunks[k] for k in order]
        starts = [0, *itertools.accumulate(b - a for a, b in chunks)]
        pos, end = self.rank * self.num_samples, (self.rank + 1) * self.num_samples
        out: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        while pos < end:
            p = pos % n  # padding wraps around to the epoch's first indices
            k = bisect.bisect_right(starts, p) - 1
            a, b = chunks[k]
            offset = p - starts[k]
            take = min(b - a - offset, end - pos)
            out.append(self._permuted(a, b)[offset : offset + take])
            pos += take
        return np.concatenate(out)

    def __repr__(self) -> str:
        return (
            f"DistributedChunkedSampler({self._n} indices, rank {self.rank}/{self.num_replicas},"
            f" {len(self._chunks)} chunks, partition={self.partition!r}, seed={self.seed}, "
            f"epoch={self.epoch})"
        )


def _chunks(n: int, offsets: list[int], chunksize: int | None) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges covering ``range(n)``: cut at ``offsets``, at most ``chunksize``.

    >>> _chunks(10, [0, 4], None)
    [(0, 4), (4, 10)]
    >>> _chunks(10, [0, 4], 3)
    [(0, 3), (3, 4), (4, 7), (7, 10)]
    """
    bounds = sorted({o for o in offsets if 0 < o < n} | {0, n})
    chunks = []
    for lo, hi in itertools.pairwise(bounds):
        step = chunksize or hi - lo
        chunks.extend((a, min(a + step, hi)) for a in range(lo, hi, step))
    return chunks


def _default_rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` from torch.distributed, else ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    logger.info(
        "DistributedChunkedSampler: no torch.distributed process group here; reading every "
        "index as rank 0 of 1 (pass num_replicas= and rank= to choose)"
    )
    return 0, 1

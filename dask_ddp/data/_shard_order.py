"""Which shard when: the reading order a sampler announces, and the background download of
the next shards (:class:`_ShardOrder`, on :class:`~dask_ddp.data._prefetch.Prefetcher`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import partial

from dask_ddp.data._prefetch import Prefetcher

logger = logging.getLogger("dask_ddp.data.shards")


class _ShardOrder:
    """The part of :class:`~dask_ddp.data.ShardListDataset` that knows the shard order
    and keeps the next ``prefetch`` shards downloading while one is read."""

    def set_shard_order(self, order: Sequence[int] | None) -> None:
        """Say in which order the shards will be read, so that workers download ahead.

        :class:`DistributedChunkedSampler` calls this for you (at construction and in
        ``set_epoch``), before the DataLoader starts its workers, and starts the
        download of the first shards in ``set_epoch`` and when the DataLoader iterates
        it (in the rank's process, while the workers start). Each process that reads
        samples (a DataLoader worker started afterwards, or the rank itself with
        ``num_workers=0``) keeps the next ``prefetch`` shards of ``order`` downloading in
        a background thread while it reads the current one. It stops prefetching when
        its reads leave the order (a stale order in ``persistent_workers``, another
        sampler).

        Parameters
        ----------
        order : sequence of int, or None
            Shard numbers (positions in :attr:`shards`), in reading order; None forgets it.

        Examples
        --------
        >>> ds.set_shard_order([4, 0, 7, 2])  # doctest: +SKIP
        """
        if order is None:
            self._plan = None
            return
        plan = tuple(int(k) for k in order)
        bad = [k for k in plan if not 0 <= k < len(self._shards)]
        if bad:
            raise ValueError(
                f"set_shard_order() got shard {bad[0]}, but there are shards 0 to "
                f"{len(self._shards) - 1}"
            )
        self._plan = plan
        self._plan_pos = 0

    def _advance_plan(self, s: int) -> None:
        """Shard ``s`` is being opened: queue the next ones of the plan for download."""
        plan = self._plan
        if plan is None or not self.prefetch or self._protocol == "file":
            return
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self._prefetch, name="shards", keep_results=False)
        try:
            pos = plan.index(s, self._plan_pos)
        except ValueError:
            logger.debug(
                "process %d read shard %d, which its shard order does not list next; "
                "prefetching stops",
                os.getpid(),
                s,
            )
            self._plan = None
            self._prefetcher.want([])
            return
        self._plan_pos = pos
        self._prefetcher.want([k for k in plan[pos + 1 : pos + 1 + self.prefetch] if k != s])

    def start_prefetch(self) -> None:
        """Start downloading the order's first shards (a new epoch is starting).

        The sampler calls this in the rank's process from ``set_epoch`` and when it is
        iterated: the downloads run on the process's warm connection while the DataLoader
        starts its workers, who find the shards on disk or being written; without
        workers, this is the reading process's own prefetch.
        """
        plan = self._plan
        if plan is None or not self.prefetch or self._protocol == "file":
            return
        self._this_process()
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self._prefetch, name="shards", keep_results=False)
        self._plan_pos = 0
        self._prefetcher.want(list(plan[: 1 + self.prefetch]))

    def wait_prefetched(self, timeout: float | None = None) -> bool:
        """Wait until the shards being prefetched in this process are downloaded (or have
        failed; the read that needs one raises its error); True at once when none are.

        Examples
        --------
        >>> ds.start_prefetch(); ds.wait_prefetched(60)  # doctest: +SKIP
        True
        """
        prefetcher = self._prefetcher
        return True if prefetcher is None else prefetcher.wait_idle(timeout)

    @property
    def prefetching(self) -> bool:
        """Whether this process is downloading shards ahead of its reads right now."""
        return self._prefetcher is not None and self._prefetcher.busy

    @property
    def shard_order(self) -> tuple[int, ...] | None:
        """The shard order given to :meth:`set_shard_order`, or None."""
        return self._plan

    def _prefetch(self, s: int) -> None:
        """Download shard ``s`` into the host's cache unless it is there (prefetch thread)."""
        if s in self._indexes and self._local_cache().path(self._cache_key(s)).exists():
            return
        f, _ = self._local_cache().open_file(self._cache_key(s), partial(self._download, s))
        f.close()

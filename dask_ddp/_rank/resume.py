"""Where a rank's state comes from when its function asks for it (:func:`dask_ddp.get_checkpoint`).

The job's supervisor decides, for each attempt, which copy of the last checkpoint each rank
reads (:class:`~dask_ddp._rank.slot.Restore`, in the rank's spec): the replica in a surviving
peer's memory, or the durable copy in the store. :class:`Resumer` follows that plan, and
falls back to the store when the plan cannot be followed: the replica's worker left since,
the replica was dropped, or the store holds a newer checkpoint than the supervisor knew of
(the writer died before it could say so). It then tells the supervisor where the state
really came from (a ``LOADED`` event), which ``Job.history`` shows.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from .._shared.protocol import LOADED, Restore
from . import checkpoint
from .replicas import PeerLink
from .slot import CheckpointSettings

logger = logging.getLogger(__name__)

__all__ = ["Resumer"]


class Resumer:
    """Loads one rank's checkpoints for one run of its function.

    Parameters
    ----------
    settings : CheckpointSettings
        Where the job's checkpoints are, and the supervisor's plan (``restore``).
    rank, world_size : int
        The rank loading, and how many ranks the job has now.
    device : torch.device or str
        Where loaded tensors go.
    peer : PeerLink, optional
        The way to the replica stores (None: the store only).
    announce : callable
        ``announce(kind, body)`` tells the job (the rank's channel's ``put``).

    Examples
    --------
    >>> import tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> _ = checkpoint.write({"w": torch.ones(2)}, d, step=4)
    >>> told = []
    >>> r = Resumer(CheckpointSettings(d), rank=0, world_size=1, device="cpu",
    ...             announce=lambda kind, body: told.append(body[:2]))
    >>> r.load()["w"].tolist(), told
    ([1.0, 1.0], [['store', 4]])
    """

    def __init__(
        self,
        settings: CheckpointSettings,
        *,
        rank: int,
        world_size: int,
        device: Any,
        peer: PeerLink | None = None,
        announce: Callable[[str, list[Any]], None],
    ) -> None:
        self.settings, self.rank, self.world_size, self.device = settings, rank, world_size, device
        self._peer, self._announce = peer, announce

    def load(self, *, per_rank: bool = False, rank: int | None = None) -> Any:
        """The newest checkpoint of the job's state, or of rank ``rank``'s own state
        (``per_rank``; this rank's by default), on this rank's device; None if none."""
        settings = self.settings
        if settings.directory is None:
            return None
        own = per_rank and rank in (None, self.rank)
        writer = self.rank if own else (rank if per_rank else 0)
        plan = self._plan(per_rank, writer) if (own or not per_rank) else None
        if plan is not None and plan.source == "peer":
            state = self._from_peer(plan, per_rank)
            if state is not None:
                return state[1]
        if per_rank:
            found = checkpoint.latest_shard(
                settings.directory,
                writer,
                self.world_size if own else None,
                map_location=self.device,
                storage_options=settings.storage_options,
            )
        else:
            found = checkpoint.latest(
                settings.directory,
                map_location=self.device,
                storage_options=settings.storage_options,
            )
        if found is None:
            return None
        self._tell("store", found[0], settings.directory)
        return found[1]

    def _plan(self, per_rank: bool, writer: int) -> Restore | None:
        for plan in self.settings.restore:
            if (plan.world_size is not None) == per_rank and plan.writer == writer:
                return plan
        return None

    def _newest_durable(self, per_rank: bool) -> int | None:
        settings = self.settings
        if per_rank:
            complete = checkpoint.complete_shards(settings.directory, settings.storage_options)
            steps = [s for s, world, _ in complete if world == self.world_size]
        else:
            steps = [s for s, _ in checkpoint.list_checkpoints(
                settings.directory, settings.storage_options
            )]  # fmt: skip
        return max(steps, default=None)

    def _from_peer(self, plan: Restore, per_rank: bool) -> tuple[int, Any] | None:
        """``(step, state)`` from the replica the plan names, or None (then the store).

        The store is listed while the replica travels (a fresh worker's first listing
        costs as much as a fetch): a newer durable checkpoint than the plan's wins.
        """
        why = "it is no longer there"
        data = None
        with concurrent.futures.ThreadPoolExecutor(1, "dask-ddp-list") as lister:
            listed = lister.submit(self._newest_durable, per_rank)
            if self._peer is not None:
                try:
                    data = self._peer.fetch(plan.holder, plan.writer, plan.world_size, plan.step)
                except (OSError, TimeoutError) as exc:  # the holder left meanwhile
                    why = f"{type(exc).__name__}: {exc}"
            newest = listed.result()
        if newest is not None and newest > plan.step:
            logger.info(
                "rank %d: the store holds the checkpoint of step %d, newer than %s; loading "
                "that one", self.rank, newest, plan.describe(),
            )  # fmt: skip
            return None
        if data is None:
            logger.warning(
                "rank %d: could not read %s (%s); loading the checkpoint from %s instead",
                self.rank, plan.describe(), why, self.settings.directory,
            )  # fmt: skip
            return None
        state = checkpoint.load(data, plan.url or plan.describe(), map_location=self.device)
        self._tell("peer", plan.step, plan.holder)
        logger.info("rank %d: resumed from %s", self.rank, plan.describe())
        return plan.step, state

    def _tell(self, source: str, step: int, where: str | None) -> None:
        try:
            self._announce(LOADED, [source, step, where])
        except Exception as exc:  # the channel's own error is raised where it matters
            logger.debug("rank %d: could not say where its state came from: %s", self.rank, exc)

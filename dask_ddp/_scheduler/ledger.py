"""What a job's supervisor knows of its checkpoints, and where each new attempt resumes from.

The ranks tell the supervisor (in the clear part of their events, :mod:`dask_ddp._rank.channel`)
each checkpoint that became durable and each replica a peer's memory took.
:class:`CheckpointLedger` keeps that, and :meth:`CheckpointLedger.plan` decides, when the
job is placed again after a restart or a resize, which copy each rank reads: the replica in
a surviving worker's memory when it holds the newest durable checkpoint, else the durable
copy in the store. Pure: the supervisor passes the workers alive.
"""

from __future__ import annotations

from collections.abc import Container

from .._shared.protocol import Restore

__all__ = ["CheckpointLedger", "describe_sources", "writer_rank"]

_STEPS_KEPT = 16  # durable steps remembered per kind of checkpoint


def describe_sources(sources: set[str]) -> str | None:
    """The sources of an attempt's state in one word, as ``Job.history`` shows them.

    >>> describe_sources({"peer"}), describe_sources({"store", "peer"}), describe_sources(set())
    ('peer', 'peer+store', None)
    """
    return "+".join(sorted(sources)) or None


def writer_rank(rank: int, world_size: int | None) -> int:
    """The rank a checkpoint is filed under: its own for per-rank state (``world_size``
    given), 0 for the job's state, whichever rank reported it."""
    return rank if world_size is not None else 0


class CheckpointLedger:
    """A job's durable checkpoints and replicas, across its attempts.

    Checkpoints of the job's state (rank 0's) and of per-rank state are kept apart:
    ``world_size`` None, or the number of ranks that each wrote their own file.

    Examples
    --------
    >>> ledger = CheckpointLedger()
    >>> ledger.landed(0, "s3://b/r/checkpoint-000000000010.pt", 10, None)
    >>> ledger.replicated(0, 10, "tcp://w2:1", None)
    >>> plans, source, step = ledger.plan(2, alive={"tcp://w2:1"})
    >>> source, step, plans[1][0].holder
    ('peer', 10, 'tcp://w2:1')
    >>> ledger.plan(2, alive=set())[1:]
    ('store', 10)
    """

    def __init__(self) -> None:
        # world size (None: the job's state) -> step -> writer rank -> url
        self.durable: dict[int | None, dict[int, dict[int, str]]] = {}
        # (world size, writer rank) -> (step, holder)
        self.replicas: dict[tuple[int | None, int], tuple[int, str]] = {}

    def landed(self, rank: int, url: str, step: int, world_size: int | None) -> None:
        """Rank ``rank``'s checkpoint of ``step`` is durable at ``url``."""
        writer = writer_rank(rank, world_size)
        steps = self.durable.setdefault(world_size, {})
        steps.setdefault(step, {})[writer] = url
        for old in sorted(steps)[:-_STEPS_KEPT]:
            del steps[old]

    def replicated(self, rank: int, step: int, holder: str, world_size: int | None) -> str | None:
        """Rank ``rank``'s checkpoint of ``step`` is in ``holder``'s memory too; return the
        worker that held its replica before, if it is another one (to drop it there)."""
        key = (world_size, writer_rank(rank, world_size))
        before = self.replicas.get(key)
        self.replicas[key] = (step, holder)
        return before[1] if before is not None and before[1] != holder else None

    def found(self, writer: int, world_size: int | None, step: int, holder: str) -> bool:
        """``holder`` says it keeps ``writer``'s replica of ``step`` (the writer's own word
        may have died with its worker): record it if that checkpoint is known durable and
        newer than the replica known; return whether it was.

        >>> ledger = CheckpointLedger()
        >>> ledger.landed(0, "s3://b/r/checkpoint-000000000010.pt", 10, None)
        >>> ledger.found(0, None, 10, "tcp://w2:1"), ledger.found(0, None, 12, "tcp://w2:1")
        (True, False)
        """
        key = (world_size, writer_rank(writer, world_size))
        known = self.replicas.get(key)
        durable = writer in self.durable.get(world_size, {}).get(step, {})
        if not durable or (known is not None and known[0] >= step):
            return False
        self.replicas[key] = (step, holder)
        return True

    def holders(self) -> set[str]:
        """Every worker holding a replica of the job."""
        return {holder for _, holder in self.replicas.values()}

    def plan(
        self, world_size: int, alive: Container[str]
    ) -> tuple[list[tuple[Restore, ...]], str | None, int | None]:
        """Where each of ``world_size`` new ranks reads the last checkpoint: the per-rank
        plans, and in one word where the state comes from (``"peer"``, ``"store"``,
        ``"peer+store"``; None when no checkpoint is known) and its step."""
        plans: list[list[Restore]] = [[] for _ in range(world_size)]
        job_state = self._job_state(alive)
        if job_state is not None:
            for plan in plans:
                plan.append(job_state)
        shards = self._shards(world_size, alive)
        for rank, shard in enumerate(shards):
            plans[rank].append(shard)
        used = [r for plan in plans for r in plan]
        step = job_state.step if job_state is not None else (shards[0].step if shards else None)
        return [tuple(p) for p in plans], describe_sources({r.source for r in used}), step

    def _job_state(self, alive: Container[str]) -> Restore | None:
        steps = self.durable.get(None)
        if not steps:
            return None
        step = max(steps)
        url = steps[step].get(0)
        replica = self.replicas.get((None, 0))
        if replica is not None and replica[0] == step and replica[1] in alive:
            return Restore(step, "peer", 0, None, holder=replica[1], url=url)
        return Restore(step, "store", 0, None, url=url)

    def _shards(self, world_size: int, alive: Container[str]) -> list[Restore]:
        steps = self.durable.get(world_size, {})
        complete = [s for s, files in steps.items() if len(files) == world_size]
        if not complete:
            return []
        step = max(complete)
        out = []
        for rank in range(world_size):
            url = steps[step][rank]
            replica = self.replicas.get((world_size, rank))
            if replica is not None and replica[0] == step and replica[1] in alive:
                out.append(Restore(step, "peer", rank, world_size, holder=replica[1], url=url))
            else:
                out.append(Restore(step, "store", rank, world_size, url=url))
        return out

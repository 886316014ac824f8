"""The contract between the scheduler's supervisor and the ranks: what one sends the other.

Both wings import this module and nothing of each other: the scheduler wing (plugin,
supervisor, pool, launcher, ledger, page) plans ranks and reads what they say; the rank
wing (bootstrap, context, slot, the event sender, checkpoint saving) runs them. What
travels between them is defined here, as records with named fields:

- :class:`RankOutcome`: how a rank ended, decided by the rank from the exception object
  itself (its class, and whether it earns a restart): the supervisor reads the
  :class:`Verdict`, never an exception's text.
- :class:`Restore`: where a rank of a new attempt reads the last checkpoint.
- task keys (:func:`rank_key`), event topics (:func:`job_topic`) and the names an attempt's
  futures are published under (:func:`dataset_name`).

Each record has a ``to_wire``/``from_wire`` pair of plain values (msgpack-able) with a
version, :data:`VERSION`: a reader refuses a record of a newer version than it knows
rather than misreading it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = [
    "VERSION",
    "RankOutcome",
    "Restore",
    "Verdict",
    "WireVersionError",
    "dataset_name",
    "job_topic",
    "run_id_of",
]

#: The version of the records below; a reader takes records of this version or older.
VERSION = 1


class WireVersionError(ValueError):
    """A record of a newer version than this side of the cluster knows (two dask-ddp
    versions on one cluster)."""

    def __init__(self, kind: str, version: Any) -> None:
        super().__init__(kind, version)
        self.kind, self.version = kind, version

    def __str__(self) -> str:
        return (
            f"a {self.kind} record of version {self.version} arrived, but this dask-ddp reads "
            f"up to version {VERSION}: install the same dask-ddp on the client, the scheduler "
            "and the workers"
        )


def _check_version(kind: str, data: dict[str, Any]) -> None:
    version = data.get("v", VERSION)
    if not isinstance(version, int) or version > VERSION:
        raise WireVersionError(kind, version)


class Verdict(str, enum.Enum):
    """What a rank's end means for its job, as the rank decided it.

    - ``done``: the function returned.
    - ``grow``: an elastic job's ranks stopped at a checkpoint to grow onto more workers.
    - ``stopped``: stopped from outside (the job was cancelled or is being stopped), or
      because another rank failed first (:attr:`RankOutcome.failed_rank`).
    - ``retry``: failed with an error that earns a restart from the last checkpoint:
      :class:`~dask_ddp.RetryableError`, or an :class:`~dask_ddp.InfrastructureError`
      (what runs the job failed, not the job's code).
    - ``fail``: failed with any other error.

    >>> Verdict("retry").failed, Verdict.STOPPED.failed
    (True, False)
    """

    DONE = "done"
    GROW = "grow"
    STOPPED = "stopped"
    RETRY = "retry"
    FAIL = "fail"

    @property
    def failed(self) -> bool:
        """Whether the rank itself failed (its own error)."""
        return self in (Verdict.RETRY, Verdict.FAIL)


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    """How one rank ended, carried by its final marker to the supervisor and the clients.

    Attributes
    ----------
    verdict : Verdict
        What it means for the job (decided on the rank, from the exception object).
    error_class : str or None
        The exception's class, ``module.QualName`` (``"builtins.ValueError"``).
    summary : str
        The error in one line for people (``"ValueError: bad batch"``); never parsed.
    traceback : str
        The rank's traceback, in the user's own frames.
    failed_rank : int or None
        ``stopped``: the rank that failed first, if another rank's failure stopped it.
    peer_lost : bool
        ``stopped``: a collective failed because a peer's connection closed while no rank
        had recorded an error (the peer's process died).
    step : int or None
        ``grow``: the step of the checkpoint the ranks stopped at.

    Examples
    --------
    >>> o = RankOutcome(Verdict.FAIL, "builtins.ValueError", "ValueError: bad batch")
    >>> RankOutcome.from_wire(o.to_wire()) == o
    True
    >>> RankOutcome(Verdict.STOPPED, failed_rank=1, summary="ValueError: x").describe()
    'stopped: rank 1 failed'
    """

    verdict: Verdict
    error_class: str | None = None
    summary: str = ""
    traceback: str = ""
    failed_rank: int | None = None
    peer_lost: bool = False
    step: int | None = None

    def describe(self) -> str:
        """How the rank ended, as its row in the views says it."""
        if self.verdict.failed:
            return f"failed: {self.summary}"
        if self.verdict is Verdict.STOPPED:
            if self.failed_rank is not None:
                return f"stopped: rank {self.failed_rank} failed"
            return f"stopped: {self.summary}"
        if self.verdict is Verdict.GROW:
            return f"stopped: the job resizes at step {self.step}"
        return "finished"

    def to_wire(self) -> dict[str, Any]:
        """Plain values with the record's version."""
        return {"v": VERSION, **dataclasses.asdict(self), "verdict": self.verdict.value}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> RankOutcome:
        """The outcome :meth:`to_wire` described.

        Raises
        ------
        WireVersionError
            The record is of a newer version than this dask-ddp reads.
        """
        _check_version("rank outcome", data)
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        return cls(**{**values, "verdict": Verdict(data["verdict"])})


DONE = RankOutcome(Verdict.DONE)


@dataclasses.dataclass(frozen=True)
class Restore:
    """Where a rank of a new attempt finds a checkpoint, as the job's supervisor decided.

    Attributes
    ----------
    step : int
        The checkpoint's step.
    source : str
        ``"peer"``: a replica held in the memory of the worker ``holder``; ``"store"``: the
        durable copy at ``url``.
    writer : int
        Whose checkpoint: 0 for the job's state, the rank for per-rank state.
    world_size : int or None
        For per-rank state, the number of ranks that wrote it; None for the job's state.
    holder : str or None
        The worker holding the replica (``source="peer"``).
    url : str or None
        The durable copy, the fallback when the replica cannot be read.

    Examples
    --------
    >>> Restore(40, "peer", 0, holder="tcp://10.0.0.2:4242").describe()
    'the replica of step 40 in the memory of tcp://10.0.0.2:4242'
    """

    step: int
    source: str
    writer: int = 0
    world_size: int | None = None
    holder: str | None = None
    url: str | None = None

    def describe(self) -> str:
        """Where it is, in words."""
        if self.source == "peer":
            return f"the replica of step {self.step} in the memory of {self.holder}"
        return f"{self.url or 'the store'} (step {self.step})"


def job_topic(job_id: str) -> str:
    """The event topic of one job (all its attempts): jobs never share a topic.

    >>> job_topic("3f2a")
    'dask-ddp-3f2a'
    """
    return f"dask-ddp-{job_id}"


def dataset_name(run_id: str) -> str:
    """The name an attempt's rank futures are published under.

    >>> dataset_name("3f2a9c1b2d4e-1")
    'dask-ddp-3f2a9c1b2d4e-1'
    """
    return f"dask-ddp-{run_id}"


def run_id_of(job_id: str, attempt: int) -> str:
    """An attempt's id: the job's id for the first, ``<job id>-<attempt>`` after; every
    event of a rank carries it.

    >>> run_id_of("3f2a", 0), run_id_of("3f2a", 2)
    ('3f2a', '3f2a-2')
    """
    return job_id if attempt == 0 else f"{job_id}-{attempt}"

"""The data a job is made of, shared by the scheduler's supervisor and the client's view.

Nothing here talks to a cluster: these are the values that travel between the client that
launches a job (:class:`JobSpec`), the supervisor that runs it on the scheduler
(:mod:`dask_ddp._scheduler.supervisor`) and every client that follows it (:class:`Transition`,
:class:`JobInfo`, :class:`MetricRecord`, :class:`OutputLine`, :class:`JobState`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple

__all__ = [
    "FINAL_STATES",
    "AttemptStart",
    "CheckpointInfo",
    "JobInfo",
    "JobSpec",
    "JobState",
    "MetricRecord",
    "OutputLine",
    "SweepSpec",
    "Transition",
    "TrialInfo",
    "with_starts",
]


class JobState(str, enum.Enum):
    """Where a job is in its life; the supervisor on the scheduler moves it.

    ::

        waiting ──> running ──> [stopping] ──> succeeded | failed | cancelled
                     │   ^  <──> stalled
                     v   │
              restarting | resizing

    - ``waiting``: not enough free workers yet (other jobs hold them, or the cluster is
      still growing); it holds none meanwhile.
    - ``running``: its ranks are placed and run.
    - ``stalled``: its ranks run, but none sent anything (a record, a checkpoint, a line)
      for ``ddp.stall-timeout`` and their stacks did not change; the history entry names
      the ranks outside a collective, the likely cause. ``running`` again once one does
      (``ddp.stall-action``: ``restart`` or ``fail`` stops the attempt instead).
    - ``restarting``: a rank failed in a way that earns a restart (a lost worker in a
      fixed-size job, :class:`~dask_ddp.RetryableError`); the ranks are stopped and placed
      again, from the last checkpoint.
    - ``resizing``: an elastic job changes size: a worker left (it shrinks) or workers
      joined (it grows at its next checkpoint). Never a failure.
    - ``stopping``: the job's end is decided (a rank failed, or it was cancelled) and its
      error known (:meth:`Job.result <dask_ddp.Job.result>` raises it already); its ranks
      still running are being stopped. It ends in the decided state once every worker is
      free again (a rank's processes get SIGTERM, then SIGKILL after ``ddp.failure-grace``).
    - ``succeeded``, ``failed``, ``cancelled``: final; the job holds no worker.

    Examples
    --------
    >>> JobState("succeeded") is JobState.SUCCEEDED
    True
    >>> JobState.RESIZING.final, JobState.FAILED.final
    (False, True)
    """

    WAITING = "waiting"
    RUNNING = "running"
    RESTARTING = "restarting"
    RESIZING = "resizing"
    STALLED = "stalled"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        """Whether the job ends in this state."""
        return self.value in FINAL_STATES


#: The states a job ends in, as strings.
FINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})


@dataclasses.dataclass(frozen=True)
class Transition:
    """One change of a job's state: an entry of :attr:`Job.history <dask_ddp.Job.history>`.

    Attributes
    ----------
    state : JobState
        The state the job entered.
    reason : str
        Why, in words (``"launched"``, the failure it restarts after, the resize).
    time : float
        When, in seconds since the epoch (the scheduler's clock).
    attempt : int
        The placement the job is at: 0 for the first, one more per restart or resize.
    world_size : int
        The ranks of that placement (0 while none is placed).
    since : float or None
        ``running`` entries: when the job last stopped training (its launch, or when the
        attempt before it stopped), so that :attr:`seconds_to_first_step` is the time
        without training.
    first_step : float or None
        ``running`` entries: when the placement's first :func:`dask_ddp.report` arrived.
    restored_from : str or None
        ``running`` entries: where the ranks' state came from when they loaded the last
        checkpoint (:func:`dask_ddp.get_checkpoint`): ``"peer"`` (a replica in a surviving
        worker's memory), ``"store"`` (the durable copy under ``checkpoint_dir``), or
        ``"peer+store"`` (per-rank state, some of each); None while no rank loaded one.
        The supervisor's plan when the attempt is placed, corrected by what the ranks
        report.
    restored_step : int or None
        ``running`` entries: the step of that checkpoint.

    Examples
    --------
    >>> t = Transition(JobState.RUNNING, "grow", 1.7e9 + 1, 1, 3, since=1.7e9,
    ...                first_step=1.7e9 + 4.5)
    >>> t.seconds_to_first_step
    4.5
    >>> [(t.state.value, t.world_size) for t in job.history]  # doctest: +SKIP
    [('waiting', 0), ('running', 2), ('resizing', 2), ('running', 3), ('succeeded', 3)]
    """

    state: JobState
    reason: str
    time: float
    attempt: int = 0
    world_size: int = 0
    since: float | None = None
    first_step: float | None = None
    restored_from: str | None = None
    restored_step: int | None = None

    @property
    def seconds_to_first_step(self) -> float | None:
        """From :attr:`since` to the first reported step; None before it (or not running)."""
        if self.first_step is None or self.since is None:
            return None
        return self.first_step - self.since

    def to_wire(self) -> dict[str, Any]:
        """Plain values, as the supervisor sends them to clients."""
        return {**dataclasses.asdict(self), "state": self.state.value}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Transition:
        """The transition :meth:`to_wire` described.

        >>> t = Transition(JobState.WAITING, "no free workers", 1.0)
        >>> Transition.from_wire(t.to_wire()) == t
        True
        """
        return cls(**{**data, "state": JobState(data["state"])})


@dataclasses.dataclass(frozen=True)
class AttemptStart:
    """What the supervisor learns of an attempt after its ``running`` entry was published
    (an entry, once published, never changes): when its first record came, and where its
    ranks' state came from (the plan when it is placed, then what the ranks report).
    :attr:`Job.history <dask_ddp.Job.history>` shows them on the attempt's first
    ``running`` entry (:func:`with_starts`).

    >>> s = AttemptStart(1, first_step=5.0, restored_from="peer", restored_step=40)
    >>> AttemptStart.from_wire(s.to_wire()) == s
    True
    """

    attempt: int
    first_step: float | None = None
    restored_from: str | None = None
    restored_step: int | None = None

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> AttemptStart:
        return cls(**data)


def with_starts(history: list[Transition], starts: list[AttemptStart]) -> list[Transition]:
    """``history`` as :attr:`Job.history <dask_ddp.Job.history>` shows it: each attempt's
    first ``running`` entry with what was learned of the attempt since (``starts``).

    >>> h = [Transition(JobState.RUNNING, "2 ranks", 1.0, 0, 2, since=0.0),
    ...      Transition(JobState.RUNNING, "stall ended", 9.0, 0, 2, since=0.0)]
    >>> [t.first_step for t in with_starts(h, [AttemptStart(0, first_step=3.0)])]
    [3.0, None]
    """
    by_attempt = {s.attempt: s for s in starts}
    shown, seen = [], set()
    for t in history:
        start = by_attempt.get(t.attempt)
        if t.state is JobState.RUNNING and start is not None and t.attempt not in seen:
            seen.add(t.attempt)
            t = dataclasses.replace(
                t,
                first_step=start.first_step,
                restored_from=start.restored_from,
                restored_step=start.restored_step,
            )
        shown.append(t)
    return shown


class MetricRecord(NamedTuple):
    """One :func:`dask_ddp.report` call, as the client received it.

    Attributes
    ----------
    rank : int
        The rank that reported it.
    step : int or None
        The ``step=`` it was reported with.
    time : float
        When the rank called ``report()``, in seconds since the epoch (``time.time()`` on
        the rank's host).
    metrics : dict of str to int or float
        The reported values.

    Examples
    --------
    >>> MetricRecord(rank=0, step=3, time=1.7e9, metrics={"loss": 0.25}).metrics["loss"]
    0.25
    """

    rank: int
    step: int | None
    time: float
    metrics: dict[str, float]


class OutputLine(NamedTuple):
    """One line a rank printed (``print()``, ``sys.stdout``/``sys.stderr``), on the client.

    Examples
    --------
    >>> OutputLine(rank=1, stream="stdout", text="epoch 3 done")
    OutputLine(rank=1, stream='stdout', text='epoch 3 done')
    """

    rank: int
    stream: str
    text: str


@dataclasses.dataclass(frozen=True)
class JobInfo:
    """A job the cluster knows, as :func:`dask_ddp.jobs` lists it.

    Attributes
    ----------
    job_id, name : str
        The job's id and name (``launch(name=)``, else the function's or script's).
    state : JobState
        Where it is.
    launched_by : str
        ``user@host`` of the client that launched it.
    started : float
        When it was launched, in seconds since the epoch.
    world_size : int
        Ranks of its current (or last) placement.
    step : int or None
        The highest step its ranks reported.
    attempts : int
        Placements so far.
    followers : int
        Clients following it now (0: it runs on its own, see ``ddp.orphan-timeout``).
    detached : bool
        Launched with ``detach=True``: it runs to its end with no client.
    error : str or None
        Its error in one line, once it failed.
    sweep : str or None
        The sweep it is a trial of (:func:`dask_ddp.sweep`), by id.

    Examples
    --------
    >>> [(j.name, j.state.value, j.step) for j in dask_ddp.jobs(client)]  # doctest: +SKIP
    [('train', 'running', 1200)]
    """

    job_id: str
    name: str
    state: JobState
    launched_by: str
    started: float
    world_size: int
    step: int | None
    attempts: int
    followers: int
    detached: bool
    error: str | None = None
    sweep: str | None = None


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything the supervisor needs to run a job, as the launching client sends it.

    The function and its arguments are ``payload``: bytes pickled on the client and
    unpickled only by the ranks, so the scheduler never imports the user's code.
    Configuration is resolved on the client (``settings``, a :class:`dask_ddp.config.Settings`).
    """

    job_id: str
    name: str  # launch(name=), else the function's or script's
    named: bool  # the name was given: no other running job may have it
    payload: bytes
    settings: Any
    workers: int | list[str] | None  # as launch() got it: every worker, a count, or names
    min_workers: int | None  # an elastic job's least size (checked on the client)
    ranks_per_worker: int | str = 1  # launch(ranks_per_worker=): a number, or "gpu"
    pass_local_rank: bool = False  # launch(pass_local_rank=)
    init_process_group: bool = True  # False: a script calls init_process_group itself
    checkpoint_dir: str | None = None  # launch(checkpoint_dir=), keep_last=, storage_options=
    keep_last: int | None = None
    storage_options: dict[str, Any] | None = None
    max_restarts: int = 0
    total_steps: int | None = None
    client: str | None = None
    launched_by: str = "?"
    detach: bool = False
    datasets: tuple[Any, ...] = ()
    datasets_name: str | None = None
    adaptive: bool = False
    sources: Any = None  # tracebacks.Sources: the function's code by value, placed
    sweep: str | None = None  # a sweep's trial: the sweep's id
    watch: str | None = None  # a trial: the metric its sweep reads (EventPlan.watch)
    trial_kwargs: dict[str, Any] | None = None  # a trial: its params(), over the kwargs


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint that has landed: where, which step, how many bytes, and when.

    Attributes
    ----------
    url : str
        Where it is, complete.
    step : int
        The ``step=`` it was saved with.
    nbytes : int
        Its size.
    rank : int
        The rank that wrote it.
    time : float
        When it landed, in seconds since the epoch (the rank's clock).
    stall : float
        Seconds the rank's training loop waited in ``save_checkpoint()`` for it: copying
        the state off the live tensors, plus any wait for the upload before it (an
        asynchronous save); the whole write (a synchronous one).
    world_size : int or None
        For per-rank state (``save_checkpoint(..., per_rank=True)``), the number of ranks
        that each wrote their own file for this step; None for the job's state.

    Examples
    --------
    >>> job.checkpoints[-1]  # doctest: +SKIP
    CheckpointInfo(url='s3://bucket/run1/checkpoint-000000000100.pt', step=100, ...)
    """

    url: str
    step: int
    nbytes: int
    rank: int
    time: float
    stall: float = 0.0
    world_size: int | None = None


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """A sweep as its client sends it (:func:`dask_ddp.sweep`).

    ``study`` is ``(study, params)`` pickled on the client: the sweep's own thread on the
    scheduler unpickles it (the one place a user's code and Optuna run there); ``trial`` is
    every trial's job but for its id, name, checkpoint directory and ``params()``.
    """

    sweep_id: str
    name: str
    named: bool
    study: bytes
    trial: JobSpec
    n_trials: int
    metric: str
    client: str | None = None
    launched_by: str = "?"


@dataclasses.dataclass(frozen=True)
class TrialInfo:
    """One trial of a sweep, as :attr:`Sweep.trials <dask_ddp.Sweep.trials>` lists it.

    Attributes
    ----------
    number : int
        The trial's number in its study.
    state : str
        ``"waiting"`` (for a whole worker set), ``"running"``, ``"complete"``, ``"pruned"``
        or ``"fail"``: the last three are final, as Optuna's ``TrialState`` has them.
    job_id : str or None
        Its job (:attr:`Sweep.jobs <dask_ddp.Sweep.jobs>`).
    params : dict
        The hyperparameters its ``params(trial)`` suggested.
    value : float or None
        Its objective, once complete.
    step : int or None
        The last step whose ``metric`` the study was told (:meth:`optuna.trial.Trial.report`).
    latest : float or None
        The ``metric`` reported at that step.
    pruned_at : int or None
        The step at which the study's pruner stopped it.
    error : str or None
        Why it failed, in one line.
    curve : list of [step, value]
        Rank 0's ``metric`` so far, thinned to at most 64 points.
    started, ended : float or None
        When it started running, and ended (seconds since the epoch).
    attempts : int
        Placements of its job (more than one: it restarted from its checkpoint).

    Examples
    --------
    >>> t = TrialInfo(3, "pruned", "ab12", {"lr": 0.1}, pruned_at=4)
    >>> t.final, TrialInfo.from_wire(t.to_wire()) == t
    (True, True)
    """

    number: int
    state: str
    job_id: str | None = None
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    value: float | None = None
    step: int | None = None
    latest: float | None = None
    pruned_at: int | None = None
    error: str | None = None
    curve: list[list[float]] = dataclasses.field(default_factory=list)
    started: float | None = None
    ended: float | None = None
    attempts: int = 0

    @property
    def final(self) -> bool:
        """Whether the trial is over (complete, pruned or failed)."""
        return self.state in ("complete", "pruned", "fail")

    def to_wire(self) -> dict[str, Any]:
        """Plain values."""
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> TrialInfo:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

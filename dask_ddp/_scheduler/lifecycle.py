"""A job's life as one pure function: a typed fact in, the job's next life and actions out.

Everything that can happen to a job arrives at its supervisor as a *fact* (a rank started
or ended, a task ended, a worker left or joined, the pool offered free workers, cancel was
asked, the last client left, a timer fired, an action finished or failed). :func:`step`
decides what it means, and only it::

    life, actions = step(life, fact, policy, now)

It reads typed fields (a rank's :class:`~dask_ddp._shared.protocol.Verdict`, the workers that
left while an attempt was placed), never an exception's text, and it decides everything the
job's driver then says and raises: the error a job ends with (a typed exception on the
:class:`Publish` that says so, built from typed fields), what ``launch()`` raises
(:class:`Finish`), the error a lost rank's future raises (:class:`FailTask`), the notes. It does
nothing itself: the supervisor (:mod:`dask_ddp._scheduler.supervisor`) carries out the *actions*
it returns (ask the pool, place an attempt, abort ranks, restart workers, give workers back,
publish a transition, arm a timer) and feeds what comes of them back in as facts. Nothing here
touches a cluster, a clock or a lock, so the whole life is tested as a model: random sequences
of facts, the invariants checked after each (``tests/test_lifecycle.py``).

The phases of a job, inside its public :class:`~dask_ddp.JobState`::

    new -> waiting -> placing -> running -> stopping -> ended
              ^          |                     |
              +----------+---------------------+   (the next attempt: restart or resize)

- ``waiting``: the pool has not offered the workers (the job holds those it kept from its
  last attempt, if any).
- ``placing``: the job took the workers the pool offered; the launcher probes and opens the store
  (:class:`Place` -> :class:`Prepared`), then submits the rank tasks (:class:`Submit` ->
  :class:`Placed`), unless the job was cancelled meanwhile: then nothing is submitted or
  published, and the job ends at once (:class:`Discard`).
- ``running``: the ranks run; the first conclusive fact decides how the attempt ends.
- ``stopping``: the attempt's end is decided; its ranks are stopped. A worker goes back
  to the pool (or to the next attempt) only once it is *clean*: its rank's task ended, or
  the rank never started there and will end at once if it does, or the worker was
  restarted or left. A rank's worker kills the rank's process tree ``ddp.failure-grace``
  after the abort; a worker whose rank's task has still not ended :data:`STOP_MARGIN`
  later (the worker itself does not answer) is restarted, and one that cannot be restarted
  is quarantined, never reused.
- ``ended``: the job holds no worker, and only now is its final state published (while
  its ranks stop, its public state is ``stopping``: its end and its error are known).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any

from .. import errors
from .._shared.protocol import Ended, Fault, RankEnd, RankOutcome, Verdict, run_id_of
from .._shared.values import JobState

__all__ = [
    "RESTARTS",
    "Action",
    "Cause",
    "Fact",
    "Life",
    "Phase",
    "Policy",
    "Timer",
    "step",
]

_HOUR = 3600.0


class Phase(str, enum.Enum):
    """Where the supervisor is in the job's life (see the module's docstring)."""

    NEW = "new"
    WAITING = "waiting"
    PLACING = "placing"
    RUNNING = "running"
    STOPPING = "stopping"
    ENDED = "ended"


#: Seconds past ``ddp.failure-grace`` before the workers of ranks that did not stop are
#: restarted: by then each worker has killed its rank's process tree, so a rank task still
#: running means the worker itself does not answer.
STOP_MARGIN = 10.0


class Timer(str, enum.Enum):
    """The timers a job arms; each firing comes back as :class:`TimerFired`."""

    GRACE = "grace"  # a rank stopped because of another: the cause has this long to come
    DRAIN = "drain"  # every task ended: the last final markers have this long to come
    STOP = "stop"  # the ranks were asked to stop: after this, their workers are restarted
    SCALE = "scale"  # the cluster is smaller than the job needs: after this, it fails
    ORPHAN = "orphan"  # no client follows the job: after this, it is cancelled


class WaitKind(str, enum.Enum):
    """Why a job waits for workers."""

    HELD = "held"  # other jobs hold some of the cluster's workers
    SMALL = "small"  # the cluster has fewer workers than the job needs


class EndKind(str, enum.Enum):
    """What ended an attempt (see :class:`Ending`)."""

    CANCELLED = "cancelled"  # cancel was asked (by a client, or no client followed the job)
    DONE = "done"  # every rank finished
    GROW = "grow"  # the ranks stopped at a checkpoint to grow onto more workers
    RANK = "rank"  # a rank failed with its own error (its verdict: retry or fail)
    LOST = "lost"  # a rank's worker left the cluster
    STOPPED = "stopped"  # ranks stopped with no cause of their own (a peer's process died)
    TASK = "task"  # a rank's task failed without a word from the rank
    PLACEMENT = "placement"  # placing the attempt failed for good
    SCALE = "scale"  # the cluster stayed smaller than the job needs
    SUPERVISOR = "supervisor"  # an action of the job's supervisor failed: it cannot go on
    RESIZES = "resizes"  # more resizes than ddp.max-resizes in an hour
    STALLED = "stalled"  # no rank progressed for ddp.stall-timeout (ddp.stall-action)


class TaskEnd(str, enum.Enum):
    """How a rank's task ended on the scheduler."""

    MEMORY = "memory"  # it returned: its value is on its worker
    ERRED = "erred"  # it raised


class StallAction(str, enum.Enum):
    """What a stall does (``ddp.stall-action``)."""

    WARN = "warn"  # says so in the history, and again when progress resumes
    RESTART = "restart"  # stops the attempt and restarts it, counted against max_restarts
    FAIL = "fail"  # stops the job: JobStalledError


@dataclasses.dataclass(frozen=True)
class Ending:
    """How an attempt (or the job) ends, decided once, by the first conclusive fact.

    ``why`` is for people (the transition's reason); decisions read ``kind``, ``cause``
    (through :data:`RESTARTS`, into ``retry``) and ``lost``, and the job's error is built
    from the named fields of its kind.
    """

    kind: EndKind
    why: str
    rank: int | None = None  # the rank whose end decided it (STOPPED: the cause, if known)
    worker: str | None = None  # that rank's worker (STOPPED: the stopped rank's)
    outcome: RankOutcome | None = None
    error: Any = None  # PLACEMENT: the exception placing raised
    retry: bool = False  # earns a restart from the last checkpoint (RESTARTS[cause])
    lost: bool = False  # a worker or a peer's process went away: an elastic job shrinks
    cause: Cause | None = None  # what failed, as RESTARTS reads it
    stopped: int | None = None  # STOPPED: the rank that stopped (its cause is ``rank``)
    need: int = 0  # SCALE: the workers the job needs
    have: int = 0  # SCALE: those the cluster had
    waited: float = 0.0  # SCALE: for how long
    resizes: int = 0  # RESIZES: those within the hour
    limit: int | None = None  # RESIZES: ddp.max-resizes
    causes: tuple[int, ...] = ()  # STALLED: the ranks outside a collective

    @property
    def headline(self) -> str:
        """What ended it, in a few words (a stopped rank's status says it)."""
        if self.kind in (EndKind.RANK, EndKind.TASK):
            return f"rank {self.rank} failed"
        if self.kind is EndKind.LOST:
            return f"rank {self.rank} was lost"
        if self.kind is EndKind.STOPPED:
            return "a peer's process died" if self.lost else f"rank {self.stopped} stopped"
        return self.kind.value


class Cause(str, enum.Enum):
    """What ended a failed attempt, as far as restarting goes: a failed rank's
    :class:`~dask_ddp._shared.protocol.Fault`, or what the supervisor saw (a row of
    :data:`RESTARTS`)."""

    CODE = "code"  # the job's own code raised
    ASKED = "asked"  # RetryableError
    INFRASTRUCTURE = (
        "infrastructure"  # an InfrastructureError (store, rendezvous, fetch, storage unreachable)
    )
    CREDENTIALS = "credentials"  # storage refused the credentials
    WORKER_LOST = "worker lost"  # a rank's worker left the cluster while it ran
    PEER_DIED = "peer died"  # ranks stopped because a peer's process died, no error of its own
    UNTOLD = "untold"  # ranks stopped for a rank whose own error never came
    TASK = "task"  # a rank's task failed without a word from the rank
    STALL = "stall"  # no progress for ddp.stall-timeout, with ddp.stall-action: restart/fail

    @classmethod
    def of(cls, fault: Fault | None) -> Cause:
        """The row of a failed rank's fault (an outcome from before faults: the code)."""
        return cls(fault.value) if fault is not None else cls.CODE


#: Whether an attempt's end restarts the job (from its last checkpoint, while
#: ``max_restarts`` last): the one table that decides it, printed in docs/jobs.md. A stall
#: restarts with ``ddp.stall-action: restart`` only (:meth:`_Step.restarts`).
RESTARTS: dict[Cause, bool] = {
    Cause.CODE: False,
    Cause.ASKED: True,
    Cause.INFRASTRUCTURE: True,
    Cause.CREDENTIALS: False,  # a restart would meet the same refusal
    Cause.WORKER_LOST: True,
    Cause.PEER_DIED: True,
    Cause.UNTOLD: False,
    Cause.TASK: False,
    Cause.STALL: False,
}


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a job may do, fixed at launch (from ``launch()`` and ``ddp.*``): how many
    workers it runs on (at least ``min_workers``, at most ``max_workers``, checked against
    the cluster at launch), how often it restarts and resizes, its timeouts; ``job`` is its
    id, which its errors name."""

    min_workers: int
    max_workers: int
    job: str = "job"
    max_restarts: int = 0
    max_resizes: int | None = 20  # None: no limit
    failure_grace: float = 5.0
    drain: float = 10.0
    scale_timeout: float = 300.0
    orphan_timeout: float = 600.0
    stall_timeout: float | None = 120.0  # ddp.stall-timeout; None: no stall is ever decided
    stall_action: StallAction = StallAction.WARN
    result_limit: int = 1_048_576  # ddp.result-limit: the values the supervisor holds

    @property
    def elastic(self) -> bool:
        return self.min_workers < self.max_workers


@dataclasses.dataclass(frozen=True)
class RankLife:
    """One rank of the current attempt, as far as its worker's cleanliness goes."""

    worker: str
    key: str = "?"  # its task's key
    started: bool = False
    outcome: RankOutcome | None = None
    task: TaskEnd | None = None  # once its task ended
    task_summary: str = ""  # an erred task's exception, for people
    lost: bool = False  # its worker left the cluster
    idle: bool = False  # the abort found it not started: it ends at once if it starts
    restarted: bool = False  # its worker was restarted
    abandoned: bool = False  # its worker could not be restarted: quarantined

    @property
    def clean(self) -> bool:
        """Its worker holds nothing of it, or never will: it may take other work."""
        return self.task is not None or self.lost or self.idle or self.restarted or self.abandoned


@dataclasses.dataclass(frozen=True)
class Wait:
    """What a waiting job waits for."""

    kind: WaitKind
    need: int
    have: int


@dataclasses.dataclass(frozen=True)
class Life:
    """A job's whole state as :func:`step` reads and writes it."""

    phase: Phase = Phase.NEW
    state: JobState = JobState.WAITING  # the last state published
    attempt: int = 0
    ranks: tuple[RankLife, ...] = ()
    held: frozenset[str] = frozenset()  # the workers the job holds: their only record
    restarts_left: int = 0
    resizes: tuple[float, ...] = ()  # when each resize was decided
    cancel: str | None = None
    ending: Ending | None = None  # the current attempt's
    next_state: JobState | None = None  # where the job goes once the attempt stopped
    grow_requested: bool = False
    wait: Wait | None = None
    short_since: float | None = None
    timers: tuple[tuple[Timer, int], ...] = ()  # armed timers and their tokens
    tokens: int = 0
    restarting: frozenset[str] = frozenset()  # workers asked to restart, not yet answered
    stalled: bool = False  # the running attempt is stalled (published: JobState.STALLED)
    sample: tuple[int, float, tuple[tuple[int, str], ...]] | None = None  # the last stack
    # sample taken while no rank spoke: (attempt, quiet_since, stacks)
    closed: bool = False  # ended, and its Finish carried out: nothing of it is left running

    @classmethod
    def new(cls, policy: Policy) -> Life:
        return cls(restarts_left=policy.max_restarts)

    def armed(self, timer: Timer) -> int | None:
        """The token of ``timer`` if it is armed."""
        return dict(self.timers).get(timer)


# -- facts: what happened -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Start:
    """The job was launched."""


@dataclasses.dataclass(frozen=True)
class Short:
    """The pool could not offer the workers asked for at once; the cluster has ``cluster``
    workers (those kept out of every job not counted)."""

    cluster: int


@dataclasses.dataclass(frozen=True)
class ClusterChanged:
    """Workers joined, left or were given back by other jobs; ``cluster`` are there (those
    kept out of every job not counted)."""

    cluster: int


@dataclasses.dataclass(frozen=True)
class Offered:
    """The pool offers the job ``workers``: those it holds, then free ones (no job holds
    them), in rank order, as many as it asked for. The job takes them by holding them
    (:attr:`Life.held`, the only record of who holds a worker), or leaves them free."""

    workers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Attempt ``attempt`` is ready to run: its workers probed, rank 0's store open, its
    ranks planned. Nothing of it was submitted yet."""

    attempt: int


@dataclasses.dataclass(frozen=True)
class Placed:
    """Attempt ``attempt`` was placed and its rank tasks submitted, rank ``i`` on
    ``workers[i]`` as task ``keys[i]``; the workers are on ``hosts`` hosts."""

    attempt: int
    workers: tuple[str, ...]
    keys: tuple[str, ...] = ()
    hosts: int = 1


@dataclasses.dataclass(frozen=True)
class RankStarted:
    """A rank's task started running it (its first status)."""

    attempt: int
    rank: int


@dataclasses.dataclass(frozen=True)
class RankEnded:
    """A rank's final marker: how it ended, as the rank decided."""

    attempt: int
    rank: int
    outcome: RankOutcome


@dataclasses.dataclass(frozen=True)
class TaskEnded:
    """A rank's task ended on the scheduler (``erred`` or not); ``summary`` is an erred
    task's exception, for people."""

    attempt: int
    rank: int
    erred: bool
    summary: str = ""


@dataclasses.dataclass(frozen=True)
class WorkerLost:
    """A worker left the cluster (killed, restarted, scaled down)."""

    worker: str


@dataclasses.dataclass(frozen=True)
class AbortAnswered:
    """The workers answered an abort: on ``idle`` ones no rank of the attempt ran (it ends
    at once if its task starts later)."""

    attempt: int
    idle: frozenset[str]


@dataclasses.dataclass(frozen=True)
class WorkersRestarted:
    """The workers were restarted: nothing of the job is left in them."""

    workers: frozenset[str]


@dataclasses.dataclass(frozen=True)
class CancelAsked:
    """Somebody asked the job to stop."""

    reason: str


@dataclasses.dataclass(frozen=True)
class ClientLeft:
    """The last client following the job left (a job launched detached never hears it)."""


@dataclasses.dataclass(frozen=True)
class ClientAttached:
    """A client follows the job again."""


@dataclasses.dataclass(frozen=True)
class Sampled:
    """The stacks of ``attempt``'s ranks, sampled while none had sent anything for
    ``quiet`` seconds, since ``quiet_since`` (the supervisor's clock: two samples with the
    same ``quiet_since`` had no word from any rank between them). ``stacks``: each rank's
    stack text, ``(rank, text)`` in rank order; ``complete``: every rank answered.
    ``causes`` are the ranks outside a collective (the likely cause of a stall), at
    ``where`` (``"train (train.py:42)"``, one per cause); ``waiting`` the ranks waiting in
    a collective. Whether this is a stall is :func:`step`'s to decide."""

    attempt: int
    quiet: float
    quiet_since: float
    stacks: tuple[tuple[int, str], ...]
    complete: bool = True
    causes: tuple[int, ...] = ()
    where: tuple[str, ...] = ()
    waiting: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Progressed:
    """A rank of ``attempt`` sent something while the attempt was stalled."""

    attempt: int


@dataclasses.dataclass(frozen=True)
class Finished:
    """The job's :class:`Finish` was carried out: its datasets and replicas are gone, and
    nothing of the job runs any more (the job is *closed*)."""


@dataclasses.dataclass(frozen=True)
class TimerFired:
    """A timer armed by an :class:`Arm` action fired (a stale token is ignored)."""

    timer: Timer
    token: int


class ActionKind(str, enum.Enum):
    PLACE = "place"
    ABORT = "abort"
    RESTART = "restart"
    GROW = "grow"
    PUBLISH = "publish"
    FAIL_TASK = "fail-task"
    ASK = "ask"  # the pool could not take the job's request
    TAKE_MORE = "take-more"
    WITHDRAW = "withdraw"
    DEMAND = "demand"
    FINISH = "finish"  # the job's end (its replicas, datasets, the pool's record)


@dataclasses.dataclass(frozen=True)
class ActionFailed:
    """An action could not be carried out. ``workers``: those it was for (``RESTART``), or,
    for ``PLACE``, the attempt's workers that had left the cluster when it
    failed; ``error``: the exception, for the job's error."""

    action: ActionKind
    attempt: int = 0
    workers: frozenset[str] = frozenset()
    error: Any = None
    why: str = ""


Fact = (
    Start
    | Short
    | ClusterChanged
    | Offered
    | Prepared
    | Placed
    | RankStarted
    | RankEnded
    | TaskEnded
    | WorkerLost
    | AbortAnswered
    | WorkersRestarted
    | CancelAsked
    | ClientLeft
    | ClientAttached
    | Finished
    | TimerFired
    | ActionFailed
    | Sampled
    | Progressed
)


# -- actions: what the supervisor is to do ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Ask:
    """Ask the pool for ``want`` workers in all, at least ``need`` (those the job holds
    count): :class:`Offered` once free ones suffice; :class:`Short` if they do not at
    first."""

    attempt: int
    want: int
    need: int


@dataclasses.dataclass(frozen=True)
class Withdraw:
    """Drop the job's request to the pool."""


@dataclasses.dataclass(frozen=True)
class Place:
    """Probe ``workers``, open rank 0's store and plan attempt ``attempt``:
    :class:`Prepared`, or :class:`ActionFailed` (``PLACE``)."""

    attempt: int
    workers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Submit:
    """Submit the prepared attempt ``attempt``'s rank tasks: :class:`Placed` at once
    (before any other fact), or :class:`ActionFailed` (``PLACE``)."""

    attempt: int


@dataclasses.dataclass(frozen=True)
class Discard:
    """Prepared attempt ``attempt`` will never run (the job was cancelled while it was
    prepared): close its store. Nothing of it was submitted or published."""

    attempt: int


@dataclasses.dataclass(frozen=True)
class Abort:
    """Ask ``ranks`` of ``attempt`` to stop (``reason``; ``cause``: the rank whose end
    stopped them): :class:`AbortAnswered`, or :class:`ActionFailed` (``ABORT``)."""

    attempt: int
    ranks: tuple[int, ...]
    workers: tuple[str, ...]
    reason: str
    cause: int | None


@dataclasses.dataclass(frozen=True)
class RestartWorkers:
    """Restart ``workers`` (their ranks did not stop): :class:`WorkersRestarted` (and
    :class:`WorkerLost` for each), or :class:`ActionFailed` (``RESTART``)."""

    attempt: int
    workers: frozenset[str]


@dataclasses.dataclass(frozen=True)
class FailTask:
    """Fail rank ``rank``'s task, left without its worker, with ``error``, so that its
    future says why (a :class:`~dask_ddp.errors.WorkerLostError`, ``finished`` when its
    value went with the worker; a :class:`~dask_ddp.errors.RankStoppedError` when the
    attempt was being stopped already); ``status``: the rank's status to show, if it
    changes."""

    attempt: int
    rank: int
    worker: str
    error: BaseException
    status: Ended | None = None


@dataclasses.dataclass(frozen=True)
class Release:
    """The job gave ``workers`` back (it no longer holds them: they are clean): the pool
    offers them to the jobs that wait."""

    workers: frozenset[str]


@dataclasses.dataclass(frozen=True)
class Quarantine:
    """Keep ``workers`` (a rank there could be neither stopped nor its worker restarted)
    out of every job until they leave the cluster."""

    workers: frozenset[str]


@dataclasses.dataclass(frozen=True)
class TakeMore:
    """Ask the pool, once, for free workers until the job holds ``want`` (at least
    ``need``): :class:`Offered` if there are, else nothing."""

    want: int
    need: int


@dataclasses.dataclass(frozen=True)
class RequestGrow:
    """Ask attempt ``attempt``'s ranks to stop at their next checkpoint, to grow."""

    attempt: int


@dataclasses.dataclass(frozen=True)
class Demand:
    """Keep ``missing`` workers of demand visible to adaptive scaling."""

    missing: int


@dataclasses.dataclass(frozen=True)
class Arm:
    timer: Timer
    seconds: float
    token: int


@dataclasses.dataclass(frozen=True)
class Disarm:
    timer: Timer


@dataclasses.dataclass(frozen=True)
class Publish:
    """Enter ``state``: one history entry, one log line, one message to the clients.
    ``ending``: what ended the attempt; ``error``: the error the job ends with, once its
    end is decided (a final state, or ``stopping`` towards one)."""

    state: JobState
    reason: str
    attempt: int
    world_size: int
    ending: Ending | None = None
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class Waiting:
    """Say what the job waits for (once per change of what it waits for); ``announce``:
    it waits for another kind of thing than before (a line in the log and the views)."""

    wait: Wait
    seconds_left: float | None
    announce: bool = True


@dataclasses.dataclass(frozen=True)
class Note:
    text: str


@dataclasses.dataclass(frozen=True)
class Finish:
    """The job is over: what is left of it (datasets, replicas) goes, it says so, and
    :class:`Finished` comes back.
    ``error``: what ``launch()`` raises, for a job that failed before any attempt was
    placed (None: ``launch()`` returns the job)."""

    error: BaseException | None = None


Action = (
    Ask
    | Withdraw
    | Place
    | Submit
    | Discard
    | Abort
    | RestartWorkers
    | FailTask
    | Release
    | Quarantine
    | TakeMore
    | RequestGrow
    | Demand
    | Arm
    | Disarm
    | Publish
    | Waiting
    | Note
    | Finish
)


# -- the transition function ----------------------------------------------------------------
def step(life: Life, fact: Fact, policy: Policy, now: float) -> tuple[Life, list[Action]]:
    """The one place where a job's life moves: ``fact`` applied to ``life``.

    Parameters
    ----------
    life : Life
        The job as it is.
    fact : Fact
        What happened.
    policy : Policy
        What the job may do.
    now : float
        The time, in seconds (resizes are counted per hour; waits say how long is left).

    Returns
    -------
    (Life, list of Action)
        The job as it is now, and what the supervisor is to do, in order.

    Examples
    --------
    >>> p = Policy(min_workers=2, max_workers=2)
    >>> life, actions = step(Life.new(p), Start(), p, 0.0)
    >>> life.phase.value, actions
    ('waiting', [Ask(attempt=0, want=2, need=2)])
    >>> life, actions = step(life, Offered(("a", "b")), p, 0.0)
    >>> life.phase.value, actions
    ('placing', [Place(attempt=0, workers=('a', 'b'))])
    """
    stepper = _Step(life, policy, now)
    stepper.take(fact)
    return stepper.life, stepper.actions


class _Step:
    """One application of :func:`step`: the life being built, and the actions so far."""

    def __init__(self, life: Life, policy: Policy, now: float) -> None:
        self.life, self.policy, self.now = life, policy, now
        self.actions: list[Action] = []

    def set(self, **changes: Any) -> None:
        self.life = dataclasses.replace(self.life, **changes)

    def take(self, fact: Fact) -> None:
        handler = getattr(self, f"on_{type(fact).__name__}")
        handler(fact)

    # -- timers ---------------------------------------------------------------------------
    def arm(self, timer: Timer, seconds: float) -> None:
        token = self.life.tokens + 1
        timers = tuple((t, k) for t, k in self.life.timers if t is not timer)
        self.set(timers=(*timers, (timer, token)), tokens=token)
        self.actions.append(Arm(timer, max(0.0, seconds), token))

    def disarm(self, *timers: Timer) -> None:
        for timer in timers:
            if self.life.armed(timer) is not None:
                self.set(timers=tuple((t, k) for t, k in self.life.timers if t is not timer))
                self.actions.append(Disarm(timer))

    # -- facts ----------------------------------------------------------------------------
    def on_Start(self, fact: Start) -> None:
        if self.life.phase is Phase.NEW:
            self.ask()

    def on_Short(self, fact: Short) -> None:
        if self.life.phase is Phase.WAITING:
            self.waiting(fact.cluster)

    def on_ClusterChanged(self, fact: ClusterChanged) -> None:
        life = self.life
        if life.phase is Phase.WAITING and life.wait is not None:
            self.waiting(fact.cluster)
        else:
            self.take_more()

    def on_Offered(self, fact: Offered) -> None:
        """The job takes the workers by holding them: a waiting job places its attempt on
        them, a running elastic job grows onto them at its next checkpoint. A job that
        wants them no more leaves them free (nothing to give back: it never held them)."""
        life = self.life
        workers = frozenset(fact.workers)
        if life.phase is Phase.WAITING and len(workers) >= self.need():
            self.disarm(Timer.SCALE)
            self.set(phase=Phase.PLACING, held=workers, wait=None, short_since=None)
            self.actions.append(Place(life.attempt, tuple(fact.workers)))
            self.demand()
        elif (
            life.phase is Phase.RUNNING
            and self.policy.elastic
            and life.ending is None
            and not life.grow_requested
            and not workers <= life.held
        ):
            self.set(held=life.held | workers, grow_requested=True)
            self.actions.append(RequestGrow(life.attempt))
            self.demand()

    def on_Prepared(self, fact: Prepared) -> None:
        life = self.life
        if life.phase is not Phase.PLACING or fact.attempt != life.attempt:
            self.actions.append(Discard(fact.attempt))
        elif life.cancel is not None:  # asked while it was prepared: it never starts
            self.actions.append(Discard(fact.attempt))
            self.finish(JobState.CANCELLED, Ending(EndKind.CANCELLED, life.cancel))
        else:
            self.actions.append(Submit(fact.attempt))

    def on_Placed(self, fact: Placed) -> None:
        life = self.life
        if life.phase is not Phase.PLACING or fact.attempt != life.attempt:
            return
        keys = fact.keys or ("?",) * len(fact.workers)
        ranks = tuple(
            RankLife(w, k, lost=w not in life.held) for w, k in zip(fact.workers, keys, strict=True)
        )
        self.set(phase=Phase.RUNNING, ranks=ranks, grow_requested=False, stalled=False)
        if life.cancel is not None:  # asked between its Submit and this fact
            self.end(Ending(EndKind.CANCELLED, life.cancel))
            return
        hosts = "host" if fact.hosts == 1 else "hosts"
        self.publish(JobState.RUNNING, f"{len(ranks)} ranks on {fact.hosts} {hosts}")
        self.evaluate()
        self.take_more()  # workers that joined while it was placed were offered to nobody

    def on_RankStarted(self, fact: RankStarted) -> None:
        rank = self.rank(fact.attempt, fact.rank)
        if rank is not None and not rank.started:
            self.update(fact.rank, started=True)

    def on_RankEnded(self, fact: RankEnded) -> None:
        rank = self.rank(fact.attempt, fact.rank)
        if rank is None or rank.outcome is not None:
            return
        self.update(fact.rank, outcome=fact.outcome, started=True)
        self.progress()

    def on_TaskEnded(self, fact: TaskEnded) -> None:
        rank = self.rank(fact.attempt, fact.rank)
        if rank is None or rank.task is not None:
            return
        self.update(
            fact.rank,
            task=TaskEnd.ERRED if fact.erred else TaskEnd.MEMORY,
            task_summary=fact.summary,
        )
        self.progress()

    def on_WorkerLost(self, fact: WorkerLost) -> None:
        """A rank never runs twice: what it left on a worker that left (its value, or its
        task not started) fails its future, in a job that runs or one that ended. Dask
        would compute it again on a worker back at that address (a fixed port)."""
        life = self.life
        self.set(held=life.held - {fact.worker})
        if life.phase not in (Phase.RUNNING, Phase.STOPPING, Phase.ENDED):
            return
        ending = life.ending
        for r, rank in enumerate(life.ranks):
            if rank.worker != fact.worker or rank.lost:
                continue
            done = rank.outcome is not None and rank.outcome.verdict is Verdict.DONE
            if rank.task is TaskEnd.MEMORY or (rank.task is None and done):
                # Its value was there: its future says it went with the worker.
                lost = errors.WorkerLostError(
                    r, rank.worker, rank.key, finished=True, limit=self.policy.result_limit
                )
                self.actions.append(FailTask(life.attempt, r, rank.worker, lost))
            elif rank.task is None and ending is not None:  # stopped already, for this
                run = run_id_of(self.policy.job, life.attempt)
                stopped = errors.RankStoppedError(r, ending.why, job=run)
                shown = Ended(RankEnd.STOPPED, ending.headline)
                self.actions.append(FailTask(life.attempt, r, rank.worker, stopped, shown))
            elif rank.task is None:
                lost = errors.WorkerLostError(r, rank.worker, rank.key)
                shown = Ended(RankEnd.LOST, "its worker left the cluster")
                self.actions.append(FailTask(life.attempt, r, rank.worker, lost, shown))
            self.update(r, lost=True)
        self.progress()

    def on_AbortAnswered(self, fact: AbortAnswered) -> None:
        life = self.life
        if life.phase is not Phase.STOPPING or fact.attempt != life.attempt:
            return
        for r, rank in enumerate(life.ranks):
            if rank.worker in fact.idle and not rank.clean:
                self.update(r, idle=True)
        self.progress()

    def on_WorkersRestarted(self, fact: WorkersRestarted) -> None:
        life = self.life
        self.set(restarting=life.restarting - fact.workers)
        if life.phase is not Phase.STOPPING:
            return
        for r, rank in enumerate(life.ranks):
            if rank.worker in fact.workers and not rank.clean:
                self.update(r, restarted=True)
        self.progress()

    def on_CancelAsked(self, fact: CancelAsked) -> None:
        life = self.life
        if life.phase is Phase.ENDED or life.cancel is not None:
            return
        self.set(cancel=fact.reason)
        self.disarm(Timer.ORPHAN)
        if life.phase in (Phase.NEW, Phase.WAITING):
            self.actions.append(Withdraw())
            self.finish(JobState.CANCELLED, Ending(EndKind.CANCELLED, fact.reason))
        elif life.phase is Phase.RUNNING and life.ending is None:
            self.end(Ending(EndKind.CANCELLED, fact.reason))
        # placing: stopped as soon as it is placed; stopping: cancelled once stopped

    def on_ClientLeft(self, fact: ClientLeft) -> None:
        life = self.life
        if (
            life.phase is not Phase.ENDED
            and life.cancel is None
            and life.armed(Timer.ORPHAN) is None
        ):
            timeout = self.policy.orphan_timeout
            self.actions.append(
                Note(
                    f"its last client left; the job goes on for {timeout:.0f} s "
                    "(ddp.orphan-timeout) for a client to attach (dask_ddp.attach), then is "
                    "cancelled"
                )
            )
            self.arm(Timer.ORPHAN, timeout)

    def on_Finished(self, fact: Finished) -> None:
        if self.life.phase is Phase.ENDED:
            self.set(closed=True)

    def on_ClientAttached(self, fact: ClientAttached) -> None:
        if self.life.armed(Timer.ORPHAN) is not None:
            self.disarm(Timer.ORPHAN)
            self.actions.append(Note("a client attached; the job is followed again"))

    def on_Sampled(self, fact: Sampled) -> None:
        """A stall is no word from any rank for ``ddp.stall-timeout`` and the same stacks,
        every rank's, in two samples with no word between them."""
        life = self.life
        if (
            life.phase is not Phase.RUNNING
            or fact.attempt != life.attempt
            or life.ending is not None
            or life.stalled
        ):
            return
        seen = (fact.attempt, fact.quiet_since, fact.stacks)
        self.set(sample=seen)
        timeout = self.policy.stall_timeout
        if timeout is None or fact.quiet < timeout or not fact.complete or life.sample != seen:
            return
        causes = [f"rank {r} in {w}" for r, w in zip(fact.causes, fact.where, strict=True)]
        why = f"no rank progressed for {fact.quiet:.0f} s"
        if causes:
            why += f"; outside a collective (the likely cause): {', '.join(causes)}"
        if fact.waiting:
            why += f"; waiting in a collective: rank(s) {', '.join(map(str, fact.waiting))}"
        self.set(stalled=True)
        self.publish(JobState.STALLED, why)
        action = self.policy.stall_action
        if action is StallAction.WARN:
            return
        rank = fact.causes[0] if fact.causes else None
        worker = life.ranks[rank].worker if rank is not None else None
        self.end(
            Ending(
                EndKind.STALLED,
                why,
                rank,
                worker,
                retry=self.restarts(Cause.STALL),
                cause=Cause.STALL,
                causes=tuple(fact.causes),
            )
        )

    def on_Progressed(self, fact: Progressed) -> None:
        life = self.life
        if life.stalled and life.phase is Phase.RUNNING and fact.attempt == life.attempt:
            self.set(stalled=False)
            if life.ending is None:
                self.publish(JobState.RUNNING, "progress resumed")

    def on_TimerFired(self, fact: TimerFired) -> None:
        life = self.life
        if life.armed(fact.timer) != fact.token:
            return  # disarmed or armed again since
        self.set(timers=tuple((t, k) for t, k in life.timers if t is not fact.timer))
        if fact.timer is Timer.ORPHAN:
            timeout = self.policy.orphan_timeout
            self.on_CancelAsked(
                CancelAsked(
                    f"no client followed the job for {timeout:.0f} s (ddp.orphan-timeout); "
                    "attach within that time to keep it, or launch with detach=True"
                )
            )
        elif fact.timer is Timer.SCALE and life.phase is Phase.WAITING:
            need = life.wait.need if life.wait else self.need()
            have = life.wait.have if life.wait else 0
            waited = self.now - (life.short_since if life.short_since is not None else self.now)
            why = (
                f"the cluster had only {have} of the {need} workers the job needs for "
                f"{waited:.0f} s (ddp.scale-timeout)"
            )
            self.actions.append(Withdraw())
            ending = Ending(
                EndKind.SCALE, why, need=need, have=have, waited=self.policy.scale_timeout
            )
            self.finish(JobState.FAILED, ending)
        elif fact.timer is Timer.STOP and life.phase is Phase.STOPPING:
            stuck = frozenset(r.worker for r in life.ranks if not r.clean) - life.restarting
            if stuck:
                self.set(restarting=life.restarting | stuck)
                self.actions.append(RestartWorkers(life.attempt, stuck))
        elif fact.timer in (Timer.GRACE, Timer.DRAIN) and life.phase is Phase.RUNNING:
            self.evaluate(grace_over=fact.timer is Timer.GRACE, drain_over=True)

    def on_ActionFailed(self, fact: ActionFailed) -> None:
        life = self.life
        if fact.action is ActionKind.PLACE:
            if life.phase is not Phase.PLACING or fact.attempt != life.attempt:
                return
            if life.cancel is not None:
                self.finish(JobState.CANCELLED, Ending(EndKind.CANCELLED, life.cancel))
            elif fact.workers:  # a worker left while it was placed: without it, again
                self.set(phase=Phase.WAITING)
                self.actions.append(Note(f"placing attempt {life.attempt} again: {fact.why}"))
                self.ask()
            else:
                ending = Ending(EndKind.PLACEMENT, fact.why, error=fact.error)
                self.finish(JobState.FAILED, ending)
        elif fact.action is ActionKind.RESTART:
            self.set(restarting=life.restarting - fact.workers)
            stuck = [
                r
                for r, rank in enumerate(life.ranks)
                if rank.worker in fact.workers and not rank.clean
            ]
            given_up = frozenset(life.ranks[r].worker for r in stuck) & life.held
            if given_up:  # a rank runs there still: no job may use it
                self.set(held=life.held - given_up)
                self.actions.append(Quarantine(given_up))
                self.actions.append(
                    Note(
                        f"workers {sorted(given_up)} are kept out of dask-ddp jobs: a rank "
                        "there did not stop and the worker could not be restarted"
                    )
                )
            for r in stuck:
                self.update(r, abandoned=True)
            self.progress()
        elif fact.action is ActionKind.ABORT:
            self.actions.append(Note(f"stopping attempt {fact.attempt}'s ranks: {fact.why}"))
        elif fact.action is ActionKind.ASK:
            # The request never reached the pool: nothing would ever offer the job workers.
            if life.phase is Phase.WAITING and fact.attempt == life.attempt:
                why = f"the worker pool could not take the job's request for workers ({fact.why})"
                ending = Ending(EndKind.SUPERVISOR, why, error=fact.why)
                self.actions.append(Withdraw())
                self.finish(JobState.CANCELLED if life.cancel else JobState.FAILED, ending)
        elif fact.action is ActionKind.FINISH:
            # What was left of the job may still be there; nothing of it runs: it is closed.
            self.actions.append(Note(f"its end was not carried out in full: {fact.why}"))
            if life.phase is Phase.ENDED:
                self.set(closed=True)
        elif fact.action in (
            ActionKind.PUBLISH,
            ActionKind.FAIL_TASK,
            ActionKind.TAKE_MORE,
            ActionKind.WITHDRAW,
            ActionKind.DEMAND,
        ):
            # The job's life goes on as decided (a look for more workers is dropped, a
            # request withdrawn at the end is forgotten with the job, adaptive demand shows
            # again at the next change, and a job short of workers still fails after
            # ddp.scale-timeout); its clients are told what could not be done.
            self.actions.append(Note(f"{fact.action.value} failed: {fact.why}"))
        # GROW: the ranks go on at their size; the next change of the cluster tries again

    # -- the attempt ----------------------------------------------------------------------
    def rank(self, attempt: int, rank: int) -> RankLife | None:
        life = self.life
        if attempt != life.attempt or life.phase not in (Phase.RUNNING, Phase.STOPPING):
            return None
        return life.ranks[rank] if 0 <= rank < len(life.ranks) else None

    def update(self, rank: int, **changes: Any) -> None:
        ranks = list(self.life.ranks)
        ranks[rank] = dataclasses.replace(ranks[rank], **changes)
        self.set(ranks=tuple(ranks))

    def progress(self) -> None:
        if self.life.phase is Phase.RUNNING:
            self.evaluate()
        elif self.life.phase is Phase.STOPPING:
            self.stopped()

    def evaluate(self, *, grace_over: bool = False, drain_over: bool = False) -> None:
        """A running attempt's end, from what its ranks and tasks said, once it is known.

        In order: a rank asked to grow; a rank failed with its own error (the first in
        rank order); a rank's worker was lost; a task failed without a word from its rank;
        ranks stopped with no cause of their own, once ``ddp.failure-grace`` passed or
        every task ended (the cause, another rank's error, usually comes first); every
        rank finished (its final marker there, or ``ddp.event-drain-timeout`` passed).
        """
        life = self.life
        ranks = life.ranks
        grow = next((r for r in ranks if r.outcome and r.outcome.verdict is Verdict.GROW), None)
        if grow is not None:
            self.end(Ending(EndKind.GROW, f"grow at the checkpoint of step {grow.outcome.step}"))
            return
        for i, rank in enumerate(ranks):
            if rank.outcome is not None and rank.outcome.verdict.failed:
                cause = Cause.of(rank.outcome.fault)
                why = f"rank {i} failed on {rank.worker}: {rank.outcome.summary}"
                self.end(
                    Ending(
                        EndKind.RANK,
                        why,
                        i,
                        rank.worker,
                        rank.outcome,
                        retry=self.restarts(cause),
                        cause=cause,
                    )
                )
                return
        for i, rank in enumerate(ranks):
            if rank.lost and rank.task is not TaskEnd.MEMORY and rank.outcome is None:
                why = f"rank {i} was lost: its worker {rank.worker} left the cluster while it ran"
                cause = Cause.WORKER_LOST
                self.end(
                    Ending(
                        EndKind.LOST,
                        why,
                        i,
                        rank.worker,
                        retry=self.restarts(cause),
                        lost=True,
                        cause=cause,
                    )
                )
                return
        for i, rank in enumerate(ranks):
            if rank.task is TaskEnd.ERRED and rank.outcome is None:
                why = f"rank {i}'s task failed on {rank.worker}: {rank.task_summary}"
                cause = Cause.TASK
                self.end(
                    Ending(
                        EndKind.TASK, why, i, rank.worker, retry=self.restarts(cause), cause=cause
                    )
                )
                return
        ended = all(r.task is not None or r.lost for r in ranks)
        stopped = [
            (i, r)
            for i, r in enumerate(ranks)
            if r.outcome and r.outcome.verdict is Verdict.STOPPED
        ]
        if stopped:
            if grace_over or ended:
                i, rank = stopped[0]
                outcome = rank.outcome
                why = f"rank {i} stopped: {outcome.summary}"
                if outcome.peer_lost:
                    why = f"rank {i} stopped: a peer's process died ({outcome.summary})"
                cause = Cause.PEER_DIED if outcome.peer_lost else Cause.UNTOLD
                self.end(
                    Ending(
                        EndKind.STOPPED,
                        why,
                        outcome.failed_rank,
                        rank.worker,
                        outcome,
                        retry=self.restarts(cause),
                        lost=outcome.peer_lost,
                        cause=cause,
                        stopped=i,
                    )
                )
            elif life.armed(Timer.GRACE) is None:
                self.arm(Timer.GRACE, self.policy.failure_grace)
            return
        if ended:
            if all(r.outcome is not None for r in ranks) or drain_over:
                missing = [i for i, r in enumerate(ranks) if r.outcome is None]
                for i in missing:
                    self.actions.append(
                        Note(
                            f"rank {i}: its final marker never arrived, so its last records "
                            "may be missing"
                        )
                    )
                self.end(Ending(EndKind.DONE, "every rank finished"))
            elif life.armed(Timer.DRAIN) is None:
                self.arm(Timer.DRAIN, self.policy.drain)

    def end(self, ending: Ending) -> None:
        """The running attempt ends: decide what comes next, then stop its ranks."""
        self.disarm(Timer.GRACE, Timer.DRAIN)
        state, ending = self.decide(ending)
        self.set(phase=Phase.STOPPING, ending=ending, next_state=state, stalled=False)
        if not state.final:  # restarting or resizing: said now, while the ranks stop
            self.publish(state, self.reason(state, ending), ending)
        life = self.life
        running = tuple(i for i, r in enumerate(life.ranks) if not r.clean)
        if running:
            if state.final:  # decided, and said so (the error is known), while they stop
                self.publish(JobState.STOPPING, self.reason(state, ending), ending)
            workers = tuple(life.ranks[i].worker for i in running)
            reason = ending.why if ending.kind is not EndKind.CANCELLED else life.cancel or ""
            self.actions.append(Abort(life.attempt, running, workers, reason, ending.rank))
            self.arm(Timer.STOP, self.policy.failure_grace + STOP_MARGIN)
        self.stopped()

    def restarts(self, cause: Cause) -> bool:
        """Whether an end of this cause earns a restart: :data:`RESTARTS`, and a stall's
        by ``ddp.stall-action``."""
        if cause is Cause.STALL:
            return self.policy.stall_action is StallAction.RESTART
        return RESTARTS[cause]

    def decide(self, ending: Ending) -> tuple[JobState, Ending]:
        """Where the job goes once this attempt has stopped: the one place that says
        restart, resize, fail or finish."""
        life, policy = self.life, self.policy
        if ending.kind is EndKind.CANCELLED:
            return JobState.CANCELLED, ending
        if ending.kind is EndKind.DONE:
            return JobState.SUCCEEDED, ending
        if ending.kind is EndKind.GROW:
            return self.resize(ending)
        if policy.elastic and ending.lost:
            return self.resize(ending)
        if ending.retry and life.restarts_left > 0:
            self.set(restarts_left=life.restarts_left - 1)
            return JobState.RESTARTING, ending
        return JobState.FAILED, ending

    def resize(self, ending: Ending) -> tuple[JobState, Ending]:
        """A resize, unless the job resized ``ddp.max-resizes`` times in the last hour."""
        limit = self.policy.max_resizes
        recent = [t for t in self.life.resizes if t > self.now - _HOUR]
        if limit is not None and len(recent) >= limit:
            why = (
                f"the job resized {len(recent)} times within an hour (ddp.max-resizes: "
                f"{limit}); the last: {self.reason(JobState.RESIZING, ending)}"
            )
            return JobState.FAILED, Ending(
                EndKind.RESIZES, why, ending.rank, ending.worker, resizes=len(recent), limit=limit
            )
        self.set(resizes=(*recent, self.now))
        return JobState.RESIZING, ending

    def reason(self, state: JobState, ending: Ending) -> str:
        if state is JobState.RESTARTING:
            used = self.policy.max_restarts - self.life.restarts_left
            return (
                f"{ending.why}; restart {used} of {self.policy.max_restarts}, from the last "
                "checkpoint"
            )
        if state is JobState.RESIZING and ending.kind is not EndKind.GROW:
            return f"shrink: {ending.why}"
        return ending.why

    def stopped(self) -> None:
        """A stopping attempt is over once every rank is clean: the job goes on to its next
        attempt with the workers it holds, or ends and gives them back."""
        life = self.life
        if life.phase is not Phase.STOPPING or not all(r.clean for r in life.ranks):
            return
        if life.restarting:  # their successors are not there yet: the job waits for them
            return
        self.disarm(Timer.STOP)
        state, ending = life.next_state, life.ending
        assert state is not None and ending is not None
        if life.cancel is not None and not state.final:
            state, ending = JobState.CANCELLED, Ending(EndKind.CANCELLED, life.cancel)
        if state.final:
            self.finish(state, ending)
            return
        self.set(
            phase=Phase.WAITING,
            attempt=life.attempt + 1,
            ranks=(),
            ending=None,
            next_state=None,
            grow_requested=False,
        )
        self.ask()

    def finish(self, state: JobState, ending: Ending) -> None:
        """The job ends in ``state``: every worker it holds goes back, then it says so.
        ``launch()`` raises the job's error if it failed before any attempt was placed."""
        life = self.life
        never_placed = life.attempt == 0 and not life.ranks
        self.disarm(*(t for t, _ in life.timers))
        self.release(life.held)
        self.set(phase=Phase.ENDED, ending=ending, next_state=state)
        error = self.publish(state, self.reason(state, ending), ending)
        self.actions.append(Finish(error if state is JobState.FAILED and never_placed else None))

    # -- workers --------------------------------------------------------------------------
    def need(self) -> int:
        return self.policy.min_workers

    def ask(self) -> None:
        self.set(phase=Phase.WAITING, wait=None)
        self.actions.append(Ask(self.life.attempt, self.policy.max_workers, self.need()))

    def waiting(self, cluster: int) -> None:
        """The job waits: for workers other jobs hold (as long as it takes), or for the
        cluster to grow (``ddp.scale-timeout``, then it fails)."""
        life, need = self.life, self.need()
        left = None
        if cluster >= need:
            wait = Wait(WaitKind.HELD, need, cluster)
            self.disarm(Timer.SCALE)
            self.set(short_since=None)
        else:
            wait = Wait(WaitKind.SMALL, need, cluster)
            since = life.short_since if life.short_since is not None else self.now
            left = self.policy.scale_timeout - (self.now - since)
            self.set(short_since=since)
            if life.armed(Timer.SCALE) is None:
                self.arm(Timer.SCALE, left)
        if life.wait != wait:
            self.set(wait=wait)
            if life.attempt == 0 and life.state is JobState.WAITING and life.wait is None:
                self.publish(JobState.WAITING, wait_text(wait, left))  # the job's first wait
            announce = life.wait is None or life.wait.kind is not wait.kind
            self.actions.append(Waiting(wait, left, announce))

    def release(self, workers: Iterable[str]) -> None:
        """The job holds ``workers`` no more: they are free (the pool hears of it)."""
        workers = frozenset(workers)
        if workers:
            self.set(held=self.life.held - workers)
            self.actions.append(Release(workers))

    def take_more(self) -> None:
        """Whether a job grows: an elastic job running below its most looks, once, for free
        workers (when the cluster changed, and when an attempt starts running: a worker
        that joined while it was placed is seen then, or never)."""
        life = self.life
        if (
            life.phase is Phase.RUNNING
            and self.policy.elastic
            and life.ending is None
            and not life.grow_requested
            and len(life.held) < self.policy.max_workers
        ):
            self.actions.append(TakeMore(self.policy.max_workers, len(life.held) + 1))

    def demand(self) -> None:
        if self.policy.elastic:
            self.actions.append(Demand(max(0, self.policy.max_workers - len(self.life.held))))

    def publish(
        self,
        state: JobState,
        reason: str,
        ending: Ending | None = None,
    ) -> BaseException | None:
        """Enter ``state``; once the job's end is decided, with the error it ends with
        (returned)."""
        life = self.life
        world = len(life.ranks) if state is not JobState.WAITING else 0
        final = state if state.final else None
        if state is JobState.STOPPING and life.next_state is not None and life.next_state.final:
            final = life.next_state
        error = self.error_of(final, ending) if final is not None else None
        self.set(state=state)
        self.actions.append(Publish(state, reason, life.attempt, world, ending, error))
        return error

    def error_of(self, state: JobState, ending: Ending | None) -> BaseException | None:
        """The error a job that ends in ``state`` ends with (``Job.result()`` raises it),
        built from how its attempt ended: typed fields only."""
        job = self.policy.job
        if state is JobState.CANCELLED:
            return errors.JobCancelledError(job, ending.why if ending else "cancelled")
        if state is not JobState.FAILED or ending is None:
            return None
        kind, ranks = ending.kind, self.life.ranks
        rank = ending.rank if ending.rank is not None else 0
        key = ranks[rank].key if rank < len(ranks) else "?"
        worker = ending.worker or "?"
        outcome = ending.outcome
        if kind is EndKind.RANK and outcome is not None:
            return errors.RankFailedError(rank, worker, key, outcome.summary, outcome.traceback)
        if kind is EndKind.TASK:
            summary = ranks[rank].task_summary if rank < len(ranks) else ending.why
            return errors.RankFailedError(rank, worker, key, summary)
        if kind is EndKind.LOST:
            return errors.WorkerLostError(rank, worker, key)
        if kind is EndKind.STOPPED and outcome is not None:
            first = -1 if outcome.peer_lost else outcome.failed_rank
            stopped = ending.stopped if ending.stopped is not None else rank
            return errors.RankStoppedError(stopped, outcome.summary, job=job, failed_rank=first)
        if kind is EndKind.PLACEMENT and isinstance(ending.error, BaseException):
            return ending.error
        if kind is EndKind.SCALE:
            return errors.ScaleTimeoutError(job, ending.need, ending.have, ending.waited)
        if kind is EndKind.RESIZES:
            return errors.TooManyResizesError(job, ending.resizes, ending.limit, ending.why)
        if kind is EndKind.STALLED:
            return errors.JobStalledError(job, ending.why, ending.causes)
        if kind is EndKind.SUPERVISOR:
            return errors.SupervisorError(job, ending.why)
        return errors.DaskDDPError(ending.why)


def wait_text(wait: Wait, left: float | None) -> str:
    """What a waiting job says it waits for.

    >>> wait_text(Wait(WaitKind.SMALL, 3, 1), 299.6)
    'waiting for the cluster to grow: 1 of at least 3 workers there (300 s left)'
    """
    if wait.kind is WaitKind.HELD:
        return (
            f"waiting for {wait.need} free workers: other jobs hold some of the cluster's "
            f"{wait.have}"
        )
    return (
        f"waiting for the cluster to grow: {wait.have} of at least {wait.need} workers there "
        f"({left or 0:.0f} s left)"
    )

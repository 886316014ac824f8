"""The contract between the client, the scheduler's supervisor and the ranks: the ground
floor every wing of the package stands on.

dask-ddp runs in three processes' roles, each a *wing* that imports only this module, the
shared values (:mod:`dask_ddp._shared.values`, :mod:`dask_ddp.errors`, :mod:`dask_ddp.config`,
:mod:`dask_ddp._shared.placement`, ...) and its own modules (``tests/test_structure.py`` checks
it): the client (launch, the job's handle and views), the scheduler (the plugin and each
job's supervisor) and the ranks (bootstrap, context, the event sender, checkpoints). What
travels between them is defined here, as records with named fields and a version:

- :class:`RankSpec` (its :class:`Rendezvous`, :class:`CheckpointPlan` and
  :class:`EventPlan`): everything a rank task needs, planned by the supervisor.
- :class:`RankOutcome`: how a rank ended, decided by the rank from the exception object
  itself (its class, and whether it earns a restart): the supervisor reads the
  :class:`Verdict`, never an exception's text.
- :class:`Restore`: where a rank of a new attempt reads the last checkpoint.
- The rank's messages (:data:`METRICS`, :class:`Metric`, ...), packed in batches
  (:func:`encode`, :func:`decode`), and what each event tells the supervisor and the
  clients in the clear (:class:`Told`), each event stamped with :data:`VERSION`.
- Names: task keys (:func:`rank_key`), event topics (:func:`job_topic`), the datasets an
  attempt's futures are published under (:func:`dataset_name`), the scheduler handlers
  the client calls (:data:`HANDLERS`), and the functions one wing runs in another's
  process, by name (:class:`Entry`, :func:`call`): the scheduler never imports the rank's
  code to run it, nor the client the scheduler's.

Each record has a ``to_wire``/``from_wire`` pair of plain values (msgpack-able); a reader
refuses a record of a newer version than it knows rather than misreading it.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack
from distributed.diagnostics.plugin import WorkerPlugin

from ..errors import WIRE_VERSION, WireVersionError
from .placement import RankPlacement
from .values import AttemptStart, JobState, Transition

__all__ = [
    "BLOB_HANDLER",
    "HANDLERS",
    "VERSION",
    "CheckpointPlan",
    "Ended",
    "Entry",
    "EventPlan",
    "Fault",
    "RankEnd",
    "RankOutcome",
    "RankSpec",
    "Rendezvous",
    "Restore",
    "StateMessage",
    "Told",
    "Verdict",
    "acall",
    "call",
    "dataset_name",
    "decode",
    "encode",
    "flush_interval",
    "is_rank_key",
    "job_topic",
    "order_mark",
    "pick_curve_metric",
    "rank_key",
    "record",
    "run_id_of",
    "sweep_topic",
]

#: The version of the records below; a reader takes records of this version or older.
VERSION = WIRE_VERSION


def _check_version(kind: str, data: dict[str, Any]) -> None:
    version = data.get("v", VERSION)
    if not isinstance(version, int) or version > VERSION:
        raise WireVersionError(kind, version)


def _known_fields(cls: type, kind: str, data: dict[str, Any]) -> dict[str, Any]:
    """The values of ``data`` that are fields of the record class ``cls`` (a newer peer's
    extra keys left out), once its version is one this dask-ddp reads."""
    _check_version(kind, data)
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


class Verdict(str, enum.Enum):
    """What a rank's end means for its job, as the rank decided it.

    - ``done``: the function returned.
    - ``grow``: an elastic job's ranks stopped at a checkpoint to grow onto more workers.
    - ``stopped``: stopped from outside (the job was cancelled or is being stopped), or
      because another rank failed first (:attr:`RankOutcome.failed_rank`).
    - ``fail``: failed with its own error; :attr:`RankOutcome.fault` says what failed,
      and the job's supervisor alone decides from it whether the job restarts
      (``lifecycle.RESTARTS``).

    >>> Verdict("fail").failed, Verdict.STOPPED.failed
    (True, False)
    """

    DONE = "done"
    GROW = "grow"
    STOPPED = "stopped"
    FAIL = "fail"

    @property
    def failed(self) -> bool:
        """Whether the rank itself failed (its own error)."""
        return self is Verdict.FAIL


class Fault(str, enum.Enum):
    """What failed, as a failed rank tells it from its exception's class (a typed fact:
    whether that restarts the job is the supervisor's decision, never the rank's).

    - ``code``: the job's own code raised.
    - ``asked``: a :class:`~dask_ddp.RetryableError`: the code asks for a restart.
    - ``infrastructure``: an :class:`~dask_ddp.InfrastructureError`, what runs the job
      failed (the store, a rendezvous, a sample fetch, storage that did not answer).
    - ``credentials``: storage refused the credentials
      (:class:`~dask_ddp.errors.StorageAccessError` with ``problem="credentials"``): a
      restart would meet the same refusal.
    """

    CODE = "code"
    ASKED = "asked"
    INFRASTRUCTURE = "infrastructure"
    CREDENTIALS = "credentials"


class RankEnd(str, enum.Enum):
    """How a rank's task ended, as every view shows it (its row's status).

    - ``finished``: its function returned.
    - ``failed``: its function raised.
    - ``stopped``: it was stopped (the job was cancelled, another rank failed, the job grows).
    - ``lost``: its worker left the cluster before the rank said how it ended.
    """

    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"


@dataclasses.dataclass(frozen=True)
class Ended:
    """A rank's end as the supervisor decided it, sent to every client as it is: ``how``,
    and ``why`` in words for people (never parsed back).

    >>> e = Ended(RankEnd.FAILED, "ValueError: bad batch")
    >>> e.describe(), Ended.from_wire(e.to_wire()) == e
    ('failed: ValueError: bad batch', True)
    """

    how: RankEnd
    why: str = ""

    def describe(self) -> str:
        """The end in a few words, as a rank's row says it."""
        return f"{self.how.value}: {self.why}" if self.why else self.how.value

    def to_wire(self) -> list[str]:
        return [self.how.value, self.why]

    @classmethod
    def from_wire(cls, data: list[str]) -> Ended:
        how, why = data
        return cls(RankEnd(how), str(why))


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
    fault : Fault or None
        ``fail``: what failed (the job's code, the infrastructure, credentials, ...).
    value : bytes or None
        ``done``: the rank's return value, pickled, when it is no larger than
        ``ddp.result-limit``: the job's supervisor holds it, so that ``Job.result()``
        answers after the rank's worker left (:meth:`holding`).
    number : float or None
        ``done``: the return value as a number, when it is one (an int, a float, a numpy
        scalar, a one-element tensor): a sweep's trial takes it as its objective, so the
        scheduler never unpickles a value.

    Examples
    --------
    >>> o = RankOutcome(Verdict.FAIL, "builtins.ValueError", "ValueError: bad batch",
    ...                 fault=Fault.CODE)
    >>> RankOutcome.from_wire(o.to_wire()) == o
    True
    >>> RankOutcome(Verdict.STOPPED, failed_rank=1, summary="ValueError: x").end().describe()
    'stopped: rank 1 failed'
    """

    verdict: Verdict
    error_class: str | None = None
    summary: str = ""
    traceback: str = ""
    failed_rank: int | None = None
    peer_lost: bool = False
    step: int | None = None
    fault: Fault | None = None
    value: bytes | None = None
    number: float | None = None

    def holding(self, value: bytes | None, limit: int) -> RankOutcome:
        """This outcome with the rank's pickled return value, if it succeeded and
        ``value`` is at most ``limit`` bytes (larger values stay on the rank's worker).

        >>> o = RankOutcome(Verdict.DONE)
        >>> o.holding(b"12345", limit=8).value, o.holding(b"123456789", limit=8).value
        (b'12345', None)
        >>> RankOutcome(Verdict.FAIL).holding(b"1", limit=8).value is None
        True
        """
        if self.verdict is not Verdict.DONE or value is None or len(value) > limit:
            return self
        return dataclasses.replace(self, value=value)

    def end(self) -> Ended:
        """How the rank ended, as its row in the views says it."""
        if self.verdict.failed:
            return Ended(RankEnd.FAILED, self.summary)
        if self.verdict is Verdict.STOPPED:
            if self.failed_rank is not None:
                return Ended(RankEnd.STOPPED, f"rank {self.failed_rank} failed")
            return Ended(RankEnd.STOPPED, self.summary)
        if self.verdict is Verdict.GROW:
            return Ended(RankEnd.STOPPED, f"the job resizes at step {self.step}")
        return Ended(RankEnd.FINISHED)

    def to_wire(self) -> dict[str, Any]:
        """Plain values with the record's version."""
        fault = None if self.fault is None else self.fault.value
        return {
            "v": VERSION,
            **dataclasses.asdict(self),
            "verdict": self.verdict.value,
            "fault": fault,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> RankOutcome:
        """The outcome :meth:`to_wire` described.

        Raises
        ------
        WireVersionError
            The record is of a newer version than this dask-ddp reads.
        """
        values = _known_fields(cls, "rank outcome", data)
        fault = data.get("fault")
        return cls(
            **{
                **values,
                "verdict": Verdict(data["verdict"]),
                "fault": None if fault is None else Fault(fault),
            }
        )


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


def sweep_topic(sweep_id: str) -> str:
    """The event topic of one sweep (its state; each trial's job has a topic of its own).

    >>> sweep_topic("5e1d")
    'dask-ddp-sweep-5e1d'
    """
    return f"dask-ddp-sweep-{sweep_id}"


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


def order_mark(client_id: str) -> str:
    """The dataset a client publishes before it launches a job: ``Client.publish_dataset``
    returns once the scheduler has read the client's stream that far, so the job comes
    after every task the client submitted before it (the plugin drops it with the client).

    >>> order_mark("Client-1")
    'dask-ddp-order-Client-1'
    """
    return f"dask-ddp-order-{client_id}"


def run_id_of(job_id: str, attempt: int) -> str:
    """An attempt's id: the job's id for the first, ``<job id>-<attempt>`` after; every
    event of a rank carries it.

    >>> run_id_of("3f2a", 0), run_id_of("3f2a", 2)
    ('3f2a', '3f2a-2')
    """
    return job_id if attempt == 0 else f"{job_id}-{attempt}"


_RANK_KEY = re.compile(r"ddp_\w*-rank\d+-[0-9a-f]+(-\d+)?$")


def rank_key(name: str, run: str, rank: int) -> str:
    """A rank task's key. Dask's task stream, progress bars and Prometheus metrics group
    tasks by the key's leading words (``dask.utils.key_split``): here ``ddp_<name>``, the
    same for every job of one function, so that the scheduler's per-prefix state stays
    bounded however many jobs run. The rank and the attempt's run id follow, for the
    ``/ddp/`` page and for people reading a key.

    >>> rank_key("train.py", "3f2a9c1b2d4e-1", 0)
    'ddp_train_py-rank0-3f2a9c1b2d4e-1'
    >>> from dask.utils import key_split
    >>> key_split(rank_key("Trainer.fit.<locals>.step", "abcdefabcdef", 1))
    'ddp_Trainer_fit_locals_step'
    """
    word = re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_")[:40] or "fn"
    return f"ddp_{word}-rank{rank}-{run}"


def is_rank_key(key: object) -> bool:
    """Whether ``key`` is a rank task's (:func:`rank_key`).

    >>> is_rank_key(rank_key("train", "3f2a9c1b2d4e", 0)), is_rank_key("ddp_x")
    (True, False)
    """
    return isinstance(key, str) and _RANK_KEY.match(key) is not None


def flush_interval(ranks: int, interval: float, rate: float) -> float:
    """How often each rank of a job of ``ranks`` ranks sends its buffered messages:
    every ``interval`` seconds (``ddp.event-flush-interval``), or less often, so that the
    job's ranks together send the scheduler at most ``rate`` events a second
    (``ddp.job-event-rate``). The scheduler's cost is per event (a read, a relay, a write,
    whatever the batch holds): a fixed interval would make it grow with the job.

    >>> flush_interval(256, 0.2, 2000)
    0.2
    >>> flush_interval(1000, 0.2, 2000)
    0.5
    """
    return max(interval, ranks / rate)


# -- what runs in another wing's process, by name ------------------------------------------
class Entry:
    """The functions one wing runs in another's processes (``Client.run``, a rank task, a
    worker plugin), named ``module:function`` so that the caller need not import them: the
    scheduler plans ranks without importing the rank's code, and the client installs the
    scheduler's plugin without importing it. :func:`call` and :func:`acall` import and
    run them where they run."""

    PROBE = "dask_ddp._rank.tasks:probe_worker"  # async: GPUs, and rank 0's store
    RUN_RANK = "dask_ddp._rank.tasks:run_rank"  # the rank task
    ABORT = "dask_ddp._rank.tasks:abort_rank"
    RANK_STACKS = "dask_ddp._rank.tasks:rank_stacks"  # every thread's stack, from faulthandler
    REQUEST_GROW = "dask_ddp._rank.tasks:request_grow"
    DROP_STORE = "dask_ddp._rank.tasks:drop_store"  # rank 0's store, when placing failed
    HELD_REPLICAS = "dask_ddp._rank.replicas:held_for"
    DROP_REPLICAS = "dask_ddp._rank.replicas:drop_job"
    DROP_HELD = "dask_ddp._rank.channel:drop_held"
    TAKE_BLOB = "dask_ddp._rank.channel:take_blob"  # a large message, through the scheduler
    BLOB_HANDLER = "dask_ddp._rank.channel:BlobHandler"  # a WorkerPlugin class
    REPLICA_PLUGIN = "dask_ddp._rank.replicas:ReplicaPlugin"  # a WorkerPlugin class
    TEMPLATE_PLUGIN = "dask_ddp._rank.tasks:TemplatePlugin"  # a WorkerPlugin class
    INSTALL_PLUGIN = "dask_ddp._scheduler.plugin:install_for_client"  # async, on the scheduler


def resolve(entry: str) -> Callable[..., Any]:
    """The function (or class) ``entry`` (``"dask_ddp.module:name"``) names.

    >>> resolve("dask_ddp._shared.protocol:job_topic")("3f2a")
    'dask-ddp-3f2a'
    """
    module, _, name = entry.partition(":")
    if not module.startswith("dask_ddp.") or not name:
        raise ValueError(f"{entry!r} is not a dask_ddp function (dask_ddp.<module>:<name>)")
    return getattr(importlib.import_module(module), name)


def _server_kwargs(fn: Callable[..., Any], worker: Any, scheduler: Any) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    given = {"dask_worker": worker, "dask_scheduler": scheduler}
    return {k: v for k, v in given.items() if k in params and v is not None}


def call(
    entry: str, *args: Any, dask_worker: Any = None, dask_scheduler: Any = None, **kwargs: Any
) -> Any:
    """Run ``entry`` here (a task, or ``Client.run``, which passes the server it runs on).

    >>> call("dask_ddp._shared.protocol:run_id_of", "3f2a", 1)
    '3f2a-1'
    """
    fn = resolve(entry)
    return fn(*args, **kwargs, **_server_kwargs(fn, dask_worker, dask_scheduler))


async def acall(
    entry: str, *args: Any, dask_worker: Any = None, dask_scheduler: Any = None, **kwargs: Any
) -> Any:
    """:func:`call` for an ``entry`` that is a coroutine function (``Client.run`` awaits it
    on the server's event loop)."""
    fn = resolve(entry)
    return await fn(*args, **kwargs, **_server_kwargs(fn, dask_worker, dask_scheduler))


class NamedWorkerPlugin(WorkerPlugin):
    """A worker plugin registered by name: the class ``entry`` names is imported on each
    worker, never by whoever registers it (the scheduler's plugin)."""

    idempotent = True  # a second registration leaves the installed one alone

    def __init__(self, entry: str, name: str) -> None:
        self.entry, self.name = entry, name
        self._plugin: Any = None

    def setup(self, worker: Any) -> Any:
        self._plugin = resolve(self.entry)()
        return self._plugin.setup(worker)

    def teardown(self, worker: Any) -> Any:
        if self._plugin is not None:
            return self._plugin.teardown(worker)
        return None


#: The worker handler that hands a rank's large messages to a client (they never travel
#: through the scheduler: :class:`dask_ddp._rank.channel.BlobHandler` serves them).
BLOB_HANDLER = "dask_ddp_blob"

#: The scheduler handlers dask-ddp's plugin serves, which clients call by name
#: (``dask_ddp._shared.dask_internals.call_scheduler``): each answers with plain values, a refusal
#: too (``{"refused": errors.to_wire(...)}``), so that no scheduler log holds a job's payload.
HANDLERS = {
    "launch": "dask_ddp_launch",
    "cancel": "dask_ddp_cancel",
    "attach": "dask_ddp_attach",
    "list": "dask_ddp_list",
    "forget": "dask_ddp_forget",
    "values": "dask_ddp_values",
    "ready": "dask_ddp_ready",
    "sweep": "dask_ddp_sweep",
    "sweep_cancel": "dask_ddp_sweep_cancel",
    "sweep_trials": "dask_ddp_sweep_trials",
}


# -- what the supervisor tells its clients ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StateMessage:
    """The job as its supervisor tells every client: on the job's topic at each change, and
    as the answer to ``launch()`` and ``attach()`` (which adds ``summary`` and
    ``checkpoints``). Read by field on both sides, as the other records between the wings.

    ``version`` grows with each message (a client ignores older ones); ``outcome`` is the
    state the job ends in once that is decided (while it is ``stopping``); ``ended`` says how
    each rank of the attempt ended, so far; ``error`` is the job's error as
    :func:`dask_ddp.errors.to_wire` sends it; ``stopped``: nothing of the job runs any more
    (its life is closed).

    >>> m = StateMessage("3f2a", JobState.RUNNING, version=2, workers=("tcp://a:1",))
    >>> StateMessage.from_wire(m.to_wire()) == m
    True
    >>> StateMessage.is_one({"kind": "state", "job": "3f2a"}, "3f2a")
    True
    """

    job: str
    state: JobState
    version: int = 0
    name: str | None = None
    outcome: JobState | None = None
    attempt: int = 0
    run_id: str | None = None
    workers: tuple[str, ...] = ()
    backend: str = ""
    dataset: str | None = None
    keys: tuple[str, ...] = ()
    ended: tuple[Ended | None, ...] = ()
    waiting: str | None = None
    history: tuple[Transition, ...] = ()
    starts: tuple[AttemptStart, ...] = ()
    error: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()
    total: int | None = None
    stopped: bool = False
    launched_by: str = "?"
    started: float = 0.0
    detached: bool = False

    @staticmethod
    def is_one(msg: Any, job: str) -> bool:
        """Whether an event of the job's topic is this job's state message."""
        return isinstance(msg, dict) and msg.get("kind") == "state" and msg.get("job") == job

    def to_wire(self) -> dict[str, Any]:
        """Plain (msgpack-able) values with the record's version."""
        return {
            "kind": "state",
            "v": VERSION,
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
            "state": self.state.value,
            "outcome": None if self.outcome is None else self.outcome.value,
            "workers": list(self.workers),
            "keys": list(self.keys),
            "ended": [e and e.to_wire() for e in self.ended],
            "history": [t.to_wire() for t in self.history],
            "starts": [s.to_wire() for s in self.starts],
            "notes": list(self.notes),
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> StateMessage:
        """The message :meth:`to_wire` described (other keys, such as ``summary``, are
        left out).

        Raises
        ------
        WireVersionError
            The record is of a newer version than this dask-ddp reads.
        """
        plain = _known_fields(cls, "state message", data)
        outcome = data.get("outcome")
        return cls(
            **{
                **plain,
                "state": JobState(data["state"]),
                "outcome": JobState(outcome) if outcome else None,
                "workers": tuple(data.get("workers") or ()),
                "keys": tuple(data.get("keys") or ()),
                "ended": tuple(
                    Ended.from_wire(e) if e is not None else None for e in data.get("ended") or ()
                ),
                "history": tuple(Transition.from_wire(t) for t in data.get("history") or ()),
                "starts": tuple(AttemptStart.from_wire(t) for t in data.get("starts") or ()),
                "notes": tuple(data.get("notes") or ()),
            }
        )


# -- what a rank task needs ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """How a rank joins its process group: rank 0's store (opened on its worker before any
    rank runs), the backend and the timeouts."""

    backend: str
    master_addr: str
    master_port: int
    timeout: float  # the process group's (ddp.timeout)
    rendezvous_timeout: float  # for every rank to join (ddp.rendezvous-timeout)
    init_process_group: bool = True  # False: the script calls init_process_group itself


@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """Where a rank's checkpoints go and where its state comes from on a restart."""

    directory: str | None = None
    keep_last: int | None = None
    storage_options: dict[str, Any] | None = None
    mode: str = "async"  # ddp.checkpoint.mode
    replica_holder: str | None = None  # the worker keeping this rank's replicas (None: none)
    replica_fraction: float = 0.25  # ddp.checkpoint.replica-memory
    restore: tuple[Restore, ...] = ()  # where the state comes from, as the supervisor decided


@dataclasses.dataclass(frozen=True)
class EventPlan:
    """Where and how often a rank sends its messages."""

    topic: str  # the job's event topic, the same for all its attempts
    # ddp.event-flush-interval, for the job's size. A rank that sent nothing for an
    # interval sends at once (its channel's idle interval is the same): at most one event
    # per rank per interval, idle or busy; with a shorter idle interval, a rank reporting a
    # little less often than a busy one would send more events than it.
    flush_interval: float = 0.05
    max_event_bytes: int = 64_000  # ddp.max-event-bytes (64kB)
    # ddp.result-limit (1 MiB): a return value up to this size rides on the rank's final
    # marker, and the job's supervisor holds it
    result_limit: int = 1_048_576
    # A sweep's trial: the metric its sweep reads (its values at each step tell in the
    # clear, Told.watched), whatever metric the views' curve draws
    watch: str | None = None


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """Everything one rank task needs, planned by the job's supervisor.

    Attributes
    ----------
    job_id : str
        The job's id, the same for all its attempts.
    run_id : str
        This attempt's id (:func:`run_id_of`): every event of the rank carries it.
    key : str
        The rank task's key (:func:`rank_key`).
    attempt : int
        0 for the first placement, one more per restart or resize.
    max_restarts : int
        The restarts the job may make (torchrun's ``TORCHELASTIC_MAX_RESTARTS``).
    placement : RankPlacement
        Where the rank runs and what it sees (rank, local rank, GPUs).
    rendezvous, checkpoint, events
        How it joins its group, where its checkpoints go, where its messages go.
    can_grow : bool
        An elastic job below its size: the ranks may stop at a checkpoint to grow.
    datasets : dict or None
        Its share of ``launch(datasets=)`` (keys and row ranges, no data).
    trial_kwargs : dict or None
        A sweep's trial: the keyword arguments its ``params(trial)`` returned, given to the
        function over the launch's own.
    failure_grace : float
        Seconds a stopped rank's process has between SIGTERM and SIGKILL.
    """

    job_id: str
    run_id: str
    key: str
    attempt: int
    placement: RankPlacement
    rendezvous: Rendezvous
    events: EventPlan
    checkpoint: CheckpointPlan = CheckpointPlan()
    max_restarts: int = 0
    pass_local_rank: bool = False
    threads_per_rank: int | None = None  # ddp.threads-per-rank
    tune_malloc: bool = True  # ddp.tune-malloc
    failure_grace: float = 5.0  # ddp.failure-grace: a stopped rank's SIGTERM to SIGKILL
    can_grow: bool = False
    datasets: dict[str, Any] | None = None
    trial_kwargs: dict[str, Any] | None = None  # a sweep's trial: its params(), over kwargs


# -- what a rank says ----------------------------------------------------------------------
#: The kinds of a rank's messages, each with its record below.
METRICS = "m"  # a report() record: Metric
RESULT = "r"  # a submit_result() payload: Result
CHECKPOINT = "c"  # a checkpoint that is durable: CheckpointNote
REPLICA = "p"  # a checkpoint kept in another worker's memory: ReplicaNote
LOADED = "l"  # where the rank's state came from: LoadedNote
OUTPUT = "o"  # printed lines: Output
STATUS = "s"  # the rank's phase or activity: Status


class Metric(NamedTuple):
    step: int | None
    time: float
    values: dict[str, float]


class Result(NamedTuple):
    key: str | None
    path: str
    data: Any


class CheckpointNote(NamedTuple):
    url: str
    step: int
    nbytes: int
    time: float
    stall: float
    world_size: int | None  # None: the job's state; else the ranks of per-rank state


class ReplicaNote(NamedTuple):
    step: int
    holder: str
    world_size: int | None
    nbytes: int


class LoadedNote(NamedTuple):
    source: str  # "peer" or "store"
    step: int
    where: str


class Output(NamedTuple):
    stream: str  # "stdout" or "stderr"
    text: str  # lines joined by "\n"


class Status(NamedTuple):
    phase: str | None  # "queued", "joining", "running", or None (only the activity changed)
    detail: str
    time: float


RECORDS: dict[str, type[tuple]] = {
    METRICS: Metric,
    RESULT: Result,
    CHECKPOINT: CheckpointNote,
    REPLICA: ReplicaNote,
    LOADED: LoadedNote,
    OUTPUT: Output,
    STATUS: Status,
}


def record(kind: str, body: Any) -> tuple:
    """A message's body as its record (named fields).

    >>> record(METRICS, [3, 1.5, {"loss": 0.25}]).values
    {'loss': 0.25}
    """
    return RECORDS[kind](*body)


def _packer() -> msgpack.Packer:
    return msgpack.Packer(use_bin_type=True, autoreset=True)


def pick_curve_metric(values: dict[str, Any]) -> str:
    """The metric the curve draws: ``loss``, else the first with "loss" in its name, else
    the first.

    >>> pick_curve_metric({"acc": 0.5, "train_loss": 0.2})
    'train_loss'
    """
    if "loss" in values:
        return "loss"
    return next((k for k in values if "loss" in k.lower()), next(iter(values)))


def encode(run: str, rank: int, seq: int, msgs: list[list[Any]]) -> dict[str, Any]:
    """The event carrying ``msgs`` (messages ``seq``, ``seq + 1``, ...) of one rank, and
    what they tell in the clear (:class:`Told`), as a rank's channel sends them.

    The messages travel packed (msgpack, back to back) in one ``bytes`` value: the worker
    and the scheduler then handle one opaque value per batch instead of walking every
    record, which is what caps ``log_event`` near 40,000 records/s.

    >>> decode(encode("3f2a", 0, 5, [["m", [1, 0.0, {"loss": 0.5}]]]))
    [['m', [1, 0.0, {'loss': 0.5}]]]
    """
    packed = b"".join(map(_packer().pack, msgs))
    told, metric = Told(), None
    for kind, body in msgs:
        if kind == METRICS and metric is None and body[2]:
            metric = pick_curve_metric(body[2])
        told.add(kind, body, metric)
    return {
        "v": VERSION, "run": run, "rank": rank, "seq": seq, "n": len(msgs), "packed": packed,
        "told": told.to_wire(),
    }  # fmt: skip


def decode(event: dict[str, Any]) -> list[list[Any]]:
    """The messages of an event made by :func:`encode` (or sent by a rank's channel)."""
    _check_version("event", event)
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=0)
    unpacker.feed(event["packed"])
    return list(unpacker)


_TOLD_POINTS = 16  # curve points an event tells in the clear, at most


@dataclasses.dataclass
class Told:
    """What one event tells in the clear, to the job's supervisor and every client alike
    (:meth:`Progress.take <dask_ddp._shared.progress.Progress.take>`), so that the scheduler
    never unpacks a batch: how many records, the first one's step and time and the last one (for
    rates), the curve's points (one metric's values), the rank's latest status, the
    checkpoints that landed, their replicas, and where the rank's state came from.

    >>> told = Told()
    >>> told.add(METRICS, [1, 0.0, {"loss": 0.5}], "loss")
    >>> told.add(CHECKPOINT, ["file:///c/1.pt", 1, 10, 0.1, 0.0, None], None)
    >>> again = Told.from_wire(told.to_wire())
    >>> again.records, again.last.values, again.checkpoints[0].step
    (1, {'loss': 0.5}, 1)
    """

    records: int = 0
    first: tuple[int | None, float] | None = None
    last: Metric | None = None
    points: list[list[float]] = dataclasses.field(default_factory=list)
    status: Status | None = None
    checkpoints: list[CheckpointNote] = dataclasses.field(default_factory=list)
    replicas: list[ReplicaNote] = dataclasses.field(default_factory=list)
    loaded: LoadedNote | None = None
    watched: list[list[float]] = dataclasses.field(default_factory=list)

    def add(self, kind: str, body: Any, metric: str | None, watch: str | None = None) -> None:
        """Count one message of the batch (``metric``: the curve's; ``watch``: a sweep's,
        every value of which is told, :attr:`watched`)."""
        if kind == METRICS:
            m = Metric(*body)
            self.records += 1
            self.last = m
            if self.first is None:
                self.first = (m.step, m.time)
            x = m.step if m.step is not None else self.records
            if metric in m.values:
                self.points.append([x, m.values[metric]])
                if len(self.points) > 2 * _TOLD_POINTS:
                    del self.points[1:-1:2]  # thinned, the first and the last kept
            if watch is not None and watch in m.values:
                self.watched.append([x, m.values[watch]])
        elif kind == STATUS:
            status = Status(*body)
            if status.phase is None and self.status is not None:  # the batch's phase stays
                status = status._replace(phase=self.status.phase)
            self.status = status
        elif kind == CHECKPOINT:
            self.checkpoints.append(CheckpointNote(*body))
        elif kind == REPLICA:
            self.replicas.append(ReplicaNote(*body))
        elif kind == LOADED:
            self.loaded = LoadedNote(*body)

    def __bool__(self) -> bool:
        return bool(self.records or self.status or self.checkpoints or self.replicas) or (
            self.loaded is not None
        )

    def to_wire(self) -> dict[str, Any]:
        """Plain values: only what there is."""
        wire: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value:
                wire[field.name] = list(value) if isinstance(value, tuple) else value
        return wire

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Told:
        first = data.get("first")
        return cls(
            records=data.get("records", 0),
            first=tuple(first) if first else None,
            last=Metric(*data["last"]) if data.get("last") else None,
            points=[list(p) for p in data.get("points", ())],
            status=Status(*data["status"]) if data.get("status") else None,
            checkpoints=[CheckpointNote(*c) for c in data.get("checkpoints", ())],
            replicas=[ReplicaNote(*r) for r in data.get("replicas", ())],
            loaded=LoadedNote(*data["loaded"]) if data.get("loaded") else None,
            watched=[list(p) for p in data.get("watched", ())],
        )

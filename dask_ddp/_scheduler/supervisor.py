"""A job's supervisor on the scheduler: the facts of its life in, the actions carried out.

:class:`Supervisor` runs one job from its launch to its end, whether or not the client that
launched it is still there. It lives in dask-ddp's scheduler plugin
(:mod:`dask_ddp._scheduler.plugin`), which hands it what the scheduler sees: a rank task's end, a
worker that left or joined, a rank's events, a client that came or went, a cancel. Each
becomes a typed fact of :mod:`dask_ddp._scheduler.lifecycle`, whose one function,
:func:`~dask_ddp._scheduler.lifecycle.step`, decides what it means; the supervisor only carries out
the actions it returns and feeds what comes of them back in, one fact at a time::

    hooks, timers, finished actions --facts--> step() --actions--> pool, launcher, clients
         ^                                                              |
         +--------------------------------------------------------------+

It decides nothing itself. Every transition is one INFO line in the scheduler's log, one
:class:`~dask_ddp.Transition` in the job's history, and one message on the job's event
topic, which every client following the job reads (:mod:`dask_ddp._client.reader`). An action that
fails (placing, stopping ranks, restarting a worker) comes back as a fact, and the job's
life acts on it.

Nothing here blocks the event loop: placing is arithmetic on the scheduler's own worker
table (:mod:`dask_ddp._scheduler.pool`), everything else awaits the plugin's client
(:mod:`dask_ddp._scheduler.launcher`). The function the ranks run is bytes here, never unpickled.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from .. import errors
from .._shared import tracebacks
from .._shared.placement import WorkerInfo, order_workers
from .._shared.progress import Progress, view_state
from .._shared.protocol import RankOutcome, StateMessage, Told, job_topic
from .._shared.values import AttemptStart, CheckpointInfo, JobSpec, JobState, Transition
from ..errors import DaskDDPError, WireVersionError
from . import lifecycle as lc
from .launcher import Attempt, Launcher
from .ledger import CheckpointLedger, describe_sources, writer_rank

logger = logging.getLogger(__name__)

_CHECKPOINTS_KEPT = 1000  # checkpoints a job remembers (Job.checkpoints of a later client)
_NOTES_KEPT = 20


class Host(Protocol):
    """What a supervisor needs of the scheduler plugin that holds it
    (:class:`dask_ddp._scheduler.plugin.DaskDDPPlugin`)."""

    scheduler: Any  # distributed.Scheduler
    client: Any  # the plugin's own asynchronous distributed.Client
    pool: Any  # its dask_ddp._scheduler.pool.WorkerPool
    gpus: dict[str, Any]  # worker -> (GPU count, CUDA_VISIBLE_DEVICES), probed once
    changes: Any  # its dask_ddp._scheduler.page.Changes: the pages wait on it

    def watch_keys(self, job: Supervisor, keys: list[Any]) -> None: ...

    def unwatch_keys(self, keys: list[Any]) -> None: ...

    def job_ended(self, job: Supervisor) -> None: ...


class Observer(Protocol):
    """What follows a job from the scheduler (a sweep, its trials): on the loop, never
    blocking, never calling back into the job while it is told."""

    def told(self, job: Supervisor, rank: int, told: Told) -> None: ...

    def changed(self, job: Supervisor) -> None: ...


def first_line(error: BaseException) -> str:
    """An error in one line: its summary, else the first line of its text."""
    return str(getattr(error, "summary", None) or error).split("\n", 1)[0]


def _failed(action: lc.Action, exc: Exception) -> lc.ActionFailed | None:
    """The fact that ``action``, carried out at once, raised ``exc`` (None for actions
    whose failure changes nothing of the job's life: a timer, a note)."""
    why = f"{type(exc).__name__}: {exc}"
    simple = {
        lc.Ask: lc.ActionKind.ASK,
        lc.TakeMore: lc.ActionKind.TAKE_MORE,
        lc.Withdraw: lc.ActionKind.WITHDRAW,
        lc.Demand: lc.ActionKind.DEMAND,
        lc.Finish: lc.ActionKind.FINISH,
    }
    if type(action) in simple:
        attempt = action.attempt if isinstance(action, lc.Ask) else 0
        return lc.ActionFailed(simple[type(action)], attempt, error=exc, why=why)
    if isinstance(action, lc.Publish):
        return lc.ActionFailed(lc.ActionKind.PUBLISH, action.attempt, error=exc, why=why)
    if isinstance(action, lc.FailTask):
        return lc.ActionFailed(lc.ActionKind.FAIL_TASK, action.attempt, error=exc, why=why)
    if isinstance(action, lc.Submit):
        return lc.ActionFailed(lc.ActionKind.PLACE, action.attempt, error=exc, why=why)
    return None


class Supervisor:
    """One job, attempt after attempt, on the scheduler's loop.

    Parameters
    ----------
    plugin : Host
        The scheduler plugin: its scheduler, its own client, the worker pool.
    spec : JobSpec
        The job as its client sent it.
    size : (int, int)
        How many workers it runs on, at least and at most, checked against the cluster at
        launch (the job's :class:`~dask_ddp._scheduler.lifecycle.Policy` keeps them).
    datasets : optional
        The job's Dask collections, planned again for each attempt.
    observer : Observer, optional
        Told what the ranks tell and each change of the job (a sweep, of its trials).
    """

    def __init__(
        self,
        plugin: Host,
        spec: JobSpec,
        size: tuple[int, int],
        datasets: Any = None,
        observer: Observer | None = None,
    ) -> None:
        self.plugin, self.spec = plugin, spec
        self.observer = observer
        self.job_id = spec.job_id
        self.topic = job_topic(spec.job_id)
        self.settings = settings = spec.settings
        self.policy = lc.Policy(
            min_workers=size[0],
            max_workers=size[1],
            job=spec.job_id,
            max_restarts=spec.max_restarts,
            max_resizes=settings.max_resizes,
            failure_grace=settings.failure_grace,
            drain=settings.event_drain_timeout,
            scale_timeout=settings.scale_timeout,
            orphan_timeout=settings.orphan_timeout,
            stall_timeout=settings.stall_timeout,
            stall_action=lc.StallAction(settings.stall_action),
            result_limit=settings.result_limit,
        )
        self.life = lc.Life.new(self.policy)
        self.history: list[Transition] = []  # appended to, never rewritten
        self.starts: dict[int, AttemptStart] = {}  # what each attempt's entry did not know
        self.attempt: Attempt | None = None
        self._prepared: Attempt | None = None  # probed and planned, not submitted yet
        self.error: BaseException | None = None
        self.wait_reason: str | None = None
        self.notes: list[str] = []
        self.progress = Progress()
        self.checkpoints: list[CheckpointInfo] = []  # what Job.checkpoints of a later client shows
        self.ledger = CheckpointLedger()  # durable checkpoints and replicas: restarts' source
        self.followers: set[str] = set() if spec.detach or not spec.client else {spec.client}
        self.started = time.time()
        self.finished: float | None = None
        self.launch_error: BaseException | None = None  # what launch() raises (Finish)
        self.launcher = Launcher(plugin.client, plugin.scheduler, spec, plugin.gpus, datasets)
        self._datasets = datasets
        self._facts: collections.deque[Any] = collections.deque()
        self._stepping = False
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        self._timers: dict[lc.Timer, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        self._since = self.started  # when the job last stopped training
        self._version = 0  # of the last message to the clients (they ignore older ones)
        # Stalls: when a rank of the current attempt last sent anything (Sampled's
        # quiet_since; the last sample itself is the life's).
        self._progress_at = time.monotonic()
        self._watch: asyncio.TimerHandle | None = None
        self._soon: asyncio.TimerHandle | None = None  # a message due (_publish_soon)
        # The attempt whose futures are being published: no client hears the job's outcome
        # before it can read them (_publish holds that message until then).
        self._publishing: int | None = None

    @property
    def state(self) -> JobState:
        """The job's state, as it was last published."""
        return self.life.state

    @property
    def held(self) -> frozenset[str]:
        """The workers the job holds: its life's record, which the pool asks."""
        return self.life.held

    # -- facts: what the plugin tells it (hooks on the scheduler's loop: never block) ---------
    @property
    def closed(self) -> bool:
        """The job ended and nothing of it is left running (its life says so)."""
        return self.life.closed

    def until(self, done: Callable[[], bool]) -> asyncio.Future[None]:
        """A future that resolves once ``done()`` holds, checked after each fact taken."""
        future = asyncio.get_running_loop().create_future()
        if done():
            future.set_result(None)
        else:
            self._waiters.append((done, future))
        return future

    def start(self) -> None:
        """Start the job's life. Its first state (it runs, waits, or ended) is the first
        entry of :attr:`history`; the plugin answers the launch then (:meth:`until`)."""
        self.feed(lc.Start())
        if self.settings.stall_timeout is not None:
            self._watch_stalls()

    def feed(self, fact: lc.Fact) -> None:
        """Take one fact: its step, then its actions, before the next fact is taken (a fact
        an action brings about waits its turn)."""
        self._facts.append(fact)
        if self._stepping:
            return
        self._stepping = True
        try:
            while self._facts:
                fact = self._facts.popleft()
                self.life, actions = lc.step(self.life, fact, self.policy, time.time())
                for action in actions:
                    try:
                        self._act(action)
                    except Exception as exc:  # a fact: step decides what follows
                        logger.exception("dask-ddp job %s: %s failed", self.job_id, action)
                        failed = _failed(action, exc)
                        if failed is not None:
                            self._facts.append(failed)
        finally:
            self._stepping = False
        waiting = []
        for done, future in self._waiters:
            if not future.done():
                if done():
                    future.set_result(None)
                else:
                    waiting.append((done, future))
        self._waiters = waiting

    def on_event(self, msg: dict[str, Any]) -> None:
        """An event of the job's topic: what a rank told in the clear, or its final marker."""
        a, rank = self.attempt, msg.get("rank")
        if a is None or msg.get("run") != a.run_id or not isinstance(rank, int):
            return  # the supervisor's own messages, or a rank of an attempt before this one
        if not 0 <= rank < len(a.workers):
            return
        self._progress_at = time.monotonic()
        self.plugin.changes.bump()  # the pages show the ranks' progress as it comes
        if self.life.stalled:
            self.feed(lc.Progressed(a.number))
        if msg.get("told"):
            try:
                told = Told.from_wire(msg["told"])
            except (KeyError, TypeError, ValueError) as exc:
                self._note(f"rank {rank}: an event could not be read ({exc})")
            else:
                self._told(a, rank, told)
        if "end" in msg:
            try:
                outcome = RankOutcome.from_wire(msg["outcome"])
            except (WireVersionError, KeyError, TypeError, ValueError) as exc:
                self._note(f"rank {rank}: its final marker could not be read ({exc})")
                return
            self.progress.end(rank, outcome.end())
            self.feed(lc.RankEnded(a.number, rank, outcome))
            self._publish_soon()  # every client's view says how the rank ended, as decided here

    def _told(self, a: Attempt, rank: int, told: Told) -> None:
        self.progress.take(rank, told)
        if self.observer is not None:
            self.observer.told(self, rank, told)
        if told.last is not None and not a.reported:
            a.reported = True
            self._first_step(a)
        if told.status is not None and told.status.phase is not None:
            self.feed(lc.RankStarted(a.number, rank))
        for c in told.checkpoints:
            self.checkpoints.append(
                CheckpointInfo(c.url, c.step, c.nbytes, rank, c.time, c.stall, c.world_size)
            )
            del self.checkpoints[:-_CHECKPOINTS_KEPT]
            self.ledger.landed(rank, c.url, c.step, c.world_size)
        for r in told.replicas:
            self._replicated(rank, r.step, r.holder, r.world_size)
        if told.loaded is not None:
            self._loaded(a, rank, list(told.loaded))

    def on_task(self, rank: int, finish: str, info: dict[str, Any]) -> None:
        """Rank ``rank``'s task of the current attempt reached ``finish`` (memory, erred)."""
        a = self.attempt
        if a is None:
            return
        erred = finish == "erred"
        summary = str(info.get("exception_text") or "") if erred else ""
        self.feed(lc.TaskEnded(a.number, rank, erred, summary))

    def on_worker_removed(self, address: str) -> None:
        """A worker left the cluster."""
        self.feed(lc.WorkerLost(address))

    def workers_changed(self) -> None:
        """Workers joined, left or were given back (a waiting job looks again; an elastic
        one may grow)."""
        self.feed(lc.ClusterChanged(self.plugin.pool.usable()))

    def follow(self, client: str) -> None:
        """A client attached: the job is followed again."""
        self.followers.add(client)
        self.feed(lc.ClientAttached())

    def unfollow(self, client: str) -> None:
        """A client left; with nobody left to follow it, the job is cancelled after
        ``ddp.orphan-timeout`` unless a client attaches (or it was launched detached)."""
        if client not in self.followers:
            return
        self.followers.discard(client)
        if not self.followers and not self.spec.detach:
            self.feed(lc.ClientLeft())

    def cancel(self, reason: str) -> None:
        """Ask the job to stop (it ends cancelled); :attr:`closed` once it has."""
        self.feed(lc.CancelAsked(reason))

    # -- actions ------------------------------------------------------------------------------
    def _act(self, action: lc.Action) -> None:
        pool = self.plugin.pool
        if isinstance(action, lc.Ask):
            self._ask(action.attempt, action.want, action.need, waits=True)
        elif isinstance(action, lc.Withdraw):
            pool.withdraw(self.job_id)
        elif isinstance(action, lc.Place):
            self._spawn(self._place(action), lc.ActionKind.PLACE, action.attempt)
        elif isinstance(action, lc.Submit):
            self._submit(action)
        elif isinstance(action, lc.Discard):
            self._discard(action)
        elif isinstance(action, lc.Abort):
            self._spawn(self._abort(action), lc.ActionKind.ABORT, action.attempt)
        elif isinstance(action, lc.RestartWorkers):
            logger.warning(
                "dask-ddp job %s: ranks on %s did not stop within %.0f s (ddp.failure-grace: "
                "blocked in C++, or never at a safe point); restarting those workers",
                self.job_id, sorted(action.workers), self.settings.failure_grace,
            )  # fmt: skip
            self._spawn(self._restart(action), lc.ActionKind.RESTART, action.attempt)
        elif isinstance(action, lc.FailTask):
            self._fail_task(action)
        elif isinstance(action, lc.Release):
            pool.changed()
        elif isinstance(action, lc.Quarantine):
            pool.quarantine(self.job_id, action.workers)
        elif isinstance(action, lc.TakeMore):
            self._ask(self.life.attempt + 1, action.want, action.need, waits=False)
        elif isinstance(action, lc.RequestGrow):
            a = self.attempt
            if a is not None and a.number == action.attempt:
                logger.info(
                    "dask-ddp job %s: more workers free; the job grows to %d ranks at its "
                    "next checkpoint", self.job_id, len(self.life.held),
                )  # fmt: skip
                self._spawn(self.launcher.request_grow(a), lc.ActionKind.GROW, a.number)
        elif isinstance(action, lc.Demand):
            pool.demand(self.job_id, action.missing)
        elif isinstance(action, lc.Arm):
            self._arm(action)
        elif isinstance(action, lc.Disarm):
            handle = self._timers.pop(action.timer, None)
            if handle is not None:
                handle.cancel()
        elif isinstance(action, lc.Publish):
            self._transition(action)
        elif isinstance(action, lc.Waiting):
            self._waiting(action)
        elif isinstance(action, lc.Note):
            self._note(action.text)
        elif isinstance(action, lc.Finish):
            self.launch_error = action.error
            self._spawn(self._finish(), lc.ActionKind.FINISH, 0)

    def _spawn(self, work: Any, kind: lc.ActionKind | None, attempt: int) -> None:
        """Run ``work`` on the loop; if it raises, that is a fact (``ActionFailed``)."""

        async def run() -> None:
            try:
                await work
            except Exception as exc:
                if kind is None:  # a look that changes nothing of the job (a stall sample)
                    logger.exception("dask-ddp job %s: a background step failed", self.job_id)
                    return
                why = f"{type(exc).__name__}: {exc}"
                logger.warning("dask-ddp job %s: %s failed: %s", self.job_id, kind.value, why)
                self.feed(lc.ActionFailed(kind, attempt, error=exc, why=why))

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- stalls ----------------------------------------------------------------------------
    def _watch_stalls(self) -> None:
        """Every quarter of ``ddp.stall-timeout``: once no rank sent anything for half of
        it, sample the ranks' stacks (a fact for ``step``, which decides whether the job
        stalled, says so and acts)."""
        timeout = self.settings.stall_timeout
        assert timeout is not None
        if self.life.phase is lc.Phase.ENDED:
            return
        loop = asyncio.get_running_loop()
        self._watch = loop.call_later(max(0.5, timeout / 4), self._watch_stalls)
        a = self.attempt
        quiet = time.monotonic() - self._progress_at
        if a is None or self.life.phase is not lc.Phase.RUNNING or self.life.stalled:
            return
        if quiet >= timeout / 2:
            self._spawn(self._sample(a), None, a.number)

    async def _sample(self, a: Attempt) -> None:
        """Sample the stacks of ``a``'s ranks, and where each is: a :class:`~.lifecycle.
        Sampled` fact, unless a rank spoke meanwhile (the stacks may be of before it)."""
        from .._shared.protocol import Entry, call

        since = self._progress_at
        try:
            answers = await self.plugin.client.run(
                call, Entry.RANK_STACKS, self.job_id, workers=sorted(set(a.workers)),
                on_error="return",
            )  # fmt: skip
        except Exception as exc:  # a worker left meanwhile: this sample is none
            logger.info("dask-ddp job %s: could not sample its stacks: %s", self.job_id, exc)
            return
        if a is not self.attempt or self._progress_at != since:
            return
        stacks = sorted(
            (rank, text)
            for found in answers.values()
            if isinstance(found, list)
            for rank, text in found
        )
        causes, where, waiting = [], [], []
        for rank, text in stacks:
            in_collective, at = tracebacks.stuck_at(text, self.spec.sources)
            if in_collective:
                waiting.append(rank)
            else:
                causes.append(rank)
                where.append(at)
        self.feed(
            lc.Sampled(
                a.number,
                time.monotonic() - since,
                since,
                tuple(stacks),
                complete=len(stacks) >= len(a.workers),
                causes=tuple(causes),
                where=tuple(where),
                waiting=tuple(waiting),
            )
        )

    def _ask(self, number: int, want: int, need: int, *, waits: bool) -> None:
        """Ask the pool for workers for attempt ``number``: :class:`~.lifecycle.Offered`
        once free ones suffice; if they do not at first, :class:`~.lifecycle.Short` and the
        request waits (``waits``), else it is dropped (an elastic job's look for more)."""
        named = number == 0 and isinstance(self.spec.workers, list)
        self.plugin.pool.ask(
            self,
            lambda: self._candidates(number),
            want=want,
            need=need,
            on_offer=lambda workers: self.feed(lc.Offered(tuple(workers))),
            on_short=(lambda cluster: self.feed(lc.Short(cluster))) if waits else None,
            demand=not named,
        )

    async def _place(self, action: lc.Place) -> None:
        """Probe, open the store, plan, submit: the attempt is placed (a fact), then its
        futures are published for every client."""
        workers = list(action.workers)
        try:
            attempt = await self.launcher.prepare(
                action.attempt, workers, can_grow=len(workers) < self.policy.max_workers
            )
        except Exception as exc:
            # What it saw: the workers that left meanwhile (step places the attempt again
            # without them), and the error (step fails the job with it: a backend without
            # GPUs, a dataset partition lost for good, or a bug, logged with its traceback).
            gone = frozenset(w for w in workers if w not in self.plugin.scheduler.workers)
            if not gone and not isinstance(exc, DaskDDPError):
                logger.exception("dask-ddp job %s: placing it failed", self.job_id)
            why = (
                first_line(exc) if isinstance(exc, DaskDDPError) else f"{type(exc).__name__}: {exc}"
            )
            self.feed(lc.ActionFailed(lc.ActionKind.PLACE, action.attempt, gone, exc, why))
            return
        last = self.attempt
        if last is not None:  # the attempt before: its futures go, its replicas are counted
            await self.launcher.unpublish(last)
            self.plugin.unwatch_keys(last.keys)
            await self._find_replicas(last)
        self._prepared = attempt
        self.feed(lc.Prepared(attempt.number))

    def _submit(self, action: lc.Submit) -> None:
        """Submit the prepared attempt: it is placed (a fact, taken before any other), then
        its futures are published for every client."""
        attempt, self._prepared = self._prepared, None
        if attempt is None or attempt.number != action.attempt:
            return
        source, step = self._restore(attempt)
        self.starts[attempt.number] = AttemptStart(attempt.number, None, source, step)
        self.attempt = attempt
        self.plugin.watch_keys(self, attempt.keys)
        self.progress.place(attempt.workers)
        self.launcher.submit(attempt)
        # Clients hear of the placement before any of its ranks can say a word ...
        self._progress_at = time.monotonic()
        known = self.plugin.scheduler.workers
        hosts = len({known[w].host for w in attempt.workers if w in known})
        self.feed(lc.Placed(attempt.number, tuple(attempt.workers), tuple(attempt.keys), hosts))
        # ... then of its futures, once any client can read them.
        self._publishing = attempt.number
        self._spawn(self._publish_attempt(attempt), lc.ActionKind.PUBLISH, attempt.number)

    async def _publish_attempt(self, attempt: Attempt) -> None:
        try:
            await self.launcher.publish(attempt)
        finally:
            if self._publishing == attempt.number:
                self._publishing = None
            self._publish()  # with the futures' name; and an outcome held meanwhile

    def _discard(self, action: lc.Discard) -> None:
        """A prepared attempt that never runs: its store closes; nothing else was made."""
        attempt, self._prepared = self._prepared, None
        if attempt is not None and attempt.number == action.attempt:
            self._cleanup(
                self.launcher.drop_store(attempt.run_id, attempt.store_worker),
                f"close attempt {attempt.number}'s store",
            )

    async def _abort(self, action: lc.Abort) -> None:
        a = self.attempt
        if a is None or a.number != action.attempt:
            return
        idle = await self.launcher.abort(a, action.ranks, action.reason, action.cause)
        self.feed(lc.AbortAnswered(action.attempt, frozenset(idle)))

    async def _restart(self, action: lc.RestartWorkers) -> None:
        try:
            done, failed = await self.launcher.restart(
                sorted(action.workers),
                self.plugin.pool,
                timeout=self.settings.rendezvous_timeout,
            )
        except Exception as exc:  # none answered: step quarantines them all, never waits
            done, failed = set(), set(action.workers)
            logger.warning("dask-ddp job %s: restarting %s failed", self.job_id, failed)
            why = f"could not restart {sorted(failed)}: {type(exc).__name__}: {exc}"
        else:
            why = f"could not restart {sorted(failed)}"
        if done:
            self.feed(lc.WorkersRestarted(frozenset(done)))
        if failed:
            self.feed(
                lc.ActionFailed(lc.ActionKind.RESTART, action.attempt, frozenset(failed), why=why)
            )

    def _fail_task(self, action: lc.FailTask) -> None:
        a = self.attempt
        if a is None or a.number != action.attempt:
            return
        if action.status is not None:
            self.progress.end(action.rank, action.status)
        self.launcher.fail_lost(a, action.rank, action.error)

    def _arm(self, action: lc.Arm) -> None:
        old = self._timers.pop(action.timer, None)
        if old is not None:
            old.cancel()
        fact = lc.TimerFired(action.timer, action.token)
        self._timers[action.timer] = asyncio.get_running_loop().call_later(
            action.seconds, self.feed, fact
        )

    # -- placing ------------------------------------------------------------------------------
    async def _find_replicas(self, last: Attempt) -> None:
        """Ask the workers that keep the job's replicas what they hold before planning the
        next attempt: a rank's word that its replica landed is lost when its worker dies
        right after (SIGKILL within milliseconds), while the replica itself is safe."""
        holders = self.ledger.holders() | {
            s.checkpoint.replica_holder for s in last.specs if s.checkpoint.replica_holder
        }
        if not holders:
            return
        try:
            held = await self.launcher.held_replicas(sorted(holders))
        except Exception as exc:  # the restart reads the store instead
            self._note(f"could not ask {sorted(holders)} which replicas they hold: {exc}")
            return
        for holder, entries in held.items():
            for writer, world, step in entries:
                if self.ledger.found(writer, world, step, holder):
                    logger.info(
                        "dask-ddp job %s: %s keeps the replica of rank %d's checkpoint of "
                        "step %d, which its rank did not get to announce",
                        self.job_id, holder, writer, step,
                    )  # fmt: skip

    def _restore(self, attempt: Attempt) -> tuple[str | None, int | None]:
        """Decide where each rank of a new attempt reads the last checkpoint (a surviving
        peer's memory, else the store) and tell the ranks; return it in one word, and the
        checkpoint's step."""
        plans, source, step = self.ledger.plan(len(attempt.workers), self.plugin.scheduler.workers)
        if source is None:
            return None, None
        self.launcher.restore_from(attempt, plans)
        where = "; ".join(
            f"rank {rank}: {', '.join(r.describe() for r in plan)}"
            for rank, plan in enumerate(plans)
        )
        logger.info(
            "dask-ddp job %s: attempt %d resumes from the checkpoint of step %d (%s): %s",
            self.job_id, attempt.number, step, source, where,
        )  # fmt: skip
        return source, step

    def _candidates(self, number: int) -> list[str]:
        """The workers an attempt may run on, in rank order: the ones asked for (the first
        attempt of a job that names its workers), else every worker (the pool's offer puts
        those the job holds first)."""
        if number == 0 and isinstance(self.spec.workers, list):
            return list(self.spec.workers)
        workers = self.plugin.scheduler.workers
        ordered = order_workers([WorkerInfo(a, ws.host) for a, ws in workers.items()])
        return [w.address for w in ordered]

    # -- checkpoints the ranks told of --------------------------------------------------------
    def _replicated(self, rank: int, step: int, holder: str, world: int | None) -> None:
        """A rank's checkpoint is in ``holder``'s memory too; the worker that held the one
        before (an earlier attempt's holder) lets it go."""
        before = self.ledger.replicated(rank, step, holder, world)
        if before is not None:
            key = (writer_rank(rank, world), world)
            self._cleanup(self.launcher.drop_replicas([before], key), f"drop a replica on {before}")

    def _cleanup(self, work: Any, what: str) -> None:
        """Run a clean-up that decides nothing; if it fails, the job's notes say so."""

        async def run() -> None:
            try:
                await work
            except Exception as exc:
                self._note(f"could not {what}: {type(exc).__name__}: {exc}")

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _loaded(self, a: Attempt, rank: int, body: list[Any]) -> None:
        """A rank loaded its state: ``Job.history`` says where it really came from."""
        source, step, where = body
        a.loaded.setdefault(rank, []).append(body)
        planned = (
            {r.source for r in a.specs[rank].checkpoint.restore} if rank < len(a.specs) else set()
        )
        if planned and source not in planned:
            self._note(
                f"attempt {a.number}: rank {rank} loaded the checkpoint of step {step} from "
                f"the {source} ({where}), not from the {'+'.join(sorted(planned))} as planned"
            )
        sources: set[str] = set()
        for r, spec in enumerate(a.specs):
            told = a.loaded.get(r)
            sources |= {b[0] for b in told} if told else {p.source for p in spec.checkpoint.restore}
        steps = [b[1] for told in a.loaded.values() for b in told]
        start = self.starts.get(a.number, AttemptStart(a.number))
        restored = dataclasses.replace(
            start, restored_from=describe_sources(sources), restored_step=max(steps)
        )
        if restored != start:
            self.starts[a.number] = restored
            self._publish()

    # -- the end ------------------------------------------------------------------------------
    async def _finish(self) -> None:
        """The job is over (its workers went back with its final state): what is left of
        it goes, and it says so."""
        self.finished = time.time()
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        self.plugin.pool.forget(self.job_id)
        if self.ledger.holders():  # the job's replicas leave its holders' memory
            try:
                await self.launcher.drop_replicas(sorted(self.ledger.holders()), None)
            except Exception as exc:
                self._note(f"could not drop its checkpoint replicas: {exc}")
        if self._datasets is not None:
            try:
                await self._datasets.release(self.plugin.client)
            except Exception as exc:
                self._note(f"could not release its datasets: {exc}")
        self.feed(lc.Finished())
        self._publish()
        self.plugin.job_ended(self)

    # -- what it says -------------------------------------------------------------------------
    def _transition(self, action: lc.Publish) -> None:
        """Enter a state: one history entry, one log line, one message to the clients."""
        state, now = action.state, time.time()
        old = self.history[-1].state.value if self.history else "launched"
        if state in (JobState.RESTARTING, JobState.RESIZING) or state.final:
            self._since = now  # training stopped here
        reason = action.reason
        if state.final or action.error is not None:
            self.error = action.error
        self.history.append(
            Transition(
                state,
                reason,
                now,
                attempt=action.attempt,
                world_size=action.world_size,
                since=self._since if state is JobState.RUNNING else None,
            )
        )
        logger.info(
            "dask-ddp job %s (%s): %s -> %s: %s",
            self.job_id, self.spec.name, old, state.value, reason,
            extra={"job_state": state.value},
        )  # fmt: skip
        self._publish()

    def _waiting(self, action: lc.Waiting) -> None:
        """Say what the job waits for: one line per new kind of wait."""
        self.wait_reason = lc.wait_text(action.wait, action.seconds_left)
        if action.announce:
            logger.info("dask-ddp job %s: %s", self.job_id, self.wait_reason)
            self._publish()

    def _first_step(self, a: Attempt) -> None:
        """The current attempt's first record arrived: its start says when."""
        now = time.time()
        start = self.starts.get(a.number, AttemptStart(a.number))
        self.starts[a.number] = dataclasses.replace(start, first_step=now)
        running = [t for t in self.history if t.state is JobState.RUNNING]
        here = next((t for t in running if t.attempt == a.number), None)
        before = [t for t in running if t.attempt < a.number]
        if here is not None and before and before[-1].world_size != here.world_size:
            self._note(
                f"resized from {before[-1].world_size} to {here.world_size} ranks; "
                f"training again {now - (here.since or now):.1f} s after it stopped"
            )
        self._publish()

    def _note(self, text: str) -> None:
        logger.info("dask-ddp job %s: %s", self.job_id, text)
        self.notes.append(text)
        del self.notes[:-_NOTES_KEPT]
        self._publish()

    def _publish(self) -> None:
        """Tell every client following the job (its topic's subscribers) where it is.

        Not the job's outcome while its attempt's futures are being published: a client
        that hears it reads the ranks' values (and a failed rank's own exception) from them
        at once. A job that ends while its publish is on its way (a short one, on a busy
        scheduler) is told of once they are published, or could not be."""
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        if self.observer is not None:
            self.observer.changed(self)
        if self._publishing is not None and self._outcome() is not None:
            return  # _publish_attempt says it
        self._version += 1
        self.plugin.scheduler.log_event(self.topic, self.public_state())
        self.plugin.changes.bump()

    def _publish_soon(self) -> None:
        """:meth:`_publish` within ``ddp.event-flush-interval``, once for everything that
        changed meanwhile (each state message costs the scheduler and every client: ranks
        that end one by one must not send one each)."""
        if self._soon is None:
            interval = self.settings.event_flush_interval
            self._soon = asyncio.get_running_loop().call_later(interval, self._publish)

    def _holding(self) -> str | None:
        """The line the views show under the job's title: what a waiting job waits for, or
        why a stalled one is stalled."""
        if self.life.phase is lc.Phase.WAITING:
            return self.wait_reason
        if self.life.stalled and self.history:
            return f"stalled: {self.history[-1].reason}"
        return None

    def public_state(self) -> dict[str, Any]:
        """The job as clients see it (a :class:`~dask_ddp._shared.protocol.StateMessage`,
        msgpack-able): state, placement, history, error."""
        a = self.attempt
        outcome = self._outcome()
        return StateMessage(
            job=self.job_id,
            state=self.state,
            version=self._version,
            name=self.spec.name,
            outcome=JobState(outcome) if outcome else None,
            attempt=a.number if a is not None else 0,
            run_id=a.run_id if a is not None else None,
            workers=tuple(a.workers) if a is not None else (),
            backend=a.backend if a is not None else "",
            dataset=a.dataset if a is not None and a.published else None,
            keys=tuple(a.keys) if a is not None else (),
            ended=tuple(self.progress.ended()) if a is not None else (),
            waiting=self._holding(),
            history=tuple(self.history),
            starts=tuple(self.starts.values()),
            error=errors.to_wire(self.error) if self.error is not None else None,
            notes=tuple(self.notes),
            total=self.spec.total_steps,
            stopped=self.closed,
            launched_by=self.spec.launched_by,
            started=self.started,
            detached=self.spec.detach,
        ).to_wire()

    def _outcome(self) -> str | None:
        """The state the job ends in, once that is decided (while it is ``stopping``)."""
        life = self.life
        if life.state.final:
            return life.state.value
        if life.state is JobState.STOPPING and life.next_state is not None:
            return life.next_state.value
        return None

    def held_values(self) -> list[bytes | None]:
        """Each rank's return value as its final marker carried it (pickled; None: larger
        than ``ddp.result-limit``, or the rank did not succeed), rank order: what
        ``Job.result()`` reads when a worker of a succeeded job left with its value."""
        return [r.outcome.value if r.outcome else None for r in self.life.ranks]

    def summary(self) -> dict[str, Any]:
        """What the ``/ddp/`` page draws: the live view's state, capped (each rank's values
        and curve as :meth:`Progress.page_ranks <dask_ddp._shared.progress.Progress.page_ranks>`
        caps them, the last 20 notes, no printed output)."""
        a = self.attempt
        error = self.error
        return view_state(
            job=self.job_id,
            name=self.spec.name,
            state=self.state.value,
            waiting=self._holding(),
            total=self.spec.total_steps,
            backend=a.backend if a is not None else "",
            elapsed=(self.finished or time.time()) - self.started,
            attempts=a.number + 1 if a is not None else 0,
            records=self.progress.records,
            ranks=self.progress.page_ranks(),
            metric=self.progress.metric,
            error=None if error is None else first_line(error),
            traceback=getattr(error, "rank_traceback", None) or None,
            notes=self.notes,
            output=[],
            launched_by=self.spec.launched_by,
            client=self.spec.client,
            started=self.started,
            followers=len(self.followers),
            detached=self.spec.detach,
        )

"""A job's life in the cluster: one state machine per job, on the scheduler's event loop.

:class:`Supervisor` runs one job from its launch to its end, whether or not the client that
launched it is still there. It lives in dask-ddp's scheduler plugin
(:mod:`dask_ddp._plugin`), which hands it what the scheduler sees (a rank task's end, a
worker that left, a rank's events) and asks it to cancel. Its coroutine, :meth:`Supervisor.run`,
reads the state, decides, logs one line and moves on::

    waiting ──> running ──> succeeded | failed | cancelled
                 │   ^
                 v   │
          restarting | resizing

Every transition is one INFO line in the scheduler's log, one :class:`~dask_ddp.Transition`
in the job's history, and one message on the job's event topic, which every client
following the job reads (:mod:`dask_ddp._reader`). What happens when an attempt ends is
decided in one place, :meth:`Supervisor._decide`: success, a restart (a lost worker in a
fixed-size job, :class:`~dask_ddp.RetryableError`, while restarts are left), a resize (an
elastic job that lost a worker, or grows onto new ones at a checkpoint: never a failure,
bounded by ``ddp.max-resizes`` an hour), or the end.

Nothing here blocks the event loop: placing is arithmetic on the scheduler's own worker
table (:mod:`dask_ddp._pool`), everything else awaits the plugin's client
(:mod:`dask_ddp._launcher`). The function the ranks run is bytes here, never unpickled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Protocol

from . import errors, events
from ._launcher import Attempt, Launcher, wait_first
from ._ledger import CheckpointLedger, describe_sources, writer_rank
from ._progress import Progress, ended_text
from ._types import JobSpec, JobState, Transition
from .errors import (
    DaskDDPError,
    JobCancelledError,
    RankFailedError,
    RankStoppedError,
    ScaleTimeoutError,
    TooManyResizesError,
    WorkerLostError,
)
from .placement import WorkerInfo, order_workers

logger = logging.getLogger(__name__)

_CHECKPOINTS_KEPT = 1000  # checkpoints a job remembers (Job.checkpoints of a later client)
_NOTES_KEPT = 20
_HOUR = 3600.0


class Host(Protocol):
    """What a supervisor needs of the scheduler plugin that holds it
    (:class:`dask_ddp._plugin.DaskDDPPlugin`)."""

    scheduler: Any  # distributed.Scheduler
    client: Any  # the plugin's own asynchronous distributed.Client
    pool: Any  # its dask_ddp._pool.WorkerPool
    gpus: dict[str, Any]  # worker -> (GPU count, CUDA_VISIBLE_DEVICES), probed once

    def watch_keys(self, job: Supervisor, keys: list[Any]) -> None: ...

    def unwatch_keys(self, keys: list[Any]) -> None: ...

    def job_ended(self, job: Supervisor) -> None: ...


@dataclasses.dataclass(frozen=True)
class Size:
    """How many workers a job runs on: at least ``min_workers``, at most ``max_workers``."""

    min_workers: int
    max_workers: int

    @property
    def elastic(self) -> bool:
        return self.min_workers < self.max_workers


@dataclasses.dataclass
class _End:
    """How an attempt ended, as :meth:`Supervisor._watch` found it."""

    cancelled: str | None = None
    grow: int | None = None  # the checkpoint's step, when the ranks stopped to grow
    error: BaseException | None = None
    cause_rank: int | None = None  # the rank whose failure or loss ended the attempt
    lost: bool = False  # ended by a worker that left
    retryable: bool = False

    def stop_reason(self) -> str:
        """What the ranks still running are told when they are stopped."""
        if self.cancelled is not None:
            return self.cancelled
        if self.grow is not None:
            return f"the job resizes at the checkpoint of step {self.grow}"
        if isinstance(self.error, RankFailedError):
            return self.error.cause
        if isinstance(self.error, RankStoppedError):
            return self.error.reason
        return f"{type(self.error).__name__}: {str(self.error).split(chr(10), 1)[0]}"


def first_line(error: BaseException) -> str:
    """An error in one line: its summary, else the first line of its text."""
    return str(getattr(error, "summary", None) or error).split("\n", 1)[0]


class Supervisor:
    """One job, attempt after attempt, as a coroutine on the scheduler's loop.

    Parameters
    ----------
    plugin : Host
        The scheduler plugin: its scheduler, its own client, the worker pool.
    spec : JobSpec
        The job as its client sent it.
    size : Size
        How many workers it runs on, checked against the cluster at launch.
    datasets : optional
        The job's Dask collections, planned again for each attempt.
    """

    def __init__(self, plugin: Host, spec: JobSpec, size: Size, datasets: Any = None) -> None:
        self.plugin, self.spec, self.size = plugin, spec, size
        self.job_id = spec.job_id
        self.topic = events.job_topic(spec.job_id)
        self.settings = spec.settings
        self.state = JobState.WAITING
        self.history: list[Transition] = []
        self.attempt: Attempt | None = None
        self.restarts_left = spec.max_restarts
        self.error: BaseException | None = None
        self.wait_reason: str | None = None
        self.notes: list[str] = []
        self.progress = Progress()
        self.checkpoints: list[list[Any]] = []  # CheckpointInfo's fields, in order
        self.ledger = CheckpointLedger()  # durable checkpoints and replicas: restarts' source
        self._replica_drops: set[asyncio.Future[None]] = set()
        self.followers: set[str] = set() if spec.detach or not spec.client else {spec.client}
        self.started = time.time()
        self.finished: float | None = None
        self.stopped = asyncio.Event()  # ranks stopped, workers given back: the very end
        self.placed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.launcher = Launcher(plugin.client, plugin.scheduler, spec, plugin.gpus, datasets)
        self._datasets = datasets
        self._changed = asyncio.Event()  # something the state machine reads has changed
        self._cancel: str | None = None
        self._since = self.started  # when the job last stopped training
        self._orphan: asyncio.TimerHandle | None = None
        self._stopping: tuple[str, int | None] | None = None  # why the attempt is stopped
        self._task: asyncio.Task[None] | None = None
        self._wait_kind: str | None = None
        self._version = 0  # of the last message to the clients (they ignore older ones)
        self._limit: TooManyResizesError | None = None  # why it failed, past ddp.max-resizes

    # -- what the plugin tells it (hooks on the scheduler's loop: never block) ------------
    def start(self) -> None:
        """Start the job's coroutine; :attr:`placed` resolves once it runs or waits."""
        self._task = asyncio.ensure_future(self.run())

    def on_event(self, msg: dict[str, Any]) -> None:
        """An event of the job's topic: what a rank told in the clear, or its final marker."""
        a, rank = self.attempt, msg.get("rank")
        if a is None or msg.get("job") != a.run_id or not isinstance(rank, int):
            return  # the supervisor's own messages, or a rank of an attempt before this one
        if not 0 <= rank < len(a.workers):
            return
        told = msg.get("told")
        if told:
            if "last" in told:
                step, when, values = told["last"]
                self.progress.add(
                    rank, step, when, values, told.get("m", 1), told.get("pts"), told.get("first")
                )
                if not a.reported:
                    a.reported = True
                    self._first_step()
            if "s" in told:
                self.progress.set_status(rank, *told["s"])
            for url, step, nbytes, when, stall, world in told.get("c", ()):
                self.checkpoints.append([url, step, nbytes, rank, when, stall, world])
                del self.checkpoints[:-_CHECKPOINTS_KEPT]
                self.ledger.landed(rank, url, step, world)
            for step, holder, world, _nbytes in told.get("p", ()):
                self._replicated(rank, step, holder, world)
            if "l" in told:
                self._loaded(a, rank, told["l"])
        if "end" in msg:
            outcome = msg.get("outcome") or {"ok": True}
            a.markers[rank] = outcome
            self.progress.end(rank, ended_text(outcome))
            self._changed.set()

    def _replicated(self, rank: int, step: int, holder: str, world: int | None) -> None:
        """A rank's checkpoint is in ``holder``'s memory too; the worker that held the one
        before (an earlier attempt's holder) lets it go."""
        before = self.ledger.replicated(rank, step, holder, world)
        if before is not None:
            key = (writer_rank(rank, world), world)
            drop = asyncio.ensure_future(self.launcher.drop_replicas([before], key))
            self._replica_drops.add(drop)
            drop.add_done_callback(self._replica_drops.discard)

    def _loaded(self, a: Attempt, rank: int, body: list[Any]) -> None:
        """A rank loaded its state: ``Job.history`` says where it really came from."""
        source, step, where = body
        a.loaded.setdefault(rank, []).append(body)
        planned = {r.source for r in a.specs[rank].restore} if rank < len(a.specs) else set()
        if planned and source not in planned:
            self._note(
                f"attempt {a.number}: rank {rank} loaded the checkpoint of step {step} from "
                f"the {source} ({where}), not from the {'+'.join(sorted(planned))} as planned"
            )
        sources: set[str] = set()
        for r, spec in enumerate(a.specs):
            told = a.loaded.get(r)
            sources |= {b[0] for b in told} if told else {p.source for p in spec.restore}
        steps = [b[1] for told in a.loaded.values() for b in told]
        restored = (describe_sources(sources), max(steps))
        for i in range(len(self.history) - 1, -1, -1):
            entry = self.history[i]
            if entry.state is JobState.RUNNING and entry.attempt == a.number:
                if (entry.restored_from, entry.restored_step) != restored:
                    self.history[i] = dataclasses.replace(
                        entry, restored_from=restored[0], restored_step=restored[1]
                    )
                    self._publish()
                break

    def on_task(self, rank: int, finish: str, info: dict[str, Any]) -> None:
        """Rank ``rank``'s task of the current attempt reached ``finish`` (memory, erred)."""
        a = self.attempt
        if a is None or rank in a.ended:
            return
        a.ended[rank] = finish
        if finish == "erred":
            a.errors[rank] = str(info.get("exception_text") or "")
        self._changed.set()

    def on_worker_removed(self, address: str) -> None:
        """A worker left the cluster: each rank of the current attempt there is lost, and its
        task (left without a worker it may run on) fails with the reason at once, before a
        worker of the same address could start it again. A finished rank's value that was
        there is lost too: its task fails the same way instead of training again."""
        a = self.attempt
        if a is None:
            return
        for rank, worker in enumerate(a.workers):
            if worker != address or rank in a.lost:
                continue
            if rank in a.ended:
                if a.ended[rank] == "memory":
                    lost = WorkerLostError(rank, address, a.keys[rank], finished=True)
                    self.launcher.fail_lost(a, rank, lost)
                continue
            a.lost[rank] = address
            if self._stopping is None:  # this loss ends the attempt
                error: BaseException = WorkerLostError(rank, address, a.keys[rank])
                self._stopping = (str(error), rank)
                self.progress.end(rank, "lost: its worker left the cluster")
            else:
                reason, cause = self._stopping
                error = RankStoppedError(rank, reason, job=a.run_id, failed_rank=cause)
                self.progress.end(rank, f"stopped: {reason.split(':', 1)[0]}")
            self.launcher.fail_lost(a, rank, error)
        self._changed.set()

    def workers_changed(self) -> None:
        """Workers joined, left or were given back (a waiting job looks again; an elastic
        one may grow)."""
        self._changed.set()

    def follow(self, client: str) -> None:
        """A client attached: the job is followed again."""
        self.followers.add(client)
        if self._orphan is not None:
            self._orphan.cancel()
            self._orphan = None
            self._note(f"client {client} attached; the job is followed again")

    def unfollow(self, client: str) -> None:
        """A client left; with nobody left to follow it, the job is cancelled after
        ``ddp.orphan-timeout`` unless a client attaches (or it was launched detached)."""
        if client not in self.followers:
            return
        self.followers.discard(client)
        if self.followers or self.spec.detach or self.state.final or self._orphan is not None:
            return
        timeout = self.settings.orphan_timeout
        self._note(
            f"its last client left; the job goes on for {timeout:.0f} s (ddp.orphan-timeout) "
            "for a client to attach (dask_ddp.attach), then is cancelled"
        )
        self._orphan = asyncio.get_running_loop().call_later(timeout, self._orphaned, timeout)

    def _orphaned(self, timeout: float) -> None:
        self._orphan = None
        self.cancel(
            f"no client followed the job for {timeout:.0f} s (ddp.orphan-timeout); attach "
            "within that time to keep it, or launch with detach=True"
        )

    def cancel(self, reason: str) -> None:
        """Ask the job to stop (it ends cancelled); :attr:`stopped` is set once it has."""
        if self._cancel is None and not self.state.final:
            self._cancel = reason
            self._changed.set()

    # -- the state machine ----------------------------------------------------------------
    async def run(self) -> None:
        """The job's life: place, watch, decide, again until it ends."""
        try:
            placed = await self._acquire()
            while placed:
                end = await self._watch()
                state, reason = self._decide(end)
                error = (self._limit or end.error) if state.final else None
                self._transition(state, reason, error=error)
                await self._stop(end)
                if state.final:
                    break
                placed = await self._acquire()
        except DaskDDPError as exc:  # placing failed: a timeout, a backend, lost data
            self._fail_placement(exc)
        except Exception as exc:  # the supervisor must never die silently
            logger.exception("dask-ddp job %s: its supervisor failed", self.job_id)
            self._fail_placement(exc)
        finally:
            await self._finish()

    def _fail_placement(self, exc: BaseException) -> None:
        if not self.placed.done():  # launch() raises it: nothing ran
            self.placed.set_exception(exc)
        if not self.state.final:
            self._transition(JobState.FAILED, first_line(exc), error=exc)

    async def _acquire(self) -> bool:
        """Hold workers for the next attempt (waiting for them if need be), place it and
        submit its ranks; False when the job ended instead (cancelled while it waited)."""
        number = 0 if self.attempt is None else self.attempt.number + 1
        need = self.size.min_workers
        if self._cancel is not None:  # while the last attempt was being stopped
            self._transition(JobState.CANCELLED, self._cancel)
            return False
        while True:
            workers = self.plugin.pool.take(
                self.job_id, self._candidates(number), want=self.size.max_workers, need=need
            )
            if workers is None:
                workers = await self._wait_for_workers(number, need)
                if workers is None:
                    self._transition(JobState.CANCELLED, self._cancel or "cancelled")
                    return False
            try:
                attempt = await self.launcher.prepare(
                    number, workers, can_grow=len(workers) < self.size.max_workers
                )
            except OSError:  # a worker left while it was probed: the pool forgot it
                if all(w in self.plugin.scheduler.workers for w in workers):
                    raise
                continue
            break
        if self.attempt is not None:
            await self.launcher.unpublish(self.attempt)
            self.plugin.unwatch_keys(self.attempt.keys)
            await self._find_replicas(self.attempt)
        restored = self._restore(attempt)
        self.attempt, self._stopping = attempt, None
        self.plugin.watch_keys(self, attempt.keys)
        self.progress.place(attempt.workers)
        self.launcher.submit(attempt)
        self.plugin.pool.demand(self.job_id, self.size.max_workers - len(workers))
        # Clients hear of the placement before any of its ranks can say a word ...
        hosts = len({self.plugin.scheduler.workers[w].host for w in workers})
        self._transition(
            JobState.RUNNING, f"{len(workers)} ranks on {hosts} hosts", restored=restored
        )
        # ... then of its futures, once any client can read them.
        await self.launcher.publish(attempt)
        self._publish()
        if not self.placed.done():
            self.placed.set_result(None)
        return True

    async def _find_replicas(self, last: Attempt) -> None:
        """Ask the workers that keep the job's replicas what they hold before planning the
        next attempt: a rank's word that its replica landed is lost when its worker dies
        right after (SIGKILL within milliseconds), while the replica itself is safe."""
        holders = self.ledger.holders() | {s.replica_holder for s in last.specs if s.replica_holder}
        if not holders:
            return
        for holder, entries in (await self.launcher.held_replicas(sorted(holders))).items():
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
        """The workers an attempt may run on: the ones asked for (the first attempt of a job
        that names its workers), else the ones it holds, then the rest in rank order."""
        if number == 0 and isinstance(self.spec.workers, list):
            return list(self.spec.workers)
        workers = self.plugin.scheduler.workers
        held = [w for w in self.plugin.pool.held(self.job_id) if w in workers]
        ordered = order_workers([WorkerInfo(a, ws.host) for a, ws in workers.items()])
        return held + [w.address for w in ordered if w.address not in held]

    async def _wait_for_workers(self, number: int, need: int) -> list[str] | None:
        """Wait until the pool grants the job its workers; None if it was cancelled first.

        Workers held by other jobs are waited for as long as it takes; a cluster too small
        for ``need`` is waited for ``ddp.scale-timeout`` (``ddp.rendezvous-timeout`` for a
        fixed-size job's restart), then :class:`~dask_ddp.ScaleTimeoutError`.
        """
        limit = self.settings.scale_timeout
        if number > 0 and not self.size.elastic:
            limit = self.settings.rendezvous_timeout
        named = number == 0 and isinstance(self.spec.workers, list)
        granted = self.plugin.pool.ask(
            self.job_id,
            lambda: self._candidates(number),
            want=self.size.max_workers,
            need=need,
            demand=not named,
        )
        short_since: float | None = None
        try:
            while not granted.done():
                self._changed.clear()
                if self._cancel is not None:
                    return None
                have, now = len(self.plugin.scheduler.workers), time.monotonic()
                left = None
                if have >= need:
                    short_since = None
                    why = (
                        f"waiting for {need} free workers: other jobs hold some of the "
                        f"cluster's {have}"
                    )
                else:
                    short_since = now if short_since is None else short_since
                    left = limit - (now - short_since)
                    if left <= 0:
                        raise ScaleTimeoutError(self.job_id, need, have, limit)
                    why = (
                        f"waiting for the cluster to grow: {have} of at least {need} workers "
                        f"there ({left:.0f} s left)"
                    )
                self._waiting(why)
                await wait_first(granted, self._changed.wait(), timeout=left)
            return granted.result()
        finally:
            if not granted.done():
                self.plugin.pool.withdraw(self.job_id)
            self.wait_reason, self._wait_kind = None, None

    def _waiting(self, why: str) -> None:
        """Say what the job waits for: the first wait of a job is its ``waiting`` state; a
        restart or resize that waits says it in its own state. One line per new reason."""
        kind = why.split(":", 1)[0]
        self.wait_reason = why
        if self.state is JobState.WAITING and not self.history:
            self._transition(JobState.WAITING, why)
            if not self.placed.done():
                self.placed.set_result(None)
        elif kind != self._wait_kind:
            logger.info("dask-ddp job %s: %s", self.job_id, why)
            self._publish()
        self._wait_kind = kind

    async def _watch(self) -> _End:
        """Watch the current attempt until its outcome is known: every rank finished, one
        failed (or lost its worker), the ranks stopped to grow, or the job was cancelled.
        An elastic job below its size takes free workers meanwhile and asks its ranks to
        stop at their next checkpoint to grow onto them."""
        a = self.attempt
        assert a is not None
        grace_until: float | None = None
        drain_until: float | None = None
        while True:
            self._changed.clear()
            now = time.monotonic()
            if self._cancel is not None:
                return _End(cancelled=self._cancel)
            end = self._outcome(a, grace_over=grace_until is not None and now >= grace_until)
            if end is not None:
                return end
            if grace_until is None and self._only_stopped(a):
                # A rank stopped because of another: its own error comes within the grace.
                grace_until = now + self.settings.failure_grace
            if len(a.ended) == len(a.workers):  # every task finished: the last records come
                drain_until = drain_until or now + self.settings.event_drain_timeout
                if now >= drain_until:
                    self._note_missing(a)
                    return _End()
            await self._grow(a)
            timeout = min(
                (t - now for t in (grace_until, drain_until) if t is not None), default=None
            )
            await wait_first(self._changed.wait(), timeout=timeout)

    def _outcome(self, a: Attempt, *, grace_over: bool) -> _End | None:
        """The attempt's outcome from what its ranks said and what their tasks did; None
        while it is not known yet."""
        grows = [o["grow"] for o in a.markers.values() if "grow" in o]
        if grows:
            return _End(grow=grows[0])
        stopped: _End | None = None
        for rank in range(len(a.workers)):
            if rank in a.lost:
                continue  # its task was failed for it: below
            outcome = a.markers.get(rank)
            if outcome is None and a.ended.get(rank) == "erred":
                text = a.errors.get(rank, "")
                outcome = (
                    {"stopped": text, "failed_rank": -1}
                    if text.startswith("RankStoppedError")
                    else {"failed": text or "the rank's task failed", "retryable": False}
                )
            if outcome is None:
                continue
            if "failed" in outcome:
                error = RankFailedError(
                    rank, a.workers[rank], a.keys[rank], outcome["failed"],
                    outcome.get("traceback") or "",
                )  # fmt: skip
                return _End(error=error, cause_rank=rank, retryable=outcome.get("retryable", False))
            if "stopped" in outcome and stopped is None:
                first = outcome.get("failed_rank")
                error = RankStoppedError(rank, outcome["stopped"], failed_rank=first)
                stopped = _End(
                    error=error, cause_rank=first, retryable=first is not None and first < 0
                )
        if a.lost:
            rank, worker = next(iter(a.lost.items()))
            error = WorkerLostError(rank, worker, a.keys[rank])
            return _End(error=error, cause_rank=rank, lost=True, retryable=True)
        if stopped is not None and (grace_over or len(a.ended) == len(a.workers)):
            return stopped
        finished = len(a.ended) == len(a.workers) and all(e == "memory" for e in a.ended.values())
        if finished and len(a.markers) == len(a.workers):
            return _End()
        return None

    def _only_stopped(self, a: Attempt) -> bool:
        return any("stopped" in o for o in a.markers.values())

    def _decide(self, end: _End) -> tuple[JobState, str]:
        """The one place where a job's next state is chosen, when an attempt has ended."""
        if end.cancelled is not None:
            return JobState.CANCELLED, end.cancelled
        if end.grow is not None:
            return self._resize(f"grow at the checkpoint of step {end.grow}")
        if end.error is None:
            return JobState.SUCCEEDED, "every rank finished"
        why = first_line(end.error)
        if self.size.elastic and (
            end.lost or (end.retryable and not isinstance(end.error, RankFailedError))
        ):
            return self._resize(f"shrink: {why}")
        if end.retryable and self.restarts_left > 0:
            self.restarts_left -= 1
            used = self.spec.max_restarts - self.restarts_left
            return JobState.RESTARTING, (
                f"{why}; restart {used} of {self.spec.max_restarts}, from the last checkpoint"
            )
        return JobState.FAILED, why

    def _resize(self, why: str) -> tuple[JobState, str]:
        """A resize, unless the job resized ``ddp.max-resizes`` times in the last hour."""
        limit = self.settings.max_resizes
        now = time.time()
        recent = [t for t in self.history if t.state is JobState.RESIZING and t.time > now - _HOUR]
        if len(recent) >= limit:
            self._limit = TooManyResizesError(self.job_id, len(recent), limit, why)
            return JobState.FAILED, first_line(self._limit)
        return JobState.RESIZING, why

    async def _grow(self, a: Attempt) -> None:
        """An elastic job below its size takes free workers, then asks its ranks to stop at
        their next checkpoint (they resize onto every worker the job holds by then)."""
        if not self.size.elastic or a.grow_requested or self._stopping is not None:
            return
        held = len(self.plugin.pool.held(self.job_id))
        if held >= self.size.max_workers or not self.plugin.pool.free():
            return
        got = self.plugin.pool.take(
            self.job_id, self._candidates(a.number + 1), want=self.size.max_workers, need=held + 1
        )
        if got is None:
            return
        self.plugin.pool.demand(self.job_id, self.size.max_workers - len(got))
        logger.info(
            "dask-ddp job %s: %d more workers free; the job grows to %d ranks at its next "
            "checkpoint", self.job_id, len(got) - held, len(got),
        )  # fmt: skip
        await self.launcher.request_grow(a)

    async def _stop(self, end: _End) -> None:
        """Stop the attempt's ranks still running: abort them in place, restart the workers
        of those stuck in a C++ collective after ``ddp.failure-grace``, close the store,
        and give clients a second for the records the stopped ranks sent on their way out."""
        a = self.attempt
        if a is None:
            return
        reason = end.stop_reason()
        self._stopping = (reason, end.cause_rank)
        grace = self.settings.failure_grace
        running = a.running()
        stuck: set[str] = set()
        if running:
            idle = await self.launcher.abort(a, running, reason, end.cause_rank)
            deadline = time.monotonic() + grace
            while a.running() and time.monotonic() < deadline:
                self._changed.clear()
                await wait_first(self._changed.wait(), timeout=deadline - time.monotonic())
            # A rank whose task has not started (queued behind another task on its worker)
            # stops as soon as it starts: restarting its worker would kill what it waits for.
            stuck = {a.workers[r] for r in a.running()} - idle
            if stuck:
                await self.launcher.restart(a, sorted(stuck), grace)
        if 0 not in a.markers and a.store_worker not in stuck:
            await self.launcher.drop_store(a)  # rank 0 never took it (it never started)
        await self._drain(a, min(self.settings.event_drain_timeout, 1.0))
        if running:  # a rank stopped before it could say so (queued, or in its rendezvous)
            stopped = ended_text({"stopped": reason, "failed_rank": end.cause_rank})
            for rank in running:
                self.progress.end(rank, stopped)

    async def _drain(self, a: Attempt, timeout: float) -> None:
        """Wait up to ``timeout`` for the final markers of the ranks whose task ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            missing = set(a.ended) - set(a.markers) - a.silent()
            if not missing:
                return
            self._changed.clear()
            await wait_first(self._changed.wait(), timeout=deadline - time.monotonic())

    def _note_missing(self, a: Attempt) -> None:
        for rank in sorted(set(range(len(a.workers))) - set(a.markers)):
            text = (
                f"rank {rank}: its final marker never arrived, so its last records may be missing"
            )
            logger.warning(
                "dask-ddp job %s: %s after waiting %.0f s (ddp.event-drain-timeout)",
                self.job_id, text, self.settings.event_drain_timeout,
            )  # fmt: skip
            self._note(text)

    async def _finish(self) -> None:
        """The job is over: give its workers back, release its data, say so."""
        self.finished = time.time()
        if self._orphan is not None:
            self._orphan.cancel()
        self.plugin.pool.forget(self.job_id)
        if self.ledger.holders():  # the job's replicas leave its holders' memory
            await self.launcher.drop_replicas(sorted(self.ledger.holders()), None)
        if self._datasets is not None:
            await self._datasets.release(self.plugin.client)
        if not self.placed.done():
            self.placed.set_result(None)
        self.stopped.set()
        self._publish()
        self.plugin.job_ended(self)

    # -- what it says ---------------------------------------------------------------------
    def _transition(
        self,
        state: JobState,
        reason: str,
        *,
        error: BaseException | None = None,
        restored: tuple[str | None, int | None] = (None, None),
    ) -> None:
        """Enter ``state``: one history entry, one log line, one message to the clients."""
        a = self.attempt
        old, now = self.state, time.time()
        if state in (JobState.RESTARTING, JobState.RESIZING) or state.final:
            self._since = now  # training stopped here
        self.state = state
        if error is not None:
            self.error = error
        if state is JobState.CANCELLED and self.error is None:
            self.error = JobCancelledError(self.job_id, reason)
        self.history.append(
            Transition(
                state,
                reason,
                now,
                attempt=a.number if a is not None else 0,
                world_size=len(a.workers) if a is not None and state is not JobState.WAITING else 0,
                since=self._since if state is JobState.RUNNING else None,
                restored_from=restored[0],
                restored_step=restored[1],
            )
        )
        logger.info(
            "dask-ddp job %s (%s): %s -> %s: %s",
            self.job_id, self.spec.name, old.value if len(self.history) > 1 else "launched",
            state.value, reason, extra={"job_state": state.value},
        )  # fmt: skip
        self._publish()

    def _first_step(self) -> None:
        """The current attempt's first record arrived: its ``running`` entry says when."""
        now = time.time()
        for i in range(len(self.history) - 1, -1, -1):
            entry = self.history[i]
            if entry.state is JobState.RUNNING:
                self.history[i] = dataclasses.replace(entry, first_step=now)
                before = [t for t in self.history[:i] if t.state is JobState.RUNNING]
                if before and before[-1].world_size != entry.world_size:
                    self._note(
                        f"resized from {before[-1].world_size} to {entry.world_size} ranks; "
                        f"training again {now - (entry.since or now):.1f} s after it stopped"
                    )
                break
        self._publish()

    def _note(self, text: str) -> None:
        logger.info("dask-ddp job %s: %s", self.job_id, text)
        self.notes.append(text)
        del self.notes[:-_NOTES_KEPT]
        self._publish()

    def _publish(self) -> None:
        """Tell every client following the job (its topic's subscribers) where it is."""
        self._version += 1
        self.plugin.scheduler.log_event(self.topic, self.public_state())

    def public_state(self) -> dict[str, Any]:
        """The job as clients see it (msgpack-able): state, placement, history, error."""
        a = self.attempt
        return {
            "kind": "state",
            "version": self._version,
            "job": self.job_id,
            "name": self.spec.name,
            "state": self.state.value,
            "attempt": a.number if a is not None else 0,
            "run_id": a.run_id if a is not None else None,
            "workers": list(a.workers) if a is not None else [],
            "backend": a.backend if a is not None else "",
            "dataset": a.dataset if a is not None and a.published else None,
            "keys": list(a.keys) if a is not None else [],
            "ended": [s.ended for s in self.progress.status] if a is not None else [],
            "waiting": self.wait_reason,
            "history": [t.to_wire() for t in self.history],
            "error": errors.to_wire(self.error) if self.error is not None else None,
            "notes": list(self.notes),
            "total": self.spec.total_steps,
            "stopped": self.stopped.is_set(),
            "launched_by": self.spec.launched_by,
            "started": self.started,
            "detached": self.spec.detach,
        }

    def summary(self) -> dict[str, Any]:
        """What the ``/ddp/`` page draws: the live view's state, capped (each rank's values
        and curve as :meth:`Progress.page_ranks <dask_ddp._progress.Progress.page_ranks>`
        caps them, the last 20 notes, no printed output)."""
        a = self.attempt
        error = self.error
        return {
            "job": self.job_id,
            "name": self.spec.name,
            "state": self.state.value,
            "waiting": self.wait_reason,
            "total": self.spec.total_steps,
            "backend": a.backend if a is not None else "",
            "elapsed": (self.finished or time.time()) - self.started,
            "attempts": a.number + 1 if a is not None else 0,
            "records": self.progress.records,
            "ranks": self.progress.page_ranks(),
            "metric": self.progress.metric,
            "error": None if error is None else first_line(error),
            "traceback": getattr(error, "rank_traceback", None) or None,
            "notes": list(self.notes),
            "output": [],
            "launched_by": self.spec.launched_by,
            "client": self.spec.client,
            "started": self.started,
            "followers": len(self.followers),
            "detached": self.spec.detach,
        }

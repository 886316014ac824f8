"""A job's life as a model: thousands of random fact sequences through ``_lifecycle.step``,
the invariants checked after every fact.

:class:`World` plays everything around the supervisor: the cluster's workers (killed,
restarted by their nanny under a new address, joining), other jobs holding some of them,
the pool, the rank processes on the workers (queued, running, ended) and what the actions
``step`` returns do there, answered late and in any order, the way the scheduler's loop
interleaves them. It also keeps the truth ``step`` never sees (which worker still runs a
rank of the job), so that it can check that a worker is given back only once it is clean.

The invariants (issue 36): a job in a final state holds no workers, and its final state is
published only then; a worker goes back to the pool only when no rank of the job runs on
it; every job reaches a final state once its ranks have ended or its workers are gone; a
cancel in any state gives every worker back within ``ddp.failure-grace`` plus one worker
restart; a grow never counts as a failure; restarts and resizes stay within their bounds.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
from pathlib import Path
from typing import Any

import pytest

import dask_ddp
from dask_ddp._scheduler import lifecycle as lc
from dask_ddp._shared.protocol import Fault, RankOutcome, Verdict
from dask_ddp._shared.values import JobState

SEQUENCES = int(os.environ.get("DASK_DDP_MODEL_SEQUENCES", "5000"))


#: docs/jobs.md's table of what restarts a job, by ``lifecycle.Cause`` (checked against
#: the docs below); a stall restarts only with ddp.stall-action: restart.
RESTARTS_AS_DOCUMENTED = {
    "code": False,
    "asked": True,
    "infrastructure": True,
    "credentials": False,
    "worker lost": True,
    "peer died": True,
    "untold": False,
    "task": False,
    "stall": False,
}


class InvariantBroken(AssertionError):
    pass


@dataclasses.dataclass
class Proc:
    """A rank's task on a worker, as it really is."""

    attempt: int
    rank: int
    worker: str
    state: str = "queued"  # queued, running, ended, dead
    doomed: bool = False  # an abort found it queued: it ends at once when it starts
    told_stop: bool = False  # an abort reached it while it ran


class World:
    """The cluster around one job, driven by a seeded random generator."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        rng = self.rng
        self.seed = seed
        lo = rng.choice([1, 2, 2, 3])
        hi = lo + rng.choice([0, 0, 1, 2])
        self.policy = lc.Policy(
            min_workers=lo,
            max_workers=hi,
            max_restarts=rng.choice([0, 1, 3, 6]),
            max_resizes=rng.choice([None, 0, 2, 5]),
            failure_grace=5.0,
            drain=10.0,
            scale_timeout=300.0,
            orphan_timeout=600.0,
            stall_timeout=rng.choice([None, 120.0]),
            stall_action=rng.choice(list(lc.StallAction)),
        )
        self.names = itertools.count()
        self.cluster: set[str] = {self.new_name() for _ in range(rng.choice([0, 1, 2, 3, 4]))}
        # The workers other jobs hold, and those kept out of every job. What this job holds
        # is its life's alone (Life.held): the pool asks it, as WorkerPool asks the lives.
        self.others: set[str] = {w for w in sorted(self.cluster) if rng.random() < 0.3}
        self.quarantined: set[str] = set()
        self.life = lc.Life.new(self.policy)
        self.now = 1000.0
        self.request: tuple[int, int, bool] | None = None  # want, need, waits (Ask)
        self.looked = False  # a pass found the request short, and said so
        self.pass_due = False  # the pool's pass, soon on the loop (any event may come first)
        self.offered: frozenset[str] = frozenset()  # free workers of the offer being taken
        self.before = self.life  # the life before the fact being taken
        self.tell = False  # the pass tells the job the workers changed
        self.queue: list[Any] = []  # facts due now (answers of synchronous actions)
        self.later: list[Any] = []  # facts that arrive at some later moment
        self.timers: dict[lc.Timer, tuple[int, float]] = {}
        self.procs: list[Proc] = []
        self.places = 0  # Place actions not answered yet
        self.grow_asked: set[int] = set()
        self.published: list[lc.Publish] = []
        self.finished = False
        self.log: list[str] = []
        self.cancelled_at: int | None = None
        self.ran = False  # an attempt was placed (launch() returned the job)
        self.prepared: dict[int, tuple[str, ...]] = {}  # attempts probed, not yet submitted
        self.discarded = 0
        self.stopping_error: BaseException | None = None
        self.fired_after_cancel: list[lc.Timer] = []
        self.spoke_at = 0.0  # the ranks' last word (Sampled's quiet_since)
        self.look_failed = False  # the pool raised at the job's last look for more workers
        self.moved = 0  # where the ranks' stacks are (a new frame: they moved)

    def new_name(self) -> str:
        return f"w{next(self.names)}"

    # -- feeding facts ----------------------------------------------------------------------
    def feed(self, fact: Any) -> None:
        before = self.life
        self.log.append(f"{fact}")
        self.life, actions = lc.step(self.life, fact, self.policy, self.now)
        self.before = before
        for action in actions:
            self.log.append(f"  -> {action}")
            self.act(action)
        self.check(before, fact, actions)

    def run_queue(self) -> None:
        while True:
            while self.queue:
                self.feed(self.queue.pop(0))
            if not (self.pass_due and self.rng.random() < 0.5):
                return  # the pass comes later: other things happen first
            self.pool_pass()

    # -- the pool: it offers free workers, and the job takes them in its step ----------------
    def usable(self) -> int:
        return len(self.cluster - self.quarantined)

    def free(self) -> list[str]:
        """Workers no job holds (the others' record, and this job's life) nor is kept out."""
        return sorted(self.cluster - self.others - self.quarantined - self.life.held)

    def pool_pass(self) -> None:
        """WorkerPool's pass, on the loop, outside every step: the request is offered what
        is free now, or told it is short once (a single look is dropped); then the job hears
        the workers changed, if they did (in that order, as WorkerPool)."""
        self.pass_due = False
        tell, self.tell = self.tell, False
        if self.request is not None:
            want, need, waits = self.request
            mine = sorted(self.life.held & self.cluster)
            new = self.free()[: max(0, want - len(mine))]
            if len(mine) + len(new) >= need:
                self.request = None
                self.offered = frozenset(new)
                self.queue.append(lc.Offered(tuple(mine + new)))
            elif not waits:
                self.request = None
            elif not self.looked:
                self.looked = True
                self.queue.append(lc.Short(self.usable()))
            while self.queue:  # the job takes it at once: nothing else runs meanwhile
                self.feed(self.queue.pop(0))
            self.offered = frozenset()
        if tell:
            self.queue.append(lc.ClusterChanged(self.usable()))

    def pool_changed(self) -> None:
        self.tell = self.pass_due = True
        self.look_failed = False

    def ask(self, want: int, need: int, *, waits: bool) -> None:
        self.request, self.looked, self.pass_due = (want, need, waits), False, True

    def act(self, action: Any) -> None:
        if isinstance(action, lc.Ask):
            if self.request is not None and self.request[2]:
                raise InvariantBroken("a second Ask while one is pending")
            if self.rng.random() < 0.02:  # the pool raised: the supervisor tells step
                self.queue.append(lc.ActionFailed(lc.ActionKind.ASK, action.attempt, why="x"))
                return
            self.ask(action.want, action.need, waits=True)
        elif isinstance(action, lc.Withdraw):
            self.request = None
            if self.rng.random() < 0.05:
                self.queue.append(lc.ActionFailed(lc.ActionKind.WITHDRAW, why="x"))
        elif isinstance(action, lc.Place):
            if self.places:
                raise InvariantBroken("a second Place while one is in flight")
            self.places += 1
            self.later.append(("place", action))
        elif isinstance(action, lc.Submit):  # submitted at once: placed before anything else
            workers = self.prepared.pop(action.attempt)
            for rank, w in enumerate(workers):
                self.procs.append(Proc(action.attempt, rank, w))
            keys = tuple(f"k{action.attempt}-{r}" for r in range(len(workers)))
            self.queue.append(lc.Placed(action.attempt, workers, keys, hosts=1))
        elif isinstance(action, lc.Discard):
            self.prepared.pop(action.attempt)
            self.discarded += 1
        elif isinstance(action, lc.Abort):
            self.later.append(("abort", action))
        elif isinstance(action, lc.RestartWorkers):
            self.later.append(("restart", action))
        elif isinstance(action, lc.Release):
            for w in action.workers:
                if w not in self.before.held or w in self.life.held:
                    raise InvariantBroken(f"released {w}, which the job did not hold, or does")
                if w not in self.cluster:
                    continue  # it left (its WorkerLost is on its way)
                busy = [p for p in self.procs if p.worker == w and self.harmful(p)]
                if busy:
                    raise InvariantBroken(f"released {w} while a rank still runs there: {busy}")
            self.pool_changed()
        elif isinstance(action, lc.Quarantine):
            for w in action.workers:
                if w in self.life.held:
                    raise InvariantBroken(f"quarantined {w}, which the job still holds")
                if w in self.cluster:
                    if not any(p.worker == w and self.harmful(p) for p in self.procs):
                        raise InvariantBroken(f"quarantined {w}, where no rank runs")
                    self.quarantined.add(w)
            self.pool_changed()
        elif isinstance(action, lc.TakeMore):
            if self.request is not None and self.request[2]:
                raise InvariantBroken("a TakeMore while an Ask is pending")
            if self.rng.random() < 0.05:
                self.look_failed = True  # the job looks again at the next change
                self.queue.append(lc.ActionFailed(lc.ActionKind.TAKE_MORE, why="x"))
                return
            self.ask(action.want, action.need, waits=False)
        elif isinstance(action, lc.RequestGrow):
            self.grow_asked.add(action.attempt)
        elif isinstance(action, lc.Arm):
            self.timers[action.timer] = (action.token, action.seconds)
        elif isinstance(action, lc.Disarm):
            self.timers.pop(action.timer, None)
        elif isinstance(action, lc.Publish):
            if self.published and self.published[-1].state.final:
                raise InvariantBroken(f"published {action.state} after the final state")
            self.published.append(action)
        elif isinstance(action, lc.Finish):
            if self.finished:
                raise InvariantBroken("finished twice")
            self.finished = True
            self.later.append(("finish", action))  # its clean-up takes a while

    @staticmethod
    def harmful(p: Proc) -> bool:
        """A process that still holds (or will hold) its worker for the job."""
        return p.state == "running" or (p.state == "queued" and not p.doomed)

    # -- answers that come later ------------------------------------------------------------
    def answer(self, kind: str, action: Any) -> None:
        if kind == "place":
            self.places -= 1
            dead = [w for w in action.workers if w not in self.cluster]
            if dead or self.rng.random() < 0.05:
                self.queue.append(
                    lc.ActionFailed(
                        lc.ActionKind.PLACE, action.attempt, frozenset(dead), why="probe failed"
                    )
                )
                return
            self.prepared[action.attempt] = action.workers
            self.queue.append(lc.Prepared(action.attempt))
        elif kind == "abort":
            if self.rng.random() < 0.05:
                self.queue.append(lc.ActionFailed(lc.ActionKind.ABORT, action.attempt))
                return
            idle = set()
            for w in action.workers:
                if w not in self.cluster:
                    continue
                mine = [p for p in self.procs if p.worker == w and p.attempt == action.attempt]
                if not mine or all(p.state != "running" for p in mine):
                    for p in mine:
                        p.doomed = True
                    idle.add(w)
                else:
                    for p in mine:
                        p.told_stop = True
            self.queue.append(lc.AbortAnswered(action.attempt, frozenset(idle)))
        elif kind == "restart":
            # The nannies end the processes (the workers leave), then the supervisor hears
            # back once their successors joined; or the restart fails.
            if self.rng.random() < 0.1:
                self.queue.append(lc.ActionFailed(lc.ActionKind.RESTART, workers=action.workers))
                return
            for w in action.workers:
                if w in self.cluster:
                    self.kill(w, replace=True)
            self.later.append(("restarted", action))
        elif kind == "restarted":
            self.queue.append(lc.WorkersRestarted(frozenset(action.workers)))
        elif kind == "finish":
            if self.rng.random() < 0.1:  # its clean-up raised: the job is closed all the same
                self.queue.append(lc.ActionFailed(lc.ActionKind.FINISH, why="x"))
            else:
                self.queue.append(lc.Finished())

    def kill(self, w: str, *, replace: bool) -> None:
        for p in self.procs:
            if p.worker == w and p.state in ("queued", "running"):
                p.state = "dead"
        self.cluster.discard(w)
        self.others.discard(w)
        self.quarantined.discard(w)
        self.queue.append(lc.WorkerLost(w))
        if replace:
            self.cluster.add(self.new_name())
        self.pool_changed()

    # -- the world's own events -------------------------------------------------------------
    def outcome(self, p: Proc) -> RankOutcome:
        rng = self.rng
        if p.doomed or (p.told_stop and rng.random() < 0.8):
            return RankOutcome(Verdict.STOPPED, summary="stopped")
        if p.attempt in self.grow_asked and rng.random() < 0.5:
            return RankOutcome(Verdict.GROW, step=10)
        r = rng.random()
        if r < 0.5:
            return RankOutcome(Verdict.DONE)
        if r < 0.58:
            return RankOutcome(
                Verdict.FAIL, "builtins.ValueError", "ValueError: x", fault=Fault.CODE
            )
        if r < 0.66:
            error = "dask_ddp.errors.RetryableError"
            return RankOutcome(Verdict.FAIL, error, "RetryableError", fault=Fault.ASKED)
        if r < 0.72:
            error = "dask_ddp.errors.RendezvousTimeoutError"
            return RankOutcome(Verdict.FAIL, error, "timeout", fault=Fault.INFRASTRUCTURE)
        if r < 0.78:
            error = "dask_ddp.errors.StorageAccessError"
            return RankOutcome(Verdict.FAIL, error, "denied", fault=Fault.CREDENTIALS)
        if r < 0.84:
            first = rng.choice([r for r in range(3) if r != p.rank])  # never itself
            return RankOutcome(Verdict.STOPPED, failed_rank=first, summary="peer")
        if r < 0.9:  # the rank that failed never said so
            return RankOutcome(Verdict.STOPPED, summary="stopped")
        return RankOutcome(Verdict.STOPPED, peer_lost=True, summary="connection closed")

    def end_proc(self, p: Proc, *, marker: bool = True) -> None:
        p.state = "ended"
        outcome = self.outcome(p)
        if marker:
            self.queue.append(lc.RankEnded(p.attempt, p.rank, outcome))
        erred = outcome.verdict not in (Verdict.DONE, Verdict.GROW)
        self.queue.append(lc.TaskEnded(p.attempt, p.rank, erred or not marker, "Error"))

    def event(self, *, cooperate: bool = True, grow: bool = True) -> bool:
        """One random thing happens; False when nothing can."""
        rng = self.rng
        weights: dict[str, float] = {}
        if self.later:
            weights["answer"] = 4
        if self.timers:
            weights["timer"] = 0.7
        if self.pass_due:
            weights["pass"] = 3
        queued = [p for p in self.procs if p.state == "queued" and p.worker in self.cluster]
        running = [p for p in self.procs if p.state == "running"]
        if queued:
            weights["start"] = 3
        if running and cooperate:
            weights["end"] = 2
        if running:
            weights.update(sample=0.8, progress=0.3)
        if grow:
            if self.cluster:
                weights["kill"] = 0.4
            weights.update(join=0.6, other=0.6, client=0.3)
            if self.life.cancel is None:
                weights["cancel"] = 0.08
        if not weights:
            return False
        pick = rng.choices(list(weights), list(weights.values()))[0]
        if pick == "answer":
            kind, action = self.later.pop(rng.randrange(len(self.later)))
            self.answer(kind, action)
        elif pick == "pass":
            self.pool_pass()
        elif pick == "timer":
            timer = rng.choice(sorted(self.timers))
            token, seconds = self.timers.pop(timer)
            self.now += seconds
            if self.cancelled_at is not None:
                self.fired_after_cancel.append(timer)
            self.queue.append(lc.TimerFired(timer, token))
        elif pick == "start":
            p = rng.choice(queued)
            if p.doomed:  # ends at once, holding nothing
                p.state = "ended"
                outcome = RankOutcome(Verdict.STOPPED, summary="stopped before it started")
                self.queue += [
                    lc.RankEnded(p.attempt, p.rank, outcome),
                    lc.TaskEnded(p.attempt, p.rank, True),
                ]
            else:
                p.state = "running"
                self.queue.append(lc.RankStarted(p.attempt, p.rank))
        elif pick == "end":
            self.end_proc(rng.choice(running), marker=rng.random() > 0.05)
        elif pick == "sample":  # the supervisor sampled the stacks while no rank spoke
            ranks = sorted({p.rank for p in running})
            causes = tuple(r for r in ranks if rng.random() < 0.5)
            waiting = tuple(r for r in ranks if r not in causes)
            where = tuple(f"train (train.py:{r})" for r in causes)
            if rng.random() < 0.3:  # the ranks moved on without a word
                self.moved += 1
            stacks = tuple((r, f"frame {self.moved}") for r in ranks)
            attempt = rng.choice([self.life.attempt, self.life.attempt, self.life.attempt - 1])
            quiet = rng.choice([30.0, 119.0, 120.0, 300.0, 300.0])
            complete = rng.random() < 0.9
            self.queue.append(
                lc.Sampled(attempt, quiet, self.spoke_at, stacks, complete, causes, where, waiting)
            )
        elif pick == "progress":  # a rank spoke
            self.spoke_at += 1.0
            self.moved += 1
            self.queue.append(lc.Progressed(self.life.attempt))
        elif pick == "kill":
            self.kill(rng.choice(sorted(self.cluster)), replace=rng.random() < 0.7)
        elif pick == "join":
            self.cluster.add(self.new_name())
            self.pool_changed()
        elif pick == "other":  # another job gives a worker back, or is offered a free one
            if self.others and rng.random() < 0.7:
                self.others.discard(rng.choice(sorted(self.others)))
            elif self.free():
                self.others.add(rng.choice(self.free()))
            self.pool_changed()
        elif pick == "cancel":
            self.cancel()
        elif pick == "client":
            self.queue.append(lc.ClientLeft() if rng.random() < 0.5 else lc.ClientAttached())
        self.run_queue()
        self.check_grows()
        return True

    def cancel(self) -> None:
        self.cancelled_at = len(self.log)
        self.queue.append(lc.CancelAsked("cancelled by the test"))

    # -- invariants ---------------------------------------------------------------------------
    def check_held(self, before: lc.Life, fact: Any, actions: list[Any]) -> None:
        """The job's life is the only record of what it holds: it takes only workers the
        pool offered it free, never one another job holds or one kept out of every job."""
        life = self.life
        taken = life.held - before.held
        if taken and not (isinstance(fact, lc.Offered) and taken <= self.offered):
            raise InvariantBroken(f"took {set(taken)} on {fact}, which offered {self.offered}")
        if life.held & (self.others | self.quarantined):
            shared = life.held & (self.others | self.quarantined)
            raise InvariantBroken(f"holds {set(shared)}, held by another job or kept out")
        if isinstance(fact, lc.Offered) and life.phase is lc.Phase.PLACING:
            placed = [a for a in actions if isinstance(a, lc.Place)]
            if placed and set(placed[0].workers) != life.held:
                raise InvariantBroken(f"placed on {placed[0].workers}, holding {set(life.held)}")

    def check_grows(self) -> None:
        """Once nothing is due, an elastic job that runs below its most while a worker is
        free is looking for it (a worker that joined while its attempt was placed too)."""
        life = self.life
        if self.queue or self.pass_due or self.request is not None or self.look_failed:
            return
        below = self.policy.elastic and len(life.held) < self.policy.max_workers
        running = life.phase is lc.Phase.RUNNING and life.ending is None
        if below and running and not life.grow_requested and self.free():
            raise InvariantBroken(
                f"runs on {len(life.held)} of at most {self.policy.max_workers} workers while "
                f"{self.free()} are free, and looks for none"
            )

    def check(self, before: lc.Life, fact: Any, actions: list[Any]) -> None:
        life = self.life
        self.check_held(before, fact, actions)
        if life.closed and not (life.phase is lc.Phase.ENDED and self.finished):
            raise InvariantBroken(f"closed while {life.phase}, its Finish not carried out")
        if before.closed and not life.closed:
            raise InvariantBroken("a closed job opened again")
        if life.phase is lc.Phase.ENDED:
            if life.held:
                raise InvariantBroken(f"an ended job holds {set(life.held)}")
            if not life.state.final:
                raise InvariantBroken(f"an ended job's published state is {life.state}")
        elif life.state.final:
            raise InvariantBroken(f"{life.state} published while the job is {life.phase}")
        if life.state is JobState.STOPPING and life.phase is not lc.Phase.STOPPING:
            raise InvariantBroken(f"'stopping' published while the job is {life.phase}")
        if (life.state is JobState.STALLED) != life.stalled:
            raise InvariantBroken(f"'{life.state.value}' published, stalled={life.stalled}")
        if life.state is JobState.STALLED and life.phase is not lc.Phase.RUNNING:
            raise InvariantBroken(f"'stalled' published while the job is {life.phase}")
        self.check_stall(before, fact, actions)
        if before.phase is lc.Phase.ENDED:
            allowed: tuple[type, ...] = (lc.FailTask,)  # a lost rank's future
            if isinstance(fact, lc.ActionFailed):
                allowed = (lc.Note,)  # an action that failed, answered after the end: said
            if any(not isinstance(a, allowed) for a in actions):
                raise InvariantBroken(f"an ended job acted: {actions}")
        if isinstance(fact, lc.WorkerLost) and life.phase in (
            lc.Phase.RUNNING,
            lc.Phase.STOPPING,
            lc.Phase.ENDED,
        ):
            # Dask would compute a task left there again on a worker back at that address.
            failed = {a.rank for a in actions if isinstance(a, lc.FailTask)}
            for r, rank in enumerate(before.ranks if before.ranks else ()):
                left = (
                    rank.worker == fact.worker
                    and not rank.lost
                    and rank.task is not lc.TaskEnd.ERRED
                )
                if left and r not in failed and before.phase is not lc.Phase.PLACING:
                    raise InvariantBroken(
                        f"rank {r}'s task was left on {fact.worker}, which left, in {life.phase}: "
                        "a worker back at its address would run it again"
                    )
        if life.restarts_left < 0:
            raise InvariantBroken("restarts below zero")
        restarts = sum(p.state is JobState.RESTARTING for p in self.published)
        if restarts > self.policy.max_restarts:
            raise InvariantBroken(f"{restarts} restarts, at most {self.policy.max_restarts}")
        limit = self.policy.max_resizes
        if limit is not None:
            resizes = [p for p in self.published if p.state is JobState.RESIZING]
            if len(resizes) > limit:  # the model's clock moves only with its timers
                raise InvariantBroken(f"{len(resizes)} resizes within the hour, at most {limit}")
        self.check_errors(before, fact, actions)
        if isinstance(fact, lc.Prepared):
            answered = [a for a in actions if isinstance(a, (lc.Submit, lc.Discard))]
            if len(answered) != 1:
                raise InvariantBroken(f"a prepared attempt was answered with {answered}")
            if before.cancel is not None and isinstance(answered[0], lc.Submit):
                raise InvariantBroken("an attempt prepared after a cancel was submitted")
        for a in actions:
            if isinstance(a, lc.Publish) and a.ending is not None:
                if a.ending.kind is lc.EndKind.GROW and a.state not in (
                    JobState.RESIZING,
                    JobState.FAILED,
                ):
                    raise InvariantBroken(f"a grow led to {a.state}")
                if a.ending.kind is lc.EndKind.GROW and life.restarts_left != before.restarts_left:
                    raise InvariantBroken("a grow used a restart")
                if a.state is JobState.FAILED and a.ending.kind is lc.EndKind.GROW:
                    raise InvariantBroken("a grow failed the job")

    def check_errors(self, before: lc.Life, fact: Any, actions: list[Any]) -> None:
        """The errors step decides: the one a job ends with matches how it ended, the one
        said while it stops is the one it ends with, launch() raises only for a job that
        failed before any attempt was placed, a lost rank's future says why."""
        life = self.life
        for a in actions:
            if isinstance(a, lc.Publish):
                if a.state is JobState.RUNNING:
                    self.ran = True
                self.check_error(a)
            elif isinstance(a, lc.Finish):
                failed = self.published[-1] if self.published else None
                raises = failed is not None and failed.state is JobState.FAILED and not self.ran
                if (a.error is not None) != raises or (raises and a.error is not failed.error):
                    raise InvariantBroken(
                        f"launch() raises {a.error!r}; the job ran: {self.ran}, ended {failed}"
                    )
            elif isinstance(a, lc.FailTask):
                rank = before.ranks[a.rank]
                if isinstance(a.error, dask_ddp.errors.RankStoppedError):
                    if before.ending is None or a.status is None:
                        raise InvariantBroken(f"{a}: stopped, yet the attempt was not stopping")
                elif not isinstance(a.error, dask_ddp.WorkerLostError) or a.error.key != rank.key:
                    raise InvariantBroken(f"{a}: a lost rank's future says {a.error!r}")
                elif a.error.finished != (a.status is None):
                    raise InvariantBroken(f"{a}: a finished rank's status changed")
        if (
            isinstance(fact, lc.ActionFailed)
            and fact.action is lc.ActionKind.PLACE
            and fact.workers
            and any(isinstance(a, lc.Publish) and a.state is JobState.FAILED for a in actions)
        ):
            raise InvariantBroken("a placement that lost a worker failed the job")
        if life.phase is lc.Phase.RUNNING and not self.ran:
            raise InvariantBroken("running, and launch() was never told")

    def check_stall(self, before: lc.Life, fact: Any, actions: list[Any]) -> None:
        """A running attempt stalls exactly when no rank spoke for ddp.stall-timeout and
        every rank's stacks were the same in two samples with no word between them; it acts
        as ddp.stall-action says, and a word clears it."""
        said = [a for a in actions if isinstance(a, lc.Publish) and a.state is JobState.STALLED]
        if not isinstance(fact, lc.Sampled):
            if said:
                raise InvariantBroken(f"stalled on {fact}, not on a sample")
            return
        timeout = self.policy.stall_timeout
        should = (
            before.phase is lc.Phase.RUNNING
            and before.ending is None
            and not before.stalled
            and fact.attempt == before.attempt
            and timeout is not None
            and fact.quiet >= timeout
            and fact.complete
            and before.sample == (fact.attempt, fact.quiet_since, fact.stacks)
        )
        if bool(said) != should:
            raise InvariantBroken(f"{fact} after {before.sample}: stalled {bool(said)}")
        ended = self.life.ending is not None and self.life.ending.kind is lc.EndKind.STALLED
        if should and ended != (self.policy.stall_action is not lc.StallAction.WARN):
            raise InvariantBroken(f"stalled with {self.policy.stall_action}: ended {ended}")

    def check_error(self, a: lc.Publish) -> None:
        if a.state is JobState.RESTARTING:
            cause = a.ending.cause if a.ending is not None else None
            stall_restarts = self.policy.stall_action is lc.StallAction.RESTART
            if cause is None or not (
                RESTARTS_AS_DOCUMENTED[cause.value] or (cause is lc.Cause.STALL and stall_restarts)
            ):
                raise InvariantBroken(f"{a}: restarts, and docs/jobs.md says no for {cause}")
        if isinstance(a.error, dask_ddp.RankStoppedError):
            text = str(a.error)
            if a.error.failed_rank == a.error.rank or "job None" in text:
                raise InvariantBroken(f"{a}: the stopped rank's error reads {text!r}")
        classes = {
            lc.EndKind.RANK: dask_ddp.RankFailedError,
            lc.EndKind.TASK: dask_ddp.RankFailedError,
            lc.EndKind.LOST: dask_ddp.WorkerLostError,
            lc.EndKind.STOPPED: dask_ddp.RankStoppedError,
            lc.EndKind.SCALE: dask_ddp.ScaleTimeoutError,
            lc.EndKind.RESIZES: dask_ddp.errors.TooManyResizesError,
            lc.EndKind.STALLED: dask_ddp.JobStalledError,
            lc.EndKind.PLACEMENT: dask_ddp.DaskDDPError,
            lc.EndKind.SUPERVISOR: dask_ddp.errors.SupervisorError,
        }
        if a.state is JobState.STOPPING:
            if a.error is None:
                raise InvariantBroken(f"{a}: stopping towards its end, with no error said")
            self.stopping_error = a.error
            return
        if a.state is JobState.CANCELLED:
            expected: type | None = dask_ddp.JobCancelledError
        elif a.state is JobState.FAILED:
            expected = classes[a.ending.kind]
        else:
            expected = None
        if (a.error is None) != (expected is None) or (
            expected is not None and not isinstance(a.error, expected)
        ):
            raise InvariantBroken(f"{a}: the job ended with {a.error!r}, not a {expected}")
        if a.ending is not None and a.ending.rank is not None and hasattr(a.error, "key"):
            key = f"k{a.attempt}-{a.ending.rank}"
            if a.error.key != key:
                raise InvariantBroken(f"{a}: its error names task {a.error.key}, not {key}")
        said, self.stopping_error = self.stopping_error, None
        if (
            a.state.final
            and said is not None
            and (type(said) is not type(a.error) or str(said) != str(a.error))
        ):
            raise InvariantBroken(f"said {said!r} while it stopped, ended with {a.error!r}")

    # -- the end of a sequence --------------------------------------------------------------
    def settle(self, *, cooperate: bool, limit: int = 2000) -> int:
        """Let only answers, timers and (if ``cooperate``) the ranks' own ends happen until
        the job ends; the number of events it took. Other jobs end first (a job waits for
        the workers they hold as long as it takes)."""
        self.others.clear()
        self.pool_changed()
        self.run_queue()
        for n in range(limit):
            if self.life.closed:
                return n
            if not self.event(cooperate=cooperate, grow=False):
                break
        raise InvariantBroken(
            f"the job never ended: {self.life.phase}, {self.life.state}, held {set(self.life.held)}"
        )


def _run(world: World, events: int) -> None:
    world.feed(lc.Start())
    world.run_queue()
    for _ in range(events):
        if world.life.phase is lc.Phase.ENDED:
            break
        world.event()


def _explain(world: World, exc: BaseException) -> str:
    tail = "\n".join(world.log[-60:])
    return f"seed {world.seed}, policy {world.policy}:\n{exc}\nlast facts and actions:\n{tail}"


def _sequence(seed: int) -> None:
    """One random life, then one of the two endings the invariants promise."""
    rng = random.Random(seed * 7919)
    world = World(seed)
    try:
        _run(world, rng.randrange(0, 150))
        if world.life.phase is lc.Phase.ENDED:
            return
        ending = rng.random()
        if ending < 0.5:
            # A cancel: only answers and timers from now on, no rank stops by itself.
            world.cancel()
            world.run_queue()
            world.settle(cooperate=False)
            stops = [t for t in world.fired_after_cancel if t is not lc.Timer.STOP]
            if stops or world.fired_after_cancel.count(lc.Timer.STOP) > 1:
                raise InvariantBroken(
                    "a cancel waited for more than ddp.failure-grace and one worker restart: "
                    f"timers fired {world.fired_after_cancel}"
                )
        elif ending < 0.75:
            # Every worker goes away for good: the job must end (failed, after scale-timeout).
            for w in sorted(world.cluster):
                world.kill(w, replace=False)
            world.run_queue()
            world.settle(cooperate=True)
        else:
            # The ranks end on their own (no cancel, no kill): the job ends.
            world.settle(cooperate=True)
        if world.life.held:
            raise InvariantBroken("the job ended holding workers")
        # After the end, a worker of its last attempt leaves (a fixed-port worker may come
        # back at its address): what a rank left there fails its future, nothing else moves.
        used = sorted({r.worker for r in world.life.ranks} & world.cluster)
        if used:
            world.kill(rng.choice(used), replace=False)
            world.run_queue()
    except InvariantBroken as exc:
        raise InvariantBroken(_explain(world, exc)) from None


def _all_sequences() -> None:
    for seed in range(SEQUENCES):
        _sequence(seed)


def test_random_lives_keep_every_invariant() -> None:
    _all_sequences()


def test_the_model_catches_a_broken_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    # Break one rule on purpose: a stopping attempt gives its workers back before its ranks
    # are clean (what stranded the cluster). The model must find it, and say where.
    monkeypatch.setattr(lc.RankLife, "clean", property(lambda self: True))
    with pytest.raises(InvariantBroken, match="while a rank still runs there"):
        _all_sequences()


def test_the_model_catches_a_wrong_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # A lost worker's job said to fail with the rank's own error: the model must find it.
    right = lc._Step.error_of

    def wrong(self: Any, state: JobState, ending: lc.Ending | None) -> BaseException | None:
        if ending is not None and ending.kind is lc.EndKind.LOST:
            return dask_ddp.RankFailedError(0, "w", "k", "ValueError: x")
        return right(self, state, ending)

    monkeypatch.setattr(lc._Step, "error_of", wrong)
    with pytest.raises(InvariantBroken, match="the job ended with RankFailedError"):
        _all_sequences()


def test_a_grow_never_counts_as_a_failure() -> None:
    p = lc.Policy(min_workers=1, max_workers=3, max_restarts=0, max_resizes=5)
    life, _ = lc.step(lc.Life.new(p), lc.Start(), p, 0.0)
    life, _ = lc.step(life, lc.Offered(("a",)), p, 0.0)
    life, _ = lc.step(life, lc.Placed(0, ("a",)), p, 0.0)
    life, actions = lc.step(life, lc.Offered(("a", "b")), p, 0.0)
    assert lc.RequestGrow(0) in actions
    grow = RankOutcome(Verdict.GROW, step=40)
    life, actions = lc.step(life, lc.RankEnded(0, 0, grow), p, 0.0)
    published = [a for a in actions if isinstance(a, lc.Publish)]
    assert [(a.state, a.reason) for a in published] == [
        (JobState.RESIZING, "grow at the checkpoint of step 40")
    ]
    assert life.restarts_left == 0
    life, actions = lc.step(life, lc.TaskEnded(0, 0, False), p, 0.0)
    assert lc.Ask(1, 3, 1) in actions and life.held == {"a", "b"}


def test_too_many_resizes_fail_the_job() -> None:
    p = lc.Policy(min_workers=1, max_workers=2, max_resizes=1)
    life, _ = lc.step(lc.Life.new(p), lc.Start(), p, 0.0)
    for attempt in range(2):
        life, _ = lc.step(life, lc.Offered(("a",)), p, 10.0 * attempt)
        life, _ = lc.step(life, lc.Placed(attempt, ("a",)), p, 10.0 * attempt)
        grow = RankOutcome(Verdict.GROW, step=attempt)
        life, actions = lc.step(life, lc.RankEnded(attempt, 0, grow), p, 10.0 * attempt)
        life, actions = lc.step(life, lc.TaskEnded(attempt, 0, False), p, 10.0 * attempt)
    assert life.phase is lc.Phase.ENDED and life.state is JobState.FAILED
    assert life.ending.kind is lc.EndKind.RESIZES
    assert (life.ending.resizes, life.ending.limit) == (1, 1)
    assert lc.Release(frozenset({"a"})) in actions


def test_no_resize_limit_when_max_resizes_is_none() -> None:
    p = lc.Policy(min_workers=1, max_workers=2, max_resizes=None)
    life, _ = lc.step(lc.Life.new(p), lc.Start(), p, 0.0)
    for attempt in range(50):
        life, _ = lc.step(life, lc.Offered(("a",)), p, 0.0)
        life, _ = lc.step(life, lc.Placed(attempt, ("a",)), p, 0.0)
        grow = RankOutcome(Verdict.GROW, step=attempt)
        life, _ = lc.step(life, lc.RankEnded(attempt, 0, grow), p, 0.0)
        life, _ = lc.step(life, lc.TaskEnded(attempt, 0, False), p, 0.0)
        assert life.phase is lc.Phase.WAITING
    assert life.state is JobState.RESIZING


def test_cancel_while_placing_never_submits_the_attempt() -> None:
    p = lc.Policy(min_workers=2, max_workers=2, failure_grace=5.0)
    life, _ = lc.step(lc.Life.new(p), lc.Start(), p, 0.0)
    life, _ = lc.step(life, lc.Offered(("a", "b")), p, 0.0)
    life, actions = lc.step(life, lc.CancelAsked("stop"), p, 0.0)
    assert actions == [] and life.phase is lc.Phase.PLACING  # the launcher is probing
    life, actions = lc.step(life, lc.Prepared(0), p, 0.0)
    assert actions[0] == lc.Discard(0) and not any(isinstance(a, lc.Submit) for a in actions)
    assert lc.Release(frozenset({"a", "b"})) in actions  # nothing of it runs there
    assert life.phase is lc.Phase.ENDED and life.state is JobState.CANCELLED
    published = [a.state for a in actions if isinstance(a, lc.Publish)]
    assert published == [JobState.CANCELLED]


def test_cancel_between_submit_and_placed_stops_the_attempt_once_placed() -> None:
    p = lc.Policy(min_workers=2, max_workers=2, failure_grace=5.0)
    life, _ = lc.step(lc.Life.new(p), lc.Start(), p, 0.0)
    life, _ = lc.step(life, lc.Offered(("a", "b")), p, 0.0)
    life, actions = lc.step(life, lc.Prepared(0), p, 0.0)
    assert actions == [lc.Submit(0)]
    life, actions = lc.step(life, lc.CancelAsked("stop"), p, 0.0)
    assert actions == [] and life.phase is lc.Phase.PLACING  # its Placed is on its way
    life, actions = lc.step(life, lc.Placed(0, ("a", "b")), p, 0.0)
    published = [a.state for a in actions if isinstance(a, lc.Publish)]
    assert published == [JobState.STOPPING]  # never said "running"; its end is known
    assert lc.Abort(0, (0, 1), ("a", "b"), "stop", None) in actions
    assert lc.Arm(lc.Timer.STOP, 5.0 + lc.STOP_MARGIN, life.armed(lc.Timer.STOP)) in actions
    life, actions = lc.step(life, lc.AbortAnswered(0, frozenset({"a"})), p, 0.0)
    assert life.phase is lc.Phase.STOPPING  # b's rank runs: b is not given back yet
    life, actions = lc.step(life, lc.TimerFired(lc.Timer.STOP, life.armed(lc.Timer.STOP)), p, 5)
    assert actions == [lc.RestartWorkers(0, frozenset({"b"}))]
    life, actions = lc.step(life, lc.WorkersRestarted(frozenset({"b"})), p, 6.0)
    assert life.phase is lc.Phase.ENDED and life.state is JobState.CANCELLED
    assert actions[0] == lc.Release(frozenset({"a", "b"}))


def test_docs_print_the_restart_table_step_decides_from() -> None:
    # docs/jobs.md's table and the model's expectation are the product's table, row for row.
    text = (Path(__file__).parent.parent / "docs" / "jobs.md").read_text()
    table = text.split("### What restarts a job", 1)[1].split("\n\n", 3)[2]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    said = [row.rstrip(" |").rsplit("| ", 1)[1] for row in rows[1:]]
    assert {c.value: r for c, r in lc.RESTARTS.items()} == RESTARTS_AS_DOCUMENTED
    order = list(lc.Cause)
    assert len(said) == len(order)
    for cause, word in zip(order, said, strict=True):
        expected = (
            "with `restart` only"
            if cause is lc.Cause.STALL
            else "yes"
            if lc.RESTARTS[cause]
            else "no"
        )
        assert word == expected, (cause, word)


def test_missing_credentials_never_restart_a_job() -> None:
    p = lc.Policy(min_workers=1, max_workers=1, max_restarts=3)
    life, _ = lc.step(lc.Life.new(p), lc.Start(), p, 0.0)
    life, _ = lc.step(life, lc.Offered(("a",)), p, 0.0)
    life, _ = lc.step(life, lc.Placed(0, ("a",)), p, 0.0)
    denied = RankOutcome(
        Verdict.FAIL, "dask_ddp.errors.StorageAccessError", "denied", fault=Fault.CREDENTIALS
    )
    life, _ = lc.step(life, lc.RankEnded(0, 0, denied), p, 1.0)
    life, _ = lc.step(life, lc.TaskEnded(0, 0, True), p, 1.0)
    assert life.state is JobState.FAILED and life.restarts_left == 3
    assert life.ending.cause is lc.Cause.CREDENTIALS
    unreachable = dataclasses.replace(denied, fault=Fault.INFRASTRUCTURE)
    life, _ = lc.step(lc.Life.new(p), lc.Start(), p, 0.0)
    life, _ = lc.step(life, lc.Offered(("a",)), p, 0.0)
    life, _ = lc.step(life, lc.Placed(0, ("a",)), p, 0.0)
    life, _ = lc.step(life, lc.RankEnded(0, 0, unreachable), p, 1.0)
    life, _ = lc.step(life, lc.TaskEnded(0, 0, True), p, 1.0)
    assert life.restarts_left == 2

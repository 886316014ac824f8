"""The worker pool as a model: several jobs ask for workers, take what they are offered in
their step, give workers back, are cancelled; workers join, leave and are kept out; the
pool's passes run on a real event loop, interleaved at random with all of it.

The pool keeps no record of who holds a worker: it asks each job (``Holder.held``, a
supervisor's life). The invariants, checked after every event and every pass: no worker is
held by two jobs, nor held while kept out of every job; a job takes only what it was
offered; once a pass has run, no request left waiting could be met by the free workers; a
request is told it is short once, and a single look is never left waiting.
"""

from __future__ import annotations

import asyncio
import os
import random
import types
from typing import Any

import pytest

from dask_ddp._scheduler.pool import WorkerPool

SEQUENCES = int(os.environ.get("DASK_DDP_POOL_SEQUENCES", "400"))


class Broken(AssertionError):
    pass


class Job:
    """A job as the pool sees it: what it holds is its own record, set in its step."""

    def __init__(self, job_id: str, world: World) -> None:
        self.job_id, self.world = job_id, world
        self.held: frozenset[str] = frozenset()
        self.want = self.need = 0
        self.waiting = False  # asked, and wants the workers (a cancelled job does not)
        self.shorts = 0

    def ask(self, want: int, need: int, *, once: bool = False) -> None:
        pool = self.world.pool
        self.waiting, self.shorts, self.want, self.need = True, 0, want, need
        pool.ask(
            self,
            lambda: sorted(pool.scheduler.workers),
            want=want,
            need=need,
            on_offer=self.offered,
            on_short=None if once else self.short,
        )
        self.once = once

    def offered(self, workers: list[str]) -> None:
        """Its step: a job that still wants workers takes them; one that does not leaves
        them free."""
        world = self.world
        new = set(workers) - self.held
        if not self.need <= len(set(workers)) == len(workers) <= self.want:
            world.broken.append(
                f"{self.job_id} offered {workers}: want {self.want}, need {self.need}"
            )
        for other in world.jobs.values():
            if other is not self and new & other.held:
                world.broken.append(f"{self.job_id} offered {new & other.held}, {other.job_id}'s")
        if new & world.pool.quarantined():
            world.broken.append(f"{self.job_id} offered {new}, kept out of every job")
        if not self.waiting:
            return
        self.waiting = False
        self.held = frozenset(workers)

    def short(self, cluster: int) -> None:
        self.shorts += 1
        if self.shorts > 1:
            self.world.broken.append(f"{self.job_id} told it is short twice")


class World:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.names = iter(range(10_000))
        self.scheduler = types.SimpleNamespace(workers={})
        self.jobs: dict[str, Job] = {}
        self.pool = WorkerPool(self.scheduler, jobs=lambda: self.jobs.values(), on_change=self.told)
        self.changes_told = 0
        self.broken: list[str] = []  # what the pool's callbacks found (the loop runs them)
        for _ in range(self.rng.randrange(0, 6)):
            self.join()

    def told(self) -> None:
        self.changes_told += 1

    def join(self) -> None:
        address = f"tcp://w{next(self.names)}"
        self.scheduler.workers[address] = types.SimpleNamespace(name=address, host="h", nthreads=1)
        self.pool.add_worker(address)
        self.pool.changed()

    def leave(self, address: str) -> None:
        del self.scheduler.workers[address]
        self.pool.remove_worker(address)
        for job in self.jobs.values():  # WorkerLost: each job's life forgets it
            job.held -= {address}
        self.pool.changed()

    def event(self) -> None:
        rng = self.rng
        workers = sorted(self.scheduler.workers)
        pick = rng.choices(
            ["launch", "release", "cancel", "grow", "join", "leave", "quarantine"],
            [3, 2, 1, 1, 1.5, 1, 0.3],
        )[0]
        idle = [j for j in self.jobs.values() if not j.waiting]
        if pick == "launch" or not self.jobs:
            job = Job(f"j{len(self.jobs)}", self)
            self.jobs[job.job_id] = job
            need = rng.randint(1, 3)
            job.ask(need + rng.choice([0, 0, 1]), need)
        elif pick == "release" and idle:  # a job ends or restarts: its workers are clean
            job = rng.choice(idle)
            job.held = frozenset()
            self.pool.changed()
            if rng.random() < 0.5:
                need = rng.randint(1, 3)
                job.ask(need, need)
        elif pick == "cancel":
            job = rng.choice(list(self.jobs.values()))
            job.waiting = False
            self.pool.withdraw(job.job_id)
        elif pick == "grow" and idle:  # a running elastic job takes more, if it can
            job = rng.choice([j for j in idle if j.held] or idle)
            job.ask(len(job.held) + 2, len(job.held) + 1, once=True)
        elif pick == "join":
            self.join()
        elif pick == "leave" and workers:
            self.leave(rng.choice(workers))
        elif pick == "quarantine":
            free = self.pool.free()
            if free:
                self.pool.quarantine("j?", [rng.choice(free)])

    def check(self, *, passed: bool) -> None:
        if self.broken:
            raise Broken(self.broken[0])
        seen: dict[str, str] = {}
        for job in self.jobs.values():
            for address in job.held:
                if address in seen:
                    raise Broken(f"{address} held by {seen[address]} and {job.job_id}")
                seen[address] = job.job_id
        if seen.keys() & self.pool.quarantined():
            raise Broken(f"{seen.keys() & self.pool.quarantined()} held and kept out")
        if self.pool.holders() != seen:
            raise Broken(f"the pool reads {self.pool.holders()}, the jobs hold {seen}")
        if not passed:
            return
        for job_id, request in self.pool._requests.items():
            if request.on_short is None:
                raise Broken(f"{job_id}'s single look was left waiting")
            if self.pool._offer(request) is not None:
                raise Broken(f"{job_id} waits, yet the free workers would do")
            if request.job.shorts != 1:
                raise Broken(f"{job_id} waits, told it is short {request.job.shorts} times")


async def _sequence(seed: int) -> None:
    world = World(seed)
    for _ in range(world.rng.randrange(5, 60)):
        world.event()
        world.check(passed=False)
        if world.rng.random() < 0.5:
            await asyncio.sleep(0)  # the loop runs what is due: the pool's pass
            world.check(passed=world.pool._pass is None)
    await asyncio.sleep(0)
    world.check(passed=True)


def _all_sequences() -> None:
    async def main() -> None:
        for seed in range(SEQUENCES):
            try:
                await _sequence(seed)
            except Broken as exc:
                raise Broken(f"seed {seed}: {exc}") from None

    asyncio.run(main())


def test_jobs_hold_only_what_they_were_offered_and_never_the_same_worker() -> None:
    _all_sequences()


def test_the_model_catches_a_pool_that_keeps_no_account_of_the_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A pool that does not ask the jobs what they hold offers a held worker again.
    monkeypatch.setattr(WorkerPool, "holders", lambda self: {})
    with pytest.raises(Broken, match=r"offered|held by"):
        _all_sequences()


def test_a_request_the_cluster_can_meet_is_offered_on_the_loop_not_at_once() -> None:
    async def main() -> list[Any]:
        world = World(0)
        world.scheduler.workers.clear()
        for _ in range(2):
            world.join()
        first, second = Job("a", world), Job("b", world)
        world.jobs.update(a=first, b=second)
        first.ask(2, 2)
        second.ask(2, 2)
        asked = (first.held, second.held)
        await asyncio.sleep(0)
        return [asked, set(world.scheduler.workers), first.held, second.held, second.shorts]

    asked, cluster, first, second, shorts = asyncio.run(main())
    assert asked == (frozenset(), frozenset())  # nothing is decided inside the asking step
    assert first == cluster and second == frozenset() and shorts == 1

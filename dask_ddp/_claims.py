"""Whole worker sets for jobs: taken at once, never held while waiting for more.

A job's ranks each need a worker of their own. Each worker is claimed with a
``distributed.Semaphore`` of one lease named after the worker's address, and a job takes
its workers under one cluster-wide ``distributed.Lock`` with non-blocking acquires: it
gets at least the number it needs and keeps them, or gives back what it got and waits for
a change while holding nothing. So no job ever holds some workers while it waits for
workers another job holds (no hold-and-wait), and concurrent jobs run one after the
other instead of deadlocking at the rendezvous. The leases are Dask's own: the scheduler
drops those of a client that went away after ``distributed.scheduler.locks.lease-timeout``.

A change worth looking again for is published on :data:`TOPIC` (a job gave workers
back) or by the scheduler on its ``"all"`` topic (a worker joined or left).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from distributed import Client, Lock, Semaphore

from . import _topics

logger = logging.getLogger(__name__)

#: Event topic on which a job announces that it gave workers back.
TOPIC = "dask-ddp-placement"
_LOCK = "dask-ddp-placement"
_CHANGES = {"add-worker", "remove-worker", "released"}


def _semaphore_name(address: str) -> str:
    return f"dask-ddp-worker-{address}"


class WorkerClaims:
    """The workers one job holds, taken and given back whole.

    Examples
    --------
    >>> claims = WorkerClaims(client, "3f2a")          # doctest: +SKIP
    >>> claims.take(["tcp://a:1", "tcp://a:2"], want=2, need=2)  # doctest: +SKIP
    True
    >>> claims.release()                                # doctest: +SKIP
    """

    def __init__(self, client: Client, job_id: str) -> None:
        self.client, self.job_id = client, job_id
        self._semaphores: dict[str, Semaphore] = {}
        self._held: list[str] = []
        self._changed = threading.Event()
        self._unsubscribe: list[Callable[[], None]] = []
        self._lock: Lock | None = None
        #: Called on the client's event loop at each change (the supervisor's wake-up).
        self.on_change: Callable[[], None] | None = None

    @property
    def held(self) -> list[str]:
        """The workers this job holds, in the order it took them."""
        return list(self._held)

    def _semaphore(self, address: str) -> Semaphore:
        sem = self._semaphores.get(address)
        if sem is None:
            sem = Semaphore(
                max_leases=1,
                name=_semaphore_name(address),
                scheduler_rpc=self.client.scheduler,
                loop=self.client.loop,
            )
            self._semaphores[address] = sem
        return sem

    def take(self, candidates: Sequence[str], *, want: int, need: int) -> bool:
        """Claim free workers among ``candidates`` (in their order) until ``want`` are held.

        Keeps them and returns True when at least ``need`` are held then; otherwise gives
        back the ones just taken and returns False. Never waits for a worker.
        """
        self._changed.clear()  # a change from now on is worth another look
        new = self.client.sync(self._take, list(candidates), want, need)
        if new is None:
            return False
        self._held += new
        if new:
            logger.debug("job %s: claimed %s", self.job_id, new)
        return True

    async def _take(self, candidates: list[str], want: int, need: int) -> list[str] | None:
        # On the client's event loop: the acquires of a round go out together.
        if self._lock is None:
            self._lock = Lock(_LOCK, scheduler_rpc=self.client.scheduler, loop=self.client.loop)
        await self._lock.acquire()  # held for this round of non-blocking acquires only
        try:
            new: list[str] = []
            free = [a for a in candidates if a not in self._held]
            while free and len(self._held) + len(new) < want:
                count = want - len(self._held) - len(new)
                batch, free = free[:count], free[count:]
                got = await asyncio.gather(*(self._semaphore(a).acquire(timeout=0) for a in batch))
                new += [a for a, ok in zip(batch, got, strict=True) if ok]
            if len(self._held) + len(new) < need:
                await asyncio.gather(*(self._semaphores[a].release() for a in new))
                return None
            return new
        finally:
            await self._lock.release()

    def release(self, addresses: Sequence[str] | None = None) -> None:
        """Give back ``addresses`` (default: every held worker) and say so to waiting jobs."""
        gone = [a for a in (self._held if addresses is None else addresses) if a in self._held]
        for address in gone:
            self._held.remove(address)
        # A closed client cannot: the scheduler drops its leases after their timeout.
        if gone and self.client.status in ("running", "connecting"):
            self.client.sync(self._release, gone)

    async def _release(self, gone: list[str]) -> None:
        done = await asyncio.gather(
            *(self._semaphores[a].release() for a in gone), return_exceptions=True
        )
        for address, outcome in zip(gone, done, strict=True):
            if isinstance(outcome, BaseException):  # the lease times out on the scheduler
                logger.debug("job %s: not released: %s (%s)", self.job_id, address, outcome)
        with contextlib.suppress(Exception):  # the client is closing: nobody to tell
            await self.client.log_event(TOPIC, {"action": "released", "workers": gone})

    def watch(self) -> None:
        """Follow the changes that may free or add workers (see :meth:`wait_for_change`
        and :attr:`on_change`), from before the first :meth:`take`."""

        def handle(event: Any) -> None:
            msg = event[1] if isinstance(event, tuple) else event
            if isinstance(msg, dict) and msg.get("action") in _CHANGES:
                self._changed.set()
                if self.on_change is not None:
                    self.on_change()

        if not self._unsubscribe:
            for topic in ("all", TOPIC):
                self._unsubscribe.append(_topics.follow(self.client, topic, handle))

    def wait_for_change(self, timeout: float) -> bool:
        """Wait until a worker joined or left, or a job gave workers back since the last
        :meth:`take`; False after ``timeout`` seconds (a lease that timed out is not
        announced, so waiters look again now and then)."""
        return self._changed.wait(timeout)

    def wake(self) -> None:
        """End a :meth:`wait_for_change` now (the job was cancelled)."""
        self._changed.set()

    def close(self) -> None:
        """Give everything back and stop following changes."""
        self.release()
        for unsubscribe in self._unsubscribe:
            with contextlib.suppress(Exception):
                unsubscribe()
        self._unsubscribe.clear()
        for sem in [*self._semaphores.values(), *([self._lock] if self._lock else [])]:
            sem.refresh_callback.stop()  # never close(): that would drop other jobs' leases
        self._semaphores.clear()
        self._lock = None

"""The cluster's workers as jobs hold them: whole sets, decided in the scheduler's memory.

A job's ranks each need a worker of their own, and a job takes its workers whole: it gets
at least the number it needs at once and keeps them, or nothing (no job ever holds some
workers while it waits for workers another job holds, so concurrent jobs run one after the
other instead of deadlocking at the rendezvous). :class:`WorkerPool` lives in the
scheduler plugin, beside the ``add_worker``/``remove_worker`` hooks: a request that cannot
be met waits in launch order and is granted, in the same tick, when a worker joins or a job
gives workers back.

While a job waits (or an elastic job runs below its size), its missing workers are demand
that Dask's adaptive scaling sees: one placeholder task per missing worker, restricted to a
resource no worker has, of the prefix ``ddp-waiting-for-worker`` whose default duration
(``distributed.scheduler.default-task-durations``, set in dask_ddp.yaml) is long enough
that ``Scheduler.adaptive_target()`` asks for a worker each. Workers a job holds are never
chosen by adaptive scale-down (:meth:`WorkerPool.protect`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger(__name__)

PLACEHOLDER = "ddp-waiting-for-worker"  # the placeholder tasks' prefix (dask_ddp.yaml)
_RESOURCE = "dask-ddp-placeholder"  # a resource no worker has: placeholders never run


def _placeholder() -> None:  # pragma: no cover - never runs (its resource does not exist)
    return None


@dataclasses.dataclass
class _Request:
    """A job's wish: up to ``want`` workers in all, at least ``need``, from ``candidates()``;
    ``on_grant(workers)`` once they are its; ``demand``: more workers would help it (not so
    for a job that names its workers)."""

    job_id: str
    candidates: Callable[[], list[str]]
    want: int
    need: int
    on_grant: Callable[[list[str]], None]
    demand: bool = True


QUARANTINED = "<quarantined>"  # the holder of workers no job may use (see WorkerPool.quarantine)


class WorkerPool:
    """Which job holds which worker, and the requests waiting for workers.

    Parameters
    ----------
    scheduler : distributed.Scheduler
        Its ``workers`` table is the pool's view of the cluster.
    on_change : callable
        Called with no argument after every change of the workers (joined, left, given
        back), once the waiting requests that could be met were granted: running jobs
        look again (an elastic job may grow).

    Examples
    --------
    >>> pool = WorkerPool(scheduler, on_change=lambda: None)  # doctest: +SKIP
    >>> pool.take("3f2a", ["tcp://a:1", "tcp://a:2"], want=2, need=2)  # doctest: +SKIP
    ['tcp://a:1', 'tcp://a:2']
    >>> pool.release("3f2a")  # doctest: +SKIP
    """

    def __init__(self, scheduler: Any, on_change: Callable[[], None]) -> None:
        self.scheduler = scheduler
        self.holder: dict[str, str] = {}  # worker address -> job id
        self._requests: dict[str, _Request] = {}  # in the order they were made
        self._on_change = on_change
        self._client: Any = None
        self._placeholders: dict[str, list[Any]] = {}  # job id -> placeholder futures
        self._growing: dict[str, int] = {}  # job id -> workers a running elastic job lacks
        self._returning: dict[Any, list[asyncio.Future[str]]] = {}  # name -> waiters

    def attach_client(self, client: Any) -> None:
        """The plugin's own client, which submits and cancels placeholders."""
        self._client = client

    # -- holding ---------------------------------------------------------------------------
    def held(self, job_id: str) -> list[str]:
        """The workers ``job_id`` holds, in the order it took them."""
        return [a for a, j in self.holder.items() if j == job_id]

    def quarantined(self) -> list[str]:
        """Workers kept out of every job (:meth:`quarantine`)."""
        return self.held(QUARANTINED)

    def free(self) -> list[str]:
        """Workers no job holds."""
        return [a for a in self.scheduler.workers if a not in self.holder]

    def take(
        self, job_id: str, candidates: Iterable[str], *, want: int, need: int
    ) -> list[str] | None:
        """Give ``job_id`` free workers among ``candidates`` (in their order) until it holds
        ``want``; if it then holds at least ``need`` return all it holds, else take nothing
        and return None. Never waits."""
        held = self.held(job_id)
        new = []
        for address in candidates:
            if len(held) + len(new) >= want:
                break
            if address in self.scheduler.workers and address not in self.holder:
                new.append(address)
        if len(held) + len(new) < need:
            return None
        for address in new:
            self.holder[address] = job_id
        if new:
            logger.debug("job %s: took %s", job_id, new)
        return held + new

    def release(self, job_id: str, addresses: Iterable[str] | None = None) -> None:
        """Give back ``addresses`` (default: every worker ``job_id`` holds)."""
        gone = self.held(job_id) if addresses is None else list(addresses)
        changed = False
        for address in gone:
            if self.holder.get(address) == job_id:
                del self.holder[address]
                changed = True
        if changed:
            self.changed()

    def quarantine(self, job_id: str, addresses: Iterable[str]) -> None:
        """Keep ``addresses`` out of every job until they leave the cluster: a rank of
        ``job_id`` there could be neither stopped nor its worker restarted, and a job
        placed there would wait on it. Adaptive scaling may close them."""
        for address in addresses:
            if address in self.scheduler.workers and self.holder.get(address) in (job_id, None):
                self.holder[address] = QUARANTINED
                logger.warning(
                    "dask-ddp: worker %s is kept out of dask-ddp jobs: job %s's rank there did "
                    "not stop and the worker could not be restarted; restart it "
                    "(client.restart_workers) or let it go, and it is used again",
                    address, job_id,
                )  # fmt: skip

    def protect(self, workers: list[Any]) -> list[Any]:
        """Of ``workers`` (``WorkerState``s adaptive scale-down would close), those no job
        holds: a job's workers stay, between two of its placements too."""
        return [ws for ws in workers if self.holder.get(ws.address, QUARANTINED) == QUARANTINED]

    # -- waiting ---------------------------------------------------------------------------
    def ask(
        self,
        job_id: str,
        candidates: Callable[[], list[str]],
        *,
        want: int,
        need: int,
        on_grant: Callable[[list[str]], None],
        demand: bool = True,
    ) -> None:
        """A request granted as soon as ``take`` would succeed, in the order requests were
        made: ``on_grant(workers)`` is called then, with every worker the job holds.
        Meanwhile the missing workers are adaptive scaling's demand (unless ``demand`` is
        false)."""
        self._requests.pop(job_id, None)
        self._requests[job_id] = _Request(job_id, candidates, want, need, on_grant, demand)
        self._grant()
        self._update_demand()

    def withdraw(self, job_id: str) -> None:
        """Drop ``job_id``'s request (it was cancelled or timed out)."""
        self._requests.pop(job_id, None)
        self._update_demand()

    def changed(self) -> None:
        """Workers joined, left or were given back: grant what can be granted now, then
        tell the running jobs."""
        self._grant()
        self._update_demand()
        self._on_change()

    def remove_worker(self, address: str) -> str | None:
        """A worker left the cluster: forget it; return the job that held it, if any."""
        return self.holder.pop(address, None)

    def add_worker(self, address: str) -> None:
        """A worker joined: whoever waits for its name to come back hears of it."""
        ws = self.scheduler.workers.get(address)
        for future in self._returning.pop(ws.name if ws is not None else None, []):
            if not future.done():
                future.set_result(address)

    def returned(self, name: Any) -> asyncio.Future[str]:
        """A future of the address of the next worker to join under ``name`` (a restarted
        worker comes back under its name, at a new address)."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._returning.setdefault(name, []).append(future)
        return future

    def _grant(self) -> None:
        for job_id, request in list(self._requests.items()):
            workers = self.take(job_id, request.candidates(), want=request.want, need=request.need)
            if workers is not None:
                del self._requests[job_id]
                request.on_grant(workers)

    # -- adaptive demand -------------------------------------------------------------------
    def missing(self) -> dict[str, int]:
        """Workers each waiting job still lacks, beyond what the cluster has free."""
        return {
            job_id: max(0, r.want - len(self.held(job_id)))
            for job_id, r in self._requests.items()
            if r.demand
        }

    def demand(self, job_id: str, missing: int) -> None:
        """Keep ``missing`` workers of demand for ``job_id`` visible to adaptive scaling
        (an elastic job below its size calls it; waiting requests count by themselves)."""
        self._growing[job_id] = missing
        self._update_demand()

    def _update_demand(self) -> None:
        if self._client is None or self._client.status not in ("running", "connecting"):
            return
        wanted = dict(self._growing)
        for job_id, n in self.missing().items():
            wanted[job_id] = max(wanted.get(job_id, 0), n)
        threads = max((ws.nthreads for ws in self.scheduler.workers.values()), default=1)
        for job_id in set(wanted) | set(self._placeholders):
            # adaptive_target() divides by the workers' threads: one task per thread.
            count = wanted.get(job_id, 0) * max(1, threads)
            have = self._placeholders.setdefault(job_id, [])
            if len(have) > count:
                drop, have[:] = have[count:], have[:count]
                for future in drop:  # nobody else wants them: the scheduler forgets them
                    future.release()
            while len(have) < count:
                have.append(
                    self._client.submit(
                        _placeholder,
                        key=f"{PLACEHOLDER}-{len(have)}-{job_id}",
                        resources={_RESOURCE: 1},
                        pure=False,
                    )
                )
            if not have:
                del self._placeholders[job_id]

    def forget(self, job_id: str) -> None:
        """``job_id`` ended: no request, no demand, no worker."""
        self._growing.pop(job_id, None)
        self.withdraw(job_id)
        self.release(job_id)

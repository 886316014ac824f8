"""The cluster's workers as jobs hold them: whole sets, offered in the scheduler's memory.

A job's ranks each need a worker of their own, and a job takes its workers whole: it gets
at least the number it needs at once and keeps them, or nothing (no job ever holds some
workers while it waits for workers another job holds, so concurrent jobs run one after the
other instead of deadlocking at the rendezvous). :class:`WorkerPool` lives in the
scheduler plugin, beside the ``add_worker``/``remove_worker`` hooks.

Which job holds which worker is written in one place: each job's life
(:attr:`dask_ddp._scheduler.lifecycle.Life.held`). The pool keeps no such record; it asks
the lives. It keeps the requests, in the order they were made, and offers free workers to
them in a pass of its own on the scheduler's loop, one job at a time: the job takes an
offer in its step (an :class:`~dask_ddp._scheduler.lifecycle.Offered` fact), so its life
holds the workers before the next request is looked at, and no worker is offered twice.
A pass runs soon after a request is made, a worker joins or leaves, or a job gives workers
back; never inside a job's step.

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
from typing import Any, Protocol

logger = logging.getLogger(__name__)

PLACEHOLDER = "ddp-waiting-for-worker"  # the placeholder tasks' prefix (dask_ddp.yaml)
_RESOURCE = "dask-ddp-placeholder"  # a resource no worker has: placeholders never run


def _placeholder() -> None:  # pragma: no cover - never runs (its resource does not exist)
    return None


class Holder(Protocol):
    """A job as the pool sees it (:class:`dask_ddp._scheduler.supervisor.Supervisor`)."""

    job_id: str

    @property
    def held(self) -> frozenset[str]:
        """The workers it holds: its life's record, the only one."""
        ...


@dataclasses.dataclass
class _Request:
    """A job's wish: up to ``want`` workers in all, at least ``need``, from ``candidates()``
    (in their order); ``on_offer(workers)``: the offer, for the job to take in its step;
    ``on_short(cluster)``: the first pass could not offer them (None: a single look, dropped
    if it finds nothing); ``demand``: more workers would help it (not so for a job that
    names its workers)."""

    job: Holder
    candidates: Callable[[], list[str]]
    want: int
    need: int
    on_offer: Callable[[list[str]], None]
    on_short: Callable[[int], None] | None
    demand: bool = True
    looked: bool = False  # a pass looked at it and could not offer the workers


class WorkerPool:
    """The requests waiting for workers, offered the free ones; the workers kept out.

    Parameters
    ----------
    scheduler : distributed.Scheduler
        Its ``workers`` table is the pool's view of the cluster.
    jobs : callable
        The jobs there are (:class:`Holder`): what they hold is what is not free.
    on_change : callable
        Called with no argument after every change of the workers (joined, left, given
        back), once the waiting requests that could be met were offered them: running jobs
        look again (an elastic job may grow).

    Examples
    --------
    >>> pool = WorkerPool(scheduler, jobs=jobs.values, on_change=look_again)  # doctest: +SKIP
    >>> pool.ask(job, candidates, want=2, need=2, on_offer=take, on_short=wait)  # doctest: +SKIP
    """

    def __init__(
        self,
        scheduler: Any,
        jobs: Callable[[], Iterable[Holder]],
        on_change: Callable[[], None],
    ) -> None:
        self.scheduler = scheduler
        self._jobs = jobs
        self._quarantined: set[str] = set()
        self._requests: dict[str, _Request] = {}  # in the order they were made
        self._on_change = on_change
        self._pass: asyncio.Handle | None = None  # a pass due on the loop
        self._tell = False  # the pass due tells the running jobs (workers changed)
        self._client: Any = None
        self._placeholders: dict[str, list[Any]] = {}  # job id -> placeholder futures
        self._growing: dict[str, int] = {}  # job id -> workers a running elastic job lacks
        self._returning: dict[Any, list[asyncio.Future[str]]] = {}  # name -> waiters

    def attach_client(self, client: Any) -> None:
        """The plugin's own client, which submits and cancels placeholders."""
        self._client = client

    # -- holding: what the jobs' lives say -------------------------------------------------
    def holders(self) -> dict[str, str]:
        """Worker address -> the job that holds it, read off every job's life."""
        return {address: job.job_id for job in self._jobs() for address in job.held}

    def quarantined(self) -> frozenset[str]:
        """Workers kept out of every job (:meth:`quarantine`)."""
        return frozenset(self._quarantined)

    def usable(self) -> int:
        """The cluster's workers, less those kept out of every job."""
        return len(self.scheduler.workers) - len(self._quarantined)

    def free(self) -> list[str]:
        """Workers no job holds and none is kept out of."""
        taken = self.holders().keys() | self._quarantined
        return [a for a in self.scheduler.workers if a not in taken]

    def quarantine(self, job_id: str, addresses: Iterable[str]) -> None:
        """Keep ``addresses`` out of every job until they leave the cluster: a rank of
        ``job_id`` there could be neither stopped nor its worker restarted, and a job
        placed there would wait on it. Adaptive scaling may close them."""
        for address in addresses:
            if address in self.scheduler.workers:
                self._quarantined.add(address)
                logger.warning(
                    "dask-ddp: worker %s is kept out of dask-ddp jobs: job %s's rank there did "
                    "not stop and the worker could not be restarted; restart it "
                    "(client.restart_workers) or let it go, and it is used again",
                    address, job_id,
                )  # fmt: skip
        self.changed()

    def protect(self, workers: list[Any]) -> list[Any]:
        """Of ``workers`` (``WorkerState``s adaptive scale-down would close), those no job
        holds: a job's workers stay, between two of its placements too."""
        held = self.holders()
        return [ws for ws in workers if ws.address not in held]

    # -- asking ----------------------------------------------------------------------------
    def ask(
        self,
        job: Holder,
        candidates: Callable[[], list[str]],
        *,
        want: int,
        need: int,
        on_offer: Callable[[list[str]], None],
        on_short: Callable[[int], None] | None = None,
        demand: bool = True,
    ) -> None:
        """Offer ``job`` workers among ``candidates()`` as soon as it can hold at least
        ``need`` (at most ``want``; those it holds count), in the order requests were made:
        ``on_offer(workers)``, with every worker it would hold. If the first pass cannot,
        ``on_short(cluster)``, and the request waits; without ``on_short`` it is dropped.
        Once the pass found it short, the missing workers are adaptive scaling's demand
        (unless ``demand`` is false). A job's new request replaces its last."""
        self._requests.pop(job.job_id, None)
        self._requests[job.job_id] = _Request(
            job, candidates, want, need, on_offer, on_short, demand
        )
        self._soon()  # the pass updates the demand: none for a request it meets at once

    def withdraw(self, job_id: str) -> None:
        """Drop ``job_id``'s request (it was cancelled or timed out)."""
        self._requests.pop(job_id, None)
        self._update_demand()

    def changed(self) -> None:
        """Workers joined, left, were given back or kept out: offer what can be offered
        now, then tell the running jobs (soon, on the loop: never inside a job's step)."""
        self._tell = True
        self._soon()

    def remove_worker(self, address: str) -> None:
        """A worker left the cluster (the jobs that held it hear of it themselves)."""
        self._quarantined.discard(address)

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

    # -- offering --------------------------------------------------------------------------
    def _soon(self) -> None:
        if self._pass is None:
            self._pass = asyncio.get_running_loop().call_soon(self._offer_all)

    def _offer_all(self) -> None:
        """One pass: each request in turn is offered what is free now, and its job takes
        the offer (in its step, fed at once: no job steps while the loop runs this) before
        the next request is looked at."""
        self._pass = None
        tell, self._tell = self._tell, False
        for job_id, request in list(self._requests.items()):
            if self._requests.get(job_id) is not request:
                continue  # withdrawn or replaced by a job that took an offer before it
            workers = self._offer(request)
            if workers is not None:
                del self._requests[job_id]
                logger.debug("job %s: offered %s", job_id, workers)
                request.on_offer(workers)
            elif request.on_short is None:
                del self._requests[job_id]
            elif not request.looked:
                request.looked = True
                request.on_short(self.usable())
        self._update_demand()
        if tell:
            self._on_change()

    def _offer(self, request: _Request) -> list[str] | None:
        """The workers ``request``'s job would hold: those it holds (still there), then free
        candidates, until it holds ``want``; None if that is fewer than ``need``."""
        workers, held, free = self.scheduler.workers, request.job.held, set(self.free())
        candidates = list(dict.fromkeys(request.candidates()))
        mine = [a for a in candidates if a in held and a in workers]
        mine += sorted(a for a in held if a in workers and a not in mine)
        new = [a for a in candidates if a in free][: max(0, request.want - len(mine))]
        if len(mine) + len(new) < request.need:
            return None
        return mine + new

    # -- adaptive demand -------------------------------------------------------------------
    def missing(self) -> dict[str, int]:
        """Workers each waiting job still lacks, beyond what the cluster has free."""
        return {
            job_id: max(0, r.want - len(r.job.held))
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
        """``job_id`` ended: no request, no demand (its life holds no worker)."""
        self._growing.pop(job_id, None)
        self.withdraw(job_id)

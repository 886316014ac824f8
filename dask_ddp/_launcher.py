"""Placing a job on the cluster: whole worker sets, a probe, a rank plan, the rank tasks.

:class:`Launcher` places a job for its first attempt and again for every restart or
resize: it claims its workers whole (:mod:`dask_ddp._claims`), probes them (GPUs, busy
ranks, and rank 0's store), plans the ranks (:mod:`dask_ddp.placement`) and builds the
rank tasks, one impure task per rank, pinned to its worker and never retried elsewhere.
:func:`job_size` checks ``workers=``/``min_workers=`` before anything starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from distributed import Client, Future

from . import _traceback, bootstrap, config, script
from ._claims import WorkerClaims
from .errors import NoWorkersError, PlacementError, ScaleTimeoutError
from .placement import (
    WorkerInfo,
    choose_backend,
    order_workers,
    plan_ranks,
    rank_key,
    select_workers,
)

if TYPE_CHECKING:
    from .data import _collection_plan as _collections

logger = logging.getLogger(__name__)

_LOOK_AGAIN = 5.0  # seconds between looks for free workers when no change was announced


def _resolve_names(info: Mapping[str, Mapping[str, Any]], requested: Any) -> Any:
    """Let ``workers=`` name workers by their Dask name as well as by address."""
    if requested is None or isinstance(requested, (int, str)):
        return requested
    by_name = {str(w.get("name")): addr for addr, w in info.items()}
    return [r if r in info else by_name.get(str(r), r) for r in requested]


@dataclasses.dataclass(frozen=True)
class Size:
    """How many workers a job runs on: at least ``min_workers``, at most ``max_workers``."""

    min_workers: int
    max_workers: int


def job_size(
    client: Client,
    workers: int | Sequence[str] | None,
    min_workers: int | None,
    checkpoint_dir: str | os.PathLike[str] | None,
) -> tuple[Size, int | list[str] | None]:
    """Check ``workers=`` and ``min_workers=`` before anything starts; return the job's
    size and the workers it asks for (names resolved to addresses)."""
    if min_workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int):
            raise PlacementError(
                f"min_workers={min_workers!r} needs workers= as a number (the most workers the "
                f"job may use); got workers={workers!r}"
            )
        if isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1:
            raise PlacementError(
                f"min_workers must be a whole number of at least 1; got {min_workers!r}"
            )
        if min_workers > workers:
            raise PlacementError(
                f"min_workers={min_workers} is more than workers={workers}: the job would never "
                "start. Pass min_workers <= workers."
            )
        if min_workers < workers and checkpoint_dir is None:
            raise PlacementError(
                f"workers={workers}, min_workers={min_workers} resizes the job from its last "
                "checkpoint, but it has no checkpoint_dir: pass checkpoint_dir='s3://bucket/run1' "
                "(any fsspec URL the workers share) and save_checkpoint() in the function"
            )
        if min_workers < workers:
            return Size(min_workers, workers), workers  # the cluster may grow into it
    info = client.scheduler_info(n_workers=-1)["workers"]
    if not info:
        raise NoWorkersError(client.scheduler.address)
    requested = _resolve_names(info, workers)
    chosen = select_workers({addr: w["host"] for addr, w in info.items()}, requested)
    size = Size(len(chosen), len(chosen))
    return size, list(chosen) if isinstance(requested, (list, tuple)) else requested


@dataclasses.dataclass
class Attempt:
    """One placement of a job: its run id (attempt 0 uses the job id), ranks and store."""

    run_id: str
    attempt: int
    workers: list[str]
    backend: str
    store_worker: str
    submit: Callable[[], list[Future]]
    abandon: Callable[[], None]
    sources: _traceback.Sources | None = None  # where the client's copy of fn lives


def job_name(fn: Callable[..., Any], args: tuple) -> str:
    """What the job runs, for people: the script's file name, else the function's name.

    >>> job_name(job_name, ())
    'job_name'
    >>> job_name(script.run_script, ("print(1)", "/home/ana/train.py", []))
    'train.py'
    """
    if fn is script.run_script:
        return os.path.basename(args[1])
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class Launcher:
    """Places a job on the cluster, for its first attempt and for every restart."""

    def __init__(
        self,
        client: Client,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict[str, Any],
        settings: config.Settings,
        job_id: str,
        size: Size,
        requested: int | list[str] | None,
        **rank_options: Any,
    ) -> None:
        self.client, self.fn, self.args, self.kwargs = client, fn, args, kwargs
        self.settings, self.job_id, self.rank_options = settings, job_id, rank_options
        self.size, self.requested = size, requested
        self.name = job_name(fn, args)
        self.sources = _traceback.Sources(fn)
        self.claims = WorkerClaims(client, job_id)
        self.datasets: _collections._Datasets | None = None

    @property
    def elastic(self) -> bool:
        """Whether the job may run on fewer workers than its most."""
        return self.size.min_workers < self.size.max_workers

    def place(
        self,
        attempt: int,
        *,
        wait: bool = True,
        on_wait: Callable[[str], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Attempt | None:
        """Claim a whole set of workers (see :mod:`dask_ddp._claims`) and plan on them.

        Keeps the workers the job still holds, adds free ones up to its size, and needs at
        least its minimum. Without enough free workers it returns None (``wait=False``), or
        waits for a change while holding nothing new: workers held by other jobs are waited
        for as long as it takes, a cluster too small for the minimum up to
        ``ddp.scale-timeout`` (``ddp.rendezvous-timeout`` for a fixed-size job's restart).
        """
        size = self.size
        limit = self.settings.scale_timeout
        if attempt > 0 and size.min_workers == size.max_workers:
            limit = self.settings.rendezvous_timeout
        short_since: float | None = None
        while True:
            info = self.client.scheduler_info(n_workers=-1)["workers"]
            self.claims.release([w for w in self.claims.held if w not in info])
            candidates = self._candidates(info, attempt)
            if self.claims.take(candidates, want=size.max_workers, need=size.min_workers):
                return self.prepare(attempt, self.claims.held, info)
            if not wait:
                return None
            now = time.monotonic()
            if len(info) >= size.min_workers:
                short_since = None
                why = (
                    f"waiting for {size.min_workers} free workers: other jobs hold some of "
                    f"the cluster's {len(info)}"
                )
            else:
                short_since = now if short_since is None else short_since
                if now - short_since > limit:
                    raise ScaleTimeoutError(self.job_id, size.min_workers, len(info), limit)
                why = (
                    f"waiting for the cluster to grow: {len(info)} of at least "
                    f"{size.min_workers} workers there ({limit - (now - short_since):.0f} s left)"
                )
            if on_wait is not None:
                on_wait(why)
            if cancelled is not None and cancelled():
                return None
            # A lease given up by a client that died is not announced: look again now and then.
            self.claims.wait_for_change(_LOOK_AGAIN)

    def _candidates(self, info: Mapping[str, Mapping[str, Any]], attempt: int) -> list[str]:
        """The workers this attempt may run on, held ones first, then in rank order."""
        if attempt == 0 and isinstance(self.requested, list):
            return self.requested
        ordered = order_workers([WorkerInfo(a, w["host"]) for a, w in info.items()])
        held = [w for w in self.claims.held if w in info]
        return held + [w.address for w in ordered if w.address not in held]

    def try_grow(self, attempt: Attempt) -> bool:
        """Claim free workers for a running elastic job below its size; when it got some,
        ask its rank 0 to stop at the next checkpoint. False when nothing changed."""
        size, held = self.size, len(self.claims.held)
        if not self.elastic or held >= size.max_workers:
            return False
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        candidates = self._candidates(info, attempt.attempt)
        if not self.claims.take(candidates, want=size.max_workers, need=held + 1):
            return False
        self.client.run(
            bootstrap.request_grow, attempt.run_id, workers=[attempt.store_worker],
            on_error="ignore",
        )  # fmt: skip
        logger.info(
            "job %s: %d more workers free; the job grows to %d ranks at its next checkpoint",
            self.job_id, len(self.claims.held) - held, len(self.claims.held),
        )  # fmt: skip
        return True

    def prepare(
        self, attempt: int, workers: Sequence[str], info: Mapping[str, Mapping[str, Any]]
    ) -> Attempt:
        """Probe ``workers`` (claimed, each in ``info``, the scheduler's worker table), plan
        the ranks on them and build their tasks, ready to submit."""
        client, settings = self.client, self.settings
        run_id = self.job_id if attempt == 0 else f"{self.job_id}-{attempt}"
        chosen = list(workers)
        rank0 = order_workers([WorkerInfo(a, info[a]["host"]) for a in chosen])[0]
        can_grow = self.elastic and len(chosen) < self.size.max_workers
        probes = client.run(
            bootstrap.probe_worker, run_id, rank0.address, settings.rendezvous_timeout,
            workers=chosen,
        )  # fmt: skip

        def abandon() -> None:
            client.run(bootstrap.drop_store, run_id, workers=[rank0.address], on_error="ignore")

        try:
            for worker, probe in probes.items():
                if probe["busy"]:
                    logger.info(
                        "job %s: worker %s is running %s; this job's rank waits for it "
                        "(up to ddp.rendezvous-timeout for the other ranks)",
                        run_id, worker, probe["busy"],
                    )  # fmt: skip
            infos = [
                WorkerInfo(
                    address=a,
                    host=info[a]["host"],
                    gpu_count=settings.gpu_count
                    if settings.gpu_count is not None
                    else probes[a]["gpu_count"],
                    cuda_visible_devices=probes[a]["cuda_visible_devices"],
                )
                for a in chosen
            ]
            backend, why = choose_backend(settings.backend, infos)
            plan = plan_ranks(infos)
            # Each attempt splits the data again, for where its ranks and the partitions
            # are now (a restart may run on other workers, after partitions were recomputed).
            shares = (
                self.datasets.plan([p.worker for p in plan])
                if self.datasets is not None
                else [None] * len(plan)
            )
        except BaseException:
            abandon()
            raise
        port = probes[rank0.address]["store_port"]
        logger.info(
            "job %s: attempt %d, %d ranks on %d hosts, backend %s (%s), rendezvous at %s:%d",
            self.job_id, attempt, len(plan), plan[-1].node_rank + 1, backend, why, rank0.host,
            port,
        )  # fmt: skip
        specs = [
            bootstrap.RankSpec(
                job_id=run_id,
                key=rank_key(self.name, run_id, placement.rank),
                attempt=attempt,
                backend=backend,
                timeout=settings.timeout,
                rendezvous_timeout=settings.rendezvous_timeout,
                master_addr=rank0.host,
                master_port=port,
                threads_per_rank=settings.threads_per_rank,
                allow_daemon_children=settings.allow_daemon_children,
                tune_malloc=settings.tune_malloc,
                placement=placement,
                event_flush_interval=settings.event_flush_interval,
                max_event_bytes=settings.max_event_bytes,
                datasets=shares[placement.rank],
                can_grow=can_grow,
                **self.rank_options,
            )
            for placement in plan
        ]

        def submit() -> list[Future]:
            futures: list[Future] = []
            try:
                for spec in specs:
                    futures.append(
                        client.submit(
                            bootstrap.run_rank,
                            self.fn,
                            self.args,
                            self.kwargs,
                            spec,
                            key=spec.key,
                            workers=[spec.placement.worker],
                            allow_other_workers=False,
                            pure=False,
                            retries=0,
                        )
                    )
            except BaseException:
                client.cancel(futures)
                abandon()
                raise
            return futures

        workers = [p.worker for p in plan]
        return Attempt(
            run_id, attempt, workers, backend, rank0.address, submit, abandon, self.sources
        )

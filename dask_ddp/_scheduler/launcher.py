"""Placing one attempt of a job on the workers the pool gave it, and stopping it again.

Runs in the scheduler plugin, on the scheduler's event loop, through the plugin's own
client (public ``Client`` API, asynchronous): one ``Client.run`` probes the workers it has
not seen yet (their GPUs) and opens the job's ``TCPStore`` on rank 0's worker (port 0, so
the OS picks a free port and two jobs never share one, and the store listens before any
rank connects); :mod:`dask_ddp._shared.placement` plans the ranks; one impure task per rank is
submitted, pinned to its worker and never retried elsewhere, and the attempt's futures are
published (``Client.publish_dataset``) so that every client can read them, whoever
launched the job. Stopping an attempt aborts its ranks in place, restarts the workers of
ranks stuck in a C++ collective, and fails the tasks left without a worker with the reason
(never a bare ``CancelledError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import pickle
from collections.abc import Sequence
from typing import Any

from .._shared import dask_internals
from .._shared.placement import (
    WorkerInfo,
    choose_backend,
    order_workers,
    plan_ranks,
    replica_holders,
)
from .._shared.protocol import (
    CheckpointPlan,
    Entry,
    EventPlan,
    RankSpec,
    Rendezvous,
    Restore,
    acall,
    call,
    dataset_name,
    flush_interval,
    job_topic,
    rank_key,
    run_id_of,
)
from .._shared.values import JobSpec
from ..errors import PlacementError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Attempt:
    """One placement of a job: where its ranks run, and what the supervisor needs to reach
    them (how each rank ended is the job's life's, :mod:`dask_ddp._scheduler.lifecycle`).

    Attributes
    ----------
    number : int
        0 for the first placement, one more per restart or resize.
    run_id : str
        The job id for attempt 0, ``<job id>-<number>`` after; rank events carry it.
    workers : list of str
        Each rank's worker, in rank order.
    keys : list of str
        Each rank's task key.
    loaded : dict
        Rank -> where its state came from, as it said: ``[source, step, where]`` each time.
    """

    number: int
    run_id: str
    workers: list[str]
    backend: str
    store_worker: str
    keys: list[str]
    specs: list[RankSpec]
    futures: list[Any] = dataclasses.field(default_factory=list)
    loaded: dict[int, list[list[Any]]] = dataclasses.field(default_factory=dict)
    reported: bool = False  # a rank of this attempt reported a record
    published: bool = False  # its futures are published (every client can read them)

    @property
    def dataset(self) -> str:
        return dataset_name(self.run_id)


class Launcher:
    """Prepares, submits and stops the attempts of one job.

    Parameters
    ----------
    client : distributed.Client
        The scheduler plugin's own asynchronous client.
    scheduler : distributed.Scheduler
        The scheduler, for its worker table (hosts).
    spec : JobSpec
        The job as its client sent it.
    gpus : dict
        Worker address -> ``(gpu count, CUDA_VISIBLE_DEVICES)``, probed once per worker and
        shared by every job (the plugin forgets a worker's entry when it leaves).
    datasets : optional
        The job's Dask collections (:class:`dask_ddp.data._collection_plan.Datasets`),
        split between the ranks again for every attempt.
    """

    def __init__(
        self, client: Any, scheduler: Any, spec: JobSpec, gpus: dict[str, Any], datasets: Any
    ) -> None:
        self.client, self.scheduler, self.spec = client, scheduler, spec
        self.gpus, self.datasets = gpus, datasets

    async def prepare(self, number: int, workers: Sequence[str], *, can_grow: bool) -> Attempt:
        """Probe ``workers`` (held by the job), open rank 0's store, plan the ranks and build
        their tasks' specs. Raises what placing them raises (a backend without GPUs, a
        worker that left meanwhile, a dataset partition lost for good)."""
        spec, settings = self.spec, self.spec.settings
        run_id = run_id_of(spec.job_id, number)
        hosts = {a: self.scheduler.workers[a].host for a in workers}
        rank0 = order_workers([WorkerInfo(a, hosts[a]) for a in workers])[0].address
        targets = sorted({rank0, *(a for a in workers if a not in self.gpus)})
        probes = await self.client.run(
            acall, Entry.PROBE, run_id, rank0, settings.rendezvous_timeout, workers=targets
        )
        for address, probe in probes.items():
            self.gpus[address] = (probe["gpu_count"], probe["cuda_visible_devices"])
            if probe["busy"]:
                logger.info(
                    "job %s: worker %s is running %s; this job's rank waits for it (up to "
                    "ddp.rendezvous-timeout for the other ranks)", run_id, address, probe["busy"],
                )  # fmt: skip
        try:
            infos = [
                WorkerInfo(
                    address=a,
                    host=hosts[a],
                    gpu_count=settings.gpu_count
                    if settings.gpu_count is not None
                    else self.gpus[a][0],
                    cuda_visible_devices=self.gpus[a][1],
                )
                for a in workers
            ]
            counts = self.ranks_per_worker(infos)
            backend, why = choose_backend(settings.backend, infos, counts)
            plan = plan_ranks(infos, counts)
            shares = (
                await self.datasets.plan(self.client, [p.worker for p in plan])
                if self.datasets is not None
                else [None] * len(plan)
            )
        except BaseException:
            try:
                await self.drop_store(run_id, rank0)
            except Exception as exc:  # the error placing raised is the one to tell
                logger.warning("job %s: could not close its store on %s: %s", run_id, rank0, exc)
            raise
        port = probes[rank0]["store_port"]
        flush = flush_interval(len(plan), settings.event_flush_interval, settings.job_event_rate)
        if flush > settings.event_flush_interval:
            logger.info(
                "job %s: %d ranks send their records every %.2f s, not every %.2f s, to keep "
                "the job under %g events a second through the scheduler (ddp.job-event-rate)",
                spec.job_id, len(plan), flush, settings.event_flush_interval,
                settings.job_event_rate,
            )  # fmt: skip
        logger.info(
            "job %s: attempt %d, %d ranks on %d hosts, backend %s (%s), rendezvous at %s:%d",
            spec.job_id, number, len(plan), plan[-1].node_rank + 1, backend, why, hosts[rank0],
            port,
        )  # fmt: skip
        holders: list[str | None] = [None] * len(plan)
        if spec.checkpoint_dir and settings.checkpoint_replicas:
            spare = [
                WorkerInfo(a, ws.host) for a, ws in self.scheduler.workers.items() if a not in hosts
            ]
            holders = replica_holders(plan, order_workers(spare))
        rendezvous = Rendezvous(
            backend=backend,
            master_addr=hosts[rank0],
            master_port=port,
            timeout=settings.timeout,
            rendezvous_timeout=settings.rendezvous_timeout,
            init_process_group=spec.init_process_group,
        )
        plan_events = EventPlan(
            job_topic(spec.job_id),
            flush_interval=flush,
            max_event_bytes=settings.max_event_bytes,
            result_limit=settings.result_limit,
            watch=spec.watch,
        )
        specs = [
            RankSpec(
                job_id=spec.job_id,
                run_id=run_id,
                key=rank_key(spec.name, run_id, p.rank),
                attempt=number,
                placement=p,
                rendezvous=rendezvous,
                events=plan_events,
                checkpoint=CheckpointPlan(
                    directory=spec.checkpoint_dir,
                    keep_last=spec.keep_last,
                    storage_options=spec.storage_options,
                    mode=settings.checkpoint_mode,
                    replica_holder=holders[p.rank],
                    replica_fraction=settings.replica_fraction,
                ),
                max_restarts=spec.max_restarts,
                pass_local_rank=spec.pass_local_rank,
                threads_per_rank=settings.threads_per_rank,
                tune_malloc=settings.tune_malloc,
                failure_grace=settings.failure_grace,
                can_grow=can_grow,
                datasets=shares[p.rank],
                trial_kwargs=spec.trial_kwargs,
            )
            for p in plan
        ]
        return Attempt(
            number=number,
            run_id=run_id,
            workers=[p.worker for p in plan],
            backend=backend,
            store_worker=rank0,
            keys=[s.key for s in specs],
            specs=specs,
        )

    def ranks_per_worker(self, infos: Sequence[WorkerInfo]) -> dict[str, int]:
        """How many ranks each worker runs (``launch(ranks_per_worker=)``): the number given,
        or with ``"gpu"`` as many as it has GPUs (its ``GPU`` resource, else the GPUs it
        sees, or ``ddp.gpu-count``).

        Raises
        ------
        PlacementError
            ``"gpu"`` on a worker that has none.
        """
        wanted = self.spec.ranks_per_worker
        if wanted != "gpu":
            return {w.address: int(wanted) for w in infos}
        counts = {}
        for w in infos:
            resource = self.scheduler.workers[w.address].resources.get("GPU")
            counts[w.address] = int(resource) if resource else w.gpu_count
            if counts[w.address] < 1:
                raise PlacementError(
                    f"job {self.spec.job_id}: ranks_per_worker='gpu' runs a rank per GPU, and "
                    f"worker {w.address} has none (no GPU resource, and it sees no GPU). "
                    "Pass ranks_per_worker=N, or choose workers with GPUs (workers=[...])."
                )
        return counts

    def restore_from(self, attempt: Attempt, plans: Sequence[tuple[Restore, ...]]) -> None:
        """Tell each rank of ``attempt`` where its state comes from (before it is submitted)."""
        attempt.specs = [
            dataclasses.replace(spec, checkpoint=dataclasses.replace(spec.checkpoint, restore=plan))
            for spec, plan in zip(attempt.specs, plans, strict=True)
        ]

    async def held_replicas(
        self, workers: Sequence[str]
    ) -> dict[str, list[tuple[int, int | None, int]]]:
        """The job's replicas each of ``workers`` (those alive) keeps: ``(writer, world
        size, step)``; a worker that does not answer is left out. Raises what the call
        raises (the scheduler is closing)."""
        alive = sorted(set(workers) & set(self.scheduler.workers))
        if not alive:
            return {}
        held = await self.client.run(
            call, Entry.HELD_REPLICAS, self.spec.job_id, workers=alive, on_error="return"
        )
        return {w: entries for w, entries in held.items() if isinstance(entries, list)}

    async def drop_replicas(self, workers: Sequence[str], key: tuple[int, Any] | None) -> None:
        """Forget the job's replicas on ``workers`` (those of ``key``, ``(writer, world
        size)``, only, if given) at the job's end, or when they moved elsewhere."""
        alive = sorted(set(workers) & set(self.scheduler.workers))
        if alive:
            await self.client.run(
                call, Entry.DROP_REPLICAS, self.spec.job_id, key, workers=alive, on_error="return"
            )

    def submit(self, attempt: Attempt) -> None:
        """Submit the attempt's rank tasks, one graph (it goes out on the client's stream),
        each task pinned to its rank's worker."""
        attempt.futures = dask_internals.submit_pinned(
            self.client,
            [
                (spec.key, spec.placement.worker, call, (Entry.RUN_RANK, self.spec.payload, spec))
                for spec in attempt.specs
            ],
        )

    async def publish(self, attempt: Attempt) -> None:
        """Publish the attempt's futures, so that every client can read them (and the
        cluster keeps their values until the job is forgotten)."""
        await self.client.publish_dataset(attempt.futures, name=attempt.dataset, override=True)
        attempt.published = True

    async def unpublish(self, attempt: Attempt) -> None:
        """Let the cluster forget the attempt's futures (and the values they hold)."""
        with contextlib.suppress(KeyError, OSError):  # gone already, or the scheduler is closing
            await self.client.unpublish_dataset(attempt.dataset)
        dask_internals.drop_published_client(self.scheduler, attempt.dataset)
        for future in attempt.futures:
            future.release()
        attempt.futures, attempt.published = [], False

    # -- stopping ------------------------------------------------------------------------------
    async def abort(
        self, attempt: Attempt, ranks: Sequence[int], reason: str, failed_rank: int | None
    ) -> set[str]:
        """Ask ``ranks`` of ``attempt`` to stop (:func:`dask_ddp._rank.tasks.abort_rank`);
        return the workers that answered that no rank of the attempt runs there (it ends
        at once if its task starts later: the worker is clean). A worker that did not
        answer is not among them. Raises what the call raises."""
        targets = sorted({attempt.workers[r] for r in ranks} & set(self.scheduler.workers))
        if not targets:
            return set()
        answers = await self.client.run(
            call, Entry.ABORT, attempt.run_id, reason, failed_rank, workers=targets,
            on_error="return",
        )  # fmt: skip
        for worker, answer in answers.items():
            if isinstance(answer, BaseException):
                logger.warning(
                    "job %s: %s did not take the stop (%s: %s); its worker is restarted if "
                    "its rank goes on", attempt.run_id, worker, type(answer).__name__, answer,
                )  # fmt: skip
        return {w for w, running in answers.items() if running is False}

    async def restart(
        self, workers: Sequence[str], pool: Any, timeout: float
    ) -> tuple[set[str], set[str]]:
        """Restart ``workers``, whose ranks did not stop: each one's process is killed, and
        its nanny starts a new one, which joins under the same name; a worker without a
        nanny is closed (its deployment may start it again). Return the workers done (gone,
        their successors joined within ``timeout``) and those that could not be
        restarted."""
        table = self.scheduler.workers
        alive = [w for w in workers if w in table]
        done = set(workers) - set(alive)
        back = {w: pool.returned(table[w].name) for w in alive if table[w].nanny}
        lone = [w for w in alive if w not in back]
        if lone:  # nothing can start them again here: they go
            answers = await self.client.restart_workers(lone, raise_for_error=False)
            done |= {w for w, answer in answers.items() if answer in ("OK", "removed")}
        if back:
            answers = await dask_internals.kill_worker_processes(self.client, list(back))
            for worker, answer in answers.items():
                if isinstance(answer, BaseException):
                    logger.warning(
                        "job %s: could not restart %s: %s", self.spec.job_id, worker, answer
                    )
                    back.pop(worker).cancel()
        if back:
            await asyncio.wait(list(back.values()), timeout=timeout)
        done |= {w for w, future in back.items() if future.done() and not future.cancelled()}
        for future in back.values():
            future.cancel()
        return done, set(workers) - done

    def fail_lost(self, attempt: Attempt, rank: int, error: BaseException) -> None:
        """Fail rank ``rank``'s task, left without a worker (its worker left or was
        restarted), with ``error``: its future then says why it ended, whichever way it is
        read, instead of waiting for a worker that will not come back."""
        dask_internals.fail_task(self.scheduler, attempt.keys[rank], pickle.dumps(error))

    async def drop_store(self, run_id: str, worker: str) -> None:
        """Close the store opened for ``run_id`` on ``worker`` (an attempt that never ran)."""
        await self.client.run(call, Entry.DROP_STORE, run_id, workers=[worker], on_error="return")

    async def request_grow(self, attempt: Attempt) -> None:
        """Ask the attempt's rank 0 to stop every rank at its next checkpoint."""
        await self.client.run(
            call, Entry.REQUEST_GROW, attempt.run_id, workers=[attempt.store_worker],
            on_error="return",
        )  # fmt: skip

"""dask-ddp's scheduler plugin: where every job lives, and how clients reach it.

:class:`DaskDDPPlugin` is a ``SchedulerPlugin``. ``launch()`` installs it on any running
cluster (:func:`install`, once per client; a second client's registration leaves the
running one alone), and ``dask scheduler --preload dask_ddp`` installs it when the
scheduler starts. It holds:

- the jobs, one :class:`~dask_ddp._scheduler.supervisor.Supervisor` each, from launch until
  forgotten
  (:meth:`Job.forget <dask_ddp.Job.forget>`, or the oldest finished ones past
  ``ddp.dashboard.max-jobs``);
- the worker pool (:mod:`dask_ddp._scheduler.pool`), fed by the ``add_worker``/``remove_worker``
  hooks, which also keeps adaptive scale-down off workers that hold ranks;
- its own asynchronous ``Client`` of the scheduler (public API: submit, run, publish), which
  connects in the background, so that the plugin may be installed while the scheduler
  starts, and is closed before the scheduler;
- the ``/ddp/`` pages and Prometheus gauges (:mod:`dask_ddp._scheduler.page`).

Scheduler hooks hand each supervisor what concerns it: a rank task's end (``transition``),
its events (``log_event``), a worker that joined or left, a client that left. Clients call
the plugin through scheduler handlers of its own, by name
(:data:`dask_ddp._shared.protocol.HANDLERS`, from :mod:`dask_ddp._client.calls`): each answers with
plain values, a refusal too (``{"refused": ...}``, never a raised error that the
scheduler would log with the job's payload), and the plugin tells the clients that follow
a job what happens to it on the job's event topic. It registers the workers' plugins by
name (:class:`dask_ddp._shared.protocol.NamedWorkerPlugin`): the scheduler never imports the
ranks' code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from distributed import Client
from distributed.diagnostics.plugin import SchedulerPlugin

from .. import config as _config
from .._shared import dask_internals, preload
from .._shared.placement import select_workers
from .._shared.protocol import HANDLERS, Entry, NamedWorkerPlugin, call, order_mark
from .._shared.values import JobSpec, SweepSpec
from ..errors import (
    DaskDDPError,
    JobNameTakenError,
    JobNotFoundError,
    JobStillRunningError,
    NoWorkersError,
    SchedulerPluginError,
    SweepStudyError,
    to_wire,
)
from . import page
from .lifecycle import STOP_MARGIN
from .pool import WorkerPool
from .supervisor import Observer, Supervisor
from .sweep import SweepSupervisor

logger = logging.getLogger(__name__)

_CANCEL_SLACK = 60.0  # seconds past failure grace and STOP_MARGIN: a stuck worker's restart

PLUGIN_NAME = "dask-ddp"


class DaskDDPPlugin(SchedulerPlugin):
    """Runs dask-ddp's jobs on the scheduler (see the module's docstring).

    Parameters
    ----------
    max_jobs : int, optional
        Finished jobs kept (``ddp.dashboard.max-jobs``).
    pages : bool, optional
        Serve the ``/ddp/`` pages and gauges (``ddp.dashboard.enabled``).
    """

    name = PLUGIN_NAME
    idempotent = True  # a second client's registration leaves the running plugin alone

    def __init__(self, max_jobs: int | None = None, pages: bool | None = None) -> None:
        self.max_jobs = int(max_jobs or _config.get("ddp.dashboard.max-jobs"))
        self.pages = bool(_config.get("ddp.dashboard.enabled") if pages is None else pages)
        self.changes = page.Changes()  # what the /ddp/ pages show, changing
        self.jobs: dict[str, Supervisor] = {}  # in launch order
        self.sweeps: dict[str, SweepSupervisor] = {}  # in launch order
        self.gpus: dict[str, Any] = {}  # worker -> (GPU count, CUDA_VISIBLE_DEVICES)
        self.scheduler: Any = None
        self.client: Any = None
        self.pool: WorkerPool | None = None
        self._keys: dict[Any, tuple[Supervisor, int]] = {}  # rank task key -> job, rank
        self._topics: dict[str, Supervisor] = {}
        self._ready: asyncio.Event | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._forgetting: set[asyncio.Future[None]] = set()
        self._app: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # Sent to the scheduler by Client.register_plugin: its settings only.
        return {"max_jobs": self.max_jobs, "pages": self.pages}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    # -- life --------------------------------------------------------------------------------
    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.pool = WorkerPool(
            scheduler, jobs=lambda: self.jobs.values(), on_change=self._workers_changed
        )
        for what, handler in (
            ("launch", self._handle_launch),
            ("cancel", self._handle_cancel),
            ("attach", self._handle_attach),
            ("list", self._handle_list),
            ("forget", self._handle_forget),
            ("values", self._handle_values),
            ("ready", self._handle_ready),
            ("sweep", self._handle_sweep),
            ("sweep_cancel", self._handle_sweep_cancel),
            ("sweep_trials", self._handle_sweep_trials),
        ):
            dask_internals.add_scheduler_handler(scheduler, HANDLERS[what], handler)
        self._ready = asyncio.Event()
        # A preloaded plugin starts under the scheduler's start-up lock: a start() that
        # waited for its own client's connection would wait for itself.
        self._connecting = asyncio.ensure_future(self._connect())
        if self.pages:
            self._app = page.add_pages(self)
        # Kept after the plugin closes: the workers of a closing cluster leave after it.
        logging.getLogger("distributed.scheduler").addFilter(preload.LOST_RANK_VALUES)

    async def _connect(self) -> None:
        try:
            self.client = await Client(
                self.scheduler.address,
                asynchronous=True,
                set_as_default=False,
                name="dask-ddp-supervisor",
                # A TLS cluster (Security.temporary(), dask-gateway, Coiled) takes only
                # connections that show its certificate: the scheduler's own.
                security=_config.client_security(self.scheduler.security, "scheduler"),
            )
            # Workers serve large rank messages to clients directly (dask_ddp._rank.channel), and
            # checkpoint replicas to each other (dask_ddp._rank.replicas).
            await self.client.register_plugin(
                NamedWorkerPlugin(Entry.BLOB_HANDLER, "dask-ddp-blob-handler")
            )
            await self.client.register_plugin(
                NamedWorkerPlugin(Entry.REPLICA_PLUGIN, "dask-ddp-replicas")
            )
            # Each worker starts the template its ranks' processes fork from as it joins,
            # not when its first rank is placed (dask_ddp._rank.rankproc).
            await self.client.register_plugin(
                NamedWorkerPlugin(Entry.TEMPLATE_PLUGIN, "dask-ddp-rank-template")
            )
        except Exception:
            logger.exception("dask-ddp: the plugin could not connect to its scheduler")
            raise
        self.pool.attach_client(self.client)
        self._ready.set()

    async def ready(self) -> None:
        """Wait until the plugin's client is connected (raises if it could not)."""
        if self._ready.is_set():
            return
        await asyncio.shield(self._connecting)

    async def before_close(self) -> None:
        for sweep in list(self.sweeps.values()):
            sweep.cancel("the scheduler is closing")
        for job in list(self.jobs.values()):
            job.cancel("the scheduler is closing")
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        if self.client is not None:
            await self.client.close()

    async def close(self) -> None:
        if self._app is not None:
            page.remove_pages(self, self._app)
        for name in HANDLERS.values():
            dask_internals.remove_scheduler_handler(self.scheduler, name)

    # -- what clients ask, by name (dask_ddp._client.calls): plain values, refusals too ---
    async def _handle_launch(self, spec: JobSpec) -> dict[str, Any]:
        try:
            return {"state": await self.launch(spec)}
        except DaskDDPError as exc:
            return {"refused": to_wire(exc)}

    async def _handle_cancel(self, job: str, reason: str) -> dict[str, Any]:
        try:
            found = self.find(job)
        except DaskDDPError as exc:
            return {"refused": to_wire(exc)}
        found.cancel(reason)
        # Answered within a bound: a job whose ranks do not stop (a worker that does not
        # answer) is said to be stopping still; the client's cancel() waits for its end.
        bound = found.settings.failure_grace + STOP_MARGIN + _CANCEL_SLACK
        try:
            await asyncio.wait_for(found.until(lambda: found.closed), bound)
        except asyncio.TimeoutError:
            logger.warning(
                "dask-ddp job %s: not stopped %.0f s after its cancel; answering the client",
                job, bound,
            )  # fmt: skip
        return {"state": found.public_state()}

    def _handle_attach(self, job: str, client: str | None = None) -> dict[str, Any]:
        sweep = self.find_sweep(job)
        if sweep is not None:  # a sweep by its id or name: its state, and its topic from now
            if client:
                self.scheduler.subscribe_topic(sweep.topic, client)
            return {"sweep": sweep.public_state()}
        try:
            return {"state": self.attach(job, client)}
        except DaskDDPError as exc:
            return {"refused": to_wire(exc)}

    async def _handle_sweep(self, spec: SweepSpec) -> dict[str, Any]:
        """Start a sweep; answer once its first trial runs or waits (or could not)."""
        await self.ready()
        for other in self.sweeps.values():
            if spec.named and other.spec.name == spec.name and not other.final:
                return {"refused": to_wire(JobNameTakenError(spec.name, other.sweep_id))}
        sweep = SweepSupervisor(self, spec)
        self.sweeps[spec.sweep_id] = sweep
        if spec.client:
            self.scheduler.subscribe_topic(sweep.topic, spec.client)
        sweep.start()
        try:
            await sweep.first_trial()
        except Exception as exc:
            await sweep.until_done()
            self.sweeps.pop(spec.sweep_id, None)
            if not isinstance(exc, DaskDDPError):  # the study did not unpickle, or ask failed
                exc = SweepStudyError(spec.sweep_id, f"{type(exc).__name__}: {exc}")
            return {"refused": to_wire(exc)}
        return {"state": sweep.public_state()}

    async def _handle_sweep_cancel(self, sweep: str, reason: str) -> dict[str, Any]:
        found = self.find_sweep(sweep)
        if found is None:
            return {"refused": to_wire(JobNotFoundError([], job=sweep))}
        found.cancel(reason)
        await found.until_done()
        return {"state": found.public_state()}

    async def _handle_sweep_trials(self, sweep: str) -> dict[str, Any]:
        found = self.find_sweep(sweep)
        if found is None:
            return {"refused": to_wire(JobNotFoundError([], job=sweep))}
        return {"trials": await found.frozen_trials()}

    def find_sweep(self, sweep: str) -> SweepSupervisor | None:
        """The sweep of id ``sweep``, else the newest given that name (``name=``; a running
        one first). A sweep named after its function only is found by id: a job of that
        function's name is what the name finds."""
        if sweep in self.sweeps:
            return self.sweeps[sweep]
        named = [s for s in self.sweeps.values() if s.spec.named and s.spec.name == sweep]
        running = [s for s in named if not s.final]
        return (running or named or [None])[-1]

    def _handle_values(self, job: str) -> dict[str, Any]:
        """The return values ``job``'s supervisor holds (see ``ddp.result-limit``)."""
        try:
            return {"values": self.find(job).held_values()}
        except DaskDDPError as exc:
            return {"refused": to_wire(exc)}

    def _handle_list(self) -> dict[str, Any]:
        return {"rows": page.rows(self)}

    async def _handle_forget(self, job: str) -> dict[str, Any]:
        try:
            await self.forget(job)
        except DaskDDPError as exc:
            return {"refused": to_wire(exc)}
        return {}

    async def _handle_ready(self) -> dict[str, Any]:
        await self.ready()
        return {"ready": True}

    # -- hooks ---------------------------------------------------------------------------
    def add_worker(self, scheduler: Any, worker: str) -> None:
        self.pool.add_worker(worker)
        self.pool.changed()

    def remove_worker(
        self, scheduler: Any, worker: str, *, stimulus_id: str, **kwargs: Any
    ) -> None:
        self.gpus.pop(worker, None)
        self.pool.remove_worker(worker)
        for job in list(self.jobs.values()):
            job.on_worker_removed(worker)
        self.pool.changed()

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish in ("memory", "erred"):
            entry = self._keys.get(key)
            if entry is not None:
                entry[0].on_task(entry[1], finish, kwargs)

    def log_event(self, topic: str, msg: Any) -> None:
        job = self._topics.get(topic) if isinstance(topic, str) else None
        if job is not None and isinstance(msg, dict) and "kind" not in msg:
            job.on_event(msg)

    def remove_client(self, scheduler: Any, client: str) -> None:
        scheduler.extensions["publish"].datasets.pop(order_mark(client), None)
        dask_internals.drop_published_client(scheduler, order_mark(client))
        for job in list(self.jobs.values()):
            job.unfollow(client)

    def valid_workers_downscaling(self, scheduler: Any, workers: list[Any]) -> list[Any]:
        return self.pool.protect(workers)

    def _workers_changed(self) -> None:
        for job in list(self.jobs.values()):
            if not job.closed:
                job.workers_changed()

    # -- what supervisors ask of it ------------------------------------------------------
    def watch_keys(self, job: Supervisor, keys: list[Any]) -> None:
        """Hand ``job`` the ends of these rank tasks."""
        for rank, key in enumerate(keys):
            self._keys[key] = (job, rank)

    def unwatch_keys(self, keys: list[Any]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def job_ended(self, job: Supervisor) -> None:
        """``job`` ended: forget the oldest finished jobs past ``max_jobs``."""
        finished = [j for j in self.jobs.values() if j.closed]
        for old in finished[: max(0, len(finished) - self.max_jobs)]:
            self._drop(old)  # at once: the list never holds more than max_jobs finished
            forgetting = asyncio.ensure_future(self._release(old))
            self._forgetting.add(forgetting)
            forgetting.add_done_callback(self._forgetting.discard)

    def sweep_ended(self, sweep: SweepSupervisor) -> None:
        """``sweep`` ended: forget the oldest finished sweeps past ``max_jobs`` (their trials'
        jobs go as other jobs do)."""
        finished = [s for s in self.sweeps.values() if s.final]
        for old in finished[: max(0, len(finished) - self.max_jobs)]:
            self.sweeps.pop(old.sweep_id, None)
            dask_internals.drop_topic(old.topic, None, self.scheduler)

    # -- what clients ask of it ----------------------------------------------------------
    def _check_name(self, spec: JobSpec) -> None:
        """A name given by the user names one running job at a time."""
        for job in self.jobs.values():
            if spec.named and job.spec.name == spec.name and not job.state.final:
                raise JobNameTakenError(spec.name, job.job_id)

    async def launch(self, spec: JobSpec, observer: Observer | None = None) -> dict[str, Any]:
        """Take a job; answer once it runs or waits for workers (its first placement's error,
        if it cannot be placed at all, is raised to the launching client). ``observer``
        (a sweep, of its trial) is told what the job's ranks tell and each change."""
        await self.ready()
        self._check_name(spec)
        size, spec = self._size(spec)
        datasets = None
        if spec.datasets:
            from ..data._collection_plan import Datasets

            datasets = await Datasets.take(self.client, spec)
            try:  # another launch may have taken the name while this one waited
                self._check_name(spec)
            except JobNameTakenError:
                await datasets.release(self.client)
                raise
        job = Supervisor(self, spec, size, datasets, observer)
        self.jobs[spec.job_id] = job
        self._topics[job.topic] = job
        if spec.client:
            # Before any rank can report: the launching client misses nothing.
            self.scheduler.subscribe_topic(job.topic, spec.client)
        job.start()
        try:
            await job.until(lambda: bool(job.history))  # it runs, waits, or ended
        except BaseException:
            self._drop(job)
            raise
        if job.launch_error is not None:  # it failed before any attempt was placed
            self._drop(job)
            raise job.launch_error
        return job.public_state()

    def _size(self, spec: JobSpec) -> tuple[tuple[int, int], JobSpec]:
        """The job's size, at least and at most, checked against the cluster (and its named
        workers resolved)."""
        workers = self.scheduler.workers
        requested = spec.workers
        if spec.min_workers is not None and isinstance(requested, int):
            return (spec.min_workers, requested), spec  # elastic: the cluster may grow
        if not workers and not (spec.adaptive and isinstance(requested, int)):
            raise NoWorkersError(self.scheduler.address)
        if isinstance(requested, int) and spec.adaptive and requested > len(workers):
            return (requested, requested), spec  # an adaptive cluster grows into it
        if isinstance(requested, list):
            by_name = {str(ws.name): address for address, ws in workers.items()}
            requested = [r if r in workers else by_name.get(str(r), r) for r in requested]
        chosen = select_workers({a: ws.host for a, ws in workers.items()}, requested)
        if isinstance(requested, list):
            spec = dataclasses.replace(spec, workers=list(chosen))
        return (len(chosen), len(chosen)), spec

    def find(self, job: str) -> Supervisor:
        """The job of id ``job``, else the newest of that name (a running one first)."""
        if job in self.jobs:
            return self.jobs[job]
        named = [j for j in self.jobs.values() if j.spec.name == job]
        running = [j for j in named if not j.state.final]
        found = (running or named)[-1:] if named else []
        if not found:
            raise JobNotFoundError([], job=job)
        return found[0]

    def attach(self, job: str, client: str | None) -> dict[str, Any]:
        """A client follows ``job`` from now on: its state, summary and checkpoints so far."""
        found = self.find(job)
        if client:
            self.scheduler.subscribe_topic(found.topic, client)
            found.follow(client)
        return {
            **found.public_state(),
            "summary": found.summary(),
            "checkpoints": [dataclasses.asdict(c) for c in found.checkpoints],
            "sources": dask_internals.pickled(found.spec.sources),  # for stacks, tracebacks
        }

    async def forget(self, job_id: str) -> None:
        """Let the cluster forget a finished job: its record, its results, its events."""
        job = self.jobs.get(job_id)
        if job is None:
            return
        if not job.closed:
            raise JobStillRunningError(job_id, job.state.value)
        self._drop(job)
        await self._release(job)

    async def _release(self, job: Supervisor) -> None:
        """What the cluster keeps of a dropped job: its ranks' values, held messages, events."""
        dask_internals.drop_topic(job.topic, None, self.scheduler)
        if job.attempt is not None:
            await job.launcher.unpublish(job.attempt)
            workers = sorted(set(job.attempt.workers) & set(self.scheduler.workers))
            if workers:
                await self.client.run(
                    call, Entry.DROP_HELD, job.job_id, workers=workers, on_error="return"
                )

    def _drop(self, job: Supervisor) -> None:
        self.jobs.pop(job.job_id, None)
        self._topics.pop(job.topic, None)
        if job.attempt is not None:
            self.unwatch_keys(job.attempt.keys)


def _plugin_of(scheduler: Any) -> DaskDDPPlugin:
    plugin = scheduler.plugins.get(PLUGIN_NAME)
    if plugin is None:
        raise SchedulerPluginError(scheduler.address, "the plugin is not installed")
    return plugin


async def install_on(dask_scheduler: Any) -> bool:
    """Install the plugin on ``dask_scheduler`` if it is a scheduler and has none yet: the
    ``dask_setup`` of ``--preload dask_ddp`` and ``--preload dask_ddp.dashboard`` (it runs
    while the scheduler starts, so it does not wait for the plugin's own client, which
    connects once the scheduler listens)."""
    if not hasattr(dask_scheduler, "register_scheduler_plugin"):
        return False
    if PLUGIN_NAME not in dask_scheduler.plugins:
        plugin = DaskDDPPlugin()
        await dask_scheduler.register_scheduler_plugin(plugin, name=PLUGIN_NAME, idempotent=True)
    return True


async def install_for_client(dask_scheduler: Any) -> dict[str, Any]:
    """What a client runs on the scheduler (by name,
    :data:`dask_ddp._shared.protocol.Entry.INSTALL_PLUGIN`) the first time it launches: the plugin,
    installed once and ready. A scheduler whose ``register_scheduler_plugin`` handler is
    blocked (``distributed.scheduler.blocked-handlers``) gets no plugin this way: its
    operator chose that plugins come with the scheduler (``--preload dask_ddp``)."""
    blocked = getattr(dask_scheduler, "blocked_handlers", ())
    if PLUGIN_NAME not in dask_scheduler.plugins and "register_scheduler_plugin" in blocked:
        cause = "its 'register_scheduler_plugin' handler is blocked"
        return {"refused": to_wire(SchedulerPluginError(dask_scheduler.address, cause))}
    await install_on(dask_scheduler)
    await dask_scheduler.plugins[PLUGIN_NAME].ready()
    return {"ready": True}

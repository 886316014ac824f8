"""A sweep on the scheduler: an Optuna study's trials, each a dask-ddp job on a whole
worker set, as many at once as the worker pool has free sets.

:class:`SweepSupervisor` holds one sweep from :func:`dask_ddp.sweep` until the cluster
forgets it. It decides, in one place each:

- **when to ask for a trial** (:meth:`SweepSupervisor._may_ask`): while no trial of the
  sweep waits for workers. The pool (:mod:`dask_ddp._scheduler.pool`) offers a whole worker
  set to the waiting trial the moment one is free, and the next trial is asked then, so the
  sweep keeps the cluster busy whatever its size, and an adaptive cluster sees the waiting
  trial's demand and grows for it. No client-side ``n_jobs``.
- **what the study is told** (:meth:`SweepSupervisor._report`, :meth:`_outcome`): rank 0's
  values of the sweep's ``metric`` at each step (:attr:`Told.watched
  <dask_ddp._shared.protocol.Told.watched>`), then the trial's end: ``COMPLETE`` with rank
  0's return value if it is a number (:attr:`RankOutcome.number
  <dask_ddp._shared.protocol.RankOutcome.number>`), else the last value reported;
  ``PRUNED``; or ``FAIL`` with the job's error. A worker lost mid-trial is the trial's job's
  own business (its ``max_restarts``, from its checkpoint): the study never hears of it.
- **when to prune**: the study's pruner is asked after each batch of steps; a prune cancels
  the trial's job, which stops every rank at once and gives its workers back.

A named sweep **resumes** its study (:meth:`SweepSupervisor._resume`): the trials of an
earlier sweep of its name that ended count toward ``n_trials``, and those it cut off
(running when its scheduler went, or stopped by its end) run again first, each from its
own checkpoint directory. With a durable storage, the same call after a scheduler's
restart goes on where the sweep was.

The study and ``params()`` come pickled from the client and are unpickled, asked and told
in the sweep's own thread (one, so the study sees its calls in order): the one place a
user's code and Optuna run on the scheduler, never on its event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import cloudpickle

from .. import errors
from .._shared.protocol import Told, sweep_topic
from .._shared.values import JobState, SweepSpec, TrialInfo
from ..errors import DaskDDPError, SweepParamsError
from .supervisor import Supervisor, first_line

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The user attributes a sweep sets on its trials: a named sweep's name, a trial stopped
# because its sweep stopped, and, on a trial that runs such a one again, the number whose
# checkpoint directory it resumes from and the number it runs again.
_NAME, _CUT_OFF, _RESUMES, _AGAIN = (
    "dask_ddp_sweep_name", "dask_ddp_cut_off", "dask_ddp_resumes", "dask_ddp_runs_again",
)  # fmt: skip
_CURVE_POINTS = 64  # each trial's curve as the views draw it, at most
_PUBLISH_EVERY = 0.1  # seconds: a sweep's state goes out at most this often while it runs


class SweepSupervisor:
    """One sweep, on the scheduler's loop (see the module's docstring).

    Parameters
    ----------
    plugin : DaskDDPPlugin
        The scheduler plugin: it launches the trials' jobs and holds them.
    spec : SweepSpec
        The sweep as its client sent it.
    """

    def __init__(self, plugin: Any, spec: SweepSpec) -> None:
        self.plugin, self.spec = plugin, spec
        self.sweep_id = spec.sweep_id
        self.topic = sweep_topic(spec.sweep_id)
        self.state = "running"  # then succeeded, failed or cancelled
        self.error: BaseException | None = None
        self.cancel_reason: str | None = None
        self.trials: dict[int, TrialInfo] = {}
        self.direction: str | None = None
        self.best: int | None = None  # the best trial's number so far
        self.before = 0  # trials of a sweep of this name that ended before it (_resume)
        self.resumed = 0  # trials cut off before that it runs again
        self.started = time.time()
        self.finished: float | None = None
        self._jobs: dict[str, int] = {}  # trial job id -> trial number
        self._ending: set[int] = set()  # trials whose end is being told
        # The thread's own: the study, params(), each live trial and its last step told.
        self._study: Any = None
        self._params: Callable[[Any], Any] | None = None
        self._live: dict[int, Any] = {}
        self._told_step: dict[int, int] = {}
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"dask-ddp-sweep-{spec.sweep_id}"
        )
        self._wake = asyncio.Event()
        self._launching = False
        self._first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._done = asyncio.Event()
        self._tasks: set[asyncio.Future[Any]] = set()
        self._version = 0
        self._soon: asyncio.TimerHandle | None = None
        self._task: asyncio.Future[None] | None = None

    # -- life -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def first_trial(self) -> None:
        """Wait until the first trial's job runs or waits (raises what stopped it)."""
        await asyncio.shield(self._first)

    async def until_done(self) -> None:
        await self._done.wait()

    @property
    def final(self) -> bool:
        return self._done.is_set()

    def cancel(self, reason: str) -> None:
        """Ask no more trials and cancel the running ones (they end ``FAIL``)."""
        if self.cancel_reason is None and not self.final:
            self.cancel_reason = reason
            self._stop_trials(f"the sweep was cancelled: {reason}")
            self._wake.set()

    async def _run(self) -> None:
        try:
            await self._call(self._load)
            while True:
                if self._may_ask():
                    await self._start_trial()
                    continue
                if self._over():
                    break
                self._wake.clear()
                await self._wake.wait()
        except Exception as exc:
            self.error = exc
            logger.warning("dask-ddp sweep %s: %s", self.sweep_id, first_line(exc))
            if not self._first.done():
                self._first.set_exception(exc)
            self._stop_trials(f"the sweep failed: {first_line(exc)}")
            while not all(t.final for t in self.trials.values()):
                self._wake.clear()
                await self._wake.wait()
        if not self._first.done():
            self._first.set_result(None)
        self.state = (
            "failed" if self.error is not None
            else "cancelled" if self.cancel_reason is not None
            else "succeeded"
        )  # fmt: skip
        self.finished = time.time()
        logger.info("dask-ddp sweep %s (%s): %s", self.sweep_id, self.spec.name, self.state)
        self._publish()
        self._done.set()
        self._thread.shutdown(wait=False)  # the study is read from the loop's executor now
        self.plugin.sweep_ended(self)

    def _may_ask(self) -> bool:
        """Whether to ask the study for a trial now: the sweep goes on, has trials left,
        and none of its trials waits for workers (one that waits is the pool's next)."""
        return (
            self.error is None
            and self.cancel_reason is None
            and len(self.trials) + self.before < self.spec.n_trials
            and not self._launching
            and not any(t.state == "waiting" for t in self.trials.values())
        )

    def _over(self) -> bool:
        return all(t.final for t in self.trials.values()) and (
            len(self.trials) + self.before >= self.spec.n_trials
            or self.cancel_reason is not None
            or self.error is not None
        )

    def _stop_trials(self, reason: str) -> None:
        for job_id, number in self._jobs.items():
            job = self.plugin.jobs.get(job_id)
            if job is not None and not self.trials[number].final:
                job.cancel(reason)

    async def _start_trial(self) -> None:
        self._launching = True
        try:
            number, params, kwargs, resumes = await self._call(self._ask)
            spec = self._trial_spec(number, kwargs, resumes)
            self.trials[number] = TrialInfo(number, "waiting", spec.job_id, params)
            self._jobs[spec.job_id] = number
            self._publish_soon()
            try:
                await self.plugin.launch(spec, observer=self)
            except DaskDDPError as exc:  # it cannot be placed at all: nor could any trial
                await self._call(self._tell, number, "fail", None, first_line(exc))
                self._set(number, state="fail", error=first_line(exc), ended=time.time())
                raise
        finally:
            self._launching = False
        if not self._first.done():
            self._first.set_result(None)
        if self.cancel_reason is not None or self.error is not None:
            self._stop_trials("the sweep is stopping")

    def _trial_spec(self, number: int, kwargs: dict[str, Any], resumes: int | None) -> Any:
        """Trial ``number``'s job; one that runs a cut-off trial again (``resumes``) has that
        trial's checkpoint directory, and resumes from its last checkpoint."""
        base = self.spec.trial
        directory = base.checkpoint_dir
        if directory is not None:
            directory = (
                f"{directory.rstrip('/')}/trial-{number if resumes is None else resumes:04d}"
            )
        return dataclasses.replace(
            base,
            job_id=uuid.uuid4().hex[:12],
            name=f"{self.spec.name}-{number}",
            named=False,
            checkpoint_dir=directory,
            client=None,  # the sweep follows its trials; they need no client
            detach=True,
            sweep=self.sweep_id,
            watch=self.spec.metric,
            trial_kwargs=kwargs,
        )

    # -- what its trials' jobs tell it (Observer) ----------------------------------------------
    def told(self, job: Supervisor, rank: int, told: Told) -> None:
        number = self._jobs.get(job.job_id)
        if rank != 0 or not told.watched or number is None:
            return
        record = self.trials[number]
        if record.final or record.pruned_at is not None:
            return
        curve = record.curve + [list(p) for p in told.watched]
        while len(curve) > _CURVE_POINTS:
            del curve[1:-1:2]  # thinned, the first and the last kept
        x, value = told.watched[-1]
        self._set(number, curve=curve, step=int(x), latest=float(value))
        self._spawn(self._report(job, number, [list(p) for p in told.watched]))

    def changed(self, job: Supervisor) -> None:
        number = self._jobs.get(job.job_id)
        if number is None or number not in self.trials:
            return
        record = self.trials[number]
        if record.final:
            return
        if job.closed:
            if number not in self._ending:
                self._ending.add(number)
                self._spawn(self._end_trial(job, number))
            return
        waiting = job.state is JobState.WAITING
        attempts = len({t.attempt for t in job.history if t.state is JobState.RUNNING})
        started = record.started
        if not waiting and started is None:
            started = time.time()
        if (record.state == "waiting") != waiting or attempts != record.attempts:
            self._set(
                number,
                state="waiting" if waiting else "running",
                started=started,
                attempts=attempts,
            )
            self._wake.set()

    async def _report(self, job: Supervisor, number: int, points: list[list[float]]) -> None:
        prune, step = await self._call(self._tell_points, number, points)
        record = self.trials[number]
        if prune and not job.state.final and record.pruned_at is None and not record.final:
            self._set(number, pruned_at=step)
            pruner = type(self._study.pruner).__name__
            job.cancel(f"pruned at step {step} by the study's {pruner}")

    async def _end_trial(self, job: Supervisor, number: int) -> None:
        record = self.trials[number]
        state, value, error = self._outcome(job, record)
        # Stopped because the sweep stopped (cancelled, failed, its scheduler closing): a
        # later sweep of the same name runs it again (_load).
        cut_off = (
            job.state is JobState.CANCELLED
            and record.pruned_at is None
            and (self.cancel_reason is not None or self.error is not None)
        )
        try:
            self.best = await self._call(self._tell, number, state, value, error, cut_off)
        except Exception as exc:  # the study refused it: the trial ends all the same
            state, value, error = "fail", None, f"the study could not be told: {first_line(exc)}"
            raise
        finally:
            self._set(number, state=state, value=value, error=error, ended=time.time())
            self._wake.set()

    def _outcome(self, job: Supervisor, record: TrialInfo) -> tuple[str, float | None, str | None]:
        """How a trial whose job ended is told: its Optuna state, value and error."""
        if job.state is JobState.SUCCEEDED:
            ranks = job.life.ranks
            outcome = ranks[0].outcome if ranks else None
            value = outcome.number if outcome is not None else None
            if value is None:
                value = record.latest
            if value is None:
                return (
                    "fail",
                    None,
                    (f"rank 0 reported no {self.spec.metric!r} and returned no number"),
                )
            if math.isnan(value):
                return "fail", None, f"its {self.spec.metric!r} is NaN"
            return "complete", value, None
        if record.pruned_at is not None:
            return "pruned", None, None
        error = first_line(job.error) if job.error is not None else job.state.value
        return "fail", None, error

    # -- the thread's side: Optuna --------------------------------------------------------
    def _load(self) -> None:
        self._study, self._params = cloudpickle.loads(self.spec.study)
        self.direction = self._study.direction.name.lower()
        if self.spec.named:
            self._resume()
        try:
            self.best = self._study.best_trial.number
        except ValueError:  # no complete trial yet
            self.best = None

    def _resume(self) -> None:
        """A named sweep whose study already has trials of a sweep of that name (its
        scheduler restarted, with a durable storage; or it was cancelled): those that ended
        count toward ``n_trials``, and those cut off (left running by a scheduler that went,
        or stopped by their sweep's end) run again first, from their checkpoints."""
        TrialState = _trial_state(None)
        mine = [
            t
            for t in self._study.get_trials(deepcopy=False)
            if t.user_attrs.get(_NAME) == self.spec.name
        ]
        again = {t.user_attrs.get(_AGAIN) for t in mine}
        cut = [
            t
            for t in mine
            if (t.state is TrialState.RUNNING or t.user_attrs.get(_CUT_OFF))
            and t.number not in again
        ]
        self.before = sum(t.state.is_finished() and not t.user_attrs.get(_CUT_OFF) for t in mine)
        for t in cut:
            if t.state is TrialState.RUNNING:
                self._study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
            first = t.user_attrs.get(_RESUMES, t.number)  # its checkpoints' directory
            self._study.enqueue_trial(t.params, user_attrs={_RESUMES: first, _AGAIN: t.number})
        self.resumed = len(cut)
        if mine:
            logger.info(
                "dask-ddp sweep %s (%s): %d trials of this name ended before, %d cut off run "
                "again", self.sweep_id, self.spec.name, self.before, len(cut),
            )  # fmt: skip

    def _ask(self) -> tuple[int, dict[str, Any], dict[str, Any], int | None]:
        trial = self._study.ask()
        try:
            kwargs = self._params(trial)
        except Exception as exc:
            self._study.tell(trial, state=_trial_state("FAIL"))
            raise SweepParamsError(
                self.sweep_id, trial.number, f"{type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            self._study.tell(trial, state=_trial_state("FAIL"))
            raise SweepParamsError(
                self.sweep_id, trial.number, f"it returned a {type(kwargs).__name__}"
            )
        trial.set_user_attr("dask_ddp_sweep", self.sweep_id)
        if self.spec.named:
            trial.set_user_attr(_NAME, self.spec.name)
        self._live[trial.number] = trial
        return trial.number, dict(trial.params), kwargs, trial.user_attrs.get(_RESUMES)

    def _tell_points(self, number: int, points: list[list[float]]) -> tuple[bool, int | None]:
        trial = self._live.get(number)
        if trial is None:
            return False, None
        last = self._told_step.get(number)
        for x, value in points:
            step = int(x)
            if last is not None and step <= last:
                continue  # a restart goes over the steps after its checkpoint again
            trial.report(float(value), step)
            last = step
        if last is None:
            return False, None
        self._told_step[number] = last
        return bool(trial.should_prune()), last

    def _tell(
        self, number: int, state: str, value: float | None, error: str | None,
        cut_off: bool = False,
    ) -> int | None:  # fmt: skip
        trial = self._live.pop(number, None)
        if trial is not None:
            if error is not None:
                trial.set_user_attr("dask_ddp_error", error)
            if cut_off:
                trial.set_user_attr(_CUT_OFF, True)
            if state == "complete":
                self._study.tell(trial, value)
            else:
                self._study.tell(trial, state=_trial_state(state.upper()))
        try:
            return self._study.best_trial.number
        except ValueError:
            return None

    async def frozen_trials(self) -> bytes:
        """The study's trials (Optuna's ``FrozenTrial``), pickled: in the sweep's thread
        while it runs, then in the loop's executor (nothing else touches the study)."""

        def pickled() -> bytes:
            return cloudpickle.dumps(self._study.get_trials(deepcopy=False))

        if self.final:
            return await asyncio.get_running_loop().run_in_executor(None, pickled)
        return await self._call(pickled)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, fn, *args)

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._ended_task)

    def _ended_task(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            logger.error("dask-ddp sweep %s: %s", self.sweep_id, first_line(exc), exc_info=exc)
            if self.error is None:
                self.error = exc
                self._stop_trials(f"the sweep failed: {first_line(exc)}")
            self._wake.set()

    # -- what it says ------------------------------------------------------------------------
    def _set(self, number: int, **changes: Any) -> None:
        self.trials[number] = dataclasses.replace(self.trials[number], **changes)
        self._publish_soon()

    def public_state(self) -> dict[str, Any]:
        """The sweep as its clients see it: plain values."""
        return {
            "sweep": self.sweep_id,
            "name": self.spec.name,
            "state": self.state,
            "version": self._version,
            "n_trials": self.spec.n_trials,
            "metric": self.spec.metric,
            "direction": self.direction,
            "best": self.best,
            "before": self.before,
            "resumed": self.resumed,
            "error": errors.to_wire(self.error) if self.error is not None else None,
            "cancel_reason": self.cancel_reason,
            "trials": [self.trials[n].to_wire() for n in sorted(self.trials)],
            "started": self.started,
            "finished": self.finished,
            "launched_by": self.spec.launched_by,
        }

    def _publish(self) -> None:
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        self._version += 1
        self.plugin.scheduler.log_event(self.topic, self.public_state())
        self.plugin.changes.bump()

    def _publish_soon(self) -> None:
        if self._soon is None:
            self._soon = asyncio.get_running_loop().call_later(_PUBLISH_EVERY, self._publish)


def _trial_state(name: str | None) -> Any:
    """Optuna's ``TrialState[name]`` (the enum itself for None): imported in the thread."""
    from optuna.trial import TrialState

    return TrialState if name is None else TrialState[name]

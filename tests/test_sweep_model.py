"""The sweep's supervisor as a model: a real Optuna study and the real
:class:`~dask_ddp._scheduler.sweep.SweepSupervisor`, on a real event loop and its real
thread, with the trials' jobs played by stand-ins that a random schedule places, reports
from, restarts, fails, finishes and cancels, and the sweep cancelled at a random moment.
After each event: at most one trial waits for workers, no more trials are asked than
``n_trials``, the study holds what the sweep told it and nothing twice, and a sweep that
ended did so in the state its trials call for."""

from __future__ import annotations

import asyncio
import random
import types
from typing import Any

import cloudpickle
import optuna
import pytest

from dask_ddp._scheduler.sweep import SweepSupervisor
from dask_ddp._shared.protocol import Told
from dask_ddp._shared.values import JobSpec, JobState, SweepSpec, Transition

optuna.logging.set_verbosity(optuna.logging.WARNING)

# Optuna warns when a step is reported twice (a restart's repeated steps must not be): here
# that is an error, in the sweep's thread too, and the sweep fails with it.
pytestmark = pytest.mark.filterwarnings("error")


class _Job:
    """What the sweep reads of a trial's job (a Supervisor's fields) and does to it."""

    def __init__(self, spec: Any, observer: Any) -> None:
        self.job_id, self.spec, self.observer = spec.job_id, spec, observer
        self.state = JobState.WAITING
        self.closed = False
        self.history = [Transition(JobState.WAITING, "no free workers", 0.0)]
        self.error: BaseException | None = None
        self.life = types.SimpleNamespace(ranks=[])
        self.attempt = 0
        self.cancelled: str | None = None

    def move(self, state: JobState, reason: str = "") -> None:
        self.state = state
        self.history.append(Transition(state, reason, 0.0, attempt=self.attempt))
        self.observer.changed(self)

    def end(self, state: JobState, number: float | None = None) -> None:
        if number is not None:
            outcome = types.SimpleNamespace(number=number)
            self.life = types.SimpleNamespace(ranks=[types.SimpleNamespace(outcome=outcome)])
        if state is JobState.FAILED:
            self.error = ValueError("the trial diverged")
        self.state = state
        self.closed = True
        self.history.append(Transition(state, self.cancelled or "", 0.0, attempt=self.attempt))
        self.observer.changed(self)

    def cancel(self, reason: str) -> None:
        if self.cancelled is None and not self.closed:
            self.cancelled = reason


class _Plugin:
    def __init__(self) -> None:
        self.jobs: dict[str, _Job] = {}
        self.scheduler = types.SimpleNamespace(log_event=lambda topic, msg: None)
        self.changes = types.SimpleNamespace(bump=lambda: None)
        self.ended: list[Any] = []

    async def launch(self, spec: Any, observer: Any = None) -> dict[str, Any]:
        job = self.jobs[spec.job_id] = _Job(spec, observer)
        observer.changed(job)
        return {}

    def sweep_ended(self, sweep: Any) -> None:
        self.ended.append(sweep)


def _params(trial: optuna.Trial) -> dict[str, Any]:
    return {"lr": trial.suggest_float("lr", 0.01, 1.0)}


def _check(sweep: SweepSupervisor, study_view: Any, n_trials: int) -> None:
    trials = sweep.trials.values()
    assert sum(t.state == "waiting" for t in trials) <= 1, "more than one trial waits"
    assert len(sweep.trials) <= n_trials
    told = {t.number: t.state.name for t in study_view() if t.state.is_finished()}
    for t in trials:
        if t.final:  # told once, as the sweep says
            assert told.get(t.number) == t.state.upper(), (t, told.get(t.number))


async def _play(seed: int) -> None:
    rng = random.Random(seed)
    n_trials = rng.randint(1, 8)
    study = optuna.create_study(
        pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0)
    )
    base = JobSpec("", "model", False, b"", None, workers=1, min_workers=None)
    spec = SweepSpec(
        sweep_id=f"model{seed}", name="model", named=False,
        study=cloudpickle.dumps((study, _params)), trial=base, n_trials=n_trials,
        metric="val_loss",
    )  # fmt: skip
    plugin = _Plugin()
    sweep = SweepSupervisor(plugin, spec)
    sweep.start()
    steps: dict[str, int] = {}
    cancel_at = rng.choice([None, rng.randint(0, 60)])
    for event in range(400):
        await asyncio.sleep(rng.choice([0, 0, 0.001]))
        await asyncio.sleep(0)
        _check(sweep, lambda: sweep._study.get_trials(deepcopy=False), n_trials)
        if sweep.final:
            break
        if event == cancel_at:
            sweep.cancel("the model cancels it")
        live = [j for j in plugin.jobs.values() if not j.closed]
        if not live:
            continue
        job = rng.choice(live)
        if job.cancelled is not None:  # its ranks stop
            job.end(JobState.CANCELLED)
            continue
        what = rng.random()
        if job.state is JobState.WAITING:
            if what < 0.7:
                job.move(JobState.RUNNING, "placed")
        elif what < 0.5:  # rank 0 reports a step or two
            step = steps.get(job.job_id, 0)
            told = Told(watched=[[s, rng.random()] for s in range(step, step + 2)])
            steps[job.job_id] = step + 2
            job.observer.told(job, 0, told)
            if rng.random() < 0.2:  # and a repeated one, as after a restart
                job.observer.told(job, 0, Told(watched=[[step, 0.5]]))
        elif what < 0.6:  # a lost worker: its job restarts
            job.attempt += 1
            job.move(JobState.RESTARTING, "worker lost")
            job.move(JobState.RUNNING, "placed again")
        elif what < 0.75:
            job.end(JobState.FAILED)
        elif what < 0.95:
            job.end(JobState.SUCCEEDED, rng.choice([None, rng.random()]))
    for _ in range(200):
        if sweep.final:
            break
        for job in [j for j in plugin.jobs.values() if not j.closed]:
            if job.state is JobState.WAITING:
                job.move(JobState.RUNNING, "placed")
            else:
                job.end(JobState.CANCELLED if job.cancelled else JobState.SUCCEEDED, 1.0)
        await asyncio.sleep(0.001)
    await asyncio.wait_for(sweep.until_done(), 10)
    trials = sweep._study.get_trials(deepcopy=False)
    _check(sweep, lambda: trials, n_trials)
    assert all(t.state.is_finished() for t in trials), "a trial was never told"
    assert len(trials) == len(sweep.trials)
    assert plugin.ended == [sweep]
    if sweep.cancel_reason is None:
        assert sweep.state == "succeeded" and len(sweep.trials) == n_trials
    else:
        assert sweep.state == "cancelled"


@pytest.mark.parametrize("seed", range(40))
def test_the_sweep_under_random_events(seed: int) -> None:
    asyncio.run(_play(seed))

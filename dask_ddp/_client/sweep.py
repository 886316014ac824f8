"""Sweeps: an Optuna study whose trials are dask-ddp jobs, started from the client.

:func:`sweep` checks its arguments here, builds every trial's job once (the function and
its arguments pickled as ``launch()`` pickles them), pickles the study and ``params`` for
the scheduler, and hands the sweep to dask-ddp's scheduler plugin, where
:class:`~dask_ddp._scheduler.sweep.SweepSupervisor` runs it from then on. :class:`Sweep`
is the client's view of it: its trials as the scheduler tells them on the sweep's topic,
the trials' jobs, the best trial, and a live view in Jupyter.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle
from distributed import Client

from .._shared import view as _view
from .._shared.protocol import sweep_topic
from .._shared.values import SweepSpec, TrialInfo
from ..config import TimeoutLike
from ..errors import JobCancelledError, NotPicklableError, from_wire
from . import calls, topics
from .job import attach_job
from .launch import _launched_by, job_name, job_spec

__all__ = ["Sweep", "sweep"]

_FINAL = ("succeeded", "failed", "cancelled")


def _optuna() -> Any:
    try:
        import optuna
    except ImportError as exc:
        raise ImportError(
            "dask_ddp.sweep() runs an Optuna study: install optuna (pip install "
            "'dask-ddp[sweep]'), on the client and where the scheduler runs"
        ) from exc
    return optuna


def sweep(
    client: Client,
    fn: Callable[..., Any],
    study: Any,
    params: Callable[[Any], Mapping[str, Any]],
    *,
    n_trials: int,
    metric: str,
    workers_per_trial: int = 1,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    ranks_per_worker: int | str = 1,
    backend: str | None = None,
    timeout: TimeoutLike | None = None,
    max_restarts: int = 3,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    keep_last: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    total_steps: int | None = None,
    stall_timeout: TimeoutLike | None = None,
    name: str | None = None,
) -> Sweep:
    """Run an Optuna study's trials as DDP jobs on the cluster, as many at once as it holds.

    Each trial is a job of ``fn`` on a whole set of ``workers_per_trial`` workers (each with
    ``ranks_per_worker`` ranks), with the keyword arguments ``params(trial)`` returns over
    ``kwargs``. The sweep asks the study for its next trial whenever none of its trials
    waits for workers, so the cluster's free worker sets decide how many run at once (an
    adaptive cluster grows for the waiting one). Rank 0's ``metric`` values
    (:func:`dask_ddp.report`) are the trial's intermediate values, and the study's pruner is
    asked after each: a prune stops every rank of the trial at once and its workers take
    the next. The sweep lives in the cluster: it goes on if this client leaves, and
    :func:`dask_ddp.attach` finds it again by its ``name=`` (or its id).

    Parameters
    ----------
    client : distributed.Client
        A synchronous client of the cluster.
    fn : callable
        The training function, an ordinary rank function (as for :func:`dask_ddp.launch`).
    study : optuna.Study
        The study, with its sampler, pruner, direction and storage. It runs on the
        scheduler: an in-memory study is a copy there (:meth:`Sweep.result` copies the
        trials back into this one); a durable one (``JournalStorage`` on a file the
        scheduler sees, an RDB URL) is shared.
    params : callable
        ``params(trial) -> dict``: suggests the hyperparameters (``trial.suggest_float``
        and the like) and returns ``fn``'s keyword arguments. Called once per trial, on the
        scheduler, in the sweep's own thread: no rank holds a trial object.
    n_trials : int
        How many trials to run (pruned and failed ones count).
    metric : str
        The name ``fn`` reports (``dask_ddp.report({metric: value}, step=step)``) that the
        study optimises: rank 0's value at each step is the trial's intermediate value, and
        its last one the objective, unless rank 0 returns a number, which is.
    workers_per_trial : int, optional
        Workers each trial's job takes, whole (default 1).
    args, kwargs : optional
        ``fn``'s arguments common to every trial; ``params()``'s keyword arguments win.
    ranks_per_worker, backend, timeout, total_steps, stall_timeout : optional
        As for :func:`dask_ddp.launch`, for each trial.
    max_restarts : int, optional
        Restarts of each trial's job (from its checkpoint) after a lost worker, default 3:
        a worker lost mid-trial is not a failed trial.
    checkpoint_dir : str, optional
        A prefix: each trial's job checkpoints under ``{checkpoint_dir}/trial-NNNN``.
    keep_last, storage_options : optional
        As for :func:`dask_ddp.launch`.
    name : str, optional
        The sweep's name, unique among the cluster's running sweeps (its trials' jobs are
        ``{name}-{number}``). Default: the function's name.

    Returns
    -------
    Sweep
        ``result()`` (the best ``FrozenTrial``), ``trials``, ``jobs``, ``study``,
        ``cancel()``, and a live view in Jupyter.

    Raises
    ------
    ImportError
        Optuna is not installed.
    SweepStudyError
        The scheduler could not take the study (Optuna missing there, say).
    SweepParamsError
        ``params`` failed for the first trial (the sweep stops as soon as it fails for any).
    PlacementError
        ``workers_per_trial`` is more than the cluster has (and it does not scale).

    Examples
    --------
    >>> import optuna  # doctest: +SKIP
    >>> def train(lr, epochs=5):
    ...     for epoch in range(epochs):
    ...         dask_ddp.report({"val_loss": 1.0 / (epoch + 1) + lr}, step=epoch)
    >>> study = optuna.create_study(pruner=optuna.pruners.MedianPruner())  # doctest: +SKIP
    >>> sweep = dask_ddp.sweep(client, train, study,
    ...                        lambda t: {"lr": t.suggest_float("lr", 1e-4, 1e-1, log=True)},
    ...                        n_trials=16, workers_per_trial=2,
    ...                        metric="val_loss")  # doctest: +SKIP
    >>> sweep.result().params  # doctest: +SKIP
    {'lr': 0.00012}
    """
    optuna = _optuna()
    if not isinstance(study, optuna.Study):
        raise TypeError(f"study= takes an optuna.Study; got {type(study).__name__}")
    if len(study.directions) != 1:
        raise ValueError("a sweep optimises one metric: the study has several directions")
    if not callable(params):
        raise TypeError(f"params= takes a function of the trial; got {type(params).__name__}")
    for what, value in (("n_trials", n_trials), ("workers_per_trial", workers_per_trial)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a whole number of at least 1; got {value!r}")
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"metric= takes the name the ranks report; got {metric!r}")
    trial, _ = job_spec(
        client, fn, args, kwargs, pass_local_rank=False, init_process_group=True,
        workers=workers_per_trial, backend=backend, timeout=timeout,
        ranks_per_worker=ranks_per_worker, max_restarts=max_restarts,
        checkpoint_dir=checkpoint_dir, keep_last=keep_last, storage_options=storage_options,
        total_steps=total_steps, detach=True, stall_timeout=stall_timeout,
    )  # fmt: skip
    try:
        pickled = cloudpickle.dumps((study, params))
    except Exception as exc:
        raise NotPicklableError("the study or params", f"{type(exc).__name__}: {exc}") from exc
    spec = SweepSpec(
        sweep_id=uuid.uuid4().hex[:12],
        name=name or job_name(fn, tuple(args)),
        named=name is not None,
        study=pickled,
        trial=trial,
        n_trials=n_trials,
        metric=metric,
        client=client.id,
        launched_by=_launched_by(),
    )
    handle = Sweep(client, {"sweep": spec.sweep_id, "name": spec.name}, study)
    try:
        state = calls.submit_sweep(client, spec)
    except BaseException:
        handle._stop()
        raise
    handle._take(state)
    return handle


class Sweep:
    """A sweep in the cluster, as this client follows it (:func:`dask_ddp.sweep`,
    :func:`dask_ddp.attach`).

    Its state comes from the scheduler on the sweep's topic, at each change; the trials'
    jobs are :class:`~dask_ddp.Job` handles, attached on first use.

    Examples
    --------
    >>> sweep = dask_ddp.attach(client, "lr-search")   # doctest: +SKIP
    >>> [(t.number, t.state, t.value) for t in sweep.trials]  # doctest: +SKIP
    [(0, 'complete', 0.31), (1, 'pruned', None), (2, 'running', None)]
    >>> sweep.result().params                          # doctest: +SKIP
    """

    def __init__(self, client: Client, state: dict[str, Any], study: Any = None) -> None:
        self._client = client
        self._study = study  # as given to sweep()
        self._merged_study: Any = None  # with the sweep's trials (study)
        self._state = dict(state)
        self._changed = threading.Condition()
        self._jobs: dict[int, Any] = {}
        self._views: list[Any] = []
        self._copied = False
        self._unfollow: Callable[[], None] | None = topics.follow(
            client, sweep_topic(state["sweep"]), self._receive
        )

    @classmethod
    def attached(cls, client: Client, state: dict[str, Any]) -> Sweep:
        """The sweep whose ``state`` the cluster answered an attach with."""
        handle = cls(client, state)
        handle._take(state)
        return handle

    # -- what the scheduler says -----------------------------------------------------------
    def _receive(self, event: Any) -> None:  # on the client's loop: never blocks
        msg = event[1] if isinstance(event, tuple) else event
        if isinstance(msg, dict) and msg.get("sweep") == self.sweep_id:
            self._take(msg)

    def _take(self, state: dict[str, Any]) -> None:
        with self._changed:
            if state.get("version", 0) < self._state.get("version", 0):
                return  # an older message than the one held
            self._state = dict(state)
            self._changed.notify_all()
        for shown in self._views:
            shown.update(_view.render_sweep_html(state))
        if state.get("state") in _FINAL:
            self._stop()

    def _stop(self) -> None:
        if self._unfollow is not None:
            self._unfollow()
            self._unfollow = None

    # -- what users read ------------------------------------------------------------------
    @property
    def sweep_id(self) -> str:
        return self._state["sweep"]

    @property
    def name(self) -> str:
        return self._state["name"]

    @property
    def state(self) -> str:
        """``"running"``, then ``"succeeded"`` (every trial ended), ``"failed"`` or
        ``"cancelled"``."""
        return self._state.get("state", "running")

    @property
    def trials(self) -> list[TrialInfo]:
        """Every trial asked so far, by number: state, params, value, curve."""
        return [TrialInfo.from_wire(t) for t in self._state.get("trials", ())]

    @property
    def best_trial(self) -> TrialInfo | None:
        """The best complete trial so far, as the study ranks them (None before one)."""
        best = self._state.get("best")
        return next((t for t in self.trials if t.number == best), None)

    @property
    def jobs(self) -> dict[int, Any]:
        """Each trial's :class:`~dask_ddp.Job`, by trial number (attached on first use;
        the cluster keeps the last ``ddp.dashboard.max-jobs`` jobs)."""
        for t in self.trials:
            if t.job_id is not None and t.number not in self._jobs:
                self._jobs[t.number] = attach_job(self._client, t.job_id)
        return dict(self._jobs)

    @property
    def study(self) -> Any:
        """The study with the sweep's trials: the one given to :func:`dask_ddp.sweep` when
        its storage is shared with the scheduler (a JournalStorage file, an RDB URL); for an
        in-memory one (a copy on the scheduler) or a sweep attached to, a study in memory
        with the sweep's finished trials (those so far while it runs)."""
        if self._merged_study is None or (not self._copied and self.done):
            self._merged_study = self._merged(self._study)
        return self._merged_study

    @property
    def resumed(self) -> tuple[int, int]:
        """A named sweep on a study that has an earlier sweep of its name (its scheduler
        went, or it was cancelled): (trials of it that ended, counted toward ``n_trials``;
        trials it cut off, which this one runs again first, from their checkpoints)."""
        return self._state.get("before", 0), self._state.get("resumed", 0)

    @property
    def done(self) -> bool:
        return self.state in _FINAL

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the sweep ends; whether it did within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while not self.done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the sweep's end and return the study's best trial (a ``FrozenTrial``).

        Raises
        ------
        TimeoutError
            It did not end within ``timeout`` seconds.
        SweepParamsError, SweepStudyError, PlacementError
            The sweep failed (its error).
        JobCancelledError
            It was cancelled (``sweep.study.best_trial`` is the best so far).
        """
        if not self.wait(timeout):
            raise TimeoutError(
                f"sweep {self.sweep_id} ({self.name}) did not end within {timeout} s; it goes "
                "on in the cluster (sweep.trials shows it, sweep.cancel() stops it)"
            )
        error = self._state.get("error")
        if error is not None:
            raise from_wire(error)
        if self.state == "cancelled":
            raise JobCancelledError(self.sweep_id, self._state.get("cancel_reason") or "")
        return self.study.best_trial

    def cancel(self, reason: str = "cancelled by the client") -> None:
        """Ask no more trials and cancel the running ones; returns once they stopped."""
        self._take(calls.cancel_sweep(self._client, self.sweep_id, reason))

    def _merged(self, study: Any) -> Any:
        """The study with the sweep's trials: ``study`` itself when it sees them (a durable
        storage the scheduler shares), else a new study in memory with them (an in-memory
        study given to the sweep was a copy on the scheduler; it stays as it was)."""
        optuna = _optuna()
        frozen = [
            t for t in calls.sweep_trials(self._client, self.sweep_id) if t.state.is_finished()
        ]
        if study is not None:
            mine = {t.number: t.state for t in study.get_trials(deepcopy=False)}
            if all(mine.get(t.number) == t.state for t in frozen):
                self._copied = self.done
                return study
        merged = optuna.create_study(
            study_name=self.name,
            direction=self._state.get("direction") or "minimize",
            sampler=None if study is None else study.sampler,
            pruner=None if study is None else study.pruner,
        )
        merged.add_trials(frozen)
        self._copied = self.done
        return merged

    def __repr__(self) -> str:
        trials = self.trials
        done = sum(t.final for t in trials)
        return (
            f"<dask_ddp.Sweep {self.sweep_id} ({self.name}): {self.state}, {done} of "
            f"{self._state.get('n_trials', '?')} trials done>"
        )

    def _repr_html_(self) -> str:
        return _view.render_sweep_html(self._full_state())

    def _full_state(self) -> dict[str, Any]:
        return {"n_trials": 0, "metric": "", "trials": [], "state": self.state, **self._state}

    def _ipython_display_(self) -> None:
        """The live view: a row per trial and each trial's curve, refreshed in place as the
        scheduler tells of each change."""
        from IPython.display import HTML, display

        self._views.append(_Shown(display(HTML(self._repr_html_()), display_id=True)))


class _Shown:
    """A sweep's HTML in a notebook's output, replaced in place through its handle."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def update(self, text: str) -> None:
        from IPython.display import HTML

        self._handle.update(HTML(text))

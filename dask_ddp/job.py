"""The client's handle on a job: its futures, its state, its outcome, its reports.

A :class:`Job` is what :func:`dask_ddp.launch` returns. It reads the job's state, which
the job's supervisor (:mod:`dask_ddp.supervise`) keeps up to date: the rank futures, the
records the ranks reported (:func:`dask_ddp.report`), their checkpoints and printed lines,
each rank's phase, and the outcome. The first rank to fail decides the job's error, and
the supervisor stops the other ranks at once. Before :meth:`Job.result` returns, every
rank's final marker has arrived, so every record a rank reported before its function
returned is in :attr:`Job.metrics`.

The live view (``job`` as the last line of a notebook cell, or :meth:`Job.watch` in a
terminal) runs on the client only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any, Protocol

from distributed import Client, Future

from . import checkpoint, view
from ._model import AttemptInfo, JobModel, JobState, MetricRecord, OutputLine
from .errors import JobNotFoundError

if TYPE_CHECKING:
    import pandas

__all__ = ["AttemptInfo", "Job", "JobState", "MetricRecord", "OutputLine"]

# Rank task key -> its job. Weak: a job lives as long as the user holds it or one of its
# rank futures (each future refers to its job, see _register), so that
# DaskResultsHandler.process_results(prefix, futures) finds the job behind run()'s list.
_jobs_by_key: weakref.WeakValueDictionary[str, Job] = weakref.WeakValueDictionary()
_JOB_ATTR = "_dask_ddp_job"


def _register(job: Job, futures: Sequence[Future]) -> None:
    """Make ``job`` findable from its rank futures, and keep it alive with them."""
    for fut in futures:
        _jobs_by_key[str(fut.key)] = job
        setattr(fut, _JOB_ATTR, job)


def _job_for(futures: Job | Sequence[Future]) -> Job:
    """The job behind ``futures`` (a Job, or its rank futures)."""
    if isinstance(futures, Job):
        return futures
    keys = [str(getattr(f, "key", f)) for f in futures]
    jobs = {id(j): j for j in (_jobs_by_key.get(k) for k in keys) if j is not None}
    if not keys or len(jobs) != 1 or any(k not in _jobs_by_key for k in keys):
        raise JobNotFoundError(keys)
    return next(iter(jobs.values()))


class _Supervising(Protocol):
    """What a Job asks of its supervisor (:class:`dask_ddp.supervise.Supervisor`)."""

    def cancel(self, reason: str) -> None: ...

    def join(self, timeout: float | None = None) -> bool: ...


class Job:
    """Handle on a job started by :func:`dask_ddp.launch`.

    Attributes
    ----------
    job_id : str
        Identifier; rank task keys are ``ddp_<name>_<id[:6]>_rank<rank>-<job_id>``.

    Examples
    --------
    >>> job = dask_ddp.launch(client, train, args=(cfg,))  # doctest: +SKIP
    >>> job                                                 # doctest: +SKIP
    (live view in Jupyter: per-rank progress, loss curve, errors)
    >>> job.result()                                        # doctest: +SKIP
    [0.31, 0.31]
    >>> job.metrics_frame().groupby("rank").loss.last()     # doctest: +SKIP
    """

    def __init__(
        self, client: Client, job_id: str, model: JobModel, supervisor: _Supervising
    ) -> None:
        self.client = client
        self.job_id = job_id
        self._model = model
        self._supervisor = supervisor

    @property
    def futures(self) -> list[Future]:
        """The current attempt's rank futures, in rank order. A job waiting for workers has
        none yet: this waits until it is placed (:meth:`wait_placed` takes a timeout), and is
        empty if it ended first (cancelled, :class:`~dask_ddp.ScaleTimeoutError`)."""
        self.wait_placed()
        return list(self._model.futures)

    @property
    def workers(self) -> list[str]:
        """The worker address of each rank of the current attempt, in rank order."""
        return list(self._model.workers)

    @property
    def backend(self) -> str:
        """The torch.distributed backend in use."""
        return self._model.backend

    @property
    def topic(self) -> str:
        """The Dask event topic the current attempt's ranks report on."""
        return self._model.topic

    @property
    def state(self) -> JobState:
        """The job's state (a :class:`JobState`)."""
        return self._model.state

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self._model.workers)

    def done(self) -> bool:
        """True once every rank has finished, or the job failed or was cancelled."""
        return self._model.done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job is done; False if ``timeout`` seconds passed first."""
        return self._model.done.wait(timeout)

    def result(self, timeout: float | None = None) -> list[Any]:
        """Every rank's return value, in rank order.

        When it returns, :attr:`metrics` holds every record the ranks reported.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait; ``None`` waits for the job to finish.

        Raises
        ------
        RankFailedError
            A rank raised; the rank's exception is chained as ``__cause__``.
        WorkerLostError
            A rank's worker left the cluster while it ran.
        JobCancelledError
            The job was cancelled.
        TimeoutError
            ``timeout`` passed first.
        """
        if not self._model.done.wait(timeout):
            raise TimeoutError(f"job {self.job_id} did not finish within {timeout} s")
        if self._model.error is not None:
            raise self._model.error
        return self.client.gather(self.futures)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The job's error once it is done, or None if it succeeded."""
        if not self._model.done.wait(timeout):
            raise TimeoutError(f"job {self.job_id} did not finish within {timeout} s")
        return self._model.error

    def cancel(self, reason: str = "cancelled by the user") -> None:
        """Stop every rank and release their workers; :meth:`result` then raises.

        Returns once the ranks have stopped (their workers are restarted if a rank does not
        stop within ``ddp.failure-grace``).
        """
        self._supervisor.cancel(reason)

    @property
    def checkpoints(self) -> list[checkpoint.CheckpointInfo]:
        """Every checkpoint the ranks saved (:func:`dask_ddp.save_checkpoint`), as it lands.

        Each is a :class:`~dask_ddp.checkpoint.CheckpointInfo` (url, step, nbytes, rank,
        time), in the order they were written, across restarts.
        """
        with self._model.cond:
            return list(self._model.checkpoints)

    @property
    def attempts(self) -> int:
        """How many times the job was placed: 1, plus one per restart or resize."""
        return self._model.attempt + 1

    @property
    def history(self) -> list[AttemptInfo]:
        """Each placement so far, first to last: an :class:`~dask_ddp.AttemptInfo` (ranks, why,
        seconds to its first step). An elastic job has one per size it ran at.

        >>> [(a.world_size, a.reason[:22]) for a in job.history]  # doctest: +SKIP
        [(3, 'started'), (2, 'rank 2 was lost: its w')]
        """
        with self._model.cond:
            return list(self._model.history)

    def wait_placed(self, timeout: float | None = None) -> bool:
        """Block until the ranks are submitted (:attr:`futures` is filled) or the job is
        done; False if ``timeout`` seconds passed first. A job waits for workers that other
        jobs hold."""
        model = self._model
        with model.cond:
            return model.cond.wait_for(lambda: model.futures or model.done.is_set(), timeout)

    @property
    def metrics(self) -> list[MetricRecord]:
        """Every :func:`dask_ddp.report` record received so far, in arrival order.

        Each rank's records are in the order the rank reported them. Returns a copy.

        Examples
        --------
        >>> job.result()                          # doctest: +SKIP
        >>> [r.metrics["loss"] for r in job.metrics if r.rank == 0][-3:]  # doctest: +SKIP
        [0.34, 0.33, 0.31]
        """
        with self._model.cond:
            return list(self._model.metrics)

    @property
    def output(self) -> list[OutputLine]:
        """The lines the ranks printed, as they arrived (the last 10,000; a copy).

        Each rank's ``print()`` and writes to ``sys.stdout``/``sys.stderr`` while its
        function runs reach the client line by line; they also stay in the worker's own log.
        The live view shows the latest few; ``launch(on_output=...)`` gets each one.

        Examples
        --------
        >>> job.result()                            # doctest: +SKIP
        >>> [line.text for line in job.output if line.rank == 0][-1]  # doctest: +SKIP
        'epoch 3: loss 0.31'
        """
        with self._model.cond:
            return list(self._model.output)

    def metrics_frame(self) -> pandas.DataFrame:
        """:attr:`metrics` as a pandas DataFrame: columns rank, step, time, then one per
        metric name (missing values are NaN). ``time`` is seconds since the epoch.

        Raises
        ------
        ImportError
            pandas is not installed.

        Examples
        --------
        >>> df = job.metrics_frame()              # doctest: +SKIP
        >>> df.pivot_table(index="step", columns="rank", values="loss")  # doctest: +SKIP
        """
        return _metrics_frame(self.metrics)

    def iter_metrics(self, timeout: float | None = None) -> Iterator[MetricRecord]:
        """Yield every record as it arrives, from the first one; stop when the job is done
        and its last record has been yielded.

        Parameters
        ----------
        timeout : float, optional
            Longest wait for the next record, in seconds; ``None`` waits as long as the job
            runs.

        Raises
        ------
        TimeoutError
            No record arrived within ``timeout`` while the job was still running.

        Examples
        --------
        >>> for rec in job.iter_metrics():        # doctest: +SKIP
        ...     writer.add_scalar(f"loss/rank{rec.rank}", rec.metrics["loss"], rec.step)
        """
        return self._model.iter_metrics(timeout)

    def watch(self, *, file: IO[str] | None = None) -> None:
        """Show a progress line (tqdm) until the job is done, then return.

        In a terminal it is one line with the record count, rate and each rank's step and
        latest metrics; in Jupyter ``tqdm.auto`` draws a notebook bar (displaying the job
        itself gives the full live view). Call :meth:`result` afterwards for the outcome.

        Parameters
        ----------
        file : file-like, optional
            Where to draw the line (default: standard error).

        Examples
        --------
        >>> job = dask_ddp.launch(client, train)  # doctest: +SKIP
        >>> job.watch()                           # doctest: +SKIP
        job 3f2a9c: 1200 reports [00:12, 98.1 reports/s, r0 step 599 loss 0.31 | r1 ...]
        """
        view.watch_progress(self._model, file)

    def view_state(
        self,
        until: Callable[[dict[str, Any]], bool] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """The state the live view draws, as a dict; optionally once ``until(state)`` holds.

        Keys: ``job``, ``state``, ``backend``, ``elapsed``, ``attempts``, ``records``,
        ``total``, ``metric``, ``error`` (one line), ``traceback``, ``notes``, ``waiting``,
        ``output`` and ``ranks``: per rank ``rank``, ``worker``, ``status`` (submitted,
        queued, joining, running, failed, stopped, or its future's), ``activity``,
        ``count``, ``step``, ``last``, ``rate``, ``step_rate``, ``error`` and ``curve``.

        Parameters
        ----------
        until : callable, optional
            A predicate on the state; wait until it returns true (checked at each change).
        timeout : float, optional
            Longest wait for ``until``, in seconds; ``None`` waits as long as it takes.

        Raises
        ------
        TimeoutError
            ``until`` was still false after ``timeout`` seconds.

        Examples
        --------
        >>> running = lambda s: s["ranks"][0]["status"] == "running"
        >>> job.view_state(running, timeout=60)["ranks"][0]["step"]  # doctest: +SKIP
        12
        """
        return self._model.wait_state(until, timeout)

    def _take_results(self, key: str) -> Iterator[tuple[int, str, Any]]:
        """Pop results sent with ``key`` as they arrive, until the job's channel closes."""
        return self._model.take_results(key)

    def _wait_stopped(self, timeout: float | None = None) -> bool:
        """Wait until the job's ranks are stopped and its resources released (after
        ``result()`` raised for a failure, that can take ``ddp.failure-grace`` and a worker
        restart longer); False if ``timeout`` passed first."""
        return self._supervisor.join(timeout)

    def __repr__(self) -> str:
        return (
            f"<dask_ddp.Job {self.job_id}: {self.state.value}, {self.world_size} ranks, "
            f"{self.backend}, {len(self._model.metrics)} reports>"
        )

    def _repr_html_(self) -> str:
        return view.render_html(self._model.snapshot())

    def _ipython_display_(self) -> None:
        """The live view: ipywidgets progress bars per rank, a loss curve and errors,
        refreshed by the supervisor while the job runs (a self-updating HTML display
        when ipywidgets is not installed)."""
        from IPython.display import display

        shown: view.WidgetView | view.HandleView
        try:
            shown = view.WidgetView(self.world_size)
        except ImportError:
            shown = view.HandleView()
        shown.show(display, self._model.snapshot())
        self._model.views.append(shown)
        if self._model.closed:
            shown.update(self._model.snapshot())


def _metrics_frame(records: list[MetricRecord]) -> pandas.DataFrame:
    """``records`` as a DataFrame: rank, step, time, then one column per metric name."""
    try:
        import pandas as pd
    except ImportError as exc:
        raise ImportError(
            "Job.metrics_frame() needs pandas; install it (pip install pandas) or use "
            "job.metrics, a list of records."
        ) from exc
    names: dict[str, None] = {}
    for rec in records:
        names.update(dict.fromkeys(rec.metrics))
    columns = ["rank", "step", "time", *(n for n in names if n not in {"rank", "step", "time"})]
    rows = [{**r.metrics, "rank": r.rank, "step": r.step, "time": r.time} for r in records]
    frame = pd.DataFrame.from_records(rows, columns=columns)
    return frame.astype({"rank": "int64", "step": "Int64", "time": "float64"})

"""The client's handle on a job that lives in the cluster: :class:`Job`, :func:`jobs`,
:func:`attach_job` (what :func:`dask_ddp.attach` does for a job).

A job runs on the scheduler, in dask-ddp's plugin (:mod:`dask_ddp._scheduler.supervisor`),
whether or not the client that launched it is still there. A :class:`Job` is one client's view
of it: it follows the job's event topic (:mod:`dask_ddp._client.reader`) into a
:class:`~dask_ddp._client.model.JobModel` and reads the job's state, history, records, printed
lines and checkpoints from there; its rank futures are the ones the supervisor published, bound
to this client. :func:`dask_ddp.launch` returns one; :func:`attach_job` gives one for a job another
client launched (or this one, before a kernel restart); :func:`jobs` lists the jobs the cluster
knows.

Before :meth:`Job.result` returns, every rank's final marker has arrived, so every record
a rank reported before its function returned is in :attr:`Job.metrics`. The live view
(``job`` as the last line of a notebook cell, or :meth:`Job.watch` in a terminal) runs on
the client only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any

import cloudpickle
from distributed import Client, Future

from .. import errors
from .._shared import tracebacks, view
from .._shared.protocol import StateMessage
from .._shared.values import CheckpointInfo, JobInfo, JobState, MetricRecord, OutputLine, Transition
from ..errors import JobNotFoundError, RankFailedError
from . import calls
from .model import JobModel
from .reader import EventReader

if TYPE_CHECKING:
    import pandas

__all__ = [
    "Job",
    "JobInfo",
    "JobState",
    "MetricRecord",
    "OutputLine",
    "Transition",
    "attach_job",
    "attached",
    "jobs",
]

# Rank task key -> its job. Weak: a job lives as long as the user holds it or one of its
# rank futures (each future refers to its job, see _register), so that
# DaskResultsHandler.process_results(prefix, futures) finds the job behind run()'s list.
_jobs_by_key: weakref.WeakValueDictionary[str, Job] = weakref.WeakValueDictionary()
_JOB_ATTR = "_dask_ddp_job"
_CLOSE_WAIT = 30.0  # seconds cancel() waits for the supervisor's last word to arrive
_BIND_WAIT = 10.0  # seconds Job.futures waits for the reader to bind them, then asks itself


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
    found = {id(j): j for j in (_jobs_by_key.get(k) for k in keys) if j is not None}
    if not keys or len(found) != 1 or any(k not in _jobs_by_key for k in keys):
        raise JobNotFoundError(keys)
    return next(iter(found.values()))


class Job:
    """One client's handle on a job started by :func:`dask_ddp.launch` (or found with
    :func:`dask_ddp.attach`).

    Attributes
    ----------
    job_id : str
        Identifier; rank task keys are ``ddp_<name>-rank<rank>-<job_id>[-<attempt>]``.
    name : str
        ``launch(name=)``, else the function's (or script's) name.

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
        self,
        client: Client,
        model: JobModel,
        reader: EventReader,
        sources: tracebacks.Sources | None = None,
    ) -> None:
        self.client = client
        self.job_id = model.job_id
        self._model = model
        self._reader = reader
        self._sources = sources  # where the function's code came from: tracebacks, stacks
        self._error: tuple[Any, BaseException | None] = (None, None)

    @property
    def name(self) -> str:
        """The job's name (``launch(name=)``, else its function's or script's)."""
        return self._model.name

    @property
    def futures(self) -> list[Future]:
        """The current placement's rank futures, in rank order, bound to this client.

        A job waiting for workers has none yet: this waits until it is placed
        (:meth:`wait_placed` takes a timeout), and is empty if it ended first (cancelled,
        :class:`~dask_ddp.ScaleTimeoutError`). Every future of a failed job raises the
        failing rank's error, or :class:`~dask_ddp.RankStoppedError` naming that rank.
        """
        self.wait_placed()
        model = self._model
        with model.cond:  # bound by the reader as soon as they were announced
            model.cond.wait_for(lambda: model.futures[0] == model.dataset, _BIND_WAIT)
            name, futures = model.futures
        if name is None or name != model.dataset:
            name = model.dataset
            if name is None:
                return []
            try:
                futures = list(self.client.get_dataset(name))
            except KeyError:
                raise JobNotFoundError([], job=self.job_id) from None
            model.set_futures(name, futures)
        _register(self, futures)
        return list(futures)

    @property
    def workers(self) -> list[str]:
        """The worker address of each rank of the current placement, in rank order."""
        return list(self._model.workers)

    @property
    def backend(self) -> str:
        """The torch.distributed backend in use."""
        return self._model.backend

    @property
    def topic(self) -> str:
        """The Dask event topic the job's ranks report on (every placement)."""
        return self._reader.topic

    @property
    def state(self) -> JobState:
        """The job's state (a :class:`JobState`)."""
        return self._model.state

    @property
    def world_size(self) -> int:
        """Number of ranks of the current placement."""
        return len(self._model.workers)

    def done(self) -> bool:
        """True once the job succeeded, failed or was cancelled."""
        return self._model.done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job is done; False if ``timeout`` seconds passed first."""
        return self._model.done.wait(timeout)

    def result(self, timeout: float | None = None) -> list[Any]:
        """Every rank's return value, in rank order.

        When it returns, :attr:`metrics` holds every record the ranks reported. The cluster
        keeps the values until the job is forgotten (:meth:`forget`, or the oldest finished
        jobs past ``ddp.dashboard.max-jobs``), so any client may read them meanwhile.

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
        error = self.exception(timeout)
        if error is not None:
            raise error
        try:
            return self.client.gather(self.futures)
        except Exception as lost:  # a worker left with a value: the supervisor holds it
            return self._held_values(lost)

    def _held_values(self, lost: Exception) -> list[Any]:
        """The values of a succeeded job whose gather failed (a worker left with one): those
        the job's supervisor holds, the rest gathered; ``lost`` if a value is in neither."""
        try:
            held = calls.held_values(self.client, self.job_id)
        except Exception as exc:  # forgotten, or a scheduler without the handler
            raise lost from exc
        if len(held) != len(self.futures):
            raise lost
        return [
            cloudpickle.loads(value) if value is not None else self.client.gather(future)
            for future, value in zip(self.futures, held, strict=True)
        ]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The job's error once it is done, or None if it succeeded."""
        if not self._model.done.wait(timeout):
            raise TimeoutError(f"job {self.job_id} did not finish within {timeout} s")
        wire = self._model.error
        if wire is None:
            return None
        if self._error[0] is not wire:
            self._error = (wire, self._rebuild(wire))
        return self._error[1]

    def _rebuild(self, wire: dict[str, Any]) -> BaseException:
        """The job's error as the supervisor described it; a rank's error comes with the
        rank's own exception (unpickled here, from its future) and traceback."""
        error = errors.from_wire(wire)
        if not isinstance(error, RankFailedError):
            return error
        try:
            own = self.futures[error.rank].exception(timeout=10)
        except Exception:  # forgotten, or its class is not importable here: the text stays
            own = None
        if own is None or isinstance(own, errors.RankStoppedError):
            return error
        own = tracebacks.rebuild(own, self._sources)
        rebuilt = RankFailedError(
            error.rank, error.worker, error.key, error.cause, tracebacks.user_traceback(own)
        )
        rebuilt.__cause__ = own
        return rebuilt

    def cancel(self, reason: str = "cancelled by the user") -> None:
        """Stop every rank and release their workers; :meth:`result` then raises.

        Returns once the ranks have stopped: each rank's processes get SIGTERM, then SIGKILL
        after ``ddp.failure-grace``; the workers keep running, with their data.
        """
        calls.cancel_job(self.client, self.job_id, reason)
        with self._model.cond:  # the supervisor's last message, on its way here
            self._model.cond.wait_for(lambda: self._model.closed, _CLOSE_WAIT)

    def stacks(self) -> dict[int, str]:
        """Every running rank's current Python stacks, all threads, with file and line:
        where a job that seems hung is.

        Each rank's process dumps them itself (:mod:`faulthandler`, on a signal), so this
        works while a rank is blocked in C++ (a collective waiting for a peer, a store).

        Returns
        -------
        dict
            Rank -> its stacks as faulthandler writes them (``Thread 0x... (most recent
            call first):`` then ``File "train.py", line 42 in train``...), for the ranks
            running now; empty once the job ended. A frame of code sent by value (a
            notebook cell's or ``__main__``'s function) is under its cell or file, as
            in a traceback (``Cell In[3], line 4 in train``), with its source line.

        Examples
        --------
        >>> for rank, text in job.stacks().items():  # doctest: +SKIP
        ...     print("rank", rank, text)
        """
        from .._shared.protocol import Entry, call

        if self.done():
            return {}
        answers = self.client.run(
            call, Entry.RANK_STACKS, self.job_id, workers=sorted(set(self.workers)),
            on_error="return",
        )  # fmt: skip
        found = [item for a in answers.values() if isinstance(a, list) for item in a]
        place = self._sources.restack if self._sources is not None else str
        return {rank: place(text) for rank, text in sorted(found)}

    def forget(self) -> None:
        """Let the cluster forget this finished job: its record, its ranks' return values
        (:meth:`result` no longer works, here or in any client) and its events.

        Raises
        ------
        JobStillRunningError
            The job has not ended: cancel it, or wait for it, first.
        """
        calls.forget_job(self.client, self.job_id)

    @property
    def checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint the ranks saved (:func:`dask_ddp.save_checkpoint`), as it lands.

        Each is a :class:`~dask_ddp._rank.checkpoint.CheckpointInfo` (url, step, nbytes, rank,
        time), in the order they were written, across restarts.
        """
        with self._model.cond:
            return list(self._model.checkpoints)

    @property
    def attempts(self) -> int:
        """How many times the job was placed: 1, plus one per restart or resize."""
        return self._model.attempt + 1

    @property
    def history(self) -> list[Transition]:
        """Every change of the job's state so far, first to last: a
        :class:`~dask_ddp.Transition` each (the state entered, why, when, the placement's
        size; a ``running`` entry also says how long until its first reported step).

        >>> [(t.state.value, t.world_size) for t in job.history]  # doctest: +SKIP
        [('running', 3), ('resizing', 3), ('running', 2), ('succeeded', 2)]
        """
        with self._model.cond:
            return list(self._model.history)

    def wait_placed(self, timeout: float | None = None) -> bool:
        """Block until the ranks are submitted (:attr:`futures` can be read) or the job is
        done; False if ``timeout`` seconds passed first. A job waits for workers that
        other jobs hold."""
        model = self._model
        with model.cond:
            return model.cond.wait_for(lambda: model.dataset or model.done.is_set(), timeout)

    @property
    def metrics(self) -> list[MetricRecord]:
        """Every :func:`dask_ddp.report` record received so far, in arrival order.

        Each rank's records are in the order the rank reported them. A client that
        attached to a running job has the records the cluster still held (its last 1000
        events), then every new one. Returns a copy.

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

        Keys: ``job``, ``name``, ``state``, ``backend``, ``elapsed``, ``attempts``,
        ``records``, ``total``, ``metric``, ``error`` (one line), ``traceback``, ``notes``,
        ``waiting``, ``output`` and ``ranks``: per rank ``rank``, ``worker``, ``status``
        (submitted, queued, joining, running, finished, failed, stopped, lost),
        ``activity``, ``count``, ``step``, ``last``, ``rate``, ``step_rate``, ``error`` and
        ``curve``.

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

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Wait until the job's ranks have stopped and its workers are free again (after a
        failure that can take ``ddp.failure-grace`` and a worker restart longer than the
        outcome); False if ``timeout`` passed first."""
        with self._model.cond:
            return self._model.cond.wait_for(lambda: self._model.closed, timeout)

    def iter_results(self, key: str) -> Iterator[tuple[int, str, Any]]:
        """``(rank, path, data)`` of each result the ranks sent with
        :meth:`DaskResultsHandler.submit_result <dask_ddp.results.DaskResultsHandler.submit_result>`
        under ``key`` (the handler's ``pub_sub_key``), each handed out once, as they arrive,
        until the job has stopped. :meth:`~dask_ddp.results.DaskResultsHandler.process_results`
        writes them to files.

        Examples
        --------
        >>> for rank, path, data in job.iter_results(handler.pub_sub_key):  # doctest: +SKIP
        ...     print(rank, path, len(data))
        """
        return self._model.take_results(key)

    def __repr__(self) -> str:
        return (
            f"<dask_ddp.Job {self.job_id} ({self.name}): {self.state.value}, "
            f"{self.world_size} ranks, {self.backend}, {len(self._model.metrics)} reports>"
        )

    def _repr_html_(self) -> str:
        return view.render_html(self._model.snapshot())

    def _ipython_display_(self) -> None:
        """The live view: ipywidgets progress bars per rank, a loss curve and errors,
        refreshed while the job runs (a self-updating HTML display without ipywidgets)."""
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


def jobs(client: Client) -> list[JobInfo]:
    """The jobs the cluster knows: running, waiting, and the last finished ones, newest
    first, whoever launched them.

    Examples
    --------
    >>> [(j.job_id, j.name, j.state.value) for j in dask_ddp.jobs(client)]  # doctest: +SKIP
    [('3f2a9c1b2d4e', 'nightly', 'running')]
    """
    return [
        JobInfo(
            job_id=row["job"],
            name=row["name"],
            state=JobState(row["state"]),
            launched_by=row["launched_by"],
            started=row["started"],
            world_size=row["ranks"],
            step=row["step"],
            attempts=row["attempts"],
            followers=row["followers"],
            detached=row["detached"],
            error=row["error"],
            sweep=row.get("sweep"),
        )
        for row in calls.list_jobs(client)
    ]


def attach_job(client: Client, job: str) -> Job:
    """Follow the job ``job`` (an id or a name), as :func:`dask_ddp.attach` does for a job."""
    return attached(client, calls.attach(client, job)["state"])


def attached(client: Client, state: dict[str, Any]) -> Job:
    """A :class:`Job` for the job whose ``state`` the cluster answered an attach with (it
    sends this client the job's events from then on)."""
    model = JobModel(state["job"], state["name"])
    reader = EventReader(client, model)
    reader.follow()  # what came meanwhile is in the scheduler's history, read first
    model.apply_state(state)
    model.seed(state["summary"], state["checkpoints"])
    told = StateMessage.from_wire(state)
    if told.state.final:
        model.finish()
    if told.stopped:
        model.close()
    reader.start(resumed=(told.run_id,) if told.run_id else ())
    reader.caught_up.wait(_CLOSE_WAIT)  # Job.metrics has the records the cluster held
    return Job(client, model, reader, state.get("sources"))


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

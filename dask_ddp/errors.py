"""The exceptions dask_ddp raises.

Every class derives from :class:`DaskDDPError` and, where one fits, from the built-in
exception with the same meaning (``TimeoutError``, ``ValueError``, ...), so existing
``except`` clauses keep working. Each keeps its fields as attributes, passes them to
``super().__init__`` so that it pickles back from a worker, and builds its message in
``__str__``: what happened, where (rank, worker, task key) and what to do.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BackendUnavailableError",
    "ChannelError",
    "CheckpointShardsError",
    "CheckpointUploadError",
    "DaskDDPError",
    "InfrastructureError",
    "JobCancelledError",
    "JobNameTakenError",
    "JobNotFoundError",
    "JobStillRunningError",
    "NoWorkersError",
    "NotInRankError",
    "NotPicklableError",
    "PlacementError",
    "RankFailedError",
    "RankStoppedError",
    "RendezvousTimeoutError",
    "ScaleTimeoutError",
    "SchedulerPluginError",
    "TooManyResizesError",
    "UnsafeResultPathError",
    "WorkerBusyError",
    "WorkerLostError",
]


class DaskDDPError(Exception):
    """Base class of every error dask_ddp raises.

    Examples
    --------
    >>> try:                                   # doctest: +SKIP
    ...     dask_ddp.launch(client, train).result()
    ... except dask_ddp.DaskDDPError as err:   # any of dask_ddp's own errors
    ...     print(err)
    """


class InfrastructureError(DaskDDPError):
    """What runs the job failed it, not the job's code: a worker left, ranks or the job
    timed out waiting for each other or for workers, the scheduler or the storage could not
    be reached. One class for that decision: catch it to retry on a healthier cluster (the
    subclasses say which part failed, with their fields; built-in bases such as
    ``TimeoutError`` and ``OSError`` stay where they fit).

    Examples
    --------
    >>> issubclass(WorkerLostError, InfrastructureError)
    True
    >>> try:                                             # doctest: +SKIP
    ...     job.result()
    ... except dask_ddp.InfrastructureError:
    ...     job = dask_ddp.launch(client, train, checkpoint_dir=...)  # again, from checkpoints
    """


class NoWorkersError(InfrastructureError, RuntimeError):
    """The cluster has no workers to place ranks on.

    Examples
    --------
    >>> print(NoWorkersError("tcp://127.0.0.1:8786"))  # doctest: +ELLIPSIS
    the Dask cluster at tcp://127.0.0.1:8786 has no workers, so no rank can start. ...
    """

    def __init__(self, scheduler: str) -> None:
        super().__init__(scheduler)
        self.scheduler = scheduler

    def __str__(self) -> str:
        return (
            f"the Dask cluster at {self.scheduler} has no workers, so no rank can start. "
            "Start workers (cluster.scale(2)) or wait for them with "
            "client.wait_for_workers(2) before launching."
        )


class PlacementError(DaskDDPError, ValueError):
    """The ``workers=`` argument cannot be satisfied by this cluster.

    Examples
    --------
    >>> dask_ddp.launch(client, train, workers=64)  # doctest: +SKIP
    PlacementError: workers=64 but the cluster has 2 workers ...
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class NotPicklableError(DaskDDPError, TypeError):
    """The function or its arguments cannot be sent to the workers.

    Examples
    --------
    >>> print(NotPicklableError("fn", "cannot pickle '_thread.lock' object"))
    ... # doctest: +ELLIPSIS
    fn cannot be pickled to send it to the workers: cannot pickle '_thread.lock' object. ...
    """

    def __init__(self, what: str, cause: str) -> None:
        super().__init__(what, cause)
        self.what, self.cause = what, cause

    def __str__(self) -> str:
        return (
            f"{self.what} cannot be pickled to send it to the workers: {self.cause}. "
            "Define the function at module level or in a notebook cell, and pass plain data "
            "(no open files, locks, clients or CUDA tensors) as its arguments."
        )


class BackendUnavailableError(DaskDDPError, ValueError):
    """The requested torch.distributed backend cannot run on the chosen workers.

    Examples
    --------
    >>> dask_ddp.launch(client, train, backend="nccl")  # doctest: +SKIP
    BackendUnavailableError: backend='nccl' cannot run on worker tcp://...: it has no GPU. ...
    """

    def __init__(self, backend: str, worker: str, reason: str, fix: str) -> None:
        super().__init__(backend, worker, reason, fix)
        self.backend, self.worker, self.reason, self.fix = backend, worker, reason, fix

    def __str__(self) -> str:
        return (
            f"backend={self.backend!r} cannot run on worker {self.worker}: {self.reason}. "
            f"{self.fix}"
        )


class WorkerBusyError(InfrastructureError, RuntimeError):
    """A worker process stayed busy with another job's rank for the whole rendezvous timeout.

    Examples
    --------
    >>> print(WorkerBusyError("tcp://10.0.0.7:40311", "dask-ddp-3f2a-rank-0"))
    ... # doctest: +ELLIPSIS
    worker tcp://10.0.0.7:40311 is still running another dask_ddp rank (dask-ddp-3f2a-rank-0); ...
    """

    def __init__(self, worker: str, other_key: str) -> None:
        super().__init__(worker, other_key)
        self.worker, self.other_key = worker, other_key

    def __str__(self) -> str:
        return (
            f"worker {self.worker} is still running another dask_ddp rank ({self.other_key}); "
            "one worker process runs one rank at a time. Wait for that job (job.result()) "
            "before launching, or launch on other workers with workers=[...]."
        )


class RendezvousTimeoutError(InfrastructureError, TimeoutError):
    """Not every rank joined the process group in time.

    Examples
    --------
    >>> err = RendezvousTimeoutError(1, "tcp://10.0.0.7:40311", "k", 60, "only 1 of 2 ranks joined")
    >>> err.rank, isinstance(err, TimeoutError)
    (1, True)
    """

    def __init__(self, rank: int, worker: str, key: str, timeout: float, cause: str) -> None:
        super().__init__(rank, worker, key, timeout, cause)
        self.rank, self.worker, self.key = rank, worker, key
        self.timeout, self.cause = timeout, cause

    def __str__(self) -> str:
        return (
            f"rank {self.rank} on {self.worker} (task {self.key}) waited {self.timeout:g} s for "
            f"the other ranks to join the process group: {self.cause}. A rank that did not "
            "start is usually queued behind other tasks on its worker; free those workers, or "
            "raise the limit with dask.config.set({'ddp.rendezvous-timeout': '5 minutes'})."
        )


class RankFailedError(DaskDDPError):
    """A rank raised; the job was stopped. Raised on the client.

    The rank's own exception is chained as ``__cause__`` and its traceback, as the rank saw
    it, is in ``rank_traceback``.

    Examples
    --------
    >>> try:                                       # doctest: +SKIP
    ...     job.result()
    ... except dask_ddp.RankFailedError as err:
    ...     print(err.rank, err.worker)            # where it happened
    ...     print(err.rank_traceback)              # the rank's own traceback
    ...     original = err.__cause__               # e.g. the ValueError it raised
    """

    def __init__(
        self, rank: int, worker: str, key: str, cause: str, rank_traceback: str = ""
    ) -> None:
        super().__init__(rank, worker, key, cause, rank_traceback)
        self.rank, self.worker, self.key = rank, worker, key
        self.cause, self.rank_traceback = cause, rank_traceback

    @property
    def summary(self) -> str:
        """The error in one line, without the traceback."""
        return (
            f"rank {self.rank} failed on {self.worker} (task {self.key}): {self.cause}. "
            "The other ranks were stopped"
        )

    def __str__(self) -> str:
        text = f"{self.summary}; fix the error in the rank's traceback"
        cause = self.__cause__
        if cause is not None and cause.__traceback__ is not None:
            return text + " (printed above, as the cause)"  # shown once
        if self.rank_traceback:
            text += f":\n\n{self.rank_traceback.rstrip()}"
        return text


class WorkerLostError(InfrastructureError):
    """A rank's worker left the cluster while the rank ran (or, ``finished=True``, after it
    finished, taking the rank's return value along). Raised on the client.

    With ``max_restarts=N`` a fixed-size job restarts instead (from the last checkpoint),
    and an elastic job shrinks.

    Examples
    --------
    >>> print(WorkerLostError(1, "tcp://10.0.0.7:40311", "ddp_train-rank1-3f2a"))
    ... # doctest: +ELLIPSIS
    rank 1 was lost: its worker tcp://10.0.0.7:40311 left the cluster while it ran task ...
    """

    def __init__(self, rank: int, worker: str, key: str, finished: bool = False) -> None:
        super().__init__(rank, worker, key, finished)
        self.rank, self.worker, self.key, self.finished = rank, worker, key, finished

    def __str__(self) -> str:
        if self.finished:
            return (
                f"rank {self.rank}'s return value was lost: its worker {self.worker} left the "
                f"cluster after task {self.key} finished. The job succeeded; its values live "
                "on the ranks' workers until the job is forgotten."
            )
        return (
            f"rank {self.rank} was lost: its worker {self.worker} left the cluster while it ran "
            f"task {self.key} (killed, out of memory, or removed). The other ranks were stopped."
        )


class RankStoppedError(DaskDDPError):
    """Raised inside a rank that was stopped before it finished: another rank failed first
    (``failed_rank``), or the client stopped the job (cancelled, or stopping it after a
    failure). Its futures raise it; ``job.result()`` raises the first failure instead.

    Parameters
    ----------
    rank : int
        The rank that stopped.
    reason : str
        Why: the failed rank's error (``"ValueError: bad batch"``) or the client's reason.
    job : str, optional
        The job's id, when the client stopped it.
    failed_rank : int, optional
        The rank that failed first; -1 for a peer whose process died without an error of
        its own (its connection closed).

    Examples
    --------
    >>> print(RankStoppedError(0, "ValueError: bad batch", failed_rank=1))
    ... # doctest: +ELLIPSIS
    rank 0 stopped because rank 1 failed first (ValueError: bad batch); ...
    >>> print(RankStoppedError(1, "cancelled by the user", job="3f2a"))
    rank 1 of job 3f2a was stopped: cancelled by the user
    """

    def __init__(
        self, rank: int, reason: str, job: str | None = None, failed_rank: int | None = None
    ) -> None:
        super().__init__(rank, reason, job, failed_rank)
        self.rank, self.reason, self.job, self.failed_rank = rank, reason, job, failed_rank

    @property
    def cause(self) -> str:
        """The failed rank's error (``reason``, under the name ``RankFailedError`` uses)."""
        return self.reason

    def __str__(self) -> str:
        if self.failed_rank is None:
            return f"rank {self.rank} of job {self.job} was stopped: {self.reason}"
        if self.failed_rank < 0:
            return (
                f"rank {self.rank} stopped because a peer's connection closed without an "
                f"error of its own ({self.reason}): a peer's worker process died or was "
                "killed (out of memory, preemption)"
            )
        return (
            f"rank {self.rank} stopped because rank {self.failed_rank} failed first "
            f"({self.reason}); see rank {self.failed_rank}'s error for the cause"
        )


class ScaleTimeoutError(InfrastructureError, TimeoutError):
    """A job waited longer than ``ddp.scale-timeout`` for the workers it needs.

    Examples
    --------
    >>> print(ScaleTimeoutError("3f2a", 2, 1, 300.0))  # doctest: +ELLIPSIS
    job 3f2a needs at least 2 workers, but the cluster had only 1 for 300 s. ...
    """

    def __init__(self, job: str, needed: int, had: int, waited: float) -> None:
        super().__init__(job, needed, had, waited)
        self.job, self.needed, self.had, self.waited = job, needed, had, waited

    def __reduce__(self) -> tuple[type, tuple[str, int, int, float]]:
        # OSError (TimeoutError's base) would keep only two of the four arguments.
        return type(self), (self.job, self.needed, self.had, self.waited)

    def __str__(self) -> str:
        return (
            f"job {self.job} needs at least {self.needed} workers, but the cluster had only "
            f"{self.had} for {self.waited:.0f} s. Scale the cluster (cluster.scale("
            f"{self.needed}) or cluster.adapt(minimum={self.needed})), launch with a smaller "
            "min_workers=, or raise ddp.scale-timeout."
        )


class RetryableError(DaskDDPError):
    """Raise it (or a subclass) in a rank to ask for a restart from the last checkpoint.

    With ``launch(..., max_restarts=N)``, a job whose rank raises it is placed again and
    the training function runs again, ``get_context().attempt`` incremented. Lost workers
    are always retried that way.

    Examples
    --------
    >>> def train():                                         # doctest: +SKIP
    ...     try:
    ...         batch = fetch_from_feature_store()
    ...     except ConnectionError as err:
    ...         raise dask_ddp.RetryableError("feature store unreachable") from err
    >>> dask_ddp.launch(client, train, max_restarts=2)      # doctest: +SKIP
    """


class CheckpointDirMissingError(DaskDDPError, RuntimeError):
    """``save_checkpoint()`` was called in a job launched without ``checkpoint_dir``.

    Examples
    --------
    >>> print(CheckpointDirMissingError(0))  # doctest: +ELLIPSIS
    save_checkpoint() on rank 0: this job has no checkpoint directory. ...
    """

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.rank = rank

    def __str__(self) -> str:
        return (
            f"save_checkpoint() on rank {self.rank}: this job has no checkpoint directory. "
            "Launch it with dask_ddp.launch(client, fn, checkpoint_dir='s3://bucket/run1') "
            "(any fsspec URL, or a local path the workers share)."
        )


class CheckpointUploadError(InfrastructureError, OSError):
    """An asynchronous checkpoint could not be written; raised on the rank that saved it,
    at its next ``save_checkpoint()`` or when its function ends.

    Examples
    --------
    >>> err = CheckpointUploadError(0, 20, "s3://b/run1/checkpoint-000000000020.pt",
    ...                             "PermissionError: Access Denied", 10)
    >>> print(err)  # doctest: +ELLIPSIS
    rank 0 could not write the checkpoint of step 20 to s3://b/run1/checkpoint-...pt: ...
    """

    def __init__(
        self, rank: int, step: int, url: str, cause: str, previous: int | None = None
    ) -> None:
        super().__init__(rank, step, url, cause, previous)
        self.rank, self.step, self.url, self.cause = rank, step, url, cause
        self.previous = previous

    def __reduce__(self) -> tuple[Any, ...]:  # OSError keeps only two of its args
        return type(self), (self.rank, self.step, self.url, self.cause, self.previous)

    def __str__(self) -> str:
        kept = (
            f"the checkpoint of step {self.previous} stays the latest"
            if self.previous is not None
            else "no checkpoint of this job is durable yet"
        )
        return (
            f"rank {self.rank} could not write the checkpoint of step {self.step} to "
            f"{self.url}: {self.cause}. Nothing of it is visible there, and {kept}. Check "
            "that the workers may write there (credentials, bucket policy, free space); "
            "launch with checkpoint_mode='sync' to see such errors at the call."
        )


class CheckpointShardsError(DaskDDPError, ValueError):
    """Per-rank state was saved by a different number of ranks than load it.

    Examples
    --------
    >>> print(CheckpointShardsError("s3://b/run1", 40, 4, 2))  # doctest: +ELLIPSIS
    the newest per-rank checkpoint under s3://b/run1 (step 40) was written by 4 ranks, ...
    """

    def __init__(self, directory: str, step: int, saved: int, loading: int) -> None:
        super().__init__(directory, step, saved, loading)
        self.directory, self.step, self.saved, self.loading = directory, step, saved, loading

    def __str__(self) -> str:
        return (
            f"the newest per-rank checkpoint under {self.directory} (step {self.step}) was "
            f"written by {self.saved} ranks, and this job runs {self.loading}: each rank "
            "only has its own part. Load a part by number with get_checkpoint(per_rank=True, "
            "rank=r) and reshard it yourself, or launch with the same number of workers."
        )


class JobCancelledError(DaskDDPError):
    """``Job.result()`` was called on a job that was cancelled.

    Examples
    --------
    >>> print(JobCancelledError("3f2a"))
    job 3f2a was cancelled (cancelled by the user); launch it again to get a result
    """

    def __init__(self, job: str, reason: str = "cancelled by the user") -> None:
        super().__init__(job, reason)
        self.job, self.reason = job, reason

    def __str__(self) -> str:
        return f"job {self.job} was cancelled ({self.reason}); launch it again to get a result"


class TooManyResizesError(InfrastructureError, RuntimeError):
    """An elastic job resized more often than ``ddp.max-resizes`` allows in an hour.

    Examples
    --------
    >>> print(TooManyResizesError("3f2a", 20, 20, "shrink: rank 1 was lost"))
    ... # doctest: +ELLIPSIS
    job 3f2a resized 20 times in the last hour, the most ddp.max-resizes allows (20); ...
    """

    def __init__(self, job: str, resizes: int, limit: int, last: str) -> None:
        super().__init__(job, resizes, limit, last)
        self.job, self.resizes, self.limit, self.last = job, resizes, limit, last

    def __str__(self) -> str:
        return (
            f"job {self.job} resized {self.resizes} times in the last hour, the most "
            f"ddp.max-resizes allows ({self.limit}); the last one: {self.last}. The cluster "
            "keeps losing workers: find why they leave (memory, preemption), or raise "
            "ddp.max-resizes."
        )


class JobNameTakenError(DaskDDPError, ValueError):
    """``launch(name=)`` names a job like one the cluster runs now.

    Examples
    --------
    >>> print(JobNameTakenError("nightly", "3f2a"))  # doctest: +ELLIPSIS
    a job named 'nightly' runs on this cluster already (job 3f2a). ...
    """

    def __init__(self, name: str, job: str) -> None:
        super().__init__(name, job)
        self.name, self.job = name, job

    def __str__(self) -> str:
        return (
            f"a job named {self.name!r} runs on this cluster already (job {self.job}). Pick "
            f"another name, follow that job with dask_ddp.attach(client, {self.name!r}), or "
            "cancel it first."
        )


class NotInRankError(DaskDDPError, RuntimeError):
    """A rank-only function was called outside a dask_ddp rank.

    Examples
    --------
    >>> import dask_ddp
    >>> dask_ddp.get_context()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    dask_ddp.errors.NotInRankError: get_context() works only inside a function started by ...
    """

    def __init__(self, function: str) -> None:
        super().__init__(function)
        self.function = function

    def __str__(self) -> str:
        return (
            f"{self.function}() works only inside a function started by dask_ddp.launch() or "
            "dask_ddp.dispatch.run(); here no rank is running. Call it from the training function."
        )


class ChannelError(InfrastructureError, RuntimeError):
    """A rank could not send its messages (``report()``, ``submit_result()``) to the client.

    Examples
    --------
    >>> print(ChannelError(0, "3f2a", "the worker's connection closed"))
    rank 0 of job 3f2a could not send to the client: the worker's connection closed
    """

    def __init__(self, rank: int, job: str, cause: str) -> None:
        super().__init__(rank, job, cause)
        self.rank, self.job, self.cause = rank, job, cause

    def __str__(self) -> str:
        return f"rank {self.rank} of job {self.job} could not send to the client: {self.cause}"


class UnsafeResultPathError(DaskDDPError, ValueError):
    """A result path would land outside the directory results are written to.

    Examples
    --------
    >>> print(UnsafeResultPathError("../x.json", "out", "it climbs out with '..'"))
    ... # doctest: +ELLIPSIS
    refusing result path '../x.json': it climbs out with '..', so it would not land under 'out'. ...
    """

    def __init__(self, path: str, prefix: str | None, reason: str) -> None:
        super().__init__(path, prefix, reason)
        self.path, self.prefix, self.reason = path, prefix, reason

    def __str__(self) -> str:
        where = f"under {self.prefix!r}" if self.prefix is not None else "under the prefix"
        return (
            f"refusing result path {self.path!r}: {self.reason}, so it would not land {where}. "
            "Pass a relative path without '..', such as 'worker/0/step-10.json'."
        )


class JobStillRunningError(DaskDDPError, RuntimeError):
    """``Job.forget()`` on a job that has not ended.

    Examples
    --------
    >>> print(JobStillRunningError("3f2a", "running"))
    job 3f2a is still running: cancel() it, or wait for it to end, then forget() it
    """

    def __init__(self, job: str, state: str) -> None:
        super().__init__(job, state)
        self.job, self.state = job, state

    def __str__(self) -> str:
        return (
            f"job {self.job} is still {self.state}: cancel() it, or wait for it to end, "
            "then forget() it"
        )


class JobNotFoundError(DaskDDPError, LookupError):
    """No dask_ddp job is what was asked for: the futures given belong to none, or the
    cluster knows no job of that id or name.

    Examples
    --------
    >>> print(JobNotFoundError(["k1"]))  # doctest: +ELLIPSIS
    no dask_ddp job started from this client owns the futures [k1]. ...
    >>> print(JobNotFoundError([], job="nightly"))  # doctest: +ELLIPSIS
    the cluster knows no dask_ddp job 'nightly': ...
    """

    def __init__(self, keys: list[str], job: str | None = None) -> None:
        super().__init__(keys, job)
        self.keys, self.job = keys, job

    def __str__(self) -> str:
        if self.job is not None:
            return (
                f"the cluster knows no dask_ddp job {self.job!r}: it never ran here, or it was "
                "forgotten (Job.forget(), or older than the last ddp.dashboard.max-jobs jobs). "
                "dask_ddp.jobs(client) lists the jobs it knows."
            )
        shown = ", ".join(map(str, self.keys[:3])) + (", ..." if len(self.keys) > 3 else "")
        return (
            f"no dask_ddp job started from this client owns the futures [{shown}]. Pass the "
            "list that dask_ddp.dispatch.run() returned, or job.futures, or the Job itself, "
            "and keep it referenced while results are processed."
        )


class SchedulerPluginError(InfrastructureError, RuntimeError):
    """The cluster's scheduler did not take dask-ddp's plugin, which runs every job there.

    Examples
    --------
    >>> print(SchedulerPluginError("tcp://10.0.0.2:8786", ModuleNotFoundError("dask_ddp")))
    ... # doctest: +ELLIPSIS
    the scheduler at tcp://10.0.0.2:8786 did not take dask-ddp's plugin ...
    """

    def __init__(self, scheduler: str, cause: str) -> None:
        super().__init__(scheduler, cause)
        self.scheduler, self.cause = scheduler, cause

    def __str__(self) -> str:
        return (
            f"the scheduler at {self.scheduler} did not take dask-ddp's plugin ({self.cause}). "
            "dask-ddp runs each job's supervisor on the scheduler: install dask-ddp (and "
            "torch) where the scheduler runs, and start it with `dask scheduler --preload "
            "dask_ddp` where plugins cannot be registered at run time."
        )


def to_wire(error: BaseException) -> dict[str, Any]:
    """``error`` as plain values, as the scheduler sends a job's error to its clients.

    >>> from_wire(to_wire(JobCancelledError("3f2a", "no client"))).reason
    'no client'
    """
    text = str(error)
    args = error.__reduce__()[1]  # what rebuilds it (OSError's args keep only two)
    return {
        "type": type(error).__name__,
        "args": [a if isinstance(a, (str, int, float, type(None))) else str(a) for a in args],
        "text": text,
        "summary": getattr(error, "summary", None) or text.split("\n", 1)[0],
        "traceback": getattr(error, "rank_traceback", None) or None,
    }


def from_wire(data: dict[str, Any]) -> DaskDDPError:
    """The error :func:`to_wire` described: the same dask_ddp class, else a
    :class:`DaskDDPError` with its text."""
    cls = globals().get(data.get("type", ""))
    if isinstance(cls, type) and issubclass(cls, DaskDDPError):
        try:
            return cls(*data.get("args", ()))
        except TypeError:
            pass
    return DaskDDPError(data.get("text", "the job failed"))

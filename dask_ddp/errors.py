"""The exceptions dask_ddp raises.

Every class derives from :class:`DaskDDPError` and, where one fits, from the built-in
exception with the same meaning (``TimeoutError``, ``ValueError``, ...), so existing
``except`` clauses keep working. Each keeps its fields as attributes, passes them to
``super().__init__`` so that it pickles back from a worker, and builds its message in
``__str__``: what happened, where (rank, worker, task key) and what to do.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "ChannelError",
    "DashboardUnavailableWarning",
    "DaskDDPError",
    "JobCancelledError",
    "JobNotFoundError",
    "NoWorkersError",
    "NotInRankError",
    "NotPicklableError",
    "PeerFailedError",
    "PlacementError",
    "RankAbortedError",
    "RankFailedError",
    "RankStoppedError",
    "RendezvousTimeoutError",
    "ResizeStopError",
    "ScaleTimeoutError",
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


class NoWorkersError(DaskDDPError, RuntimeError):
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


class WorkerBusyError(DaskDDPError, RuntimeError):
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


class RendezvousTimeoutError(DaskDDPError, TimeoutError):
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


class WorkerLostError(DaskDDPError):
    """A rank's worker left the cluster while the rank ran. Raised on the client.

    With ``max_restarts=N`` the job restarts instead (from the last checkpoint).

    Examples
    --------
    >>> print(WorkerLostError(1, "tcp://10.0.0.7:40311", "dask-ddp-3f2a-rank-1"))
    ... # doctest: +ELLIPSIS
    rank 1 was lost: its worker tcp://10.0.0.7:40311 left the cluster while it ran task ...
    """

    def __init__(self, rank: int, worker: str, key: str) -> None:
        super().__init__(rank, worker, key)
        self.rank, self.worker, self.key = rank, worker, key

    def __str__(self) -> str:
        return (
            f"rank {self.rank} was lost: its worker {self.worker} left the cluster while it ran "
            f"task {self.key} (killed, out of memory, or removed). The other ranks were stopped."
        )


class RankStoppedError(DaskDDPError):
    """Raised inside a rank that was stopped before it finished: another rank failed first
    (``failed_rank``), or the client stopped the job (cancelled, or stopping it after a
    failure). Its futures raise it; ``job.result()`` raises the first failure instead.

    ``PeerFailedError`` and ``RankAbortedError`` are the same class, under the names of
    the two cases it used to be split into.

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
        """The failed rank's error, as ``PeerFailedError.cause`` was."""
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


#: A rank stopped because another rank failed first (the name of that case).
PeerFailedError = RankStoppedError


class ResizeStopError(RankStoppedError):
    """Raised by every rank of an elastic job that stops at a checkpoint to grow.

    The job then restarts from that checkpoint with more ranks; this is not a failure and
    does not count against ``max_restarts``. Only the futures of the attempt that stopped
    raise it; :meth:`Job.result() <dask_ddp.Job.result>` returns the last attempt's results.

    Examples
    --------
    >>> print(ResizeStopError(1, 40))  # doctest: +ELLIPSIS
    rank 1 stopped at its checkpoint of step 40: the job restarts there with more ranks ...
    """

    def __init__(self, rank: int, step: int) -> None:
        super().__init__(rank, f"stopped at the checkpoint of step {step} to grow")
        self.args = (rank, step)
        self.step = step

    def __str__(self) -> str:
        return (
            f"rank {self.rank} stopped at its checkpoint of step {self.step}: the job restarts "
            "there with more ranks (workers joined the cluster); nothing failed"
        )


class ScaleTimeoutError(DaskDDPError, TimeoutError):
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


#: A rank the client stopped (the name of that case).
RankAbortedError = RankStoppedError


class JobCancelledError(DaskDDPError):
    """``Job.result()`` was called on a job that was cancelled.

    Examples
    --------
    >>> job.cancel(); job.result()  # doctest: +SKIP
    JobCancelledError: job 3f2a was cancelled; launch it again to get a result
    """

    def __init__(self, job: str) -> None:
        super().__init__(job)
        self.job = job

    def __str__(self) -> str:
        return f"job {self.job} was cancelled; launch it again to get a result"


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


class ChannelError(DaskDDPError, RuntimeError):
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


class JobNotFoundError(DaskDDPError, ValueError):
    """No dask_ddp job in this process owns the given futures.

    Examples
    --------
    >>> print(JobNotFoundError(["k1"]))  # doctest: +ELLIPSIS
    no dask_ddp job started from this client owns the futures [k1]. ...
    """

    def __init__(self, keys: list[str]) -> None:
        super().__init__(keys)
        self.keys = keys

    def __str__(self) -> str:
        shown = ", ".join(map(str, self.keys[:3])) + (", ..." if len(self.keys) > 3 else "")
        return (
            f"no dask_ddp job started from this client owns the futures [{shown}]. Pass the "
            "list that dask_ddp.dispatch.run() returned, or job.futures, or the Job itself, "
            "and keep it referenced while results are processed."
        )


class DashboardUnavailableWarning(UserWarning):
    """The cluster's scheduler did not take dask-ddp's dashboard plugin: jobs train, but
    the ``/ddp/`` page and the ``dask_ddp_*`` Prometheus gauges are not there.

    Examples
    --------
    >>> print(DashboardUnavailableWarning("tcp://10.0.0.2:8786", ModuleNotFoundError("dask_ddp")))
    ... # doctest: +ELLIPSIS
    the scheduler at tcp://10.0.0.2:8786 did not take dask-ddp's dashboard plugin ...
    """

    def __init__(self, scheduler: str, cause: BaseException) -> None:
        super().__init__(scheduler, cause)
        self.scheduler, self.cause = scheduler, cause

    def __str__(self) -> str:
        return (
            f"the scheduler at {self.scheduler} did not take dask-ddp's dashboard plugin "
            f"({type(self.cause).__name__}: {self.cause}); jobs train, but the cluster's "
            "dashboard has no /ddp/ page. Install dask-ddp where the scheduler runs (or start "
            "it with --preload dask_ddp.dashboard), or set ddp.dashboard.enabled: false to "
            "stop trying."
        )

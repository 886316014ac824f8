"""The exceptions dask_ddp raises.

Every class derives from :class:`DaskDDPError` and, where one fits, from the built-in
exception with the same meaning (``TimeoutError``, ``ValueError``, ...), so existing
``except`` clauses keep working. Each keeps its fields as attributes, passes them to
``super().__init__`` so that it pickles back from a worker, and builds its message in
``__str__``: what happened, where (rank, worker, task key) and what to do.
"""

from __future__ import annotations

import inspect
import logging
import pickle
from collections.abc import Mapping
from typing import Any, Literal

__all__ = [
    "BackendUnavailableError",
    "ChannelError",
    "CheckpointDirMissingError",
    "CheckpointShardsError",
    "CheckpointUploadError",
    "CorruptDataError",
    "DaskDDPError",
    "DataNotFoundError",
    "DatasetComputeError",
    "DatasetNotFoundError",
    "DatasetPartitionLostError",
    "DatasetTooSmallError",
    "InfrastructureError",
    "JobCancelledError",
    "JobNameTakenError",
    "JobNotFoundError",
    "JobStalledError",
    "JobStillRunningError",
    "MissingFieldError",
    "NoWorkersError",
    "NotInRankError",
    "NotPicklableError",
    "PlacementError",
    "RankDiedError",
    "RankFailedError",
    "RankStoppedError",
    "RendezvousTimeoutError",
    "RetryableError",
    "SampleFetchError",
    "ScaleTimeoutError",
    "SchedulerPluginError",
    "ScriptExitError",
    "ScriptModulesTooLargeError",
    "ScriptSettingsError",
    "ShardListError",
    "StorageAccessError",
    "SupervisorError",
    "TooManyResizesError",
    "UnsafeCheckpointError",
    "UnsafeResultPathError",
    "UnsupportedCollectionError",
    "WireVersionError",
    "WorkerBusyError",
    "WorkerLostError",
]

logger = logging.getLogger(__name__)


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


class RankDiedError(InfrastructureError, RuntimeError):
    """A rank's process ended without saying how (a signal, ``os._exit``, a crash in C or
    the kernel's out-of-memory killer); its worker is unharmed. As under torchrun, whose
    agent restarts a worker group when a worker process dies, ``max_restarts=N`` restarts
    the job from its last checkpoint.

    Examples
    --------
    >>> print(RankDiedError(1, "tcp://10.0.0.7:40311", "ddp_train-rank1-3f2a", -9))
    ... # doctest: +ELLIPSIS
    rank 1's process died (killed by signal 9, SIGKILL) on worker tcp://10.0.0.7:40311 ...
    """

    def __init__(self, rank: int, worker: str, key: str, exitcode: int | None) -> None:
        super().__init__(rank, worker, key, exitcode)
        self.rank, self.worker, self.key, self.exitcode = rank, worker, key, exitcode

    def __str__(self) -> str:
        import signal

        code = self.exitcode
        if code is not None and code < 0:
            try:
                how = f"killed by signal {-code}, {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit code {code}"
        return (
            f"rank {self.rank}'s process died ({how}) on worker {self.worker} (task {self.key}) "
            "before it returned or raised. Its worker is unharmed. Look for an out-of-memory "
            "kill in the host's kernel log or a crash in a C extension; max_restarts=N restarts "
            "the job from its last checkpoint."
        )


class JobStalledError(DaskDDPError, TimeoutError):
    """No rank of the job progressed for ``ddp.stall-timeout`` with unchanged stacks, and
    ``ddp.stall-action`` is ``fail``. Raised on the client; ``ranks`` are those outside a
    collective (the likely cause).

    Examples
    --------
    >>> print(JobStalledError("3f2a", "no rank progressed for 120 s; ...", (1,)))
    ... # doctest: +ELLIPSIS
    job 3f2a stalled: no rank progressed for 120 s; .... Job.stacks() shows where ...
    """

    def __init__(self, job: str, why: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(job, why, ranks)
        self.job, self.why, self.ranks = job, why, tuple(ranks)

    def __str__(self) -> str:
        return (
            f"job {self.job} stalled: {self.why}. Job.stacks() shows where each rank is while "
            "one runs; fix the hang, or raise ddp.stall-timeout if a step legitimately takes "
            "that long."
        )


class SupervisorError(DaskDDPError, RuntimeError):
    """The job's supervisor (on the scheduler) could not carry out one of its own steps,
    such as asking the cluster's worker pool for workers, so the job was ended rather than
    left waiting forever. Raised on the client.

    Examples
    --------
    >>> print(SupervisorError("3f2a", "the worker pool could not take the job's request"))
    ... # doctest: +ELLIPSIS
    job 3f2a was ended by its supervisor: the worker pool could not take the job's request. ...
    """

    def __init__(self, job: str, why: str) -> None:
        super().__init__(job, why)
        self.job, self.why = job, why

    def __str__(self) -> str:
        return (
            f"job {self.job} was ended by its supervisor: {self.why}. The scheduler's log has "
            "the traceback; launch the job again, and report it with that log if it repeats."
        )


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

    def __init__(
        self, rank: int, worker: str, key: str, finished: bool = False, limit: int | None = None
    ) -> None:
        super().__init__(rank, worker, key, finished, limit)
        self.rank, self.worker, self.key, self.finished = rank, worker, key, finished
        self.limit = limit  # finished: ddp.result-limit, the largest value the cluster holds

    def __str__(self) -> str:
        if self.finished:
            held = (
                f"values up to ddp.result-limit ({self.limit:,} bytes pickled) are held by the "
                "job's supervisor; larger ones"
                if self.limit
                else "its values"
            )
            return (
                f"rank {self.rank}'s return value was lost: its worker {self.worker} left the "
                f"cluster after task {self.key} finished. The job succeeded; {held} live only "
                "on the ranks' workers until the job is forgotten. Return a smaller value (save "
                "a large one to storage and return its path), or raise ddp.result-limit."
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


class SweepParamsError(DaskDDPError, RuntimeError):
    """A sweep's ``params(trial)`` raised, or returned something other than a dict of
    keyword arguments: the sweep stops (its running trials are cancelled), since every
    trial would meet the same.

    Examples
    --------
    >>> print(SweepParamsError("5e1d", 3, "KeyError: 'lr'"))  # doctest: +ELLIPSIS
    sweep 5e1d: params(trial) failed for trial 3: KeyError: 'lr'. ...
    """

    def __init__(self, sweep: str, trial: int, cause: str) -> None:
        super().__init__(sweep, trial, cause)
        self.sweep, self.trial, self.cause = sweep, trial, cause

    def __str__(self) -> str:
        return (
            f"sweep {self.sweep}: params(trial) failed for trial {self.trial}: {self.cause}. "
            "It runs on the scheduler, once per trial, and must return the training "
            "function's keyword arguments as a dict (trial.suggest_float(...) and the like); "
            "call it on a trial of your own (study.ask()) to see it fail."
        )


class SweepStudyError(DaskDDPError, RuntimeError):
    """The scheduler could not take a sweep's study: it did not unpickle there (Optuna, or
    a module the study's sampler or ``params`` needs, is not installed where the scheduler
    runs), or asking it for a trial failed.

    Examples
    --------
    >>> print(SweepStudyError("5e1d", "ModuleNotFoundError: No module named 'optuna'"))
    ... # doctest: +ELLIPSIS
    sweep 5e1d: the scheduler could not take its study: ModuleNotFoundError: ...
    """

    def __init__(self, sweep: str, cause: str) -> None:
        super().__init__(sweep, cause)
        self.sweep, self.cause = sweep, cause

    def __str__(self) -> str:
        return (
            f"sweep {self.sweep}: the scheduler could not take its study: {self.cause}. The "
            "study and params() run on the scheduler: install optuna (pip install "
            "'dask-ddp[sweep]') and what params() imports where the scheduler runs, and give "
            "the study a storage the scheduler reaches (in memory, a JournalStorage file it "
            "sees, an RDB URL it connects to)."
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


class WireVersionError(DaskDDPError, ValueError):
    """A record of a newer version than this side of the cluster knows arrived: the client,
    the scheduler and the workers run different versions of dask-ddp.

    Examples
    --------
    >>> print(WireVersionError("rank outcome", 2))  # doctest: +ELLIPSIS
    a rank outcome record of version 2 arrived, but this dask-ddp reads up to version 1: ...
    """

    def __init__(self, kind: str, version: Any) -> None:
        super().__init__(kind, version)
        self.kind, self.version = kind, version

    def __str__(self) -> str:
        return (
            f"a {self.kind} record of version {self.version} arrived, but this dask-ddp reads "
            f"up to version {WIRE_VERSION}: install the same dask-ddp on the client, the "
            "scheduler and the workers"
        )


#: The version of the records that travel between client, scheduler and ranks
#: (:mod:`dask_ddp._shared.protocol`); here, where the error that names it lives.
WIRE_VERSION = 1


# -- the datasets' errors (dask_ddp.data) ----------------------------------------------------
class DataNotFoundError(DaskDDPError, FileNotFoundError):
    """The data a dataset was built on is not there: a bucket, prefix or path that does not
    exist or holds no sample it accepts, or a shard that its shard list names.

    Parameters
    ----------
    url : str
        The URL that was asked for, e.g. ``"s3://bucket/train"`` or a shard's URL.
    reason : str
        What is missing, as a sentence fragment (for a shard: the filesystem's error).
    listed_in : str, optional
        For a shard: the shard list that names it.

    Examples
    --------
    >>> str(DataNotFoundError("s3://missing-bucket/train", "the bucket does not exist"))
    'cannot build a dataset from s3://missing-bucket/train: the bucket does not exist'
    >>> err = DataNotFoundError("s3://b/shard-000007.tar", "no such key", listed_in="s3://b/shards.json")
    >>> isinstance(err, FileNotFoundError)
    True
    >>> print(err)  # doctest: +ELLIPSIS
    shard s3://b/shard-000007.tar does not exist (no such key), but s3://b/shards.json lists it...
    """

    def __init__(self, url: str, reason: str, listed_in: str | None = None) -> None:
        super().__init__(url, reason, listed_in)
        self.url, self.reason, self.listed_in = url, reason, listed_in

    def __reduce__(self) -> tuple[type, tuple[str, str, str | None]]:
        # OSError's own __reduce__ would rebuild the exception from (errno, strerror).
        return type(self), (self.url, self.reason, self.listed_in)

    @property
    def source(self) -> str | None:
        """The shard list that names a missing shard (as ``listed_in``)."""
        return self.listed_in

    @property
    def cause(self) -> str:
        return self.reason

    def __str__(self) -> str:
        if self.listed_in is not None:
            return (
                f"shard {self.url} does not exist ({self.reason}), but {self.listed_in} lists "
                "it. Upload the shard, or regenerate the shard list (write_shards writes both)"
            )
        return f"cannot build a dataset from {self.url}: {self.reason}"


class CorruptDataError(DaskDDPError, ValueError):
    """Data was read but is not what it should be: a sample its decoder cannot decode, a
    shard that is not a readable tar file, or a shard holding another number of samples
    than its shard list says.

    Parameters
    ----------
    url : str
        The sample's or shard's URL.
    cause : str
        What is wrong: the decoder's error, or what is wrong with the shard.
    what : {"sample", "shard"}
        What is corrupt.
    listed_in : str, optional
        For a shard whose sample count is off: the shard list, with ``expected`` (its
        ``nsamples``) and ``found``.

    Examples
    --------
    >>> print(CorruptDataError("s3://b/train/cat/1.jpg", "cannot identify image file"))
    ... # doctest: +ELLIPSIS
    cannot decode s3://b/train/cat/1.jpg: cannot identify image file. Replace or delete ...
    >>> print(CorruptDataError("s3://b/shard-000002.tar", "truncated at byte 512", "shard"))
    ... # doctest: +ELLIPSIS
    shard s3://b/shard-000002.tar is not a readable tar file: truncated at byte 512. ...
    """

    def __init__(
        self,
        url: str,
        cause: str,
        what: str = "sample",
        *,
        listed_in: str | None = None,
        expected: int | None = None,
        found: int | None = None,
    ) -> None:
        super().__init__(url, cause, what)
        self.url, self.cause, self.what = url, cause, what
        self.listed_in, self.expected, self.found = listed_in, expected, found

    def __reduce__(self) -> tuple[Any, ...]:
        fields = {"listed_in": self.listed_in, "expected": self.expected, "found": self.found}
        return _rebuild_corrupt, (self.url, self.cause, self.what, fields)

    @classmethod
    def count(cls, url: str, listed_in: str, expected: int, found: int) -> CorruptDataError:
        """A shard holding ``found`` samples where ``listed_in`` says ``expected``."""
        cause = f"it holds {found} samples, but {listed_in} says {expected} (nsamples)"
        return cls(url, cause, "shard", listed_in=listed_in, expected=expected, found=found)

    def __str__(self) -> str:
        if self.what == "sample":
            return (
                f"cannot decode {self.url}: {self.cause}. Replace or delete the object, or "
                "pass on_corrupt='skip' to read the next readable sample in its place"
            )
        if self.expected is not None:
            return (
                f"shard {self.url} holds {self.found} samples, but {self.listed_in} says "
                f"{self.expected} (nsamples). The shard list is out of date or the shard was "
                "rewritten: regenerate the list (write_shards), or correct its nsamples"
            )
        return (
            f"shard {self.url} is not a readable tar file: {self.cause}. Its local copy "
            "(if cached) was deleted, so the next read downloads it again; if the stored "
            "shard itself is damaged, rewrite it (write_shards)"
        )


def _rebuild_corrupt(url: str, cause: str, what: str, fields: dict[str, Any]) -> CorruptDataError:
    return CorruptDataError(url, cause, what, **fields)


class SampleFetchError(InfrastructureError, OSError):
    """Reading a sample's bytes failed, after the transient errors were retried.

    Parameters
    ----------
    url : str
        The sample's URL.
    cause : str
        The last error, as ``"ExceptionType: message"``.

    Examples
    --------
    >>> err = SampleFetchError("s3://b/k.jpg", "ClientError: SlowDown")
    >>> str(err)  # doctest: +ELLIPSIS
    'cannot read s3://b/k.jpg: ClientError: SlowDown. Transient errors ...'
    """

    def __init__(self, url: str, cause: str) -> None:
        super().__init__(url, cause)
        self.url, self.cause = url, cause

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.url, self.cause)

    def __str__(self) -> str:
        return (
            f"cannot read {self.url}: {self.cause}. Transient errors (5xx, throttling, reset "
            "connections) were already retried; check that the object exists and is readable "
            "with these credentials, or raise retries= for a flaky store"
        )


StorageProblem = Literal["unreachable", "credentials"]


class StorageAccessError(InfrastructureError, OSError):
    """The store cannot be used at all: its endpoint refuses or cannot be reached, or no
    credentials were found to sign requests to it. Raised at the first request, after a
    few quick attempts for a refused connection (other transient errors keep their
    ``retries=``).

    Parameters
    ----------
    url : str
        The URL that was being read.
    endpoint : str
        The store's endpoint (``endpoint_url=``), or ``""`` for AWS's default.
    problem : {"unreachable", "credentials"}
        What stops every request.
    cause : str
        The client's error, as ``"ExceptionType: message"``.

    Examples
    --------
    >>> print(StorageAccessError("s3://b/shards.json", "http://10.0.0.5:9000", "unreachable",
    ...                          "EndpointConnectionError: connection refused"))
    ... # doctest: +ELLIPSIS
    cannot reach the store at http://10.0.0.5:9000 to read s3://b/shards.json: ...
    """

    def __init__(self, url: str, endpoint: str, problem: StorageProblem, cause: str) -> None:
        super().__init__(url, endpoint, problem, cause)
        self.url, self.endpoint, self.problem, self.cause = url, endpoint, problem, cause

    def __reduce__(self) -> tuple[type, tuple[str, str, StorageProblem, str]]:
        return type(self), (self.url, self.endpoint, self.problem, self.cause)

    def __str__(self) -> str:
        where = self.endpoint or "AWS's default S3 endpoint"
        if self.problem == "unreachable":
            return (
                f"cannot reach the store at {where} to read {self.url}: {self.cause}. Check "
                "endpoint_url= (scheme, host and port), that the store is running, and that "
                "this machine (every Dask worker, too) can connect to it"
            )
        return (
            f"no credentials were found to read {self.url} from {where} ({self.cause}). "
            "For a public bucket pass anon=True; otherwise set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws/credentials) where the dataset "
            "is read (the client and every Dask worker), or pass storage_options="
            "{'key': ..., 'secret': ...}"
        )


class ShardListError(DaskDDPError, ValueError):
    """A shard list (JSON file or Python list) is malformed.

    Parameters
    ----------
    source : str
        Where the list came from: the JSON file's URL, or ``"the shard list passed in"``.
    reason : str
        What is wrong, as a sentence fragment.

    Examples
    --------
    >>> print(ShardListError("s3://b/shards.json", "entry 3 has no 'nsamples'"))
    ... # doctest: +ELLIPSIS
    bad shard list s3://b/shards.json: entry 3 has no 'nsamples'. A shard list is ...
    """

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(source, reason)
        self.source, self.reason = source, reason

    def __str__(self) -> str:
        return (
            f"bad shard list {self.source}: {self.reason}. A shard list is "
            '{"shardlist": [{"url": "shard-000000.tar", "nsamples": 1000}, ...]} (relative '
            "URLs are resolved against the JSON file's folder), or a Python list of such "
            "dicts; dask_ddp.data.write_shards writes one"
        )


class MissingFieldError(DaskDDPError, KeyError):
    """A sample lacks a field (extension) that ``keys=`` or a lookup in its dict asks for.

    Examples
    --------
    >>> err = MissingFieldError("/d/shard-000000.tar", "000017", ".cls", (".jpg", ".json"))
    >>> print(err)  # doctest: +ELLIPSIS
    sample '000017' in /d/shard-000000.tar has no '.cls' field (it has: .jpg, .json). ...
    """

    def __init__(self, url: str, key: str, wanted: str, available: tuple[str, ...]) -> None:
        super().__init__(url, key, wanted, available)
        self.url, self.key, self.wanted, self.available = url, key, wanted, available

    def __str__(self) -> str:
        return (
            f"sample {self.key!r} in {self.url} has no {self.wanted!r} field (it has: "
            f"{', '.join(self.available)}). Fields are named by extension, with wids's dot "
            "in the sample dict ('.jpg'); name alternatives with ';' in keys= ('jpg;png')"
        )


# -- Dask collections passed as datasets= (dask_ddp.data.collections) ---------------------


class UnsupportedCollectionError(DaskDDPError, TypeError):
    """A value in ``datasets=`` is not a dask.dataframe, dask.bag or dask.array collection.

    Examples
    --------
    >>> print(UnsupportedCollectionError("train", "list"))  # doctest: +ELLIPSIS
    datasets={'train': ...} is a list; launch(datasets=...) takes a dask.dataframe ...
    """

    def __init__(self, name: str, type_name: str) -> None:
        super().__init__(name, type_name)
        self.name, self.type_name = name, type_name

    def __str__(self) -> str:
        return (
            f"datasets={{{self.name!r}: ...}} is a {self.type_name}; launch(datasets=...) "
            "takes a dask.dataframe DataFrame or Series, a dask.bag Bag or a dask.array "
            "Array (or dask_ddp.data.CollectionSource(collection, ...)). Wrap in-memory data "
            "first, e.g. dask.dataframe.from_pandas(df, npartitions=8)"
        )


class DatasetTooSmallError(DaskDDPError, ValueError):
    """A dataset has fewer rows than the job has ranks, so some rank would get none.

    Examples
    --------
    >>> print(DatasetTooSmallError("train", 1, 2, True))  # doctest: +ELLIPSIS
    dataset 'train' has 1 rows, fewer than the job's 2 ranks...
    """

    def __init__(self, name: str, rows: int, world_size: int, drop_last: bool) -> None:
        super().__init__(name, rows, world_size, drop_last)
        self.name, self.rows = name, rows
        self.world_size, self.drop_last = world_size, drop_last

    def __str__(self) -> str:
        if self.rows == 0:
            return (
                f"dataset {self.name!r} has no rows: every partition is empty. Check the "
                "collection (len(ddf)) before launching"
            )
        return (
            f"dataset {self.name!r} has {self.rows} rows, fewer than the job's "
            f"{self.world_size} ranks, and drop_last=True would leave every rank without "
            "data. Pass CollectionSource(collection, drop_last=False) to pad, or use fewer "
            "workers (launch(..., workers=N))"
        )


class DatasetComputeError(DaskDDPError, RuntimeError):
    """Computing a dataset's partition on the cluster failed before the job started.

    The partition's own exception is chained as ``__cause__``.

    Examples
    --------
    >>> print(DatasetComputeError("train", 3, "('x', 3)", "ValueError: bad row"))
    ... # doctest: +ELLIPSIS
    dataset 'train': computing partition 3 (key ('x', 3)) failed: ValueError: bad row. ...
    """

    def __init__(self, name: str, partition: int, key: str, cause: str) -> None:
        super().__init__(name, partition, key, cause)
        self.name, self.partition, self.key, self.cause = name, partition, key, cause

    def __str__(self) -> str:
        return (
            f"dataset {self.name!r}: computing partition {self.partition} (key {self.key}) "
            f"failed: {self.cause}. No rank was started; fix the collection (compute one "
            "partition with ddf.partitions[i].compute() to see the error) and launch again"
        )


class DatasetPartitionLostError(InfrastructureError, RuntimeError):
    """A dataset's partition is no longer anywhere in the cluster and cannot be recomputed.

    Raised on a rank when it fetches the partition, or on the client when a restart plans
    the data again. It happens when the workers holding a partition that has no recipe (data
    from ``client.scatter``, or a collection built on scattered futures) died.

    Examples
    --------
    >>> err = DatasetPartitionLostError("train", 4, "('x', 4)", ("tcp://10.0.0.5:4000",), 1)
    >>> print(err)  # doctest: +ELLIPSIS
    dataset 'train': partition 4 (key ('x', 4)), last held by tcp://10.0.0.5:4000, is lost...
    """

    def __init__(
        self,
        name: str,
        partition: int,
        key: str,
        holders: tuple[str, ...],
        rank: int | None,
    ) -> None:
        super().__init__(name, partition, key, holders, rank)
        self.name, self.partition, self.key = name, partition, key
        self.holders, self.rank = holders, rank

    def __str__(self) -> str:
        where = ", ".join(self.holders) or "a worker that left"
        who = f" (needed by rank {self.rank})" if self.rank is not None else ""
        return (
            f"dataset {self.name!r}: partition {self.partition} (key {self.key}), last held "
            f"by {where}, is lost{who}: its worker left the cluster and Dask cannot compute "
            "it again (its data came from client.scatter or other futures without a "
            "recipe). Build the collection from a source Dask can recompute (files, "
            "from_pandas, from_array), or persist it with replicas (client.replicate), and "
            "launch again"
        )


class DatasetNotFoundError(DaskDDPError, KeyError):
    """``get_dataset_shard(name)`` names a dataset the job was not launched with.

    Examples
    --------
    >>> print(DatasetNotFoundError("valid", ("train",), 0))  # doctest: +ELLIPSIS
    rank 0 has no dataset 'valid'; this job was launched with datasets=['train']. ...
    """

    def __init__(self, name: str, available: tuple[str, ...], rank: int) -> None:
        super().__init__(name, available, rank)
        self.name, self.available, self.rank = name, available, rank

    def __str__(self) -> str:
        return (
            f"rank {self.rank} has no dataset {self.name!r}; this job was launched with "
            f"datasets={list(self.available)}. Pass it to the launch: "
            f"dask_ddp.launch(client, train, datasets={{{self.name!r}: collection}})"
        )


# -- scripts' and checkpoints' errors (dask_ddp._shared.script, dask_ddp._rank.checkpoint) ---
class ScriptExitError(DaskDDPError):
    """A script called ``sys.exit`` with a non-zero status on a rank."""

    def __init__(self, path: str, code: object) -> None:
        super().__init__(path, code)
        self.path, self.code = path, code

    def __str__(self) -> str:
        return f"script {self.path} exited with status {self.code!r}"


class ScriptModulesTooLargeError(DaskDDPError, ValueError):
    """The modules a script imports from its folder are too large to ship with the job,
    and some workers do not see them at the client's path."""

    def __init__(self, path: str, sizes: Mapping[str, int], limit: int) -> None:
        super().__init__(path, dict(sizes), limit)
        self.path, self.sizes, self.limit = path, dict(sizes), limit

    def __str__(self) -> str:
        largest = sorted(self.sizes.items(), key=lambda item: -item[1])[:5]
        listed = ", ".join(f"{name} ({size / 1024:.0f} KiB)" for name, size in largest)
        return (
            f"{self.path} imports {len(self.sizes)} modules from its folder, "
            f"{sum(self.sizes.values()) / 2**20:.1f} MiB in all ({listed}), more than "
            f"ddp.script-modules-limit ({self.limit / 2**20:.1f} MiB) allows to ship with the "
            "job, and some workers do not see them at that path. Install them on the workers "
            "(pip install -e . in a shared folder, or a package in the workers' image), or "
            "raise the limit: DASK_DDP__SCRIPT_MODULES_LIMIT=64MiB"
        )


class ScriptSettingsError(DaskDDPError, ValueError):
    """A script's ``[tool.dask-ddp]`` inline metadata is malformed."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(path, problem)
        self.path, self.problem = path, problem

    def __str__(self) -> str:
        return f"{self.path}: its inline metadata (# /// script) {self.problem}"


# -- the client: what the script says and imports ------------------------------------------

# What a script may say in its [tool.dask-ddp] table, and the values each key takes.


class UnsafeCheckpointError(DaskDDPError, pickle.UnpicklingError):
    """A checkpoint holds objects that ``weights_only=True`` loading refuses.

    Examples
    --------
    >>> print(UnsafeCheckpointError("s3://b/run1/checkpoint-000000000010.pt", "MyConfig"))
    ... # doctest: +ELLIPSIS
    checkpoint s3://b/run1/checkpoint-000000000010.pt holds objects that safe loading ...
    """

    def __init__(self, url: str, cause: str) -> None:
        super().__init__(url, cause)
        self.url, self.cause = url, cause

    def __str__(self) -> str:
        return (
            f"checkpoint {self.url} holds objects that safe loading (weights_only=True) refuses: "
            f"{self.cause}. Save plain state (model.state_dict(), optimizer.state_dict(), "
            "numbers, strings, lists, dicts of tensors) with dask_ddp.save_checkpoint()."
        )


def to_wire(error: BaseException) -> dict[str, Any]:
    """``error`` as plain values, as the scheduler sends a job's error to its clients: its
    class's name and its constructor's arguments by name (each kept as the attribute of
    that name), with its text.

    >>> from_wire(to_wire(JobCancelledError("3f2a", "no client"))).reason
    'no client'
    >>> to_wire(ScaleTimeoutError("3f2a", 3, 2, 300.0))["fields"]
    {'job': '3f2a', 'needed': 3, 'had': 2, 'waited': 300.0}
    """
    text = str(error)
    return {
        "type": type(error).__name__,
        "fields": _fields(error),
        "args": [_plain(a) for a in error.__reduce__()[1]],  # a peer of an earlier version
        "text": text,
        "summary": getattr(error, "summary", None) or text.split("\n", 1)[0],
        "traceback": getattr(error, "rank_traceback", None) or None,
    }


def _fields(error: BaseException) -> dict[str, Any] | None:
    """The constructor's arguments by name, from the attributes of the same names; None
    for a class that does not keep each (a builtin, a user's own)."""
    try:
        params = list(inspect.signature(type(error).__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    fields = {}
    for param in params:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            return None
        if not hasattr(error, param.name):
            return None
        fields[param.name] = _plain(getattr(error, param.name))
    return fields


def _plain(value: Any) -> Any:
    """A constructor argument as plain values (a tuple of ranks as a list); else its text."""
    scalar = (str, int, float, type(None))
    if isinstance(value, scalar):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, scalar) for v in value):
        return list(value)
    if isinstance(value, Mapping) and all(isinstance(v, scalar) for v in value.values()):
        return {str(k): v for k, v in value.items()}
    return str(value)


def from_wire(data: dict[str, Any]) -> DaskDDPError:
    """The error :func:`to_wire` described: the same dask_ddp class, rebuilt from its named
    fields, else a :class:`DaskDDPError` with its text (and a warning: a constructor that
    no longer takes what was sent; ``tests/test_errors.py`` round-trips every error)."""
    cls = globals().get(data.get("type", ""))
    if isinstance(cls, type) and issubclass(cls, DaskDDPError):
        fields = data.get("fields")
        try:
            return cls(**fields) if fields is not None else cls(*data.get("args", ()))
        except TypeError as exc:
            logger.warning("a %s could not be rebuilt from %s: %s", cls.__name__, fields, exc)
    return DaskDDPError(data.get("text", "the job failed"))

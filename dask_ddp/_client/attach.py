"""``dask_ddp.attach``: a client follows a job or a sweep the cluster has, whoever
started it (:class:`~dask_ddp._client.job.Job`, :class:`~dask_ddp._client.sweep.Sweep`)."""

from __future__ import annotations

from distributed import Client

from . import calls
from .job import Job, attached
from .sweep import Sweep

__all__ = ["attach"]


def attach(client: Client, job: str) -> Job | Sweep:
    """Follow a job the cluster runs (or ran recently), whoever launched it; or a sweep
    (:func:`dask_ddp.sweep`), by its id or name: then a :class:`~dask_ddp.Sweep`.

    The job's state, history, checkpoints and each rank's progress so far come at once;
    its records from the events the cluster still holds, then each new one as it comes;
    :meth:`Job.result`, :meth:`Job.cancel`, :attr:`Job.futures` and the live view work as
    for the client that launched it. A job whose last client left is followed again (its
    ``ddp.orphan-timeout`` stops). ``on_report`` callbacks of the client that launched it
    do not move here: iterate :meth:`Job.iter_metrics` instead.

    Parameters
    ----------
    client : distributed.Client
        A client of the job's cluster.
    job : str
        The job's id, or its name (the running job of that name, else the newest); or a
        sweep's.

    Raises
    ------
    JobNotFoundError
        The cluster knows no such job (never ran there, or was forgotten).

    Examples
    --------
    >>> job = dask_ddp.attach(client, "nightly")   # doctest: +SKIP
    >>> job.history[-1].state, job.metrics[-1]      # doctest: +SKIP
    >>> job.result()                                # doctest: +SKIP
    """
    answer = calls.attach(client, job)  # the cluster sends this client its events now
    if "sweep" in answer:
        return Sweep.attached(client, answer["sweep"])
    return attached(client, answer["state"])

"""Start a function as one torch.distributed rank per Dask worker.

:func:`launch` is the full API and returns a :class:`~dask_ddp.job.Job`; :func:`run` keeps
dask-pytorch-ddp's signature and returns the rank futures. Both plan once on the client
(:mod:`dask_ddp.placement`), probe the chosen workers (GPUs, busy ranks, and rank 0's
store), then submit one impure task per rank, pinned to its worker and never retried
elsewhere.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle
from distributed import Client, Future

from . import bootstrap, config, script
from .config import TimeoutLike
from .errors import NotPicklableError, NoWorkersError
from .job import Job, MetricRecord
from .placement import WorkerInfo, choose_backend, order_workers, plan_ranks, select_workers

logger = logging.getLogger(__name__)

__all__ = ["launch", "launch_script", "run"]


def _check_picklable(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> None:
    name = getattr(fn, "__qualname__", repr(fn))
    for what, value in ((f"the function {name!r}", fn), ("its args", args), ("its kwargs", kwargs)):
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            raise NotPicklableError(what, f"{type(exc).__name__}: {exc}") from exc


def _resolve_names(info: Mapping[str, Mapping[str, Any]], requested: Any) -> Any:
    """Let ``workers=`` name workers by their Dask name as well as by address."""
    if requested is None or isinstance(requested, (int, str)):
        return requested
    by_name = {str(w.get("name")): addr for addr, w in info.items()}
    return [r if r in info else by_name.get(str(r), r) for r in requested]


def launch(
    client: Client,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    workers: int | Sequence[str] | None = None,
    backend: str | None = None,
    timeout: TimeoutLike | None = None,
    pass_local_rank: bool = False,
    on_report: Callable[[MetricRecord], Any] | None = None,
) -> Job:
    """Run ``fn(*args, **kwargs)`` as one DDP rank on each chosen Dask worker.

    Each rank gets torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), its own GPU first in
    ``CUDA_VISIBLE_DEVICES``, and a default process group that is initialised before ``fn``
    and destroyed after it. Inside ``fn``, :func:`dask_ddp.get_context` describes the rank.

    Parameters
    ----------
    client : distributed.Client
        A synchronous client of the cluster to train on.
    fn : callable
        The training function. It and its arguments must pickle.
    args : sequence, optional
        Positional arguments for ``fn``, the same on every rank.
    kwargs : mapping, optional
        Keyword arguments for ``fn``.
    workers : int or list of str, optional
        Every worker (default), the first N workers in rank order, or these worker
        addresses (or Dask worker names).
    backend : {"gloo", "nccl", None}, optional
        torch.distributed backend; ``None`` reads ``ddp.backend`` (default: nccl when every
        worker sees a GPU, else gloo).
    timeout : float, str or timedelta, optional
        Process-group timeout: the longest any collective may wait. Seconds, or a string
        like ``"10 minutes"``. ``None`` reads ``ddp.timeout``.
    pass_local_rank : bool, optional
        Also pass ``local_rank=`` to ``fn`` (as dask-pytorch-ddp did).
    on_report : callable, optional
        Called on the client with each :class:`~dask_ddp.job.MetricRecord` the ranks send
        with :func:`dask_ddp.report`, in each rank's order, as they arrive: forward them to
        TensorBoard, MLflow or a file. It runs on the job's watcher thread, never on a rank
        or on the client's event loop; if it raises, the error is logged and it is not
        called again for this job.

    Returns
    -------
    Job
        Handle with the rank futures, ``result()``, ``metrics``, ``cancel()`` and a live
        notebook view.

    Raises
    ------
    NoWorkersError
        The cluster has no workers.
    PlacementError
        ``workers=`` asks for more workers than there are, or names unknown ones.
    NotPicklableError
        ``fn`` or its arguments cannot be sent to the workers.
    BackendUnavailableError
        ``backend="nccl"`` on a worker without a GPU.

    Notes
    -----
    A chosen worker that is running another job's rank runs this job's rank afterwards, as
    Dask queues tasks. The ranks that started first wait up to ``ddp.rendezvous-timeout``
    for the others, then the job fails with :class:`~dask_ddp.errors.RendezvousTimeoutError`.

    Examples
    --------
    >>> from dask.distributed import Client, LocalCluster
    >>> client = Client(LocalCluster(n_workers=2, threads_per_worker=1))  # doctest: +SKIP
    >>> def train(lr):
    ...     ctx = dask_ddp.get_context()
    ...     return ctx.rank
    >>> dask_ddp.launch(client, train, args=(0.1,)).result()  # doctest: +SKIP
    [0, 1]
    """
    return _launch(
        client,
        fn,
        args,
        kwargs,
        workers=workers,
        backend=backend,
        timeout=timeout,
        pass_local_rank=pass_local_rank,
        init_process_group=True,
        on_report=on_report,
    )


def _launch(
    client: Client,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    *,
    workers: int | Sequence[str] | None,
    backend: str | None,
    timeout: TimeoutLike | None,
    pass_local_rank: bool,
    init_process_group: bool,
    on_report: Callable[[MetricRecord], Any] | None = None,
) -> Job:
    args = tuple(args)
    kwargs = dict(kwargs or {})
    settings = config.resolve(backend=backend, timeout=timeout)
    _check_picklable(fn, args, kwargs)

    info = client.scheduler_info(n_workers=-1)["workers"]
    if not info:
        raise NoWorkersError(client.scheduler.address)
    chosen = select_workers(
        {addr: w["host"] for addr, w in info.items()}, _resolve_names(info, workers)
    )
    rank0 = order_workers([WorkerInfo(a, info[a]["host"]) for a in chosen])[0]
    job_id = uuid.uuid4().hex[:12]

    probes = client.run(
        bootstrap.probe_worker,
        job_id,
        rank0.address,
        settings.rendezvous_timeout,
        workers=chosen,
    )
    try:
        for worker, probe in probes.items():
            if probe["busy"]:
                logger.info(
                    "job %s: worker %s is running %s; this job's rank waits for it "
                    "(up to ddp.rendezvous-timeout for the other ranks)",
                    job_id,
                    worker,
                    probe["busy"],
                )
        infos = [
            WorkerInfo(
                address=a,
                host=info[a]["host"],
                gpu_count=settings.gpu_count
                if settings.gpu_count is not None
                else probes[a]["gpu_count"],
                cuda_visible_devices=probes[a]["cuda_visible_devices"],
            )
            for a in chosen
        ]
        chosen_backend, why = choose_backend(settings.backend, infos)
        plan = plan_ranks(infos)
    except BaseException:
        client.run(bootstrap.drop_store, job_id, workers=[rank0.address], on_error="ignore")
        raise
    port = probes[rank0.address]["store_port"]
    logger.info(
        "job %s: %d ranks on %d hosts, backend %s (%s), rendezvous at %s:%d",
        job_id,
        len(plan),
        plan[-1].node_rank + 1,
        chosen_backend,
        why,
        rank0.host,
        port,
    )

    # The job subscribes to its event topic here, before any rank is submitted.
    job = Job(
        client,
        job_id,
        [p.worker for p in plan],
        chosen_backend,
        store_worker=rank0.address,
        failure_grace=settings.failure_grace,
        drain_timeout=settings.event_drain_timeout,
        on_report=on_report,
    )
    futures = []
    for placement in plan:
        spec = bootstrap.RankSpec(
            job_id=job_id,
            key=f"dask-ddp-{job_id}-rank-{placement.rank}",
            attempt=0,
            backend=chosen_backend,
            timeout=settings.timeout,
            rendezvous_timeout=settings.rendezvous_timeout,
            master_addr=rank0.host,
            master_port=port,
            threads_per_rank=settings.threads_per_rank,
            allow_daemon_children=settings.allow_daemon_children,
            pass_local_rank=pass_local_rank,
            placement=placement,
            init_process_group=init_process_group,
            event_flush_interval=settings.event_flush_interval,
            max_event_bytes=settings.max_event_bytes,
        )
        try:
            futures.append(
                client.submit(
                    bootstrap.run_rank,
                    fn,
                    args,
                    kwargs,
                    spec,
                    key=spec.key,
                    workers=[placement.worker],
                    allow_other_workers=False,
                    pure=False,
                    retries=0,
                )
            )
        except BaseException:
            client.cancel(futures)
            job._abandon()
            client.run(bootstrap.drop_store, job_id, workers=[rank0.address], on_error="ignore")
            raise
    job._start(futures)
    return job


def launch_script(
    client: Client,
    path: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    workers: int | Sequence[str] | None = None,
    backend: str | None = None,
    timeout: TimeoutLike | None = None,
) -> Job:
    """Run a torchrun-style script as ``__main__`` on each rank.

    The script is read here and sent to the workers, so it need not exist on them. Each rank
    sees torchrun's environment and ``sys.argv == [path, *args]``; the script calls
    ``init_process_group()`` itself, as it would under torchrun. A non-zero ``sys.exit``
    fails the rank. Every rank's return value is its exit code (0).

    Examples
    --------
    >>> dask_ddp.launch_script(client, "train.py", ["--epochs", "1"]).result()  # doctest: +SKIP
    [0, 0]
    """
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    return _launch(
        client,
        script.run_script,
        (source, path, [str(a) for a in args]),
        None,
        workers=workers,
        backend=backend,
        timeout=timeout,
        pass_local_rank=False,
        init_process_group=False,
    )


def run(
    client: Client,
    fn: Callable[..., Any],
    *args: Any,
    backend: str | None = None,
    pass_local_rank: bool = False,
    **kwargs: Any,
) -> list[Future]:
    """dask-pytorch-ddp's ``run()``: start ``fn`` on every worker, return the futures.

    A drop-in for ``dask_pytorch_ddp.dispatch.run``: same signature, one future per rank in
    rank order, each resolving to that rank's return value. Positional ``args`` reach
    ``fn`` (the predecessor's ``TypeError`` there is fixed), and a failing rank still stops
    the others. Prefer :func:`launch` for new code: it returns a :class:`~dask_ddp.job.Job`.

    Examples
    --------
    >>> from distributed import wait
    >>> futures = dask_ddp.dispatch.run(client, train, cfg)  # doctest: +SKIP
    >>> wait(futures); [f.result() for f in futures]        # doctest: +SKIP
    """
    job = launch(client, fn, args, kwargs, backend=backend, pass_local_rank=pass_local_rank)
    return job.futures

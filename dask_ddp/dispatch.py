"""Start a function as one torch.distributed rank per Dask worker.

:func:`launch` is the full API and returns a :class:`~dask_ddp.job.Job`; :func:`run` keeps
dask-pytorch-ddp's signature and returns the rank futures. Both plan once on the client
(:mod:`dask_ddp.placement`), probe the chosen workers (GPUs, busy ranks, and rank 0's
store), then submit one impure task per rank, pinned to its worker and never retried
elsewhere.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle
from distributed import Client, Future

from . import bootstrap, config, script
from .config import TimeoutLike
from .errors import NotPicklableError, NoWorkersError, PlacementError
from .job import Job, MetricRecord, OutputLine
from .placement import WorkerInfo, choose_backend, order_workers, plan_ranks, select_workers
from .supervise import Supervisor

if TYPE_CHECKING:
    from .data import _collection_plan as _collections

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
    on_output: Callable[[OutputLine], Any] | None = None,
    max_restarts: int = 0,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    keep_last: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    datasets: Mapping[str, Any] | None = None,
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
        TensorBoard, MLflow or a file. It runs on the job's supervisor thread, never on a rank
        or on the client's event loop; if it raises, the error is logged and it is not
        called again for this job.
    on_output : callable, optional
        Called on the client with each :class:`~dask_ddp.job.OutputLine` a rank prints
        (``print()``, ``sys.stdout``, ``sys.stderr``) while ``fn`` runs, in each rank's
        order; like ``on_report``, on the supervisor thread. The lines are also in
        :attr:`Job.output` and the live view, and still in the worker's own log.
    max_restarts : int, optional
        How many times to place the job again and rerun ``fn`` when a rank's worker is
        lost (killed, out of memory, removed) or a rank raises
        :class:`~dask_ddp.errors.RetryableError`. Each rerun sees
        ``get_context().attempt`` incremented and ``get_checkpoint()`` returning the
        last checkpoint. 0 (default) fails the job instead.
    checkpoint_dir : str, optional
        Any fsspec URL (``s3://bucket/run1``, a local path the workers share) where
        :func:`dask_ddp.save_checkpoint` writes and :func:`dask_ddp.get_checkpoint` reads.
    keep_last : int, optional
        Keep only the newest N checkpoints (default: all).
    storage_options : mapping, optional
        fsspec options for ``checkpoint_dir`` (for example
        ``{"client_kwargs": {"endpoint_url": "http://minio:9000"}}``).
    datasets : mapping of str to Dask collection, optional
        Training data already in Dask: ``{"train": ddf}`` with a dask.dataframe DataFrame or
        Series, a dask.bag Bag or a dask.array Array, or a
        :class:`~dask_ddp.data.CollectionSource` for options (``shuffle``, ``seed``,
        ``drop_last``). Each is computed into the workers' memory before the ranks start
        (``launch`` returns once it is) and held until the job ends, restarts included.
        Its rows are split evenly between the ranks, preferring partitions already on a
        rank's worker; inside ``fn``, :func:`dask_ddp.get_dataset_shard` (``"train"``)
        returns the rank's share, which fetches its partitions worker to worker, never
        through the client. Every rank gets the same number of rows (a few repeated, or
        left out with ``drop_last=True``), so the same number of batches.

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
    UnsupportedCollectionError
        A value in ``datasets=`` is not a Dask dataframe, bag or array.
    DatasetComputeError
        Computing a partition of a dataset failed.

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
        on_output=on_output,
        max_restarts=max_restarts,
        checkpoint_dir=checkpoint_dir,
        keep_last=keep_last,
        storage_options=storage_options,
        datasets=datasets,
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
    on_output: Callable[[OutputLine], Any] | None = None,
    max_restarts: int = 0,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    keep_last: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    datasets: Mapping[str, Any] | None = None,
) -> Job:
    args = tuple(args)
    kwargs = dict(kwargs or {})
    settings = config.resolve(backend=backend, timeout=timeout)
    _check_picklable(fn, args, kwargs)
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be 0 or more; got {max_restarts!r}")
    job_id = uuid.uuid4().hex[:12]
    data = None
    if datasets:
        # Imported here: the data modules (PIL, fsspec, dask.dataframe) cost every launch
        # ~80 ms and 8 MB otherwise, and most jobs bring no Dask collection.
        from .data import _collection_plan as _collections

        data = _collections._persist_datasets(client, datasets, job_id)
    launcher = _Launcher(
        client, fn, args, kwargs, settings, job_id,
        pass_local_rank=pass_local_rank,
        init_process_group=init_process_group,
        checkpoint_dir=None if checkpoint_dir is None else os.fspath(checkpoint_dir),
        keep_last=keep_last,
        storage_options=dict(storage_options) if storage_options else None,
    )  # fmt: skip
    launcher.datasets = data
    try:
        first = launcher.prepare(0, workers)
        # The supervisor subscribes to the attempt's event topic before any rank is
        # submitted. It releases the datasets' partitions when the job is done
        # (succeeded, failed for good, or cancelled), restarts included.
        return Supervisor(
            client,
            job_id,
            launcher,
            first,
            failure_grace=settings.failure_grace,
            drain_timeout=settings.event_drain_timeout,
            max_restarts=max_restarts,
            on_report=on_report,
            on_output=on_output,
            datasets=data,
        ).start()
    except BaseException:
        if data is not None:
            data.release()
        raise


@dataclasses.dataclass
class _Attempt:
    """One placement of a job: its run id (attempt 0 uses the job id), ranks and store."""

    run_id: str
    attempt: int
    workers: list[str]
    backend: str
    store_worker: str
    submit: Callable[[], list[Future]]
    abandon: Callable[[], None]


class _Launcher:
    """Places a job on the cluster, for its first attempt and for every restart."""

    def __init__(
        self,
        client: Client,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict[str, Any],
        settings: config.Settings,
        job_id: str,
        **rank_options: Any,
    ) -> None:
        self.client, self.fn, self.args, self.kwargs = client, fn, args, kwargs
        self.settings, self.job_id, self.rank_options = settings, job_id, rank_options
        self.world_size = 0
        self.datasets: _collections._Datasets | None = None

    def relaunch(self, attempt: int) -> _Attempt:
        """Place the job again on the workers there now, waiting for enough of them."""
        timeout = self.settings.rendezvous_timeout
        try:
            self.client.wait_for_workers(self.world_size, timeout=timeout)
        except TimeoutError as exc:
            raise PlacementError(
                f"job {self.job_id}: restart {attempt} needs {self.world_size} workers, but "
                f"fewer were there after {timeout:g} s; scale the cluster or raise "
                "ddp.rendezvous-timeout"
            ) from exc
        return self.prepare(attempt, self.world_size)

    def prepare(self, attempt: int, workers: int | Sequence[str] | None) -> _Attempt:
        client, settings = self.client, self.settings
        run_id = self.job_id if attempt == 0 else f"{self.job_id}-{attempt}"
        info = client.scheduler_info(n_workers=-1)["workers"]
        if not info:
            raise NoWorkersError(client.scheduler.address)
        chosen = select_workers(
            {addr: w["host"] for addr, w in info.items()}, _resolve_names(info, workers)
        )
        rank0 = order_workers([WorkerInfo(a, info[a]["host"]) for a in chosen])[0]
        probes = client.run(
            bootstrap.probe_worker, run_id, rank0.address, settings.rendezvous_timeout,
            workers=chosen,
        )  # fmt: skip

        def abandon() -> None:
            client.run(bootstrap.drop_store, run_id, workers=[rank0.address], on_error="ignore")

        try:
            for worker, probe in probes.items():
                if probe["busy"]:
                    logger.info(
                        "job %s: worker %s is running %s; this job's rank waits for it "
                        "(up to ddp.rendezvous-timeout for the other ranks)",
                        run_id, worker, probe["busy"],
                    )  # fmt: skip
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
            backend, why = choose_backend(settings.backend, infos)
            plan = plan_ranks(infos)
            # Each attempt splits the data again, for where its ranks and the partitions
            # are now (a restart may run on other workers, after partitions were recomputed).
            shares = (
                self.datasets.plan([p.worker for p in plan])
                if self.datasets is not None
                else [None] * len(plan)
            )
        except BaseException:
            abandon()
            raise
        port = probes[rank0.address]["store_port"]
        self.world_size = len(plan)
        logger.info(
            "job %s: attempt %d, %d ranks on %d hosts, backend %s (%s), rendezvous at %s:%d",
            self.job_id, attempt, len(plan), plan[-1].node_rank + 1, backend, why, rank0.host,
            port,
        )  # fmt: skip
        specs = [
            bootstrap.RankSpec(
                job_id=run_id,
                key=f"dask-ddp-{run_id}-rank-{placement.rank}",
                attempt=attempt,
                backend=backend,
                timeout=settings.timeout,
                rendezvous_timeout=settings.rendezvous_timeout,
                master_addr=rank0.host,
                master_port=port,
                threads_per_rank=settings.threads_per_rank,
                allow_daemon_children=settings.allow_daemon_children,
                tune_malloc=settings.tune_malloc,
                placement=placement,
                event_flush_interval=settings.event_flush_interval,
                max_event_bytes=settings.max_event_bytes,
                datasets=shares[placement.rank],
                **self.rank_options,
            )
            for placement in plan
        ]

        def submit() -> list[Future]:
            futures: list[Future] = []
            try:
                for spec in specs:
                    futures.append(
                        client.submit(
                            bootstrap.run_rank,
                            self.fn,
                            self.args,
                            self.kwargs,
                            spec,
                            key=spec.key,
                            workers=[spec.placement.worker],
                            allow_other_workers=False,
                            pure=False,
                            retries=0,
                        )
                    )
            except BaseException:
                client.cancel(futures)
                abandon()
                raise
            return futures

        return _Attempt(
            run_id, attempt, [p.worker for p in plan], backend, rank0.address, submit, abandon
        )


def launch_script(
    client: Client,
    path: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    workers: int | Sequence[str] | None = None,
    backend: str | None = None,
    timeout: TimeoutLike | None = None,
    on_output: Callable[[OutputLine], Any] | None = None,
) -> Job:
    """Run a torchrun-style script as ``__main__`` on each rank.

    The script is read here and sent to the workers, so it need not exist on them. Each rank
    sees torchrun's environment and ``sys.argv == [path, *args]``; the script calls
    ``init_process_group()`` itself, as it would under torchrun. A non-zero ``sys.exit``
    fails the rank. Every rank's return value is its exit code (0). What the script prints
    reaches the client line by line (:attr:`Job.output`, and ``on_output`` for each line).

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
        on_output=on_output,
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

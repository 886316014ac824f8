"""Start a function as one torch.distributed rank per Dask worker.

:func:`launch` is the full API and returns a :class:`~dask_ddp._client.job.Job`; :func:`run` keeps
dask-pytorch-ddp's signature and returns the rank futures; :func:`launch_script` runs a
torchrun-style script. They check their arguments here, on the client, pickle the function
and its arguments once (the scheduler keeps the bytes and never unpickles them), and hand
the job to dask-ddp's scheduler plugin (:mod:`dask_ddp._scheduler.plugin`), where its supervisor
(:mod:`dask_ddp._scheduler.supervisor`) runs it from then on, whether or not this client stays.
"""

from __future__ import annotations

import getpass
import logging
import os
import socket
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle
from distributed import Client, Future

from .. import config
from .._shared import dask_internals, script, tracebacks
from .._shared.values import JobSpec, MetricRecord, OutputLine
from ..config import TimeoutLike
from ..errors import NotPicklableError, PlacementError
from . import calls
from .job import Job
from .model import JobModel
from .reader import EventReader

logger = logging.getLogger(__name__)

__all__ = ["launch", "launch_script", "run"]


def _pickled(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> bytes:
    """``(fn, args, kwargs)`` pickled once, for the ranks; which part does not pickle, if
    one does not."""
    try:
        return cloudpickle.dumps((fn, args, dict(kwargs)))
    except Exception:
        name = getattr(fn, "__qualname__", repr(fn))
        for what, value in (
            (f"the function {name!r}", fn),
            ("its args", args),
            ("its kwargs", kwargs),
        ):
            try:
                cloudpickle.dumps(value)
            except Exception as exc:
                raise NotPicklableError(what, f"{type(exc).__name__}: {exc}") from exc
        raise


def job_name(fn: Callable[..., Any], args: tuple) -> str:
    """What the job runs, for people: the script's file name, else the function's name.

    >>> job_name(job_name, ())
    'job_name'
    >>> job_name(script.run_script, ("print(1)", "/home/ana/train.py", []))
    'train.py'
    """
    if fn is script.run_script:
        return os.path.basename(args[1])
    if fn is script.run_module or fn is script.run_program:
        return os.path.basename(args[0])
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _check_size(
    workers: int | Sequence[str] | None,
    min_workers: int | None,
    checkpoint_dir: str | os.PathLike[str] | None,
) -> None:
    """Check ``workers=`` and ``min_workers=`` against each other before anything starts
    (the scheduler checks them against the cluster)."""
    if min_workers is None:
        return
    if isinstance(workers, bool) or not isinstance(workers, int):
        raise PlacementError(
            f"min_workers={min_workers!r} needs workers= as a number (the most workers the "
            f"job may use); got workers={workers!r}"
        )
    if isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1:
        raise PlacementError(
            f"min_workers must be a whole number of at least 1; got {min_workers!r}"
        )
    if min_workers > workers:
        raise PlacementError(
            f"min_workers={min_workers} is more than workers={workers}: the job would never "
            "start. Pass min_workers <= workers."
        )
    if min_workers < workers and checkpoint_dir is None:
        raise PlacementError(
            f"workers={workers}, min_workers={min_workers} resizes the job from its last "
            "checkpoint, but it has no checkpoint_dir: pass checkpoint_dir='s3://bucket/run1' "
            "(any fsspec URL the workers share) and save_checkpoint() in the function"
        )


def _check_ranks_per_worker(value: Any) -> int | str:
    """``ranks_per_worker=`` as the job takes it: a whole number of at least 1, or "gpu".

    >>> _check_ranks_per_worker(2), _check_ranks_per_worker("GPU")
    (2, 'gpu')
    >>> _check_ranks_per_worker(0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: ranks_per_worker takes a whole number of at least 1, or "gpu" (a rank ...; got 0
    """
    if isinstance(value, str) and value.strip().lower() == "gpu":
        return "gpu"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(
        'ranks_per_worker takes a whole number of at least 1, or "gpu" (a rank per GPU of '
        f"each worker); got {value!r}"
    )


def _launched_by() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # a container's uid without a name, and no USER/LOGNAME
        user = f"uid {os.getuid()}" if hasattr(os, "getuid") else "?"
    return f"{user}@{socket.gethostname()}"


def launch(
    client: Client,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    workers: int | Sequence[str] | None = None,
    min_workers: int | None = None,
    ranks_per_worker: int | str = 1,
    backend: str | None = None,
    timeout: TimeoutLike | None = None,
    pass_local_rank: bool = False,
    on_report: Callable[[MetricRecord], Any] | None = None,
    on_output: Callable[[OutputLine], Any] | None = None,
    max_restarts: int = 0,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    keep_last: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    checkpoint_mode: str | None = None,
    datasets: Mapping[str, Any] | None = None,
    total_steps: int | None = None,
    name: str | None = None,
    detach: bool = False,
    stall_timeout: TimeoutLike | None = None,
) -> Job:
    """Run ``fn(*args, **kwargs)`` as DDP ranks on the chosen Dask workers: one rank on each
    (``ranks_per_worker=N``: N on each, such as a worker per node holding the node's GPUs).

    Each rank gets torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), a GPU of its own at
    ``cuda:LOCAL_RANK`` (docs/placement.md), and a default process group that is
    initialised before ``fn`` and destroyed after it. Inside ``fn``,
    :func:`dask_ddp.get_context` describes the rank.

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
        Every worker (default), N workers, or these worker addresses (or Dask worker
        names). The job takes its workers whole: while another job holds some of them it
        waits (``job.state`` is ``"waiting"``) holding none, so concurrent jobs run one after
        the other and never deadlock at the rendezvous.
    min_workers : int, optional
        With ``workers=N``: start as soon as ``min_workers`` workers are free and run
        elastically between the two (see docs/elastic.md). A lost worker shrinks the job:
        it resumes from its last checkpoint on the workers left; workers that join grow
        it at its next checkpoint. Neither counts against ``max_restarts``; more than
        ``ddp.max-resizes`` resizes in an hour fail the job. Needs ``checkpoint_dir``.
        Default: ``workers``, a fixed size. The cluster may have fewer than N workers (an
        adaptive cluster grows for the job); fewer than ``min_workers`` for longer than
        ``ddp.scale-timeout`` fails the job with :class:`~dask_ddp.ScaleTimeoutError`.
    ranks_per_worker : int or "gpu", optional
        How many ranks each worker runs, each in a process of its own (default 1). ``"gpu"``:
        as many as the worker has GPUs (its ``GPU`` resource, else the GPUs it sees): one
        Dask worker per node, ``dask worker --nworkers 1 --resources GPU=8``, trains on all
        eight. The world size is the workers times this; ``workers=`` and ``min_workers=``
        (and an elastic job's resizes) still count workers, whole. The ranks of a host see
        all its GPUs, each its own at ``cuda:LOCAL_RANK`` (docs/placement.md).
    backend : {"gloo", "nccl", "cpu:gloo,cuda:nccl", None}, optional
        torch.distributed backend; ``None`` reads ``ddp.backend`` (default: nccl when every
        worker sees a GPU, else gloo). ``"cpu:gloo,cuda:nccl"`` gives one process group
        both, as DCP's ``async_save`` needs (docs/checkpoints.md).
    timeout : float, str or timedelta, optional
        Process-group timeout: the longest any collective may wait. Seconds, or a string
        like ``"10 minutes"``. ``None`` reads ``ddp.timeout``.
    pass_local_rank : bool, optional
        Also pass ``local_rank=`` to ``fn`` (as dask-pytorch-ddp did).
    on_report : callable, optional
        Called on this client with each :class:`~dask_ddp.MetricRecord` the ranks send
        with :func:`dask_ddp.report`, in each rank's order, as they arrive: forward them to
        TensorBoard, MLflow or a file. It runs on a thread of its own, never on a rank or
        on the client's event loop; if it raises, the error is logged and it is not called
        again for this job. It runs only while this client is there: a job outlives its
        client, its callbacks do not (see docs/jobs.md).
    on_output : callable, optional
        Called on this client with each :class:`~dask_ddp.OutputLine` a rank prints
        (``print()``, ``sys.stdout``, ``sys.stderr``) while ``fn`` runs, in each rank's
        order; like ``on_report``. The lines are also in :attr:`Job.output` and the live
        view, and still in the worker's own log.
    max_restarts : int, optional
        How many times to place the job again and rerun ``fn`` when a rank's worker is
        lost (killed, out of memory, removed) in a fixed-size job, a rank raises
        :class:`~dask_ddp.RetryableError`, or what runs the job fails a rank (an
        :class:`~dask_ddp.InfrastructureError`: the rendezvous, the job's store, a sample
        fetch). Each rerun sees ``get_context().attempt`` incremented and
        ``get_checkpoint()`` returning the last checkpoint. 0 (default) fails the job
        instead.
    checkpoint_dir : str, optional
        Any fsspec URL (``s3://bucket/run1``, a local path the workers share) where
        :func:`dask_ddp.save_checkpoint` writes and :func:`dask_ddp.get_checkpoint` reads.
    keep_last : int, optional
        Keep only the newest N checkpoints (default: all).
    storage_options : mapping, optional
        fsspec options for ``checkpoint_dir`` (for example
        ``{"client_kwargs": {"endpoint_url": "http://minio:9000"}}``).
    checkpoint_mode : {"async", "sync", None}, optional
        ``"async"``: :func:`dask_ddp.save_checkpoint` returns once the state is copied to
        CPU memory and the checkpoint is written in the background (and also kept in
        another worker's memory, for restarts); ``"sync"``: it returns once the checkpoint
        is written. ``None`` reads ``ddp.checkpoint.mode`` (default ``"async"``). See
        docs/checkpoints.md.
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
    total_steps : int, optional
        How many steps the function trains (the ``step=`` it reports counts them from 0):
        the live view's bars then show steps done of it, percent, elapsed and time left, as
        tqdm does. Without it the bars are relative to the leading rank.
    name : str, optional
        A name for the job, unique among the cluster's running jobs: find it again with
        ``dask_ddp.attach(client, name)``. Default: the function's name (not unique).
    detach : bool, optional
        Run to the end with no client at all. By default a job whose last client leaves
        goes on for ``ddp.orphan-timeout`` (10 minutes) for a client to attach, then is
        cancelled (see docs/jobs.md).
    stall_timeout : float, str or timedelta, optional
        A running job none of whose ranks sends anything (a record, a checkpoint, a
        printed line) for this long, with stacks that do not change, is ``stalled``: its
        history says so and names the ranks outside a collective, the likely cause
        (:meth:`Job.stacks` shows every rank's stack). ``0`` turns it off; ``None`` reads
        ``ddp.stall-timeout`` (2 minutes). ``ddp.stall-action`` says what a stall does.

    Returns
    -------
    Job
        Handle with the rank futures, ``result()``, ``metrics``, ``cancel()`` and a live
        notebook view. The job itself lives in the cluster (see :func:`dask_ddp.attach`).

    Raises
    ------
    NoWorkersError
        The cluster has no workers (and does not scale itself: on an adaptive cluster, or
        for an elastic job, ``launch`` waits for workers up to ``ddp.scale-timeout``).
    SchedulerPluginError
        The scheduler does not take dask-ddp's plugin (see docs/deploy.md).
    JobNameTakenError
        ``name=`` is the name of a job the cluster runs now.
    PlacementError
        ``workers=`` asks for more workers than there are, or names unknown ones;
        ``min_workers=`` is more than ``workers=``, or less without ``checkpoint_dir``.
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
    The job runs on the scheduler, in dask-ddp's plugin (installed by the first launch, or
    by ``dask scheduler --preload dask_ddp``), which places it on whole sets of workers: a
    job launched while others hold the workers it needs waits for them without holding
    any (``launch`` returns at once; :meth:`Job.result` waits). A worker busy with another
    client's task still queues this job's rank, whose peers wait up to
    ``ddp.rendezvous-timeout``.

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
        min_workers=min_workers,
        ranks_per_worker=ranks_per_worker,
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
        checkpoint_mode=checkpoint_mode,
        datasets=datasets,
        total_steps=total_steps,
        name=name,
        detach=detach,
        stall_timeout=stall_timeout,
    )


def job_spec(
    client: Client,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    *,
    pass_local_rank: bool,
    init_process_group: bool,
    workers: int | Sequence[str] | None = None,
    backend: str | None = None,
    timeout: TimeoutLike | None = None,
    min_workers: int | None = None,
    ranks_per_worker: int | str = 1,
    max_restarts: int = 0,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    keep_last: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    checkpoint_mode: str | None = None,
    datasets: Mapping[str, Any] | None = None,
    total_steps: int | None = None,
    name: str | None = None,
    detach: bool = False,
    adaptive: bool | None = None,
    stall_timeout: TimeoutLike | None = None,
) -> tuple[JobSpec, Any]:
    """The job's :class:`JobSpec`, its arguments checked and pickled once (and its
    datasets persisted and published, returned with it), as ``launch()`` and each trial of
    ``sweep()`` send it; the plugin installed."""
    args = tuple(args)
    kwargs = dict(kwargs or {})
    settings = config.resolve(
        backend=backend, timeout=timeout, checkpoint_mode=checkpoint_mode,
        stall_timeout=stall_timeout,
    )  # fmt: skip
    if total_steps is not None and (isinstance(total_steps, bool) or total_steps < 1):
        raise ValueError(f"total_steps must be a whole number of at least 1; got {total_steps!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a whole number, 0 or more; got {max_restarts!r}")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ValueError(f"name= takes a non-empty str; got {name!r}")
    _check_size(workers, min_workers, checkpoint_dir)
    ranks_per_worker = _check_ranks_per_worker(ranks_per_worker)
    if isinstance(workers, (list, tuple)):
        workers = [str(w) for w in workers]
    payload = _pickled(fn, args, kwargs)
    sources = tracebacks.Sources(fn)  # where its code sent by value came from
    calls.install(client)
    job_id = uuid.uuid4().hex[:12]
    persisted = None
    if datasets:
        # Imported here: the data modules (PIL, fsspec, dask.dataframe) cost every launch
        # ~80 ms and 8 MB otherwise, and most jobs bring no Dask collection.
        from ..data import _collection_plan as _collections

        persisted = _collections._persist_datasets(client, datasets, job_id)
        persisted.publish()  # the job's supervisor holds them from now on
    spec = JobSpec(
        job_id=job_id,
        name=name or job_name(fn, args),
        named=name is not None,
        payload=payload,
        settings=settings,
        workers=workers,
        min_workers=min_workers,
        ranks_per_worker=ranks_per_worker,
        pass_local_rank=pass_local_rank,
        init_process_group=init_process_group,
        checkpoint_dir=None if checkpoint_dir is None else os.fspath(checkpoint_dir),
        keep_last=keep_last,
        storage_options=dict(storage_options) if storage_options else None,
        max_restarts=max_restarts,
        total_steps=total_steps,
        client=client.id,
        launched_by=_launched_by(),
        detach=detach,
        datasets=tuple(persisted.specs) if persisted is not None else (),
        datasets_name=persisted.name if persisted is not None else None,
        adaptive=dask_internals.is_adaptive(client) if adaptive is None else adaptive,
        sources=sources,
    )
    return spec, persisted


def _launch(
    client: Client,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    *,
    on_report: Callable[[MetricRecord], Any] | None = None,
    on_output: Callable[[OutputLine], Any] | None = None,
    **options: Any,
) -> Job:
    """Launch the job ``job_spec`` builds from ``options`` (the public functions' own, by
    name), and follow it with ``on_report`` and ``on_output``."""
    spec, persisted = job_spec(client, fn, args, kwargs, **options)
    model = JobModel(spec.job_id, spec.name)
    model.total_steps = spec.total_steps
    reader = EventReader(client, model, on_report=on_report, on_output=on_output)
    try:
        # The cluster subscribes this client too, before any rank reports.
        state = calls.submit_job(client, spec, reader.follow)
    except BaseException:
        reader.stop()
        if persisted is not None:
            client.unpublish_dataset(persisted.name)
        raise
    model.apply_state(state)
    reader.start()
    return Job(client, model, reader, spec.sources)


def launch_script(
    client: Client,
    path: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    module: bool = False,
    no_python: bool = False,
    workers: int | Sequence[str] | None = None,
    min_workers: int | None = None,
    ranks_per_worker: int | str = 1,
    backend: str | None = None,
    timeout: TimeoutLike | None = None,
    on_report: Callable[[MetricRecord], Any] | None = None,
    on_output: Callable[[OutputLine], Any] | None = None,
    max_restarts: int = 0,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    keep_last: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    checkpoint_mode: str | None = None,
    name: str | None = None,
    detach: bool = False,
) -> Job:
    """Run a torchrun-style script as ``__main__`` on each rank, as ``python path args``.

    The script is read here and sent to the workers, so it need not exist on them. Each rank
    sees torchrun's environment (``TORCHELASTIC_RESTART_COUNT`` and
    ``TORCHELASTIC_MAX_RESTARTS`` included) and ``sys.argv == [path, *args]``; the script
    calls ``init_process_group()`` itself, as it would under torchrun. Its module is
    ``sys.modules["__main__"]`` while it runs (pickle finds its classes) and its folder is
    first on ``sys.path``: workers that see the folder at the same path import from it, and
    the others get a copy of the modules the script imports from there, shipped with the
    job (at most ``ddp.script-modules-limit`` in all; see docs/scripts.md). A non-zero
    ``sys.exit`` fails the rank. Every rank's return value is its exit code (0). What the
    script prints reaches the client line by line (:attr:`Job.output`, and ``on_output``
    for each line).

    Parameters
    ----------
    client : distributed.Client
        A synchronous client of the cluster to train on.
    path : str or os.PathLike
        The script's path; with ``module=True`` a module name, with ``no_python=True`` a
        program.
    args : sequence of str, optional
        The script's command-line arguments.
    module : bool, optional
        ``path`` is a module, run as ``python -m path args`` (torchrun's ``-m``): found
        from this process's working directory, which is then first on the ranks'
        ``sys.path``; a module under it is shipped as a script's folder is, an installed
        one must be installed on the workers.
    no_python : bool, optional
        ``path`` is a program, not Python (torchrun's ``--no-python``): each rank runs
        ``path args`` as a process of its own with torchrun's environment, on the worker's
        machine (it must be there); its output lines are the rank's, a non-zero exit status
        fails the rank, and it is stopped when the rank is.
    workers, min_workers, ranks_per_worker, backend, timeout, max_restarts : optional
        As for :func:`launch`. A restarted script runs again from its start.
    checkpoint_dir, keep_last, storage_options, checkpoint_mode : optional
        As for :func:`launch`: the script resumes from :func:`dask_ddp.get_checkpoint`, or
        from snapshot files of its own.
    on_report : callable, optional
        Called with each :class:`~dask_ddp.MetricRecord` the script reports
        (:func:`dask_ddp.report`, or a library's dask-ddp logger), as for :func:`launch`.
    on_output : callable, optional
        Called with each :class:`~dask_ddp.OutputLine` the script prints, as for
        :func:`launch`.
    name : str, optional
        A name for the job, unique among the cluster's running jobs, to find it again with
        ``dask_ddp.attach(client, name)``. Default: the script's file name (not unique).
    detach : bool, optional
        Run to the end with no client at all (see :func:`launch`).

    Returns
    -------
    Job
        As :func:`launch` returns.

    Raises
    ------
    ScriptModulesTooLargeError
        The modules the script imports from its folder are over the limit and some
        workers do not see them at that path.
    SyntaxError
        The script, or a module it imports from its folder, does not compile.
    ModuleNotFoundError
        ``module=True`` and ``python -m path`` would not find the module here either.
    ValueError
        Both ``module=True`` and ``no_python=True``.

    And what :func:`launch` raises.

    Examples
    --------
    >>> dask_ddp.launch_script(client, "train.py", ["--epochs", "1"]).result()  # doctest: +SKIP
    [0, 0]
    >>> dask_ddp.launch_script(client, "train.py", max_restarts=3,
    ...                        checkpoint_dir="s3://bucket/run1")  # doctest: +SKIP
    >>> job = dask_ddp.launch_script(client, "train.py", name="nightly", detach=True)
    ...                                                            # doctest: +SKIP
    >>> dask_ddp.launch_script(client, "trainer.main", module=True)  # doctest: +SKIP
    """
    return _launch_script(
        client, path, args, module=module, no_python=no_python, workers=workers,
        min_workers=min_workers, ranks_per_worker=ranks_per_worker, backend=backend,
        timeout=timeout, on_report=on_report, on_output=on_output, max_restarts=max_restarts,
        checkpoint_dir=checkpoint_dir,
        keep_last=keep_last, storage_options=storage_options, checkpoint_mode=checkpoint_mode,
        name=name, detach=detach,
    )  # fmt: skip


def _launch_script(
    client: Client,
    path: str | os.PathLike[str],
    args: Sequence[str],
    *,
    module: bool,
    no_python: bool,
    cluster_may_grow: bool | None = None,
    **options: Any,
) -> Job:
    """:func:`launch_script`; ``cluster_may_grow=True`` (the command line with
    ``--scheduler``): a job of more workers than the cluster has waits for them (and asks an
    adaptive cluster for them) up to ``ddp.scale-timeout``, as on a cluster object that
    adapts."""
    if module and no_python:
        raise ValueError(
            "module=True runs a Python module and no_python=True a program that is not "
            "Python: pass one of them (as torchrun refuses -m with --no-python)"
        )
    path = os.fspath(path)
    argv = [str(a) for a in args]
    if no_python:
        return _launch(
            client, script.run_program, (path, argv), None, pass_local_rank=False,
            init_process_group=False, adaptive=cluster_may_grow, **options,
        )  # fmt: skip
    if module:
        files = script.module_files(path)
        fn, fn_args = script.run_module, (path, argv)
    else:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        files = script.script_files(path)
        fn, fn_args = script.run_script, (source, path, argv)
    limit = config.script_modules_limit()
    sizes = {name: len(data) for name, data in files.modules.items()}
    if sum(sizes.values()) > limit:
        # Too large to ship: fine only where every worker already sees them at that path.
        seen = client.run(script.sees_modules, files.folder, files.digests)
        if not all(seen.values()):
            raise script.ScriptModulesTooLargeError(path, sizes, limit)
        files = files.without_modules()
    job = _launch(
        client, fn, fn_args, {"files": files}, pass_local_rank=False,
        init_process_group=False, adaptive=cluster_may_grow, **options,
    )  # fmt: skip
    if files.modules:
        logger.info(
            "job %s: shipped %s (%d bytes), which %s imports from %s, for workers that do "
            "not see that folder", job.job_id, ", ".join(sorted(files.modules)),
            sum(sizes.values()), os.path.basename(path), files.folder,
        )  # fmt: skip
    return job


def run(
    client: Client,
    fn: Callable[..., Any],
    *args: Any,
    backend: str | None = None,
    pass_local_rank: bool = False,
    ranks_per_worker: int | str = 1,
    **kwargs: Any,
) -> list[Future]:
    """dask-pytorch-ddp's ``run()``: start ``fn`` on every worker, return the futures.

    A drop-in for ``dask_pytorch_ddp.dispatch.run``: same signature, one future per rank in
    rank order, each resolving to that rank's return value. Positional ``args`` reach
    ``fn`` (the predecessor's ``TypeError`` there is fixed), and a failing rank still stops
    the others. ``ranks_per_worker`` is :func:`launch`'s (a keyword argument of that name
    is not passed on to ``fn``). Prefer :func:`launch` for new code: it returns a
    :class:`~dask_ddp._client.job.Job`.

    Examples
    --------
    >>> from distributed import wait
    >>> futures = dask_ddp.dispatch.run(client, train, cfg)  # doctest: +SKIP
    >>> wait(futures); [f.result() for f in futures]        # doctest: +SKIP
    """
    job = launch(
        client, fn, args, kwargs, backend=backend, pass_local_rank=pass_local_rank,
        ranks_per_worker=ranks_per_worker,
    )  # fmt: skip
    return job.futures  # waits while other jobs hold its workers

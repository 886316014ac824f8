"""``python -m dask_ddp [--scheduler ADDR] [--nworkers N] script.py ARGS...``

Runs a torchrun-style script as ``__main__`` on N Dask workers, one rank each, with the
environment torchrun would give it. Without ``--scheduler`` it starts a LocalCluster of
N worker processes (default 2) for the run. Exits with 0 when every rank succeeded, 1 with
the failing rank's traceback otherwise, 2 for bad arguments.

Only the standard library is imported until the arguments are checked, so ``--help`` and
usage errors answer at once. A LocalCluster of its own starts its worker processes first
(they import torch while the command imports the rest), has no dashboard unless
``--dashboard`` asks for one, and is torn down at once when the job ends: its workers die
with the command (see :mod:`dask_ddp._preload`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

_EPILOG = """\
Options go before the script: everything after it is passed to the script.

examples:
  %(prog)s train.py --epochs 3
  %(prog)s --scheduler tcp://scheduler:8786 --nworkers 8 train.py --lr 0.1

Each rank sees RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT as under
torchrun and calls init_process_group() itself. What the ranks print is shown here with a
[rank N] prefix (with a LocalCluster the workers share this terminal and print directly).
Settings: DASK_DDP__TIMEOUT, DASK_DDP__RENDEZVOUS_TIMEOUT, ... (see dask_ddp.yaml).
exit status: 0 every rank succeeded, 1 a rank failed or the cluster was unusable, 2 usage.
"""


def _prog() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "dask-ddp" if name.startswith("dask-ddp") else "python -m dask_ddp"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_prog(),
        description="Run a torchrun-style training script with one rank per Dask worker.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [-h] [--scheduler ADDR] [--nworkers N] [--backend {gloo,nccl}] "
        "[--dashboard] script [args ...]",
    )
    parser.add_argument(
        "--scheduler", metavar="ADDR", help="Dask scheduler address (default: a LocalCluster)"
    )
    parser.add_argument(
        "--nworkers",
        metavar="N",
        type=int,
        default=None,
        help="number of ranks (default: every worker, or 2 for a LocalCluster)",
    )
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with GPUs"
    )
    parser.add_argument(
        "--dashboard",
        action="store_true",
        help="serve the LocalCluster's Dask dashboard (on a free port, logged at start)",
    )
    parser.add_argument("script", help="path of the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _print_line(line: object) -> None:
    rank, stream, text = line  # an OutputLine
    print(f"[rank {rank}] {text}", file=sys.stderr if stream == "stderr" else sys.stdout)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m dask_ddp`` and the ``dask-ddp`` command."""
    parser = _parser()
    opts = parser.parse_args(argv)
    if opts.nworkers is not None and opts.nworkers < 1:
        parser.error("--nworkers must be at least 1")
    if not os.path.isfile(opts.script):
        parser.error(f"no script at {opts.script!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if opts.scheduler:
        return _run_on_scheduler(opts)
    return _run_on_local_cluster(opts)


def _quiet_job_failure() -> None:
    """A failed job is printed by the command, whole; its supervisor's line for the failure
    (the command's own LocalCluster runs it, in this process) would repeat it."""
    logging.getLogger("dask_ddp.supervise").addFilter(
        lambda record: getattr(record, "job_state", None) != "failed"
    )


def _import_dispatch() -> threading.Thread:
    """Import the client's side of dask_ddp in the background (while workers start)."""
    thread = threading.Thread(
        target=__import__, args=("dask_ddp.dispatch",), name="dask-ddp-import", daemon=True
    )
    thread.start()
    return thread


def _run_on_scheduler(opts: argparse.Namespace) -> int:
    importing = _import_dispatch()
    from distributed import Client

    try:
        client = Client(opts.scheduler, timeout="30s")
    except (OSError, TimeoutError) as exc:
        print(f"dask_ddp: cannot reach the scheduler {opts.scheduler}: {exc}", file=sys.stderr)
        return 1
    try:
        importing.join()
        return _run_job(client, opts, own_cluster=False)
    finally:
        client.close(timeout=2)


def _run_on_local_cluster(opts: argparse.Namespace) -> int:
    n = opts.nworkers or 2
    log = logging.getLogger("dask_ddp")
    log.info("no --scheduler given: starting a LocalCluster of %d worker processes", n)
    importing = _import_dispatch()
    from distributed import Client, LocalCluster

    scratch = tempfile.mkdtemp(prefix="dask-ddp-")
    code = 1
    try:
        cluster = LocalCluster(
            n_workers=n,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            scheduler_kwargs={"dashboard": opts.dashboard},
            local_directory=scratch,
            preload=["dask_ddp._preload"],
        )
        if opts.dashboard:
            log.info("Dask dashboard: %s", cluster.dashboard_link)
        client = Client(cluster)
        importing.join()
        code = _run_job(client, opts, own_cluster=True)
    finally:
        _exit_now(code, scratch)
    return code  # not reached: _exit_now does not return


def _exit_now(code: int, scratch: str) -> None:
    """End the command at once, with every process it started.

    The job is over and its results are printed: a graceful close of the cluster would
    wait for workers that may be stuck in a collective or still tearing torch down (the
    nanny waits seconds before it kills them). The workers die with this process
    (``PR_SET_PDEATHSIG``, set by :mod:`dask_ddp._preload`); the rest of its children
    (the spawn context's resource tracker, a worker that had not yet set it) are killed
    here.
    """
    import psutil

    logging.disable(logging.CRITICAL)  # the nanny would report each worker it sees killed
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    shutil.rmtree(scratch, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_job(client: Any, opts: argparse.Namespace, *, own_cluster: bool) -> int:
    from .dispatch import launch_script
    from .errors import DaskDDPError

    log = logging.getLogger("dask_ddp")
    _quiet_job_failure()
    if opts.nworkers:
        have = len(client.scheduler_info(n_workers=-1)["workers"])
        if have < opts.nworkers:
            log.info("waiting for %d workers (the cluster has %d)", opts.nworkers, have)
        try:
            client.wait_for_workers(opts.nworkers, timeout="120s")
        except TimeoutError:
            have = len(client.scheduler_info(n_workers=-1)["workers"])
            print(
                f"dask_ddp: --nworkers {opts.nworkers} but the cluster has {have} workers "
                "after 120 s; start more workers or ask for fewer",
                file=sys.stderr,
            )
            return 1
    job = launch_script(
        client,
        opts.script,
        opts.args,
        workers=opts.nworkers,
        backend=opts.backend,
        # A LocalCluster's workers print to this terminal themselves.
        on_output=None if own_cluster else _print_line,
    )
    log.info("job %s: %d ranks running %s", job.job_id, job.world_size, opts.script)
    try:
        job.result()
    except DaskDDPError as exc:
        shown = str(exc)
        print(f"dask_ddp: {shown}", file=sys.stderr)
        rank_traceback = getattr(exc, "rank_traceback", "")
        if rank_traceback and rank_traceback not in shown:
            print(rank_traceback.rstrip(), file=sys.stderr)
        if own_cluster:
            return 1  # everything it started ends with the command
        # On a shared cluster, leave it clean: a stuck peer's worker is restarted.
        if not job.wait_stopped(timeout=60):
            log.warning("job %s: its ranks were still being stopped at exit", job.job_id)
        return 1
    log.info("job %s: every rank finished", job.job_id)
    if job.metrics:  # what the script reported (report(), or a library's dask_ddp logger)
        from .view import progress_line

        log.info("job %s: %d reports; last: %s", job.job_id, len(job.metrics),
                 progress_line(job.view_state()))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m dask_ddp [--scheduler ADDR] [--nworkers N] script.py ARGS...``

Runs a torchrun-style script as ``__main__`` on N Dask workers, one rank each, with the
environment torchrun would give it. Without ``--scheduler`` it starts a LocalCluster of
N worker processes (default 2) for the run. Exits with 0 when every rank succeeded, 1 with
the failing rank's traceback otherwise.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from distributed import Client, LocalCluster

from .dispatch import launch_script
from .errors import DaskDDPError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dask_ddp",
        description="Run a torchrun-style training script with one rank per Dask worker.",
    )
    parser.add_argument(
        "--scheduler", help="Dask scheduler address (default: start a LocalCluster)"
    )
    parser.add_argument(
        "--nworkers",
        type=int,
        default=None,
        help="number of ranks (default: every worker, or 2 for a LocalCluster)",
    )
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: automatic)")
    parser.add_argument("script", help="path of the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m dask_ddp`` and the ``dask-ddp`` command."""
    opts = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    log = logging.getLogger("dask_ddp")
    if opts.nworkers is not None and opts.nworkers < 1:
        _parser().error("--nworkers must be at least 1")
    cluster = None
    if opts.scheduler:
        client = Client(opts.scheduler)
    else:
        n = opts.nworkers or 2
        log.info("no --scheduler given: starting a LocalCluster of %d worker processes", n)
        cluster = LocalCluster(
            n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0"
        )
        client = Client(cluster)
    try:
        if opts.nworkers:
            client.wait_for_workers(opts.nworkers, timeout="120s")
        job = launch_script(
            client, opts.script, opts.args, workers=opts.nworkers, backend=opts.backend
        )
        log.info("job %s: %d ranks running %s", job.job_id, job.world_size, opts.script)
        try:
            job.result()
        except DaskDDPError as exc:
            print(f"dask_ddp: {exc}", file=sys.stderr)
            return 1
        log.info("job %s: every rank finished", job.job_id)
        return 0
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


if __name__ == "__main__":
    sys.exit(main())

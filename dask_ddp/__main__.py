"""``python -m dask_ddp [--scheduler ADDR] [--nworkers N] script.py ARGS...``

Runs a torchrun-style script as ``__main__`` on N Dask workers, one rank each, with the
environment torchrun would give it. Without ``--scheduler`` it starts a LocalCluster of
N worker processes (default 2) for the run. Exits with 0 when every rank succeeded, 1 with
the failing rank's traceback otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

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
        "script [args ...]",
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
    log = logging.getLogger("dask_ddp")
    # A failed job is printed below, whole; the job's own one-line warning would repeat it.
    logging.getLogger("dask_ddp.job").addFilter(
        lambda record: not str(record.msg).startswith("job %s failed")
    )

    from distributed import Client, LocalCluster

    from .dispatch import launch_script
    from .errors import DaskDDPError

    cluster = None
    try:
        if opts.scheduler:
            client = Client(opts.scheduler, timeout="30s")
        else:
            n = opts.nworkers or 2
            log.info("no --scheduler given: starting a LocalCluster of %d worker processes", n)
            cluster = LocalCluster(
                n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0"
            )
            client = Client(cluster)
            # Its workers log to this terminal: keep the job's own report of a failed rank
            # the only one (plugins also reach workers that restart).
            client.register_plugin(_QuietRankFailures(), name="dask-ddp-quiet-rank-failures")
    except (OSError, TimeoutError) as exc:
        print(f"dask_ddp: cannot reach the scheduler {opts.scheduler}: {exc}", file=sys.stderr)
        return 1
    try:
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
            on_output=_print_line if cluster is None else None,
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
            # Workers that ran torch can take a few seconds to exit; the nanny's warning
            # about it ("still alive after 4.0 seconds, killing") is noise at this point.
            logging.getLogger("distributed.nanny").setLevel(logging.ERROR)
            cluster.close()


class _RankComputeFailedFilter(logging.Filter):
    """Drops a worker's "Compute Failed" record for a rank task (``dask-ddp-...``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg, args = record.msg, record.args
        return not (
            isinstance(msg, str)
            and msg.startswith("Compute Failed")
            and isinstance(args, tuple)
            and bool(args)
            and str(args[0]).startswith("dask-ddp-")
        )


class _QuietRankFailures(WorkerPlugin):
    """On the CLI's own LocalCluster, whose workers print to the user's terminal: a failed
    rank's traceback is printed once, by the CLI, not again by each worker's log."""

    def setup(self, worker: Any) -> None:
        logging.getLogger("distributed.worker").addFilter(_RankComputeFailedFilter())


if __name__ == "__main__":
    sys.exit(main())

"""``python -m dask_ddp [--scheduler ADDR] [--nworkers N|MIN:MAX] [--max-restarts N]
[--checkpoint-dir URL] script.py ARGS...``

Runs a torchrun-style script as ``__main__`` on N Dask workers, one rank each, with the
environment torchrun would give it. Without ``--scheduler`` it starts a LocalCluster of
N worker processes (default 2; MAX of a range) for the run. Exits with 0 when every rank
succeeded, 1 with the failing rank's traceback otherwise, 2 for bad arguments.

Quiet, as torchrun is: it prints what the script prints, then one line of outcome (with
the restarts and resizes there were, and the last values the script reported). Dask's and
dask_ddp's own logs show from WARNING up, every INFO line with ``-v``.

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
  %(prog)s --nworkers 2:4 --max-restarts 3 --checkpoint-dir s3://bucket/run1 train.py

Each rank sees RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and
TORCHELASTIC_RESTART_COUNT as under torchrun and calls init_process_group() itself. A
restarted script runs again from its start and resumes from dask_ddp.get_checkpoint() or
from snapshot files of its own (docs/scripts.md). What the ranks print is shown here with a
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
        usage="%(prog)s [-h] [-v] [--scheduler ADDR] [--nworkers N|MIN:MAX] "
        "[--max-restarts N] [--checkpoint-dir URL] [--backend {gloo,nccl}] [--dashboard] "
        "script [args ...]",
    )
    parser.add_argument(
        "--scheduler", metavar="ADDR", help="Dask scheduler address (default: a LocalCluster)"
    )
    parser.add_argument(
        "--nworkers",
        metavar="N|MIN:MAX",
        default=None,
        help="number of ranks (default: every worker, or 2 for a LocalCluster); MIN:MAX, as "
        "torchrun's --nnodes, runs elastic: it starts with MIN, shrinks when workers are lost "
        "and grows as workers join, resuming from a checkpoint each time",
    )
    parser.add_argument(
        "--max-restarts",
        metavar="N",
        type=int,
        default=0,
        help="restart the ranks from the start of the script up to N times after a failure "
        "(a lost worker, dask_ddp.RetryableError); default 0",
    )
    parser.add_argument(
        "--checkpoint-dir",
        metavar="URL",
        default=None,
        help="where dask_ddp.save_checkpoint() writes and get_checkpoint() reads: a folder or "
        "fsspec URL (s3://bucket/run1) every worker reaches",
    )
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with GPUs"
    )
    parser.add_argument(
        "--dashboard",
        action="store_true",
        help="serve the LocalCluster's Dask dashboard on a free port (with --scheduler: show "
        "the scheduler's), and print its address",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show Dask's and dask_ddp's INFO logs"
    )
    parser.add_argument("script", help="path of the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _parse_nworkers(value: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` (torchrun's ``--nnodes``) as ``(MIN, MAX)``.

    >>> _parse_nworkers("4"), _parse_nworkers("2:4")
    ((4, 4), (2, 4))
    >>> _parse_nworkers("3:2")
    Traceback (most recent call last):
    ...
    ValueError: --nworkers 3:2: MIN is more than MAX; give MIN:MAX with MIN <= MAX, as 2:3
    """
    low, _, high = value.partition(":")
    try:
        lowest, highest = int(low), int(high or low)
    except ValueError:
        raise ValueError(
            f"--nworkers {value}: give a number of workers (4) or a range MIN:MAX (2:4)"
        ) from None
    if lowest < 1:
        raise ValueError(f"--nworkers {value}: --nworkers must be at least 1")
    if lowest > highest:
        raise ValueError(
            f"--nworkers {value}: MIN is more than MAX; give MIN:MAX with MIN <= MAX, as "
            f"{highest}:{lowest}"
        )
    return lowest, highest


_OPT_IN = """\
# /// script
# [tool.dask-ddp]
# resume = "own-snapshots"
# ///"""


def _check(parser: argparse.ArgumentParser, opts: argparse.Namespace) -> None:
    """Every check that needs no cluster, before anything starts: exits with status 2."""
    from .script import ScriptSettingsError, script_settings

    opts.size = None
    if opts.nworkers is not None:
        try:
            opts.size = _parse_nworkers(opts.nworkers)
        except ValueError as exc:
            parser.error(str(exc))
    if opts.max_restarts < 0:
        parser.error(f"--max-restarts {opts.max_restarts}: give 0 or more restarts")
    if not os.path.isfile(opts.script):
        parser.error(f"no script at {opts.script!r}")
    with open(opts.script, encoding="utf-8") as f:
        source = f.read()
    try:
        opts.own_snapshots = script_settings(source, opts.script).get("resume") == "own-snapshots"
    except ScriptSettingsError as exc:
        parser.error(str(exc))
    elastic = opts.size is not None and opts.size[0] < opts.size[1]
    if elastic and opts.checkpoint_dir is None and not opts.own_snapshots:
        parser.error(
            f"--nworkers {opts.nworkers} resizes the job, and each resize restarts the script, "
            "which must then resume where it was. Pass --checkpoint-dir URL (a folder every "
            "worker reaches; the script saves with dask_ddp.save_checkpoint() and resumes with "
            "dask_ddp.get_checkpoint()), or, if the script resumes from snapshot files of its "
            f"own as torchrun scripts do, say so at its top:\n{_OPT_IN}\n(see docs/scripts.md)"
        )


def _print_line(line: object) -> None:
    rank, stream, text = line  # an OutputLine
    # Flushed: the command's output may be a pipe (| tee, a test), read as it comes.
    out = sys.stderr if stream == "stderr" else sys.stdout
    print(f"[rank {rank}] {text}", file=out, flush=True)


def _say(text: str) -> None:
    """One line from the command itself, on stderr, whatever the log level."""
    print(f"dask_ddp: {text}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m dask_ddp`` and the ``dask-ddp`` command."""
    parser = _parser()
    opts = parser.parse_args(argv)
    _check(parser, opts)
    # Before distributed is imported: it then logs through this handler (it adds its own
    # only where the root logger has none), which shows INFO lines with -v only.
    handler = logging.StreamHandler()
    handler.setLevel(logging.INFO if opts.verbose else logging.WARNING)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(message)s", handlers=[handler]
    )
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
        _say(f"cannot reach the scheduler {opts.scheduler}: {exc}")
        return 1
    scratch = tempfile.mkdtemp(prefix="dask-ddp-")
    try:
        if opts.dashboard:
            _say(f"Dask dashboard: {client.dashboard_link}")
        importing.join()
        return _run_job(client, opts, scratch, own_cluster=False)
    finally:
        client.close(timeout=2)
        shutil.rmtree(scratch, ignore_errors=True)


def _run_on_local_cluster(opts: argparse.Namespace) -> int:
    n = opts.size[1] if opts.size else 2
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
            silence_logs=False if opts.verbose else logging.WARNING,
        )
        if opts.dashboard:
            _say(f"Dask dashboard: {cluster.dashboard_link}")
        client = Client(cluster)
        importing.join()
        code = _run_job(client, opts, scratch, own_cluster=True)
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


def _wait_for_workers(client: Any, opts: argparse.Namespace) -> bool:
    """Wait for the workers the job needs to start (MIN of a range); False after 120 s."""
    if opts.size is None:
        return True
    need = opts.size[0]
    have = len(client.scheduler_info(n_workers=-1)["workers"])
    if have < need:
        _say(f"waiting for {need} workers (the cluster has {have})")
    try:
        client.wait_for_workers(need, timeout="120s")
    except TimeoutError:
        have = len(client.scheduler_info(n_workers=-1)["workers"])
        _say(
            f"--nworkers {opts.nworkers} but the cluster has {have} workers after 120 s; "
            "start more workers or ask for fewer"
        )
        return False
    return True


def _outcome(job: Any, seconds: float) -> str:
    """The line that ends a successful run: size, time, what happened on the way, and the
    last values the script reported."""
    from ._types import JobState

    text = f"every rank finished: {job.world_size} ranks, {seconds:.1f} s"
    why = None  # each restart or resize, with the size the job ran at after it
    changes = []
    for t in job.history:
        if t.state in (JobState.RESTARTING, JobState.RESIZING):
            why = t.reason
        elif t.state is JobState.RUNNING and why is not None:
            changes.append(f"{t.world_size} ranks after {why}")
            why = None
    if changes:
        text += "; " + "; ".join(changes)
    if job.metrics:  # what the script reported (report(), or a library's dask_ddp logger)
        from .view import progress_line

        text += f"; {len(job.metrics)} reports; last: {progress_line(job.view_state())}"
    return text


def _run_job(client: Any, opts: argparse.Namespace, scratch: str, *, own_cluster: bool) -> int:
    import time

    from .dispatch import launch_script
    from .errors import DaskDDPError

    log = logging.getLogger("dask_ddp")
    _quiet_job_failure()
    if not _wait_for_workers(client, opts):
        return 1
    lowest, highest = opts.size or (None, None)
    checkpoint_dir = opts.checkpoint_dir
    if lowest != highest and checkpoint_dir is None:
        # The script resumes from its own snapshots (checked in _check): the job's own
        # checkpoint list goes to a folder of the command's, removed when it exits.
        checkpoint_dir = os.path.join(scratch, "checkpoints")
    started = time.monotonic()
    try:
        job = launch_script(
            client,
            opts.script,
            opts.args,
            workers=highest,
            min_workers=lowest if lowest != highest else None,
            backend=opts.backend,
            max_restarts=opts.max_restarts,
            checkpoint_dir=checkpoint_dir,
            # A LocalCluster's workers print to this terminal themselves.
            on_output=None if own_cluster else _print_line,
        )
    except (DaskDDPError, SyntaxError) as exc:
        _say(str(exc))
        return 1
    log.info("job %s: %d ranks running %s", job.job_id, job.world_size, opts.script)
    try:
        job.result()
    except DaskDDPError as exc:
        shown = str(exc)
        _say(shown)
        rank_traceback = getattr(exc, "rank_traceback", "")
        if rank_traceback and rank_traceback not in shown:
            print(rank_traceback.rstrip(), file=sys.stderr)
        if own_cluster:
            return 1  # everything it started ends with the command
        # On a shared cluster, leave it clean: a stuck peer's worker is restarted.
        if not job.wait_stopped(timeout=60):
            log.warning("job %s: its ranks were still being stopped at exit", job.job_id)
        return 1
    _say(_outcome(job, time.monotonic() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m dask_ddp [--scheduler ADDR] [--nworkers N|MIN:MAX] [--max-restarts N]
[--checkpoint-dir URL] [--name NAME] [--detach] [torchrun's options] script.py ARGS...``

Runs a torchrun-style script as ``__main__`` on N Dask workers, one rank each, with the
environment torchrun would give it. Without ``--scheduler`` it starts a LocalCluster of
N worker processes (default 2; MAX of a range) for the run. Exits with 0 when every rank
succeeded, 1 with the failing rank's traceback otherwise, 2 for bad arguments, 130 when a
signal (Ctrl-C, SIGTERM) stopped it: the job is cancelled first, as torchrun stops its ranks.

torchrun's whole command line is taken, so that replacing the word ``torchrun`` is the
only change (:data:`TORCHRUN_OPTIONS` says what each of its options does here):
``--nproc-per-node`` times ``--nnodes`` is the number of workers, ``-m`` runs a module,
``--no-python`` a program; the rendezvous options are accepted, and the Dask cluster does
the rendezvous.

Quiet, as torchrun is: it prints what the script prints, then one line of outcome (with
the restarts and resizes there were, and the last values the script reported). Dask's and
dask_ddp's own logs show from WARNING up, every INFO line with ``-v``.

Only the standard library is imported until the arguments are checked, so ``--help`` and
usage errors answer at once. A LocalCluster of its own starts its worker processes first
(they import torch while the command imports the rest), has no dashboard unless
``--dashboard`` asks for one, and is torn down at once when the job ends: its workers die
with the command (see :mod:`dask_ddp._shared.preload`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

_EPILOG = """\
Options go before the script: everything after it is passed to the script.

examples:
  %(prog)s train.py --epochs 3
  %(prog)s --scheduler tcp://scheduler:8786 --nworkers 8 train.py --lr 0.1
  %(prog)s --nworkers 2:4 --max-restarts 3 --checkpoint-dir s3://bucket/run1 train.py
  %(prog)s --standalone --nproc-per-node=2 train.py        (torchrun's command line)
  %(prog)s --scheduler tcp://scheduler:8786 --name nightly --detach train.py

Each rank sees RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and
TORCHELASTIC_RESTART_COUNT as under torchrun and calls init_process_group() itself. A
restarted script runs again from its start and resumes from dask_ddp.get_checkpoint() or
from snapshot files of its own (docs/scripts.md). What the ranks print is shown here with a
[rank N] prefix (with a LocalCluster the workers share this terminal and print directly).
Ctrl-C or SIGTERM cancels the job (its ranks stop, their workers are free) and exits 130.
Settings: DASK_DDP__TIMEOUT, DASK_DDP__SCALE_TIMEOUT, ... (see dask_ddp.yaml).
exit status: 0 every rank succeeded, 1 a rank failed or the cluster was unusable, 2 usage,
130 stopped by a signal.
"""


class TorchrunOption(NamedTuple):
    """One of torchrun's options, and what it does here (``--help`` and docs/scripts.md
    show the table)."""

    flags: tuple[str, ...]
    metavar: str | None  # None: a switch
    kind: str  # "used": it changes what runs; "rendezvous" or "ignored": accepted only
    here: str


_RENDEZVOUS = "accepted: the Dask cluster does the rendezvous"

#: torchrun's options (torch 2.14) and what each does here.
TORCHRUN_OPTIONS = (
    TorchrunOption(
        ("--nproc-per-node", "--nproc_per_node"), "N", "used",
        "ranks per node (host): a number, or gpu, cpu, auto counted on this machine as "
        "torchrun counts them (those three with --scheduler: one rank on every worker). Without "
        "--scheduler one worker per node holds the node's N ranks; with --scheduler, N ranks "
        "on each worker of a cluster of one worker per host, or N workers of each host "
        "where hosts have several (dask-cuda)",
    ),
    TorchrunOption(
        ("--nnodes",), "N|MIN:MAX", "used",
        "nodes (hosts; default 1); MIN:MAX runs elastic, growing and shrinking by whole "
        "nodes",
    ),
    TorchrunOption(
        ("--max-restarts", "--max_restarts"), "N", "used",
        "restart the ranks up to N times after a lost worker, RetryableError or "
        "InfrastructureError",
    ),
    TorchrunOption(
        ("-m", "--module"), None, "used",
        "the script is a module, run as python -m NAME; the working directory comes first "
        "on the ranks' sys.path",
    ),
    TorchrunOption(
        ("--no-python", "--no_python"), None, "used",
        "the script is a program, not Python: each rank runs it as a process of its own, "
        "with torchrun's environment",
    ),
    TorchrunOption(
        ("--signals-to-handle", "--signals_to_handle"), "SIGNALS", "used",
        "the signals that cancel the job and exit 130 (default SIGTERM,SIGINT,SIGHUP,"
        "SIGQUIT, as torchrun's)",
    ),
    TorchrunOption(("--standalone",), None, "rendezvous", _RENDEZVOUS),
    TorchrunOption(("--rdzv-backend", "--rdzv_backend"), "BACKEND", "rendezvous", _RENDEZVOUS),
    TorchrunOption(("--rdzv-endpoint", "--rdzv_endpoint"), "HOST:PORT", "rendezvous", _RENDEZVOUS),
    TorchrunOption(("--rdzv-id", "--rdzv_id"), "ID", "rendezvous", _RENDEZVOUS),
    TorchrunOption(("--rdzv-conf", "--rdzv_conf"), "CONF", "rendezvous", _RENDEZVOUS),
    TorchrunOption(("--master-addr", "--master_addr"), "ADDR", "rendezvous", _RENDEZVOUS),
    TorchrunOption(("--master-port", "--master_port"), "PORT", "rendezvous", _RENDEZVOUS),
    TorchrunOption(("--node-rank", "--node_rank"), "N", "rendezvous", _RENDEZVOUS),
    TorchrunOption(("--local-addr", "--local_addr"), "ADDR", "rendezvous", _RENDEZVOUS),
    TorchrunOption(
        ("-t", "--tee"), "STD", "ignored",
        "every rank's lines come here with a [rank N] prefix and stay in its worker's log",
    ),
    TorchrunOption(("-r", "--redirects"), "STD", "ignored", "the same"),
    TorchrunOption(
        ("--log-dir", "--log_dir"), "DIR", "ignored",
        "the workers' logs keep each rank's output; Job.output holds it",
    ),
    TorchrunOption(
        ("--local-ranks-filter", "--local_ranks_filter"), "RANKS", "ignored",
        "every rank's lines are shown, with a [rank N] prefix",
    ),
    TorchrunOption(
        ("--log-line-prefix-template", "--log_line_prefix_template"), "TEMPLATE", "ignored",
        "lines are prefixed [rank N]",
    ),
    TorchrunOption(
        ("--duplicate-stdout-filters", "--duplicate_stdout_filters"), "FILTERS", "ignored",
        "no log files are written",
    ),
    TorchrunOption(
        ("--duplicate-stderr-filters", "--duplicate_stderr_filters"), "FILTERS", "ignored",
        "no log files are written",
    ),
    TorchrunOption(
        ("--logs-specs", "--logs_specs"), "NAME", "ignored", "no log files are written"
    ),
    TorchrunOption(
        ("--role",), "ROLE", "ignored", "every rank has one role: ROLE_NAME is default"
    ),
    TorchrunOption(
        ("--monitor-interval", "--monitor_interval"), "SECONDS", "ignored",
        "the job's supervisor on the scheduler hears of a rank's end at once",
    ),
    TorchrunOption(
        ("--start-method", "--start_method"), "METHOD", "ignored",
        "ranks run in Dask worker processes, already started",
    ),
    TorchrunOption(
        ("--run-path", "--run_path"), None, "ignored",
        "the script already runs inside the worker's process, as runpy.run_path would run it",
    ),
    TorchrunOption(
        ("--event-log-handler", "--event_log_handler"), "HANDLER", "ignored",
        "Job.history records the job's events",
    ),
    TorchrunOption(
        ("--numa-binding", "--numa_binding"), "BINDING", "ignored",
        "bind the Dask workers where they are started (dask-cuda does)",
    ),
    TorchrunOption(
        ("--shutdown-timeout", "--shutdown_timeout"), "SECONDS", "ignored",
        "a stopped rank gets SIGTERM, then SIGKILL after ddp.failure-grace",
    ),
    TorchrunOption(
        ("--virtual-local-rank", "--virtual_local_rank"), None, "ignored",
        "each rank's GPU is cuda:LOCAL_RANK, as torchrun places it without the flag (the "
        "frameworks index by LOCAL_RANK); LOCAL_RANK keeps its value",
    ),
    TorchrunOption(
        ("--print-completion", "--print_completion"), "SHELL", "ignored",
        "this command has no shell completion script",
    ),
)  # fmt: skip

_HANDLED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default
_INTERRUPTED = 130  # the exit status after a signal cancelled the job


def torchrun_table() -> str:
    """torchrun's options and what each does here, as the Markdown table of
    docs/scripts.md.

    >>> print(torchrun_table().splitlines()[3])
    | `--nnodes N\\|MIN:MAX` | works | nodes (hosts; default 1); ...
    """
    kinds = {"used": "works", "rendezvous": "accepted", "ignored": "ignored"}
    rows = ["| torchrun | dask_ddp | what it does here |", "|---|---|---|"]
    for option in TORCHRUN_OPTIONS:
        shown = ", ".join(
            f"`{flag}`" if option.metavar is None else f"`{flag} {option.metavar}`"
            for flag in option.flags
        ).replace("|", "\\|")  # a cell's own bar, not the table's
        rows.append(f"| {shown} | {kinds[option.kind]} | {option.here} |")
    return "\n".join(rows)


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
        "[--name NAME] [--detach] [torchrun's options] script [args ...]",
        allow_abbrev=False,  # torchrun's options share prefixes
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
        "--max_restarts",
        metavar="N",
        type=int,
        default=0,
        help="restart the ranks from the start of the script up to N times after a failure "
        "(a lost worker, dask_ddp.RetryableError, dask_ddp.InfrastructureError); default 0",
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
        "--name",
        metavar="NAME",
        help="name the job, unique among the cluster's running jobs, to find it again with "
        "dask_ddp.attach(client, NAME)",
    )
    parser.add_argument(
        "--detach",
        action="store_true",
        help="with --scheduler: leave the job running on the cluster, print how to attach "
        "to it, and exit",
    )
    parser.add_argument(
        "--stacks",
        metavar="JOB",
        help="with --scheduler: print every rank's current stacks (all threads) of the running "
        "job JOB (a name or an id), and exit; no script",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show Dask's and dask_ddp's INFO logs"
    )
    groups = {
        kind: parser.add_argument_group(title, text)
        for kind, title, text in (
            ("used", "torchrun's options that work here",
             "torchrun's command line works as it is: replace the word torchrun and nothing\n"
             "else (--max-restarts above is one of them too)"),
            ("rendezvous", "torchrun's rendezvous options",
             "accepted; the Dask cluster does the rendezvous: rank 0's worker opens the job's\n"
             "store on a free port of its own address"),
            ("ignored", "torchrun's other options, accepted and ignored",
             "each is taken, with its value, and changes nothing here, because:"),
        )
    }  # fmt: skip
    for option in TORCHRUN_OPTIONS:
        if option.flags[0] == "--max-restarts":
            continue  # one of this command's own, above
        shown = argparse.SUPPRESS if option.kind == "rendezvous" else option.here
        group = groups[option.kind]
        if option.metavar is None:
            group.add_argument(*option.flags, action="store_true", help=shown)
        else:
            group.add_argument(*option.flags, metavar=option.metavar, help=shown)
    groups["rendezvous"].description += "\n  " + "\n  ".join(
        ", ".join(f"{flag} {option.metavar or ''}".rstrip() for flag in option.flags)
        for option in TORCHRUN_OPTIONS
        if option.kind == "rendezvous"
    )
    parser.set_defaults(signals_to_handle=_HANDLED_SIGNALS)
    parser.add_argument("script", nargs="?", help="path of the training script (-m: a module name)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _parse_nworkers(value: str, option: str = "--nworkers") -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` (torchrun's ``--nnodes``) as ``(MIN, MAX)``.

    >>> _parse_nworkers("4"), _parse_nworkers("2:4")
    ((4, 4), (2, 4))
    >>> _parse_nworkers("3:2")
    Traceback (most recent call last):
    ...
    ValueError: --nworkers 3:2: MIN is more than MAX; give MIN:MAX with MIN <= MAX, as 2:3
    """
    low, _, high = value.partition(":")
    what = "workers" if option == "--nworkers" else "nodes"
    try:
        lowest, highest = int(low), int(high or low)
    except ValueError:
        raise ValueError(
            f"{option} {value}: give a number of {what} (4) or a range MIN:MAX (2:4)"
        ) from None
    if lowest < 1:
        raise ValueError(f"{option} {value}: {option} must be at least 1")
    if lowest > highest:
        raise ValueError(
            f"{option} {value}: MIN is more than MAX; give MIN:MAX with MIN <= MAX, as "
            f"{highest}:{lowest}"
        )
    return lowest, highest


def _local_gpus() -> int:
    """The NVIDIA GPUs this machine's processes see (``CUDA_VISIBLE_DEVICES`` first), found
    without importing torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d for d in visible.split(",") if d.strip()]
        return 0 if devices[:1] == ["-1"] else len(devices)
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _per_node(value: str, local: bool) -> int | None:
    """torchrun's ``--nproc-per-node``: a number, or ``gpu``, ``cpu``, ``auto`` counted on
    this machine (``local``: the command's own LocalCluster); None, with ``--scheduler``,
    for every worker of the cluster.

    >>> _per_node("2", local=True), _per_node("cpu", local=False)
    (2, None)
    """
    if value.isdigit():
        if int(value) < 1:
            raise ValueError(f"--nproc-per-node {value}: give at least 1")
        return int(value)
    if value not in ("gpu", "cpu", "auto"):
        raise ValueError(f"--nproc-per-node {value}: give a number, or gpu, cpu or auto")
    if not local:
        return None
    gpus = _local_gpus()
    if value == "gpu" and not gpus:
        raise ValueError(
            "--nproc-per-node gpu: this machine has no GPU (torchrun says 'Cuda is not "
            "available'); give a number, or cpu"
        )
    return gpus if value in ("gpu", "auto") and gpus else os.cpu_count() or 1


def _size(
    opts: argparse.Namespace,
) -> tuple[tuple[int, int] | None, str | None, int | None]:
    """The job's size ``(MIN, MAX)`` (None: every worker, or 2 for a LocalCluster) from
    ``--nworkers`` (workers) or torchrun's ``--nnodes`` (nodes), the options that said it
    (for messages), and torchrun's ``--nproc-per-node`` (ranks per node; None: one rank
    per worker)."""
    torchrun = opts.nproc_per_node is not None or opts.nnodes is not None
    if opts.nworkers is not None:
        if torchrun:
            raise ValueError(
                "--nworkers counts the Dask workers the job takes, and torchrun's "
                "--nproc-per-node and --nnodes say the same: give one or the other"
            )
        return _parse_nworkers(opts.nworkers), f"--nworkers {opts.nworkers}", None
    if not torchrun:
        return None, None, None
    nodes = _parse_nworkers(opts.nnodes or "1", "--nnodes")
    per = _per_node(opts.nproc_per_node or "1", local=opts.scheduler is None)
    said = " ".join(
        f"{flag} {value}"
        for flag, value in (("--nproc-per-node", opts.nproc_per_node), ("--nnodes", opts.nnodes))
        if value is not None
    )
    if per is None:
        return None, said, None
    return nodes, said, per


def _one_worker_per_host(client: Any) -> bool:
    """Whether no host of the cluster runs two of its workers (an empty cluster, which may
    grow, counts as one)."""
    hosts = [w["host"] for w in client.scheduler_info(n_workers=-1)["workers"].values()]
    return len(hosts) == len(set(hosts))


def _resolve_nodes(client: Any, opts: argparse.Namespace, own_cluster: bool) -> None:
    """torchrun's nodes as Dask workers, now that the cluster is known: a node is a worker
    holding ``--nproc-per-node`` ranks (the command's own cluster, or one of one worker
    per host), or, where hosts run several workers (dask-cuda), that many workers of one
    rank each. Sets ``opts.size`` (workers) and ``opts.ranks_per_worker``."""
    opts.ranks_per_worker = 1
    per = opts.per_node
    if per is None or opts.size is None:
        return
    if own_cluster or _one_worker_per_host(client):
        opts.ranks_per_worker = per
        return
    logging.getLogger("dask_ddp").info(
        "%s: hosts of this cluster run several workers: %d workers a node, one rank each",
        opts.size_said, per,
    )  # fmt: skip
    opts.size = (opts.size[0] * per, opts.size[1] * per)


def _signals(value: str) -> list[signal.Signals]:
    """torchrun's ``--signals-to-handle``: signal names, comma-separated.

    >>> [s.name for s in _signals("SIGTERM, SIGINT")]
    ['SIGTERM', 'SIGINT']
    """
    names = [name.strip().upper() for name in value.split(",") if name.strip()]
    try:
        return [signal.Signals[n if n.startswith("SIG") else f"SIG{n}"] for n in names]
    except KeyError as exc:
        raise ValueError(
            f"--signals-to-handle {value}: {exc.args[0]} is no signal; give names as "
            f"{_HANDLED_SIGNALS}"
        ) from None


_OPT_IN = """\
# /// script
# [tool.dask-ddp]
# resume = "own-snapshots"
# ///"""


def _check(parser: argparse.ArgumentParser, opts: argparse.Namespace) -> None:
    """Every check that needs no cluster, before anything starts: exits with status 2."""
    from .._shared.script import ScriptSettingsError, module_files, script_settings

    try:
        opts.size, opts.size_said, opts.per_node = _size(opts)
        opts.signals = _signals(opts.signals_to_handle)
    except ValueError as exc:
        parser.error(str(exc))
    if opts.max_restarts < 0:
        parser.error(f"--max-restarts {opts.max_restarts}: give 0 or more restarts")
    if opts.stacks is not None:
        if not opts.scheduler or opts.script is not None:
            parser.error(
                "--stacks JOB prints a running job's stacks: give --scheduler ADDR, no script"
            )
        return
    if opts.script is None:
        parser.error("give the training script (or -m MODULE, or --no-python PROGRAM)")
    if opts.detach and not opts.scheduler:
        parser.error(
            "--detach leaves the job running on a cluster after the command exits: give "
            "the cluster with --scheduler ADDR (the command's own LocalCluster ends with it)"
        )
    if opts.module and opts.no_python:
        parser.error("-m runs a Python module and --no-python a program: give one of them")
    opts.own_snapshots = False
    if opts.no_python:
        if not opts.scheduler and shutil.which(opts.script) is None:
            parser.error(f"--no-python: no program {opts.script!r} here (not on PATH)")
        path = None
    elif opts.module:
        try:
            path = module_files(opts.script).file
        except ModuleNotFoundError as exc:
            parser.error(f"-m {opts.script}: {exc} (python -m {opts.script} would fail too)")
    elif not os.path.isfile(opts.script):
        parser.error(f"no script at {opts.script!r}")
    else:
        path = opts.script
    if path is not None and path.endswith(".py"):
        with open(path, encoding="utf-8") as f:
            source = f.read()
        try:
            opts.own_snapshots = script_settings(source, path).get("resume") == "own-snapshots"
        except ScriptSettingsError as exc:
            parser.error(str(exc))
    elastic = opts.size is not None and opts.size[0] < opts.size[1]
    if elastic and opts.checkpoint_dir is None and not opts.own_snapshots:
        parser.error(
            f"{opts.size_said} resizes the job, and each resize restarts the script, "
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


class _Interrupted(BaseException):
    """A signal the command handles came; raised in the main thread by its handler (a
    BaseException, as KeyboardInterrupt is, so that no ``except Exception`` takes it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class _Signals:
    """The signals that stop the command (torchrun's ``--signals-to-handle``): the first
    raises :class:`_Interrupted` in the main thread, where the command cancels its job; a
    second one, while that is under way, raises again and the command leaves at once.
    Held (:meth:`hold`), a first signal waits until the hold ends: the job is launched
    whole, so that it can be cancelled."""

    def __init__(self, signums: Sequence[int]) -> None:
        self.signums = list(signums)
        self.received: int | None = None
        self._holding = False
        self._saved: dict[int, Any] = {}

    def install(self) -> None:
        for signum in self.signums:
            self._saved[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        self._saved.clear()

    def _handle(self, signum: int, frame: object) -> None:
        first = self.received is None
        if first:
            self.received = signum
        if first and self._holding:
            return
        raise _Interrupted(signum)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self.received is not None:
            raise _Interrupted(self.received)

    def ignore_from_now(self) -> None:
        """The job is over: a signal now changes nothing."""
        self._holding = True
        self.received = self.received or -1


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
    _log_torchrun_options(opts)
    if opts.stacks is not None:
        return _print_stacks(opts.scheduler, opts.stacks)
    signals = _Signals(opts.signals)
    signals.install()
    try:
        if opts.scheduler:
            return _run_on_scheduler(opts, signals)
        return _run_on_local_cluster(opts, signals)
    finally:
        signals.restore()


def _print_stacks(scheduler: str, name: str) -> int:
    """``--stacks JOB``: each running rank's stacks, as faulthandler dumps them in the rank's
    own process (it works while a rank is blocked in a collective)."""
    from distributed import Client

    from ..errors import JobNotFoundError
    from . import job as _job

    with Client(scheduler) as client:
        try:
            job = _job.attach_job(client, name)
        except JobNotFoundError as exc:
            _say(str(exc))
            return 1
        stacks = job.stacks()
        if not stacks:
            _say(f"job {job.job_id} ({job.name}) has no running rank ({job.state.value})")
            return 1
        for rank, text in stacks.items():
            print(f"rank {rank} (on {job.workers[rank]}):\n{text.rstrip()}\n", flush=True)
    return 0


def _log_torchrun_options(opts: argparse.Namespace) -> None:
    """Say once, at INFO (``-v``), which of torchrun's options given change nothing here."""
    log = logging.getLogger("dask_ddp")
    given = {
        kind: [
            o.flags[-1] if len(o.flags[0]) == 2 else o.flags[0]  # --tee, not -t
            for o in TORCHRUN_OPTIONS
            if o.kind == kind and _given(opts, o)
        ]
        for kind in ("rendezvous", "ignored")
    }
    if given["rendezvous"]:
        log.info(
            "torchrun's %s: the Dask cluster does the rendezvous (rank 0's worker opens the "
            "job's store on a free port of its own address)", ", ".join(given["rendezvous"]),
        )  # fmt: skip
    if given["ignored"]:
        log.info(
            "torchrun's %s: accepted and ignored (see python -m dask_ddp --help)",
            ", ".join(given["ignored"]),
        )
    if opts.size is None and opts.size_said and opts.scheduler:
        log.info("%s with --scheduler: one rank on every worker of the cluster", opts.size_said)


def _given(opts: argparse.Namespace, option: TorchrunOption) -> bool:
    value = getattr(opts, option.flags[-1].lstrip("-").replace("-", "_"))
    return bool(value) if option.metavar is None else value is not None


def _quiet_job_failure() -> None:
    """A failed job is printed by the command, whole; its supervisor's line for the failure
    (the command's own LocalCluster runs it, in this process) would repeat it."""
    logging.getLogger("dask_ddp._scheduler.supervisor").addFilter(
        lambda record: getattr(record, "job_state", None) != "failed"
    )


def _import_dispatch() -> threading.Thread:
    """Import the client's side of dask_ddp in the background (while workers start)."""
    thread = threading.Thread(
        target=__import__, args=("dask_ddp.dispatch",), name="dask-ddp-import", daemon=True
    )
    thread.start()
    return thread


def _run_on_scheduler(opts: argparse.Namespace, signals: _Signals) -> int:
    importing = _import_dispatch()
    from distributed import Client

    try:
        client = Client(opts.scheduler, timeout="30s")
    except (OSError, TimeoutError) as exc:
        _say(f"cannot reach the scheduler {opts.scheduler}: {exc}")
        return 1
    except _Interrupted as stop:
        _say(f"{stop.name}: stopped before the job started")
        return _INTERRUPTED
    scratch = tempfile.mkdtemp(prefix="dask-ddp-")
    try:
        if opts.dashboard:
            _say(f"Dask dashboard: {client.dashboard_link}")
        importing.join()
        return _run_job(client, opts, scratch, signals, own_cluster=False)
    except _Interrupted as stop:
        _say(f"{stop.name}: stopped before the job started")
        return _INTERRUPTED
    finally:
        signals.ignore_from_now()
        client.close(timeout=2)
        shutil.rmtree(scratch, ignore_errors=True)


def _run_on_local_cluster(opts: argparse.Namespace, signals: _Signals) -> int:
    n = opts.size[1] if opts.size else 2
    log = logging.getLogger("dask_ddp")
    log.info("no --scheduler given: starting a LocalCluster of %d worker processes", n)
    importing = _import_dispatch()
    from distributed import Client

    from .._shared.protocol import call

    # The cluster's nannies are in this process, and hold its rank template for their
    # workers: started now, its imports (torch's, 2-3 s of CPU) run beside the workers'
    # start instead of after it (by name: the nannies' side, not the command line's). The
    # cluster runs one script: the template imports what every script needs, not dynamo
    # (a DDP script's ranks import it, as under torchrun; _template.LEAN).
    call("dask_ddp._rank.template:start_here", lean=True)
    scratch = tempfile.mkdtemp(prefix="dask-ddp-")
    code, cluster = 1, None
    try:
        cluster = _start_local_cluster(n, scratch, dashboard=opts.dashboard, verbose=opts.verbose)
        if opts.dashboard:
            _say(f"Dask dashboard: {cluster.dashboard_link}")
        client = Client(cluster)
        importing.join()
        code = _run_job(client, opts, scratch, signals, own_cluster=True)
    except _Interrupted as stop:
        _say(f"{stop.name}: stopped before the job started")
        code = _INTERRUPTED
    except Exception:  # shown before _exit_now ends the process, which would hide it
        log.exception("dask_ddp: the command failed")
    finally:
        signals.ignore_from_now()
        _exit_now(code, scratch, cluster)
    return code  # not reached: _exit_now does not return


def _start_local_cluster(n: int, scratch: str, *, dashboard: bool, verbose: bool) -> Any:
    """The command's own LocalCluster: ``n`` worker processes of one thread each, their
    files in ``scratch``, the dashboard's page only with ``dashboard``.

    It never loses a worker to a stale lost-worker timer: SpecCluster arms
    ``distributed.deploy.lost-worker-timeout`` (15 s) at each removal of a worker and never
    cancels it when the worker's name comes back, so an earlier kill's timer closes the
    nanny of a worker that is restarting after a later kill, for good. The timer is there
    to close the job of a worker that went; here each nanny lives in this process and
    starts its worker again itself, and the command never scales its cluster: nothing is
    left for the timer to do, and it is set out of reach, for the rest of this process
    (which ends with its cluster; the key is read at each removal, not at the cluster's
    start). A public setting, where a SpecCluster subclass that cancels the timer or a
    nanny opened again would reach into distributed's private ``_update_worker_status``
    and ``workers``.
    """
    import dask
    from distributed import LocalCluster

    dask.config.set({"distributed.deploy.lost-worker-timeout": _NEVER})
    return LocalCluster(
        n_workers=n,
        threads_per_worker=1,
        processes=True,
        dashboard_address=":0",
        scheduler_kwargs={"dashboard": dashboard},
        local_directory=scratch,
        preload=["dask_ddp._shared.preload", "dask_ddp._rank.host"],
        silence_logs=False if verbose else logging.WARNING,
    )


_NEVER = "3650 days"  # a lost-worker timeout that never fires while the command runs


def _result_saying_stalls(job: Any) -> list[Any]:
    """``job.result()``, saying in one line each time the job stalls, and when it goes on."""
    from .._shared.values import JobState

    seen = len(job.history)

    def changed(_: Any) -> bool:
        return job.done() or len(job.history) > seen

    while not job.done():
        job.view_state(changed)
        history = job.history
        for i in range(seen, len(history)):
            t, before = history[i], history[i - 1] if i else None
            if t.state is JobState.STALLED:
                _say(
                    f"job {job.job_id} stalled: {t.reason} (python -m dask_ddp --scheduler "
                    f"ADDR --stacks {job.name or job.job_id} prints every rank's stack)"
                )
            elif t.state is JobState.RUNNING and before and before.state is JobState.STALLED:
                _say(f"job {job.job_id}: progress resumed")
        seen = len(history)
    return job.result()


def _exit_now(code: int, scratch: str, cluster: Any = None) -> None:
    """End the command at once, with every process it started.

    The job is over and its results are printed: a graceful close of the cluster would
    wait for workers that may be stuck in a collective or still tearing torch down (the
    nanny waits seconds before it kills them). Every process under this one (workers,
    their template, rank processes) is killed, and the command exits once they are gone,
    as torchrun does: a shell or a scheduler that starts the next command finds none of
    them still exiting. ``cluster``'s nannies are told first that they are closing, so
    that none starts its worker again meanwhile.
    """
    import psutil
    from distributed.core import Status

    logging.disable(logging.CRITICAL)  # the nanny would report each worker it sees killed
    for nanny in getattr(cluster, "workers", {}).values():
        nanny.status = Status.closing  # what Nanny.close() sets first: no restart
    # The spawn context's resource tracker goes last, and at once before the exit: this
    # process, reaping its workers, still tells it what they left, and a tracker killed
    # earlier is started again to hear that (printing a traceback for each name). Nothing
    # may tell it anything once it is killed: a semaphore of a nanny's collected by then
    # (in any thread) started a new tracker that printed a KeyError traceback for each
    # name (twice in about ten runs of test_cli's Ctrl-C test), so the module's public
    # functions do nothing from then on; the exit follows at once.
    children = psutil.Process().children(recursive=True)
    trackers = [c for c in children if _is_resource_tracker(c)]
    _kill_and_wait([c for c in children if c not in trackers], _EXIT_WAIT)
    shutil.rmtree(scratch, ignore_errors=True)
    _silence_resource_tracker()
    for child in trackers:
        with contextlib.suppress(psutil.Error):
            child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _silence_resource_tracker() -> None:
    """From now on this process tells multiprocessing's resource tracker nothing (and never
    starts one): ``register``, ``unregister`` and ``ensure_running``, the functions of
    ``multiprocessing.resource_tracker`` that its users call, do nothing."""
    from multiprocessing import resource_tracker

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    for name in ("register", "unregister", "ensure_running"):
        setattr(resource_tracker, name, nothing)


def _is_resource_tracker(process: Any) -> bool:
    """Whether ``process`` (a ``psutil.Process``) is multiprocessing's resource tracker (its
    command line runs ``multiprocessing.resource_tracker``)."""
    import psutil

    try:
        return any("multiprocessing.resource_tracker" in part for part in process.cmdline())
    except psutil.Error:
        return False


_EXIT_WAIT = 10.0  # seconds: the most the command waits for its killed processes to end


def _kill_and_wait(processes: Sequence[Any], timeout: float) -> None:
    """SIGKILL ``processes`` (``psutil.Process``) and wait until each one has ended (a
    zombie has), up to ``timeout``. On Linux through a pidfd per process, opened before
    the kill (no pid reuse can redirect it) and polled for its end; elsewhere through
    psutil."""
    import psutil

    if not hasattr(os, "pidfd_open"):
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(processes, timeout=timeout)
        return
    import select

    poller, fds = select.poll(), []
    for process in processes:
        try:
            fd = os.pidfd_open(process.pid)
        except OSError:  # gone already
            continue
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        poller.register(fd, select.POLLIN)
        fds.append(fd)
    deadline = time.monotonic() + timeout
    left = len(fds)
    while left and (wait := deadline - time.monotonic()) > 0:
        for fd, _ in poller.poll(wait * 1000):
            poller.unregister(fd)
            left -= 1
    for fd in fds:
        os.close(fd)


def _wait_for_own_workers(client: Any, opts: argparse.Namespace) -> bool:
    """Wait until the command's own LocalCluster has the workers the job needs (MIN of a
    range), up to ``ddp.scale-timeout``; False if they did not come."""
    from dask.utils import format_time, parse_timedelta

    from ..config import get

    need = opts.size[0] if opts.size else 1
    limit = parse_timedelta(get("ddp.scale-timeout"), "s")
    try:
        client.wait_for_workers(need, timeout=limit)
    except TimeoutError:
        have = len(client.scheduler_info(n_workers=-1)["workers"])
        _say(
            f"the LocalCluster started {have} of {need} workers within {format_time(limit)} "
            "(ddp.scale-timeout); see the workers' errors above"
        )
        return False
    return True


def _say_waiting(client: Any, opts: argparse.Namespace) -> None:
    """With --scheduler, a cluster that has fewer workers than the job needs: say that the
    job waits for them (the job asks an adaptive cluster for them) and how long."""
    if opts.size is None:
        return
    need = opts.size[0]
    have = len(client.scheduler_info(n_workers=-1)["workers"])
    if have < need:
        from ..config import get

        _say(
            f"waiting for {need} workers (the cluster has {have}; an adaptive cluster is "
            f"asked for them) up to ddp.scale-timeout, {get('ddp.scale-timeout')}"
        )


def _outcome(job: Any, seconds: float) -> str:
    """The line that ends a successful run: size, time, what happened on the way, and the
    last values the script reported."""
    from .._shared.values import JobState

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
        from .._shared.view import progress_line

        text += f"; {len(job.metrics)} reports; last: {progress_line(job.view_state())}"
    return text


def _attach_hint(client: Any, job: Any) -> str:
    """How to follow a detached job, in one line."""
    address = client.scheduler.address
    return (
        f"job {job.job_id} ({job.name}) runs detached on {address}; follow it with "
        f'dask_ddp.attach(Client("{address}"), "{job.name if job.name else job.job_id}") '
        "(dask_ddp.jobs(client) lists the cluster's jobs)"
    )


def _run_job(
    client: Any, opts: argparse.Namespace, scratch: str, signals: _Signals, *, own_cluster: bool
) -> int:
    from ..errors import DaskDDPError, RankFailedError
    from .launch import _launch_script

    log = logging.getLogger("dask_ddp")
    _quiet_job_failure()
    _resolve_nodes(client, opts, own_cluster)
    if own_cluster:
        if not _wait_for_own_workers(client, opts):
            return 1
    else:
        _say_waiting(client, opts)
    lowest, highest = opts.size or (None, None)
    checkpoint_dir = opts.checkpoint_dir
    if lowest != highest and checkpoint_dir is None:
        # The script resumes from its own snapshots (checked in _check): the job's own
        # checkpoint list goes to a folder of the command's, removed when it exits.
        checkpoint_dir = os.path.join(scratch, "checkpoints")
    started = time.monotonic()
    job = None
    try:
        try:
            with signals.hold():  # a signal now cancels the job, once it is launched whole
                job = _launch_script(
                    client,
                    opts.script,
                    opts.args,
                    module=opts.module,
                    no_python=opts.no_python,
                    # With --scheduler, a job of more workers than the cluster has waits for
                    # them up to ddp.scale-timeout, asking an adaptive cluster for them.
                    cluster_may_grow=not own_cluster,
                    workers=highest,
                    min_workers=lowest if lowest != highest else None,
                    ranks_per_worker=opts.ranks_per_worker,
                    backend=opts.backend,
                    max_restarts=opts.max_restarts,
                    checkpoint_dir=checkpoint_dir,
                    # A LocalCluster's workers print to this terminal themselves.
                    on_output=None if own_cluster or opts.detach else _print_line,
                    name=opts.name,
                    detach=opts.detach,
                )
        except (DaskDDPError, SyntaxError, ImportError) as exc:
            _say(str(exc))
            return 1
        log.info("job %s (%s): %s", job.job_id, opts.script, job.state.value)
        if opts.detach:
            _say(_attach_hint(client, job))
            return 0
        _result_saying_stalls(job)
    except _Interrupted as stop:
        return _cancel(job, stop, own_cluster=own_cluster)
    except DaskDDPError as exc:
        signals.ignore_from_now()
        if isinstance(exc, RankFailedError) and exc.rank_traceback:
            # As a Python traceback reads: the rank's first, then what it did to the job.
            print(exc.rank_traceback.rstrip(), file=sys.stderr)
            _say(f"{exc.summary}; fix the error in the rank's traceback above")
        else:
            _say(str(exc))
        if own_cluster:
            return 1  # everything it started ends with the command
        # On a shared cluster, leave it clean: a stuck peer's worker is restarted.
        if not job.wait_stopped(timeout=60):
            log.warning("job %s: its ranks were still being stopped at exit", job.job_id)
        return 1
    signals.ignore_from_now()
    _say(_outcome(job, time.monotonic() - started))
    return 0


def _cancel(job: Any, stop: _Interrupted, *, own_cluster: bool) -> int:
    """A signal came while the job ran: cancel it, as torchrun stops its ranks, and say so
    in one line; the command then exits 130."""
    from ..errors import DaskDDPError

    if job is None:
        _say(f"{stop.name}: stopped before the job started")
        return _INTERRUPTED
    if own_cluster:  # its ranks end with the command's LocalCluster, at once
        _say(f"{stop.name}: stopped job {job.job_id} and the command's LocalCluster")
        return _INTERRUPTED
    try:
        job.cancel(f"{stop.name} to the command that launched it")
    except _Interrupted as again:
        _say(
            f"{again.name} again: left job {job.job_id} being cancelled on the cluster "
            "without waiting for its ranks to stop"
        )
        return _INTERRUPTED
    except DaskDDPError as exc:
        _say(f"{stop.name}: job {job.job_id} could not be cancelled: {exc}")
        return _INTERRUPTED
    _say(f"{stop.name}: job {job.job_id} cancelled; its ranks stopped and their workers are free")
    return _INTERRUPTED

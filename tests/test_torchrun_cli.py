"""torchrun's command lines, as PyTorch's docs and tutorials write them, with the word
``torchrun`` replaced by ``python -m dask_ddp`` and nothing else changed. torchrun itself
runs each line first, as the control: both must give every rank the same environment,
arguments and result.

The table of torchrun's options (what each does here) is one piece of data, shown by
``--help`` and written in docs/scripts.md; a test keeps the two the same.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dask_ddp._client.cli import TORCHRUN_OPTIONS, torchrun_table

DOCS = Path(__file__).resolve().parent.parent / "docs" / "scripts.md"

TRAIN = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT"]
    seen = " ".join(f"{n}={os.environ.get(n)}" for n in names)
    spec = __spec__.name if __spec__ is not None else None
    line = (f"SEEN {__name__} spec={spec} argv0={os.path.basename(sys.argv[0])} "
            f"args={sys.argv[1:]} {seen} sum={total.item()}\\n")
    os.write(1, line.encode())  # one write: the ranks share the command's stdout
    dist.destroy_process_group()
    """
)

LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "dask_ddp": [sys.executable, "-m", "dask_ddp"],
}

# The five lines of issue 37, each pasted from PyTorch's docs or tutorials.
LINES = {
    "standalone": "--standalone --nproc_per_node=2 train.py --epochs 2",
    "nnodes": "--nnodes=1 --nproc-per-node=2 train.py",
    "max-restarts": "--nproc-per-node 2 --max-restarts=1 train.py",
    "module": "--standalone --nproc-per-node=2 -m trainmod",
    "rendezvous": (
        "--nnodes 1 --nproc_per_node 2 --rdzv-backend=c10d --rdzv-endpoint=localhost:0 train.py"
    ),
}


def _seen(name: str, line: str, cwd: Path) -> list[str]:
    done = subprocess.run(
        [*LAUNCHERS[name], *line.split()], cwd=cwd, capture_output=True, text=True, timeout=240
    )
    seen = sorted(out for out in done.stdout.splitlines() if out.startswith("SEEN "))
    # torchrun's gloo ranks now and then abort as they exit, after the work is done
    # (tests/test_torchrun_parity.py): its output is checked, not its status.
    assert name == "torchrun" or done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert len(seen) == 2, (name, done.stdout[-2000:], done.stderr[-3000:])
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("line", list(LINES.values()), ids=list(LINES))
def test_torchrun_s_command_line_runs_unchanged(line: str, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "trainmod.py").write_text(TRAIN)
    control = _seen("torchrun", line, tmp_path)
    assert all("sum=1.0" in s for s in control), control
    assert _seen("dask_ddp", line, tmp_path) == control


def test_help_shows_what_each_of_torchrun_s_options_does_here() -> None:
    out = subprocess.run(
        [*LAUNCHERS["dask_ddp"], "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    text = "".join(out.stdout.split())  # argparse wraps lines, at hyphens too
    for title in (
        "torchrun's options that work here",
        "torchrun's rendezvous options",
        "torchrun's other options, accepted and ignored",
    ):
        assert title in out.stdout
    for option in TORCHRUN_OPTIONS:
        for flag in option.flags:
            assert flag in out.stdout, flag
        if option.kind != "rendezvous" and option.flags[0] != "--max-restarts":  # own help
            assert "".join(option.here.split()) in text, option.here


def test_the_table_in_docs_scripts_md_is_the_command_s() -> None:
    assert torchrun_table() in DOCS.read_text()


def test_every_option_of_torchrun_is_taken() -> None:
    """Every option of the installed torchrun's parser is in the table, under all its
    spellings."""
    from torch.distributed.run import get_args_parser

    torchrun = {
        flag
        for action in get_args_parser()._actions
        for flag in action.option_strings
        if flag not in ("-h", "--help")
    }
    ours = {flag for option in TORCHRUN_OPTIONS for flag in option.flags}
    assert torchrun == ours


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--nworkers", "2", "--nproc-per-node", "2"], "give one or the other"),
        (["--nproc-per-node", "two"], "--nproc-per-node two: give a number, or gpu, cpu or auto"),
        (["--nnodes", "2:1", "--nproc-per-node", "1"], "--nnodes 2:1: MIN is more than MAX"),
        (["--nnodes", "1:2", "--nproc-per-node", "2"], "--nnodes 1:2 resizes the job"),
        (["--detach"], "--detach leaves the job running on a cluster after the command exits"),
        (["-m", "--no-python"], "-m runs a Python module and --no-python a program"),
        (["--signals-to-handle", "SIGNOPE"], "SIGNOPE is no signal"),
    ],
)
def test_what_does_not_fit_is_refused_before_anything_starts(
    options: list[str], message: str, tmp_path: Path
) -> None:
    (tmp_path / "train.py").write_text("import torch\n")
    out = subprocess.run(
        [*LAUNCHERS["dask_ddp"], *options, "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_a_module_python_would_not_find_is_refused(tmp_path: Path) -> None:
    out = subprocess.run(
        [*LAUNCHERS["dask_ddp"], "-m", "no_such_trainer"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "-m no_such_trainer: No module named 'no_such_trainer'" in out.stderr, out.stderr


@pytest.mark.slow
def test_no_python_runs_a_program_with_torchrun_s_environment(tmp_path: Path) -> None:
    program = [
        "sh",
        "-c",
        'echo "SEEN RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK $0"',
    ]
    line = ["--nproc-per-node", "2", "--no-python", *program, "an-argument"]
    seen = {}
    for name, launcher in LAUNCHERS.items():
        done = subprocess.run(
            [*launcher, *line], cwd=tmp_path, capture_output=True, text=True, timeout=240
        )
        seen[name] = sorted(out for out in done.stdout.splitlines() if out.startswith("SEEN "))
        assert len(seen[name]) == 2, (name, done.stdout[-2000:], done.stderr[-3000:])
    assert seen["dask_ddp"] == seen["torchrun"]
    failing = subprocess.run(
        [*LAUNCHERS["dask_ddp"], "--nproc-per-node", "2", "--no-python", "sh", "-c", "exit 3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert failing.returncode == 1, failing.stderr
    assert "sh exited with status 3" in failing.stderr, failing.stderr


def test_the_rendezvous_options_are_said_once_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from dask_ddp._client.cli import _check, _log_torchrun_options, _parser

    (tmp_path / "train.py").write_text("import torch\n")
    parser = _parser()
    opts = parser.parse_args(
        ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--standalone", "--tee", "3",
         "--nproc-per-node", "2", str(tmp_path / "train.py"), "--tee", "kept"]
    )  # fmt: skip
    _check(parser, opts)
    # One node of two ranks; the script's own --tee, after it, is its own.
    assert (opts.size, opts.per_node) == ((1, 1), 2) and opts.args == ["--tee", "kept"]
    with caplog.at_level(logging.INFO, logger="dask_ddp"):
        _log_torchrun_options(opts)
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [
        (
            logging.INFO,
            "torchrun's --standalone, --rdzv-backend, --rdzv-endpoint: the Dask cluster does "
            "the rendezvous (rank 0's worker opens the job's store on a free port of its own "
            "address)",
        ),
        (logging.INFO, "torchrun's --tee: accepted and ignored (see python -m dask_ddp --help)"),
    ], said

"""The README's quick start runs as written, its other Python blocks run on one machine,
every ``python -m dask_ddp`` command line the README and docs/ show parses, and
BENCHMARKS.md says where each figure comes from."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import dask_ddp

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = README.with_name("BENCHMARKS.md")


@pytest.mark.slow
def test_quick_start_runs(tmp_path: Path) -> None:
    block = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    assert len(block.splitlines()) <= 25
    script = tmp_path / "quickstart.py"
    script.write_text(block)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[0, 1]"


def _sections(text: str) -> list[str]:
    return re.split(r"(?m)^(?=## )", text)[1:]


def test_every_benchmarks_section_names_its_commit() -> None:
    """A figure without the commit it was measured on is not quoted: each section of
    BENCHMARKS.md names at least one."""
    commit = re.compile(r"`[0-9a-f]{7,40}`")
    missing = [
        s.split("\n", 1)[0] for s in _sections(BENCHMARKS.read_text()) if not commit.search(s)
    ]
    assert not missing, f"BENCHMARKS.md sections without a commit: {missing}"
    assert len(_sections("## a `0123abc`\n## b\n")) == 2


# --- The README's Python blocks, run as a notebook session on one machine -----------------


@dataclasses.dataclass(frozen=True)
class _Block:
    """How one of the README's Python blocks runs here: ``holds`` is a line of it (to know
    it by), ``before`` the code run first in the session's namespace (what the README
    leaves to the reader), ``replace`` what is swapped in its text, each pair found in it,
    and ``skip`` why it cannot run on one machine (then it is only compiled)."""

    holds: str
    before: str = ""
    replace: tuple[tuple[str, str], ...] = ()
    skip: str = ""


# Every Python block of README.md, in order: a block added, removed or moved fails
# test_readme_python_blocks_run until it is listed here. None is skipped today: a block
# that needs what one machine lacks (GPUs, a cluster of many hosts, a real S3 bucket it
# cannot do without) gets ``skip=`` with the reason. The S3 URL of the jobs block is a
# local folder instead (what it checks, a job launched, listed and attached by name, does
# not depend on where its checkpoints would go).
_BLOCKS = (
    # The quick start: its LocalCluster(n_workers=2, threads_per_worker=1) is the shared
    # cluster of 2 worker processes (tests/conftest.py), which its `with` leaves running.
    _Block(holds="job = dask_ddp.launch(client, train, args=(100, 0.01))"),
    # Jobs in the cluster: `client` and `train` are the quick start's, as in a notebook.
    _Block(
        holds='job = dask_ddp.attach(client, "nightly")',
        before="client = notebook_client",
        replace=(('"s3://bucket/nightly"', "nightly_dir"),),
    ),
    # A sweep: `client` is the notebook's, as in the jobs block.
    _Block(holds="sweep = dask_ddp.sweep(client, fit, study,", before="client = notebook_client"),
    # Migrating from dask-pytorch-ddp: `train` and `cfg` are such a user's.
    _Block(
        holds="futures = dispatch.run(client, train, cfg, backend=",
        before=(
            "cfg = {'steps': 3}\n"
            "def train(cfg, local_rank):\n"
            "    import torch.distributed as dist\n"
            "    return dist.get_rank(), local_rank, cfg['steps']\n"
        ),
    ),
)


class _SharedCluster:
    """Stands in for ``LocalCluster(...)`` in a block: the shared cluster, left running."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.asked: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> _SharedCluster:
        self.asked.append(kwargs)
        return self

    def __enter__(self) -> Any:
        return self.cluster

    def __exit__(self, *exc: object) -> None:
        return None


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.slow
def test_readme_python_blocks_run(
    client: Any,
    cluster: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each Python block of the README runs, in order, in one namespace (as cells of one
    notebook) against the shared LocalCluster, and does what the README says it does."""
    import dask.distributed

    blocks = _python_blocks(README.read_text())
    held = [b.holds in t for b, t in zip(_BLOCKS, blocks, strict=False)]
    assert len(blocks) == len(_BLOCKS) and all(held), (
        "README.md's Python blocks changed: list each in _BLOCKS, in order"
    )
    stand_in = _SharedCluster(cluster)
    monkeypatch.setattr(dask.distributed, "LocalCluster", stand_in)
    # "__main__": the quick start's guard runs, and cloudpickle ships its functions by value.
    namespace: dict[str, Any] = {
        "__name__": "__main__",
        "notebook_client": client,
        "nightly_dir": str(tmp_path / "nightly"),
    }
    for block, text in zip(_BLOCKS, blocks, strict=True):
        for old, new in block.replace:
            assert old in text, f"{old!r} is no longer in the README block holding {block.holds!r}"
            text = text.replace(old, new)
        code = compile(text, f"README.md block holding {block.holds!r}", "exec")
        if block.skip:
            continue
        exec(block.before, namespace)
        exec(code, namespace)
        if block is _BLOCKS[0]:
            assert stand_in.asked == [{"n_workers": 2, "threads_per_worker": 1}]
            assert capsys.readouterr().out.strip().splitlines()[-1] == "[0, 1]"
        elif block is _BLOCKS[1]:
            job = namespace["job"]  # the attached one
            assert job.name == "nightly"
            assert job.result() == [0, 1]
            assert "nightly" in [j.name for j in dask_ddp.jobs(client)]
        elif block is _BLOCKS[2]:
            sweep = namespace["sweep"]
            assert sweep.state == "succeeded" and len(sweep.trials) == 8
            best = dask_ddp.attach(client, "lr-search").best_trial
            assert best is not None and capsys.readouterr().out.strip() == str(best.params)
        else:
            assert client.gather(namespace["futures"]) == [(0, 0, 3), (1, 1, 3)]
    namespace.clear()  # the futures and jobs it holds


# --- Every `python -m dask_ddp ...` in the docs, against the command line's parser ----------

_DOCS = [README, *sorted(README.with_name("docs").glob("*.md"))]
_COMMAND = re.compile(r"(?:python -m dask_ddp|dask-ddp)(?=\s|$)")


def _command_lines(text: str) -> list[str]:
    """The ``python -m dask_ddp ...`` (or ``dask-ddp ...``) command lines of a Markdown
    text: in its shell blocks, one a line (a ``$`` prompt, a ``# comment`` and what comes
    after ``&&``, ``;`` or ``|`` left out), and in its inline code (``python -m dask_ddp``
    only: ``dask-ddp`` in prose is the project's name).

    >>> _command_lines("```bash\\n$ pip install . && dask-ddp a.py --x 1  # run\\n```\\n"
    ...                "and `python -m dask_ddp\\n  --nworkers 2 b.py` or `python -m dask_ddp._x`")
    ['dask-ddp a.py --x 1', 'python -m dask_ddp --nworkers 2 b.py']
    """
    found = []
    fenced = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", re.S | re.M)
    for lang, body in fenced.findall(text):
        if lang == "python":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"^\s*\$\s+", "", line)
            for part in re.split(r"&&|\|\||;|\|", line):
                part = re.sub(r"\s+#.*$", "", part).strip()
                if _COMMAND.match(part):
                    found.append(part)
    prose = fenced.sub("", text)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if span.startswith("python -m dask_ddp") and _COMMAND.match(span):
            found.append(span)
    return found


def _script_flags(path: Path) -> set[str] | None:
    """The options a script's argparse parser takes (read from its ``add_argument`` calls),
    or None if it adds none."""
    flags = {
        arg.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and str(arg.value).startswith("-")
    }
    return flags | {"-h", "--help"} if flags else None


def _command_line_errors(command: str) -> str | None:
    """What is wrong with one documented command line: an option the command line's own
    parser (dask_ddp._client.cli) does not take or refuses, or, for a script of this
    repository (examples/train.py), an option that script does not take. None if nothing.

    >>> _command_line_errors("python -m dask_ddp --nworkers 2 examples/train.py --steps 3")
    >>> print(_command_line_errors("python -m dask_ddp --nworker 2 train.py"))  # doctest: +ELLIPSIS
    python -m dask_ddp --nworker 2 train.py: ...: error: unrecognized arguments: --nworker
    >>> print(_command_line_errors("python -m dask_ddp examples/train.py --epochs 3"))
    python -m dask_ddp examples/train.py --epochs 3: examples/train.py takes no --epochs
    """
    from dask_ddp._client import cli

    parser = cli._parser()
    rest = command[_COMMAND.match(command).end() :]
    if "[" in rest:  # a synopsis ([--name NAME] ...): only its options are checked
        flags = re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", rest)
        unknown = [f for f in flags if f not in parser._option_string_actions]
        return f"{command}: takes no {' '.join(unknown)}" if unknown else None
    argv = shlex.split(rest)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            opts = parser.parse_args(argv)
    except SystemExit as exc:  # 0: --help
        return f"{command}: {said.getvalue().strip().splitlines()[-1]}" if exc.code else None
    script = ROOT / opts.script if opts.script else None
    if script is None or not script.is_file() or opts.module or opts.no_python:
        return None  # a user's script (train.py): its options are its own
    takes = _script_flags(script) or set()
    bad = [a for a in opts.args if a.startswith("-") and a.split("=")[0] not in takes]
    return f"{command}: {opts.script} takes no {' '.join(bad)}" if bad else None


def test_documented_command_lines_parse() -> None:
    """Every ``python -m dask_ddp ...`` the README and docs/ show uses only options the
    command line takes (and, for examples/train.py, options the script takes)."""
    commands = {doc.name: _command_lines(doc.read_text()) for doc in _DOCS}
    assert len(commands["README.md"]) >= 3 and len(commands["scripts.md"]) >= 10, commands
    wrong = [
        f"{name}: {error}"
        for name, lines in commands.items()
        for line in lines
        if (error := _command_line_errors(line)) is not None
    ]
    assert not wrong, "\n".join(wrong)

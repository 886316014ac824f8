"""The package's shape: small modules, small classes, distributed's internals behind one door.

These are the limits DESIGN.md sets for ``dask_ddp/`` (docstrings included): a module a
maintainer can read in one sitting, a class that owns one thing, and every use of
distributed's private API in ``dask_ddp/_dask_internals.py``, where its own tests name the
distributed versions it was checked against.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dask_ddp"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300
INTERNALS = PACKAGE / "_dask_internals.py"


def _name(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


# Private attributes of distributed's objects, as this package names them: a scheduler,
# client or worker (or their private parts) reached through a leading underscore, the
# worker's handler table and stored data, and distributed's sync helper.
PRIVATE_DISTRIBUTED = re.compile(
    r"(?<![A-Za-z0-9])_?(?:dask_scheduler|scheduler|client|worker)\._[a-z]\w*"
    r"|(?<![A-Za-z0-9])_?worker\.(?:handlers|data)\b"
    r"|\bdistributed\.utils\.sync\b|\bfrom distributed\.utils import[^\n]*\bsync\b"
)


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_module_is_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{_name(path)} has {lines} lines: split it by what it owns"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_classes_are_small(path: Path) -> None:
    tree = ast.parse(path.read_text())
    big = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    }
    assert not big, f"{_name(path)}: classes over {MAX_CLASS_LINES} lines: {big}"


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """The lines of ``path`` with comments and docstrings left out."""
    tree = ast.parse(path.read_text())
    docs: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.update(range(first.lineno, first.end_lineno + 1))
    return [
        (number, line.split("#", 1)[0])
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if number not in docs
    ]


@pytest.mark.parametrize("path", [p for p in MODULES if p != INTERNALS], ids=_name)
def test_private_distributed_api_only_in_internals(path: Path) -> None:
    uses = [
        f"{number}: {line.strip()}"
        for number, line in _code_lines(path)
        if PRIVATE_DISTRIBUTED.search(line)
    ]
    assert not uses, (
        f"{_name(path)} uses distributed's private API outside dask_ddp/_dask_internals.py:\n"
        + "\n".join(uses)
    )


def test_the_pattern_finds_what_it_should() -> None:
    for line in (
        "broker = dask_scheduler._broker",
        "client._send_to_scheduler({})",
        "worker.handlers.setdefault(x, y)",
        "value = worker.data[key]",
        "from distributed.utils import sync",
        "self._worker.handlers.setdefault(x, y)",
    ):
        assert PRIVATE_DISTRIBUTED.search(line), line
    for line in ("client.submit(fn)", "self._worker = worker", "worker.address", "client.run(f)"):
        assert not PRIVATE_DISTRIBUTED.search(line), line

"""The package's shape: three wings on one ground floor, no import circles, and every use
of distributed's private API behind one door (``dask_ddp/_dask_internals.py``, whose own
tests check each of them against the installed distributed).

Size is not checked here: a module is as long as what it owns needs (see docs/design.md).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dask_ddp"
MODULES = sorted(PACKAGE.rglob("*.py"))
INTERNALS = PACKAGE / "_dask_internals.py"


def _name(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


NAMES = {_module(p): p for p in MODULES}


def _imports(path: Path) -> set[str]:
    """The dask_ddp modules ``path`` imports: at the top, inside functions and under
    ``TYPE_CHECKING`` alike (a circle broken by a lazy import is still a circle)."""
    name = _module(path)
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(
                    base[: len(base) - node.level + 1] + ([node.module] if node.module else [])
                )
            else:
                target = node.module or ""
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in NAMES else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in NAMES and m != name}


GRAPH = {name: _imports(path) for name, path in NAMES.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles() -> None:
    assert _circles(GRAPH) == []


def test_the_circle_finder_finds_circles() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


# Three wings and one ground floor (docs/design.md): the client (launch, the job's handle),
# the scheduler (the plugin and each job's supervisor) and the ranks (what runs on the
# workers). Each wing imports only the ground floor (the protocol between the wings and the
# values they share), the library (dask_ddp.data) and its own modules; the ground floor
# imports only itself. The public facades (the package, the dask-pytorch-ddp results
# handler, the framework integrations) may import anything.
GROUND = {
    "dask_ddp._protocol",
    "dask_ddp._activity",
    "dask_ddp._types",
    "dask_ddp.errors",
    "dask_ddp.config",
    "dask_ddp.placement",
    "dask_ddp._dask_internals",
    "dask_ddp._progress",
    "dask_ddp.view",
    "dask_ddp._traceback",
    "dask_ddp._preload",
    "dask_ddp.script",
    "dask_ddp._version",
}
CLIENT = {
    "dask_ddp.dispatch",
    "dask_ddp.job",
    "dask_ddp._model",
    "dask_ddp._reader",
    "dask_ddp._topics",
    "dask_ddp._cluster",
    "dask_ddp.__main__",
}
SCHEDULER = {
    "dask_ddp._plugin",
    "dask_ddp.supervise",
    "dask_ddp._lifecycle",
    "dask_ddp._pool",
    "dask_ddp._launcher",
    "dask_ddp._ledger",
    "dask_ddp._dashboard",
    "dask_ddp.dashboard",
}
RANK = {
    "dask_ddp.bootstrap",
    "dask_ddp._cuda",
    "dask_ddp.context",
    "dask_ddp._slot",
    "dask_ddp.events",
    "dask_ddp.checkpoint",
    "dask_ddp._saving",
    "dask_ddp._replicas",
    "dask_ddp._resume",
    "dask_ddp._resize",
    "dask_ddp._status",
    "dask_ddp._output",
    "dask_ddp._process",
    "dask_ddp._malloc",
    "dask_ddp._lanes",
    "dask_ddp._rankproc",
    "dask_ddp._template",
    "dask_ddp._storehost",
}
LIBRARY = {m for m in NAMES if m.startswith("dask_ddp.data")}
FACADES = {"dask_ddp", "dask_ddp.results"} | {
    m for m in NAMES if m.startswith("dask_ddp.integrations")
}
WINGS = {"client": CLIENT, "scheduler": SCHEDULER, "rank": RANK}


def _reach(module: str, graph: dict[str, set[str]]) -> set[str]:
    """Every module ``module`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for found in graph[todo.pop()] - seen:
            seen.add(found)
            todo.append(found)
    return seen


def test_every_module_has_its_place() -> None:
    placed = GROUND | LIBRARY | FACADES | CLIENT | SCHEDULER | RANK
    assert set(NAMES) - placed == set(), "add each new module to a wing or the ground floor"
    groups = [GROUND, LIBRARY, FACADES, CLIENT, SCHEDULER, RANK]
    assert sum(len(g) for g in groups) == len(placed), "a module is in two places"


@pytest.mark.parametrize("module", sorted(GROUND))
def test_the_ground_floor_imports_no_wing(module: str) -> None:
    assert _reach(module, GRAPH) - GROUND == set()


@pytest.mark.parametrize(
    ("wing", "module"), [(w, m) for w, ms in sorted(WINGS.items()) for m in sorted(ms)]
)
def test_a_wing_imports_only_the_ground_floor_and_itself(wing: str, module: str) -> None:
    outside = _reach(module, GRAPH) - GROUND - LIBRARY - WINGS[wing]
    assert not outside, f"{module} ({wing} wing) reaches {sorted(outside)}"


def test_the_wing_check_sees_through_other_modules() -> None:
    graph = {"c": {"g"}, "g": set(), "c2": {"c"}, "s": {"c2"}}
    assert _reach("s", graph) == {"c2", "c", "g"}
    assert _reach("g", graph) == set()


@pytest.mark.parametrize("module", sorted(m for m in NAMES if m.startswith("dask_ddp.data")))
def test_data_needs_no_cluster_and_no_rank_context(module: str) -> None:
    # Datasets run anywhere (a notebook, a DataLoader worker): they take rank and world
    # size from their caller or torch.distributed, never from dask_ddp.context.
    assert _reach(module, GRAPH) - GROUND - LIBRARY == set()


# Private attributes of distributed's objects, as this package names them: a scheduler,
# client or worker (or their private parts) reached through a leading underscore, the
# worker's handler table and stored data, distributed's sync helper, a client's connections
# to other servers, a coordination primitive bound to a private RPC and loop, a Semaphore's
# refresh callback, and the HTTP router's list of applications.
PRIVATE_DISTRIBUTED = re.compile(
    r"(?<![A-Za-z0-9])_?(?:dask_scheduler|scheduler|client|worker)\._[a-z]\w*"
    r"|(?<![A-Za-z0-9])_?worker\.(?:handlers|data)\b"
    r"|\bdistributed\.utils\.sync\b|\bfrom distributed\.utils import[^\n]*\bsync\b"
    r"|\bclient\.rpc\(|\bclient\.scheduler\.\w+\("
    r"|\bscheduler_rpc=|\bloop=|\.refresh_callback\b"
    r"|\bhttp_application\.applications\b|\bhttp\.applications\b"
)


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
        "await client.rpc(worker).dask_ddp_blob(key=k)",
        "await client.scheduler.events(topic=t)",
        "Semaphore(name=n, scheduler_rpc=client.scheduler, loop=client.loop)",
        "sem.refresh_callback.stop()",
        "http_application.applications.remove(app)",
    ):
        assert PRIVATE_DISTRIBUTED.search(line), line
    for line in (
        "client.submit(fn)",
        "self._worker = worker",
        "worker.address",
        "client.run(f)",
        "client.loop.call_later(1, f)",
        "client.scheduler.address",
    ):
        assert not PRIVATE_DISTRIBUTED.search(line), line


def test_every_module_has_its_line_in_the_design() -> None:
    """docs/design.md says what each module owns: a module added without its line fails here."""
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    parts = design.split("## Parts and what each owns", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"[\w/]+\.py|\w+/", parts))
    own = [p.name for p in MODULES if p.parent == PACKAGE and p.name != "_version.py"]
    own += [f"{d.name}/" for d in PACKAGE.iterdir() if (d / "__init__.py").exists()]
    missing = sorted(set(own) - named)
    assert not missing, f"docs/design.md, 'Parts and what each owns', does not name {missing}"

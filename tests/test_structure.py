"""The package's shape: three wings on one ground floor, no import circles, and every use
of distributed's private API behind one door (``dask_ddp/_shared/dask_internals.py``, whose own
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
INTERNALS = PACKAGE / "_shared" / "dask_internals.py"


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


# Three wings and one ground floor (docs/design.md), each a folder: the client (launch, the
# job's handle), the scheduler (the plugin and each job's supervisor) and the ranks (what
# runs on the workers). Each wing imports only the ground floor (``_shared/``, with the
# public ``errors`` and ``config`` every wing raises and reads), the library
# (``dask_ddp.data``) and its own folder; the ground floor imports only itself. The top
# level holds the public modules, which may import anything; nothing else sits outside
# a folder.
FOLDERS = {"client": "_client", "scheduler": "_scheduler", "rank": "_rank"}
PUBLIC = {
    "dask_ddp",
    "dask_ddp.__main__",
    "dask_ddp.dispatch",
    "dask_ddp.results",
    "dask_ddp.dashboard",
    "dask_ddp.errors",
    "dask_ddp.config",
}


def _in(folder: str, names: set[str] | dict[str, Path] = NAMES) -> set[str]:
    return {m for m in names if m == f"dask_ddp.{folder}" or m.startswith(f"dask_ddp.{folder}.")}


GROUND = _in("_shared") | {"dask_ddp.errors", "dask_ddp.config"}
WINGS = {wing: _in(folder) for wing, folder in FOLDERS.items()}
LIBRARY = _in("data")
FACADES = (PUBLIC - GROUND) | _in("integrations")


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
    """A module sits in a wing's folder, the ground floor's, the library's or the
    integrations', or is one of the public modules at the top."""
    placed = GROUND | LIBRARY | FACADES | set().union(*WINGS.values())
    outside = sorted(set(NAMES) - placed)
    assert not outside, f"{outside} sit outside the wings: move each into a wing's folder"


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
    # size from their caller or torch.distributed, never from dask_ddp._rank.context.
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
        f"{_name(path)} uses distributed's private API outside "
        "dask_ddp/_shared/dask_internals.py:\n" + "\n".join(uses)
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


def _design_map() -> set[str]:
    """The modules docs/design.md's map names, as paths: ``_client/launch.py`` under the
    ``_client/:`` heading, ``dispatch.py`` under none."""
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    parts = design.split("## Parts and what each owns", 1)[1].split("\n## ", 1)[0]
    block = parts.split("```", 2)[1]
    named, folder = set(), ""
    for line in block.splitlines():
        heading = re.match(r"  (_\w+/):", line)
        if heading:
            folder = heading.group(1)
        elif line.startswith(("tests/", "benchmarks/", "notebooks/")):
            folder = ""
        for name in re.findall(r"(?<![\w/.])(\w+\.py|\w+/)(?=\s|$)", line):
            named.add(name if name.endswith("/") else folder + name)
    return named


def test_every_module_has_its_line_in_the_design() -> None:
    """docs/design.md says what each module owns, under its folder: a module added or moved
    without its line fails here."""
    named = _design_map()
    own = {
        str(p.relative_to(PACKAGE))
        for p in MODULES
        if p.name != "__init__.py" and p.parent.name not in ("data", "integrations")
    }
    own |= {"__init__.py", "data/", "integrations/"}
    missing = sorted(own - named)
    assert not missing, f"docs/design.md, 'Parts and what each owns', does not name {missing}"


# -- multiprocessing's private names, and the Pythons the package admits -------------------------


def _multiprocessing_private_names(path: Path) -> list[str]:
    """Each private name of ``multiprocessing`` that ``path`` reaches: an attribute or an
    import beginning with ``_`` on ``multiprocessing`` or one of its modules (through any
    name it was imported as)."""
    tree = ast.parse(path.read_text())
    aliases: set[str] = set()  # names bound to multiprocessing or one of its modules
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "multiprocessing":
                    aliases.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("multiprocessing"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"from {node.module} import {alias.name}")
                aliases.add(alias.asname or alias.name)
            if any(part.startswith("_") for part in (node.module or "").split(".")):
                found.append(f"from {node.module} import ...")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            base = node.value
            while isinstance(base, ast.Attribute | ast.Call):
                base = base.value if isinstance(base, ast.Attribute) else base.func
            if isinstance(base, ast.Name) and base.id in aliases and not node.attr.startswith("__"):
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_module_uses_a_private_name_of_multiprocessing(path: Path) -> None:
    # The rank template was multiprocessing's forkserver, subclassed: its private fields,
    # a copy of Popen._launch, a patched reduction.recvfds, the daemon flag in
    # current_process()._config. Each Python release may move them (3.12 added an
    # authentication handshake to the forkserver): the fork server is our own now.
    assert _multiprocessing_private_names(path) == []


def test_the_private_name_check_sees_them() -> None:
    import tempfile

    code = (
        "import multiprocessing\nfrom multiprocessing import popen_forkserver as pf\n"
        "from multiprocessing.forkserver import _forkserver\n"
        "multiprocessing.current_process()._config\npf.Popen._launch\n"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    try:
        found = _multiprocessing_private_names(Path(f.name))
    finally:
        Path(f.name).unlink()
    assert found == [
        "from multiprocessing.forkserver import _forkserver",
        "line 4: ._config",
        "line 5: ._launch",
    ]


def test_the_pythons_nox_tests_are_those_python_requires_admits() -> None:
    import configparser

    from packaging.specifiers import SpecifierSet

    root = PACKAGE.parent
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    admitted = SpecifierSet(config["options"]["python_requires"])
    nox = ast.parse((root / "noxfile.py").read_text())
    [pythons] = [
        ast.literal_eval(node.value)
        for node in ast.walk(nox)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PYTHONS"
    ]
    candidates = [f"3.{minor}" for minor in range(8, 16)]
    assert pythons == [v for v in candidates if f"{v}.0" in admitted]

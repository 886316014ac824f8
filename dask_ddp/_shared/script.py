"""torchrun-style scripts as ranks: the script as ``__main__``, its folder importable.

On the client, :func:`script_files` finds what the script imports from its own folder
(the way :mod:`modulefinder` reads imports, without running anything), :func:`module_files`
does the same for a module run as ``python -m NAME`` (torchrun's ``-m``), and
:func:`script_settings` reads what the script says about itself in its inline metadata
(PEP 723, a ``[tool.dask-ddp]`` table). On each rank, :func:`run_module` runs a module as
``python -m`` would, :func:`run_program` runs a program that is not Python (torchrun's
``--no-python``) with the rank's environment, and :func:`run_script` runs the script as
``python script.py`` would:

- a fresh module object is ``sys.modules["__main__"]`` while it runs, so pickle finds the
  classes and functions it defines (``torch.save(model)`` of its own ``nn.Module``);
- its folder is first on ``sys.path``: the folder itself when this worker sees the shipped
  modules there unchanged (a shared filesystem), else a temporary copy of them;
- ``sys.argv`` is ``[path, *args]`` (torchrun's environment, ``TORCHELASTIC_*``
  included, comes from :mod:`dask_ddp._rank.tasks`).

Afterwards the worker gets back its own ``__main__``, ``sys.argv``, ``sys.path`` and working
directory (the environment is the rank's, restored by the bootstrap), and forgets the
modules the script imported from its folder, so the next job's script imports its own.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import hashlib
import importlib.util
import linecache
import modulefinder
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import ScriptExitError, ScriptModulesTooLargeError, ScriptSettingsError

__all__ = [
    "ScriptExitError",
    "ScriptFiles",
    "ScriptModulesTooLargeError",
    "ScriptSettingsError",
    "module_files",
    "run_module",
    "run_program",
    "run_script",
    "script_files",
    "script_settings",
]


SETTINGS = {"resume": ("own-snapshots",)}

# PEP 723's reference regular expression for inline script metadata blocks.
_METADATA = re.compile(r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$")


def script_settings(source: str, path: str = "script") -> dict[str, Any]:
    """The ``[tool.dask-ddp]`` table of the script's inline metadata (PEP 723), or {}.

    >>> script_settings('''# /// script
    ... # dependencies = ["torch"]
    ... # [tool.dask-ddp]
    ... # resume = "own-snapshots"
    ... # ///
    ... import torch''')
    {'resume': 'own-snapshots'}
    >>> script_settings("import torch")
    {}
    """
    blocks = [m for m in _METADATA.finditer(source) if m["type"] == "script"]
    if not blocks:
        return {}
    if len(blocks) > 1:
        raise ScriptSettingsError(path, "appears more than once")
    content = "".join(
        line[2:] if line.startswith("# ") else line[1:]
        for line in blocks[0]["content"].splitlines(keepends=True)
    )
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ScriptSettingsError(
                path, "needs Python 3.11 or the tomli package to be read"
            ) from None
    try:
        table = tomllib.loads(content).get("tool", {}).get("dask-ddp", {})
    except tomllib.TOMLDecodeError as exc:
        raise ScriptSettingsError(path, f"is not valid TOML: {exc}") from exc
    for key, value in table.items():
        if key not in SETTINGS:
            raise ScriptSettingsError(
                path, f"has [tool.dask-ddp] {key!r}; known keys: {', '.join(SETTINGS)}"
            )
        if value not in SETTINGS[key]:
            raise ScriptSettingsError(
                path, f"has {key} = {value!r}; accepted: {', '.join(map(repr, SETTINGS[key]))}"
            )
    return table


@dataclasses.dataclass(frozen=True)
class ScriptFiles:
    """Where the script lives on the client, and the modules it imports from its folder.

    ``file`` is its absolute path (``__file__`` under ``python``), ``folder`` the folder
    that ``python`` puts first on ``sys.path`` (symbolic links resolved), and ``modules``
    maps each module file's path inside ``folder`` to its bytes.
    """

    file: str
    folder: str
    modules: dict[str, bytes] = dataclasses.field(default_factory=dict)

    @property
    def digests(self) -> dict[str, str]:
        """Each shipped module's SHA-256, by its path inside the folder."""
        return {name: hashlib.sha256(data).hexdigest() for name, data in self.modules.items()}

    def without_modules(self) -> ScriptFiles:
        return dataclasses.replace(self, modules={})


def script_files(path: str) -> ScriptFiles:
    """Find the modules and packages ``path`` imports from its own folder, at any depth
    and wherever in the code (a function's ``import`` too); nothing is run.

    Modules imported by a computed name (``importlib.import_module(name)``) are not found:
    workers see those only through a shared folder or an installed package.
    """
    file = os.path.abspath(path)
    folder = os.path.dirname(os.path.realpath(path))
    finder = modulefinder.ModuleFinder(path=[folder])
    finder.run_script(file)
    modules = {}
    for name, module in finder.modules.items():
        where = module.__file__
        if name == "__main__" or not where or not where.startswith(folder + os.sep):
            continue
        with open(where, "rb") as f:
            modules[os.path.relpath(where, folder)] = f.read()
    return ScriptFiles(file, folder, modules)


def module_files(name: str, folder: str | None = None) -> ScriptFiles:
    """Find the module ``python -m NAME`` would run from ``folder`` (default: the working
    directory, first on its ``sys.path``), and the modules it imports from there; nothing of
    the module itself is run (its parent packages are imported to find it, as ``python -m``
    does).

    ``file`` is the module's file and ``folder`` the working directory. A module under that
    folder is shipped with what it imports from there (and its packages' ``__init__``
    files); an installed one (outside it) must be installed on the workers too, as on each
    node under torchrun.

    Raises
    ------
    ModuleNotFoundError
        ``python -m NAME`` would not find it either.
    """
    folder = os.path.realpath(folder or os.getcwd())
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{name}.__main__")  # a package: its __main__
    except (ImportError, ValueError) as exc:
        raise ModuleNotFoundError(f"No module named {name!r} ({exc})", name=name) from exc
    finally:
        if added:
            sys.path.remove(folder)
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    file = spec.origin
    if not os.path.realpath(file).startswith(folder + os.sep):
        return ScriptFiles(file, folder)  # installed: the workers import their own copy
    # By its name: its packages' __init__ files come too, and relative imports resolve.
    finder = modulefinder.ModuleFinder(path=[folder])
    finder.import_hook(spec.name)
    modules = {}
    for found in finder.modules.values():
        where = found.__file__
        if where and os.path.realpath(where).startswith(folder + os.sep):
            with open(where, "rb") as f:
                modules[os.path.relpath(os.path.realpath(where), folder)] = f.read()
    return ScriptFiles(os.path.abspath(file), folder, modules)


def sees_modules(folder: str, digests: Mapping[str, str], dask_worker: Any = None) -> bool:
    """Whether this machine has each module at ``folder`` with the given SHA-256
    (run on the workers by ``client.run``, and by each rank for itself)."""
    for name, digest in digests.items():
        try:
            with open(os.path.join(folder, name), "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != digest:
                    return False
        except OSError:
            return False
    return True


# -- the rank: the script as __main__ --------------------------------------------------


@contextlib.contextmanager
def _importable(files: ScriptFiles) -> Iterator[None]:
    """The script's folder first on ``sys.path`` (or a copy of its modules, where this
    worker does not see them); afterwards the worker's own ``sys.path``, and the modules
    the script imported from there forgotten."""
    copy = None
    folder = files.folder
    if not sees_modules(folder, files.digests):
        folder = copy = tempfile.mkdtemp(prefix="dask-ddp-script-")
        for name, data in files.modules.items():
            os.makedirs(os.path.dirname(os.path.join(copy, name)), exist_ok=True)
            with open(os.path.join(copy, name), "wb") as f:
                f.write(data)
    saved, before = list(sys.path), set(sys.modules)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path[:] = saved
        sys.path_importer_cache.pop(folder, None)
        for name in set(sys.modules) - before:
            where = getattr(sys.modules[name], "__file__", None) or ""
            if where.startswith(folder + os.sep):
                del sys.modules[name]
        if copy is not None:
            shutil.rmtree(copy, ignore_errors=True)


@contextlib.contextmanager
def _as_main(module: types.ModuleType, source: str) -> Iterator[None]:
    """``module`` is ``__main__`` and ``source`` the lines of its file (for tracebacks,
    :mod:`inspect` and ``torch.jit.script``, where the file is not on this worker)."""
    file = module.__file__ or ""
    saved_main, saved_lines = sys.modules["__main__"], linecache.cache.get(file)
    sys.modules["__main__"] = module
    linecache.cache[file] = (len(source), None, source.splitlines(keepends=True), file)
    try:
        yield
    finally:
        sys.modules["__main__"] = saved_main
        if saved_lines is None:
            linecache.cache.pop(file, None)
        else:
            linecache.cache[file] = saved_lines


@contextlib.contextmanager
def _process_state(argv: list[str]) -> Iterator[None]:
    """``sys.argv`` for the script; the worker's own, and its working directory, after."""
    saved_argv, cwd = sys.argv, os.getcwd()
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved_argv
        with contextlib.suppress(OSError):
            os.chdir(cwd)


def run_script(
    source: str,
    path: str,
    args: list[str],
    *,
    files: ScriptFiles | None = None,
) -> int:
    """Run ``source`` as the ``__main__`` module of ``path``; return its exit code (0).

    A non-zero ``sys.exit`` raises :class:`ScriptExitError`.
    """
    if files is None:
        files = ScriptFiles(os.path.abspath(path), os.path.dirname(os.path.realpath(path)))
    code = compile(source, files.file, "exec")
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=files.file, __builtins__=builtins, __cached__=None, __package__=None
    )
    with (
        _process_state([path, *args]),
        _importable(files),
        _as_main(main, source),
    ):
        try:
            exec(code, main.__dict__)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise ScriptExitError(path, exc.code) from None
    return 0


def run_module(name: str, args: list[str], *, files: ScriptFiles) -> int:
    """Run the module ``name`` as ``python -m name args`` would (torchrun's ``-m``), with
    ``files.folder`` (the client's working directory, or a copy of the modules shipped from
    there) first on ``sys.path``; return its exit code (0).

    A non-zero ``sys.exit`` raises :class:`ScriptExitError`.
    """
    with _process_state([files.file, *args]), _importable(files):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise ScriptExitError(name, exc.code) from None
    return 0


def run_program(program: str, args: list[str]) -> int:
    """Run ``program args`` as a process of its own (torchrun's ``--no-python``: a program
    that is not Python, or a wrapper that starts one) with the rank's environment, which
    has torchrun's variables; its output lines are the rank's. Returns 0.

    The program runs in the rank's process group: a stop (the job was cancelled, another
    rank failed) sends it SIGTERM with the rank, and SIGKILL after ``ddp.failure-grace``.

    Raises
    ------
    ScriptExitError
        It exited with a non-zero status.
    FileNotFoundError
        There is no such program on this worker.
    """
    proc = subprocess.Popen(
        [program, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        bufsize=1,
    )
    relays = [
        threading.Thread(target=_relay, args=(stream, name), daemon=True)
        for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))
    ]
    for relay in relays:
        relay.start()
    try:
        code = proc.wait()  # a stop's SIGTERM interrupts it (the rank's handler raises)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for relay in relays:
            relay.join()
    if code != 0:
        raise ScriptExitError(program, code)
    return 0


def _relay(stream: Any, name: str) -> None:
    """Write each line of a child's ``stream`` to this process's ``sys.<name>``, where the
    rank's output is forwarded from."""
    for line in stream:
        target = getattr(sys, name)
        target.write(line)
        target.flush()

"""torchrun-style scripts as ranks: the script as ``__main__``, its folder importable.

On the client, :func:`script_files` finds what the script imports from its own folder
(the way :mod:`modulefinder` reads imports, without running anything) and
:func:`script_settings` reads what the script says about itself in its inline metadata
(PEP 723, a ``[tool.dask-ddp]`` table). On each rank, :func:`run_script` runs the script as
``python script.py`` would:

- a fresh module object is ``sys.modules["__main__"]`` while it runs, so pickle finds the
  classes and functions it defines (``torch.save(model)`` of its own ``nn.Module``);
- its folder is first on ``sys.path``: the folder itself when this worker sees the shipped
  modules there unchanged (a shared filesystem), else a temporary copy of them;
- ``sys.argv`` is ``[path, *args]`` (torchrun's environment, ``TORCHELASTIC_*``
  included, comes from :mod:`dask_ddp.bootstrap`).

Afterwards the worker gets back its own ``__main__``, ``sys.argv``, ``sys.path`` and working
directory (the environment is the rank's, restored by the bootstrap), and forgets the
modules the script imported from its folder, so the next job's script imports its own.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import hashlib
import linecache
import modulefinder
import os
import re
import shutil
import sys
import tempfile
import types
from collections.abc import Iterator, Mapping
from typing import Any

from .errors import ScriptExitError, ScriptModulesTooLargeError, ScriptSettingsError

__all__ = [
    "ScriptExitError",
    "ScriptFiles",
    "ScriptModulesTooLargeError",
    "ScriptSettingsError",
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

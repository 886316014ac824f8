"""Run a torchrun-style script as one rank: ``__main__``, ``sys.argv``, exit status."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

__all__ = ["ScriptExitError", "run_script"]

from .errors import DaskDDPError


class ScriptExitError(DaskDDPError):
    """A script called ``sys.exit`` with a non-zero status on a rank."""

    def __init__(self, path: str, code: object) -> None:
        super().__init__(path, code)
        self.path, self.code = path, code

    def __str__(self) -> str:
        return f"script {self.path} exited with status {self.code!r}"


@contextlib.contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


def run_script(source: str, path: str, args: list[str]) -> int:
    """Execute ``source`` as the ``__main__`` module of ``path``; return its exit code (0)."""
    code = compile(source, path, "exec")
    namespace = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
    with _argv([path, *args]):
        try:
            exec(code, namespace)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise ScriptExitError(path, exc.code) from None
    return 0

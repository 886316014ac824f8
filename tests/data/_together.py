"""Run a function in several forked processes that all start it at the same moment.

Tests of the host-wide cache use it to make processes contend for the same entries.
Imported by the test modules beside it (pytest puts this folder on ``sys.path``); a
module of its own, not conftest.py, because the processes unpickle its functions by name.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

_start: multiprocessing.synchronize.Barrier | None = None


def _join(barrier: multiprocessing.synchronize.Barrier) -> None:
    global _start
    _start = barrier


def _at_once(fn: Callable[[Any], Any], arg: Any) -> Any:
    assert _start is not None
    _start.wait(timeout=60)  # every process starts at once, so they contend
    return fn(arg)


def run_together(fn: Callable[[Any], Any], args: Sequence[Any]) -> list[Any]:
    """``[fn(a) for a in args]``, each in its own forked process, started together."""
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(len(args))
    with ProcessPoolExecutor(len(args), ctx, _join, (barrier,)) as pool:
        return list(pool.map(_at_once, [fn] * len(args), args))

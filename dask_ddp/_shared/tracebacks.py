"""A failed rank's traceback as its author reads it, on the client.

The rank's exception comes back through Dask with every frame of the worker: Dask's task
machinery and dask-ddp's around the user's own. And cloudpickle sends a function defined
in ``__main__`` or a notebook cell by value, naming its file ``<dynamic-code>`` (it keeps
the line numbers), so its frames show no source line and no "Cell In[n]". Here the
traceback keeps the user's frames only, and those frames get back the file (or notebook
cell) and source line that the client's copy of the function knows.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

import dask
import distributed

_LIBRARY_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (sys.modules["dask_ddp"], distributed, dask)
)
_FRAME = re.compile(r'\s*File "(.*)", line (\d+) in (.*)')
_THREAD = re.compile(r"^(?:Current thread|Thread) 0x", re.M)
_DYNAMIC = "<dynamic-code>"  # the file name cloudpickle gives code it sends by value
_DYNAMIC_FRAME = re.compile(
    r'^(?P<indent>[ \t]*)File "<dynamic-code>", line (?P<line>\d+) in (?P<name>.*)$', re.M
)
_CARETS = re.compile(r"^\s*[\^~]+\s*$")


def _codes(fn: Any) -> Iterator[types.CodeType]:
    """The code objects of ``fn`` and of the functions, lambdas and classes defined in it."""
    fn = getattr(fn, "func", fn)  # functools.partial
    fn = getattr(fn, "__func__", fn)  # bound method
    code = getattr(fn, "__code__", None) or getattr(type(fn).__call__, "__code__", None)
    todo = [code] if isinstance(code, types.CodeType) else []
    while todo:
        code = todo.pop()
        yield code
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]


class Sources:
    """Where the client's copy of a job's function lives: file, lines and source text of
    each code object, taken on the client (where a notebook cell's lines are) and sent
    with the job, so that a rank's code sent by value (``<dynamic-code>``) reads as its
    author wrote it wherever it is shown: a failed rank's traceback (:func:`rebuild`), its
    stacks (:meth:`restack`) and where a stalled rank is (:func:`stuck_at`).

    >>> def train():
    ...     return 1
    >>> file, shown, first = Sources(train).place("train", train.__code__.co_firstlineno + 1)
    >>> file == train.__code__.co_filename, shown == f'File "{file}"'
    (True, True)
    >>> first == train.__code__.co_firstlineno
    True
    >>> Sources(train).source_line("train", train.__code__.co_firstlineno + 1)
    'return 1'
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        # code name -> (first line, last line, file, shown name, the source lines between)
        self._spans: dict[str, list[tuple[int, int, str, str, tuple[str, ...]]]] = {}
        for code in _codes(fn):
            lines = [line for _, _, line in code.co_lines() if line is not None]
            first, last = code.co_firstlineno, max(lines, default=code.co_firstlineno)
            filename = code.co_filename
            text = tuple(linecache.getlines(filename)[first - 1 : last])
            span = (first, last, filename, _cell_name(filename), text)
            self._spans.setdefault(code.co_name, []).append(span)

    def _span(self, name: str, lineno: int) -> tuple[int, int, str, str, tuple[str, ...]] | None:
        for span in self._spans.get(name, ()):
            if span[0] <= lineno <= span[1]:
                return span
        return None

    def place(self, name: str, lineno: int) -> tuple[str, str, int] | None:
        """(file, shown name, the code's first line) of the frame ``name`` at ``lineno``
        sent as dynamic code."""
        span = self._span(name, lineno)
        return None if span is None else (span[2], span[3], span[0])

    def source_line(self, name: str, lineno: int) -> str:
        """The source line ``lineno`` of the code ``name``, stripped; "" if unknown."""
        span = self._span(name, lineno)
        return "" if span is None else _line(span, lineno)

    def restack(self, stacks: str) -> str:
        r"""A :mod:`faulthandler` dump with each frame of code sent by value under its file
        (or notebook cell) and followed by its source line, as a traceback shows it.

        >>> def train():
        ...     return 1
        >>> line = train.__code__.co_firstlineno + 1
        >>> dump = f'Current thread 0x02:\n  File "<dynamic-code>", line {line} in train\n'
        >>> shown = Sources(train).restack(dump).splitlines()
        >>> shown[1] == f'  File "{train.__code__.co_filename}", line {line} in train'
        True
        >>> shown[2]
        '    return 1'
        """

        def frame(m: re.Match[str]) -> str:
            name, lineno = m["name"], int(m["line"])
            span = self._span(name, lineno)
            if span is None:
                return m[0]
            source = _line(span, lineno)
            return f"{m['indent']}{span[3]}, line {lineno} in {name}" + (
                f"\n{m['indent']}  {source}" if source else ""
            )

        return _DYNAMIC_FRAME.sub(frame, stacks)

    def where(self, name: str, lineno: int) -> str | None:
        """Where a stalled rank is in code sent by value, ``"train (train.py:42:
        time.sleep(3600))"`` (``Cell In[3], line 4`` in a notebook), or None if unknown."""
        span = self._span(name, lineno)
        if span is None:
            return None
        shown = span[3]
        at = (
            f"{os.path.basename(span[2])}:{lineno}"
            if shown.startswith("File ")
            else f"{shown}, line {lineno}"
        )
        source = _line(span, lineno)
        return f"{name} ({at}: {source})" if source else f"{name} ({at})"


def _line(span: tuple[int, int, str, str, tuple[str, ...]], lineno: int) -> str:
    """Line ``lineno`` of ``span``'s source, stripped; "" where the client had none."""
    first, text = span[0], span[4]
    return text[lineno - first].strip() if 0 <= lineno - first < len(text) else ""


def _cell_name(filename: str) -> str:
    """``Cell In[3]`` for a notebook cell's file (as IPython names it), else the file."""
    ip = sys.modules.get("IPython")
    shell = ip.get_ipython() if ip is not None and hasattr(ip, "get_ipython") else None
    try:
        named = shell.compile.format_code_name(filename) if shell is not None else None
    except Exception:  # an IPython without it
        named = None
    return f"{named[0]} {named[1]}" if named else f'File "{filename}"'


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions chained to it (its cause, else its context), once each."""
    seen: set[int] = set()
    part: BaseException | None = exc
    while part is not None and id(part) not in seen:
        seen.add(id(part))
        yield part
        part = part.__cause__ or part.__context__


def user_traceback(exc: BaseException) -> str:
    """The text of a rank's error after :func:`rebuild`: the author's own frames, named as
    their editor or notebook names them (``Cell In[3]``), and no ``^^^`` markers."""
    lines = "".join(traceback.format_exception(exc)).splitlines(keepends=True)
    text = "".join(line for line in lines if not _CARETS.match(line))
    files = {f.filename for part in _chain(exc) for f in traceback.extract_tb(part.__traceback__)}
    for filename in files:
        text = text.replace(f'File "{filename}"', _cell_name(filename))
    return text


def plain_text(exc: BaseException, limit: int = 20_000) -> str:
    """``exc``'s traceback as text with the author's frames only, where it was raised (on
    the rank, for the job's page on the dashboard): no dask, distributed or dask_ddp frames,
    no ``^^^`` markers, at most ``limit`` characters.

    >>> try:
    ...     raise ValueError("bad batch")
    ... except ValueError as err:
    ...     print(plain_text(err).splitlines()[-1])
    ValueError: bad batch
    """
    shown = traceback.TracebackException.from_exception(exc)
    part: traceback.TracebackException | None = shown
    while part is not None:
        kept = [f for f in part.stack if not f.filename.startswith(_LIBRARY_DIRS)]
        part.stack = traceback.StackSummary.from_list(kept)
        part = part.__cause__ or part.__context__
    lines = "".join(shown.format()).splitlines(keepends=True)
    return "".join(line for line in lines if not _CARETS.match(line))[-limit:]


class _Rebuilt(Exception):
    pass


def _traceback_of(frames: list[tuple[str, str, int, int]]) -> types.TracebackType | None:
    """A real traceback through ``frames`` (file, name, line, first line of the code), made
    as tblib does, by raising from stub code placed at each line; but each stub starts at
    its function's first line, so that IPython (stack_data) finds the function and shows
    the line that raised rather than the ``def`` line."""
    top: types.TracebackType | None = None
    last: types.TracebackType | None = None
    for filename, name, lineno, first in frames:
        # As wide as the real line, so that Python draws no ^^^ under the wrong columns.
        width = len(linecache.getline(filename, lineno).strip())
        line = "raise (_Rebuilt" + " " * max(0, width - 16) + ")"
        stub = compile("\n" * (lineno - first) + line, filename, "exec")
        code = stub.replace(co_firstlineno=first, co_name=name)
        try:
            exec(code, {"_Rebuilt": _Rebuilt, "__name__": "__rank__"})
        except _Rebuilt:
            tb = sys.exc_info()[2].tb_next  # the stub's frame, without this one
        if last is None:
            top = tb
        else:
            last.tb_next = tb
        last = tb
    return top


def rebuild(exc: BaseException, sources: Sources | None = None) -> BaseException:
    """``exc``, and each exception chained to it, with a traceback of the rank's own frames
    only (no dask, distributed or dask_ddp frames), each under its real file: a notebook
    cell's file, so IPython shows "Cell In[n]" and the source line. Python and IPython then
    print the rank's error once, as the cause of the job's error."""
    for part in _chain(exc):
        frames = []  # (file, code name, line, the code's first line)
        tb = part.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            filename, name, lineno, first = code.co_filename, code.co_name, tb.tb_lineno, None
            if not filename.startswith(_LIBRARY_DIRS):
                if filename == _DYNAMIC and sources is not None:
                    placed = sources.place(name, lineno)
                    if placed is not None:
                        filename, _, first = placed
                frames.append((filename, name, lineno, first or lineno))
            tb = tb.tb_next
        if frames:
            with contextlib.suppress(Exception):  # cannot: keep the traceback Dask gave
                part.__traceback__ = _traceback_of(frames)
    return exc


def stuck_at(stacks: str, sources: Sources | None = None) -> tuple[bool, str]:
    r"""Where a rank's main thread is, from its :mod:`faulthandler` dump (every thread,
    the main one last): whether it waits in a collective (``torch.distributed`` on top),
    and its innermost frame of the user's own code, ``"train (train.py:42)"``; in code
    sent by value, where ``sources`` (the job's function) places it, with its source line.

    >>> dump = (
    ...     'Thread 0x01 (most recent call first):\n  File "/x/threading.py", line 9 in wait\n\n'
    ...     'Current thread 0x02 (most recent call first):\n'
    ...     '  File "/v/site-packages/torch/distributed/c10d.py", line 2 in all_reduce\n'
    ...     '  File "/home/me/train.py", line 42 in train\n'
    ... )
    >>> stuck_at(dump)
    (True, 'train (train.py:42)')
    """
    blocks = [b for b in _THREAD.split(stacks) if b.strip()]
    if not blocks:
        return False, "?"
    frames = [m.groups() for m in map(_FRAME.match, blocks[-1].splitlines()) if m]
    if not frames:
        return False, "?"
    waiting = any("torch/distributed/" in path for path, _, _ in frames[:4])
    file, line, name = next((f for f in frames if not _library(f[0])), frames[0])
    placed = sources.where(name, int(line)) if file == _DYNAMIC and sources else None
    return waiting, placed or f"{name} ({os.path.basename(file)}:{line})"


def _library(path: str) -> bool:
    """Whether ``path`` is library code (Python's, an installed package's, dask-ddp's)."""
    return (
        "site-packages" in path
        or path.startswith(_STDLIB)
        or path.startswith(_LIBRARY_DIRS)
        or path.startswith("<frozen")
    )


_STDLIB = os.path.dirname(os.__file__) + os.sep

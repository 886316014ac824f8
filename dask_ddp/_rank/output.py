"""What a rank prints, forwarded to the client line by line.

While the rank's function runs, ``sys.stdout`` and ``sys.stderr`` of its worker process are
replaced by writers that still write to the worker's own streams (its log keeps them) and
also put every complete line on the rank's channel (:mod:`dask_ddp._rank.channel`, kind
``OUTPUT``), so the notebook or the ``dask-ddp`` command shows a rank's ``print()`` even when
the worker runs on another machine. A partial line goes when the rank ends. Processes the
rank starts (DataLoader workers) keep writing to the worker's streams only: they cannot use
the worker's connection.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from .._shared.protocol import OUTPUT
from . import channel as events


class _Forward(io.TextIOBase):
    """A text stream that writes through to ``original`` and sends whole lines."""

    def __init__(self, original: TextIO, name: str, put: Callable[..., Any]) -> None:
        super().__init__()
        self._original = original
        self._name = name
        self._put = put
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._partial = ""

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._original, "encoding", "utf-8")

    def fileno(self) -> int:
        return self._original.fileno()

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._original.write(text)
        if os.getpid() == self._pid:
            with self._lock:
                joined = self._partial + text
                end = joined.rfind("\n") + 1
                self._partial = joined[end:]
                if end:
                    self._send(joined[: end - 1])
        return len(text)

    def flush(self) -> None:
        self._original.flush()

    def close_forwarding(self) -> None:
        with self._lock:
            if self._partial:
                self._send(self._partial)
                self._partial = ""

    def _send(self, lines: str) -> None:
        with contextlib.suppress(Exception):  # the rank's channel closed: the log has it
            self._put(OUTPUT, [self._name, lines], "print")


@contextlib.contextmanager
def forwarded(channel: events.RankChannel) -> Iterator[None]:
    """Forward the lines written to ``sys.stdout``/``sys.stderr`` while the block runs."""
    saved = sys.stdout, sys.stderr
    out = _Forward(sys.stdout, "stdout", channel.put)
    err = _Forward(sys.stderr, "stderr", channel.put)
    sys.stdout, sys.stderr = out, err  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        out.close_forwarding()
        err.close_forwarding()

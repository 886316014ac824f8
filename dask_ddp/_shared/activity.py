"""What a library call is busy with, said where someone listens: the ground floor's door for
:mod:`dask_ddp.data` to tell a rank's status without depending on the rank's code.

The rank wing's :mod:`dask_ddp._rank.status` registers itself here (:func:`listen`) when it is
imported, which every rank does; elsewhere (a notebook listing a dataset, a script of its
own) :func:`say` only logs and :func:`follow` does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class Listener(Protocol):
    def activity(self, text: str) -> None: ...

    def follow(self, path: str, describe: Callable[[], str | None]) -> Callable[[], None]: ...


_listener: list[Any] = []  # the process's listener: at most one, the rank wing's status


def listen(listener: Listener) -> None:
    """Make ``listener`` hear what library calls say in this process (once per process)."""
    if not _listener:
        _listener.append(listener)


def say(text: str) -> None:
    """Say what the caller is busy with: the rank's activity in a rank, a log line anywhere.

    >>> say("listing s3://bucket/train")
    """
    if _listener:
        _listener[0].activity(text)
    else:
        logger.info("%s", text)


def follow(path: str, describe: Callable[[], str | None]) -> Callable[[], None]:
    """Say ``describe()`` whenever ``path`` changes (see :func:`dask_ddp._rank.status.follow`);
    nothing outside a rank. Returns what stops it.

    >>> follow("/tmp", lambda: "cache: 1 of 2 files")()
    """
    if _listener:
        return _listener[0].follow(path, describe)
    return lambda: None

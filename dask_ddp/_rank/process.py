"""Process-level measures around a rank's own process, in one place.

- :func:`platform_start_method`: a rank starts DataLoader workers the way they start under
  torchrun (fork on Linux before Python 3.14), not with the spawn a Dask worker inherits.
- :func:`is_peer_loss`: recognise a collective that failed because a peer went away.
- :func:`interface_of`: the network interface that carries an address (gloo's).

(A rank used to run inside its worker's process, which needed more: its gloo sockets
severed by fd on a stop, torch's group counter reset, forked children's inherited objects
frozen. A process of its own, ended on a stop, needs none of them; and a daemonic worker
need not be let to start children: its ranks' processes are its template's, a plain
interpreter's, forked by dask-ddp's own fork server.)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
from collections.abc import Iterator

logger = logging.getLogger(__name__)

__all__ = [
    "interface_of",
    "is_peer_loss",
    "platform_start_method",
]


@contextlib.contextmanager
def platform_start_method() -> Iterator[None]:
    """Make the platform's default the default start method while the block runs.

    A Dask worker process is started with spawn, and a spawned process inherits spawn as
    its default, so ``DataLoader(num_workers=2)`` in a rank would spawn its workers and
    pickle the dataset, where under torchrun (a plain process) it forks: code whose
    dataset holds a local function (wids's notebooks do) fails with "Can't pickle local
    object". The default is restored afterwards; ``multiprocessing_context=`` still wins.

    >>> with platform_start_method():
    ...     multiprocessing.get_start_method() == multiprocessing.get_all_start_methods()[0]
    True
    """
    was = multiprocessing.get_start_method(allow_none=True)
    default = multiprocessing.get_all_start_methods()[0]
    if was != default:
        multiprocessing.set_start_method(default, force=True)
    try:
        yield
    finally:
        if was != default:
            multiprocessing.set_start_method(was, force=True)


_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Read error")


def is_peer_loss(exc: BaseException) -> bool:
    """Did a collective fail because a peer's connection went away?

    >>> is_peer_loss(RuntimeError("[gloo] Connection closed by peer [10.0.0.7]:4711"))
    True
    >>> is_peer_loss(ValueError("Connection closed by peer"))
    False
    """
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, (RuntimeError, dist.DistError)) and any(m in text for m in _PEER_LOSS)


def interface_of(address: str) -> str | None:
    """The network interface that carries ``address`` on this machine, if any.

    The machine's addresses are read once per process (0.6 ms: a rank's process inherits
    them from its template, :mod:`dask_ddp._rank.rankproc`), again when ``address`` is not
    among them.

    >>> interface_of("127.0.0.1")
    'lo'
    """
    name = _interfaces().get(address)
    if name is None:
        _interfaces.cache_clear()
        name = _interfaces().get(address)
    return name


@functools.lru_cache(maxsize=1)
def _interfaces() -> dict[str, str]:
    """Each address of this machine, with the first network interface that carries it."""
    import psutil

    names: dict[str, str] = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            names.setdefault(a.address, name)
    return names

"""glibc malloc thresholds in a rank's process, forked from a Dask worker's template.

Dask's nanny starts every worker with ``MALLOC_TRIM_THRESHOLD_=65536``
(``distributed.nanny.pre-spawn-environ``) so that the worker hands freed memory back to the
OS. Setting any threshold also switches off glibc's dynamic mmap threshold, so every
allocation above 128 KiB -- every activation and gradient tensor of a CPU training step --
becomes its own ``mmap``, page-faulted in and ``munmap``-ed again on free. Measured here
(2 cores, the benchmarks' small CNN, batch 32, 1 thread): 75-88 steps/s with the worker's
setting against 150-190 without it; DDP ranks inside Dask workers trained at 0.79x
torchrun's speed because of it.

:func:`tune` gives the rank's process glibc's own upper limits (32 MiB mmap threshold,
64 MiB trim threshold, what the dynamic thresholds grow to); the process inherited the
worker's environment and ends with its rank, so the worker's own setting never changes and
nothing needs putting back. The variables are also removed from the rank's environment, so
that processes the rank spawns (DataLoader workers with the ``spawn`` start method) get
glibc's defaults too. Nothing happens where glibc is not the allocator or where the worker runs
without the variables (glibc is then dynamic already, and stays so).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_GLIBC_DEFAULT = 128 * 1024  # both thresholds, once either is set
_RANK_MMAP = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
_RANK_TRIM = 2 * _RANK_MMAP  # the trim threshold glibc pairs with it
_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """libc, once per process (``find_library`` runs ``ldconfig``: ~2 ms a call)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 -- glibc only
    except (OSError, AttributeError):
        return None
    return libc


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def tune(enabled: bool = True) -> None:
    """Give this process (a rank's own) glibc's upper malloc thresholds for the rest of its
    life, and take the worker's variables out of its environment. Nothing is put back: the
    process ends with its rank, and the worker never changed.

    >>> tune(enabled=False)
    """
    saved = {k: os.environ.get(k) for k in _VARIABLES}
    libc = _glibc() if enabled and any(v is not None for v in saved.values()) else None
    if libc is None:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _RANK_MMAP)
    libc.mallopt(_M_TRIM_THRESHOLD, _RANK_TRIM)
    for k in _VARIABLES:
        os.environ.pop(k, None)
    logger.debug("malloc thresholds raised for the rank (its worker had %s)", saved)

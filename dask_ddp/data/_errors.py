"""The exceptions the datasets in :mod:`dask_ddp.data` raise, and the checks that raise them.

The classes are defined in :mod:`dask_ddp.errors` with every other error of the package
(``dask_ddp.errors``, ``dask_ddp.data`` and ``dask_ddp`` export each of them); this module
names them for the datasets, and holds the argument checks and the corrupt-sample policy.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Literal

from dask.utils import parse_bytes

from dask_ddp.errors import (  # defined with every other error of dask_ddp
    CorruptDataError,
    DataNotFoundError,
    DatasetComputeError,
    DatasetNotFoundError,
    DatasetPartitionLostError,
    DatasetTooSmallError,
    MissingFieldError,
    SampleFetchError,
    ShardListError,
    StorageAccessError,
    UnsupportedCollectionError,
)

__all__ = [
    "CorruptDataError",
    "DataNotFoundError",
    "DatasetComputeError",
    "DatasetNotFoundError",
    "DatasetPartitionLostError",
    "DatasetTooSmallError",
    "MissingFieldError",
    "SampleFetchError",
    "ShardListError",
    "StorageAccessError",
    "UnsupportedCollectionError",
]


def check_int(name: str, value: object, minimum: int) -> None:
    """Raise ValueError unless ``value`` is an int of at least ``minimum``.

    >>> check_int("retries", 3, 0)
    >>> check_int("retries", -1, 0)
    Traceback (most recent call last):
    ValueError: retries= must be an int >= 0, got -1
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}= must be an int >= {minimum}, got {value!r}")


def parse_size(name: str, value: int | str) -> int:
    """Bytes from a size given as an int or a string such as ``"200GB"``.

    >>> parse_size("cache_size", "2kB")
    2000
    >>> parse_size("cache_size", 0)
    Traceback (most recent call last):
    ValueError: cache_size= must be a positive size, got 0
    """
    try:
        size = parse_bytes(value) if isinstance(value, str) else value
    except ValueError as err:
        raise ValueError(f"{name}= takes bytes or a size like '200GB', got {value!r}") from err
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{name}= must be a positive size, got {value!r}")
    return size


OnCorrupt = Literal["raise", "skip"]
"""What a dataset does with a sample that does not decode (``on_corrupt=``)."""


def check_on_corrupt(value: object) -> None:
    """Raise ValueError unless ``value`` is ``"raise"`` or ``"skip"``."""
    if value not in ("raise", "skip"):
        raise ValueError(f"on_corrupt= must be 'raise' or 'skip', got {value!r}")


class CorruptSamples:
    """The samples found corrupt in this process, for ``on_corrupt="skip"``.

    Each DataLoader worker learns its own (the set is not pickled with the dataset); a
    corrupt sample is replaced by the next readable one, cyclically. Warnings go to
    ``log``, the dataset module's logger.

    >>> bad = CorruptSamples(logging.getLogger("dask_ddp.data.s3"))
    >>> bad.mark(1, CorruptDataError("s3://b/1.jpg", "truncated"), Counter())
    >>> 1 in bad, bad.next_readable(0, 3, "s3://b")
    (True, 2)
    """

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._indices: set[int] = set()

    def __contains__(self, index: object) -> bool:
        return index in self._indices

    def mark(self, index: int, err: CorruptDataError, stats: Counter[str]) -> None:
        """Remember ``index`` as corrupt, count it in ``stats`` and log it."""
        self._indices.add(index)
        stats["corrupt"] += 1
        self._log.warning(
            "skipping corrupt sample %s (%d corrupt so far in process %d): %s",
            err.url,
            stats["corrupt"],
            os.getpid(),
            err.cause,
        )

    def next_readable(self, index: int, n: int, source: str) -> int:
        """The first index after ``index`` (cyclically, of ``n``) not known to be corrupt."""
        for step in range(1, n + 1):
            j = (index + step) % n
            if j not in self._indices:
                return j
        raise DataNotFoundError(source, f"all {n} samples failed to decode")

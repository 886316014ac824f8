"""The exceptions the datasets in :mod:`dask_ddp.data` raise.

Each derives from :class:`dask_ddp.errors.DaskDDPError` and from the built-in exception
with the same meaning, so ``except FileNotFoundError`` or ``except ValueError`` keeps
working. Each keeps its fields as attributes, passes them to ``super().__init__`` so that
it pickles back from a DataLoader worker or a Dask worker, and builds its message in
``__str__``: what happened, which URL, and what to do.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any, Literal

from dask.utils import parse_bytes

from dask_ddp.errors import DaskDDPError, InfrastructureError

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


class DataNotFoundError(DaskDDPError, FileNotFoundError):
    """The data a dataset was built on is not there: a bucket, prefix or path that does not
    exist or holds no sample it accepts, or a shard that its shard list names.

    Parameters
    ----------
    url : str
        The URL that was asked for, e.g. ``"s3://bucket/train"`` or a shard's URL.
    reason : str
        What is missing, as a sentence fragment (for a shard: the filesystem's error).
    listed_in : str, optional
        For a shard: the shard list that names it.

    Examples
    --------
    >>> str(DataNotFoundError("s3://missing-bucket/train", "the bucket does not exist"))
    'cannot build a dataset from s3://missing-bucket/train: the bucket does not exist'
    >>> err = DataNotFoundError("s3://b/shard-000007.tar", "no such key", listed_in="s3://b/shards.json")
    >>> isinstance(err, FileNotFoundError)
    True
    >>> print(err)  # doctest: +ELLIPSIS
    shard s3://b/shard-000007.tar does not exist (no such key), but s3://b/shards.json lists it...
    """

    def __init__(self, url: str, reason: str, listed_in: str | None = None) -> None:
        super().__init__(url, reason, listed_in)
        self.url, self.reason, self.listed_in = url, reason, listed_in

    def __reduce__(self) -> tuple[type, tuple[str, str, str | None]]:
        # OSError's own __reduce__ would rebuild the exception from (errno, strerror).
        return type(self), (self.url, self.reason, self.listed_in)

    @property
    def source(self) -> str | None:
        """The shard list that names a missing shard (as ``listed_in``)."""
        return self.listed_in

    @property
    def cause(self) -> str:
        return self.reason

    def __str__(self) -> str:
        if self.listed_in is not None:
            return (
                f"shard {self.url} does not exist ({self.reason}), but {self.listed_in} lists "
                "it. Upload the shard, or regenerate the shard list (write_shards writes both)"
            )
        return f"cannot build a dataset from {self.url}: {self.reason}"


class CorruptDataError(DaskDDPError, ValueError):
    """Data was read but is not what it should be: a sample its decoder cannot decode, a
    shard that is not a readable tar file, or a shard holding another number of samples
    than its shard list says.

    Parameters
    ----------
    url : str
        The sample's or shard's URL.
    cause : str
        What is wrong: the decoder's error, or what is wrong with the shard.
    what : {"sample", "shard"}
        What is corrupt.
    listed_in : str, optional
        For a shard whose sample count is off: the shard list, with ``expected`` (its
        ``nsamples``) and ``found``.

    Examples
    --------
    >>> print(CorruptDataError("s3://b/train/cat/1.jpg", "cannot identify image file"))
    ... # doctest: +ELLIPSIS
    cannot decode s3://b/train/cat/1.jpg: cannot identify image file. Replace or delete ...
    >>> print(CorruptDataError("s3://b/shard-000002.tar", "truncated at byte 512", "shard"))
    ... # doctest: +ELLIPSIS
    shard s3://b/shard-000002.tar is not a readable tar file: truncated at byte 512. ...
    """

    def __init__(
        self,
        url: str,
        cause: str,
        what: str = "sample",
        *,
        listed_in: str | None = None,
        expected: int | None = None,
        found: int | None = None,
    ) -> None:
        super().__init__(url, cause, what)
        self.url, self.cause, self.what = url, cause, what
        self.listed_in, self.expected, self.found = listed_in, expected, found

    def __reduce__(self) -> tuple[Any, ...]:
        fields = {"listed_in": self.listed_in, "expected": self.expected, "found": self.found}
        return _rebuild_corrupt, (self.url, self.cause, self.what, fields)

    @classmethod
    def count(cls, url: str, listed_in: str, expected: int, found: int) -> CorruptDataError:
        """A shard holding ``found`` samples where ``listed_in`` says ``expected``."""
        cause = f"it holds {found} samples, but {listed_in} says {expected} (nsamples)"
        return cls(url, cause, "shard", listed_in=listed_in, expected=expected, found=found)

    def __str__(self) -> str:
        if self.what == "sample":
            return (
                f"cannot decode {self.url}: {self.cause}. Replace or delete the object, or "
                "pass on_corrupt='skip' to read the next readable sample in its place"
            )
        if self.expected is not None:
            return (
                f"shard {self.url} holds {self.found} samples, but {self.listed_in} says "
                f"{self.expected} (nsamples). The shard list is out of date or the shard was "
                "rewritten: regenerate the list (write_shards), or correct its nsamples"
            )
        return (
            f"shard {self.url} is not a readable tar file: {self.cause}. Its local copy "
            "(if cached) was deleted, so the next read downloads it again; if the stored "
            "shard itself is damaged, rewrite it (write_shards)"
        )


def _rebuild_corrupt(url: str, cause: str, what: str, fields: dict[str, Any]) -> CorruptDataError:
    return CorruptDataError(url, cause, what, **fields)


class SampleFetchError(InfrastructureError, OSError):
    """Reading a sample's bytes failed, after the transient errors were retried.

    Parameters
    ----------
    url : str
        The sample's URL.
    cause : str
        The last error, as ``"ExceptionType: message"``.

    Examples
    --------
    >>> err = SampleFetchError("s3://b/k.jpg", "ClientError: SlowDown")
    >>> str(err)  # doctest: +ELLIPSIS
    'cannot read s3://b/k.jpg: ClientError: SlowDown. Transient errors ...'
    """

    def __init__(self, url: str, cause: str) -> None:
        super().__init__(url, cause)
        self.url, self.cause = url, cause

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.url, self.cause)

    def __str__(self) -> str:
        return (
            f"cannot read {self.url}: {self.cause}. Transient errors (5xx, throttling, reset "
            "connections) were already retried; check that the object exists and is readable "
            "with these credentials, or raise retries= for a flaky store"
        )


StorageProblem = Literal["unreachable", "credentials"]


class StorageAccessError(InfrastructureError, OSError):
    """The store cannot be used at all: its endpoint refuses or cannot be reached, or no
    credentials were found to sign requests to it. Raised at the first request, after a
    few quick attempts for a refused connection (other transient errors keep their
    ``retries=``).

    Parameters
    ----------
    url : str
        The URL that was being read.
    endpoint : str
        The store's endpoint (``endpoint_url=``), or ``""`` for AWS's default.
    problem : {"unreachable", "credentials"}
        What stops every request.
    cause : str
        The client's error, as ``"ExceptionType: message"``.

    Examples
    --------
    >>> print(StorageAccessError("s3://b/shards.json", "http://10.0.0.5:9000", "unreachable",
    ...                          "EndpointConnectionError: connection refused"))
    ... # doctest: +ELLIPSIS
    cannot reach the store at http://10.0.0.5:9000 to read s3://b/shards.json: ...
    """

    def __init__(self, url: str, endpoint: str, problem: StorageProblem, cause: str) -> None:
        super().__init__(url, endpoint, problem, cause)
        self.url, self.endpoint, self.problem, self.cause = url, endpoint, problem, cause

    def __reduce__(self) -> tuple[type, tuple[str, str, StorageProblem, str]]:
        return type(self), (self.url, self.endpoint, self.problem, self.cause)

    def __str__(self) -> str:
        where = self.endpoint or "AWS's default S3 endpoint"
        if self.problem == "unreachable":
            return (
                f"cannot reach the store at {where} to read {self.url}: {self.cause}. Check "
                "endpoint_url= (scheme, host and port), that the store is running, and that "
                "this machine (every Dask worker, too) can connect to it"
            )
        return (
            f"no credentials were found to read {self.url} from {where} ({self.cause}). "
            "For a public bucket pass anon=True; otherwise set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws/credentials) where the dataset "
            "is read (the client and every Dask worker), or pass storage_options="
            "{'key': ..., 'secret': ...}"
        )


class ShardListError(DaskDDPError, ValueError):
    """A shard list (JSON file or Python list) is malformed.

    Parameters
    ----------
    source : str
        Where the list came from: the JSON file's URL, or ``"the shard list passed in"``.
    reason : str
        What is wrong, as a sentence fragment.

    Examples
    --------
    >>> print(ShardListError("s3://b/shards.json", "entry 3 has no 'nsamples'"))
    ... # doctest: +ELLIPSIS
    bad shard list s3://b/shards.json: entry 3 has no 'nsamples'. A shard list is ...
    """

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(source, reason)
        self.source, self.reason = source, reason

    def __str__(self) -> str:
        return (
            f"bad shard list {self.source}: {self.reason}. A shard list is "
            '{"shardlist": [{"url": "shard-000000.tar", "nsamples": 1000}, ...]} (relative '
            "URLs are resolved against the JSON file's folder), or a Python list of such "
            "dicts; dask_ddp.data.write_shards writes one"
        )


class MissingFieldError(DaskDDPError, KeyError):
    """A sample lacks a field (extension) that ``keys=`` or a lookup in its dict asks for.

    Examples
    --------
    >>> err = MissingFieldError("/d/shard-000000.tar", "000017", ".cls", (".jpg", ".json"))
    >>> print(err)  # doctest: +ELLIPSIS
    sample '000017' in /d/shard-000000.tar has no '.cls' field (it has: .jpg, .json). ...
    """

    def __init__(self, url: str, key: str, wanted: str, available: tuple[str, ...]) -> None:
        super().__init__(url, key, wanted, available)
        self.url, self.key, self.wanted, self.available = url, key, wanted, available

    def __str__(self) -> str:
        return (
            f"sample {self.key!r} in {self.url} has no {self.wanted!r} field (it has: "
            f"{', '.join(self.available)}). Fields are named by extension, with wids's dot "
            "in the sample dict ('.jpg'); name alternatives with ';' in keys= ('jpg;png')"
        )


# -- Dask collections passed as datasets= (dask_ddp.data.collections) ---------------------


class UnsupportedCollectionError(DaskDDPError, TypeError):
    """A value in ``datasets=`` is not a dask.dataframe, dask.bag or dask.array collection.

    Examples
    --------
    >>> print(UnsupportedCollectionError("train", "list"))  # doctest: +ELLIPSIS
    datasets={'train': ...} is a list; launch(datasets=...) takes a dask.dataframe ...
    """

    def __init__(self, name: str, type_name: str) -> None:
        super().__init__(name, type_name)
        self.name, self.type_name = name, type_name

    def __str__(self) -> str:
        return (
            f"datasets={{{self.name!r}: ...}} is a {self.type_name}; launch(datasets=...) "
            "takes a dask.dataframe DataFrame or Series, a dask.bag Bag or a dask.array "
            "Array (or dask_ddp.data.CollectionSource(collection, ...)). Wrap in-memory data "
            "first, e.g. dask.dataframe.from_pandas(df, npartitions=8)"
        )


class DatasetTooSmallError(DaskDDPError, ValueError):
    """A dataset has fewer rows than the job has ranks, so some rank would get none.

    Examples
    --------
    >>> print(DatasetTooSmallError("train", 1, 2, True))  # doctest: +ELLIPSIS
    dataset 'train' has 1 rows, fewer than the job's 2 ranks...
    """

    def __init__(self, name: str, rows: int, world_size: int, drop_last: bool) -> None:
        super().__init__(name, rows, world_size, drop_last)
        self.name, self.rows = name, rows
        self.world_size, self.drop_last = world_size, drop_last

    def __str__(self) -> str:
        if self.rows == 0:
            return (
                f"dataset {self.name!r} has no rows: every partition is empty. Check the "
                "collection (len(ddf)) before launching"
            )
        return (
            f"dataset {self.name!r} has {self.rows} rows, fewer than the job's "
            f"{self.world_size} ranks, and drop_last=True would leave every rank without "
            "data. Pass CollectionSource(collection, drop_last=False) to pad, or use fewer "
            "workers (launch(..., workers=N))"
        )


class DatasetComputeError(DaskDDPError, RuntimeError):
    """Computing a dataset's partition on the cluster failed before the job started.

    The partition's own exception is chained as ``__cause__``.

    Examples
    --------
    >>> print(DatasetComputeError("train", 3, "('x', 3)", "ValueError: bad row"))
    ... # doctest: +ELLIPSIS
    dataset 'train': computing partition 3 (key ('x', 3)) failed: ValueError: bad row. ...
    """

    def __init__(self, name: str, partition: int, key: str, cause: str) -> None:
        super().__init__(name, partition, key, cause)
        self.name, self.partition, self.key, self.cause = name, partition, key, cause

    def __str__(self) -> str:
        return (
            f"dataset {self.name!r}: computing partition {self.partition} (key {self.key}) "
            f"failed: {self.cause}. No rank was started; fix the collection (compute one "
            "partition with ddf.partitions[i].compute() to see the error) and launch again"
        )


class DatasetPartitionLostError(InfrastructureError, RuntimeError):
    """A dataset's partition is no longer anywhere in the cluster and cannot be recomputed.

    Raised on a rank when it fetches the partition, or on the client when a restart plans
    the data again. It happens when the workers holding a partition that has no recipe (data
    from ``client.scatter``, or a collection built on scattered futures) died.

    Examples
    --------
    >>> err = DatasetPartitionLostError("train", 4, "('x', 4)", ("tcp://10.0.0.5:4000",), 1)
    >>> print(err)  # doctest: +ELLIPSIS
    dataset 'train': partition 4 (key ('x', 4)), last held by tcp://10.0.0.5:4000, is lost...
    """

    def __init__(
        self,
        name: str,
        partition: int,
        key: str,
        holders: tuple[str, ...],
        rank: int | None,
    ) -> None:
        super().__init__(name, partition, key, holders, rank)
        self.name, self.partition, self.key = name, partition, key
        self.holders, self.rank = holders, rank

    def __str__(self) -> str:
        where = ", ".join(self.holders) or "a worker that left"
        who = f" (needed by rank {self.rank})" if self.rank is not None else ""
        return (
            f"dataset {self.name!r}: partition {self.partition} (key {self.key}), last held "
            f"by {where}, is lost{who}: its worker left the cluster and Dask cannot compute "
            "it again (its data came from client.scatter or other futures without a "
            "recipe). Build the collection from a source Dask can recompute (files, "
            "from_pandas, from_array), or persist it with replicas (client.replicate), and "
            "launch again"
        )


class DatasetNotFoundError(DaskDDPError, KeyError):
    """``get_dataset_shard(name)`` names a dataset the job was not launched with.

    Examples
    --------
    >>> print(DatasetNotFoundError("valid", ("train",), 0))  # doctest: +ELLIPSIS
    rank 0 has no dataset 'valid'; this job was launched with datasets=['train']. ...
    """

    def __init__(self, name: str, available: tuple[str, ...], rank: int) -> None:
        super().__init__(name, available, rank)
        self.name, self.available, self.rank = name, available, rank

    def __str__(self) -> str:
        return (
            f"rank {self.rank} has no dataset {self.name!r}; this job was launched with "
            f"datasets={list(self.available)}. Pass it to the launch: "
            f"dask_ddp.launch(client, train, datasets={{{self.name!r}: collection}})"
        )


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

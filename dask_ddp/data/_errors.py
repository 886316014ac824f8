"""The exceptions the datasets in :mod:`dask_ddp.data` raise.

Each derives from :class:`dask_ddp.errors.DaskDDPError` and from the built-in exception
with the same meaning, so ``except FileNotFoundError`` or ``except ValueError`` keeps
working. Each keeps its fields as attributes, passes them to ``super().__init__`` so that
it pickles back from a DataLoader worker or a Dask worker, and builds its message in
``__str__``: what happened, which URL, and what to do.
"""

from __future__ import annotations

from dask_ddp.errors import DaskDDPError

__all__ = [
    "CorruptSampleError",
    "DataNotFoundError",
    "NoSamplesError",
    "SampleFetchError",
]


class DataNotFoundError(DaskDDPError, FileNotFoundError):
    """The bucket, prefix or path a dataset was built on does not exist or holds nothing.

    Parameters
    ----------
    url : str
        The URL the dataset was asked to read, e.g. ``"s3://bucket/train"``.
    reason : str
        What is missing, as a sentence fragment.

    Examples
    --------
    >>> str(DataNotFoundError("s3://missing-bucket/train", "the bucket does not exist"))
    'cannot build a dataset from s3://missing-bucket/train: the bucket does not exist'
    """

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(url, reason)
        self.url, self.reason = url, reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # OSError's own __reduce__ would rebuild the exception from (errno, strerror).
        return type(self), (self.url, self.reason)

    def __str__(self) -> str:
        return f"cannot build a dataset from {self.url}: {self.reason}"


class NoSamplesError(DataNotFoundError):
    """Objects exist under the URL, but none of them is a sample the dataset accepts.

    Examples
    --------
    >>> err = NoSamplesError("s3://bucket/docs", "3 objects, none ending in .jpg or .png")
    >>> isinstance(err, FileNotFoundError)
    True
    """


class CorruptSampleError(DaskDDPError, ValueError):
    """A sample was read, but the decode function could not decode it.

    Parameters
    ----------
    url : str
        The sample's URL, e.g. ``"s3://bucket/train/cat/0001.jpg"``.
    cause : str
        The decoder's error message.

    Examples
    --------
    >>> err = CorruptSampleError("s3://b/train/cat/1.jpg", "cannot identify image file")
    >>> print(err)  # doctest: +ELLIPSIS
    cannot decode s3://b/train/cat/1.jpg: cannot identify image file. Replace or delete ...
    """

    def __init__(self, url: str, cause: str) -> None:
        super().__init__(url, cause)
        self.url, self.cause = url, cause

    def __str__(self) -> str:
        return (
            f"cannot decode {self.url}: {self.cause}. Replace or delete the object, or pass "
            "on_corrupt='skip' to read the next readable sample in its place"
        )


class SampleFetchError(DaskDDPError, OSError):
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

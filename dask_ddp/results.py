"""dask-pytorch-ddp's results handler, on top of the job's channel.

Ranks call :meth:`DaskResultsHandler.submit_result` with a relative path and some data;
the client calls :meth:`DaskResultsHandler.process_results` with a directory and the
job's futures, and each result is written to ``prefix/path`` as it arrives. Code written
for ``dask_pytorch_ddp.results`` works after changing the import.

Unlike the predecessor (``distributed.pubsub``, removed in distributed 2025.4), results
travel through the job's own channel (:mod:`dask_ddp._rank.channel`): in order per rank, never
mixed with another job's, and a payload larger than ``ddp.max-event-bytes`` (a pickled
``state_dict``) goes from the rank's worker to the client directly, never through the
scheduler, and is released on the worker once the client has it. A path that would land
outside ``prefix`` (absolute, ``..``, or through a symbolic link) is refused.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import uuid
from collections.abc import Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING

from distributed import Future

from ._rank.context import _rank_channel
from ._shared.protocol import RESULT
from .errors import UnsafeResultPathError

if TYPE_CHECKING:
    from ._client.job import Job

logger = logging.getLogger(__name__)

__all__ = ["DaskResultsHandler"]

_SEPARATORS = re.compile(r"[\\/]")


def _check_relative(path: str, prefix: str | None = None) -> str:
    """Refuse a result path that is not a plain relative file path.

    >>> _check_relative("worker/0/data-1.json")
    'worker/0/data-1.json'
    >>> _check_relative("../escape.json")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dask_ddp.errors.UnsafeResultPathError: refusing result path '../escape.json': it contains...
    """
    if not isinstance(path, str):
        raise TypeError(f"a result path must be a str, such as 'worker/0/x.json'; got {path!r}")
    reason = None
    parts = _SEPARATORS.split(path)
    if not path or path in {".", "./"}:
        reason = "it is empty"
    elif "\0" in path:
        reason = "it contains a NUL character"
    elif PurePosixPath(path).is_absolute() or PureWindowsPath(path).drive or path[0] in "/\\":
        reason = "it is absolute"
    elif ".." in parts:
        reason = "it contains '..'"
    elif parts[-1] in {"", "."}:
        reason = "it names a directory, not a file"
    if reason is not None:
        raise UnsafeResultPathError(path, prefix, reason)
    return path


def _safe_target(root: Path, path: str) -> Path:
    """Where ``path`` lands under ``root``, symbolic links followed; refused if outside.

    ``root`` must exist. Components that do not exist yet are plain names (no ``..``), so
    creating them keeps the file inside ``root``.
    """
    _check_relative(path, str(root))
    real_root = root.resolve(strict=True)
    target = real_root.joinpath(*(p for p in _SEPARATORS.split(path) if p not in {"", "."}))
    resolved = target.resolve()
    if resolved == real_root or real_root not in resolved.parents:
        raise UnsafeResultPathError(
            path, str(root), f"it leads through a symbolic link to {str(resolved)!r}"
        )
    return resolved


def _write(target: Path, data: str | bytes) -> None:
    """Write atomically: readers see the old file or the whole new one, never a part."""
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    part = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.part")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(part, target)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


class DaskResultsHandler:
    """Send files from the ranks to a directory on the client (dask-pytorch-ddp's API).

    Parameters
    ----------
    pub_sub_key : str, optional
        Names this handler's results within a job, so several handlers in one job stay
        apart; a random one by default. The rank and the client must use the same
        handler (or the same key): create it before launching and use it in the
        training function, as below. Jobs never see each other's results, whatever the
        key.

    Examples
    --------
    >>> rh = DaskResultsHandler()
    >>> def train(steps):
    ...     rank = dask_ddp.get_context().rank
    ...     for step in range(steps):
    ...         rh.submit_result(f"worker/{rank}/data-{step}.json", json.dumps({"step": step}))
    ...         if rank == 0 and step % 100 == 0:
    ...             rh.submit_result(f"checkpoint-{step}.pkl", pickle.dumps(model.state_dict()))
    >>> futures = dask_ddp.dispatch.run(client, train, 1000)       # doctest: +SKIP
    >>> rh.process_results("results", futures, raise_errors=False)  # doctest: +SKIP
    """

    def __init__(self, pub_sub_key: str | None = None) -> None:
        self.pub_sub_key = pub_sub_key if pub_sub_key is not None else uuid.uuid4().hex

    def __repr__(self) -> str:
        return f"DaskResultsHandler(pub_sub_key={self.pub_sub_key!r})"

    def submit_result(self, path: str, data: str | bytes) -> None:
        """On a rank: send ``data`` to be written to ``prefix/path`` on the client.

        Returns at once: the data is sent in the background, in order with the rank's
        other messages. Large data (over ``ddp.max-event-bytes``) waits in this worker's
        memory until the client fetches it directly.

        Parameters
        ----------
        path : str
            Relative file path under the client's ``prefix``; ``/`` separates directories.
        data : str or bytes
            The file's content; str is written as UTF-8.

        Raises
        ------
        NotInRankError
            Called outside a rank's function.
        UnsafeResultPathError
            ``path`` is absolute, contains ``..`` or names a directory.
        TypeError
            ``data`` is neither str nor bytes.
        """
        channel = _rank_channel("submit_result")
        _check_relative(path)
        if isinstance(data, str):
            data = str(data)
        elif isinstance(data, (bytes, bytearray, memoryview)):
            data = bytes(data)
        else:
            raise TypeError(
                f"submit_result() sends str or bytes; got {type(data).__name__} for {path!r}. "
                "Serialise it first: json.dumps(...) or pickle.dumps(...)."
            )
        channel.put(RESULT, [self.pub_sub_key, str(path), data], "submit_result")

    def process_results(
        self,
        prefix: str | os.PathLike[str],
        futures: Job | Sequence[Future],
        raise_errors: bool = True,
    ) -> None:
        """On the client: write each result under ``prefix`` as it arrives; return when the
        job is done and every result it sent has been written.

        Parameters
        ----------
        prefix : str or path-like
            Directory to write into; created if missing.
        futures : list of distributed.Future, or Job
            What :func:`dask_ddp.dispatch.run` returned (or ``job.futures``, or the
            :class:`~dask_ddp.Job` from :func:`dask_ddp.launch`).
        raise_errors : bool, optional
            If the job fails, raise its error (after writing every result that arrived);
            otherwise log it and return. Also decides whether a refused path raises or is
            logged and skipped.

        Raises
        ------
        RankFailedError, WorkerLostError, JobCancelledError
            The job failed, with ``raise_errors=True``.
        UnsafeResultPathError
            A result's path would land outside ``prefix``, with ``raise_errors=True``.
            Nothing is written outside ``prefix`` either way.
        JobNotFoundError
            ``futures`` do not belong to a dask_ddp job started from this process.
        """
        from ._client.job import _job_for

        job = _job_for(futures)
        root = Path(prefix)
        root.mkdir(parents=True, exist_ok=True)
        written = 0
        for rank, path, data in job.iter_results(self.pub_sub_key):
            try:
                target = _safe_target(root, path)
            except UnsafeResultPathError:
                if raise_errors:
                    raise
                logger.exception("job %s: refused a result of rank %d", job.job_id, rank)
                continue
            _write(target, data)
            written += 1
            logger.debug("job %s: rank %d wrote %s", job.job_id, rank, target)
        error = job.exception()
        logger.info("job %s: %d results written under %s", job.job_id, written, root)
        if error is None:
            return
        if raise_errors:
            raise error
        logger.error(
            "job %s failed; %d results were written under %s",
            job.job_id,
            written,
            root,
            exc_info=error,
        )

"""The rank's view of its job: :func:`get_context` inside the training function.

The context is set by :mod:`dask_ddp.bootstrap` for as long as the user's function runs.
One rank runs per worker process at a time, so the context is per process: threads the
training function starts, and DataLoader workers forked from the rank, see it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from .errors import NotInRankError

__all__ = ["RankContext", "get_context"]


@dataclasses.dataclass(frozen=True)
class RankContext:
    """What a rank knows about itself, in torchrun's terms.

    Attributes
    ----------
    rank : int
        Global rank, ``0 <= rank < world_size``. Not stable across restarts.
    local_rank : int
        Rank among the ranks on this host, from 0.
    world_size : int
        Number of ranks in the job.
    local_world_size : int
        Number of ranks on this host.
    node_rank : int
        Index of this host among the job's hosts, from 0.
    device : torch.device
        ``cuda:0`` when the rank has a GPU (``CUDA_VISIBLE_DEVICES`` puts the rank's own GPU
        first), else ``cpu``.
    backend : str
        The torch.distributed backend of the process group (``"gloo"`` or ``"nccl"``).
    attempt : int
        0 for the first run of the job, incremented on every restart.
    job_id : str
        The job's identifier; task keys are ``dask-ddp-<job_id>-rank-<rank>``.
    worker : str
        Address of the Dask worker running this rank.
    master_addr, master_port
        Where the process group's store listens (rank 0's host).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str
    attempt: int
    job_id: str
    worker: str
    master_addr: str
    master_port: int


_current: RankContext | None = None


def get_context() -> RankContext:
    """Return the running rank's :class:`RankContext`.

    Raises
    ------
    NotInRankError
        When called outside a function started by :func:`dask_ddp.launch` or
        :func:`dask_ddp.dispatch.run`.

    Examples
    --------
    >>> def train():
    ...     ctx = dask_ddp.get_context()
    ...     model = torch.nn.Linear(4, 2).to(ctx.device)
    ...     return ctx.rank
    >>> dask_ddp.launch(client, train).result()  # doctest: +SKIP
    [0, 1]
    """
    if _current is None:
        raise NotInRankError("get_context")
    return _current


@contextlib.contextmanager
def _activated(ctx: RankContext) -> Iterator[RankContext]:
    """Make ``ctx`` the process's current rank for the duration of the block."""
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous

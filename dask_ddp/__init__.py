"""Train existing PyTorch programs with DistributedDataParallel on a Dask cluster.

>>> import dask_ddp
>>> sorted(dask_ddp.__all__)[:3]
['BackendUnavailableError', 'DaskDDPError', 'Job']
"""

from . import config as _config  # noqa: F401  (loads the ddp: defaults into dask.config)
from ._version import __version__
from .context import RankContext, get_context
from .dispatch import launch, launch_script, run
from .errors import (
    BackendUnavailableError,
    DaskDDPError,
    JobCancelledError,
    NotInRankError,
    NotPicklableError,
    NoWorkersError,
    PeerFailedError,
    PlacementError,
    RankAbortedError,
    RankFailedError,
    RendezvousTimeoutError,
    WorkerBusyError,
    WorkerLostError,
)
from .job import Job, JobState

__all__ = [
    "BackendUnavailableError",
    "DaskDDPError",
    "Job",
    "JobCancelledError",
    "JobState",
    "NoWorkersError",
    "NotInRankError",
    "NotPicklableError",
    "PeerFailedError",
    "PlacementError",
    "RankAbortedError",
    "RankContext",
    "RankFailedError",
    "RendezvousTimeoutError",
    "WorkerBusyError",
    "WorkerLostError",
    "__version__",
    "get_context",
    "launch",
    "launch_script",
    "run",
]

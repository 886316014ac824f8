"""Train existing PyTorch programs with DistributedDataParallel on a Dask cluster.

>>> import dask_ddp
>>> {"launch", "run", "get_context", "report", "save_checkpoint"} <= set(dask_ddp.__all__)
True
"""

from . import config as _config  # noqa: F401  (loads the ddp: defaults into dask.config)
from ._version import __version__
from .checkpoint import CheckpointInfo, UnsafeCheckpointError
from .context import (
    RankContext,
    get_checkpoint,
    get_context,
    get_dataset_shard,
    report,
    save_checkpoint,
)
from .dispatch import launch, launch_script, run
from .errors import (
    BackendUnavailableError,
    ChannelError,
    CheckpointDirMissingError,
    DaskDDPError,
    JobCancelledError,
    JobNotFoundError,
    NotInRankError,
    NotPicklableError,
    NoWorkersError,
    PeerFailedError,
    PlacementError,
    RankAbortedError,
    RankFailedError,
    RendezvousTimeoutError,
    RetryableError,
    UnsafeResultPathError,
    WorkerBusyError,
    WorkerLostError,
)
from .job import Job, JobState, MetricRecord, OutputLine
from .results import DaskResultsHandler

__all__ = [
    "BackendUnavailableError",
    "ChannelError",
    "CheckpointDirMissingError",
    "CheckpointInfo",
    "DaskDDPError",
    "DaskResultsHandler",
    "Job",
    "JobCancelledError",
    "JobNotFoundError",
    "JobState",
    "MetricRecord",
    "NoWorkersError",
    "NotInRankError",
    "NotPicklableError",
    "OutputLine",
    "PeerFailedError",
    "PlacementError",
    "RankAbortedError",
    "RankContext",
    "RankFailedError",
    "RendezvousTimeoutError",
    "RetryableError",
    "UnsafeCheckpointError",
    "UnsafeResultPathError",
    "WorkerBusyError",
    "WorkerLostError",
    "__version__",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "launch",
    "launch_script",
    "report",
    "run",
    "save_checkpoint",
]

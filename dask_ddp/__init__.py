"""Train existing PyTorch programs with DistributedDataParallel on a Dask cluster.

>>> import dask_ddp
>>> {"launch", "run", "get_context", "report", "save_checkpoint"} <= set(dask_ddp.__all__)
True
"""

import importlib as _importlib
import importlib.util as _importlib_util
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from ._version import __version__

if _TYPE_CHECKING:  # what a type checker and an IDE see; at run time names load on use
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
        DashboardUnavailableWarning,
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
        RankStoppedError,
        RendezvousTimeoutError,
        ResizeStopError,
        RetryableError,
        ScaleTimeoutError,
        UnsafeResultPathError,
        WorkerBusyError,
        WorkerLostError,
    )
    from .job import AttemptInfo, Job, JobState, MetricRecord, OutputLine
    from .results import DaskResultsHandler

# Each public name and the module that defines it. Modules load on first use, so that
# `python -m dask_ddp --help` and a client that only launches never import torch.
_WHERE = {
    "CheckpointInfo": "checkpoint",
    "UnsafeCheckpointError": "checkpoint",
    "RankContext": "context",
    "get_checkpoint": "context",
    "get_context": "context",
    "get_dataset_shard": "context",
    "report": "context",
    "save_checkpoint": "context",
    "launch": "dispatch",
    "launch_script": "dispatch",
    "run": "dispatch",
    "BackendUnavailableError": "errors",
    "ChannelError": "errors",
    "CheckpointDirMissingError": "errors",
    "DaskDDPError": "errors",
    "DashboardUnavailableWarning": "errors",
    "JobCancelledError": "errors",
    "JobNotFoundError": "errors",
    "NotInRankError": "errors",
    "NotPicklableError": "errors",
    "NoWorkersError": "errors",
    "PeerFailedError": "errors",
    "PlacementError": "errors",
    "RankAbortedError": "errors",
    "RankFailedError": "errors",
    "RankStoppedError": "errors",
    "RendezvousTimeoutError": "errors",
    "ResizeStopError": "errors",
    "RetryableError": "errors",
    "ScaleTimeoutError": "errors",
    "UnsafeResultPathError": "errors",
    "WorkerBusyError": "errors",
    "WorkerLostError": "errors",
    "AttemptInfo": "job",
    "Job": "job",
    "JobState": "job",
    "MetricRecord": "job",
    "OutputLine": "job",
    "DaskResultsHandler": "results",
}


def __getattr__(name: str) -> _Any:
    module = _WHERE.get(name)
    if module is None:
        # A submodule (dask_ddp.dispatch, dask_ddp.data, ...) after a bare `import dask_ddp`.
        if not name.startswith("__") and _importlib_util.find_spec(f"{__name__}.{name}"):
            return _importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module 'dask_ddp' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next lookup is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AttemptInfo",
    "BackendUnavailableError",
    "ChannelError",
    "CheckpointDirMissingError",
    "CheckpointInfo",
    "DashboardUnavailableWarning",
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
    "RankStoppedError",
    "RendezvousTimeoutError",
    "ResizeStopError",
    "RetryableError",
    "ScaleTimeoutError",
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

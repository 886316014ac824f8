"""Train existing PyTorch programs with DistributedDataParallel on a Dask cluster.

>>> import dask_ddp
>>> {"launch", "run", "get_context", "report", "save_checkpoint"} <= set(dask_ddp.__all__)
True
"""

import importlib as _importlib
import importlib.util as _importlib_util
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from ._shared.version import __version__

if _TYPE_CHECKING:  # what a type checker and an IDE see; at run time names load on use
    from ._client.attach import attach
    from ._client.job import (
        Job,
        JobInfo,
        JobState,
        MetricRecord,
        OutputLine,
        Transition,
        jobs,
    )
    from ._client.launch import launch, launch_script, run
    from ._client.sweep import Sweep, sweep
    from ._rank.checkpoint import CheckpointInfo, PendingCheckpoint
    from ._rank.context import (
        RankContext,
        get_checkpoint,
        get_context,
        get_dataset_shard,
        report,
        save_checkpoint,
    )
    from ._shared.values import TrialInfo
    from .errors import (
        DaskDDPError,
        InfrastructureError,
        JobCancelledError,
        JobNotFoundError,
        JobStalledError,
        RankFailedError,
        RankStoppedError,
        RetryableError,
        ScaleTimeoutError,
        WorkerLostError,
    )
    from .results import DaskResultsHandler

# Each public name and the module that defines it. Modules load on first use, so that
# `python -m dask_ddp --help` and a client that only launches never import torch.
_WHERE = {
    "CheckpointInfo": "_rank.checkpoint",
    "PendingCheckpoint": "_rank.checkpoint",
    "RankContext": "_rank.context",
    "get_checkpoint": "_rank.context",
    "get_context": "_rank.context",
    "get_dataset_shard": "_rank.context",
    "report": "_rank.context",
    "save_checkpoint": "_rank.context",
    "launch": "dispatch",
    "launch_script": "dispatch",
    "run": "dispatch",
    "DaskDDPError": "errors",
    "InfrastructureError": "errors",
    "JobCancelledError": "errors",
    "JobNotFoundError": "errors",
    "JobStalledError": "errors",
    "RankFailedError": "errors",
    "RankStoppedError": "errors",
    "RetryableError": "errors",
    "ScaleTimeoutError": "errors",
    "WorkerLostError": "errors",
    "Job": "_client.job",
    "JobInfo": "_client.job",
    "JobState": "_client.job",
    "MetricRecord": "_client.job",
    "OutputLine": "_client.job",
    "Transition": "_client.job",
    "attach": "_client.attach",
    "jobs": "_client.job",
    "DaskResultsHandler": "results",
    "Sweep": "_client.sweep",
    "sweep": "_client.sweep",
    "TrialInfo": "_shared.values",
}


async def _dask_setup(server: _Any) -> None:
    """``dask scheduler --preload dask_ddp``: install dask-ddp's plugin as the scheduler
    starts, so that every job runs there from the first one, on a scheduler that blocks
    plugin registration too (a worker preloaded with it does nothing)."""
    from ._scheduler.plugin import install_on

    await install_on(server)


def __getattr__(name: str) -> _Any:
    if name == "dask_setup":  # the preload hook: not a public name of the package
        return _dask_setup
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
    "CheckpointInfo",
    "DaskDDPError",
    "DaskResultsHandler",
    "InfrastructureError",
    "Job",
    "JobCancelledError",
    "JobInfo",
    "JobNotFoundError",
    "JobStalledError",
    "JobState",
    "MetricRecord",
    "OutputLine",
    "PendingCheckpoint",
    "RankContext",
    "RankFailedError",
    "RankStoppedError",
    "RetryableError",
    "ScaleTimeoutError",
    "Sweep",
    "Transition",
    "TrialInfo",
    "WorkerLostError",
    "__version__",
    "attach",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "jobs",
    "launch",
    "launch_script",
    "report",
    "run",
    "save_checkpoint",
    "sweep",
]

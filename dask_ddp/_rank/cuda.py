"""The rank's GPU in its worker's process: which CUDA device is the rank's own.

Placement (:mod:`dask_ddp._shared.placement`) gives each rank a ``CUDA_VISIBLE_DEVICES`` in which
its own GPU is ``cuda:LOCAL_RANK``. That list takes effect only if CUDA starts after the
rank set it: CUDA reads ``CUDA_VISIBLE_DEVICES`` once per process, when its driver is
initialised. A worker whose CUDA started earlier (an earlier job's rank under another
list, an RMM pool or a task that touched CUDA) keeps the list it started under. This
module remembers that list for the process, and :func:`rank_device` finds the rank's own
GPU in it, so that ``get_context().device`` is always the GPU placement chose, and says
when ``cuda:LOCAL_RANK`` would not be.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import TYPE_CHECKING

from .._shared.placement import RankPlacement, device_index
from ..errors import PlacementError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["driver_initialised", "rank_device"]

_CUDA_ERROR_NOT_INITIALIZED = 3

_lock = threading.Lock()
_started_under: list[str | None] = []  # the CUDA_VISIBLE_DEVICES this process's CUDA started with


def driver_initialised() -> bool:
    """Whether the CUDA driver was initialised in this process (by torch or anything
    else), which fixes the devices it sees. Asks the driver without initialising it:
    every driver call but a few answers ``CUDA_ERROR_NOT_INITIALIZED`` before ``cuInit``.
    False where there is no driver.

    >>> isinstance(driver_initialised(), bool)
    True
    """
    import torch

    if torch.cuda.is_initialized():
        return True
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED


def rank_device(placement: RankPlacement, job: str) -> torch.device:
    """The rank's device, made current: its own GPU where CUDA shows it, else ``cpu``.

    Call it inside the rank, after its environment is set and before anything else
    touches CUDA.

    Raises
    ------
    PlacementError
        CUDA started in this worker process under a ``CUDA_VISIBLE_DEVICES`` that hides
        the rank's GPU.
    """
    import torch

    p = placement
    if not p.use_gpu:
        return torch.device("cpu")
    # What the rank's environment says (bootstrap set it from the plan).
    visible = p.worker_visible_devices if p.cuda_visible_devices is None else p.cuda_visible_devices
    with _lock:
        if not _started_under and driver_initialised():
            # Started before any rank: under the worker's own list.
            _started_under.append(p.worker_visible_devices)
        started = _started_under[0] if _started_under else visible
        index = device_index(p.gpu, started)
        if index is None:
            raise PlacementError(
                f"job {job}, rank {p.rank} on {p.worker}: its GPU {p.gpu} is not visible in "
                f"this worker process, whose CUDA started before the rank under "
                f"CUDA_VISIBLE_DEVICES={started!r}. Restart the workers (client.restart()) "
                "and launch again; do not touch CUDA in a task before a worker's first rank."
            )
        if index != p.device_index:
            logger.warning(
                "job %s, rank %d on %s: this worker's CUDA started before the rank, under "
                "CUDA_VISIBLE_DEVICES=%r, so the rank's GPU %s is cuda:%d here, not cuda:%d "
                "as planned (LOCAL_RANK is %d). get_context().device is cuda:%d; code that "
                "picks cuda:LOCAL_RANK (accelerate, Lightning, DeepSpeed) would use another "
                "GPU. Restart the workers (client.restart()) before launching to fix it.",
                job, p.rank, p.worker, started, p.gpu, index, p.device_index, p.local_rank,
                index,
            )  # fmt: skip
        device = torch.device("cuda", index)
        if torch.cuda.is_available():  # False where a GPU is only pretended (ddp.gpu-count)
            torch.cuda.set_device(device)
            if not _started_under:
                _started_under.append(visible)
    return device

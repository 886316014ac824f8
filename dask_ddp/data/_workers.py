"""What the datasets do once in each DataLoader worker process."""

from __future__ import annotations

import gc
import logging
import os

import torch.utils.data

logger = logging.getLogger(__name__)

_checked_pid: int | None = None  # the process that last looked; a forked child differs


def freeze_inherited_objects() -> None:
    """In a DataLoader worker, hide the objects that exist now from the garbage collector.

    A worker starts with every object of the process that made it: about 460,000 with
    torch loaded. Reading allocates objects that outlive a collection or two (in-flight
    S3 requests, batches being built), and when enough pile up Python runs a full
    collection that walks all of them: 0.2 to 0.3 s in which the worker makes no batch,
    about once per 2,000 samples read from S3 one object each. ``gc.freeze()`` moves what
    exists now out of the collector's sight (and stops it from writing to the inherited
    pages), so a full collection takes milliseconds. Python's documentation gives this
    pattern for forked workers. Objects frozen are never collected, so whatever garbage
    the worker inherited stays. The rank's own objects are never frozen (its template's are:
    :mod:`dask_ddp._rank.template`).
    """
    global _checked_pid
    pid = os.getpid()
    if _checked_pid == pid:
        return
    _checked_pid = pid
    if torch.utils.data.get_worker_info() is None:
        return  # not a DataLoader worker
    gc.freeze()
    logger.debug("DataLoader worker %d: froze %d inherited objects", pid, gc.get_freeze_count())

"""Worker preload for the command line's own LocalCluster (``python -m dask_ddp``).

Dask runs :func:`dask_setup` in each worker process as it starts (``preload=``). It makes
the worker ready for a rank before the rank's task arrives, and fit to share the user's
terminal:

- the worker dies with the command (``PR_SET_PDEATHSIG``): a command killed by a signal,
  or one that exits at once after a rank failed, leaves no worker behind;
- (with :mod:`dask_ddp._rank.host`, the second preload) the template its ranks' processes
  fork from starts in a background thread while the worker registers, so the first rank
  task does not wait for its imports (about 3 s of a cold start);
- the worker's "Compute Failed" log block for a rank task is dropped: the command prints
  the failing rank's error once, itself.
"""

from __future__ import annotations

import ctypes
import logging
import re
import signal
import sys
from typing import Any

from .protocol import is_rank_key

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class RankComputeFailedFilter(logging.Filter):
    """Turns a worker's "Compute Failed" record for a rank task (``ddp_<name>_rank<r>-...``)
    into one INFO line.

    The client raises the rank's error with its traceback; the worker's ERROR block (key,
    task, exception and traceback as reprs) would print it again wherever the workers'
    output goes, a notebook's included (a LocalCluster's workers write to the kernel's
    stderr). Handlers at WARNING, as a LocalCluster's are, drop the INFO line; a real
    cluster's worker log, usually at INFO, keeps it for operators.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        msg, args = record.msg, record.args
        if (
            isinstance(msg, str)
            and msg.startswith("Compute Failed")
            and isinstance(args, tuple)
            and len(args) >= 4
            and is_rank_key(args[0])
        ):
            record.msg = "rank task %s failed: %s (the client raises it, with its traceback)"
            record.args = (args[0], args[3])
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


class LostRankValuesFilter(logging.Filter):
    """Turns the scheduler's warning that a worker left with "already computed task(s),
    which will be recomputed elsewhere" into one INFO line when those tasks are all rank
    tasks: dask-ddp never recomputes a rank (its supervisor fails the task at once with
    :class:`~dask_ddp.WorkerLostError`), so the warning would be wrong, and it would print
    into every notebook that closes a LocalCluster after a job."""

    _KEYS = re.compile(r"\{([^{}]*)\}")

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage() if record.levelno == logging.WARNING else ""
        if "lose already computed task(s)" in msg:
            found = self._KEYS.search(msg)
            keys = re.findall(r"'([^']*)'", found.group(1)) if found else []
            if keys and all(is_rank_key(k) for k in keys):
                record.msg = "%s (values of finished dask-ddp ranks: their futures now raise)"
                record.args = (msg.split(", which will", 1)[0],)
                record.levelno, record.levelname = logging.INFO, "INFO"
        return True


#: The filter dask-ddp's scheduler plugin puts on the scheduler's log while it runs.
LOST_RANK_VALUES = LostRankValuesFilter()

#: The one filter every worker of a dask-ddp job gets (see events.BlobHandler).
RANK_FAILURES = RankComputeFailedFilter()


def quiet_rank_failures() -> None:
    """Install :data:`RANK_FAILURES` on this worker process's ``distributed.worker`` log
    (again is harmless: a logger keeps a filter once)."""
    logging.getLogger("distributed.worker").addFilter(RANK_FAILURES)


def die_with_parent() -> bool:
    """Ask Linux to kill this process when its parent exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable", exc_info=True)
        return False


def dask_setup(worker: Any) -> None:
    """Dask's preload hook: runs in each worker process before it registers."""
    die_with_parent()
    quiet_rank_failures()

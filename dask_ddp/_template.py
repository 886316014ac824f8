"""The rank template's own set-up: run once, before it forks its first rank's process, by
the template that imports this module (the last of :data:`dask_ddp._rankproc.PRELOAD`)
with :data:`~dask_ddp._rankproc.TEMPLATE_MARK` in its environment (the mark goes, so its
ranks do not inherit it). Any other process that imports it (the suite's doctests) is
left as it was.

What it works out here, every rank's process inherits instead of working out again:

- the C library's handle (``find_library`` runs ``ldconfig`` in a child process) and the
  machine's network addresses (gloo's interface is chosen from them; 0.6 ms);
- gloo's registration: torch 2.14 registers even its built-in backends on first use, by
  reading every installed package's entry points (6-10 ms where a few hundred packages are
  installed), and each rank's process would pay it again;
- the collector's view of the template's objects: before each fork they are frozen
  (``gc.freeze``, as Python's documentation advises for forked workers). A rank's first
  full collection otherwise walks all of them (350,000 with torch), writing to each one:
  250 ms of CPU and 89 MB of the template's pages copied into every rank's process, which
  a frozen template's rank does in 0.2 ms and 75 pages. The rank's own objects are
  collected as usual; garbage it inherited from the template stays.
"""

from __future__ import annotations

import gc
import logging
import os

from . import _malloc, _process, _rankproc

logger = logging.getLogger(__name__)


def _prepare() -> None:
    os.register_at_fork(before=gc.freeze)
    # The rest only saves each rank some time: a failure must not stop the template (an
    # exception from a preload other than ImportError ends multiprocessing's forkserver).
    try:
        import torch.distributed as dist

        _malloc._glibc()
        _process.interface_of("127.0.0.1")
        dist.BackendConfig("gloo")
    except Exception:
        logger.debug("the rank template's set-up failed", exc_info=True)


if os.environ.pop(_rankproc.TEMPLATE_MARK, None) == "1":
    _prepare()

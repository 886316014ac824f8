"""The rank template: the process a worker's rank processes are forked from, where it lives,
and its own set-up.

**Where it lives.** The template is a fork server of dask-ddp's own
(:mod:`dask_ddp._rank.forkserver`: a fresh interpreter, public APIs only, nothing of
``multiprocessing``'s) that has imported torch and dask-ddp (:data:`PRELOAD`). A worker
with a nanny (every LocalCluster's, ``dask worker``'s default) asks its nanny for it
(:func:`find`): the nanny's process keeps one, shared by the nannies in that process (a
LocalCluster's are all in one) and started by the first worker that asks, and stops it
when the last of those nannies closes. A worker that is lost and
replaced finds it still there, its imports done (torch's and dynamo's: 2-3 s of CPU): the
replacement's first rank forks at once instead of waiting for them, and a cluster of N
workers imports torch into one template instead of N. A worker without a nanny, or whose
nanny cannot be asked, keeps a template of its own, started on first use; one whose
nanny's template has gone asks again (the nanny starts another). Each rank's process
takes its worker's environment (``_rankproc``), whichever process its template belongs
to.

**Its own set-up.** Run once, before the template forks its first rank's process, by the
template itself (:func:`prepare`, called as the last of :data:`PRELOAD`). Any other process
that imports this module (a worker, the suite's doctests) is left as it was. What it works
out here, every rank's process inherits instead of working out again:

- the C library's handle (``find_library`` runs ``ldconfig`` in a child process) and the
  machine's network addresses (gloo's interface is chosen from them; 0.6 ms);
- gloo's registration: torch 2.14 registers even its built-in backends on first use, by
  reading every installed package's entry points (6-10 ms where a few hundred packages are
  installed), and each rank's process would pay it again;
- the collector's view of the template's objects: before each fork they are frozen
  (``gc.freeze``, as Python's documentation advises for forked workers; the fork server
  does it). A rank's first
  full collection otherwise walks all of them (350,000 with torch), writing to each one:
  250 ms of CPU and 89 MB of the template's pages copied into every rank's process, which
  a frozen template's rank does in 0.2 ms and 75 pages. The rank's own objects are
  collected as usual; garbage it inherited from the template stays.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from distributed.diagnostics.plugin import NannyPlugin

from . import forkserver, malloc
from . import process as _process

logger = logging.getLogger(__name__)

__all__ = [
    "LEAN",
    "PRELOAD",
    "Template",
    "find",
    "own",
    "prepare",
    "start_here",
]

#: Modules the template imports once, so that a rank's process starts with them. Measured
#: in a process forked from a template without them: ``dask_ddp.data._collection_shard``
#: took 50 ms in each rank, and ``DistributedDataParallel(model)`` 1.4 s (it imports
#: ``torch._dynamo``, and with it sympy: 889 modules), which a restart paid again.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.utils.data",
    "torch.optim",
    "torch._dynamo",
    "dask_ddp._rank.tasks",
    "dask_ddp._rank.rankproc",
    "dask_ddp._rank.host",
    "dask_ddp.data._collection_shard",
    "dask_ddp._rank.template:prepare",  # the template's own set-up, once its imports are done
]

#: What the command line's template imports (:func:`start_here` ``lean=True``): what every
#: script needs. Its cluster lives for one script: dynamo (and sympy), 1.8 s of CPU on the
#: path to every script's start, is imported by the ranks whose script builds a
#: ``DistributedDataParallel`` (1.4 s each, side by side), as under torchrun.
LEAN = [m for m in PRELOAD if m != "torch._dynamo"]

#: The name of the nanny plugin that holds the nanny's process's template for it.
NANNY_PLUGIN = "dask-ddp-rank-template"


class Template(Protocol):
    """Where a worker's ranks fork from: its nanny's process's template, or its own."""

    def fork(self, target: Callable[..., Any], args: Sequence[Any], fds: Sequence[int],
             environ: dict[str, str]) -> forkserver.ForkedProcess:  # fmt: skip
        """A process forked from it, running ``target(fds, *args)`` with ``environ``
        (:func:`dask_ddp._rank.forkserver.fork`)."""

    def start(self) -> None:
        """Start it if it is this process's own and not running (its imports go on in its
        own process: the first fork from it waits for them)."""

    def alive(self) -> bool:
        """Whether it can still fork (as far as this process can tell)."""


class _Own:
    """A template this process starts (on first use) and owns: it ends when this process
    does, or when :meth:`stop` is called."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        self.preload = list(preload)
        self.holders = 0  # the nannies in this process that hold it for their workers
        self._server: forkserver.Server | None = None
        # A hold, a release (the last one stops it), a start and an address given out never
        # cross: an address read as the last holder let go would be one that no longer forks.
        self._lock = threading.RLock()

    def address(self) -> tuple[str, int]:
        """The template's address and pid (started now if it is not running)."""
        with self._lock:
            server = self._server
            if server is None or not server.running():
                if server is not None:
                    server.stop()
                server = self._server = forkserver.start(self.preload)
            return server.address, server.pid

    def fork(self, target: Callable[..., Any], args: Sequence[Any], fds: Sequence[int],
             environ: dict[str, str]) -> forkserver.ForkedProcess:  # fmt: skip
        return forkserver.fork(self.address()[0], target, args, fds, environ)

    def start(self) -> None:
        self.address()

    def alive(self) -> bool:
        return True  # started again on the next fork if it ended

    def hold(self) -> None:
        """A nanny in this process holds it for its workers."""
        with self._lock:
            self.holders += 1

    def release(self) -> None:
        """A nanny lets it go: the last one stops it."""
        with self._lock:
            self.holders -= 1
            if self.holders == 0:
                self.stop()

    def stop(self) -> None:
        """Let the template go: it exits once it sees that nobody wants it (after its
        imports, if it is still importing), its ranks left to their workers."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.stop()


class _Nanny:
    """The template of this worker's nanny's process, at ``address``, process ``pid``."""

    def __init__(self, address: str, pid: int) -> None:
        self.address, self.pid = address, pid
        self.gone = False  # a fork from it failed: its nanny stopped it, or it died

    def fork(self, target: Callable[..., Any], args: Sequence[Any], fds: Sequence[int],
             environ: dict[str, str]) -> forkserver.ForkedProcess:  # fmt: skip
        try:
            return forkserver.fork(self.address, target, args, fds, environ)
        except OSError:
            self.gone = True  # the next probe asks the nanny again (find)
            raise

    def start(self) -> None:
        pass  # its nanny's process started it

    def alive(self) -> bool:
        """Whether it can still fork (as far as this worker can tell)."""
        if self.gone:
            return False
        try:
            os.kill(self.pid, 0)
        except (ProcessLookupError, PermissionError):  # (another user's took the number)
            return False
        return True


_own = _Own()  # this process's own template (started on first use), its nannies' too


def own() -> _Own:
    """This process's own template: a worker's until its nanny's is found (:func:`find`)."""
    return _own


def start_here(lean: bool = False) -> None:
    """Start this process's own template now, for the nannies it is about to start (the
    command line's LocalCluster), its imports beside their workers' start; ``lean``: only
    :data:`LEAN`'s (for a cluster that runs one script)."""
    if lean:
        _own.preload = list(LEAN)
    _own.address()


async def find(worker: Any, current: Template) -> Template:
    """The template ``worker``'s ranks fork from from now on: ``current`` while it is its
    nanny's and still forks; else its nanny's process's template, asked of the nanny (a
    nanny whose template went starts another); where there is no nanny, or it cannot say,
    this process's own (logged)."""
    if worker.nanny is None or (isinstance(current, _Nanny) and current.alive()):
        return current
    from .._shared import dask_internals

    if isinstance(current, _Nanny):
        logger.info("dask-ddp: worker %s asks its nanny for its rank template again: the "
                    "one at %s is gone", worker.address, current.address)  # fmt: skip
    try:
        address, pid = await dask_internals.run_in_nanny(worker, _hold_for_nanny)
    except Exception as exc:  # the worker's own template does as well
        logger.info(
            "dask-ddp: worker %s starts its own rank template: its nanny %s could not hold "
            "one (%s)", worker.address, worker.nanny, exc,
        )  # fmt: skip
        return _own
    return _Nanny(address, pid)


async def _hold_for_nanny(dask_worker: Any) -> tuple[str, int]:
    """Run in a nanny (``Nanny.run``, asked by its worker): hold its process's template for
    its workers, started now if needed (again, if it died); its address and pid."""
    import asyncio

    nanny = dask_worker
    if NANNY_PLUGIN not in nanny.plugins:
        await nanny.plugin_add(plugin=_NannyHold(), name=NANNY_PLUGIN)
    address, pid = await asyncio.get_running_loop().run_in_executor(None, _own.address)
    logger.debug("dask-ddp: nanny %s holds the rank template %d at %s", nanny.address, pid, address)
    return address, pid


class _NannyHold(NannyPlugin):
    """A nanny's hold on its process's template: the template stops when the last nanny in
    the process that holds it closes."""

    def setup(self, nanny: Any) -> None:
        _own.hold()

    def teardown(self, nanny: Any) -> None:
        _own.release()


def prepare() -> None:
    """The template's own set-up, in the template alone, once its imports are done (the
    last of :data:`PRELOAD`). It only saves each rank some time: a failure is
    logged and the template serves all the same."""
    try:
        import torch.distributed as dist

        malloc._glibc()
        _process.interface_of("127.0.0.1")
        dist.BackendConfig("gloo")
    except Exception:
        logger.debug("the rank template's set-up failed", exc_info=True)

"""The rank template: the process a worker's rank processes are forked from, where it lives,
and its own set-up.

**Where it lives.** The template is a ``multiprocessing`` forkserver of dask-ddp's own (not
the process-wide one user code may start) that has imported torch and dask-ddp
(:data:`PRELOAD`). A worker with a nanny (every LocalCluster's, ``dask worker``'s default)
asks its nanny for it (:func:`find`): the nanny's process keeps one, shared by the nannies
in that process (a LocalCluster's are all in one) and started by the first worker that
asks, and stops it when the last of those nannies closes. A worker that is lost and
replaced finds it still there, its imports done (torch's and dynamo's: 2-3 s of CPU): the
replacement's first rank forks at once instead of waiting for them, and a cluster of N
workers imports torch into one template instead of N. A worker without a nanny, or whose
nanny cannot be asked, keeps a template of its own, started on first use; one whose
nanny's template has gone asks again (the nanny starts another). Each rank's process
takes its worker's environment (``_rankproc``), whichever process its template belongs
to.

**Its own set-up.** Run once, before the template forks its first rank's process, by the
template that imports this module (the last of :data:`PRELOAD`) with :data:`TEMPLATE_MARK`
in its environment (the mark goes, so its ranks do not inherit it). Any other process that
imports it (a worker, the suite's doctests) is left as it was. What it works out here,
every rank's process inherits instead of working out again (and, first, it drops a request
that a killed worker cut off, which ended multiprocessing's loop):

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

import contextlib
import errno
import gc
import io
import logging
import os
import threading
from multiprocessing import forkserver, popen_forkserver, process, resource_tracker, spawn, util
from multiprocessing.context import reduction, set_spawning_popen
from typing import Any

from distributed.diagnostics.plugin import NannyPlugin

from . import malloc
from . import process as _process

logger = logging.getLogger(__name__)

__all__ = [
    "LEAN",
    "PRELOAD",
    "TEMPLATE_MARK",
    "TemplateProcess",
    "find",
    "lost",
    "start",
    "start_here",
]

#: Modules the template imports once, so that a rank's process starts with them. Measured
#: in a process forked from a template without them: ``dask_ddp.data._collection_shard``
#: took 50 ms in each rank, and ``DistributedDataParallel(model)`` 1.4 s (it imports
#: ``torch._dynamo``, and with it sympy: 889 modules), which a restart paid again.
PRELOAD = [
    "__main__",
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.utils.data",
    "torch.optim",
    "torch._dynamo",
    "dask_ddp._rank.tasks",
    "dask_ddp._rank.rankproc",
    "dask_ddp.data._collection_shard",
    "dask_ddp._rank.template",  # the template's own set-up, once its imports are done
]

#: What the command line's template imports (:func:`start_here` ``lean=True``): what every
#: script needs. Its cluster lives for one script: dynamo (and sympy), 1.8 s of CPU on the
#: path to every script's start, is imported by the ranks whose script builds a
#: ``DistributedDataParallel`` (1.4 s each, side by side), as under torchrun.
LEAN = [m for m in PRELOAD if m != "torch._dynamo"]

#: Set in the environment of the process that starts a template, while it starts it: the
#: template's own set-up runs where it finds it, and nowhere else that imports this module.
TEMPLATE_MARK = "DASK_DDP_RANK_TEMPLATE"

#: The name of the nanny plugin that holds the nanny's process's template for it.
NANNY_PLUGIN = "dask-ddp-rank-template"

_mark_lock = threading.Lock()  # the mark is in the process-wide environment


class _Own(forkserver.ForkServer):
    """A template this process starts (on first use) and owns: it ends when this process
    does, or when :meth:`stop` is called."""

    def __init__(self) -> None:
        super().__init__()
        self.set_forkserver_preload(PRELOAD)
        self.holders = 0  # the nannies in this process that hold it for their workers
        # A hold, a release (the last one stops it) and an address given out never cross:
        # an address read as the last holder let go would be one that no longer forks.
        self._holding = threading.Lock()

    def ensure_running(self) -> None:
        # multiprocessing's own check fails where this process reaped it elsewhere (psutil)
        with self._lock:  # type: ignore[attr-defined]
            pid = self._forkserver_pid  # type: ignore[attr-defined]
            if pid is not None:
                try:
                    ended = os.waitpid(pid, os.WNOHANG)[0] != 0
                except ChildProcessError:
                    ended = True
                if ended:
                    os.close(self._forkserver_alive_fd)  # type: ignore[attr-defined]
                    self._forkserver_pid = self._forkserver_alive_fd = None
                    self._forkserver_address = None
        # multiprocessing starts the template with this process's environment
        with _mark_lock:
            os.environ[TEMPLATE_MARK] = "1"
            try:
                super().ensure_running()
            finally:
                os.environ.pop(TEMPLATE_MARK, None)

    def address(self) -> tuple[str, int]:
        """The template's address and pid (started now if it is not running)."""
        with self._holding:
            self.ensure_running()
            return self._forkserver_address, self._forkserver_pid  # type: ignore[attr-defined]

    def hold(self) -> None:
        """A nanny in this process holds it for its workers."""
        with self._holding:
            self.holders += 1

    def release(self) -> None:
        """A nanny lets it go: the last one stops it."""
        with self._holding:
            self.holders -= 1
            if self.holders == 0:
                self.stop()

    def stop(self) -> None:
        """Let the template go: it exits once no process can ask it for a fork (closing
        what says it is wanted), its ranks left to their workers. Not waited for here (a
        template still importing exits when its imports are done): a thread reaps it."""
        with self._lock:  # type: ignore[attr-defined]
            pid, alive = self._forkserver_pid, self._forkserver_alive_fd  # type: ignore[attr-defined]
            if pid is None:
                return
            self._forkserver_pid = self._forkserver_alive_fd = None
            address, self._forkserver_address = self._forkserver_address, None
        os.close(alive)
        with contextlib.suppress(OSError):
            os.unlink(address)
        reaper = threading.Thread(target=_reap, args=(pid,), name="dask-ddp-template-exit")
        reaper.daemon = True
        reaper.start()


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


class _Nanny(forkserver.ForkServer):
    """The template of this worker's nanny's process, at ``address``, process ``pid``."""

    def __init__(self, address: str, pid: int) -> None:
        super().__init__()
        self._forkserver_address, self.pid = address, pid
        # Handed to each rank's process as multiprocessing hands a forkserver's "alive" end
        # (the rank's own forkserver context, if it uses one, starts its own).
        self._forkserver_alive_fd = os.open(os.devnull, os.O_RDONLY)
        self.gone = False  # a fork from it failed: its nanny stopped it, or it died

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._forkserver_alive_fd)

    def ensure_running(self) -> None:
        resource_tracker.ensure_running()  # its fd goes to each rank, as multiprocessing's does

    def alive(self) -> bool:
        """Whether it can still fork (as far as this worker can tell)."""
        if self.gone:
            return False
        try:
            os.kill(self.pid, 0)
        except (ProcessLookupError, PermissionError):  # (another user's took the number)
            return False
        return True


_own = _Own()  # this process's own template (started on first use)
_here: forkserver.ForkServer = _own  # where this worker's ranks fork from


def start() -> None:
    """Start this worker's template if it is its own and not running; its imports go on in
    its own process (the first fork from it waits for them)."""
    _here.ensure_running()


def start_here(lean: bool = False) -> None:
    """Start this process's own template now, for the nannies it is about to start (the
    command line's LocalCluster), its imports beside their workers' start; ``lean``: only
    :data:`LEAN`'s (for a cluster that runs one script)."""
    if lean:
        _own.set_forkserver_preload(LEAN)
    _own.address()


def lost() -> bool:
    """Whether this worker's template is its nanny's, and gone (died, or stopped)."""
    here = _here
    return isinstance(here, _Nanny) and not here.alive()


async def find(worker: Any) -> None:
    """Ask ``worker``'s nanny for its process's template, which its ranks fork from from then
    on; where there is no nanny, or it cannot say, the worker keeps its own (logged). A
    nanny whose template went (a fork from it failed) is asked again: it starts another."""
    global _here
    if worker.nanny is None or (isinstance(_here, _Nanny) and _here.alive()):
        return
    from .._shared import dask_internals

    if isinstance(_here, _Nanny):
        logger.info("dask-ddp: worker %s asks its nanny for its rank template again: the "
                    "one at %s is gone", worker.address, _here._forkserver_address)  # fmt: skip
    try:
        address, pid = await dask_internals.run_in_nanny(worker, _hold_for_nanny)
    except Exception as exc:  # the worker's own template does as well
        logger.info(
            "dask-ddp: worker %s starts its own rank template: its nanny %s could not hold "
            "one (%s)", worker.address, worker.nanny, exc,
        )  # fmt: skip
        _here = _own
        return
    _here = _Nanny(address, pid)


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


class _Popen(popen_forkserver.Popen):
    """multiprocessing's forkserver start, from this worker's template (:data:`_here`), not
    the process-wide forkserver (``popen_forkserver.Popen._launch``, but for the server)."""

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        here = _here
        try:
            self.sentinel, w = here.connect_to_new_process(self._fds)
        except OSError:
            if isinstance(here, _Nanny):  # the next probe asks the nanny again (find)
                here.gone = True
            raise
        # As multiprocessing does: the data pipe's write end stays open, the child's sentinel
        # of its parent.
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class TemplateProcess(process.BaseProcess):
    """A ``multiprocessing`` process forked from this worker's template."""

    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:
        return _Popen(process_obj)


def _outlive_vanished_clients() -> None:
    """A worker killed between connecting to its template and sending its request ended
    multiprocessing's forkserver (``recvfds`` raises ``EOFError`` out of its loop), and with
    a nanny's template, every worker's in that process: the request is dropped as the loop
    drops an aborted connection. Each fork gets multiprocessing's own back."""
    receive = reduction.recvfds

    def recvfds(sock: Any, size: int) -> list[int]:
        try:
            return receive(sock, size)
        except (EOFError, ConnectionError, RuntimeError) as exc:
            raise ConnectionAbortedError(errno.ECONNABORTED, "a request cut off") from exc

    def restore() -> None:
        reduction.recvfds = receive

    reduction.recvfds = recvfds
    os.register_at_fork(after_in_child=restore)


def _prepare() -> None:
    _outlive_vanished_clients()
    os.register_at_fork(before=gc.freeze)
    # The rest only saves each rank some time: a failure must not stop the template (an
    # exception from a preload other than ImportError ends multiprocessing's forkserver).
    try:
        import torch.distributed as dist

        malloc._glibc()
        _process.interface_of("127.0.0.1")
        dist.BackendConfig("gloo")
    except Exception:
        logger.debug("the rank template's set-up failed", exc_info=True)


if os.environ.pop(TEMPLATE_MARK, None) == "1":
    _prepare()

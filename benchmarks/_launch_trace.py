"""The tracer of ``launch_floor.py``: loaded by every process of its run (a ``sitecustomize``
that imports this and calls :func:`install`), it wraps the functions a launch passes
through, as their modules are imported, and appends each call's entry and exit time to the
file ``$DDP_TRACE`` (one ``write`` each: a few microseconds)."""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import os
import sys
import time
from collections.abc import Callable
from typing import Any

_fd: list[Any] = [None, None]  # the file's descriptor, and the pid that opened it


def emit(name: str, phase: str, extra: str = "") -> None:
    pid = os.getpid()
    if _fd[1] != pid:  # a forked process opens its own
        _fd[0] = os.open(os.environ["DDP_TRACE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        _fd[1] = pid
    os.write(_fd[0], f"{time.time():.6f} {pid} {name} {phase} {extra}\n".encode())


def _wrap(obj: Any, attr: str, name: str, extra: Callable[..., str] | None = None) -> None:
    f = getattr(obj, attr)
    if inspect.iscoroutinefunction(f):

        @functools.wraps(f)
        async def traced(*args: Any, **kwargs: Any) -> Any:
            emit(name, "in", extra(args, kwargs) if extra else "")
            try:
                return await f(*args, **kwargs)
            finally:
                emit(name, "out", extra(args, kwargs) if extra else "")
    else:

        @functools.wraps(f)
        def traced(*args: Any, **kwargs: Any) -> Any:
            emit(name, "in", extra(args, kwargs) if extra else "")
            try:
                return f(*args, **kwargs)
            finally:
                emit(name, "out", extra(args, kwargs) if extra else "")

    setattr(obj, attr, traced)


def _stage(args: tuple, kwargs: dict) -> str:
    return args[3] if len(args) > 3 else kwargs.get("stage", "joined")


def _stimulus(args: tuple, kwargs: dict) -> str:
    return "+".join(type(e).__name__ for e in args[1:])


def _patch(module: Any) -> None:
    name = module.__name__
    if name == "dask_ddp.dispatch":
        _wrap(module, "launch", "client.launch")
    elif name == "dask_ddp._client.job":
        _wrap(module.Job, "result", "client.result")
    elif name == "dask_ddp._scheduler.launcher":
        _wrap(module.Launcher, "prepare", "sched.prepare")
        _wrap(module.Launcher, "submit", "sched.submit")
        _wrap(module.Launcher, "publish", "sched.publish")
    elif name == "dask_ddp._rank.tasks":
        _wrap(module, "probe_worker", "worker.probe")
        _wrap(module, "run_rank", "worker.run_rank")
        _wrap(module, "run_in_process", "rank.run_in_process")
        _wrap(module, "_connect_store", "rank.store")
        _wrap(module, "_rendezvous", "rank.rendezvous", _stage)
    elif name == "dask_ddp._rank.rankproc":
        _wrap(module, "_take", "worker.take_spare")
        _wrap(module.RankLink, "next_go", "rank.next_go")
    elif name == "dask_ddp._scheduler.supervisor":
        _wrap(module.Supervisor, "on_task", "sched.on_task")
        _wrap(module.Supervisor, "_transition", "sched.state", lambda a, k: a[1].state.value)
    elif name == "dask_ddp._client.reader":
        _wrap(module.EventReader, "_state", "client.state", lambda a, k: a[1].get("state", ""))
    elif name == "distributed.client":
        _wrap(module.Client, "_gather", "client.gather")
    elif name == "distributed.scheduler":
        _wrap(module.Scheduler, "update_graph", "sched.update_graph")
        _wrap(module.Scheduler, "handle_task_finished", "sched.task_finished")
    elif name == "distributed.worker":
        _wrap(module.Worker, "handle_stimulus", "worker.stimulus", _stimulus)
        _wrap(module.Worker, "execute", "worker.execute")
    elif name == "torch.distributed":
        _wrap(module, "init_process_group", "rank.init_pg")
        _wrap(module, "destroy_process_group", "rank.destroy_pg")


_TARGETS = {
    "dask_ddp._client.launch", "dask_ddp._client.job", "dask_ddp._scheduler.launcher",
    "dask_ddp._rank.tasks", "dask_ddp._rank.rankproc", "torch.distributed",
    "dask_ddp._scheduler.supervisor", "dask_ddp._client.reader",
    "distributed.client", "distributed.scheduler", "distributed.worker",
}  # fmt: skip


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a target module as the others would, and patches it once it has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if os.environ.get("DDP_TRACE"):
        sys.meta_path.insert(0, _Finder())

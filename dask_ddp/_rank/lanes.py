"""Many Dask workers in one process, each running a simulated rank: the control plane at
scale on a small machine.

``python -m dask_ddp._rank.lanes tcp://scheduler:8786 --workers 250`` starts 250 Dask workers
(one thread each, no nanny) in this process and serves until they close. Each worker is a lane
(:class:`LaneHost`, the second kind of :class:`~dask_ddp._rank.host.RankHost`): the rank
task :func:`dask_ddp._rank.tasks.run_rank` runs on it as on any worker, with its own
channel, store connection, status and abort, but leaves the process-wide settings alone
(environment, threads, printed output), and its job must not start a process group. The
scheduler sees as many workers as there are lanes, and the job's supervisor (the scheduler
plugin) places, watches and stops their ranks as it does real ones.

Used by ``benchmarks/control_plane.py`` and its test. The workers' own housekeeping (event
loop ticks, system monitor, profiler, memory monitor) runs rarely or not at all here, so
that a few processes can host 1,000 of them on 2 cores; what they send the scheduler
(heartbeats at the rate the scheduler asks, task results, events) is unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
from typing import Any

import dask

from . import storehost
from .host import Ending, RankHost, RankWork, release_waiters_at, release_waiters_in, use_lanes
from .slot import ProcessSlot, RankRun, bind

logger = logging.getLogger(__name__)

#: The workers' own housekeeping, made rare (per worker; the scheduler is not affected).
QUIET_WORKERS = {
    "distributed.admin.tick.interval": "1s",
    "distributed.admin.system-monitor.interval": "10s",
    "distributed.admin.system-monitor.disk": False,
    "distributed.worker.profile.enabled": False,
}


class LaneHost(RankHost):
    """A worker that is a lane: its ranks run in its task's thread, in this process shared
    with the other lanes (a slot of its own each), torch imported here, rank 0's store held
    here; no process group, nothing to fork or count elsewhere."""

    def __init__(self, worker: Any) -> None:
        super().__init__(worker, ProcessSlot())

    def get_ready(self) -> None:
        pass  # nothing to start: its ranks are threads

    async def warm(self) -> None:
        pass

    def gpu_count(self) -> int:
        import torch

        return torch.cuda.device_count()

    def open_store(self, job_id: str, timeout: float) -> int:
        store = storehost.new_store(self.worker.ip, timeout)
        self.slot.put_store(job_id, store)
        return store.port

    def run(self, work: RankWork) -> Ending:
        bind(self.slot)  # what the rank's code finds (this_slot) while it runs here
        try:
            return work.in_thread(), None, None
        finally:
            bind(None)

    def release_waits(self, active: list[RankRun], unclaimed: Any) -> None:
        masters = [r.master for r in active if r.master is not None]
        if unclaimed is not None:
            target, arg = release_waiters_in, unclaimed
        elif masters:
            target, arg = release_waiters_at, masters[0]
        else:
            return
        threading.Thread(target=target, args=(arg,), name="dask-ddp-release", daemon=True).start()


async def serve(scheduler: str, count: int, name: str, batch: int = 25) -> None:
    """Start ``count`` lanes (workers named ``<name>-<i>``) on ``scheduler``, ``batch`` at a
    time, print ``ready``, and serve until every one has closed."""
    from distributed import Worker

    use_lanes(LaneHost)
    # What a real worker imports on its first rank (the first probe), done before the
    # workers join: launches measure the control plane, not this import.
    import torch.distributed  # noqa: F401

    workers: list[Worker] = []
    for start in range(0, count, batch):
        group = [
            Worker(
                scheduler,
                nthreads=1,
                memory_limit=0,
                name=f"{name}-{i}",
                dashboard=False,
                validate=False,
            )
            for i in range(start, min(count, start + batch))
        ]
        await asyncio.gather(*group)
        workers += group
    print("ready", flush=True)
    await asyncio.gather(*(w.finished() for w in workers))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dask_ddp._rank.lanes", description=__doc__)
    parser.add_argument("scheduler", help="the scheduler's address")
    parser.add_argument("--workers", type=int, required=True, help="lanes in this process")
    parser.add_argument("--name", default=f"lane-{os.getpid()}", help="prefix of their names")
    args = parser.parse_args(argv)
    with dask.config.set(QUIET_WORKERS):
        asyncio.run(serve(args.scheduler, args.workers, args.name))


if __name__ == "__main__":
    main()

"""Where a launch's CPU goes: every process of the cluster, dask_ddp against plain Dask.

Issue 44 asks for a launch within 1.5x plain Dask. With N ranks on a 2-core machine a
launch is CPU-bound from N = 4 or so; this measures, per process role, the CPU time
(user and system, from ``/proc``) spent between the call and the results:

- dask_ddp: ``launch(client, fn).result()`` of an N-rank job whose function returns at once;
- plain Dask: N impure tasks pinned one to each worker, submitted and gathered;
- idle: the same cluster, doing nothing, for as long as the median dask_ddp launch (the
  workers' and the scheduler's heartbeats and system monitors, which both sides pay).

The roles: ``main`` (this process: the client, the scheduler and the nannies of the
LocalCluster), ``workers``, ``template`` (the nannies' rank template) and ``rank
processes`` (the spares forked from it that ran the ranks, counted until their task
returned; a process that ended within the window is counted in ``reaped``)::

    python benchmarks/launch_cpu.py --workers 8 --runs 12

Each timed call follows ``--gap`` seconds of quiet, as in ``launch_growth.py``.
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from typing import Any

import psutil
from _common import command_line, median, versions
from launch_growth import cluster_of, run_plain


def rank_pid() -> int:
    """The timed function: the rank's process."""
    return os.getpid()


def snapshot() -> dict[int, tuple[float, float, int, float]]:
    """pid -> (user, system, parent pid, reaped children's CPU) of this process and every
    process under it."""
    me = psutil.Process()
    out = {}
    for process in [me, *me.children(recursive=True)]:
        try:
            t = process.cpu_times()
            out[process.pid] = (
                t.user,
                t.system,
                process.ppid(),
                t.children_user + t.children_system,
            )
        except psutil.Error:
            continue
    return out


def split(
    before: dict[int, Any], after: dict[int, Any], workers: set[int], ranks: set[int]
) -> dict[str, float]:
    """CPU seconds between two snapshots, by role (``user``/``system`` kept apart)."""
    me = os.getpid()
    templates = {after.get(p, before.get(p))[2] for p in ranks if p in after or p in before}

    def role(pid: int, parent: int) -> str:
        if pid == me:
            return "main"
        if pid in ranks:
            return "rank processes"
        if pid in workers:
            return "workers"
        if pid in templates:
            return "template"
        if parent in templates:
            return "template's other children"
        return "other"

    out: collections.Counter[str] = collections.Counter()
    for pid, (user, system, parent, reaped) in after.items():
        r = role(pid, parent)
        user0, system0, _, reaped0 = before.get(pid, (0.0, 0.0, parent, reaped))
        out[f"{r} user"] += user - user0
        out[f"{r} system"] += system - system0
        out["reaped"] += reaped - reaped0
    for pid, (user, system, _, _) in before.items():
        if pid not in after:  # ended within the window: counted by its parent's reaped
            out["reaped"] -= user + system
    return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--warmup-runs", type=int, default=3)
    parser.add_argument("--gap", type=float, default=0.5)
    args = parser.parse_args()
    import dask_ddp

    sides: dict[str, list[dict[str, float]]] = {"dask_ddp": [], "plain Dask": [], "idle": []}
    walls: dict[str, list[float]] = {"dask_ddp": [], "plain Dask": []}
    with cluster_of(args.workers) as client:
        addresses = sorted(client.scheduler_info(n_workers=-1)["workers"])
        workers = set(client.run(os.getpid).values())
        for _ in range(args.warmup_runs):
            dask_ddp.launch(client, rank_pid).result()
            run_plain(client, addresses)
        for _ in range(args.runs):
            time.sleep(args.gap)
            a, t0 = snapshot(), time.perf_counter()
            ranks = set(dask_ddp.launch(client, rank_pid).result())
            walls["dask_ddp"].append(time.perf_counter() - t0)
            sides["dask_ddp"].append(split(a, snapshot(), workers, ranks))
            time.sleep(args.gap)
            a, t0 = snapshot(), time.perf_counter()
            run_plain(client, addresses)
            walls["plain Dask"].append(time.perf_counter() - t0)
            sides["plain Dask"].append(split(a, snapshot(), workers, set()))
            time.sleep(args.gap)
            a = snapshot()
            time.sleep(median(walls["dask_ddp"]))
            sides["idle"].append(split(a, snapshot(), workers, set()))
    print(f"\n{command_line()}")
    print(
        f"{versions('dask', 'distributed')}, {args.workers} workers, {args.runs} runs, "
        f"{args.gap} s quiet before each; CPU in ms, mean per launch (the clock ticks are 10 ms)"
    )
    print(
        f"call -> results, median: dask_ddp {median(walls['dask_ddp']) * 1e3:.1f} ms, "
        f"plain Dask {median(walls['plain Dask']) * 1e3:.1f} ms "
        f"({median(walls['dask_ddp']) / median(walls['plain Dask']):.2f}x); idle window = "
        f"dask_ddp's median"
    )
    roles = sorted({k for runs in sides.values() for r in runs for k in r})
    print(f"{'':34}" + "".join(f"{side:>12}" for side in sides))
    for role in roles:
        means = [sum(r.get(role, 0.0) for r in runs) / len(runs) * 1e3 for runs in sides.values()]
        if any(abs(m) >= 0.05 for m in means):
            print(f"{role:34}" + "".join(f"{m:12.1f}" for m in means))
    totals = [sum(sum(r.values()) for r in runs) / len(runs) * 1e3 for runs in sides.values()]
    print(f"{'total':34}" + "".join(f"{m:12.1f}" for m in totals))


if __name__ == "__main__":
    main()

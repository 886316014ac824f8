"""The least a launch can take that gives each rank a process of its own and a gloo group.

Issue 44 asks a launch (call -> results) within 1.5x plain Dask's N pinned tasks. Any
design that runs a rank in a process of its own and hands ``fn`` a made process group pays
at least what plain Dask pays, plus a hop from the task to that process and back, plus
gloo's group. This measures those floors on one warm LocalCluster of N single-threaded
workers, the four sides alternating (each call after ``--gap`` s of quiet), call -> results:

- ``plain``: ``client.submit`` of N impure tasks, one pinned to each worker, gathered;
- ``process``: the same tasks, each handing one line to a process waiting beside its
  worker (started before, torch imported) and returning its answer: the hop alone;
- ``group``: the same, and each waiting process makes a gloo process group of N
  (``init_process_group`` on a store that worker 0's process holds open, every process
  connected to it already, a fresh prefix each call) before it answers (the group is
  destroyed after the call, untimed): the hop and the group, with nothing a design must
  also do (no placement, no rendezvous of its own, no payload, no result channel, no
  supervisor);
- ``dask_ddp``: ``dask_ddp.launch(client, fn).result()`` of a function that returns at once.

It prints each side's median and its ratio to plain Dask::

    python benchmarks/launch_bound.py --sizes 2,4,8,16 --runs 9

``group / plain`` above 1.5 means no design with a process per rank and a group made
before ``fn`` meets issue 44's launch target on this machine. Hold
``/tmp/dask_ddp_quiet.lock`` while it runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from typing import Any

from _common import command_line, median, versions
from launch_growth import cluster_of, run_dask_ddp, run_plain

SIDES = ("plain", "process", "group", "dask_ddp")


def child(master: str | None) -> None:
    """A process waiting beside a worker: ``hop R`` answers; ``group R RANK WORLD`` makes a
    gloo group of WORLD (prefix R) on the store first, then answers; ``drop R`` destroys
    the group (after the timed call, untimed).

    A process that closed its group as soon as it answered would cut a peer still
    connecting gloo's mesh ("Connection closed by peer"; dask_ddp's ranks wait for each
    other after the group for that reason). Leaving that wait out makes the floor lower,
    never higher."""
    from datetime import timedelta

    import torch.distributed as dist

    if master is None:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
        print(store.port, flush=True)
    else:
        host, port = master.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
        print("connected", flush=True)
    for line in sys.stdin:
        kind, tag, *rest = line.split()
        if kind == "drop":  # the last group goes only now, untimed: see the docstring
            if dist.is_initialized():
                dist.destroy_process_group()
        elif kind == "group":
            rank, world = int(rest[0]), int(rest[1])
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(tag, store),
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=60),
            )
        print("ok", flush=True)


def start_child(dask_worker: Any, script: str, master: str | None) -> str:
    """(On a worker, through ``client.run``.) Start its waiting process; return its first
    line (the store's port for worker 0's)."""
    command = [sys.executable, script, "--child"] + ([] if master is None else [master])
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
    )
    dask_worker._bound_child = (proc, threading.Lock())
    return proc.stdout.readline().strip()


def stop_child(dask_worker: Any) -> None:
    proc, _ = dask_worker._bound_child
    proc.stdin.close()
    proc.wait(60)


def hop(line: str) -> float:
    """(A task.) Hand ``line`` to the worker's waiting process; when its answer came."""
    from distributed import get_worker

    proc, lock = get_worker()._bound_child
    with lock:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        proc.stdout.readline()
    return time.time()


def run_hops(client: Any, workers: list[str], kind: str, tag: str) -> float:
    """Call -> results of one task per worker, each handing its line to its process."""
    world = len(workers)
    t0 = time.time()
    futures = [
        client.submit(
            hop, f"{kind} {tag} {rank} {world}", workers=[w], allow_other_workers=False, pure=False
        )
        for rank, w in enumerate(workers)
    ]
    client.gather(futures)
    return time.time() - t0


def measure(n: int, runs: int, warmup: int, gap: float) -> dict[str, list[float]]:
    with cluster_of(n) as client:
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        script = os.path.abspath(__file__)
        port = client.run(start_child, script=script, master=None, workers=workers[:1])
        master = f"127.0.0.1:{port[workers[0]]}"
        client.run(start_child, script=script, master=master, workers=workers[1:])
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        try:
            for i in range(warmup + runs):
                for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                    time.sleep(gap)
                    if side == "plain":
                        took = run_plain(client, workers)[1]
                    elif side == "dask_ddp":
                        took = run_dask_ddp(client)[1]
                    elif side == "process":
                        took = run_hops(client, workers, "hop", f"r{i}")
                    else:
                        took = run_hops(client, workers, "group", f"r{i}")
                        run_hops(client, workers, "drop", f"r{i}")
                    if i >= warmup:
                        times[side].append(took)
        finally:
            client.run(stop_child)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2,4,8,16", help="worker counts, comma-separated")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--warmup-runs", type=int, default=2)
    parser.add_argument("--gap", type=float, default=0.5, help="seconds of quiet before each call")
    parser.add_argument("--child", nargs="?", const="", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args.child or None)
    rows = [
        (n, measure(n, args.runs, args.warmup_runs, args.gap))
        for n in map(int, args.sizes.split(","))
    ]
    print(f"\n{command_line()}")
    print(
        f"{versions('dask', 'distributed', 'dask-ddp')}, {args.runs} runs a side "
        f"(medians), {args.gap} s quiet before each call; call -> results (ms), ratio to plain"
    )
    print(f"{'N':>3} " + " ".join(f"{side:>16}" for side in SIDES))
    for n, times in rows:
        base = median(times["plain"])
        cells = [f"{median(times[s]) * 1e3:8.1f} ({median(times[s]) / base:4.2f}x)" for s in SIDES]
        print(f"{n:>3} " + " ".join(f"{c:>16}" for c in cells))
    print("every time (ms):")
    for n, times in rows:
        for side in SIDES:
            print(f"  N={n} {side}: {', '.join(f'{t * 1e3:.1f}' for t in times[side])}")


if __name__ == "__main__":
    main()

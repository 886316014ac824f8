"""Launch cost as the job grows: dask_ddp against plain Dask on the same cluster.

For N = 2, 4, 8, 16 worker processes (one thread each), one run measures, alternately
(A, B, A, B, ...) after warm-up runs:

- dask_ddp: ``launch(client, fn)`` of an N-rank job whose function returns at once, from
  the call to every rank inside ``fn`` (placement, rendezvous, ``init_process_group``),
  and to the gathered results (``job.result()``);
- plain Dask: ``client.submit`` of N impure tasks, one pinned to each worker, from the call
  to every task inside its function, and to ``client.gather``.

It prints the medians and the ratio dask_ddp / plain Dask at each N::

    python benchmarks/launch_growth.py --runs 5

Each timed call follows ``--gap`` seconds of quiet (0.5 by default): what a rank leaves
to do after its task returned (its process's exit, the next spare's fork: about 20 ms of
CPU per rank) then does not fall into the other side's time. ``--gap 0`` measures launches
back to back, each paying the last one's.

(16 workers import torch once each: on a 2-core machine the clusters take a minute or two
to start; the timed runs are on warm workers.)

``--against DIR`` compares this tree's dask_ddp with another's (a ``git worktree`` of an
older commit), run for run: two driver processes, one per tree (``PYTHONPATH``), each with
its own cluster of N workers, alive at once; they take turns (A B B A ...), each call after
``--gap`` seconds of quiet while the other cluster idles, so that the machine's drift
reaches both sides alike. It prints each side's median, their ratio and how many pairs
this tree won::

    git worktree add /tmp/before 58c5e88
    python benchmarks/launch_growth.py --against /tmp/before --sizes 2,4,8 --runs 20
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from _common import HERE, command_line, median, versions


def entered(tag: int = 0) -> float:
    """The timed function: when it was entered."""
    return time.time()


def run_dask_ddp(client) -> tuple[float, float]:
    import dask_ddp

    t0 = time.time()
    out = dask_ddp.launch(client, entered).result()
    return max(out) - t0, time.time() - t0


def run_plain(client, workers: list[str]) -> tuple[float, float]:
    t0 = time.time()
    futures = [
        client.submit(entered, i, workers=[w], allow_other_workers=False, pure=False)
        for i, w in enumerate(workers)
    ]
    out = client.gather(futures)
    return max(out) - t0, time.time() - t0


@contextlib.contextmanager
def cluster_of(n: int) -> Iterator[Any]:
    """A client of a LocalCluster of ``n`` single-threaded worker processes, all joined."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(n, timeout=600)
        yield client


def serve(n: int, warmup_runs: int) -> None:
    """A driver of ``--against``: its own cluster of ``n`` workers; one timed launch per
    ``go`` line read, its times written as a JSON line."""
    import dask_ddp

    with cluster_of(n) as client:
        for _ in range(warmup_runs):
            run_dask_ddp(client)
        print(json.dumps({"ready": dask_ddp.__file__}), flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            print(json.dumps(run_dask_ddp(client)), flush=True)


def against(args: argparse.Namespace) -> None:
    """This tree's launches against ``args.against``'s, interleaved (see the docstring)."""
    here = os.path.dirname(HERE)
    trees = {"this": here, "other": os.path.abspath(args.against)}
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        drivers = {
            side: subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--serve",
                    str(n),
                    "--warmup-runs",
                    str(args.warmup_runs),
                ],
                env={**os.environ, "PYTHONPATH": tree},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for side, tree in trees.items()
        }
        try:
            for side, driver in drivers.items():
                ready = json.loads(driver.stdout.readline())["ready"]
                if not ready.startswith(trees[side]):
                    raise SystemExit(f"the {side} driver imported dask_ddp from {ready}")
            done: dict[str, list[float]] = {side: [] for side in drivers}
            for i in range(args.runs):
                for side in ("this", "other") if i % 2 == 0 else ("other", "this"):
                    time.sleep(args.gap)
                    drivers[side].stdin.write("go\n")
                    drivers[side].stdin.flush()
                    done[side].append(json.loads(drivers[side].stdout.readline())[1])
        finally:
            for driver in drivers.values():
                with contextlib.suppress(OSError):
                    driver.stdin.close()
            for driver in drivers.values():
                driver.wait(120)
        rows.append((n, done))
    print(f"\n{command_line()}")
    print(
        f"{versions('dask', 'distributed')}, {args.runs} runs a side, interleaved, "
        f"{args.gap} s quiet before each call; other = {trees['other']}"
    )
    print(f"{'N':>3} {'this':>8} {'other':>8} {'ratio':>6} {'this won':>9}")
    for n, done in rows:
        a, b = median(done["this"]), median(done["other"])
        won = sum(x < y for x, y in zip(done["this"], done["other"], strict=True))
        print(f"{n:>3} {a:>7.3f}s {b:>7.3f}s {a / b:>5.2f}x {won:>4}/{len(done['this'])}")
    print("every time (s), call -> results gathered:")
    for n, done in rows:
        for side, times in done.items():
            print(f"  N={n} {side}: {', '.join(f'{t:.3f}' for t in times)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup-runs", type=int, default=2)
    parser.add_argument("--sizes", default="2,4,8,16", help="worker counts, comma-separated")
    parser.add_argument(
        "--gap",
        type=float,
        default=0.5,
        help="seconds of quiet before each timed call, either side's (0: back to back)",
    )
    parser.add_argument(
        "--against",
        metavar="DIR",
        help="another tree's dask_ddp (a git worktree): compared run for run, interleaved",
    )
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # --against's drivers
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.warmup_runs)
    if args.against:
        return against(args)

    sizes = [int(n) for n in args.sizes.split(",")]
    rows = []
    for n in sizes:
        with cluster_of(n) as client:
            workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
            ours: dict[str, list[float]] = {"in": [], "done": []}
            plain: dict[str, list[float]] = {"in": [], "done": []}
            for i in range(args.warmup_runs + args.runs):
                time.sleep(args.gap)
                a = run_dask_ddp(client)
                time.sleep(args.gap)
                b = run_plain(client, workers)
                if i < args.warmup_runs:
                    continue
                for times, (t_in, t_done) in ((ours, a), (plain, b)):
                    times["in"].append(t_in)
                    times["done"].append(t_done)
            rows.append((n, ours, plain))

    print(f"\n{command_line()}")
    print(
        f"{versions('dask', 'distributed', 'dask-ddp')}, {args.runs} runs (medians), "
        f"{args.gap} s quiet before each call"
    )
    print(
        f"{'N':>3} {'dask_ddp in fn':>15} {'plain in fn':>12} {'ratio':>6}"
        f" {'dask_ddp done':>14} {'plain done':>11} {'ratio':>6}"
    )
    for n, ours, plain in rows:
        a_in, b_in = median(ours["in"]), median(plain["in"])
        a_done, b_done = median(ours["done"]), median(plain["done"])
        print(
            f"{n:>3} {a_in:>14.3f}s {b_in:>11.3f}s {a_in / b_in:>5.1f}x"
            f" {a_done:>13.3f}s {b_done:>10.3f}s {a_done / b_done:>5.1f}x"
        )
    print("every time (s), call -> results gathered:")
    for n, ours, plain in rows:
        print(f"  N={n} dask_ddp: {', '.join(f'{t:.3f}' for t in ours['done'])}")
        print(f"  N={n} plain:    {', '.join(f'{t:.3f}' for t in plain['done'])}")


if __name__ == "__main__":
    main()

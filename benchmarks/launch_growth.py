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
"""

from __future__ import annotations

import argparse
import time

from _common import command_line, median, versions


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
    args = parser.parse_args()

    from distributed import Client, LocalCluster

    sizes = [int(n) for n in args.sizes.split(",")]
    rows = []
    for n in sizes:
        with (
            LocalCluster(
                n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0"
            ) as cluster,
            Client(cluster) as client,
        ):
            client.wait_for_workers(n, timeout=600)
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

"""Several ranks behind one worker against a worker per rank: the same 4-rank job as 2
workers x 2 ranks (``ranks_per_worker=2``) and as 4 workers x 1 rank, side by side.

One run starts both clusters (LocalClusters, worker processes, gloo, CPU) and measures,
alternately (A, B, A, B, ...) after warm-up runs:

- launch: the call to every rank inside the function, and a short job end to end (call to
  gathered results), warm;
- training: steady steps per second of the same small CNN (DDP, batch 32, one torch thread
  per rank: 4 ranks share the machine's cores either way);
- memory: the unique memory (USS) of each worker process, of each rank process (while the
  ranks run) and of the template, and their sum per layout.

Prints every time, the medians and the ratios (2 x 2 over 4 x 1)::

    python benchmarks/ranks_per_worker.py --runs 5
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import psutil
from _common import command_line, ddp_steps_per_second, median, versions

RANKS = 4


def rank_fn(steps: int, warmup: int, hold: float, pids: str | None = None) -> dict[str, Any]:
    """Enter, train ``warmup + steps`` DDP steps, then stay ``hold`` seconds (its pid written
    into the folder ``pids``: its memory is read meanwhile); when it entered, its steps per
    second and its pid."""
    entered = time.time()
    steps_per_s = ddp_steps_per_second(steps, warmup)
    if pids is not None:
        with open(os.path.join(pids, str(os.getpid())), "w"):
            pass
    time.sleep(hold)
    return {
        "entered": entered,
        "steps_per_s": steps_per_s,
        "pid": os.getpid(),
    }


def _uss(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_full_info().uss / 2**20
    except psutil.Error:
        return float("nan")


def _layout(client: Any, per_worker: int, steps: int, warmup: int) -> dict[str, Any]:
    import dask_ddp

    t0 = time.time()
    out = dask_ddp.launch(
        client, rank_fn, args=(steps, warmup, 0.0), ranks_per_worker=per_worker
    ).result()
    return {
        "launch": max(o["entered"] for o in out) - t0,
        "total": time.time() - t0,
        "steps_per_s": median(o["steps_per_s"] for o in out),
    }


def _memory(client: Any, per_worker: int) -> dict[str, Any]:
    """USS of the workers, of the ranks while they run, and of the template (MiB)."""
    import tempfile

    import dask_ddp

    with tempfile.TemporaryDirectory() as pids:
        job = dask_ddp.launch(
            client, rank_fn, args=(0, 3, 4.0, pids), ranks_per_worker=per_worker
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while len(os.listdir(pids)) < RANKS and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = [int(name) for name in os.listdir(pids)]
        workers = client.run(os.getpid)
        templates = [
            p for p in psutil.Process().children()
            if any("forkserver" in part for part in p.cmdline())
        ]  # fmt: skip
        result = {
            "workers": [_uss(p) for p in workers.values()],
            "ranks": [_uss(p) for p in ranks],
            "templates": [_uss(t.pid) for t in templates],
        }
        job.result()
    result["total"] = sum(result["workers"]) + sum(result["ranks"]) + sum(result["templates"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup-runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100, help="timed training steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before timing")
    args = parser.parse_args()

    import dask
    from distributed import Client, LocalCluster

    print(command_line())
    print(versions("torch", "distributed", "dask"))
    # Both clusters' nannies are in this process: they share its one template, which the
    # memory figures count once for each layout.
    with (
        dask.config.set({"ddp.threads-per-rank": 1}),
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as two,
        Client(two) as by_two,
        LocalCluster(n_workers=4, threads_per_worker=1, dashboard_address=":0") as four,
        Client(four) as by_four,
    ):
        layouts = {"2 workers x 2 ranks": (by_two, 2), "4 workers x 1 rank": (by_four, 1)}
        for client, per in layouts.values():
            for _ in range(args.warmup_runs):
                _layout(client, per, args.steps, args.warmup)
        times: dict[str, list[dict[str, Any]]] = {name: [] for name in layouts}
        for run in range(args.runs):
            for name, (client, per) in layouts.items():
                result = _layout(client, per, args.steps, args.warmup)
                times[name].append(result)
                print(
                    f"run {run} {name}: launch {result['launch']:.3f} s, total "
                    f"{result['total']:.3f} s, {result['steps_per_s']:.1f} steps/s per rank"
                )
        memory = {name: _memory(client, per) for name, (client, per) in layouts.items()}
    print()
    print(
        "| layout | call -> all in fn | short job | steps/s per rank | workers' USS | "
        "ranks' USS | template | total |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    medians = {}
    for name, results in times.items():
        m = {k: median(r[k] for r in results) for k in ("launch", "total", "steps_per_s")}
        medians[name] = m
        mem = memory[name]
        print(
            f"| {name} | {m['launch']:.3f} s | {m['total']:.3f} s | {m['steps_per_s']:.1f} | "
            f"{', '.join(f'{u:.0f}' for u in mem['workers'])} MiB | "
            f"{', '.join(f'{u:.0f}' for u in mem['ranks'])} MiB | "
            f"{', '.join(f'{u:.0f}' for u in mem['templates'])} MiB | {mem['total']:.0f} MiB |"
        )
    a, b = medians["2 workers x 2 ranks"], medians["4 workers x 1 rank"]
    memory_ratio = memory["2 workers x 2 ranks"]["total"] / memory["4 workers x 1 rank"]["total"]
    print()
    print(
        f"2x2 / 4x1: launch {a['launch'] / b['launch']:.2f}x, short job "
        f"{a['total'] / b['total']:.2f}x, steps/s {a['steps_per_s'] / b['steps_per_s']:.2f}x, "
        f"memory {memory_ratio:.2f}x"
    )


if __name__ == "__main__":
    main()

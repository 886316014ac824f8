"""Where a launch's milliseconds go: each stage's time, from every process, at N workers.

A tracer (:mod:`_launch_trace`, loaded by every process of the run through a
``sitecustomize`` in a temporary folder put first on ``PYTHONPATH``: the driver's client
and scheduler, the workers, their template and the ranks forked from it) appends the entry
and exit time of each function a launch passes through to one file. The driver launches,
on a warm LocalCluster of N workers (one thread each), K jobs whose function returns at
once, each after 0.5 s of quiet, and after each, as plain Dask's reference, N trivial
tasks pinned one to each worker (``submit`` then ``gather``), traced the same way (Dask's
own stages: the scheduler's ``update_graph`` and ``task-finished``, a worker's stimuli
and ``execute``, the client's gather). Each side's table gives, for each stage seen in
most of its launches, the median over the K launches of its first and last time (over
the ranks) after the call, in ms::

    python benchmarks/launch_floor.py --workers 2 --launches 15
    python benchmarks/launch_floor.py --workers 16 --launches 9

The rank's ``init_pg`` rows also count a spare's rehearsal, and ``destroy_pg`` the last
launch's teardown, when one falls in a launch's window. Hold ``/tmp/dask_ddp_quiet.lock``
while it runs.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def fn() -> float:
    return time.time()


def drive(workers: int, launches: int) -> None:
    """(In the traced process.) Warm the cluster, then time ``launches`` launches."""
    from distributed import Client, LocalCluster

    import dask_ddp

    trace = os.environ["DDP_TRACE"]
    with (
        LocalCluster(
            n_workers=workers, threads_per_worker=1, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        client.wait_for_workers(workers, timeout=300)
        for _ in range(3):
            dask_ddp.launch(client, fn).result()
            time.sleep(0.5)
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        for i in range(launches):
            for side in ("dask_ddp", "plain"):
                time.sleep(0.5)
                with open(trace, "a") as f:
                    f.write(f"{time.time():.6f} {os.getpid()} MARK {side}:{i}\n")
                if side == "dask_ddp":
                    dask_ddp.launch(client, fn).result()
                else:
                    client.gather(
                        [
                            client.submit(fn, workers=[w], allow_other_workers=False, pure=False)
                            for w in workers
                        ]
                    )
                with open(trace, "a") as f:
                    f.write(f"{time.time():.6f} {os.getpid()} END {side}:{i}\n")


def analyse(path: str) -> None:
    events = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4:
                extra = parts[4] if len(parts) > 4 else ""
                events.append((float(parts[0]), parts[2], parts[3], extra))
    events.sort()
    ends = {phase: t for t, name, phase, _ in events if name == "END"}
    for side in ("dask_ddp", "plain"):
        marks = [
            (t, phase) for t, name, phase, _ in events if name == "MARK" and phase.startswith(side)
        ]
        stages: dict[str, list[tuple[float, float, int]]] = collections.defaultdict(list)
        totals = []
        for t0, mark in marks:
            totals.append(ends[mark] - t0)
            seen: dict[str, list[float]] = collections.defaultdict(list)
            for t, name, phase, extra in events:
                if t0 <= t <= ends[mark] and name not in ("MARK", "END"):
                    seen[f"{name} {phase} {extra}".strip()].append(t - t0)
            for stage, times in seen.items():
                stages[stage].append((min(times), max(times), len(times)))
        total = statistics.median(totals) * 1000
        print(f"\n{side}: {len(marks)} launches, call -> results: median {total:.1f} ms")
        print(" first ms   last ms  calls  stage")
        rows = [
            (
                statistics.median(v[0] for v in values) * 1000,
                statistics.median(v[1] for v in values) * 1000,
                statistics.median(v[2] for v in values),
                stage,
            )
            for stage, values in stages.items()
            if len(values) * 2 > len(marks)  # in most launches: not a stray timer's
        ]
        for first, last, calls, stage in sorted(rows):
            print(f"{first:9.1f} {last:9.1f}  {calls:5g}  {stage}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--launches", type=int, default=15)
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.drive:
        drive(opts.workers, opts.launches)
        return
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
            f.write("import _launch_trace\n_launch_trace.install()\n")
        trace = os.path.join(tmp, "events.log")
        path = os.pathsep.join([tmp, HERE, *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {**os.environ, "PYTHONPATH": path, "DDP_TRACE": trace}
        command = [
            sys.executable, os.path.abspath(__file__), "--drive",
            "--workers", str(opts.workers), "--launches", str(opts.launches),
        ]  # fmt: skip
        subprocess.run(command, env=env, check=True)
        print(" ".join(["python benchmarks/launch_floor.py", *sys.argv[1:]]))
        analyse(trace)


if __name__ == "__main__":
    main()

"""Many short jobs in a row on one cluster: does anything grow or slow down?

A sweep, or a long notebook session, launches job after job on the same cluster. This runs
``--jobs`` short 2-rank jobs in a row, as a user would (``launch()``, ``result()``, the
``Job`` dropped; no ``forget()``), on a cluster whose scheduler and workers run in their
own processes (so that each one's memory can be read). Each job reports ``--records``
records per rank and saves one checkpoint. It prints:

- the time per job (launch to ``result()``), median of the first 50 jobs after the first
  one (the workers import torch in it) and of the last 50, and their ratio;
- records lost: every record every rank reported must be in ``Job.metrics``;
- RSS growth of the scheduler, the client and each worker from job 100 to the last one
  (the scheduler keeps the last ``ddp.dashboard.max-jobs`` = 100 finished jobs: growth
  before that is the cap filling up), and the scheduler's RSS every 100 jobs (distributed
  keeps the last 1000 events of each topic and messages of each connection: growth that
  stops once those are full is theirs);
- the scheduler's task prefixes and the lines of its Prometheus ``/metrics`` after 10 jobs
  and after the last one::

    python benchmarks/soak.py --jobs 1000
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import urllib.request

import psutil
import torch
from _common import command_line, median, start_cluster, versions
from distributed import Client

import dask_ddp

WORLD = 2


def short_job(records: int) -> int:
    """A short job: ``records`` reports, then one checkpoint (rank 0 writes it)."""
    ctx = dask_ddp.get_context()
    for step in range(records):
        dask_ddp.report({"loss": 1.0 / (step + 1), "lr": 0.1}, step=step)
    dask_ddp.save_checkpoint({"weights": torch.ones(16), "step": records}, step=records)
    return ctx.rank


def _prefixes(dask_scheduler=None) -> list[str]:
    return sorted(dask_scheduler.task_prefixes)


def _metrics_lines(client: Client) -> list[str]:
    """The series of the scheduler's /metrics (each line without its value)."""
    info = client.scheduler_info(n_workers=0)
    host = client.scheduler.address.split("://", 1)[1].rsplit(":", 1)[0]
    url = f"http://{host}:{info['services']['dashboard']}/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    return [line.rsplit(" ", 1)[0] if not line.startswith("#") else line for line in lines]


class _Rss:
    def __init__(self, client: Client) -> None:
        self.procs = {"scheduler": psutil.Process(client.run_on_scheduler(os.getpid))}
        self.procs["client"] = psutil.Process()
        for i, (_, pid) in enumerate(sorted(client.run(os.getpid).items())):
            self.procs[f"worker {i}"] = psutil.Process(pid)

    def read(self) -> dict[str, float]:
        return {name: p.memory_info().rss / 2**20 for name, p in self.procs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--records", type=int, default=20, help="report() calls per rank")
    args = parser.parse_args()
    if args.jobs < 150:
        parser.error("--jobs must be at least 150 (growth is read from job 100 on)")

    times: list[float] = []
    lost = failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        sched_file, procs = start_cluster(tmp, WORLD)
        try:
            with Client(scheduler_file=sched_file) as client:
                client.wait_for_workers(WORLD, timeout="120s")
                rss = _Rss(client)
                at_100: dict[str, float] = {}
                scheduler_rss: list[float] = []
                after_10: tuple[list[str], list[str]] | None = None
                started = time.monotonic()
                for i in range(1, args.jobs + 1):
                    folder = os.path.join(tmp, f"ckpt-{i}")
                    t0 = time.perf_counter()
                    job = dask_ddp.launch(client, short_job, args=(args.records,),
                                          checkpoint_dir=folder)  # fmt: skip
                    job.result(timeout=120)
                    times.append(time.perf_counter() - t0)
                    lost += WORLD * args.records - len(job.metrics)
                    failed += job.state is not dask_ddp.JobState.SUCCEEDED
                    del job
                    shutil.rmtree(folder, ignore_errors=True)
                    if i == 10:
                        after_10 = (client.run_on_scheduler(_prefixes), _metrics_lines(client))
                    if i == 100:
                        at_100 = rss.read()
                    if i % 100 == 0:
                        scheduler_rss.append(rss.read()["scheduler"])
                        print(f"  {i} jobs, {time.monotonic() - started:.0f} s, last job "
                              f"{times[-1] * 1e3:.0f} ms", flush=True)  # fmt: skip
                at_end = rss.read()
                prefixes, lines = client.run_on_scheduler(_prefixes), _metrics_lines(client)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=60)

    first, last = median(times[1:51]), median(times[-50:])
    print(f"\n{command_line()}")
    print(f"{versions('dask', 'distributed', 'dask-ddp')}, {WORLD} ranks per job")
    print(f"{args.jobs} jobs of {args.records} records per rank and one checkpoint, "
          f"{sum(times):.0f} s in jobs")  # fmt: skip
    print("| measure | value |\n| --- | --- |")
    print(f"| time per job, jobs 2-51 (median) | {first * 1e3:.0f} ms |")
    print(f"| time per job, last 50 (median) | {last * 1e3:.0f} ms |")
    print(f"| last / first | {last / first:.2f}x |")
    print(f"| records lost | {lost} of {args.jobs * WORLD * args.records} |")
    print(f"| jobs not succeeded | {failed} |")
    for name in at_end:
        print(f"| RSS {name}, job 100 -> {args.jobs} | {at_100[name]:.0f} -> "
              f"{at_end[name]:.0f} MB ({at_end[name] - at_100[name]:+.1f} MB) |")  # fmt: skip
    print(f"| RSS scheduler every 100 jobs | {', '.join(f'{r:.0f}' for r in scheduler_rss)} MB |")
    assert after_10 is not None
    print(f"| task prefixes after 10 / {args.jobs} jobs | {len(after_10[0])} / {len(prefixes)} |")
    print(f"| /metrics lines after 10 / {args.jobs} jobs | {len(after_10[1])} / {len(lines)} |")
    ddp = [sum("ddp" in line for line in s) for s in (after_10[1], lines)]
    print(f"| /metrics lines naming ddp after 10 / {args.jobs} jobs | {ddp[0]} / {ddp[1]} |")
    print(f"task prefixes at the end: {', '.join(prefixes)}")
    new = sorted(set(lines) - set(after_10[1]))
    gone = sorted(set(after_10[1]) - set(lines))
    print(f"/metrics series new since job 10: {new or 'none'}; gone: {gone or 'none'}")


if __name__ == "__main__":
    main()

"""The control plane at 64, 256 and 1,000 ranks: one real scheduler, simulated ranks.

Everything dask-ddp does beside training goes through the Dask scheduler: placing the
ranks, their tasks, every ``report()`` batch, status, checkpoints, each job's supervisor.
For each size N this starts one real scheduler (its own process, dask-ddp's plugin on it)
and N Dask workers hosted by a few processes (``python -m dask_ddp._rank.lanes``: many workers
per process, each running one rank through the package's rank task, ``run_rank``). One
job of N ranks runs :func:`simulated_rank`: ``report()`` every ``--period`` seconds, a
status update every 10 reports, ``save_checkpoint()`` every 20 (the job may grow by one
worker, so every rank coordinates through the job's store at each checkpoint), no torch
collectives. After a settling time the window of ``--window`` seconds is measured; then
one rank fails and the supervisor stops the others. It prints, per size:

- launch -> all started: from ``launch()`` to the last rank's first record;
- the scheduler's CPU (% of one core, its process's CPU time over the window) and its
  event loop's longest block (distributed's own tick measure) while every rank reports;
- report -> client delay p50/p99 (``on_report`` on the client, same machine clock);
- records lost (every rank's records ``0..n-1`` must reach ``Job.metrics``);
- the scheduler's memory (RSS) growth during the window, and after the job;
- failure -> all stopped: from the failing rank's last record to the client seeing the job
  stopped (every rank task ended, workers given back);
- the TCPStore rendezvous for N clients on loopback (``--store-processes`` processes, a
  thread per client: connect, add, wait until all have), apart from the job, with this
  machine's resolver and with its timeout capped (below);
- the CPU the lane processes and this client used during the window, since on a 2-core
  machine they compete with the scheduler for the same cores.

The resolver: a TCPStore server looks up the name of every client that connects
(``getnameinfo`` of its IPv4-mapped address, on the store's one thread). Where no DNS
server answers, as on the machines these ran on, one lookup in about 25 waits out the
resolver's timeout (5 s), and every client of the store waits with it. The processes this
starts therefore run with ``RES_OPTIONS="timeout:1 attempts:1"`` (1 s, glibc's least)
unless ``--resolver-as-is`` is given; the TCPStore row shows both. See docs/scale.md.

::

    python benchmarks/control_plane.py --ranks 64,256,1000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import timedelta
from typing import Any

import psutil
from distributed import Client

import dask_ddp
from dask_ddp._client.launch import _launch
from dask_ddp._rank import status
from dask_ddp._shared import dask_internals

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# -- the simulated rank -------------------------------------------------------------------
class SimulatedFailure(RuntimeError):
    """The failure :func:`simulated_rank` raises on its failing rank."""


def simulated_rank(period: float, flag: str, fail_rank: int, limit: float) -> int:
    """One rank: ``report()`` every ``period`` s, a status every 10 reports, a checkpoint
    every 20; rank ``fail_rank`` raises once the file ``flag`` exists. Its last record says
    how many it reported before (``{"sent": n}``), also when the job stops it."""
    ctx = dask_ddp.get_context()
    sent = 0
    start = next_at = time.monotonic()
    try:
        while time.monotonic() - start < limit:
            dask_ddp.report({"loss": 1.0 / (sent + 1), "lr": 0.1}, step=sent)
            sent += 1
            if sent % 10 == 0:
                status.activity(f"simulated batch {sent}")
            if sent % 20 == 0:
                dask_ddp.save_checkpoint({"step": sent}, step=sent)
            if ctx.rank == fail_rank and os.path.exists(flag):
                raise SimulatedFailure(f"rank {ctx.rank} fails after {sent} reports")
            next_at += period
            time.sleep(max(0.0, next_at - time.monotonic()))
    finally:
        dask_ddp.report({"sent": sent})
    return sent


# -- the cluster --------------------------------------------------------------------------
#: The resolver's timeout capped at glibc's least (see the module's docstring).
QUICK_RESOLVER = {"RES_OPTIONS": "timeout:1 attempts:1"}


def _env(resolver: dict[str, str]) -> dict[str, str]:
    path = [ROOT, HERE, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
    return {**env, **resolver}


class Cluster:
    """A scheduler process and ``ranks`` lanes in ``processes`` processes."""

    def __init__(self, ranks: int, processes: int, tmp: str, resolver: dict[str, str]) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []  # the scheduler first, then the lanes
        self.client: Client | None = None
        try:
            self._start(ranks, processes, tmp, resolver)
        except BaseException:
            self.close()  # a scheduler or lanes that started must not outlive a failed start
            raise

    def _start(self, ranks: int, processes: int, tmp: str, resolver: dict[str, str]) -> None:
        sched_file = os.path.join(tmp, "scheduler.json")
        self.scheduler = subprocess.Popen(
            [sys.executable, "-m", "dask", "scheduler", "--scheduler-file", sched_file,
             "--port", "0", "--dashboard-address", ":0", "--preload", "dask_ddp"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(resolver),
        )  # fmt: skip
        self.procs.append(self.scheduler)
        deadline = time.monotonic() + 120
        while not os.path.exists(sched_file):
            if time.monotonic() > deadline or self.scheduler.poll() is not None:
                raise RuntimeError("the scheduler did not start")
            time.sleep(0.1)
        with open(sched_file) as f:
            self.address = json.load(f)["address"]
        t0 = time.monotonic()
        shares = [ranks // processes + (i < ranks % processes) for i in range(processes)]
        for i, share in enumerate(s for s in shares if s):
            command = [sys.executable, "-m", "dask_ddp._rank.lanes", self.address,
                       "--workers", str(share), "--name", f"lanes{i}"]  # fmt: skip
            self.procs.append(
                subprocess.Popen(
                    command,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=_env(resolver),
                )
            )
        self.client = Client(self.address)
        self.client.wait_for_workers(ranks, timeout=600)
        self.started_in = time.monotonic() - t0

    def pids(self) -> dict[str, list[psutil.Process]]:
        return {
            "scheduler": [psutil.Process(self.scheduler.pid)],
            "lanes": [psutil.Process(p.pid) for p in self.procs[1:]],
            "client": [psutil.Process()],
        }

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        for proc in reversed(self.procs):  # the lanes, then the scheduler
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


# -- one job at one size ------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    ranks: int
    cluster_start: float = 0.0
    launch_returned: float = 0.0
    all_started: float = 0.0
    scheduler_cpu: float = 0.0  # % of one core over the window
    lanes_cpu: float = 0.0
    client_cpu: float = 0.0
    blocked: float = 0.0  # longest gap between two ticks of the scheduler's loop, s
    delay_p50: float = 0.0
    delay_p99: float = 0.0
    records: int = 0
    lost: int = 0
    unaccounted: int = 0  # ranks whose last record ({"sent": n}) never arrived
    rss_before: float = 0.0  # MB
    rss_window: float = 0.0
    rss_after: float = 0.0
    failure_to_stopped: float = 0.0
    state: str = ""
    failed_rank: int | None = None
    page_ms: float = 0.0  # GET /ddp/api/jobs/<id> during the window
    page_kb: float = 0.0
    store: float = 0.0  # TCPStore rendezvous of N clients, s, this machine's resolver
    store_quick: float = 0.0  # the same, the resolver's timeout capped
    notes: list[str] = dataclasses.field(default_factory=list)


class _Arrivals:
    """What ``on_report`` saw: each rank's first record time, every delay in the window,
    and the steps that arrived."""

    def __init__(self, ranks: int) -> None:
        self.lock = threading.Lock()
        self.first = [None] * ranks
        self.window: tuple[float, float] | None = None
        self.delays: list[float] = []

    def __call__(self, rec: dask_ddp.MetricRecord) -> None:
        now = time.time()
        with self.lock:
            if self.first[rec.rank] is None:
                self.first[rec.rank] = rec.time
            w = self.window
            if w is not None and w[0] <= rec.time < w[1]:
                self.delays.append(now - rec.time)


def _page(cluster: Cluster, job_id: str) -> tuple[float, float]:
    info = cluster.client.scheduler_info(n_workers=0)
    host = cluster.address.split("://", 1)[1].rsplit(":", 1)[0]
    url = f"http://{host}:{info['services']['dashboard']}/ddp/api/jobs/{job_id}"
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as reply:
        body = reply.read()
    return (time.perf_counter() - t0) * 1e3, len(body) / 1e3


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(
    ranks: int,
    *,
    processes: int = 4,
    period: float = 0.1,
    settle: float = 3.0,
    window: float = 10.0,
    store_processes: int = 4,
    resolver: dict[str, str] | None = None,
    page: bool = True,
) -> Result:
    """Run one job of ``ranks`` simulated ranks on a fresh cluster; measure it.
    ``resolver``: environment for the processes (default :data:`QUICK_RESOLVER`);
    ``page``: read the job's ``/ddp/`` JSON once during the window, as an open page would."""
    resolver = QUICK_RESOLVER if resolver is None else resolver
    out = Result(ranks)
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(ranks, processes, tmp, resolver)
        try:
            out.cluster_start = cluster.started_in
            _run_job(cluster, out, tmp, period=period, settle=settle, window=window, page=page)
        finally:
            cluster.close()
    if store_processes:
        out.store = store_rendezvous(ranks, store_processes, {})
        out.store_quick = store_rendezvous(ranks, store_processes, QUICK_RESOLVER)
    return out


def _run_job(
    cluster: Cluster,
    out: Result,
    tmp: str,
    *,
    period: float,
    settle: float,
    window: float,
    page: bool,
) -> None:
    client, ranks = cluster.client, out.ranks
    procs = cluster.pids()
    sched = procs["scheduler"][0]
    flag = os.path.join(tmp, "fail-now")
    fail_rank = ranks // 2
    arrivals = _Arrivals(ranks)
    out.rss_before = sched.memory_info().rss / 2**20
    t0 = time.time()
    # init_process_group=False: no torch collectives (two process groups cannot share a
    # process). workers=N + 1, min_workers=N: the job may grow by one, so every rank waits
    # for rank 0's word at each checkpoint through the job's store (dask_ddp._rank.resize).
    job = _launch(
        client, simulated_rank, (period, flag, fail_rank, 600.0), None,
        workers=ranks + 1, min_workers=ranks, backend="gloo", timeout=60,
        pass_local_rank=False, init_process_group=False, on_report=arrivals,
        checkpoint_dir=os.path.join(tmp, "checkpoints"), name="simulated",
    )  # fmt: skip
    out.launch_returned = time.time() - t0
    deadline = time.monotonic() + 300
    while any(f is None for f in arrivals.first):
        if time.monotonic() > deadline or job.done():
            missing = sum(f is None for f in arrivals.first)
            raise RuntimeError(f"{missing} of {ranks} ranks never reported ({job.state})")
        time.sleep(0.05)
    out.all_started = max(arrivals.first) - t0
    time.sleep(settle)

    cpu0 = {k: _cpu(v) for k, v in procs.items()}
    client.run_on_scheduler(dask_internals.reset_max_tick)
    w0 = time.time()
    arrivals.window = (w0, w0 + window)
    time.sleep(window / 2)
    if page:
        out.page_ms, out.page_kb = _page(cluster, job.job_id)  # as an open /ddp/ page would
    time.sleep(max(0.0, w0 + window - time.time()))
    elapsed = time.time() - w0
    cpu1 = {k: _cpu(v) for k, v in procs.items()}
    out.blocked = client.run_on_scheduler(dask_internals.max_tick_seconds)
    out.rss_window = sched.memory_info().rss / 2**20
    out.scheduler_cpu = 100 * (cpu1["scheduler"] - cpu0["scheduler"]) / elapsed
    out.lanes_cpu = 100 * (cpu1["lanes"] - cpu0["lanes"]) / elapsed
    out.client_cpu = 100 * (cpu1["client"] - cpu0["client"]) / elapsed

    open(flag, "w").close()  # rank fail_rank fails at its next report
    stopped = job.wait_stopped(timeout=300)
    seen_stopped = time.time()
    time.sleep(0.5)  # on_report runs on its own thread: let it catch up
    with arrivals.lock:
        delays = list(arrivals.delays)
    out.delay_p50, out.delay_p99 = _quantile(delays, 0.5), _quantile(delays, 0.99)
    out.state = job.state.value
    error = job.exception(timeout=60)
    out.failed_rank = getattr(error, "rank", None)
    if not stopped:
        out.notes.append("the job did not stop within 300 s")
    steps: list[set[int]] = [set() for _ in range(ranks)]
    sent: list[int | None] = [None] * ranks
    fail_time = None
    for rec in job.metrics:
        if "sent" in rec.metrics:
            sent[rec.rank] = int(rec.metrics["sent"])
            if rec.rank == fail_rank:
                fail_time = rec.time
        elif rec.step is not None:
            steps[rec.rank].add(rec.step)
    out.records = len(job.metrics)
    out.lost = sum(
        len(set(range(n)) - got) for n, got in zip(sent, steps, strict=True) if n is not None
    )
    out.unaccounted = sum(n is None for n in sent)
    out.failure_to_stopped = seen_stopped - fail_time if fail_time else float("nan")
    out.rss_after = sched.memory_info().rss / 2**20
    out.notes += job._model.notes[-3:]


# -- TCPStore rendezvous ------------------------------------------------------------------
def _quiet_torch(resolver: dict[str, str]) -> None:
    # Before the resolver's first use in this process, and before torch is imported.
    os.environ.update({**resolver, "TORCH_CPP_LOG_LEVEL": "ERROR"})


def _store_server(ports: Any, resolver: dict[str, str]) -> None:
    _quiet_torch(resolver)
    import torch.distributed as dist

    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    ports.put(master.port)
    time.sleep(3600)


def _store_clients(
    port: int, world: int, count: int, go: Any, done: Any, resolver: dict[str, str]
) -> None:
    _quiet_torch(resolver)
    import torch.distributed as dist

    go.wait()
    finished: list[float] = []
    errors: list[str] = []

    def one() -> None:
        try:
            store = dist.TCPStore(
                "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300)
            )
            if store.add("joined", 1) == world:
                store.set("ready", "1")
            store.wait(["ready"])
            finished.append(time.time())
        except Exception as exc:  # reported by the parent
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.put((max(finished) if finished else float("nan"), errors[:1]))


def store_rendezvous(world: int, processes: int, resolver: dict[str, str]) -> float:
    """Seconds for ``world`` TCPStore clients (``processes`` processes, one thread per
    client) to connect to one store on loopback, add themselves and see all joined; the
    store's server runs in a process of its own with ``resolver`` in its environment."""
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_store_server, args=(ports, resolver), daemon=True)
    server.start()
    port = ports.get(timeout=120)
    go, done = ctx.Event(), ctx.Queue()
    shares = [world // processes + (i < world % processes) for i in range(processes)]
    children = [
        ctx.Process(target=_store_clients, args=(port, world, n, go, done, resolver))
        for n in shares
        if n
    ]
    for child in children:
        child.start()
    time.sleep(5)  # the children import torch before the start
    t0 = time.time()
    go.set()
    ends = [done.get(timeout=300) for _ in children]
    for child in children:
        child.join(timeout=60)
    server.terminate()
    errors = [e for _, errs in ends for e in errs]
    if errors:
        raise RuntimeError(f"TCPStore clients failed: {errors[0]}")
    return max(end for end, _ in ends) - t0


# -- the table ----------------------------------------------------------------------------
ROWS = [
    ("workers joined (lanes started)", lambda r: f"{r.cluster_start:.1f} s"),
    ("launch() returned", lambda r: f"{r.launch_returned:.2f} s"),
    ("launch -> all ranks started", lambda r: f"{r.all_started:.2f} s"),
    ("scheduler CPU, every rank reporting", lambda r: f"{r.scheduler_cpu:.0f}% of a core"),
    ("scheduler loop's longest block", lambda r: f"{r.blocked:.3f} s"),
    ("report -> client delay p50 / p99", lambda r: f"{r.delay_p50:.3f} / {r.delay_p99:.3f} s"),
    ("records delivered / lost", lambda r: f"{r.records} / {r.lost}"
     + (f" ({r.unaccounted} ranks unaccounted)" if r.unaccounted else "")),
    ("scheduler RSS before / window / after", lambda r: f"{r.rss_before:.0f} / "
     f"{r.rss_window:.0f} / {r.rss_after:.0f} MB"),
    ("failure -> all stopped", lambda r: f"{r.failure_to_stopped:.2f} s"),
    ("job state, failed rank", lambda r: f"{r.state}, rank {r.failed_rank}"),
    ("/ddp/api/jobs/<id> during the window", lambda r: f"{r.page_ms:.0f} ms, {r.page_kb:.0f} kB"),
    ("TCPStore rendezvous, N clients", lambda r: f"{r.store:.2f} s ({r.store_quick:.2f} s "
     "resolver capped)"),
    ("lanes / client CPU in the window", lambda r: f"{r.lanes_cpu:.0f}% / {r.client_cpu:.0f}%"),
]  # fmt: skip


def print_table(results: list[Result]) -> None:
    print("| ranks | " + " | ".join(str(r.ranks) for r in results) + " |")
    print("| --- |" + " --- |" * len(results))
    for name, cell in ROWS:
        print(f"| {name} | " + " | ".join(cell(r) for r in results) + " |")
    for r in results:
        for note in r.notes:
            print(f"  {r.ranks} ranks: {note}")


def main() -> None:
    from _common import command_line, versions

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="64,256,1000", help="sizes, comma-separated")
    parser.add_argument("--processes", type=int, default=4, help="lane processes")
    parser.add_argument("--period", type=float, default=0.1, help="seconds between reports")
    parser.add_argument("--window", type=float, default=10.0, help="seconds measured")
    parser.add_argument("--store-processes", type=int, default=4)
    parser.add_argument(
        "--no-page", action="store_true", help="do not read the job's /ddp/ JSON in the window"
    )
    parser.add_argument(
        "--resolver-as-is", action="store_true",
        help="run the cluster with this machine's resolver settings (default: timeout 1 s)",
    )  # fmt: skip
    args = parser.parse_args()
    resolver = {} if args.resolver_as_is else QUICK_RESOLVER
    results = []
    for n in (int(x) for x in args.ranks.split(",")):
        t0 = time.monotonic()
        results.append(
            measure(
                n,
                processes=args.processes,
                period=args.period,
                window=args.window,
                store_processes=args.store_processes,
                resolver=resolver,
                page=not args.no_page,
            )
        )
        print(f"  {n} ranks measured in {time.monotonic() - t0:.0f} s", flush=True)
    print(f"\n{command_line()}")
    print(f"{versions('dask', 'distributed', 'dask-ddp')}, {args.processes} lane processes, "
          f"a report every {args.period} s per rank, {args.window:.0f} s window, "
          f"ddp.event-flush-interval {dask_ddp.config.get('ddp.event-flush-interval')}, "
          f"cluster environment {resolver or 'as is'}")  # fmt: skip
    print_table(results)


if __name__ == "__main__":
    main()

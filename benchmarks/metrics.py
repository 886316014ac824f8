"""The rank -> client channel: report() cost, delivery, delay, training slowdown, payloads.

One run measures, on a cluster whose scheduler runs in its own process (so that its memory
can be watched) with two single-threaded workers, 2 ranks, gloo, CPU:

- the cost of one ``dask_ddp.report()`` call on the rank, back to back and once per ms,
  against one ``Worker.log_event`` per record (the naive channel);
- records per second delivered without loss for a burst from 2 ranks (every record
  checked, in order), against one ``log_event`` per record received with
  ``Client.subscribe_topic``;
- the median delay from ``report()`` on a rank to the record on the client (``on_report``),
  to a live view showing it (the HTML view redrawn, as in a notebook) and to the job's
  ``/ddp/`` page showing it (its script's long poll, read as the browser reads it), for
  records reported every 5 ms (a rank reporting every step) and every 50 ms;
- the slowdown of a DDP training loop with a ~5 ms step that reports its loss every step,
  against the same loop without reporting: one job runs pairs of adjacent 100-step blocks,
  the first plain, the second reporting, and the median of the pair ratios is taken; an
  A/A control job (both blocks plain) alternates with it and shows the noise floor;
- the scheduler's memory growth (RSS of its process, sampled every 5 ms) while a 200 MB
  ``submit_result()`` payload is delivered, and the delivery rate, against the same
  payload sent through the scheduler (``ddp.max-event-bytes`` raised above its size).

Variants are measured alternately (A, B, A, B, ...) after warm-up runs; every value and the
medians are printed::

    python benchmarks/metrics.py --runs 5
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import dask
import distributed
import psutil
import torch
from _common import start_cluster
from distributed import Client

import dask_ddp
from dask_ddp._shared import view
from dask_ddp.results import DaskResultsHandler

WORLD = 2


# -- on the ranks ---------------------------------------------------------------------
def rank_report_cost(n: int) -> dict[str, float]:
    """Microseconds per call: report() and log_event, back to back and once per ms."""
    from distributed import get_worker

    worker = get_worker()
    topic = f"bench-naive-{dask_ddp.get_context().job_id}"
    out = {}
    for name, call in (
        ("report", lambda i: dask_ddp.report({"loss": 0.5, "acc": 0.9}, step=i)),
        ("log_event", lambda i: worker.log_event(topic, {"step": i, "loss": 0.5, "acc": 0.9})),
    ):
        start = time.perf_counter()
        for i in range(n):
            call(i)
        out[f"{name} back to back"] = (time.perf_counter() - start) / n * 1e6
        spaced = []
        for i in range(min(n, 1000)):
            t = time.perf_counter()
            call(i)
            spaced.append(time.perf_counter() - t)
            while time.perf_counter() - t < 0.001:  # one call per ms, without sleeping
                pass
        out[f"{name} 1/ms"] = statistics.median(spaced) * 1e6
    return out


def rank_burst(n: int) -> float:
    """Report ``n`` records as fast as possible; return when the first was reported."""
    first = time.time()
    for i in range(n):
        dask_ddp.report({"loss": 1.0 / (i + 1)}, step=i)
    return first


def rank_naive_burst(n: int, topic: str) -> float:
    from distributed import get_worker

    worker = get_worker()
    rank = dask_ddp.get_context().rank
    first = time.time()
    for i in range(n):
        worker.log_event(topic, {"rank": rank, "step": i, "loss": 1.0 / (i + 1)})
    return first


def rank_paced(n: int, period: float) -> int:
    """Report every ``period`` seconds (spinning, so the period is exact)."""
    next_at = time.perf_counter()
    for i in range(n):
        next_at += period
        dask_ddp.report({"loss": 1.0 / (i + 1)}, step=i)
        while time.perf_counter() < next_at:
            pass
    return n


def _mlp(width: int) -> torch.nn.Module:
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def rank_train(
    width: int, blocks: int, block_steps: int, warmup: int, report: bool
) -> dict[str, list[float]]:
    """Seconds per block of ``block_steps`` DDP steps, in pairs of adjacent blocks: the
    first plain, the second reporting the loss every step (or, with ``report=False``, plain
    too: the A/A control that shows the noise). One process runs both, so the machine's
    load drifts alike for the two blocks of a pair."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp(width))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, width), torch.randint(0, 10, (64,))
    loss_fn = torch.nn.CrossEntropyLoss()
    times: dict[str, list[float]] = {"a": [], "b": [], "a_cpu": [], "b_cpu": []}
    step = 0
    for block in range(-1, 2 * blocks):
        reporting = report and block % 2 == 1
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(warmup if block < 0 else block_steps):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            if reporting:
                dask_ddp.report({"loss": loss.detach()}, step=step)
            step += 1
        if block >= 0:
            times["b" if block % 2 else "a"].append(time.perf_counter() - start)
            # CPU of the whole rank process (training, flusher and the worker's event loop
            # threads): unlike wall time, hardly moved by other programs on the machine.
            times["b_cpu" if block % 2 else "a_cpu"].append(time.process_time() - cpu)
    return times


def rank_payload(rh: DaskResultsHandler, nbytes: int) -> float:
    """Rank 0 submits ``nbytes`` of random data; returns when it called submit_result()."""
    if dask_ddp.get_context().rank != 0:
        return 0.0
    data = os.urandom(nbytes)
    submitted = time.time()
    rh.submit_result("checkpoint.bin", data)
    return submitted


def _blobs_held() -> int:
    from dask_ddp._rank import channel as events

    return events.blobs_held()


# -- on the client --------------------------------------------------------------------
def _median(values: list[float]) -> float:
    return statistics.median(values)


def measure_burst(client: Client, n: int) -> float:
    job = dask_ddp.launch(client, rank_burst, args=(n,))
    firsts = job.result(timeout=600)
    done = time.time()
    records = job.metrics
    for rank in range(WORLD):
        steps = [r.step for r in records if r.rank == rank]
        if steps != list(range(n)):
            raise RuntimeError(f"rank {rank}: {len(steps)} of {n} records, or out of order")
    return WORLD * n / (done - min(firsts))


def measure_naive_burst(client: Client, n: int) -> float:
    topic = f"bench-naive-{time.time_ns()}"
    seen = [0]
    complete = threading.Event()

    def handler(event: Any) -> None:
        seen[0] += 1
        if seen[0] == WORLD * n:
            complete.set()

    client.subscribe_topic(topic, handler)
    try:
        job = dask_ddp.launch(client, rank_naive_burst, args=(n, topic))
        firsts = job.result(timeout=600)
        if not complete.wait(timeout=120):
            raise RuntimeError(f"naive channel: {seen[0]} of {WORLD * n} records arrived")
        return WORLD * n / (time.time() - min(firsts))
    finally:
        client.unsubscribe_topic(topic)


class _ShownSteps:
    """When each step of each rank was first shown: by a live view, or by the page."""

    def __init__(self) -> None:
        self.shown: list[tuple[float, dict[int, int]]] = []  # (time.time(), rank -> step)

    def saw(self, steps: dict[int, int]) -> None:
        self.shown.append((time.time(), steps))

    def delays(self, records: list[dask_ddp.MetricRecord]) -> list[float]:
        """For each record, from its report() to the first showing of its step or a later one."""
        out = []
        for rec in records:
            for when, steps in self.shown:
                if steps.get(rec.rank, -1) >= rec.step:
                    out.append(when - rec.time)
                    break
        return out


class _ViewRecorder(_ShownSteps):
    """A live view as the notebook has (it draws the HTML view each time), that notes what
    it showed when."""

    def update(self, snap: dict[str, Any]) -> None:
        view.render_html(snap)
        self.saw({r["rank"]: r["step"] for r in snap["ranks"] if r["step"] is not None})


# a rank's row of the page (dask_ddp._shared.view.render_html): its number, then its step
_PAGE_ROW = re.compile(
    r"<tr><td>(\d+)</td>(?:<td>[^<]*</td>){2}<td><progress[^>]*></progress></td><td>step (\d+)"
)


class _PageReader(_ShownSteps):
    """The job's page in a browser: its script's long poll of ``/ddp/jobs/<id>/view`` (or,
    on a dask_ddp before it, its request every second)."""

    def __init__(self, client: Client, job_id: str) -> None:
        super().__init__()
        base = client.dashboard_link.rsplit("/status", 1)[0]
        self._url = f"{base}/ddp/jobs/{job_id}/view"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen = ""
        while True:
            with urllib.request.urlopen(self._url + seen, timeout=30) as r:
                count = r.headers["X-DDP-Seen"]
                part = r.read().decode()
            self.saw({int(rank): int(step) for rank, step in _PAGE_ROW.findall(part)})
            if "data-final" in part:
                return
            if count is None:  # a page before the long poll (issue 44): it asked every second
                time.sleep(1.0)
            else:
                seen = f"?seen={count}"

    def join(self) -> None:
        self._thread.join(60)


def measure_delay(client: Client, n: int, period: float) -> dict[str, tuple[float, float]]:
    """Median and p95 delay from report() to the client's on_report, to a live view
    redrawn, and to the job's page redrawn."""
    records: list[dask_ddp.MetricRecord] = []
    arrived: list[float] = []

    def on_report(rec: dask_ddp.MetricRecord) -> None:
        arrived.append(time.time() - rec.time)
        records.append(rec)

    drawn = _ViewRecorder()
    job = dask_ddp.launch(client, rank_paced, args=(n, period), on_report=on_report)
    job._model.views.append(drawn)  # as Job._ipython_display_ adds its view
    page = _PageReader(client, job.job_id)
    job.result(timeout=600)
    page.join()
    out = {}
    for name, delays in (
        ("client", arrived),
        ("view", drawn.delays(records)),
        ("page", page.delays(records)),
    ):
        delays.sort()
        out[name] = (_median(delays), delays[int(0.95 * (len(delays) - 1))])
    return out


def calibrate_width(client: Client, target: float) -> tuple[int, float]:
    """The MLP width whose DDP step takes about ``target`` seconds here."""
    width, step = 256, 0.0
    for _ in range(8):
        out = dask_ddp.launch(client, rank_train, args=(width, 1, 40, 5, False)).result()
        step = max(r["a"][0] for r in out) / 40
        if abs(step - target) < 0.15 * target:
            break
        width = max(16, int(width * (target / step) ** 0.5))
    return width, step


class _RssPeak:
    """Samples a process's RSS every 5 ms in a thread; the peak since start()."""

    def __init__(self, pid: int) -> None:
        self._proc = psutil.Process(pid)
        self._stop = threading.Event()
        self.baseline = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> _RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        self.after = self._proc.memory_info().rss


def measure_payload(
    client: Client, scheduler_pid: int, nbytes: int, through_scheduler: bool
) -> tuple[float, float, float]:
    """(scheduler RSS growth at peak in MB, growth after delivery in MB, delivery MB/s)."""
    rh = DaskResultsHandler(f"bench-{time.time_ns()}")
    limit = f"{2 * nbytes}B" if through_scheduler else dask.config.get("ddp.max-event-bytes")
    with _RssPeak(scheduler_pid) as rss:
        with dask.config.set({"ddp.max-event-bytes": limit}):
            job = dask_ddp.launch(client, rank_payload, args=(rh, nbytes))
        arrived = None
        for _, _, data in job.iter_results(rh.pub_sub_key):
            arrived = time.time()
            if len(data) != nbytes:
                raise RuntimeError(f"payload of {len(data)} bytes, expected {nbytes}")
            del data
        submitted = job.result(timeout=600)[0]
        job.wait_stopped(timeout=60)  # the scheduler has dropped the job's events by then
    if arrived is None:
        raise RuntimeError("the payload never arrived")
    if not through_scheduler and any(client.run(_blobs_held).values()):
        raise RuntimeError("a worker still holds the payload after delivery")
    mb = 1e6
    return (
        (rss.peak - rss.baseline) / mb,
        (rss.after - rss.baseline) / mb,
        nbytes / mb / (arrived - submitted),
    )


def _alternate(
    runs: int, warmup: int, variants: dict[str, Callable[[], Any]]
) -> dict[str, list[Any]]:
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    out: dict[str, list[Any]] = {name: [] for name in variants}
    for _ in range(runs):
        for name, fn in variants.items():
            out[name].append(fn())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup-runs", type=int, default=1)
    parser.add_argument("--calls", type=int, default=100_000, help="report() calls timed")
    parser.add_argument("--burst", type=int, default=100_000, help="records per rank")
    parser.add_argument("--paced", type=int, default=600, help="records per rank, every 5 ms")
    parser.add_argument("--steps", type=int, default=2500, help="timed steps per variant")
    parser.add_argument("--payload-mb", type=int, default=200)
    parser.add_argument(
        "--parts",
        default="cost,rate,delay,train,payload",
        help="what to measure, comma-separated (default: all)",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        sched_file, procs = start_cluster(tmp, WORLD)
        scheduler_pid = procs[-1].pid
        try:
            with Client(scheduler_file=sched_file) as client:
                client.wait_for_workers(WORLD, timeout="120s")
                report(client, scheduler_pid, args)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=60)


Row = tuple[str, str, str, str]


def part_cost(client: Client, args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    cost = _alternate(
        args.runs,
        args.warmup_runs,
        {"cost": lambda: dask_ddp.launch(client, rank_report_cost, args=(args.calls,)).result()},
    )["cost"]
    per_rank = [r for run in cost for r in run]

    def cost_of(name: str) -> float:
        return _median([r[name] for r in per_rank])

    rows = [
        (
            "report() cost, back to back (µs/call)",
            f"{cost_of('report back to back'):.2f}",
            f"{cost_of('log_event back to back'):.2f} (log_event/record)",
            "<= 50",
        ),
        (
            "report() cost, 1 call per ms (µs/call)",
            f"{cost_of('report 1/ms'):.2f}",
            f"{cost_of('log_event 1/ms'):.2f} (log_event/record)",
            "<= 50",
        ),
    ]
    names = ("report back to back", "report 1/ms", "log_event back to back", "log_event 1/ms")
    details = [
        f"  {name} (µs/call, per rank): {', '.join(f'{r[name]:.2f}' for r in per_rank)}"
        for name in names
    ]
    return rows, details


def part_rate(client: Client, args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    rates = _alternate(
        args.runs,
        args.warmup_runs,
        {
            "ours": lambda: measure_burst(client, args.burst),
            "naive": lambda: measure_naive_burst(client, args.burst),
        },
    )
    row = (
        f"records/s delivered, no loss ({WORLD}x{args.burst})",
        f"{_median(rates['ours']):,.0f}",
        f"{_median(rates['naive']):,.0f} (log_event/record)",
        ">= 20,000",
    )
    details = [
        f"  records/s {name}: {', '.join(f'{v:,.0f}' for v in values)}"
        for name, values in rates.items()
    ]
    return [row], details


def part_delay(client: Client, args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    both = _alternate(
        args.runs,
        args.warmup_runs,
        {
            "every 5 ms": lambda: measure_delay(client, args.paced, 0.005),
            # a loss curve a user watches, a sweep that prunes on it: 20 records a second
            "every 50 ms": lambda: measure_delay(client, args.paced // 3, 0.05),
        },
    )
    rows, details = [], []
    for name, runs in both.items():
        for where in ("client", "view", "page"):
            delays = [run[where] for run in runs]
            rows.append(
                (
                    f"median delay report() -> {where}, {name} (s)",
                    f"{_median([d[0] for d in delays]):.3f}",
                    f"p95 {_median([d[1] for d in delays]):.3f}",
                    "<= 0.05",
                )
            )
            details.append(
                f"  delay median/p95 to the {where}, {name} (s): "
                + ", ".join(f"{a:.3f}/{b:.3f}" for a, b in delays)
            )
    return rows, details


def part_train(client: Client, args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    width, step = calibrate_width(client, 0.005)

    block_steps = 100  # ~0.5 s: longer than ddp.event-flush-interval

    def pair_ratios(report: bool) -> tuple[list[float], list[float]]:
        """b/a for each pair of adjacent blocks: wall time of the slower rank (DDP waits
        for it), and CPU time of the rank processes (summed)."""
        job = dask_ddp.launch(
            client, rank_train, args=(width, args.steps // block_steps, block_steps, 20, report)
        )
        ranks = job.result(timeout=600)

        def per_pair(key: str, combine: Callable[..., float]) -> list[float]:
            return [combine(t) for t in zip(*(r[key] for r in ranks), strict=True)]

        wall = zip(per_pair("a", max), per_pair("b", max), strict=True)
        cpu = zip(per_pair("a_cpu", sum), per_pair("b_cpu", sum), strict=True)
        return [b / a for a, b in wall], [b / a for a, b in cpu]

    training = _alternate(
        args.runs,
        args.warmup_runs,
        {"report": lambda: pair_ratios(True), "control": lambda: pair_ratios(False)},
    )

    def pooled(name: str, which: int) -> float:
        return _median([r for run in training[name] for r in run[which]]) - 1

    rows = [
        (
            f"training slowdown, {step * 1e3:.1f} ms DDP step (wall)",
            f"{pooled('report', 0) * 100:+.2f}%",
            f"{pooled('control', 0) * 100:+.2f}% (A/A control, no report)",
            "<= 2%",
        ),
        (
            "  same, CPU time of the rank processes",
            f"{pooled('report', 1) * 100:+.2f}%",
            f"{pooled('control', 1) * 100:+.2f}% (A/A control, no report)",
            "",
        ),
    ]
    details = [
        f"  training: MLP width {width}, {step * 1e3:.2f} ms/step calibrated; per run, pairs "
        f"of adjacent {block_steps}-step blocks ({2 * args.steps} steps), ratio second/first"
    ]
    for name, runs in training.items():
        for which, label in ((0, "wall"), (1, "rank CPU")):
            medians = ", ".join(f"{_median(run[which]):.4f}" for run in runs)
            details.append(
                f"  training {name}, {label}: median pair ratio per run: {medians}; "
                f"{len(runs[0][0])} pairs/run"
            )
    return rows, details


def part_payload(
    client: Client, args: argparse.Namespace, scheduler_pid: int
) -> tuple[list[Row], list[str]]:
    nbytes = args.payload_mb * 1_000_000
    payload = _alternate(
        args.runs,
        args.warmup_runs,
        {
            "ours": lambda: measure_payload(client, scheduler_pid, nbytes, False),
            "scheduler": lambda: measure_payload(client, scheduler_pid, nbytes, True),
        },
    )
    rows = [
        (
            f"scheduler RSS growth, {args.payload_mb} MB payload (MB)",
            f"{_median([p[0] for p in payload['ours']]):+.1f}",
            f"{_median([p[0] for p in payload['scheduler']]):+.1f} (through scheduler)",
            "< 20",
        ),
        (
            f"{args.payload_mb} MB payload delivery rate (MB/s)",
            f"{_median([p[2] for p in payload['ours']]):.0f}",
            f"{_median([p[2] for p in payload['scheduler']]):.0f} (through scheduler)",
            "",
        ),
    ]
    details = [
        f"  payload {name}: peak/after RSS growth (MB), MB/s: "
        + ", ".join(f"{a:+.1f}/{b:+.1f}, {c:.0f}" for a, b, c in values)
        for name, values in payload.items()
    ]
    return rows, details


def report(client: Client, scheduler_pid: int, args: argparse.Namespace) -> None:
    dask_ddp.launch(client, rank_burst, args=(10,)).result(timeout=300)  # workers import torch
    parts = {
        "cost": lambda: part_cost(client, args),
        "rate": lambda: part_rate(client, args),
        "delay": lambda: part_delay(client, args),
        "train": lambda: part_train(client, args),
        "payload": lambda: part_payload(client, args, scheduler_pid),
    }
    rows: list[Row] = []
    details: list[str] = []
    for name in args.parts.split(","):
        if name not in parts:
            raise SystemExit(f"--parts: unknown part {name!r}; choose from {', '.join(parts)}")
        more_rows, more_details = parts[name]()
        rows += more_rows
        details += more_details

    print(f"\n{' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, distributed "
        f"{distributed.__version__}, dask_ddp {dask_ddp.__version__}, {os.cpu_count()} CPUs, "
        f"{WORLD} ranks (gloo), {args.runs} runs after {args.warmup_runs} warm-up; "
        f"ddp.event-flush-interval={dask.config.get('ddp.event-flush-interval')}, "
        f"ddp.max-event-bytes={dask.config.get('ddp.max-event-bytes')}"
    )
    header = ("", "dask_ddp", "reference", "target")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    print("every value:")
    for line in details:
        print(line)


if __name__ == "__main__":
    main()

"""Recovery after a lost worker, and checkpoint throughput against plain torch.save.

1. Recovery: a 2-rank job on a LocalCluster checkpoints every few steps; rank 1 kills
   (SIGKILL) its own process, then, in a second set of runs, its worker's process,
   mid-training on the first attempt. With ``max_restarts=1`` the job is placed again and
   resumes from the last checkpoint. The time from the kill to the first training step of
   the next attempt is printed. (Before each rank had a process of its own, both were one
   kill: the rank ran in its worker's process. A lost worker's replacement starts the
   template its ranks fork from, torch's import, on the restart's path.)
   Elastic: the same kill in a ``workers=3, min_workers=2`` job on 3 workers, which goes on
   with 2 ranks at once; when the nanny's replacement joins, the job grows back to 3 at its
   next checkpoint. Printed: kill -> first step at 2 ranks, and worker joined -> first
   step at 3 ranks, beside the plain restart at the same size.
2. Checkpoints: a state of ``--mb`` MB is written and read back with dask_ddp's checkpoint
   module and with plain ``torch.save``/``torch.load`` to the same place, alternately,
   on local disk and on a real S3 server (moto, started here on loopback)::

    pip install -e ".[test]" -c constraints.txt
    python benchmarks/recovery.py --runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import distributed
import torch


def train(
    ckpt_every: int, steps: int, marker_dir: str, step_seconds: float = 0.0, kill: str = "worker"
) -> dict:
    """A resumable training loop: the benchmarked job."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dask_ddp

    ctx = dask_ddp.get_context()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    resumed = dask_ddp.get_checkpoint()
    if resumed is not None:
        model.module.load_state_dict(resumed["model"])
        opt.load_state_dict(resumed["opt"])
        start = resumed["step"] + 1
    first_step_at = None
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step * 100 + ctx.rank)
        opt.zero_grad()
        model(torch.randn(32, 64, generator=g)).pow(2).mean().backward()
        opt.step()
        if first_step_at is None:
            first_step_at = time.time()
            dask_ddp.report({"step_seconds": step_seconds}, step=step)  # Job.history's first step
        if step % ckpt_every == 0:
            dask_ddp.save_checkpoint(
                {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                step=step,
            )
        if ctx.attempt == 0 and ctx.rank == 1 and step == steps // 2:
            with open(os.path.join(marker_dir, "killed_at"), "w") as f:
                f.write(repr(time.time()))
            if kill == "worker":  # the rank's worker (get_worker().pid in a rank), and the rank
                os.kill(distributed.get_worker().pid, signal.SIGKILL)
            else:  # the rank's own process (before issue 42 that was its worker's)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        time.sleep(step_seconds)
    return {"attempt": ctx.attempt, "first_step_at": first_step_at, "start": start}


@contextlib.contextmanager
def _warm_cluster(n_workers: int) -> Iterator[tuple[str, Any]]:
    """A temporary directory and the client of a LocalCluster whose workers imported torch."""
    from distributed import Client, LocalCluster

    import dask_ddp

    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalCluster(
            n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        dask_ddp.launch(client, time.time).result()  # warm: workers import torch
        yield tmp, client


def bench_recovery(steps: int, kill: str) -> tuple[float, int]:
    import dask_ddp

    with _warm_cluster(2) as (tmp, client):
        job = dask_ddp.launch(
            client, train, args=(5, steps, tmp, 0.0, kill), max_restarts=1,
            checkpoint_dir=os.path.join(tmp, "ckpt"),
        )  # fmt: skip
        out = job.result(timeout=300)
        with open(os.path.join(tmp, "killed_at")) as f:
            killed_at = float(f.read())
        resumed_at = min(o["first_step_at"] for o in out)
        return resumed_at - killed_at, out[0]["start"]


def bench_elastic(steps: int) -> tuple[float, float, list[int]]:
    """An elastic job (workers=3, min_workers=2) on 3 workers: rank 1 kills its worker, the
    job goes on with 2 from its checkpoint at once; the nanny's replacement joins and the
    job grows back to 3 at its next checkpoint. Returns (kill -> first step at 2 ranks,
    worker joined -> first step at 3 ranks, the sizes it ran at)."""
    import dask_ddp

    joined: list[float] = []
    with _warm_cluster(3) as (tmp, client):
        client.subscribe_topic(  # when the replacement joins, by the scheduler's clock
            "all",
            lambda ev: joined.append(ev[0]) if ev[1].get("action") == "add-worker" else None,
        )
        job = dask_ddp.launch(
            client, train, args=(5, steps, tmp, 0.02), workers=3, min_workers=2,
            checkpoint_dir=os.path.join(tmp, "ckpt"),
        )  # fmt: skip
        job.result(timeout=300)
        with open(os.path.join(tmp, "killed_at")) as f:
            killed_at = float(f.read())
        placements = [t for t in job.history if t.state is dask_ddp.JobState.RUNNING]
        sizes = [t.world_size for t in placements]
        if sizes != [3, 2, 3] or not joined:
            raise RuntimeError(f"the job ran at {sizes}, not [3, 2, 3]: raise --elastic-steps")
        return placements[1].first_step - killed_at, placements[2].first_step - joined[-1], sizes


def _state(mb: int) -> dict:
    n = mb * 1024 * 1024 // 4 // 8
    return {f"layer{i}": torch.randn(n) for i in range(8)}


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_checkpoints(mb: int, runs: int, where: str, storage_options: dict) -> dict:
    import fsspec

    from dask_ddp._rank import checkpoint

    state = _state(mb)
    times: dict[str, list[float]] = {
        k: [] for k in ("ours write", "torch.save", "ours read", "torch.load")
    }
    for i in range(runs + 1):  # first round is warm-up
        ours_dir = f"{where}/ours-{uuid.uuid4().hex[:8]}"
        plain = f"{where}/plain-{uuid.uuid4().hex[:8]}.pt"

        def plain_save(plain: str = plain) -> None:
            with fsspec.open(plain, "wb", **storage_options) as f:
                torch.save(state, f)

        def plain_load(plain: str = plain) -> None:
            with fsspec.open(plain, "rb", **storage_options) as f:
                torch.load(f, weights_only=True)

        w_ours = _time(
            lambda d=ours_dir: checkpoint.write(state, d, step=1, storage_options=storage_options)
        )
        w_plain = _time(plain_save)
        r_ours = _time(lambda d=ours_dir: checkpoint.latest(d, storage_options=storage_options))
        r_plain = _time(plain_load)
        if i:
            for key, value in zip(times, (w_ours, w_plain, r_ours, r_plain), strict=True):
                times[key].append(value)
    return {k: mb / statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mb", type=int, default=100, help="checkpoint size in MB")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--elastic-steps", type=int, default=600, help="steps of the elastic job (20 ms each)"
    )
    args = parser.parse_args()

    import dask
    import distributed
    from moto.server import ThreadedMotoServer

    import dask_ddp

    print(f"{os.path.basename(sys.executable)} {' '.join(sys.argv)}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, dask {dask.__version__}, "
        f"distributed {distributed.__version__}, dask_ddp {dask_ddp.__version__}, "
        f"{os.cpu_count()} cores"
    )
    medians = {}
    for kill in ("process", "worker"):
        recoveries = []
        for _ in range(args.runs):
            seconds, resumed_from = bench_recovery(args.steps, kill)
            recoveries.append(seconds)
            print(
                f"recovery, rank's {kill} killed: kill -> first step of attempt 1: "
                f"{seconds:.2f} s (resumed at step {resumed_from})"
            )
        medians[kill] = statistics.median(recoveries)
        print(
            f"recovery median, rank's {kill} killed: {medians[kill]:.2f} s over {args.runs} "
            "runs (target < 10 s)"
        )
    shrinks, grows = [], []
    for _ in range(args.runs):
        shrink, grow, sizes = bench_elastic(args.elastic_steps)
        shrinks.append(shrink)
        grows.append(grow)
        print(
            f"elastic (ranks {sizes}): kill -> first step at 2 ranks {shrink:.2f} s; "
            f"worker joined -> first step at 3 ranks {grow:.2f} s"
        )
    plain = medians["worker"]
    print(
        f"elastic median over {args.runs} runs: shrink {statistics.median(shrinks):.2f} s, "
        f"grow {statistics.median(grows):.2f} s (target < 10 s each); plain restart at the "
        f"same size {plain:.2f} s: shrink/plain {statistics.median(shrinks) / plain:.2f}x"
    )

    for name, value in {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        with tempfile.TemporaryDirectory() as tmp:
            places = {
                "local disk": (tmp, {}),
                "S3 (moto, loopback)": (
                    "s3://bench",
                    {"client_kwargs": {"endpoint_url": endpoint}},
                ),
            }
            print(f"\ncheckpoint throughput, {args.mb} MB state, MB/s (median of {args.runs}):")
            for label, (where, opts) in places.items():
                r = bench_checkpoints(args.mb, args.runs, where, opts)
                print(
                    f"  {label:<20} write: ours {r['ours write']:.0f} vs torch.save "
                    f"{r['torch.save']:.0f} ({r['ours write'] / r['torch.save']:.2f}x); "
                    f"read: ours {r['ours read']:.0f} vs "
                    f"torch.load {r['torch.load']:.0f} ({r['ours read'] / r['torch.load']:.2f}x)"
                )
    finally:
        server.stop()


if __name__ == "__main__":
    main()

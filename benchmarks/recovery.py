"""Recovery after a lost worker, and checkpoint throughput against plain torch.save.

1. Recovery: a 2-rank job on a LocalCluster checkpoints every few steps; rank 1 kills its
   own worker process (SIGKILL) mid-training on the first attempt. With
   ``max_restarts=1`` the job is placed again and resumes from the last checkpoint. The
   time from the kill to the first training step of the next attempt is printed.
2. Checkpoints: a state of ``--mb`` MB is written and read back with dask_ddp's checkpoint
   module and with plain ``torch.save``/``torch.load`` to the same place, alternately,
   on local disk and on a real S3 server (moto, started here on loopback)::

    pip install -e ".[test]" -c constraints.txt
    python benchmarks/recovery.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import uuid

import torch


def train(ckpt_every: int, steps: int, marker_dir: str) -> dict:
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
        if step % ckpt_every == 0:
            dask_ddp.save_checkpoint(
                {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                step=step,
            )
        if ctx.attempt == 0 and ctx.rank == 1 and step == steps // 2:
            with open(os.path.join(marker_dir, "killed_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    return {"attempt": ctx.attempt, "first_step_at": first_step_at, "start": start}


def bench_recovery(steps: int) -> tuple[float, int]:
    from distributed import Client, LocalCluster

    import dask_ddp

    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        dask_ddp.launch(client, time.time).result()  # warm: workers import torch
        job = dask_ddp.launch(
            client, train, args=(5, steps, tmp), max_restarts=1,
            checkpoint_dir=os.path.join(tmp, "ckpt"),
        )  # fmt: skip
        out = job.result(timeout=300)
        with open(os.path.join(tmp, "killed_at")) as f:
            killed_at = float(f.read())
        resumed_at = min(o["first_step_at"] for o in out)
        return resumed_at - killed_at, out[0]["start"]


def _state(mb: int) -> dict:
    n = mb * 1024 * 1024 // 4 // 8
    return {f"layer{i}": torch.randn(n) for i in range(8)}


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_checkpoints(mb: int, runs: int, where: str, storage_options: dict) -> dict:
    import fsspec

    from dask_ddp import checkpoint

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
    recoveries = []
    for _ in range(args.runs):
        seconds, resumed_from = bench_recovery(args.steps)
        recoveries.append(seconds)
        print(
            f"recovery: kill -> first step of attempt 1: {seconds:.2f} s "
            f"(resumed at step {resumed_from})"
        )
    print(
        f"recovery median: {statistics.median(recoveries):.2f} s over {args.runs} runs "
        "(target < 10 s)"
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

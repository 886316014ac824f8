"""Launch latency and training speed: dask_ddp against dask-pytorch-ddp and torchrun.

One run measures, with the same function and world size (2 ranks, gloo, CPU):

- launch: time from the call to every rank being inside the function, and end to end for
  a short job (call to gathered results), warm (on a cluster that has run a job before),
  for ``dask_ddp.launch``, dask-pytorch-ddp's ``run()`` and ``torchrun`` (which always starts
  cold: new processes that import torch);
- training: steady steps per second of the same small CNN (batch 32) under dask_ddp,
  dask-pytorch-ddp and torchrun, with the same threads per rank.

The launchers are measured alternately (A, B, C, A, B, C, ...) after warm-up runs, and the
medians and their ratios are printed::

    pip install -e ".[bench]" -c constraints.txt
    python benchmarks/launch.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time

import torch
from _common import command_line, ddp_steps_per_second, median, torchrun_command, versions

WORLD = 2


def rank_fn(steps: int, warmup: int) -> dict:
    """The benchmarked function: enter, train ``warmup + steps`` DDP steps, report."""
    entered = time.time()
    import torch.distributed as dist

    if not dist.is_initialized():  # torchrun child: initialise as a torchrun script would
        dist.init_process_group("gloo")
    return {
        "entered": entered,
        "steps_per_s": ddp_steps_per_second(steps, warmup),
        "threads": torch.get_num_threads(),
    }


def _child(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    out = rank_fn(args.steps, args.warmup)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def run_dask_ddp(client, steps: int, warmup: int) -> tuple[float, float, list[dict]]:
    import dask_ddp

    t0 = time.time()
    out = dask_ddp.launch(client, rank_fn, args=(steps, warmup)).result()
    return max(o["entered"] for o in out) - t0, time.time() - t0, out


def run_predecessor(client, steps: int, warmup: int) -> tuple[float, float, list[dict]]:
    from dask_pytorch_ddp import dispatch

    t0 = time.time()
    futures = dispatch.run(client, rank_fn, backend="gloo", steps=steps, warmup=warmup)
    out = client.gather(futures)
    return max(o["entered"] for o in out) - t0, time.time() - t0, out


def run_torchrun(steps: int, warmup: int, env: dict) -> tuple[float, float, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "out.json")
        t0 = time.time()
        proc = subprocess.run(
            torchrun_command(
                os.path.abspath(__file__), WORLD,
                ["--child", "--out", out_path, "--steps", str(steps), "--warmup", str(warmup)],
            ),
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        total = time.time() - t0
        if proc.returncode != 0:
            if not os.path.exists(out_path):
                raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
            # Seen here: a child aborts at exit ("terminate called without an active
            # exception") after rank 0 wrote the results; the timings are whole.
            print(f"note: torchrun exited with {proc.returncode} after writing its results")
        with open(out_path) as f:
            out = json.load(f)
    return max(o["entered"] for o in out) - t0, total, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup-runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200, help="timed training steps per run")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps before timing")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument(
        "--skip-predecessor", action="store_true",
        help="leave dask-pytorch-ddp out (its run() fails with torch 2.14: the process group "
        "it destroys is gone)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.child:
        _child(args)
        return

    from distributed import Client, LocalCluster

    import dask_ddp

    try:
        import dask_pytorch_ddp  # noqa: F401

        has_predecessor = not args.skip_predecessor
    except ImportError:
        has_predecessor = False
        print("dask-pytorch-ddp is not installed (pip install -e '.[bench]'): skipping it")

    launchers = {"dask_ddp": run_dask_ddp}
    if has_predecessor:
        launchers["dask-pytorch-ddp"] = run_predecessor
    names = [*launchers, "torchrun"]
    launch: dict[str, list[float]] = {n: [] for n in names}
    total: dict[str, list[float]] = {n: [] for n in names}
    speed: dict[str, list[float]] = {n: [] for n in names}
    threads: dict[str, int] = {}
    # Starting a LocalCluster sets MALLOC_TRIM_THRESHOLD_ (and *_NUM_THREADS) in this
    # process's environment for its workers; torchrun must not inherit it, or its ranks train
    # with the worker's malloc setting (half speed), which is not what a torchrun user gets.
    clean_env = dict(os.environ)

    with (
        LocalCluster(
            n_workers=WORLD, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        first_t0 = time.time()
        first = dask_ddp.launch(client, rank_fn, args=(0, 0)).result()
        cold = max(o["entered"] for o in first) - first_t0
        for i in range(args.warmup_runs + args.runs):
            for name in names:
                # short job: launch latency and end-to-end
                if name == "torchrun":
                    entered, elapsed, _ = run_torchrun(0, 0, clean_env)
                    _, _, trained = run_torchrun(args.steps, args.warmup, clean_env)
                else:
                    entered, elapsed, _ = launchers[name](client, 0, 0)
                    _, _, trained = launchers[name](client, args.steps, args.warmup)
                if i < args.warmup_runs:
                    continue
                launch[name].append(entered)
                total[name].append(elapsed)
                speed[name].append(median([o["steps_per_s"] for o in trained]))
                threads[name] = trained[0]["threads"]

    print(f"\n{command_line()}")
    print(
        f"{versions('dask', 'distributed', 'dask-ddp')}, "
        f"{WORLD} ranks (gloo, CPU), {args.runs} runs (medians)"
    )
    print(
        f"dask_ddp first job on a fresh cluster (workers import torch): {cold:.2f} s "
        "to all ranks in fn"
    )
    header = (
        f"{'launcher':<18}{'call->all in fn':>16}{'short job e2e':>15}{'steps/s':>10}{'threads':>9}"
    )
    print(header)
    for name in names:
        print(
            f"{name:<18}{median(launch[name]):>15.3f}s{median(total[name]):>14.3f}s"
            f"{median(speed[name]):>10.1f}{threads[name]:>9}"
        )
    ours = "dask_ddp"
    for name in names[1:]:
        print(
            f"ratio {name}/dask_ddp: launch {median(launch[name]) / median(launch[ours]):.2f}x, "
            f"short job {median(total[name]) / median(total[ours]):.2f}x; "
            f"dask_ddp steps/s / {name}: {median(speed[ours]) / median(speed[name]):.3f}"
        )
    print("every time (s), call -> all ranks in fn:")
    for name in names:
        print(f"  {name}: {', '.join(f'{t:.3f}' for t in launch[name])}")
    print("every steady steps/s:")
    for name in names:
        print(f"  {name}: {', '.join(f'{t:.1f}' for t in speed[name])}")


if __name__ == "__main__":
    main()

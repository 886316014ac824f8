"""dask_ddp side by side with the tools users would pick instead: Ray, torchrun, dask-pytorch-ddp.

One training function (:func:`train`: the benchmarks' small CNN, ``_common.small_cnn``, on
generated images, seed 0, ``DistributedSampler(seed=0)`` data order, SGD with momentum) is
run by ``dask_ddp.launch``, dask-pytorch-ddp's ``dispatch.run``, Ray Train's
``TorchTrainer`` and ``torchrun`` on this machine, in one run of this script. For each it
prints:

- time to first step: from the call on the driver until every rank has finished its first
  optimizer step, on running clusters (a Dask ``LocalCluster`` shared by the two Dask tools,
  a local Ray instance; torchrun has no cluster and starts new processes every time). The
  Dask tools also run ``--launches`` 1-step jobs per round, for more samples where they are
  cheap; "call -> in fn" is the part until every rank is inside the function;
- steady steps per second, timed after ``--warmup-steps`` untimed steps (median over ranks):
  over the whole timed window, and the median rate of its 20-step blocks (which leaves out
  the pauses other processes cause on a shared machine); the CPU time per step of a rank's
  whole process, and the threads each rank trained with;
- total wall time for ``--warmup-steps + --steps`` steps: call to results back;
- cost per metric report on the rank, dask_ddp ``report()`` against Ray's
  ``ray.train.report``: a loop of reports without training, timing each call. "Back to
  back" is the steady state of a loop that reports every step (the first two calls are not
  counted: they fill Ray's one-slot queue without waiting); "spaced" leaves a gap after
  each call long enough for the channel to be idle (5 ms for dask_ddp; 2.5 s for Ray, whose
  controller takes one report per 2 s poll), Ray's best case. Delivery: how many of the
  records the driver holds afterwards;
- peak memory of the driver process (Linux ``VmHWM``, read just before it exits), in a
  fresh process per tool that starts its own cluster and runs a ``--cold-steps`` job
  ("cold"; the same process gives the time from starting the driver to the first step).
  It includes what runs inside the driver: Dask's scheduler and client, Ray's core worker;
  for torchrun the driver runs torchrun's ``main()`` itself, so it is the ``torchrun``
  process (agent and store). Not the other processes (Dask workers and nannies; Ray's GCS,
  raylet and agents; the ranks). Each driver imports torch, as a training script does;
- whether the final parameters match dask_ddp's (``torch.allclose`` on every tensor of the
  ``state_dict``; the largest absolute difference is printed);
- a worker's death: the last rank SIGKILLs its own process at step ``--warmup-steps``, and
  the driver's usual wait (``Job.result()``, ``client.gather``, ``fit()``, torchrun's exit)
  is timed until it raises (at most ``--failure-timeout``), with what it raised, and then
  how long until the tool runs a job again (and what that took).

Scenarios. CPU (no GPU visible): 2 ranks, gloo. GPU (when ``torch.cuda.is_available()``,
or ``--device cuda``): 1 rank on ``cuda:0``, nccl, AMP (float16 autocast and
``GradScaler``); the GPU's name is printed. One run measures one scenario, and it says at
the start and in the summary which one, and why the other is skipped. Every tool trains
with the same torch threads per rank (``--threads``; by default cores // ranks, 1 on a
2-core machine): :func:`train` sets them, and the summary prints what each tool had set
and what it trained with.

Environment. Starting a Dask ``LocalCluster`` puts its nanny's pre-spawn variables
(``MALLOC_TRIM_THRESHOLD_=65536``, ``OMP_NUM_THREADS=1``, ...) into this process's own
environment, and processes started from it afterwards would inherit them (with
``MALLOC_TRIM_THRESHOLD_`` a CPU rank trains at about half speed). So the peers run as
their users would run them: Ray is started before the LocalCluster, and torchrun and the
cold drivers get this process's environment from before it. The summary prints the
variable as each training function saw it.

The tools run alternately (dask_ddp, dask-pytorch-ddp, Ray, torchrun, then the report
loops, round after round) after ``--warmup-runs`` rounds of 1-step jobs that are not
counted. Every value, the medians, and two ratios against dask_ddp are printed: the median
of per-round ratios (jobs that ran next to each other, so slow drifts in the machine's load
cancel; the targets use it) and the ratio of medians. Ray runs as
``ray.init(num_cpus=2, include_dashboard=False)`` with usage stats off and every address on
127.0.0.1; Dask's cluster listens on 127.0.0.1; gloo binds to ``lo``; nothing else is
contacted. Optional dependencies: ``pip install -e ".[bench]" -c constraints.txt``::

    python benchmarks/peers.py                 # about 6.5 minutes on 2 cores
    python benchmarks/peers.py --runs 1 --warmup-runs 0 --no-failure --cold-runs 0  # a look
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import distributed
import torch
from _common import command_line, median, small_cnn, torchrun_command, versions

logger = logging.getLogger("peers")
TOOLS = ("dask_ddp", "dask-pytorch-ddp", "ray", "torchrun")
REPORTERS = ("dask_ddp", "ray")
HOST = "127.0.0.1"
PREDECESSOR_PORT = 23456  # dask-pytorch-ddp 0.2.2's fixed rendezvous port
SAMPLES = 4096  # generated images; each rank sees half of them per epoch
BLOCK = 20  # steps per block for the median block rate
BATCH = 32  # per rank
RAY_GAP = 2.5  # s between spaced ray.train.report calls: Ray Train polls a worker every 2 s
DASK_GAP = 0.005  # s between spaced dask_ddp.report calls


# -- on the ranks --------------------------------------------------------------------------
def _dataset() -> torch.utils.data.TensorDataset:
    """Generated 1x28x28 images with learnable labels; the same on every rank and tool."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 1, 28, 28, generator=g)
    y = (x.flatten(1) @ torch.randn(28 * 28, 10, generator=g)).argmax(1)
    return torch.utils.data.TensorDataset(x, y)


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    """The benchmarked training function, unchanged under every tool.

    Trains ``cfg["warmup"] + cfg["steps"]`` DDP steps and writes, to ``cfg["out"]``, one
    ``rank<r>.json`` per rank (timestamps, steps/s, threads) and rank 0's final
    ``state.pt``. With ``cfg["kill_at"] >= 0`` the last rank SIGKILLs its own process at
    that step, after writing the time to ``killed.json``.
    """
    entered = time.time()
    # What the tool gave this process, before the function sets the common thread count:
    # every tool trains with cfg["threads"] torch threads per rank.
    threads_given = torch.get_num_threads()
    malloc_env = os.environ.get("MALLOC_TRIM_THRESHOLD_")
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    if not dist.is_initialized():  # torchrun child: as a torchrun script would
        dist.init_process_group(cfg["backend"])
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = cfg["cuda"]
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        from torch.backends import cudnn  # a local import: cudnn's module does not pickle

        torch.cuda.set_device(device)
        cudnn.deterministic, cudnn.benchmark = True, False
    data = _dataset()
    sampler = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True
    )
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, pin_memory=cuda)
    data_ready = time.time()
    model = small_cnn().to(device)
    ddp = DDP(model, device_ids=[0] if cuda else None)
    ddp_ready = time.time()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg["amp"])
    total = cfg["warmup"] + cfg["steps"]
    step = epoch = 0
    first = start = cpu = 0.0
    marks: list[float] = []  # perf_counter at the start of timing and after every BLOCK steps
    loss = torch.zeros(())
    while step < total:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step == cfg["kill_at"] and rank == world - 1:
                with open(os.path.join(cfg["out"], "killed.json"), "w") as f:
                    json.dump({"time": time.time(), "pid": os.getpid()}, f)
                # The rank's worker dies (get_worker() in a rank: a stand-in that knows its
                # pid), and the rank with it.
                os.kill(distributed.get_worker().pid, signal.SIGKILL)
                time.sleep(60)
            if step == cfg["warmup"]:
                if cuda:
                    torch.cuda.synchronize()
                start, cpu = time.perf_counter(), time.process_time()
                marks.append(start)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.float16, enabled=cfg["amp"]):
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            step += 1
            if step == 1:
                if cuda:
                    torch.cuda.synchronize()
                first = time.time()
            if step > cfg["warmup"] and (step - cfg["warmup"]) % BLOCK == 0:
                if cuda:
                    torch.cuda.synchronize()
                marks.append(time.perf_counter())
            if step == total:
                break
        epoch += 1
    if cuda:
        torch.cuda.synchronize()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    out = {
        "rank": rank,
        "entered": entered,
        "data_ready": data_ready,
        "ddp_ready": ddp_ready,
        "first_step": first,
        "steps_per_s": cfg["steps"] / elapsed if cfg["steps"] else float("nan"),
        # the steady rate without the pauses other processes cause on a shared machine
        "block_steps_per_s": median(BLOCK / (b - a) for a, b in itertools.pairwise(marks)),
        "cpu_per_step": cpu / cfg["steps"] if cfg["steps"] else float("nan"),  # whole process
        "threads": torch.get_num_threads(),
        "threads_given": threads_given,
        "malloc_env": malloc_env,
        "loss": loss.item(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
    }
    with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if rank == 0:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        torch.save(state, os.path.join(cfg["out"], "state.pt"))
    return out


def report_loop(cfg: dict[str, Any]) -> None:
    """Seconds per report call on this rank, back to back and spaced; no training."""
    import torch.distributed as dist

    if cfg["tool"] == "dask_ddp":
        import dask_ddp

        def call(i: int) -> None:
            dask_ddp.report({"loss": 0.5, "acc": 0.9}, step=i)

    else:
        import ray.train

        def call(i: int) -> None:
            ray.train.report({"loss": 0.5, "acc": 0.9, "step": i})

    back, spaced = [], []
    for i in range(cfg["back"]):
        t = time.perf_counter()
        call(i)
        back.append(time.perf_counter() - t)
    for i in range(cfg["spaced"]):
        time.sleep(cfg["gap"])
        t = time.perf_counter()
        call(cfg["back"] + i)
        spaced.append(time.perf_counter() - t)
    with open(os.path.join(cfg["out"], f"report{dist.get_rank()}.json"), "w") as f:
        json.dump({"back": back, "spaced": spaced}, f)


def _torchrun_child(cfg_path: str) -> None:
    import torch.distributed as dist

    with open(cfg_path) as f:
        cfg = json.load(f)
    train(cfg)
    dist.destroy_process_group()


# -- on the driver: one job per tool ----------------------------------------------------------
@dataclass
class Bench:
    """What the runners share: the clusters, the scenario, and a scratch directory."""

    tmp: str
    world: int
    backend: str
    cuda: bool
    threads: int = 0  # torch threads per rank for every tool; 0: leave what the tool set
    # The environment processes started for the peers get (torchrun, cold drivers): this
    # process's, taken before a LocalCluster starts in it. Dask's nanny puts its workers'
    # pre-spawn variables (MALLOC_TRIM_THRESHOLD_=65536, OMP/MKL/OPENBLAS_NUM_THREADS=1)
    # into the environment of the process that starts it, and a process started afterwards
    # would inherit them: torchrun's ranks then train at half speed, unlike a user's.
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    torchrun_in_process: bool = False  # a cold driver is the torchrun process itself
    client: Any = None  # distributed.Client of a LocalCluster with ``world`` workers
    ray_up: bool = False
    tools: list[str] = field(default_factory=list)

    def job_dir(self, tag: str) -> str:
        path = os.path.join(self.tmp, f"{tag}-{uuid.uuid4().hex[:8]}")
        os.makedirs(path)
        return path

    def train_cfg(self, steps: int, warmup: int, kill_at: int = -1) -> dict[str, Any]:
        return {
            "steps": steps, "warmup": warmup, "backend": self.backend, "cuda": self.cuda,
            "amp": self.cuda, "kill_at": kill_at, "threads": self.threads,
        }  # fmt: skip


def run_dask_ddp(b: Bench, fn: Callable, cfg: dict[str, Any]) -> Any:
    import dask_ddp

    return dask_ddp.launch(b.client, fn, args=(cfg,), backend=b.backend).result()


def run_predecessor(b: Bench, fn: Callable, cfg: dict[str, Any]) -> Any:
    from dask_pytorch_ddp import dispatch

    # keyword argument: 0.2.2 passes positional ones in the wrong place
    return b.client.gather(dispatch.run(b.client, fn, backend=b.backend, cfg=cfg))


def run_ray(b: Bench, fn: Callable, cfg: dict[str, Any]) -> Any:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        fn,
        train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=b.world, use_gpu=b.cuda),
        torch_config=TorchConfig(backend=b.backend),
        run_config=RunConfig(
            storage_path=os.path.join(b.tmp, "ray-results"), name=uuid.uuid4().hex[:12]
        ),
    )
    return trainer.fit()


def run_torchrun(b: Bench, fn: Callable, cfg: dict[str, Any], timeout: float | None = None):
    """``torchrun --standalone --nproc-per-node=<world> peers.py --child cfg.json``: in a new
    process, or in this one for a cold driver (``b.torchrun_in_process``), which then is the
    ``torchrun`` process a user starts (its agent and store)."""
    if fn is not train:
        raise ValueError("torchrun runs train() only")
    cfg_path = os.path.join(cfg["out"], "cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    command = torchrun_command(os.path.abspath(__file__), b.world, ["--child", cfg_path])
    if b.torchrun_in_process:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun_main

        try:
            torchrun_main(command[3:])  # the arguments after "python -m torch.distributed.run"
        except ChildFailedError as e:
            if cfg["kill_at"] >= 0 or not _all_written(cfg["out"], b.world):
                raise RuntimeError(f"torchrun failed: {_describe(e)}") from e
            print(f"note: a torchrun child failed after every rank wrote its results: {e}")
        return None
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=b.env
    )  # fmt: skip
    if proc.returncode != 0 and cfg["kill_at"] < 0 and _all_written(cfg["out"], b.world):
        # Seen here: a child aborts at exit ("terminate called without an active exception")
        # after writing its results; the timings are whole, so they are kept.
        print(f"note: torchrun exited with {proc.returncode} after every rank wrote its results")
    elif proc.returncode != 0:
        # torchrun's summary names the first rank to fail ("Root Cause"); show that part
        cause = proc.stderr.rpartition("Root Cause")[2]
        rank = re.search(r"rank\s*:\s*(\d+)", cause)
        code = re.search(r"exitcode\s*:\s*(-?\d+)[^\n]*?(\(SIG\w+\))?\n", cause)
        summary = (
            f"rank {rank.group(1)} exitcode {code.group(1)} {code.group(2) or ''}".strip()
            if rank and code
            else proc.stderr[-1500:]
        )
        raise RuntimeError(f"torchrun exited with {proc.returncode}; root cause: {summary}")
    return proc


def _all_written(out: str, world: int) -> bool:
    names = [f"rank{r}.json" for r in range(world)] + ["state.pt"]
    return all(os.path.exists(os.path.join(out, n)) for n in names)


def _wait_for_port(b: Bench, port: int, timeout: float = 120.0) -> None:
    """Wait while a process outside our cluster listens on ``port``: dask-pytorch-ddp always
    uses 23456, so one of its jobs elsewhere on this host would merge with ours. (Our own
    rank-0 worker keeps listening there after a job: torch reuses that store in-process.)"""
    ours = set(b.client.run(os.getpid).values())
    waited = time.time()
    while time.time() - waited < timeout and _listener(port) - ours:
        time.sleep(0.2)
    if time.time() - waited > 0.5:
        print(f"note: another process on this host listened on port {port}; waited "
              f"{time.time() - waited:.1f} s", flush=True)  # fmt: skip


def _listener(port: int) -> set[int]:
    """Pids listening on TCP ``port`` (Linux /proc; an empty set elsewhere)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # LISTEN
                    inodes.add(cols[9])
    pids = set()
    if not inodes:
        return pids
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    pids.add(int(pid))
                    break
    return pids


RUNNERS: dict[str, Callable[..., Any]] = {
    "dask_ddp": run_dask_ddp,
    "dask-pytorch-ddp": run_predecessor,
    "ray": run_ray,
    "torchrun": run_torchrun,
}


def _read_ranks(out: str, world: int, prefix: str = "rank") -> list[dict[str, Any]]:
    ranks = []
    for r in range(world):
        with open(os.path.join(out, f"{prefix}{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def train_once(b: Bench, tool: str, steps: int, warmup: int) -> dict[str, Any]:
    """One training job: time to first step, steps/s, total wall time, final parameters."""
    cfg = {**b.train_cfg(steps, warmup), "out": b.job_dir(tool)}
    if tool == "dask-pytorch-ddp":
        _wait_for_port(b, PREDECESSOR_PORT)  # before the clock starts
    t0 = time.time()
    RUNNERS[tool](b, train, cfg)
    done = time.time()
    ranks = _read_ranks(cfg["out"], b.world)
    return {
        "in_fn": max(r["entered"] for r in ranks) - t0,
        "called_at": t0,
        "first_step_at": max(r["first_step"] for r in ranks),
        "first_step": max(r["first_step"] for r in ranks) - t0,
        "steps_per_s": median(r["steps_per_s"] for r in ranks),
        "block_steps_per_s": median(r["block_steps_per_s"] for r in ranks),
        "cpu_per_step": median(r["cpu_per_step"] for r in ranks),
        "total": done - t0,
        "threads": ranks[0]["threads"],
        "threads_given": ranks[0]["threads_given"],
        "malloc_env": ranks[0]["malloc_env"],
        "device": ranks[0]["device"],
        "state": torch.load(os.path.join(cfg["out"], "state.pt"), weights_only=True),
    }


def report_once(b: Bench, tool: str, back: int, spaced: int) -> dict[str, Any]:
    """One report loop job; every rank's per-call times, and the records the driver got."""
    gap = DASK_GAP if tool == "dask_ddp" else RAY_GAP
    cfg = {"tool": tool, "back": back, "spaced": spaced, "gap": gap, "out": b.job_dir("report")}
    if tool == "dask_ddp":
        import dask_ddp

        job = dask_ddp.launch(b.client, report_loop, args=(cfg,), backend=b.backend)
        job.result()
        kept = f"{len(job.metrics)} of {b.world * (back + spaced)} records in Job.metrics"
    else:
        result = run_ray(b, report_loop, cfg)
        n = b.world * (back + spaced)
        kept = (
            f"Result.metrics is None: none of the {n} records is on the driver (Ray Train "
            "2.60 returns metrics only with a checkpoint; a UserCallback on its controller "
            "sees each)"
            if result.metrics is None
            else f"Result.metrics holds the last of {n} records only"
        )
    ranks = _read_ranks(cfg["out"], b.world, "report")
    return {
        # steady state only: Ray's first two calls fill its one-slot queue without waiting
        "back": [t for r in ranks for t in r["back"][2:]],
        "first two": [t for r in ranks for t in r["back"][:2]],
        "spaced": [t for r in ranks for t in r["spaced"]],
        "kept": kept,
    }


def params_match(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple:
    """(allclose on every tensor, largest absolute difference)."""
    same = state.keys() == ref.keys()
    diff = 0.0
    for k in ref:
        if k in state:
            same = same and torch.allclose(state[k].float(), ref[k].float())
            diff = max(diff, (state[k].float() - ref[k].float()).abs().max().item())
    return same, diff


# -- worker death -------------------------------------------------------------------------------
def failure_once(b: Bench, tool: str, steps: int, kill_at: int, timeout: float) -> dict:
    """The last rank kills its own process at step ``kill_at``; time the driver's usual wait
    (``Job.result()``, ``client.gather``, ``fit()``, torchrun's exit) until it raises, at most
    ``timeout`` s after the kill, then time until the tool runs a job again."""
    cfg = {**b.train_cfg(steps, 0, kill_at=kill_at), "out": b.job_dir(f"fail-{tool}")}
    killed = os.path.join(cfg["out"], "killed.json")
    futures: list = []

    def call() -> Any:
        if tool == "dask-pytorch-ddp":
            from dask_pytorch_ddp import dispatch

            _wait_for_port(b, PREDECESSOR_PORT)
            futures.extend(dispatch.run(b.client, train, backend=b.backend, cfg=cfg))
            return b.client.gather(futures)
        if tool == "dask_ddp":
            import dask_ddp

            job = dask_ddp.launch(b.client, train, args=(cfg,), backend=b.backend)
            futures.extend(job.futures)
            return job.result()
        if tool == "torchrun":
            return run_torchrun(b, train, cfg, timeout=timeout + 120)
        return RUNNERS[tool](b, train, cfg)

    outcome, raised_at = _timed(call, timeout, start_after=killed)
    if raised_at is None and futures:
        outcome += " (" + ", ".join(f"rank {i} {f.status}" for i, f in enumerate(futures)) + ")"
    kill_time = _read_json(killed, {}).get("time")
    detect = raised_at - kill_time if raised_at and kill_time else None
    return {
        "detect": detect,
        "outcome": outcome,
        "recover": _recover(b, tool, timeout, futures),
    }


def _timed(fn: Callable[[], Any], timeout: float, start_after: str = "") -> tuple:
    """Run ``fn`` in a thread for at most ``timeout`` s (counted from when the file
    ``start_after`` appears); return (what happened, when it raised or None)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            fn()
            box["outcome"] = "returned without error"
        except Exception as e:  # what the user sees is what we measure
            box["outcome"], box["at"] = _describe(e), time.time()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    if start_after:
        deadline = time.time() + 120
        while not os.path.exists(start_after) and thread.is_alive() and time.time() < deadline:
            time.sleep(0.01)
    thread.join(timeout)
    if thread.is_alive():
        return f"no error within {timeout:.0f} s", None
    return box["outcome"], box.get("at")


def _read_json(path: str, default: Any) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def _describe(exc: BaseException) -> str:
    """``Type: message`` on one line, without source paths; per rank for Ray's group errors."""
    failures = getattr(exc, "worker_failures", None)  # ray.train.WorkerGroupError
    if isinstance(failures, dict) and failures:
        ranks = "; ".join(f"rank {r}: {_describe(e)[:70]}" for r, e in sorted(failures.items()))
        return f"{type(exc).__name__} ({ranks})"
    text = re.sub(r"\[/[^\]]*\]\s*", "", " ".join(str(exc).split()))
    return f"{type(exc).__name__}: {text[:150]}"


def _recover(b: Bench, tool: str, timeout: float, stale: list) -> str:
    """Seconds until a one-step job of the same tool succeeds again: wait for the cluster's
    workers, run the job; when that fails, cancel the failed job's tasks, restart the Dask
    workers (``client.restart()``) and run it again, as a user would have to."""
    if tool == "torchrun":
        return "nothing to recover: every torchrun run starts new processes"
    start = time.time()
    if b.client is not None and tool in ("dask_ddp", "dask-pytorch-ddp"):
        try:
            b.client.wait_for_workers(b.world, timeout=timeout)
        except TimeoutError as e:  # WorkerStartTimeoutError; the job below says what it does
            logger.warning("%s: %s", tool, e)
    outcome, _ = _timed(lambda: train_once(b, tool, 1, 0), timeout)
    if outcome == "returned without error":
        return f"ran {time.time() - start:.1f} s later, no cleanup needed"
    if b.client is None or tool not in ("dask_ddp", "dask-pytorch-ddp"):
        return f"not recovered: {outcome}"

    def clean() -> None:
        b.client.cancel(stale)
        b.client.restart(timeout=timeout, wait_for_workers=True)

    cleaned, _ = _timed(clean, timeout + 30)
    if cleaned != "returned without error":
        return f"not recovered: {outcome}; client.restart(): {cleaned}"
    again, _ = _timed(lambda: train_once(b, tool, 1, 0), timeout)
    if again != "returned without error":
        return f"not recovered: {outcome}; after client.restart(): {again}"
    return (
        f"ran {time.time() - start:.1f} s later, only after cancelling the failed job's tasks "
        f"and client.restart(); run right away it failed: {outcome[:100]}"
    )


# -- cold drivers: a fresh process per tool ------------------------------------------------------
@contextlib.contextmanager
def _cluster(b: Bench, tool: str) -> Iterator[None]:
    """The tool's cluster on this machine, on 127.0.0.1 only; nothing for torchrun."""
    if tool in ("dask_ddp", "dask-pytorch-ddp"):
        from distributed import Client, LocalCluster

        with (
            LocalCluster(
                n_workers=b.world, threads_per_worker=1, processes=True, host=HOST,
                dashboard_address=f"{HOST}:0",
            ) as cluster,
            Client(cluster) as client,
        ):  # fmt: skip
            b.client = client
            try:
                yield
            finally:
                b.client = None
    elif tool == "ray":
        import ray

        ray.init(
            num_cpus=max(2, b.world), num_gpus=1 if b.cuda else 0, include_dashboard=False,
            _node_ip_address=HOST, log_to_driver=False, logging_level="WARNING",
        )  # fmt: skip
        try:
            yield
        finally:
            ray.shutdown()
    else:
        yield


def driver_main(tool: str, spec_path: str) -> None:
    """A cold driver: start ``tool``'s cluster in this fresh process, run one job, print
    one ``RESULT {json}`` line with the times and this process's peak RSS. A torchrun
    driver runs torchrun's ``main()`` in this process, as the ``torchrun`` command does."""
    with open(spec_path) as f:
        spec = json.load(f)
    b = Bench(
        tmp=spec["tmp"], world=spec["world"], backend=spec["backend"], cuda=spec["cuda"],
        threads=spec["threads"], torchrun_in_process=True,
    )  # fmt: skip
    t = time.time()
    with _cluster(b, tool):
        up = time.time() - t
        result = train_once(b, tool, spec["steps"], spec["warmup"])
    torch.save(result.pop("state"), os.path.join(spec["tmp"], f"cold-{tool}.pt"))
    result["cluster_up"] = up
    result["maxrss_mb"] = _peak_rss_mb()  # before this interpreter's exit (see below)
    print("RESULT " + json.dumps(result), flush=True)


def _peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB; 0 where unknown.

    Linux's ``VmHWM``: the high-water mark of this program's own memory (``ru_maxrss`` is
    not used: it survives ``fork`` and ``execve``, so a driver started from this large
    benchmark process would report the benchmark's size). Read before the interpreter
    exits: a process that imported torch grows by about 110 MiB while it shuts down, the
    same for every tool. Other systems have no ``/proc``: the column then reads 0.
    """
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def cold_once(b: Bench, tool: str, steps: int, warmup: int) -> dict[str, Any]:
    """Run a cold driver for ``tool``; add the time from starting it to the first step."""
    spec = {
        "tmp": b.tmp, "world": b.world, "backend": b.backend, "cuda": b.cuda,
        "threads": b.threads,
    }  # fmt: skip
    spec_path = os.path.join(b.tmp, f"cold-{tool}.json")
    with open(spec_path, "w") as f:
        json.dump({**spec, "steps": steps, "warmup": warmup}, f)
    started = time.time()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--driver", tool, spec_path],
        capture_output=True,
        text=True,
        timeout=300,
        env=b.env,  # as a user's shell would start it: without the nanny's variables
    )
    done = time.time()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"cold {tool} driver exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
    result = json.loads(lines[-1][len("RESULT ") :])
    result["start_to_first_step"] = result["first_step_at"] - started
    result["start_to_done"] = done - started  # including the cluster's shutdown
    result["state"] = torch.load(os.path.join(b.tmp, f"cold-{tool}.pt"), weights_only=True)
    return result


# -- the run -------------------------------------------------------------------------------------
@dataclass
class Results:
    """Everything measured, per tool: lists in run order."""

    tools: list[str]
    warm: dict[str, dict[str, list]] = field(default_factory=dict)
    launches: dict[str, dict[str, list]] = field(default_factory=dict)  # 1-step jobs
    cold: dict[str, dict[str, list]] = field(default_factory=dict)
    reports: dict[str, dict[str, list]] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    failures: dict[str, dict] = field(default_factory=dict)
    states: dict[str, dict[str, list]] = field(default_factory=dict)  # "warm"/"cold" -> ...
    started: dict[str, float] = field(default_factory=dict)
    load: float = field(default_factory=lambda: os.getloadavg()[0])  # other work on the host

    def add(self, into: dict[str, dict[str, list]], tool: str, result: dict) -> None:
        for k, v in result.items():
            if k != "state":
                into.setdefault(tool, {}).setdefault(k, []).append(v)


def _available(wanted: list[str]) -> list[str]:
    modules = {"dask_ddp": "dask_ddp", "dask-pytorch-ddp": "dask_pytorch_ddp", "ray": "ray.train"}
    tools = []
    for tool in wanted:
        if tool not in TOOLS:
            raise SystemExit(f"--tools: unknown tool {tool!r}; choose from {', '.join(TOOLS)}")
        try:
            if tool in modules:
                __import__(modules[tool])
        except ImportError as e:
            print(f"{tool} is not installed ({e}; pip install -e '.[bench]'): skipping it")
            continue
        tools.append(tool)
    if "dask_ddp" not in tools:
        raise SystemExit("dask_ddp is the reference: it must be among --tools")
    return tools


def _environment() -> None:
    """Loopback only, no usage stats, and ``_common`` sent with the functions that use it."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray turns an explicit 127.0.0.1 into the host's routable address on Linux unless it
    # is told that this is a single-machine instance; then every Ray process listens on
    # 127.0.0.1 (checked with psutil.net_connections).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    # train() uses _common (small_cnn, median). Pickled by value, it reaches Ray's workers
    # without this folder on their PYTHONPATH: a folder there shadows the standard library
    # for every process started with it (a benchmarks/collections.py did, at start-up).
    # Dask's workers import it anyway (they inherit sys.path); torchrun runs this file.
    import _common
    import cloudpickle

    cloudpickle.register_pickle_by_value(_common)
    with contextlib.suppress(ImportError):
        from ray import cloudpickle as ray_cloudpickle

        ray_cloudpickle.register_pickle_by_value(_common)


def _warm_phase(b: Bench, res: Results, args: argparse.Namespace, began: float) -> None:
    """Rounds of one job per tool, then the report loops; warm-up rounds run 1-step jobs
    (the workers import torch, the OS caches the files) and are not counted."""
    for i in range(args.warmup_runs + args.runs):
        counted = i >= args.warmup_runs
        for tool in res.tools:
            if not counted:
                train_once(b, tool, 1, 0)
                continue
            result = train_once(b, tool, args.steps, args.warmup_steps)
            res.states.setdefault("warm", {}).setdefault(tool, []).append(result["state"])
            res.add(res.warm, tool, result)
        quick = [t for t in res.tools if t in ("dask_ddp", "dask-pytorch-ddp")]
        for _ in range(args.launches if counted else 0):
            for tool in quick:  # more samples of the time to first step, where they are cheap
                result = train_once(b, tool, 1, 0)
                res.add(res.launches, tool, {k: result[k] for k in ("in_fn", "first_step")})
        for tool in res.reports:
            if tool == "ray" and not counted:
                continue  # every Ray job starts new processes: there is nothing to warm
            if tool == "dask_ddp":
                result = report_once(b, tool, args.report_calls, args.report_calls // 10)
            else:
                spaced = max(1, args.ray_report_calls // 2)
                result = report_once(b, tool, args.ray_report_calls, spaced)
            res.kept[tool] = result.pop("kept")
            if counted:
                for key, values in res.reports[tool].items():
                    values += result[key]
        print(
            f"round {i + 1}/{args.warmup_runs + args.runs} "
            f"({'counted' if counted else 'warm-up'}) done at {time.time() - began:.0f} s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--runs", type=int, default=4, help="counted rounds (medians)")
    add("--warmup-runs", type=int, default=1, help="rounds of 1-step jobs, not counted")
    add("--steps", type=int, default=200, help="timed steps per job")
    add("--warmup-steps", type=int, default=10, help="untimed steps before them")
    add("--launches", type=int, default=8,
        help="extra 1-step jobs per round for the Dask tools (time to first step)")  # fmt: skip
    add("--report-calls", type=int, default=2000, help="dask_ddp report() calls per loop")
    add("--ray-report-calls", type=int, default=4,
        help="ray.train.report calls per loop, back to back (2 counted) and spaced")  # fmt: skip
    add("--cold-runs", type=int, default=1, help="fresh drivers per tool (0: none)")
    add("--cold-steps", type=int, default=10, help="steps of a cold driver's job")
    add("--failure", action=argparse.BooleanOptionalAction, default=True,
        help="kill a rank mid-training once per tool")  # fmt: skip
    add("--failure-timeout", type=float, default=60.0, help="s to wait for an error")
    add("--tools", default=",".join(TOOLS), help="comma-separated subset of " + ", ".join(TOOLS))
    add("--device", choices=("auto", "cpu", "cuda"), default="auto",
        help="auto: the GPU scenario when torch sees a GPU, else the CPU one")  # fmt: skip
    add("--threads", type=int, default=0,
        help="torch threads per rank, the same for every tool (0: cores // ranks)")  # fmt: skip
    add("--child", help=argparse.SUPPRESS)
    add("--driver", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _torchrun_child(args.child)
        return
    _environment()
    if args.driver:
        driver_main(*args.driver)
        return

    began = time.time()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    world, backend = (1, "nccl") if cuda else (2, "gloo")
    print(_scenario_note(args.device, cuda), flush=True)
    threads = args.threads or max(1, _cores() // world)
    res = Results(tools=_available([t for t in args.tools.split(",") if t]))
    res.reports = {
        t: {"back": [], "spaced": [], "first two": []} for t in REPORTERS if t in res.tools
    }
    with tempfile.TemporaryDirectory(prefix="dask-ddp-peers-") as tmp:
        # Bench keeps this process's environment from before any cluster starts (Bench.env)
        b = Bench(
            tmp=tmp, world=world, backend=backend, cuda=cuda, threads=threads, tools=res.tools
        )
        with contextlib.ExitStack() as stack:
            # Ray first: ray.init starts the raylet that starts every Ray worker, and it must
            # not inherit what a LocalCluster puts into this process's environment.
            for name, tool in (("ray.init", "ray"), ("LocalCluster", "dask_ddp")):
                if tool in res.tools:
                    t = time.time()
                    stack.enter_context(_cluster(b, tool))
                    res.started[name] = time.time() - t
            _warm_phase(b, res, args, began)
            if args.failure:
                for tool in res.tools:
                    kill_at = max(5, args.warmup_steps)
                    res.failures[tool] = failure_once(
                        b, tool, kill_at + 10_000, kill_at, args.failure_timeout
                    )
                print(f"worker deaths done at {time.time() - began:.0f} s", flush=True)
        for _ in range(args.cold_runs):
            for tool in res.tools:
                result = cold_once(b, tool, args.cold_steps, 0)
                res.states.setdefault("cold", {}).setdefault(tool, []).append(result["state"])
                res.add(res.cold, tool, result)
    _print(args, res, cuda)
    print(f"finished in {time.time() - began:.0f} s")


def _cores() -> int:
    """CPU cores this process may use."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _scenario_note(device: str, cuda: bool) -> str:
    """Which scenario runs, and why the other one does not."""
    gpu = "GPU scenario (1 rank on cuda:0, nccl, AMP float16)"
    cpu = f"CPU scenario (2 ranks, gloo, {_cores()} cores)"
    if cuda:
        return f"running the {gpu}; the CPU scenario: --device cpu"
    if device == "cpu":
        return f"running the {cpu} (--device cpu); the GPU scenario is not run"
    return (
        f"running the {cpu}; the {gpu} is SKIPPED: no GPU visible "
        f"(torch.cuda.is_available() is False; torch {torch.__version__}, "
        f"built with CUDA {torch.version.cuda})"
    )


# -- the printout ---------------------------------------------------------------------------
def _t(seconds: float) -> str:
    """A duration with a readable unit.

    >>> _t(1.2e-6), _t(0.0074), _t(2.0)
    ('1.2 us', '7.4 ms', '2.00 s')
    """
    if seconds != seconds:  # NaN: not measured
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def _threads(d: dict[str, list]) -> str:
    """``given->used`` torch threads, or ``a,b->c`` where runs differed.

    >>> _threads({"threads_given": [1, 1], "threads": [1, 1]})
    '1->1'
    """
    return f"{_values(d['threads_given'])}->{_values(d['threads'])}"


def _values(values: list) -> str:
    """The distinct values of a list, in order, ``-`` for None.

    >>> _values([None, None]), _values(["65536", None])
    ('-', '65536,-')
    """
    return ",".join(dict.fromkeys("-" if v is None else str(v) for v in values))


def _print(args: argparse.Namespace, res: Results, cuda: bool) -> None:
    tools, warm, cold = res.tools, res.warm, res.cold

    def med(d: dict, tool: str, key: str) -> float:
        return median(d.get(tool, {}).get(key, []))

    def ratio(d: dict, tool: str, key: str) -> float:
        return med(d, tool, key) / med(d, "dask_ddp", key)

    # time to first step: every counted job of the tool (training jobs and 1-step jobs)
    starts = {
        t: {k: warm[t][k] + res.launches.get(t, {}).get(k, []) for k in ("in_fn", "first_step")}
        for t in tools
    }
    devices = sorted({d for t in tools for d in warm[t]["device"]})
    scenario = (
        f"GPU: 1 rank on cuda:0 ({', '.join(devices)}), nccl, AMP float16"
        if cuda
        else f"CPU: 2 ranks, gloo, device {', '.join(devices)}"
    )
    print(f"\n{command_line()}")
    print(_scenario_note(args.device, cuda))
    print(versions("dask", "distributed", "dask-ddp", "dask-pytorch-ddp", "ray"))
    print(
        f"{scenario}; batch {BATCH} per rank; {args.runs} counted runs after {args.warmup_runs} "
        f"warm-up (medians); 1-min load average {res.load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end; cluster start: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in res.started.items())
    )

    match = {}
    for tool in tools:
        same, diff = True, 0.0
        for states in res.states.values():
            for state in states.get(tool, []):
                s, d = params_match(state, states["dask_ddp"][0])
                same, diff = same and s, max(diff, d)
        match[tool] = f"{'yes' if same else 'NO'} (max |diff| {diff:.1e})"
    cost = {t: {k: median(v) for k, v in r.items()} for t, r in res.reports.items()}

    print(
        f"\nwarm clusters: per round one job of {args.warmup_steps}+{args.steps} steps per tool, "
        f"and {args.launches} 1-step jobs per Dask tool; first step = call -> every rank "
        "finished step 1 (median over all jobs, n); steps/s over the whole timed window, and "
        f"the median rate of its {BLOCK}-step blocks"
    )
    print(
        f"{'tool':<17}{'call->in fn':>12}{'first step':>11}{'n':>4}{'steps/s':>9}{'blocks':>8}"
        f"{'CPU/step':>10}{'threads':>8}{'total':>9}{'report b2b':>12}{'spaced':>10}"
        "  params = dask_ddp's"
    )
    for tool in tools:
        c = cost.get(tool, {})
        print(
            f"{tool:<17}{_t(med(starts, tool, 'in_fn')):>12}"
            f"{_t(med(starts, tool, 'first_step')):>11}{len(starts[tool]['first_step']):>4}"
            f"{med(warm, tool, 'steps_per_s'):>9.1f}{med(warm, tool, 'block_steps_per_s'):>8.1f}"
            f"{_t(med(warm, tool, 'cpu_per_step')):>10}"
            f"{_threads(warm[tool]):>8}"
            f"{_t(med(warm, tool, 'total')):>9}{_t(c.get('back', float('nan'))):>12}"
            f"{_t(c.get('spaced', float('nan'))):>10}  {match[tool]}"
        )
    print(
        "threads: torch threads per rank the tool gave -> trained with (train() sets the same "
        "number under every tool)\nMALLOC_TRIM_THRESHOLD_ inside the training function: "
        + "; ".join(f"{t} {_values(warm[t]['malloc_env'])}" for t in tools)
        + " (dask_ddp lifts the worker's value while a rank runs, dask_ddp/_rank/malloc.py)"
    )
    if cold:
        print(
            f"\ncold: a fresh driver process per tool starts its cluster and runs a "
            f"{args.cold_steps}-step job ({args.cold_runs} run)"
        )
        print(f"{'tool':<17}{'driver peak RSS':>16}{'cluster start':>15}"
              f"{'start->first step':>19}{'start->done':>13}")  # fmt: skip
        for tool in tools:
            print(
                f"{tool:<17}{med(cold, tool, 'maxrss_mb'):>13.0f} MB"
                f"{_t(med(cold, tool, 'cluster_up')):>15}"
                f"{_t(med(cold, tool, 'start_to_first_step')):>19}"
                f"{_t(med(cold, tool, 'start_to_done')):>13}"
            )
    if res.failures:
        print(f"\nworker death: the last rank SIGKILLs its process at step "
              f"{max(5, args.warmup_steps)}")  # fmt: skip
        for tool in tools:
            f = res.failures[tool]
            detect = _t(f["detect"]) if f["detect"] is not None else "never"
            print(f"  {tool}: the driver raised after {detect}: {f['outcome']}")
            print(f"  {' ' * len(tool)}  next job: {f['recover']}")
    if res.kept:
        print("\nreport delivery (what the driver holds after the report loop):")
        for tool, note in res.kept.items():
            print(f"  {tool}: {note}")

    def paired(d: dict, tool: str, key: str) -> float:
        """Median of per-round ratios tool/dask_ddp: jobs that ran next to each other. The
        lists start with the training jobs in round order; Ray and torchrun have no 1-step
        jobs, so their pairs end there."""
        pairs = zip(d[tool].get(key, []), d["dask_ddp"].get(key, []), strict=False)
        return median(a / b for a, b in pairs)

    print(
        "\nratios against dask_ddp, peer / dask_ddp (steps/s: dask_ddp / peer); first the "
        "median of per-round ratios (jobs run next to each other), then the ratio of medians"
    )
    for tool in tools[1:]:
        parts = [
            ("time to first step", paired(starts, tool, "first_step"),
             ratio(starts, tool, "first_step")),
            ("total", paired(warm, tool, "total"), ratio(warm, tool, "total")),
            ("steps/s", 1 / paired(warm, tool, "steps_per_s"),
             1 / ratio(warm, tool, "steps_per_s")),
            (f"{BLOCK}-step block steps/s", 1 / paired(warm, tool, "block_steps_per_s"),
             1 / ratio(warm, tool, "block_steps_per_s")),
            ("CPU per step", paired(warm, tool, "cpu_per_step"),
             ratio(warm, tool, "cpu_per_step")),
        ]  # fmt: skip
        if cold:
            parts += [
                ("cold start->first step", ratio(cold, tool, "start_to_first_step"), None),
                ("driver peak RSS", ratio(cold, tool, "maxrss_mb"), None),
            ]
        print(f"  {tool}: " + ", ".join(
            f"{name} {r:.3g}x" + (f" ({m:.3g}x)" if m is not None else "") for name, r, m in parts
        ))  # fmt: skip
    if "ray" in cost:
        print(
            f"  ray: cost per report back to back "
            f"{cost['ray']['back'] / cost['dask_ddp']['back']:.3g}x, "
            f"spaced {cost['ray']['spaced'] / cost['dask_ddp']['spaced']:.3g}x (ratio of medians)"
        )

    print("\ntargets (issue 9), from this run (per-round ratios; ratio of medians in brackets):")
    targets = []
    if "ray" in tools:
        r, m = 1 / paired(starts, "ray", "first_step"), 1 / ratio(starts, "ray", "first_step")
        targets.append(("time to first step <= 0.5x Ray Train's", r, m, r <= 0.5))
    if "dask-pytorch-ddp" in tools:
        tool = "dask-pytorch-ddp"
        r, m = 1 / paired(starts, tool, "first_step"), 1 / ratio(starts, tool, "first_step")
        targets.append(("time to first step <= dask-pytorch-ddp's", r, m, r <= 1.0))
    if "torchrun" in tools:
        for key, how in (("block_steps_per_s", f"median of {BLOCK}-step blocks"),
                         ("steps_per_s", "whole timed window")):  # fmt: skip
            r, m = 1 / paired(warm, "torchrun", key), 1 / ratio(warm, "torchrun", key)
            targets.append((f"steady steps/s >= 0.97x torchrun's ({how})", r, m, r >= 0.97))
    if "ray" in cost:
        for key, how in (("spaced", "spaced, Ray's best case"), ("back", "back to back")):
            r = cost["dask_ddp"][key] / cost["ray"][key]
            targets.append((f"cost per report <= 0.5x Ray's ({how})", r, r, r <= 0.5))
    for name, r, m, ok in targets:
        print(f"  {name}: {r:.3g}x ({m:.3g}x)  {'met' if ok else 'NOT MET'}")

    print("\nevery value (counted runs, in run order):")
    for key in ("in_fn", "first_step", "steps_per_s", "block_steps_per_s", "cpu_per_step",
                "total"):  # fmt: skip
        for tool in tools:
            print(f"  {key} {tool}: " + ", ".join(f"{v:.3f}" for v in warm[tool][key]))
    for key in ("in_fn", "first_step"):
        for tool, values in res.launches.items():
            print(f"  {key} {tool} 1-step jobs: " + ", ".join(f"{v:.3f}" for v in values[key]))
    for tool, rep in res.reports.items():
        for key, values in rep.items():
            v = sorted(values)
            shown = v if len(v) <= 12 else [*v[:3], *v[len(v) // 2 - 1 : len(v) // 2 + 2], *v[-3:]]
            what = "all" if len(v) <= 12 else "lowest 3, middle 3, highest 3"
            print(f"  report {key} {tool} ({len(v)} calls, {what}): "
                  + ", ".join(_t(x) for x in shown))  # fmt: skip
    for tool in cold:
        for key in ("maxrss_mb", "cluster_up", "start_to_first_step", "start_to_done"):
            print(f"  cold {key} {tool}: " + ", ".join(f"{v:.2f}" for v in cold[tool][key]))


if __name__ == "__main__":
    main()

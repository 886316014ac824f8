"""Everything issue 38 measures on a GPU, in one call of at most 5 minutes on one H100.

Made for the device machine (one GPU, Python 3.12, its own torch and torchvision, dask and
distributed from ``.whl/``; the package runs from this source tree through PYTHONPATH;
BENCHMARKS.md, "GPU: benchmarks/gpu.py", says how to call it). It prints as it goes, and
with ``--out DIR`` writes every number to ``DIR/gpu.json`` after each section, so a call
cut short still brings back what ran. Sections, in this order (``--sections`` picks):

``placement``
    What a rank sees on this machine: ``get_context().device``, ``LOCAL_RANK``,
    ``CUDA_VISIBLE_DEVICES``, the current CUDA device and its name.
``steps``
    Step rate of one loop (resnet50, bf16 autocast, channels_last, batch ``--batch``,
    synthetic data on the GPU, SGD, DDP world size 1 with nccl, ``--warmup-steps`` then
    ``--steps`` timed steps, ``cudnn.benchmark`` on) run three ways, alternated round by
    round after ``--warmup-rounds`` uncounted rounds: ``dask_ddp.launch`` on worker A;
    the same loop in a plain Dask task on worker B that sets up its own process group;
    ``torchrun --standalone --nproc-per-node=1`` (new processes each round, with the
    environment from before the LocalCluster started). Prints every round, the medians,
    and dask_ddp's ratio to torchrun (median of per-round ratios, and ratio of medians).
``checkpoints``
    A 1-rank dask_ddp job (``backend="cpu:gloo,cuda:nccl"``) with ``--checkpoint-mb`` of
    CUDA tensors (64 MB each): the stall of the first ``save_checkpoint`` and of
    ``--saves`` later ones; a copy into preallocated pinned memory (the floor); what
    allocating those pinned buffers costs (what a first save paid before it was staged on
    the GPU); ``torch.save`` to a local file; DCP ``async_save`` (returning, and durable);
    a GPU step's time idle and during the first save's background write; the reloaded
    state equal to the last saved.
``after``
    A plain ``client.submit`` task sent right after an nccl job to the same worker: does it
    see a process group, and can it start its own? And a job asking for nccl while another
    job holds two workers on one GPU: how long until it fails with
    ``BackendUnavailableError``.
``tests``
    ``pytest -m gpu tests/test_gpu.py`` (with ``--noconftest`` where the S3 test servers'
    packages are missing), its summary, within the time that is left.

``--cpu-smoke`` runs every section on the CPU with tiny sizes and gloo (resnet18 on 32x32
images, 16 MB of checkpoint; one GPU pretended with ``ddp.gpu-count`` for the nccl job that
must fail), to check the script itself where no GPU is lent::

    python benchmarks/gpu.py --out /tmp/gpu                   # on the GPU: about 4 minutes
    python benchmarks/gpu.py --cpu-smoke                      # here: about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from _common import command_line, median, torchrun_command, versions  # noqa: E402

SECTIONS = ("placement", "steps", "checkpoints", "after", "tests")
TENSOR_MB = 64
# The environment before any LocalCluster: starting one puts the nanny's pre-spawn
# variables (MALLOC_TRIM_THRESHOLD_, OMP_NUM_THREADS) into this process's own.
BASE_ENV = dict(os.environ)


# -- on the ranks and in the tasks ----------------------------------------------------------
def train_loop(cfg: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The benchmarked loop, the same under every tool: DDP over the default process group,
    bf16 autocast, channels_last, one synthetic batch on the device. Returns steps/s."""
    import torchvision
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = device.type == "cuda"
    if cuda:
        from torch.backends import cudnn  # a local import: cudnn's module does not pickle

        torch.cuda.set_device(device)
        cudnn.benchmark = True
    torch.manual_seed(0)
    model = getattr(torchvision.models, cfg["model"])().to(
        device, memory_format=torch.channels_last
    )
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    size = cfg["image"]
    x = torch.randn(cfg["batch"], 3, size, size, device=device).to(
        memory_format=torch.channels_last
    )
    y = torch.randint(0, 1000, (cfg["batch"],), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(cfg["warmup"]):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(cfg["steps"]):
        step()
    sync()
    elapsed = time.perf_counter() - start
    return {"steps_per_s": cfg["steps"] / elapsed, "threads": torch.get_num_threads()}


def dask_ddp_train(cfg: dict[str, Any]) -> dict[str, Any]:
    import dask_ddp

    return train_loop(cfg, dask_ddp.get_context().device)


def _own_group(backend: str) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def plain_task_train(cfg: dict[str, Any]) -> dict[str, Any]:
    """The loop in a plain Dask task that sets up (and ends) a process group of its own."""
    import torch.distributed as dist

    _own_group(cfg["backend"])
    try:
        return train_loop(cfg, torch.device("cuda", 0) if cfg["cuda"] else torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def torchrun_child(cfg_path: str) -> None:
    """A torchrun rank, as a torchrun script would run the loop."""
    import torch.distributed as dist

    with open(cfg_path) as f:
        cfg = json.load(f)
    dist.init_process_group(cfg["backend"])
    local = int(os.environ["LOCAL_RANK"])
    try:
        out = train_loop(cfg, torch.device("cuda", local) if cfg["cuda"] else torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    with open(cfg["result"], "w") as f:
        json.dump(out, f)


def where_am_i() -> dict[str, Any]:
    import dask_ddp

    ctx = dask_ddp.get_context()
    out = {
        "device": str(ctx.device),
        "local_rank": ctx.local_rank,
        "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "backend": ctx.backend,
    }
    if torch.cuda.is_available():
        out["current_device"] = torch.cuda.current_device()
        out["name"] = torch.cuda.get_device_name(ctx.device)
    return out


def _gpu_step(a: torch.Tensor, repeat: int) -> float:
    """One GPU "training step" (``repeat`` matmuls), synchronised: its seconds."""
    start = time.perf_counter()
    for _ in range(repeat):
        a @ a
    if a.is_cuda:
        torch.cuda.synchronize(a.device)
    return time.perf_counter() - start


def checkpoint_bench(cfg: dict[str, Any]) -> dict[str, Any]:
    """On the rank: the save stalls and the references, for one state of CUDA tensors."""
    import torch.distributed.checkpoint as dcp

    import dask_ddp

    ctx = dask_ddp.get_context()
    device = ctx.device
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    gen = torch.Generator(device=device).manual_seed(0)
    n = cfg["mb"] * 2**20 // 4
    state: dict[str, Any] = {}
    for i in range(0, n, TENSOR_MB * 2**20 // 4):
        size = min(TENSOR_MB * 2**20 // 4, n - i)
        state[f"layer{len(state)}.weight"] = torch.randn(size, device=device, generator=gen)
    sync()
    a = torch.randn(cfg["matmul"], cfg["matmul"], device=device, dtype=torch.bfloat16)
    _gpu_step(a, cfg["repeat"])
    idle = [_gpu_step(a, cfg["repeat"]) for _ in range(20)]
    out: dict[str, Any] = {"device": str(device), "mb": cfg["mb"], "idle_step_s": median(idle)}

    def save(step: int) -> tuple[float, list[float], float]:
        """The stall of one save, the GPU steps run until it is durable, and that time."""
        start = time.perf_counter()
        pending = dask_ddp.save_checkpoint(state, step=step)
        stall = time.perf_counter() - start
        beside = []
        while not pending.done():
            beside.append(_gpu_step(a, cfg["repeat"]))
        pending.wait(600)
        return stall, beside, time.perf_counter() - start

    first, beside, durable = save(1)
    out.update(first_stall_s=first, first_durable_s=durable, steps_beside_first_s=median(beside))
    later = []
    for s in range(2, 2 + cfg["saves"]):
        with torch.no_grad():
            state["layer0.weight"].add_(1)  # training goes on between saves
        stall, beside, _ = save(s)
        later.append(stall)
    out.update(later_stalls_s=later, later_stall_s=median(later))
    # The floor: a copy into pinned memory allocated beforehand, and what allocating it cost.
    start = time.perf_counter()
    pinned = [
        torch.empty(t.numel() * 4, dtype=torch.uint8, pin_memory=cuda) for t in state.values()
    ]
    out["pinned_alloc_s"] = time.perf_counter() - start
    copies = []
    for _ in range(3):
        start = time.perf_counter()
        for buf, t in zip(pinned, state.values(), strict=True):
            buf.copy_(t.view(torch.uint8), non_blocking=cuda)
        sync()
        copies.append(time.perf_counter() - start)
    out["pinned_copy_s"] = median(copies)
    del pinned
    # torch.save, on the training path.
    path = os.path.join(cfg["scratch"], "torch_save.pt")
    start = time.perf_counter()
    torch.save(state, path)
    out["torch_save_s"] = time.perf_counter() - start
    os.remove(path)
    # DCP async_save (needs gloo beside nccl): the call's stall, then durable.
    dcp_stalls, dcp_durable = [], []
    for i in range(2):
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=os.path.join(cfg["scratch"], f"dcp{i}"))
        dcp_stalls.append(time.perf_counter() - start)
        future.result()
        dcp_durable.append(time.perf_counter() - start)
    out.update(dcp_stalls_s=dcp_stalls, dcp_durable_s=dcp_durable)
    # The last checkpoint, loaded back onto the rank's device.
    loaded = dask_ddp.get_checkpoint()
    out["reload_devices"] = sorted({str(t.device) for t in loaded.values()})
    out["reload_equal"] = all(torch.equal(loaded[k], v) for k, v in state.items())
    return out


def nccl_allreduce(backend: str) -> str:
    import dask_ddp

    ctx = dask_ddp.get_context()
    t = torch.ones(1, device=ctx.device)
    torch.distributed.all_reduce(t)
    return ctx.worker


def plain_after_job(backend: str) -> dict[str, Any]:
    """A plain task right after a job: a process group left over, and one of its own."""
    import torch.distributed as dist

    out: dict[str, Any] = {"initialised_at_start": dist.is_initialized()}
    try:
        _own_group(backend)
        dist.destroy_process_group()
        out["own_group"] = "ok"
    except Exception as exc:
        out["own_group"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def hold(event: str) -> int:
    from distributed import Event

    import dask_ddp

    Event(event).wait(timeout=120)
    return dask_ddp.get_context().rank


# -- on the driver ------------------------------------------------------------------------
class Report:
    """What the run found: printed as it comes, and kept in ``DIR/gpu.json``."""

    def __init__(self, out: str | None) -> None:
        self.out, self.data = out, {}
        if out:
            os.makedirs(out, exist_ok=True)

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.data.setdefault("lines", []).append(text)

    def put(self, section: str, value: Any) -> None:
        self.data[section] = value
        if self.out:
            with open(os.path.join(self.out, "gpu.json"), "w") as f:
                json.dump(self.data, f, indent=1, default=str)


@contextlib.contextmanager
def timed_section(report: Report, name: str) -> Iterator[None]:
    start = time.perf_counter()
    report.say(f"\n== {name}")
    try:
        yield
    except Exception as exc:  # one section failing must not lose the others' numbers
        report.say(f"{name} FAILED: {type(exc).__name__}: {exc}")
        report.put(f"{name}_error", f"{type(exc).__name__}: {exc}")
    report.say(f"({name}: {time.perf_counter() - start:.1f} s)")


def run_torchrun(cfg: dict[str, Any], scratch: str) -> dict[str, Any]:
    cfg = {**cfg, "result": os.path.join(scratch, "torchrun.json")}
    path = os.path.join(scratch, "torchrun-cfg.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    command = torchrun_command(os.path.abspath(__file__), 1, ["--child", path])
    proc = subprocess.run(command, capture_output=True, text=True, env=BASE_ENV, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with {proc.returncode}: {proc.stderr[-1500:]}")
    with open(cfg["result"]) as f:
        return json.load(f)


def steps_section(args: Any, report: Report, client: Any, a: str, b: str, scratch: str) -> None:
    import dask_ddp

    cfg = {
        "model": args.model, "image": args.image, "batch": args.batch, "warmup": args.warmup_steps,
        "steps": args.steps, "backend": args.backend, "cuda": not args.cpu_smoke,
    }  # fmt: skip
    ways: dict[str, Callable[[], dict[str, Any]]] = {
        "dask_ddp": lambda: dask_ddp.launch(
            client, dask_ddp_train, args=(cfg,), workers=[a], backend=args.backend
        ).result(timeout=300)[0],
        "plain Dask task": lambda: client.submit(
            plain_task_train, cfg, workers=[b], pure=False
        ).result(timeout=300),
        "torchrun": lambda: run_torchrun(cfg, scratch),
    }
    rates: dict[str, list[float]] = {w: [] for w in ways}
    threads: dict[str, int] = {}
    started = time.perf_counter()
    for r in range(args.warmup_rounds + args.rounds):
        counted = r >= args.warmup_rounds
        round_started = time.perf_counter()
        line = []
        for way, run in ways.items():
            out = run()
            threads[way] = out["threads"]
            line.append(f"{way} {out['steps_per_s']:.2f}")
            if counted:
                rates[way].append(out["steps_per_s"])
        report.say(f"round {r + 1} ({'counted' if counted else 'warm-up'}): " + ", ".join(line))
        took = time.perf_counter() - round_started
        if counted and time.perf_counter() - started + took > args.steps_budget:
            report.say(f"stopped after {r + 1} rounds: the next would pass --steps-budget")
            break
    ours, ref, plain = rates["dask_ddp"], rates["torchrun"], rates["plain Dask task"]
    per_round = [o / t for o, t in zip(ours, ref, strict=True)]
    summary = {
        "rates": rates,
        "threads": threads,
        "medians": {w: median(v) for w, v in rates.items()},
        "dask_ddp/torchrun, median of per-round ratios": median(per_round),
        "dask_ddp/torchrun, ratio of medians": median(ours) / median(ref),
        "plain task/torchrun, ratio of medians": median(plain) / median(ref),
    }
    for key, value in summary.items():
        report.say(f"{key}: {value}")
    report.put("steps", summary)


def checkpoints_section(args: Any, report: Report, client: Any, a: str, scratch: str) -> None:
    import dask_ddp

    cfg = {
        "mb": args.checkpoint_mb, "saves": args.saves, "scratch": scratch,
        "matmul": args.matmul, "repeat": args.matmul_repeat,
    }  # fmt: skip
    backend = "gloo" if args.cpu_smoke else "cpu:gloo,cuda:nccl"
    job = dask_ddp.launch(
        client, checkpoint_bench, args=(cfg,), workers=[a], backend=backend,
        checkpoint_dir=os.path.join(scratch, "ckpt"), keep_last=2,
    )  # fmt: skip
    out = job.result(timeout=600)[0]
    out["first/pinned copy"] = out["first_stall_s"] / out["pinned_copy_s"]
    out["later/pinned copy"] = out["later_stall_s"] / out["pinned_copy_s"]
    out["pinned alloc + copy (a first save without staging on the GPU)"] = (
        out["pinned_alloc_s"] + out["pinned_copy_s"]
    )
    out["job.checkpoints stalls"] = [round(c.stall, 4) for c in job.checkpoints]
    for key, value in out.items():
        report.say(f"{key}: {value}")
    report.put("checkpoints", out)


def after_section(args: Any, report: Report, client: Any, a: str) -> None:
    import dask
    from distributed import Event

    import dask_ddp

    worker = dask_ddp.launch(
        client, nccl_allreduce, args=(args.backend,), workers=[a], backend=args.backend
    ).result(timeout=300)[0]
    plain = client.submit(plain_after_job, args.backend, workers=[worker], pure=False)
    out: dict[str, Any] = {"plain task after a job": plain.result(timeout=120)}
    # nccl asked for while another job holds two workers that share one GPU (on the CPU,
    # one pretended GPU).
    pretend = {"ddp.gpu-count": 1} if args.cpu_smoke else {}
    with dask.config.set(pretend):
        holder = dask_ddp.launch(client, hold, args=("gpu-bench-release",))
        start = time.perf_counter()
        waiting = dask_ddp.launch(client, dask_ddp.get_context, backend="nccl")
    out["nccl job while held: state"] = str(waiting.state)
    Event("gpu-bench-release", client).set()
    holder.result(timeout=300)
    try:
        waiting.result(timeout=300)
        out["nccl job while held"] = "ran (not expected: two ranks share one GPU)"
    except dask_ddp.errors.BackendUnavailableError as exc:
        out["nccl job while held"] = (
            f"BackendUnavailableError after {time.perf_counter() - start:.2f} s: {exc}"
        )
    for key, value in out.items():
        report.say(f"{key}: {value}")
    report.put("after", out)


def run_pytest(args: Any, report: Report, left: float) -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-m", "gpu"]
    # One process, whatever pyproject's addopts say (two pytest-xdist processes would share
    # the GPUs, and a machine without the test extra lacks pytest-xdist).
    command += ["-o", "addopts=--strict-markers"]
    # tests/conftest.py imports the S3 test servers' packages, which test_gpu.py does not
    # need; without them, run it alone (on the CPU, conftest is what skips it).
    if not args.cpu_smoke and not all(importlib.util.find_spec(m) for m in ("boto3", "moto")):
        command.append("--noconftest")
    command.append(os.path.join(ROOT, "tests", "test_gpu.py"))
    report.say(" ".join(command[1:]))
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=max(30.0, left), cwd=ROOT
        )
        tail = proc.stdout.strip().splitlines()[-15:]
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        tail = [f"pytest passed the time left ({left:.0f} s)", *out.strip().splitlines()[-10:]]
    for line in tail:
        report.say(line)
    report.put("tests", tail)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny, on the CPU, gloo")
    parser.add_argument("--out", help="also write DIR/gpu.json")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--checkpoint-mb", type=int, default=1024)
    parser.add_argument("--saves", type=int, default=3, help="saves after the first")
    parser.add_argument("--budget", type=float, default=290.0, help="seconds for the whole run")
    parser.add_argument("--steps-budget", type=float, default=130.0, help="seconds for steps")
    args = parser.parse_args(argv)
    args.model, args.image = "resnet50", 224
    args.matmul, args.matmul_repeat = 8192, 3
    args.backend = "nccl"
    if args.cpu_smoke:
        args.model, args.image, args.batch = "resnet18", 32, 4
        args.steps, args.warmup_steps = 3, 1
        args.rounds, args.warmup_rounds = min(args.rounds, 2), 0
        args.checkpoint_mb, args.saves = 16, 2
        args.matmul, args.backend = 256, "gloo"
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections takes {','.join(SECTIONS)}; got {sorted(unknown)}")

    started = time.perf_counter()
    report = Report(args.out)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    report.say(f"{command_line()}\n{versions('dask', 'distributed', 'torchvision')}, GPU: {gpu}")
    report.say(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}")
    if not args.cpu_smoke and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run with --cpu-smoke to check the script on the CPU")
    report.put("header", {"command": command_line(), "gpu": gpu, "args": vars(args)})

    from distributed import Client, LocalCluster

    import dask_ddp

    cluster_sections = [s for s in sections if s != "tests"]
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-bench-"))
        if cluster_sections:
            cluster = stack.enter_context(
                LocalCluster(
                    n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
                )
            )
            client = stack.enter_context(Client(cluster))
            client.wait_for_workers(2, timeout="120s")
            a, b = sorted(client.scheduler_info(n_workers=-1)["workers"])
            report.say(f"cluster up after {time.perf_counter() - started:.1f} s: A={a} B={b}")
        if "placement" in sections:
            with timed_section(report, "placement"):
                seen = dask_ddp.launch(
                    client, where_am_i, workers=[a], backend=args.backend
                ).result(timeout=300)
                report.say(f"rank 0 sees {seen[0]}")
                report.put("placement", seen)
        if "steps" in sections:
            with timed_section(report, "steps"):
                steps_section(args, report, client, a, b, scratch)
        if "checkpoints" in sections:
            with timed_section(report, "checkpoints"):
                checkpoints_section(args, report, client, a, scratch)
        if "after" in sections:
            with timed_section(report, "after"):
                after_section(args, report, client, a)
    if "tests" in sections:
        with timed_section(report, "tests"):
            run_pytest(args, report, args.budget - (time.perf_counter() - started))
    report.say(f"\ntotal {time.perf_counter() - started:.1f} s")
    report.put("total_s", time.perf_counter() - started)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        torchrun_child(sys.argv[2])
    else:
        main()

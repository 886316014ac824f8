"""What the benchmark scripts share: the model, the torchrun command line, and the header.

Imported by the scripts in this folder as ``_common`` (running ``python benchmarks/x.py``
puts this folder first on ``sys.path``). Functions that run on the ranks pickle references
to this module, so the processes that run them must import it too: Dask's worker processes
inherit ``sys.path`` from the process that started them; other launchers (Ray's workers)
need this folder on ``PYTHONPATH`` (:func:`export_path`).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def small_cnn() -> torch.nn.Module:
    """The benchmarks' model: a small CNN for 1x28x28 images, 10 classes, seeded (0).

    >>> sum(p.numel() for p in small_cnn().parameters())
    9930
    """
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(512, 10),
    )  # fmt: skip


def ddp_steps_per_second(steps: int, warmup: int) -> float:
    """Train :func:`small_cnn` under DDP (the default process group) for ``warmup`` untimed
    and ``steps`` timed steps of batch 32; the timed steps per second (0 for none)."""
    import time

    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(small_cnn())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    start = time.perf_counter()
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return steps / (time.perf_counter() - start) if steps else 0.0


def median(values: Iterable[float]) -> float:
    """The median, or NaN for no values (a tool that did not run).

    >>> median([3.0, 1.0, 2.0]), median([])
    (2.0, nan)
    """
    values = list(values)
    return statistics.median(values) if values else float("nan")


def torchrun_command(script: str, nproc: int, args: Sequence[str]) -> list[str]:
    """``torchrun --standalone --nproc-per-node=N script ARGS``, with this interpreter.

    >>> torchrun_command("b.py", 2, ["--child"])[2:]
    ['torch.distributed.run', '--nproc-per-node=2', '--standalone', 'b.py', '--child']
    """
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--standalone", script, *args,
    ]  # fmt: skip


def export_path() -> None:
    """Put this folder on ``PYTHONPATH`` so that processes started from now on (Ray's
    workers, torchrun's children) can import ``_common``."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if HERE not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *parts])


def command_line() -> str:
    """The exact command that is running, to paste into BENCHMARKS.md."""
    return shlex.join([os.path.basename(sys.executable), *sys.argv])


def versions(*dists: str) -> str:
    """``python X, torch Y, <dist> Z, ..., N cores``; "not installed" for a missing one."""
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for dist in dists:
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist} not installed")
    parts.append(f"{os.cpu_count()} cores")
    return ", ".join(parts)


def start_cluster(tmp: str, workers: int) -> tuple[str, list[subprocess.Popen]]:
    """A scheduler and ``workers`` worker processes (one thread each) in processes of their
    own, so that each one's memory can be read. Returns the scheduler file, once the
    scheduler listens, and the processes, the scheduler last (terminate them when done)."""
    sched_file = os.path.join(tmp, "scheduler.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "dask", "scheduler", "--scheduler-file", sched_file,
         "--port", "0", "--dashboard-address", ":0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    nanny = subprocess.Popen(
        [sys.executable, "-m", "dask", "worker", "--scheduler-file", sched_file,
         "--nworkers", str(workers), "--nthreads", "1", "--no-dashboard"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not os.path.exists(sched_file):  # written once the scheduler listens
        if time.monotonic() > deadline or scheduler.poll() is not None:
            raise RuntimeError("the scheduler did not start")
        time.sleep(0.1)
    return sched_file, [nanny, scheduler]

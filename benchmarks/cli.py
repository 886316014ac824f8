"""Cold start of the command line: ``python -m dask_ddp`` against ``torchrun``, whole process.

Both commands run the same 2-rank script from a cold start (a new interpreter, a new
LocalCluster or torchrun's own processes), for each of two scripts: ``ddp`` builds one
DistributedDataParallel layer and takes one step; ``group`` only makes the process group
and does one ``all_reduce`` (the launcher's fixed cost, nearly alone). For each run it
takes the wall time until the command exits and the CPU time of the command and every
process it started: this script makes itself the child subreaper
(``PR_SET_CHILD_SUBREAPER``), so processes orphaned by the command (workers that die with
it) are reparented here and reaped, and ``RUSAGE_CHILDREN`` counts them all.

The commands alternate after a warm-up round (the page cache holds torch for both), and
the table gives medians and the ratio ours/torchrun (below 1.0: ours is faster).

    python benchmarks/cli.py --runs 5                # both scripts
    python benchmarks/cli.py --runs 5 --scripts group

Hold ``/tmp/dask_ddp_quiet.lock`` while it runs (``flock /tmp/dask_ddp_quiet.lock ...``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import subprocess
import sys
import tempfile
import time

from _common import command_line, median, torchrun_command, versions

_PR_SET_CHILD_SUBREAPER = 36

SCRIPTS = {
    "ddp": """\
import torch, torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
model(torch.ones(4, 8)).sum().backward()
dist.barrier()  # gloo aborts a rank whose peer tears its pairs down mid-step
dist.destroy_process_group()
""",
    "group": """\
import torch, torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
""",
}
TARGET = 0.7  # issue 44: ours within 0.7x torchrun's wall time, whole process


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _reap_all() -> None:
    """Wait for every descendant, the command's orphans included."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def measure(command: list[str], env: dict[str, str]) -> tuple[float, float] | None:
    """(wall seconds until the command exits, CPU seconds of it and all it started), or
    None when the command failed (its error is printed; torchrun's gloo ranks now and then
    abort at exit with "terminate called without an active exception")."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    _, err = proc.communicate()
    wall = time.perf_counter() - start
    _reap_all()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        print(f"\n{command[:4]}... failed ({proc.returncode}):\n{err[-1500:]}")
        return None
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def compare(script: str, opts: argparse.Namespace, env: dict[str, str]) -> None:
    """Alternate the two commands on ``script``, print their medians and the ratio."""
    commands = {
        "dask_ddp": [sys.executable, "-m", "dask_ddp", "--nworkers", str(opts.nproc), script],
        "torchrun": torchrun_command(script, opts.nproc, []),
    }
    for command in commands.values():  # warm-up: the page cache, .pyc files
        measure(command, env)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    failed = dict.fromkeys(commands, 0)
    for _ in range(opts.runs):
        for name, command in commands.items():
            run = measure(command, env)
            if run is None:
                failed[name] += 1
            else:
                results[name].append(run)
    print(f"\n{'command':<12}{'wall s (median)':>17}{'CPU s (median)':>16}   runs (wall/CPU)")
    for name, runs in results.items():
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        each = " ".join(f"{w:.2f}/{c:.2f}" for w, c in runs)
        note = f"   ({failed[name]} failed runs left out)" if failed[name] else ""
        print(f"{name:<12}{median(walls):>17.2f}{median(cpus):>16.2f}   {each}{note}")
    ours, theirs = results["dask_ddp"], results["torchrun"]
    wall_ratio = median(w for w, _ in ours) / median(w for w, _ in theirs)
    cpu_ratio = median(c for _, c in ours) / median(c for _, c in theirs)
    verdict = "met" if wall_ratio <= TARGET and cpu_ratio <= TARGET else "NOT MET"
    print(
        f"ratio dask_ddp/torchrun: wall {wall_ratio:.2f}x, CPU {cpu_ratio:.2f}x "
        f"(target <= {TARGET}x both: {verdict})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="measured runs of each command")
    parser.add_argument("--nproc", type=int, default=2, help="ranks")
    parser.add_argument(
        "--scripts", default=",".join(SCRIPTS), help=f"comma-separated, of {', '.join(SCRIPTS)}"
    )
    opts = parser.parse_args()
    _become_subreaper()
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_TRIM_THRESHOLD_"}
    print(command_line())
    print(versions("dask", "distributed"))
    with tempfile.TemporaryDirectory() as tmp:
        for name in opts.scripts.split(","):
            script = os.path.join(tmp, f"{name}.py")
            with open(script, "w") as f:
                f.write(SCRIPTS[name])
            print(f"\nscript {name!r}:")
            compare(script, opts, env)


if __name__ == "__main__":
    main()

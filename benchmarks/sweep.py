"""Sweeps: ``dask_ddp.sweep()`` against the Optuna glue a user writes by hand today.

One LocalCluster of ``--workers`` worker processes (one thread each) and one client run, in
turn, the same study twice: a RandomSampler (seed 0) over a log-uniform ``lr`` and a
MedianPruner (2 startup trials, 2 warm-up steps), ``--trials`` trials of 2-worker jobs. The
training function sleeps ``--epoch-seconds`` per epoch (so that 2 cores are not what it
waits for) and reports a ``val_loss`` that is a fixed function of ``lr`` and the epoch, so
both sides see the same curves. Both studies have the same ``lr`` values enqueued, the ones
a RandomSampler (seed 0) suggests in turn: ``optimize(n_jobs>1)`` reseeds the sampler from
the OS for every trial, so the seed alone would give the glue other values each run.

* ours: ``dask_ddp.sweep(client, epochs, study, params, workers_per_trial=2,
  metric="val_loss")``: the study runs on the scheduler, which prunes and places trials;
* glue: ``study.optimize(objective, n_jobs=workers // 2)``, where ``objective`` launches a
  job (``dask_ddp.launch``), reports rank 0's records to the trial as they arrive, and on
  ``trial.should_prune()`` cancels the job and raises ``optuna.TrialPruned``.

For each side it prints the wall time, the trials' outcomes, the utilisation (rank-seconds
of the trials' jobs, from their ``running`` entry to their last one, over workers x wall),
the ideal wall time (the trials' busy seconds over the trials that fit at once) and the
ratio to it, how long a pruned trial's workers stay held after the prune, and the
per-trial overheads: launch (the job's first history entry) -> first record, placement
(its ``running`` entry) -> first record, and a trial's end -> the next first record on its
workers. A sweep asks for its next trial as soon as none waits, so its jobs are mostly
launched ahead, ``waiting`` for workers: their launch -> first record includes that wait.
Then the ratio ours/glue of the wall times (below 1.0: ours is faster)::

    python benchmarks/sweep.py                       # about a minute on 2 cores
    python benchmarks/sweep.py --trials 32 --workers 8 --epochs 12

Hold ``/tmp/dask_ddp_quiet.lock`` while it runs (``flock /tmp/dask_ddp_quiet.lock ...``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import subprocess
import threading
import time
from typing import Any

import optuna
from _common import HERE, command_line, median, versions
from distributed import Client, LocalCluster

import dask_ddp

optuna.logging.set_verbosity(optuna.logging.WARNING)

METRIC = "val_loss"
LR_LOW, LR_HIGH = 1e-4, 1e-1


def val_loss(lr: float, epoch: int) -> float:
    """A decreasing curve whose level depends on ``lr`` (best at 10**-2.5).

    >>> round(val_loss(10**-2.5, 0), 3), round(val_loss(10**-2.5, 7), 3)
    (2.0, 0.688)
    """
    return (1.0 + (math.log10(lr) + 2.5) ** 2) * (0.5 + 1.5 / (epoch + 1))


def epochs(lr: float, n_epochs: int = 8, epoch_seconds: float = 0.5) -> float:
    """The trial: ``n_epochs`` epochs of ``epoch_seconds`` of sleep, each reported."""
    loss = float("nan")
    for epoch in range(n_epochs):
        time.sleep(epoch_seconds)
        loss = val_loss(lr, epoch)
        dask_ddp.report({METRIC: loss}, step=epoch)
    return loss


def suggest_lr(trial: optuna.Trial) -> float:
    return trial.suggest_float("lr", LR_LOW, LR_HIGH, log=True)


def seeded_lrs(n_trials: int) -> list[float]:
    """The ``lr`` values a RandomSampler (seed 0) suggests for ``n_trials`` trials in turn."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    return [suggest_lr(study.ask()) for _ in range(n_trials)]


def new_study(lrs: list[float]) -> optuna.Study:
    """A fresh study, its trials' ``lr`` enqueued (``optimize(n_jobs>1)`` reseeds the
    sampler from the OS for each trial: the seed alone would not give both sides the
    same values)."""
    study = optuna.create_study(
        sampler=optuna.samplers.RandomSampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2),
    )
    for lr in lrs:
        study.enqueue_trial({"lr": lr})
    return study


@dataclasses.dataclass
class Trial:
    """One trial as both sides are measured: its outcome and its job."""

    number: int
    state: str  # complete, pruned, fail
    lr: float | None
    value: float | None
    job: Any  # dask_ddp.Job
    pruned_at: int | None = None  # the step the pruner stopped it at
    pruned: float | None = None  # when the prune was decided (seconds since the epoch)


@dataclasses.dataclass
class Side:
    name: str
    wall: float
    trials: list[Trial]
    best: Any  # the study's best FrozenTrial


def run_ours(client: Client, args: argparse.Namespace) -> Side:
    study = new_study(seeded_lrs(args.trials))
    start = time.perf_counter()
    sweep = dask_ddp.sweep(
        client, epochs, study, lambda t: {"lr": suggest_lr(t)},
        n_trials=args.trials, workers_per_trial=args.workers_per_trial, metric=METRIC,
        kwargs={"n_epochs": args.epochs, "epoch_seconds": args.epoch_seconds},
    )  # fmt: skip
    best = sweep.result(timeout=args.timeout)
    wall = time.perf_counter() - start
    jobs = sweep.jobs
    trials = []
    for info in sweep.trials:
        job = jobs.get(info.number)
        if job is not None:
            job.wait_stopped(30)
        pruned = None
        if job is not None and info.state == "pruned":
            pruned = next((t.time for t in job.history if "pruned" in t.reason), None)
        lr = info.params.get("lr")
        trials.append(Trial(info.number, info.state, lr, info.value, job, info.pruned_at, pruned))
    return Side("ours", wall, trials, best)


def run_glue(client: Client, args: argparse.Namespace) -> Side:
    study = new_study(seeded_lrs(args.trials))
    lock = threading.Lock()
    jobs: dict[int, Any] = {}
    prunes: dict[int, tuple[int, float]] = {}

    def objective(trial: optuna.Trial) -> float:
        lr = suggest_lr(trial)
        job = dask_ddp.launch(
            client, epochs, workers=args.workers_per_trial,
            kwargs={"lr": lr, "n_epochs": args.epochs, "epoch_seconds": args.epoch_seconds},
        )  # fmt: skip
        with lock:
            jobs[trial.number] = job
        value = None
        for record in job.iter_metrics():
            if record.rank != 0 or METRIC not in record.metrics:
                continue
            value = record.metrics[METRIC]
            trial.report(value, record.step)
            if trial.should_prune():
                with lock:
                    prunes[trial.number] = (record.step, time.time())
                job.cancel(f"pruned at step {record.step}")
                raise optuna.TrialPruned()
        job.result()
        if value is None:
            raise RuntimeError(f"trial {trial.number}: rank 0 reported no {METRIC}")
        return value

    start = time.perf_counter()
    study.optimize(
        objective, n_trials=args.trials, n_jobs=args.workers // args.workers_per_trial,
        catch=(Exception,),
    )  # fmt: skip
    wall = time.perf_counter() - start
    trials = []
    for frozen in study.get_trials(deepcopy=False):
        job = jobs.get(frozen.number)
        if job is not None:
            job.wait_stopped(30)
        step, pruned = prunes.get(frozen.number, (None, None))
        state = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "fail"}.get(
            frozen.state.name, frozen.state.name.lower()
        )
        trials.append(
            Trial(frozen.number, state, frozen.params.get("lr"), frozen.value, job, step, pruned)
        )
    try:
        best = study.best_trial
    except ValueError:  # no trial completed
        best = None
    return Side("glue", wall, trials, best)


@dataclasses.dataclass
class Timeline:
    """A trial's job, in times (seconds since the epoch, the one machine's clock)."""

    launched: float  # its first history entry
    running: float  # its first running entry
    ended: float  # its last history entry
    world: int
    first_metric: float | None
    workers: frozenset[str]


def timeline(trial: Trial) -> Timeline | None:
    history = trial.job.history if trial.job is not None else []
    running = [t for t in history if t.state.value == "running"]
    if not running:
        return None
    records = trial.job.metrics
    return Timeline(
        launched=history[0].time,
        running=running[0].time,
        ended=history[-1].time,
        world=running[0].world_size,
        first_metric=min((r.time for r in records), default=None),
        workers=frozenset(trial.job.workers),
    )


def analyse(side: Side, args: argparse.Namespace) -> dict[str, Any]:
    concurrency = args.workers // args.workers_per_trial
    lines = {t.number: timeline(t) for t in side.trials}
    live = [x for x in lines.values() if x is not None]
    busy = [x.ended - x.running for x in live]
    rank_seconds = sum((x.ended - x.running) * x.world for x in live)
    ideal = sum(busy) / concurrency
    prune_free, report_free = [], []
    for t in side.trials:
        line = lines[t.number]
        if t.state != "pruned" or line is None:
            continue
        if t.pruned is not None:
            prune_free.append(line.ended - t.pruned)
        reported = [
            r.time for r in t.job.metrics if r.rank == 0 and r.step == t.pruned_at
        ]  # fmt: skip
        if reported:
            report_free.append(line.ended - reported[0])
    to_first = [x.first_metric - x.launched for x in live if x.first_metric is not None]
    placed_first = [x.first_metric - x.running for x in live if x.first_metric is not None]
    gaps = []
    for x in live:
        later = [
            y.first_metric for y in live
            if y is not x and y.launched > x.launched and y.first_metric is not None
            and y.first_metric > x.ended and (not x.workers or x.workers & y.workers)
        ]  # fmt: skip
        if later:
            gaps.append(min(later) - x.ended)
    counts = {s: sum(t.state == s for t in side.trials) for s in ("complete", "pruned", "fail")}
    return {
        "wall": side.wall,
        "counts": counts,
        "utilisation": rank_seconds / (args.workers * side.wall),
        "ideal": ideal,
        "prune_free": prune_free,
        "report_free": report_free,
        "to_first": to_first,
        "placed_first": placed_first,
        "gaps": gaps,
        "lines": lines,
    }


def print_trials(side: Side, stats: dict[str, Any]) -> None:
    print(f"\n{side.name}: trial, state, lr, value / pruned at, busy s, workers")
    for t in side.trials:
        line = stats["lines"][t.number]
        if t.state == "pruned":
            outcome = f"step {t.pruned_at}"
        else:
            outcome = f"{t.value:.4f}" if t.value is not None else "-"
        busy = f"{line.ended - line.running:.2f}" if line is not None else "-"
        where = ",".join(sorted(w.rsplit(":", 1)[-1] for w in line.workers)) if line else "-"
        lr = f"{t.lr:.2e}" if t.lr is not None else "-"
        print(f"  {t.number:>3} {t.state:<9} {lr:>9} {outcome:>10} {busy:>6}  {where}")


def med_max(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{median(values):.3f} / {max(values):.3f} s (n={len(values)})"


def table(sides: list[Side], stats: list[dict[str, Any]], args: argparse.Namespace) -> None:
    def best(side: Side) -> str:
        if side.best is None:
            return "-"
        return f"{side.best.value:.4f} (trial {side.best.number}, lr {side.best.params['lr']:.2e})"

    rows = [
        ("wall time", lambda s, x: f"{x['wall']:.2f} s"),
        (
            "trials complete / pruned / failed",
            lambda s, x: " / ".join(str(x["counts"][k]) for k in ("complete", "pruned", "fail")),
        ),
        ("utilisation (rank-s busy / workers x wall)", lambda s, x: f"{x['utilisation']:.1%}"),
        (
            f"ideal wall (busy s / {args.workers // args.workers_per_trial} at once)",
            lambda s, x: f"{x['ideal']:.2f} s",
        ),
        ("wall / ideal", lambda s, x: f"{x['wall'] / x['ideal']:.2f}x" if x["ideal"] else "-"),
        ("prune -> workers free, median / max", lambda s, x: med_max(x["prune_free"])),
        (
            "pruned step's report -> workers free, median / max",
            lambda s, x: med_max(x["report_free"]),
        ),
        (
            f"launch -> first record, median (incl. 1 epoch, {args.epoch_seconds} s)",
            lambda s, x: f"{median(x['to_first']):.3f} s",
        ),
        (
            "placed (running entry) -> first record, median (incl. 1 epoch)",
            lambda s, x: f"{median(x['placed_first']):.3f} s",
        ),
        (
            "trial end -> next first record on its workers, median (incl. 1 epoch)",
            lambda s, x: f"{median(x['gaps']):.3f} s (n={len(x['gaps'])})",
        ),
        ("best val_loss", lambda s, x: best(s)),
    ]
    names = [s.name for s in sides]
    print(f"\n| | {' | '.join(names)} |")
    print("| --- |" + " --- |" * len(names))
    for label, cell in rows:
        cells = [cell(s, x) for s, x in zip(sides, stats, strict=True)]
        print(f"| {label} | {' | '.join(cells)} |")
    by = {s.name: x for s, x in zip(sides, stats, strict=True)}
    print(
        f"\nratio ours/glue, wall time: {by['ours']['wall'] / by['glue']['wall']:.2f}x "
        "(below 1.0: ours is faster)"
    )


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=16, help="trials per side (16)")
    parser.add_argument("--workers", type=int, default=4, help="cluster workers (4)")
    parser.add_argument("--workers-per-trial", type=int, default=2, help="(2)")
    parser.add_argument("--epochs", type=int, default=8, help="epochs per trial (8)")
    parser.add_argument("--epoch-seconds", type=float, default=0.5, help="sleep per epoch (0.5)")
    parser.add_argument("--timeout", type=float, default=600, help="longest sweep, s (600)")
    args = parser.parse_args()
    if args.workers < args.workers_per_trial:
        parser.error("--workers must be at least --workers-per-trial")
    print(command_line())
    print(f"dask_ddp {git_commit()}")
    print(versions("dask", "distributed", "optuna"))
    print(time.strftime("%Y-%m-%d %H:%M %Z"), f"load average {os.getloadavg()[0]:.1f}")
    print(
        f"{args.workers} workers, {args.trials} trials of {args.workers_per_trial} workers, "
        f"{args.epochs} epochs of {args.epoch_seconds} s each"
    )
    with (
        LocalCluster(
            n_workers=args.workers, threads_per_worker=1, processes=True,
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        client.wait_for_workers(args.workers, timeout=300)
        # Warm up: every worker imports torch and starts its ranks once, untimed.
        warm = {"lr": 1e-3, "n_epochs": 1, "epoch_seconds": 0.0}
        dask_ddp.launch(client, epochs, kwargs=warm, workers=args.workers).result()
        sides = []
        for run in (run_ours, run_glue):
            time.sleep(1.0)
            sides.append(run(client, args))
        stats = [analyse(side, args) for side in sides]
        for side, x in zip(sides, stats, strict=True):
            print_trials(side, x)
        table(sides, stats, args)


if __name__ == "__main__":
    main()

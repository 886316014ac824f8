"""Sweeps (``dask_ddp.sweep``): a real Optuna study whose trials are jobs on real
LocalClusters: packing by the worker pool, pruning that stops every rank of a trial, failed
and restarted trials, a sweep that outlives its client, adaptive clusters, mixed sizes."""

from __future__ import annotations

import html
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import distributed
import optuna
import pytest
from distributed import Client, LocalCluster

import dask_ddp
from dask_ddp.errors import SweepParamsError

optuna.logging.set_verbosity(optuna.logging.WARNING)


def curve(
    lr: float, steps: int = 6, delay: float = 0.05, fail: bool = False,
    hang_after: int | None = None,
) -> dict:  # fmt: skip
    """A trial: ``val_loss = lr * (steps - step)``, one step per ``delay`` seconds (and a
    minute's sleep after step ``hang_after``); each rank says where it ran."""
    ctx = dask_ddp.get_context()
    for step in range(steps):
        if fail and step == 2:
            raise ValueError(f"trial with lr={lr} diverged")
        time.sleep(delay)
        dask_ddp.report({"val_loss": lr * (steps - step)}, step=step)
        if step == hang_after:
            time.sleep(60)
    return {"rank": ctx.rank, "world": ctx.world_size}


def lr_params(trial: optuna.Trial) -> dict[str, Any]:
    return {"lr": trial.suggest_float("lr", 0.1, 1.0)}


def _pruning_study(**kwargs: Any) -> optuna.Study:
    return optuna.create_study(
        pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=1), **kwargs
    )


def test_a_prune_stops_every_rank_and_the_next_trial_takes_its_workers(client: Client) -> None:
    # The first trial's values are the lowest: every later one is worse at step 1 and is
    # pruned there, with both its ranks stopped (they would sleep a minute there), and the
    # next trial runs on the two workers it freed.
    study = _pruning_study()
    for lr in (0.1, 0.9, 0.8, 0.7):
        study.enqueue_trial({"lr": lr})
    sweep = dask_ddp.sweep(
        client, curve, study, lambda t: {**lr_params(t), "hang_after": 1 if t.number else None},
        n_trials=4, workers_per_trial=2, metric="val_loss",
    )  # fmt: skip
    started = time.monotonic()
    best = sweep.result(timeout=120)
    took = time.monotonic() - started
    assert best.number == 0 and best.value == pytest.approx(0.1 * 1)  # its last step's value
    assert [t.state for t in sweep.trials] == ["complete", "pruned", "pruned", "pruned"]
    assert [t.pruned_at for t in sweep.trials[1:]] == [1, 1, 1]
    assert took < 60  # each pruned trial's ranks would have slept a minute
    jobs = sweep.jobs
    for number in (1, 2, 3):
        job = jobs[number]
        assert job.state.value == "cancelled" and job.wait_stopped(10)
        assert "pruned at step 1" in job.history[-1].reason
    assert set(jobs[1].workers) == set(jobs[2].workers) == set(client.scheduler_info()["workers"])
    # The study holds what the sweep told it: intermediate values, states, the objective.
    frozen = sweep.study.trials
    assert [t.state.name for t in frozen] == ["COMPLETE", "PRUNED", "PRUNED", "PRUNED"]
    # Each trial was asked for once the one before it no longer waited for workers (the
    # pool's next), not all at once.
    trials = sweep.trials
    for n in (1, 2, 3):
        assert frozen[n].datetime_start.timestamp() >= trials[n - 1].started - 0.05
    assert frozen[0].intermediate_values == {s: pytest.approx(0.1 * (6 - s)) for s in range(6)}


def test_a_trial_that_raises_fails_and_the_sweep_goes_on(client: Client) -> None:
    sweep = dask_ddp.sweep(
        client, curve, optuna.create_study(),
        lambda t: {**lr_params(t), "fail": t.number == 1},
        n_trials=3, metric="val_loss",
    )  # fmt: skip
    best = sweep.result(timeout=120)
    states = [t.state for t in sweep.trials]
    assert states == ["complete", "fail", "complete"]
    assert "ValueError: trial with lr=" in sweep.trials[1].error
    assert best.number in (0, 2)
    failed = sweep.study.trials[1]
    assert failed.state.name == "FAIL" and "diverged" in failed.user_attrs["dask_ddp_error"]


def test_a_returned_number_is_the_objective(client: Client) -> None:
    def returns(lr: float) -> float:
        dask_ddp.report({"val_loss": 100.0}, step=0)
        return lr * 2

    sweep = dask_ddp.sweep(
        client, returns, optuna.create_study(direction="maximize"), lr_params,
        n_trials=2, metric="val_loss",
    )  # fmt: skip
    best = sweep.result(timeout=120)
    assert best.value == pytest.approx(best.params["lr"] * 2)
    assert sweep.study.direction.name == "MAXIMIZE"


def test_params_that_fail_stop_the_sweep_naming_the_trial(client: Client) -> None:
    def params(trial: optuna.Trial) -> dict[str, Any]:
        if trial.number == 1:
            raise KeyError("lr")
        return lr_params(trial)

    sweep = dask_ddp.sweep(
        client, curve, optuna.create_study(), params, n_trials=4, metric="val_loss"
    )
    with pytest.raises(SweepParamsError, match="trial 1: KeyError: 'lr'"):
        sweep.result(timeout=120)
    assert sweep.state == "failed"
    assert all(t.final for t in sweep.trials)
    # The first trial's params fail at once: sweep() itself raises, and nothing runs.
    with pytest.raises(SweepParamsError, match="trial 0"):
        dask_ddp.sweep(client, curve, optuna.create_study(), lambda t: 1, n_trials=1,
                       metric="val_loss")  # fmt: skip


def test_bad_arguments_are_refused_before_anything_runs(client: Client) -> None:
    study = optuna.create_study()
    for kwargs, error, match in (
        ({"n_trials": 0}, ValueError, "n_trials"),
        ({"workers_per_trial": 0}, ValueError, "workers_per_trial"),
        ({"metric": ""}, ValueError, "metric"),
    ):
        args = {"n_trials": 1, "metric": "val_loss", **kwargs}
        with pytest.raises(error, match=match):
            dask_ddp.sweep(client, curve, study, lr_params, **args)
    with pytest.raises(TypeError, match=r"optuna\.Study"):
        dask_ddp.sweep(client, curve, "study", lr_params, n_trials=1, metric="val_loss")
    with pytest.raises(ValueError, match="one metric"):
        dask_ddp.sweep(
            client, curve, optuna.create_study(directions=["minimize", "maximize"]),
            lr_params, n_trials=1, metric="val_loss",
        )  # fmt: skip
    with pytest.raises(dask_ddp.errors.PlacementError):
        dask_ddp.sweep(client, curve, study, lr_params, n_trials=1, workers_per_trial=3,
                       metric="val_loss")  # fmt: skip
    assert study.trials == []


def test_the_sweep_outlives_its_client_and_attach_reads_the_best(
    client: Client, cluster: LocalCluster
) -> None:
    storage = optuna.storages.InMemoryStorage()
    with Client(cluster) as launching:
        dask_ddp.sweep(
            launching, curve, optuna.create_study(storage=storage), lr_params,
            n_trials=4, metric="val_loss", name="outlives", kwargs={"delay": 0.3},
        )  # fmt: skip
    # The launching client is gone; the sweep goes on in the cluster.
    sweep = dask_ddp.attach(client, "outlives")
    assert isinstance(sweep, dask_ddp.Sweep)
    assert isinstance(dask_ddp.attach(client, sweep.sweep_id), dask_ddp.Sweep)
    # A sweep without name= is named after its function: that name still finds its jobs.
    unnamed = dask_ddp.sweep(client, curve, optuna.create_study(), lr_params, n_trials=1,
                             metric="val_loss")  # fmt: skip
    unnamed.result(timeout=60)
    dask_ddp.launch(client, curve, kwargs={"lr": 0.1}).result(timeout=60)
    assert isinstance(dask_ddp.attach(client, "curve"), dask_ddp.Job)
    best = sweep.result(timeout=120)
    assert [t.state for t in sweep.trials] == ["complete"] * 4
    assert best.value == min(t.value for t in sweep.trials)
    assert len(sweep.study.trials) == 4 and sweep.study.best_trial.number == best.number
    assert storage.get_all_trials(0) == []  # an in-memory study was a copy on the scheduler


def test_a_durable_study_is_shared_with_the_scheduler(client: Client, tmp_path: Path) -> None:
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "journal.log"))
    )
    study = optuna.create_study(study_name="shared", storage=storage)
    sweep = dask_ddp.sweep(client, curve, study, lr_params, n_trials=2, metric="val_loss")
    best = sweep.result(timeout=120)
    again = optuna.load_study(study_name="shared", storage=storage)
    assert len(again.trials) == 2 and again.best_trial.number == best.number
    assert len(study.trials) == 2  # not copied twice


def test_trials_of_different_sizes_share_one_cluster(client: Client) -> None:
    wide = dask_ddp.sweep(
        client, curve, optuna.create_study(), lr_params, n_trials=3, workers_per_trial=2,
        metric="val_loss", name="wide",
    )  # fmt: skip
    narrow = dask_ddp.sweep(
        client, curve, optuna.create_study(), lr_params, n_trials=4, workers_per_trial=1,
        metric="val_loss", name="narrow",
    )  # fmt: skip
    wide.result(timeout=180)
    narrow.result(timeout=180)
    assert [t.state for t in wide.trials] == ["complete"] * 3
    assert [t.state for t in narrow.trials] == ["complete"] * 4
    assert {j.world_size for j in wide.jobs.values()} == {2}
    assert {j.world_size for j in narrow.jobs.values()} == {1}


def test_launch_s_options_reach_each_trial(client: Client, tmp_path: Path) -> None:
    # ranks_per_worker, backend and checkpoint_dir (a prefix: a directory per trial) are
    # each trial's job's.
    def ranks(lr: float) -> dict:
        ctx = dask_ddp.get_context()
        dask_ddp.save_checkpoint({"lr": lr}, step=0)
        dask_ddp.report({"val_loss": lr}, step=0)
        return {"world": ctx.world_size, "local": ctx.local_world_size, "backend": ctx.backend}

    sweep = dask_ddp.sweep(
        client, ranks, optuna.create_study(), lr_params, n_trials=2, metric="val_loss",
        ranks_per_worker=2, backend="gloo", checkpoint_dir=str(tmp_path),
    )  # fmt: skip
    sweep.result(timeout=120)
    for t in sweep.trials:
        assert sweep.jobs[t.number].result() == [{"world": 2, "local": 2, "backend": "gloo"}] * 2
        assert t.value == pytest.approx(t.params["lr"])
        assert (tmp_path / f"trial-{t.number:04d}").is_dir()


def test_cancel_stops_the_running_trials(client: Client) -> None:
    sweep = dask_ddp.sweep(
        client, curve, optuna.create_study(), lr_params, n_trials=10, metric="val_loss",
        kwargs={"delay": 10.0},
    )  # fmt: skip
    sweep.cancel("enough")
    assert sweep.state == "cancelled"
    with pytest.raises(dask_ddp.JobCancelledError, match="enough"):
        sweep.result(timeout=10)
    assert all(t.state == "fail" for t in sweep.trials) and len(sweep.trials) <= 3


def resumable(lr: float, kill: bool, steps: int = 8) -> dict:
    """Checkpoints every other step; the trial told to ``kill`` kills its worker after it
    reported step 4 of its first attempt, and resumes from step 3's checkpoint (so that
    it reports step 4 again)."""
    state = dask_ddp.get_checkpoint()
    start = 0 if state is None else state["step"] + 1
    ctx = dask_ddp.get_context()
    for step in range(start, steps):
        time.sleep(0.05)
        dask_ddp.report({"val_loss": lr * (steps - step)}, step=step)
        if step % 2 == 1:
            dask_ddp.save_checkpoint({"step": step}, step=step)
        if kill and ctx.attempt == 0 and step == 4:
            time.sleep(0.5)  # the record of step 4 goes out first
            os.kill(distributed.get_worker().pid, signal.SIGKILL)
            time.sleep(60)
    return {"attempt": ctx.attempt, "start": start}


@pytest.mark.slow
def test_a_worker_lost_mid_trial_restarts_it_from_its_checkpoint(
    own_cluster: LocalCluster, tmp_path: Path
) -> None:
    with Client(own_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        sweep = dask_ddp.sweep(
            client, resumable, optuna.create_study(),
            lambda t: {**lr_params(t), "kill": t.number == 0},
            n_trials=3, metric="val_loss", checkpoint_dir=str(tmp_path),
        )  # fmt: skip
        sweep.result(timeout=180)
        trials = sweep.trials
        assert [t.state for t in trials] == ["complete"] * 3
        assert trials[0].attempts == 2 and trials[0].value == pytest.approx(
            trials[0].params["lr"] * 1
        )
        restarted = sweep.jobs[0]
        assert restarted.result()[0] == {"attempt": 1, "start": 4}
        assert (tmp_path / "trial-0000").is_dir() and (tmp_path / "trial-0002").is_dir()
        # The study saw each step once, with its value: step 4, trained again after the
        # restart, is not reported twice.
        lr = trials[0].params["lr"]
        values = sweep.study.trials[0].intermediate_values
        assert values == {s: pytest.approx(lr * (8 - s)) for s in range(8)}


@pytest.mark.slow
def test_an_adaptive_cluster_grows_for_a_sweep() -> None:
    with _cluster(0) as cluster, Client(cluster) as client:
        cluster.adapt(minimum=0, maximum=2, interval="200ms")
        seen: set[str] = set()
        sweep = dask_ddp.sweep(
            client, curve, optuna.create_study(), lr_params, n_trials=4, metric="val_loss",
            kwargs={"delay": 0.5},
        )  # fmt: skip
        while not sweep.wait(0.2):
            seen |= set(client.scheduler_info()["workers"])
        sweep.result()
        assert len(seen) >= 2
        workers = {w for j in sweep.jobs.values() for w in j.workers}
        assert len(workers) == 2  # trials ran side by side on the workers it grew


def test_the_page_groups_a_sweep_s_trials(client: Client) -> None:
    study = _pruning_study()
    for lr in (0.2, 0.9, 0.1):
        study.enqueue_trial({"lr": lr})
    sweep = dask_ddp.sweep(
        client, curve, study,
        lambda t: {**lr_params(t), "hang_after": 1 if t.number == 1 else None},
        n_trials=3, workers_per_trial=2, metric="val_loss", name="paged",
    )  # fmt: skip
    sweep.result(timeout=120)
    base = client.dashboard_link.rsplit("/status", 1)[0] + "/ddp/"

    def get(path: str) -> str:
        with urllib.request.urlopen(base + path, timeout=10) as response:
            return response.read().decode()

    row = next(r for r in json.loads(get("api/sweeps"))["sweeps"] if r["sweep"] == sweep.sweep_id)
    assert (row["name"], row["state"], row["n_trials"]) == ("paged", "succeeded", 3)
    assert (row["complete"], row["pruned"], row["fail"], row["best_trial"]) == (2, 1, 0, 2)
    assert row["best_value"] == pytest.approx(0.1)
    listing = get("")
    assert f"sweeps/{sweep.sweep_id}" in listing
    trial_jobs = {t.job_id for t in sweep.trials}
    assert not any(f"jobs/{job}" in listing for job in trial_jobs)  # on the sweep's page
    page = html.unescape(get(f"sweeps/{sweep.sweep_id}"))
    assert all(f"../jobs/{job}" in page for job in trial_jobs)
    assert "pruned at step 1" in page and "trial 2" in page and "<svg" in page
    assert "data-final" in get(f"sweeps/{sweep.sweep_id}/view")
    state = json.loads(get(f"api/sweeps/{sweep.sweep_id}"))
    assert [t["state"] for t in state["trials"]] == ["complete", "pruned", "complete"]
    # dask_ddp.jobs names each trial's sweep; the notebook draws the same table.
    listed = {j.job_id: j.sweep for j in dask_ddp.jobs(client)}
    assert {listed[job] for job in trial_jobs} == {sweep.sweep_id}
    notebook = html.unescape(sweep._repr_html_())
    assert "3 of 3 trials done; best: trial 2" in notebook and "pruned at step 1" in notebook


def held_at_3(lr: float, go: str, steps: int = 6) -> dict:
    """Checkpoints each step and waits at step 3 until ``go`` exists; where it started."""
    state = dask_ddp.get_checkpoint()
    start = 0 if state is None else state["step"] + 1
    for step in range(start, steps):
        dask_ddp.report({"val_loss": lr * (steps - step)}, step=step)
        dask_ddp.save_checkpoint(
            {"step": step},
            step=step,
        ).wait()
        while step == 3 and not os.path.exists(go):
            time.sleep(0.05)
    return {"start": start}


def _until_held(sweep: dask_ddp.Sweep) -> None:
    """Wait until the sweep's first two trials wait at step 3 (``held_at_3``)."""
    deadline = time.monotonic() + 60
    while [t.step for t in sweep.trials[:2]] != [3, 3]:
        assert time.monotonic() < deadline, sweep.trials
        time.sleep(0.1)


def _cluster(n_workers: int) -> LocalCluster:
    return LocalCluster(
        n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0"
    )


@pytest.mark.slow
def test_a_named_sweep_resumes_its_durable_study_after_its_scheduler_went(
    tmp_path: Path,
) -> None:
    # A sweep on a JournalStorage file: its first cluster closes (scheduler and all) while
    # two trials wait at step 3 and the third waits for a worker. The same call on a new
    # cluster resumes the study: the three cut-off trials run again, each from its own
    # checkpoint (the third had none).
    journal = str(tmp_path / "journal.log")
    go = tmp_path / "go"

    def run(client: Client) -> dask_ddp.Sweep:
        storage = optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(journal)
        )
        study = optuna.create_study(study_name="resumed", storage=storage, load_if_exists=True)
        return dask_ddp.sweep(
            client, held_at_3, study, lr_params, n_trials=3, metric="val_loss", name="resumed",
            kwargs={"go": str(go)}, checkpoint_dir=str(tmp_path / "ckpt"),
        )  # fmt: skip

    with _cluster(2) as cluster, Client(cluster) as client:
        _until_held(run(client))
    go.touch()
    with _cluster(2) as cluster, Client(cluster) as client:
        again = run(client)
        best = again.result(timeout=120)
        assert again.resumed == (0, 3)
        trials = again.trials
        assert [t.state for t in trials] == ["complete"] * 3
        starts = sorted(again.jobs[t.number].result()[0]["start"] for t in trials)
        assert starts == [0, 4, 4]  # the two cut off resumed after step 3's checkpoint
    study = optuna.load_study(
        study_name="resumed",
        storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(journal)),
    )
    states = [t.state.name for t in study.trials]
    assert states == ["FAIL"] * 3 + ["COMPLETE"] * 3, states
    assert {t.user_attrs["dask_ddp_runs_again"] for t in study.trials[3:]} == {0, 1, 2}
    for t in study.trials[3:]:
        assert t.params == study.trials[t.user_attrs["dask_ddp_runs_again"]].params
    assert best.number == study.best_trial.number


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="needs Debian's chromium package")
def test_the_sweep_s_page_in_a_real_browser(client: Client, tmp_path: Path) -> None:
    """Headless Chromium follows a sweep's page live: its long poll redraws the trials as
    they go on, until the sweep ends and the script stops asking (then the browser hands
    over the DOM it drew, saved under artifacts/)."""
    go = tmp_path / "go"
    sweep = dask_ddp.sweep(
        client, held_at_3, optuna.create_study(), lr_params, n_trials=3, metric="val_loss",
        name="browsed", kwargs={"go": str(go)}, checkpoint_dir=str(tmp_path / "ckpt"),
    )  # fmt: skip
    _until_held(sweep)
    url = client.dashboard_link.rsplit("/status", 1)[0] + f"/ddp/sweeps/{sweep.sweep_id}"
    browser = subprocess.Popen(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000",
         "--dump-dom", url],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        time.sleep(2)  # the page loaded, its first request waits for a change
        assert browser.poll() is None, "the browser stopped while the sweep ran"
        go.touch()
        dom, _ = browser.communicate(timeout=120)
    finally:
        browser.kill()
        go.touch()
    sweep.result(timeout=120)
    artifacts = Path(os.environ.get("DASK_DDP_ARTIFACTS", Path(__file__).parents[1] / "artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    (artifacts / "dashboard-sweep.html").write_text(dom)
    assert "dask_ddp sweep browsed" in dom and "3 of 3 trials done" in dom, dom[-2000:]
    assert "succeeded" in dom and "data-final" in dom and "<svg" in dom

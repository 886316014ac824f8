"""The /ddp/ page on the cluster's own dashboard, over real HTTP from a real scheduler."""

from __future__ import annotations

import contextlib
import html
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dask.utils import key_split
from distributed import Client, Event

import dask_ddp
from dask_ddp import DashboardUnavailableWarning, view

ARTIFACTS = Path(os.environ.get("DASK_DDP_ARTIFACTS", Path(__file__).parent.parent / "artifacts"))


def _train(steps: int, pause_at: int | None = None) -> int:
    ctx = dask_ddp.get_context()
    go = Event("dask-ddp-test-dashboard-go") if pause_at is not None else None
    for step in range(steps):
        dask_ddp.report({"loss": 2.3 / (1 + step), "lr": 0.1}, step=step)
        if step == pause_at:
            go.wait(120)
    return ctx.rank


def _base(client: Client) -> str:
    return client.dashboard_link.rsplit("/status", 1)[0] + "/ddp/"


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _until(check: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Ask ``check`` until it returns something true: the page is fed once a second, and
    HTTP has no way to wait for a change."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _job_json(client: Client, job_id: str) -> dict[str, Any] | None:
    status, body = _get(_base(client) + f"api/jobs/{job_id}")
    return json.loads(body) if status == 200 else None


@pytest.fixture
def paused_job(client: Client) -> Iterator[dask_ddp.Job]:
    """A 2-rank job that reports steps 0..9, then waits for the test's go."""
    go = Event("dask-ddp-test-dashboard-go", client=client)
    go.clear()
    job = dask_ddp.launch(client, _train, (20, 9))
    try:
        yield job
    finally:
        go.set()
        job.result(timeout=120)


def test_the_page_shows_a_running_job_then_its_end(client: Client, paused_job: dask_ddp.Job):
    job = paused_job
    running = _until(
        lambda: (
            (j := _job_json(client, job.job_id)) and all(r["step"] == 9 for r in j["ranks"]) and j
        )
    )
    assert running, "the running job's ranks never reached step 9 on the page"
    assert running["state"] == "running"
    assert [r["rank"] for r in running["ranks"]] == [0, 1]
    assert sorted(r["worker"] for r in running["ranks"]) == sorted(job.workers)
    assert running["name"] == "_train"
    assert "@" in running["launched_by"] and running["client"] == client.id
    assert running["ranks"][0]["last"]["loss"] == pytest.approx(2.3 / 10)
    assert len(running["ranks"][0]["curve"]) >= 2

    status, page = _get(_base(client))
    assert status == 200 and job.job_id in page and "running" in page
    status, listing = _get(_base(client) + "api/jobs")
    row = next(r for r in json.loads(listing)["jobs"] if r["job"] == job.job_id)
    assert row["state"] == "running" and row["ranks"] == 2 and row["step"] == 9
    status, page = _get(_base(client) + f"jobs/{job.job_id}")
    assert status == 200 and "<svg" in page and "rank 1" in page and "fetch(" in page

    Event("dask-ddp-test-dashboard-go", client=client).set()
    assert job.result(timeout=120) == [0, 1]
    done = _until(lambda: (j := _job_json(client, job.job_id)) and j["state"] != "running" and j)
    assert done["state"] == "succeeded"
    assert [r["step"] for r in done["ranks"]] == [19, 19]
    status, view = _get(_base(client) + f"jobs/{job.job_id}/view")
    assert "data-final" in view  # the page stops refreshing


def test_a_job_that_does_not_exist_is_a_404_that_says_so(client: Client):
    dask_ddp.launch(client, _train, (2,)).result(timeout=120)  # the plugin is installed
    status, page = _get(_base(client) + "jobs/0123456789ab")
    assert status == 404
    assert "No dask-ddp job '0123456789ab' on this cluster" in html.unescape(page)
    status, body = _get(_base(client) + "api/jobs/0123456789ab")
    assert status == 404 and "No dask-ddp job" in json.loads(body)["error"]


def test_prometheus_gauges(client: Client, paused_job: dask_ddp.Job):
    pytest.importorskip("prometheus_client")
    job = paused_job
    assert _until(lambda: (j := _job_json(client, job.job_id)) and j["ranks"][0]["step"] == 9)
    status, text = _get(client.dashboard_link.rsplit("/status", 1)[0] + "/metrics")
    assert status == 200
    assert 'dask_ddp_jobs{state="running"}' in text
    assert f'dask_ddp_ranks{{job="{job.job_id}"}} 2.0' in text
    assert f'dask_ddp_step{{job="{job.job_id}",rank="1"}} 9.0' in text
    assert f'dask_ddp_step_rate{{job="{job.job_id}",rank="0"}}' in text


def test_rank_tasks_are_named_after_the_job_and_rank(client: Client):
    job = dask_ddp.launch(client, _train, (2,))
    job.result(timeout=120)
    names = [key_split(f.key) for f in job.futures]
    assert names == [f"ddp_train_{job.job_id[:6]}_rank{r}" for r in range(2)]
    prefixes = client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.task_prefixes))
    assert set(names) <= set(prefixes)


def test_the_page_works_with_the_dashboard_turned_off_for_jobs(client: Client):
    import dask

    with dask.config.set({"ddp.dashboard.enabled": False}):
        job = dask_ddp.launch(client, _train, (2,))
        job.result(timeout=120)
    assert _job_json(client, job.job_id) is None


def _scheduler(tmp_path: Path, *preload: str, **env: str) -> tuple[subprocess.Popen, str]:
    """A real `dask scheduler` process with ``preload`` modules and ``env``; its file."""
    file = tmp_path / "scheduler.json"
    cmd = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
           "--port", "0", "--dashboard-address", ":0", "--scheduler-file", str(file)]  # fmt: skip
    for p in preload:
        cmd += ["--preload", p]
    proc = subprocess.Popen(
        cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while not file.exists() or not file.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the scheduler did not start")
        time.sleep(0.1)
    return proc, str(file)


@contextlib.contextmanager
def _cluster(tmp_path: Path, *preload: str, **env: str) -> Iterator[Client]:
    """A scheduler process and two worker processes, and a client of them."""
    scheduler, file = _scheduler(tmp_path, *preload, **env)
    workers = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file", file,
         "--nworkers", "2", "--nthreads", "1", "--no-dashboard"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with Client(scheduler_file=file) as client:
            client.wait_for_workers(2, timeout=60)
            yield client
    finally:
        workers.terminate()
        scheduler.terminate()
        workers.wait(30)
        scheduler.wait(30)


@pytest.mark.slow
def test_a_scheduler_that_refuses_plugins_still_trains_with_one_warning(tmp_path: Path):
    """A locked-down scheduler (``distributed.scheduler.blocked-handlers``, what a hosted
    cluster may set): jobs train; the user is told once that there is no page."""

    def train() -> int:  # defined here: pickled by value (the scheduler cannot import tests)
        dask_ddp.report({"loss": 1.0}, step=0)
        return dask_ddp.get_context().rank

    blocked = {"DASK_DISTRIBUTED__SCHEDULER__BLOCKED_HANDLERS": '["register_scheduler_plugin"]'}
    with _cluster(tmp_path, **blocked) as client:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = dask_ddp.launch(client, train).result(timeout=120)
            second = dask_ddp.launch(client, train).result(timeout=120)
        assert first == second == [0, 1]
        shown = [w for w in caught if issubclass(w.category, DashboardUnavailableWarning)]
        assert len(shown) == 1
        assert "register_scheduler_plugin" in str(shown[0].message)  # what refused it
        assert "/ddp/" in str(shown[0].message)
        assert shown[0].filename == __file__  # points at the user's launch() line
        status, _ = _get(client.dashboard_link.rsplit("/status", 1)[0] + "/ddp/")
        assert status == 404


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="needs Debian's chromium package")
def test_the_page_in_a_real_browser(client: Client, paused_job: dask_ddp.Job, tmp_path: Path):
    """Headless Chromium loads the job's page while the job runs; the screenshot and the
    DOM it drew are saved under artifacts/."""
    job = paused_job
    assert _until(lambda: (j := _job_json(client, job.job_id)) and j["ranks"][0]["step"] == 9)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard-job.png"
    shot.unlink(missing_ok=True)
    url = _base(client) + f"jobs/{job.job_id}"
    common = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000"]  # fmt: skip
    subprocess.run(
        [*common, f"--screenshot={shot}", "--window-size=1000,700", url],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    dom = subprocess.run(
        [*common, "--dump-dom", url], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    (ARTIFACTS / "dashboard-job.html").write_text(dom)
    assert shot.stat().st_size > 5000  # a PNG with something drawn
    assert f"dask_ddp job {job.job_id}" in dom and "<svg" in dom and "step 9" in dom


@pytest.mark.slow
def test_the_scheduler_preload_serves_the_page_and_a_labextension_panel(tmp_path: Path):
    """`dask scheduler --preload dask_ddp.dashboard`: the page is there before any job, and
    /individual-plots.json lists the Bokeh panel that dask-labextension shows."""
    pytest.importorskip("bokeh")
    with _cluster(tmp_path, "dask_ddp.dashboard") as client:
        root = client.dashboard_link.rsplit("/status", 1)[0]
        status, page = _get(root + "/ddp/")
        assert status == 200 and "No dask-ddp job has run on this cluster yet" in page
        status, plots = _get(root + "/individual-plots.json")
        assert json.loads(plots)["Individual Ddp Jobs"] == "/individual-ddp-jobs"
        status, panel = _get(root + "/individual-ddp-jobs")
        assert status == 200 and "bokeh" in panel.lower()

        def train() -> int:
            dask_ddp.report({"loss": 1.0}, step=0)
            return dask_ddp.get_context().rank

        with warnings.catch_warnings():
            warnings.simplefilter("error", DashboardUnavailableWarning)
            job = dask_ddp.launch(client, train)
            assert job.result(timeout=120) == [0, 1]
        assert _until(lambda: (j := _job_json(client, job.job_id)) and j["state"] == "succeeded")


@pytest.mark.skipif(_chromium() is None, reason="needs Debian's chromium package")
@pytest.mark.parametrize(
    ("theme", "background", "text"),
    [("light", "#ffffff", "#000000"), ("dark", "#111111", "#e0e0e0")],
)
def test_the_view_reads_in_light_and_dark_themes(
    theme: str, background: str, text: str, tmp_path: Path
) -> None:
    """The view's curve takes the surrounding text colour (as JupyterLab's themes set it):
    drawn in headless Chromium on each theme's colours, its tick labels are there to read,
    not black on black."""
    from PIL import Image

    ranks = [
        {"rank": r, "worker": f"tcp://10.0.0.{r}:1", "status": "pending", "activity": "",
         "count": 50, "step": 49, "last": {"loss": 0.01}, "rate": 10.0, "step_rate": 10.0,
         "error": None, "curve": [(float(s), 2.3 / (1 + s) ** 2) for s in range(50)]}
        for r in range(2)
    ]  # fmt: skip
    snap = {"job": "3f2a9c1b2d4e", "state": "running", "waiting": None, "total": 100,
            "backend": "gloo", "elapsed": 5.0, "records": 100, "ranks": ranks,
            "metric": "loss", "error": None, "notes": [], "output": []}  # fmt: skip
    page = tmp_path / f"view-{theme}.html"
    page.write_text(
        f"<html><head><meta charset='utf-8'></head>"
        f"<body style='margin:0;background:{background};color:{text}'>"
        f"{view.render_html(snap)}</body></html>"
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"view-{theme}.png"
    subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
         "--window-size=700,400", page.as_uri()],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    image = Image.open(shot).convert("L")
    svg_top = 12 + 22 * 3  # below the title and the two rank rows
    ticks = image.crop((0, svg_top, 50, svg_top + 140))  # the y tick labels' column
    want = Image.new("L", (1, 1), text).getpixel((0, 0))
    counts = ticks.histogram()  # pixels per grey level
    near_text = sum(counts[max(0, want - 60) : want + 60])
    assert near_text > 30, f"no {theme} tick labels in the text colour: {shot}"


def test_the_scheduler_keeps_a_capped_summary_of_the_last_jobs() -> None:
    """Scheduler memory stays bounded: the latest summary of the last max-jobs jobs (the
    oldest finished one goes first), curves thinned, no printed output."""
    from dask_ddp._dashboard import DashboardPlugin

    plugin = DashboardPlugin(max_jobs=3)
    for i in range(5):
        rank = {"rank": 0, "step": 4999, "step_rate": 10.0, "error": "x" * 100_000,
                "last": {f"m{k}": float(k) for k in range(100)},
                "curve": [(float(s), 1.0 / (s + 1)) for s in range(5000)]}  # fmt: skip
        state = "running" if i == 0 else "succeeded"
        plugin.update(
            {"job": f"job{i}", "state": state, "ranks": [rank], "metric": "m1",
             "notes": ["n"] * 500, "output": ["line"] * 1000},
            client="Client-1",
        )  # fmt: skip
    assert list(plugin.jobs) == ["job0", "job3", "job4"]  # the running one is kept
    kept = plugin.jobs["job4"]
    assert "output" not in kept and len(kept["notes"]) == 20
    assert len(kept["ranks"][0]["curve"]) <= 201 and len(kept["ranks"][0]["last"]) == 16
    assert len(kept["ranks"][0]["error"]) == 20_000
    assert [r["job"] for r in plugin.rows()] == ["job4", "job3", "job0"]
    assert plugin.rows()[0]["client"] == "Client-1" and plugin.rows()[0]["value"] == 1.0
    plugin.update({"job": "job5", "ranks": "not a list"}, client="Client-2")  # bad input
    plugin.update("not a summary", client="Client-2")
    assert list(plugin.jobs) == ["job0", "job3", "job4"]  # ignored, nothing lost


def test_the_bokeh_panel_draws_the_jobs_and_the_running_one() -> None:
    """The panel's document, built as the scheduler's Bokeh server builds it: the list of
    jobs and the running job drawn as the notebook draws it, refreshed every second."""
    pytest.importorskip("bokeh")
    from bokeh.document import Document

    from dask_ddp import dashboard
    from dask_ddp._dashboard import PLUGIN_NAME, DashboardPlugin

    plugin = DashboardPlugin(max_jobs=10)
    rank = {"rank": 0, "worker": "tcp://10.0.0.1:1", "status": "running", "activity": "",
            "count": 3, "step": 2, "last": {"loss": 0.5}, "rate": 1.0, "step_rate": 1.0,
            "error": None, "curve": [(0.0, 1.0), (1.0, 0.7), (2.0, 0.5)]}  # fmt: skip
    for job, state in (("aaaaaaaaaaaa", "succeeded"), ("bbbbbbbbbbbb", "running")):
        plugin.update(
            {"job": job, "state": state, "ranks": [rank], "metric": "loss", "notes": [],
             "backend": "gloo", "elapsed": 3.0, "records": 3, "total": None, "error": None},
            client="Client-1",
        )  # fmt: skip

    class Scheduler:
        plugins = {PLUGIN_NAME: plugin}

    doc = Document()
    dashboard._panel(Scheduler(), {"prefix": "/"}, doc)
    text = doc.roots[0].text
    assert "aaaaaaaaaaaa" in text and "dask_ddp job bbbbbbbbbbbb</b>: running" in text
    assert "<svg" in text and "href='/ddp/jobs/aaaaaaaaaaaa'" in text
    assert doc.title == "dask-ddp jobs" and doc.session_callbacks  # refreshed while open

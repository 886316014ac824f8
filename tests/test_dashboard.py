"""The /ddp/ page on the cluster's own dashboard, over real HTTP from a real scheduler: it
reads each job's supervisor there, whoever launched the job."""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dask.utils import key_split
from distributed import Client, Event

import dask_ddp
from dask_ddp._shared import view

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
    """Ask ``check`` until it returns something true: HTTP has no way to wait for a change."""
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
    # both ranks: the ranks report on their own, rank 1 may still be at step 8 when rank 0 is at 9
    assert _until(
        lambda: (j := _job_json(client, job.job_id)) and all(r["step"] == 9 for r in j["ranks"])
    )
    status, text = _get(client.dashboard_link.rsplit("/status", 1)[0] + "/metrics")
    assert status == 200
    assert 'dask_ddp_jobs{state="running"}' in text
    assert f'dask_ddp_ranks{{job="{job.job_id}"}} 2.0' in text
    assert f'dask_ddp_step{{job="{job.job_id}",rank="1"}} 9.0' in text
    assert f'dask_ddp_step_rate{{job="{job.job_id}",rank="0"}}' in text


def _prefixes(dask_scheduler: Any = None) -> list[str]:
    return list(dask_scheduler.task_prefixes)


def test_rank_tasks_share_one_prefix_per_function(client: Client):
    # The task stream and progress bars say the function; the scheduler's per-prefix
    # state (and its Prometheus series) stays the same however many jobs run.
    job = dask_ddp.launch(client, _train, (2,))
    job.result(timeout=120)
    assert [key_split(f.key) for f in job.futures] == ["ddp_train", "ddp_train"]
    assert [f.key for f in job.futures] == [f"ddp_train-rank{r}-{job.job_id}" for r in (0, 1)]
    before = set(client.run_on_scheduler(_prefixes))
    assert "ddp_train" in before
    for _ in range(3):
        dask_ddp.launch(client, _train, (2,)).result(timeout=120)
    assert set(client.run_on_scheduler(_prefixes)) == before


def test_the_plugin_runs_jobs_without_pages_when_they_are_turned_off(own_cluster):
    import dask

    with dask.config.set({"ddp.dashboard.enabled": False}), Client(own_cluster) as client:
        job = dask_ddp.launch(client, _train, (2,))  # installs the plugin, without pages
        assert job.result(timeout=120) == [0, 1]
        status, _ = _get(_base(client))
        assert status == 404
        assert [j.job_id for j in dask_ddp.jobs(client)] == [job.job_id]


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
def test_a_scheduler_that_refuses_plugins_needs_the_preload(tmp_path: Path):
    """A locked-down scheduler (``distributed.scheduler.blocked-handlers``, what a hosted
    cluster may set) cannot take the plugin at run time: launch() says so and how to fix
    it; started with ``--preload dask_ddp`` it runs jobs."""

    def train() -> int:  # defined here: pickled by value (the scheduler cannot import tests)
        dask_ddp.report({"loss": 1.0}, step=0)
        return dask_ddp.get_context().rank

    blocked = {"DASK_DISTRIBUTED__SCHEDULER__BLOCKED_HANDLERS": '["register_scheduler_plugin"]'}
    with _cluster(tmp_path, **blocked) as client:
        refused = pytest.raises(
            dask_ddp.errors.SchedulerPluginError, match="register_scheduler_plugin"
        )
        with refused as info:
            dask_ddp.launch(client, train)
        assert "--preload dask_ddp" in str(info.value)
        assert client.run(lambda: 1)  # the cluster is untouched
    with _cluster(tmp_path, "dask_ddp", **blocked) as client:
        assert dask_ddp.launch(client, train).result(timeout=120) == [0, 1]
        status, page = _get(_base(client))
        assert status == 200 and "_train" not in page and "train" in page


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="needs Debian's chromium package")
def test_the_page_in_a_real_browser(client: Client, paused_job: dask_ddp.Job, tmp_path: Path):
    """Headless Chromium loads the job's page while the job runs (the screenshot), then
    follows it live: its script's long poll redraws the page as the ranks go on, until the
    job ends and the script stops asking (then the browser's clock runs out and it hands
    over the DOM it drew). The screenshot and the DOM are saved under artifacts/."""
    job = paused_job
    assert _until(lambda: (j := _job_json(client, job.job_id)) and j["ranks"][0]["step"] == 9)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard-job.png"
    shot.unlink(missing_ok=True)
    url = _base(client) + f"jobs/{job.job_id}"
    common = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    subprocess.run(  # at the page's load: as the server drew it
        [*common, f"--screenshot={shot}", "--window-size=1000,700", url],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    assert shot.stat().st_size > 5000  # a PNG with something drawn
    # The browser's clock stands still while a request is out: it dumps the DOM only once
    # the script stopped asking, which it does when the page shows the job's end.
    browser = subprocess.Popen(
        [*common, "--virtual-time-budget=3000", "--dump-dom", url],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        time.sleep(2)  # the page loaded, its first request waits for a change
        assert browser.poll() is None, "the browser stopped while the job was paused"
        Event("dask-ddp-test-dashboard-go", client=client).set()
        dom, _ = browser.communicate(timeout=120)
    finally:
        browser.kill()
    (ARTIFACTS / "dashboard-job.html").write_text(dom)
    assert f"dask_ddp job {job.job_id}" in dom and "<svg" in dom
    assert "step 19" in dom and "succeeded" in dom and "data-final" in dom, dom[-2000:]


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


def test_the_scheduler_keeps_a_capped_summary_of_each_job() -> None:
    """Scheduler memory stays bounded whatever a job reports: the summary the page draws
    keeps 200 curve points and 16 values a rank, never the records themselves."""
    from dask_ddp._shared.progress import Progress

    progress = Progress()
    progress.place(["tcp://10.0.0.1:1"])
    for step in range(5000):
        values = {f"m{k}": float(k) for k in range(100)} | {"loss": 1.0 / (step + 1)}
        progress.add(0, step, float(step), values, n=10)
    (rank,) = progress.page_ranks()
    assert rank["count"] == 50_000 and rank["step"] == 4999
    assert len(rank["curve"]) <= 201 and rank["curve"][-1] == [4999.0, 1.0 / 5000]
    assert len(rank["last"]) == 16
    assert len(progress.progress[0].curve) < 800  # what it holds, thinned as it goes


def test_the_page_of_a_large_job_stays_small() -> None:
    """The page's curve points are shared among the ranks: a 1,000-rank job's summary
    holds about 20,000 points, not 200 for each rank (which made 1-1.5 MB of JSON)."""
    from dask_ddp._shared.progress import Progress

    progress = Progress()
    progress.place([f"tcp://10.0.{r // 250}.{r % 250}:1" for r in range(1000)])
    for step in range(400):
        for r in range(1000):
            progress.add(r, step, float(step), {"loss": 1.0 / (step + 1)})
    ranks = progress.page_ranks()
    assert sum(len(r["curve"]) for r in ranks) <= 21_000  # 20 a rank, and each one's last
    assert all(r["curve"][-1] == [399.0, 1.0 / 400] for r in ranks)
    assert len(json.dumps(ranks)) < 1_000_000


def test_finished_jobs_past_max_jobs_are_forgotten_oldest_first(own_cluster) -> None:
    import dask

    with dask.config.set({"ddp.dashboard.max-jobs": 2}), Client(own_cluster) as client:
        ids = [dask_ddp.launch(client, _train, (1,)) for _ in range(4)]
        for job in ids:
            job.result(timeout=120)
        assert _until(lambda: len(dask_ddp.jobs(client)) == 2)
        assert [j.job_id for j in dask_ddp.jobs(client)] == [ids[3].job_id, ids[2].job_id]
        with pytest.raises(dask_ddp.JobNotFoundError):
            dask_ddp.attach(client, ids[0].job_id)
        assert _get(_base(client) + f"jobs/{ids[0].job_id}")[0] == 404


def test_the_bokeh_panel_draws_the_jobs_and_the_running_one(
    own_cluster, paused_job_on_own: dask_ddp.Job
) -> None:
    """The panel's document, built as the scheduler's Bokeh server builds it, on the real
    scheduler: the list of jobs and the running job drawn as the notebook draws it,
    refreshed every second."""
    pytest.importorskip("bokeh")
    from bokeh.document import Document

    from dask_ddp import dashboard

    doc = Document()
    dashboard._panel(own_cluster.scheduler, {"prefix": "/"}, doc)
    text = doc.roots[0].text
    job = paused_job_on_own
    assert f"dask_ddp job {job.job_id}</b>: " in text and job.job_id in text
    assert f"href='ddp/jobs/{job.job_id}'" in text  # relative: it works behind a proxy
    assert doc.title == "dask-ddp jobs" and doc.session_callbacks  # refreshed while open


@pytest.fixture
def paused_job_on_own(own_cluster) -> Iterator[dask_ddp.Job]:
    with Client(own_cluster) as client:
        client.wait_for_workers(2, timeout=60)
        go = Event("dask-ddp-test-dashboard-go", client=client)
        go.clear()
        job = dask_ddp.launch(client, _train, (20, 9))
        job.view_state(lambda s: all(r["step"] == 9 for r in s["ranks"]), timeout=120)
        try:
            yield job
        finally:
            go.set()
            job.result(timeout=120)


class _VirtualTime(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to its next timer instead of waiting for it: what a
    test measures of a timer is the timer's own arithmetic, never how busy the machine
    is. It never blocks: a loop with nothing ready and no timer is a deadlock, raised."""

    def __init__(self) -> None:
        self._now = 0.0
        loop = self

        class Jumping(selectors.DefaultSelector):  # type: ignore[misc, valid-type]
            def select(self, timeout: float | None = None) -> list:
                events = super().select(0)
                if not events:
                    if timeout is None:
                        raise AssertionError("the loop waits with no timer: a deadlock")
                    loop._now += timeout
                return events

        super().__init__(Jumping())

    def time(self) -> float:
        return self._now


def test_pages_waiting_for_a_change_are_woken_at_once_then_in_batches() -> None:
    """The pages' long poll (`_dashboard.Changes`), as random sequences of changes and
    waiting requests: a request whose page shows less than there is answers at once; one
    that waits answers at the next change, at once after a quiet spell of `gap` and exactly
    `gap` after the last wake under a stream of changes; with no change it answers after
    its timeout with nothing new; a page slow to draw is drawn less often. On a loop of
    virtual time (`_VirtualTime`): the times are the pacing's, not the machine's load."""
    import itertools
    import random

    from dask_ddp._scheduler.page import Changes

    gap = 0.05

    async def rounds() -> None:
        clock = asyncio.get_running_loop().time
        rng = random.Random(44)
        changes = Changes(gap)
        woken: list[float] = []
        at_once: list[float] = []
        batched: list[float] = []
        for _ in range(60):
            seen = changes.count
            if rng.random() < 0.2:  # behind: answered at once
                assert await changes.after(seen - 1, timeout=5) == seen
                continue
            waiting = [asyncio.ensure_future(changes.after(seen, timeout=5)) for _ in range(2)]
            await asyncio.sleep(rng.choice([0, 0.001, 0.02, 0.06]))
            began = clock()
            for _ in range(rng.randint(1, 3)):  # a burst of changes
                changes.bump()
            counts = await asyncio.gather(*waiting)
            now = clock()
            assert counts[0] == counts[1] and counts[0] > seen  # every waiter, the news
            quiet = not woken or began - woken[-1] >= gap
            due = began if quiet else woken[-1] + gap
            (at_once if quiet else batched).append(now - due)
            woken.append(now)
        # After a quiet spell, at once; in a stream, at `gap` after the last wake: both
        # kinds came up, and every wake was on time to the clock's rounding.
        assert at_once and max(abs(t) for t in at_once) < 1e-9, at_once
        assert batched and max(abs(t) for t in batched) < 1e-9, batched
        seen = changes.count
        began = clock()
        assert await changes.after(seen, timeout=0.2) == seen  # nothing new: the timeout
        assert clock() - began == pytest.approx(0.2)
        # A page that takes 20 ms to draw is drawn at most every 0.2 s (a tenth of the
        # scheduler's loop), whatever the stream of changes.
        changes.drew(0.02)
        woken.clear()
        for _ in range(3):
            waiting = asyncio.ensure_future(changes.after(changes.count, timeout=5))
            await asyncio.sleep(0)
            changes.bump()
            await waiting
            woken.append(clock())
        assert min(b - a for a, b in itertools.pairwise(woken)) == pytest.approx(0.2), woken

    loop = _VirtualTime()
    try:
        loop.run_until_complete(rounds())
    finally:
        loop.close()


def test_the_page_s_request_waits_for_the_job_s_next_change(
    client: Client, paused_job: dask_ddp.Job
) -> None:
    """`/ddp/jobs/<id>/view?seen=N` (what the page asks, N from its last answer's
    `X-DDP-Seen`) is held while nothing changes, and answered with the change when the
    ranks report: the page shows a step as it comes, not at its next second."""
    import concurrent.futures

    job = paused_job
    assert _until(
        lambda: (j := _job_json(client, job.job_id)) and all(r["step"] == 9 for r in j["ranks"])
    )
    url = _base(client) + f"jobs/{job.job_id}/view"

    def ask(seen: str | None = None) -> tuple[int, str, float]:
        began = time.monotonic()
        with urllib.request.urlopen(url + (f"?seen={seen}" if seen else ""), timeout=10) as r:
            seen_now = r.headers["X-DDP-Seen"]
            r.read()
        return int(seen_now), seen_now, time.monotonic() - began

    for _ in range(3):  # (a rank's last event may still be on its way: then once more)
        count, seen, _ = ask()
        held = ask(seen)  # the job is paused: nothing changes, the request is held a second
        if held[0] == count:
            break
    assert held[0] == count and held[2] >= 0.9, held
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_get, url + f"?seen={count}")
        time.sleep(0.3)  # the request is in, and held
        assert not waiting.done()
        Event("dask-ddp-test-dashboard-go", client=client).set()
        status, part = waiting.result(timeout=30)
    assert status == 200
    steps = [int(s) for s in re.findall(r"step (\d+)", part)]
    assert steps and max(steps) > 9, part  # drawn after the ranks went on

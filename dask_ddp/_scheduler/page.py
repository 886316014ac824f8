"""The training page on the cluster's own dashboard, served by dask-ddp's scheduler plugin.

On the dashboard's HTTP server (the port of ``/status``, under its prefix):

- ``/ddp/``: the sweeps on the cluster (each a line: trials done, pruned, failed, the best
  so far) and the jobs that are not a sweep's trials (running, finished, failed; who
  launched them);
- ``/ddp/sweeps/<id>``: one sweep, its trials grouped (state, value, pruned, each linked to
  its job's page) and their curves, drawn as the notebook draws it
  (:func:`dask_ddp._shared.view.render_sweep_html`), redrawn as it changes;
- ``/ddp/jobs/<id>``: one job, drawn as the notebook draws it
  (:func:`dask_ddp._shared.view.render_html`),
  redrawn while it runs as soon as something it shows changes (a long poll: the page asks
  for the next change, the server answers when there is one, within a second either way);
- ``/ddp/api/jobs``, ``/ddp/api/jobs/<id>``, ``/ddp/api/sweeps`` and
  ``/ddp/api/sweeps/<id>``: the same as JSON;
- gauges on the scheduler's Prometheus ``/metrics`` (``dask_ddp_*``).

The page is plain HTML, inline SVG and a few lines of script, so it works on a cluster
without internet. It reads each job's supervisor
(:meth:`dask_ddp._scheduler.supervisor.Supervisor.summary`:
the live view's state with the curve thinned and values capped, never the metric stream),
so it shows a job whoever launched it, and whether or not that client is still there.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import dask.config
from tornado import web

from .._shared import dask_internals, view
from .._shared.values import FINAL_STATES


class Holder(Protocol):
    """What the pages read of dask-ddp's scheduler plugin (:mod:`dask_ddp._scheduler.plugin`)."""

    scheduler: Any  # distributed.Scheduler
    jobs: dict[str, Any]  # job id -> its supervisor (summary(), in launch order)
    sweeps: dict[str, Any]  # sweep id -> its supervisor (public_state(), in launch order)
    max_jobs: int
    changes: Changes  # bumped by the supervisors when what the pages show changes


logger = logging.getLogger(__name__)

_WAIT = 1.0  # the longest a page's request waits for a change (the elapsed time ticks on)
_GAP = 0.02  # pages are woken at most this often: at once after a quiet spell, in batches
# under a stream of changes (a job's ranks each tell the supervisor every event flush) ...
_SHARE = 0.1  # ... and drawing them takes at most this share of the scheduler's loop


class Changes:
    """A count of changes to what the pages show, and the pages' requests waiting for the
    next one: a long poll, paced. The first change after a quiet spell wakes them at once;
    changes that follow within ``gap`` of a wake are woken together, ``gap`` after it (the
    reverse of Nagle's algorithm: no delay when idle, batches only under load), or later
    when the pages take long to draw (:meth:`drew`): they take at most ``share`` of the
    scheduler's loop. On the scheduler's event loop.

    >>> changes = Changes()
    >>> changes.count
    0
    """

    def __init__(self, gap: float = _GAP, share: float = _SHARE) -> None:
        self.count = 0
        self._gap = self._least_gap = gap
        self._share = share
        self._woken = -gap  # the loop's time of the last wake (its clock paces the wakes)
        self._due: asyncio.TimerHandle | None = None
        self._waiters: asyncio.Future[None] | None = None

    def bump(self) -> None:
        """Something the pages show changed (on the scheduler's loop)."""
        self.count += 1
        if self._waiters is None or self._due is not None:
            return  # no page waits, or a wake is already due and will show this too
        loop = asyncio.get_running_loop()
        wait = self._woken + self._gap - loop.time()
        if wait <= 0:
            self._wake()
        else:
            self._due = loop.call_later(wait, self._wake)

    def drew(self, seconds: float) -> None:
        """A page took ``seconds`` to draw: the next wakes are that much over the share
        apart (a large job's page is drawn less often, not at the cost of the scheduler)."""
        self._gap = max(self._least_gap, seconds / self._share)

    def _wake(self) -> None:
        self._due = None
        self._woken = asyncio.get_running_loop().time()
        waiters, self._waiters = self._waiters, None
        if waiters is not None and not waiters.done():
            waiters.set_result(None)

    async def after(self, seen: int, timeout: float = _WAIT) -> int:
        """Return the count once it is past ``seen``, or after ``timeout`` seconds."""
        if self.count > seen:
            return self.count
        if self._waiters is None:
            self._waiters = asyncio.get_running_loop().create_future()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._waiters), timeout)
        return self.count


# -- the rows of the list --------------------------------------------------------------
def row(job: dict[str, Any]) -> dict[str, Any]:
    """A job's line in the list (``/ddp/api/jobs``, :func:`dask_ddp.jobs`), from its
    supervisor's :meth:`~dask_ddp._scheduler.supervisor.Supervisor.summary`."""
    ranks = job.get("ranks", [])
    steps = [r["step"] for r in ranks if r.get("step") is not None]
    rates = [r["step_rate"] for r in ranks if r.get("step_rate")]
    metric = job.get("metric")
    values = [r["last"][metric] for r in ranks if metric in r.get("last", {})]
    error = job.get("error")
    return {
        "job": job["job"],
        "name": job.get("name"),
        "state": job["state"],
        "ranks": len(ranks),
        "launched_by": job.get("launched_by"),
        "client": job.get("client"),
        "started": job.get("started"),
        "elapsed": job.get("elapsed"),
        "attempts": job.get("attempts", 1),
        "step": max(steps) if steps else None,
        "step_rate": sum(rates) / len(rates) if rates else None,
        "metric": metric,
        "value": values[0] if values else None,
        "error": error.split("\n", 1)[0] if isinstance(error, str) else None,
        "followers": job.get("followers", 0),
        "detached": job.get("detached", False),
    }


def rows(plugin: Holder) -> list[dict[str, Any]]:
    """Every job's line, the newest launched first."""
    return [
        {**row(job.summary()), "sweep": job.spec.sweep} for job in reversed(plugin.jobs.values())
    ]


def sweep_row(state: dict[str, Any]) -> dict[str, Any]:
    """A sweep's line in the list (``/ddp/api/sweeps``), from its supervisor's state."""
    trials = state["trials"]
    counts = {k: sum(t["state"] == k for t in trials) for k in ("complete", "pruned", "fail")}
    best = next((t for t in trials if t["number"] == state.get("best")), None)
    return {
        "sweep": state["sweep"],
        "name": state["name"],
        "state": state["state"],
        "n_trials": state["n_trials"],
        "asked": len(trials),
        "before": state.get("before", 0),  # ended in an earlier sweep of its name
        "running": sum(t["state"] == "running" for t in trials),
        **counts,
        "metric": state["metric"],
        "best_trial": None if best is None else best["number"],
        "best_value": None if best is None else best["value"],
        "launched_by": state.get("launched_by"),
        "started": state.get("started"),
    }


def sweep_rows(plugin: Holder) -> list[dict[str, Any]]:
    """Every sweep's line, the newest first."""
    return [sweep_row(s.public_state()) for s in reversed(plugin.sweeps.values())]


# -- pages -------------------------------------------------------------------------------
_STYLE = """
:root { color-scheme: light dark; }
body { font: 13px system-ui, sans-serif; margin: 1em 1.5em; }
table { border-collapse: collapse; }
td, th { padding: 2px 8px; text-align: left; border-bottom: 1px solid #8884; }
a { color: inherit; }
.failed { color: #d33; } .succeeded { color: #2a2; } .running { color: #27c; }
"""


def _page(title: str, body: str, refresh: str | None = None, seen: int = 0) -> str:
    script = ""
    if refresh is not None:
        # Redraw the part that changes while the job runs: ask for it once it changed past
        # what this page shows (the server holds the request until then, or a second), and
        # again at once; after an error, a second later.
        script = (
            f"<script>const part=document.getElementById('live');let seen={seen};"
            "const pause=()=>new Promise(w=>setTimeout(w,1000));"
            f"async function tick(){{try{{const r=await fetch({json.dumps(refresh)}+'?seen='+seen);"
            "if(r.ok){seen=Number(r.headers.get('X-DDP-Seen'))||seen;"
            "part.innerHTML=await r.text();}else{await pause();}}catch(e){await pause();}"
            "if(!part.querySelector('[data-final]')){tick();}}"
            "tick();</script>"
        )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
        f"</title><style>{_STYLE}</style></head><body><div id='live'>{body}</div>"
        f"{script}</body></html>"
    )


def _or_blank(value: Any, form: str | None = None) -> str:
    return "" if value is None else form.format(value) if form else view.fmt(value)


def _sweep_line(r: dict[str, Any], base: str) -> str:
    best = "" if r["best_trial"] is None else f" (trial {r['best_trial']})"
    return (
        f"<tr><td><a href='{base}sweeps/{html.escape(r['sweep'])}'>{html.escape(r['sweep'])}"
        f"</a></td><td>{html.escape(r['name'])}</td>"
        f"<td class='{html.escape(r['state'])}'>{html.escape(r['state'])}</td>"
        f"<td>{r['complete'] + r['pruned'] + r['fail'] + r['before']} of {r['n_trials']}</td>"
        f"<td>{r['running']}</td><td>{r['pruned']}</td><td>{r['fail']}</td>"
        f"<td>{html.escape(r['metric'])} {_or_blank(r['best_value'])}{best}</td>"
        f"<td>{html.escape(r['launched_by'] or '')}</td></tr>"
    )


def list_html(plugin: Holder, base: str = "") -> str:
    """The table of jobs. Its links are relative (``base``: the way from the page that shows
    it to ``/ddp/``, ``""`` on that page itself), so that they work wherever a proxy serves
    the dashboard (dask-gateway's ``/clusters/<name>/``, JupyterHub's
    ``/user/<name>/proxy/8787/``)."""
    sweeps = "".join(_sweep_line(r, base) for r in sweep_rows(plugin))
    sweeps_html = (
        "<h2>dask-ddp sweeps</h2><table><tr><th>sweep</th><th>name</th><th>state</th>"
        "<th>trials done</th><th>running</th><th>pruned</th><th>failed</th><th>best</th>"
        f"<th>launched by</th></tr>{sweeps}</table>"
        if sweeps
        else ""
    )
    table = "".join(
        f"<tr><td><a href='{base}jobs/{html.escape(r['job'])}'>{html.escape(r['job'])}</a></td>"
        f"<td>{html.escape(r['name'] or '')}</td>"
        f"<td class='{html.escape(r['state'])}'>{html.escape(r['state'])}</td>"
        f"<td>{r['ranks']}</td><td>{html.escape(r['launched_by'] or '')}</td>"
        f"<td>{_or_blank(r['step'])}</td><td>{_or_blank(r['step_rate'], '{:.1f}')}</td>"
        f"<td>{html.escape(r['metric'] or '')} {_or_blank(r['value'])}</td>"
        f"<td>{r['attempts']}</td><td>{html.escape(r['error'] or '')}</td></tr>"
        for r in rows(plugin)
        if r["sweep"] is None  # a sweep's trials are on its page
    )
    if not table:
        table = "<tr><td colspan='10'>No dask-ddp job has run on this cluster yet.</td></tr>"
    return sweeps_html + (
        "<h2>dask-ddp jobs</h2><table><tr><th>job</th><th>function</th><th>state</th>"
        "<th>ranks</th><th>launched by</th><th>step</th><th>steps/s</th><th>latest</th>"
        f"<th>attempts</th><th>error</th></tr>{table}</table>"
    )


def _job_html(job: dict[str, Any]) -> str:
    """One job, drawn on its page ``/ddp/jobs/<id>`` (so ``../`` is the list)."""
    final = " data-final='1'" if job["state"] in FINAL_STATES else ""
    who = html.escape(f"launched by {job.get('launched_by') or '?'}")
    return (
        f"<p{final}><a href='../'>all jobs</a> · {who} · attempts {job.get('attempts', 1)}"
        f"</p>{view.render_html(job)}"
    )


def _sweep_html(state: dict[str, Any]) -> str:
    """One sweep, drawn on its page ``/ddp/sweeps/<id>`` (``../`` is the list)."""
    final = " data-final='1'" if state["state"] in FINAL_STATES else ""
    who = html.escape(f"launched by {state.get('launched_by') or '?'}")
    return (
        f"<p{final}><a href='../'>all jobs</a> · {who}</p>"
        f"{view.render_sweep_html(state, link=lambda job: f'../jobs/{job}')}"
    )


class _Handler(web.RequestHandler):
    def initialize(self, plugin: Holder) -> None:
        self.plugin = plugin

    def _job(self, job_id: str) -> dict[str, Any] | None:
        job = self.plugin.jobs.get(job_id)
        if job is None:
            self.set_status(404)
            return None
        return job.summary()

    def _missing(self, job_id: str) -> str:
        return (
            f"No dask-ddp job {job_id!r} on this cluster: it never ran here, or it is older "
            f"than the last {self.plugin.max_jobs} jobs the scheduler keeps."
        )

    async def _part(self, draw: Callable[[], str]) -> None:
        """Answer a page's request for the part that changes: once it changed past the
        request's ``seen`` (none: now), with the count in ``X-DDP-Seen`` for the page's next
        request; what drawing it cost paces the next wakes (:meth:`Changes.drew`)."""
        seen = self.get_argument("seen", None)
        changes = self.plugin.changes
        count = changes.count if seen is None else await changes.after(_int(seen))
        self.set_header("X-DDP-Seen", str(count))
        self.set_header("Cache-Control", "no-store")
        began = time.monotonic()
        self.write(draw())
        changes.drew(time.monotonic() - began)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise web.HTTPError(400, f"seen={text!r}: not a number") from None


class _ListPage(_Handler):
    def get(self) -> None:
        seen = self.plugin.changes.count
        self.write(_page("dask-ddp jobs", list_html(self.plugin), "list", seen))


class _ListPart(_Handler):
    async def get(self) -> None:
        await self._part(lambda: list_html(self.plugin))


class _JobPage(_Handler):
    def get(self, job_id: str) -> None:
        seen = self.plugin.changes.count
        job = self._job(job_id)
        if job is None:
            self.write(_page("no such job", f"<p>{html.escape(self._missing(job_id))}</p>"))
            return
        url = f"{job_id}/view"  # relative to /ddp/jobs/<id>, as every link here
        self.write(_page(f"dask-ddp job {job_id}", _job_html(job), url, seen))


class _JobPart(_Handler):
    async def get(self, job_id: str) -> None:
        def draw() -> str:
            job = self._job(job_id)
            if job is None:
                return f"<p data-final='1'>{html.escape(self._missing(job_id))}</p>"
            return _job_html(job)

        await self._part(draw)


class _SweepPage(_Handler):
    def _sweep(self, sweep_id: str) -> dict[str, Any] | None:
        sweep = self.plugin.sweeps.get(sweep_id)
        if sweep is None:
            self.set_status(404)
            return None
        return sweep.public_state()

    def _no_sweep(self, sweep_id: str) -> str:
        return f"No dask-ddp sweep {sweep_id!r} on this cluster."

    def get(self, sweep_id: str) -> None:
        seen = self.plugin.changes.count
        state = self._sweep(sweep_id)
        if state is None:
            self.write(_page("no such sweep", f"<p>{html.escape(self._no_sweep(sweep_id))}</p>"))
            return
        url = f"{sweep_id}/view"
        self.write(_page(f"dask-ddp sweep {sweep_id}", _sweep_html(state), url, seen))


class _SweepPart(_SweepPage):
    async def get(self, sweep_id: str) -> None:  # type: ignore[override]
        def draw() -> str:
            state = self._sweep(sweep_id)
            if state is None:
                return f"<p data-final='1'>{html.escape(self._no_sweep(sweep_id))}</p>"
            return _sweep_html(state)

        await self._part(draw)


class _SweepsApi(_Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps({"sweeps": sweep_rows(self.plugin)}))


class _SweepApi(_SweepPage):
    def get(self, sweep_id: str) -> None:
        self.set_header("Content-Type", "application/json")
        state = self._sweep(sweep_id)
        self.write(json.dumps(state if state is not None else {"error": self._no_sweep(sweep_id)}))


class _JobsApi(_Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps({"jobs": rows(self.plugin)}))


class _JobApi(_Handler):
    def get(self, job_id: str) -> None:
        self.set_header("Content-Type", "application/json")
        job = self._job(job_id)
        self.write(json.dumps(job if job is not None else {"error": self._missing(job_id)}))


def _application(plugin: Holder, prefix: str) -> web.Application:
    base = prefix + "ddp/"
    kw = {"plugin": plugin}
    job = r"([0-9A-Za-z_.-]+)"
    return web.Application(
        [
            (base.rstrip("/"), web.RedirectHandler, {"url": "ddp/"}),  # relative, as links
            (base, _ListPage, kw),
            (base + "list", _ListPart, kw),
            (base + "jobs/" + job, _JobPage, kw),
            (base + "jobs/" + job + "/view", _JobPart, kw),
            (base + "api/jobs/?", _JobsApi, kw),
            (base + "api/jobs/" + job, _JobApi, kw),
            (base + "sweeps/" + job, _SweepPage, kw),
            (base + "sweeps/" + job + "/view", _SweepPart, kw),
            (base + "api/sweeps/?", _SweepsApi, kw),
            (base + "api/sweeps/" + job, _SweepApi, kw),
        ]
    )


# -- Prometheus --------------------------------------------------------------------------
class _Collector:
    """``dask_ddp_*`` gauges for the live plugins in this process (one collector per
    process, as prometheus_client's registry wants; schedulers started one after another
    in a test process each add their plugin)."""

    def __init__(self) -> None:
        self.plugins: weakref.WeakSet[Holder] = weakref.WeakSet()

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        ns = dask.config.get("distributed.dashboard.prometheus.namespace", "dask")
        name = f"{ns}_ddp" if ns else "ddp"
        jobs = GaugeMetricFamily(f"{name}_jobs", "dask-ddp jobs the scheduler knows, by state",
                                 labels=["state"])  # fmt: skip
        ranks = GaugeMetricFamily(f"{name}_ranks", "Ranks of each running dask-ddp job",
                                  labels=["job"])  # fmt: skip
        rate = GaugeMetricFamily(f"{name}_step_rate", "Steps per second of each running rank",
                                 labels=["job", "rank"])  # fmt: skip
        step = GaugeMetricFamily(f"{name}_step", "Latest step of each running rank",
                                 labels=["job", "rank"])  # fmt: skip
        counts: dict[str, int] = {}
        for plugin in list(self.plugins):
            for job in (j.summary() for j in list(plugin.jobs.values())):
                counts[job["state"]] = counts.get(job["state"], 0) + 1
                if job["state"] not in ("running", "stalled"):
                    continue
                ranks.add_metric([job["job"]], len(job["ranks"]))
                for r in job["ranks"]:
                    if r.get("step_rate") is not None:
                        rate.add_metric([job["job"], str(r["rank"])], r["step_rate"])
                    if r.get("step") is not None:
                        step.add_metric([job["job"], str(r["rank"])], r["step"])
        for state, n in sorted(counts.items()):
            jobs.add_metric([state], n)
        return [jobs, ranks, rate, step]


_collector_lock = threading.Lock()
_the_collector: _Collector | None = None


def _collector() -> _Collector:
    global _the_collector
    with _collector_lock:
        if _the_collector is None:
            _the_collector = _Collector()
            try:
                from prometheus_client import REGISTRY
            except ImportError:
                pass  # no Prometheus: the scheduler's /metrics says so itself
            else:
                REGISTRY.register(_the_collector)
        return _the_collector


def add_pages(plugin: Holder) -> web.Application | None:
    """Serve ``plugin``'s jobs on its scheduler's dashboard and Prometheus ``/metrics``;
    returns the application to give to :func:`remove_pages` (None without a dashboard)."""
    _collector().plugins.add(plugin)
    http = getattr(plugin.scheduler, "http_application", None)
    if http is None:
        return None
    app = _application(plugin, dask_internals.http_prefix(plugin.scheduler))
    http.add_application(app)
    return app


def remove_pages(plugin: Holder, app: web.Application | None) -> None:
    """Stop serving what :func:`add_pages` served."""
    _collector().plugins.discard(plugin)
    http = getattr(plugin.scheduler, "http_application", None)
    if http is not None and app is not None:
        dask_internals.remove_http_application(http, app)

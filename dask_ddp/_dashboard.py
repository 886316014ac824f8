"""The training page on the cluster's own dashboard: a scheduler plugin and its client feed.

:class:`DashboardPlugin` runs in the scheduler. It serves, on the dashboard's HTTP server
(the port of ``/status``, under its prefix):

- ``/ddp/``: the jobs on the cluster (running, finished, failed; who launched them);
- ``/ddp/jobs/<id>``: one job, drawn as the notebook draws it (:func:`dask_ddp.view.render_html`),
  refreshed every second while it runs;
- ``/ddp/api/jobs`` and ``/ddp/api/jobs/<id>``: the same as JSON;
- gauges on the scheduler's Prometheus ``/metrics`` (``dask_ddp_*``).

The page is plain HTML, inline SVG and a few lines of script, so it works on a cluster
without internet. Each job's supervisor sends a summary of its state
(:func:`summary`: the live view's snapshot without printed output, the curve thinned) at
most once a second on the client's batched stream; the scheduler keeps the latest summary
of the last ``ddp.dashboard.max-jobs`` jobs, never the metric stream itself, so its memory
stays bounded. ``launch()`` installs the plugin on any cluster (:func:`attach`); a scheduler
that cannot take it (dask-ddp not importable there) leaves jobs training, with one warning.
"""

from __future__ import annotations

import getpass
import html
import json
import logging
import os
import socket
import sys
import threading
import time
import warnings
import weakref
from typing import Any

import dask.config
from distributed import Client
from distributed.diagnostics.plugin import SchedulerPlugin
from tornado import web

from . import _dask_internals, view
from . import config as _config  # noqa: F401  (loads the ddp.* defaults)
from .errors import DashboardUnavailableWarning

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dask-ddp-dashboard"
_OP = "dask-ddp-job-summary"  # the scheduler's stream handler for job summaries
_SEND_PERIOD = 1.0  # seconds between two summaries of a running job
_CURVE_POINTS = 200  # points per rank kept on the scheduler
_METRICS = 16  # latest metric values kept per rank
_TEXT = 20_000  # characters kept of an error or a note
_NOTES = 20
_FINAL = view.FINAL_STATES


# -- the summary a job sends -------------------------------------------------------------
def _clip(text: Any) -> Any:
    return text[:_TEXT] if isinstance(text, str) else text


def _thin(curve: list[Any]) -> list[list[float]]:
    step = max(1, -(-len(curve) // _CURVE_POINTS))
    kept = curve[::step]
    if curve and kept[-1] is not curve[-1]:
        kept.append(curve[-1])
    return [[float(x), float(y)] for x, y in kept]


def summary(snap: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """What the scheduler keeps of a job: the live view's state (see
    :meth:`dask_ddp.Job.view_state`) with the curve thinned, metric values, errors and
    notes capped, and no printed output. Applied again by the scheduler, so a client that
    sends more cannot make it keep more.

    >>> snap = {"job": "3f2a", "state": "running", "ranks": [], "notes": [], "output": ["x"]}
    >>> sorted(summary(snap, launched_by="ana@laptop"))
    ['job', 'launched_by', 'notes', 'ranks', 'state']
    """
    out = {k: _clip(v) for k, v in snap.items() if k not in ("output", "ranks", "notes")}
    out["ranks"] = [
        {
            **{k: _clip(v) for k, v in r.items() if k not in ("curve", "last")},
            "last": {str(k): v for k, v in list(r.get("last", {}).items())[:_METRICS]},
            "curve": _thin(r.get("curve", [])),
        }
        for r in snap.get("ranks", [])
    ]
    out["notes"] = [_clip(n) for n in list(snap.get("notes", []))[-_NOTES:]]
    out.update({k: _clip(v) for k, v in extra.items()})
    return out


def _row(job: dict[str, Any]) -> dict[str, Any]:
    """A job's line in the list (``/ddp/api/jobs``)."""
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
    }


# -- the scheduler side ------------------------------------------------------------------
class DashboardPlugin(SchedulerPlugin):
    """Keeps a summary of each job and serves the ``/ddp/`` pages (see the module doc).

    Installed by ``launch()`` (``Client.register_plugin``); one per scheduler.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, max_jobs: int | None = None) -> None:
        self.max_jobs = int(max_jobs or dask.config.get("ddp.dashboard.max-jobs"))
        self.jobs: dict[str, dict[str, Any]] = {}  # oldest first
        self.scheduler: Any = None
        self._app: web.Application | None = None

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        _dask_internals.add_stream_handler(scheduler, _OP, self.update)
        http = getattr(scheduler, "http_application", None)
        if http is not None:
            self._app = _application(self, _dask_internals.http_prefix(scheduler))
            http.add_application(self._app)
        _collector().plugins.add(self)

    async def close(self) -> None:
        _dask_internals.remove_stream_handler(self.scheduler, _OP)
        http = getattr(self.scheduler, "http_application", None)
        if http is not None and self._app in http.applications:
            http.applications.remove(self._app)
        _collector().plugins.discard(self)

    def update(self, job: dict[str, Any], client: str | None = None, **_: Any) -> None:
        """A job's summary arrived from the client ``client`` (the stream handler: an
        exception here would close that client's connection, so none leaves)."""
        try:
            kept = summary(job, client=client, updated=time.time())
            if not isinstance(kept.get("job"), str) or not isinstance(kept.get("state"), str):
                raise ValueError("no job id or state")
        except Exception:
            logger.warning("dask-ddp dashboard: a summary from %s ignored", client, exc_info=True)
            return
        self.jobs[kept["job"]] = kept  # a known job keeps its place: the list is by launch
        while len(self.jobs) > self.max_jobs:  # forget the oldest finished job, else the oldest
            old = next((k for k, j in self.jobs.items() if j["state"] in _FINAL), None)
            del self.jobs[old if old is not None else next(iter(self.jobs))]

    def rows(self) -> list[dict[str, Any]]:
        """Every job's line, the newest launched first."""
        return [_row(j) for j in reversed(self.jobs.values())]


# -- pages -------------------------------------------------------------------------------
_STYLE = """
:root { color-scheme: light dark; }
body { font: 13px system-ui, sans-serif; margin: 1em 1.5em; }
table { border-collapse: collapse; }
td, th { padding: 2px 8px; text-align: left; border-bottom: 1px solid #8884; }
a { color: inherit; }
.failed { color: #d33; } .succeeded { color: #2a2; } .running { color: #27c; }
"""


def _page(title: str, body: str, refresh: str | None = None) -> str:
    script = ""
    if refresh is not None:  # refresh the part that changes while the job runs
        script = (
            "<script>const part=document.getElementById('live');"
            f"async function tick(){{const r=await fetch({json.dumps(refresh)});"
            "if(r.ok){part.innerHTML=await r.text();}"
            "if(!part.querySelector('[data-final]')){setTimeout(tick,1000);}}"
            "setTimeout(tick,1000);</script>"
        )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
        f"</title><style>{_STYLE}</style></head><body><div id='live'>{body}</div>"
        f"{script}</body></html>"
    )


def _or_blank(value: Any, form: str | None = None) -> str:
    return "" if value is None else form.format(value) if form else view.fmt(value)


def list_html(plugin: DashboardPlugin, base: str) -> str:
    """The table of jobs (``base``: the page's path, ``/ddp/`` under the prefix)."""
    rows = "".join(
        f"<tr><td><a href='{base}jobs/{html.escape(r['job'])}'>{html.escape(r['job'])}</a></td>"
        f"<td>{html.escape(r['name'] or '')}</td>"
        f"<td class='{html.escape(r['state'])}'>{html.escape(r['state'])}</td>"
        f"<td>{r['ranks']}</td><td>{html.escape(r['launched_by'] or '')}</td>"
        f"<td>{_or_blank(r['step'])}</td><td>{_or_blank(r['step_rate'], '{:.1f}')}</td>"
        f"<td>{html.escape(r['metric'] or '')} {_or_blank(r['value'])}</td>"
        f"<td>{r['attempts']}</td><td>{html.escape(r['error'] or '')}</td></tr>"
        for r in plugin.rows()
    )
    if not rows:
        rows = "<tr><td colspan='10'>No dask-ddp job has run on this cluster yet.</td></tr>"
    return (
        "<h2>dask-ddp jobs</h2><table><tr><th>job</th><th>function</th><th>state</th>"
        "<th>ranks</th><th>launched by</th><th>step</th><th>steps/s</th><th>latest</th>"
        f"<th>attempts</th><th>error</th></tr>{rows}</table>"
    )


def _job_html(job: dict[str, Any], base: str) -> str:
    final = " data-final='1'" if job["state"] in _FINAL else ""
    who = html.escape(f"launched by {job.get('launched_by') or '?'}")
    return (
        f"<p{final}><a href='{base}'>all jobs</a> · {who} · attempts {job.get('attempts', 1)}"
        f"</p>{view.render_html(job)}"
    )


class _Handler(web.RequestHandler):
    def initialize(self, plugin: DashboardPlugin, base: str) -> None:
        self.plugin, self.base = plugin, base

    def _job(self, job_id: str) -> dict[str, Any] | None:
        job = self.plugin.jobs.get(job_id)
        if job is None:
            self.set_status(404)
        return job

    def _missing(self, job_id: str) -> str:
        return (
            f"No dask-ddp job {job_id!r} on this cluster: it never ran here, or it is older "
            f"than the last {self.plugin.max_jobs} jobs the scheduler keeps."
        )


class _ListPage(_Handler):
    def get(self) -> None:
        self.write(_page("dask-ddp jobs", list_html(self.plugin, self.base), self.base + "list"))


class _ListPart(_Handler):
    def get(self) -> None:
        self.write(list_html(self.plugin, self.base))


class _JobPage(_Handler):
    def get(self, job_id: str) -> None:
        job = self._job(job_id)
        if job is None:
            self.write(_page("no such job", f"<p>{html.escape(self._missing(job_id))}</p>"))
            return
        url = f"{self.base}jobs/{job_id}/view"
        self.write(_page(f"dask-ddp job {job_id}", _job_html(job, self.base), url))


class _JobPart(_Handler):
    def get(self, job_id: str) -> None:
        job = self._job(job_id)
        self.write(
            f"<p data-final='1'>{html.escape(self._missing(job_id))}</p>"
            if job is None
            else _job_html(job, self.base)
        )


class _JobsApi(_Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps({"jobs": self.plugin.rows()}))


class _JobApi(_Handler):
    def get(self, job_id: str) -> None:
        self.set_header("Content-Type", "application/json")
        job = self._job(job_id)
        self.write(json.dumps(job if job is not None else {"error": self._missing(job_id)}))


def _application(plugin: DashboardPlugin, prefix: str) -> web.Application:
    base = prefix + "ddp/"
    kw = {"plugin": plugin, "base": base}
    job = r"([0-9A-Za-z_.-]+)"
    return web.Application(
        [
            (base.rstrip("/"), web.RedirectHandler, {"url": base}),
            (base, _ListPage, kw),
            (base + "list", _ListPart, kw),
            (base + "jobs/" + job, _JobPage, kw),
            (base + "jobs/" + job + "/view", _JobPart, kw),
            (base + "api/jobs/?", _JobsApi, kw),
            (base + "api/jobs/" + job, _JobApi, kw),
        ]
    )


# -- Prometheus --------------------------------------------------------------------------
class _Collector:
    """``dask_ddp_*`` gauges for the live plugins in this process (one collector per
    process, as prometheus_client's registry wants; schedulers started one after another
    in a test process each add their plugin)."""

    def __init__(self) -> None:
        self.plugins: weakref.WeakSet[DashboardPlugin] = weakref.WeakSet()

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
            for job in plugin.jobs.values():
                counts[job["state"]] = counts.get(job["state"], 0) + 1
                if job["state"] != "running":
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


# -- the client side ---------------------------------------------------------------------
_installed: weakref.WeakKeyDictionary[Client, bool] = weakref.WeakKeyDictionary()
_install_lock = threading.Lock()


def install(client: Client) -> bool:
    """Install :class:`DashboardPlugin` on ``client``'s scheduler, once per client; False
    (after one :class:`DashboardUnavailableWarning`) if the scheduler cannot take it."""
    with _install_lock:
        done = _installed.get(client)
        if done is not None:
            return done
        try:
            client.register_plugin(DashboardPlugin(), name=PLUGIN_NAME)
            # A scheduler without the handler answers nothing rather than an error; and a
            # job summary sent to a scheduler without the plugin would close our connection.
            if not client.run_on_scheduler(_has_plugin):
                raise RuntimeError("the plugin is not in the scheduler's plugins")
        except Exception as exc:  # what the scheduler said: a blocked handler, ...
            warning = DashboardUnavailableWarning(client.scheduler.address, exc)
            warnings.warn(warning, stacklevel=_caller_level())
            _installed[client] = False
            return False
        _installed[client] = True
        return True


def _has_plugin(dask_scheduler: Any) -> bool:
    return PLUGIN_NAME in dask_scheduler.plugins


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside dask_ddp."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # a container's uid without a name, and no USER/LOGNAME
        return f"uid {os.getuid()}" if hasattr(os, "getuid") else "?"


class DashboardFeed:
    """A view of one job (in the job model's views) that sends its summary to the
    scheduler's page: at most once a second, and once more when the job ends."""

    def __init__(self, client: Client, name: str) -> None:
        self.client = client
        self.extra = {
            "name": name,
            "launched_by": f"{_user()}@{socket.gethostname()}",
            "started": time.time(),
        }
        self._last = 0.0

    def update(self, snap: dict[str, Any]) -> float | None:
        """Send ``snap``; or, within a second of the last one, ask the job model to call
        again when that second is up (returns the seconds to wait)."""
        now = time.monotonic()
        if now - self._last < _SEND_PERIOD and snap["state"] not in _FINAL:
            return self._last + _SEND_PERIOD - now
        self._last = now
        if self.client.status == "running":
            job = summary(snap, **self.extra)
            _dask_internals.send_to_scheduler(self.client, {"op": _OP, "job": job})
        return None


def attach(client: Client, model: Any, name: str) -> None:
    """Feed ``model``'s job to the dashboard page, if ``ddp.dashboard.enabled`` and the
    scheduler took the plugin."""
    if dask.config.get("ddp.dashboard.enabled") and install(client):
        model.views.append(DashboardFeed(client, name))
        model.mark_views()

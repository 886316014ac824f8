"""The job's live view on the client: HTML, an inline SVG curve, ipywidgets.

Pure rendering: every function here takes a snapshot of the job (a dict built by
:meth:`dask_ddp.Job.view_state`, the job model's state) and never touches the job itself.
:class:`WidgetView` draws progress bars with ipywidgets; :class:`HandleView` replaces a
static HTML display in place where ipywidgets is missing.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from typing import Any

from .protocol import RankEnd
from .values import FINAL_STATES

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


_LEGEND_ROWS = 8  # curves named in the legend, at most (a sweep draws one per trial)
_SMOOTHING = 0.6  # the weight TensorBoard's smoothing slider starts at
_LOG_SPAN = 100.0  # a metric spanning more than two decades is drawn on a log axis


def smoothed(ys: list[float]) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    out, last = [], 0.0
    for n, y in enumerate(ys, start=1):
        last = last * _SMOOTHING + (1 - _SMOOTHING) * y
        out.append(last / (1 - _SMOOTHING**n))
    return out


def _y_axis(ys: list[float]) -> tuple[Callable[[float], float], list[float], bool]:
    """(value -> position in [0, 1], tick values, whether the axis is logarithmic)."""
    lo, hi = min(ys), max(ys)
    if lo > 0 and hi / lo > _LOG_SPAN:
        a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        step = max(1, math.ceil((b - a) / 5))
        ticks = [10.0**e for e in range(a, b + 1, step)]
        return (lambda y: (math.log10(max(y, 1e-300)) - a) / (b - a)), ticks, True
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    ticks = [lo + (hi - lo) * i / 4 for i in range(5)]
    return (lambda y: (y - lo) / (hi - lo)), ticks, False


def svg_curve(ranks: list[dict[str, Any]], metric: str | None) -> str:
    """``metric`` per rank (or per trial of a sweep: its ``label``) as an inline SVG chart:
    raw line faint, smoothed line over it, ticks and a legend, a log y axis when the values
    span more than two decades. Text and axes take the surrounding text colour, so light
    and dark themes both read."""
    curves = [r for r in ranks if len(r["curve"]) >= 2]
    points = [p for r in curves for p in r["curve"]]
    if metric is None or not points:
        return ""
    width, height, left, bottom, top, right = 460, 170, 52, 30, 10, 8
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    x1 = x1 if x1 > x0 else x0 + 1
    to_y, ticks, log = _y_axis(ys)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def sy(y: float) -> float:
        return height - bottom - to_y(y) * (height - bottom - top)

    parts = [
        f'<rect x="{left}" y="{top}" width="{width - left - right}" '
        f'height="{height - bottom - top}" fill="none" stroke="currentColor" '
        'stroke-opacity="0.3"/>'
    ]
    for t in ticks:
        parts.append(
            f'<text x="{left - 4}" y="{sy(t) + 3:.1f}" text-anchor="end">{fmt(float(t))}</text>'
        )
    for i, r in enumerate(curves):
        color = _COLORS[r["rank"] % len(_COLORS)]
        name = html.escape(r.get("label") or f"rank {r['rank']}")
        steps, values = [x for x, _ in r["curve"]], [y for _, y in r["curve"]]
        for line, extra in ((values, ' stroke-opacity="0.3"'), (smoothed(values), "")):
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(steps, line, strict=True))
            parts.append(
                f'<polyline fill="none" stroke="{color}" stroke-width="1.5"{extra} '
                f'points="{path}"><title>{name}</title></polyline>'
            )
        if i < _LEGEND_ROWS:
            parts.append(
                f'<text x="{width - right - 4}" y="{top + 12 + 12 * i}" text-anchor="end" '
                f'fill="{color}">{name}</text>'
            )
    label = html.escape(metric) + (" (log scale)" if log else "")
    parts += [
        f'<text x="{left}" y="{height - bottom + 12}">{fmt(x0)}</text>',
        f'<text x="{width - right}" y="{height - bottom + 12}" text-anchor="end">{fmt(x1)}</text>',
        f'<text x="{(left + width - right) // 2}" y="{height - 4}" text-anchor="middle">'
        f"step; {label}, smoothed {_SMOOTHING}</text>",
    ]
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'style="font:10px sans-serif" fill="currentColor" role="img" '
        f'aria-label="{label} by step">{"".join(parts)}</svg>'
    )


_WAITING = {
    "submitted": "waiting for its worker to start the task",
    "queued": "waiting for its worker",
    "joining": "waiting for the other ranks to join",
    "running": "running, nothing reported yet",
}


def _bars(snap: dict[str, Any]) -> list[tuple[int, int]]:
    """(value, max) of each rank's bar: steps done of ``total`` when the job has one, else
    relative to the leading rank."""
    done = [r["step"] + 1 if r["step"] is not None else r["count"] for r in snap["ranks"]]
    top = snap.get("total") or max([1, *done])
    return [(min(d, top), top) for d in done]


def _bar_style(r: dict[str, Any], snap: dict[str, Any]) -> str:
    """ipywidgets' colour of a rank's bar: red where it failed, amber where it was stopped."""
    if r.get("error"):
        return "warning" if r["status"] == RankEnd.STOPPED.value else "danger"
    return "success" if snap["state"] == "succeeded" else "info"


def _interval(seconds: float) -> str:
    """``1:02:03`` or ``02:03``, as tqdm shows times."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:d}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def _rank_text(r: dict[str, Any], snap: dict[str, Any]) -> str:
    """The rank's progress and latest metrics, or what it waits for; then what it is busy
    with. With the job's total steps: n/total, percent, elapsed, time left and steps/s."""
    if r.get("error"):  # "failed: ValueError: ..." or "stopped: rank 1 failed"
        done = f"step {r['step']} · " if r.get("step") is not None else ""
        return f"{done}<span style='color:#d33'>{html.escape(_short(r['error']))}</span>"
    activity = html.escape(r.get("activity") or "")
    if not r["count"]:
        return activity or _WAITING.get(r["status"], "")
    total = snap.get("total")
    step_rate = r.get("step_rate")
    if total and r["step"] is not None:
        done = min(r["step"] + 1, total)
        step = f"{done}/{total} ({100 * done / total:.0f}%) {_interval(snap['elapsed'])}"
        if step_rate:
            step += f"<{_interval((total - done) / step_rate)}, {step_rate:.1f} steps/s"
    else:
        step = f"step {r['step']}" if r["step"] is not None else f"{r['count']} reports"
        if step_rate or r["rate"]:
            step += f", {step_rate:.1f} steps/s" if step_rate else f", {r['rate']:.1f} reports/s"
    last = ", ".join(f"{html.escape(k)} {fmt(v)}" for k, v in list(r["last"].items())[:4])
    return f"{step}" + (f" · {last}" if last else "") + (f" — {activity}" if activity else "")


def _title(snap: dict[str, Any]) -> str:
    ranks = snap["ranks"]
    state = html.escape(snap["state"])
    started = sum(r["status"] not in ("submitted", "queued", "joining") for r in ranks)
    if snap["state"] == "running" and started < len(ranks):
        state = f"starting ({started} of {len(ranks)} ranks in the process group)"
    return (
        f"<b>dask_ddp job {html.escape(snap['job'])}</b>: {state}, "
        f"{len(ranks)} ranks, backend {html.escape(snap['backend'])}, "
        f"{snap['records']} reports, {snap['elapsed']:.1f} s"
        + ("" if snap.get("total") else "; bars relative to the leading rank")
    )


def _short(text: str, limit: int = 160) -> str:
    """The first line of ``text``, cut at a word boundary to at most ``limit`` characters.

    >>> _short("failed: ValueError: bad batch", 24)
    'failed: ValueError…'
    """
    line = text.split("\n", 1)[0]
    if len(line) <= limit:
        return line
    cut = line[: limit - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(" :,;") + "…"


def _errors_html(snap: dict[str, Any]) -> str:
    """The job's error once: its first line, the rank's traceback folded under it; then
    notes and what the job waits for. Each rank's own state is in its row."""
    parts = []
    if snap["error"]:
        headline, _, rest = snap["error"].partition("\n")
        parts.append(f"<div style='color:#d33'>{html.escape(headline)}</div>")
        folded = snap.get("traceback") or rest.strip()
        if folded:
            parts.append(
                "<details><summary>traceback</summary><pre style='white-space:pre-wrap;"
                f"margin:2px 0'>{html.escape(folded)}</pre></details>"
            )
    parts += [f"<div style='color:#a60'>{html.escape(n)}</div>" for n in snap["notes"]]
    if snap.get("waiting"):
        parts.append(f"<div style='color:#a60'>{html.escape(snap['waiting'])}</div>")
    return "".join(parts)


def _output_html(snap: dict[str, Any]) -> str:
    """The latest lines the ranks printed, if any."""
    lines = snap.get("output") or []
    if not lines:
        return ""
    text = html.escape("\n".join(lines))
    return f"<pre style='margin:4px 0;font-size:11px;max-height:12em;overflow:auto'>{text}</pre>"


def render_html(snap: dict[str, Any]) -> str:
    """The whole view as static HTML: title, a row per rank, the curve, the errors."""
    rows = "".join(
        f"<tr><td>{r['rank']}</td><td>{html.escape(r['worker'])}</td>"
        f"<td>{html.escape(r['status'])}</td>"
        f"<td><progress value='{value}' max='{top}'></progress></td>"
        f"<td>{_rank_text(r, snap)}</td></tr>"
        for r, (value, top) in zip(snap["ranks"], _bars(snap), strict=True)
    )
    return (
        f"<div>{_title(snap)}<table><tr><th>rank</th><th>worker</th><th>status</th>"
        f"<th>progress</th><th>latest</th></tr>{rows}</table>"
        f"{svg_curve(snap['ranks'], snap['metric'])}{_output_html(snap)}{_errors_html(snap)}"
        "</div>"
    )


def render_sweep_html(state: dict[str, Any], link: Callable[[str], str] | None = None) -> str:
    """A sweep as static HTML (its state as the scheduler tells it): the title with the best
    trial so far, a row per trial (``link(job_id)``: where its job's page is, on the
    ``/ddp/`` pages), and each trial's curve of the sweep's metric."""
    trials = state["trials"]
    # trials of a sweep of this name that ended before it (it resumed them) count too
    done = sum(t["state"] in ("complete", "pruned", "fail") for t in trials) + state.get(
        "before", 0
    )
    best = next((t for t in trials if t["number"] == state.get("best")), None)
    best_text = (
        f"; best: trial {best['number']}, {html.escape(state['metric'])} = {fmt(best['value'])}"
        if best is not None and best["value"] is not None
        else ""
    )
    title = (
        f"<b>dask_ddp sweep {html.escape(state['name'])}</b> ({state['sweep']}): {state['state']}, "
        f"{done} of {state['n_trials']} trials done{best_text}"
    )
    rows = []
    for t in trials:
        params = ", ".join(f"{html.escape(str(k))}={fmt(v)}" for k, v in t["params"].items())
        value = t["value"] if t["value"] is not None else t["latest"]
        detail = t["error"] or (f"pruned at step {t['pruned_at']}" if t["pruned_at"] else "")
        mark = " &#9733;" if best is not None and t["number"] == best["number"] else ""
        number = str(t["number"])
        if link is not None and t["job_id"]:
            number = f"<a href='{html.escape(link(t['job_id']))}'>{number}</a>"
        rows.append(
            f"<tr><td>{number}{mark}</td><td class='{t['state']}'>{t['state']}</td>"
            f"<td>{params}</td>"
            f"<td>{'' if value is None else fmt(value)}</td>"
            f"<td>{'' if t['step'] is None else t['step']}</td>"
            f"<td>{html.escape(_short(detail, 120))}</td></tr>"
        )
    curves = [
        {"rank": t["number"], "label": f"trial {t['number']}", "curve": t["curve"]} for t in trials
    ]
    error = state.get("error")
    error_html = (
        f"<pre style='color:#d62728'>{html.escape(error.get('text', ''))}</pre>" if error else ""
    )
    return (
        f"<div>{title}<table><tr><th>trial</th><th>state</th><th>params</th>"
        f"<th>{html.escape(state['metric'])}</th><th>step</th><th></th></tr>{''.join(rows)}"
        f"</table>{svg_curve(curves, state['metric'])}{error_html}</div>"
    )


class WidgetView:
    """ipywidgets: one progress bar per rank, the curve and the errors."""

    def __init__(self, world_size: int) -> None:
        import ipywidgets as widgets

        self._widgets = widgets
        self._title = widgets.HTML()
        self.bars: list[Any] = []
        self.labels: list[Any] = []
        self.plot = widgets.HTML()
        self._errors = widgets.HTML()
        self._output = widgets.HTML()
        self.widget = widgets.VBox()
        self._handle: Any = None
        self._final = False
        self._resize(world_size)

    def _resize(self, world_size: int) -> None:
        """One bar per rank: an elastic job's number of ranks changes between attempts
        (and is 0 while it waits for workers)."""
        w = self._widgets
        self.bars = [
            w.IntProgress(value=0, min=0, max=1, description=f"rank {r}") for r in range(world_size)
        ]
        self.labels = [w.HTML() for _ in range(world_size)]
        rows = [w.HBox([b, t]) for b, t in zip(self.bars, self.labels, strict=True)]
        self.widget.children = [self._title, *rows, self.plot, self._output, self._errors]

    def show(self, display: Callable[..., Any], snap: dict[str, Any]) -> None:
        self.update(snap)
        self._handle = display(self._bundle(snap), raw=True, display_id=True)

    def _bundle(self, snap: dict[str, Any]) -> dict[str, Any]:
        """The widget, with a static HTML copy of ``snap`` beside it: what nbconvert,
        GitHub and nbviewer show when the widget's state was not saved with the notebook."""
        return {**self.widget._repr_mimebundle_(), "text/html": render_html(snap)}

    def update(self, snap: dict[str, Any]) -> None:
        if snap["state"] in FINAL_STATES and self._handle is not None and not self._final:
            self._final = True  # the output keeps a copy of the final state, once
            self._handle.update(self._bundle(snap), raw=True)
        self._title.value = _title(snap)
        if len(snap["ranks"]) != len(self.bars):
            self._resize(len(snap["ranks"]))
        shown = zip(self.bars, self.labels, snap["ranks"], _bars(snap), strict=True)
        for bar, label, r, (value, top) in shown:
            bar.max, bar.value = top, value  # max first: value never exceeds it
            bar.bar_style = _bar_style(r, snap)
            label.value = _rank_text(r, snap)
        plot = svg_curve(snap["ranks"], snap["metric"])
        if plot != self.plot.value:
            self.plot.value = plot
        output = _output_html(snap)
        if output != self._output.value:
            self._output.value = output
        self._errors.value = _errors_html(snap)


class HandleView:
    """Without ipywidgets: the HTML view, replaced in place through a display handle."""

    def __init__(self) -> None:
        self._handle: Any = None

    def show(self, display: Callable[..., Any], snap: dict[str, Any]) -> None:
        from IPython.display import HTML

        self._handle = display(HTML(render_html(snap)), display_id=True)

    def update(self, snap: dict[str, Any]) -> None:
        from IPython.display import HTML

        if self._handle is not None:
            self._handle.update(HTML(render_html(snap)))


def progress_line(snap: dict[str, Any]) -> str:
    """A terminal's one-line view of the ranks in a job's state (``Job.view_state()``).

    >>> ranks = [
    ...     {"count": 0, "step": None, "last": {}, "status": "joining", "activity": ""},
    ...     {"count": 5, "step": 4, "last": {"loss": 0.25}, "status": "pending", "activity": ""},
    ... ]
    >>> progress_line({"ranks": ranks})
    'r0 joining | r1 step 4 loss 0.25'
    """
    parts = []
    for r, rank in enumerate(snap["ranks"]):
        busy = f" ({rank['activity']})" if rank["activity"] else ""
        if rank["count"] == 0:
            parts.append(f"r{r} {rank['status']}{busy}")
            continue
        where = f" step {rank['step']}" if rank["step"] is not None else f" {rank['count']} reports"
        shown = ", ".join(f"{k} {fmt(v)}" for k, v in list(rank["last"].items())[:2])
        parts.append(f"r{r}{where}" + (f" {shown}" if shown else "") + busy)
    if snap.get("waiting"):
        parts.append(snap["waiting"])
    return " | ".join(parts)


def watch_progress(model: Any, file: Any = None) -> None:
    """Draw a job's progress line with tqdm until the job is done (``Job.watch``).

    ``model`` is the job's :class:`~dask_ddp._client.model.JobModel`.
    """
    from tqdm.auto import tqdm

    with tqdm(desc=f"job {model.job_id}", unit=" reports", file=file) as bar:
        shown, line = 0, ""
        for count, line in model.progress_lines():
            # A new phase or activity is drawn at once; new records at tqdm's rate, so the
            # line a waiting job last changed to is never left undrawn.
            bar.set_postfix_str(line, refresh=count == shown)
            bar.update(count - shown)
            shown = count
        model.done.wait()  # set right after the channel closes
        bar.set_postfix_str(f"{model.state.value}; {line}")

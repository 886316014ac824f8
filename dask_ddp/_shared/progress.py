"""What a job's ranks have said so far, drawn as the views draw it: one :class:`Progress`.

The supervisor on the scheduler keeps one per job for the ``/ddp/`` page, and every
client's :class:`~dask_ddp._client.model.JobModel` keeps one for the notebook; both take
the same events (:meth:`Progress.take`: what each event tells in the clear, a
:class:`~dask_ddp._shared.protocol.Told`), so they hold one account. Both build the same
snapshot (:meth:`Progress.ranks`, the ``"ranks"`` of
:meth:`dask_ddp.Job.view_state`), which :mod:`dask_ddp._shared.view` draws.
"""

from __future__ import annotations

import math
from typing import Any

from .protocol import Ended, RankEnd, Told, pick_curve_metric

__all__ = ["Progress", "view_state"]

CURVE_POINTS = 400  # points kept per rank for the loss curve (older ones thinned)
# What the /ddp/ page gets of each rank (Progress.page_ranks): metric values, curve points,
# and curve points of all ranks together.
PAGE_VALUES, PAGE_CURVE_POINTS, PAGE_TOTAL_POINTS = 16, 200, 20_000


def view_state(
    *,
    job: str,
    name: str,
    state: str,
    waiting: str | None,
    total: int | None,
    backend: str,
    elapsed: float,
    attempts: int,
    records: int,
    ranks: list[dict[str, Any]],
    metric: str | None,
    error: str | None,
    traceback: str | None,
    notes: list[str],
    output: list[str],
    **extra: Any,
) -> dict[str, Any]:
    """What every view of a job draws (:mod:`dask_ddp._shared.view`): the notebook's, from
    a client's :class:`~dask_ddp._client.model.JobModel`, and the ``/ddp/`` page's, from the
    supervisor on the scheduler. One builder, so that the two never draw different things;
    ``extra`` is what only one of them adds (the page: who launched the job, how many follow it).

    >>> view_state(job="3f2a", name="train", state="running", waiting=None, total=None,
    ...            backend="gloo", elapsed=1.0, attempts=1, records=0, ranks=[], metric=None,
    ...            error=None, traceback=None, notes=[], output=[])["state"]
    'running'
    """
    return {
        "job": job,
        "name": name,
        "state": state,
        "waiting": waiting,
        "total": total,
        "backend": backend,
        "elapsed": max(0.0, elapsed),
        "attempts": attempts,
        "records": records,
        "ranks": ranks,
        "metric": metric,
        "error": error,
        "traceback": traceback,
        "notes": list(notes),
        "output": list(output),
        **extra,
    }


class _RankProgress:
    """What the views show for one rank: reports, step, rates, latest values, the curve."""

    def __init__(self) -> None:
        self.count = 0
        self.step: int | None = None
        self.last: dict[str, float] = {}
        self.first_time: float | None = None
        self.first_step: int | None = None
        self.last_time: float | None = None
        self.curve: list[tuple[float, float]] = []
        self._stride = 1
        self._points = 0
        self._base = 0  # records counted before the rates' first record (a seeded summary)

    def add(
        self,
        step: int | None,
        when: float,
        values: dict[str, float],
        metric: str | None,
        n: int,
        points: list[list[float]] | None = None,
        first: list[Any] | None = None,
    ) -> None:
        """Take ``n`` records ending with this one (``step``, ``when``, ``values``; ``first``:
        the first one's ``[step, time]``); the curve gets ``points`` (``[x, y]`` of the
        curve's metric, what a rank's event tells of its records) or, without them, this
        record's value."""
        if self.first_time is None:
            self._base = self.count
            first_step, self.first_time = first if first is not None else (step, when)
            self.first_step = first_step
        self.count += n
        self.step = step if step is not None else self.step
        self.first_step = self.step if self.first_step is None else self.first_step
        self.last = values
        self.last_time = when
        if points is None:
            if metric is None or metric not in values:
                return
            x = float(step if step is not None else self.count)
            points = [[x, values[metric]]]
        for x, y in points:
            self._points += 1
            if self._points % self._stride or not math.isfinite(float(y)):
                continue
            self.curve.append((float(x), float(y)))
            if len(self.curve) >= 2 * CURVE_POINTS:
                del self.curve[1::2]
                self._stride *= 2

    @property
    def rate(self) -> float | None:
        """Reports per second between the first and the latest."""
        if self.first_time is None or self.last_time is None or self.last_time <= self.first_time:
            return None
        return (self.count - self._base - 1) / (self.last_time - self.first_time)

    @property
    def step_rate(self) -> float | None:
        """Steps per second between the first and the latest report with a step."""
        if self.step is None or self.first_step is None or self.rate is None:
            return None
        return (self.step - self.first_step) / (self.last_time - self.first_time)


class _RankStatus:
    """A rank's phase in the current placement, and what it last said it was busy with."""

    def __init__(self) -> None:
        self.phase: str | None = None  # None: submitted, its task has not started yet
        self.detail = ""
        self.time = 0.0  # when the rank said it (the rank's clock, as record times)
        self.ended: Ended | None = None  # how its task ended, as the supervisor decided

    def fresh(self, prog: _RankProgress) -> bool:
        """Whether what the rank last said it was busy with is still news: said before it
        reported anything, or at most a couple of seconds before its latest report."""
        return bool(self.detail) and self.time >= (prog.last_time or 0.0) - 2.0


class Progress:
    """Every rank's progress and status in a job's current placement.

    A resized job keeps the progress of the ranks it still has; statuses start again with
    each placement.

    Examples
    --------
    >>> p = Progress()
    >>> p.place(["tcp://a:1", "tcp://b:1"])
    >>> p.add(0, 3, 1.0, {"loss": 0.5})
    >>> p.set_status(1, "joining", "waiting for the other ranks", 1.0)
    >>> [(r["status"], r["step"]) for r in p.ranks()]
    [('running', 3), ('joining', None)]
    """

    def __init__(self) -> None:
        self.workers: list[str] = []
        self.progress: list[_RankProgress] = []
        self.status: list[_RankStatus] = []
        self.metric: str | None = None
        self.records = 0
        self.changes = 0  # status changes seen (wakes a terminal's progress line)

    def place(self, workers: list[str]) -> None:
        """A new placement on ``workers``: their statuses start again."""
        self.workers = list(workers)
        self.status = [_RankStatus() for _ in self.workers]
        del self.progress[len(self.workers) :]
        self.progress += [_RankProgress() for _ in self.workers[len(self.progress) :]]

    def add(
        self,
        rank: int,
        step: int | None,
        when: float,
        values: dict[str, float],
        n: int = 1,
        points: list[list[float]] | None = None,
        first: list[Any] | None = None,
    ) -> None:
        """``n`` records of ``rank``, the latest of them this one (``points``: the curve's
        points among them, ``first``: the first one's step and time, when the rank's event
        told them)."""
        self.records += n
        if not 0 <= rank < len(self.progress):
            return  # a rank of a placement before this one, stopping
        if self.metric is None and values:
            self.metric = pick_curve_metric(values)
        self.progress[rank].add(step, when, values, self.metric, n, points, first)
        status = self.status[rank]
        if status.phase is None:
            status.phase = "running"  # its records arrived before its status

    def take(self, rank: int, told: Told) -> None:
        """What one event of ``rank`` tells in the clear (:class:`~.protocol.Told`): its
        records and its latest status. The supervisor and every client that follows the
        job take the same events here, so that the ``/ddp/`` page and the notebook show
        one account of the job's progress."""
        last = told.last
        if last is not None:
            first = list(told.first) if told.first else None
            self.add(
                rank, last.step, last.time, last.values, told.records, told.points or None, first
            )
        if told.status is not None:
            self.set_status(rank, *told.status)

    def seed(self, ranks: list[dict[str, Any]], records: int, metric: str | None) -> None:
        """Start from a summary of the ranks so far (what :meth:`ranks` gave elsewhere): a
        client that attaches to a running job sees its progress and curve at once."""
        self.records, self.metric = records, metric
        for r in ranks:
            if 0 <= r["rank"] < len(self.progress):
                prog = self.progress[r["rank"]]
                prog.count, prog.step, prog.last = r["count"], r["step"], dict(r["last"])
                prog.curve = [(float(x), float(y)) for x, y in r["curve"]]

    def set_status(self, rank: int, phase: str | None, detail: Any, when: Any) -> None:
        """A rank's phase (None: unchanged, activity only) and what it is busy with."""
        if not 0 <= rank < len(self.status):
            return
        status = self.status[rank]
        if phase is not None:
            status.phase = phase
        status.detail = str(detail or "")
        status.time = float(when or 0.0)
        self.changes += 1

    def end(self, rank: int, ended: Ended) -> None:
        """Rank ``rank``'s task ended (the first word on it stands)."""
        if 0 <= rank < len(self.status) and self.status[rank].ended is None:
            self.status[rank].ended = ended
            self.changes += 1

    def ended(self) -> list[Ended | None]:
        """How each rank's task ended, None while it runs."""
        return [s.ended for s in self.status]

    def ranks(self, *, curve_points: int | None = None, values: int | None = None) -> list[dict]:
        """Each rank as the views draw it (the ``"ranks"`` of ``Job.view_state()``);
        ``curve_points``/``values`` thin the curve and cap the metric values kept."""
        out = []
        for r, (worker, prog, status) in enumerate(
            zip(self.workers, self.progress, self.status, strict=True)
        ):
            ended = status.ended
            error = ended.describe() if ended and ended.how is not RankEnd.FINISHED else None
            phase = ended.how.value if ended else status.phase or "submitted"
            out.append(
                {
                    "rank": r,
                    "worker": worker,
                    "status": phase,
                    "activity": status.detail if status.fresh(prog) and not ended else "",
                    "count": prog.count,
                    "step": prog.step,
                    "last": dict(list(prog.last.items())[:values]),
                    "rate": prog.rate,
                    "step_rate": prog.step_rate,
                    "error": error,
                    "curve": _thin(prog.curve, curve_points),
                }
            )
        return out

    def page_ranks(self) -> list[dict]:
        """:meth:`ranks` as the ``/ddp/`` page and an attaching client get them, capped so
        that the scheduler's memory and the page's JSON stay bounded however many ranks
        report: 16 values and 200 curve points a rank, 20,000 points in all (a 1,000-rank
        job's page was 1-1.5 MB of JSON, and building it blocked the scheduler's loop for
        0.3-1.5 s a refresh)."""
        share = PAGE_TOTAL_POINTS // max(1, len(self.workers))
        return self.ranks(curve_points=max(2, min(PAGE_CURVE_POINTS, share)), values=PAGE_VALUES)


def _thin(curve: list[tuple[float, float]], points: int | None) -> list[list[float]]:
    """``curve`` with at most about ``points`` points, the last one kept.

    >>> _thin([(x, x) for x in range(10)], 4)
    [[0.0, 0.0], [3.0, 3.0], [6.0, 6.0], [9.0, 9.0]]
    """
    if points is None:
        return [[float(x), float(y)] for x, y in curve]
    step = max(1, -(-len(curve) // points))
    kept = curve[::step]
    if curve and kept[-1] is not curve[-1]:
        kept.append(curve[-1])
    return [[float(x), float(y)] for x, y in kept]

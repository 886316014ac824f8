"""A job as one client knows it, read by :class:`~dask_ddp._client.job.Job` and the live views.

:class:`JobModel` is this client's copy of a job that lives in the cluster. Its
:class:`~dask_ddp._client.reader.EventReader` writes into it from the job's event topic: the
supervisor's messages (state, placement, history, error: :meth:`JobModel.apply_state`) and the
ranks' own messages (records, printed lines, checkpoints, results: :meth:`JobModel.add`), and
the progress each event tells in the clear, taken as the supervisor takes it
(:meth:`JobModel.told`). The :class:`~dask_ddp.Job` handle and the views read it. One
:class:`threading.Condition` guards it and wakes the readers waiting for a change
(:meth:`Job.iter_metrics`, :meth:`Job.watch`, :meth:`Job.view_state`).
"""

from __future__ import annotations

import collections
import contextvars
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .._shared import protocol, view
from .._shared.progress import Progress, view_state
from .._shared.values import (
    CheckpointInfo,
    JobState,
    MetricRecord,
    OutputLine,
    Transition,
    with_starts,
)

logger = logging.getLogger(__name__)

# The live views are redrawn at once after a quiet spell, and in batches under a stream of
# records: at most every _VIEW_GAP seconds, and at most a _VIEW_SHARE of the client's loop
# (a redraw that took d seconds waits d / _VIEW_SHARE before the next one).
_VIEW_GAP = 0.02
_VIEW_SHARE = 0.1
_OUTPUT_LINES = 10_000  # printed lines kept in Job.output (the oldest go first)
_VIEW_LINES = 8  # printed lines the live view shows


class JobModel:
    """A job's state on this client: the supervisor's word, and what the ranks sent.

    Written on the client's event loop by the job's reader; read from any thread under
    :attr:`cond`.
    """

    def __init__(self, job_id: str, name: str) -> None:
        self.job_id, self.name = job_id, name
        self.cond = threading.Condition()
        self.done = threading.Event()  # set once the outcome is known
        # The supervisor's word (apply_state).
        self.version = -1  # of the last message taken
        self.state = JobState.WAITING
        self.outcome: JobState | None = None  # where it ends, once decided (or final)
        self.attempt = 0
        self.run_id: str | None = None
        self.workers: list[str] = []
        self.backend = ""
        self.dataset: str | None = None
        self.keys: list[str] = []
        self.futures: tuple[str | None, list[Any]] = (None, [])  # the dataset's, when bound
        self.history: list[Transition] = []
        self.error: dict[str, Any] | None = None  # the job's error as the supervisor sent it
        self.wait_reason: str | None = None
        self.total_steps: int | None = None
        self.started = time.time()
        self.finished: float | None = None
        self.closed = False  # the ranks stopped and every message arrived: nothing more comes
        self._their_notes: list[str] = []
        # What the ranks sent (add).
        self.metrics: list[MetricRecord] = []
        self.output: collections.deque[OutputLine] = collections.deque(maxlen=_OUTPUT_LINES)
        self.checkpoints: list[CheckpointInfo] = []
        self.results: dict[str, collections.deque[tuple[int, str, Any]]] = {}
        self.progress = Progress()
        self._own_notes: list[str] = []  # what this client noticed (a callback failed, ...)
        # The views, redrawn on the client's loop (_VIEW_GAP, _VIEW_SHARE).
        self.views: list[Any] = []
        self.schedule: Callable[[float, Callable[[], None]], Any] | None = None
        self._view_due = False
        self._next_view = 0.0  # time.monotonic() before which no redraw is due

    @property
    def notes(self) -> list[str]:
        return self._their_notes + self._own_notes

    # -- written by the reader ------------------------------------------------------------
    def apply_state(self, msg: dict[str, Any]) -> bool:
        """Take the supervisor's message (a :class:`~dask_ddp._shared.protocol.StateMessage`
        on the wire; older ones than the last taken are ignored); return True when it starts
        a new placement."""
        m = protocol.StateMessage.from_wire(msg)
        with self.cond:
            if m.version <= self.version:
                return False
            self.version = m.version
            new = m.run_id != self.run_id and m.run_id is not None
            self.state = m.state
            self.outcome = m.outcome or (m.state if m.state.final else None)
            self.name = m.name or self.name
            self.attempt = m.attempt
            self.run_id = m.run_id
            self.backend = m.backend
            self.dataset = m.dataset
            self.keys = list(m.keys)
            self.history = with_starts(list(m.history), list(m.starts))
            self.error = m.error
            self.wait_reason = m.waiting
            self.total_steps = m.total
            self.started = m.started or self.started
            self._their_notes = list(m.notes)
            if new or list(m.workers) != self.workers:
                self.workers = list(m.workers)
                self.progress.place(self.workers)
            for rank, ended in enumerate(m.ended):
                if ended is not None:
                    self.progress.end(rank, ended)
            if self.state.final and self.finished is None:
                self.finished = time.time()
            self.cond.notify_all()
        self.mark_views()
        return new

    def set_futures(self, dataset: str, futures: list[Any]) -> None:
        """The rank futures published as ``dataset``, bound to this client."""
        with self.cond:
            self.futures = (dataset, futures)
            self.cond.notify_all()

    def seed(self, summary: dict[str, Any], checkpoints: list[dict[str, Any]]) -> None:
        """What an attaching client learns of the job so far: each rank's progress and
        curve (the capped summary the cluster keeps), and its checkpoints."""
        with self.cond:
            self.progress.seed(
                summary.get("ranks", []), summary.get("records", 0), summary.get("metric")
            )
            self.checkpoints = [CheckpointInfo(**c) for c in checkpoints]
            self.cond.notify_all()

    def told(self, rank: int, told: protocol.Told) -> None:
        """What an event of the current placement's rank ``rank`` tells in the clear: the
        progress the views show, taken as the supervisor takes it (one account)."""
        with self.cond:
            self.progress.take(rank, told)
        self.mark_views()

    def add(self, rank: int, msgs: list[list[Any]]) -> tuple[list, list]:
        """Take a rank's decoded messages; return the new records and printed lines."""
        records: list[MetricRecord] = []
        printed: list[OutputLine] = []
        with self.cond:
            for kind, body in msgs:
                if kind == protocol.METRICS:
                    m = protocol.Metric(*body)
                    records.append(MetricRecord(rank, m.step, m.time, m.values))
                elif kind == protocol.CHECKPOINT:
                    c = protocol.CheckpointNote(*body)
                    info = CheckpointInfo(
                        c.url, c.step, c.nbytes, rank, c.time, c.stall, c.world_size
                    )
                    if info not in self.checkpoints:
                        self.checkpoints.append(info)
                elif kind == protocol.RESULT:
                    r = protocol.Result(*body)
                    self.results.setdefault(r.key, collections.deque()).append(
                        (rank, r.path, r.data)
                    )
                elif kind == protocol.OUTPUT:
                    o = protocol.Output(*body)
                    printed += [OutputLine(rank, o.stream, line) for line in o.text.split("\n")]
            self.metrics.extend(records)
            self.output.extend(printed)
            self.cond.notify_all()
        self.mark_views()
        return records, printed

    def note(self, text: str) -> None:
        """Something this client noticed (a callback failed, messages were lost)."""
        with self.cond:
            self._own_notes.append(text)
        self.mark_views()

    def finish(self) -> None:
        """The outcome is known (a final state): :meth:`Job.result` returns from now on."""
        with self.cond:
            self.done.set()
            self.cond.notify_all()
        self.refresh_views()

    def close(self) -> None:
        """Nothing more arrives: wake every reader for the last time."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.done.set()
        self.refresh_views()

    # -- views ------------------------------------------------------------------------
    def mark_views(self) -> None:
        """A change the views should show: at once if they are not drawn too often."""
        if not self.views or self._view_due or self.schedule is None:
            return
        self._view_due = True
        self.schedule(max(0.0, self._next_view - time.monotonic()), self.refresh_views)

    def refresh_views(self) -> None:
        """Redraw the views now. They are drawn in an empty context: the client's event
        loop runs its callbacks in the context of the notebook cell that started it (the
        one that made the Client), and the kernel would send the drawing as that cell's
        output; with no context it goes with the cell running now, as a thread's would."""
        contextvars.Context().run(self._refresh_views)

    def _refresh_views(self) -> None:
        self._view_due = False
        if not self.views:
            return
        began = time.monotonic()
        state = self.snapshot()
        for shown in list(self.views):
            try:
                shown.update(state)
            except Exception:  # a closed notebook must not stop the job's reader
                logger.debug("job %s: live view update failed", self.job_id, exc_info=True)
        took = time.monotonic() - began
        self._next_view = began + max(_VIEW_GAP, took / _VIEW_SHARE)

    def snapshot(self) -> dict[str, Any]:
        """The state the views draw (see :meth:`dask_ddp.Job.view_state`)."""
        with self.cond:
            end = self.finished if self.finished is not None else time.time()
            error = self.error or {}
            return view_state(
                job=self.job_id,
                name=self.name,
                state=self.state.value,
                waiting=self.wait_reason,
                total=self.total_steps,
                backend=self.backend,
                elapsed=end - self.started,
                attempts=self.attempt + 1,
                records=len(self.metrics) or self.progress.records,
                ranks=self.progress.ranks(),
                metric=self.progress.metric,
                error=error.get("summary"),
                traceback=error.get("traceback"),
                notes=self.notes,
                output=[
                    f"[rank {o.rank}] {o.text}"
                    for o in itertools.islice(reversed(self.output), _VIEW_LINES)
                ][::-1],
            )

    def progress_line(self) -> str:
        """One line for a terminal: each rank's step and latest metrics."""
        return view.progress_line(self.snapshot())

    def wait_state(
        self, until: Callable[[dict[str, Any]], bool] | None, timeout: float | None
    ) -> dict[str, Any]:
        """:meth:`snapshot`, once ``until(snapshot)`` holds (see ``Job.view_state``)."""
        if until is None:
            return self.snapshot()
        with self.cond:
            if not self.cond.wait_for(lambda: until(self.snapshot()) or self.closed, timeout):
                raise TimeoutError(f"job {self.job_id}: the state did not come within {timeout} s")
            state = self.snapshot()
        if not until(state):
            raise TimeoutError(f"job {self.job_id}: the job ended before the state came")
        return state

    # -- readers ----------------------------------------------------------------------
    def iter_metrics(self, timeout: float | None = None) -> Iterator[MetricRecord]:
        """Every record from the first, as it arrives, until nothing more comes."""
        seen = 0
        while True:
            with self.cond:
                if not self.cond.wait_for(
                    lambda n=seen: len(self.metrics) > n or self.closed, timeout
                ):
                    raise TimeoutError(f"job {self.job_id}: no record arrived within {timeout} s")
                new = self.metrics[seen:]
                closed = self.closed
            seen += len(new)
            yield from new
            if closed and not new:
                return

    def progress_lines(self) -> Iterator[tuple[int, str]]:
        """(record count, progress line) at each new record or status, until closed."""
        shown, changes = -1, -1
        while True:
            with self.cond:
                self.cond.wait_for(
                    lambda n=shown, c=changes: (
                        len(self.metrics) > n or self.progress.changes != c or self.closed
                    )
                )
                shown, changes, closed = len(self.metrics), self.progress.changes, self.closed
                line = self.progress_line()
            yield shown, line
            if closed:
                return

    def take_results(self, key: str) -> Iterator[tuple[int, str, Any]]:
        """Pop results sent with ``key`` as they arrive, until nothing more comes."""
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.results.get(key) or self.closed)
                pending = self.results.get(key)
                if not pending:
                    return
                item = pending.popleft()
            yield item

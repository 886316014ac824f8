"""What a rank is doing, for the client's live view: its phase and its current activity.

A rank passes through phases before its function trains: *queued* (another job's rank
holds its worker), *joining* (waiting for the other ranks at the rendezvous), *running*.
While it runs, library code says what it is busy with (listing a bucket, filling a cache)
through :func:`activity`, and long waits register a probe with :func:`watch` that is
sampled every second. Each change goes to the client as one small, unnumbered event on the
job's topic (:func:`dask_ddp.events.job_topic`): best effort, never blocking and never
raising, so a lost one only leaves the view a second behind.

Outside a rank (in the notebook, or in a DataLoader worker process, which cannot send
events through the worker's connection) the same calls only log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

QUEUED = "queued"
JOINING = "joining"
RUNNING = "running"

#: Seconds between two samples of the probes registered with :func:`watch`.
PROBE_PERIOD = 1.0


class _Target:
    """Where this process's rank sends its status; one per rank, set by the bootstrap."""

    def __init__(self, worker: Any, job_id: str, rank: int) -> None:
        self.worker = worker
        self.job_id = job_id
        self.rank = rank
        self.pid = os.getpid()
        self.last: tuple[str | None, str] | None = None
        self.probes: list[Callable[[], str | None]] = []
        self.stop = threading.Event()
        self.poller: threading.Thread | None = None
        self.lock = threading.Lock()

    def send(self, phase: str | None, detail: str) -> None:
        from .events import job_topic

        if os.getpid() != self.pid or self.last == (phase, detail):
            return
        self.last = (phase, detail)
        fields = {"job": self.job_id, "rank": self.rank, "status": phase, "detail": detail}
        try:
            self.worker.log_event(job_topic(self.job_id), {**fields, "time": time.time()})
        except Exception:  # the view is best effort: training must not fail for it
            logger.debug("job %s: status not sent", self.job_id, exc_info=True)

    def poll(self) -> None:
        while not self.stop.wait(PROBE_PERIOD):
            with self.lock:
                probes = list(self.probes)
            for probe in probes:
                try:
                    text = probe()
                except Exception:
                    logger.debug("a status probe failed", exc_info=True)
                    continue
                if text:
                    self.send(None, text)


_target: _Target | None = None


@contextlib.contextmanager
def reporting(worker: Any, job_id: str, rank: int) -> Iterator[None]:
    """Send this process's status to the client of ``job_id`` while the block runs."""
    global _target
    target = _Target(worker, job_id, rank)
    _target = target
    try:
        yield
    finally:
        _target = None
        target.stop.set()
        if target.poller is not None:
            target.poller.join()


def phase(name: str, detail: str = "") -> None:
    """Enter a phase (:data:`QUEUED`, :data:`JOINING`, :data:`RUNNING`)."""
    if _target is not None:
        _target.send(name, detail)


def activity(text: str) -> None:
    """Say what the rank is busy with (logged at INFO in any case).

    >>> activity("listing s3://bucket/train")
    """
    logger.info("%s", text)
    if _target is not None:
        _target.send(None, text)


def watch(probe: Callable[[], str | None]) -> Callable[[], None]:
    """Sample ``probe`` every second while the rank runs; its text, when it changes, is
    the rank's activity. Returns a function that stops sampling it. Outside a rank it
    does nothing.

    >>> stop = watch(lambda: "cache: 10 of 100 files")
    >>> stop()
    """
    target = _target
    if target is None or os.getpid() != target.pid:
        return lambda: None
    with target.lock:
        target.probes.append(probe)
        if target.poller is None:
            target.poller = threading.Thread(
                target=target.poll, name=f"dask-ddp-status-{target.job_id}", daemon=True
            )
            target.poller.start()

    def stop() -> None:
        with target.lock, contextlib.suppress(ValueError):
            target.probes.remove(probe)

    return stop

"""One background prefetcher for the datasets: shards into the cache, windows of a collection.

A :class:`Prefetcher` runs ``fetch(item)`` in one background thread over the items it is
told it will need (:meth:`Prefetcher.want`), in order. Two uses:

- *warming* (``keep_results=False``): the shard dataset asks for the next shards of its
  reading order; a fetch's result is the cached file, so nothing is kept, and a fetch that
  fails is only logged (the reader's own read raises it properly);
- *read-ahead* (``keep_results=True``, ``ahead=N``): a collection's windows are fetched at
  most ``N`` ahead of the one the training loop holds, and :meth:`Prefetcher.results`
  yields them in order, raising a fetch's exception where its result would be.

Everything waits on one condition variable: no polling. The thread ends when nothing is
left to fetch (a later :meth:`~Prefetcher.want` starts a new one), so a process that trains
job after job keeps no thread, and no dataset, of a finished job. Fetches run in a copy of
the creating thread's context variables, so Dask calls made there know the rank's worker.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class Prefetcher(Generic[T, R]):
    """Fetch items in a background thread, ahead of the reader.

    Parameters
    ----------
    fetch : callable
        Called with each wanted item, in order, in the background thread.
    name : str
        Names the thread (``dask-ddp-prefetch-<name>``).
    ahead : int, optional
        With ``keep_results``: at most this many results fetched and not yet taken.
        None: no bound.
    keep_results : bool
        Keep each result (and error) for :meth:`results`; False: drop them.

    Examples
    --------
    >>> p = Prefetcher(lambda x: x * x, name="doc", ahead=2)
    >>> p.want([1, 2, 3])
    >>> list(p.results())
    [1, 4, 9]
    """

    def __init__(
        self,
        fetch: Callable[[T], R],
        *,
        name: str,
        ahead: int | None = None,
        keep_results: bool = True,
    ) -> None:
        if ahead is not None and ahead < 1:
            raise ValueError(f"ahead= must be at least 1 or None, got {ahead!r}")
        self._fetch = fetch
        self._name = name
        self._ahead = ahead
        self._keep = keep_results
        self._context = contextvars.copy_context()
        self._cond = threading.Condition()
        self._wanted: deque[T] = deque()
        self._ready: deque[tuple[bool, R | BaseException]] = deque()
        self._running = False  # a thread is running (fetching, or waiting for room)
        self._closed = False

    @property
    def busy(self) -> bool:
        """Whether a fetch is under way or wanted."""
        with self._cond:
            return self._running

    def want(self, items: Sequence[T]) -> None:
        """Fetch ``items`` next, in order, replacing what was wanted and not yet started."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"prefetcher {self._name} is closed")
            self._wanted = deque(items)
            if self._wanted and not self._running:
                self._running = True
                thread = threading.Thread(
                    target=self._context.copy().run,
                    args=(self._run,),
                    name=f"dask-ddp-prefetch-{self._name}",
                    daemon=True,
                )
                thread.start()
            self._cond.notify_all()

    def results(self) -> Iterator[R]:
        """Yield the kept results in order until nothing more is wanted or fetching.

        A fetch that raised raises here, in its place; nothing after it is fetched.
        """
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._ready or self._closed or not self._running)
                if not self._ready:
                    return
                ok, value = self._ready.popleft()
                self._cond.notify_all()  # room for the next fetch
            if not ok:
                assert isinstance(value, BaseException)
                raise value
            yield value  # type: ignore[misc]

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is wanted or being fetched; False if ``timeout`` passed."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._running, timeout)

    def close(self) -> None:
        """Stop: nothing more is fetched (one under way finishes) and kept results drop."""
        with self._cond:
            self._closed = True
            self._wanted.clear()
            self._ready.clear()
            self._cond.notify_all()

    def _has_room(self) -> bool:
        return not self._keep or self._ahead is None or len(self._ready) < self._ahead

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or not self._wanted or self._has_room())
                if self._closed or not self._wanted:
                    self._running = False
                    self._cond.notify_all()
                    return
                item = self._wanted.popleft()
            try:
                result: tuple[bool, R | BaseException] = (True, self._fetch(item))
            except Exception as exc:
                result = (False, exc)
            with self._cond:
                if not result[0]:
                    if self._keep:
                        self._wanted.clear()  # the reader raises it; nothing after it
                    else:  # the reader's own read of it raises the error properly
                        logger.debug("prefetch %s of %r failed: %s", self._name, item, result[1])
                if self._keep and not self._closed:
                    self._ready.append(result)
                self._cond.notify_all()

"""The datasets' one background prefetcher (dask_ddp/data/_prefetch.py), on real threads."""

from __future__ import annotations

import contextvars
import threading

import pytest

from dask_ddp.data._prefetch import Prefetcher


def test_results_come_in_order_and_the_thread_ends() -> None:
    p = Prefetcher(lambda x: x * 10, name="order", ahead=2)
    p.want(range(6))
    assert list(p.results()) == [0, 10, 20, 30, 40, 50]
    assert p.wait_idle(10) and not p.busy
    assert not any(t.name == "dask-ddp-prefetch-order" for t in threading.enumerate())


def test_never_more_than_ahead_fetched_and_not_taken() -> None:
    fetched: list[int] = []
    held = threading.Condition()

    def fetch(x: int) -> int:
        with held:
            fetched.append(x)
            held.notify_all()
        return x

    p = Prefetcher(fetch, name="ahead", ahead=2)
    p.want(range(10))
    results = p.results()
    assert next(results) == 0  # taken: room for one more beyond the two ready
    with held:
        assert held.wait_for(lambda: len(fetched) == 3, timeout=10)
        assert not held.wait_for(lambda: len(fetched) > 3, timeout=0.3)  # it waits for room
    assert list(results) == list(range(1, 10))


def test_a_failed_fetch_raises_in_its_place_and_stops() -> None:
    def fetch(x: int) -> int:
        if x == 2:
            raise ValueError("window 2 is gone")
        return x

    calls: list[int] = []
    p = Prefetcher(lambda x: calls.append(x) or fetch(x), name="fail", ahead=1)
    p.want(range(5))
    results = p.results()
    assert [next(results), next(results)] == [0, 1]
    with pytest.raises(ValueError, match="window 2 is gone"):
        next(results)
    assert p.wait_idle(10) and calls == [0, 1, 2]


def test_warming_drops_results_and_errors_and_want_replaces() -> None:
    gate = threading.Event()
    done: list[int] = []

    def fetch(x: int) -> None:
        gate.wait(10)
        if x == 1:
            raise OSError("not cached: the reader will say so")
        done.append(x)

    p: Prefetcher[int, None] = Prefetcher(fetch, name="warm", keep_results=False)
    p.want([0, 1, 2, 3])
    p.want([1, 5])  # the reader moved on: 0 (under way) finishes, then 1 and 5 only
    gate.set()
    assert p.wait_idle(10)
    assert done in ([0, 5], [5])
    assert list(p.results()) == []
    p.want([7])  # a new thread for new work
    assert p.wait_idle(10) and done[-1] == 7


def test_close_stops_fetching() -> None:
    started = threading.Event()
    release = threading.Event()

    def fetch(x: int) -> int:
        started.set()
        release.wait(10)
        return x

    p = Prefetcher(fetch, name="close", ahead=1)
    p.want(range(100))
    assert started.wait(10)
    p.close()
    release.set()
    assert p.wait_idle(10)
    assert list(p.results()) == []
    with pytest.raises(RuntimeError, match="closed"):
        p.want([1])


def test_fetches_see_the_creating_threads_context() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    var.set("rank 3")
    p = Prefetcher(lambda _: var.get(), name="context")
    p.want([0, 1])
    assert list(p.results()) == ["rank 3", "rank 3"]


def test_bad_ahead_is_refused() -> None:
    with pytest.raises(ValueError, match="ahead= must be at least 1"):
        Prefetcher(lambda x: x, name="bad", ahead=0)

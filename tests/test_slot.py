"""The per-process slot of the rank side (dask_ddp._rank.slot) and what the context reads
from it."""

from __future__ import annotations

import threading

import pytest
import torch

import dask_ddp
from dask_ddp._rank.context import _activated
from dask_ddp._rank.slot import PROCESS, CheckpointSettings, ProcessSlot, RankContext, RankRun
from dask_ddp._shared.placement import RankPlacement
from dask_ddp._shared.protocol import EventPlan, RankSpec, Rendezvous


def _run(job: str = "3f2a", rank: int = 0) -> RankRun:
    return RankRun(job, f"dask-ddp-{job}-rank-{rank}", rank)


def _spec(job: str, rank: int = 0, world: int = 1, host: str = "w", port: int = 1) -> RankSpec:
    """Rank ``rank``'s spec of a ``world``-rank job whose store is at ``host:port``."""
    placement = RankPlacement(rank, 0, world, 0, 1, "tcp://w:1", "w", False, None)
    return RankSpec(
        job_id=job, run_id=job, key=f"dask-ddp-{job}-rank-{rank}", attempt=0,
        placement=placement, rendezvous=Rendezvous("gloo", host, port, 60, 20),
        events=EventPlan(f"dask-ddp-{job}"),
    )  # fmt: skip


def test_a_second_run_queues_until_the_first_releases() -> None:
    slot = ProcessSlot()
    first, second = _run("a"), _run("b")
    assert slot.claim(first, timeout=1)
    holders: list[RankRun] = []
    claimed = threading.Event()

    def claim_second() -> None:
        if slot.claim(second, timeout=60, on_wait=holders.append):
            claimed.set()

    thread = threading.Thread(target=claim_second)
    thread.start()
    assert not claimed.wait(0.2)  # queued behind the first
    slot.release(first)
    thread.join(60)
    assert claimed.is_set() and slot.current() is second and holders == [first]
    slot.release(second)
    assert slot.current() is None


def test_claim_gives_up_after_its_timeout() -> None:
    slot = ProcessSlot()
    assert slot.claim(_run("a"), timeout=1)
    assert not slot.claim(_run("b"), timeout=0.05)


def test_release_ends_the_runs_helpers_once() -> None:
    slot, run, ended = ProcessSlot(), _run(), []
    run.on_end.append(lambda: ended.append("follower"))
    assert slot.claim(run, timeout=1)
    slot.release(run)
    slot.release(run)  # a second release neither fails nor calls them again
    assert ended == ["follower"] and run.on_end == []


def test_a_store_is_handed_over_once() -> None:
    slot, store = ProcessSlot(), object()
    slot.put_store("3f2a", store)
    assert slot.take_store("3f2a") is store
    assert slot.take_store("3f2a") is None


def _context(rank: int = 0) -> RankContext:
    return RankContext(
        rank=rank,
        local_rank=rank,
        world_size=2,
        local_world_size=2,
        node_rank=0,
        device=torch.device("cpu"),
        backend="gloo",
        attempt=0,
        job_id="3f2a",
        worker="tcp://127.0.0.1:1",
        master_addr="127.0.0.1",
        master_port=1,
    )


class _Shard:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_the_context_is_the_running_ranks_only_while_its_function_runs() -> None:
    with pytest.raises(dask_ddp.errors.NotInRankError, match="get_context"):
        dask_ddp.get_context()
    run = _run()
    assert PROCESS.claim(run, timeout=1)
    try:
        with pytest.raises(dask_ddp.errors.NotInRankError):
            dask_ddp.get_context()  # claimed, but the function has not started
        shard = _Shard()
        with _activated(run, _context(), CheckpointSettings(None)) as ctx:
            assert dask_ddp.get_context() is ctx
            assert dask_ddp.get_checkpoint() is None  # no checkpoint_dir
            run.dataset_shards["train"] = shard
        assert shard.closed and run.context is None and run.dataset_shards == {}
        with pytest.raises(dask_ddp.errors.NotInRankError, match="report"):
            dask_ddp.report({"loss": 1.0})
    finally:
        PROCESS.release(run)


def test_a_job_stopped_before_its_rank_started_stops_the_rank_when_it_does() -> None:
    from dask_ddp._rank import tasks as bootstrap

    # The client stops a job whose task the worker has started but whose rank has not
    # claimed the slot yet: nothing to abort now, so the stop is remembered.
    assert bootstrap.abort_rank("late-job", "cancelled by the user") is False
    assert PROCESS.stopped_before_start("late-job") == ("cancelled by the user", None)
    spec = _spec("late-job")
    ran = []
    with (
        pytest.raises(dask_ddp.RankStoppedError, match="cancelled by the user"),
        bootstrap._claim_slot(spec, _run("late-job"), PROCESS),
    ):
        ran.append(True)
    assert ran == [] and PROCESS.current() is None  # never ran, and the slot is free again


def test_a_rank_stopped_while_it_connects_to_a_gone_store_stops_there() -> None:
    import socket

    from dask_ddp._rank import tasks as bootstrap
    from dask_ddp._rank.slot import StopRequested

    # Rank 0's store is gone (closed by the abort, or with its worker): rank 1 connects to
    # a port nothing listens on. Stopped meanwhile, it stops at the next try, a safe point,
    # instead of sitting in C++ for the whole rendezvous timeout (and costing its worker a
    # restart): StopRequested, never the RendezvousTimeoutError of the timeout.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = _spec("gone-store", rank=1, world=2, host="127.0.0.1", port=port)
    slot, run = ProcessSlot(), _run("gone-store", 1)
    assert slot.claim(run, timeout=1)
    stopper = threading.Timer(0.5, slot.stop, args=("gone-store", "cancelled by the user", None))
    stopper.start()
    try:
        with pytest.raises(StopRequested, match="cancelled by the user"):
            bootstrap._connect_store(spec, run, slot, lane=False)
    finally:
        stopper.join()
        slot.release(run)


def test_ranks_released_by_an_abort_all_stop_at_the_rendezvous_even_the_last_to_join() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from dask_ddp._rank import host
    from dask_ddp._rank import tasks as bootstrap

    # The abort released the rendezvous before every rank joined. The last rank to join
    # must read that word too, not write "all joined" over it: had it gone on into
    # init_process_group alone, it would wait there in C++ for the others until the
    # group's timeout, and its worker be restarted.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    host.release_waiters_at(("127.0.0.1", store.port))
    for r in (0, 1):  # rank 1 is the last to join
        spec = _spec("released", rank=r, world=2, host="127.0.0.1", port=store.port)
        with pytest.raises(dask_ddp.RankStoppedError, match="stopped while ranks gathered"):
            bootstrap._rendezvous(store, spec, _run("released", r))


def test_random_claims_stops_and_releases_keep_one_job_s_ranks_in_a_slot() -> None:
    # The model: a worker's slot holds the ranks of one job at a time (several ranks per
    # worker), another job's rank waits (here: a claim that does not wait, refused), a stop
    # reaches exactly that job's ranks and any of its ranks that come later, a release
    # frees one rank only. Random events, the invariants after each.
    import random

    rng = random.Random(56)
    for _ in range(300):
        slot = ProcessSlot()
        held: list[RankRun] = []  # what the model says holds the slot
        stopped: set[str] = set()
        for n in range(40):
            event = rng.choice(["claim", "claim", "release", "stop"])
            job = rng.choice(["a", "b", "c"])
            if event == "claim":
                run = RankRun(job, f"{job}-{n}", rng.randrange(4))
                took = slot.claim(run, timeout=0)
                others = [r for r in held if r.job_id != job]
                if job in stopped and others:
                    assert took and all(r is not run for r in slot.runs)  # ends without it
                elif others:
                    assert not took
                else:
                    assert took
                    held.append(run)
            elif event == "release" and held:
                run = rng.choice(held)
                slot.release(run)
                held = [r for r in held if r is not run]
            elif event == "stop":
                asked = slot.stop(job, "stopped by the model", None)
                assert asked == [r for r in held if r.job_id == job]
                assert all(r.stop_reason == "stopped by the model" for r in asked)
                assert slot.stopped_before_start(job) == ("stopped by the model", None)
                stopped.add(job)
            assert slot.runs == held
            assert len({r.job_id for r in slot.runs}) <= 1
            assert slot.running() == sorted(held, key=lambda r: r.rank)

"""Restarts from checkpoints kept in peers' memory, on a real LocalCluster whose workers are
killed, with the checkpoints on a real S3 server behind a proxy that delays every request.

One cluster for the module (its tests kill workers; the nanny replaces each one). Every run
trains the same deterministic model, so each restarted run must end with exactly the
parameters of the uninterrupted one.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import distributed
import pytest
import torch
from distributed import Client, LocalCluster

import dask_ddp
from dask_ddp._rank import checkpoint, replicas

STEPS, EVERY = 12, 3  # checkpoints at steps 2, 5, 8, 11


def _train(
    directory: str, options: dict | None, per_rank: bool, kill_self: bool, settle: bool
) -> dict:
    """DDP on a 6 MB layer; per step data fixed by the step. ``settle``: on the first
    attempt, wait until each checkpoint is durable and replicated (so that what a kill
    finds is known); ``kill_self``: rank 1 SIGKILLs its own worker at step 7."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(1024, 1536))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    visible = checkpoint.list_checkpoints(directory, options)
    # what the store itself loads as the latest, when a restarted attempt begins
    latest = None
    if ctx.attempt and ctx.rank == 0 and not per_rank:
        latest = checkpoint.latest(directory, storage_options=options)[0]
    start = 0
    state = dask_ddp.get_checkpoint(per_rank=per_rank)
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(1000 * step + ctx.rank)
        opt.zero_grad()
        model(torch.randn(8, 1024, generator=g)).pow(2).mean().backward()
        opt.step()
        if step % EVERY == EVERY - 1:
            pending = dask_ddp.save_checkpoint(
                {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                step=step,
                per_rank=per_rank,
            )
            if settle and ctx.attempt == 0:
                if pending is not None:
                    pending.wait(60)
                # before rank 1 dies: a stop reaches a rank at once, and a rank that stops
                # gives up the checkpoint it still writes
                torch.distributed.barrier()
        if kill_self and ctx.attempt == 0 and ctx.rank == 1 and step == 7:
            # The rank's worker dies (get_worker() in a rank: a stand-in that knows its pid), and
            # the rank with it.
            os.kill(distributed.get_worker().pid, signal.SIGKILL)
            time.sleep(60)
    return {
        "attempt": ctx.attempt,
        "start": start,
        "visible": [s for s, _ in visible],
        "latest": latest,
        "params": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
    }


def _cluster() -> LocalCluster:
    return LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0")


@pytest.fixture
def killing_cluster() -> Iterator[LocalCluster]:
    # One per test, on the default configuration: a test kills a worker, and SpecCluster
    # closes a worker's nanny lost-worker-timeout after a removal if the same worker is
    # killed again while it restarts (Dask's quirk, which the tests' own kills would hit).
    with _cluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The parameters of the uninterrupted run."""
    directory = str(tmp_path_factory.mktemp("reference"))
    with _cluster() as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        out = dask_ddp.launch(
            client, _train, args=(directory, None, False, False, False),
            checkpoint_dir=directory,
        ).result(timeout=120)  # fmt: skip
    return out[0]["params"]


def _options(endpoint: str) -> dict:
    # 5 MB blocks: a checkpoint of this model (12.6 MB) is a multipart upload
    return {"key": "testing", "secret": "testing", "endpoint_url": endpoint,
            "default_block_size": 5 * 2**20}  # fmt: skip


def _rank_1_killed(
    client: Client, url: str, flaky_proxy, *, per_rank: bool
) -> tuple[dask_ddp.Job, list[dict], dict]:
    """Train with checkpoints under ``url`` through a 20 ms proxy while rank 1 SIGKILLs its
    own worker at step 7 (one restart allowed): the job, its ranks' results, the options."""
    client.wait_for_workers(2, timeout="60s")
    options = _options(flaky_proxy(delay=0.02).url)
    job = dask_ddp.launch(
        client, _train, args=(url, options, per_rank, True, True), checkpoint_dir=url,
        storage_options=options, max_restarts=1,
    )  # fmt: skip
    return job, job.result(timeout=180), options


def _resumed(job: dask_ddp.Job) -> dask_ddp.Transition:
    return [t for t in job.history if t.state.value == "running"][-1]


def _same_params(out: list[dict], reference: dict) -> None:
    for name, value in reference.items():
        for o in out:
            torch.testing.assert_close(o["params"][name], value, rtol=0, atol=0)


@pytest.mark.slow
def test_rank_0_killed_midway_through_an_upload_resumes_from_the_peer_replica(
    killing_cluster, reference, s3_client, bucket, flaky_proxy
) -> None:
    url = f"s3://{bucket}/peer"
    with Client(killing_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        killed: list[bytes] = []
        pid: list[int] = []

        def kill_rank_0(head: bytes) -> None:
            # The first part of step 8's multipart upload (the upload is open, its bytes on
            # their way): rank 0's worker dies midway through it.
            first = head.split(b"\r\n", 1)[0]
            if not killed and b"checkpoint-000000000008.pt?" in first and b"partNumber=1&" in first:
                killed.append(head)
                os.kill(pid[0], signal.SIGKILL)

        options = _options(flaky_proxy(delay=0.02, on_request=kill_rank_0).url)
        job = dask_ddp.launch(
            client, _train, args=(url, options, False, False, True), checkpoint_dir=url,
            storage_options=options, max_restarts=1,
        )  # fmt: skip
        rank0 = job.workers[0]
        pid.append(client.run(os.getpid, workers=[rank0])[rank0])
        out = job.result(timeout=180)
    assert killed
    assert [o["attempt"] for o in out] == [1, 1]
    # When attempt 1 started, step 5 was still the latest: nothing of step 8 was visible.
    assert out[0]["visible"] == [2, 5]
    assert out[0]["latest"] == 5  # and it loads from the store, not only from the replica
    assert [o["start"] for o in out] == [6, 6]
    resumed = _resumed(job)
    assert (resumed.attempt, resumed.restored_from, resumed.restored_step) == (1, "peer", 5)
    _same_params(out, reference)
    assert [c.step for c in job.checkpoints] == [2, 5, 8, 11]


@pytest.mark.slow
def test_with_the_replica_s_worker_lost_too_it_resumes_from_the_store(
    killing_cluster, reference, bucket, flaky_proxy
) -> None:
    with Client(killing_cluster) as client:
        # Rank 0 writes; its replicas live on rank 1's worker, which dies.
        job, out, _ = _rank_1_killed(client, f"s3://{bucket}/store", flaky_proxy, per_rank=False)
    assert [o["start"] for o in out] == [6, 6]
    resumed = _resumed(job)
    assert (resumed.restored_from, resumed.restored_step) == ("store", 5)
    _same_params(out, reference)


@pytest.mark.slow
def test_per_rank_state_resumes_from_the_replica_that_survived(
    killing_cluster, reference, bucket, flaky_proxy
) -> None:
    url = f"s3://{bucket}/shards"
    with Client(killing_cluster) as client:
        job, out, options = _rank_1_killed(client, url, flaky_proxy, per_rank=True)
        # Rank 0's part was kept on rank 1's worker (lost): from the store; rank 1's part
        # was kept on rank 0's worker: from there.
        resumed = _resumed(job)
        assert (resumed.restored_from, resumed.restored_step) == ("peer+store", 5)
        assert [o["start"] for o in out] == [6, 6]
        _same_params(out, reference)
        shards = checkpoint.list_shards(url, options)
        assert [(s, w, sorted(f)) for s, w, f in shards][-1] == (11, 2, [0, 1])
        assert job.wait_stopped(60)
        job.forget()
        # The job ended: no worker keeps its replicas any more.
        held = client.run(_held, job.job_id)
    assert set(held.values()) == {0}


def _held(job_id: str, dask_worker=None) -> int:
    from dask_ddp._rank.replicas import STORE

    return sum(1 for key in STORE.held() if key[0] == job_id)


def _unannounced(directory: str, go: str) -> dict:
    """Rank 0 saves step 3 (its replica kept on rank 1's worker) but never says the
    replica landed, as when its worker is SIGKILLed just after; once told (the Event
    ``go``), it is killed. The next attempt reports where its state came from."""
    from distributed import Event

    from dask_ddp._rank import saving
    from dask_ddp._shared import protocol

    ctx = dask_ddp.get_context()
    state = dask_ddp.get_checkpoint()
    if ctx.attempt == 0:
        if ctx.rank == 0:  # the patch dies with this worker
            say = saving.Saver._say
            saving.Saver._say = lambda self, kind, body: (
                None if kind == protocol.REPLICA else say(self, kind, body)
            )
        pending = dask_ddp.save_checkpoint({"w": torch.arange(1000.0), "step": 3}, step=3)
        if pending is not None:
            pending.wait(60)
            Event(go).wait(60)
            # The rank's worker dies (get_worker() in a rank: a stand-in that knows its pid), and
            # the rank with it.
            os.kill(distributed.get_worker().pid, signal.SIGKILL)
            time.sleep(60)
        torch.distributed.barrier()  # fails once rank 0 is gone
    return {"step": state["step"], "w": state["w"].sum().item()}


@pytest.mark.slow
def test_a_replica_its_rank_did_not_announce_is_found_on_its_holder(
    killing_cluster, tmp_path
) -> None:
    from distributed import Event

    with Client(killing_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        go = Event(f"go-{tmp_path.name}", client=client)
        job = dask_ddp.launch(
            client, _unannounced, args=(str(tmp_path), go.name), checkpoint_dir=str(tmp_path),
            max_restarts=1,
        )  # fmt: skip
        # the supervisor knows the checkpoint is durable, not that it was replicated
        job.view_state(lambda _: bool(job.checkpoints), timeout=60)
        go.set()
        out = job.result(timeout=120)
    assert out == [{"step": 3, "w": 499500.0}] * 2
    resumed = _resumed(job)
    assert (resumed.attempt, resumed.restored_from, resumed.restored_step) == (1, "peer", 3)


# --- a replica fetched piece by piece (PeerLink, worker to worker) ---
def _hold(job_id: str, step: int, data: bytes, dask_worker=None) -> None:
    from dask_ddp._rank.replicas import STORE

    STORE.reserve((job_id, 0, None), len(data), budget=2**40, memory=None)
    assert STORE.put((job_id, 0, None), step, data)


def _fetch(job_id: str, holder: str, step: int, piece: int) -> tuple[str, bytes | None, bool]:
    from distributed import get_worker

    from dask_ddp._rank.replicas import PeerLink

    got = PeerLink(get_worker(), job_id, piece=piece).fetch(holder, 0, None, step)
    if got is None:
        return "none", None, False
    aligned = isinstance(got, torch.Tensor) and got.data_ptr() % 64 == 0
    return type(got).__name__, bytes(got.numpy() if isinstance(got, torch.Tensor) else got), aligned


def _put_again_and_again(job_id: str, step: int, versions: list[bytes], dask_worker=None) -> int:
    """Put ``versions`` of the same step in turn for a while (as a second save of one step
    would): a fetch running meanwhile must never mix pieces of two."""
    import time

    from dask_ddp._rank.replicas import STORE

    deadline, puts = time.monotonic() + 3, 0
    while time.monotonic() < deadline:
        data = versions[puts % len(versions)]
        STORE.reserve((job_id, 0, None), len(data), budget=2**40, memory=None)
        STORE.put((job_id, 0, None), step, data)
        puts += 1
        time.sleep(0.001)
    return puts


@pytest.fixture
def holder_and_reader(killing_cluster: LocalCluster) -> Iterator[tuple[Client, str, str]]:
    from dask_ddp._rank.replicas import ReplicaPlugin

    with Client(killing_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        client.register_plugin(ReplicaPlugin())
        holder, reader = sorted(client.scheduler_info()["workers"])
        yield client, holder, reader


def test_a_replica_arrives_whole_in_pieces_into_an_aligned_buffer(holder_and_reader) -> None:
    client, holder, reader = holder_and_reader
    data = os.urandom(100_003)  # 13 pieces of 8,000 bytes, the last one short
    client.run(_hold, "pieces", 4, data, workers=[holder])
    kind, got, aligned = client.submit(
        _fetch, "pieces", holder, 4, 8_000, workers=[reader], pure=False
    ).result(timeout=60)
    assert (kind, got == data, aligned) == ("Tensor", True, True)
    # another step than the one held: nothing, and the caller falls back to the store
    missing = client.submit(_fetch, "pieces", holder, 5, 8_000, workers=[reader], pure=False)
    assert missing.result(timeout=60)[0] == "none"
    # from its own worker's store: the store's bytes themselves, not a copy
    kind, got, _ = client.submit(
        _fetch, "pieces", holder, 4, 8_000, workers=[holder], pure=False
    ).result(timeout=60)
    assert kind != "Tensor" and got == data


@pytest.mark.slow
def test_a_replica_put_again_while_it_travels_is_never_mixed(holder_and_reader) -> None:
    client, holder, reader = holder_and_reader
    versions = [bytes([v]) * 400_000 for v in range(3)]
    client.run(_hold, "mixed", 1, versions[0], workers=[holder])
    putting = client.submit(
        _put_again_and_again, "mixed", 1, versions, workers=[holder], pure=False
    )
    seen = []
    while not putting.done():
        _, got, _ = client.submit(
            _fetch, "mixed", holder, 1, 1_000, workers=[reader], pure=False
        ).result(timeout=60)
        seen.append(got)
    assert putting.result() > 10
    assert all(got is None or got in versions for got in seen), "pieces of two puts mixed"


def _saves_past_a_lost_holder(directory: str, go: str) -> list[float]:
    """Ten checkpoints of a small state; after the third, waits for ``go`` (the test kills
    the replica's holder meanwhile); how long each later save took to be durable."""
    took = []
    for step in range(10):
        started = time.monotonic()
        dask_ddp.save_checkpoint({"w": torch.full((1024,), float(step))}, step=step).wait()
        took.append(time.monotonic() - started)
        dask_ddp.report({"step": step}, step=step)
        while step == 2 and not os.path.exists(go):
            time.sleep(0.05)
    return took[3:]


@pytest.mark.slow
def test_a_lost_replica_holder_holds_no_later_save(killing_cluster: LocalCluster, tmp_path) -> None:
    # A one-rank job keeps its replicas on the other worker. That worker dies: the next
    # save's replica finds no holder within the reservation's timeout, and the saves after
    # it put none (each put to the gone worker held its save for distributed's connect
    # timeout, 30 s, and the job's end for as long).
    go = tmp_path / "go"
    with Client(killing_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        rank_worker, holder = sorted(client.scheduler_info()["workers"])
        job = dask_ddp.launch(
            client, _saves_past_a_lost_holder, args=(str(tmp_path / "ckpt"), str(go)),
            workers=[rank_worker], checkpoint_dir=str(tmp_path / "ckpt"),
        )  # fmt: skip
        for record in job.iter_metrics(timeout=60):
            if record.step == 2:
                break
        pid = client.run(os.getpid, workers=[holder])[holder]
        os.kill(pid, signal.SIGKILL)
        go.touch()
        took = job.result(timeout=60)[0]
        assert [c.step for c in job.checkpoints][-1] == 9
        assert sum(took) < replicas.RESERVE_TIMEOUT + 5, took  # one reservation's wait
        assert sorted(took)[-2] < 2, took  # only one save waited: no later one tried again

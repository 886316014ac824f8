"""Asynchronous checkpoints and peers' replicas, on real LocalClusters and a real S3 server.

What is checked: a save copies the state at the call (every tensor compared), writes that
fail surface at the next save and at the function's end naming URL and step, ``keep_last``
never leaves the store without a checkpoint while uploads are slow, a save that finds one
checkpoint in flight and one staged waits for the first, and a state too large for the
worker's memory is saved synchronously with one warning. The restarts (a worker killed
midway through an upload, replicas lost or not, per-rank state) are in
tests/test_checkpoint_replicas.py.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Iterator

import dask
import pytest
import torch
from distributed import Client

import dask_ddp
from dask_ddp._rank import checkpoint
from dask_ddp._rank.saving import Saver
from dask_ddp._rank.slot import CheckpointSettings
from dask_ddp._scheduler.ledger import CheckpointLedger


def _options(endpoint: str) -> dict:
    return {"key": "testing", "secret": "testing", "endpoint_url": endpoint}


def _tensors(obj, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{path}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{path}/{i}")


def _assert_same(expected, got, path: str = "") -> None:
    """The same structure, every tensor equal (dtype, shape, values), the rest equal."""
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape, path
        assert torch.equal(got, expected), path
    elif isinstance(expected, dict):
        assert list(got) == list(expected), path
        for key in expected:
            _assert_same(expected[key], got[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            _assert_same(e, g, f"{path}/{i}")
    else:
        assert got == expected, path


def _training_state() -> dict:
    """A model's and Adam's state after a step, with tied weights and a view."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    model[2].weight = model[0].weight  # tied: one storage under two names
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    flat = torch.arange(12.0)
    return {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "step": 3,
        "window": flat[2:6],  # a view of a larger storage
        "extra": [flat, torch.ones(2, dtype=torch.int64), "name"],
    }


def _change_everything(state: dict) -> None:
    """The next "optimizer step" and more: every tensor and container changes at once."""
    with torch.no_grad():
        for _, t in _tensors(state):
            t.add_(100)
    state["opt"]["param_groups"][0]["lr"] = 9.0
    state["extra"].append("later")
    state["step"] += 1


def _save_then_change_everything() -> tuple | None:
    ctx = dask_ddp.get_context()
    state = _training_state()
    expected = copy.deepcopy(state)  # the state as it was at the call
    pending = dask_ddp.save_checkpoint(state, step=3)
    _change_everything(state)
    if ctx.rank != 0:
        return None
    info = pending.wait(60)
    loaded = dask_ddp.get_checkpoint()
    tied = loaded["model"]["0.weight"].data_ptr() == loaded["model"]["2.weight"].data_ptr()
    return expected, loaded, type(pending).__name__, info.step, tied


def test_a_state_changed_right_after_the_save_is_saved_as_it_was(client: Client, tmp_path) -> None:
    job = dask_ddp.launch(client, _save_then_change_everything, checkpoint_dir=str(tmp_path))
    out = job.result(timeout=120)
    expected, loaded, kind, step, tied = out[0]
    assert (kind, step, out[1]) == ("PendingCheckpoint", 3, None)
    assert len(list(_tensors(expected))) == len(list(_tensors(loaded))) > 8
    _assert_same(expected, loaded)  # every tensor as it was, none as it became
    assert tied  # the tied weights still share their storage, as torch.save keeps them
    assert [c.step for c in job.checkpoints] == [3]


# -- sync mode: the behaviour before asynchronous saves ------------------------------------
def _save_and_list(directory: str, options: dict | None) -> tuple[str, list[int]] | None:
    w = torch.zeros(4)
    out = dask_ddp.save_checkpoint({"w": w, "step": 1}, step=1)
    listed = [s for s, _ in checkpoint.list_checkpoints(directory, options)]  # at the return
    w.add_(1)
    return None if out is None else (type(out).__name__, listed)


def test_sync_mode_from_launch_or_config_saves_before_it_returns(
    client: Client, s3_client, bucket
) -> None:
    options = _opt(s3_client)
    url = f"s3://{bucket}/sync"
    out = dask_ddp.launch(
        client, _save_and_list, args=(f"{url}/a", options), checkpoint_dir=f"{url}/a",
        storage_options=options, checkpoint_mode="sync",
    ).result(timeout=120)  # fmt: skip
    assert out == [("CheckpointInfo", [1]), None]  # durable (listed) when it returned
    with dask.config.set({"ddp.checkpoint.mode": "sync"}):
        job = dask_ddp.launch(
            client, _save_and_list, args=(f"{url}/b", options), checkpoint_dir=f"{url}/b",
            storage_options=options,
        )  # fmt: skip
    assert job.result(timeout=120) == [("CheckpointInfo", [1]), None]
    # The argument wins over the configuration.
    with dask.config.set({"ddp.checkpoint.mode": "sync"}):
        job = dask_ddp.launch(
            client, _save_and_list, args=(f"{url}/c", options), checkpoint_dir=f"{url}/c",
            storage_options=options, checkpoint_mode="async",
        )  # fmt: skip
    assert job.result(timeout=120)[0][0] == "PendingCheckpoint"
    with pytest.raises(ValueError, match=r"checkpoint_mode.*'async' or 'sync'"):
        dask_ddp.launch(client, _save_and_list, checkpoint_dir=url, checkpoint_mode="later")


def _save_once_into_a_refusing_store() -> str:
    try:
        dask_ddp.save_checkpoint({"w": torch.ones(3), "step": 1}, step=1)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_sync_mode_raises_a_refused_write_at_the_call(client: Client, s3_client, locked) -> None:
    _, url = locked
    out = dask_ddp.launch(
        client, _save_once_into_a_refusing_store, checkpoint_dir=url,
        storage_options=_opt(s3_client), checkpoint_mode="sync", workers=1,
    ).result(timeout=120)  # fmt: skip
    assert out[0].startswith("PermissionError"), out[0]
    assert [s for s, _ in checkpoint.list_checkpoints(url, _opt(s3_client))] == [0]


# -- failures ------------------------------------------------------------------------------
@pytest.fixture
def locked(s3_client, bucket) -> tuple[str, str]:
    """``(bucket, url)``: a prefix with a checkpoint of step 0, then refusing writes (a
    bucket policy denying PutObject there)."""
    url = f"s3://{bucket}/locked"
    checkpoint.write({"w": torch.zeros(3), "step": 0}, url, step=0, storage_options=_opt(s3_client))
    policy = {
        "Version": "2012-10-17",
        "Statement": [{
            "Effect": "Deny", "Principal": "*", "Action": "s3:PutObject",
            "Resource": f"arn:aws:s3:::{bucket}/locked/*",
        }],
    }  # fmt: skip
    s3_client.put_bucket_policy(Bucket=bucket, Policy=json.dumps(policy))
    return bucket, url


def _opt(s3_client) -> dict:
    return _options(s3_client.meta.endpoint_url)


def _save_into_a_refusing_store(wait_first: bool) -> dict | None:
    ctx = dask_ddp.get_context()
    if ctx.rank != 0:
        return None
    pending = dask_ddp.save_checkpoint({"w": torch.ones(3), "step": 1}, step=1)
    if not wait_first:
        return None  # the function ends: its end raises
    deadline = time.monotonic() + 60
    while not pending.done() and time.monotonic() < deadline:
        time.sleep(0.01)  # the write fails within a few requests
    try:
        dask_ddp.save_checkpoint({"w": torch.ones(3), "step": 2}, step=2)
    except dask_ddp.errors.CheckpointUploadError as exc:
        return {"text": str(exc), "url": exc.url, "step": exc.step,
                "latest": dask_ddp.get_checkpoint()["step"]}  # fmt: skip
    return {"text": "no error"}


def test_a_refused_write_raises_at_the_next_save_and_at_the_end(
    client: Client, s3_client, locked
) -> None:
    _, url = locked
    options = _opt(s3_client)
    out = dask_ddp.launch(
        client, _save_into_a_refusing_store, args=(True,), checkpoint_dir=url,
        storage_options=options,
    ).result(timeout=120)[0]  # fmt: skip
    assert out["url"] == f"{url}/checkpoint-000000000001.pt" and out["step"] == 1
    assert out["url"] in out["text"] and "step 1" in out["text"]
    assert "the checkpoint of step 0 stays the latest" in out["text"]
    assert out["latest"] == 0  # the previous checkpoint is still the one loaded
    assert [s for s, _ in checkpoint.list_checkpoints(url, options)] == [0]

    job = dask_ddp.launch(
        client, _save_into_a_refusing_store, args=(False,), checkpoint_dir=url,
        storage_options=options,
    )  # fmt: skip
    with pytest.raises(dask_ddp.RankFailedError, match=r"CheckpointUploadError.*step 1"):
        job.result(timeout=120)
    assert job.checkpoints == []


# -- keep_last while uploads are slow ----------------------------------------------------
def _save_often(steps: int) -> list[float]:
    ctx = dask_ddp.get_context()
    w = torch.zeros(64 * 1024)  # 256 kB
    stalls = []
    for step in range(steps):
        w.add_(1)
        pending = dask_ddp.save_checkpoint({"w": w, "step": step}, step=step)
        if ctx.rank == 0:
            stalls.append(pending.stall)
    return stalls


def test_keep_last_never_leaves_the_store_without_a_checkpoint(
    client: Client, s3_client, bucket, flaky_proxy
) -> None:
    proxy = flaky_proxy(delay=0.02)  # each request 20 ms late, as a distant store
    url = f"s3://{bucket}/run"
    seen: list[list[int]] = []
    stop = threading.Event()

    def watch() -> None:  # straight to the server, not through the proxy
        while not stop.is_set():
            listed = s3_client.list_objects_v2(Bucket=bucket, Prefix="run/")
            names = [o["Key"].rsplit("/", 1)[-1] for o in listed.get("Contents", [])]
            seen.append(sorted(int(n[11:23]) for n in names if n.startswith("checkpoint-")))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        job = dask_ddp.launch(
            client, _save_often, args=(8,), checkpoint_dir=url, keep_last=2,
            storage_options=_options(proxy.url),
        )  # fmt: skip
        stalls = job.result(timeout=120)[0]
    finally:
        stop.set()
        watcher.join(10)
    since_first = seen[next(i for i, s in enumerate(seen) if s) :]
    assert len(since_first) > 10
    assert all(len(s) >= 1 for s in since_first)  # never a moment without a checkpoint
    assert all(len(s) <= 3 for s in since_first)  # the new one lands, then the oldest goes
    newest = [max(s) for s in since_first]
    assert newest == sorted(newest)  # visible in step order
    assert since_first[-1] == [6, 7]
    assert [c.step for c in job.checkpoints] == list(range(8))
    assert len(stalls) == 8 and all(s >= 0 for s in stalls)
    assert [c.stall for c in job.checkpoints] == stalls


# -- the saver on its own, in this process -------------------------------------------------
def test_a_third_save_waits_for_the_first_to_be_written(s3_client, bucket, flaky_proxy) -> None:
    proxy = flaky_proxy(delay=0.05)
    said: list[list] = []
    saver = Saver(
        CheckpointSettings(f"s3://{bucket}/order", storage_options=_options(proxy.url)),
        rank=0, world_size=1, announce=lambda kind, body: said.append(body),
    )  # fmt: skip
    w = torch.zeros(1000)
    first = saver.save({"w": w}, step=1)
    second = saver.save({"w": w.add(1)}, step=2)
    third = saver.save({"w": w.add(2)}, step=3)
    # One in flight, one staged: the third waited until the first was written.
    assert first.done() and first.info is not None
    saver.finish()
    assert [p.wait(0).step for p in (first, second, third)] == [1, 2, 3]
    assert [b[1] for b in said] == [1, 2, 3]  # announced durable, in step order
    state = checkpoint.latest(f"s3://{bucket}/order", storage_options=_options(proxy.url))[1]
    assert state["w"][0].item() == 2.0


def _kept(saver: Saver) -> set[int]:
    """The addresses of the buffers a saver keeps for its next copy."""
    return {b.data_ptr() for bufs in saver.stager._free.values() for b in bufs}


def test_a_save_without_buffers_is_copied_on_its_device_and_moved_off_the_training_path(
    tmp_path, caplog
) -> None:
    # A GPU state's first save finds no pinned buffers, and pinning them in the save would
    # stall it (pinning costs many times a copy): it is copied on the GPU, and the writer moves
    # the copy into pinned buffers. Here the CPU stands in for the GPU.
    asked: list[tuple[str, int]] = []

    def device_first(device: torch.device, nbytes: int) -> bool:
        asked.append((device.type, nbytes))
        return True

    saver = Saver(
        CheckpointSettings(str(tmp_path)), rank=0, world_size=1,
        announce=lambda kind, body: None, device_first=device_first,
    )  # fmt: skip
    state = _training_state()
    expected = copy.deepcopy(state)
    with caplog.at_level(logging.DEBUG, logger="dask_ddp._rank.saving"):
        first = saver.save(state, step=1)
        _change_everything(state)
        assert first.wait(60).step == 1
    assert asked == [("cpu", saver.stager.size(state))]  # every storage, each once
    assert "checkpoint of step 1 staged" in caplog.text and "(partly on its devices)" in caplog.text
    assert "step 1 moved off its devices" in caplog.text
    # The writer moved the copy into buffers kept for the next save.
    assert saver.stager.free_bytes == saver.stager.size(state)
    kept = _kept(saver)
    loaded = checkpoint.latest(str(tmp_path))[1]
    _assert_same(expected, loaded)  # as it was at the call, none of the changes after
    assert loaded["model"]["0.weight"].data_ptr() == loaded["model"]["2.weight"].data_ptr()
    # The next save finds a buffer for every storage: copied straight into them.
    asked.clear()
    caplog.clear()
    expected = copy.deepcopy(state)
    with caplog.at_level(logging.DEBUG, logger="dask_ddp._rank.saving"):
        assert saver.save(state, step=2).wait(60).step == 2
    assert asked == [] and "moved off" not in caplog.text
    assert _kept(saver) == kept  # the same buffers, reused
    _assert_same(expected, checkpoint.latest(str(tmp_path))[1])
    saver.finish()


def test_the_end_raises_a_write_that_failed(s3_client, locked) -> None:
    _, url = locked
    saver = Saver(
        CheckpointSettings(url, storage_options=_opt(s3_client)),
        rank=0, world_size=1, announce=lambda kind, body: None,
    )  # fmt: skip
    pending = saver.save({"w": torch.ones(2)}, step=7)
    with pytest.raises(dask_ddp.errors.CheckpointUploadError, match="step 7") as info:
        saver.finish()
    assert info.value.url == pending.url and info.value.step == 7


def test_a_state_too_large_for_memory_is_saved_synchronously_with_one_warning(
    tmp_path, caplog
) -> None:
    saver = Saver(
        CheckpointSettings(str(tmp_path)), rank=0, world_size=1,
        announce=lambda kind, body: None,
        memory=lambda: (900 << 20, 1 << 30),  # 900 MB used of 1 GiB: 4 MB more is too much
    )  # fmt: skip
    big = torch.zeros(1 << 20)
    with caplog.at_level(logging.WARNING, logger="dask_ddp._rank.saving"):
        infos = [saver.save({"w": big}, step=s) for s in (1, 2)]
    saver.finish()
    assert [type(i).__name__ for i in infos] == ["CheckpointInfo", "CheckpointInfo"]
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path))] == [1, 2]
    warnings = [r for r in caplog.records if "synchronously" in r.getMessage()]
    assert len(warnings) == 1 and "memory limit" in warnings[0].getMessage()


def test_per_rank_files_count_once_every_rank_wrote_and_keep_last_keeps_them(tmp_path) -> None:
    d = str(tmp_path)
    savers = [
        Saver(CheckpointSettings(d, keep_last=1), rank=r, world_size=2,
              announce=lambda kind, body: None)
        for r in range(2)
    ]  # fmt: skip
    for step in (1, 2):
        for r, saver in enumerate(savers):
            saver.save({"r": torch.tensor(r), "step": step}, step=step, per_rank=True)
            saver.flush()
            # Once both ranks wrote step 1, one complete checkpoint is always there.
            found = checkpoint.latest_shard(d, 0, 2)
            if (step, r) == (1, 0):
                assert found is None
            else:
                assert found is not None and found[0] in (1, 2)
    for saver in savers:
        saver.finish()
    assert [(s, w, sorted(f)) for s, w, f in checkpoint.list_shards(d)] == [(2, 2, [0, 1])]
    assert checkpoint.latest_shard(d, 1, 2)[1]["r"].item() == 1
    with pytest.raises(dask_ddp.errors.CheckpointShardsError, match="written by 2 ranks"):
        checkpoint.latest_shard(d, 0, 3)


def test_the_ledger_plans_each_rank_s_own_state() -> None:
    ledger = CheckpointLedger()
    for rank in range(2):
        ledger.landed(rank, f"s3://b/r/checkpoint-5.rank-{rank}", 5, 2)
    ledger.replicated(0, 5, "tcp://w1:1", 2)  # rank 0's part is on rank 1's worker
    ledger.replicated(1, 5, "tcp://w0:1", 2)
    plans, source, step = ledger.plan(2, alive={"tcp://w0:1"})  # w1 is gone
    assert (source, step) == ("peer+store", 5)
    assert [p[0].source for p in plans] == ["store", "peer"]
    assert plans[1][0].holder == "tcp://w0:1" and plans[0][0].url.endswith("rank-0")
    assert ledger.plan(3, alive={"tcp://w0:1"}) == ([(), (), ()], None, None)  # other size
    assert ledger.replicated(1, 8, "tcp://w2:1", 2) == "tcp://w0:1"  # moved: drop it there

"""DaskResultsHandler (dask-pytorch-ddp's API) on a real LocalCluster."""

from __future__ import annotations

import datetime
import json
import logging
import os
import pickle
from pathlib import Path

import dask
import msgpack
import pytest
import torch
import torch.distributed as dist
from distributed import Client
from distributed.diagnostics.plugin import SchedulerPlugin
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP

import dask_ddp
from dask_ddp import dispatch
from dask_ddp._client import reader
from dask_ddp._rank import channel as events
from dask_ddp._shared import protocol
from dask_ddp.results import DaskResultsHandler, _safe_target

# As in the predecessor's README: a handler created on the client and captured by the
# training function. The README's key is a uuid made in the notebook, where the function
# travels by value; this module is imported again on the workers, so the key is fixed.
key = "dask-ddp-test-results"
rh = DaskResultsHandler(key)


def run_transfer_learning(n_steps: int, every: int, width: int = 4) -> int:
    worker_rank = int(dist.get_rank())
    torch.manual_seed(0)
    model = DDP(nn.Linear(width, width))
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = nn.MSELoss()
    count = 0
    for epoch in range(n_steps):
        dt = datetime.datetime.now().isoformat()
        inputs = torch.randn(8, width)
        loss = criterion(model(inputs), inputs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        count += 1
        rh.submit_result(
            f"worker/{worker_rank}/data-{dt}.json",
            json.dumps(
                {"loss": loss.item(), "epoch": epoch, "count": count, "worker": worker_rank}
            ),
        )
        if (count % every) == 0 and worker_rank == 0:
            rh.submit_result(f"checkpoint-{dt}.pkl", pickle.dumps(model.state_dict()))
    return count


def _checkpoints(prefix: Path) -> list[dict]:
    return [pickle.loads(p.read_bytes()) for p in sorted(prefix.glob("checkpoint-*.pkl"))]


def test_the_predecessor_readme_example(client: Client, tmp_path: Path) -> None:
    futures = dispatch.run(client, run_transfer_learning, 10, 3)
    rh.process_results(str(tmp_path), futures, raise_errors=False)
    assert [f.result() for f in futures] == [10, 10]
    for rank in (0, 1):
        lines = [json.loads(p.read_text()) for p in (tmp_path / "worker" / str(rank)).iterdir()]
        assert sorted(d["count"] for d in lines) == list(range(1, 11))
        assert {d["worker"] for d in lines} == {rank}
    checkpoints = _checkpoints(tmp_path)
    assert len(checkpoints) == 3  # counts 3, 6 and 9 on rank 0
    for state in checkpoints:
        assert set(state) == {"module.weight", "module.bias"}
        assert state["module.weight"].shape == (4, 4)
    assert not list(tmp_path.rglob("*.part"))


class _EventSizes(SchedulerPlugin):
    """Records the size of every dask_ddp event the scheduler relays."""

    name = "test-dask-ddp-event-sizes"

    def __init__(self) -> None:
        self.sizes: dict[str, list[int]] = {}

    def log_event(self, topic: str, msg: object) -> None:
        if topic.startswith("dask-ddp-"):
            size = len(msgpack.packb(msg, use_bin_type=True))
            self.sizes.setdefault(topic, []).append(size)


def _sizes(dask_scheduler=None) -> dict[str, list[int]]:
    return dask_scheduler.plugins[_EventSizes.name].sizes


def _blobs_held() -> int:
    return events.blobs_held()


def test_large_payloads_bypass_the_scheduler(client: Client, tmp_path: Path) -> None:
    client.register_plugin(_EventSizes())
    try:
        with dask.config.set({"ddp.max-event-bytes": "16kB"}):
            # A 512x512 Linear: each pickled state_dict is about 1 MB.
            job = dask_ddp.launch(client, run_transfer_learning, args=(4, 2, 512))
        rh.process_results(tmp_path, job)
        assert job.result(timeout=120) == [4, 4]
        sizes = client.run_on_scheduler(_sizes)[job.topic]
    finally:
        client.unregister_scheduler_plugin(_EventSizes.name)
    checkpoints = _checkpoints(tmp_path)
    assert len(checkpoints) == 2
    assert all(s["module.weight"].shape == (512, 512) for s in checkpoints)
    assert all(p.stat().st_size > 1_000_000 for p in tmp_path.glob("checkpoint-*.pkl"))
    # Only references and small batches went through the scheduler ...
    assert max(sizes) < 16_000
    assert sum(sizes) < 50_000
    # ... and the workers let go of each payload once the client had it.
    assert set(client.run(_blobs_held).values()) == {0}


def _two_handlers(a: DaskResultsHandler, b: DaskResultsHandler) -> None:
    rank = dask_ddp.get_context().rank
    a.submit_result(f"a/{rank}.txt", "from a ✓")
    b.submit_result(f"b/{rank}.bin", bytes([rank, 255]))


def test_handlers_and_jobs_stay_apart(client: Client, tmp_path: Path) -> None:
    a, b = DaskResultsHandler(), DaskResultsHandler()
    first = dask_ddp.launch(client, _two_handlers, args=(a, b))
    first.result(timeout=120)  # jobs sharing workers run one after the other
    second = dask_ddp.launch(client, _two_handlers, args=(a, b))
    a.process_results(tmp_path / "a1", first.futures)
    b.process_results(tmp_path / "b1", first.futures)  # held by the job until asked for
    a.process_results(tmp_path / "a2", second)
    for prefix in ("a1", "a2"):
        found = sorted(p.relative_to(tmp_path / prefix) for p in (tmp_path / prefix).rglob("*.*"))
        assert found == [Path("a/0.txt"), Path("a/1.txt")]
        assert (tmp_path / prefix / "a" / "1.txt").read_text(encoding="utf-8") == "from a ✓"
    assert (tmp_path / "b1" / "b" / "1.bin").read_bytes() == bytes([1, 255])
    assert not (tmp_path / "a1" / "b").exists()


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("../escape.json", "contains '..'"),
        ("worker/../../escape.json", "contains '..'"),
        ("worker\\..\\..\\escape.json", "contains '..'"),
        ("/etc/escape.json", "absolute"),
        ("\\\\server\\share\\escape.json", "absolute"),
        ("C:\\escape.json", "absolute"),
        ("", "empty"),
        ("worker/", "names a directory"),
        ("a\0b", "NUL"),
    ],
)
def test_paths_that_leave_the_prefix_are_refused(tmp_path: Path, path: str, reason: str) -> None:
    with pytest.raises(dask_ddp.errors.UnsafeResultPathError, match=reason):
        _safe_target(tmp_path, path)


def test_symlinks_out_of_the_prefix_are_refused(tmp_path: Path) -> None:
    prefix, outside = tmp_path / "prefix", tmp_path / "outside"
    prefix.mkdir()
    outside.mkdir()
    (prefix / "link").symlink_to(outside, target_is_directory=True)
    (prefix / "file.json").symlink_to(outside / "file.json")
    (prefix / "inner").symlink_to(prefix / "sub", target_is_directory=True)
    with pytest.raises(dask_ddp.errors.UnsafeResultPathError, match="symbolic link"):
        _safe_target(prefix, "link/x.json")
    with pytest.raises(dask_ddp.errors.UnsafeResultPathError, match="symbolic link"):
        _safe_target(prefix, "file.json")
    assert _safe_target(prefix, "inner/x.json") == (prefix / "sub" / "x.json").resolve()
    assert _safe_target(prefix, "./a/b.json") == (prefix / "a" / "b.json").resolve()


def _submit(paths: list[str]) -> int:
    for path in paths:
        rh.submit_result(path, json.dumps({"path": path}))
    return len(paths)


def test_escaping_results_write_nothing_outside(
    client: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prefix, outside = tmp_path / "prefix", tmp_path / "outside"
    prefix.mkdir()
    outside.mkdir()
    (prefix / "link").symlink_to(outside, target_is_directory=True)
    paths = ["ok/before.json", "link/escape.json", "ok/after.json"]

    job = dask_ddp.launch(client, _submit, args=(paths,))
    with pytest.raises(dask_ddp.errors.UnsafeResultPathError, match=r"link/escape\.json"):
        rh.process_results(prefix, job.futures)
    with caplog.at_level(logging.ERROR, logger="dask_ddp.results"):
        job = dask_ddp.launch(client, _submit, args=(paths,))
        rh.process_results(prefix, job.futures, raise_errors=False)
    assert "refused a result" in caplog.text
    assert sorted(p.name for p in (prefix / "ok").iterdir()) == ["after.json", "before.json"]
    assert list(outside.iterdir()) == []

    # A rank is refused a path with '..' or an absolute one at once: its job fails.
    job = dask_ddp.launch(client, _submit, args=(["fine.json", "../escape.json"],))
    with pytest.raises(dask_ddp.RankFailedError) as info:
        rh.process_results(prefix, job.futures)
    assert isinstance(info.value.__cause__, dask_ddp.errors.UnsafeResultPathError)
    assert (prefix / "fine.json").exists()
    assert not (tmp_path / "escape.json").exists()


def _fail_after_results() -> None:
    rank = dask_ddp.get_context().rank
    rh.submit_result(f"r{rank}.json", "{}")
    dist.barrier()
    if rank == 1:
        raise RuntimeError("rank 1 broke")


def test_rank_errors_raise_or_are_logged(
    client: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    futures = dispatch.run(client, _fail_after_results)
    with pytest.raises(dask_ddp.RankFailedError, match="rank 1 broke"):
        rh.process_results(tmp_path / "raise", futures)
    assert sorted(os.listdir(tmp_path / "raise")) == ["r0.json", "r1.json"]

    futures = dispatch.run(client, _fail_after_results)
    with caplog.at_level(logging.ERROR, logger="dask_ddp.results"):
        rh.process_results(tmp_path / "log", futures, raise_errors=False)
    assert "failed" in caplog.text and "rank 1 broke" in caplog.text
    assert sorted(os.listdir(tmp_path / "log")) == ["r0.json", "r1.json"]


def _bad_data() -> str:
    try:
        rh.submit_result("x.json", {"not": "serialised"})
    except TypeError as exc:
        return str(exc)
    return "accepted"


def _inc(x: int) -> int:
    return x + 1


def test_misuse_is_refused(client: Client, tmp_path: Path) -> None:
    with pytest.raises(dask_ddp.errors.NotInRankError, match=r"submit_result\(\)"):
        rh.submit_result("x.json", "{}")
    assert "str or bytes" in dask_ddp.launch(client, _bad_data, workers=1).result(timeout=60)[0]
    with pytest.raises(dask_ddp.JobNotFoundError, match=r"dask_ddp\.dispatch\.run"):
        rh.process_results(tmp_path, [client.submit(_inc, 1)])


def test_errors_pickle() -> None:
    for error in (
        dask_ddp.errors.UnsafeResultPathError("../x", "/tmp/p", "it contains '..'"),
        dask_ddp.JobNotFoundError(["k1", "k2"]),
        dask_ddp.errors.ChannelError(1, "job", "boom"),
    ):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)


def _hold_payload(job_id: str, dask_worker=None) -> str:
    events.hold_blob(f"{job_id}/0/0", [protocol.RESULT, ["k", "x.bin", b"x" * 10]])
    return dask_worker.address


def _send_unread(steps: int) -> int:
    rh = DaskResultsHandler("unread")
    for step in range(steps):
        rh.submit_result(f"{step}.bin", b"x" * 100_000)
    return dask_ddp.get_context().rank


def test_payloads_are_released_on_delivery_or_when_the_job_is_forgotten(client: Client) -> None:
    dask_ddp.jobs(client)  # the plugin is installed: every worker serves large messages
    worker = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
    client.run(_hold_payload, "job-a", workers=[worker])
    ref = {"worker": worker, "key": "job-a/0/0", "nbytes": 10}
    fetched = client.sync(reader.fetch_blob, client, ref)
    assert fetched == [[protocol.RESULT, ["k", "x.bin", b"x" * 10]]]
    with pytest.raises(dask_ddp.errors.ChannelError, match="no longer holds"):
        client.sync(reader.fetch_blob, client, ref)  # handed over once, then forgotten
    client.run(_hold_payload, "job-b", workers=[worker])
    assert client.run(events.drop_held, "job-b", workers=[worker]) == {worker: 1}
    assert client.run(_blobs_held, workers=[worker]) == {worker: 0}
    # A job whose large messages nobody fetched: the workers hold them until it is forgotten.
    with dask.config.set({"ddp.max-event-bytes": "16kB"}):
        job = dask_ddp.launch(client, _send_unread, args=(3,))
    assert job.result(timeout=60) == [0, 1]
    assert sum(client.run(_blobs_held).values()) == 0  # this client fetched them all
    client.run(_hold_payload, job.job_id, workers=[job.workers[0]])  # as if nobody had
    job.forget()
    assert sum(client.run(_blobs_held).values()) == 0
    with pytest.raises(dask_ddp.JobNotFoundError):
        dask_ddp.attach(client, job.job_id)

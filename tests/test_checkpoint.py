"""Checkpoint files: atomic, the last N kept, safe loading, local and on a real S3 server
(tests/conftest.py's)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from dask_ddp._rank import checkpoint
from dask_ddp._rank.checkpoint import UnsafeCheckpointError


def _state(step: int) -> dict:
    return {
        "model": {"w": torch.full((3, 2), float(step)), "b": torch.arange(2.0)},
        "step": step,
        "name": "run",
        "history": [0.5, 0.25],
        "pair": (1, 2),
    }


def _assert_state(loaded: dict, step: int) -> None:
    torch.testing.assert_close(loaded["model"]["w"], torch.full((3, 2), float(step)))
    assert loaded["step"] == step and loaded["name"] == "run"
    assert loaded["history"] == [0.5, 0.25] and loaded["pair"] == (1, 2)


def test_round_trip_and_keep_last(tmp_path: Path) -> None:
    d = str(tmp_path / "ckpt")
    assert checkpoint.latest(d) is None
    for step in (1, 5, 10):
        url, nbytes = checkpoint.write(_state(step), d, step=step, keep_last=2)
        assert nbytes > 0 and url.endswith(f"checkpoint-{step:012d}.pt")
    assert [s for s, _ in checkpoint.list_checkpoints(d)] == [5, 10]
    step, state = checkpoint.latest(d)
    assert step == 10
    _assert_state(state, 10)
    assert not [p for p in Path(d).iterdir() if p.name.endswith(".partial")]


def test_corrupt_or_partial_files_are_never_returned(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    checkpoint.write(_state(1), str(d), step=1)
    checkpoint.write(_state(2), str(d), step=2)
    newest = d / f"checkpoint-{2:012d}.pt"
    newest.write_bytes(newest.read_bytes()[:40])  # truncated, as by a crash mid-copy
    (d / ".checkpoint-000000000003.abc.partial").write_bytes(b"half a checkpoint")
    step, state = checkpoint.latest(str(d))
    assert step == 1
    _assert_state(state, 1)


class Arbitrary:
    """An object only full unpickling could rebuild."""


def test_unsafe_objects_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    # a checkpoint written by plain torch.save with an arbitrary class inside
    torch.save({"obj": Arbitrary()}, d / "checkpoint-000000000001.pt")
    with pytest.raises(UnsafeCheckpointError, match="weights_only=True"):
        checkpoint.latest(str(d))


def _saved(state: dict) -> torch.Tensor:
    """``torch.save``'s bytes in a uint8 tensor: a replica as a restarted rank fetches it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _inside(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    return 0 <= tensor.data_ptr() - buffer.data_ptr() < buffer.numel()


def test_a_fetched_replica_loads_in_place(monkeypatch) -> None:
    buffer = _saved(_state(3))
    loaded = checkpoint.load(buffer, "replica")
    _assert_state(loaded, 3)
    # every tensor is a view of the buffer (torch.load's mmap path, with this torch)
    assert _inside(loaded["model"]["w"], buffer) and _inside(loaded["model"]["b"], buffer)
    # where torch changed that path, it still loads, through torch.load (a copy)
    real = torch.serialization._load

    def without_overall_storage(*args, overall_storage=None, **kwargs):
        if overall_storage is not None:
            raise TypeError("_load() got an unexpected keyword argument 'overall_storage'")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.serialization, "_load", without_overall_storage)
    copied = checkpoint.load(buffer, "replica")
    _assert_state(copied, 3)
    assert not _inside(copied["model"]["w"], buffer)


def test_a_fetched_replica_with_unsafe_objects_is_refused() -> None:
    with pytest.raises(UnsafeCheckpointError, match="weights_only=True"):
        checkpoint.load(_saved({"obj": Arbitrary()}), "replica")


def test_a_write_that_fails_midway_leaves_nothing(tmp_path: Path, s3_endpoint, bucket) -> None:
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    state = {"w": torch.zeros(1 << 20), "later": Unpicklable()}  # fails after 4 MB
    opts = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    for d, options in ((str(tmp_path), None), (f"s3://{bucket}/cut", opts)):
        with pytest.raises(RuntimeError, match="cannot pickle"):
            checkpoint.write(state, d, step=1, storage_options=options)
        # fsspec would complete the upload on close: nothing half-written may appear
        assert checkpoint.list_checkpoints(d, options) == []
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step"):
        checkpoint.write({}, str(tmp_path), step=-1)
    with pytest.raises(ValueError, match="keep_last"):
        checkpoint.write({}, str(tmp_path), step=1, keep_last=0)


def test_round_trip_through_s3(s3_endpoint: str, bucket: str) -> None:
    d = f"s3://{bucket}/run1"
    opts = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    assert checkpoint.latest(d, storage_options=opts) is None
    for step in (3, 7, 9):
        checkpoint.write(_state(step), d, step=step, keep_last=2, storage_options=opts)
    assert [s for s, _ in checkpoint.list_checkpoints(d, opts)] == [7, 9]
    step, state = checkpoint.latest(d, storage_options=opts)
    assert step == 9
    _assert_state(state, 9)

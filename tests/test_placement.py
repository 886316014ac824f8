"""Placement is pure: every rule is checked here without a cluster or a GPU."""

from __future__ import annotations

import pytest

from dask_ddp.errors import BackendUnavailableError, PlacementError
from dask_ddp.placement import (
    WorkerInfo,
    choose_backend,
    plan_ranks,
    rotate_devices,
    select_workers,
)


def test_ranks_grouped_by_host_then_address() -> None:
    workers = [
        WorkerInfo("tcp://10.0.0.2:9000", "10.0.0.2"),
        WorkerInfo("tcp://10.0.0.1:10000", "10.0.0.1"),
        WorkerInfo("tcp://10.0.0.1:9000", "10.0.0.1"),
        WorkerInfo("tcp://10.0.0.2:8000", "10.0.0.2"),
    ]
    plan = plan_ranks(workers)
    assert [p.worker for p in plan] == [
        "tcp://10.0.0.1:9000",
        "tcp://10.0.0.1:10000",
        "tcp://10.0.0.2:8000",
        "tcp://10.0.0.2:9000",
    ]
    assert [p.rank for p in plan] == [0, 1, 2, 3]
    assert [p.local_rank for p in plan] == [0, 1, 0, 1]
    assert [p.node_rank for p in plan] == [0, 0, 1, 1]
    assert {p.local_world_size for p in plan} == {2}
    assert {p.world_size for p in plan} == {4}


def test_rotation_on_eight_gpu_host() -> None:
    workers = [WorkerInfo(f"tcp://h:{9000 + i}", "h", gpu_count=8) for i in range(8)]
    plan = plan_ranks(workers)
    assert plan[2].cuda_visible_devices == "2,3,4,5,6,7,0,1"
    assert plan[0].cuda_visible_devices == "0,1,2,3,4,5,6,7"
    assert all(p.use_gpu for p in plan)


def test_more_workers_than_gpus_wraps_around() -> None:
    workers = [WorkerInfo(f"tcp://h:{9000 + i}", "h", gpu_count=2) for i in range(3)]
    assert [p.cuda_visible_devices for p in plan_ranks(workers)] == ["0,1", "1,0", "0,1"]


def test_no_gpus_means_no_rotation() -> None:
    plan = plan_ranks([WorkerInfo("tcp://h:1", "h"), WorkerInfo("tcp://h:2", "h")])
    assert [p.cuda_visible_devices for p in plan] == [None, None]
    assert not any(p.use_gpu for p in plan)


def test_dask_cuda_rotation_is_respected() -> None:
    # dask-cuda gives each worker its own rotation; the worker's GPU is already cuda:0.
    workers = [
        WorkerInfo("tcp://h:1", "h", gpu_count=4, cuda_visible_devices="0,1,2,3"),
        WorkerInfo("tcp://h:2", "h", gpu_count=4, cuda_visible_devices="1,2,3,0"),
    ]
    assert [p.cuda_visible_devices for p in plan_ranks(workers)] == [None, None]


def test_shared_visible_list_is_rotated_within_itself() -> None:
    workers = [
        WorkerInfo("tcp://h:1", "h", gpu_count=2, cuda_visible_devices="4,6"),
        WorkerInfo("tcp://h:2", "h", gpu_count=2, cuda_visible_devices="4,6"),
    ]
    assert [p.cuda_visible_devices for p in plan_ranks(workers)] == ["4,6", "6,4"]


def test_rotate_keeps_uuids() -> None:
    assert rotate_devices(1, ["GPU-a", "MIG-b"]) == "MIG-b,GPU-a"


def test_loopback_rank0_across_hosts_is_refused() -> None:
    workers = [
        WorkerInfo("tcp://127.0.0.1:1", "127.0.0.1"),
        WorkerInfo("tcp://10.0.0.9:1", "10.0.0.9"),
    ]
    with pytest.raises(PlacementError, match="loopback"):
        plan_ranks(workers)


def test_backend_choice() -> None:
    cpu = WorkerInfo("tcp://a:1", "a", 0)
    gpu = WorkerInfo("tcp://b:1", "b", 1)
    assert choose_backend(None, [cpu, gpu])[0] == "gloo"
    assert choose_backend(None, [gpu])[0] == "nccl"
    assert choose_backend("gloo", [gpu]) == ("gloo", "requested")
    with pytest.raises(BackendUnavailableError, match=r"backend='gloo'.*backend=None") as info:
        choose_backend("nccl", [gpu, cpu])
    assert info.value.worker == "tcp://a:1"
    assert isinstance(info.value, ValueError)


def test_select_workers() -> None:
    available = {"tcp://b:1": "b", "tcp://a:2": "a", "tcp://a:1": "a"}
    assert select_workers(available, None) == list(available)
    assert select_workers(available, 2) == ["tcp://a:1", "tcp://a:2"]
    assert select_workers(available, ["tcp://b:1"]) == ["tcp://b:1"]
    with pytest.raises(PlacementError, match=r"more ranks than the cluster has workers \(3\)"):
        select_workers(available, 4)
    with pytest.raises(PlacementError, match="does not know"):
        select_workers(available, ["tcp://nowhere:1"])
    with pytest.raises(PlacementError, match="twice"):
        select_workers(available, ["tcp://b:1", "tcp://b:1"])
    with pytest.raises(PlacementError, match="at least 1"):
        select_workers(available, 0)
    with pytest.raises(PlacementError, match="number of workers or a list"):
        select_workers(available, "tcp://b:1")


def test_errors_pickle() -> None:
    import pickle

    import dask_ddp.errors as errors

    samples = [
        errors.RankFailedError(1, "tcp://w:1", "key", "ValueError: x", "tb"),
        errors.RankStoppedError(0, "RuntimeError: closed", failed_rank=1),
        errors.RankStoppedError(1, "cancelled by the user", job="3f2a"),
        errors.RendezvousTimeoutError(1, "tcp://w:1", "key", 60.0, "1 of 2 joined"),
        errors.WorkerBusyError("tcp://w:1", "dask-ddp-x-rank-0"),
        errors.BackendUnavailableError("nccl", "tcp://w:1", "no GPU", "Pass gloo."),
    ]
    for exc in samples:
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc)
        assert str(back) == str(exc)


def test_ranks_that_would_share_a_gpu_get_gloo_or_a_clear_error() -> None:
    one_gpu = [WorkerInfo("tcp://a:1", "a", 1), WorkerInfo("tcp://a:2", "a", 1)]
    assert choose_backend(None, one_gpu) == ("gloo", "host a has 2 ranks but 1 GPU")
    with pytest.raises(BackendUnavailableError, match="GPU of its own for each rank"):
        choose_backend("nccl", one_gpu)
    two_gpus = [WorkerInfo("tcp://a:1", "a", 2), WorkerInfo("tcp://a:2", "a", 2)]
    assert choose_backend(None, two_gpus)[0] == "nccl"
    dask_cuda = [  # each worker leads with its own GPU: fine
        WorkerInfo("tcp://a:1", "a", 2, "0,1"),
        WorkerInfo("tcp://a:2", "a", 2, "1,0"),
    ]
    assert choose_backend(None, dask_cuda)[0] == "nccl"
    same_first = [WorkerInfo("tcp://a:1", "a", 2, "0,1"), WorkerInfo("tcp://a:2", "a", 2, "0,1")]
    assert choose_backend(None, same_first)[0] == "gloo"

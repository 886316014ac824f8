"""Placement is pure: every rule is checked here without a cluster or a GPU."""

from __future__ import annotations

import random

import pytest

from dask_ddp._shared.placement import (
    RankPlacement,
    WorkerInfo,
    choose_backend,
    device_index,
    plan_ranks,
    select_workers,
)
from dask_ddp.errors import BackendUnavailableError, PlacementError


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


def _sees(p: RankPlacement, gpu_count: int) -> list[str]:
    """The GPUs a rank sees, in CUDA order: its CUDA_VISIBLE_DEVICES, or every GPU."""
    value = (
        p.cuda_visible_devices if p.cuda_visible_devices is not None else p.worker_visible_devices
    )
    return value.split(",") if value is not None else [str(i) for i in range(gpu_count)]


def _at_local_rank(plan: list[RankPlacement], gpu_count: int) -> list[str]:
    """The GPU that cuda:LOCAL_RANK names in each rank (torchrun scripts, accelerate,
    Lightning and DeepSpeed index it)."""
    return [_sees(p, gpu_count)[p.local_rank] for p in plan]


def test_each_rank_owns_cuda_local_rank_on_an_eight_gpu_host() -> None:
    workers = [WorkerInfo(f"tcp://h:{9000 + i}", "h", gpu_count=8) for i in range(8)]
    plan = plan_ranks(workers)
    # Nothing to change (torchrun's way): every rank sees all eight, its own at LOCAL_RANK.
    assert [p.cuda_visible_devices for p in plan] == [None] * 8
    assert [p.gpu for p in plan] == [str(i) for i in range(8)]
    assert [p.device_index for p in plan] == list(range(8))
    assert _at_local_rank(plan, 8) == [p.gpu for p in plan]
    assert all(p.use_gpu for p in plan)


def test_more_workers_than_gpus_wraps_around() -> None:
    workers = [WorkerInfo(f"tcp://h:{9000 + i}", "h", gpu_count=2) for i in range(3)]
    plan = plan_ranks(workers)
    assert [(p.gpu, p.device_index) for p in plan] == [("0", 0), ("1", 1), ("0", 0)]


def test_no_gpus_means_no_devices() -> None:
    plan = plan_ranks([WorkerInfo("tcp://h:1", "h"), WorkerInfo("tcp://h:2", "h")])
    assert [p.cuda_visible_devices for p in plan] == [None, None]
    assert [(p.gpu, p.device_index) for p in plan] == [(None, None), (None, None)]
    assert not any(p.use_gpu for p in plan)


def test_dask_cuda_workers_keep_their_gpu_at_cuda_local_rank() -> None:
    # dask-cuda's LocalCUDACluster gives worker i the list rotated by i: its GPU leads.
    # The workers' addresses need not follow their GPUs' order.
    lists = {"tcp://h:4": "0,1,2,3", "tcp://h:2": "1,2,3,0", "tcp://h:3": "2,3,0,1"}
    lists["tcp://h:1"] = "3,0,1,2"
    workers = [WorkerInfo(a, "h", 4, v) for a, v in lists.items()]
    plan = plan_ranks(workers)
    assert [p.worker for p in plan] == ["tcp://h:1", "tcp://h:2", "tcp://h:3", "tcp://h:4"]
    assert [p.gpu for p in plan] == ["3", "1", "2", "0"]  # the GPU dask-cuda gave each
    assert {p.cuda_visible_devices for p in plan} == {"3,1,2,0"}  # one list for the host
    assert _at_local_rank(plan, 4) == ["3", "1", "2", "0"]
    assert [p.device_index for p in plan] == [0, 1, 2, 3]
    # A job on two of them: the other GPUs stay visible, after the job's.
    two = plan_ranks(
        [WorkerInfo("tcp://h:3", "h", 4, "2,3,0,1"), WorkerInfo("tcp://h:5", "h", 4, "1,2,3,0")]
    )
    assert [p.cuda_visible_devices for p in two] == ["2,1,3,0", "2,1,3,0"]
    assert _at_local_rank(two, 4) == ["2", "1"]


def test_a_worker_whose_list_already_is_the_host_s_is_left_alone() -> None:
    plan = plan_ranks(
        [WorkerInfo("tcp://h:1", "h", 2, "0,1"), WorkerInfo("tcp://h:2", "h", 2, "1,0")]
    )
    assert [p.cuda_visible_devices for p in plan] == [None, "0,1"]
    assert _at_local_rank(plan, 2) == ["0", "1"]
    alone = plan_ranks([WorkerInfo("tcp://h:1", "h", 3, "GPU-b,GPU-a,MIG-c")])[0]
    assert (alone.cuda_visible_devices, alone.gpu, alone.device_index) == (None, "GPU-b", 0)


def test_uuids_and_a_host_wide_list() -> None:
    uuids = [
        WorkerInfo("tcp://h:1", "h", 2, "GPU-b,GPU-a"),
        WorkerInfo("tcp://h:2", "h", 2, "GPU-a,GPU-b"),
    ]
    plan = plan_ranks(uuids)
    assert [p.cuda_visible_devices for p in plan] == [None, "GPU-b,GPU-a"]
    assert [p.gpu for p in plan] == ["GPU-b", "GPU-a"]
    assert _at_local_rank(plan, 2) == ["GPU-b", "GPU-a"]
    # The same list on every worker (set once for the host): local rank k owns its k-th.
    shared = [WorkerInfo(f"tcp://h:{i}", "h", 2, "4,6") for i in (1, 2)]
    plan = plan_ranks(shared)
    assert [p.cuda_visible_devices for p in plan] == [None, None]
    assert [p.gpu for p in plan] == ["4", "6"] == _at_local_rank(plan, 2)


def test_any_layout_puts_each_rank_s_own_gpu_at_cuda_local_rank() -> None:
    rng = random.Random(38)
    for _ in range(500):
        gpus = rng.randint(1, 8)
        base = rng.sample([str(i) for i in range(gpus)] + ["GPU-x", "GPU-y"], gpus)
        n = rng.randint(1, gpus)
        kind = rng.choice(["plain", "host", "dask-cuda"])
        workers = []
        for i, lead in enumerate(rng.sample(range(gpus), n)):
            visible = {
                "plain": None,
                "host": ",".join(base),
                "dask-cuda": ",".join(base[lead:] + base[:lead]),
            }[kind]
            workers.append(
                WorkerInfo(f"tcp://h:{rng.randint(1, 60000) * 8 + i}", "h", gpus, visible)
            )
        plan = plan_ranks(workers)
        at = _at_local_rank(plan, gpus)
        assert at == [p.gpu for p in plan], workers
        assert len(set(at)) == n, workers  # no two ranks on one GPU
        assert [p.device_index for p in plan] == [p.local_rank for p in plan], workers
        if kind == "dask-cuda":  # each keeps the GPU dask-cuda gave its worker
            assert [p.gpu for p in plan] == [p.worker_visible_devices.split(",")[0] for p in plan]
        assert len({",".join(_sees(p, gpus)) for p in plan}) == 1, workers  # one list a host
        assert choose_backend(None, workers)[0] == "nccl", workers


def test_device_index_in_a_process_whose_cuda_started_under_another_list() -> None:
    assert device_index("2", "2,0,1,3") == 0
    assert device_index("2", "1,2,3,0") == 1  # dask-cuda's list, from before the rank
    assert device_index("2", None) == 2
    assert device_index("GPU-a", None) is None  # a UUID needs the list to be found
    assert device_index("GPU-a", "GPU-b,GPU-a") == 1
    assert device_index("5", "0,1") is None
    assert device_index(None, "0,1") is None


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
    with pytest.raises(BackendUnavailableError, match="host a has 2 ranks but 1 GPU"):
        choose_backend("cpu:gloo,cuda:nccl", one_gpu)  # DCP's async_save needs both
    assert choose_backend("cpu:gloo,cuda:nccl", [WorkerInfo("tcp://a:1", "a", 1)])[0] == (
        "cpu:gloo,cuda:nccl"
    )
    two_gpus = [WorkerInfo("tcp://a:1", "a", 2), WorkerInfo("tcp://a:2", "a", 2)]
    assert choose_backend(None, two_gpus)[0] == "nccl"
    dask_cuda = [  # each worker leads with its own GPU: fine
        WorkerInfo("tcp://a:1", "a", 2, "0,1"),
        WorkerInfo("tcp://a:2", "a", 2, "1,0"),
    ]
    assert choose_backend(None, dask_cuda)[0] == "nccl"
    # The same list on both (set once for the host): local rank k owns its k-th GPU.
    same_list = [WorkerInfo("tcp://a:1", "a", 2, "0,1"), WorkerInfo("tcp://a:2", "a", 2, "0,1")]
    assert choose_backend(None, same_list)[0] == "nccl"
    same_first = [WorkerInfo("tcp://a:1", "a", 2, "0,1"), WorkerInfo("tcp://a:2", "a", 1, "0")]
    assert choose_backend(None, same_first) == ("gloo", "host a has 2 ranks but 1 GPU")


def test_a_rank_follows_the_list_its_process_s_cuda_started_under(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from dask_ddp._rank import cuda

    workers = [
        WorkerInfo("tcp://h:1", "h", 4, "0,1,2,3"),
        WorkerInfo("tcp://h:2", "h", 4, "2,3,0,1"),
    ]
    second = plan_ranks(workers)[1]
    assert (second.gpu, second.device_index, second.cuda_visible_devices) == ("2", 1, "0,2,1,3")
    # CUDA not started yet: the rank's own list takes effect, and cuda:LOCAL_RANK is its GPU.
    monkeypatch.setattr(cuda, "_started_under", [])
    assert str(cuda.rank_device(second, "job")) == "cuda:1"
    # Its worker's CUDA started before (under dask-cuda's list): the GPU is found there,
    # with a warning that cuda:LOCAL_RANK is another GPU in this process.
    monkeypatch.setattr(cuda, "_started_under", ["2,3,0,1"])
    with caplog.at_level("WARNING", logger="dask_ddp._rank.cuda"):
        assert str(cuda.rank_device(second, "job")) == "cuda:0"
    assert "not cuda:1 as planned (LOCAL_RANK is 1)" in caplog.text
    monkeypatch.setattr(cuda, "_started_under", ["0,1"])  # a list without its GPU
    with pytest.raises(PlacementError, match=r"GPU 2 is not visible .*\(client.restart\(\)\)"):
        cuda.rank_device(second, "job")
    no_gpu = plan_ranks([WorkerInfo("tcp://h:1", "h")])[0]
    assert str(cuda.rank_device(no_gpu, "job")) == "cpu"

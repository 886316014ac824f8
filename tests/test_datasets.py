"""launch(datasets=...): Dask collections split between the ranks, on real LocalClusters."""

from __future__ import annotations

import os
import pickle
import random
import signal
import time

import dask
import dask.array as da
import dask.bag as db
import dask.dataframe as dd
import distributed
import numpy as np
import pandas as pd
import pytest
import torch
from distributed import Client, Event, LocalCluster
from distributed.utils_test import poll_for

import dask_ddp
from dask_ddp.data import (
    CollectionSource,
    DatasetComputeError,
    DatasetNotFoundError,
    DatasetPartitionLostError,
    DatasetTooSmallError,
    UnsupportedCollectionError,
)
from dask_ddp.data._collection_plan import _plan_pieces


def _frame(n: int) -> pd.DataFrame:
    ids = np.arange(n)
    return pd.DataFrame({"id": ids, "x": ids * 0.5, "y": (ids % 3).astype("int8")})


def _uneven(n: int, parts: int = 7) -> dd.DataFrame:
    """``n`` rows in partitions of different sizes."""
    rng = np.random.default_rng(n)
    cuts = np.sort(rng.choice(np.arange(1, n), size=parts - 1, replace=False))
    frame = _frame(n)
    pieces = [frame.iloc[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    return dd.from_delayed([dask.delayed(p) for p in pieces], meta=_frame(0), verify_meta=False)


# -- rank functions ----------------------------------------------------------------------


def _read_epochs(name: str, epochs: int, batch_size: int, fmt: str | None, **kw) -> dict:
    torch.distributed.barrier()  # see _ask_for
    shard = dask_ddp.get_dataset_shard(name)
    out = {"len": len(shard), "total": shard.total_rows, "epochs": []}
    for _ in range(epochs):
        batches = list(shard.iter_batches(batch_size, format=fmt, **kw))
        out["epochs"].append(batches)
    out["num_batches"] = shard.num_batches(batch_size, drop_last=kw.get("drop_last", False))
    out["stats"] = shard.get_stats()
    return out


def _ids_of(batch) -> list:
    if isinstance(batch, dict):
        return [int(i) for i in batch["id"]]
    if isinstance(batch, pd.DataFrame):
        return batch["id"].tolist()
    return [int(i) for i in batch]


def _rows(name: str) -> dict:
    torch.distributed.barrier()  # see _ask_for
    shard = dask_ddp.get_dataset_shard(name)
    return {"rows": list(shard.iter_rows()), "again": list(shard), "epoch": shard.epoch}


def _ask_for(name: str) -> None:
    # Every rank finishes joining first: a rank that fails at once can cut a peer's gloo
    # connectFullMesh short, and that peer's error would be reported instead of this one.
    torch.distributed.barrier()
    dask_ddp.get_dataset_shard(name)


# -- what reaches the ranks --------------------------------------------------------------


def test_dataframe_reaches_two_ranks_complete_without_duplicates(client: Client) -> None:
    n = 1000  # 500 rows per rank: nothing padded or dropped
    ddf = _uneven(n)
    out = dask_ddp.launch(
        client, _read_epochs, args=("train", 1, 64, "pandas"), datasets={"train": ddf}
    ).result(timeout=120)
    seen = []
    for rank in out:
        frames = rank["epochs"][0]
        assert rank["len"] == 500 and rank["total"] == n
        assert sum(len(f) for f in frames) == 500
        assert all(len(f) == 64 for f in frames[:-1]) and len(frames[-1]) == 500 % 64
        whole = pd.concat(frames)
        pd.testing.assert_frame_equal(  # rows arrive intact, columns and dtypes kept
            whole.sort_values("id").reset_index(drop=True),
            _frame(n).iloc[sorted(whole["id"])].reset_index(drop=True),
        )
        seen += whole["id"].tolist()
    assert len(seen) == n and sorted(seen) == list(range(n))  # complete, no duplicates
    stats = [rank["stats"] for rank in out]
    fetched = sum(s["partitions_local"] + s["partitions_remote"] for s in stats)
    assert fetched >= 7 and all(s["windows"] >= 1 for s in stats)
    # Partitions are split where they lie: each rank reads its own worker's first.
    assert sum(s["partitions_local"] for s in stats) >= fetched // 2
    assert set(out[0]["epochs"][0][0]["id"]).isdisjoint(out[1]["epochs"][0][0]["id"])


def test_dataframe_as_torch_and_numpy_batches(client: Client) -> None:
    ddf = dd.from_pandas(_frame(300), npartitions=4)
    torch_out, numpy_out = (
        dask_ddp.launch(
            client,
            _read_epochs,
            args=("t", 1, 32, fmt),
            datasets={"t": CollectionSource(ddf, shuffle=False)},
        ).result(timeout=120)
        for fmt in ("torch", "numpy")
    )
    for rank in torch_out:
        first = rank["epochs"][0][0]
        assert set(first) == {"id", "x", "y"} and first["y"].dtype == torch.int8
        torch.testing.assert_close(first["x"], first["id"].double() * 0.5)
    ids = sorted(i for rank in numpy_out for b in rank["epochs"][0] for i in _ids_of(b))
    assert ids == list(range(300))
    assert isinstance(numpy_out[0]["epochs"][0][0]["x"], np.ndarray)


def test_bag_items_reach_the_ranks(client: Client) -> None:
    items = [{"id": i, "text": f"doc {i}"} for i in range(250)]
    bag = db.from_sequence(items, npartitions=6).map(lambda d: {**d, "len": len(d["text"])})
    out = dask_ddp.launch(
        client, _read_epochs, args=("docs", 1, 16, None), datasets={"docs": bag}
    ).result(timeout=120)
    got = [item for rank in out for batch in rank["epochs"][0] for item in batch]
    assert [len(rank["epochs"][0]) for rank in out] == [8, 8]  # 125 items each: 7 x 16 + 13
    assert sorted(got, key=lambda d: d["id"]) == [{**d, "len": len(d["text"])} for d in items]
    collated = dask_ddp.launch(
        client, _read_epochs, args=("docs", 1, 16, "torch"), datasets={"docs": bag}
    ).result(timeout=120)
    assert isinstance(collated[0]["epochs"][0][0]["id"], torch.Tensor)


def test_array_rows_reach_the_ranks(client: Client) -> None:
    values = np.arange(403 * 6, dtype="float32").reshape(403, 6)
    arr = da.from_array(values, chunks=(50, 4))  # chunked along both axes: rechunked to rows
    out = dask_ddp.launch(
        client,
        _read_epochs,
        args=("a", 1, 40, "torch"),
        datasets={"a": CollectionSource(arr, drop_last=True)},
    ).result(timeout=120)
    rows = torch.cat([torch.cat(rank["epochs"][0]) for rank in out])
    assert rows.shape == (402, 6)  # 201 per rank; one row left out (drop_last)
    first = (rows[:, 0] / 6).long()
    assert len(set(first.tolist())) == 402  # no duplicates
    torch.testing.assert_close(rows, torch.from_numpy(values)[first])  # each row intact


def _scribble_then_read(name: str, fmt: str) -> list[float]:
    torch.distributed.barrier()  # see _ask_for
    shard = dask_ddp.get_dataset_shard(name)
    sums = []
    for _ in range(2):
        total = 0.0
        for batch in shard.iter_batches(7, format=fmt, window=1):
            tensor = batch["x"] if isinstance(batch, dict) else batch
            total += float(tensor.sum())
            tensor.zero_()  # a training loop may change its batch in place
        sums.append(total)
    return sums


def test_partitions_on_another_worker_come_worker_to_worker(client: Client) -> None:
    a, b = sorted(client.scheduler_info(n_workers=-1)["workers"])
    ddf = client.persist(dd.from_pandas(_frame(90), npartitions=3), workers=[b])
    out = dask_ddp.launch(
        client, _read_epochs, args=("t", 1, 8, "numpy"), workers=[a], datasets={"t": ddf}
    ).result(timeout=120)
    assert sorted(i for batch in out[0]["epochs"][0] for i in _ids_of(batch)) == list(range(90))
    assert out[0]["stats"]["partitions_remote"] == 3  # all on b, fetched from there
    assert out[0]["stats"]["partitions_local"] == 0


def test_changing_a_batch_in_place_leaves_the_data_alone(client: Client) -> None:
    arr = da.from_array(np.arange(60, dtype="float64").reshape(30, 2), chunks=(10, 2))
    ddf = dd.from_pandas(_frame(30), npartitions=3)
    for data, fmt in ((arr, "torch"), (ddf, "torch")):
        source = CollectionSource(data, shuffle=False)  # no shuffle: no copy by shuffling
        out = dask_ddp.launch(
            client, _scribble_then_read, args=("d", fmt), datasets={"d": source}
        ).result(timeout=120)
        for first, second in out:
            assert first == second > 0


def test_rows_and_epochs_on_the_rank(client: Client) -> None:
    ddf = dd.from_pandas(_frame(20), npartitions=3)
    out = dask_ddp.launch(client, _rows, args=("t",), datasets={"t": ddf}).result(timeout=120)
    for rank in out:
        assert rank["epoch"] == 2  # two iterations: epochs 0 and 1
        assert {r["id"] for r in rank["rows"]} == {r["id"] for r in rank["again"]}
        assert all(r["x"] == r["id"] * 0.5 for r in rank["rows"])
        assert rank["rows"] != rank["again"]  # another epoch, another order
    assert sorted(r["id"] for rank in out for r in rank["rows"]) == list(range(20))


# -- equal steps per rank: padding and dropping ------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_gets_the_same_number_of_batches(client: Client, drop_last: bool) -> None:
    n = 1001  # odd: one row padded, or one left out
    ddf = _uneven(n, parts=5)
    out = dask_ddp.launch(
        client,
        _read_epochs,
        args=("t", 2, 64, "numpy"),
        kwargs={"drop_last": False},
        datasets={"t": CollectionSource(ddf, drop_last=drop_last)},
    ).result(timeout=120)
    per_rank = 500 if drop_last else 501
    for rank in out:
        assert rank["len"] == per_rank
        for epoch in rank["epochs"]:
            assert len(epoch) == rank["num_batches"] == 8
            assert sum(len(b["id"]) for b in epoch) == per_rank
    ids = [i for rank in out for b in rank["epochs"][0] for i in _ids_of(b)]
    if drop_last:
        assert len(set(ids)) == len(ids) == 1000
    else:
        assert set(ids) == set(range(n)) and len(ids) == 1002  # one row twice


def test_batch_drop_last_and_window_options(client: Client) -> None:
    ddf = dd.from_pandas(_frame(200), npartitions=5)
    out = dask_ddp.launch(
        client,
        _read_epochs,
        args=("t", 1, 30, "pandas"),
        kwargs={"drop_last": True, "window": 1, "prefetch": 0},
        datasets={"t": ddf},
    ).result(timeout=120)
    for rank in out:
        assert [len(b) for b in rank["epochs"][0]] == [30, 30, 30]  # 100 rows: 10 left out
        assert rank["num_batches"] == 3


# -- shuffling ---------------------------------------------------------------------------


def _orders(name: str, epochs: int, resume_at: int | None) -> list[list[int]]:
    torch.distributed.barrier()  # see _ask_for
    shard = dask_ddp.get_dataset_shard(name)
    orders = [[int(i) for b in shard.iter_batches(16, format="numpy") for i in b["id"]]]
    for _ in range(1, epochs):
        orders.append([int(i) for b in shard.iter_batches(16, format="numpy") for i in b["id"]])
    if resume_at is not None:  # as after a restart: set_epoch brings the order back
        shard.set_epoch(resume_at)
        orders.append([int(i) for b in shard.iter_batches(16, format="numpy") for i in b["id"]])
    return orders


def test_shuffle_differs_per_epoch_and_repeats_per_seed(client: Client) -> None:
    ddf = dd.from_pandas(_frame(400), npartitions=8).persist()

    def run(**options) -> list[list[list[int]]]:
        source = CollectionSource(ddf, **options)
        return dask_ddp.launch(client, _orders, args=("t", 3, 1), datasets={"t": source}).result(
            timeout=120
        )

    first, again, other, plain = run(seed=7), run(seed=7), run(seed=8), run(shuffle=False)
    assert first == again  # deterministic for a seed
    for rank in range(2):
        e0, e1, e2, resumed = first[rank]
        assert sorted(e0) == sorted(e1) == sorted(e2)  # the same rows every epoch...
        assert e0 != e1 and e1 != e2 and e0 != e2  # ...in another order
        assert resumed == e1  # set_epoch(1) gives epoch 1's order again
        assert other[rank][0] != e0 and sorted(other[rank][0]) == sorted(e0)
        assert plain[rank][0] == plain[rank][1] == sorted(plain[rank][0])  # partition order
    # Shuffling mixes rows of different partitions within a window.
    assert e0[:50] != sorted(e0[:50])
    assert ddf.x.sum().compute() == _frame(400).x.sum()  # the user's persisted data is intact


# -- errors ------------------------------------------------------------------------------


def test_unknown_name_fails_with_the_names_there_are(client: Client) -> None:
    ddf = dd.from_pandas(_frame(10), npartitions=2)
    job = dask_ddp.launch(client, _ask_for, args=("valid",), datasets={"train": ddf})
    with pytest.raises(dask_ddp.RankFailedError, match="no dataset 'valid'") as info:
        job.result(timeout=120)
    assert isinstance(info.value.__cause__, DatasetNotFoundError)
    assert "datasets=['train']" in str(info.value)
    job = dask_ddp.launch(client, _ask_for, args=("train",))  # a job without datasets
    with pytest.raises(dask_ddp.RankFailedError, match=r"datasets=\[\]"):
        job.result(timeout=120)


def test_get_dataset_shard_outside_a_rank() -> None:
    with pytest.raises(
        dask_ddp.errors.NotInRankError, match=r"get_dataset_shard\(\) works only inside"
    ):
        dask_ddp.get_dataset_shard("train")


def test_bad_datasets_fail_before_any_rank_starts(client: Client) -> None:
    with pytest.raises(UnsupportedCollectionError, match=r"datasets=\{'x': ...\} is a list"):
        dask_ddp.launch(client, _ask_for, args=("x",), datasets={"x": [1, 2, 3]})
    with pytest.raises(DatasetTooSmallError, match="fewer than the job's 2 ranks"):
        dask_ddp.launch(
            client,
            _ask_for,
            args=("x",),
            datasets={"x": CollectionSource(db.from_sequence([1]), drop_last=True)},
        )
    bad = db.from_sequence(range(4), npartitions=2).map(lambda i: 1 // (i - 3))
    with pytest.raises(DatasetComputeError, match="partition 1") as info:
        dask_ddp.launch(client, _ask_for, args=("x",), datasets={"x": bad})
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(
        dask_ddp.RankFailedError, match="format= takes one of 'pandas', 'numpy', 'torch'"
    ):
        dask_ddp.launch(
            client,
            _read_epochs,
            args=("t", 1, 4, "arrow"),
            datasets={"t": dd.from_pandas(_frame(8), npartitions=2)},
        ).result(timeout=120)


def test_errors_pickle() -> None:
    for err in (
        UnsupportedCollectionError("t", "list"),
        DatasetTooSmallError("t", 1, 2, True),
        DatasetComputeError("t", 1, "k", "ValueError: x"),
        DatasetPartitionLostError("t", 1, "k", ("tcp://a:1",), 0),
        DatasetNotFoundError("v", ("t",), 1),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)


# -- lifetime: held for the job, released after it -----------------------------------------


def _known(keys: list, dask_scheduler=None) -> list:
    return [k for k in keys if k in dask_scheduler.tasks]


def test_partitions_are_held_for_the_job_and_released_after_it(client: Client) -> None:
    ddf = dd.from_pandas(_frame(100), npartitions=4)
    keys = [d.key for d in ddf.to_delayed()]  # the keys launch() computes
    go = Event("dask-ddp-test-held", client=client)
    job = dask_ddp.launch(client, _wait_then_read, args=("t", go.name), datasets={"t": ddf})
    assert client.run_on_scheduler(_known, keys) == keys  # in the cluster while it runs
    go.set()
    assert job.result(timeout=120) == [50, 50]
    poll_for(lambda: not client.run_on_scheduler(_known, keys), timeout=30)


# -- planning: pure ----------------------------------------------------------------------


def test_plan_splits_rows_evenly_and_prefers_local_partitions() -> None:
    rng = random.Random(0)
    for _ in range(300):
        world = rng.randint(1, 5)
        workers = [f"w{i}" for i in range(world)]
        lengths = [rng.choice([0, 1, 7, 30, 100]) for _ in range(rng.randint(1, 12))]
        holders = [[rng.choice([*workers, "elsewhere"])] for _ in lengths]
        total = sum(lengths)
        for drop_last in (False, True):
            shares = _plan_pieces(lengths, holders, workers, drop_last=drop_last)
            per = total // world if drop_last else -(-total // world)
            if per == 0:
                assert shares is None
                continue
            rows = [[(i, r) for i, a, b in share for r in range(a, b)] for share in shares]
            assert all(len(r) == per for r in rows)  # the same number on every rank
            flat = [x for r in rows for x in r]
            unique = set(flat)
            if drop_last:
                assert len(unique) == len(flat) and total - len(flat) < world
            else:
                assert unique == {(i, r) for i, n in enumerate(lengths) for r in range(n)}
                assert len(flat) - total < world
    # A partition goes whole to the rank whose worker holds it, when it fits.
    shares = _plan_pieces([10, 10, 10, 10], [["b"], ["a"], ["b"], ["a"]], ["a", "b"])
    assert shares == [[(1, 0, 10), (3, 0, 10)], [(0, 0, 10), (2, 0, 10)]]


# -- restarts and lost workers (own clusters) --------------------------------------------


def _read_then_die(name: str) -> dict:
    torch.distributed.barrier()  # see _ask_for
    ctx = dask_ddp.get_context()
    shard = dask_ddp.get_dataset_shard(name)
    ids = []
    for batch in shard.iter_batches(50, format="numpy"):
        ids += [int(i) for i in batch["id"]]
        if ctx.attempt == 0 and ctx.rank == 1:
            # The rank's worker dies (get_worker() in a rank: a stand-in that knows its pid), and
            # the rank with it.
            os.kill(distributed.get_worker().pid, signal.SIGKILL)
            time.sleep(60)
    return {"attempt": ctx.attempt, "ids": ids}


@pytest.mark.slow
def test_a_restart_still_finds_the_data(own_cluster: LocalCluster) -> None:
    with Client(own_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        ddf = dd.from_pandas(_frame(600), npartitions=6)
        job = dask_ddp.launch(
            client, _read_then_die, args=("t",), datasets={"t": ddf}, max_restarts=1
        )
        out = job.result(timeout=180)
        assert [o["attempt"] for o in out] == [1, 1]
        ids = [i for o in out for i in o["ids"]]
        assert sorted(ids) == list(range(600))  # lost partitions were computed again


def _wait_then_read(name: str, event: str) -> int:
    torch.distributed.barrier()  # see _ask_for
    shard = dask_ddp.get_dataset_shard(name)
    Event(event).wait(timeout=60)
    return sum(len(b) for b in shard.iter_batches(10))


@pytest.mark.slow
def test_a_lost_partition_without_a_recipe_is_a_clear_error(own_cluster: LocalCluster) -> None:
    with Client(own_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        a, b = sorted(client.scheduler_info(n_workers=-1)["workers"])
        parts = client.scatter([[1, 2, 3], [4, 5, 6]], workers=[b])  # data only on b
        bag = db.from_delayed(parts)
        go = Event("dask-ddp-test-lost", client=client)
        job = dask_ddp.launch(
            client, _wait_then_read, args=("x", go.name), workers=[a], datasets={"x": bag}
        )
        pid = client.run(os.getpid, workers=[b])[b]
        os.kill(pid, signal.SIGKILL)
        poll_for(lambda: b not in client.scheduler_info(n_workers=-1)["workers"], timeout=30)
        go.set()
        with pytest.raises(dask_ddp.RankFailedError, match="is lost") as info:
            job.result(timeout=120)
        cause = info.value.__cause__
        assert isinstance(cause, DatasetPartitionLostError)
        assert cause.rank == 0 and cause.name == "x" and b in cause.holders
        assert "client.scatter" in str(cause)

"""The parts ShardListDataset wires, each used alone: the shard list, the reader of this
process's shards (and its shard order), and the sample decoder."""

from __future__ import annotations

import pickle
import threading

import pytest

from dask_ddp.data import DataNotFoundError, ShardListError, write_shards
from dask_ddp.data._decode import SampleDecoder, WidsDecoder
from dask_ddp.data._shard_reader import ShardOrder, ShardReader
from dask_ddp.data._specs import Shard, ShardList


def _no_client(protocol: str):
    raise AssertionError(f"a dict or list needs no {protocol} client")


def test_shard_list_says_which_shard_holds_each_sample(tmp_path):
    listing, fs = ShardList.load(
        {"shardlist": [{"url": "a.tar", "nsamples": 3}, {"url": "b.tar", "nsamples": 0},
                       {"url": "c.tar", "nsamples": 2}]},
        base=str(tmp_path), connect=_no_client,
    )  # fmt: skip
    assert fs is None and len(listing) == 5 and listing.offsets == [0, 3, 3]
    assert [listing.where(i) for i in range(5)] == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]
    assert listing.shards[2] == Shard(str(tmp_path / "c.tar"), 2, None)
    assert pickle.loads(pickle.dumps(listing)).where(4) == (2, 1)
    with pytest.raises(ShardListError, match="several filesystems"):
        ShardList([Shard("/d/a.tar", 1, None), Shard("s3://b/a.tar", 1, None)], "mixed")
    with pytest.raises(DataNotFoundError, match="hold no samples"):
        ShardList([Shard("/d/a.tar", 0, None)], "empty")


def test_reader_reads_raw_fields_and_starts_afresh_after_a_pickle(tmp_path):
    shards = write_shards([{"txt": f"#{i}", "cls": i} for i in range(5)], tmp_path, maxcount=2)
    listing = ShardList([Shard(**s) for s in shards], "test")
    reader = ShardReader(listing, {}, retries=0, cache_dir=str(tmp_path / "cache"))
    raw = reader.read(3)
    assert (raw["txt"], raw["cls"], raw["__key__"], raw["__shardindex__"]) == (
        b"#3", b"3", "000000003", 1,
    )  # fmt: skip
    assert reader.locate(4) == (shards[2]["url"], "000000004")
    copy = pickle.loads(pickle.dumps(reader))
    assert set(copy.get_stats().values()) == {0}
    assert copy.read(0)["txt"] == b"#0" and copy.get_stats()["shard_opens"] == 1
    reader.close()
    assert reader.read(2)["txt"] == b"#2"  # closed shards open again on the next read


def test_shard_order_downloads_ahead_and_stops_when_reads_leave_it():
    fetched, done = [], threading.Event()

    def fetch(s: int) -> None:
        fetched.append(s)
        done.set()

    order = ShardOrder(5, 1, fetch)
    order.set([3, 1, 4])
    order.opened(3)  # reading shard 3: shard 1 downloads ahead
    assert done.wait(10) and order.wait(10) and fetched == [1]
    order.opened(0)  # a shard the order does not list next: prefetching stops
    assert order.plan is None and order.wait(10) and fetched == [1]
    with pytest.raises(ValueError, match="there are shards 0 to 4"):
        order.set([5])


def test_sample_decoder_ways():
    raw = {"cls": b"7", "json": b'{"a": 1}', "__key__": "k", "__shard__": "s.tar"}
    assert SampleDecoder(keys=("cls", "json"))(raw) == (7, {"a": 1})
    assert SampleDecoder(decode=False)(raw)[".cls"] == b"7"
    wids_way = SampleDecoder()
    assert wids_way.transformations == [WidsDecoder("PIL")]
    wids_way.add_transform(lambda s: s[".cls"] * 2)
    assert wids_way(raw) == 14
    with pytest.raises(TypeError, match="two ways to decode"):
        SampleDecoder(keys=("cls",), transformations="PIL")

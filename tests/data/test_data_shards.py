"""Tar shards: write_shards, ShardListDataset (local and S3, cache, workers) and
DistributedChunkedSampler."""

from __future__ import annotations

import gc
import io
import itertools
import json
import logging
import pickle
import tarfile
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _together import run_together
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

import dask_ddp
import dask_ddp.data._shard_reader as shard_reader_module
import dask_ddp.data._tar as tar_module
from dask_ddp.data import (
    CorruptDataError,
    DataNotFoundError,
    DistributedChunkedSampler,
    MissingFieldError,
    S3ImageFolder,
    ShardListDataset,
    ShardListError,
    write_shards,
)

IMAGE_FIELD = "jpg;jpeg;png;bmp"


def pixels(img: Image.Image) -> bytes:
    return np.asarray(img).tobytes()


RANK_S3_OPTIONS = {
    "key": "testing",
    "secret": "testing",
    "client_kwargs": {"region_name": "us-east-1"},
}
"""Credentials for code in a Dask worker, which was started before the S3 fixture set them."""


def cached_shards(cache_dir: Path) -> list[Path]:
    """The shards in a cache directory (not the indexes, lock files or partial files)."""
    files = [p for p in cache_dir.rglob("*") if p.is_file() and "." not in p.name]
    return sorted(p for p in files if not p.read_bytes().startswith(b'{"keys"'))  # an index


@pytest.fixture(autouse=True)
def _default_cache_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Datasets without cache_dir= keep their shard indexes here, not in the real tempdir."""
    monkeypatch.setattr(
        shard_reader_module, "_default_cache_dir", lambda: tmp_path / "default-cache"
    )


@pytest.fixture
def shard_dir(image_tree: Path, tmp_path: Path) -> Path:
    """``image_tree`` (12 images, 3 classes) written as shards of at most 5 samples."""
    write_shards(datasets.ImageFolder(str(image_tree)), tmp_path / "shards", maxcount=5)
    return tmp_path / "shards"


# -- writing and reading back -----------------------------------------------------------


def test_imagefolder_round_trip_local(image_tree, shard_dir, image_count):
    reference = datasets.ImageFolder(str(image_tree))
    listing = json.loads((shard_dir / "shards.json").read_text())
    assert listing["wids_version"] == 1
    assert [(s["url"], s["nsamples"]) for s in listing["shardlist"]] == [
        ("shard-000000.tar", 5), ("shard-000001.tar", 5), ("shard-000002.tar", 2),
    ]  # fmt: skip
    assert [s["filesize"] for s in listing["shardlist"]] == [
        (shard_dir / s["url"]).stat().st_size for s in listing["shardlist"]
    ]

    ds = ShardListDataset(shard_dir / "shards.json", keys=(IMAGE_FIELD, "cls"))
    assert len(ds) == image_count
    assert ds.shard_offsets == [0, 5, 10]
    for i in range(len(ds)):
        img, target = ds[i]
        ref, ref_target = reference[i]
        assert (img.mode, img.size, target) == ("RGB", ref.size, ref_target)
        assert pixels(img) == pixels(ref)

    # The files' own bytes, not re-encoded copies, under their own extensions.
    raw = ShardListDataset(shard_dir / "shards.json", decode=False)
    for i, (path, _) in enumerate(reference.samples):
        ext = path.rsplit(".", 1)[1].lower()
        assert raw[i]["." + ext] == Path(path).read_bytes()
        assert raw[i]["__key__"] == f"{i:09d}"
    assert ds.locate(7) == (str(shard_dir / "shard-000001.tar"), "000000007")


def test_s3_round_trip_and_cache(s3_endpoint, s3_client, bucket, image_tree, tmp_path):
    url = f"s3://{bucket}/sets/train"
    shards = write_shards(
        datasets.ImageFolder(str(image_tree)), url, maxcount=4, endpoint_url=s3_endpoint
    )
    assert [s["url"] for s in shards] == [f"{url}/shard-00000{i}.tar" for i in range(3)]
    local = ShardListDataset(
        write_shards(datasets.ImageFolder(str(image_tree)), tmp_path / "local", maxcount=4),
        decode=True,  # every image extension (wids's decoding leaves .jpeg, .bmp as bytes)
    )
    cache_dir = tmp_path / "cache"
    ds = ShardListDataset(
        f"{url}/shards.json", endpoint_url=s3_endpoint, cache_dir=cache_dir, decode=True
    )
    assert ds.cache_dir == str(cache_dir)
    for i in range(len(ds)):
        a, b = ds[i], local[i]
        assert a["__key__"] == b["__key__"]
        assert a[".cls"] == b[".cls"]
        image = next(k for k in a if not k.startswith("__") and k != ".cls")
        assert pixels(a[image]) == pixels(b[image])
    stats = ds.get_stats()
    assert (stats["requested"], stats["downloads"], stats["cache_hits"]) == (12, 3, 0)
    assert stats["downloaded_bytes"] == sum(s["filesize"] for s in shards)
    assert len(cached_shards(cache_dir)) == 3
    assert not list(cache_dir.rglob("*.part"))

    # Another process on this host (a new dataset object) reads the cache, not the store.
    for s in shards:
        s3_client.delete_object(Bucket=bucket, Key=s["url"].removeprefix(f"s3://{bucket}/"))
    again = ShardListDataset(f"{url}/shards.json", endpoint_url=s3_endpoint, cache_dir=cache_dir)
    assert [again[i][".cls"] for i in range(12)] == [local[i][".cls"] for i in range(12)]
    assert again.get_stats()["cache_hits"] == 3
    assert again.get_stats()["downloads"] == 0
    fresh = ShardListDataset(
        f"{url}/shards.json", endpoint_url=s3_endpoint, cache_dir=tmp_path / "other"
    )
    with pytest.raises(DataNotFoundError, match=r"shard-000000.tar does not exist .* lists it"):
        fresh[0]


def test_s3imagefolder_is_copied_byte_for_byte(s3_endpoint, s3_images, tmp_path):
    bucket, prefix, local = s3_images
    source = S3ImageFolder(bucket, prefix, endpoint_url=s3_endpoint)
    shards = write_shards(source, tmp_path / "out", shuffle=True, seed=1)
    ds = ShardListDataset(shards, decode=False)
    seen = set()
    for i in range(len(ds)):
        sample = ds[i]
        index = int(sample["__key__"])  # the key is the index in the source dataset
        seen.add(index)
        url, target = source.samples[index]
        ext = url.rsplit(".", 1)[1].lower()
        assert sample["." + ext] == (local / url.split(prefix + "/", 1)[1]).read_bytes()
        assert int(sample[".cls"]) == target
    assert seen == set(range(len(source)))
    assert [int(ds[i]["__key__"]) for i in range(len(ds))] != list(range(len(ds)))  # shuffled


def _double(value: bytes) -> str:
    return value.decode() * 2


def _keys_only(sample: dict) -> str:
    return sample["__key__"]


def test_fields_of_every_kind(tmp_path):
    rng = np.random.default_rng(0)
    array = rng.normal(size=(3, 4)).astype(np.float32)
    tensor = torch.arange(6).reshape(2, 3)
    image = Image.fromarray(rng.integers(0, 256, (5, 7, 3), dtype=np.uint8))
    smooth = Image.new("RGB", (7, 5), (200, 120, 40))  # JPEG keeps flat colours
    samples = [
        {"png": image, "cls": 3, "json": {"a": [1, 2]}, "txt": "héllo", "npy": array,
         "pth": {"w": tensor}, "raw.bin": b"\x00\x01", "__key__": "first"},
        {"jpg": smooth, "cls": np.int64(4), "json": [], "txt": "", "npy": array[:1],
         "pth": tensor, "raw.bin": b""},
    ]  # fmt: skip
    shards = write_shards(samples, tmp_path, maxcount=1)
    assert [s["nsamples"] for s in shards] == [1, 1]
    ds = ShardListDataset(tmp_path / "shards.json")
    first, second = ds[0], ds[1]
    assert (first["__key__"], second["__key__"]) == ("first", "000000001")
    assert pixels(first[".png"]) == pixels(image)  # PNG is lossless
    assert np.abs(np.asarray(second[".jpg"], float) - np.asarray(smooth, float)).max() < 4
    assert (first[".cls"], first[".json"], first[".txt"]) == (3, {"a": [1, 2]}, "héllo")
    assert (second[".cls"], second[".json"], second[".txt"]) == (4, [], "")
    np.testing.assert_array_equal(first[".npy"], array)
    assert torch.equal(first[".pth"]["w"], tensor)
    assert torch.equal(second[".pth"], tensor)
    assert (first[".raw.bin"].getvalue(), second[".raw.bin"].getvalue()) == (b"\x00\x01", b"")

    custom = ShardListDataset(tmp_path / "shards.json", decode={"txt": _double, "png": None})
    assert custom[0][".txt"] == "héllohéllo"
    assert custom[0][".png"][:4] == b"\x89PNG"  # None keeps the bytes
    assert isinstance(custom[0][".npy"], np.ndarray)  # the other defaults still apply
    assert ShardListDataset(tmp_path / "shards.json", decode=_keys_only)[1] == "000000001"

    picked = ShardListDataset(
        tmp_path / "shards.json",
        keys=("png;jpg", "cls"),
        transform=(transforms.functional.pil_to_tensor, None),
    )
    img, target = picked[1]
    assert (img.shape, target) == ((3, 5, 7), 4)
    missing = ShardListDataset(tmp_path / "shards.json", keys=("png", "cls"))
    with pytest.raises(MissingFieldError, match=r"sample .000000001. in .* has no .png. field"):
        missing[1]


def test_tuples_and_iterables(tmp_path):
    def generate():
        for i in range(7):
            yield np.full(2, i), i, f"text {i}"

    shards = write_shards(generate(), tmp_path / "a", maxcount=3)
    assert [s["nsamples"] for s in shards] == [3, 3, 1]
    ds = ShardListDataset(shards, keys=("npy", "cls", "txt"))
    assert [(int(a[0]), c, t) for a, c, t in (ds[i] for i in range(7))] == [
        (i, i, f"text {i}") for i in range(7)
    ]
    named = write_shards([(b"abc", 1)], tmp_path / "b", fields=("bin", "cls"))
    assert ShardListDataset(named, decode=True)[0][".bin"] == b"abc"
    with pytest.raises(TypeError, match="pass fields= with an extension"):
        write_shards([(b"abc", 1)], tmp_path / "c")
    with pytest.raises(ValueError, match="has two 'cls' field"):
        write_shards([(1, 2)], tmp_path / "d")
    with pytest.raises(TypeError, match="cannot encode its 'cls' field"):
        write_shards([{"cls": 1.5}], tmp_path / "e")
    with pytest.raises(ValueError, match="shuffle=True needs samples with len"):
        write_shards(generate(), tmp_path / "f", shuffle=True)
    with pytest.raises(ValueError, match="got no samples"):
        write_shards([], tmp_path / "g")


def test_maxsize_starts_new_shards(tmp_path):
    samples = [{"bin": bytes(3000)} for _ in range(10)]
    shards = write_shards(samples, tmp_path, maxsize=10_000)
    assert all(s["filesize"] <= 10_240 for s in shards)  # one tar record of slack
    assert sum(s["nsamples"] for s in shards) == 10
    assert len(shards) >= 4


# -- shard lists ------------------------------------------------------------------------


def test_shard_list_forms(shard_dir, tmp_path, image_count):
    listing = json.loads((shard_dir / "shards.json").read_text())
    # Relative URLs resolve against the JSON's folder, wherever it is.
    (tmp_path / "lists").mkdir()
    entries = [dict(s, url=f"../shards/{s['url']}") for s in listing["shardlist"]]
    moved = dict(listing, shardlist=entries)
    (tmp_path / "lists" / "train.json").write_text(json.dumps(moved))
    assert len(ShardListDataset(tmp_path / "lists" / "train.json")) == image_count
    # A "base" wins; a dict or a list of entries works without a file.
    based = dict(listing, base=str(shard_dir))
    assert len(ShardListDataset(based)) == image_count
    absolute = [dict(s, url=str(shard_dir / s["url"])) for s in listing["shardlist"]]
    ds = ShardListDataset(absolute)
    assert ds.shards[2] == {"url": str(shard_dir / "shard-000002.tar"), "nsamples": 2,
                            "filesize": listing["shardlist"][2]["filesize"]}  # fmt: skip
    assert len(ds) == image_count


@pytest.mark.parametrize(
    ("shards", "match"),
    [
        ([], "it lists no shards"),
        ([{"url": "a.tar"}], r"entry 0 \(a.tar\) has no 'nsamples'"),
        ([{"nsamples": 3}], "entry 0 has no 'url'"),
        (["a.tar"], "entry 0 is 'a.tar', not a dict"),
        ({"shards": []}, r"it has no 'shardlist' \(found \['shards'\]\)"),
        ([{"url": "/a.tar", "nsamples": 1}, {"url": "s3://b/a.tar", "nsamples": 1}],
         "several filesystems"),
    ],
)  # fmt: skip
def test_bad_shard_lists(shards, match):
    with pytest.raises(ShardListError, match=match):
        ShardListDataset(shards)


def test_shard_list_file_errors(tmp_path):
    with pytest.raises(DataNotFoundError, match="the shard list does not exist"):
        ShardListDataset(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ShardListError, match="it is not JSON"):
        ShardListDataset(tmp_path / "bad.json")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"decode": "utf-8"}, TypeError, "decode= takes True, False"),
        ({"keys": "jpg"}, TypeError, "keys= takes a sequence"),
        ({"keys": ("jpg",), "transform": (None, None)}, TypeError, "one function or None per"),
        ({"open_shards": 0}, ValueError, "open_shards= must be an int >= 1"),
        ({"cache_size": "lots"}, ValueError, "cache_size= takes bytes"),
        ({"on_corrupt": "ignore"}, ValueError, "on_corrupt= must be"),
    ],
)
def test_bad_arguments(shard_dir, kwargs, error, match):
    with pytest.raises(error, match=match):
        ShardListDataset(shard_dir / "shards.json", **kwargs)


def test_open_shards_add_few_objects_for_the_garbage_collector(tmp_path):
    # An index of per-sample tuples made DataLoader workers run full collections (about
    # 0.3 s each in a process with torch loaded) that stalled the batch being made.
    members = [(f"{i:06d}.{ext}", b"x") for i in range(1000) for ext in ("jpg", "cls")]
    entries = []
    for k in range(4):
        (tmp_path / f"s{k}.tar").write_bytes(_tar(members, format=tarfile.USTAR_FORMAT))
        entries.append({"url": str(tmp_path / f"s{k}.tar"), "nsamples": 1000})
    ds = ShardListDataset(entries, decode=False, cache_dir=tmp_path / "cache")
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        for k in range(4):
            ds[k * 1000 + 999]  # indexes shard k (built, then loaded from the cache)
        fresh = ShardListDataset(entries, decode=False, cache_dir=tmp_path / "cache")
        for k in range(4):
            fresh[k * 1000]
        grown = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert grown < 200  # 8 indexes of 1,000 samples; per-sample tuples were 32,000


# -- broken shards ----------------------------------------------------------------------


def _tar(members: list[tuple[str, bytes]], **kwargs) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", **kwargs) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
            else:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data or b""))
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tar_written_by_others(tmp_path, fmt):
    long = "deep/" * 25 + "k1"  # over ustar's 100-character names: an extension header
    names = [("a/x0.txt", b"zero"), ("a/x0.cls", b"0"), ("a/", None), ("README", b"no ext")]
    if fmt != tarfile.USTAR_FORMAT:
        names += [(f"{long}.txt", b"one"), (f"{long}.seg.png", b"png"), ("ünï.txt", b"two")]
    (tmp_path / "s.tar").write_bytes(_tar(names, format=fmt))
    count = 1 if fmt == tarfile.USTAR_FORMAT else 3  # a/x0 (README has no extension), ...
    ds = ShardListDataset([{"url": str(tmp_path / "s.tar"), "nsamples": count}], decode=False)
    assert ds[0] == {".txt": b"zero", ".cls": b"0", "__key__": "a/x0", "__dataset__": None,
                     "__shard__": str(tmp_path / "s.tar"), "__index__": 0,
                     "__shardindex__": 0}  # fmt: skip
    if count == 3:
        assert (ds[1]["__key__"], ds[1][".txt"], ds[1][".seg.png"]) == (long, b"one", b"png")
        assert (ds[2]["__key__"], ds[2][".txt"]) == ("ünï", b"two")


def _members(tar_bytes: bytes) -> list[tuple[str, int, int]]:
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        return [(m.name, m.offset_data, m.size) for m in tar if m.isreg()]


def _scan(path: Path, data: bytes) -> list[tuple[str, int, int]] | None:
    path.write_bytes(data)
    with open(path, "rb") as f:
        found = tar_module._scan_plain_tar(f, len(data))
    return None if found is None else list(zip(found[0], found[1], found[2], strict=True))


def test_fast_tar_scan_agrees_with_tarfile_or_defers_to_it(tmp_path):
    path = tmp_path / "s.tar"
    prefixed = "p" * 120 + "/x.txt"  # over 100 characters: ustar's prefix field holds "ppp..."
    plain = [("a/x0.txt", b"zero"), ("a/x0.cls", b"12"), ("ünï.json", b"{}"),
             (prefixed, b"long"), ("big.bin", bytes(5000)), ("empty.txt", b"")]  # fmt: skip
    data = _tar(plain, format=tarfile.USTAR_FORMAT)
    assert _scan(path, data) == _members(data)
    assert _scan(path, data)[3][0] == prefixed
    assert _scan(path, _tar([("a/", None)], format=tarfile.USTAR_FORMAT)) is None  # a folder
    assert _scan(path, _tar([("l" * 120 + ".txt", b"x")], format=tarfile.GNU_FORMAT)) is None
    bad_sum = bytearray(data)
    bad_sum[148:150] = b"77"  # the first header's checksum field
    assert _scan(path, bytes(bad_sum)) is None  # tarfile then calls the shard corrupt
    seven_digits = bytearray(data)  # a writer that fills the checksum field "%07o\0"
    seven_digits[148:156] = b"%07o\0" % int(data[148:154], 8)
    assert _scan(path, bytes(seven_digits)) == _members(data)
    junk_name = bytearray(data)
    junk_name[20:24] = b"junk"  # after the first name's NUL; tarfile cuts it off there
    junk_name[148:156] = b"%06o\0 " % (sum(junk_name[:148]) + 256 + sum(junk_name[156:512]))
    assert _scan(path, bytes(junk_name)) is None
    assert _members(bytes(junk_name))[0][0] == "a/x0.txt"


def test_missing_shard(shard_dir):
    (shard_dir / "shard-000001.tar").unlink()
    ds = ShardListDataset(shard_dir / "shards.json")
    assert (ds[4][".cls"], ds[10][".cls"]) == (0, 2)  # the other shards still read
    with pytest.raises(DataNotFoundError, match=r"shard-000001.tar does not exist") as info:
        ds[5]
    assert isinstance(info.value, FileNotFoundError)
    assert pickle.loads(pickle.dumps(info.value)).url == info.value.url


def test_count_mismatch(shard_dir):
    listing = json.loads((shard_dir / "shards.json").read_text())
    listing["shardlist"][1]["nsamples"] = 6
    (shard_dir / "shards.json").write_text(json.dumps(listing))
    ds = ShardListDataset(shard_dir / "shards.json")
    with pytest.raises(CorruptDataError, match=r"holds 5 samples, but .*shards\.json says 6"):
        ds[5]


def test_corrupt_shards(shard_dir):
    ds = ShardListDataset(shard_dir / "shards.json")
    data = (shard_dir / "shard-000000.tar").read_bytes()
    (shard_dir / "shard-000000.tar").write_bytes(data[:1500])  # cut inside a member
    with pytest.raises(CorruptDataError, match=r"unexpected end of data|truncated"):
        ds[0]
    (shard_dir / "shard-000001.tar").write_bytes(b"not a tar file at all" * 100)
    with pytest.raises(CorruptDataError, match=r"shard-000001\.tar is not a readable tar"):
        ds[5]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.addfile(tarfile.TarInfo("0.cls"), io.BytesIO(b""))
    (shard_dir / "shard-000002.tar").write_bytes(buf.getvalue())
    with pytest.raises(CorruptDataError, match="gzip-compressed"):
        ds[10]


def test_corrupt_download_is_not_kept(s3_endpoint, s3_client, bucket, tmp_path):
    samples = [{"txt": "a"}, {"txt": "b"}]
    shards = write_shards(samples, f"s3://{bucket}/c", endpoint_url=s3_endpoint)
    s3_client.put_object(Bucket=bucket, Key="c/shard-000000.tar", Body=b"x" * 10240)
    ds = ShardListDataset(shards, endpoint_url=s3_endpoint, cache_dir=tmp_path)
    with pytest.raises(CorruptDataError):
        ds[0]
    assert cached_shards(tmp_path) == []  # the next read downloads it again
    s3_client.put_object(Bucket=bucket, Key="c/shard-000000.tar", Body=b"x" * 10)
    with pytest.raises(CorruptDataError, match=r"download has 10 bytes, but .* filesize"):
        ds[0]


def _fail(data: bytes) -> None:
    raise ValueError("bad label")


def test_corrupt_sample_raise_or_skip(tmp_path, caplog):
    write_shards([{"txt": str(i), "cls": i} for i in range(4)], tmp_path)
    strict = ShardListDataset(tmp_path / "shards.json", decode={"cls": _fail})
    with pytest.raises(CorruptDataError, match=r"#000000001.cls: ValueError: bad label"):
        strict[1]
    lenient = ShardListDataset(
        tmp_path / "shards.json", decode={"cls": _fail, "txt": None}, on_corrupt="skip",
        keys=("txt",),
    )  # fmt: skip
    with caplog.at_level(logging.WARNING), pytest.raises(Exception, match="all 4 samples"):
        lenient[0]
    assert "skipping corrupt sample" in caplog.text


# -- the cache --------------------------------------------------------------------------


def _read_all(ds: ShardListDataset) -> dict[str, int]:
    for i in range(len(ds)):
        ds[i]
    return ds.get_stats()


def test_processes_on_a_host_download_each_shard_once(
    s3_endpoint, bucket, image_tree, tmp_path, flaky_proxy
):
    write_shards(
        datasets.ImageFolder(str(image_tree)), f"s3://{bucket}/p", maxcount=4,
        endpoint_url=s3_endpoint,
    )  # fmt: skip
    proxy = flaky_proxy(delay=0.05)  # slow downloads keep the other process waiting
    ds = ShardListDataset(
        f"s3://{bucket}/p/shards.json", endpoint_url=proxy.url, cache_dir=tmp_path
    )
    stats = run_together(_read_all, [ds, ds])  # both contend for each shard
    assert sum(s["downloads"] for s in stats) == 3  # the lock made the other one wait
    assert sum(s["cache_hits"] for s in stats) == 3
    assert proxy.requests == 1 + 3  # the shard list, then each shard once
    assert len(cached_shards(tmp_path)) == 3


def test_cache_size_evicts_least_recently_used(s3_endpoint, bucket, tmp_path):
    samples = [{"bin": bytes([i]) * 4000} for i in range(6)]
    shards = write_shards(samples, f"s3://{bucket}/e", maxcount=1, endpoint_url=s3_endpoint)
    size = shards[0]["filesize"]
    ds = ShardListDataset(
        shards, endpoint_url=s3_endpoint, cache_dir=tmp_path, cache_size=2 * size, open_shards=1
    )
    for _epoch in range(2):
        for i in range(6):
            assert ds[i][".bin"].getvalue() == bytes([i]) * 4000
        assert sum(p.stat().st_size for p in cached_shards(tmp_path)) <= 2 * size
    assert ds.get_stats()["downloads"] == 12  # nothing survived until the next epoch


def test_random_access_warns(tmp_path, caplog):
    write_shards([{"cls": i} for i in range(60)], tmp_path, maxcount=2)
    ds = ShardListDataset(tmp_path / "shards.json", open_shards=2)
    order = np.random.default_rng(0).permutation(60).tolist() * 5
    with caplog.at_level(logging.WARNING, logger="dask_ddp.data.shards"):
        assert [ds[i][".cls"] for i in order] == order
    assert caplog.text.count("Use sampler=DistributedChunkedSampler(dataset)") == 1


# -- DataLoader workers and pickling ----------------------------------------------------


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_dataloader_workers(s3_endpoint, bucket, image_tree, tmp_path, context, image_count):
    url = f"s3://{bucket}/w"
    reference = datasets.ImageFolder(str(image_tree), transform=transforms.ToTensor())
    write_shards(datasets.ImageFolder(str(image_tree)), url, maxcount=3, endpoint_url=s3_endpoint)
    ds = ShardListDataset(
        f"{url}/shards.json", keys=(IMAGE_FIELD, "cls"), transform=(transforms.ToTensor(), None),
        endpoint_url=s3_endpoint, cache_dir=tmp_path / "cache",
    )  # fmt: skip
    ds[0]  # the parent opens a shard and a client first: workers must not share them
    assert (ds.get_stats()["shard_opens"], ds.get_stats()["downloads"]) == (1, 1)
    seen = []
    for rank in range(2):  # rank 0 reads with 2 worker processes, rank 1 in-process
        sampler = DistributedChunkedSampler(ds, num_replicas=2, rank=rank, seed=5)
        workers = {"num_workers": 2, "multiprocessing_context": context} if rank == 0 else {}
        loader = DataLoader(ds, batch_size=None, sampler=sampler, **workers)
        seen += [(x.flatten().tolist(), int(t)) for x, t in loader]
    expected = sorted((x.flatten().tolist(), t) for x, t in reference)
    assert sorted(seen) == expected
    assert len(seen) == image_count
    assert ds[1][1] == reference[1][1]  # the parent still reads after the workers ran


class _WithStats(ShardListDataset):
    """Returns each sample with the reading process's counters."""

    def __getitem__(self, index: int):
        return super().__getitem__(index), {**self.get_stats(), "frozen": gc.get_freeze_count()}


@pytest.mark.slow
def test_workers_download_the_next_shard_ahead(s3_endpoint, bucket, tmp_path, flaky_proxy):
    samples = [{"cls": i} for i in range(60)]
    write_shards(samples, f"s3://{bucket}/ahead", maxcount=10, endpoint_url=s3_endpoint)
    proxy = flaky_proxy(delay=0.05)  # each download takes a while
    ds = _WithStats(
        f"s3://{bucket}/ahead/shards.json", keys=("cls",), endpoint_url=proxy.url,
        cache_dir=tmp_path,
    )  # fmt: skip
    sampler = DistributedChunkedSampler(ds, num_replicas=1, rank=0, seed=3)
    order = list(sampler)  # epoch 0, read to its end: the sampler moves on to epoch 1 ...
    sampler.set_epoch(0)  # ... so back to 0, for the DataLoader
    assert ds.shard_order == tuple(dict.fromkeys(i // 10 for i in order))  # the shard order
    loader = DataLoader(ds, batch_size=None, sampler=sampler, num_workers=1)
    items = list(loader)
    assert [int(cls) for (cls,), _ in items] == order
    stats = items[-1][1]  # the worker's counters after its last read
    assert stats["frozen"] > 100_000  # the worker hid torch's objects from the collector
    assert gc.get_freeze_count() == 0  # this process never freezes
    assert ds.wait_prefetched(30)
    # Each shard was downloaded once on the host: the first ones by this process as the
    # epoch started (see the next test), the rest by the worker, ...
    assert stats["downloads"] + ds.get_stats()["downloads"] == 6
    assert stats["cache_hits"] >= 1  # ... most of them before it opened them
    assert stats["shard_opens"] == 6
    assert len(cached_shards(tmp_path)) == 6


@pytest.mark.parametrize("prefetch", [1, 2, 0])
def test_iterating_the_sampler_starts_the_first_downloads(s3_endpoint, bucket, tmp_path, prefetch):
    # The rank's process fetches the epoch's first shard while its DataLoader workers
    # start (and the next ones, as far as prefetch= reaches), on its warm connection.
    write_shards([{"cls": i} for i in range(40)], f"s3://{bucket}/head", maxcount=10,
                 endpoint_url=s3_endpoint)  # fmt: skip
    ds = ShardListDataset(
        f"s3://{bucket}/head/shards.json", endpoint_url=s3_endpoint, cache_dir=tmp_path,
        prefetch=prefetch,
    )  # fmt: skip
    sampler = DistributedChunkedSampler(ds, num_replicas=1, rank=0, seed=1)
    assert cached_shards(tmp_path) == [] and not ds.prefetching
    first = next(iter(sampler))
    if prefetch == 0:
        assert not ds.prefetching and ds.get_stats()["downloads"] == 0
        return
    assert ds.wait_prefetched(30)
    stats = ds.get_stats()
    assert (stats["requested"], stats["downloads"]) == (0, 1 + prefetch)
    assert len(cached_shards(tmp_path)) == 1 + prefetch
    ds[first]
    assert ds.get_stats()["cache_hits"] == 1  # the first read found its shard on disk
    # Nothing outlives the downloads: a rank's process runs job after job.
    assert ds.wait_prefetched(30) and not ds.prefetching
    for thread in threading.enumerate():
        if thread.name == "dask-ddp-prefetch-shards":
            thread.join(30)  # it has returned from its work: only its exit is left
    gone = weakref.ref(ds)
    del ds, sampler
    gc.collect()
    assert gone() is None


def _read_two_epochs(url: str, endpoint: str, cache: str) -> list[list[int]]:
    ds = ShardListDataset(url, keys=("cls",), endpoint_url=endpoint,
                          storage_options=RANK_S3_OPTIONS, cache_dir=cache)  # fmt: skip
    sampler = DistributedChunkedSampler(ds, seed=2)  # rank and world from the process group
    loader = DataLoader(
        ds, batch_size=5, sampler=sampler, num_workers=2, multiprocessing_context="fork"
    )
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)  # this process starts downloading the epoch's first shard
        epochs.append([int(c) for (batch,) in loader for c in batch])
    return epochs


def test_ranks_read_shards_with_dataloader_workers(client, s3_endpoint, bucket, tmp_path):
    # The real set-up: two ranks on one host, each prefetching in its own (Dask worker)
    # process while its DataLoader forks workers, all sharing one cache directory.
    write_shards([{"cls": i} for i in range(60)], f"s3://{bucket}/ranks", maxcount=10,
                 endpoint_url=s3_endpoint)  # fmt: skip
    url = f"s3://{bucket}/ranks/shards.json"
    job = dask_ddp.launch(client, _read_two_epochs, args=(url, s3_endpoint, str(tmp_path)))
    per_rank = job.result(timeout=120)
    for epoch in range(2):
        seen = [c for rank in per_rank for c in rank[epoch]]
        assert sorted(seen) == list(range(60)) and len(per_rank[0][epoch]) == 30
    assert per_rank[0][0] != per_rank[0][1]  # a new order each epoch
    assert len(cached_shards(tmp_path)) == 6  # each shard downloaded once for the host


def test_pickle_drops_open_files(shard_dir):
    ds = ShardListDataset(shard_dir / "shards.json", keys=("cls",))
    assert ds[6] == (1,)
    copy = pickle.loads(pickle.dumps(ds))
    assert set(copy.get_stats().values()) == {0}  # a new process's counters
    assert copy[6] == (1,)
    assert copy.get_stats()["shard_opens"] == 1  # nothing open crossed: it opened its own
    assert ds[6] == (1,) and ds.get_stats()["shard_opens"] == 1  # the original's stays open


# -- the sampler ------------------------------------------------------------------------


def all_ranks(n: int, world: int, epoch: int = 0, **kwargs) -> list[list[int]]:
    out = []
    for rank in range(world):
        sampler = DistributedChunkedSampler(range(n), num_replicas=world, rank=rank, **kwargs)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
        assert len(out[-1]) == len(sampler)
    return out


@pytest.mark.parametrize("partition", ["fixed", "shuffled"])
@pytest.mark.parametrize(("n", "world"), [(100, 4), (103, 4), (10, 3), (5, 8), (1, 2)])
def test_sampler_covers_every_index_once(partition, n, world):
    for drop_last in (False, True):
        ranks = all_ranks(n, world, epoch=2, chunksize=7, partition=partition, drop_last=drop_last)
        counts = {len(r) for r in ranks}
        assert len(counts) == 1  # equal counts on every rank
        flat = [i for r in ranks for i in r]
        if drop_last:
            assert len(flat) == n // world * world
            assert len(set(flat)) == len(flat)  # at most left out, never repeated
        else:
            assert len(flat) == -(-n // world) * world
            assert set(flat) == set(range(n))  # every index, a few repeated to pad
        assert set(flat) <= set(range(n))


@pytest.mark.parametrize("partition", ["fixed", "shuffled"])
def test_sampler_order_per_epoch_and_seed(partition):
    epoch0 = all_ranks(1000, 2, epoch=0, partition=partition, chunksize=100)
    epoch1 = all_ranks(1000, 2, epoch=1, partition=partition, chunksize=100)
    assert epoch0 != epoch1
    assert epoch0 == all_ranks(1000, 2, epoch=0, partition=partition, chunksize=100)
    assert epoch0 != all_ranks(1000, 2, epoch=0, partition=partition, chunksize=100, seed=1)
    assert all_ranks(10, 2, shuffle=False, partition=partition) == [
        [0, 1, 2, 3, 4],
        [5, 6, 7, 8, 9],
    ]
    if partition == "fixed":  # each rank keeps its range: a host caches only its share
        assert [sorted(r) for r in epoch0] == [sorted(r) for r in epoch1]
    else:
        assert [sorted(r) for r in epoch0] != [sorted(r) for r in epoch1]


@pytest.mark.parametrize("partition", ["fixed", "shuffled"])
def test_sampler_reads_one_shard_after_another(tmp_path, partition):
    write_shards([{"cls": i} for i in range(100)], tmp_path, maxcount=10)
    ds = ShardListDataset(tmp_path / "shards.json")
    for rank in range(3):
        sampler = DistributedChunkedSampler(ds, num_replicas=3, rank=rank, partition=partition)
        shards = [i // 10 for i in sampler]
        runs = 1 + sum(a != b for a, b in itertools.pairwise(shards))
        assert runs <= len(set(shards)) + 1  # each shard in one run (padding may add one)
        assert shards != sorted(shards) or len(set(shards)) == 1  # chunk order shuffled


def test_sampler_defaults_from_process_group(tmp_path):
    alone = DistributedChunkedSampler(range(10))
    assert (alone.rank, alone.num_replicas) == (0, 1)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        sampler = DistributedChunkedSampler(range(10), rank=0)  # rank=0 is honoured
        assert (sampler.rank, sampler.num_replicas) == (0, 1)
        assert sorted(sampler) == list(range(10))
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match=r"rank= must be an int in \[0, 1\]"):
        DistributedChunkedSampler(range(10), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas= must be an int >= 1"):
        DistributedChunkedSampler(range(10), num_replicas=0, rank=0)
    with pytest.raises(ValueError, match="partition= must be"):
        DistributedChunkedSampler(range(10), partition="random")
    with pytest.raises(ValueError, match="chunksize= must be"):
        DistributedChunkedSampler(range(10), chunksize=0)

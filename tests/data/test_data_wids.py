"""wids compatibility: shards written by webdataset, read by real ``wids`` and by
``dask_ddp.data`` the wids notebook's way (only the import differs), sample by sample."""

from __future__ import annotations

import io
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import Client
from PIL import Image

import dask_ddp
import dask_ddp.data
from dask_ddp.data import (
    DistributedChunkedSampler,
    ShardListDataset,
    ShardListError,
    StorageAccessError,
    write_shards,
)

wids = pytest.importorskip("wids")
wds = pytest.importorskip("webdataset")

SHARDS, PER_SHARD = 4, 25


def _image(i: int, mode: str) -> Image.Image:
    rng = np.random.default_rng(i)
    size = (24 + i % 5, 20)
    if mode == "L":
        return Image.fromarray(rng.integers(0, 255, size[::-1], dtype=np.uint8), "L")
    return Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8), "RGB")


def _write_with_webdataset(folder: Path) -> list[Path]:
    """Shards written by webdataset's own ShardWriter: JPEG, grayscale PNG, label, JSON,
    text, and a gzipped text field."""
    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "shard-%06d.tar"), maxcount=PER_SHARD, verbose=0) as sink:
        for i in range(SHARDS * PER_SHARD):
            sample = {"__key__": f"s{i:05d}", "cls": i % 7, "json": {"i": i}, "txt": f"#{i}"}
            if i % 3:
                sample["jpg"] = _image(i, "RGB")
            else:
                sample["png"] = _image(i, "L")
            sample["txt.gz"] = f"zipped {i}"  # webdataset gzips it
            sink.write(sample)
    return sorted(folder.glob("shard-*.tar"))


@pytest.fixture(scope="module")
def wds_shards(tmp_path_factory) -> Path:
    """webdataset-written shards and a ``widsindex``-made index, ``shards.json``."""
    folder = tmp_path_factory.mktemp("wds")
    tars = _write_with_webdataset(folder)
    # On PATH, or next to this Python (a venv's bin/ that is not activated).
    widsindex = shutil.which("widsindex") or shutil.which(
        "widsindex", path=str(Path(sys.executable).parent)
    )
    if widsindex is None:
        pytest.skip("needs wids's widsindex command (pip install wids) on PATH")
    subprocess.run(
        [widsindex, "create", "--name", "train", "-o", "shards.json", *[t.name for t in tars]],
        cwd=folder, check=True, capture_output=True,
    )  # fmt: skip
    return folder / "shards.json"


def _pixels(value) -> np.ndarray:
    return np.asarray(value)


def _same(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        mine = ours[key]
        if isinstance(value, Image.Image):
            assert isinstance(mine, Image.Image) and mine.mode == value.mode, key
            np.testing.assert_array_equal(_pixels(mine), _pixels(value))
        elif isinstance(value, io.BytesIO):
            assert isinstance(mine, io.BytesIO) and mine.getvalue() == value.getvalue(), key
        elif isinstance(value, np.ndarray):
            np.testing.assert_array_equal(mine, value)
        elif key == "__shard__":
            assert Path(mine) == Path(value).resolve()
        else:
            assert mine == value, key


@pytest.mark.parametrize("transformations", [None, "numpy", []])
def test_every_sample_as_wids_gives_it(wds_shards, tmp_path, transformations):
    kwargs = {} if transformations is None else {"transformations": transformations}
    theirs = wids.ShardListDataset(str(wds_shards), cache_dir=str(tmp_path / "w"), keep=True,
                                   **kwargs)  # fmt: skip
    ours = dask_ddp.data.ShardListDataset(str(wds_shards), cache_dir=str(tmp_path / "d"),
                                          keep=True, **kwargs)  # fmt: skip
    assert len(ours) == len(theirs) == SHARDS * PER_SHARD
    for i in range(len(theirs)):
        _same(ours[i], theirs[i])
    sample = ours[4]
    if transformations is None:  # wids's default: PIL images as stored, text decoded
        assert isinstance(sample[".jpg"], Image.Image) and sample[".txt.gz"] == "zipped 4"
        assert ours[3][".png"].mode == "L"
    theirs.close()
    ours.close()


def make_sample(sample):
    from torchvision import transforms

    image = transforms.functional.to_tensor(sample[".jpg" if ".jpg" in sample else ".png"])
    return image, sample[".cls"]


def test_add_transform_as_wids(wds_shards, tmp_path):
    theirs = wids.ShardListDataset(str(wds_shards), cache_dir=str(tmp_path / "w"))
    ours = ShardListDataset(str(wds_shards), cache_dir=str(tmp_path / "d"))
    assert ours.add_transform(make_sample) is ours
    theirs.add_transform(make_sample)
    for i in (0, 1, 50, 99):
        (a, la), (b, lb) = ours[i], theirs[i]
        assert torch.equal(a, b) and la == lb
    ours.add_transform(lambda s: s[1])  # transforms run in the order they were added
    assert ours[10] == 3


@pytest.fixture
def one_process_group(tmp_path):
    """wids's sampler asks torch.distributed for the world; one local gloo process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_sampler_covers_the_same_indices_as_wids(wds_shards, one_process_group):
    ds = ShardListDataset(str(wds_shards))
    n, world = len(ds), 2
    for epoch in range(3):
        covered = []
        for rank in range(world):
            theirs = wids.DistributedChunkedSampler(
                ds, num_replicas=world, rank=rank, chunksize=10, shuffle=True
            )
            ours = DistributedChunkedSampler(
                ds, num_replicas=world, rank=rank, chunksize=10, shuffle=True
            )
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            mine, their = list(ours), list(theirs)
            assert len(mine) == len(ours) == len(their) == n // world
            assert sorted(mine) == sorted(their)  # the same share: each host's shards
            assert len(set(mine)) == len(mine)
            covered += mine
        assert sorted(covered) == list(range(n))  # every index once per epoch


def test_sampler_wids_arguments():
    n = 100
    first = DistributedChunkedSampler(range(n), num_replicas=1, rank=0, chunksize=10,
                                      shufflefirst=False, drop_last=None)  # fmt: skip
    order = list(first)
    # shufflefirst=False: epoch 0 visits the chunks in order, shuffled within each
    assert [sorted(order[k : k + 10]) for k in range(0, n, 10)] == [
        list(range(k, k + 10)) for k in range(0, n, 10)
    ]
    assert order != list(range(n))
    # read to its end: the next epoch, chunks shuffled too (as wids)
    assert first.epoch == 1
    again = list(first)
    assert again != order and sorted(again) == list(range(n))
    first.set_epoch(0)
    assert list(first) == order  # set_epoch still decides
    unread = iter(first)  # the DataLoader makes an iterator it never reads: no new epoch
    del unread
    assert first.epoch == 1 and next(iter(first)) == again[0]
    some = DistributedChunkedSampler(range(n), num_replicas=2, rank=1, num_samples=40)
    assert sorted(some) == list(range(20, 40))
    with pytest.raises(ValueError, match="num_samples= must be an int >= 1"):
        DistributedChunkedSampler(range(n), num_replicas=1, rank=0, num_samples=0)


# -- the shard list, as wids reads it ----------------------------------------------------


def test_shard_list_forms(wds_shards, tmp_path):
    desc = json.loads(wds_shards.read_text())
    assert desc["__kind__"] == "wids-shard-index-v1" and "md5sum" in desc["shardlist"][0]
    folder = str(wds_shards.parent)
    relative = desc["shardlist"]
    absolute = [{**e, "url": f"{folder}/{e['url']}"} for e in relative]
    forms = {
        "path": ShardListDataset(wds_shards),
        "url": ShardListDataset(f"file://{wds_shards}"),
        "dict + base": ShardListDataset(desc, base=folder),
        "list + base": ShardListDataset(relative, base=folder + "/"),
        "list": ShardListDataset(absolute),
        "options": ShardListDataset(wds_shards, options={"shardlist": absolute[:2]}),
    }
    for name, ds in forms.items():
        expected = 2 * PER_SHARD if name == "options" else SHARDS * PER_SHARD
        assert len(ds) == expected, name
        assert ds[PER_SHARD + 1]["__key__"] == f"s{PER_SHARD + 1:05d}", name
        assert ds[PER_SHARD + 1]["__shardindex__"] == 1
    moved = tmp_path / "lists"
    moved.mkdir()
    (moved / "train.json").write_text(json.dumps(desc))
    with pytest.raises(FileNotFoundError, match=r"lists/shard-000000\.tar"):
        ShardListDataset(moved / "train.json")[0]  # relative to the JSON's folder: not there
    assert ShardListDataset(moved / "train.json", base=folder)[0]["__key__"] == "s00000"
    with pytest.raises(ShardListError, match="entry 0"):
        ShardListDataset([{"url": "x.tar"}])


def test_json_url_on_s3(wds_shards, s3_client, bucket, s3_endpoint, tmp_path):
    for path in wds_shards.parent.iterdir():
        s3_client.upload_file(str(path), bucket, f"train/{path.name}")
    ours = ShardListDataset(f"s3://{bucket}/train/shards.json", endpoint_url=s3_endpoint,
                            cache_dir=tmp_path)  # fmt: skip
    theirs = wids.ShardListDataset(str(wds_shards), cache_dir=str(tmp_path / "w"))
    for i in (0, 26, 99):
        sample = ours[i]
        assert sample["__shard__"].startswith(f"s3://{bucket}/train/shard-")
        _same({**sample, "__shard__": theirs[i]["__shard__"]}, theirs[i])


# -- the two ways to decode --------------------------------------------------------------


def test_keys_mode_and_wids_mode_do_not_mix(tmp_path):
    write_shards([{"jpg": _image(1, "RGB"), "cls": 1}], tmp_path)
    url = tmp_path / "shards.json"
    image, label, key = ShardListDataset(url, keys=(".jpg;png", "cls", "__key__"))[0]
    assert image.mode == "RGB" and label == 1 and key == "000000000"  # dots optional
    raw = ShardListDataset(url, decode=False)[0]
    assert raw[".cls"] == b"1" and raw["__index__"] == 0  # our decode=: bytes, wids's keys
    undecoded = ShardListDataset(url, transformations=[])[0]
    assert undecoded[".cls"].getvalue() == b"1"  # wids's: io.BytesIO
    with pytest.raises(TypeError, match="two ways to decode"):
        ShardListDataset(url, keys=("cls",), transformations="PIL")
    with pytest.raises(TypeError, match="transformations= takes"):
        ShardListDataset(url, transformations=[3])
    with pytest.raises(ValueError, match="'PIL' or 'numpy'"):
        ShardListDataset(url, transformations="tensor")
    with pytest.raises(ValueError, match="lru_size= must be an int >= 1"):
        ShardListDataset(url, lru_size=0)
    ds = ShardListDataset(url, lru_size=3, dataset_name="x", localname=lambda u: u, keep=False)
    ds = pickle.loads(pickle.dumps(ds))  # for spawn-started workers: the lambda is not kept
    assert ds.open_shards == 3 and ds.dataset_name == "x"
    assert ds.add_transform(make_sample)[0][1] == 1
    ds.close()  # closes the open shard; the dataset reopens it on the next read
    assert ds[0][1] == 1


def test_bad_sample_names_shard_and_sample(tmp_path):
    write_shards([{"jpg": b"not a jpeg", "cls": 1}, {"png": _image(1, "L"), "cls": 2}], tmp_path)
    ds = ShardListDataset(tmp_path / "shards.json")
    with pytest.raises(dask_ddp.data.CorruptDataError, match=r"shard-000000.tar#000000000.jpg"):
        ds[0]
    ds.add_transform(make_sample).add_transform(lambda s: s[0])
    assert ds[1].shape == (1, 20, 25)
    lookup = ShardListDataset(tmp_path / "shards.json").add_transform(lambda s: s[".jpg"])
    with pytest.raises(
        dask_ddp.data.MissingFieldError,
        match=r"'000000001' in .*shard-000000.tar has no '.jpg' field \(it has: .png, .cls\)",
    ):
        lookup[1]


# -- S3 that cannot be used at all ------------------------------------------------------


@pytest.mark.slow
def test_refused_endpoint_fails_fast_naming_it(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    start = time.monotonic()
    with pytest.raises(StorageAccessError, match=r"cannot reach the store at http://127.0.0.1:1"):
        ShardListDataset(
            "s3://b/shards.json", endpoint_url="http://127.0.0.1:1", cache_dir=tmp_path
        )
    with pytest.raises(StorageAccessError, match="connection refused"):
        dask_ddp.data.S3ImageFolder("b", "train", endpoint_url="http://127.0.0.1:1")
    listed = ShardListDataset([{"url": "s3://b/shard-0.tar", "nsamples": 1}], prefetch=0,
                              endpoint_url="http://127.0.0.1:1", cache_dir=tmp_path)  # fmt: skip
    with pytest.raises(StorageAccessError, match=r"read s3://b/shard-0\.tar: connection refused"):
        listed[0]  # the download of a shard
    assert time.monotonic() - start < 20  # botocore alone retries for about a minute


def test_no_credentials_says_how_to_give_them(tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StorageAccessError) as caught:
        dask_ddp.data.FileDataset("s3://b/train", endpoint_url="http://127.0.0.1:1")
    message = str(caught.value)
    assert "s3://b/train" in message and "anon=True" in message
    assert "AWS_ACCESS_KEY_ID" in message and "storage_options" in message
    assert caught.value.problem == "credentials" and isinstance(caught.value, OSError)


# -- the wids notebook's program, through launch() ---------------------------------------


def _train_like_the_notebook(url: str, endpoint: str, cache: str) -> int:
    """What the notebook's ``train_in_ray`` does for Ray: configure, then ``train()``."""
    import os

    import wids_notebook as notebook
    from torchvision.models import resnet18

    from dask_ddp import get_context

    # The store's address and credentials, as a worker gets them from its environment.
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL_S3=endpoint)  # fmt: skip
    notebook.TRAIN_URL, notebook.CACHE_DIR = url, cache
    # ResNet-18 for the notebook's ResNet-50 (a fifth of the CPU; the same calls), one step of
    # 32 images a rank: the program runs as the notebook wrote it, around a smaller model.
    notebook.resnet50 = resnet18
    ctx = get_context()
    config = notebook.Config(rank=ctx.rank, world_size=ctx.world_size, backend="gloo",
                             epochs=1, maxsteps=16)  # fmt: skip
    notebook.train(config)
    return int(dist.get_world_size())


@pytest.mark.slow
def test_wids_notebook_trains_through_launch(own_cluster, s3_client, s3_endpoint, bucket, tmp_path):
    # Its own cluster: the model's freed memory would stay in the shared workers' heaps.
    images = [{"__key__": f"{i:06d}", "jpg": _image(i, "RGB"), "cls": i % 10} for i in range(128)]
    local = tmp_path / "shards"
    write_shards(images, local, maxcount=32)
    for path in local.iterdir():
        s3_client.upload_file(str(path), bucket, f"fake-imagenet/{path.name}")
    url = f"s3://{bucket}/fake-imagenet/shards.json"
    with Client(own_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        job = dask_ddp.launch(client, _train_like_the_notebook,
                              args=(url, s3_endpoint, str(tmp_path / "_cache")))  # fmt: skip
        assert job.result(timeout=240) == [2, 2]
    done = [line for line in job.output if "finished training (maxsteps)" in line.text]
    assert sorted(line.rank for line in done) == [0, 1]  # each rank: 1 step of 32 images
    assert all(line.text.endswith("32 16") for line in done)

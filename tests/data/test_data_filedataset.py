"""FileDataset: any fsspec URL, a user decode function, and its argument checks."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

from dask_ddp.data import (
    CorruptDataError,
    DataNotFoundError,
    FileDataset,
)
from dask_ddp.data._fsclient import filesystem_options


def load_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data))


@pytest.fixture
def arrays(tmp_path: Path) -> Path:
    root = tmp_path / "arrays"
    for i in range(6):
        (root / f"part{i % 2}").mkdir(parents=True, exist_ok=True)
        np.save(root / f"part{i % 2}" / f"{i}.npy", np.full((2, 3), i, dtype=np.float32))
    (root / "index.json").write_text("{}")
    return root


def test_local_directory_with_decode(arrays: Path):
    ds = FileDataset(arrays, decode=load_npy, suffixes=(".NPY",), transform=lambda a: a * 2)
    assert len(ds) == 6
    assert ds.urls == sorted(str(p) for p in arrays.rglob("*.npy"))
    assert ds.urls[0] == str(arrays / "part0" / "0.npy")  # local paths stay plain paths
    batch = next(iter(DataLoader(ds, batch_size=6)))
    assert batch.shape == (6, 2, 3)
    assert sorted(batch[:, 0, 0].tolist()) == [0, 2, 4, 6, 8, 10]
    with pytest.raises(ValueError, match="endpoint_url= and anon= apply to s3:// URLs"):
        FileDataset(arrays, endpoint_url="http://127.0.0.1:1")


def test_explicit_list_of_urls(arrays: Path):
    urls = [str(arrays / "part1" / "3.npy"), str(arrays / "part0" / "0.npy")]
    ds = FileDataset(urls, decode=load_npy)
    assert ds.urls == urls  # as given, not listed or sorted
    assert ds[0][0, 0] == 3
    assert ds.root == str(arrays) + "/"
    copy = pickle.loads(pickle.dumps(ds))
    assert copy[1][0, 0] == 0


def test_s3_prefix_with_suffixes_and_storage_options(s3_endpoint, s3_client, bucket):
    for i in range(4):
        buf = io.BytesIO()
        np.save(buf, np.arange(i + 1))
        s3_client.put_object(Bucket=bucket, Key=f"set/{i}.npy", Body=buf.getvalue())
    s3_client.put_object(Bucket=bucket, Key="set/README", Body=b"four arrays")
    s3_client.put_object(Bucket=bucket, Key="set/empty-folder/", Body=b"")  # a folder marker
    ds = FileDataset(
        f"s3://{bucket}/set/",
        decode=load_npy,
        suffixes=[".npy"],
        storage_options={"key": "testing", "secret": "testing", "endpoint_url": s3_endpoint},
    )
    assert [len(a) for a in ds.__getitems__([0, 1, 2, 3])] == [1, 2, 3, 4]
    raw = FileDataset(f"s3://{bucket}/set", endpoint_url=s3_endpoint)
    assert raw.urls[-1] == f"s3://{bucket}/set/README"  # no folder marker among samples
    assert raw[-1] == b"four arrays"


def test_no_matching_files(arrays: Path):
    with pytest.raises(DataNotFoundError, match=r"7 files are under it but none is accepted"):
        FileDataset(arrays, suffixes=(".parquet",))


def test_missing_local_path(tmp_path: Path):
    with pytest.raises(DataNotFoundError, match="nothing is under it"):
        FileDataset(tmp_path / "nope")


def test_decode_error_is_corrupt_sample(arrays: Path):
    ds = FileDataset(arrays, decode=load_npy)  # index.json is not an array
    json = ds.urls.index(str(arrays / "index.json"))
    with pytest.raises(CorruptDataError, match=f"cannot decode {arrays}/index.json"):
        ds[json]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"concurrency": 0}, ValueError, "concurrency= must be an int >= 1"),
        ({"retries": -1}, ValueError, "retries= must be an int >= 0"),
        ({"on_corrupt": "ignore"}, ValueError, "on_corrupt= must be 'raise' or 'skip'"),
        ({"decode": "utf-8"}, TypeError, "decode= takes a function"),
    ],
)
def test_bad_arguments(arrays: Path, kwargs, error, match):
    with pytest.raises(error, match=match):
        FileDataset(arrays, **kwargs)


def test_bad_urls(arrays: Path):
    with pytest.raises(ValueError, match="chained URLs"):
        FileDataset(f"simplecache::{arrays}")
    with pytest.raises(ValueError, match="one filesystem"):
        FileDataset([str(arrays / "a"), "s3://bucket/b"])
    with pytest.raises(ValueError, match="empty list"):
        FileDataset([])


@pytest.mark.parametrize(
    ("endpoint", "user", "verify"),
    [
        ("http://10.0.0.5:9000", {}, False),  # plain HTTP: no CA bundle to load
        ("https://s3.example.com", {}, None),  # TLS: botocore's default, verified
        (None, {}, None),  # AWS
        (None, {"endpoint_url": "http://minio:9000"}, False),
        ("http://10.0.0.5:9000", {"client_kwargs": {"verify": "/ca.pem", "x": 1}}, "/ca.pem"),
    ],
)
def test_tls_verification_is_skipped_only_without_tls(endpoint, user, verify):
    options = filesystem_options("s3", endpoint, None, user, 10, 8)
    assert options.get("client_kwargs", {}).get("verify") == verify
    if "client_kwargs" in user:
        assert options["client_kwargs"] == user["client_kwargs"]  # the user's, untouched

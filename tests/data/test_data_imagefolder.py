"""S3ImageFolder against torchvision's ImageFolder over the same files on local disk."""

from __future__ import annotations

import pickle

import pytest
import torch
from torchvision import datasets, transforms

from dask_ddp.data import (
    IMG_EXTENSIONS,
    CorruptDataError,
    DataNotFoundError,
    S3ImageFolder,
    SampleFetchError,
)


def relative(samples: list[tuple[str, int]], root: str) -> list[tuple[str, int]]:
    return [(path.removeprefix(root).lstrip("/"), target) for path, target in samples]


def test_same_samples_and_tensors_as_imagefolder(s3_endpoint, s3_images, image_count):
    bucket, prefix, local = s3_images
    to_tensor = transforms.ToTensor()
    ours = S3ImageFolder(
        bucket,
        prefix,
        transform=to_tensor,
        target_transform=lambda t: t * 10,
        endpoint_url=s3_endpoint,
    )
    theirs = datasets.ImageFolder(
        str(local), transform=to_tensor, target_transform=lambda t: t * 10
    )

    assert ours.classes == theirs.classes == ["cat", "dog", "zebra"]
    assert ours.class_to_idx == theirs.class_to_idx
    assert relative(ours.samples, f"s3://{bucket}/{prefix}") == relative(theirs.samples, str(local))
    assert ours.imgs == ours.samples
    with pytest.raises(AttributeError):
        ours.samples = ours.samples[:3]  # read-only: select with torch.utils.data.Subset
    assert ours.targets == theirs.targets
    assert len(ours) == len(theirs) == image_count
    assert ours.extensions == IMG_EXTENSIONS == datasets.folder.IMG_EXTENSIONS

    for i in range(len(theirs)):  # one at a time: __getitem__
        (a, ta), (b, tb) = ours[i], theirs[i]
        assert ta == tb
        assert torch.equal(a, b), ours.samples[i]
    batch = ours.__getitems__(list(range(len(ours))))  # all at once, as a DataLoader asks
    for (a, ta), i in zip(batch, range(len(theirs)), strict=True):
        b, tb = theirs[i]
        assert ta == tb
        assert torch.equal(a, b)


def test_pil_images_without_transform(s3_endpoint, s3_images):
    bucket, prefix, local = s3_images
    ours = S3ImageFolder(bucket, prefix, endpoint_url=s3_endpoint)
    theirs = datasets.ImageFolder(str(local))
    img, target = ours[-1]
    ref, ref_target = theirs[len(theirs) - 1]
    assert (img.mode, img.size, target) == (ref.mode, ref.size, ref_target)
    assert img.tobytes() == ref.tobytes()


def test_predecessor_keywords_and_attributes(s3_endpoint, s3_images):
    bucket, prefix, _ = s3_images
    old = S3ImageFolder(s3_bucket=bucket, s3_prefix=prefix, endpoint_url=s3_endpoint)
    positional = S3ImageFolder(bucket, prefix + "/", None, None, False, endpoint_url=s3_endpoint)
    assert old.samples == positional.samples
    assert (old.s3_bucket, old.s3_prefix, old.anon) == (bucket, prefix, False)
    assert old.all_files == [f"{prefix}/{url.split(prefix + '/', 1)[1]}" for url, _ in old.samples]
    with pytest.raises(TypeError, match="not both"):
        S3ImageFolder(bucket, s3_bucket=bucket)
    with pytest.raises(TypeError, match="needs bucket="):
        S3ImageFolder(prefix=prefix)
    with pytest.raises(ValueError, match="put the folder in prefix="):
        S3ImageFolder(f"{bucket}/{prefix}", endpoint_url=s3_endpoint)


def test_endpoint_from_environment_like_boto3(s3_endpoint, s3_images, monkeypatch, image_count):
    # dask-pytorch-ddp users reach other stores through AWS_ENDPOINT_URL; that keeps working.
    bucket, prefix, _ = s3_images
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    ds = S3ImageFolder(s3_bucket=bucket, s3_prefix=prefix)
    assert len(ds) == image_count
    assert ds[0][1] == 0


def test_whole_bucket_as_root(upload_tree, s3_endpoint, bucket, image_tree, image_count):
    upload_tree(bucket, "", image_tree)
    ds = S3ImageFolder(bucket, endpoint_url=s3_endpoint)
    assert ds.classes == ["cat", "dog", "zebra"]
    assert len(ds) == image_count


def test_missing_bucket(s3_endpoint):
    with pytest.raises(DataNotFoundError, match="bucket 'no-such-bucket' does not exist"):
        S3ImageFolder("no-such-bucket", "train", endpoint_url=s3_endpoint)


def test_empty_prefix_names_what_is_there(s3_endpoint, s3_images):
    bucket, _, _ = s3_images
    with pytest.raises(DataNotFoundError, match=r"data/tran: nothing is under it.*holds train"):
        S3ImageFolder(bucket, "data/tran", endpoint_url=s3_endpoint)


def test_prefix_without_images(s3_client, s3_endpoint, bucket):
    for key in ("docs/a/readme.txt", "docs/b/notes.csv"):
        s3_client.put_object(Bucket=bucket, Key=key, Body=b"text")
    no_image = r"2 objects are under it but no image \(looked for"
    with pytest.raises(DataNotFoundError, match=no_image):
        S3ImageFolder(bucket, "docs", endpoint_url=s3_endpoint)
    assert issubclass(DataNotFoundError, FileNotFoundError)


def test_objects_but_no_class_folders(s3_client, s3_endpoint, bucket):
    s3_client.put_object(Bucket=bucket, Key="flat/0.jpg", Body=b"x")
    with pytest.raises(DataNotFoundError, match="no class folder"):
        S3ImageFolder(bucket, "flat", endpoint_url=s3_endpoint)


def test_class_folder_without_images(upload_tree, write_image, s3_endpoint, bucket, tmp_path):
    write_image(tmp_path / "cat" / "0.jpg", 0)
    (tmp_path / "dog").mkdir()
    (tmp_path / "dog" / "notes.txt").write_text("no images here")
    upload_tree(bucket, "p", tmp_path)
    with pytest.raises(DataNotFoundError, match="class folders dog hold no image"):
        S3ImageFolder(bucket, "p", endpoint_url=s3_endpoint)
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes dog"):
        datasets.ImageFolder(str(tmp_path))  # the same rule as ImageFolder
    ds = S3ImageFolder(bucket, "p", endpoint_url=s3_endpoint, allow_empty=True)
    assert ds.classes == ["cat", "dog"]
    assert ds.targets == [0]


def test_is_valid_file(s3_endpoint, s3_images):
    bucket, prefix, local = s3_images
    ours = S3ImageFolder(bucket, prefix, endpoint_url=s3_endpoint, is_valid_file=_is_png)
    theirs = datasets.ImageFolder(str(local), is_valid_file=_is_png)
    assert relative(ours.samples, f"s3://{bucket}/{prefix}") == relative(theirs.samples, str(local))
    assert ours.extensions is None


def _is_png(path: str) -> bool:
    return path.endswith(".png")


@pytest.fixture
def with_corrupt(s3_client, s3_images) -> tuple[str, str, str]:
    bucket, prefix, _ = s3_images
    key = f"{prefix}/dog/9.jpg"  # index 6 in ImageFolder order
    s3_client.put_object(Bucket=bucket, Key=key, Body=b"\xff\xd8 this is not a JPEG")
    return bucket, prefix, f"s3://{bucket}/{key}"


def test_corrupt_image_names_its_key(s3_endpoint, with_corrupt):
    bucket, prefix, url = with_corrupt
    ds = S3ImageFolder(bucket, prefix, endpoint_url=s3_endpoint)
    bad = [u for u, _ in ds.samples].index(url)
    with pytest.raises(CorruptDataError, match=f"cannot decode {url}: UnidentifiedImageError"):
        ds[bad]
    with pytest.raises(CorruptDataError, match=url):
        ds.__getitems__(list(range(len(ds))))
    assert ds[bad - 1][1] == ds.targets[bad - 1]  # the others still read


def test_corrupt_image_skipped_on_request(s3_endpoint, with_corrupt, caplog):
    bucket, prefix, url = with_corrupt
    ds = S3ImageFolder(
        bucket,
        prefix,
        endpoint_url=s3_endpoint,
        on_corrupt="skip",
        transform=transforms.ToTensor(),
    )
    bad = [u for u, _ in ds.samples].index(url)
    with caplog.at_level("WARNING", logger="dask_ddp.data.s3"):
        batch = ds.__getitems__(list(range(len(ds))))
        again = ds[bad]
    assert len(batch) == len(ds)  # batch sizes stay the same on every rank
    assert torch.equal(batch[bad][0], batch[bad + 1][0])  # replaced by the next sample
    assert batch[bad][1] == ds.targets[bad + 1]
    assert torch.equal(again[0], batch[bad + 1][0])
    stats = ds.get_stats()
    assert (stats["corrupt"], stats["skipped"]) == (1, 2)
    warnings = [r.getMessage() for r in caplog.records if url in r.getMessage()]
    assert len(warnings) == 1  # once per corrupt file and process, not per read
    assert warnings[0].startswith(f"skipping corrupt sample {url} (1 corrupt so far in process")


def test_errors_pickle():
    errors = [
        DataNotFoundError("s3://b/p", "nothing is under it"),
        DataNotFoundError("s3://b/p", "no image"),
        CorruptDataError("s3://b/p/c/1.jpg", "OSError: truncated"),
        SampleFetchError("s3://b/p/c/1.jpg", "ClientError: SlowDown"),
    ]
    for err in errors:
        copy = pickle.loads(pickle.dumps(err))
        assert type(copy) is type(err)
        assert str(copy) == str(err)
        assert copy.url == err.url


def test_index_errors(s3_endpoint, s3_images, image_count):
    bucket, prefix, _ = s3_images
    ds = S3ImageFolder(bucket, prefix, endpoint_url=s3_endpoint)
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]
    assert ds[-len(ds)][1] == ds.targets[0]
    assert repr(ds) == f"S3ImageFolder('s3://{bucket}/{prefix}', {image_count} samples)"

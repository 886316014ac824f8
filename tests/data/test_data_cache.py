"""The host-local cache: filled once, reused by other processes, atomic, and locked."""

from __future__ import annotations

import fcntl
import multiprocessing
import multiprocessing.synchronize
import os
import threading
from pathlib import Path

import pytest
import torch
from _together import run_together
from torchvision import transforms

from dask_ddp.data import FileDataset, LocalCache, S3ImageFolder


def cached_files(cache_dir: Path) -> list[Path]:
    """The cached samples: not the locks, nor the datasets' progress counters (.filled-*)."""
    return sorted(
        p
        for p in cache_dir.rglob("*")
        if p.is_file() and p.suffix != ".lock" and not p.name.startswith(".filled-")
    )


def test_cache_filled_once_and_reused(s3_endpoint, s3_client, s3_images, tmp_path):
    bucket, prefix, _ = s3_images
    cache_dir = tmp_path / "cache"
    kwargs = {
        "endpoint_url": s3_endpoint,
        "cache_dir": cache_dir,
        "transform": transforms.ToTensor(),
    }
    first = S3ImageFolder(bucket, prefix, **kwargs)
    n = len(first)
    epoch1 = first.__getitems__(list(range(n)))
    assert first.get_stats() | {"fetched_bytes": 0} == {
        "requested": n, "cache_hits": 0, "fetched": n, "fetched_bytes": 0, "corrupt": 0,
        "skipped": 0,
    }  # fmt: skip
    assert len(cached_files(cache_dir)) == n
    assert not [p for p in cache_dir.rglob("*.part")]

    # Another rank on this host (a new dataset object) reads the cache, not the store.
    second = S3ImageFolder(bucket, prefix, **kwargs)
    for key in first.all_files:
        s3_client.delete_object(Bucket=bucket, Key=key)
    epoch2 = second.__getitems__(list(range(n)))
    assert second.get_stats()["cache_hits"] == n
    assert second.get_stats()["fetched"] == 0
    for (a, ta), (b, tb) in zip(epoch1, epoch2, strict=True):
        assert ta == tb
        assert torch.equal(a, b)

    # A fresh dataset without the cache shows the objects really are gone.
    with pytest.raises(FileNotFoundError):
        S3ImageFolder(bucket, prefix, endpoint_url=s3_endpoint)


def test_truncated_cache_file_is_fetched_again(s3_endpoint, s3_images, tmp_path):
    bucket, prefix, _ = s3_images
    ds = S3ImageFolder(bucket, prefix, endpoint_url=s3_endpoint, cache_dir=tmp_path)
    good = ds[4]
    ds._store.cache.path(ds._cache_key(4)).write_bytes(b"\xff\xd8 half a JPEG")
    again = ds[4]
    assert again[0].tobytes() == good[0].tobytes()
    assert ds.get_stats()["fetched"] == 2


def _read_all(ds: FileDataset) -> dict[str, int]:
    for start in range(0, len(ds), 5):
        ds.__getitems__(list(range(start, min(start + 5, len(ds)))))
    return ds.get_stats()


def test_processes_on_a_host_fetch_each_object_once(s3_images, tmp_path, flaky_proxy, image_count):
    bucket, prefix, _ = s3_images
    proxy = flaky_proxy(delay=0.05)  # slow fetches keep the other processes waiting
    cache_dir = tmp_path / "cache"
    ds = FileDataset(f"s3://{bucket}/{prefix}", endpoint_url=proxy.url, cache_dir=cache_dir)
    stats = run_together(_read_all, [ds] * 4)  # all four contend for each batch
    assert sum(s["fetched"] for s in stats) == len(ds)  # the locks made the others wait
    assert sum(s["cache_hits"] for s in stats) == 3 * len(ds)
    assert len(cached_files(cache_dir)) == len(ds) == image_count + 3  # the .txt/.md/.csv files too


def test_local_cache_is_atomic(tmp_path):
    cache = LocalCache(tmp_path)

    def failing_fetch(positions: list[int]) -> list[bytes | BaseException]:
        return [b"ok" if p == 0 else OSError("connection reset") for p in positions]

    out, hits = cache.get_many(["a", "b"], [2, 2], failing_fetch)
    assert hits == 0
    assert out[0] == b"ok"
    assert isinstance(out[1], OSError)
    assert cache.read("a") == b"ok"
    assert cache.read("b") is None  # errors are not cached
    assert cache.read("a", size=3) is None  # a size mismatch counts as missing
    assert not list(tmp_path.rglob("*.part"))


def _lock_is_free_in_child(cache: LocalCache, released: multiprocessing.synchronize.Event) -> None:
    assert released.wait(30)  # the parent's thread has finished its download
    fd = os.open(cache.path("k").with_suffix(".lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: still held
    finally:
        os.close(fd)


def test_a_lock_held_while_the_process_forks_is_released_for_the_child(tmp_path):
    # A prefetch thread can hold an entry's lock when the DataLoader forks its workers.
    # The child inherits a copy of the lock's descriptor; when the thread is done, the
    # lock must be free, or the child (or any other process) waits for it forever.
    cache = LocalCache(tmp_path)
    downloading, finish = threading.Event(), threading.Event()

    def download(path: Path) -> None:
        downloading.set()
        assert finish.wait(30)
        path.write_bytes(b"data")

    thread = threading.Thread(target=lambda: cache.open_file("k", download)[0].close())
    thread.start()
    assert downloading.wait(30)
    ctx = multiprocessing.get_context("fork")
    released = ctx.Event()
    child = ctx.Process(target=_lock_is_free_in_child, args=(cache, released))
    child.start()  # while the thread holds the lock
    finish.set()
    thread.join(30)
    released.set()
    child.join(30)
    assert child.exitcode == 0

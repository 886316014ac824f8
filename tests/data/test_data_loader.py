"""The datasets inside DataLoaders: worker processes (fork and spawn), DistributedSampler,
pickling, more than one page of keys, and concurrent batch fetches."""

from __future__ import annotations

import gc
import multiprocessing
import pickle
import sys

import fsspec.asyn
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms

from dask_ddp.data import FileDataset, S3ImageFolder


def collect(loader: DataLoader) -> list[tuple[torch.Tensor, int]]:
    return [(x, int(t)) for images, targets in loader for x, t in zip(images, targets, strict=True)]


@pytest.mark.parametrize(
    "context",
    ["fork", pytest.param("spawn", marks=pytest.mark.slow)],  # spawn: 4-20 s
)
def test_dataloader_workers_with_distributed_sampler(s3_endpoint, s3_images, context, image_count):
    bucket, prefix, local = s3_images
    to_tensor = transforms.ToTensor()
    ds = S3ImageFolder(bucket, prefix, transform=to_tensor, endpoint_url=s3_endpoint)
    ds[0]  # the parent creates its client first: forked workers must not share it
    assert ds._store.fs is not None

    seen = []
    for rank in range(2):  # rank 0 reads with 2 worker processes, rank 1 in-process
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        workers = {"num_workers": 2, "multiprocessing_context": context} if rank == 0 else {}
        loader = DataLoader(ds, batch_size=4, sampler=sampler, **workers)
        seen += collect(loader)

    reference = datasets.ImageFolder(str(local), transform=to_tensor)
    expected = sorted((x.flatten().tolist(), t) for x, t in reference)
    assert sorted((x.flatten().tolist(), t) for x, t in seen) == expected
    assert len(seen) == image_count  # 12 samples split evenly, no padding needed


def test_pickle_drops_the_client(s3_endpoint, s3_images):
    bucket, prefix, _ = s3_images
    ds = S3ImageFolder(bucket, prefix, endpoint_url=s3_endpoint, transform=transforms.ToTensor())
    first = ds[3]
    copy = pickle.loads(pickle.dumps(ds))
    assert ds._store.fs is not None
    assert copy._store.fs is None
    assert copy.get_stats()["requested"] == 0
    again = copy[3]
    assert torch.equal(first[0], again[0])
    assert first[1] == again[1]
    assert copy._store.fs is not ds._store.fs


def _read_in_child(ds: FileDataset, queue: multiprocessing.Queue) -> None:
    queue.put((ds[0], ds._store.fs is not None))


def test_forked_process_gets_its_own_client(s3_endpoint, s3_client, bucket):
    s3_client.put_object(Bucket=bucket, Key="blobs/a.bin", Body=b"alpha")
    ds = FileDataset(f"s3://{bucket}/blobs", endpoint_url=s3_endpoint)
    parent_fs = ds._filesystem()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(ds, queue))
    child.start()
    data, had_fs = queue.get(timeout=60)
    child.join(timeout=60)
    assert (data, had_fs, child.exitcode) == (b"alpha", True, 0)
    assert ds._filesystem() is parent_fs  # the parent's client is untouched
    assert ds[0] == b"alpha"


def _loader_in_child(ds: FileDataset, queue: multiprocessing.Queue) -> None:
    ds[0]
    queue.put(id(ds._filesystem().session.get_component("data_loader")))


def test_clients_share_botocores_parsed_models_through_fork(s3_endpoint, s3_client, bucket):
    # A new botocore session parses the S3 model again (about 60 ms of CPU); every
    # DataLoader worker pays it on its first read unless it inherits the parent's.
    s3_client.put_object(Bucket=bucket, Key="m/a.bin", Body=b"alpha")
    ds = FileDataset(f"s3://{bucket}/m", endpoint_url=s3_endpoint)
    other = FileDataset(f"s3://{bucket}/m", endpoint_url=s3_endpoint)
    loader = ds._filesystem().session.get_component("data_loader")
    assert ds._filesystem().session is not other._filesystem().session
    assert other._filesystem().session.get_component("data_loader") is loader
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_loader_in_child, args=(ds, queue))
    child.start()
    assert queue.get(timeout=60) == id(loader)  # the child's new client, the same loader
    child.join(timeout=60)
    assert child.exitcode == 0


def test_a_session_in_storage_options_is_used_as_given(s3_endpoint, s3_client, bucket):
    import aiobotocore.session

    s3_client.put_object(Bucket=bucket, Key="m/a.bin", Body=b"alpha")
    session = aiobotocore.session.AioSession()
    ds = FileDataset(
        f"s3://{bucket}/m", endpoint_url=s3_endpoint, storage_options={"session": session}
    )
    assert ds[0] == b"alpha"
    assert ds._filesystem().session is session


class _FreezeCount(FileDataset):
    """Returns, with each sample, how many objects the reading process has frozen."""

    def __getitems__(self, indices):
        return [(x, gc.get_freeze_count()) for x in super().__getitems__(indices)]


@pytest.mark.parametrize("freeze_gc", [True, False])
def test_dataloader_workers_hide_inherited_objects_from_the_collector(
    s3_endpoint, s3_client, bucket, freeze_gc
):
    # A full collection in a worker walks every object inherited with torch (0.2-0.3 s).
    for i in range(4):
        s3_client.put_object(Bucket=bucket, Key=f"g/{i}", Body=bytes([i]))
    ds = _FreezeCount(f"s3://{bucket}/g", endpoint_url=s3_endpoint, freeze_gc=freeze_gc)
    assert ds[0] == (b"\x00", 0)  # never in the process that trains
    loader = DataLoader(ds, batch_size=2, num_workers=1, collate_fn=list)
    counts = [count for batch in loader for _, count in batch]
    # torch's objects, from the first read on (frozen objects can still be freed)
    assert all(c > 100_000 for c in counts) if freeze_gc else counts == [0] * 4
    assert gc.get_freeze_count() == 0


async def _collect() -> None:
    gc.collect()


def _read_and_collect(ds: FileDataset) -> None:
    loop = fsspec.asyn.get_loop()  # this process's IO loop, new after the fork
    errors: list[str] = []
    loop.set_exception_handler(
        lambda _, context: errors.append(f"{context['message']}: {context.get('exception')!r}")
    )
    ds[1]
    # A collection on fsspec's IO thread, as happens mid-read: it would finalize the
    # clients inherited from the parent there, on this process's event loop.
    fsspec.asyn.sync(loop, _collect)
    ds.__getitems__([0, 1, 2])
    fsspec.asyn.sync(loop, _collect)
    fsspec.asyn.sync(loop, _collect)  # a failed task reports itself when collected
    sys.exit(f"event loop errors: {errors}" if errors else 0)


def test_clients_inherited_through_fork_are_not_closed_in_the_child(s3_client, bucket, flaky_proxy):
    for i in range(3):
        s3_client.put_object(Bucket=bucket, Key=f"f/{i}", Body=bytes([i]))
    proxy = flaky_proxy()  # keeps connections open, as a real store does
    # A client the process made by itself (a checkpoint's url_to_fs): fsspec's instance
    # cache holds it, and clears that cache at the first filesystem made in the child.
    cached = fsspec.filesystem("s3", endpoint_url=proxy.url)
    assert cached.ls(bucket)  # its session opened, on this process's loop
    del cached
    dropped = FileDataset(f"s3://{bucket}/f", endpoint_url=proxy.url)
    dropped[0]
    del dropped  # its client sits in a reference cycle: the child's collector may find it
    ds = FileDataset(f"s3://{bucket}/f", endpoint_url=proxy.url)
    ds[0]
    child = multiprocessing.get_context("fork").Process(target=_read_and_collect, args=(ds,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0


@pytest.mark.slow  # 5-8 s, most of it uploading 1,010 objects to moto
def test_more_than_one_page_of_keys(s3_endpoint, s3_client, bucket):
    from concurrent.futures import ThreadPoolExecutor

    n = 1_010  # S3 returns at most 1,000 keys per listing page
    with ThreadPoolExecutor(16) as pool:
        list(
            pool.map(
                lambda i: s3_client.put_object(
                    Bucket=bucket, Key=f"many/{i % 7}/{i:05d}.bin", Body=i.to_bytes(4, "little")
                ),
                range(n),
            )
        )
    ds = FileDataset(
        f"s3://{bucket}/many/", decode=_as_int, endpoint_url=s3_endpoint, concurrency=16
    )
    assert len(ds) == n
    assert ds.urls == sorted(ds.urls)
    assert ds.urls[-1] == f"s3://{bucket}/many/6/01007.bin"
    some = range(0, n, 9)  # from every listing page; reading all 1,010 would add ~5 s
    loader = DataLoader(ds, batch_size=64, sampler=list(some))
    values = [int(v) for batch in loader for v in batch]
    assert sorted(values) == sorted(int(ds.urls[i][-9:-4]) for i in some)
    stats = ds.get_stats()
    assert (stats["requested"], stats["fetched"]) == (len(some), len(some))
    assert stats["fetched_bytes"] == 4 * len(some)


def _as_int(data: bytes) -> int:
    return int.from_bytes(data, "little")


def test_batch_fetch_is_concurrent_and_bounded(s3_endpoint, s3_client, bucket, flaky_proxy):
    for i in range(24):
        s3_client.put_object(Bucket=bucket, Key=f"c/{i:02d}", Body=bytes([i]))
    proxy = flaky_proxy(delay=0.05)
    ds = FileDataset(f"s3://{bucket}/c", endpoint_url=proxy.url, concurrency=6)
    proxy.max_waiting = 0  # the listing is done
    out = ds.__getitems__(list(range(24)))
    assert out == [bytes([i]) for i in range(24)]
    assert 2 <= proxy.max_waiting <= 6
    assert ds.__getitems__(list(range(24))) == out
    assert proxy.requests == 1 + 2 * 24
    assert proxy.connections <= 1 + 6  # connections are reused, batch after batch


def test_repeated_indices_are_fetched_once(s3_endpoint, s3_client, bucket):
    # DistributedSampler pads with repeats; a batch may hold one index twice.
    for i in range(3):
        s3_client.put_object(Bucket=bucket, Key=f"r/{i}", Body=bytes([i]))
    ds = FileDataset(f"s3://{bucket}/r", endpoint_url=s3_endpoint)
    assert ds.__getitems__([2, 0, 2, -1]) == [b"\x02", b"\x00", b"\x02", b"\x02"]
    assert ds.get_stats()["fetched"] == 2

"""A store that fails some requests (5xx, throttling, reset connections) still yields
every sample; one that keeps failing gives an error naming the key."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from dask_ddp.data import S3ImageFolder, SampleFetchError


def test_transient_errors_are_retried(s3_images, flaky_proxy):
    bucket, prefix, local = s3_images
    proxy = flaky_proxy(fail_every=3, reset_every=5)
    to_tensor = transforms.ToTensor()
    # The listing goes through the proxy too.
    ds = S3ImageFolder(bucket, prefix, transform=to_tensor, endpoint_url=proxy.url)
    reference = datasets.ImageFolder(str(local), transform=to_tensor)
    assert ds.samples[0][0].endswith(reference.samples[0][0].removeprefix(str(local)))

    loader = DataLoader(ds, batch_size=4)
    got = [(x, int(t)) for xs, ts in loader for x, t in zip(xs, ts, strict=True)]
    assert len(got) == len(reference)
    for (a, ta), (b, tb) in zip(got, reference, strict=True):
        assert ta == tb
        assert torch.equal(a, b)
    assert proxy.failed >= 2  # both 500 InternalError and 503 SlowDown were answered
    assert proxy.reset >= 2


def test_transient_errors_with_worker_processes(s3_images, flaky_proxy):
    bucket, prefix, _ = s3_images
    proxy = flaky_proxy(fail_every=4, reset_every=7)
    ds = S3ImageFolder(bucket, prefix, endpoint_url=proxy.url, transform=transforms.ToTensor())
    loader = DataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context="fork")
    targets = [int(t) for _, ts in loader for t in ts]
    assert targets == ds.targets
    assert proxy.failed > 0
    assert proxy.reset > 0


def test_persistent_failure_names_the_key(s3_images, flaky_proxy):
    bucket, prefix, _ = s3_images
    proxy = flaky_proxy()
    ds = S3ImageFolder(bucket, prefix, endpoint_url=proxy.url, retries=1)
    proxy.fail_every = 1  # from now on every request fails
    before = proxy.requests  # the listing
    url = ds.samples[2][0]
    with pytest.raises(SampleFetchError, match=f"cannot read {url}: .*Transient errors"):
        ds[2]
    # retries=1: botocore tries twice; s3fs repeats that once more for SlowDown only.
    assert 2 <= proxy.requests - before <= 4
    with pytest.raises(OSError, match=f"cannot read s3://{bucket}/{prefix}/"):
        ds.__getitems__([0, 1, 2])

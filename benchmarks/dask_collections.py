"""Rows per second from a dask dataframe into 2 ranks: ``launch(datasets=)`` against the
client round trip.

The same persisted dask dataframe (``--rows`` rows of ``--cols`` float32 columns in
``--partitions`` partitions, spread over 2 single-threaded worker processes) reaches 2
ranks (gloo, CPU), which read one epoch in batches of ``--batch-size`` rows and build each
batch's feature matrix (``torch.stack`` of the column tensors), the same work in both:

* ``datasets=``: ``dask_ddp.launch(client, fn, datasets={"train": ddf})``; each rank
  iterates ``get_dataset_shard("train").iter_batches(format="torch")``: partitions are read
  from the rank's own worker or fetched worker to worker, a window ahead in the background.
* ``client round trip``: ``client.compute(ddf)`` brings the whole dataframe to the client as
  pandas, the client cuts it in 2 and ``client.scatter``\\ s each half to one rank's worker
  (published under a name; the rank gets it with ``get_client().get_dataset``, a read of
  its own worker's memory), then launches; each rank turns its half into column arrays once
  and slices them into the same torch batches.

Timed from the call to ``Job.result()`` returning: rows/s = rows / wall time. Also printed:
the ranks' read loop alone (slowest rank), and the client's peak RSS growth (sampled every
5 ms). Runs alternate (A, B, A, B, ...) after ``--warmup-runs``; medians and ratios are
printed with every value::

    python benchmarks/dask_collections.py                      # about 2 minutes on 2 cores
    python benchmarks/dask_collections.py --rows 500000 --runs 1 --warmup-runs 0   # a quick look
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import numpy as np
import pandas as pd
import psutil
import torch
from _common import command_line, median, versions

WORLD = 2


# -- on the ranks ---------------------------------------------------------------------------


def read_shard(batch_size: int) -> dict:
    """``datasets=``: one epoch of torch batches from the rank's shard."""
    import dask_ddp

    shard = dask_ddp.get_dataset_shard("train")
    began = time.perf_counter()
    rows, check = 0, 0.0
    for batch in shard.iter_batches(batch_size, format="torch"):
        features = torch.stack(list(batch.values()), dim=1)
        rows += features.shape[0]
        check += float(features[:, 0].sum())
    return {
        "rows": rows,
        "check": check,
        "loop_s": time.perf_counter() - began,
        "stats": shard.get_stats(),
    }


def read_scattered(batch_size: int, prefix: str, shuffle: bool) -> dict:
    """Client round trip: the rank's scattered half, the same torch batches."""
    from distributed import get_client

    import dask_ddp

    ctx = dask_ddp.get_context()
    began = time.perf_counter()
    frame = get_client().get_dataset(f"{prefix}-{ctx.worker}").result()
    columns = {c: s.to_numpy() for c, s in frame.items()}
    if shuffle:
        order = np.random.default_rng(ctx.rank).permutation(len(frame))
        columns = {c: v[order] for c, v in columns.items()}
    columns = {c: v if v.flags.writeable else v.copy() for c, v in columns.items()}
    rows, check = 0, 0.0
    for start in range(0, len(frame), batch_size):
        batch = {c: torch.from_numpy(v[start : start + batch_size]) for c, v in columns.items()}
        features = torch.stack(list(batch.values()), dim=1)
        rows += features.shape[0]
        check += float(features[:, 0].sum())
    return {"rows": rows, "check": check, "loop_s": time.perf_counter() - began}


# -- on the client -----------------------------------------------------------------------------


class PeakRSS:
    """The client process's peak RSS growth while the block runs, sampled every 5 ms."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak = 0

    def __enter__(self) -> PeakRSS:
        self.base = self.process.memory_info().rss
        self.peak = self.base
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / 1e6


def run_ours(client, ddf, args: argparse.Namespace, run: int) -> tuple[float, list[dict]]:
    import dask_ddp
    from dask_ddp.data import CollectionSource

    source = CollectionSource(ddf, shuffle=args.shuffle, seed=run)
    began = time.perf_counter()
    out = dask_ddp.launch(
        client, read_shard, args=(args.batch_size,), datasets={"train": source}
    ).result()
    return time.perf_counter() - began, out


def run_round_trip(client, ddf, args: argparse.Namespace, run: int) -> tuple[float, list[dict]]:
    import dask_ddp

    prefix = f"bench-collections-{run}"
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    began = time.perf_counter()
    frame = client.compute(ddf).result()  # the whole dataframe, as pandas on the client
    cuts = np.linspace(0, len(frame), WORLD + 1).astype(int)
    names = []
    for worker, start, stop in zip(workers, cuts[:-1], cuts[1:], strict=True):
        [future] = client.scatter([frame.iloc[start:stop]], workers=[worker], hash=False)
        names.append(f"{prefix}-{worker}")
        client.publish_dataset(future, name=names[-1])
    del frame, future
    out = dask_ddp.launch(
        client, read_scattered, args=(args.batch_size, prefix, args.shuffle)
    ).result()
    elapsed = time.perf_counter() - began
    for name in names:
        client.unpublish_dataset(name)
    return elapsed, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--cols", type=int, default=16, help="float32 columns")
    parser.add_argument("--partitions", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--shuffle", action="store_true", help="both shuffle their rows")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup-runs", type=int, default=1)
    args = parser.parse_args()

    import dask.dataframe as dd
    from distributed import Client, LocalCluster, wait

    rng = np.random.default_rng(0)
    data = pd.DataFrame(
        {f"c{i}": rng.standard_normal(args.rows, dtype="float32") for i in range(args.cols)}
    )
    expected = float(data["c0"].to_numpy().sum(dtype="float64"))
    mb = data.memory_usage(index=False).sum() / 1e6
    print(
        f"{args.rows:,} rows x {args.cols} float32 columns ({mb:.0f} MB) in "
        f"{args.partitions} partitions, {WORLD} ranks, batch {args.batch_size}, "
        f"shuffle={args.shuffle}"
    )
    variants: dict[str, Callable] = {"datasets=": run_ours, "client round trip": run_round_trip}
    wall: dict[str, list[float]] = {v: [] for v in variants}
    loop: dict[str, list[float]] = {v: [] for v in variants}
    rss: dict[str, list[float]] = {v: [] for v in variants}
    notes: list[str] = []
    with (
        LocalCluster(
            n_workers=WORLD, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        ddf = dd.from_pandas(data, npartitions=args.partitions).persist()
        wait(ddf)
        del data
        placed = client.who_has()
        per_worker = sorted(
            sum(1 for holders in placed.values() if w in holders)
            for w in client.scheduler_info(n_workers=-1)["workers"]
        )
        print(f"partitions per worker before the runs: {per_worker}")
        run = 0
        for i in range(args.warmup_runs + args.runs):
            for name, fn in variants.items():
                run += 1
                with PeakRSS() as peak:
                    elapsed, out = fn(client, ddf, args, run)
                rows = sum(o["rows"] for o in out)
                check = sum(o["check"] for o in out)
                if rows != args.rows or not np.isclose(check, expected, rtol=1e-3, atol=1.0):
                    raise SystemExit(f"{name}: got {rows} rows (checksum {check}), expected "
                                     f"{args.rows} ({expected})")  # fmt: skip
                if i < args.warmup_runs:
                    continue
                wall[name].append(elapsed)
                loop[name].append(max(o["loop_s"] for o in out))
                rss[name].append(peak.growth_mb)
                if "stats" in out[0]:
                    s = [o["stats"] for o in out]
                    notes.append(
                        "partitions local/remote per rank: "
                        + ", ".join(f"{x['partitions_local']}/{x['partitions_remote']}" for x in s)
                        + "; wait/fetch s per rank: "
                        + ", ".join(f"{x['wait_s']:.2f}/{x['fetch_s']:.2f}" for x in s)
                    )

    print(f"\n{versions('dask', 'distributed', 'pandas')}")
    print(f"command: {command_line()}\n")
    header = f"{'':28}{'rows/s end to end':>20}{'read loop rows/s':>20}{'client RSS +MB':>16}"
    print(header)
    for name in variants:
        print(
            f"{name:28}{args.rows / median(wall[name]):>20,.0f}"
            f"{args.rows / median(loop[name]):>20,.0f}{median(rss[name]):>16.0f}"
        )
    ours, ref = "datasets=", "client round trip"
    print(
        f"\nratio datasets= / client round trip: end to end "
        f"{median(wall[ref]) / median(wall[ours]):.2f}x, read loop "
        f"{median(loop[ref]) / median(loop[ours]):.2f}x"
    )
    print("\nevery run (wall s, read loop s, client RSS +MB):")
    for name in variants:
        cells = zip(wall[name], loop[name], rss[name], strict=True)
        print(f"  {name}: " + ", ".join(f"{w:.2f}/{lp:.2f}/{r:.0f}" for w, lp, r in cells))
    for note in notes:
        print(f"  datasets= {note}")


if __name__ == "__main__":
    main()

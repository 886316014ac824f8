"""Fixtures for the dataset tests: a real S3 server (moto) on a free loopback port, a
test image tree, and a loopback HTTP proxy that fails some requests on purpose."""

from __future__ import annotations

import functools
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import numpy as np
import pytest
from moto.server import ThreadedMotoServer
from PIL import Image

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a moto S3 server, with fake credentials in the env.

    The credentials are in the environment so that DataLoader workers (fork and spawn)
    and code that takes no credentials (like dask-pytorch-ddp's) find them too, and so
    that no test can reach a real account.
    """
    with pytest.MonkeyPatch.context() as mp:
        for name, value in CREDENTIALS.items():
            mp.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture(scope="session")
def s3_client(s3_endpoint: str):
    return boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")


@pytest.fixture
def bucket(s3_client) -> str:
    """A new, empty bucket for one test."""
    name = f"test-{uuid.uuid4().hex[:16]}"
    s3_client.create_bucket(Bucket=name)
    return name


def _upload_tree(client, bucket: str, prefix: str, root: Path) -> list[str]:
    """Upload every file under ``root`` to ``s3://bucket/prefix/<relative path>``."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    keys = [f"{prefix}/{p.relative_to(root).as_posix()}".lstrip("/") for p in files]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p, k: client.upload_file(str(p), bucket, k), files, keys))
    return keys


def _write_image(path: Path, seed: int, size: tuple[int, int] = (12, 10)) -> None:
    """A small random image; the format follows the suffix (.jpg, .png, ...)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    fmt = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".bmp": "BMP"}[path.suffix.lower()]
    Image.fromarray(pixels).save(path, format=fmt)


# Test modules take these helpers as fixtures rather than importing them: another
# conftest.py may be the module named "conftest" when they are collected.
@pytest.fixture
def write_image() -> Callable[..., None]:
    """``write_image(path, seed, size=(12, 10))`` writes a small random image."""
    return _write_image


@pytest.fixture
def upload_tree(s3_client) -> Callable[[str, str, Path], list[str]]:
    """``upload_tree(bucket, prefix, root)`` uploads a local tree; returns the keys."""
    return functools.partial(_upload_tree, s3_client)


IMAGE_TREE = [
    "cat/0.jpg",
    "cat/1.JPEG",
    "cat/a.b/2.png",
    "cat/a/3.jpg",
    "cat/a/x/4.png",
    "dog/10.png",
    "dog/9.jpg",
    "dog/b[1]/5.jpg",
    "zebra/z.bmp",
    "zebra/y.jpeg",
    "zebra/w.jpg",
    "zebra/v.png",
]
NOT_IMAGES = ["cat/notes.txt", "README.md", "zebra/labels.csv"]


@pytest.fixture
def image_count() -> int:
    """How many images ``image_tree`` holds."""
    return len(IMAGE_TREE)


@pytest.fixture
def image_tree(tmp_path: Path) -> Path:
    """An ImageFolder tree on local disk: 3 classes, nested folders, mixed formats,
    a key with glob characters, and files that are not images."""
    root = tmp_path / "images"
    for seed, rel in enumerate(IMAGE_TREE):
        _write_image(root / rel, seed)
    for rel in NOT_IMAGES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("not an image")
    return root


@pytest.fixture
def s3_images(s3_client, bucket: str, image_tree: Path) -> tuple[str, str, Path]:
    """``(bucket, prefix, local_root)``: ``image_tree`` uploaded under ``data/train``."""
    _upload_tree(s3_client, bucket, "data/train", image_tree)
    return bucket, "data/train", image_tree


class FlakyProxy:
    """A loopback HTTP proxy in front of an S3 server that misbehaves on purpose.

    Request number ``n`` (counting from 1) gets a 5xx answer when ``n % fail_every == 0``
    (alternately ``500 InternalError`` and ``503 SlowDown``, S3's throttling answer), and
    its connection is reset (TCP RST, no answer) when ``n % reset_every == 0``. Other
    requests are forwarded after ``delay`` seconds; ``max_waiting`` is the most requests
    that were waiting out that delay at once, a lower bound of the client's concurrency.
    Client connections are kept alive (``connections`` counts them) although moto closes
    its own after every response: each request gets a new connection to moto.
    """

    def __init__(
        self, upstream: str, *, fail_every: int = 0, reset_every: int = 0, delay: float = 0.0
    ) -> None:
        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.fail_every, self.reset_every, self.delay = fail_every, reset_every, delay
        self.requests = self.failed = self.reset = self.waiting = self.max_waiting = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept() in _serve
        self._server.close()
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with self._lock:
            self.connections += 1
        with conn:
            while True:  # one request after another on this connection
                head, body = _read_request(conn)
                if not head:
                    return  # the client closed it
                with self._lock:
                    self.requests += 1
                    n = self.requests
                if self.fail_every and n % self.fail_every == 0:
                    with self._lock:
                        self.failed += 1
                    conn.sendall(_error_response(n))
                    return
                if self.reset_every and n % self.reset_every == 0:
                    with self._lock:
                        self.reset += 1
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                if self.delay:
                    with self._lock:
                        self.waiting += 1
                        self.max_waiting = max(self.max_waiting, self.waiting)
                    time.sleep(self.delay)  # the latency of a distant store
                    with self._lock:
                        self.waiting -= 1
                if not self._forward(conn, head, body):
                    return

    def _forward(self, conn: socket.socket, head: bytes, body: bytes) -> bool:
        """Relay one request; True if the client's connection stays open."""
        with socket.create_connection(self.upstream) as up:
            up.sendall(_set_connection(head, b"close") + body)
            response = b""
            while chunk := up.recv(65536):
                response += chunk
        resp_head, _, resp_body = response.partition(b"\r\n\r\n")
        framed = b"\r\ncontent-length:" in resp_head.lower() or head.startswith(b"HEAD ")
        conn.sendall(_set_connection(resp_head, b"keep-alive" if framed else b"close") + resp_body)
        return framed


def _read_request(conn: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b"", b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n", body


def _set_connection(head: bytes, value: bytes) -> bytes:
    lines = [
        line
        for line in head.rstrip(b"\r\n").split(b"\r\n")
        if not line.lower().startswith((b"connection:", b"keep-alive:"))
    ]
    return b"\r\n".join([*lines, b"Connection: " + value]) + b"\r\n\r\n"


def _error_response(n: int) -> bytes:
    status, code = ("500 Internal Server Error", "InternalError")
    if n % 2:
        status, code = ("503 Slow Down", "SlowDown")
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>injected by the test proxy</Message><RequestId>{n}</RequestId></Error>"
    ).encode()
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


@pytest.fixture
def flaky_proxy(s3_endpoint: str) -> Iterator[type[FlakyProxy]]:
    """A factory for :class:`FlakyProxy` in front of the moto server; closed after the test."""
    proxies: list[FlakyProxy] = []

    def make(**kwargs) -> FlakyProxy:
        proxy = FlakyProxy(s3_endpoint, **kwargs)
        proxies.append(proxy)
        return proxy

    yield make  # type: ignore[misc]
    for proxy in proxies:
        proxy.close()

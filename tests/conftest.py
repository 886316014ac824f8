"""Shared fixtures: one real LocalCluster (worker processes, gloo) for the whole session, a
real S3 server (moto) on a free loopback port, a loopback HTTP proxy in front of it that
delays or fails requests on purpose, and a cluster of real ``dask scheduler`` and
``dask worker`` processes as a deployment starts them (:class:`DaskProcesses`).

Tests that kill or restart workers start their own cluster instead.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import boto3
import cloudpickle
import leftovers as _leftovers
import pytest
import torch
from distributed import Client, LocalCluster
from leftovers import clean_up, forget_ended, leftovers
from moto.server import ThreadedMotoServer
from processes import DaskProcesses, stacks

# Its functions run on schedulers and workers of ``dask`` processes too, which cannot import
# tests/: they travel by value.
cloudpickle.register_pickle_by_value(_leftovers)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_gpu = torch.cuda.is_available()
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "netns" in item.keywords and not is_root:
            item.add_marker(pytest.mark.skip(reason="needs root for ip netns"))


def make_cluster(n_workers: int = 2) -> LocalCluster:
    return LocalCluster(
        n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0"
    )


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    with make_cluster(2) as cluster:
        yield cluster


@pytest.fixture
def client(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[Client]:
    """A client of the shared cluster. A test that leaves the cluster's workers held by a
    job, or a rank busy in a worker process, fails itself, naming what it left, and the
    cluster is made clean again for the tests after it."""
    with Client(cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        yield client
        fail_if_left(client, request, "the shared cluster", lambda: stacks_of(cluster))


def fail_if_left(
    client: Client, request: pytest.FixtureRequest, what: str, where: Callable[[], str]
) -> None:
    """Fail the test if it left ``what`` (a shared cluster, ``client``'s) unclean, naming
    what it left, after cleaning it up; ``where()``: its workers' stacks, for a cluster
    that does not answer."""
    # A worker whose event loop is blocked never answers: the test fails with where
    # its threads are, while they are still there (the scheduler restarts a worker
    # that missed its heartbeats for minutes, and its stacks go with it).
    asking = concurrent.futures.ThreadPoolExecutor(1)
    try:
        left = asking.submit(leftovers, client).result(timeout=_ANSWER_WITHIN)
    except concurrent.futures.TimeoutError:
        pytest.fail(
            f"{request.node.nodeid}: {what} did not answer within {_ANSWER_WITHIN} s after "
            f"the test; its workers' stacks:\n{where()}",
            pytrace=False,
        )
    finally:
        asking.shutdown(wait=False)
    if left:
        clean_up(client)
        pytest.fail(
            f"{request.node.nodeid} left {what} unclean: {'; '.join(left)} "
            "(cancel or wait for its jobs before it ends; the cluster was cleaned up)",
            pytrace=False,
        )


_ANSWER_WITHIN = 90  # seconds: leftovers() takes at most 60 + 5 on a cluster that answers


def stacks_of(cluster: LocalCluster) -> str:
    """Every thread's Python stack in ``cluster``'s worker processes (py-spy, a test
    dependency; "" without it), for a test that found a worker unresponsive."""
    dumps = []
    for name, nanny in list(cluster.workers.items()):
        pid = getattr(getattr(nanny, "process", None), "pid", None)
        if pid is not None:
            dumps.append(f"--- worker {name} (pid {pid})\n{stacks(pid)}")
    return "\n".join(dumps)


@pytest.fixture
def slow_publish(monkeypatch: pytest.MonkeyPatch) -> float:
    """The supervisor publishes each attempt's futures this many seconds late (it runs in
    this process: a LocalCluster's scheduler does), so that a short job ends before they
    are published."""
    from dask_ddp._scheduler import launcher

    delay = 2.0
    publish = launcher.Launcher.publish

    async def later(self: launcher.Launcher, attempt: launcher.Attempt) -> None:
        import asyncio

        await asyncio.sleep(delay)
        await publish(self, attempt)

    monkeypatch.setattr(launcher.Launcher, "publish", later)
    return delay


@pytest.fixture
def own_cluster() -> Iterator[LocalCluster]:
    """A cluster of its own, for tests that kill or restart workers."""
    with make_cluster(2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def _module_dask_processes() -> Iterator[DaskProcesses]:
    cluster = DaskProcesses(2)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def dask_processes(
    _module_dask_processes: DaskProcesses, request: pytest.FixtureRequest
) -> Iterator[DaskProcesses]:
    """A cluster of a ``dask scheduler`` process and two ``dask worker`` processes, one for
    a module's tests. After each, the workers it added are stopped and the jobs that ended
    forgotten (the next test lists only its own); a test that left a job running, a worker
    held or a rank busy fails, naming it, as with ``client``."""
    cluster = _module_dask_processes
    workers = list(cluster.workers)
    yield cluster
    added, cluster.workers[:] = cluster.workers[len(workers) :], workers
    for worker in added:
        worker.stop()
    with Client(cluster.address) as client:
        deadline = time.monotonic() + 60
        while (n := len(client.scheduler_info(n_workers=-1)["workers"])) != len(workers):
            assert time.monotonic() < deadline, (
                f"{request.node.nodeid}: the module's dask processes have {n} workers a minute "
                f"after it, not the {len(workers)} they had before it"
            )
            time.sleep(0.1)
        try:
            fail_if_left(client, request, "the module's dask processes", cluster.stacks)
        finally:
            forget_ended(client)


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


class FlakyProxy:
    """A loopback HTTP proxy in front of an S3 server that misbehaves on purpose.

    Request number ``n`` (counting from 1) gets a 5xx answer when ``n % fail_every == 0``
    (alternately ``500 InternalError`` and ``503 SlowDown``, S3's throttling answer), and
    its connection is reset (TCP RST, no answer) when ``n % reset_every == 0``. Other
    requests are forwarded after ``delay`` seconds; ``max_waiting`` is the most requests
    that were waiting out that delay at once, a lower bound of the client's concurrency.
    Client connections are kept alive (``connections`` counts them) although moto closes
    its own after every response: each request gets a new connection to moto.
    ``on_request(head)``, if given, sees each request's head (its first line: method and
    path) before it is forwarded: a test acts at a chosen request (kills a worker midway
    through an upload).
    """

    def __init__(
        self,
        upstream: str,
        *,
        fail_every: int = 0,
        reset_every: int = 0,
        delay: float = 0.0,
        on_request: Callable[[bytes], None] | None = None,
    ) -> None:
        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.fail_every, self.reset_every, self.delay = fail_every, reset_every, delay
        self.on_request = on_request
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
                if self.on_request is not None:
                    self.on_request(head)
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
            response = bytearray()
            while chunk := up.recv(1 << 20):
                response += chunk
        resp_head, _, resp_body = bytes(response).partition(b"\r\n\r\n")
        framed = b"\r\ncontent-length:" in resp_head.lower() or head.startswith(b"HEAD ")
        conn.sendall(_set_connection(resp_head, b"keep-alive" if framed else b"close") + resp_body)
        return framed


def _read_request(conn: socket.socket) -> tuple[bytes, bytes]:
    data = bytearray()
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b"", b""
        data += chunk  # a bytearray grows in place: large uploads stay linear
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    body = bytearray(rest)
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
        elif name.strip().lower() == b"expect" and value.strip().lower() == b"100-continue":
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")  # uploads wait for it
    while len(body) < length:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n", bytes(body)


def _set_connection(head: bytes, value: bytes) -> bytes:
    lines = [
        line
        for line in head.rstrip(b"\r\n").split(b"\r\n")
        if not line.lower().startswith((b"connection:", b"keep-alive:", b"expect:"))
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

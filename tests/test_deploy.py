"""dask-ddp where Dask is deployed: a real dask-gateway server (its local backend runs each
cluster's scheduler and workers as local processes, reached through the gateway's TLS
proxy), a TLS LocalCluster, and plain ``dask scheduler`` and ``dask worker`` processes
started without any preload.

On each, the same job: DDP training that reports, saves checkpoints (kept in a peer's
memory too), fails once with ``RetryableError`` and resumes from the peer's replica (a
worker-to-worker fetch over the cluster's own security), then waits; meanwhile a second
connection of the user's lists the job, attaches to it by name, and follows it to its end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from distributed import Client, Event, LocalCluster
from distributed.comm import get_address_host
from distributed.security import Security
from distributed.utils_test import poll_for
from processes import DaskProcesses, Output

import dask_ddp

# The scheduler and workers of a gateway's cluster cannot import this module: its
# functions travel by value, as a notebook's do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS, FAIL_AT, BIG = 10, 5, 100_000  # checkpoints at steps 2, 5, 8; a 100 kB line at 9


def _train(go: str) -> dict[str, Any]:
    """Deterministic DDP; rank 1 fails once at step 5 after checkpoint 5 is kept in a peer's
    memory; the resumed attempt prints a line too large for the scheduler's events (the
    launching client fetches it from the rank's worker, or through the scheduler where a
    proxy is in the way), then waits at its last step until the test sets the event ``go``.
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start, state = 0, dask_ddp.get_checkpoint()
    if state is not None:
        model.module.load_state_dict(state["model"])
        start = state["step"] + 1
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(1000 * step + ctx.rank)
        opt.zero_grad()
        loss = model(torch.randn(16, 8, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        dask_ddp.report({"loss": loss.item()}, step=step)
        if step % 3 == 2:
            state = {"model": model.module.state_dict(), "step": step}
            pending = dask_ddp.save_checkpoint(state, step=step)
            if ctx.attempt == 0:
                if pending is not None:
                    pending.wait(60)  # durable and kept in a peer's memory
                # before rank 1 fails: a stop reaches a rank at once, and a rank that
                # stops gives up the checkpoint it still writes
                torch.distributed.barrier()
        if ctx.attempt == 0 and ctx.rank == 1 and step == FAIL_AT:
            raise dask_ddp.RetryableError("a retryable failure, on purpose")
    print("x" * BIG, flush=True)
    Event(go).wait(300)
    return {"rank": ctx.rank, "attempt": ctx.attempt, "start": start}


def _job_followed_from_a_second_connection(
    client: Client, second: Callable[[], Any], checkpoints: Path, name: str
) -> dask_ddp.Job:
    """Launch :func:`_train` as ``name``; once its second attempt waits, a client from
    ``second()`` lists the job, attaches to it by name and lets it finish. Returns the
    launching client's job."""
    go = f"dask-ddp-test-go-{name}"
    job = dask_ddp.launch(
        client, _train, args=(go,), name=name, checkpoint_dir=str(checkpoints), max_restarts=1
    )
    big = "x" * BIG
    job.view_state(
        lambda s: s["attempts"] == 2 and sum(line.endswith(big) for line in s["output"]) == 2,
        timeout=240,
    )  # both ranks wait at their last step, and their large lines came
    with second() as other:
        (listed,) = [j for j in dask_ddp.jobs(other) if j.name == name]
        assert (listed.job_id, listed.state) == (job.job_id, dask_ddp.JobState.RUNNING)
        assert listed.attempts == 2 and listed.step == STEPS - 1
        attached = dask_ddp.attach(other, name)
        assert attached.job_id == job.job_id and attached.world_size == 2
        Event(go, client=other).set()
        assert attached.result(timeout=120) == job.result(timeout=120)
        _check_followed(attached)
    _check_followed(job)
    assert sorted(line.rank for line in job.output if line.text == big) == [0, 1]
    return job


def _check_followed(job: dask_ddp.Job) -> None:
    """What both connections see of the job: its results, restart, reports, checkpoints."""
    out = job.result(timeout=120)
    assert [(o["rank"], o["attempt"], o["start"]) for o in out] == [(0, 1, 6), (1, 1, 6)]
    states = [t.state.value for t in job.history]
    assert states == ["running", "restarting", "running", "succeeded"], states
    resumed = [t for t in job.history if t.state.value == "running"][-1]
    # From the replica in a peer worker's memory: fetched worker to worker, secured.
    assert (resumed.restored_from, resumed.restored_step) == ("peer", 5)
    assert [c.step for c in job.checkpoints] == [2, 5, 8]
    steps = sorted({(r.rank, r.step) for r in job.metrics if r.step >= 6})
    assert steps == [(rank, step) for rank in (0, 1) for step in range(6, STEPS)]


# -- what the rendezvous exposes --------------------------------------------------------
def _store_listens_on() -> list[str]:
    """On rank 0: the addresses the job's store listens on (it is held for rank 0's worker
    by that worker's store host, a process of its own)."""
    import psutil

    port = int(os.environ["MASTER_PORT"])
    return sorted(
        c.laddr.ip
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    )


def test_the_job_s_store_listens_on_the_worker_s_own_address(client: Client) -> None:
    """torchrun's store listens on every interface of the machine; a job's store here
    listens on its worker's address only (127.0.0.1 for this LocalCluster's workers)."""
    job = dask_ddp.launch(client, _store_listens_on)
    listens = job.result(timeout=120)
    assert listens[0] == [get_address_host(job.workers[0])], listens


def _store_ahead(dask_worker: Any = None) -> int | None:
    """The port of the store this worker opened ahead of its next job, if one waits."""
    from dask_ddp._rank.host import host_for

    ahead = host_for(dask_worker).store_ahead._ahead
    return None if ahead is None else ahead[1].port


def _master_port() -> int:
    return int(os.environ["MASTER_PORT"])


def test_a_warm_worker_hands_the_next_job_the_store_it_opened_ahead(client: Client) -> None:
    """Once a rank 0 ended, its worker opens the next job's store (on its own address): the
    next launch's probe hands it over at once (no thread hop, no open while ranks start)."""
    first = dask_ddp.launch(client, _master_port)
    used = first.result(timeout=120)[0]
    rank0 = first.workers[0]

    def ahead() -> int | None:
        return client.run(_store_ahead, workers=[rank0])[rank0]

    poll_for(lambda: ahead() is not None, timeout=30)
    port = ahead()
    assert port != used
    job = dask_ddp.launch(client, _master_port)
    assert job.workers[0] == rank0
    assert job.result(timeout=120) == [port, port]


# -- a TLS LocalCluster --------------------------------------------------------------------
@pytest.mark.slow
def test_a_tls_local_cluster(tmp_path: Path) -> None:
    security = Security.temporary()
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, protocol="tls",
            security=security, dashboard_address="127.0.0.1:0",
        ) as cluster,
        Client(cluster, security=security) as client,
    ):  # fmt: skip
        assert client.scheduler.address.startswith("tls://")
        client.wait_for_workers(2, timeout=60)
        job = _job_followed_from_a_second_connection(
            client,
            lambda: Client(cluster.scheduler_address, security=security),
            tmp_path / "checkpoints",
            "tls-job",
        )
        page = _get_json(cluster.dashboard_link, f"ddp/api/jobs/{job.job_id}")
        assert page["state"] == "succeeded"


# -- plain `dask scheduler` and `dask worker` processes, no preload ------------------------
@pytest.mark.slow
def test_plain_dask_scheduler_and_worker_processes(
    dask_processes: DaskProcesses, tmp_path: Path
) -> None:
    with Client(dask_processes.address) as client:
        client.wait_for_workers(2, timeout=60)
        _job_followed_from_a_second_connection(
            client, lambda: Client(dask_processes.address), tmp_path / "checkpoints", "plain-job"
        )


# -- a dask-gateway server -----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GATEWAY_CONFIG = """\
c.DaskGateway.address = "127.0.0.1:{api}"
c.Proxy.address = "127.0.0.1:{http}"
c.Proxy.tcp_address = "127.0.0.1:{tcp}"
c.DaskGateway.backend_class = "dask_gateway_server.backends.local.UnsafeLocalBackend"
c.DaskGateway.authenticator_class = "dask_gateway_server.auth.SimpleAuthenticator"
# distributed no longer ships the dask-scheduler and dask-worker commands
c.LocalClusterConfig.scheduler_cmd = ["dask", "scheduler"]
c.LocalClusterConfig.worker_cmd = ["dask", "worker"]
c.LocalClusterConfig.worker_threads = 1
"""


class GatewayServer:
    """A dask-gateway server process, its HTTP proxy and its TLS proxy for schedulers."""

    def __init__(self, folder: Path) -> None:
        ports = {"api": _free_port(), "http": _free_port(), "tcp": _free_port()}
        config = folder / "dask_gateway_config.py"
        config.write_text(GATEWAY_CONFIG.format(**ports))
        self.address = f"http://127.0.0.1:{ports['http']}"
        self.proxy_address = f"gateway://127.0.0.1:{ports['tcp']}"
        # Its clusters' `dask scheduler` and `dask worker` come from this environment.
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        self.server = Output(
            [sys.executable, "-m", "dask_gateway_server", "-f", str(config)],
            {"PATH": path},
            cwd=folder,
        )
        self.server.wait_for("Dask-Gateway server started")
        self.server.wait_for("200 GET /api/v1/routes")  # the proxy has its routes: it serves

    def gateway(self) -> Any:
        from dask_gateway import BasicAuth, Gateway

        return Gateway(self.address, proxy_address=self.proxy_address, auth=BasicAuth("ana"))

    def close(self) -> None:
        self.server.stop(signal.SIGTERM, timeout=60)  # stops its clusters first


def _closed_gateways_stay_closed() -> None:
    """dask-gateway 2026.3's ``Gateway.__del__`` closes a closed Gateway again, and
    distributed 2026.8's ``LoopRunner.loop`` raises once its loop has stopped: every Gateway
    raised at garbage collection, whenever that came (in a later test, or in pytest's
    summary, where it broke the interpreter's parser once). A closed one is left alone."""
    from dask_gateway import Gateway

    original = Gateway.__del__
    if getattr(original, "dask_ddp_test", False):
        return

    def __del__(self: Gateway) -> None:
        if not self.asynchronous and not self._loop_runner.is_started():
            return  # closed: its loop runner was stopped
        original(self)

    __del__.dask_ddp_test = True  # type: ignore[attr-defined]
    Gateway.__del__ = __del__  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def gateway_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    pytest.importorskip("dask_gateway_server")
    _closed_gateways_stay_closed()
    server = GatewayServer(tmp_path_factory.mktemp("gateway"))
    try:
        yield server
    finally:
        server.close()


@pytest.mark.slow
def test_a_dask_gateway_cluster(gateway_server: GatewayServer, tmp_path: Path) -> None:
    @contextlib.contextmanager
    def second() -> Iterator[Client]:  # another notebook: a gateway, its cluster by name
        with (
            gateway_server.gateway() as again,
            again.connect(cluster.name) as same,
            same.get_client() as client,
        ):
            yield client

    with gateway_server.gateway() as gateway:
        cluster = gateway.new_cluster()
        try:
            _on_the_gateway_s_cluster(cluster, second, tmp_path)
        finally:
            cluster.shutdown()


def _on_the_gateway_s_cluster(cluster: Any, second: Callable[[], Any], tmp_path: Path) -> None:
    cluster.scale(2)
    with cluster.get_client() as client:
        assert client.scheduler.address.startswith("gateway://")  # TLS through the proxy
        client.wait_for_workers(2, timeout=120)
        job = _job_followed_from_a_second_connection(
            client, second, tmp_path / "checkpoints", "gateway-job"
        )
        # The workers sit behind the proxy: the large lines came through the scheduler, and
        # this client never opened a connection to a worker.
        opened = set(client.rpc.available) | set(client.rpc.occupied)
        assert not opened & set(job.workers), opened

    # The /ddp/ page and its JSON, through the gateway's proxy under /clusters/<name>/.
    page = _get_json(cluster.dashboard_link, f"ddp/api/jobs/{job.job_id}")
    assert (page["name"], page["state"]) == ("gateway-job", "succeeded")
    listing = _get(cluster.dashboard_link, "ddp/")
    link = f"href='jobs/{job.job_id}'"  # relative: it stays under the proxy's prefix
    assert link in listing, listing[:2000]
    assert f"dask-ddp job {job.job_id}" in _get(cluster.dashboard_link, f"ddp/jobs/{job.job_id}")


def _url(dashboard_link: str, path: str) -> str:
    return dashboard_link.rsplit("/status", 1)[0] + "/" + path


def _get(dashboard_link: str, path: str) -> str:
    with urllib.request.urlopen(_url(dashboard_link, path), timeout=30) as response:
        return response.read().decode()


def _get_json(dashboard_link: str, path: str) -> dict[str, Any]:
    return json.loads(_get(dashboard_link, path))


# -- workers at fixed ports ----------------------------------------------------------------
def _rank_number() -> int:
    return dask_ddp.get_context().rank


def _task_states(keys: list[str], dask_scheduler=None) -> list[str | None]:
    return [getattr(dask_scheduler.tasks.get(k), "state", None) for k in keys]


def _rank_and_bytes(nbytes: int) -> tuple[int, bytes]:
    return dask_ddp.get_context().rank, b"x" * nbytes


def _kill_and_wait_for_return(client: Client, victim: str) -> None:
    """SIGKILL ``victim``'s worker process; return once a new one answers at its address."""
    pid = client.run(os.getpid, workers=[victim])[victim]
    os.kill(pid, signal.SIGKILL)

    def back() -> bool:
        with contextlib.suppress(Exception):
            now = client.run(os.getpid, workers=[victim]).get(victim)
            return isinstance(now, int) and now != pid
        return False

    poll_for(back, timeout=120, period=0.2)


@pytest.mark.slow
def test_a_finished_rank_never_runs_again_where_its_worker_comes_back() -> None:
    # Deployments often fix a worker's port (dask worker --worker-port, a pod that comes back
    # at its address): a worker restarted there is, to the scheduler, where a lost value may
    # be computed again. A rank never runs twice: its future says its value went with the
    # worker. A small value (up to ddp.result-limit, 1 MiB by default) is held by the job's
    # supervisor as well: result() still returns every one, to any client; a larger one
    # went with the worker, and the error says the limit.
    cluster = DaskProcesses(0)
    try:
        cluster.workers = [cluster.add_worker(worker_port=_free_port()) for _ in range(2)]
        with Client(cluster.address) as client:
            client.wait_for_workers(2, timeout=120)
            job = dask_ddp.launch(client, _rank_and_bytes, args=(10,))
            assert job.result(timeout=120) == [(0, b"x" * 10), (1, b"x" * 10)]
            keys = [f.key for f in job.futures]
            _kill_and_wait_for_return(client, job.workers[1])
            assert client.run_on_scheduler(_task_states, keys) == ["memory", "erred"]
            with pytest.raises(dask_ddp.WorkerLostError) as lost:
                job.futures[1].result(timeout=60)
            assert lost.value.finished
            assert job.result(timeout=60) == [(0, b"x" * 10), (1, b"x" * 10)]
            with Client(cluster.address) as other:
                again = dask_ddp.attach(other, job.job_id)
                assert again.result(timeout=60) == [(0, b"x" * 10), (1, b"x" * 10)]

            big = 2 * 1024 * 1024  # over the default limit
            job = dask_ddp.launch(client, _rank_and_bytes, args=(big,))
            assert [r for r, _ in job.result(timeout=120)] == [0, 1]
            _kill_and_wait_for_return(client, job.workers[1])
            with pytest.raises(dask_ddp.WorkerLostError) as lost:
                job.result(timeout=60)
            assert lost.value.finished and lost.value.rank == 1
            assert "ddp.result-limit (1,048,576 bytes" in str(lost.value)
            assert dask_ddp.launch(client, _rank_number).result(timeout=120) == [0, 1]
    finally:
        cluster.close()

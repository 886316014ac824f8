"""Ranks across real hosts: network namespaces joined by a bridge, one address each.

Two test hosts (namespaces) at 198.18.0.1 and 198.18.0.2 (the range RFC 2544 sets aside
for network tests) are joined by a bridge in a third namespace. Host 0 runs the scheduler,
each host runs two workers, and the client runs on host 0. No traffic leaves these
namespaces. Needs root and ``ip netns``; skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SUBNET = "198.18.0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _netns_available() -> bool:
    if shutil.which("ip") is None or os.geteuid() != 0:
        return False
    probe = f"ddpprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError):
        return False
    _ip("netns", "del", probe)
    return True


class _Hosts:
    def __init__(self, n: int) -> None:
        tag = f"ddp{os.getpid() % 100000}"
        self.bridge_ns = f"{tag}br"
        self.names = [f"{tag}h{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []

    def up(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addresses, strict=True)):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}",
                "netns", self.bridge_ns)  # fmt: skip
            _ip("-n", self.bridge_ns, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def spawn(self, host: int, args: list[str], log: Path) -> subprocess.Popen:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.names[host], *args],
            stdout=log.open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def run(self, host: int, args: list[str], timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.names[host], *args],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def down(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for ns in [*self.names, self.bridge_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[_Hosts, Path]]:
    if not _netns_available():
        pytest.skip("needs root and ip netns")
    tmp = tmp_path_factory.mktemp("netns")
    net = _Hosts(2)
    try:
        net.up()
        sched_file = tmp / "scheduler.json"
        py = sys.executable
        net.spawn(0, [py, "-m", "distributed.cli.dask_scheduler", "--host", net.addresses[0],
                      "--port", "0", "--no-dashboard", "--scheduler-file", str(sched_file)],
                  tmp / "scheduler.log")  # fmt: skip
        for i, addr in enumerate(net.addresses):
            net.spawn(i, [py, "-m", "distributed.cli.dask_worker", "--scheduler-file",
                          str(sched_file), "--host", addr, "--nworkers", "2", "--nthreads", "1",
                          "--no-dashboard"], tmp / f"workers{i}.log")  # fmt: skip
        yield net, sched_file
    finally:
        net.down()


DRIVER = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from distributed import Client
    import dask_ddp

    def train():
        ctx = dask_ddp.get_context()
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(ctx.rank)
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(16, 8, generator=g)).pow(2).mean().backward()
            opt.step()
        return {
            "rank": ctx.rank, "local_rank": ctx.local_rank, "node_rank": ctx.node_rank,
            "local_world_size": ctx.local_world_size, "worker": ctx.worker,
            "master_addr": os.environ["MASTER_ADDR"],
            "weights": [float(v) for v in model.module.weight.detach().flatten()],
        }

    with Client(scheduler_file=sys.argv[1]) as client:
        client.wait_for_workers(4, timeout="120s")
        print(json.dumps(dask_ddp.launch(client, train).result(timeout=240)))
    """
)


def test_ddp_job_across_two_hosts(hosts: tuple[_Hosts, Path], tmp_path: Path) -> None:
    net, sched_file = hosts
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    done = net.run(0, [sys.executable, str(driver), str(sched_file)], timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    hosts_of = [o["worker"].split("://")[1].rsplit(":", 1)[0] for o in out]
    assert hosts_of == [net.addresses[0]] * 2 + [net.addresses[1]] * 2  # grouped by host
    assert [o["local_rank"] for o in out] == [0, 1, 0, 1]
    assert [o["node_rank"] for o in out] == [0, 0, 1, 1]
    assert {o["local_world_size"] for o in out} == {2}
    assert {o["master_addr"] for o in out} == {net.addresses[0]}  # rank 0's host, not loopback
    assert all(o["weights"] == out[0]["weights"] for o in out)  # DDP kept replicas in step

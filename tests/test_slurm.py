"""HPC users: dask-jobqueue's ``SLURMCluster`` against a real one-node Slurm, started here.

The fixture starts Debian's ``munged``, ``slurmctld`` and ``slurmd`` (packages ``munge``,
``slurmctld``, ``slurmd``, ``slurm-client``; ``.ci/run`` installs them where it runs as
root) on loopback, with a configuration of its own in a temporary folder and ports the OS
picked, and stops them after. It skips cleanly where it cannot: not root, or no Slurm.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from distributed import Client

import dask_ddp

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-node Slurm on loopback; its ``SLURM_CONF`` (set in this process's environment
    while the module's tests run, as dask-jobqueue's ``sbatch`` calls need it)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("a one-node Slurm is started as root")
    missing = [
        d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()
    ]
    if missing:
        pytest.skip(f"no Slurm here (missing {missing}; apt-get install slurmctld slurmd "
                    "slurm-client munge)")  # fmt: skip
    root = tmp_path_factory.mktemp("slurm")
    for folder in ("state", "spool", "log", "munge"):
        (root / folder).mkdir()
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = root / "munge" / "sock"
    subprocess.run(
        ["munged", f"--key-file={key}", f"--socket={sock}", f"--pid-file={root}/munge/pid",
         f"--log-file={root}/munge/log", f"--seed-file={root}/munge/seed", "-f"],
        check=True, timeout=30,
    )  # fmt: skip
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(
        textwrap.dedent(f"""\
        ClusterName=dask-ddp-test
        SlurmctldHost={host}(127.0.0.1)
        SlurmctldPort={_free_port()}
        SlurmdPort={_free_port()}
        AuthType=auth/munge
        AuthInfo=socket={sock}
        CredType=cred/munge
        SlurmUser=root
        SlurmdUser=root
        StateSaveLocation={root}/state
        SlurmdSpoolDir={root}/spool
        SlurmctldPidFile={root}/ctld.pid
        SlurmdPidFile={root}/d.pid
        SlurmctldLogFile={root}/log/ctld.log
        SlurmdLogFile={root}/log/d.log
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        SelectType=select/cons_tres
        SelectTypeParameters=CR_Core
        ReturnToService=2
        MpiDefault=none
        NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 2} RealMemory=8000 State=UNKNOWN
        PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
        """)
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    try:
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon, "-f", str(conf)], check=True, timeout=30, env=env)
        deadline = time.monotonic() + 60
        while (
            "idle"
            not in subprocess.run(
                ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env
            ).stdout
        ):
            assert time.monotonic() < deadline, (root / "log" / "ctld.log").read_text()[-3000:]
            time.sleep(0.2)
        old = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(conf)
        try:
            yield {"SLURM_CONF": str(conf), "root": str(root)}
        finally:
            if old is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = old
    finally:
        for pid_file in (root / "d.pid", root / "ctld.pid", root / "munge" / "pid"):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)


def _jobs(env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        ["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, check=True,
        env={**os.environ, **env},
    )  # fmt: skip
    return done.stdout.split("\n")[:-1]


@pytest.mark.slow
def test_two_batch_job_workers_of_two_ranks_each(slurm: dict[str, str]) -> None:
    from dask_jobqueue import SLURMCluster

    # Defined here, pickled by value: the batch jobs' workers do not import the tests.
    def _spins() -> None:
        dask_ddp.report({"started": 1})
        while True:
            pass

    def _where() -> tuple[int, int, str]:
        import distributed
        import torch.distributed as dist

        return dist.get_rank(), dask_ddp.get_context().local_rank, distributed.get_worker().address

    cluster = SLURMCluster(
        cores=1, processes=1, memory="2GB", walltime="00:20:00", python=sys.executable,
        scheduler_options={"host": "127.0.0.1", "dashboard_address": ":0"},
        worker_extra_args=["--host", "127.0.0.1"],
        job_extra_directives=[f"--output={slurm['root']}/job-%j.out"],
        local_directory=slurm["root"], log_directory=slurm["root"],
    )  # fmt: skip
    try:
        cluster.scale(jobs=2)
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=180)
            assert len(_jobs(slurm)) == 2
            out = dask_ddp.launch(client, _where, ranks_per_worker=2).result(timeout=180)
            assert [rank for rank, *_ in out] == [0, 1, 2, 3]
            workers = [w for *_, w in out]
            assert workers[0] == workers[1] != workers[2] == workers[3]
            pids = client.run(os.getpid)
            # A cancel while the ranks spin frees both batch jobs' workers, which keep
            # their processes.
            job = dask_ddp.launch(client, _spins, ranks_per_worker=2)
            started = set()
            for record in job.iter_metrics(timeout=120):
                started.add(record.rank)
                if len(started) == 4:
                    break
            job.cancel()
            assert job.state is dask_ddp.JobState.CANCELLED
            assert client.run(os.getpid) == pids
            assert dask_ddp.launch(client, _where).result(timeout=120)[1][0] == 1
    finally:
        cluster.close()
    deadline = time.monotonic() + 60
    while _jobs(slurm):  # scancel is asynchronous: the jobs end within moments
        assert time.monotonic() < deadline, f"Slurm jobs left after close(): {_jobs(slurm)}"
        time.sleep(0.2)

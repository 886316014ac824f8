"""A rank is a process of its own: stopped anywhere without touching its worker.

Each kind of rank that used to cost its worker a restart (spinning in Python, blocked in C
with SIGTERM ignored, iterating a DataLoader, waiting in a collective for a peer that
sleeps) is cancelled on a cluster with the default configuration: the workers keep their
processes and the data persisted on them, and no process of the rank is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import dask
import dask.array as da
import distributed
import processes
import psutil
import pytest
import torch
import torch.distributed as dist
from distributed import Client, LocalCluster, wait
from distributed.utils_test import poll_for

import dask_ddp

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import storms  # noqa: E402  (its rounds' kinds of stuck ranks, and its checks)


@pytest.fixture(scope="module")
def stopping_cluster() -> Iterator[LocalCluster]:
    """Its own cluster: its tests stop ranks on it (with the default configuration)."""
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as cluster:
        yield cluster


@pytest.mark.parametrize(
    "kind", ["spins", pytest.param("blocked", marks=pytest.mark.slow), "loader", "collective"]
)
def test_a_stopped_rank_ends_its_process_tree_and_never_its_worker(
    stopping_cluster: LocalCluster, kind: str
) -> None:
    with Client(stopping_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        kept = client.persist(da.arange(1000, chunks=100))  # on both workers
        wait(kept)
        held = {k: sorted(v) for k, v in client.who_has(kept).items()}
        pids = client.run(os.getpid)
        job = dask_ddp.launch(client, storms.train_until_stopped, args=(kind,))
        started = set()
        for record in job.iter_metrics(timeout=60):  # every rank is where its kind stops
            if kind != "loader" or record.step is not None:  # a batch came
                started.add(record.rank)
            if len(started) == 2:
                break
        time.sleep(0.3)  # the sleepers asleep, rank 0 inside all_reduce
        began = time.monotonic()
        job.cancel()
        took = time.monotonic() - began
        assert job.state is dask_ddp.JobState.CANCELLED
        grace = dask.config.get("ddp.failure-grace")
        assert storms.left_behind(client) == {}  # the rank's whole tree is gone
        assert client.run(os.getpid) == pids  # no worker was restarted
        assert {k: sorted(v) for k, v in client.who_has(kept).items()} == held
        assert kept.sum().compute() == sum(range(1000))
        print(f"{kind}: cancel() took {took:.2f} s (ddp.failure-grace {grace})")
        assert dask_ddp.launch(client, dist.get_world_size).result(timeout=60) == [2, 2]


def _hung_at_step(step: int) -> None:
    t = torch.ones(1)
    for i in range(10):
        if i == step and dist.get_rank() == 1:
            dask_ddp.report({"hung": 1}, step=i)
            time.sleep(600)  # the user's own hang
        dist.all_reduce(t)


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def _stalled(job: dask_ddp.Job, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entries = [t for t in job.history if t.state is dask_ddp.JobState.STALLED]
        if entries:
            return entries[-1]
        time.sleep(0.05)
    raise AssertionError(f"no 'stalled' entry in {timeout} s: {job.history}")


def test_a_hung_job_says_it_stalled_and_where_each_rank_is(
    stopping_cluster: LocalCluster,
) -> None:
    with Client(stopping_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        pids = client.run(os.getpid)
        job = dask_ddp.launch(client, _hung_at_step, args=(5,), stall_timeout=2)
        for record in job.iter_metrics(timeout=60):
            if record.metrics.get("hung"):
                hung_at = record.time
                break
        entry = _stalled(job)
        assert job.state is dask_ddp.JobState.STALLED
        assert "rank 1 in _hung_at_step (test_rank_process.py:" in entry.reason
        assert "waiting in a collective: rank(s) 0" in entry.reason
        print(f"stalled {entry.time - hung_at:.2f} s after the hang (stall_timeout 2 s)")
        assert job.view_state()["waiting"] == f"stalled: {entry.reason}"  # the views' line
        metrics = _get(stopping_cluster.dashboard_link.replace("/status", "/metrics"))
        assert 'dask_ddp_jobs{state="stalled"} 1.0' in metrics
        stacks = job.stacks()
        assert sorted(stacks) == [0, 1]
        assert "in _hung_at_step" in stacks[1] and "in all_reduce" not in stacks[1]
        assert "in all_reduce" in stacks[0]  # blocked in C++, dumped all the same
        job.cancel()
        assert job.stacks() == {}
        assert client.run(os.getpid) == pids
        assert storms.left_behind(client) == {}


def _pauses(seconds: float) -> int:
    t = torch.ones(1)
    for i in range(4):
        dask_ddp.report({"i": i}, step=i)
        if i == 1:
            time.sleep(seconds)  # every rank: no progress for a while, then on
        dist.all_reduce(t)
    return dist.get_rank()


@pytest.mark.slow
def test_a_stall_clears_when_progress_resumes(client: Client) -> None:
    job = dask_ddp.launch(client, _pauses, args=(4.0,), stall_timeout=1)
    assert job.result(timeout=60) == [0, 1]
    states = [t.state.value for t in job.history]
    assert states == ["running", "stalled", "running", "succeeded"], job.history
    assert job.history[2].reason == "progress resumed"


def test_stall_action_fail_ends_the_job_with_the_ranks_named(client: Client) -> None:
    with dask.config.set({"ddp.stall-action": "fail"}):
        job = dask_ddp.launch(client, _hung_at_step, args=(1,), stall_timeout=1)
    with pytest.raises(dask_ddp.errors.JobStalledError, match="rank 1 in _hung_at_step") as info:
        job.result(timeout=60)
    assert info.value.ranks == (1,)
    assert job.wait_stopped(timeout=60)
    assert [t.state.value for t in job.history] == ["running", "stalled", "stopping", "failed"]


def test_a_stall_timeout_of_zero_turns_it_off(client: Client) -> None:
    job = dask_ddp.launch(client, _pauses, args=(2.0,), stall_timeout=0)
    assert job.result(timeout=60) == [0, 1]
    assert [t.state.value for t in job.history] == ["running", "succeeded"]


def _as_in_a_task() -> tuple[str, int]:
    from distributed import Variable, get_client, get_worker

    worker = get_worker()
    rank = dask_ddp.get_context().rank
    worker.log_event("dask-ddp-test-rank-events", {"rank": rank})
    Variable("dask-ddp-test-seen", client=get_client()).set(rank)
    return worker.address, rank


def test_a_rank_s_process_has_its_worker_and_a_client_as_a_task_does(client: Client) -> None:
    job = dask_ddp.launch(client, _as_in_a_task)
    assert job.result(timeout=60) == [(w, r) for r, w in enumerate(job.workers)]
    events = client.get_events("dask-ddp-test-rank-events")
    assert sorted(msg["rank"] for _, msg in events) == [0, 1]
    from distributed import Variable

    assert Variable("dask-ddp-test-seen", client=client).get(timeout=10) in (0, 1)


def _talk_from_a_fork() -> tuple[str, int]:
    from distributed import get_worker

    pid = os.fork()
    if pid == 0:  # a DataLoader worker would be such a child
        try:
            get_worker().log_event("dask-ddp-test-fork-events", {"from": "fork"})
        except dask_ddp.errors.ChannelError as exc:
            os._exit(3 if "forked from the rank" in str(exc) else 4)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    dask_ddp.report({"after": 1})  # the rank's own link still works
    return "forked", os.waitstatus_to_exitcode(status)


def test_only_the_rank_s_own_process_talks_to_its_worker(client: Client) -> None:
    # A process forked from the rank shares its pipe: its writes would land among the
    # rank's, and a call would wait forever for an answer the rank's thread takes.
    job = dask_ddp.launch(client, _talk_from_a_fork)
    assert job.result(timeout=60) == [("forked", 3), ("forked", 3)]
    assert client.get_events("dask-ddp-test-fork-events") == ()
    assert sorted(r.rank for r in job.metrics) == [0, 1]


class _StoppedWhilePickled:
    """A return value whose pickling (the rank's end path, after its function returned)
    gets the rank's process a SIGTERM: a cancel racing the rank's last message."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple:
        import signal

        os.kill(os.getpid(), signal.SIGTERM)  # the kernel may hand it to any thread
        time.sleep(0.2)  # a handler, if one is set, runs by now
        return (bytes, (self.data,))


def _returns_a_value_stopped_while_pickled() -> _StoppedWhilePickled:
    return _StoppedWhilePickled(b"done")


def test_a_stop_during_the_rank_s_last_message_changes_nothing(client: Client) -> None:
    # Once the function returned, the rank says how it ended: a SIGTERM then must not
    # interrupt that message (it did, through the rank's other threads, with the signal
    # only blocked in its main thread).
    job = dask_ddp.launch(client, _returns_a_value_stopped_while_pickled)
    assert job.result(timeout=120) == [b"done", b"done"]


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _collects() -> tuple[int, int]:
    import gc

    _Cycle()  # the rank's own garbage
    return gc.get_freeze_count(), gc.collect()


def test_a_rank_s_first_full_collection_leaves_the_template_s_objects_alone(
    client: Client,
) -> None:
    # Without the template's objects frozen, a rank's first full collection walked all of
    # them (350,000 with torch): 250 ms of CPU, and 89 MB of the template's pages copied
    # into the rank's process. The rank's own garbage is still collected.
    for frozen, collected in dask_ddp.launch(client, _collects).result(timeout=120):
        assert frozen > 100_000  # out of the collector's sight
        assert collected >= 1  # the cycle


def _said_by_a_fork(preload: list[str], target: Any) -> str:
    """What ``target(fds)`` writes into ``fds[0]`` in a process forked from a fork server
    that preloaded ``preload`` (the process must end well)."""
    from dask_ddp._rank import forkserver

    server = forkserver.start(preload)
    read, write = os.pipe()
    try:
        process = forkserver.fork(server.address, target, (), [write])
        os.close(write)
        process.join(180)
        with os.fdopen(read) as result:
            said = result.read()
    finally:
        server.stop()
    assert process.exitcode == 0, said
    return said


def _set_up_here(fds: list[int]) -> None:
    """In a process forked from a fork server: what the template's set-up leaves."""
    import gc

    from torch.distributed.distributed_c10d import Backend

    with os.fdopen(fds[0], "w") as out:
        out.write(f"{'GLOO' in Backend._plugins} {gc.get_freeze_count() > 0}")


@pytest.mark.parametrize("template", [True, False])
def test_only_the_template_sets_itself_up(template: bool) -> None:
    # The template registers gloo once (torch 2.14 reads every installed package's entry
    # points on a backend's first use: 6-10 ms of each rank's process) and freezes its
    # objects before each fork. Any other fork server (and any process that imports the
    # module: the suite's doctests) is left as it was.
    preload = ["torch.distributed", "dask_ddp._rank.template"]
    if template:
        preload.append("dask_ddp._rank.template:prepare")
    said = _said_by_a_fork(preload, _set_up_here).split()
    assert said == [str(template), "True"]  # every fork server freezes before it forks


def test_a_spare_reads_its_go_itself_and_its_reader_takes_over() -> None:
    # The spare's own thread waits for the go (a go read by another thread would cost the
    # rank's start that thread's wake-up); from the go on, the link's reader reads.
    import multiprocessing
    import queue

    from dask_ddp._rank import rankproc

    task_end, rank_end = multiprocessing.Pipe(duplex=True)
    link = rankproc.RankLink(rank_end, rankproc._ThreadAhead(), [])
    with pytest.raises(queue.Empty):
        link.next_go(0.05)
    from dask_ddp._rank import link as wire

    go = wire.Go(b"payload", None, None, None, None)
    task_end.send(go)
    assert link.next_go(5) == go
    task_end.send(wire.Stop("stopped by the test", 1))
    assert link.stop_told.wait(5)  # the reader took it
    assert link.stop == ("stopped by the test", 1)
    task_end.close()


@pytest.mark.parametrize("first", ["stop", "closed"])
def test_a_spare_stopped_or_let_go_before_its_go_just_returns(first: str) -> None:
    import multiprocessing

    from dask_ddp._rank import rankproc

    task_end, rank_end = multiprocessing.Pipe(duplex=True)
    link = rankproc.RankLink(rank_end, rankproc._ThreadAhead(), [])
    if first == "stop":
        from dask_ddp._rank import link as wire

        task_end.send(wire.Stop("cancelled while it started", None))
    else:
        task_end.close()
    assert link.next_go(5) is None


def test_the_interface_of_an_address_is_read_again_when_it_is_new(monkeypatch) -> None:
    # The machine's addresses are read once per process (the template's: each rank's
    # process inherits them), and again for an address not among them.
    import collections

    import psutil

    from dask_ddp._rank import process as _process

    _process._interfaces.cache_clear()
    assert _process.interface_of("127.0.0.1") == "lo"
    assert _process.interface_of("192.0.2.77") is None
    Address = collections.namedtuple("Address", "address")
    added = {**psutil.net_if_addrs(), "test0": [Address("192.0.2.77")]}
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: added)
    assert _process.interface_of("192.0.2.77") == "test0"
    _process._interfaces.cache_clear()


OFFLINE_REHEARSAL = """
import torch.distributed as dist
from dask_ddp._rank import rankproc as _rankproc

def no_connections(*args, **kwargs):
    raise AssertionError("the rehearsal connected to a store")

dist.TCPStore = no_connections
_rankproc.logger.debug = lambda *args, **kwargs: (_ for _ in ()).throw(AssertionError(args))
_rankproc._rehearse_start()
assert not dist.is_initialized()
"""


def test_a_spare_s_rehearsal_goes_nowhere_over_the_network() -> None:
    # torch looks each store connection's address up by name at both ends (a DNS query
    # each). The spares of a job rehearsing connections all at once made the resolver lose
    # queries, the ranks' own among them, and each loss held a rank's start 5 s.
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", OFFLINE_REHEARSAL], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


# -- where the template lives -----------------------------------------------------------------
_GIVEN = "DASK_DDP_TEST_WORKER_ENV"


def _template_of_rank() -> tuple[int, int, str | None]:
    """In a rank: its template's pid, its worker's, and what its worker's environment says."""
    return os.getppid(), distributed.get_worker().pid, os.environ.get(_GIVEN)


def _workers_other_than(client: Client, gone: int) -> list[int]:
    pids: list[int] = []

    def replaced() -> bool:
        pids[:] = client.run(os.getpid, on_error="ignore").values()  # the lost one may answer
        return len(pids) == 2 and gone not in pids

    poll_for(replaced, timeout=60)
    return pids


def test_ranks_fork_from_their_nanny_s_template_which_outlives_a_lost_worker() -> None:
    # A worker's template used to die with it: its replacement imported torch and dynamo
    # again on the restart's path (a plain restart took 4.3 s against 3.0 s when ranks were
    # threads). The nanny's process (this one, for a LocalCluster) keeps one for its workers.
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
            env={_GIVEN: "given"},
        ) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        before_workers = list(client.scheduler_info()["workers"])
        before = dask_ddp.launch(client, _template_of_rank).result(timeout=120)
        # The workers never import torch (their GPUs are counted, and rank 0's store held,
        # in processes forked from the template): 1.5-3 s of CPU each on a fresh cluster.
        assert client.run(lambda: "torch" in sys.modules) == dict.fromkeys(before_workers, False)
        templates = {template for template, _, _ in before}
        assert len(templates) == 1, before  # one for both workers
        template = psutil.Process(templates.pop())
        assert template.ppid() == os.getpid()
        # Each rank has its worker's environment, which the nanny's process has not.
        assert [given for *_, given in before] == ["given", "given"]
        assert _GIVEN not in os.environ
        lost = before[1][1]
        os.kill(lost, signal.SIGKILL)
        workers = _workers_other_than(client, lost)
        after = dask_ddp.launch(client, _template_of_rank).result(timeout=120)
        assert {template for template, _, _ in after} == {template.pid}
        assert sorted(worker for _, worker, _ in after) == sorted(workers)
        assert [given for *_, given in after] == ["given", "given"]


LAST_NANNY_CLOSES = """
import os, psutil
from distributed import Client, LocalCluster
import dask_ddp

if __name__ == "__main__":
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            [template] = set(dask_ddp.launch(client, os.getppid).result(timeout=120))
        template = psutil.Process(template)
        assert template.ppid() == os.getpid()
    template.wait(timeout=30)
    print("ended")
"""


@pytest.mark.slow
def test_the_nanny_s_template_ends_when_the_last_nanny_holding_it_closes(tmp_path) -> None:
    # In a process of its own: the nannies of every cluster in a process share its template
    # (the suite's other clusters would hold this one's).
    script = tmp_path / "last_nanny.py"
    script.write_text(LAST_NANNY_CLOSES)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180
    )
    assert done.stdout.split() == ["ended"], done.stderr[-3000:]


def test_a_nanny_s_template_that_died_is_started_again(own_cluster: LocalCluster) -> None:
    with Client(own_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        first = {t for t, _, _ in dask_ddp.launch(client, _template_of_rank).result(timeout=120)}
        template = psutil.Process(first.pop())
        for process in [*template.children(recursive=True), template]:  # the spares too
            with contextlib.suppress(psutil.NoSuchProcess):  # a child ending of itself meanwhile
                process.kill()
        template.wait(timeout=10)
        again = dask_ddp.launch(client, _template_of_rank).result(timeout=120)
        started = {t for t, _, _ in again}
        assert len(started) == 1 and template.pid not in started
        assert psutil.Process(started.pop()).ppid() == os.getpid()


@pytest.mark.slow
def test_a_worker_without_a_nanny_forks_from_a_template_of_its_own() -> None:
    cluster = processes.DaskProcesses(0)
    try:
        cluster.workers.append(cluster.add_worker(None, "--no-nanny"))

        def template_and_worker() -> tuple[int, int]:  # pickled by value, for `dask worker`
            return os.getppid(), distributed.get_worker().pid

        with Client(cluster.address) as client:
            client.wait_for_workers(1, timeout=120)
            [(template, worker)] = dask_ddp.launch(client, template_and_worker).result(120)
        assert psutil.Process(template).ppid() == worker
    finally:
        cluster.close()


def test_a_template_given_out_is_never_stopped_while_held() -> None:
    # The nannies of a process hold its template; the last to let go stops it. A nanny that
    # took hold while the last one was letting go must get a template that forks, not the
    # one being stopped (the suite met "Connection refused" in a probe once). The stop is
    # slowed here, so that the second nanny comes in the middle of it.
    import threading

    from dask_ddp._rank import template as _template

    stopping = threading.Event()

    class SlowToStop(_template._Own):
        def stop(self) -> None:
            stopping.set()
            time.sleep(0.3)  # the other nanny takes hold and asks for the address meanwhile
            super().stop()

    template = SlowToStop(preload=[])  # starts in milliseconds
    template.hold()
    first, _ = template.address()
    letting_go = threading.Thread(target=template.release)
    letting_go.start()
    stopping.wait(10)
    template.hold()
    given, _ = template.address()
    letting_go.join()
    try:
        assert given != first and os.path.exists(given)
    finally:
        template.release()


def _cuda_calls(fds: list[int]) -> None:
    """In a process forked from a fork server that preloaded ``cuda_watch``: the template's
    calls of torch's lazy CUDA initialisation, as it recorded them."""
    import cuda_watch
    import torch

    with os.fdopen(fds[0], "w") as out:
        out.write(repr((len(cuda_watch.calls), torch.cuda.is_initialized(), cuda_watch.calls)))


def test_the_template_never_initialises_cuda() -> None:
    # A process forked from a template whose CUDA started could not use CUDA at all; the
    # template imports what every rank imports, and sets itself up, without starting it.
    import ast

    from dask_ddp._rank import template

    said = _said_by_a_fork(["cuda_watch", *template.PRELOAD], _cuda_calls)
    calls, initialised, where = ast.literal_eval(said)
    assert (calls, initialised) == (0, False), where


def _exit_with(fds: list[int], code: int) -> None:
    sys.exit(code)


def test_a_worker_killed_mid_request_leaves_the_template_forking() -> None:
    # A nanny's template serves every worker in its process: one killed between connecting
    # and sending its request (the suite's worker kills met it twice) ended multiprocessing's
    # forkserver loop (EOFError), and the other workers' next forks were refused.
    import socket

    from dask_ddp._rank import forkserver

    server = forkserver.start([])
    try:
        with socket.socket(socket.AF_UNIX) as cut_off:
            cut_off.connect(server.address)  # and gone, as a killed worker's
        with socket.socket(socket.AF_UNIX) as half:
            half.connect(server.address)
            half.send(b"\x10\x00")  # the start of a request's length, then gone
        process = forkserver.fork(server.address, _exit_with, (3,))  # served after them
        process.join(120)
        assert process.exitcode == 3
        assert server.running()
    finally:
        server.stop()


OWNER_KILLED = """
import sys
from dask_ddp._rank import forkserver
server = forkserver.start([])
print(server.address, server.pid, flush=True)
sys.stdin.read()
"""


def test_a_template_whose_owner_was_killed_removes_its_socket_and_folder() -> None:
    # A worker's process killed (a nanny's kill, OOM) never calls stop(): each one left a
    # dask-ddp-* folder in the temporary directory, hundreds in a day of the suite.
    import psutil

    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_KILLED],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address, pid = owner.stdout.readline().split()
        server = psutil.Process(int(pid))
        assert os.path.exists(address)
    finally:
        owner.kill()
        owner.wait(30)
    server.wait(60)  # it sees its owner's pipe close, after its imports
    assert not os.path.exists(os.path.dirname(address))


def _sleeps(fds: list[int]) -> None:
    time.sleep(60)


def test_a_forked_process_s_end_is_told_with_its_signal() -> None:
    from dask_ddp._rank import forkserver

    server = forkserver.start([])
    try:
        process = forkserver.fork(server.address, _sleeps)
        process.join(0.1)
        assert process.exitcode is None and process.is_alive()
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)
        assert process.exitcode == -signal.SIGKILL
    finally:
        server.stop()
    server.process.wait(30)  # it exits once let go


def _use_a_held_store() -> dict[str, Any]:
    """In a worker's task (a thread of its, as the probe's): a store held by its store
    host, used as the worker uses a job's."""
    from datetime import timedelta

    import psutil

    from dask_ddp._rank.host import host_for

    worker = distributed.get_worker()
    stores = host_for(worker).stores
    store = stores.open(worker.ip, 30)
    store.set_timeout(timedelta(seconds=0.2))
    out: dict[str, Any] = {"port": store.port}
    out["set"] = store.compare_set("dask-ddp/joined-ready", "", b"aborted")
    out["get"] = store.get("dask-ddp/joined-ready")
    out["check"] = (store.check(["dask-ddp/joined-ready"]), store.check(["nothing"]))
    try:
        store.get("nothing")  # waits out the store's timeout
    except Exception as exc:
        out["error"] = (type(exc).__module__, type(exc).__name__)
    host = stores.pid

    def listening() -> bool:
        return any(
            c.status == psutil.CONN_LISTEN and c.laddr.port == out["port"]
            for c in psutil.Process(host).net_connections(kind="tcp")
        )

    out["listened"] = listening()
    del store  # let go: closed in its host (as a TCPStore is when let go)
    stores.open(worker.ip, 30).close()  # a call after: the close went
    deadline = time.monotonic() + 10
    while listening() and time.monotonic() < deadline:  # torch stops its server's loop
        time.sleep(0.05)
    out["listens after"] = listening()
    return out


def test_a_store_held_for_the_worker_answers_its_calls_and_closes_when_let_go(
    client: Client,
) -> None:
    out = client.submit(_use_a_held_store, pure=False).result(timeout=120)
    assert out["set"] == b"aborted" and out["get"] == b"aborted"
    assert out["check"] == (True, False)
    # torch's DistStoreError arrives as the builtin it derives from: no torch in the worker
    assert out["error"][0] == "builtins", out["error"]
    assert out["listened"] and not out["listens after"]

"""The process-level measures of a rank (dask_ddp._process), each on the real thing."""

from __future__ import annotations

import multiprocessing
import os
import socket
import types

import pytest
import torch.distributed as dist

from dask_ddp import _process


def test_fresh_group_names_undoes_what_a_failed_init_left() -> None:
    from torch.distributed import distributed_c10d as c10d

    c10d._world.group_count = 3  # what failed init_process_group calls leave behind
    _process.fresh_group_names()
    assert c10d._world.group_count == 0  # the next group is named as in a fresh process


def test_groups_watched_sees_a_group_made_by_the_script_and_restores_torch() -> None:
    import torch.distributed as dist

    original, seen = dist.init_process_group, []
    with _process.groups_watched(seen.append, set()):
        assert dist.init_process_group is not original
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            assert dist.is_initialized()
        finally:
            dist.destroy_process_group()
    assert dist.init_process_group is original
    # The group's sockets once made, and none once it was destroyed (their fds closed).
    assert len(seen) == 2 and isinstance(seen[0], frozenset) and seen[1] == frozenset()


def _grandchild() -> None:
    pass


def _daemonic(allowed: bool, results: multiprocessing.Queue) -> None:
    with _process.children_allowed(allowed):
        try:
            child = multiprocessing.get_context("fork").Process(target=_grandchild)
            child.start()
            child.join()
            results.put("started")
        except AssertionError as exc:  # "daemonic processes are not allowed to have children"
            results.put(str(exc))
    results.put(multiprocessing.current_process().daemon)


@pytest.mark.parametrize("allowed", [True, False])
def test_children_allowed_lifts_the_daemon_flag_for_the_block(allowed: bool) -> None:
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    proc = ctx.Process(target=_daemonic, args=(allowed, results), daemon=True)
    proc.start()
    outcome, daemon_after = results.get(timeout=60), results.get(timeout=60)
    proc.join(60)
    assert outcome == "started" if allowed else "daemonic" in outcome
    assert daemon_after is True  # restored after the block


def test_sever_shuts_down_only_the_new_non_dask_connections() -> None:
    dask_listener = socket.create_server(("127.0.0.1", 0))
    gloo_listener = socket.create_server(("127.0.0.1", 0))
    before = _process.socket_fds()
    dask_conn = socket.create_connection(dask_listener.getsockname())
    dask_peer, _ = dask_listener.accept()
    gloo_conn = socket.create_connection(gloo_listener.getsockname())
    gloo_peer, _ = gloo_listener.accept()
    socks = [dask_listener, gloo_listener, dask_conn, dask_peer, gloo_conn, gloo_peer]
    try:
        assert {s.fileno() for s in socks[2:]} <= _process.socket_fds()
        links = _process.process_group_links(before, {dask_listener.getsockname()[1]})
        assert links == {gloo_conn.fileno(), gloo_peer.fileno()}

        _process.sever(links)
        gloo_peer.settimeout(10)
        assert gloo_peer.recv(1) == b""  # the peer sees the connection closed at once
        os.fstat(gloo_conn.fileno())  # shut down, not closed: the fd stays its owner's
        dask_conn.sendall(b"x")
        assert dask_peer.recv(1) == b"x"  # Dask's comms are untouched
    finally:
        for s in socks:
            s.close()


def test_dask_ports_names_the_worker_and_its_scheduler() -> None:
    worker = types.SimpleNamespace(
        port=40311, scheduler=types.SimpleNamespace(address="tcp://10.0.0.7:8786")
    )
    assert _process.dask_ports(worker) == {40311, 8786}


@pytest.mark.parametrize(
    ("exc", "lost"),
    [
        (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"), True),
        (dist.DistError("Connection reset by peer"), True),
        (RuntimeError("Broken pipe"), True),
        (RuntimeError("Timed out waiting 1800000ms for recv operation"), False),
        (OSError("Connection closed by peer"), False),
    ],
)
def test_is_peer_loss(exc: BaseException, lost: bool) -> None:
    assert _process.is_peer_loss(exc) is lost


def _start_methods(results) -> None:
    before = multiprocessing.get_start_method()
    with _process.platform_start_method():
        inside = multiprocessing.get_start_method()
    results.put((before, inside, multiprocessing.get_start_method()))


def test_platform_start_method_undoes_what_a_spawned_worker_inherits() -> None:
    # A Dask worker is a spawned process: its own default is spawn, not the platform's.
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_start_methods, args=(results,))
    proc.start()
    outcome = results.get(timeout=60)
    proc.join(60)
    default = multiprocessing.get_all_start_methods()[0]
    assert outcome == ("spawn", default, "spawn")


def _freeze_count_of_a_forked_child() -> int:
    import gc

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what its collector leaves alone, then out at once
        os.write(write, str(gc.get_freeze_count()).encode())
        os._exit(0)
    os.close(write)
    try:
        return int(os.read(read, 64))
    finally:
        os.close(read)
        os.waitpid(pid, 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_inherited_objects_frozen_in_a_child_forked_inside_the_block_only() -> None:
    import gc

    assert gc.get_freeze_count() == 0  # this process has frozen nothing itself
    with _process.inherited_objects_frozen(), _process.inherited_objects_frozen():
        assert _freeze_count_of_a_forked_child() > 1000  # every object it inherited
    assert _freeze_count_of_a_forked_child() == 0
    assert gc.get_freeze_count() == 0  # the parent's own collection is untouched

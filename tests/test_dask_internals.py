"""distributed's private API as dask_ddp uses it (dask_ddp._shared.dask_internals), on a real
cluster.

Each test exercises one function against the installed distributed; the releases they were
checked against are ``_dask_internals.CHECKED_WITH``. A failure after an upgrade names the
function to port.
"""

from __future__ import annotations

import time

import distributed
import pytest
from distributed import Client
from distributed.utils_test import poll_for

import dask_ddp
from dask_ddp._client import topics
from dask_ddp._rank import replicas
from dask_ddp._shared import dask_internals, protocol


# --- used by dask_ddp._rank.channel and dask_ddp._rank.replicas ---
async def _echo(text: str = "") -> str:
    return text.upper()


def _serve_echo(add: bool, dask_worker=None) -> str:
    if add:
        dask_internals.add_worker_handler(dask_worker, "dask_ddp_test_echo", _echo)
    else:
        dask_internals.remove_worker_handler(dask_worker, "dask_ddp_test_echo")
        dask_internals.remove_worker_handler(dask_worker, "dask_ddp_test_echo")  # no error
    return dask_worker.address


async def _call_echo(client: Client, worker: str) -> str:
    return await dask_internals.call_worker(client, worker, "dask_ddp_test_echo", text="hi")


def test_a_worker_handler_is_served_and_removed(client: Client) -> None:
    worker = next(iter(client.run(_serve_echo, True).values()))
    assert client.sync(_call_echo, client, worker) == "HI"
    client.run(_serve_echo, False)
    assert client.run(_serves, "dask_ddp_test_echo", workers=[worker]) == {worker: False}


def _serves(name: str, dask_worker=None) -> bool:
    return name in dask_worker.handlers


def _call_peer_echo(peer: str) -> str:
    # From a task's thread on this worker (as a rank's thread calls it), to another worker.
    worker = distributed.get_worker()
    return dask_internals.call_peer(worker, peer, "dask_ddp_test_echo", 10, text="hey")


def test_call_peer_calls_another_worker_s_handler_from_a_task(client: Client) -> None:
    workers = sorted(client.run(_serve_echo, True).values())
    try:
        future = client.submit(_call_peer_echo, workers[1], workers=[workers[0]], pure=False)
        assert future.result(timeout=30) == "HEY"
    finally:
        client.run(_serve_echo, False)


def _call_peer_each(peer: str, stop_at: int | None) -> tuple[bool, list[tuple[int, str]]]:
    worker = distributed.get_worker()
    got: list[tuple[int, str]] = []

    def on_reply(index: int, reply: str) -> bool:
        got.append((index, reply))
        return index != stop_at

    calls = [{"text": f"piece {i}"} for i in range(9)]
    done = dask_internals.call_peer_each(
        worker, peer, "dask_ddp_test_echo", 10, calls, on_reply, window=3
    )
    return done, got


def test_call_peer_each_hands_over_every_answer_with_its_index_and_stops_when_told(
    client: Client,
) -> None:
    workers = sorted(client.run(_serve_echo, True).values())
    try:
        each = client.submit(_call_peer_each, workers[1], None, workers=[workers[0]], pure=False)
        done, got = each.result(timeout=30)
        assert done and sorted(got) == [(i, f"PIECE {i}") for i in range(9)]
        stop = client.submit(_call_peer_each, workers[1], 2, workers=[workers[0]], pure=False)
        done, got = stop.result(timeout=30)
        # stopped: the calls in flight when it was told (at most window - 1 = 2 others) may
        # still land, in any order; no new one starts
        assert not done and (2, "PIECE 2") in got
        assert len(got) - got.index((2, "PIECE 2")) - 1 <= 2, got
    finally:
        client.run(_serve_echo, False)


def test_the_blob_handler_plugin_serves_every_worker(client: Client) -> None:
    dask_ddp.jobs(client)  # dask-ddp's scheduler plugin is installed: it registers it
    assert set(client.run(_serves, protocol.BLOB_HANDLER).values()) == {True}
    assert set(client.run(_serves, replicas._HANDLER).values()) == {True}


def _topic_names(dask_scheduler=None) -> list[str]:
    return list(dask_scheduler._broker._topics)


def _subscribers(topic: str, dask_scheduler=None) -> list[str]:
    found = dask_scheduler._broker._topics.get(topic)
    return [] if found is None else list(found.subscribers)


def _wait_subscribed(client: Client, topic: str, client_id: str) -> None:
    """Subscribing is asynchronous: poll the scheduler against a deadline."""
    deadline = time.monotonic() + 30
    while client_id not in client.run_on_scheduler(_subscribers, topic):
        assert time.monotonic() < deadline, f"{client_id} never subscribed to {topic}"
        time.sleep(0.01)


def test_drop_topic_forgets_a_finished_topic_and_its_events(client: Client) -> None:
    client.log_event("dask-ddp-test-done", {"n": 1})
    client.subscribe_topic("dask-ddp-test-done", lambda event: None)
    _wait_subscribed(client, "dask-ddp-test-done", client.id)
    assert "dask-ddp-test-done" in client.run_on_scheduler(_topic_names)
    assert client.sync(dask_internals.topic_history, client, "dask-ddp-test-done")

    dropped = client.run_on_scheduler(dask_internals.drop_topic, "dask-ddp-test-done", client.id)
    assert dropped is True
    assert "dask-ddp-test-done" not in client.run_on_scheduler(_topic_names)
    assert client.get_events("dask-ddp-test-done") == ()
    # A forgotten job's topic goes whoever still follows it.
    client.log_event("dask-ddp-test-forgotten", {"n": 1})
    client.subscribe_topic("dask-ddp-test-forgotten", lambda event: None)
    _wait_subscribed(client, "dask-ddp-test-forgotten", client.id)
    assert client.run_on_scheduler(dask_internals.drop_topic, "dask-ddp-test-forgotten", None)
    assert "dask-ddp-test-forgotten" not in client.run_on_scheduler(_topic_names)


def test_drop_topic_keeps_a_topic_another_client_follows(client: Client) -> None:
    with Client(client.scheduler.address) as other:
        other.subscribe_topic("dask-ddp-test-shared", lambda event: None)
        client.log_event("dask-ddp-test-shared", {"n": 1})
        _wait_subscribed(client, "dask-ddp-test-shared", other.id)
        dropped = client.run_on_scheduler(
            dask_internals.drop_topic, "dask-ddp-test-shared", client.id
        )
        assert dropped is False
        assert "dask-ddp-test-shared" in client.run_on_scheduler(_topic_names)
    assert client.run_on_scheduler(dask_internals.drop_topic, "no-such-topic", client.id) is False


# --- used by dask_ddp.data ---
def _read_here(keys: list[str]) -> dict:
    from distributed import get_worker

    return dask_internals.read_worker_data(get_worker(), keys)


def test_read_worker_data_reads_this_workers_memory(client: Client) -> None:
    w0, w1 = sorted(client.scheduler_info(n_workers=-1)["workers"])
    [held] = client.scatter([list(range(5))], workers=[w0])
    here = client.submit(_read_here, [held.key, "no-such-key"], workers=[w0], pure=False)
    assert here.result(timeout=30) == {held.key: [0, 1, 2, 3, 4]}
    elsewhere = client.submit(_read_here, [held.key], workers=[w1], pure=False)
    assert elsewhere.result(timeout=30) == {}


def test_task_states_and_desire_keys(client: Client, cluster: distributed.LocalCluster) -> None:
    [held] = client.scatter([41])
    assert dask_internals.task_states(client, [held.key, "no-such-key"]) == {
        held.key: "memory",
        "no-such-key": None,
    }
    with Client(cluster) as other:  # a second client, as a rank's, knows only the key
        dask_internals.desire_keys(other, [held.key])
        future = distributed.Future(held.key, other)
        assert future.result(timeout=30) == 41
        future.release()


def test_our_subscription_keeps_the_users_handler_on_the_same_topic(client: Client) -> None:
    seen: list[str] = []
    client.subscribe_topic("users-topic", lambda ev: seen.append(f"user {ev[1]}"))
    assert dask_internals.topic_handler(client, "users-topic") is not None
    stop = topics.follow(client, "users-topic", lambda ev: seen.append(f"ours {ev[1]}"))

    def seen_after_logging(*expected: str) -> bool:
        # Client.log_event travels apart from the subscription: log until it got there.
        client.log_event("users-topic", expected[0].split()[1])
        return set(expected) <= set(seen)

    poll_for(lambda: seen_after_logging("ours a", "user a"), timeout=10)
    stop()
    poll_for(lambda: seen_after_logging("user b"), timeout=10)
    assert "ours b" not in seen
    client.unsubscribe_topic("users-topic")


# --- used by dask_ddp._scheduler.page ---
def test_http_prefix_and_removing_an_application(client: Client) -> None:
    assert client.run_on_scheduler(lambda dask_scheduler: dask_internals.http_prefix(
        dask_scheduler)) == "/"  # fmt: skip

    def add_and_remove(dask_scheduler=None) -> tuple[bool, bool]:
        from tornado import web

        http = dask_scheduler.http_application
        app = web.Application([("/dask-ddp-test", web.RedirectHandler, {"url": "/"})])
        http.add_application(app)
        added = app in http.applications
        dask_internals.remove_http_application(http, app)
        dask_internals.remove_http_application(http, app)  # twice: no error
        return added, app in http.applications

    assert client.run_on_scheduler(add_and_remove) == (True, False)


# --- used by dask_ddp's scheduler plugin ---
def _left_behind(dask_scheduler=None) -> str | None:
    # A task pinned to a worker address that does not exist: "no-worker" for good.
    task = dask_scheduler.tasks.get("dask-ddp-test-pinned")
    return None if task is None else task.state


def _fail_it(dask_scheduler=None) -> bool:
    import pickle

    error = dask_ddp.WorkerLostError(0, "tcp://10.0.0.9:1", "dask-ddp-test-pinned")
    return dask_internals.fail_task(dask_scheduler, "dask-ddp-test-pinned", pickle.dumps(error))


def test_fail_task_fails_a_task_without_a_worker(client: Client) -> None:
    pinned = client.submit(
        time.time, key="dask-ddp-test-pinned", workers=["tcp://10.0.0.9:1"],
        allow_other_workers=False, pure=False,
    )  # fmt: skip
    poll_for(lambda: client.run_on_scheduler(_left_behind) == "no-worker", timeout=10)
    assert client.run_on_scheduler(_fail_it) is True
    assert isinstance(pinned.exception(timeout=10), dask_ddp.WorkerLostError)
    assert client.run_on_scheduler(_fail_it) is False  # not without a worker any more


def _published_client(name: str, drop: bool, dask_scheduler=None) -> tuple[bool, bool]:
    dropped = dask_internals.drop_published_client(dask_scheduler, name) if drop else False
    return dropped, f"published-{name}" in dask_scheduler.clients


def test_drop_published_client_forgets_what_unpublishing_leaves(client: Client) -> None:
    name = "dask-ddp-test-published"
    client.publish_dataset(client.submit(time.time, pure=False), name=name)
    # Held: the entry stays while the dataset holds its key.
    assert client.run_on_scheduler(_published_client, name, True) == (False, True)
    client.unpublish_dataset(name)
    assert client.run_on_scheduler(_published_client, name, False) == (False, True)  # the leak
    assert client.run_on_scheduler(_published_client, name, True) == (True, False)


def test_the_scheduler_s_longest_tick(client: Client) -> None:
    client.run_on_scheduler(dask_internals.reset_max_tick)
    assert client.run_on_scheduler(dask_internals.max_tick_seconds) >= 0


def test_is_adaptive(client: Client) -> None:
    with (
        distributed.LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as c,
        Client(c) as other,
    ):
        assert not dask_internals.is_adaptive(other)
        c.adapt(minimum=0, maximum=1)
        assert dask_internals.is_adaptive(other)
    assert not dask_internals.is_adaptive(Client.__new__(Client))  # no cluster object


# --- used by dask_ddp._scheduler.plugin and dask_ddp._client.calls: the plugin's handlers, by name
def _serve_scheduler_echo(dask_scheduler=None) -> None:
    async def echo(spec: object = None, text: str = "") -> dict:
        return {"spec": repr(spec), "text": text.upper()}

    dask_internals.add_scheduler_handler(dask_scheduler, "dask_ddp_test_echo", echo)


def _unserve_scheduler_echo(dask_scheduler=None) -> None:
    dask_internals.remove_scheduler_handler(dask_scheduler, "dask_ddp_test_echo")


def test_a_scheduler_handler_called_by_name(client: Client) -> None:
    client.run_on_scheduler(_serve_scheduler_echo)
    try:
        spec = dask_ddp.JobState.RUNNING  # any object: it travels pickled
        answer = dask_internals.call_scheduler(
            client, "dask_ddp_test_echo", spec=dask_internals.pickled(spec), text="hi"
        )
        assert answer == {"spec": repr(spec), "text": "HI"}
    finally:
        client.run_on_scheduler(_unserve_scheduler_echo)


@pytest.mark.slow
def test_kill_worker_processes_restarts_them_under_their_names(own_cluster) -> None:
    with Client(own_cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        before = {a: w["name"] for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        victim = sorted(before)[0]
        answers = client.sync(dask_internals.kill_worker_processes, client, [victim])
        assert isinstance(answers[victim], int)  # the old process's pid

        def back() -> bool:
            now = client.scheduler_info(n_workers=-1)["workers"]
            return victim not in now and before[victim] in {w["name"] for w in now.values()}

        poll_for(back, timeout=60)


def _where(tag: int) -> tuple[int, str]:
    from distributed import get_worker

    return tag, get_worker().address


def test_submit_pinned_runs_each_call_on_its_worker_in_one_graph(client: Client) -> None:
    import uuid

    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    calls = [
        (f"pinned-{uuid.uuid4().hex}", worker, _where, (i,))
        for i, worker in enumerate(list(reversed(workers)) * 2)
    ]
    futures = dask_internals.submit_pinned(client, calls)
    assert [f.key for f in futures] == [key for key, *_ in calls]
    assert client.gather(futures) == [(i, worker) for _, worker, _, (i,) in calls]
    graphs = [
        msg for _, msg in client.get_events(client.id)
        if isinstance(msg, dict) and msg.get("action") == "update-graph"
        and msg.get("metrics", {}).get("new_tasks") == len(calls)
    ]  # fmt: skip
    assert graphs, "the calls did not go out as one graph"

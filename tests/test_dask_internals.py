"""distributed's private API as dask_ddp uses it (dask_ddp._dask_internals), on a real cluster.

Each test exercises one function against the installed distributed; the releases they were
checked against are ``_dask_internals.CHECKED_WITH``. A failure after an upgrade names the
function to port.
"""

from __future__ import annotations

import time

import distributed
from distributed import Client
from distributed.utils_test import poll_for

from dask_ddp import _dask_internals, events


def test_the_installed_distributed_was_checked() -> None:
    assert distributed.__version__ in _dask_internals.CHECKED_WITH, (
        f"distributed {distributed.__version__} is not in CHECKED_WITH "
        f"{_dask_internals.CHECKED_WITH}: run this file, port what fails, then add it"
    )


# --- used by dask_ddp.events ---
async def _echo(text: str = "") -> str:
    return text.upper()


def _serve_echo(add: bool, dask_worker=None) -> str:
    if add:
        _dask_internals.add_worker_handler(dask_worker, "dask_ddp_test_echo", _echo)
    else:
        _dask_internals.remove_worker_handler(dask_worker, "dask_ddp_test_echo")
        _dask_internals.remove_worker_handler(dask_worker, "dask_ddp_test_echo")  # no error
    return dask_worker.address


async def _call_echo(client: Client, worker: str) -> str:
    return await client.rpc(worker).dask_ddp_test_echo(text="hi")


def test_a_worker_handler_is_served_and_removed(client: Client) -> None:
    worker = next(iter(client.run(_serve_echo, True).values()))
    assert client.sync(_call_echo, client, worker) == "HI"
    client.run(_serve_echo, False)
    assert client.run(_serves, "dask_ddp_test_echo", workers=[worker]) == {worker: False}


def _serves(name: str, dask_worker=None) -> bool:
    return name in dask_worker.handlers


def test_the_blob_handler_plugin_serves_every_worker(client: Client) -> None:
    client.sync(events.register_blob_handler, client)
    client.sync(events.register_blob_handler, client)  # once per client: no second install
    assert set(client.run(_serves, events._HANDLER).values()) == {True}


def _topics(dask_scheduler=None) -> list[str]:
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
    assert "dask-ddp-test-done" in client.run_on_scheduler(_topics)

    events.forget_topic(client, "dask-ddp-test-done")
    assert "dask-ddp-test-done" not in client.run_on_scheduler(_topics)
    assert client.get_events("dask-ddp-test-done") == ()


def test_drop_topic_keeps_a_topic_another_client_follows(client: Client) -> None:
    with Client(client.scheduler.address) as other:
        other.subscribe_topic("dask-ddp-test-shared", lambda event: None)
        client.log_event("dask-ddp-test-shared", {"n": 1})
        _wait_subscribed(client, "dask-ddp-test-shared", other.id)
        dropped = client.run_on_scheduler(
            _dask_internals.drop_topic, "dask-ddp-test-shared", client.id
        )
        assert dropped is False
        assert "dask-ddp-test-shared" in client.run_on_scheduler(_topics)
    assert client.run_on_scheduler(_dask_internals.drop_topic, "no-such-topic", client.id) is False


# --- used by dask_ddp.data ---
def _read_here(keys: list[str]) -> dict:
    from distributed import get_worker

    return _dask_internals.read_worker_data(get_worker(), keys)


def test_read_worker_data_reads_this_workers_memory(client: Client) -> None:
    w0, w1 = sorted(client.scheduler_info(n_workers=-1)["workers"])
    [held] = client.scatter([list(range(5))], workers=[w0])
    here = client.submit(_read_here, [held.key, "no-such-key"], workers=[w0], pure=False)
    assert here.result(timeout=30) == {held.key: [0, 1, 2, 3, 4]}
    elsewhere = client.submit(_read_here, [held.key], workers=[w1], pure=False)
    assert elsewhere.result(timeout=30) == {}


def test_task_states_and_desire_keys(client: Client, cluster: distributed.LocalCluster) -> None:
    [held] = client.scatter([41])
    assert _dask_internals.task_states(client, [held.key, "no-such-key"]) == {
        held.key: "memory",
        "no-such-key": None,
    }
    with Client(cluster) as other:  # a second client, as a rank's, knows only the key
        _dask_internals.desire_keys(other, [held.key])
        future = distributed.Future(held.key, other)
        assert future.result(timeout=30) == 41
        future.release()


def test_our_subscription_keeps_the_users_handler_on_the_same_topic(client: Client) -> None:
    seen: list[str] = []
    client.subscribe_topic("users-topic", lambda ev: seen.append(f"user {ev[1]}"))
    assert _dask_internals.topic_handler(client, "users-topic") is not None
    stop = events.subscribe(client, "users-topic", lambda ev: seen.append(f"ours {ev[1]}"))

    def seen_after_logging(*expected: str) -> bool:
        # Client.log_event travels apart from the subscription: log until it got there.
        client.log_event("users-topic", expected[0].split()[1])
        return set(expected) <= set(seen)

    poll_for(lambda: seen_after_logging("ours a", "user a"), timeout=10)
    stop()
    poll_for(lambda: seen_after_logging("user b"), timeout=10)
    assert "ours b" not in seen
    client.unsubscribe_topic("users-topic")


# --- used by dask_ddp._dashboard ---
def test_http_prefix_and_stream_handlers(client: Client) -> None:
    assert client.run_on_scheduler(lambda dask_scheduler: _dask_internals.http_prefix(
        dask_scheduler)) == "/"  # fmt: skip

    def add(dask_scheduler=None) -> None:
        got = dask_scheduler.dask_ddp_test_got = []
        _dask_internals.add_stream_handler(
            dask_scheduler, "dask-ddp-test-op", lambda client=None, **msg: got.append((client, msg))
        )

    def got(dask_scheduler=None) -> list:
        return list(getattr(dask_scheduler, "dask_ddp_test_got", []))

    client.run_on_scheduler(add)
    try:
        _dask_internals.send_to_scheduler(client, {"op": "dask-ddp-test-op", "n": 1})
        poll_for(lambda: client.run_on_scheduler(got), timeout=10)
        assert client.run_on_scheduler(got) == [(client.id, {"n": 1})]
    finally:
        client.run_on_scheduler(
            lambda dask_scheduler: _dask_internals.remove_stream_handler(
                dask_scheduler, "dask-ddp-test-op")
        )  # fmt: skip

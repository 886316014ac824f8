"""Every use of distributed's private API, in one place.

dask-ddp relies on public distributed API wherever one does the job. What is left here
has no public equivalent in the distributed versions named by :data:`CHECKED_WITH`;
``tests/test_dask_internals.py`` exercises each function against the installed
distributed, so an upgrade that moves one of them fails there, not in a user's job.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

#: The distributed releases these functions were checked against.
CHECKED_WITH = ("2026.8.0",)


# --- used by dask_ddp.events ---
def add_worker_handler(worker: Any, name: str, handler: Callable[..., Any]) -> None:
    """Serve ``handler`` as the RPC ``name`` of ``worker`` (what extensions such as the
    shuffle do); called from :class:`dask_ddp.events.BlobHandler`'s ``setup``.

    Private: ``Worker.handlers`` is the server's handler table.
    """
    worker.handlers[name] = handler


def remove_worker_handler(worker: Any, name: str) -> None:
    """Stop serving the RPC ``name`` on ``worker``; nothing if it is not served."""
    worker.handlers.pop(name, None)


def drop_topic(topic: str, client_id: str, dask_scheduler: Any = None) -> bool:
    """Run on the scheduler (``Client.run_on_scheduler``): let its event broker forget
    ``topic`` and the events it keeps for it, once no subscriber but ``client_id`` is left.

    The broker keeps the last events of every topic for the cluster's lifetime and has no
    public call to drop one. Returns True if the topic was dropped; a scheduler without that
    broker layout, or a topic someone else still follows, is left alone.

    Private: ``Scheduler._broker._topics`` and each topic's ``subscribers``.
    """
    broker = getattr(dask_scheduler, "_broker", None)
    topics = getattr(broker, "_topics", None)
    if topics is None or topic not in topics:
        return False
    # The client's unsubscribe message travels on another comm and may not have arrived.
    topics[topic].subscribers.discard(client_id)
    if topics[topic].subscribers:
        return False
    del topics[topic]
    return True


def topic_handler(client: Any, topic: str) -> Callable[[Any], Any] | None:
    """The handler ``client.subscribe_topic(topic, ...)`` set, if any: the client keeps one
    per topic, so a second subscription would silently replace the user's.

    Private: ``Client._event_handlers`` is that table.
    """
    return client._event_handlers.get(topic)


# --- used by dask_ddp._dashboard ---
def add_stream_handler(scheduler: Any, op: str, handler: Callable[..., Any]) -> None:
    """Handle messages ``{"op": op, ...}`` that clients send on their batched stream to
    ``scheduler``: ``handler(client=<client id>, **message)`` runs on the scheduler's loop.

    Private: ``Scheduler.stream_handlers`` is the server's table of stream operations.
    """
    scheduler.stream_handlers[op] = handler


def remove_stream_handler(scheduler: Any, op: str) -> None:
    """Stop handling ``op``; nothing if it is not handled."""
    if scheduler is not None:
        scheduler.stream_handlers.pop(op, None)


def http_prefix(scheduler: Any) -> str:
    """The path the scheduler's HTTP pages live under (``dask scheduler --dashboard-prefix``),
    with slashes on both ends: ``"/"`` by default.

    Private: the scheduler does not keep its prefix; its ``health`` route carries it.
    """
    for rule in scheduler.http_application.wildcard_router.rules:
        pattern = getattr(getattr(rule.matcher, "regex", None), "pattern", "")
        if pattern.endswith("health$"):
            prefix = pattern[: -len("health$")].strip("/")
            return f"/{prefix}/" if prefix else "/"
    return "/"


def send_to_scheduler(client: Any, msg: dict[str, Any]) -> None:
    """Queue ``msg`` on ``client``'s batched stream to the scheduler (no reply, no round
    trip). Only for operations the scheduler handles (:func:`add_stream_handler`): the
    scheduler closes the connection of a client that sends an unknown one.

    Private: ``Client._send_to_scheduler``.
    """
    client._send_to_scheduler(msg)


# --- used by dask_ddp.data ---


def read_worker_data(worker: Any, keys: Sequence[Hashable]) -> dict[Hashable, Any]:
    """The values among ``keys`` that ``worker`` (this process's worker) holds in memory,
    without a copy; read on the worker's event loop, which owns its data. Called from a
    rank's thread.

    Private: ``Worker.data`` (the worker's store) and ``distributed.utils.sync``.
    """
    from distributed.utils import sync

    async def read() -> dict[Hashable, Any]:
        data = worker.data
        return {key: data[key] for key in keys if key in data}

    return sync(worker.loop, read)


def task_states(client: Any, keys: Sequence[Hashable]) -> dict[Hashable, str | None]:
    """The scheduler's state of each key (None: it has forgotten the key).

    Private: the scheduler's ``get_task_status`` handler, called through ``Client.scheduler``.
    """
    return client.sync(client.scheduler.get_task_status, keys=list(keys))


def desire_keys(client: Any, keys: Sequence[Hashable]) -> None:
    """Tell the scheduler that ``client`` wants ``keys``, for futures made from bare keys.

    Since distributed 2025 a ``Future(key, client)`` no longer registers the client's
    interest, so the client would never hear that the data is ready; this sends what
    ``Client.get_dataset`` sends for the futures it unpickles.

    Private: ``Client._send_to_scheduler`` and the ``client-desires-keys`` operation.
    """
    client._send_to_scheduler({"op": "client-desires-keys", "keys": list(keys)})

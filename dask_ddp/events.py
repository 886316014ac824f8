"""Dask's event stream as seen by dask_ddp on the client.

``Client.subscribe_topic`` keeps one handler per topic per client, so two jobs watching
the same topic (a worker's address, for its removal) would replace each other's handler.
:func:`subscribe` fans one subscription out to every listener of that client instead.
Handlers run on the client's event loop: they must not block (the job only queues).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from distributed import Client

Handler = Callable[[Any], None]


class _Router:
    def __init__(self, client: Client) -> None:
        self._client = weakref.ref(client)
        self._lock = threading.Lock()
        self._listeners: dict[str, dict[int, Handler]] = {}
        self._next = 0

    def _dispatch(self, topic: str, event: Any) -> None:
        with self._lock:
            handlers = list(self._listeners.get(topic, {}).values())
        for handler in handlers:
            handler(event)

    def add(self, topic: str, handler: Handler) -> int:
        client = self._client()
        if client is None:
            raise RuntimeError("the client behind this subscription was closed")
        with self._lock:
            token, self._next = self._next, self._next + 1
            first = topic not in self._listeners
            self._listeners.setdefault(topic, {})[token] = handler
        if first:
            client.subscribe_topic(topic, lambda event, t=topic: self._dispatch(t, event))
        return token

    def remove(self, topic: str, token: int) -> None:
        with self._lock:
            listeners = self._listeners.get(topic, {})
            listeners.pop(token, None)
            last = not listeners
            if last:
                self._listeners.pop(topic, None)
        client = self._client()
        if last and client is not None and client.status == "running":
            client.unsubscribe_topic(topic)


_routers: weakref.WeakKeyDictionary[Client, _Router] = weakref.WeakKeyDictionary()
_routers_lock = threading.Lock()


def subscribe(client: Client, topic: str, handler: Handler) -> Callable[[], None]:
    """Call ``handler(event)`` for each event on ``topic``; returns the unsubscribe call."""
    with _routers_lock:
        router = _routers.get(client)
        if router is None:
            router = _routers[client] = _Router(client)
    token = router.add(topic, handler)
    return lambda: router.remove(topic, token)

"""Client-side topic subscriptions that share the client's one handler per topic.

``Client.subscribe_topic`` keeps one handler per topic per client, so two views of the same
job in one client (two ``attach`` calls, a ``Job`` and a user's own subscription to its
topic) would replace each other's handler. :func:`follow` fans one subscription out to
every listener of that client, keeps calling a handler the user set before, and gives it
back when the last listener leaves. Handlers run on the client's event loop: they must not
block.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from distributed import Client

from .._shared import dask_internals

Handler = Callable[[Any], None]


class _Dispatch:
    """The one handler a client keeps for a topic we follow: calls every listener."""

    def __init__(self, router: _Router, topic: str) -> None:
        self.router, self.topic = router, topic

    def __call__(self, event: Any) -> None:
        self.router._dispatch(self.topic, event)


class _Router:
    def __init__(self, client: Client) -> None:
        self._client = weakref.ref(client)
        # Guards the listeners and the client's handler table for our topics: a job that
        # ends (on its supervisor's thread) and one that starts (on the caller's) may
        # leave and follow the same topic at once.
        self._lock = threading.Lock()
        self._listeners: dict[str, dict[int, Handler]] = {}
        self._theirs: dict[str, Handler] = {}  # handlers the user subscribed before us
        self._next = 0

    def _dispatch(self, topic: str, event: Any) -> None:
        with self._lock:
            handlers = list(self._listeners.get(topic, {}).values())
            theirs = self._theirs.get(topic)
        for handler in handlers:
            handler(event)
        if theirs is not None:
            theirs(event)

    def add(self, topic: str, handler: Handler) -> int:
        client = self._client()
        if client is None:
            raise RuntimeError("the client behind this subscription was closed")
        with self._lock:
            token, self._next = self._next, self._next + 1
            first = topic not in self._listeners
            self._listeners.setdefault(topic, {})[token] = handler
            if first:
                # The client keeps one handler per topic: keep calling one the user set
                # (on the scheduler's "all" topic, say), and give it back when we are done.
                theirs = dask_internals.topic_handler(client, topic)
                if theirs is not None and not isinstance(theirs, _Dispatch):
                    self._theirs[topic] = theirs
                client.subscribe_topic(topic, _Dispatch(self, topic))
        return token

    def remove(self, topic: str, token: int) -> None:
        client = self._client()
        with self._lock:
            listeners = self._listeners.get(topic, {})
            if listeners.pop(token, None) is None or listeners:
                return  # removed before, or others still follow the topic
            del self._listeners[topic]
            theirs = self._theirs.pop(topic, None)
            if client is not None and client.status == "running":
                if theirs is not None:
                    client.subscribe_topic(topic, theirs)
                else:
                    client.unsubscribe_topic(topic)


_routers: weakref.WeakKeyDictionary[Client, _Router] = weakref.WeakKeyDictionary()
_routers_lock = threading.Lock()


def follow(client: Client, topic: str, handler: Handler) -> Callable[[], None]:
    """Call ``handler(event)`` for each event on ``topic``; returns the call that stops it.

    The subscription request is queued on the client's comm to the scheduler before
    anything submitted afterwards, so a task submitted after this call cannot publish on
    ``topic`` before the scheduler knows the subscriber.
    """
    with _routers_lock:
        router = _routers.get(client)
        if router is None:
            router = _routers[client] = _Router(client)
    token = router.add(topic, handler)
    return lambda: router.remove(topic, token)

"""Every use of distributed's private API, in one place.

dask-ddp relies on public distributed API wherever one does the job. What is left here
has no public equivalent in the distributed versions named by :data:`CHECKED_WITH`;
``tests/test_dask_internals.py`` exercises each function against the installed
distributed, so an upgrade that moves one of them fails there, not in a user's job.
"""

from __future__ import annotations

from collections.abc import Callable
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


# --- used by dask_ddp.data ---

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


# --- used by dask_ddp._rank.channel and dask_ddp._rank.replicas ---
def add_worker_handler(worker: Any, name: str, handler: Callable[..., Any]) -> None:
    """Serve ``handler`` as the RPC ``name`` of ``worker`` (what extensions such as the
    shuffle do); called from :class:`dask_ddp._rank.channel.BlobHandler`'s ``setup``.

    Private: ``Worker.handlers`` is the server's handler table.
    """
    worker.handlers[name] = handler


def remove_worker_handler(worker: Any, name: str) -> None:
    """Stop serving the RPC ``name`` on ``worker``; nothing if it is not served."""
    worker.handlers.pop(name, None)


def act_for_worker(worker: Any) -> None:
    """Make ``worker`` what ``distributed.get_worker()`` returns in this thread, so that
    ``get_client()`` and Dask objects unpickled here (``distributed.Event``, ``Variable``,
    ``Future``) find a client: the real worker in a thread that serves a rank's process,
    a :class:`dask_ddp._rank.rankproc.WorkerStandIn` in the rank's process itself.

    Private: ``distributed.worker._worker_cvar``, the context variable ``get_worker`` reads.
    """
    from distributed import worker as _worker

    _worker._worker_cvar.set(worker)


def call_peer(worker: Any, address: str, handler: str, timeout: float | None, **kwargs: Any) -> Any:
    """Call the RPC ``handler`` (one a worker plugin added) of the worker at ``address``
    from a thread of ``worker`` (a rank's), worker to worker, and wait for the answer at
    most ``timeout`` seconds. Used by :class:`dask_ddp._rank.replicas.PeerLink`.

    Private: ``Worker.rpc``, the worker's pool of connections to other servers, and
    ``distributed.utils.sync`` to run the call on the worker's event loop.
    """
    from distributed.utils import sync

    async def call() -> Any:
        return await getattr(worker.rpc(address), handler)(**kwargs)

    return sync(worker.loop, call, callback_timeout=timeout)


def on_worker_loop(worker: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Run the coroutine function ``fn(*args)`` on ``worker``'s event loop from one of its
    other threads, and wait for its result.

    Private: ``distributed.utils.sync``.
    """
    from distributed.utils import sync

    return sync(worker.loop, fn, *args)


async def run_in_nanny(worker: Any, fn: Callable[..., Any]) -> Any:
    """Run ``fn`` (a function taking ``dask_worker``: the nanny) in ``worker``'s nanny, as
    ``Client.run(..., nanny=True)`` does, asked by the worker itself; its result. Raises
    what it raised, or :class:`RuntimeError` with the nanny's error.

    Private: ``Worker.rpc`` to the nanny's ``run`` handler, which takes the pickled
    function.
    """
    from distributed.protocol import pickle

    answer = await worker.rpc(worker.nanny).run(function=pickle.dumps(fn))
    if answer.get("status") != "OK":
        raise RuntimeError(f"{answer.get('exception')!r}")
    return answer["result"]


def call_peer_each(
    worker: Any,
    address: str,
    handler: str,
    timeout: float | None,
    calls: Sequence[dict[str, Any]],
    on_reply: Callable[[int, Any], bool],
    window: int = 2,
) -> bool:
    """Make the calls :func:`call_peer` would make one by one, at most ``window`` in
    flight, and hand each answer to ``on_reply(index, reply)`` (on the worker's event loop)
    as it arrives, so that it can be dropped before the next is read; ``on_reply``
    returns False to stop. Returns False if it was stopped. Used by
    :meth:`dask_ddp._rank.replicas.PeerLink.fetch` to read a replica piece by piece.
    """
    import asyncio

    from distributed.utils import sync

    async def run() -> bool:
        rpc = worker.rpc(address)
        todo = iter(enumerate(calls))  # shared: each lane takes the next call
        stopped = False

        async def lane() -> None:
            nonlocal stopped
            for index, kwargs in todo:
                if stopped:
                    return
                reply = await getattr(rpc, handler)(**kwargs)
                if not on_reply(index, reply):
                    stopped = True

        lanes = [asyncio.ensure_future(lane()) for _ in range(max(1, window))]
        try:
            await asyncio.gather(*lanes)
        finally:  # one failed (the peer left) or this was cancelled: the others stop too
            for task in lanes:
                task.cancel()
        return not stopped

    return sync(worker.loop, run, callback_timeout=timeout)


def drop_topic(topic: str, client_id: str | None, dask_scheduler: Any = None) -> bool:
    """Let the scheduler's event broker forget ``topic`` and the events it keeps for it:
    once no subscriber but ``client_id`` is left, or at once with ``client_id=None`` (the
    job was forgotten). Called on the scheduler.

    The broker keeps the last events of every topic for the cluster's lifetime and has no
    public call to drop one. Returns True if the topic was dropped; a scheduler without that
    broker layout, or a topic someone else still follows, is left alone.

    Private: ``Scheduler._broker._topics`` and each topic's ``subscribers``.
    """
    broker = getattr(dask_scheduler, "_broker", None)
    topics = getattr(broker, "_topics", None)
    if topics is None or topic not in topics:
        return False
    if client_id is not None:
        # The client's unsubscribe message travels on another comm and may not have arrived.
        topics[topic].subscribers.discard(client_id)
        if topics[topic].subscribers:
            return False
    del topics[topic]
    return True


def add_scheduler_handler(scheduler: Any, name: str, handler: Callable[..., Any]) -> None:
    """Serve ``handler`` as the scheduler's RPC ``name`` (what its extensions do); the
    plugin's own handlers, which clients call by name (:func:`call_scheduler`).

    Private: ``Scheduler.handlers`` is the server's handler table.
    """
    scheduler.handlers[name] = handler


def remove_scheduler_handler(scheduler: Any, name: str) -> None:
    """Stop serving the scheduler RPC ``name``; nothing if it is not served."""
    scheduler.handlers.pop(name, None)


def call_scheduler(client: Any, name: str, /, **kwargs: Any) -> Any:
    """Call the scheduler's RPC ``name`` (one a plugin added) from ``client`` and return
    its answer (a synchronous client waits; an asynchronous one gets a coroutine).

    Private: ``Client.scheduler``, the client's connection pool to its scheduler.
    """
    return client.sync(getattr(client.scheduler, name), **kwargs)


def pickled(value: Any) -> Any:
    """``value`` wrapped to travel pickled in an RPC message (a dataclass, bytes inside)."""
    from distributed.protocol.serialize import ToPickle

    return ToPickle(value)


async def call_worker(client: Any, worker: str, handler: str, **kwargs: Any) -> Any:
    """Call the RPC ``handler`` (one a worker plugin added, see :func:`add_worker_handler`)
    of ``worker`` from ``client``'s event loop, worker to client, without the scheduler.

    Private: ``Client.rpc``, the client's pool of connections to other servers.
    """
    return await getattr(client.rpc(worker), handler)(**kwargs)


async def topic_history(client: Any, topic: str) -> tuple[tuple[float, Any], ...]:
    """The events the scheduler keeps of ``topic`` (the last 1000), from ``client``'s event
    loop: what ``Client.get_events`` returns, without blocking the loop it runs on.

    Private: the scheduler's ``events`` handler, called through ``Client.scheduler``.
    """
    return await client.scheduler.events(topic=topic)


def topic_handler(client: Any, topic: str) -> Callable[[Any], Any] | None:
    """The handler ``client.subscribe_topic(topic, ...)`` set, if any: the client keeps one
    per topic, so a second subscription would silently replace the user's.

    Private: ``Client._event_handlers`` is that table.
    """
    return client._event_handlers.get(topic)


# --- used by dask_ddp._scheduler.page ---
def remove_http_application(http: Any, app: Any) -> None:
    """Stop routing requests to ``app``, added with ``http_application.add_application``
    (tornado's ``_ApplicationRouter`` has no call to remove one).

    Private: the router's ``applications`` list.
    """
    if app in http.applications:
        http.applications.remove(app)


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


# --- used by dask_ddp's scheduler plugin (supervise, _launcher, _plugin) ---
def fail_task(scheduler: Any, key: Any, exception: bytes) -> bool:
    """Fail the task ``key``, left without a worker it may run on (``no-worker``: its
    worker left the cluster), with the pickled ``exception``: every client's future of it
    then raises that exception instead of waiting forever. Returns whether it did.

    This is what the scheduler itself does to such tasks after
    ``distributed.scheduler.no-workers-timeout`` (``NoValidWorkerError``).

    Private: ``Scheduler.transition``/``transitions`` with the ``erred`` arguments of
    ``_transition_no_worker_erred``, and ``TaskState.state``.
    """
    ts = scheduler.tasks.get(key)
    if ts is None or ts.state != "no-worker":
        return False
    stimulus_id = f"dask-ddp-fail-{key}"
    recommendations = scheduler.transition(
        key, "erred", exception=exception, cause=key, stimulus_id=stimulus_id
    )
    scheduler.transitions(recommendations, stimulus_id=stimulus_id)
    return True


def submit_pinned(
    client: Any, calls: Sequence[tuple[str, str, Callable[..., Any], tuple]]
) -> list[Any]:
    """Submit ``(key, worker, function, args)`` calls as one graph, each task restricted to
    its worker (no other, no retries), as ``client.submit(function, *args, key=key,
    workers=[worker], pure=False)`` would one by one; their futures, in order.

    One graph is one ``update_graph`` on the scheduler, where a submit each is one each, with
    its thread hops: a job's rank tasks on 8 workers reached their last worker 10 ms sooner
    on 2 cores (8 trivial pinned tasks, call -> gathered: 38 ms submitted one by one, 30 ms
    as one graph; ``dask.annotate`` around ``delayed`` calls and one ``compute``, Dask's
    public way, 32 ms).

    Private: ``Client._graph_to_futures``, the call ``submit`` makes, here given a
    high-level graph with one layer per task, each carrying its ``workers`` annotation.
    """
    from dask._expr import HLGExpr
    from dask._task_spec import Task, parse_input
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
    from distributed.spans import SpanMetadata

    keys = [key for key, *_ in calls]
    layers = {
        key: MaterializedLayer(
            {key: Task(key, function, *(parse_input(a) for a in args))},
            annotations={"workers": [worker]},
        )
        for key, worker, function, args in calls
    }
    graph = HighLevelGraph(layers, {key: set() for key in keys})
    futures = client._graph_to_futures(
        HLGExpr(dsk=graph, output_keys=keys),
        keys,
        span_metadata=SpanMetadata(collections=[{"type": "Future"}]),
        internal_priority=dict.fromkeys(keys, 0),
    )
    return [futures[key] for key in keys]


def _kill_worker_process(dask_worker: Any = None) -> int | None:
    """Run in a nanny (``Client.run(nanny=True)``): SIGKILL its worker process; the nanny
    starts a new one, as after any crash."""
    import os
    import signal

    process = dask_worker.process
    pid = process.pid if process is not None else None
    if pid:
        os.kill(pid, getattr(signal, "SIGKILL", signal.SIGTERM))
    return pid


async def kill_worker_processes(client: Any, workers: Sequence[str]) -> dict[str, Any]:
    """End the processes of ``workers`` (each has a nanny) at once; their nannies start
    new ones, which join under the same names. ``Client.restart_workers`` instead asks a
    worker to close first and waits 4 s for it, which a worker whose rank thread is stuck
    in C never does; and its graceful close races with SpecCluster's removal of a worker
    that restarted twice within ``distributed.deploy.lost-worker-timeout``. Returns each
    worker's answer (the old process's pid, or the exception).

    Private: the nanny's ``process`` (its ``WorkerProcess``) and that object's ``pid``.
    """
    return await client.run(
        _kill_worker_process, nanny=True, workers=list(workers), on_error="return"
    )


def drop_published_client(scheduler: Any, name: str) -> bool:
    """Let the scheduler forget the client entry that publishing the dataset ``name`` made,
    once the dataset is unpublished (it holds no key). Returns whether it did.

    distributed's publish extension holds a dataset's keys for a pseudo-client
    ``published-<name>`` (``Scheduler.client_desires_keys`` creates its ``ClientState``) and
    never removes that entry when the dataset is deleted: every name ever published stays
    in ``Scheduler.clients`` for the scheduler's life. A job publishes one dataset per
    attempt, so a sweep of 10,000 jobs would leave 10,000 entries.

    Private: ``Scheduler.clients``, ``ClientState.wants_what`` and the pseudo-client's name
    (``distributed/publish.py``).
    """
    from dask.utils import stringify

    client = f"published-{stringify(name)}"
    state = scheduler.clients.get(client)
    if state is None or state.wants_what:
        return False
    del scheduler.clients[client]
    return True


def max_tick_seconds(dask_scheduler: Any = None) -> float:
    """Run on the scheduler (``Client.run_on_scheduler``): the longest gap between two
    ticks of its event loop so far, in seconds: how long something blocked the loop.

    Private: ``Scheduler.digests_max``, the scheduler's own measure of it.
    """
    return float(dask_scheduler.digests_max.get("tick-duration", 0.0))


def reset_max_tick(dask_scheduler: Any = None) -> None:
    """Run on the scheduler: start :func:`max_tick_seconds` again from now."""
    dask_scheduler.digests_max.pop("tick-duration", None)


def is_adaptive(client: Any) -> bool:
    """Whether ``client``'s cluster object (``Client(cluster)``) scales itself
    (``cluster.adapt()``); False for a client of a bare scheduler address.

    Private: ``Cluster._adaptive``, checked as ``Cluster`` itself checks it.
    """
    adaptive = getattr(getattr(client, "cluster", None), "_adaptive", None)
    return bool(adaptive is not None and getattr(adaptive, "periodic_callback", None))


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

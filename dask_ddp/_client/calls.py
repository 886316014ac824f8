"""A client's calls into dask-ddp's scheduler plugin: install it, hand it a job or a sweep,
cancel, attach, list, forget.

The client never imports the scheduler's code. It installs the plugin by running
:data:`~dask_ddp._shared.protocol.Entry.INSTALL_PLUGIN` on the scheduler by name (a scheduler
started with ``--preload dask_ddp`` has it already, and may refuse ``run_on_scheduler``),
then calls the plugin's own scheduler handlers (:data:`~dask_ddp._shared.protocol.HANDLERS`).
Each answers with plain values; a refusal (an unknown worker, too many ranks, a name
taken) comes back as a value and is raised here, as the same dask-ddp error, so that no
log on the scheduler ever holds a job's payload.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from distributed import Client

from .._shared import dask_internals
from .._shared.protocol import HANDLERS, Entry, acall, order_mark
from .._shared.values import JobSpec, SweepSpec
from ..errors import SchedulerPluginError, from_wire

_installed: weakref.WeakKeyDictionary[Client, bool] = weakref.WeakKeyDictionary()
_install_lock = threading.Lock()


def install(client: Client) -> None:
    """Install dask-ddp's scheduler plugin on ``client``'s scheduler, once per client.

    Raises
    ------
    SchedulerPluginError
        The scheduler did not take it (dask-ddp is not importable there, or
        ``run_on_scheduler`` is blocked there and the scheduler was not started with
        ``--preload dask_ddp``).
    """
    with _install_lock:
        if _installed.get(client):
            return
        try:
            answer = client.run_on_scheduler(acall, Entry.INSTALL_PLUGIN)
        except Exception as exc:
            # A locked-down scheduler refuses run_on_scheduler; one started with
            # `--preload dask_ddp` has the plugin, which answers its own handler.
            try:
                answer = _ask(client, "ready")
            except Exception:
                raise SchedulerPluginError(
                    client.scheduler.address, f"{type(exc).__name__}: {exc}"
                ) from exc
        if "refused" in answer:
            raise from_wire(answer["refused"])
        if not answer.get("ready"):
            raise SchedulerPluginError(
                client.scheduler.address, "the scheduler did not install the plugin"
            )
        _installed[client] = True


def _ask(client: Client, what: str, /, **kwargs: Any) -> dict[str, Any]:
    """Call the plugin's handler ``what``; raise the refusal it answers, if it refuses."""
    answer = dask_internals.call_scheduler(client, HANDLERS[what], **kwargs)
    if not isinstance(answer, dict):  # no such handler there: the plugin is not installed
        raise SchedulerPluginError(
            client.scheduler.address, f"the scheduler has no {HANDLERS[what]!r} handler"
        )
    if "refused" in answer:
        raise from_wire(answer["refused"])
    return answer


def submit_job(client: Client, spec: JobSpec, follow: Callable[[], Any]) -> dict[str, Any]:
    """Hand ``spec`` to the cluster, once ``follow()`` subscribed this client to the job's
    topic; the job's state once it runs or waits.

    The job comes after everything this client sent before it: a task submitted just
    before ``launch()`` on a worker the job uses runs before the job's rank there, as if
    the client had submitted both. ``Client.publish_dataset`` returns only once the
    scheduler has read the client's stream that far (the marker is one small dataset per
    client, dropped when the client leaves). The marker goes first: the client's stream
    sends at once when it has been idle, but holds what follows a send for its batch
    interval (10 ms), and the subscription need not be waited for (the supervisor
    subscribes the launching client itself).
    """
    install(client)
    client.publish_dataset(None, name=order_mark(client.id), override=True)
    follow()
    return _ask(client, "launch", spec=dask_internals.pickled(spec))["state"]


def cancel_job(client: Client, job_id: str, reason: str) -> None:
    """Cancel a job; return once its ranks stopped and its workers are free."""
    install(client)
    _ask(client, "cancel", job=job_id, reason=reason)


def attach(client: Client, job: str) -> dict[str, Any]:
    """Follow a sweep or a job (by id or name): ``{"sweep": its state}``, or ``{"state":
    the job's state, summary and checkpoints so far}``."""
    install(client)
    return _ask(client, "attach", job=job, client=client.id)


def submit_sweep(client: Client, spec: SweepSpec) -> dict[str, Any]:
    """Hand ``spec`` to the cluster; the sweep's state once its first trial runs or waits."""
    install(client)
    return _ask(client, "sweep", spec=dask_internals.pickled(spec))["state"]


def cancel_sweep(client: Client, sweep: str, reason: str) -> dict[str, Any]:
    """Cancel a sweep; its state once its trials stopped."""
    install(client)
    return _ask(client, "sweep_cancel", sweep=sweep, reason=reason)["state"]


def sweep_trials(client: Client, sweep: str) -> list[Any]:
    """The sweep's study's trials (Optuna's ``FrozenTrial``), by number."""
    import cloudpickle

    install(client)
    return list(cloudpickle.loads(_ask(client, "sweep_trials", sweep=sweep)["trials"]))


def list_jobs(client: Client) -> list[dict[str, Any]]:
    """Every job the cluster knows, newest first."""
    install(client)
    return _ask(client, "list")["rows"]


def held_values(client: Client, job_id: str) -> list[bytes | None]:
    """The ranks' return values the job's supervisor holds (pickled; None where a value was
    larger than ``ddp.result-limit``), rank order."""
    install(client)
    return list(_ask(client, "values", job=job_id)["values"])


def forget_job(client: Client, job_id: str) -> None:
    """Let the cluster forget a finished job."""
    install(client)
    _ask(client, "forget", job=job_id)

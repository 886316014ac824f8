"""What a test left on a shared cluster (running sweeps and jobs, held workers, busy rank
processes), and how the ``client`` and ``dask_processes`` fixtures clean it up. A module
of its own, not conftest: its functions run on the scheduler and the workers
(``Client.run``), sent by value (conftest registers it with cloudpickle) to ``dask``
processes that cannot import tests/, by a name no other module shares (the repository's
root has a conftest too) to a LocalCluster's scheduler in the test's own process."""

from __future__ import annotations

import contextlib
from typing import Any

from distributed import Client


async def _held_and_running(dask_scheduler: Any = None) -> dict[str, Any]:
    """The jobs still running and the workers held, once the jobs whose end was decided
    (``stopping``, or a final state whose clean-up still runs: a test that read a failure's
    error from ``result()`` is done with them) had up to a minute to end."""
    import asyncio

    plugin = dask_scheduler.plugins.get("dask-ddp")
    if plugin is None or plugin.pool is None:
        return {"held": {}, "jobs": [], "sweeps": []}
    sweeps = [
        [sweep.sweep_id, sweep.spec.name, sweep.state]
        for sweep in plugin.sweeps.values()
        if not sweep.final
    ]
    ending = [
        job.until(lambda job=job: job.closed)
        for job in plugin.jobs.values()
        if job.state.value == "stopping" or job.state.final
    ]
    if ending:
        await asyncio.wait(ending, timeout=60)
    jobs = [
        [job.job_id, job.spec.name, job.state.value]
        for job in plugin.jobs.values()
        if not job.closed
    ]
    return {"held": plugin.pool.holders(), "jobs": jobs, "sweeps": sweeps}


def _busy_rank(seconds: float) -> str | None:
    from dask_ddp._rank.slot import PROCESS

    if PROCESS.wait_idle(seconds):
        return None
    run = PROCESS.current()
    return run.key if run is not None else "?"


def leftovers(client: Client) -> list[str]:
    """What a test left on the shared cluster: running jobs, held workers, busy ranks."""
    left = []
    state = client.run_on_scheduler(_held_and_running)
    for sweep_id, name, sweep_state in state["sweeps"]:
        left.append(f"sweep {sweep_id} ({name}) still {sweep_state}")
    for job_id, name, job_state in state["jobs"]:
        left.append(f"job {job_id} ({name}) still {job_state}")
    for worker, holder in state["held"].items():
        left.append(f"worker {worker} held by {holder}")
    for worker, key in client.run(_busy_rank, 5).items():
        if key is not None:
            left.append(f"worker {worker} still runs rank task {key}")
    return left


def clean_up(client: Client) -> None:
    from dask_ddp._client import calls

    state = client.run_on_scheduler(_held_and_running)
    for sweep_id, _, _ in state["sweeps"]:
        with contextlib.suppress(Exception):
            calls.cancel_sweep(client, sweep_id, "left running by a test")
    for job_id, _, _ in state["jobs"]:
        with contextlib.suppress(Exception):
            calls.cancel_job(client, job_id, "left running by a test")
    if leftovers(client):
        client.restart(wait_for_workers=True)


def forget_ended(client: Client) -> None:
    """Let the cluster forget the jobs that ended (``dask_ddp.jobs`` lists them until then):
    a shared cluster's next test sees only its own."""
    from dask_ddp._client import calls
    from dask_ddp._shared.values import FINAL_STATES

    if not client.run_on_scheduler(_has_plugin):
        return  # no test used dask-ddp here: nothing to forget, and no plugin to install
    for row in calls.list_jobs(client):
        if row["state"] in FINAL_STATES:
            calls.forget_job(client, row["job"])


def _has_plugin(dask_scheduler: Any = None) -> bool:
    return "dask-ddp" in dask_scheduler.plugins

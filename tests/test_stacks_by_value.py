"""A stall in code sent by value reads at the user's own line.

cloudpickle sends a function of ``__main__`` (a script's, a notebook cell's) by value and
names its file ``<dynamic-code>``; its stacks and the ``stalled`` entry name the file, line
and source line the launching client knows, as a failed rank's traceback does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dask_ddp._shared import tracebacks

SCRIPT = textwrap.dedent(
    """\
    import contextlib, io, json, sys, time, urllib.request

    import torch
    import torch.distributed as dist
    from distributed import Client, LocalCluster

    import dask_ddp
    from dask_ddp._client import cli


    def train():
        t = torch.ones(1)
        dask_ddp.report({"up": 1}, step=0)
        if dist.get_rank() == 1:
            time.sleep(3600)  # the hang
        dist.all_reduce(t)


    if __name__ == "__main__":
        with (
            LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
            Client(cluster) as client,
        ):
            job = dask_ddp.launch(client, train, stall_timeout=2)
            deadline = time.monotonic() + 120
            while job.state is not dask_ddp.JobState.STALLED and time.monotonic() < deadline:
                time.sleep(0.05)
            stalled = [t.reason for t in job.history if t.state is dask_ddp.JobState.STALLED]
            stacks = job.stacks()
            with Client(cluster) as other:  # a client that did not launch it
                attached = dask_ddp.attach(other, job.job_id).stacks()
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):  # python -m dask_ddp --stacks JOB
                cli._print_stacks(cluster.scheduler_address, job.job_id)
            api = cluster.dashboard_link.replace("/status", f"/ddp/api/jobs/{job.job_id}")
            with urllib.request.urlopen(api, timeout=30) as response:
                page = response.read().decode()
            job.cancel()
        json.dump(
            {"stalled": stalled, "stacks": stacks, "attached": attached,
             "cli": printed.getvalue(), "page": page},
            sys.stdout,
        )
    """
)


@pytest.mark.slow
def test_a_stall_in_main_s_function_names_its_file_line_and_source(tmp_path: Path) -> None:
    script = tmp_path / "hangs_in_main.py"
    script.write_text(SCRIPT)
    line = SCRIPT.splitlines().index("        time.sleep(3600)  # the hang") + 1
    ran = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert ran.returncode == 0, ran.stderr[-5000:]
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    assert seen["stalled"], seen
    where = f"rank 1 in train (hangs_in_main.py:{line}: time.sleep(3600)  # the hang)"
    assert where in seen["stalled"][0], seen["stalled"]
    assert "waiting in a collective: rank(s) 0" in seen["stalled"][0]
    assert json.dumps(where)[1:-1] in seen["page"]  # the /ddp/ page's line, in its JSON
    frame = f'File "{script}", line {line} in train\n    time.sleep(3600)  # the hang\n'
    for stacks in (seen["stacks"], seen["attached"]):
        assert frame in stacks["1"], stacks["1"]
        assert "<dynamic-code>" not in stacks["0"] + stacks["1"]
        assert f'File "{script}"' in stacks["0"] and "in all_reduce" in stacks["0"]
    assert frame in seen["cli"] and "<dynamic-code>" not in seen["cli"]


def test_a_notebook_cell_s_stack_frame_is_named_by_its_cell() -> None:
    """Named on the client, where IPython is: the stacks and a stall read ``Cell In[n]``."""
    shell = pytest.importorskip("IPython.core.interactiveshell").InteractiveShell.instance()
    try:
        shell.run_cell("import time\ndef train():\n    x = 1\n    time.sleep(x)\n")
        fn = shell.user_ns["train"]
        sources = tracebacks.Sources(fn)
    finally:
        shell.clear_instance()
    line = fn.__code__.co_firstlineno + 2
    dump = (
        "Current thread 0x01 (most recent call first):\n"
        f'  File "<dynamic-code>", line {line} in train\n'
        '  File "/v/site-packages/distributed/worker.py", line 9 in execute\n'
    )
    shown = sources.restack(dump).splitlines()
    assert shown[1].startswith("  Cell In[") and shown[1].endswith(f", line {line} in train")
    assert shown[2] == "    time.sleep(x)"
    waiting, where = tracebacks.stuck_at(dump, sources)
    assert not waiting and where.startswith("train (Cell In[")
    assert where.endswith(f", line {line}: time.sleep(x))")

"""A failing job reads once and cleanly: in the view, in the raised error, in the output."""

from __future__ import annotations

import traceback

import pytest
from distributed import Client, LocalCluster

import dask_ddp
from dask_ddp._shared import tracebacks, view


def _fail_on_rank_1() -> None:
    for step in range(3):
        dask_ddp.report({"loss": 1.0 / (step + 1)}, step=step)
    if dask_ddp.get_context().rank == 1:
        raise ValueError("bad batch at step 2")  # the line the traceback must show
    import torch.distributed as dist

    dist.barrier()


def test_the_error_is_raised_from_the_rank_s_own_traceback(client: Client):
    job = dask_ddp.launch(client, _fail_on_rank_1)
    with pytest.raises(dask_ddp.RankFailedError) as info:
        job.result(timeout=120)
    err = info.value
    cause = err.__cause__
    assert isinstance(cause, ValueError)
    frames = traceback.extract_tb(cause.__traceback__)
    # Only the rank's own frame, under its file and at the line that raised.
    assert [(f.filename, f.name) for f in frames] == [(__file__, "_fail_on_rank_1")]
    assert (
        frames[0].line
        == 'raise ValueError("bad batch at step 2")  # the line the traceback must show'
    )
    printed = "".join(traceback.format_exception(err))
    assert printed.count("bad batch at step 2") == 3  # cause line, its source, the summary
    assert "distributed" not in printed.split("direct cause")[0]  # no Dask frames
    assert "_rank/tasks.py" not in printed
    assert "(printed above, as the cause)" in str(err)
    assert 'raise ValueError("bad batch at step 2")' in err.rank_traceback


def test_the_view_shows_the_error_once_and_marks_the_stopped_rank(client: Client):
    job = dask_ddp.launch(client, _fail_on_rank_1)
    with pytest.raises(dask_ddp.RankFailedError):
        job.result(timeout=120)
    # The outcome comes first; rank 0 is stopped after it (it may never have said a word).
    assert job.wait_stopped(timeout=60)
    snap = job.view_state()
    assert [r["status"] for r in snap["ranks"]] == ["stopped", "failed"]
    assert snap["ranks"][0]["error"] == "stopped: rank 1 failed"
    assert snap["ranks"][1]["error"] == "failed: ValueError: bad batch at step 2"
    page = view.render_html(snap)
    assert page.count("The other ranks were stopped") == 1
    assert page.count("<details>") == 1  # the traceback, folded once
    assert "printed above" not in page
    assert page.count("Traceback (most recent call last)") == 1


def test_a_notebook_cell_s_function_is_named_as_ipython_names_it():
    shell = pytest.importorskip("IPython.core.interactiveshell").InteractiveShell.instance()
    try:
        shell.run_cell("def train():\n    x = 1\n    raise ValueError(x)\n")
        fn = shell.user_ns["train"]
        placed = tracebacks.Sources(fn).place("train", fn.__code__.co_firstlineno + 2)
        filename, shown, first = placed
        assert filename == fn.__code__.co_filename
        assert shown.startswith("Cell In[") and first == fn.__code__.co_firstlineno
    finally:
        shell.clear_instance()


def test_workers_keep_rank_failures_out_of_the_client_s_output(capfd: pytest.CaptureFixture):
    """A LocalCluster's workers write to the client's stderr (a notebook's cell output):
    the rank's failure is raised once, not again as each worker's "Compute Failed" block."""
    # Started inside the test, so that its workers write to the stderr capfd reads.
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0")
    with cluster, Client(cluster) as client:
        job = dask_ddp.launch(client, _fail_on_rank_1)
        with pytest.raises(dask_ddp.RankFailedError):
            job.result(timeout=120)
        job.wait_stopped(60)
    out, errors = capfd.readouterr()
    assert "Compute Failed" not in out + errors


@pytest.mark.slow
def test_in_a_notebook_the_error_reads_once_from_the_cell_that_raised(tmp_path) -> None:
    """A real kernel (nbclient): the failing job's error names the cell and line that
    raised, with no Dask or dask_ddp frames, and no worker's "Compute Failed" block."""
    import re

    import nbformat
    from nbclient import NotebookClient

    cells = [
        "from distributed import Client, LocalCluster\nimport dask_ddp\n"
        "cluster = LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=':0')\n"
        "client = Client(cluster)",
        "def train():\n"
        "    dask_ddp.report({'loss': 1.0}, step=0)\n"
        "    if dask_ddp.get_context().rank == 1:\n"
        "        raise ValueError('bad batch at step 0')\n"
        "    import torch.distributed as dist\n"
        "    dist.barrier()",
        "job = dask_ddp.launch(client, train)\njob.result(timeout=120)",
        "job.wait_stopped(60)\nclient.close()\ncluster.close()",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(
        nb, timeout=240, kernel_name="python3", allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()  # fmt: skip
    errors = [o for o in nb.cells[2].outputs if o.output_type == "error"]
    assert [e.ename for e in errors] == ["RankFailedError"]
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(errors[0].traceback))
    assert "Cell In[2], line 4" in shown, shown  # the def cell, the line that raised
    assert "raise ValueError('bad batch at step 0')" in shown
    rank_part = shown.split("direct cause")[0]
    assert "_rank/tasks.py" not in shown and "site-packages" not in rank_part  # no Dask frames
    assert "<dynamic-code>" not in shown
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.outputs)
    assert "Compute Failed" not in printed


@pytest.mark.usefixtures("slow_publish")
def test_a_job_that_fails_before_its_futures_are_published_raises_the_rank_s_own_error(
    client: Client,
) -> None:
    job = dask_ddp.launch(client, _fail_on_rank_1)
    with pytest.raises(dask_ddp.RankFailedError) as info:
        job.result(timeout=60)
    assert isinstance(info.value.__cause__, ValueError)  # read from rank 1's future

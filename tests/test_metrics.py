"""report() -> Job.metrics on a real LocalCluster: completeness, order, isolation, live view."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import dask
import pytest
import torch
from distributed import Client, Event, LocalCluster
from distributed.utils_test import poll_for

import dask_ddp
from dask_ddp._client.model import JobModel
from dask_ddp._client.reader import EventReader
from dask_ddp._shared import protocol
from dask_ddp._shared.view import WidgetView, progress_line, render_html


def _burst(n: int) -> int:
    ctx = dask_ddp.get_context()
    for i in range(n):
        dask_ddp.report({"loss": 1.0 / (i + 1), "src": ctx.rank}, step=i)
    return n


def test_a_burst_arrives_complete_and_in_order(client: Client) -> None:
    n = 20_000
    job = dask_ddp.launch(client, _burst, args=(n,))
    assert job.result(timeout=120) == [n, n]
    records = job.metrics
    assert len(records) == 2 * n
    for rank in (0, 1):
        mine = [r for r in records if r.rank == rank]
        assert [r.step for r in mine] == list(range(n))
        assert all(r.metrics["src"] == rank for r in mine)
        assert [r.time for r in mine] == sorted(r.time for r in mine)
    assert records[-1].metrics.keys() == {"loss", "src"}


def _report_and_return(tag: int) -> int:
    for i in range(50):
        dask_ddp.report({"i": i}, step=i)
    dask_ddp.report({"tag": tag, "last": 1}, step=50)  # the function's last statement
    return tag


def test_records_reported_just_before_return_are_there_when_result_returns(
    client: Client,
) -> None:
    # An hour-long flush interval: only the flush at the end of the rank can deliver them.
    for tag in range(4):
        with dask.config.set({"ddp.event-flush-interval": "1 hour"}):
            job = dask_ddp.launch(client, _report_and_return, args=(tag,))
        assert job.result(timeout=120) == [tag, tag]
        last = [r for r in job.metrics if r.step == 50]
        assert sorted(r.rank for r in last) == [0, 1]
        assert all(r.metrics == {"tag": tag, "last": 1} for r in last)
        assert len(job.metrics) == 2 * 51


def _report_kinds() -> dict[str, str]:
    import numpy as np

    dask_ddp.report(
        {
            "tensor": torch.tensor(0.5),
            "f32": np.float32(0.25),
            "i64": np.int64(3),
            "flag": True,
            "huge": 2**70,
            "int": 4,
        },
        step=np.int64(7),
    )
    bad = {
        "list": ({"x": [1.0]}, {}),
        "vector": ({"x": torch.ones(3)}, {}),
        "text": ({"x": "1.0"}, {}),
        "key": ({1: 1.0}, {}),
        "mapping": ([("x", 1.0)], {}),
        "step": ({"x": 1.0}, {"step": 1.5}),
    }
    errors = {}
    for label, (metrics, kwargs) in bad.items():
        try:
            dask_ddp.report(metrics, **kwargs)
        except TypeError as exc:
            errors[label] = str(exc)
    return errors


def test_report_takes_numbers_and_0d_tensors_only(client: Client) -> None:
    job = dask_ddp.launch(client, _report_kinds, workers=1)
    (errors,) = job.result(timeout=120)
    (rec,) = job.metrics
    assert rec.step == 7 and type(rec.step) is int
    assert rec.metrics == {
        "tensor": 0.5,
        "f32": 0.25,
        "i64": 3,
        "flag": 1,
        "huge": float(2**70),
        "int": 4,
    }
    assert type(rec.metrics["tensor"]) is float and type(rec.metrics["i64"]) is int
    assert set(errors) == {"list", "vector", "text", "key", "mapping", "step"}
    assert "got list for 'x'" in errors["list"]
    assert "shape (3,)" in errors["vector"] and ".item()" in errors["vector"]
    assert "got str for 'x'" in errors["text"]
    assert "names as str" in errors["key"]
    assert "mapping" in errors["mapping"]
    assert "integer step" in errors["step"]


def test_report_outside_a_rank() -> None:
    with pytest.raises(dask_ddp.errors.NotInRankError, match=r"report\(\) works only inside"):
        dask_ddp.report({"loss": 1.0})


def test_on_report_iteration_and_dataframe(client: Client) -> None:
    seen: list[dask_ddp.MetricRecord] = []
    job = dask_ddp.launch(client, _burst, args=(500,), on_report=seen.append)
    streamed = list(job.iter_metrics(timeout=120))
    assert job.result(timeout=120) == [500, 500]
    assert streamed == job.metrics == seen
    assert len(seen) == 1000

    frame = job.metrics_frame()
    assert list(frame.columns) == ["rank", "step", "time", "loss", "src"]
    assert len(frame) == 1000
    assert frame.groupby("rank")["step"].max().to_dict() == {0: 499, 1: 499}
    assert (frame["rank"] == frame["src"]).all()


def test_a_failing_on_report_is_logged_and_dropped(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def broken(rec: dask_ddp.MetricRecord) -> None:
        calls.append(rec)
        raise RuntimeError("tensorboard is down")

    with caplog.at_level(logging.ERROR, logger="dask_ddp._client.reader"):
        job = dask_ddp.launch(client, _burst, args=(100,), on_report=broken)
        assert job.result(timeout=120) == [100, 100]
    assert len(calls) == 1
    assert len(job.metrics) == 200
    assert "on_report raised" in caplog.text and "tensorboard is down" in caplog.text
    assert "no longer called" in job._repr_html_()


def _report_then_wait(name: str) -> int:
    dask_ddp.report({"loss": 0.5}, step=0)
    assert Event(name).wait(timeout=60), "the test never saw the record"
    return dask_ddp.get_context().rank


def test_records_stream_while_the_job_runs(client: Client) -> None:
    name = f"seen-{uuid.uuid4().hex}"
    job = dask_ddp.launch(client, _report_then_wait, args=(name,))
    records = job.iter_metrics(timeout=60)
    first = [next(records), next(records)]
    assert not job.done()  # the ranks are still waiting for us
    assert sorted(r.rank for r in first) == [0, 1]
    Event(name, client=client).set()
    assert job.result(timeout=60) == [0, 1]
    assert list(records) == []


def _tagged(tag: int, n: int) -> int:
    for i in range(n):
        dask_ddp.report({"tag": tag}, step=i)
    return tag


def _events_kept(topic: str, dask_scheduler=None) -> int:
    return len(dask_scheduler.get_events(topic))


def _leave_a_reporting_thread(tag: int) -> str:
    def keep_reporting() -> None:
        while True:
            dask_ddp.report({"tag": tag})
            time.sleep(0.001)

    threading.Thread(target=keep_reporting, daemon=True).start()
    time.sleep(0.05)
    return "returned"


def test_two_jobs_never_see_each_others_records(client: Client) -> None:
    w0, w1 = sorted(client.scheduler_info(n_workers=-1)["workers"])
    a = dask_ddp.launch(client, _tagged, args=(1, 3000), workers=[w0])
    b = dask_ddp.launch(client, _tagged, args=(2, 3000), workers=[w1])
    assert a.result(timeout=120) == [1] and b.result(timeout=120) == [2]
    assert a.topic != b.topic
    assert [r.metrics["tag"] for r in a.metrics] == [1] * 3000
    assert [r.metrics["tag"] for r in b.metrics] == [2] * 3000
    # The cluster keeps a job's events (for clients that attach) until it is forgotten.
    assert client.run_on_scheduler(_events_kept, a.topic) > 0
    a.forget()
    poll_for(lambda: client.run_on_scheduler(_events_kept, a.topic) == 0, timeout=30)

    # A job's thread that outlives the job cannot report into the next one (it ends with
    # its rank's process).
    old = dask_ddp.launch(client, _leave_a_reporting_thread, args=(3,))
    assert old.result(timeout=120) == ["returned", "returned"]
    assert {r.metrics["tag"] for r in old.metrics} == {3}
    new = dask_ddp.launch(client, _tagged, args=(4, 10))
    assert new.result(timeout=120) == [4, 4]
    assert [r.metrics["tag"] for r in new.metrics] == [4] * 20


def _state(job_id: str, version: int, state: str, workers: list[str], **more: object) -> dict:
    """A message of the job's supervisor, as it sends them on the job's topic."""
    return {"kind": "state", "job": job_id, "version": version, "state": state,
            "run_id": job_id, "workers": workers, "backend": "gloo", **more}  # fmt: skip


def _subscribers(topic: str, dask_scheduler=None) -> list[str]:
    found = dask_scheduler._broker._topics.get(topic)  # distributed's own, for the test
    return [] if found is None else list(found.subscribers)


def _following(client: Client, job_id: str) -> tuple[JobModel, EventReader]:
    """A client following a job as launch() and attach() do (there, the cluster subscribes
    the client itself before answering; here the test waits for the subscription)."""
    model = JobModel(job_id, "test")
    reader = EventReader(client, model)
    reader.follow()
    reader.start()
    topic = protocol.job_topic(job_id)
    poll_for(lambda: client.id in client.run_on_scheduler(_subscribers, topic), timeout=30)
    return model, reader


def _until(model: JobModel, check: object) -> None:
    with model.cond:
        assert model.cond.wait_for(check, timeout=30), "the events never arrived"


def test_missing_events_are_filled_from_the_scheduler(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = uuid.uuid4().hex[:12]
    topic = protocol.job_topic(job_id)

    def event(seq: int, steps: range) -> dict:
        msgs = [[protocol.METRICS, [s, time.time(), {"s": s}]] for s in steps]
        return protocol.encode(job_id, 0, seq, msgs)

    # Events 0 and 1 reached the scheduler before this client followed the job.
    client.log_event(topic, event(0, range(0, 2)))
    client.log_event(topic, event(2, range(2, 5)))
    model, reader = _following(client, job_id)
    try:
        client.log_event(topic, event(5, range(5, 6)))
        _until(model, lambda: len(model.metrics) == 6)
        assert [r.step for r in model.metrics] == [0, 1, 2, 3, 4, 5]
        client.log_event(topic, event(2, range(2, 5)))  # a duplicate changes nothing
        # What the scheduler never held is reported lost, and the rest goes on.
        with caplog.at_level(logging.WARNING, logger="dask_ddp._client.reader"):
            client.log_event(topic, event(9, range(9, 10)))
            _until(model, lambda: len(model.metrics) == 7)
        assert [r.step for r in model.metrics][-1] == 9
        assert "3 messages from rank 0 were lost" in caplog.text
        assert model.notes == ["rank 0: 3 messages lost on the way"]
        client.log_event(topic, protocol.encode("another-job", 0, 10, [["m", [10, 0.0, {}]]]))
        client.log_event(topic, _state(job_id, 1, "succeeded", [], stopped=True))
        _until(model, lambda: model.closed)
        assert len(model.metrics) == 7 and model.state is dask_ddp.JobState.SUCCEEDED
    finally:
        reader.stop()


def test_status_messages_in_the_channel_reach_the_view(client: Client) -> None:
    worker = next(iter(client.scheduler_info(n_workers=-1)["workers"]))
    job_id = uuid.uuid4().hex[:12]
    topic = protocol.job_topic(job_id)
    model, reader = _following(client, job_id)
    try:
        now = time.time()
        client.log_event(topic, _state(job_id, 1, "running", [worker]))
        client.log_event(
            topic, protocol.encode(job_id, 0, 0, [[protocol.STATUS, ["joining", "1 of 2", now]]])
        )
        _until(model, lambda: model.progress.changes == 1)
        client.log_event(
            topic, protocol.encode(job_id, 0, 1, [[protocol.STATUS, [None, "listing", now]]])
        )
        _until(model, lambda: model.progress.changes == 2)
        rank = model.snapshot()["ranks"][0]
        assert (rank["status"], rank["activity"]) == ("joining", "listing")
        assert progress_line(model.snapshot()) == "r0 joining (listing)"
    finally:
        reader.stop()


def _slow_reports(n: int) -> int:
    for i in range(n):
        dask_ddp.report({"loss": 1.0 / (i + 1), "acc": i / n}, step=i)
        time.sleep(0.002)
    torch.distributed.barrier()  # both ranks report everything, then rank 1 fails
    if dask_ddp.get_context().rank == 1:
        raise ValueError("rank 1 gave up")
    return n


def test_live_view_shows_progress_curve_and_errors(client: Client) -> None:
    pytest.importorskip("ipywidgets")
    job = dask_ddp.launch(client, _slow_reports, args=(200,))
    view = WidgetView(job.world_size)
    with pytest.raises(dask_ddp.RankFailedError):
        job.result(timeout=120)
    assert len(list(job.iter_metrics(timeout=60))) == 400  # ends once the channel closed
    snap = job.view_state()
    view.update(snap)
    assert snap["metric"] == "loss"
    assert [r["step"] for r in snap["ranks"]] == [199, 199]
    assert view.bars[0].value == 200 and view.bars[0].max == 200  # steps 0..199 done
    assert view.bars[1].bar_style == "danger"
    assert "<polyline" in view.plot.value and "loss" in view.plot.value
    assert "rank 1 gave up" in view._errors.value
    assert "step 199" in view.labels[0].value
    page = render_html(snap)
    assert "<svg" in page and "rank 1 gave up" in page and "<progress" in page
    assert "r0 step 199" in progress_line(snap)


def test_watch_draws_a_progress_line(client: Client) -> None:
    import io

    out = io.StringIO()
    job = dask_ddp.launch(client, _burst, args=(300,))
    job.watch(file=out)
    assert job.done() and job.result(timeout=60) == [300, 300]
    line = out.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert f"job {job.job_id}" in line
    assert "600 reports" in line and "succeeded" in line and "r1 step 299" in line


@pytest.mark.slow
def test_live_view_in_a_notebook(cluster: LocalCluster) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipywidgets")
    cell = nbformat.v4.new_code_cell
    nb = nbformat.v4.new_notebook(
        cells=[
            cell(
                "import time\nimport dask_ddp\nfrom distributed import Client\n"
                f"client = Client({cluster.scheduler_address!r})"
            ),
            cell(
                "def train(n):\n"
                "    for i in range(n):\n"
                "        dask_ddp.report({'loss': 1 / (i + 1)}, step=i)\n"
                "        time.sleep(0.003)\n"
                "    return n\n"
                "job = dask_ddp.launch(client, train, args=(1000,))\n"
                "job"
            ),
            cell(
                "view = job._model.views[-1]  # the widget the cell above displayed\n"
                "updates = []\n"
                "view.plot.observe(lambda ch: updates.append(job.done()), 'value')\n"
                "print(job.result(timeout=120))\n"
                "print('updates while running:', updates.count(False))\n"
                "print('bars:', [b.value for b in view.bars])\n"
                "print('curve:', '<polyline' in view.plot.value)"
            ),
        ]
    )
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    display = nb.cells[1].outputs
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in display)
    text = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert "[1000, 1000]" in text
    assert "bars: [1000, 1000]" in text and "curve: True" in text  # steps 0..999 done
    running_updates = int(text.split("updates while running:")[1].split()[0])
    assert running_updates >= 1, text


class _ReportingDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        dask_ddp.report({"i": i})
        return i


def _report_from_a_dataloader_worker() -> str:
    import multiprocessing

    loader = torch.utils.data.DataLoader(
        _ReportingDataset(),
        num_workers=1,
        multiprocessing_context=multiprocessing.get_context("fork"),
    )
    try:
        list(loader)
    except Exception as exc:
        return str(exc)
    return "no error"


def test_report_in_a_forked_dataloader_worker_fails_loudly(client: Client) -> None:
    (message,) = dask_ddp.launch(client, _report_from_a_dataloader_worker, workers=1).result(
        timeout=120
    )
    assert "forked from the rank" in message


def test_channel_settings_are_resolved_on_the_client() -> None:
    from dask_ddp import config

    settings = config.resolve()
    assert settings.max_event_bytes == 64_000
    assert settings.event_flush_interval == 0.05 and settings.event_drain_timeout == 10.0
    with dask.config.set({"ddp.max-event-bytes": "1MiB", "ddp.event-flush-interval": "1s"}):
        settings = config.resolve()
    assert settings.max_event_bytes == 2**20 and settings.event_flush_interval == 1.0
    with (
        dask.config.set({"ddp.max-event-bytes": "0B"}),
        pytest.raises(ValueError, match="max-event-bytes"),
    ):
        config.resolve()


def _spaced_reports(n: int, gap: float) -> int:
    for i in range(n):
        dask_ddp.report({"loss": 1.0 / (i + 1)}, step=i)
        time.sleep(gap)
    return n


def _events_per_rank(client: Client, job: dask_ddp.Job) -> list[int]:
    counts = [0, 0]
    for _, msg in client.get_events(protocol.job_topic(job.job_id)):
        if isinstance(msg.get("rank"), int):  # not the supervisor's own messages
            counts[msg["rank"]] += 1
    return counts


def test_job_event_rate_makes_each_rank_of_a_job_send_fewer_events(client: Client) -> None:
    # 8 reports 0.15 s apart: at the default flush interval (0.2 s) nearly one event each;
    # at 0.5 events/s for 2 ranks, one flush per 4 s per rank: the first record, the rest
    # together when the rank ends.
    job = dask_ddp.launch(client, _spaced_reports, args=(8, 0.15))
    assert job.result(timeout=120) == [8, 8]
    assert min(_events_per_rank(client, job)) >= 5
    with dask.config.set({"ddp.job-event-rate": 0.5}):
        job = dask_ddp.launch(client, _spaced_reports, args=(8, 0.15))
    assert job.result(timeout=120) == [8, 8]
    assert len(job.metrics) == 16  # fewer events, every record
    assert max(_events_per_rank(client, job)) <= 3


def test_job_event_rate_bounds_a_large_job_s_flush_interval() -> None:
    from dask_ddp import config

    assert config.resolve().job_event_rate == 2000
    # Up to 400 ranks the interval is ddp.event-flush-interval; beyond, N / rate.
    assert protocol.flush_interval(400, 0.2, 2000) == 0.2
    assert protocol.flush_interval(4000, 0.2, 2000) == 2.0
    with (
        dask.config.set({"ddp.job-event-rate": 0}),
        pytest.raises(ValueError, match="job-event-rate must be a positive number"),
    ):
        config.resolve()


def test_the_curve_reads_a_loss_that_falls_five_decades() -> None:
    import math

    from dask_ddp._shared import view

    ranks = [
        {"rank": r, "curve": [(s, (2.3 - r / 10) * math.exp(-s / 15)) for s in range(200)]}
        for r in (0, 1)
    ]
    svg = view.svg_curve(ranks, "loss")
    assert "loss (log scale)" in svg  # 2.3 down to 4e-06
    assert ">1e-06<" in svg and ">0.01<" in svg and ">1<" in svg  # decades as ticks
    assert ">rank 0<" in svg and ">rank 1<" in svg  # a legend
    assert svg.count("<polyline") == 4  # raw (faint) and smoothed, per rank
    assert 'fill="currentColor"' in svg  # text follows the notebook's theme
    flat = [{"rank": 0, "curve": [(s, 1.0 - s / 100) for s in range(50)]}]
    assert "log scale" not in view.svg_curve(flat, "acc")


def test_smoothing_is_tensorboards() -> None:
    from dask_ddp._shared import view

    assert view.smoothed([1.0, 1.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])  # debiased
    assert view.smoothed([0.0, 10.0]) == pytest.approx([0.0, 6.25])


def test_a_rank_s_end_is_shown_as_the_supervisor_typed_it() -> None:
    """The supervisor sends how each rank ended as a typed value; the client shows it and
    never reads a status back out of its words (a why that starts with another status's
    word changes nothing)."""
    model = JobModel("3f2a", "train")
    ends = [["failed", "finished: the words are not read"], ["stopped", "rank 0 failed"], None]
    workers = [f"tcp://w:{r}" for r in range(3)]
    model.apply_state(_state("3f2a", 1, "failed", workers, ended=ends))
    ranks = model.snapshot()["ranks"]
    assert [r["status"] for r in ranks] == ["failed", "stopped", "submitted"]
    assert ranks[0]["error"] == "failed: finished: the words are not read"
    assert ranks[1]["error"] == "stopped: rank 0 failed" and ranks[2]["error"] is None


def test_the_widget_follows_a_job_that_changes_size() -> None:
    pytest.importorskip("ipywidgets")

    model = JobModel("3f2a", "train")  # an elastic job waiting for workers: no rank yet
    view = WidgetView(0)
    view.update(model.snapshot())
    for version, size in ((1, 3), (2, 2)):  # placed on 3 workers, then one is lost
        workers = [f"tcp://w:{r}" for r in range(size)]
        model.apply_state(_state("3f2a", version, "running", workers, attempt=version - 1))
        view.update(model.snapshot())
        assert len(view.bars) == size and len(view.widget.children) == size + 4


def _count_steps(steps: int) -> int:
    for step in range(steps):
        dask_ddp.report({"loss": 1.0 / (step + 1)}, step=step)
        time.sleep(0.01)
    return steps


def test_bars_with_a_total_show_steps_done_percent_and_time_left(client: Client) -> None:
    job = dask_ddp.launch(client, _count_steps, args=(50,), total_steps=200)
    job.result(timeout=120)
    snap = job.view_state()
    assert snap["total"] == 200
    page = render_html(snap)
    assert "<progress value='50' max='200'>" in page
    rates = [r["step_rate"] for r in snap["ranks"]]
    for rate in rates:  # tqdm's "elapsed<left": 150 steps to go at the rank's rate
        left = int(150 / rate)
        assert f"<{left // 60:02d}:{left % 60:02d}, {rate:.1f} steps/s" in page
    assert page.count("50/200 (25%)") == len(rates) == 2
    assert "relative to the leading rank" not in page
    without = dask_ddp.launch(client, _count_steps, args=(5,))
    without.result(timeout=120)
    assert "bars relative to the leading rank" in render_html(without.view_state())
    with pytest.raises(ValueError, match="total_steps"):
        dask_ddp.launch(client, _count_steps, args=(5,), total_steps=0)


def test_the_views_are_redrawn_at_once_when_idle_and_paced_under_a_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A change after a quiet spell is drawn at once; under a stream, one redraw every
    `_VIEW_GAP`, and a slow view (one whose redraw takes d) waits d / `_VIEW_SHARE`, so that
    drawing never takes more than that share of the client's loop. (On a clock of the
    test's: what it checks is the schedule, not the machine's speed.)"""
    from dask_ddp._client import model as _model

    clock = [1000.0]
    monkeypatch.setattr(_model.time, "monotonic", lambda: clock[0])
    calls: list[tuple[float, Any]] = []
    model = JobModel("3f2a", "train")
    model.schedule = lambda delay, fn: calls.append((delay, fn))

    class Drawn:
        took = 0.0

        def update(self, snap: dict[str, Any]) -> None:
            clock[0] += self.took

    drawn = Drawn()
    model.views.append(drawn)
    model.mark_views()
    ((delay, fn),) = calls
    assert delay == 0  # quiet: at once
    model.mark_views()  # already due: one redraw shows both
    assert len(calls) == 1
    fn()
    clock[0] += 0.001
    model.mark_views()  # right after a redraw: paced
    assert calls[-1][0] == pytest.approx(_model._VIEW_GAP - 0.001)
    clock[0] += calls[-1][0]
    calls[-1][1]()
    clock[0] += _model._VIEW_GAP
    model.mark_views()  # a gap since the last: at once again
    assert calls[-1][0] == 0
    drawn.took = 0.02  # a slow view: it waits its cost over the share
    calls[-1][1]()
    model.mark_views()
    assert calls[-1][0] == pytest.approx(0.02 / _model._VIEW_SHARE - 0.02)


def _reports_with_a_large_one(n: int) -> int:
    for i in range(n):
        dask_ddp.report({"loss": 1.0 / (i + 1), "acc": i / n}, step=i)
    # One record over the channel's event budget: it travels by reference.
    dask_ddp.report({"loss": 0.01, **{f"w{k}": float(k) for k in range(8000)}}, step=n)
    return n


def _supervisor_ranks(job_id: str, dask_scheduler=None) -> list[dict]:
    return dask_scheduler.plugins["dask-ddp"].jobs[job_id].progress.page_ranks()


def test_the_notebook_and_the_page_show_one_account_of_progress(client: Client) -> None:
    """The supervisor and a client take the same events into the same Progress: the page's
    rows and the notebook's agree, a record sent by reference counted on both."""
    job = dask_ddp.launch(client, _reports_with_a_large_one, args=(40,))
    assert job.result(timeout=120) == [40, 40]

    def agree() -> bool:
        return job._model.progress.page_ranks() == client.run_on_scheduler(
            _supervisor_ranks, job.job_id
        )

    poll_for(agree, timeout=30)
    ranks = job._model.progress.page_ranks()
    assert [r["count"] for r in ranks] == [41, 41] and [r["step"] for r in ranks] == [40, 40]
    assert [r["status"] for r in ranks] == ["finished", "finished"]
    assert len(job.metrics) == 82


def test_an_event_that_says_a_phase_then_an_activity_keeps_the_phase() -> None:
    """A rank's event tells its last status; an activity-only status after a phase in the
    same batch keeps that phase (the page and the notebook would miss it otherwise)."""
    told = protocol.Told()
    told.add(protocol.STATUS, ["joining", "1 of 2", 1.0], None)
    told.add(protocol.STATUS, [None, "listing", 2.0], None)
    assert told.status == protocol.Status("joining", "listing", 2.0)

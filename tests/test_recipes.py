"""The TensorBoard and MLflow recipes of docs/metrics.md, run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from distributed import Client

import dask_ddp

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def _recipe(name: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    return next(b for b in blocks if b.startswith(f"# recipe: {name}\n"))


def train() -> int:
    ctx = dask_ddp.get_context()
    for step in range(5):
        dask_ddp.report({"loss": 1.0 / (step + 1) + ctx.rank}, step=step)
    return ctx.rank


def _run(name: str, client: Client, where: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.chdir(where)  # the recipes write under the working directory
    scope = {"client": client, "train": train, "dask_ddp": dask_ddp}
    exec(compile(_recipe(name), f"docs/metrics.md ({name} recipe)", "exec"), scope)
    return scope


def test_tensorboard_recipe(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run("tensorboard", client, tmp_path, monkeypatch)
    events = EventAccumulator(str(tmp_path / "runs" / "job1"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss/rank0", "loss/rank1"]
    rank1 = events.Scalars("loss/rank1")
    assert [e.step for e in rank1] == [0, 1, 2, 3, 4]
    assert rank1[0].value == pytest.approx(2.0)


def test_mlflow_recipe(client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")

    scope = _run("mlflow", client, tmp_path, monkeypatch)
    history = mlflow.MlflowClient().get_metric_history(scope["run"].info.run_id, "loss_rank0")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (step, pytest.approx(1.0 / (step + 1))) for step in range(5)
    ]

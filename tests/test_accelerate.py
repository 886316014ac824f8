"""An HF accelerate script, with dask_ddp's tracker added, logs into Job.metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import Client

import dask_ddp

pytest.importorskip("accelerate")

ACCELERATE_SCRIPT = """
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from dask_ddp.integrations.accelerate import DaskDDPTracker  # the one line added

accelerator = Accelerator(cpu=True, log_with=[DaskDDPTracker()])  # and here
accelerator.init_trackers("tiny", config={"lr": 0.1})
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
model, opt, data = accelerator.prepare(model, opt, data)
for step, (x, y) in enumerate(data):
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    accelerator.log({"train_loss": loss.item(), "phase": "train"}, step=step)
accelerator.end_training()
print("world", accelerator.num_processes)
"""


@pytest.mark.slow
def test_an_accelerate_script_logs_into_job_metrics(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "train_accelerate.py"
    path.write_text(ACCELERATE_SCRIPT)
    job = dask_ddp.launch_script(client, path)
    assert job.result(timeout=240) == [0, 0]
    assert sorted(line.text for line in job.output if line.text.startswith("world")) == [
        "world 2",
        "world 2",
    ]
    logged = [r for r in job.metrics if "train_loss" in r.metrics]
    assert [r.step for r in logged] == list(range(4))  # 64 rows, 2 ranks, batches of 8
    assert {r.rank for r in logged} == {0}  # Accelerator.log calls trackers on rank 0
    assert all(set(r.metrics) == {"train_loss"} for r in logged)  # strings left out

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


def _train_with_hf_trainer(output_dir: str) -> dict:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from dask_ddp.integrations.transformers import DaskDDPCallback

    ctx = dask_ddp.get_context()

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
            return {"loss": torch.nn.functional.mse_loss(self.layer(x), labels)}

    seen: list[int] = []

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kw) -> None:
            seen.append(state.global_step)
            if ctx.attempt == 0 and ctx.rank == 1 and state.global_step == 10:
                raise dask_ddp.RetryableError("rank 1 lost its feature store at step 10")

    torch.manual_seed(0)
    rows = [{"x": torch.randn(4), "labels": torch.randn(1)} for _ in range(512)]
    args = TrainingArguments(
        output_dir=output_dir, max_steps=16, save_steps=4, logging_steps=2,
        per_device_train_batch_size=8, learning_rate=0.05, use_cpu=True, report_to=[],
        disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(Tiny(), args, train_dataset=rows, callbacks=[DaskDDPCallback(), Crash()])
    resume = DaskDDPCallback.resume_dir()
    trainer.train(resume_from_checkpoint=resume)
    weight = trainer.model.layer.weight.detach().clone()
    return {"resume": resume, "first": seen[0], "end": trainer.state.global_step, "w": weight}


@pytest.mark.slow
def test_an_hf_trainer_reports_and_resumes_from_the_job_s_checkpoint(
    client: Client, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    import torch

    job = dask_ddp.launch(
        client, _train_with_hf_trainer, (str(tmp_path / "hf"),),
        checkpoint_dir=str(tmp_path / "job"), max_restarts=1,
    )  # fmt: skip
    out = job.result(timeout=300)
    assert job.attempts == 2
    assert [c.step for c in job.checkpoints] == [4, 8, 12, 16]
    # The second attempt resumed from the job's step-8 checkpoint on both ranks.
    assert [o["resume"].endswith("checkpoint-8") for o in out] == [True, True]
    assert [(o["first"], o["end"]) for o in out] == [(9, 16), (9, 16)]
    torch.testing.assert_close(out[0]["w"], out[1]["w"])  # one model, trained with DDP
    logged = [r for r in job.metrics if "loss" in r.metrics]
    assert {r.rank for r in logged} == {0, 1}
    assert {r.step for r in logged} >= {2, 4, 6, 8, 10, 12, 14, 16}
    assert all("learning_rate" in r.metrics for r in logged)

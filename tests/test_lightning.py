"""Lightning inside a rank: it sees a torchrun-style (TorchElastic) launch and trains with
the process group dask_ddp set up."""

from __future__ import annotations

import pytest
import torch
from distributed import Client

import dask_ddp

pytest.importorskip("lightning")


def _tiny_module() -> torch.nn.Module:
    """A one-layer LightningModule (defined here: Lightning is imported in the rank)."""
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny()


def _fit_with_lightning() -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    ctx = dask_ddp.get_context()
    torch.manual_seed(ctx.rank)  # different data per rank; DDP keeps the weights equal
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ctx.local_world_size,
        num_nodes=ctx.world_size // ctx.local_world_size,
        strategy="ddp",
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = _tiny_module()
    torch.manual_seed(0)
    model.layer.reset_parameters()
    trainer.fit(model, DataLoader(data, batch_size=8))
    return {
        "launched_by_torchelastic": torch.distributed.is_torchelastic_launched(),
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "global_rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "weight": model.layer.weight.detach().clone(),
    }


@pytest.mark.slow
def test_lightning_chooses_its_torchelastic_environment(client: Client) -> None:
    out = dask_ddp.launch(client, _fit_with_lightning).result(timeout=240)
    assert [o["launched_by_torchelastic"] for o in out] == [True, True]
    assert [o["environment"] for o in out] == ["TorchElasticEnvironment"] * 2
    assert [(o["global_rank"], o["world_size"]) for o in out] == [(0, 2), (1, 2)]
    torch.testing.assert_close(out[0]["weight"], out[1]["weight"])  # trained as one model


LIGHTNING_SCRIPT = """
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from dask_ddp.integrations.lightning import DaskDDPLogger  # the one line added


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=6, log_every_n_steps=2,
        logger=DaskDDPLogger(),  # and here
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))
"""


@pytest.mark.slow
def test_a_lightning_script_logs_into_job_metrics(client: Client, tmp_path) -> None:
    path = tmp_path / "train_lightning.py"
    path.write_text(LIGHTNING_SCRIPT)
    job = dask_ddp.launch_script(client, path)
    assert job.result(timeout=240) == [0, 0]
    logged = [r for r in job.metrics if "train_loss" in r.metrics]
    assert {r.rank for r in logged} == {0, 1}  # every rank's, not only rank 0's
    assert sorted({r.step for r in logged if r.rank == 0}) == [1, 3, 5]  # every 2nd step


def test_the_logger_outside_a_rank_sends_nothing_and_says_so_once(caplog, monkeypatch) -> None:
    from dask_ddp.integrations.lightning import DaskDDPLogger

    real, tried, sent = dask_ddp.report, [], []

    def report(metrics, *, step=None):  # the real report(), watched: what got through?
        tried.append(step)
        real(metrics, step=step)  # outside a rank it refuses the record
        sent.append((dict(metrics), step))

    monkeypatch.setattr(dask_ddp, "report", report)
    log = DaskDDPLogger(prefix="train/")
    assert (log.name, log.version) == ("dask_ddp", "local")
    log.log_metrics({"loss": torch.tensor(0.5), "note": "text"}, step=1)
    log.log_metrics({"loss": 0.4}, step=2)
    assert tried == [1, 2] and sent == []  # both records offered, neither sent
    assert caplog.text.count("outside a dask_ddp rank") == 1


def _fit_failing_once(root: str) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from dask_ddp.integrations.lightning import DaskDDPCheckpoint

    ctx = dask_ddp.get_context()
    seen: dict = {}

    class Watch(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            seen["started_at"] = trainer.global_step

        def on_train_batch_end(self, trainer, *args) -> None:
            if ctx.attempt == 0 and ctx.rank == 1 and trainer.global_step == 10:
                raise dask_ddp.RetryableError("rank 1 lost its feature store at step 10")

    data = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    trainer = L.Trainer(
        accelerator="cpu", devices=ctx.local_world_size,
        num_nodes=ctx.world_size // ctx.local_world_size, strategy="ddp", max_steps=16,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=root, every_n_train_steps=4, save_top_k=-1),
            DaskDDPCheckpoint(),  # the line added
            Watch(),
        ],
    )  # fmt: skip
    resume = DaskDDPCheckpoint.resume_path()
    trainer.fit(_tiny_module(), DataLoader(data, batch_size=8), ckpt_path=resume)
    return {"resume": resume, "started_at": seen["started_at"], "end": trainer.global_step}


@pytest.mark.slow
def test_lightning_checkpoints_go_to_the_job_and_a_restart_resumes_there(
    client: Client, tmp_path
) -> None:
    job = dask_ddp.launch(
        client, _fit_failing_once, (str(tmp_path / "lightning"),),
        checkpoint_dir=str(tmp_path / "job"), max_restarts=1,
    )  # fmt: skip
    out = job.result(timeout=240)
    assert job.attempts == 2
    # The second attempt resumed from the job's newest checkpoint: Lightning's own, of step 8.
    assert [o["resume"].rsplit("/", 1)[-1] for o in out] == ["checkpoint-000000000008.pt"] * 2
    assert [o["started_at"] for o in out] == [8, 8]
    assert [o["end"] for o in out] == [16, 16]
    assert [c.step for c in job.checkpoints] == [4, 8, 12, 16]

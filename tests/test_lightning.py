"""Lightning inside a rank: it sees a torchrun-style (TorchElastic) launch and trains with
the process group dask_ddp set up."""

from __future__ import annotations

import pytest
import torch
from distributed import Client

import dask_ddp

pytest.importorskip("lightning")


def _fit_with_lightning() -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

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
    model = Tiny()
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

"""``python -m dask_ddp`` with torchrun's restarts and ranges: ``--max-restarts``,
``--nworkers MIN:MAX`` and ``--checkpoint-dir``.

The PyTorch DDP tutorial's own-snapshot pattern, killed and resumed, is compared with
torchrun in test_torchrun_parity.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from distributed import LocalCluster

GROWS = textwrap.dedent(
    """
    import time
    import torch, torch.distributed as dist
    import dask_ddp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = dask_ddp.get_checkpoint()
    start = 0 if state is None else state["step"] + 1
    for step in range(start, 300):
        t = torch.ones(1)
        dist.all_reduce(t)
        if rank == 0:
            print(f"step {step} world {int(t.item())}", flush=True)
        if world == 3 and step >= start + 2:
            break
        time.sleep(0.1)
        dask_ddp.save_checkpoint({"step": step}, step=step)  # where the job may grow
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_a_range_grows_the_script_at_its_next_checkpoint_when_a_worker_joins(
    own_cluster: LocalCluster, tmp_path: Path
) -> None:
    script = tmp_path / "grows.py"
    script.write_text(GROWS)
    address = own_cluster.scheduler_address
    command = [sys.executable, "-m", "dask_ddp", "--scheduler", address, "--nworkers", "2:3"]
    command += ["--checkpoint-dir", str(tmp_path / "checkpoints"), str(script)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == "[rank 0] step 2 world 2":
            own_cluster.scale(3)  # a third worker joins while the job runs on two
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (lines[-5:], err[-3000:])
    assert "[rank 0] step 0 world 2" in lines and lines[-1].endswith("world 3"), lines
    (outcome,) = [line for line in err.splitlines() if line.startswith("dask_ddp:")]
    assert "every rank finished: 3 ranks" in outcome and "3 ranks after grow" in outcome


# Appended to test_lightning's script (its imports and LightningModule): a ModelCheckpoint,
# DaskDDPCheckpoint and the resume path, as docs/scripts.md says.
LIGHTNING_RESUMES = textwrap.dedent(
    """
    import os, signal, sys
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from dask_ddp.integrations.lightning import DaskDDPCheckpoint


    class Test(Callback):  # the test's: says where training starts, kills a worker once
        def on_train_start(self, trainer, pl_module):
            if trainer.global_rank == 0:
                print(f"started at step {trainer.global_step}", flush=True)

        def on_train_batch_end(self, trainer, *args):
            first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
            if first and trainer.global_rank == 1 and trainer.global_step == 10:
                os.kill(os.getpid(), signal.SIGKILL)


    if __name__ == "__main__":
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy="ddp", max_steps=16, logger=False,
            enable_progress_bar=False, enable_model_summary=False,
            callbacks=[
                ModelCheckpoint(dirpath=sys.argv[1], every_n_train_steps=4, save_top_k=-1),
                DaskDDPCheckpoint(),
                Test(),
            ],
        )
        resume = DaskDDPCheckpoint.resume_path()  # None on the first attempt
        trainer.fit(Tiny(), DataLoader(data, batch_size=8), ckpt_path=resume)
        if trainer.global_rank == 0:
            print(f"ended at step {trainer.global_step}", flush=True)
    """
)


@pytest.mark.slow
def test_a_lightning_script_resumes_from_the_checkpoint_dir_after_a_kill(tmp_path: Path) -> None:
    from test_lightning import LIGHTNING_SCRIPT  # skips without Lightning

    module = LIGHTNING_SCRIPT.split('if __name__ == "__main__":')[0]
    script = tmp_path / "train_lightning.py"
    script.write_text(module + LIGHTNING_RESUMES)
    checkpoints = tmp_path / "checkpoints"
    done = subprocess.run(
        [sys.executable, "-m", "dask_ddp", "--max-restarts", "1", "--checkpoint-dir",
         str(checkpoints), str(script), str(tmp_path / "lightning")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    started = [line for line in done.stdout.splitlines() if line.startswith("started at")]
    assert started == ["started at step 0", "started at step 8"], done.stdout
    assert "ended at step 16" in done.stdout
    assert sorted(os.listdir(checkpoints))[-1] == "checkpoint-000000000016.pt"
    (outcome,) = [line for line in done.stderr.splitlines() if line.startswith("dask_ddp:")]
    assert "2 ranks after rank 1" in outcome, outcome

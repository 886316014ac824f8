"""The same scripts under ``torchrun`` and ``python -m dask_ddp``, compared.

The first is the PyTorch DDP tutorial's pattern (``multigpu_torchrun.py`` with its
``datautils.py``, written here for the CPU and gloo): a ``Trainer`` that saves a snapshot
every epoch and resumes from it, started by path from another folder. A worker is
SIGKILLed mid-run (rank 1 kills its own process in epoch 2 of the first attempt), and
both launchers, given one restart, finish with the same parameters and the same torchrun
environment. The second saves a model of its own class with ``torch.save`` and loads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from distributed import Client

DATAUTILS = textwrap.dedent(
    """
    import torch
    from torch.utils.data import Dataset


    class MyTrainDataset(Dataset):
        def __init__(self, size):
            g = torch.Generator().manual_seed(0)  # the same samples on every rank and run
            self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g))
                         for _ in range(size)]

        def __len__(self):
            return len(self.data)

        def __getitem__(self, index):
            return self.data[index]
    """
)

# The tutorial's multigpu_torchrun.py for the CPU: gloo, no device ids; plus the kill, the
# environment each rank saw, and the final parameters written for the comparison.
TUTORIAL = textwrap.dedent(
    """
    import argparse, json, os, signal
    import torch
    from torch.distributed import destroy_process_group, init_process_group
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from datautils import MyTrainDataset

    ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
           "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
           "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")


    class Trainer:
        def __init__(self, model, train_data, optimizer, save_every, snapshot_path, out):
            self.rank = int(os.environ["RANK"])
            self.model, self.train_data, self.optimizer = model, train_data, optimizer
            self.save_every, self.snapshot_path, self.out = save_every, snapshot_path, out
            self.epochs_run = 0
            if os.path.exists(snapshot_path):
                self._load_snapshot()
            self.model = DDP(self.model)

        def _load_snapshot(self):
            snapshot = torch.load(self.snapshot_path)
            self.model.load_state_dict(snapshot["MODEL_STATE"])
            self.epochs_run = snapshot["EPOCHS_RUN"] + 1
            print(f"Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

        def _run_epoch(self, epoch):
            self.train_data.sampler.set_epoch(epoch)
            for step, (source, targets) in enumerate(self.train_data):
                if (step == 1 and epoch == 2 and self.rank == 1
                        and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
                    os.kill(os.getpid(), signal.SIGKILL)  # the worker dies mid-epoch
                self.optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(self.model(source), targets)
                loss.backward()
                self.optimizer.step()

        def _save_snapshot(self, epoch):
            state = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
            torch.save(state, self.snapshot_path)

        def train(self, max_epochs):
            for epoch in range(self.epochs_run, max_epochs):
                self._run_epoch(epoch)
                if self.rank == 0 and epoch % self.save_every == 0:
                    self._save_snapshot(epoch)
            if self.rank == 0:
                torch.save(self.model.module.state_dict(), os.path.join(self.out, "final.pt"))


    def main(save_every, total_epochs, batch_size, snapshot_path, out):
        init_process_group(backend="gloo")
        seen = {k: os.environ.get(k) for k in ENV}
        name = f"env-{seen['TORCHELASTIC_RESTART_COUNT']}-{seen['RANK']}.json"
        with open(os.path.join(out, name), "w") as f:
            json.dump(seen, f)
        dataset = MyTrainDataset(1024)
        torch.manual_seed(0)
        model = torch.nn.Linear(20, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        data = DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset))
        Trainer(model, data, optimizer, save_every, snapshot_path, out).train(total_epochs)
        destroy_process_group()


    if __name__ == "__main__":
        parser = argparse.ArgumentParser()
        parser.add_argument("total_epochs", type=int)
        parser.add_argument("save_every", type=int)
        parser.add_argument("--batch_size", default=32, type=int)
        parser.add_argument("--out", required=True)
        args = parser.parse_args()
        main(args.save_every, args.total_epochs, args.batch_size, "snapshot.pt", args.out)
    """
)

LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"],
    "dask_ddp": [sys.executable, "-m", "dask_ddp"],
}

# torchrun 2.14's restarted ranks share its agent's store with the ranks before them, and
# gloo read the dead rank's address from it (connectFullMesh: connection refused, 3 of 3
# tries here): the test gives torchrun ranks a store of their own, as dask_ddp does.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _run(name: str, command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(TORCHRUN_ENV if name == "torchrun" else {})}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    # torchrun's gloo ranks now and then abort as they exit, after the work is done
    # (benchmarks/cli.py sees it too): its output is checked, not its status.
    assert name == "torchrun" or done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return done


@pytest.mark.slow
def test_the_tutorial_resumes_from_its_snapshot_after_a_kill_as_under_torchrun(
    tmp_path: Path,
) -> None:
    code = tmp_path / "ddp-tutorial-series"
    code.mkdir()
    (code / "multigpu_torchrun.py").write_text(TUTORIAL)
    (code / "datautils.py").write_text(DATAUTILS)
    sizes = {
        "torchrun": ["--nproc-per-node", "2", "--max-restarts", "1"],
        "dask_ddp": ["--nworkers", "2", "--max-restarts", "1"],
    }
    final, env = {}, {}
    for name, launcher in LAUNCHERS.items():
        run = tmp_path / name  # the working directory: snapshot.pt lands here
        run.mkdir()
        script = [str(code / "multigpu_torchrun.py"), "4", "1", "--out", str(run)]
        done = _run(name, [*launcher, *sizes[name], *script], cwd=run)
        assert (run / "final.pt").exists(), (name, done.stdout[-2000:], done.stderr[-3000:])
        assert (run / "snapshot.pt").exists()  # the ranks' working directory is the command's
        assert done.stdout.count("Resuming training from snapshot at Epoch 2") == 2, done.stdout
        final[name] = torch.load(run / "final.pt")
        env[name] = {p.stem: json.loads(p.read_text()) for p in run.glob("env-*.json")}
    for key, value in final["torchrun"].items():
        assert torch.equal(value, final["dask_ddp"][key]), key
    # Both attempts of both ranks, with the same torchrun variables (the run id differs).
    assert sorted(env["dask_ddp"]) == sorted(env["torchrun"]) == ["env-0-0", "env-0-1", "env-1-0",
                                                                    "env-1-1"]  # fmt: skip
    for name in ("torchrun", "dask_ddp"):
        run_ids = {seen.pop("TORCHELASTIC_RUN_ID") for seen in env[name].values()}
        assert len(run_ids) == 1 and None not in run_ids, run_ids  # constant across restarts
    assert env["dask_ddp"] == env["torchrun"]


OWN_CLASS = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x)


    dist.init_process_group("gloo")
    model = Net()
    path = os.path.join(sys.argv[1], f"net-{dist.get_rank()}.pt")
    torch.save(model, path)  # the whole model: pickled as __main__.Net
    loaded = torch.load(path, weights_only=False)
    assert type(loaded) is Net and torch.equal(loaded.fc.weight, model.fc.weight)
    print(f"loaded {type(loaded).__module__}.{type(loaded).__qualname__}", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_a_script_saves_and_loads_a_model_of_its_own_class_as_under_torchrun(
    client: Client, tmp_path: Path
) -> None:
    script = tmp_path / "own_class.py"
    script.write_text(OWN_CLASS)
    sizes = {
        "torchrun": ["--nproc-per-node", "2"],
        "dask_ddp": ["--scheduler", client.scheduler.address],
    }
    for name, launcher in LAUNCHERS.items():
        done = _run(name, [*launcher, *sizes[name], str(script), str(tmp_path)], cwd=tmp_path)
        assert done.stdout.count("loaded __main__.Net") == 2, (name, done.stdout)

"""A torchrun-style DDP training script: it runs unchanged under torchrun and dask_ddp.

    torchrun --nproc-per-node 2 examples/train.py --steps 30
    python -m dask_ddp examples/train.py --steps 30

It reads RANK/WORLD_SIZE/LOCAL_RANK from the environment and calls init_process_group
itself, trains a small CNN on generated images, and checks that every rank ends with the
same parameters (which is what DistributedDataParallel guarantees).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 1, 28, 28, generator=g) * 0.5
    images[torch.arange(n), 0, labels * 2, :] += 2.0  # a learnable pattern per class
    return TensorDataset(images, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(256, 10),
        )
    )
    data = make_data(args.steps * args.batch_size * world)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start = time.perf_counter()
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.3f}", flush=True)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered), "ranks diverged"
    if rank == 0:
        elapsed = time.perf_counter() - start
        print(
            f"rank 0 of {world} (LOCAL_RANK={os.environ['LOCAL_RANK']}): {step + 1} steps in "
            f"{elapsed:.1f} s, final loss {loss.item():.3f}, parameters identical on every rank",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

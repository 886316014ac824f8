"""The training code of webdataset's notebook "WebIndexedDataset + Distributed PyTorch
Training" (examples/train-resnet50-multiray-wids.ipynb), cell by cell, changed only in:

* ``import wids`` -> ``import dask_ddp.data as wids``;
* ``.cuda()`` -> ``.to("cpu")`` (the suite has no GPU), and the DataLoader's
  ``num_workers=4`` -> ``num_workers=2`` (2 ranks on a 2-core machine);
* the dataset URL, ``"gs://webdataset/fake-imagenet/imagenet-train.json"``, is
  ``TRAIN_URL``, which the test points at its own S3 server, and ``"./_cache"`` is
  ``CACHE_DIR``.

Ray's launcher (``train_in_ray``) is replaced by ``dask_ddp.launch``, in the test.
"""
# ruff: noqa: E501, I001, F401, UP035, UP045
# fmt: off

import os
import sys
from typing import List, Tuple, Dict, Optional, Any, Union, Callable, Iterable, Iterator, NamedTuple, Set, Sequence
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchvision.models import resnet50
from torchvision import datasets, transforms
from torch.utils.data import DataLoader
import dask_ddp.data as wids
import dataclasses
import time
from collections import deque
from pprint import pprint

TRAIN_URL = "gs://webdataset/fake-imagenet/imagenet-train.json"
CACHE_DIR = "./_cache"


def enumerate_report(seq, delta, growth=1.0):
    last = 0
    count = 0
    for count, item in enumerate(seq):
        now = time.time()
        if now - last > delta:
            last = now
            yield count, item, True
        else:
            yield count, item, False
        delta *= growth


# This is a typical PyTorch dataset, except that we read from the cloud.

def make_dataset_train():
    transform_train = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
    ])

    def make_sample(sample):
        image = sample[".jpg"]
        label = sample[".cls"]
        return transform_train(image), label

    trainset = wids.ShardListDataset(TRAIN_URL, cache_dir=CACHE_DIR, keep=True)
    trainset = trainset.add_transform(make_sample)

    return trainset


# To keep locality of reference in the dataloader, we use a special sampler
# for distributed training, DistributedChunkedSampler.

def make_dataloader_train():
    dataset = make_dataset_train()
    sampler = wids.DistributedChunkedSampler(dataset, chunksize=1000, shuffle=True)
    dataloader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=2)
    return dataloader


def make_dataloader(split="train"):
    """Make a dataloader for training or validation."""
    if split == "train":
        return make_dataloader_train()
    elif split == "val":
        return make_dataloader_val()  # noqa: F821 - as in the notebook
    else:
        raise ValueError(f"unknown split {split}")


# For convenience, we collect all the configuration parameters into
# a dataclass.

@dataclasses.dataclass
class Config:
    rank: Optional[int] = None
    epochs: int = 1
    maxsteps: int = int(1e18)
    lr: float = 0.001
    momentum: float = 0.9
    world_size: int = 8
    backend: str = "nccl"
    master_addr: str = "localhost"
    master_port: str = "12355"
    report_s: float = 15.0
    report_growth: float = 1.1


# A typical PyTorch training function.

def train(config):
    # Define the model, loss function, and optimizer
    model = resnet50(pretrained=False).to("cpu")
    if config.rank is not None:
        model = DistributedDataParallel(model)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)

    # Data loading code
    trainloader = make_dataloader(split='train')

    losses, accuracies, steps = deque(maxlen=100), deque(maxlen=100), 0

    # Training loop
    for epoch in range(config.epochs):
        for i, data, verbose in enumerate_report(trainloader, config.report_s):
            inputs, labels = data[0].to("cpu"), data[1].to("cpu")

            # zero the parameter gradients
            optimizer.zero_grad()

            # forward + backward + optimize
            outputs = model(inputs)
            loss = loss_fn(outputs, labels)
            loss.backward()
            optimizer.step()

            # just bookkeping and progress report
            steps += len(labels)
            accuracy = (outputs.argmax(1) == labels).float().mean()  # calculate accuracy
            losses.append(loss.item())
            accuracies.append(accuracy.item())
            if verbose and len(losses) > 0:
                avgloss = sum(losses)/len(losses)
                avgaccuracy = sum(accuracies)/len(accuracies)
                print(f"rank {config.rank} epoch {epoch:5d}/{i:9d} loss {avgloss:8.3f} acc {avgaccuracy:8.3f} {steps:9d}", file=sys.stderr)
            if steps > config.maxsteps:
                print("finished training (maxsteps)", steps, config.maxsteps, file=sys.stderr)
                return

    print("finished Training", steps)

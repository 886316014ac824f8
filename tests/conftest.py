"""Shared fixtures: one real LocalCluster (worker processes, gloo) for the whole session.

Tests that kill or restart workers start their own cluster instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from distributed import Client, LocalCluster


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_gpu = torch.cuda.is_available()
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "netns" in item.keywords and not is_root:
            item.add_marker(pytest.mark.skip(reason="needs root for ip netns"))


def make_cluster(n_workers: int = 2) -> LocalCluster:
    return LocalCluster(
        n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0"
    )


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    with make_cluster(2) as cluster:
        yield cluster


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster) as client:
        client.wait_for_workers(2, timeout="60s")
        yield client


@pytest.fixture
def own_cluster() -> Iterator[LocalCluster]:
    """A cluster of its own, for tests that kill or restart workers."""
    with make_cluster(2) as cluster:
        yield cluster

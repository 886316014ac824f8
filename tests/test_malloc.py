"""Ranks train with glibc's upper malloc thresholds, not the Dask worker's trim setting."""

from __future__ import annotations

import ctypes
import os
import platform

import dask.config
import pytest
from distributed import Client

import dask_ddp

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="malloc thresholds are a glibc feature"
)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def mmapped_by_a_1mib_allocation() -> dict:
    """Whether a fresh allocation of 1 MiB or more becomes its own mmap here, and the
    malloc variables.

    The allocation is 1 MiB larger than all the free memory malloc holds (``fordblks``):
    freed chunks that earlier work left in its bins cannot serve it, so only the mmap
    threshold decides (below the rank's 32 MiB, above the worker's 128 KiB).
    """
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    size = info.fordblks + (1 << 20)
    assert size < 32 << 20, f"{info.fordblks} bytes free in malloc's bins: no probe fits"
    before = info.hblks
    block = bytearray(size)
    mmapped = libc.mallinfo2().hblks > before
    del block
    return {"mmapped": mmapped, "env": os.environ.get("MALLOC_TRIM_THRESHOLD_")}


def test_rank_lifts_the_workers_trim_threshold_in_its_own_process_only(client: Client) -> None:
    on_worker = client.run(mmapped_by_a_1mib_allocation)
    assert all(r == {"mmapped": True, "env": "65536"} for r in on_worker.values()), on_worker

    in_rank = dask_ddp.launch(client, mmapped_by_a_1mib_allocation).result()
    assert in_rank == [{"mmapped": False, "env": None}] * 2

    assert all(client.run(_idle).values())  # the rank's teardown (it frees memory) is over
    after = client.run(mmapped_by_a_1mib_allocation)
    assert after == on_worker


def _idle() -> bool:
    from dask_ddp._rank.slot import PROCESS

    return PROCESS.wait_idle(30)


def test_tune_malloc_can_be_switched_off(client: Client) -> None:
    with dask.config.set({"ddp.tune-malloc": False}):
        in_rank = dask_ddp.launch(client, mmapped_by_a_1mib_allocation).result()
    assert in_rank == [{"mmapped": True, "env": "65536"}] * 2

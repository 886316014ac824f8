"""What a Dask worker holds for dask-ddp: each worker process's unique memory (USS) on a
2-worker LocalCluster after one job, whether it imported torch, and each rank process's.

This script imports neither torch nor dask-ddp at its top: a LocalCluster's workers are
spawned, and spawn imports the parent's ``__main__`` into each of them, so a script that
imports torch at its top (``--import-torch``: this one then does) gives every worker torch
whatever dask-ddp does::

    python benchmarks/worker_memory.py
    python benchmarks/worker_memory.py --import-torch
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--import-torch" in sys.argv:  # at the top, as a user's script does: its workers too
    import torch  # noqa: F401


def _rank_uss() -> float:
    import psutil

    return psutil.Process().memory_full_info().uss / 2**20


def _has_torch() -> bool:
    return "torch" in sys.modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--import-torch", action="store_true", help="import torch at the top")
    parser.parse_args()  # (--import-torch acts at the top, before main)
    import psutil
    from distributed import Client, LocalCluster

    import dask_ddp

    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        ranks = dask_ddp.launch(client, _rank_uss).result(timeout=180)
        time.sleep(2)  # the spares forked after the job
        pids = client.run(os.getpid)
        torch_in = client.run(_has_torch)
        for address, pid in sorted(pids.items()):
            uss = psutil.Process(pid).memory_full_info().uss / 2**20
            print(f"worker {address}: USS {uss:.1f} MiB, torch imported: {torch_in[address]}")
        print("rank processes: USS " + ", ".join(f"{u:.1f}" for u in ranks) + " MiB")


if __name__ == "__main__":
    main()

"""Pure planning: which worker runs which rank, and what each rank sees.

Nothing here talks to the cluster: :mod:`dask_ddp.dispatch` collects worker information
and calls these functions, so every rule is tested without a cluster or a GPU.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping, Sequence

from .errors import BackendUnavailableError, PlacementError

__all__ = [
    "RankPlacement",
    "WorkerInfo",
    "choose_backend",
    "order_workers",
    "parse_visible_devices",
    "plan_ranks",
    "replica_holders",
    "rotate_devices",
    "select_workers",
]


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """What placement needs to know of one Dask worker.

    ``cuda_visible_devices`` is the worker's own ``CUDA_VISIBLE_DEVICES`` (``None`` when
    unset); ``gpu_count`` is how many GPUs the worker process can see.
    """

    address: str
    host: str
    gpu_count: int = 0
    cuda_visible_devices: str | None = None


@dataclasses.dataclass(frozen=True)
class RankPlacement:
    """Where one rank runs and the environment it gets.

    ``cuda_visible_devices`` is the value to set in the rank, or ``None`` to leave the
    worker's environment as it is (no GPUs, or dask-cuda already chose).
    """

    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    world_size: int
    worker: str
    host: str
    use_gpu: bool
    cuda_visible_devices: str | None
    node_count: int = 1  # hosts in the plan: torchrun's GROUP_WORLD_SIZE


def _address_key(address: str) -> tuple[str, int, str]:
    """Sort key for worker addresses: numeric port order on the same host."""
    head, _, port = address.rpartition(":")
    return (head, int(port), address) if port.isdigit() else (address, 0, address)


def order_workers(workers: Sequence[WorkerInfo]) -> list[WorkerInfo]:
    """Group workers by host (hosts sorted), then by address within a host.

    Rank 0 is the first worker of the result.

    >>> [w.address for w in order_workers([WorkerInfo("tcp://b:10", "b"),
    ...     WorkerInfo("tcp://a:9", "a"), WorkerInfo("tcp://b:9", "b")])]
    ['tcp://a:9', 'tcp://b:9', 'tcp://b:10']
    """
    return sorted(workers, key=lambda w: (w.host, _address_key(w.address)))


def rotate_devices(local_rank: int, visible: Sequence[str]) -> str:
    """Put ``visible[local_rank]`` first and keep the order of the rest.

    This is dask-cuda's convention: the rank's own GPU becomes ``cuda:0`` while every GPU
    stays visible (for peer-to-peer copies).

    >>> rotate_devices(2, [str(i) for i in range(8)])
    '2,3,4,5,6,7,0,1'
    >>> rotate_devices(1, ["0", "1", "2", "GPU-9baca7f5"])
    '1,2,GPU-9baca7f5,0'
    """
    if not visible:
        raise ValueError("rotate_devices needs at least one visible device")
    i = local_rank % len(visible)
    return ",".join([*visible[i:], *visible[:i]])


def parse_visible_devices(value: str | None) -> list[str] | None:
    """Split a ``CUDA_VISIBLE_DEVICES`` value; ``None`` when unset.

    >>> parse_visible_devices("0, 3,GPU-9baca7f5")
    ['0', '3', 'GPU-9baca7f5']
    >>> parse_visible_devices("") == []
    True
    """
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _cuda_env(
    worker: WorkerInfo, local_rank: int, host_workers: Sequence[WorkerInfo]
) -> str | None:
    if worker.gpu_count <= 0:
        return None
    own = parse_visible_devices(worker.cuda_visible_devices)
    if own is None:
        return rotate_devices(local_rank, [str(i) for i in range(worker.gpu_count)])
    # A worker with its own CUDA_VISIBLE_DEVICES: dask-cuda gives each worker a different
    # rotation, and then the worker's GPU is already cuda:0. Rotate only when every worker
    # on the host sees the same list (set once for the whole host by the user).
    lists = {tuple(parse_visible_devices(w.cuda_visible_devices) or ()) for w in host_workers}
    if len(host_workers) > 1 and len(lists) == 1 and own:
        return rotate_devices(local_rank, own)
    return None


def plan_ranks(workers: Sequence[WorkerInfo]) -> list[RankPlacement]:
    """Plan one rank per worker: global rank, local rank and node rank, and GPU visibility.

    Workers are grouped by host (:func:`order_workers`); local ranks restart at 0 on each
    host and node ranks count hosts. A worker that sees ``gpu_count`` GPUs and has no
    ``CUDA_VISIBLE_DEVICES`` of its own gets the GPU list rotated by its local rank.

    >>> plan = plan_ranks([WorkerInfo("tcp://h:2", "h", 8), WorkerInfo("tcp://h:1", "h", 8),
    ...                    WorkerInfo("tcp://h:3", "h", 8)])
    >>> [(p.rank, p.worker, p.cuda_visible_devices) for p in plan]  # doctest: +NORMALIZE_WHITESPACE
    [(0, 'tcp://h:1', '0,1,2,3,4,5,6,7'), (1, 'tcp://h:2', '1,2,3,4,5,6,7,0'),
     (2, 'tcp://h:3', '2,3,4,5,6,7,0,1')]
    """
    ordered = order_workers(workers)
    if not ordered:
        raise PlacementError("no workers to plan ranks on")
    hosts: dict[str, list[WorkerInfo]] = {}
    for w in ordered:
        hosts.setdefault(w.host, []).append(w)
    loopback = [w for w in ordered if _is_loopback(w.host)]
    if len(hosts) > 1 and loopback:
        raise PlacementError(
            f"worker {loopback[0].address} is registered under the loopback address "
            f"{loopback[0].host}, but the ranks span {len(hosts)} hosts, so ranks on other hosts "
            "could not reach it (MASTER_ADDR must never be a loopback address then). Start that "
            "worker with --host set to an address the other hosts can reach."
        )
    plan = []
    for node_rank, host_workers in enumerate(hosts.values()):
        for local_rank, w in enumerate(host_workers):
            plan.append(
                RankPlacement(
                    rank=len(plan),
                    local_rank=local_rank,
                    local_world_size=len(host_workers),
                    node_rank=node_rank,
                    world_size=len(ordered),
                    worker=w.address,
                    host=w.host,
                    use_gpu=w.gpu_count > 0,
                    cuda_visible_devices=_cuda_env(w, local_rank, host_workers),
                    node_count=len(hosts),
                )
            )
    return plan


def replica_holders(
    plan: Sequence[RankPlacement], spare: Sequence[WorkerInfo] = ()
) -> list[str | None]:
    """The worker that keeps each rank's checkpoint replicas in memory: never the rank's
    own, and on another host when the job spans several (a host that goes down takes no
    checkpoint with it): the next rank's worker in rank order that is on another host, else
    the next rank's. A job of one rank keeps its replicas on a ``spare`` worker, if any.

    >>> plan = plan_ranks([WorkerInfo("tcp://a:1", "a"), WorkerInfo("tcp://a:2", "a"),
    ...                    WorkerInfo("tcp://b:1", "b")])
    >>> replica_holders(plan)
    ['tcp://b:1', 'tcp://b:1', 'tcp://a:1']
    >>> replica_holders(plan_ranks([WorkerInfo("tcp://a:1", "a")]), [WorkerInfo("tcp://c:1", "c")])
    ['tcp://c:1']
    """
    world = len(plan)
    if world == 1:
        return [spare[0].address if spare else None]
    holders: list[str | None] = []
    for p in plan:
        after = [plan[(p.rank + i) % world] for i in range(1, world)]
        elsewhere = [q for q in after if q.host != p.host]
        holders.append((elsewhere or after)[0].worker)
    return holders


def choose_backend(requested: str | None, workers: Sequence[WorkerInfo]) -> tuple[str, str]:
    """Pick the torch.distributed backend and say why.

    ``None`` picks nccl when every worker sees a GPU, else gloo. Asking for nccl where a
    worker has no GPU raises :class:`~dask_ddp.errors.BackendUnavailableError`.

    >>> choose_backend(None, [WorkerInfo("tcp://a:1", "a", 0)])
    ('gloo', 'no GPU on tcp://a:1')
    >>> choose_backend(None, [WorkerInfo("tcp://a:1", "a", 1)])[0]
    'nccl'
    """
    no_gpu = [w for w in workers if w.gpu_count <= 0]
    shared = _shared_gpu(workers)
    if requested is None:
        if no_gpu:
            return "gloo", f"no GPU on {no_gpu[0].address}"
        if shared is not None:
            return "gloo", shared[1]
        return "nccl", "every worker sees a GPU"
    backend = str(requested).lower()
    if backend == "nccl" and no_gpu:
        raise BackendUnavailableError(
            "nccl",
            no_gpu[0].address,
            "nccl needs a CUDA GPU and this worker sees none",
            "Pass backend='gloo' (or backend=None to choose automatically).",
        )
    if backend == "nccl" and shared is not None:
        raise BackendUnavailableError(
            "nccl",
            shared[0],
            shared[1] + " and nccl needs a GPU of its own for each rank",
            "Run one worker per GPU on that host (dask-cuda's LocalCUDACluster does), or "
            "pass backend='gloo'.",
        )
    return backend, "requested"


def _shared_gpu(workers: Sequence[WorkerInfo]) -> tuple[str, str] | None:
    """A host whose ranks would have to share a GPU, if any: (a worker, why).

    Workers that set their own ``CUDA_VISIBLE_DEVICES`` (dask-cuda) each lead with their
    own GPU; others get one by local rank, so a host needs as many GPUs as ranks.

    >>> _shared_gpu([WorkerInfo("tcp://a:1", "a", 1), WorkerInfo("tcp://a:2", "a", 1)])
    ('tcp://a:1', 'host a has 2 ranks but 1 GPU')
    """
    by_host: dict[str, list[WorkerInfo]] = {}
    for w in workers:
        by_host.setdefault(w.host, []).append(w)
    for host, ranks in by_host.items():
        planned = [w for w in ranks if w.cuda_visible_devices is None]
        gpus = min((w.gpu_count for w in ranks), default=0)
        own = {w.cuda_visible_devices.split(",")[0] for w in ranks if w.cuda_visible_devices}
        if len(planned) > gpus or len(own) < len(ranks) - len(planned):
            plural = "" if gpus == 1 else "s"
            return ranks[0].address, f"host {host} has {len(ranks)} ranks but {gpus} GPU{plural}"
    return None


def select_workers(
    available: Mapping[str, str], requested: int | Sequence[str] | None
) -> list[str]:
    """Choose worker addresses from ``available`` (address -> host).

    ``None`` takes every worker; an int takes that many, spread over hosts in rank order;
    a sequence names addresses (or worker names mapped by the caller) explicitly.

    >>> select_workers({"tcp://a:1": "a", "tcp://b:1": "b"}, 1)
    ['tcp://a:1']
    """
    if requested is None:
        return list(available)
    if (
        isinstance(requested, bool)
        or not isinstance(requested, (int, Sequence))
        or isinstance(requested, str)
    ):
        raise PlacementError(
            f"workers= takes a number of workers or a list of worker addresses; got {requested!r}"
        )
    if isinstance(requested, int):
        if requested < 1:
            raise PlacementError(f"workers={requested} asks for no ranks; ask for at least 1")
        if requested > len(available):
            raise PlacementError(
                f"workers={requested} asks for more ranks than the cluster has workers "
                f"({len(available)}). Scale the cluster (cluster.scale({requested})) or ask for "
                f"at most {len(available)}."
            )
        infos = [WorkerInfo(a, h) for a, h in available.items()]
        return [w.address for w in order_workers(infos)[:requested]]
    chosen = list(dict.fromkeys(requested))
    if len(chosen) != len(requested):
        raise PlacementError(f"workers= names a worker twice: {list(requested)!r}")
    unknown = [a for a in chosen if a not in available]
    if unknown:
        raise PlacementError(
            f"workers= names {unknown!r}, which the scheduler does not know; it has "
            f"{sorted(available)!r}"
        )
    if not chosen:
        raise PlacementError("workers= is an empty list; name at least one worker")
    return chosen

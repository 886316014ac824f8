"""Pure planning: which worker runs which rank, and what each rank sees.

Nothing here talks to the cluster: :mod:`dask_ddp.dispatch` collects worker information
and calls these functions, so every rule is tested without a cluster or a GPU.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping, Sequence

from ..errors import BackendUnavailableError, PlacementError

__all__ = [
    "RankPlacement",
    "WorkerInfo",
    "choose_backend",
    "device_index",
    "host_devices",
    "order_workers",
    "parse_visible_devices",
    "plan_ranks",
    "replica_holders",
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
    worker's own (:func:`host_devices` says which). ``gpu`` is the rank's own GPU as
    ``CUDA_VISIBLE_DEVICES`` names it (``"3"``, ``"GPU-..."``; ``None`` without GPUs), and
    ``device_index`` its CUDA ordinal in the rank: ``local_rank`` whenever every rank of
    the host has a GPU of its own. ``worker_visible_devices`` is the worker's own
    ``CUDA_VISIBLE_DEVICES``, the list in effect if CUDA started in the worker before the
    rank could set its own.
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
    worker_ranks: int = 1  # the ranks of the job on this rank's worker (ranks_per_worker)
    gpu: str | None = None
    device_index: int | None = None
    worker_visible_devices: str | None = None


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


def host_devices(workers: Sequence[WorkerInfo]) -> tuple[list[str | None], list[str] | None]:
    """The GPUs of one host's ranks: each worker's own GPU (``workers`` in local-rank
    order), and the ``CUDA_VISIBLE_DEVICES`` list every rank of the host gets (``None``:
    each keeps its worker's own, because they already agree).

    The rule: every rank of a host sees the same list, with its own GPU at index
    ``LOCAL_RANK``, so ``cuda:LOCAL_RANK`` (what torchrun scripts, accelerate, Lightning
    and DeepSpeed pick) is the rank's own GPU, and so is ``get_context().device``.

    - Workers without a ``CUDA_VISIBLE_DEVICES`` of their own (a LocalCluster), or all
      with the same one (set once for the host): nothing to change; local rank ``k``
      owns the list's ``k``-th GPU (as under torchrun), wrapping around when the host has
      more ranks than GPUs.
    - Workers that each lead with a GPU of their own (dask-cuda's rotation: worker ``i``
      sees ``i,i+1,...,0,...,i-1``): each keeps the GPU dask-cuda gave it, and every rank
      gets the job's GPUs on the host in local-rank order, then the host's others.

    >>> host_devices([WorkerInfo("tcp://h:1", "h", 4), WorkerInfo("tcp://h:2", "h", 4)])
    (['0', '1'], None)
    >>> host_devices([WorkerInfo("tcp://h:1", "h", 4, "2,3,0,1"),
    ...               WorkerInfo("tcp://h:2", "h", 4, "0,1,2,3")])
    (['2', '0'], ['2', '0', '3', '1'])
    """
    n = len(workers)
    if all(w.gpu_count <= 0 for w in workers):
        return [None] * n, None
    lists = [parse_visible_devices(w.cuda_visible_devices) for w in workers]
    distinct = {w.address for w in workers}
    if all(v is None for v in lists) or (len(distinct) > 1 and all(v == lists[0] for v in lists)):
        gpus = min(w.gpu_count for w in workers)
        shared = lists[0] if lists[0] is not None else [str(i) for i in range(gpus)]
        return ([shared[k % len(shared)] if shared else None for k in range(n)], None)
    # Each worker leads with its own GPU (dask-cuda); one without a list of its own gets
    # the first GPU nobody leads with. A worker that hosts several ranks (listed once per
    # rank, side by side) gives its j-th rank the j-th GPU of its list.
    owned = {v[0] for v in lists if v}
    spare = iter([str(i) for i in range(max(w.gpu_count for w in workers)) if str(i) not in owned])
    own: list[str | None] = []
    for k, (w, v) in enumerate(zip(workers, lists, strict=True)):
        j = sum(1 for other in workers[:k] if other.address == w.address)
        if v is None:
            own.append(next(spare, None))
        else:
            own.append(v[j] if j < len(v) else None)
    rest = [d for v in lists if v for d in v]
    return own, list(dict.fromkeys([*(g for g in own if g is not None), *rest]))


def device_index(gpu: str | None, visible: str | None) -> int | None:
    """The CUDA ordinal of ``gpu`` in a process whose CUDA started under
    ``CUDA_VISIBLE_DEVICES=visible`` (``None``: unset, every GPU in CUDA's order); ``None``
    if that process cannot see it.

    >>> device_index("3", "2,3,0,1"), device_index("3", None), device_index("3", "0,1")
    (1, 3, None)
    """
    if gpu is None:
        return None
    listed = parse_visible_devices(visible)
    if listed is None:
        return int(gpu) if gpu.isdigit() else None
    return listed.index(gpu) if gpu in listed else None


def plan_ranks(
    workers: Sequence[WorkerInfo], ranks_per_worker: int | Mapping[str, int] = 1
) -> list[RankPlacement]:
    """Plan ``ranks_per_worker`` ranks on each worker (a number, or worker address -> its
    number): global rank, local rank and node rank, and its GPU.

    Workers are grouped by host (:func:`order_workers`), a worker's ranks side by side;
    local ranks restart at 0 on each host and node ranks count hosts. On a host with GPUs
    each rank's own GPU is ``cuda:LOCAL_RANK`` (:func:`host_devices`).

    >>> plan = plan_ranks([WorkerInfo("tcp://h:2", "h", 8), WorkerInfo("tcp://h:1", "h", 8),
    ...                    WorkerInfo("tcp://h:3", "h", 8)])
    >>> [(p.rank, p.worker, p.gpu, p.device_index, p.cuda_visible_devices) for p in plan]
    [(0, 'tcp://h:1', '0', 0, None), (1, 'tcp://h:2', '1', 1, None), (2, 'tcp://h:3', '2', 2, None)]

    A worker per node that hosts the node's ranks (``dask worker --resources GPU=4``):
    every rank of the node sees all its GPUs, its own at ``cuda:LOCAL_RANK``:

    >>> plan = plan_ranks([WorkerInfo("tcp://a:1", "a", 4), WorkerInfo("tcp://b:1", "b", 4)], 4)
    >>> [(p.rank, p.local_rank, p.node_rank, p.gpu, p.device_index) for p in plan[3:5]]
    [(3, 3, 0, '3', 3), (4, 0, 1, '0', 0)]

    dask-cuda workers (each leads with its own GPU) keep their GPUs, and every rank of
    the host sees them in local-rank order:

    >>> plan = plan_ranks([WorkerInfo("tcp://h:1", "h", 4, "2,3,0,1"),
    ...                    WorkerInfo("tcp://h:2", "h", 4, "0,1,2,3"),
    ...                    WorkerInfo("tcp://h:3", "h", 4, "1,2,3,0")])
    >>> [(p.local_rank, p.gpu, p.device_index, p.cuda_visible_devices) for p in plan]
    [(0, '2', 0, '2,0,1,3'), (1, '0', 1, '2,0,1,3'), (2, '1', 2, '2,0,1,3')]
    """
    ordered = order_workers(workers)
    if not ordered:
        raise PlacementError("no workers to plan ranks on")
    counts = {
        w.address: ranks_per_worker if isinstance(ranks_per_worker, int)
        else ranks_per_worker[w.address]
        for w in ordered
    }  # fmt: skip
    for address, count in counts.items():
        if count < 1:
            raise PlacementError(f"worker {address} would run {count} ranks; give at least 1")
    hosts: dict[str, list[WorkerInfo]] = {}
    for w in ordered:
        hosts.setdefault(w.host, []).extend([w] * counts[w.address])
    loopback = [w for w in ordered if _is_loopback(w.host)]
    if len(hosts) > 1 and loopback:
        raise PlacementError(
            f"worker {loopback[0].address} is registered under the loopback address "
            f"{loopback[0].host}, but the ranks span {len(hosts)} hosts, so ranks on other hosts "
            "could not reach it (MASTER_ADDR must never be a loopback address then). Start that "
            "worker with --host set to an address the other hosts can reach."
        )
    world = sum(counts.values())
    plan = []
    for node_rank, host_ranks in enumerate(hosts.values()):
        own, visible = host_devices(host_ranks)
        shared = ",".join(visible) if visible is not None else None
        for local_rank, w in enumerate(host_ranks):
            sees = w.cuda_visible_devices if shared is None else shared
            plan.append(
                RankPlacement(
                    rank=len(plan),
                    local_rank=local_rank,
                    local_world_size=len(host_ranks),
                    node_rank=node_rank,
                    world_size=world,
                    worker=w.address,
                    host=w.host,
                    use_gpu=own[local_rank] is not None,
                    cuda_visible_devices=None if sees == w.cuda_visible_devices else sees,
                    node_count=len(hosts),
                    worker_ranks=counts[w.address],
                    gpu=own[local_rank],
                    device_index=device_index(own[local_rank], sees),
                    worker_visible_devices=w.cuda_visible_devices,
                )
            )
    return plan


def replica_holders(
    plan: Sequence[RankPlacement], spare: Sequence[WorkerInfo] = ()
) -> list[str | None]:
    """The worker that keeps each rank's checkpoint replicas in memory: never the rank's
    own, and on another host when the job spans several (a host that goes down takes no
    checkpoint with it): the next rank's worker in rank order that is on another host, else
    the next rank's. A job on one worker keeps its replicas on a ``spare`` worker, if any.

    >>> plan = plan_ranks([WorkerInfo("tcp://a:1", "a"), WorkerInfo("tcp://a:2", "a"),
    ...                    WorkerInfo("tcp://b:1", "b")])
    >>> replica_holders(plan)
    ['tcp://b:1', 'tcp://b:1', 'tcp://a:1']
    >>> replica_holders(plan_ranks([WorkerInfo("tcp://a:1", "a")]), [WorkerInfo("tcp://c:1", "c")])
    ['tcp://c:1']
    """
    world = len(plan)
    holders: list[str | None] = []
    for p in plan:
        after = [plan[(p.rank + i) % world] for i in range(1, world)]
        others = [q for q in after if q.worker != p.worker]
        elsewhere = [q for q in others if q.host != p.host]
        if elsewhere or others:
            holders.append((elsewhere or others)[0].worker)
        else:  # every rank of the job is on this worker: a spare one, if any
            holders.append(spare[0].address if spare else None)
    return holders


def choose_backend(
    requested: str | None,
    workers: Sequence[WorkerInfo],
    ranks_per_worker: int | Mapping[str, int] = 1,
) -> tuple[str, str]:
    """Pick the torch.distributed backend and say why (``ranks_per_worker`` as
    :func:`plan_ranks` takes it).

    ``None`` picks nccl when every worker sees a GPU, else gloo. Asking for nccl (alone or
    beside gloo, ``"cpu:gloo,cuda:nccl"``) where a worker has no GPU, or ranks of a host
    would share one, raises :class:`~dask_ddp.errors.BackendUnavailableError`.

    >>> choose_backend(None, [WorkerInfo("tcp://a:1", "a", 0)])
    ('gloo', 'no GPU on tcp://a:1')
    >>> choose_backend(None, [WorkerInfo("tcp://a:1", "a", 1)])[0]
    'nccl'
    """
    no_gpu = [w for w in workers if w.gpu_count <= 0]
    shared = _shared_gpu(workers, ranks_per_worker)
    if requested is None:
        if no_gpu:
            return "gloo", f"no GPU on {no_gpu[0].address}"
        if shared is not None:
            return "gloo", shared[1]
        return "nccl", "every worker sees a GPU"
    backend = str(requested).lower()
    nccl = "nccl" in backend  # "nccl", or nccl beside gloo: "cpu:gloo,cuda:nccl"
    if nccl and no_gpu:
        raise BackendUnavailableError(
            "nccl",
            no_gpu[0].address,
            "nccl needs a CUDA GPU and this worker sees none",
            "Pass backend='gloo' (or backend=None to choose automatically).",
        )
    if nccl and shared is not None:
        raise BackendUnavailableError(
            "nccl",
            shared[0],
            shared[1] + " and nccl needs a GPU of its own for each rank",
            "Run one worker per GPU on that host (dask-cuda's LocalCUDACluster does), or "
            "pass backend='gloo'.",
        )
    return backend, "requested"


def _shared_gpu(
    workers: Sequence[WorkerInfo], ranks_per_worker: int | Mapping[str, int] = 1
) -> tuple[str, str] | None:
    """A host whose ranks would have to share a GPU, if any: (a worker, why).

    Each rank's GPU is the one :func:`host_devices` gives it: by local rank from the
    host's list, or the one its worker leads with (dask-cuda).

    >>> _shared_gpu([WorkerInfo("tcp://a:1", "a", 1), WorkerInfo("tcp://a:2", "a", 1)])
    ('tcp://a:1', 'host a has 2 ranks but 1 GPU')
    >>> _shared_gpu([WorkerInfo("tcp://a:1", "a", 2)], 3)
    ('tcp://a:1', 'host a has 3 ranks but 2 GPUs')
    """
    by_host: dict[str, list[WorkerInfo]] = {}
    for w in order_workers(workers):
        count = (
            ranks_per_worker if isinstance(ranks_per_worker, int)
            else ranks_per_worker.get(w.address, 1)
        )  # fmt: skip
        by_host.setdefault(w.host, []).extend([w] * count)
    for host, ranks in by_host.items():
        own, _ = host_devices(ranks)
        gpus = {g for g in own if g is not None}
        if len(gpus) < len(ranks):
            why = f"host {host} has {len(ranks)} ranks but {len(gpus)} GPU"
            return ranks[0].address, why + ("" if len(gpus) == 1 else "s")
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

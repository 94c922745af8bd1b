"""``deep_ep.utils.envs``: DeepEP's test environment (``init_dist`` and the seeds, the domain sizes, the link
probes) on torch.distributed's gloo backend and shmemx's topology (needs torch).

``init_dist(local_rank, num_local_ranks)`` reads DeepEP's variables: ``MASTER_ADDR``, ``MASTER_PORT``,
``WORLD_SIZE`` (the number of nodes, DeepEP's meaning) and ``RANK`` (this node's index); ``shmemx run --deepep``
sets them from the job (one node per server of ``SHMEMX_SERVER_SIZE`` ranks). The group it returns spans the
job, so a ``deep_ep.Buffer`` made on it is a Buffer of the whole job.
"""

from __future__ import annotations

from typing import Any

import os
import random

import torch
import torch.distributed as dist

from ..buffer import SERVER_SIZE_ENV
from ..config import NUM_MAX_NVL_PEERS

__all__ = ["init_dist", "init_seed", "get_local_seed", "get_global_seed", "dist_print", "get_physical_domain_size",
           "get_logical_domain_size", "check_nvlink_connections", "check_torch_deterministic", "get_nvlink_gbs",
           "check_fast_rdma_atomic_support", "get_rdma_gbs"]

_local_rank: int | None = None
_local_seed = 0
_global_seed = 0


def init_seed(global_seed: int) -> None:
    """Seed torch and ``random`` with ``global_seed + rank`` (the local seed)."""
    global _local_seed, _global_seed
    _local_seed, _global_seed = global_seed + dist.get_rank(), global_seed
    torch.manual_seed(_local_seed)
    random.seed(_local_seed)


def get_local_seed() -> int:
    return _local_seed


def get_global_seed() -> int:
    return _global_seed


def dist_print(s: str = "", once_in_node: bool = False) -> None:
    """Print from every rank (or local rank 0 of each node), then a barrier (collective)."""
    if _local_rank is None:
        raise RuntimeError("dist_print: call init_dist first")
    if not once_in_node or _local_rank == 0:
        print(s, flush=True)
    dist.barrier()


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0) -> tuple:
    """Join the job's torch.distributed group (gloo: the CPU's backend; DeepEP asks for nccl) as rank
    ``RANK * num_local_ranks + local_rank`` of ``WORLD_SIZE * num_local_ranks``; bfloat16 becomes the default
    dtype and the CPU the default device (DeepEP: the local GPU), the seeds are set.

    Returns:
        ``(rank, num_ranks, group)``: the group spans every rank.
    """
    global _local_rank
    ip = os.getenv("MASTER_ADDR", "127.0.0.1")
    port = int(os.getenv("MASTER_PORT", "8361"))
    num_nodes, node_rank = int(os.getenv("WORLD_SIZE", 1)), int(os.getenv("RANK", 0))
    _local_rank = local_rank
    rank, size = node_rank * num_local_ranks + local_rank, num_nodes * num_local_ranks
    job_rank = os.environ.get("SHMEMX_RANK")
    if job_rank is not None and (int(job_rank), int(os.environ.get("SHMEMX_SIZE", size))) != (rank, size):
        raise ValueError(f"pe {job_rank}: init_dist({local_rank}, {num_local_ranks}) with WORLD_SIZE={num_nodes}, "
                         f"RANK={node_rank} makes rank {rank} of {size}, but this process is pe {job_rank} of "
                         f"{os.environ.get('SHMEMX_SIZE')} (run the script with shmemx run --deepep)")
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", init_method=f"tcp://{ip}:{port}", world_size=size, rank=rank)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cpu")
    init_seed(seed)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(size)))


def _server_size(num_ranks: int) -> int:
    return min(int(os.environ.get(SERVER_SIZE_ENV) or NUM_MAX_NVL_PEERS), num_ranks)


def get_physical_domain_size(group: Any) -> tuple[int, int]:
    """``(num_rdma_ranks, num_nvlink_ranks)``: servers of the group, ranks per server (``SHMEMX_SERVER_SIZE``,
    default 8)."""
    n = group.size()
    nvl = _server_size(n)
    return n // nvl, nvl


def get_logical_domain_size(group: Any, allow_hybrid_mode: bool = True) -> tuple[int, int]:
    """``(num_scaleout_ranks, num_scaleup_ranks)``: the physical domains with hybrid mode, else ``(1, ranks)``
    (as ``ElasticBuffer.get_logical_domain_size``)."""
    rdma, nvl = get_physical_domain_size(group)
    return (rdma, nvl) if allow_hybrid_mode else (1, rdma * nvl)


def check_nvlink_connections(group: Any) -> None:
    """Every pair of ranks of a server is connected (shared memory): nothing to check."""


def check_torch_deterministic() -> None:
    assert not (torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory)


# The per-rank port bandwidths of shmemx replay's default topology (observe/replay/topologies/ascend950.toml):
# what the modelled time assumes, and what DeepEP's tests divide by (a 0 here is a ZeroDivisionError there).
MODELLED_INTRA_GBPS = 150.0
MODELLED_INTER_GBPS = 22.5


def get_nvlink_gbs(factor: float = 0.9) -> float:
    """The modelled intra-server bandwidth in GB/s (no NVLink to probe)."""
    return MODELLED_INTRA_GBPS


def check_fast_rdma_atomic_support(nic_name: str = "") -> bool:
    return False


def get_rdma_gbs(nic_name: str = "") -> float:
    """The modelled inter-server bandwidth in GB/s (no NIC to probe)."""
    return MODELLED_INTER_GBPS

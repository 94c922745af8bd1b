"""DeepEP's ``Config``, its per-rank-count defaults and its buffer size hints.

On a GPU a ``Config`` picks the SMs and the chunk sizes of the NVLink / RDMA ring buffers. shmemx's kernels have
no SMs and no rings (a dispatch moves whole per-destination ranges, see ``buffer``), so a ``Config`` is accepted,
checked as DeepEP checks it, and otherwise has no effect; the size hints give DeepEP's numbers, so that code that
sizes its ``Buffer`` with them runs unchanged (``num_nvl_bytes`` then bounds the tokens per rank, see
``Buffer``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Config", "dispatch_config", "combine_config", "low_latency_rdma_size_hint", "NUM_MAX_NVL_PEERS",
           "SOURCE_META_BYTES"]

NUM_MAX_NVL_PEERS = 8
SOURCE_META_BYTES = 8  # DeepEP's SourceMeta: the source RDMA rank and the NVL-rank bit mask, two int32
_MAX_TOPK = _MAX_SCALES = 128  # what DeepEP's hints assume at most


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass
class Config:
    """``Config(num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
    num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256)``, checked as DeepEP does
    (the RDMA receive chunk is rounded up to a multiple of the send chunk)."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self):
        nvl_send, nvl_recv = self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens
        rdma_send, rdma_recv = self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens
        if self.num_sms < 0:
            raise ValueError(f"Config: num_sms must be >= 0, got {self.num_sms}")
        if not 0 < nvl_send < nvl_recv:
            raise ValueError(f"Config: need 0 < num_max_nvl_chunked_send_tokens ({nvl_send}) < "
                             f"num_max_nvl_chunked_recv_tokens ({nvl_recv})")
        if rdma_send <= 0 or rdma_recv <= 0:
            raise ValueError(f"Config: the RDMA chunk sizes must be positive, got {rdma_send}, {rdma_recv}")
        self.num_max_rdma_chunked_recv_tokens = rdma_recv = _align(rdma_recv, rdma_send)
        if not rdma_send <= rdma_recv // 2:
            raise ValueError(f"Config: num_max_rdma_chunked_send_tokens ({rdma_send}) must be at most half of "
                             f"num_max_rdma_chunked_recv_tokens ({rdma_recv})")

    @property
    def num_channels(self) -> int:
        """DeepEP's channels: two SMs each."""
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's worst-case NVLink ring bytes for ``hidden_bytes`` per token (its formula)."""
        if not (num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0):
            raise ValueError(f"get_nvl_buffer_size_hint: {num_ranks} ranks is neither < 8 nor a multiple of 8")
        rdma_ranks, nvl_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1), min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = self.num_channels * nvl_ranks * self.num_max_nvl_chunked_recv_tokens
        total = self.num_channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
        total += slots * (hidden_bytes + SOURCE_META_BYTES + _MAX_TOPK * 8 + _MAX_TOPK * 4 + _MAX_SCALES * 4)
        return _align(total, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's worst-case RDMA ring bytes (0 for one server of at most 8 ranks)."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        if num_ranks % NUM_MAX_NVL_PEERS:
            raise ValueError(f"get_rdma_buffer_size_hint: {num_ranks} ranks is not a multiple of 8")
        rdma_ranks = num_ranks // NUM_MAX_NVL_PEERS
        slots = self.num_channels * rdma_ranks * self.num_max_rdma_chunked_recv_tokens
        total = self.num_channels * rdma_ranks * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        total += slots * 2 * (hidden_bytes + SOURCE_META_BYTES + _MAX_TOPK * 8 + _MAX_TOPK * 4 + _MAX_SCALES * 4 + 16)
        return _align(total, 128)


# DeepEP's tuned defaults per number of ranks: (nvl send chunk, nvl recv chunk, rdma send chunk, rdma recv chunk)
_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
             24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
             96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
            24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
            96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def _pick(table: dict, num_ranks: int, num_sms: int, what: str) -> Config:
    if num_ranks not in table:
        raise ValueError(f"{what}: no default config for {num_ranks} ranks (DeepEP has them for "
                         f"{sorted(table)}); pass a Config")
    return Config(num_sms, *table[num_ranks])


def dispatch_config(num_ranks: int, num_sms: int = 20) -> Config:
    """DeepEP's default dispatch ``Config`` for ``num_ranks`` ranks."""
    return _pick(_DISPATCH, num_ranks, num_sms, "get_dispatch_config")


def combine_config(num_ranks: int, num_sms: int = 20) -> Config:
    """DeepEP's default combine ``Config`` for ``num_ranks`` ranks."""
    return _pick(_COMBINE, num_ranks, num_sms, "get_combine_config")


def low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                               num_experts: int) -> int:
    """Bytes of the low-latency buffer, DeepEP's ``LowLatencyLayout`` formula: two halves (double buffering) of
    send buffer, receive buffer and signals; the low-latency workspace here fits in it."""
    n, scales = num_max_dispatch_tokens_per_rank, hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2
    send = max(n * dispatch_msg, num_experts * n * combine_msg)
    recv = max(num_experts * n * dispatch_msg, num_experts * n * combine_msg)
    signal = _align(num_experts * 4, 128)
    total = 2 * (send + recv + signal)
    return (total + 128) // 128 * 128

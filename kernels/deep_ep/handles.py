"""The handles ``dispatch`` returns, in DeepEP's order: named tuples, so that DeepEP code that unpacks them or
reads ``handle[0]`` / ``handle[-4]`` works, and ``handle.rank_prefix_matrix`` reads right too.

P ranks, C channels, N = P / server_size servers ("RDMA ranks"), S = server_size ("NVL ranks"), T tokens sent,
n rows received. A channel is a contiguous slice of the sender's tokens (``[c * ceil(T/C), ...)``), as in DeepEP;
C is the kernel's channel count (``Buffer.num_channels``), not ``Config.num_sms / 2``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from shmemx.kernels.moe.records import DispatchHandle

__all__ = ["IntranodeHandle", "InternodeHandle", "LowLatencyHandle"]


# DeepEP's intranode handle is the moe handle's routing: its first six fields, in order, declared once there
_INTRANODE_FIELDS = [(f.name, np.ndarray) for f in dataclasses.fields(DispatchHandle)[:6]]


class IntranodeHandle(NamedTuple("IntranodeHandle", _INTRANODE_FIELDS)):
    """DeepEP's intranode handle (6 fields).

    Attributes:
        rank_prefix_matrix: ``[P, P] int32``, ``[i][j]`` = tokens ranks 0..i send to j (the same on every rank);
            rows from source i are ``[M[i-1][me], M[i][me])`` of recv_x.
        channel_prefix_matrix: ``[P, C] int32``, sender side: inclusive prefix over channels of the tokens sent
            to each rank.
        recv_channel_prefix_matrix: ``[P, C] int32``, receiver side: where source s's channel c starts within
            s's block of recv_x.
        recv_src_idx: ``[n] int32``, the source token of each received row.
        is_token_in_rank: ``[T, P] bool``, the sender's routing.
        send_head: ``[T, P] int32``, the row of token t among the rows sent to rank r, -1 if not sent.
    """

    __slots__ = ()

    @classmethod
    def of(cls, handle: DispatchHandle) -> "IntranodeHandle":
        """DeepEP's 6-tuple of a ``moe`` dispatch handle (its first six fields)."""
        return cls(*(getattr(handle, name) for name in cls._fields))


class InternodeHandle(NamedTuple):
    """DeepEP's internode handle (10 fields). A token from rank (server a, lane l) to rank (server b, lane k)
    goes once per destination server over RDMA to the *forwarder* (b, l), the same lane there, which forwards it
    over NVLink (here: MTE copies) to every rank of server b that needs it; combine goes back the same way.

    Attributes:
        is_token_in_rank: ``[T, P] bool``, the sender's routing.
        rdma_channel_prefix_matrix: ``[N, C] int32``, sender: inclusive prefix over channels of the tokens sent to
            each server.
        gbl_channel_prefix_matrix: ``[P, C] int32``, sender: inclusive prefix over channels of the tokens sent to
            each rank.
        recv_rdma_channel_prefix_matrix: ``[N, C] int32``, forwarder: inclusive prefix over channels of the tokens
            received from each source server (from its rank on this lane).
        recv_rdma_rank_prefix_sum: ``[N] int32``, forwarder: inclusive prefix over source servers of the tokens
            received; the last is the forwarder's row count.
        recv_gbl_channel_prefix_matrix: ``[P, C] int32``, receiver: the row of recv_x where source rank i's
            channel c starts.
        recv_gbl_rank_prefix_sum: ``[P] int32``, receiver: inclusive prefix over source ranks of the rows
            received (rows from rank i are ``[sum[i-1], sum[i])``).
        recv_src_meta: ``[n, 8] uint8``, per received row DeepEP's SourceMeta: int32 source server, int32 bit
            mask of the ranks of this server the token went to.
        send_rdma_head: ``[T, N] int32``, sender: the token's index among its channel's tokens to that server,
            -1 if not sent there.
        send_nvl_head: ``[F, S] int32``, forwarder, per row it received (F = recv_rdma_rank_prefix_sum[-1]): its
            index among the rows of the same (source server, channel) forwarded to that rank, -1 if not forwarded.
    """

    is_token_in_rank: np.ndarray
    rdma_channel_prefix_matrix: np.ndarray
    gbl_channel_prefix_matrix: np.ndarray
    recv_rdma_channel_prefix_matrix: np.ndarray
    recv_rdma_rank_prefix_sum: np.ndarray
    recv_gbl_channel_prefix_matrix: np.ndarray
    recv_gbl_rank_prefix_sum: np.ndarray
    recv_src_meta: np.ndarray
    send_rdma_head: np.ndarray
    send_nvl_head: np.ndarray


class LowLatencyHandle(NamedTuple):
    """DeepEP's low-latency handle (5 fields).

    Attributes:
        src_info: ``[E_loc, P * N_max] int32``, the source token of each packed row.
        layout_range: ``[E_loc, P] int64``, ``(begin << 32) | count`` of the rows from each source rank.
        num_max_dispatch_tokens_per_rank: N_max.
        hidden: H.
        num_experts: E.
    """

    src_info: np.ndarray
    layout_range: np.ndarray
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int

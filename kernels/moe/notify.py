"""notify_dispatch: every PE tells every other PE how many rows to expect, and where, before any payload moves.

The kernel (one AIV block) sends each peer r, on QP 0, one WRITE_WITH_NOTIFY of its record (``[W] int32``: a
header, its whole ``num_tokens_per_rank [P]`` row, its counts of r's local experts and its exclusive channel prefix
for r, ``[C]``: where each of its channels' rows start in its block at r) into r's ``notify[me]``, then r's
``notify_signal[me]`` = the call's sequence number (one WQE per peer: at 256 PEs a separate WRITE of the 4-byte
prefix was a third of the kernel's WQEs); then quiets, and waits (``aclshmem_wait_until_all``, asleep) until
every peer's signal reached the sequence number. From the P records every PE computes the same
``rank_prefix_matrix [P, P]`` (the inclusive prefix over sources of the count matrix), its
``recv_channel_prefix_matrix [P, C]``, the rows it receives and its per-local-expert counts. The header also
carries the schedule, row size, payload kind, top-k presence and channel count, so that PEs that disagree fail
here with a clear message instead of hanging later.

The notify area is reused by the next fresh dispatch; a peer writes it only after this PE's credit for the
previous dispatch (see ``Buffer``), by which time this PE has long read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import shmemx

from .lanes import FENCE_SO, Lanes
from .workspace import NOTIFY_HEADER

__all__ = ["NotifyResult", "notify_dispatch", "HEADER_FIELDS"]

HEADER_FIELDS = ("seq", "schedule", "num_tokens", "row_bytes", "x_kind", "with_topk", "num_channels", "num_topk",
                 "recv_slot")
_CHECKED = ("schedule", "row_bytes", "x_kind", "with_topk", "num_channels", "num_topk")


@dataclass
class NotifyResult:
    """What notify_dispatch computes on this PE.

    Attributes:
        rank_prefix_matrix: ``[P, P] int32`` inclusive prefix of ``counts`` over sources (the same on every PE).
        channel_prefix_matrix: ``[P, C] int32`` this PE's inclusive prefix over channels, per destination.
        recv_channel_prefix_matrix: ``[P, C] int32`` start of channel c within source s's block here.
        num_recv_tokens: rows this PE receives.
        num_recv_tokens_per_expert_list: per local expert, (token, slot) selections aligned up.
        recv_slots: ``[P] int`` the receive slot each PE named for its rows (``slots.RecvSlots``; 0: ``x``).
    """

    rank_prefix_matrix: np.ndarray
    channel_prefix_matrix: np.ndarray
    recv_channel_prefix_matrix: np.ndarray
    num_recv_tokens: int
    num_recv_tokens_per_expert_list: list
    recv_slots: np.ndarray


def _kernel(views: dict, me: int, n_pes: int, seq: int, records: np.ndarray, lanes=None) -> None:
    width = records.shape[1]
    peers = [(me + i) % n_pes for i in range(1, n_pes)]
    if peers and lanes is not None:
        _post_all(views, me, seq, records, peers, lanes)
    else:
        for peer in peers:
            shmemx.aclshmemx_udma_qp_put_signal_nbi(views["notify"][me], records[peer], width,
                                                    views["notify_signal"][me, 0:1], seq, peer, 0, config=FENCE_SO)
    views["notify"][me] = records[me]
    if peers and lanes is not None:
        lanes.batch.quiet(lanes.lane_of[peers, 0])
    else:
        for peer in peers:
            shmemx.aclshmemx_udma_qp_quiet(peer, 0)
    if peers:
        shmemx.aclshmem_wait_until_all(views["notify_signal"][:, 0], shmemx.ACLSHMEM_CMP_GE, seq,
                                       status=(np.arange(n_pes) == me).astype(np.int32))


def _post_all(views: dict, me: int, seq: int, records: np.ndarray, peers: list, lanes) -> None:
    """The loop of put_signal_nbi per peer as one batch (``Lanes.batch``): every peer's WQE built in one numpy
    operation (the bytes those calls post) and posted with one call, a doorbell per peer."""
    u64 = np.uint64
    width = records.shape[1]
    p = np.array(peers, np.intp)
    which = lanes.lane_of[p, 0]
    rbase = lanes.remote_base[p]
    notify_rmt = rbase + u64(views["notify"][me].ctypes.data - lanes.block.ctypes.data)
    signal_rmt = rbase + u64(views["notify_signal"][me, 0:1].ctypes.data - lanes.block.ctypes.data)
    close = lanes.batch.build_notifies(which, flag=FENCE_SO.flag, rmt_va=notify_rmt, sge_len=width * 4,
                                       sge_va=u64(lanes.batch.local_va(records)) + (p * width * 4).astype(u64),
                                       notify_va=signal_rmt, notify_value=seq)
    lanes.batch.post(which, np.full(len(p), 2), close, cqes=np.full(len(p), 1))


def notify_dispatch(views: dict, me: int, n_pes: int, seq: int, *, num_tokens_per_rank: np.ndarray,
                    num_tokens_per_expert: np.ndarray, channel_counts: np.ndarray, header: dict,
                    expert_alignment: int = 1, lanes: Lanes | None = None) -> NotifyResult:
    """Run the notify kernel and compute the prefix matrices (collective: every PE of the buffer calls it).

    Args:
        views: the workspace regions of this PE.
        seq: the call's sequence number (the same on every PE, larger than any before).
        num_tokens_per_rank: ``[P]`` this PE's tokens per destination.
        num_tokens_per_expert: ``[E]`` this PE's selections per global expert.
        channel_counts: ``[P, C]`` tokens each channel sends to each destination.
        header: the values of ``HEADER_FIELDS`` but seq (``recv_slot`` may be left out: 0).
        expert_alignment: round each local expert's count up to a multiple of this.
        lanes: the buffer's ``Lanes``: every peer's two WQEs go in one batch (None: a put and a put_signal call per
            peer, for callers without lanes).

    Raises:
        ValueError: a peer's header disagrees with this PE's (schedule, row size, payload kind, ...).
    """
    width = views["notify"].shape[1]
    n_experts = len(num_tokens_per_expert)
    local = n_experts // n_pes
    head = np.array([seq & 0x7FFF_FFFF] + [header.get(f, 0) for f in HEADER_FIELDS[1:]], np.int32)
    records = np.zeros((n_pes, width), np.int32)
    records[:, :NOTIFY_HEADER] = head
    records[:, NOTIFY_HEADER:NOTIFY_HEADER + n_pes] = num_tokens_per_rank
    records[:, NOTIFY_HEADER + n_pes:NOTIFY_HEADER + n_pes + local] = \
        np.asarray(num_tokens_per_expert).reshape(n_pes, local)
    at = NOTIFY_HEADER + n_pes + local  # the exclusive channel prefix for each destination
    n_channels = channel_counts.shape[1]
    records[:, at:at + n_channels] = np.cumsum(channel_counts, axis=1) - channel_counts
    shmemx.launch(_kernel, 1, views, me, n_pes, seq, records, lanes)

    got = views["notify"]  # read in place: no peer writes it again before this PE's credit (see the module)
    for name in _CHECKED:
        i = HEADER_FIELDS.index(name)
        bad = np.flatnonzero(got[:, i] != head[i])
        if len(bad):
            raise ValueError(f"pe {me}: dispatch: pe {int(bad[0])} dispatches with {name} {int(got[bad[0], i])}, "
                             f"this pe with {int(head[i])}: every pe must call dispatch with the same kind of "
                             f"payload, top-k presence and buffer schedule")
    per_expert = got[:, NOTIFY_HEADER + n_pes:NOTIFY_HEADER + n_pes + local].sum(0, dtype=np.int64)
    aligned = [int(-(-c // expert_alignment) * expert_alignment) for c in per_expert]
    # int32 throughout: a cumsum that widens to int64 on the way costs 6x at 256 PEs
    prefix = np.cumsum(got[:, NOTIFY_HEADER:NOTIFY_HEADER + n_pes], axis=0, dtype=np.int32)
    return NotifyResult(prefix, np.cumsum(channel_counts, axis=1).astype(np.int32),
                        got[:, at:at + n_channels].copy(), int(prefix[-1, me]), aligned,
                        got[:, HEADER_FIELDS.index("recv_slot")].astype(np.intp))

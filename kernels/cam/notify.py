"""The dispatch kernel's four routing inputs (what CAM's separate ``notify_dispatch`` op produces).

The seed does not describe ``notify_dispatch``; it only shows how the dispatch kernel uses its outputs
(``sendOffsetTensor``, ``sendTokenIdxTensor``, ``recvOffsetTensor``, ``recvCountTensor``). Their meaning follows
from those formulas (README A12). For sender rank r with ``topk_idx_r [bs_r, K]`` and ``p = t*K + k``::

    cnt_r[g]           = #{p : topk_idx_r.flat[p] == g}                       per global expert g
    send_offset_r[g]   = sum(cnt_r[:g])                                       [E]      exclusive prefix
    send_tokenIdx_r[p] = #{p' < p : topk_idx_r.flat[p'] == topk_idx_r.flat[p]}  [bs*K]

so a rank's dispatch area holds its own rows sorted by expert, then in (t, k) order. For receiver d and status
``s = le*R + src`` (local expert ``le``, global expert ``g = d*E_loc + le``)::

    recv_offset_d[s] = send_offset_src[g]                 row of src's dispatch area where the segment starts
    recv_count_d[s]  = sum over s' <= s of cnt_src(s')[g(s')]   [E] INCLUSIVE prefix; recv_count[E-1] rows

``notify_dispatch`` computes them collectively: each rank writes its ``cnt`` row into every rank's notify area
(the first 204 MB of an In-window half, ``NOTIFY_DISPATCH_BUFF_OFFSET``, which the dispatch and combine kernels
skip) with MTE puts (UDMA writes to ranks of other hosts, ``far``), all ranks meet in one barrier, and each derives
its arrays. Calls alternate between the notify
areas of the two halves, so one barrier per call suffices: a rank can only overwrite the area of call n in call
n + 2, after the barrier of call n + 1, which no rank passes before it finished reading call n.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import shmemx

from . import far
from .window import WindowContext

__all__ = ["NotifyDispatchOutput", "notify_dispatch", "send_layout"]


class NotifyDispatchOutput(NamedTuple):
    """The dispatch kernel's routing inputs on this rank (all int32)."""

    send_offset: np.ndarray  # [E]: first row of each global expert in this rank's dispatch area
    send_token_idx: np.ndarray  # [bs*K]: rank of (t, k) among this rank's rows for the same expert
    recv_offset: np.ndarray  # [E], by status s = le*R + src: row offset in src's dispatch area
    recv_count: np.ndarray  # [E], by status: inclusive prefix of the received counts


def send_layout(topk_idx: np.ndarray, moe_expert_num: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(cnt [E], send_offset [E], send_token_idx [bs*K])`` of one rank (int32), from ``topk_idx [bs, K]``."""
    flat = np.asarray(topk_idx).reshape(-1).astype(np.int64)
    cnt = np.bincount(flat, minlength=moe_expert_num).astype(np.int32)
    send_offset = np.zeros(moe_expert_num, np.int32)
    np.cumsum(cnt[:-1], out=send_offset[1:])
    order = np.argsort(flat, kind="stable")
    rank_in_expert = np.empty(len(flat), np.int32)
    rank_in_expert[order] = np.arange(len(flat), dtype=np.int32) - send_offset[flat[order]]
    return cnt, send_offset, rank_in_expert


def _check_topk(topk_idx: np.ndarray, moe_expert_num: int, me: int) -> None:
    if topk_idx.ndim != 2:
        raise ValueError(f"pe {me}: notify_dispatch: topk_idx must be [bs, K], got shape {topk_idx.shape}")
    if topk_idx.size and (topk_idx.min() < 0 or topk_idx.max() >= moe_expert_num):
        bad = topk_idx[(topk_idx < 0) | (topk_idx >= moe_expert_num)]
        raise ValueError(f"pe {me}: notify_dispatch: expert id {int(bad[0])} outside [0, {moe_expert_num}): the "
                         f"window path sends every (token, topk) pair and has no -1 masking (README A24)")


def notify_dispatch(ctx: WindowContext, topk_idx: np.ndarray, moe_expert_num: int) -> NotifyDispatchOutput:
    """Exchange per-expert counts and build the dispatch kernel's routing inputs. Collective.

    Args:
        ctx: the ``WindowContext``; its EP In windows' notify areas carry the counts.
        topk_idx: ``[bs, K]`` integer expert ids in ``[0, moe_expert_num)``.
        moe_expert_num: E, divisible by the EP world size.

    Returns:
        ``NotifyDispatchOutput`` (send_offset, send_token_idx, recv_offset, recv_count), int32.
    """
    topk_idx = np.asarray(topk_idx)
    ep = ctx.ep
    me, R, E = ep.rank_id, ep.rank_size, int(moe_expert_num)
    _check_topk(topk_idx, E, me)
    if E % R:
        raise ValueError(f"pe {me}: notify_dispatch: moeExpertNum should be divisible by epWorldSize, but "
                         f"moeExpertNum={E}, epWorldSize={R}.")
    cnt, send_offset, send_token_idx = send_layout(topk_idx, E)
    half = ctx.notify_calls % 2
    ctx.notify_calls += 1
    off = half * (ep.win_size // 2)
    table = ep.local_windows_in[off:off + R * E * 4].view(np.int32).reshape(R, E)
    with far.section() as udma:  # ranks of other hosts over UDMA, complete before the barrier
        for r in range(R):
            if ep.near(r):
                shmemx.aclshmemx_mte_put_nbi(table[me], cnt, E, ep.pes[r])
            else:
                udma.put(table[me], cnt, ep.pes[r])
    shmemx.aclshmem_barrier_all()
    counts = table.copy()  # counts[src, g]
    e_loc = E // R
    g = me * e_loc + np.arange(e_loc)
    per_status = counts[:, g].T.reshape(-1)  # s = le*R + src
    src_offsets = np.zeros_like(counts)
    np.cumsum(counts[:, :-1], axis=1, out=src_offsets[:, 1:])
    recv_offset = src_offsets[:, g].T.reshape(-1).astype(np.int32)
    recv_count = np.cumsum(per_status).astype(np.int32)
    return NotifyDispatchOutput(send_offset, send_token_idx, recv_offset, recv_count)

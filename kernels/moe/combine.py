"""The combine kernel: every expert rank sends each received row back to its source, which sums them.

The rows this PE received from source s are contiguous in combine's input (``[recv_lo[s], recv_hi[s])``, the
dispatch order), and within them channel c's rows start at ``recv_channel_prefix_matrix[s][c]``. On s, the rows
coming back from rank r land in s's ``combine_x`` region at ``sum_{r' < r} counts[s][r']`` (s's rows for the
lower ranks first) plus the row's ``send_head`` position, which for channel c starts at the same
``recv_channel_prefix_matrix[s][c]``. So a unit (channel c, source s) is one contiguous range on both sides:
one WQE straight from the input whether ``aggregate`` is on or off (no packing is needed either way); the
``topk_weights`` rows (when given) go the same way in one WQE. Lanes, rounds, closers and completion signals are
those of dispatch (``schedule``, ``lanes``), on the combine signal slots.

Receive side: block c waits for the sources ``c, c + C, ...``, all blocks meet, then block c reduces the tokens
of its channel: for each token, the rows of the ranks it went to, in ascending rank order, are added in float32
(a gather index per (token, contributor), padded with the region's last row, which stays zero) and rounded once
to bfloat16; topk_weights are summed the same way in float32. The rows this PE returns to itself are read where
they are, in the input (``_local_rows``): only their weights are copied into the region. Then each block gives
its sources their credit.
Where block 0 does every block's work (``Lanes.one_block``) it is the kernel's only block: it posts, waits,
reduces every token and gives every credit, with no ``sync_all``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

import shmemx

from .reference import bf16
from .schedule import Plan
from .measure import BlockTimer, CallStats

try:
    from ._reduce import bf16_reduce
except ImportError:  # built by pip install (setup.py); without it the numpy reduction runs
    bf16_reduce = None

__all__ = ["CombineArgs", "combine_kernel", "REDUCE_CHUNK"]

GE = shmemx.ACLSHMEM_CMP_GE
SET = shmemx.ACLSHMEM_SIGNAL_SET
REDUCE_CHUNK = 32  # tokens per reduction step: [32, H] float32 stays in cache


@dataclass
class CombineArgs:
    """Everything the blocks of one combine read (built on the host before the launch)."""

    me: int
    n_pes: int
    seq: int
    views: dict
    lanes: object
    plan: Plan
    stats: CallStats
    aggregate: bool
    region_offsets: dict
    xb: np.ndarray  # [num_recv, 2H] uint8: the rows to send back, C-contiguous
    weights: np.ndarray | None  # [num_recv, K] float32, C-contiguous
    recv_lo: np.ndarray  # [P] first input row of each source's block
    recv_channel_start: np.ndarray  # [P, C] start of channel c within source s's block
    dest_base: np.ndarray  # [P] where this PE's rows start in source s's combine region
    back_base: np.ndarray  # [P] where rank r's rows start in this PE's combine region
    back_rows: np.ndarray  # [P] rows rank r sends back here
    send_head: np.ndarray  # [T, P] int32
    bounds: np.ndarray  # [C + 1] token bounds of this PE's channels (the reduction split)
    zero_row: int
    out_x: np.ndarray  # [T, H] bfloat16
    out_weights: np.ndarray | None  # [T, K] float32
    scratch: object  # block -> ([REDUCE_CHUNK, H] float32, [REDUCE_CHUNK, H] uint16), reused across calls
    recv_rows: np.ndarray | None = None  # [P] rows received from each source (the groups and hierarchy kernels)
    bias: np.ndarray | None = None  # [T, H] float32: the sum starts from it (DeepEP's bias_0 + bias_1)


def _unit_range(a: CombineArgs, u) -> tuple[int, int]:
    """(first input row, first destination row) of unit u."""
    start = int(a.recv_channel_start[u.peer, u.channel])
    return int(a.recv_lo[u.peer]) + start, int(a.dest_base[u.peer]) + start


def _local(a: CombineArgs, u) -> None:
    """Unit u's rows for this PE itself: the reduction reads their hidden rows in the input (``_local_rows``),
    their weights from the region (copied here)."""
    lo, dst = _unit_range(a, u)
    if a.weights is not None:
        a.views["combine_weights"][dst:dst + u.rows] = a.weights[lo:lo + u.rows]


def _local_rows(a: CombineArgs) -> np.ndarray:
    """``[n, H] uint16``: the input's rows this PE sends back to itself, in the order they would take in its
    ``combine_x`` region (from ``back_base[me]``): the reduction reads them there, no copy into the region."""
    lo = int(a.recv_lo[a.me])
    return a.xb[lo:lo + int(a.back_rows[a.me])].view(np.uint16)


def _post_round(a: CombineArgs, units: list, timer, t: float) -> float:
    """Post every unit of a round (none for this PE) at once: their WQEs built in one numpy operation and posted
    with one call (``Lanes.submit_units``): per unit, per run of channels it carries (one, or a batched lane's),
    one WQE of rows (contiguous on both sides: aggregate or not) then one of weights; the lane's completion after
    its closing unit."""
    lanes, rb, u64 = a.lanes, a.xb.shape[1], np.uint64
    m = len(units)
    peers = np.fromiter((u.peer for u in units), np.intp, m)
    if any(u.segments for u in units):  # a piece per (unit, run of channels) with rows, in posting order
        cols = np.array([(i, u.peer, c0, n) for i, u in enumerate(units) for c0, _, n in u.parts() if n],
                        np.int64).reshape(-1, 4).T
        p_unit, p_peer, p_chan, ns = cols
    else:  # a piece per unit with rows (vectorised: 128 PEs, 1 channel)
        ns = np.fromiter((u.rows for u in units), np.int64, m)
        p_unit = np.flatnonzero(ns)
        p_peer, ns = peers[p_unit], ns[p_unit]
        p_chan = np.fromiter((u.channel for u in units), np.intp, m)[p_unit]
    start = a.recv_channel_start[p_peer, p_chan]
    lo, dst = a.recv_lo[p_peer] + start, a.dest_base[p_peer] + start
    rbase = lanes.remote_base[p_peer]
    every = np.arange(len(ns))
    pieces_of = [every]
    rmt = [rbase + u64(a.region_offsets["combine_x"]) + (dst * rb).astype(u64)]
    sge = [u64(lanes.batch.local_va(a.xb)) + (lo * rb).astype(u64)] if len(ns) else [np.zeros(0, u64)]
    length = [(ns * rb).astype(u64)]
    if a.weights is not None and len(ns):
        wb = a.weights.shape[1] * 4
        pieces_of.append(every)
        rmt.append(rbase + u64(a.region_offsets["combine_weights"]) + (dst * wb).astype(u64))
        sge.append(u64(lanes.batch.local_va(a.weights)) + (lo * wb).astype(u64))
        length.append((ns * wb).astype(u64))
    wp = np.concatenate(pieces_of)
    order = np.argsort(wp, kind="stable")  # piece by piece (so unit by unit): its rows, then its weights
    np.add.at(a.stats.peer_hidden_bytes, p_peer, ns * rb)
    t = timer.lap("build", t)
    lanes.submit_units(units, a.plan, (p_unit[wp[order]], *(np.concatenate(x)[order] for x in (rmt, sge, length))),
                       a.stats, close_kind=1, seq=a.seq, timer=timer)
    return timer.lap("submit", t)


def _wait_sources(a: CombineArgs, sources: list[int]) -> None:
    """Wait for the lanes of every rank in ``sources`` and check their records (``Lanes.wait_completions``)."""
    if sources:
        a.lanes.wait_completions(1, sources, a.seq, a.plan.lane_rows.shape[1], a.back_rows[sources],
                                 f"combine #{a.seq}", "rows this pe sent it")


def _reduce(a: CombineArgs, t0: int, t1: int) -> None:
    """Sum the returned rows of tokens [t0, t1) in ascending rank order (float32, after the bias when there is
    one), round once to bfloat16: natively (``_reduce.bf16_reduce``, one pass, without the interpreter lock;
    ``shmemx.native_access`` tells ``--check`` which rows it read), or with numpy where the native module is
    missing. Both give the same bits."""
    if t1 <= t0:
        return
    head = a.send_head[t0:t1]
    sent = head >= 0
    rows = np.where(sent, a.back_base[None, :] + head, a.zero_row)
    counts = sent.sum(1)
    width = max(int(counts.max()), 1)
    order = np.argsort(~sent, axis=1, kind="stable")[:, :width]
    gather = np.take_along_axis(rows, order, axis=1)  # [n, width]: contributors in rank order, then zero rows
    cx, cw, local = a.views["combine_x"], a.views["combine_weights"], _local_rows(a)
    # the hidden rows: this PE's own ones after the region's (row len(cx) + k: local[k])
    rows[:, a.me] = np.where(sent[:, a.me], len(cx) + head[:, a.me], a.zero_row)
    xg = np.ascontiguousarray(np.take_along_axis(rows, order, axis=1), np.int64)
    if bf16_reduce is not None:
        bf16_reduce(cx.view(np.ndarray).view(np.uint16), xg, np.ascontiguousarray(counts, np.int64),
                    a.out_x[t0:t1].view(np.uint16), None if a.bias is None else a.bias[t0:t1], a.out_x.shape[1],
                    local.view(np.ndarray))
        _note_reads(cx, local, xg, counts)
    else:
        _reduce_numpy(a, t0, xg, counts, (cx.view(np.uint16), local))
    if a.out_weights is not None:
        w = np.zeros((t1 - t0, a.out_weights.shape[1]), np.float32)
        for j in range(width):
            w += cw[gather[:, j]]
        a.out_weights[t0:t1] = w


def _note_reads(cx: np.ndarray, local: np.ndarray, gather: np.ndarray, counts: np.ndarray) -> None:
    """Tell ``--check`` which rows the native reduction read (``shmemx.native_access``): of the region, and of
    this PE's own rows (the input; ``gather`` indexes them after the region's)."""
    def rows(own: bool) -> np.ndarray:
        read = gather[np.arange(gather.shape[1]) < counts[:, None]]
        return np.unique(read[(read >= len(cx)) == own]) - (len(cx) if own else 0)

    shmemx.native_access(cx, lambda: rows(False))
    shmemx.native_access(local, lambda: rows(True))


def _reduce_numpy(a: CombineArgs, t0: int, gather: np.ndarray, counts: np.ndarray, src: tuple) -> None:
    """``_reduce``'s hidden rows with numpy, in chunks of tokens with alike counts (little zero padding); ``src``:
    the region's rows and this PE's own (``[rows, H] uint16`` each, ``gather`` indexes them one after the
    other)."""
    by_count = np.argsort(-counts, kind="stable")
    cx16, local = src
    acc, rows16 = a.scratch(shmemx.get_block_idx())  # [REDUCE_CHUNK, H] float32 and uint16, kept per block
    for c0 in range(0, len(gather), REDUCE_CHUNK):
        toks = by_count[c0:c0 + REDUCE_CHUNK]
        g = gather[toks]
        part, got = acc[:len(g)], rows16[:len(g)]
        if a.bias is None:
            part.fill(0)
        else:
            np.take(a.bias, t0 + toks, axis=0, out=part)
        for j in range(max(int(counts[toks[0]]), 1)):
            np.take(cx16, g[:, j], axis=0, out=got, mode="clip")  # no temporaries: no page faults per call
            own = np.flatnonzero(g[:, j] >= len(cx16))
            got[own] = local[g[own, j] - len(cx16)]
            np.add(part, got.view(bf16), out=part, casting="unsafe")
        a.out_x[t0 + toks] = part  # one rounding to bfloat16 (round to nearest even)


def combine_kernel(a: CombineArgs) -> None:
    """The body of every block (``shmemx.launch(combine_kernel, C, args)``): a block's share of the sending
    rounds, the waits, the reduction and the credits. Where block 0 does every block's work (``Lanes.one_block``)
    the others return at once; where it posts and waits for every block (``Lanes.one_poster``) the others copy
    only their own rows, then each reduces its channel's tokens."""
    role = a.lanes.block_role(a.plan, a.stats)
    if role is None:
        return
    c, solo, one, timer, t = role
    n_blocks = len(a.bounds) - 1
    for k in range(a.plan.rounds):
        t = _send_round(a, c, k, one, solo, timer, t)
    everyone = [r for r in range(a.n_pes) if r != a.me]
    sources = everyone if solo else [r for r in range(c, a.n_pes, n_blocks) if r != a.me]  # this block's
    if not one or c == 0:  # (with one poster, block 0 waits for every block's sources)
        _wait_sources(a, everyone if one else sources)
    t = timer.lap("wait", t)
    if solo:  # the whole reduction, then every source's credit: no other block to meet
        _reduce(a, int(a.bounds[0]), int(a.bounds[-1]))
        timer.lap("epilogue", t)
        give_credits(a, sources, timer)
        return
    shmemx.sync_all()
    t = timer.lap("sync", t)
    _reduce(a, int(a.bounds[c]), int(a.bounds[c + 1]))
    t = timer.lap("epilogue", t)
    shmemx.sync_all()
    timer.count("syncs", 2)
    timer.lap("sync", t)
    give_credits(a, sources, timer)


def _send_round(a: CombineArgs, c: int, k: int, one: bool, solo: bool, timer, t: float) -> float:
    """Round k of block c: this PE's own rows into its combine region (every block's with ``solo``), every remote
    unit of the round in one post (``_post_round``), then the round's quiets (``Lanes.end_round``)."""
    units = a.lanes.round_units(a.plan, c, k, one)
    if solo:  # the other blocks' rows for this PE too
        n_blocks = len(a.bounds) - 1
        units = units + [u for b in range(1, n_blocks) for u in a.plan.by_block[b][k] if u.peer == a.me]
    remote = [u for u in units if u.peer != a.me]
    for u in units:
        if u.peer == a.me:
            _local(a, u)
            t = timer.lap("pack", t)
    if remote:
        t = _post_round(a, remote, timer, t)
    a.stats.round_dsts[k, [u.peer for u in remote]] = True
    return a.lanes.end_round([(u.peer, u.qp) for u in remote], timer, t, last=k == a.plan.rounds - 1)


def give_credits(a: CombineArgs, peers: Iterable[int], timer: BlockTimer) -> None:
    """The returned rows of ``peers`` were reduced: their regions here may be written again (one
    ``aclshmemx_signal_op_many``)."""
    ranks = list(peers)
    shmemx.aclshmemx_signal_op_many(a.views["credits"][1, a.me, 0:1], a.seq, SET, a.lanes.peers.pes[ranks])
    timer.count("credit_writes", len(ranks))

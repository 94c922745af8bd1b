"""MoonEP's group waves: each round every PE sends to one group of ``width`` peers, and hears from one group.

The ``GroupMap`` (``topology``) gives, for round g and lane L, the peer ``dst(me, g, L)`` this PE sends to and
the peer ``incoming(me, g, L)`` it hears from; every round is a bijection on the groups, so each receiver hears
from exactly ``width`` sources per round, and after ``P / width`` rounds every pair has met once.

Blocks (AIVs): ``token_blocks`` lane workers (default one per lane) move the hidden rows; block b serves lanes
``L = b, b + token_blocks, ...``. With ``weight_blocks`` > 0 as many more blocks send the metadata (source index,
top-k experts and weights in one record per row, scales) on a QP of their own, in the same waves; without them the
lane workers send it with the rows. Per round a lane worker, for each of its lanes:

1. waits for the round's credit from ``dst(me, g, L)`` (round g > 0): the destination has finished its round g-1,
   so the waves stay in step and the in-degree bound holds in time, not only in the map;
2. posts the rows as relaxed-order (RO) WRITEs, in chunks of ``CHUNK_ROWS`` rows (one WQE per row without
   ``aggregate``) spread over the token QPs by the QP policy applied to the chunk index (3:1 by chunk for
   ``two_3_1``, as MoonEP), in batches of at most ``BATCH_WQES`` WQEs with a CQE on the last WQE of a batch,
   one doorbell per batch; then on every token QP one strong-order (SO) 8-byte WRITE of the call's sequence
   number (the generation) into the receiver's 512-byte slot ``signals[kind, me, qp]``: SO waits for the earlier
   RO WQEs of its QP, so the generation lands after the rows. (MoonEP indexes the slot ``[source][lane][QP]``; the
   lane that writes source s's slot at a receiver is always the receiver's own position, so here the lane index
   is folded away.) A destination that is this PE itself is a local copy;
3. quiets every (peer, QP) it posted (the CQE of the last batch and of the SO write), then, for each of its lanes,
   waits until every QP's slot of ``incoming(me, g, L)`` holds the generation, consumes that source's rows
   (dispatch: copies them out and gives the source its buffer credit) and writes the next round's credit
   (``seq * (rounds + 1) + g + 1``) into ``round_credits[kind, position * rounds + g + 1]`` of
   ``incoming(me, g + 1, L)``: one word per (lane, round), since the credits of one lane come from a different
   destination every round, and a SET from a fast one must not overwrite a slower one's.

Combine runs the same waves backwards (rows back to the PEs they came from), then every block reduces its share
of the tokens exactly as the fullmesh combine does (bit-identical sums).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import shmemx

from . import combine as fm_combine
from . import dispatch as fm_dispatch
from .routes import peer_tokens
from .schedule import channel_qp
from .topology import GroupMap

__all__ = ["Waves", "groups_dispatch_kernel", "groups_combine_kernel", "CHUNK_ROWS", "BATCH_WQES"]

CHUNK_ROWS = 16  # rows per aggregated WQE
BATCH_WQES = 128  # WQEs per doorbell; only the last asks for a CQE
GE = shmemx.ACLSHMEM_CMP_GE
SET = shmemx.ACLSHMEM_SIGNAL_SET
RO_FLAG = shmemx.OpConfig(cqe=0, se=0, fence=0, odr=shmemx.ACLSHMEMX_UDMA_ODR_RO).flag
RO_CQE_FLAG = shmemx.OpConfig(cqe=1, se=0, fence=0, odr=shmemx.ACLSHMEMX_UDMA_ODR_RO).flag
SO_FLAG = shmemx.ACLSHMEMX_UDMA_OP_CONFIG_SO.flag


@dataclass
class Waves:
    """The group-wave settings of one call.

    Attributes:
        gmap: the ``GroupMap``.
        token_blocks, weight_blocks: blocks for the rows and for the metadata.
        qp_policy: the chunk -> QP rule (``schedule.channel_qp`` on the chunk index; ``bytes``: fewest bytes).
        token_qps: QPs of the rows (0..token_qps-1); the weight blocks use QP ``token_qps``.
    """

    gmap: GroupMap
    token_blocks: int
    weight_blocks: int
    qp_policy: str
    token_qps: int

    @property
    def used_qps(self) -> int:
        return self.token_qps + (1 if self.weight_blocks else 0)

    def lanes_of(self, block: int) -> tuple[list[int], bool]:
        """(the lanes block ``block`` serves, whether it is a weight block)."""
        if block < self.token_blocks:
            return list(range(block, self.gmap.width, self.token_blocks)), False
        w = block - self.token_blocks
        return list(range(w, self.gmap.width, self.weight_blocks)), True

    def token(self, seq: int, g: int) -> int:
        return seq * (self.gmap.rounds + 1) + g


def _chunk_qps(w: Waves, sizes: list[int]) -> list[int]:
    if w.token_qps == 1:
        return [0] * len(sizes)
    if w.qp_policy == "bytes":
        load, out = [0] * w.token_qps, []
        for n in sizes:
            q = int(np.argmin(load))
            out.append(q)
            load[q] += n
        return out
    return [channel_qp(w.qp_policy, k) % w.token_qps for k in range(len(sizes))]


def _post(a, peer: int, qp: int, rmt, sge, length, timer, gen_slot: int) -> None:
    """RO WRITEs in batches of ``BATCH_WQES`` (CQE on each batch's last), then the SO generation write."""
    lanes, stats = a.lanes, a.stats
    queue = lanes.queues[peer, qp]
    n = len(rmt)
    for b0 in range(0, n, BATCH_WQES):
        b1 = min(n, b0 + BATCH_WQES)
        flags = np.full(b1 - b0, RO_FLAG, np.uint64)
        flags[-1] = RO_CQE_FLAG
        wqes = queue.build_writes(rmt_va=rmt[b0:b1], sge_len=length[b0:b1], sge_va=sge[b0:b1], flag=flags)
        head = queue.reserve(b1 - b0)
        queue.write(head, wqes)
        queue.ring_doorbell(head + (b1 - b0), cqes=1)
    src = lanes.local_base + a.region_offsets["send_record"] + (peer * lanes.qp_num + qp) * 64
    a.views["send_record"][peer, qp, 0] = a.seq
    gen = queue.build(shmemx.Opcode.WRITE, SO_FLAG, int(lanes.remote_base[peer]) + gen_slot, sge_len=8, sge_va=src)
    head = queue.reserve(1)
    queue.write(head, gen)
    queue.ring_doorbell(head + 1, cqes=1)
    stats.lane_wqes[peer, qp] += n + 1
    stats.lane_bytes[peer, qp] += int(np.sum(length)) + 8 if n else 8
    timer.count("so_writes")
    timer.count("flag_writes")


def _gen_slot(a, kind: int, qp: int) -> int:
    from .workspace import SIGNAL_WORDS

    return a.region_offsets["signals"] + ((kind * a.n_pes + a.me) * a.lanes.qp_num + qp) * SIGNAL_WORDS * 8


def _credit_word(w: Waves, lane: int, g: int) -> int:
    """The credit word of (lane, round): one per round, so that a later round's credit (another destination,
    which may be faster) never overwrites an earlier one still awaited."""
    return lane * w.gmap.rounds + g


def _wait_credit(a, w: Waves, kind: int, lane: int, g: int, timer, t: float) -> float:
    if g:
        i = _credit_word(w, lane, g)
        shmemx.aclshmem_wait_until(a.views["round_credits"][kind, i:i + 1], GE, w.token(a.seq, g))
        t = timer.lap("wait", t)
    return t


def _give_round_credit(a, w: Waves, kind: int, g: int, lane: int, timer) -> None:
    if g + 1 < w.gmap.rounds:
        src = w.gmap.incoming(a.me, g + 1, lane)
        i = _credit_word(w, int(w.gmap.position_of[a.me]), g + 1)
        shmemx.aclshmemx_signal_op(a.views["round_credits"][kind, i:i + 1], w.token(a.seq, g + 1), SET,
                                   a.lanes.peers.pe(src))
        timer.count("credit_writes")


def _wait_source(a, w: Waves, kind: int, s: int, timer, t: float) -> float:
    """Every QP's generation slot of source s holds this call's (combine: the token QPs only)."""
    if s != a.me:
        n_qps = w.used_qps if kind == 0 else w.token_qps
        shmemx.aclshmem_wait_until_all(a.views["signals"][kind, s, :n_qps, 0], GE, a.seq)
        t = timer.lap("wait", t)
    return t


# --- dispatch ----------------------------------------------------------------------------------------------


def _dispatch_rows(a, w: Waves, peer: int, toks: np.ndarray, weights_only: bool, timer, t: float) -> float:
    """Send this PE's rows (a weight block: their metadata) for ``peer``; a local copy for itself.

    A token block sends the hidden rows (and, without weight blocks, their metadata on its QP 0); a weight block
    the metadata (the records of source index, top-k experts and weights: ``MetaRecord``, and the scales) on the
    weight QP."""
    v, rb, n = a.views, a.row_bytes, len(toks)
    pos, spos = int(a.rank_base[peer]), int(a.send_base[peer])
    if peer == a.me:  # the token block copies everything of its own rows: it copies them out right after
        if weights_only:
            return t
        fm_dispatch._gather(a.xb, toks, v["x"][pos * rb:(pos + n) * rb].reshape(n, rb))
        fm_dispatch._stage(a, slice(pos, pos + n), toks, receive=True)
        return timer.lap("pack", t)
    lanes = a.lanes
    rbase, lbase, off = int(lanes.remote_base[peer]), lanes.local_base, a.region_offsets
    per_qp = {q: ([], [], []) for q in range(w.used_qps)}
    if not weights_only and n:
        if a.aggregate:
            fm_dispatch._gather(a.xb, toks, v["send_x"][spos * rb:(spos + n) * rb].reshape(n, rb))
            starts = list(range(0, n, CHUNK_ROWS))
            sizes = [min(CHUNK_ROWS, n - c) for c in starts]
        else:
            starts, sizes = list(range(n)), [1] * n
        for c, size, q in zip(starts, sizes, _chunk_qps(w, sizes)):
            if a.aggregate:
                src = lbase + off["send_x"] + (spos + c) * rb
            else:
                src = lanes.local_va(peer, q, a.xb) + int(toks[c]) * rb
            per_qp[q][0].append(rbase + off["x"] + (pos + c) * rb)
            per_qp[q][1].append(src)
            per_qp[q][2].append(size * rb)
        a.stats.peer_hidden_bytes[peer] += n * rb
    mq = w.token_qps if weights_only else 0
    if n and weights_only == bool(w.weight_blocks):  # the metadata records and scales: a WQE each
        fm_dispatch._stage(a, slice(spos, spos + n), toks)
        for region, staging, _ in fm_dispatch._meta(a):
            item = fm_dispatch._row_bytes(a, region)
            per_qp[mq][0].append(rbase + off[region] + pos * item)
            per_qp[mq][1].append(lbase + off[staging] + spos * item)
            per_qp[mq][2].append(n * item)
    t = timer.lap("pack", t)
    for q in ([w.token_qps] if weights_only else range(w.token_qps)):
        rmt, sge, length = (np.array(x, np.uint64) for x in per_qp[q])
        _post(a, peer, q, rmt, sge, length, timer, _gen_slot(a, 0, q))
    return timer.lap("submit", t)


def _route(a, peers: list[int], timer) -> dict:
    """Each destination's tokens (ascending), for this block's destinations only."""
    n_tok = a.xb.shape[0]
    if a.routing == "scan":  # a block reads its destinations' columns of the mask
        m = a.is_token_in_rank[:, peers]
        idx, toks = np.nonzero(m.T)
        split = np.searchsorted(idx, np.arange(len(peers) + 1))
        timer.count("route_reads", m.size)
        return {p: toks[split[i]:split[i + 1]].astype(np.int64) for i, p in enumerate(peers)}
    toks, split, reads = peer_tokens(0, n_tok, a.n_pes, routing=a.routing, dests=a.dests)
    timer.count("route_reads", reads)
    return {p: toks[split[p]:split[p + 1]] for p in peers}


def groups_dispatch_kernel(a: fm_dispatch.DispatchArgs, w: Waves) -> None:
    """The body of every block: ``shmemx.launch(groups_dispatch_kernel, token_blocks + weight_blocks, a, w)``;
    ``a`` is a ``dispatch.DispatchArgs``."""
    b = shmemx.get_block_idx()
    timer = a.stats.timer(b)
    t = timer.mark()
    lanes, weights_only = w.lanes_of(b)
    gm = w.gmap
    route = _route(a, sorted({gm.dst(a.me, g, L) for g in range(gm.rounds) for L in lanes}), timer)
    t = timer.lap("route", t)
    for g in range(gm.rounds):
        posted = []
        for L in lanes:
            peer = gm.dst(a.me, g, L)
            t = _wait_credit(a, w, 0, L, g, timer, t)
            t = _dispatch_rows(a, w, peer, route[peer], weights_only, timer, t)
            if peer != a.me:
                posted += [(peer, q) for q in ([w.token_qps] if weights_only else range(w.token_qps))]
                a.stats.round_dsts[g, peer] = True
        for peer, q in posted:
            a.lanes.quiet(peer, q)
        timer.count("quiets", len(posted))
        t = timer.lap("quiet", t)
        if weights_only:
            continue
        for L in lanes:
            s = gm.incoming(a.me, g, L)
            t = _wait_source(a, w, 0, s, timer, t)
            t = fm_dispatch.copy_out(a, s, timer, t)
            _give_round_credit(a, w, 0, g, L, timer)
    shmemx.sync_all()
    timer.count("syncs")
    timer.lap("sync", t)


# --- combine -----------------------------------------------------------------------------------------------


def _combine_rows(a, w: Waves, peer: int, timer, t: float) -> float:
    """Send back the rows that came from ``peer`` (one contiguous range on both sides), in chunks over the QPs."""
    rb = a.xb.shape[1]
    lo, hi = int(a.recv_lo[peer]), int(a.recv_lo[peer]) + int(a.recv_rows[peer])
    dst = int(a.dest_base[peer])
    n = hi - lo
    if peer == a.me:  # the reduction reads the hidden rows in the input (``combine._local_rows``)
        if a.weights is not None:
            a.views["combine_weights"][dst:dst + n] = a.weights[lo:hi]
        return timer.lap("pack", t)
    lanes = a.lanes
    rbase = int(lanes.remote_base[peer])
    per_qp = [([], [], []) for _ in range(w.token_qps)]
    if n:
        step = CHUNK_ROWS if a.aggregate else 1
        starts = list(range(0, n, step))
        sizes = [min(step, n - c) for c in starts]
        chunk_qps = _chunk_qps(w, sizes)
        vas = {q: lanes.local_va(peer, q, a.xb) for q in set(chunk_qps)}
        for c, size, q in zip(starts, sizes, chunk_qps):
            va = vas[q]
            per_qp[q][0].append(rbase + a.region_offsets["combine_x"] + (dst + c) * rb)
            per_qp[q][1].append(va + (lo + c) * rb)
            per_qp[q][2].append(size * rb)
        if a.weights is not None:
            wb = a.weights.shape[1] * 4
            per_qp[0][0].append(rbase + a.region_offsets["combine_weights"] + dst * wb)
            per_qp[0][1].append(lanes.local_va(peer, 0, a.weights) + lo * wb)
            per_qp[0][2].append(n * wb)
        a.stats.peer_hidden_bytes[peer] += n * rb
    t = timer.lap("build", t)
    for q in range(w.token_qps):
        rmt, sge, length = (np.array(x, np.uint64) for x in per_qp[q])
        _post(a, peer, q, rmt, sge, length, timer, _gen_slot(a, 1, q))
    return timer.lap("submit", t)


def groups_combine_kernel(a: fm_combine.CombineArgs, w: Waves) -> None:
    """The body of every block of a groups combine (``a``: a ``combine.CombineArgs`` with ``recv_rows``); weight
    blocks are not used by combine (its weights ride with the rows)."""
    b = shmemx.get_block_idx()
    timer = a.stats.timer(b)
    t = timer.mark()
    lanes, _ = w.lanes_of(b)
    gm = w.gmap
    for g in range(gm.rounds):
        posted = []
        for L in lanes:
            peer = gm.dst(a.me, g, L)
            t = _wait_credit(a, w, 1, L, g, timer, t)
            t = _combine_rows(a, w, peer, timer, t)
            if peer != a.me:
                posted += [(peer, q) for q in range(w.token_qps)]
                a.stats.round_dsts[g, peer] = True
        for peer, q in posted:
            a.lanes.quiet(peer, q)
        timer.count("quiets", len(posted))
        t = timer.lap("quiet", t)
        for L in lanes:
            t = _wait_source(a, w, 1, gm.incoming(a.me, g, L), timer, t)
            _give_round_credit(a, w, 1, g, L, timer)
    shmemx.sync_all()
    t = timer.lap("sync", t)
    fm_combine._reduce(a, int(a.bounds[b]), int(a.bounds[b + 1]))
    t = timer.lap("epilogue", t)
    shmemx.sync_all()
    timer.count("syncs", 2)
    timer.lap("sync", t)
    fm_combine.give_credits(a, [r for r in range(b, a.n_pes, w.token_blocks) if r != a.me], timer)

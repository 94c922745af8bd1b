"""HiSilicon's layered (hierarchy) schedule: across servers only to the same lane, then inside the server.

Ranks sit in servers of S (``Topology``, from rank ids: server ``r // S``, lane ``r % S``). With N servers the
dispatch of PE ``me`` (server σ, lane λ) runs on N blocks:

1. **Cross-server** (block δ, for every other server δ): the tokens with at least one expert on server δ (one
   record per (token, server), however many of δ's experts it chose) become records
   ``[flag = seq | source token | rank mask of δ's ranks it goes to | hidden row | top-k experts | weights |
   scales]``, packed in the staging area, and go to the relay ``δ * S + λ``, into its ``relay_in[σ]``: one
   strong-order (SO) WRITE per record, then a 64-byte end flag (a WRITE_WITH_NOTIFY of the record count, the
   signal ``relay_end[0, σ]`` = seq), SO too; batches of at most 128 WQEs with a CQE on the last. SO orders each
   record after the one before it on the QP, which is the layered kernel's arrival rule in UDMA terms: record i
   has arrived once record i+1's flag is visible, or once the end flag and record i's own flag are
   (``arrived``). The relay waits for the end flag (asleep), checks the rule over the records, and forwards.
2. **Intra-server forwarding** (block δ' forwards what came from server δ'; block σ this PE's own tokens for its
   server): for every rank d of this server, the rows whose mask names d go, with their metadata, by direct
   (MTE) copies into d's receive regions at the rows the fullmesh schedule would use (``rank_prefix_matrix``):
   one copy per (token, destination rank).
3. **Intra-server barrier**: a barrier of the server's team (``aclshmem_barrier(server_team)``, the ranks of this
   PE's server; after its copies, which are complete when they return): every row for this PE is in place.
4. **Compaction**: the rows are copied out to the outputs as the fullmesh receive side does, and every peer gets
   its buffer credit.

Combine goes back along the same path: each expert rank copies (MTE) the rows of source s to the relay of s in
its own server (``server(me) * S + lane(s)``), intra-server barrier, the relay sums the rows of each (source,
token) over its server's ranks in float32 (ascending rank), rounds the partial once to bfloat16 and sends it
across servers to the source (one aggregated WRITE, then a fenced completion signal); the source sums the
partials of the servers in ascending server order in float32 and rounds once. Rows reach the source once per
(token, server): two roundings instead of one, so combine is within ``combine_bound`` of the float32 sum, not
bit-equal to the fullmesh combine (weights are exact: one rank contributes to each top-k slot).

Difference from the layered kernel: it returns expert-major rows (one copy per (token, expert) inside the
server); this Buffer returns DeepEP's rank-major layout, so inside a server there is one copy per
(token, destination rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import shmemx

from . import dispatch as fm_dispatch
from .combine import CombineArgs, give_credits
from .lanes import FENCE_SO
from .reference import bf16
from .routes import peer_tokens
from .topology import Topology
from .workspace import WorkspaceLayout

__all__ = ["HierSpec", "RelayInfo", "hier_dispatch_kernel", "hier_combine_kernel", "plan_hier_workspace",
           "arrived", "combine_bound", "HEADER_BYTES"]

HEADER_BYTES = 32  # flag u64, source token i32, pad, rank mask u64, pad
BATCH_WQES = 128
GE = shmemx.ACLSHMEM_CMP_GE
SO_FLAG = shmemx.OpConfig(cqe=0, se=0, fence=0, odr=shmemx.ACLSHMEMX_UDMA_ODR_SO).flag
SO_CQE_FLAG = shmemx.ACLSHMEMX_UDMA_OP_CONFIG_SO.flag


def record_bytes(hidden: int, num_topk: int) -> int:
    """Bytes of one record: header, the row (sized for bfloat16), top-k experts and weights, scales; 32-aligned."""
    raw = HEADER_BYTES + 2 * hidden + 12 * num_topk + 4 * -(-hidden // 128)
    return -(-raw // 32) * 32


def plan_hier_workspace(*, topo: Topology, max_tokens: int, hidden: int, num_topk: int) -> WorkspaceLayout:
    """The hierarchy's own regions (a second allocation, made when a Buffer first uses the schedule)."""
    s, n, t = topo.server_size, topo.num_servers, max_tokens
    rec = record_bytes(hidden, num_topk)
    ws = WorkspaceLayout()
    ws.append("relay_end", (2, n, 64), np.uint64)  # word 0 the signal, word 8 the record count
    ws.append("end_record", (n, 8), np.int64)
    ws.append("relay_in", (n, t, rec), np.uint8)
    ws.append("send_rec", (n, t, rec), np.uint8)
    ws.append("relay_cin", (s, n, t, hidden), bf16)
    ws.append("relay_cw", (s, n, t, num_topk), np.float32)
    ws.append("partial_in", (n, t, hidden), bf16)
    ws.append("partial_w", (n, t, num_topk), np.float32)
    ws.append("partial_send", (n, t, hidden), bf16)
    ws.append("partial_send_w", (n, t, num_topk), np.float32)
    return ws


@dataclass
class RelayInfo:
    """What this PE relayed in a dispatch, for the combine that undoes it: per source server, the source
    tokens of its records ``tokens[δ] [n] int32`` and their rank masks ``masks[δ] [n] uint64``."""

    tokens: list
    masks: list


@dataclass
class HierSpec:
    """The hierarchy settings and regions of one call: the topology, the hierarchy views and their offsets,
    the remote base of the hierarchy allocation on every peer, the full ``rank_prefix_matrix`` and, for
    combine, the dispatch's ``RelayInfo``."""

    topo: Topology
    views: dict
    offsets: dict
    remote_base: np.ndarray
    local_base: int
    prefix: np.ndarray  # [P, P] int32
    relay: RelayInfo | None = None
    server_team: int = 0  # the team of this PE's server (aclshmem_team_split_strided of the world), its barrier


def arrived(flags: np.ndarray, seq: int, end_set: bool) -> np.ndarray:
    """The layered kernel's arrival rule: record i has arrived once record i+1's flag is set, or once the end
    flag is set and record i's own flag is (``flags [n + 1] uint64``: the flags of the n records and the slot
    after them)."""
    ok = flags == seq
    out = np.zeros(len(flags), bool)
    out[:-1] = ok[1:]
    if end_set:
        out |= ok
    return out


def combine_bound(rows_abs_sum: np.ndarray) -> np.ndarray:
    """The documented bound of the hierarchy combine: ``|combined - float32 sum| <= 2**-7 * sum |rows|`` per
    element (a bfloat16 rounding of each server's partial, then one of the total: 2**-8 relative each)."""
    return np.float64(2.0 ** -7) * rows_abs_sum


# --- dispatch ----------------------------------------------------------------------------------------------


def _record_layout(a, hv: dict):
    """(column slices of a relay record) for the row, top-k experts, weights, scales (``hv``: the hierarchy's
    views, sized by the Buffer's hidden and num_topk)."""
    rb, hidden = a.row_bytes, hv["relay_cin"].shape[3]
    k = hv["relay_cw"].shape[3]
    x0 = HEADER_BYTES
    k0 = x0 + 2 * hidden
    w0 = k0 + 8 * k
    s0 = w0 + 4 * k
    return slice(x0, x0 + rb), slice(k0, w0), slice(w0, s0), s0


def _server_masks(a, h: HierSpec, dst_server: int, toks: np.ndarray) -> np.ndarray:
    """``[n] uint64``: for each token, the bits of ``dst_server``'s ranks it goes to."""
    s = h.topo.server_size
    lo = dst_server * s
    if a.routing == "compact":
        d = a.dests[toks]
        bits = np.where((d >= lo) & (d < lo + s), np.left_shift(np.uint64(1), (d - lo).clip(0).astype(np.uint64)),
                        np.uint64(0))
        return np.bitwise_or.reduce(bits, axis=1) if bits.shape[1] else np.zeros(len(toks), np.uint64)
    m = a.is_token_in_rank[toks, lo:lo + s]
    return (m.astype(np.uint64) << np.arange(s, dtype=np.uint64)).sum(1, dtype=np.uint64)


def _send_records(a, h: HierSpec, delta: int, toks: np.ndarray, timer, t: float) -> float:
    """Block δ: one SO record per token for server δ to its relay, then the end flag."""
    topo, me, hv = h.topo, a.me, h.views
    sigma = me // topo.server_size
    relay = topo.relay(me, delta)
    n = len(toks)
    rec = hv["send_rec"][delta, :n]
    xs, ks, ws, s0 = _record_layout(a, hv)
    rec[:, 0:8].view(np.uint64)[:, 0] = a.seq
    rec[:, 8:12].view(np.int32)[:, 0] = toks
    rec[:, 16:24].view(np.uint64)[:, 0] = _server_masks(a, h, delta, toks)
    fm_dispatch._gather(a.xb, toks, rec[:, xs])
    if a.topk_idx is not None:
        rec[:, ks].view(np.int64)[:] = a.topk_idx[toks]
        rec[:, ws].view(np.float32)[:] = a.topk_weights[toks]
    if a.scales is not None:
        hs = a.scales.shape[1]
        rec[:, s0:s0 + 4 * hs].view(np.float32)[:] = a.scales[toks]
    t = timer.lap("pack", t)
    queue = a.lanes.queues[relay, 0]
    rec_bytes = hv["send_rec"].shape[2]
    rbase, lbase = int(h.remote_base[relay]), h.local_base
    rmt = rbase + h.offsets["relay_in"] + (sigma * hv["relay_in"].shape[1] + np.arange(n, dtype=np.uint64)) * rec_bytes
    sge = lbase + h.offsets["send_rec"] + (delta * hv["send_rec"].shape[1] + np.arange(n, dtype=np.uint64)) * rec_bytes
    used = s0 + (4 * a.scales.shape[1] if a.scales is not None else 0)
    for b0 in range(0, n, BATCH_WQES):
        b1 = min(n, b0 + BATCH_WQES)
        flags = np.full(b1 - b0, SO_FLAG, np.uint64)
        flags[-1] = SO_CQE_FLAG
        wqes = queue.build_writes(rmt_va=rmt[b0:b1].astype(np.uint64), sge_len=np.uint64(used),
                                  sge_va=sge[b0:b1].astype(np.uint64), flag=flags)
        head = queue.reserve(b1 - b0)
        queue.write(head, wqes)
        queue.ring_doorbell(head + (b1 - b0), cqes=1)
    t = timer.lap("build", t)
    hv["end_record"][delta, 0] = n
    hv["end_record"][delta, 1] = a.seq
    sig = rbase + h.offsets["relay_end"] + (sigma * 64) * 8
    tid, token = a.lanes.notify_keys[relay, 0]
    end = queue.build(shmemx.Opcode.WRITE_WITH_NOTIFY, SO_CQE_FLAG, sig + 64, sge_len=16,
                      sge_va=lbase + h.offsets["end_record"] + delta * 64, notify_tid=tid, notify_token=token,
                      notify_va=sig, notify_value=a.seq)
    head = queue.reserve(2)
    queue.write(head, end)
    queue.ring_doorbell(head + len(end) // 64, cqes=1)
    a.lanes.quiet(relay, 0)
    st = a.stats
    st.lane_wqes[relay, 0] += n + 1
    st.lane_bytes[relay, 0] += n * used + 16
    st.peer_hidden_bytes[relay] += n * a.row_bytes
    st.round_dsts[0, relay] = True
    timer.count("so_writes", n + 1)
    timer.count("flag_writes")
    timer.count("quiets")
    return timer.lap("quiet", t)


def _forward(a, h: HierSpec, src: int, toks: np.ndarray, masks: np.ndarray, rows: np.ndarray, recs: np.ndarray,
             scales: np.ndarray | None, timer, t: float) -> float:
    """Copy source ``src``'s rows (``rows [n, row_bytes]``, ``toks``: their source tokens, ``masks``: the local
    ranks each goes to, ``recs [n, width] uint8``: their metadata records, ``scales [n, Hs]`` or None) into every
    rank of this server, at the rows ``rank_prefix_matrix`` gives."""
    topo, me = h.topo, a.me
    base = (me // topo.server_size) * topo.server_size
    rb, v, w = a.row_bytes, a.views, a.record.width
    for dl in range(topo.server_size):
        d = base + dl
        sel = np.flatnonzero((masks >> np.uint64(dl)) & np.uint64(1))
        if not len(sel):
            continue
        n = len(sel)
        pos = int(h.prefix[src - 1, d]) if src > 0 else 0
        parts = [(v["x"][pos * rb:(pos + n) * rb], np.ascontiguousarray(rows[sel]).reshape(-1)),
                 (v["meta"][pos * w:(pos + n) * w], recs[sel].reshape(-1))]
        if scales is not None:
            parts.append((v["x_scales"][pos:pos + n], np.ascontiguousarray(scales[sel])))
        for dst, data in parts:
            if d == me:
                dst[...] = data.reshape(dst.shape)
            else:
                shmemx.aclshmemx_mte_put_nbi(dst, data.reshape(dst.shape), dst.size, a.lanes.peers.pe(d))
        if d != me:
            timer.count("mte_copies", len(parts))
            a.stats.peer_hidden_bytes[d] += n * rb
            a.stats.round_dsts[1, d] = True
    return timer.lap("submit", t)


def _relay_records(a, h: HierSpec, dp: int, timer, t: float) -> tuple[float, RelayInfo | None]:
    """Block δ': wait for server δ''s records (its rank at this lane), check the arrival rule, forward."""
    hv, topo = h.views, h.topo
    src = dp * topo.server_size + a.me % topo.server_size
    shmemx.aclshmem_wait_until(hv["relay_end"][0, dp, 0:1], GE, a.seq)
    t = timer.lap("wait", t)
    n, seq = (int(x) for x in hv["relay_end"][0, dp, 8:10].view(np.int64))
    recs = hv["relay_in"][dp]
    flags = np.zeros(n + 1, np.uint64)
    flags[:n] = recs[:n, 0:8].view(np.uint64)[:, 0]
    if n < recs.shape[0]:
        flags[n] = recs[n, 0:8].view(np.uint64)[0]
    ok = arrived(flags, a.seq, True)
    if seq != a.seq or not ok[:n].all() or flags[n] == a.seq:
        raise RuntimeError(f"pe {a.me}: hierarchy dispatch #{a.seq}: records from pe {src} break the arrival rule "
                           f"(end record count {n} seq {seq}, arrived {int(ok[:n].sum())} of {n})")
    recs = recs[:n]
    toks = recs[:, 8:12].view(np.int32)[:, 0].copy()
    masks = recs[:, 16:24].view(np.uint64)[:, 0].copy()
    xs, ks, ws, s0 = _record_layout(a, hv)
    # the relay records' fields as the receivers' metadata records
    meta = a.record.pack(toks) if a.topk_idx is None else \
        a.record.pack(toks, recs[:, ks].view(np.int64), recs[:, ws].view(np.float32))
    scales = None if a.scales is None else recs[:, s0:s0 + 4 * a.scales.shape[1]].view(np.float32)
    t = timer.lap("epilogue", t)
    t = _forward(a, h, src, toks, masks, recs[:, xs], meta, scales, timer, t)
    return t, (toks, masks)


def _own_server(a, h: HierSpec, toks: np.ndarray, timer, t: float) -> float:
    """Block σ: this PE's own tokens for the ranks of its own server (no relay)."""
    masks = _server_masks(a, h, a.me // h.topo.server_size, toks)
    meta = fm_dispatch.records(a, toks)
    scales = None if a.scales is None else a.scales[toks]
    return _forward(a, h, a.me, toks, masks, a.xb[toks], meta, scales, timer, t)


def _server_barrier(a, h: HierSpec, kind: int, timer) -> None:
    """The intra-server barrier (dispatch ``kind`` 0, combine 1): a barrier of the server's team. Counted as one
    barrier and the S - 1 flag writes a flat barrier of S ranks makes on the device (CANN's team barrier signals
    the team's other ranks), as the hand-written barrier it replaces counted them."""
    topo = h.topo
    timer.count("flag_writes", topo.server_size - 1)
    timer.count("barriers")
    if topo.server_size > 1:
        shmemx.aclshmem_barrier(h.server_team)


def _meet_server(a, h: HierSpec, b: int, phase: int, timer, t: float) -> float:
    """Every block of this PE done (``sync_all``), then this PE's server (block 0 in the server barrier of
    ``phase``: 0 dispatch, 1 combine), then every block again: the blocks go on together after the server."""
    shmemx.sync_all()
    t = timer.lap("sync", t)
    if b == 0:
        _server_barrier(a, h, phase, timer)
        t = timer.lap("wait", t)
    shmemx.sync_all()
    timer.count("syncs", 2)
    return timer.lap("sync", t)


def hier_dispatch_kernel(a: fm_dispatch.DispatchArgs, h: HierSpec, relay_out: list) -> None:
    """The body of every block (``shmemx.launch(hier_dispatch_kernel, N, a, h, relay_out)``); ``a`` is a
    ``dispatch.DispatchArgs``; ``relay_out[δ']`` receives what block δ' relayed (for the combine)."""
    b = shmemx.get_block_idx()
    timer = a.stats.timer(b)
    t = timer.mark()
    topo = h.topo
    sigma = a.me // topo.server_size
    toks, split, reads = peer_tokens(0, a.xb.shape[0], topo.num_servers, routing=a.routing,
                                     mask=a.is_token_in_rank, dests=a.dests, div=topo.server_size)
    mine = toks[split[b]:split[b + 1]]
    timer.count("route_reads", reads)
    t = timer.lap("route", t)
    if b != sigma:
        t = _send_records(a, h, b, mine, timer, t)
        t, relay_out[b] = _relay_records(a, h, b, timer, t)
    else:
        t = _own_server(a, h, mine, timer, t)
    t = _meet_server(a, h, b, 0, timer, t)
    timer.count("syncs")
    sources = range(b, a.n_pes, topo.num_servers)
    for s in sources:
        t = fm_dispatch.copy_out(a, s, timer, t, credit=False)
    shmemx.sync_all()  # every block copied out before any source gets its credit (dispatch.give_credit)
    timer.count("syncs")
    for s in sources:
        fm_dispatch.give_credit(a, s, timer)


# --- combine -----------------------------------------------------------------------------------------------


def _rows_to_relays(a, h: HierSpec, b: int, timer, t: float) -> float:
    """Phase 1 (sources s = b, b + N, ...): the rows of source s go to its relay in this server."""
    topo, me, hv = h.topo, a.me, h.views
    base = (me // topo.server_size) * topo.server_size
    dl = me % topo.server_size
    for s in range(b, a.n_pes, topo.num_servers):
        n = int(a.recv_rows[s])
        if not n:
            continue
        r = base + s % topo.server_size
        lo = int(a.recv_lo[s])
        srv = s // topo.server_size
        parts = [(hv["relay_cin"][dl, srv, :n], a.xb[lo:lo + n].view(bf16))]
        if a.weights is not None:
            parts.append((hv["relay_cw"][dl, srv, :n], a.weights[lo:lo + n]))
        for dst, data in parts:
            if r == me:
                dst[...] = data
            else:
                shmemx.aclshmemx_mte_put_nbi(dst, np.ascontiguousarray(data), dst.size, a.lanes.peers.pe(r))
        if r != me:
            timer.count("mte_copies", len(parts))
            a.stats.peer_hidden_bytes[r] += n * a.xb.shape[1]
            a.stats.round_dsts[0, r] = True
    return timer.lap("submit", t)


def _partials(a, h: HierSpec, dp: int, timer, t: float) -> float:
    """Phase 2 (block δ'): sum what this server's ranks returned for the tokens relayed from server δ' (for
    δ' = own server: this PE's own tokens), round once, send the partial to the source."""
    topo, hv = h.topo, h.views
    sigma = a.me // topo.server_size
    acc, wacc = _sum_returned(a, h, dp)
    n = len(acc)
    if dp == sigma:
        hv["partial_in"][sigma, :n] = acc
        if wacc is not None:
            hv["partial_w"][sigma, :n] = wacc
        return timer.lap("epilogue", t)
    hv["partial_send"][dp, :n] = acc
    if wacc is not None:
        hv["partial_send_w"][dp, :n] = wacc
    t = timer.lap("epilogue", t)
    return _send_partial(a, h, dp, n, wacc is not None, timer, t)


def _sum_returned(a, h: HierSpec, dp: int) -> tuple:
    """The float32 sums ``[n, H]`` (and of the weights ``[n, K]``, or None) of the rows this server's ranks
    returned for the n tokens relayed from server δ' (own server: this PE's own tokens), lane by lane."""
    topo, hv = h.topo, h.views
    sigma = a.me // topo.server_size
    if dp == sigma:
        toks = np.flatnonzero(a.server_mask[:, sigma])
        masks = a.own_masks[toks]
    else:
        toks, masks = h.relay.tokens[dp], h.relay.masks[dp]
    n = len(toks)
    acc = np.zeros((n, a.out_x.shape[1]), np.float32)
    wacc = np.zeros((n, a.weights.shape[1]), np.float32) if a.weights is not None else None
    for dl in range(topo.server_size):
        bit = ((masks >> np.uint64(dl)) & np.uint64(1)).astype(bool)
        k = int(bit.sum())
        if k:
            acc[bit] += hv["relay_cin"][dl, dp, :k].astype(np.float32)
            if wacc is not None:
                wacc[bit] += hv["relay_cw"][dl, dp, :k]
    return acc, wacc


def _send_partial(a, h: HierSpec, dp: int, n: int, with_weights: bool, timer, t: float) -> float:
    """Send the n partial sums staged for server δ' to its source (the same lane there): the rows (and
    weights) in one batch with the end record and its fenced signal, one doorbell, then the quiet."""
    topo, hv = h.topo, h.views
    sigma, lane = a.me // topo.server_size, a.me % topo.server_size
    src = dp * topo.server_size + lane
    queue = a.lanes.queues[src, 0]
    rbase, lbase, off = int(h.remote_base[src]), h.local_base, h.offsets
    hb, rows_n = a.out_x.shape[1] * 2, hv["partial_in"].shape[1]
    rmt, sge, length = [rbase + off["partial_in"] + sigma * rows_n * hb], [lbase + off["partial_send"] + dp * rows_n * hb], [n * hb]
    if with_weights:
        wb = a.weights.shape[1] * 4
        rmt.append(rbase + off["partial_w"] + sigma * rows_n * wb)
        sge.append(lbase + off["partial_send_w"] + dp * rows_n * wb)
        length.append(n * wb)
    if n == 0:
        rmt, sge, length = [], [], []
    wqes = [queue.build_writes(rmt_va=np.array(rmt, np.uint64), sge_len=np.array(length, np.uint64),
                               sge_va=np.array(sge, np.uint64), flag=0x20).view(np.uint8).reshape(-1)] if rmt else []
    hv["end_record"][dp, 0] = n
    hv["end_record"][dp, 1] = a.seq
    sig = rbase + off["relay_end"] + ((topo.num_servers + sigma) * 64) * 8
    tid, token = a.lanes.notify_keys[src, 0]
    wqes.append(np.frombuffer(queue.build(shmemx.Opcode.WRITE_WITH_NOTIFY, FENCE_SO.flag, sig + 64, sge_len=16,
                                          sge_va=lbase + off["end_record"] + dp * 64, notify_tid=tid,
                                          notify_token=token, notify_va=sig, notify_value=a.seq), np.uint8))
    queue.post(np.concatenate(wqes), cqes=len(rmt) + 1)
    a.lanes.quiet(src, 0)
    st = a.stats
    st.lane_wqes[src, 0] += len(rmt) + 1
    st.lane_bytes[src, 0] += int(sum(length)) + 16
    st.peer_hidden_bytes[src] += n * hb
    st.round_dsts[1, src] = True
    for name in ("so_writes", "flag_writes", "quiets"):
        timer.count(name)
    return timer.lap("quiet", t)


def _final_sum(a, h: HierSpec, t0: int, t1: int) -> None:
    """Phase 3: per token, the bias (if any), then the partials of its servers in ascending server order, float32,
    rounded once."""
    hv = h.views
    mask = a.server_mask[t0:t1]
    pos = a.server_pos[t0:t1]
    acc = np.zeros((t1 - t0, a.out_x.shape[1]), np.float32) if a.bias is None else a.bias[t0:t1].copy()
    wacc = np.zeros((t1 - t0, a.out_weights.shape[1]), np.float32) if a.out_weights is not None else None
    for dp in range(h.topo.num_servers):
        sel = np.flatnonzero(mask[:, dp])
        if len(sel):
            acc[sel] += hv["partial_in"][dp, pos[sel, dp]].astype(np.float32)
            if wacc is not None:
                wacc[sel] += hv["partial_w"][dp, pos[sel, dp]]
    a.out_x[t0:t1] = acc
    if wacc is not None:
        a.out_weights[t0:t1] = wacc


def hier_combine_kernel(a: CombineArgs, h: HierSpec) -> None:
    """The body of every block of a hierarchy combine (N blocks; ``a``: a ``combine.CombineArgs`` with
    ``recv_rows``, ``server_mask [T, N]``, ``server_pos [T, N]`` and ``own_masks [T]`` set)."""
    b = shmemx.get_block_idx()
    timer = a.stats.timer(b)
    t = timer.mark()
    topo = h.topo
    sigma = a.me // topo.server_size
    t = _rows_to_relays(a, h, b, timer, t)
    t = _meet_server(a, h, b, 1, timer, t)
    t = _partials(a, h, b, timer, t)
    if b != sigma:
        shmemx.aclshmem_wait_until(h.views["relay_end"][1, b, 0:1], GE, a.seq)
        t = timer.lap("wait", t)
    shmemx.sync_all()
    t = timer.lap("sync", t)
    _final_sum(a, h, int(a.bounds[b]), int(a.bounds[b + 1]))
    t = timer.lap("epilogue", t)
    shmemx.sync_all()
    timer.count("syncs", 2)
    timer.lap("sync", t)
    give_credits(a, [r for r in range(b, a.n_pes, topo.num_servers) if r != a.me], timer)

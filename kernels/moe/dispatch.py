"""The dispatch kernel: one AIV block per channel sends its tokens to every rank, then receives and copies out.

Block c owns the tokens ``[b[c], b[c+1])`` and, per destination r, a cursor: its rows for r land in r's ``x``
region at ``rank_prefix_matrix[me-1][r] + channel_prefix[r][c-1]`` (the rows of the lower ranks first, then
this rank's lower channels), in token order. Per round of the plan (see ``schedule``) the block:

1. route scan (once): ``is_token_in_rank[b[c]:b[c+1]]`` -> the token list of each destination;
2. per unit (destination r, QP q): packs what it sends into its staging area (with ``aggregate``: the hidden
   rows too, so that they go in one WQE; without it, one WQE per run of consecutive tokens reads the rows straight
   from ``x``: no staging copy), builds
   the unit's WQEs in one numpy operation and posts them with one doorbell; the lane's closer appends the
   lane's completion (record and signal, fenced: ``lanes``) to that batch; rows for this PE itself are copied
   directly;
3. quiets each lane it posted (which hands the lane to the next round's block), then ``sync_all``.

Then the receive side: block c waits (asleep) for the completion signals of every QP from the sources
``s = c, c + C, ...``, checks that their records add up to the rows notify announced, copies the source's rows
out of the workspace into the outputs (the hidden rows only where they did not land in recv_x itself: a receive
slot the receiver named in its notify record, ``slots``, or zero copy) (converting top-k experts to local indices, -1 elsewhere, weights 0 there),
and, once every block has copied its sources out (``sync_all``), gives each of its sources its credit: the region
may be written again. Where block 0 does every block's work (``Lanes.one_block``) it is the kernel's only block:
one route scan of every channel's tokens, every channel's own rows in one copy, then as above for all sources.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

import shmemx

from .routes import peer_tokens
from .schedule import Plan
from .measure import BlockTimer, CallStats
from .workspace import MetaRecord

__all__ = ["DispatchArgs", "DispatchOutputs", "dispatch_kernel"]

GE = shmemx.ACLSHMEM_CMP_GE
SET = shmemx.ACLSHMEM_SIGNAL_SET


@dataclass
class DispatchOutputs:
    """Where the received rows go: ``x [rows, row_bytes] uint8`` (a byte view of recv_x; None: zero copy, recv_x
    is the workspace's rows), ``src_idx [rows]``, and, when present, ``topk_idx [rows, K]``,
    ``topk_weights [rows, K]``, ``scales [rows, Hs]``. ``credit``: give each source its credit once copied out
    (False with zero copy: the Buffer gives it at this PE's next dispatch)."""

    x: np.ndarray | None
    src_idx: np.ndarray
    topk_idx: np.ndarray | None
    topk_weights: np.ndarray | None
    scales: np.ndarray | None
    credit: bool = True


@dataclass
class DispatchArgs:
    """Everything the blocks of one dispatch read (built on the host before the launch)."""

    me: int
    n_pes: int
    seq: int
    num_local_experts: int
    views: dict
    lanes: object
    plan: Plan
    stats: CallStats
    xb: np.ndarray  # [T, row_bytes] uint8, C-contiguous
    topk_idx: np.ndarray | None  # [T, K] int64
    topk_weights: np.ndarray | None  # [T, K] float32
    scales: np.ndarray | None  # [T, Hs] float32
    is_token_in_rank: np.ndarray  # [T, P] bool
    bounds: np.ndarray  # [C + 1] channel token bounds
    rank_base: np.ndarray  # [P] first row of this PE's block in each destination's x region
    channel_start: np.ndarray  # [P, C] exclusive prefix over channels of rows sent to each destination
    send_base: np.ndarray  # [P] first staging row of each destination's rows
    recv_lo: np.ndarray  # [P] first row received from each source
    recv_hi: np.ndarray  # [P]
    out: DispatchOutputs | None  # None: the rows do not fit (num_worst_tokens overflow); receive, do not copy
    aggregate: bool
    region_offsets: dict  # region name -> byte offset in the workspace
    record: MetaRecord  # the Buffer's metadata record (``workspace.MetaRecord``)
    routing: str = "scan"
    dests: np.ndarray | None = None  # [T, K] int32 unique destination ranks per token (routing "compact")
    x_offsets: np.ndarray | None = None  # [P] uint64 workspace offset of each destination's receive region
    recv_region: np.ndarray | None = None  # this PE's receive rows (uint8; None: the workspace's x)

    @property
    def region(self) -> np.ndarray:
        """The bytes this call's rows land in here (a receive slot, or the workspace's ``x``)."""
        return self.views["x"] if self.recv_region is None else self.recv_region

    @property
    def row_bytes(self) -> int:
        return self.xb.shape[1]


def _meta(a: DispatchArgs):
    """(region name, staging name, per-token source array) of the metadata this call sends: the records (source
    index and top-k: ``pack_records``), and the scales of an int8 / float8 payload."""
    items = [("meta", "send_meta", None)]
    if a.scales is not None:
        items.append(("x_scales", "send_x_scales", a.scales))
    return items


def _row_bytes(a: DispatchArgs, region: str) -> int:
    """Bytes per row of a metadata region (``_meta``)."""
    v = a.views[region]
    return a.record.width if region == "meta" else v.itemsize * (v.size // v.shape[0])  # (v[0] would read the row)


def records(a: DispatchArgs, toks: np.ndarray) -> np.ndarray:
    """``[len(toks), width] uint8``: the metadata records (``DispatchArgs.record``) of tokens ``toks``, a local
    array; without top-k (a cached dispatch) their source index only, the top-k fields zero."""
    if a.topk_idx is None:
        return a.record.pack(toks)
    return a.record.pack(toks, a.topk_idx[toks], a.topk_weights[toks])


def pack_records(a: DispatchArgs, region: np.ndarray, at: slice | np.ndarray, toks: np.ndarray) -> None:
    """Store the records of tokens ``toks`` (``records``) into records ``at`` (a slice or row indices) of a
    ``meta`` region (flat uint8), in one assignment: a field's view of the region is strided (a column of every
    record), and under ``--check`` every strided heap view costs a walk over its rows."""
    a.record.table(region)[at] = records(a, toks)


def _stage(a: DispatchArgs, at: slice | np.ndarray, toks: np.ndarray, receive: bool = False) -> None:
    """The metadata of tokens ``toks`` (``_meta``) into rows ``at`` of the staging regions (``receive``: of the
    receive regions)."""
    for region, staging, src in _meta(a):
        dst = a.views[region if receive else staging]
        if src is None:
            pack_records(a, dst, at, toks)
        elif isinstance(at, slice):
            _gather(src, toks, dst[at])
        else:
            dst[at] = src[toks]


def _gather(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = src[rows]`` without a temporary (a fresh temporary costs page faults on every call)."""
    np.take(src, rows, axis=0, out=out, mode="clip")  # rows are valid by construction; "raise" would buffer


def _local(a: DispatchArgs, c: int, toks: np.ndarray) -> None:
    """Channel c's rows for this PE itself (no QP): straight into the outputs at the rows they take there (the
    receive row of a source's row is its workspace row), top-k experts made local as ``copy_out`` does; the hidden
    rows into the call's receive region instead where recv_x is that region (zero copy: the workspace's x; a
    receive slot, ``slots``), and everything into the workspace when the rows overflow the outputs. No block reads them back, so no block waits for another's local copy."""
    me, rb = a.me, a.row_bytes
    pos = int(a.rank_base[me] + a.channel_start[me, c])
    n = len(toks)
    v, out, landing = a.views, a.out, a.region
    if out is None:
        _gather(a.xb, toks, landing[pos * rb:(pos + n) * rb].reshape(n, rb))
        _stage(a, slice(pos, pos + n), toks, receive=True)
        return
    x = landing[pos * rb:(pos + n) * rb].reshape(n, rb) if out.x is None else out.x[pos:pos + n]
    _gather(a.xb, toks, x)
    out.src_idx[pos:pos + n] = toks
    if out.topk_idx is not None:
        raw = a.topk_idx[toks]
        local = raw - me * a.num_local_experts
        mine = (raw >= 0) & (local >= 0) & (local < a.num_local_experts)
        out.topk_idx[pos:pos + n] = np.where(mine, local, -1)
        out.topk_weights[pos:pos + n] = np.where(mine, a.topk_weights[toks], 0)
    if out.scales is not None:
        _gather(a.scales, toks, out.scales[pos:pos + n])


def _wide_tokens(a: DispatchArgs, units, timer):
    """``(toks, split)`` of ``peer_tokens`` over the channels of every batched unit in ``units`` (one route scan
    of their tokens)."""
    segs = [seg for u in units for seg in u.segments]
    lo, hi = int(a.bounds[min(s[0] for s in segs)]), int(a.bounds[max(s[1] for s in segs)])
    toks, split, reads = peer_tokens(lo, hi, a.n_pes, routing=a.routing, mask=a.is_token_in_rank, dests=a.dests)
    timer.count("route_reads", reads)
    return toks, split


def _pieces(a: DispatchArgs, units: list, toks: np.ndarray, split: np.ndarray, wide_of):
    """The pieces a round's units send, in posting order (unit after unit, a unit's segments in order): ``(unit,
    peer, first channel, first token index in ``src``, rows)`` as arrays, and ``src``, the token array they index.
    A plain unit is one piece, its channel's tokens for the peer (``toks``/``split``: this block's route scan); a
    batched lane's unit one piece per segment (channels [c0, c1)), its tokens from ``wide_of()`` (``_wide_tokens``).
    Pieces without rows (an empty closer) are left out."""
    m = len(units)
    if not any(u.segments for u in units):  # one piece per unit with rows: vectorised (128 PEs, 1 channel)
        peers = np.fromiter((u.peer for u in units), np.intp, m)
        want = np.fromiter((u.rows for u in units), np.int64, m)
        has = np.flatnonzero(want)
        ns = split[peers[has] + 1] - split[peers[has]]
        assert (ns == want[has]).all(), (units, ns)
        chans = np.fromiter((u.channel for u in units), np.intp, m)[has]
        return has, peers[has], chans, split[peers[has]], ns, toks
    wide_toks, wide_split = wide_of()
    rows = []
    for i, u in enumerate(units):
        if not u.rows:
            continue
        assert u.segments, u  # a batched round: every remote unit with rows is a batched lane's
        rows += [(i, u.peer, c0, c1, n) for c0, c1, n in u.segments]
    p_unit, p_peer, p_chan, p_end, ns = np.array(rows, np.int64).reshape(-1, 5).T
    # where each piece's tokens are in the wide token array: the peer's tokens are one ascending run there, so
    # search the (peer, token) keys of all of the pieces together
    span = int(a.bounds[-1]) + 1  # above every token and channel bound
    peer_of = np.repeat(np.arange(len(wide_split) - 1), np.diff(wide_split))
    keys = peer_of * span + wide_toks
    lo = np.searchsorted(keys, p_peer * span + a.bounds[p_chan])
    hi = np.searchsorted(keys, p_peer * span + a.bounds[p_end])
    assert (hi - lo == ns).all(), (units, hi - lo, ns)
    return p_unit, p_peer, p_chan, lo, ns, wide_toks


def _post_round(a: DispatchArgs, units: list, toks: np.ndarray, split: np.ndarray, wide_of, timer,
                t: float) -> float:
    """Post every unit of a round (none for this PE) at once: stage their metadata (and with ``aggregate`` their
    rows), build their WQEs in one numpy operation and post them with one call (``Lanes.submit_units``): per unit
    (in the order ``units`` has them) and per piece of a unit (a batched lane's unit: segment after segment,
    ``_pieces``), the hidden rows (one WQE, or one per run of consecutive tokens), then its rows' metadata records
    (one WQE) and, for an int8 / float8 payload, their scales (one WQE); the lane's completion after its closing
    unit."""
    v, lanes, rb = a.views, a.lanes, a.row_bytes
    p_unit, p_peer, p_chan, p_lo, ns, src = _pieces(a, units, toks, split, wide_of)
    total = int(ns.sum())
    k = len(ns)
    piece_of = np.repeat(np.arange(k), ns)
    within = np.arange(total) - np.repeat(np.cumsum(ns) - ns, ns)  # row index inside its piece
    sel = src[np.repeat(p_lo, ns) + within]  # the tokens, piece after piece
    pos = a.rank_base[p_peer] + a.channel_start[p_peer, p_chan]
    spos = a.send_base[p_peer] + a.channel_start[p_peer, p_chan]
    srow = np.repeat(spos, ns) + within  # their staging rows
    if a.aggregate:
        staged = v["send_x"][:v["send_x"].size // rb * rb].reshape(-1, rb)
        staged[srow] = a.xb[sel]
    _stage(a, srow, sel)
    t = timer.lap("pack", t)
    rbase = lanes.remote_base[p_peer]
    lbase = np.uint64(lanes.local_base)
    every = np.arange(k)
    u64 = np.uint64
    # each destination's receive region (the slot it named, or its x)
    x_off = np.full(k, a.region_offsets["x"], u64) if a.x_offsets is None else a.x_offsets[p_peer]
    kinds = []  # (piece of each WQE, remote VA, local VA, length) per kind, in a piece's WQE order
    if a.aggregate:
        kinds.append((every, rbase + x_off + (pos * rb).astype(u64),
                      lbase + u64(a.region_offsets["send_x"]) + (spos * rb).astype(u64), (ns * rb).astype(u64)))
    elif total:
        brk = np.ones(total, bool)  # a run of consecutive tokens ends at a gap or at the end of its piece
        brk[1:] = (np.diff(sel) != 1) | (piece_of[1:] != piece_of[:-1])
        starts = np.flatnonzero(brk)
        count = np.diff(starts, append=total)
        rp = piece_of[starts]
        xva = u64(lanes.batch.local_va(a.xb))
        kinds.append((rp, rbase[rp] + x_off[rp] + ((pos[rp] + within[starts]) * rb).astype(u64),
                      xva + (sel[starts] * rb).astype(u64), (count * rb).astype(u64)))
    for region, staging, _ in _meta(a):  # one WQE per piece and region: its rows' records (and scales)
        item = _row_bytes(a, region)
        kinds.append((every, rbase + u64(a.region_offsets[region]) + (pos * item).astype(u64),
                      lbase + u64(a.region_offsets[staging]) + (spos * item).astype(u64), (ns * item).astype(u64)))
    wp = np.concatenate([kd[0] for kd in kinds])
    order = np.argsort(wp, kind="stable")  # piece by piece (so unit by unit), each piece's WQEs in kind order
    rmt, sge, length = (np.concatenate([kd[i] for kd in kinds])[order] for i in (1, 2, 3))
    np.add.at(a.stats.peer_hidden_bytes, p_peer, ns * rb)
    t = timer.lap("build", t)
    lanes.submit_units(units, a.plan, (p_unit[wp[order]], rmt, sge, length), a.stats, close_kind=0, seq=a.seq,
                       timer=timer)
    return timer.lap("submit", t)


def _receive_all(a: DispatchArgs, sources, timer, t: float) -> float:
    """Wait for the lanes of every source in ``sources`` (this PE's own rows are local) and check their records
    (``Lanes.wait_completions``), then copy their rows out, in as few contiguous spans as they make (the credits
    come after: ``give_credits``)."""
    peers = [s for s in sources if s != a.me]
    if not peers:
        return t
    a.lanes.wait_completions(0, peers, a.seq, a.plan.lane_rows.shape[1], a.recv_hi[peers] - a.recv_lo[peers],
                             f"dispatch #{a.seq}", f"rows notify announced for call #{a.seq}")
    t = timer.lap("wait", t)
    lo, hi = a.recv_lo[peers], a.recv_hi[peers]
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    cut = np.flatnonzero(lo[1:] != hi[:-1]) + 1
    for l0, h0 in zip(np.split(lo, cut), np.split(hi, cut)):
        _copy_rows(a, int(l0[0]), int(h0[-1]))
    return timer.lap("epilogue", t)


def copy_out(a: DispatchArgs, s: int, timer: BlockTimer, t: float, credit: bool = True) -> float:
    """Source s's rows are all here: copy them out of the workspace into the outputs (top-k experts made local),
    then give s its credit (every schedule's receive side ends with this; ``credit=False``: the caller gives it
    with ``give_credit`` once every block has copied out)."""
    _copy_rows(a, int(a.recv_lo[s]), int(a.recv_hi[s]))
    t = timer.lap("epilogue", t)
    if credit:
        give_credit(a, s, timer)
    return t


def _copy_rows(a: DispatchArgs, lo: int, hi: int) -> None:
    """Rows [lo, hi) of the receive region into the outputs (``copy_out``)."""
    v, me = a.views, a.me
    out = a.out
    if out is not None and hi > lo:
        rb = a.row_bytes
        if out.x is not None:
            out.x[lo:hi] = a.region[lo * rb:hi * rb].reshape(hi - lo, rb)
        rec = a.record
        recs = np.array(rec.rows(v["meta"], lo, hi))  # one read of the records; the fields are local views
        out.src_idx[lo:hi] = rec.src_idx(recs)
        if out.topk_idx is not None:
            raw = rec.topk_idx(recs)
            local = raw - me * a.num_local_experts
            mine = (raw >= 0) & (local >= 0) & (local < a.num_local_experts)
            out.topk_idx[lo:hi] = np.where(mine, local, -1)
            out.topk_weights[lo:hi] = np.where(mine, rec.topk_weights(recs), 0)
        if out.scales is not None:
            out.scales[lo:hi] = v["x_scales"][lo:hi]


def give_credit(a: DispatchArgs, s: int, timer: BlockTimer) -> None:
    """Give source s its credit: its next dispatch may write this PE's receive region again. A kernel whose
    blocks copy out different sources gives the credits only once every block has copied out (``sync_all``, then
    this): the region is shared, and where a source's rows land depends on the call (the counts of the lower
    ranks, the row size), so s's next rows may land where another block is still copying another source's rows."""
    if s != a.me and (a.out is None or a.out.credit):
        shmemx.aclshmemx_signal_op(a.views["credits"][0, a.me, 0:1], a.seq, SET, a.lanes.peers.pe(s))
        timer.count("credit_writes")


def give_credits(a: DispatchArgs, sources: Iterable[int], timer: BlockTimer) -> None:
    """``give_credit`` of every source in ``sources`` (but this PE) in one ``aclshmemx_signal_op_many``."""
    if a.out is not None and not a.out.credit:
        return
    ranks = [s for s in sources if s != a.me]
    shmemx.aclshmemx_signal_op_many(a.views["credits"][0, a.me, 0:1], a.seq, SET, a.lanes.peers.pes[ranks])
    timer.count("credit_writes", len(ranks))


def dispatch_kernel(a: DispatchArgs) -> None:
    """The body of every block (``shmemx.launch(dispatch_kernel, C, args)``): a block's share of the sending
    rounds, then of the receiving and the credits. Where block 0 does every block's work (``Lanes.one_block``)
    the others return at once; where it posts and receives for every block (``Lanes.one_poster``) the others
    copy only their own rows."""
    role = a.lanes.block_role(a.plan, a.stats)
    if role is None:
        return
    c, solo, one, timer, t = role
    rounds = [a.lanes.round_units(a.plan, c, k, one) for k in range(a.plan.rounds)]
    scan = _Scan(a, 0 if solo else c, len(a.bounds) - 1 if solo else c + 1, [u for r in rounds for u in r], timer)
    t = timer.lap("route", t)
    for k, units in enumerate(rounds):
        t = _send_round(a, c, k, units, scan, solo, timer, t)
    if one:
        _receive_for_all(a, c, solo, timer, t)
        return
    sources = range(c, a.n_pes, len(a.bounds) - 1)
    t = _receive_all(a, sources, timer, t)
    shmemx.sync_all()  # every block's copy-out is done before any source gets its credit (``give_credit``)
    timer.count("syncs")
    timer.lap("sync", t)
    give_credits(a, sources, timer)


class _Scan:
    """A block's route scan of channels [c0, c1): its tokens for each peer (``toks[split[p]:split[p + 1]]``),
    and, scanned once when a batched lane needs them, the tokens of every channel its units carry (``wide``)."""

    def __init__(self, a: DispatchArgs, c0: int, c1: int, units: list, timer):
        self.a, self.units, self.timer = a, units, timer  # units: every unit the block posts, all rounds
        self.toks, self.split, reads = peer_tokens(int(a.bounds[c0]), int(a.bounds[c1]), a.n_pes,
                                                   routing=a.routing, mask=a.is_token_in_rank, dests=a.dests)
        timer.count("route_reads", reads)
        self._wide = (self.toks, self.split) if (c0, c1) == (0, len(a.bounds) - 1) else None

    def of(self, peer: int) -> np.ndarray:
        return self.toks[self.split[peer]:self.split[peer + 1]]

    def wide(self):
        if self._wide is None:
            self._wide = _wide_tokens(self.a, self.units, self.timer)
        return self._wide


def _send_round(a: DispatchArgs, c: int, k: int, units: list, scan: _Scan, solo: bool, timer, t: float) -> float:
    """Round k (``units``) of block c: this PE's own rows straight into the outputs (every channel's with
    ``solo``), every remote unit in one post (``_post_round``), then the round's quiets (``Lanes.end_round``)."""
    remote = [u for u in units if u.peer != a.me]
    if solo:  # every channel's rows for this PE (they are consecutive there too)
        _local(a, 0, scan.of(a.me))
        t = timer.lap("pack", t)
    for u in units:
        if u.peer == a.me and not solo:
            _local(a, c, scan.of(a.me) if u.rows else scan.toks[:0])
            t = timer.lap("pack", t)
    if remote:
        t = _post_round(a, remote, scan.toks, scan.split, scan.wide, timer, t)
    a.stats.round_dsts[k, [u.peer for u in remote]] = True
    return a.lanes.end_round([(u.peer, u.qp) for u in remote], timer, t, last=k == a.plan.rounds - 1)


def _receive_for_all(a: DispatchArgs, c: int, solo: bool, timer, t: float) -> None:
    """``Lanes.one_poster``: block 0 receives every source and gives the credits once it has copied them all
    out."""
    if c == 0:
        t = _receive_all(a, range(a.n_pes), timer, t)
    if a.out is None and not solo:  # the blocks' own rows went into the workspace (an overflow): all of them
        # are in before a source may write the region again (a cached call with another row size puts rows
        # elsewhere)
        shmemx.sync_all()
        timer.count("syncs")
        t = timer.lap("sync", t)
    if c == 0:  # otherwise the others wrote only the outputs: no block waits for another
        give_credits(a, range(a.n_pes), timer)

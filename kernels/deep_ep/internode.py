"""Internode normal mode: DeepEP's two-tier dispatch and combine for a job of N servers of S ranks.

A token of rank (a, l) that goes to ranks of server b travels once per server: over RDMA (UDMA WQEs) to the
*forwarder* (b, l), the rank of the same lane there, which copies it over NVLink (MTE puts) to every rank of
server b that needs it. Combine goes back: each rank returns its rows to their forwarders (MTE), each forwarder
sums the rows of a token over its server (float32, rounded to bfloat16, as DeepEP's forwarder does) and returns
one row per (token, server) over RDMA; the source adds the biases and the servers' partial sums in float32 and
rounds once more. So a combined token is ``bf16(bias_0 + bias_1 + sum_b bf16(sum_{k in b} x_k))``, DeepEP's
numerics (``reference.reference_internode_combine``).

A fresh dispatch runs seed 003's ``notify_dispatch`` (``notify``); a cached one ``cached_notify``. Then, on every
rank at once (each is a sender, a forwarder and a receiver; a stage only waits for earlier stages of others):

1. **sender**: per destination server b, its rows (token order: channel after channel) packed into
   ``rdma_send[b]`` (x, scales, SourceMeta = (a, bit mask of b's ranks), top-k global experts and weights; a
   float8 dispatch's rows at their packed stride, ``RowLayout.packed``), then in chunks of ``RDMA_CHUNK`` rows,
   chunk k on lane ((b, l), k % Q): one put + signal (SO) of the chunk into (b, l)'s ``rdma_recv[a]``, the
   signal ``rdma_signal[a, q]`` = the lane's chunks so far (``_tail``); the channel prefix (an RO WRITE into
   ``rdma_meta[a]``) just before the last chunk, on its lane. Own server: the rows packed in place. The lanes
   are quieted at the end of the call, not before the forwarder runs (DeepEP's senders do not wait either);
2. **forwarder**: per source server b in the order their rows arrive (own, a - 1, a - 2, ...), chunk by chunk
   as each lands: MTE-put to each rank (a, j) of this server (from the own lane on) the chunk's rows whose mask
   has bit j into its ``nvl_recv[b * S + l]``; then per source the heads and each rank's channel prefix, an MTE
   quiet, the credits, and SET (a, j)'s ``nvl_signal[l]``. The MTE puts are non-blocking (a replay overlaps
   them with the RDMA chunks still landing);
3. **receiver**: wait for the S forwarders, copy the rows out in global source order (``recv_gbl_rank_prefix_sum``).

Every flag a rank waits on is written by a put + signal, a signal_op or an MTE put (none by a plain store), so
that a recording sees it.

Buffer reuse: a region a peer writes is written again only after its reader SET the writer's credit word for it
(four kinds: dispatch RDMA / NVL, combine NVL / RDMA), as in ``moe.Buffer``.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import ml_dtypes
import numpy as np

import shmemx
from shmemx.kernels.moe.lanes import Lanes
from shmemx.kernels.moe.peers import Peers
from shmemx.kernels.moe.routing import channel_bounds, channel_counts
from shmemx.kernels.moe.workspace import WorkspaceLayout

from .handles import InternodeHandle
from .intranode import fit_tokens
from .notify import Tiers, cached_notify, notify_dispatch

__all__ = ["Internode", "RowLayout", "plan_internode"]

bf16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
GE = shmemx.ACLSHMEM_CMP_GE
SET = shmemx.ACLSHMEM_SIGNAL_SET
RDMA_DISPATCH, NVL_DISPATCH, NVL_COMBINE, RDMA_COMBINE = range(4)
SLOT = 4  # uint64 words per (source, qp) signal slot: the signal, a pad, the record (rows, sequence number)
_CHUNK = 256  # rows per step of the forwarder's reduction
RDMA_CHUNK = 16  # rows per RDMA chunk of a dispatch (DeepEP's num_max_rdma_chunked_send_tokens: 8..20 per channel)
RO = shmemx.OpConfig(cqe=1, odr=shmemx.ACLSHMEMX_UDMA_ODR_RO).flag  # a WRITE (the channel prefix)
SO = shmemx.OpConfig(cqe=1, odr=shmemx.ACLSHMEMX_UDMA_ODR_SO).flag  # a chunk's put + signal, after earlier WQEs


def _tail(seq: int, chunks: int) -> int:
    """A dispatch lane's signal after ``chunks`` chunks of call ``seq`` landed (monotone over calls)."""
    return seq << 20 | chunks


class LaneWrites(NamedTuple):
    """The WRITEs of one RDMA lane: ``rmt`` offsets from the peer's ``base``, ``sge`` offsets from this rank's
    ``local`` base, ``length`` bytes each (empty lists: none)."""

    base: np.uint64
    local: np.uint64
    rmt: list[int]
    sge: list[int]
    length: list[int]


class LaneRecord(NamedTuple):
    """What closes an RDMA lane after its WRITEs: this rank's ``records[dst_slot, q]`` = (rows, seq) put into the
    peer's ``signal[src_slot, q]`` slot, whose signal becomes ``seq``."""

    signal: str
    records: str
    src_slot: int
    dst_slot: int
    rows: int
    seq: int


class RowLayout:
    """One dispatched token as bytes: ``x`` (``x_bytes``: 2H for bfloat16, the default and the workspace's slot
    size, H for float8), ``scales [H/128] float32``, ``meta`` (SourceMeta: int32 source server, int32 rank mask),
    ``topk_idx [K] int64``, ``topk_weights [K] float32``; 16-byte aligned. A combined row: ``x`` (2H) then
    ``topk_weights [K] float32``."""

    def __init__(self, hidden: int, num_topk: int, x_bytes: int | None = None):
        self.hidden, self.num_topk = hidden, num_topk
        self.x_bytes = 2 * hidden if x_bytes is None else x_bytes
        self.scales = self.x_bytes
        self.meta = self.scales + 4 * (-(-hidden // 128))
        self.idx = self.meta + 8
        self.weights = self.idx + 8 * num_topk
        self.bytes = -(-(self.weights + 4 * num_topk) // 16) * 16
        self.combine_bytes = -(-(2 * hidden + 4 * num_topk) // 16) * 16

    def packed(self, x_bytes: int) -> "RowLayout":
        """The rows of one dispatch whose ``x`` has ``x_bytes`` per row: a float8 dispatch's rows are packed at
        their own (smaller) stride in the same regions, so that a WRITE or copy carries only the bytes used."""
        return self if x_bytes == self.x_bytes else RowLayout(self.hidden, self.num_topk, x_bytes)


def plan_internode(*, n_pes: int, server_size: int, max_tokens: int, hidden: int, num_topk: int,
                   num_experts: int, num_channels: int, rdma_qps: int) -> tuple[WorkspaceLayout, int, int]:
    """The internode workspace and the bytes of its RDMA and NVL parts (checked against ``num_rdma_bytes`` and
    ``num_nvl_bytes``). M = max_tokens rows per source; F = N * M rows a forwarder may hold."""
    s, n = server_size, n_pes // server_size
    rows = RowLayout(hidden, num_topk)
    width = -(-(s + num_experts // n + 1) // 16) * 16
    ws = WorkspaceLayout()
    rdma = [("rdma_notify", (n, width), np.int32), ("rdma_send_notify", (n, width), np.int32),
            ("sync", (n, 4), np.uint64), ("sync_payload", (n, 2), np.int64),
            ("rdma_meta", (n, num_channels), np.int32), ("rdma_signal", (n, rdma_qps, SLOT), np.uint64),
            ("rdma_combine_signal", (n, rdma_qps, SLOT), np.uint64), ("rdma_records", (n, rdma_qps, 2), np.int64),
            ("rdma_send_meta", (n, num_channels), np.int32),
            ("rdma_recv", (n, max_tokens, rows.bytes), np.uint8), ("rdma_send", (n, max_tokens, rows.bytes), np.uint8),
            ("rdma_combine_recv", (n, max_tokens, rows.combine_bytes), np.uint8),
            ("rdma_combine_send", (n, max_tokens, rows.combine_bytes), np.uint8)]
    nvl = [("barrier", (s,), np.int32), ("credits", (4, n_pes), np.int64),
           ("nvl_notify_rank", (s, n), np.int32), ("nvl_notify_expert", (s, num_experts // n_pes), np.int32),
           ("nvl_meta", (n_pes, num_channels), np.int32), ("nvl_signal", (s, 8), np.uint64),
           ("nvl_combine_signal", (s, 8), np.uint64),
           ("nvl_recv", (n_pes, max_tokens, rows.bytes), np.uint8),
           ("nvl_combine_x", (s, n, max_tokens, 2 * hidden), np.uint8),
           ("nvl_combine_w", (s, n, max_tokens, num_topk), np.float32)]
    sizes = []
    for group in (rdma, nvl):
        start = ws.total
        for name, shape, dtype in group:
            ws.append(name, shape, dtype)
        sizes.append(ws.total - start)
    return ws, sizes[0], sizes[1]


def _head(mask: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """``[T, D] int32``: the row's index among the rows of its channel (``bounds``) with the same column set, -1
    where the column is not set."""
    out = np.full(mask.shape, -1, np.int32)
    for c in range(len(bounds) - 1):
        lo, hi = int(bounds[c]), int(bounds[c + 1])
        part = mask[lo:hi]
        out[lo:hi] = np.where(part, np.cumsum(part, axis=0) - 1, -1)
    return out


def _inclusive(counts: np.ndarray) -> np.ndarray:
    return np.cumsum(counts, axis=1).astype(np.int32)


class Internode:
    """The normal-mode engine of a ``deep_ep.Buffer`` whose job spans servers.

    Args:
        me, n_pes, server_size: this rank, P, S.
        nvl_budget, rdma_budget: ``num_nvl_bytes`` / ``num_rdma_bytes``.
        num_channels: channels of the kernels (None: 4).
    """

    def __init__(self, me: int, n_pes: int, server_size: int, nvl_budget: int, rdma_budget: int,
                 num_channels: int | None = None):
        self.me, self.n_pes, self.server_size = me, n_pes, server_size
        self.servers = n_pes // server_size
        self.server, self.lane = divmod(me, server_size)
        self.budgets = (rdma_budget, nvl_budget)
        self.num_channels = num_channels or 4
        self.rdma_qps = max(1, min(shmemx.qp_num(), self.num_channels, 8))
        self.block = None
        self.key: tuple | None = None
        self.tiers: Tiers | None = None
        self._seq = 0
        self._last = [0, 0]  # the last dispatch / combine
        self.last_times: dict = {}

    # --- the workspace -----------------------------------------------------------------------------------------

    def _plan(self, tokens: int, hidden: int, num_topk: int, num_experts: int):
        return plan_internode(n_pes=self.n_pes, server_size=self.server_size, max_tokens=tokens, hidden=hidden,
                              num_topk=num_topk, num_experts=num_experts, num_channels=self.num_channels,
                              rdma_qps=self.rdma_qps)

    def _ensure(self, hidden: int, num_topk: int | None, num_experts: int | None, num_tokens: int) -> None:
        if self.key is not None:
            num_topk = self.key[1] if num_topk is None else num_topk
            num_experts = self.key[2] if num_experts is None else num_experts
            if (hidden, num_topk, num_experts) == self.key and num_tokens <= self.max_tokens:
                return
        if num_experts is None:
            raise ValueError(f"pe {self.me}: deep_ep: a cached dispatch or a combine needs a fresh dispatch first")
        key = (hidden, num_topk or 1, num_experts)
        if num_experts % self.n_pes:
            raise ValueError(f"pe {self.me}: num_experts {num_experts} is not a multiple of {self.n_pes} ranks")
        fits = [fit_tokens(budget, lambda m, i=i: self._plan(m, *key)[1 + i]) for i, budget in enumerate(self.budgets)]
        tokens = min(fits)
        if tokens < num_tokens:
            need = self._plan(num_tokens, *key)
            raise ValueError(f"pe {self.me}: deep_ep.Buffer (internode, {self.n_pes // self.server_size} servers of "
                             f"{self.server_size}): {num_tokens} tokens of hidden {hidden} (top-{key[1]}) need "
                             f"num_rdma_bytes >= {need[1]} and num_nvl_bytes >= {need[2]}; the Buffer has "
                             f"{self.budgets[0]} and {self.budgets[1]} (room for {tokens} tokens)")
        self.close()
        layout = self._plan(tokens, *key)[0]
        self.block = shmemx.aclshmem_malloc(layout.total, name="deep_ep.internode", prefault=False)
        self.views = layout.views(self.block)
        self.offsets = {name: r.offset for name, r in layout.regions.items()}
        for name in ("sync", "rdma_signal", "rdma_combine_signal", "barrier", "credits", "nvl_signal",
                     "nvl_combine_signal"):
            self.views[name][...] = 0
        self.lanes = Lanes(self.block, Peers.of(), self.rdma_qps)
        self.tiers = Tiers(self.me, self.n_pes, self.server_size, self.views, self.rdma_qps)
        self.rows = RowLayout(hidden, key[1])
        self.packed = self.rows  # this dispatch's rows (float8: packed, ``RowLayout.packed``)
        self.key, self.max_tokens = key, tokens
        self._seq, self._last = 0, [0, 0]
        shmemx.aclshmem_barrier_all()  # every rank zeroed its words before anyone signals

    def close(self) -> None:
        if self.block is not None:
            shmemx.aclshmem_free(self.block)
            self.block, self.key, self.tiers = None, None, None

    # --- credits -----------------------------------------------------------------------------------------------

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _wait_credit(self, kind: int, readers: list[int], last: int) -> None:
        """Before writing regions of ``kind`` on ``readers``: each consumed what the call ``last`` wrote."""
        readers = [r for r in readers if r != self.me]
        if last and readers:
            status = np.ones(self.n_pes, np.int32)
            status[readers] = 0
            shmemx.aclshmem_wait_until_all(self.views["credits"][kind], GE, last, status=status)

    def _give_credit(self, kind: int, writers: list[int], seq: int) -> None:
        word = self.views["credits"][kind, self.me:self.me + 1]
        for w in writers:
            if w != self.me:
                shmemx.aclshmemx_signal_op(word, seq, SET, w)

    # --- dispatch ----------------------------------------------------------------------------------------------

    def dispatch(self, x: np.ndarray | tuple[np.ndarray, np.ndarray], handle: InternodeHandle | None,
                 num_tokens_per_rank: np.ndarray | None, num_tokens_per_rdma_rank: np.ndarray | None,
                 is_token_in_rank: np.ndarray | None, num_tokens_per_expert: np.ndarray | None,
                 topk_idx: np.ndarray | None, topk_weights: np.ndarray | None, expert_alignment: int,
                 num_worst_tokens: int) -> tuple:
        """DeepEP's internode dispatch on numpy inputs; returns (recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, InternodeHandle)."""
        data, scales = (x[0], x[1]) if isinstance(x, tuple) else (x, None)
        data = np.ascontiguousarray(data)
        n_tok = data.shape[0]
        in_rank = self._routing(data.shape, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                topk_idx, topk_weights)
        cached = handle is not None
        in_server = in_rank.reshape(n_tok, self.servers, self.server_size).any(2)
        bounds = channel_bounds(n_tok, self.num_channels)
        t0 = time.perf_counter()
        if cached:
            cached_notify(self.tiers)
            rdma_prefix = np.asarray(handle.recv_rdma_rank_prefix_sum, np.int64)
            gbl_prefix = np.asarray(handle.recv_gbl_rank_prefix_sum, np.int64)
            expert_list = None
        else:
            per_server = num_tokens_per_rdma_rank if num_tokens_per_rdma_rank is not None else in_server.sum(0)
            note = notify_dispatch(self.tiers, num_tokens_per_rank=num_tokens_per_rank,
                                   num_tokens_per_rdma_rank=per_server, num_tokens_per_expert=num_tokens_per_expert,
                                   expert_alignment=expert_alignment)
            rdma_prefix = note.recv_rdma_rank_prefix_sum.astype(np.int64)
            gbl_prefix = note.recv_gbl_rank_prefix_sum.astype(np.int64)
            expert_list = note.num_recv_tokens_per_expert_list
        self.last_times["notify"] = time.perf_counter() - t0
        num_recv = int(gbl_prefix[-1])
        overflow = bool(num_worst_tokens) and num_recv > num_worst_tokens
        seq = self._next()
        self.packed = self.rows.packed(data.dtype.itemsize * data.shape[1])
        with_topk = (not cached) and topk_idx is not None
        rdma_matrix = _inclusive(channel_counts(in_server, self.num_channels))  # [N, C]
        self._send_rdma(seq, data, scales, in_rank, in_server, bounds, rdma_matrix,
                        topk_idx if with_topk else None, topk_weights if with_topk else None)
        forwarded, recv_rdma_matrix = self._forward(seq, rdma_prefix, bool(scales is not None), with_topk)
        rows = max(num_worst_tokens, num_recv) if not overflow else num_recv
        out = self._receive(seq, gbl_prefix, rows, data.dtype, scales is not None, with_topk)
        self._quiet_lanes()
        self._last[0] = seq
        self.last_times["dispatch"] = time.perf_counter() - t0
        if overflow:
            raise ValueError(f"pe {self.me}: dispatch: {num_recv} tokens arrived, more than num_worst_tokens="
                             f"{num_worst_tokens}; nothing was returned (no silent truncation)")
        recv_x = (out["x"], out["scales"]) if scales is not None else out["x"]
        if cached:
            return recv_x, None, None, None, None
        if num_worst_tokens:
            expert_list = []
        new = InternodeHandle(
            in_rank, rdma_matrix, _inclusive(channel_counts(in_rank, self.num_channels)), recv_rdma_matrix,
            rdma_prefix.astype(np.int32), out["gbl_channel"], gbl_prefix.astype(np.int32),
            out["src_meta"], _head(in_server, bounds), forwarded)
        return recv_x, out.get("topk_idx"), out.get("topk_weights"), expert_list, new

    def _routing(self, shape, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights) -> np.ndarray:
        """Check a dispatch's routing arguments, make the workspace fit, return ``is_token_in_rank [T, P]``."""
        n_tok, hidden = shape
        if handle is not None:
            self._ensure(hidden, None, None, n_tok)
            in_rank = np.asarray(handle.is_token_in_rank, bool)
        else:
            if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
                raise ValueError(f"pe {self.me}: dispatch: give num_tokens_per_rank, is_token_in_rank and "
                                 f"num_tokens_per_expert (get_dispatch_layout)")
            if (topk_idx is None) != (topk_weights is None):
                raise ValueError(f"pe {self.me}: dispatch: give topk_idx and topk_weights together, or neither")
            self._ensure(hidden, None if topk_idx is None else topk_idx.shape[1], len(num_tokens_per_expert), n_tok)
            in_rank = np.asarray(is_token_in_rank, bool)
        if in_rank.shape != (n_tok, self.n_pes):
            raise ValueError(f"pe {self.me}: dispatch: is_token_in_rank must be [{n_tok}, {self.n_pes}], got "
                             f"{in_rank.shape}")
        return in_rank

    def _slots(self, name: str, i: int) -> np.ndarray:
        """``name[i]`` (a source's ``[max_tokens, slot bytes]`` rows) as ``[max_tokens, packed row bytes]`` for
        this dispatch's rows (``self.packed``)."""
        stride = self.packed.bytes
        return self.views[name][i].reshape(-1)[:self.max_tokens * stride].reshape(self.max_tokens, stride)

    def _pack(self, dst: np.ndarray, toks: np.ndarray, data, scales, mask_bits, topk_idx, topk_weights) -> None:
        """Rows for ``toks`` into ``dst [len(toks), row bytes]``."""
        r = self.packed
        xb = data.view(np.uint8).reshape(len(data), -1)
        np.take(xb, toks, axis=0, out=dst[:, :xb.shape[1]])
        if scales is not None:
            dst[:, r.scales:r.meta] = np.ascontiguousarray(scales, np.float32)[toks].view(np.uint8)
        meta = np.empty((len(toks), 2), np.int32)
        meta[:, 0] = self.me // self.server_size
        meta[:, 1] = mask_bits[toks]
        dst[:, r.meta:r.idx] = meta.view(np.uint8)
        if topk_idx is not None:
            dst[:, r.idx:r.weights] = np.ascontiguousarray(topk_idx, np.int64)[toks].view(np.uint8)
            dst[:, r.weights:r.weights + 4 * r.num_topk] = np.ascontiguousarray(topk_weights, np.float32)[toks] \
                .view(np.uint8)

    def _send_rdma(self, seq: int, data, scales, in_rank, in_server, bounds, rdma_matrix, topk_idx,
                   topk_weights) -> None:
        """Stage 1: each server's rows to its same-lane forwarder (UDMA), the own server's by local copies."""
        s, n, a, lane = self.server_size, self.servers, self.server, self.lane
        v, rb, lanes = self.views, self.packed.bytes, self.lanes
        slot = self.max_tokens * self.rows.bytes  # a source's region; its rows at the packed stride rb
        weights = (1 << np.arange(s, dtype=np.int64))
        peers = [((a + i) % n) * s + lane for i in range(n)]
        self._wait_credit(RDMA_DISPATCH, peers, self._last[0])
        for peer in peers:
            b = peer // s
            toks = np.flatnonzero(in_server[:, b])
            mask_bits = (in_rank[:, b * s:(b + 1) * s] * weights).sum(1).astype(np.int32)
            staging = self._slots("rdma_recv", a) if b == a else self._slots("rdma_send", b)
            self._pack(staging[:len(toks)], toks, data, scales, mask_bits, topk_idx, topk_weights)
            if b == a:  # the own server's rows are in place (this thread forwards them: no signal needed)
                v["rdma_meta"][a] = rdma_matrix[a]
                continue
            v["rdma_send_meta"][b] = rdma_matrix[b]
            base = int(lanes.remote_base[peer])
            local = int(lanes.local_base)
            rows, q_num = len(toks), self.rdma_qps
            chunks = -(-rows // RDMA_CHUNK)
            for k in range(chunks):  # chunk k on lane k % Q: one put + signal (the lane's chunks so far)
                q, lo, hi = k % q_num, k * RDMA_CHUNK, min(rows, (k + 1) * RDMA_CHUNK)
                extra = ([], [], [])
                if k == chunks - 1:  # the channel prefix just before the last chunk, on its lane
                    extra = ([base + self.offsets["rdma_meta"] + a * self.num_channels * 4],
                             [local + self.offsets["rdma_send_meta"] + b * self.num_channels * 4],
                             [self.num_channels * 4])
                sig = base + self.offsets["rdma_signal"] + (a * q_num + q) * SLOT * 8
                lanes.post(peer, q, *(np.array(e, np.uint64) for e in extra),
                           close=(base + self.offsets["rdma_recv"] + a * slot + lo * rb,
                                  local + self.offsets["rdma_send"] + b * slot + lo * rb, (hi - lo) * rb, sig,
                                  _tail(seq, k // q_num + 1)), flag=RO, close_flag=SO)

    def _quiet_lanes(self) -> None:
        """Retire the RDMA lanes of this call (at its end: the sender does not wait for its acknowledgements
        before it forwards and receives, as DeepEP's sender warps do not)."""
        n, a, s = self.servers, self.server, self.server_size
        for i in range(1, n):
            for q in range(self.rdma_qps):
                self.lanes.quiet(((a + i) % n) * s + self.lane, q)

    def _post(self, peer: int, q: int, writes: LaneWrites, record: LaneRecord) -> None:
        """The WRITEs of one RDMA lane, then its record (rows, seq) and signal ``signal[src_slot, q]`` = seq on
        the peer after them (RO WRITEs, an SO put + signal: no fence, no acknowledgement round trip): one
        doorbell."""
        rec = self.views[record.records][record.dst_slot, q]
        rec[:] = (record.rows, record.seq)
        slot = self.offsets[record.signal] + (record.src_slot * self.rdma_qps + q) * SLOT * 8
        src = self.offsets[record.records] + (record.dst_slot * self.rdma_qps + q) * 16
        base, local = writes.base, writes.local
        self.lanes.post(peer, q, base + np.array(writes.rmt, np.uint64), local + np.array(writes.sge, np.uint64),
                        np.array(writes.length, np.uint64),
                        close=(int(base) + slot + 16, int(local) + src, 16, int(base) + slot, record.seq), flag=RO,
                        close_flag=SO)

    def _signal_self(self, signal: str, slot: int, seq: int) -> None:
        """``signal[slot, q]`` = seq on this rank for every lane q (signal_op, not a store: every flag a rank
        waits on is written by a call a recording sees)."""
        for q in range(self.rdma_qps):
            shmemx.aclshmemx_signal_op(self.views[signal][slot, q, 0:1], seq, SET, self.me)

    def _wait_lanes(self, signal: str, b: int, seq: int, rows: int, what: str) -> None:
        """Wait for source server b's RDMA lanes and check that their records add up to ``rows``."""
        slots = self.views[signal][b]  # [Q, SLOT]
        shmemx.aclshmem_wait_until_all(slots[:, 0], GE, seq)
        if b == self.me // self.server_size:
            return
        rec = slots[:, 2:4].view(np.int64)
        if int(rec[:, 0].sum()) != rows or (rec[:, 1] != seq).any():
            raise RuntimeError(f"pe {self.me}: {what} #{seq}: the records from server {b} (rows per qp "
                               f"{rec[:, 0].tolist()}, seq {rec[:, 1].tolist()}) do not match the {rows} rows "
                               f"announced")

    def _forward(self, seq: int, rdma_prefix: np.ndarray, with_scales: bool, with_topk: bool):
        """Stage 2: the rows each source server sent this forwarder, to the ranks of this server (MTE).

        Returns ``(send_nvl_head [F, S], recv_rdma_channel_prefix_matrix [N, C])``."""
        s, n, a, lane = self.server_size, self.servers, self.server, self.lane
        v, r = self.views, self.packed
        counts = np.diff(rdma_prefix, prepend=0)
        nvl = [a * s + j for j in range(s)]
        self._wait_credit(NVL_DISPATCH, nvl, self._last[0])
        heads = np.full((int(rdma_prefix[-1]), s), -1, np.int32)
        matrix = np.zeros((n, self.num_channels), np.int32)
        order = [(a - i) % n for i in range(n)]  # own, then (a - 1) (whose sender serves this server first), ...
        got = {b: self._slots("rdma_recv", b)[:int(counts[b])] for b in order}
        masks = {b: np.zeros((int(counts[b]), s), bool) for b in order}
        filled = np.zeros((n, s), np.int64)  # rows forwarded so far from source server b to rank j
        chunks = {b: -(-int(counts[b]) // RDMA_CHUNK) for b in order}
        for b in order:  # chunk by chunk as they land: a source's lanes in turn, the sources one after the other
            for k in range(chunks[b]):
                lo, hi = k * RDMA_CHUNK, min(int(counts[b]), (k + 1) * RDMA_CHUNK)
                if b != a:
                    q = k % self.rdma_qps
                    shmemx.aclshmem_wait_until(v["rdma_signal"][b, q, 0:1], GE, _tail(seq, k // self.rdma_qps + 1))
                rows = got[b][lo:hi]
                bits = rows[:, r.meta + 4:r.meta + 8].copy().view(np.int32)[:, 0]
                mask = masks[b][lo:hi]
                mask[...] = (bits[:, None] >> np.arange(s)) & 1
                for step in range(s):  # from the own lane on: the forwarders of a server feed distinct ranks
                    j = (lane + step) % s
                    pick = np.flatnonzero(mask[:, j])
                    if not len(pick):
                        continue
                    dst = self._slots("nvl_recv", b * s + lane)[filled[b, j]:filled[b, j] + len(pick)]
                    filled[b, j] += len(pick)
                    if nvl[j] == self.me:
                        np.take(rows, pick, axis=0, out=dst)
                    else:
                        part = rows[pick]
                        shmemx.aclshmemx_mte_put_nbi(dst, part, part.size, nvl[j])
        for b in order:  # every chunk of b is in: its channel prefix (landed before its last chunk), heads
            rows = int(counts[b])
            if rows:
                matrix[b] = v["rdma_meta"][b]
            bounds = np.concatenate([[0], matrix[b]]).astype(np.int64)
            lo = int(rdma_prefix[b] - rows)
            heads[lo:lo + rows] = _head(masks[b], bounds)
            src_rank = b * s + lane
            for j, peer in enumerate(nvl):
                pick = np.flatnonzero(masks[b][:, j])
                chan = _inclusive(np.stack([np.diff(np.searchsorted(pick, bounds))]))[0]
                if peer == self.me:
                    v["nvl_meta"][src_rank] = chan
                else:
                    shmemx.aclshmemx_mte_put_nbi(v["nvl_meta"][src_rank], chan, self.num_channels, peer)
        shmemx.aclshmemx_mte_quiet()  # the rows are out of rdma_recv and at their ranks: credit, then signal
        self._give_credit(RDMA_DISPATCH, [((a + i) % n) * s + lane for i in range(1, n)], seq)
        for j, peer in enumerate(nvl):
            shmemx.aclshmemx_signal_op(v["nvl_signal"][lane:lane + 1, 0], seq, SET, peer)
        return heads, matrix

    def _receive(self, seq: int, gbl_prefix: np.ndarray, rows: int, dtype, with_scales: bool, with_topk: bool):
        """Stage 3: wait for this server's forwarders, then the rows in global source order."""
        s, me, r = self.server_size, self.me, self.packed
        v = self.views
        shmemx.aclshmem_wait_until_all(v["nvl_signal"][:, 0], GE, seq)
        hidden, local = self.key[0], self.key[2] // self.n_pes
        num_recv = int(gbl_prefix[-1])
        xb = hidden * np.dtype(dtype).itemsize
        out = {"x": np.zeros((rows, hidden), dtype), "src_meta": np.zeros((num_recv, 8), np.uint8),
               "gbl_channel": np.zeros((self.n_pes, self.num_channels), np.int32)}
        if with_scales:
            out["scales"] = np.zeros((rows, r.meta - r.scales), np.uint8).view(np.float32)
        if with_topk:
            out["topk_idx"] = np.full((rows, r.num_topk), -1, np.int64)
            out["topk_weights"] = np.zeros((rows, r.num_topk), np.float32)
        counts = np.diff(gbl_prefix, prepend=0)
        for i in range(self.n_pes):
            lo, n_i = int(gbl_prefix[i] - counts[i]), int(counts[i])
            chan = v["nvl_meta"][i]
            out["gbl_channel"][i] = lo + np.concatenate([[0], chan[:-1]])
            if not n_i:
                continue
            got = self._slots("nvl_recv", i)[:n_i]
            out["x"][lo:lo + n_i].view(np.uint8).reshape(n_i, xb)[...] = got[:, :xb]
            out["src_meta"][lo:lo + n_i] = got[:, r.meta:r.idx]
            if with_scales:
                out["scales"][lo:lo + n_i] = got[:, r.scales:r.meta].copy().view(np.float32)
            if with_topk:
                experts = got[:, r.idx:r.weights].copy().view(np.int64)
                weights = got[:, r.weights:r.weights + 4 * r.num_topk].copy().view(np.float32)
                mine = (experts >= me * local) & (experts < (me + 1) * local)
                out["topk_idx"][lo:lo + n_i] = np.where(mine, experts - me * local, -1)
                out["topk_weights"][lo:lo + n_i] = np.where(mine, weights, 0)
        self._give_credit(NVL_DISPATCH, [(me // s) * s + j for j in range(s)], seq)
        return out

    # --- combine -----------------------------------------------------------------------------------------------

    def combine(self, x: np.ndarray, handle: InternodeHandle, topk_weights: np.ndarray | None,
                bias: np.ndarray | tuple | None) -> tuple[np.ndarray, np.ndarray | None]:
        """DeepEP's internode combine; returns (combined_x [T, H] bfloat16, combined_topk_weights or None)."""
        hidden = x.shape[1]
        n_tok = handle.is_token_in_rank.shape[0]
        num_topk = None if topk_weights is None else topk_weights.shape[1]
        self._ensure(hidden, num_topk, None, n_tok)
        if x.dtype != np.dtype(bf16):
            raise ValueError(f"pe {self.me}: combine: x must be bfloat16, got {x.dtype}")
        if topk_weights is not None and topk_weights.shape[1] != self.rows.num_topk:
            self._ensure(hidden, topk_weights.shape[1], None, n_tok)
        gbl_prefix = np.asarray(handle.recv_gbl_rank_prefix_sum, np.int64)
        if x.shape[0] < int(gbl_prefix[-1]):
            raise ValueError(f"pe {self.me}: combine: x has {x.shape[0]} rows, the dispatch received "
                             f"{int(gbl_prefix[-1])}")
        t0 = time.perf_counter()
        cached_notify(self.tiers)
        self.last_times["notify"] = time.perf_counter() - t0
        seq = self._next()
        self._return_and_forward(seq, np.ascontiguousarray(x), handle, topk_weights, gbl_prefix)
        result = self._sum_servers(seq, handle, topk_weights is not None, bias)
        self._quiet_lanes()
        self._last[1] = seq
        self.last_times["combine"] = time.perf_counter() - t0
        return result

    def _return_and_forward(self, seq: int, x: np.ndarray, handle: InternodeHandle, topk_weights,
                            gbl_prefix: np.ndarray) -> None:
        """Combine stages 1 and 2, pipelined by source server (the remote ones first, the own one last): this
        rank returns its rows from sources (b, j) to forwarder (a, j)'s ``nvl_combine_*[lane][b]`` (MTE), part b
        after part b, each part quieted and announced (``nvl_combine_signal[lane]`` = the parts so far); while
        part p's copies are in flight, this forwarder sums part p - 1 (every rank of the server returned it) and
        sends it back over RDMA."""
        s, n, a, lane = self.server_size, self.servers, self.server, self.lane
        v = self.views
        nvl = [a * s + j for j in range(s)]
        order = [(a + i) % n for i in range(1, n)] + [a]
        self._wait_credit(NVL_COMBINE, nvl, self._last[1])
        self._wait_credit(RDMA_COMBINE, [b * s + lane for b in order[:-1]], self._last[1])
        counts = np.diff(gbl_prefix, prepend=0)
        xb = x.view(np.uint8).reshape(len(x), -1)
        w = None if topk_weights is None else np.ascontiguousarray(topk_weights, np.float32)
        for p, b in enumerate(order):
            for k in range(s):  # from the own lane on (distinct forwarders at a time)
                j = (lane + k) % s
                peer, i = nvl[j], b * s + j
                lo, cnt = int(gbl_prefix[i] - counts[i]), int(counts[i])
                if not cnt:
                    continue
                dst_x, dst_w = v["nvl_combine_x"][lane, b, :cnt], v["nvl_combine_w"][lane, b, :cnt]
                if peer == self.me:
                    dst_x[...] = xb[lo:lo + cnt]
                    if w is not None:
                        dst_w[...] = w[lo:lo + cnt]
                    continue
                shmemx.aclshmemx_mte_put_nbi(dst_x, xb[lo:lo + cnt], dst_x.size, peer)
                if w is not None:
                    shmemx.aclshmemx_mte_put_nbi(dst_w, w[lo:lo + cnt], dst_w.size, peer)
            if p:
                self._forward_part(seq, handle, order[p - 1], p, topk_weights is not None)
            shmemx.aclshmemx_mte_quiet()
            for peer in nvl:
                shmemx.aclshmemx_signal_op(v["nvl_combine_signal"][lane:lane + 1, 0], _tail(seq, p + 1), SET, peer)
        self._forward_part(seq, handle, order[-1], n, topk_weights is not None)
        self._give_credit(NVL_COMBINE, nvl, seq)

    def _forward_part(self, seq: int, handle: InternodeHandle, b: int, parts: int, with_weights: bool) -> None:
        """Combine stage 2 for source server b (the server's ranks announced ``parts`` parts): per forwarded row,
        the float32 sum over this server's ranks in rank order, rounded to bfloat16; b's block back over RDMA
        (one WRITE on lane 0, every lane its record and signal after it)."""
        s, a, lane = self.server_size, self.server, self.lane
        v, lanes = self.views, self.lanes
        cb = self.rows.combine_bytes
        shmemx.aclshmem_wait_until_all(v["nvl_combine_signal"][:, 0], GE, _tail(seq, parts))
        rdma_prefix = np.asarray(handle.recv_rdma_rank_prefix_sum, np.int64)
        counts = np.diff(rdma_prefix, prepend=0)
        lo, rows = int(rdma_prefix[b] - counts[b]), int(counts[b])
        out = v["rdma_combine_recv"][a] if b == a else v["rdma_combine_send"][b]
        self._server_sum(b, np.asarray(handle.send_nvl_head)[lo:lo + rows] >= 0, out, with_weights)
        if b == a:
            self._signal_self("rdma_combine_signal", a, seq)
            return
        peer = b * s + lane
        base, local = np.uint64(lanes.remote_base[peer]), np.uint64(lanes.local_base)
        rmt = [self.offsets["rdma_combine_recv"] + a * self.max_tokens * cb] if rows else []
        sge = [self.offsets["rdma_combine_send"] + b * self.max_tokens * cb] if rows else []
        length = [rows * cb] if rows else []
        writes = LaneWrites(base, local, rmt, sge, length)
        for q in range(self.rdma_qps):  # the block on lane 0; every lane its record and signal
            record = LaneRecord("rdma_combine_signal", "rdma_records", a, b, rows if q == 0 else 0, seq)
            self._post(peer, q, writes if q == 0 else writes._replace(rmt=[], sge=[], length=[]), record)

    def _server_sum(self, b: int, sent: np.ndarray, out: np.ndarray, with_weights: bool) -> None:
        """The rows this forwarder holds from server b (``sent [rows, S]``: forwarded to rank j): per row, the
        float32 sum of what the ranks of this server sent back, in rank order, rounded to bfloat16, into
        ``out [rows, combine row bytes]`` (then the weights' float32 sums)."""
        v, r = self.views, self.rows
        hidden, rows = r.hidden, len(sent)
        cx16 = v["nvl_combine_x"].view(np.uint16).reshape(self.server_size, self.servers, -1, hidden)
        pos = np.cumsum(sent, axis=0) - 1  # the row's place among those forwarded to rank j from b
        for c0 in range(0, rows, _CHUNK):
            c1 = min(rows, c0 + _CHUNK)
            acc = np.zeros((c1 - c0, hidden), np.float32)
            wacc = np.zeros((c1 - c0, r.num_topk), np.float32) if with_weights else None
            for j in range(self.server_size):  # ascending rank, as DeepEP sums
                ok = np.flatnonzero(sent[c0:c1, j])
                if not len(ok):
                    continue
                src = pos[c0 + ok, j]
                acc[ok] += cx16[j, b, src].view(bf16).astype(np.float32)
                if wacc is not None:
                    wacc[ok] += v["nvl_combine_w"][j, b, src]
            out[c0:c1, :2 * hidden] = acc.astype(bf16).view(np.uint8).reshape(c1 - c0, 2 * hidden)
            if wacc is not None:
                out[c0:c1, 2 * hidden:2 * hidden + 4 * r.num_topk] = wacc.view(np.uint8)

    def _sum_servers(self, seq: int, handle: InternodeHandle, with_weights: bool, bias):
        """Combine stage 3: per token, bias_0 + bias_1 + the partial sums of its servers in server order
        (float32), rounded once."""
        s, n, a, lane = self.server_size, self.servers, self.server, self.lane
        v, r = self.views, self.rows
        hidden = r.hidden
        in_rank = np.asarray(handle.is_token_in_rank, bool)
        n_tok = in_rank.shape[0]
        in_server = in_rank.reshape(n_tok, n, s).any(2)
        rdma_heads = np.asarray(handle.send_rdma_head, np.int64)
        matrix = np.asarray(handle.rdma_channel_prefix_matrix, np.int64)
        bounds = channel_bounds(n_tok, self.num_channels)
        channel = np.searchsorted(bounds, np.arange(n_tok), side="right") - 1
        acc = np.zeros((n_tok, hidden), np.float32)
        for part in _bias_parts(bias, n_tok, hidden, self.me):
            acc += part.astype(np.float32)
        wacc = np.zeros((n_tok, r.num_topk), np.float32) if with_weights else None
        for b in range(n):
            rows = int(in_server[:, b].sum())
            self._wait_lanes("rdma_combine_signal", b, seq, rows, "combine")
            toks = np.flatnonzero(rdma_heads[:, b] >= 0)
            if not len(toks):
                continue
            starts = np.concatenate([[0], matrix[b]])[channel[toks]]
            pos = starts + rdma_heads[toks, b]
            got = v["rdma_combine_recv"][b][pos]
            acc[toks] += got[:, :2 * hidden].copy().view(bf16).astype(np.float32)
            if wacc is not None:
                wacc[toks] += got[:, 2 * hidden:2 * hidden + 4 * r.num_topk].copy().view(np.float32)
        self._give_credit(RDMA_COMBINE, [((a + i) % n) * s + lane for i in range(1, n)], seq)
        return acc.astype(bf16), wacc


def _bias_parts(bias, n_tok: int, hidden: int, me: int) -> list:
    if bias is None:
        return []
    parts = [np.asarray(b) for b in (bias if isinstance(bias, (tuple, list)) else (bias,)) if b is not None]
    for p in parts:
        if p.shape != (n_tok, hidden) or p.dtype != np.dtype(bf16):
            raise ValueError(f"pe {me}: combine: bias must be [{n_tok}, {hidden}] bfloat16, got {p.shape} {p.dtype}")
    return parts

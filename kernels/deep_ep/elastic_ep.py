"""DeepEP V2's expert-parallel dispatch and combine (``ElasticBuffer.dispatch`` / ``combine``) over UDMA.

No layout step: the sender knows from ``topk_idx`` where each token goes. A **hop** is a set of peers with blocks
of its own: one WRITE_WITH_NOTIFY per (sender, peer) carries every row for that peer, with the count in the first
16 bytes of the block. Rows are ``[int64 source global token index][int32 topk_idx x K][float32 topk_weights x K]
[x bytes][scale bytes]`` on the way out and ``[bfloat16 partial x H][float32 weights x K]`` on the way back.

In call k of a hop the sender puts ``16 + count * row`` bytes into block ``[my index]`` of every peer with the
signal ``peer.<hop>.<kind>_signal[my index]`` SET to k (``aclshmemx_udma_put_signal_nbi``: the payload lands
before the signal), waits for every peer's signal, copies the rows out, then SETs ``<hop>.<kind>_credit[my index]``
on every peer: a sender writes a peer's block again (call k + 1) only after it saw that peer's credit of call k.
The own rank is served by a local copy and a local signal store; every hop quiets its puts before it returns.

Two routings, DeepEP's logical domains (``ElasticBuffer.get_logical_domain_size``):

* **direct** (one scale-up domain of every rank: one server, or ``allow_hybrid_mode=False``): one hop over every
  rank. A destination reads its sources in rank order, so its rows come sorted by ``src_rank *
  num_max_tokens_per_rank + token`` (DeepEP's reference order). Combine: the expert rank reduces each received
  token's rows over its local top-k slots (float32 in top-k order, rounded once to bfloat16: DeepEP's reduction
  within a rank) and puts them back with the weights of its slots; the source adds the ranks' partials to the
  bias in the order of each rank's last top-k slot, in float32, rounded once (``refs.combine`` recipe
  ``(True, False)``).
* **hybrid** (``S_out`` scale-out domains of ``S_up`` ranks, rank ``a * S_up + u``; a job over several servers):
  two hops, as DeepEP's hierarchical kernels, so that a token crosses the scale-out network once per domain it
  goes to. Hop ``out``: source ``(a, u)`` puts each token once to rank ``(b, u)`` of every domain ``b`` holding one
  of its experts (the forwarder: the same scale-up index). Hop ``up``: the forwarder puts, to every rank ``(b,
  v)`` of its domain, the rows it received (every source domain, in domain order) with an expert on ``(b, v)``.
  A rank's rows therefore come grouped by the scale-up peer that forwarded them
  (``psum_num_recv_tokens_per_scaleup_rank``). Combine retraces the hops: the expert rank reduces a token's local
  slots and puts the partial back to its forwarder; the forwarder sums its domain's partials (float32, in the
  order of each rank's last top-k slot, rounded once: DeepEP's reduction within a scale-up domain) and puts that
  back to the source, which adds the domains' partials to the bias in the order of each domain's last slot,
  rounded once (``refs.combine`` recipe ``(True, True)``). The forwarder keeps what it forwarded in the handle
  (``Forward``): a combine may come after other dispatches.

Without multiple reduction (``allow_multiple_reduction=False``: DeepEP's "one reduction, in the combine epilogue")
a combine row is wide: one partial per top-k slot (a non-expanded token's at its rank's last local slot, an
expanded token's every slot its own row), forwarders pass the slots on without summing, and the source adds
every slot in order to the bias, rounded once (recipes ``(True, False)`` and ``(False, False)``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import shmemx
from shmemx.kernels.moe.workspace import WorkspaceLayout

from .tensors import bf16

__all__ = ["ElasticEP", "Rows", "HEADER", "Hop", "Forward", "hops", "workspace_bytes"]

GE = shmemx.ACLSHMEM_CMP_GE
SET = shmemx.ACLSHMEM_SIGNAL_SET
HEADER = 16  # bytes before a block's rows: int64 count, 8 reserved
_WORDS = ("dispatch_signal", "combine_signal", "dispatch_credit", "combine_credit")


class Rows:
    """The byte layout of one dispatch row and one combine row (``K`` top-k slots, ``x_bytes`` of data,
    ``sf_bytes`` of scales; ``wide``: a combine row carries one ``H`` partial per top-k slot, not one in all)."""

    def __init__(self, num_topk: int, x_bytes: int, sf_bytes: int, hidden: int, wide: bool = False):
        self.k, self.x_bytes, self.sf_bytes, self.hidden, self.wide = num_topk, x_bytes, sf_bytes, hidden, wide
        self.idx = 8
        self.w = self.idx + 4 * num_topk
        self.x = self.w + 4 * num_topk
        self.sf = self.x + x_bytes
        self.size = -(-(self.sf + sf_bytes) // 16) * 16
        self.back_w = 2 * hidden * (num_topk if wide else 1)
        self.back = -(-(self.back_w + 4 * num_topk) // 16) * 16


class Hop:
    """One hop of a routing: its peers (global PEs, in block order), this rank's index among them, and the most
    rows one block carries."""

    def __init__(self, name: str, peers: list[int], mine: int, max_rows: int):
        self.name, self.peers, self.mine, self.max_rows = name, list(peers), mine, max_rows
        self.n = len(self.peers)

    def order(self) -> list[int]:
        """The peers' indices from mine on (a ring: the ranks start on different peers)."""
        return [(self.mine + i) % self.n for i in range(self.n)]


class Forward(NamedTuple):
    """What a forwarder sent on in a hybrid dispatch: the source global token index (``[R]``) and the experts
    (``[R, K]``) of the rows it received (every source domain in order), the rows from each source domain
    (``[S_out]``), and each row's place in the block to each rank of its domain (``[R, S_up]``, -1: not sent)."""

    src: np.ndarray
    topk_idx: np.ndarray
    counts: np.ndarray
    pos: np.ndarray


def hops(me: int, n_pes: int, scaleout: int, max_tokens: int) -> list[Hop]:
    """The hops of rank ``me``: one over every rank (``scaleout`` 1), or ``out`` then ``up`` (hybrid)."""
    if scaleout <= 1:
        return [Hop("all", list(range(n_pes)), me, max_tokens)]
    su = n_pes // scaleout
    domain, u = divmod(me, su)
    return [Hop("out", [b * su + u for b in range(scaleout)], domain, max_tokens),
            Hop("up", [domain * su + v for v in range(su)], u, scaleout * max_tokens)]


def _layout(route: list[Hop], rows: Rows) -> WorkspaceLayout:
    ws = WorkspaceLayout()
    for hop in route:
        block, back = HEADER + hop.max_rows * rows.size, HEADER + hop.max_rows * rows.back
        for region, size in (("send", block), ("recv", block), ("back_send", back), ("back_recv", back)):
            ws.append(f"{hop.name}.{region}", (hop.n, size), np.uint8)
        for word in _WORDS:
            ws.append(f"{hop.name}.{word}", (hop.n,), np.uint64 if word.endswith("signal") else np.int64)
    return ws


def workspace_bytes(n_pes: int, max_tokens: int, rows: Rows, scaleout: int = 1) -> int:
    """Heap bytes of the workspace of these shapes (``scaleout`` > 1: the hybrid routing)."""
    return _layout(hops(0, n_pes, scaleout, max_tokens), rows).total


def _split(rows: np.ndarray, counts) -> list[np.ndarray]:
    ends = np.cumsum(counts)
    return [rows[e - c:e] for e, c in zip(ends.tolist(), np.asarray(counts).tolist())]


def _places(owner: np.ndarray, n: int) -> np.ndarray:
    """``[R, n] int32``: each row's place among the rows sent to each of ``n`` peers (``owner [R, K]``: the peer
    of each top-k slot, -1 for none), -1 where the row does not go."""
    goes = (owner[:, :, None] == np.arange(n)).any(1)
    return np.where(goes, np.cumsum(goes, axis=0) - 1, -1).astype(np.int32)


def reduce_by_owner(rows: Rows, owner: np.ndarray, places: np.ndarray, back: list[np.ndarray],
                    start: np.ndarray | None = None, merge: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Sum the partials that came back (``back[g]``: the back rows from peer g, in the order they were sent, row
    ``places[t, g]`` for row t) into ``[R, H] bfloat16``: in float32, from ``start`` (or 0), in top-k slot order
    (``owner [R, K]``: the peer of each slot), rounded once: each peer's partial at its last slot, or (wide rows)
    every slot's own partial from its owner. ``merge`` (wide rows): no sum, ``[R, K, H] bfloat16``, each slot's
    partial from its owner. Also ``[R, K] float32``: each slot's weight from its owner."""
    n_rows, k = owner.shape
    acc = np.zeros((n_rows, rows.hidden), np.float32) if start is None else start.astype(np.float32).copy()
    merged = np.zeros((n_rows, k, rows.hidden), bf16) if merge else None
    weights = np.zeros((n_rows, k), np.float32)
    last = np.zeros_like(owner, bool)
    for j in range(k):
        last[:, j] = (owner[:, j] >= 0) & (rows.wide or ~(owner[:, j + 1:] == owner[:, j:j + 1]).any(1))
    for j in range(k):
        for g, got in enumerate(back):
            toks = np.flatnonzero(owner[:, j] == g)
            if not len(toks):
                continue
            picked = got[places[toks, g]]
            weights[toks, j] = picked[:, rows.back_w + 4 * j:rows.back_w + 4 * j + 4].copy().view(np.float32)[:, 0]
            value = _partial(rows, picked, j)
            if merge:
                merged[toks, j] = value
            else:
                acc[toks[last[toks, j]]] += value[last[toks, j]].astype(np.float32)
    return (merged if merge else acc.astype(bf16)), weights


def _partial(rows: Rows, picked: np.ndarray, j: int) -> np.ndarray:
    """``[m, H] bfloat16``: the partial of slot ``j`` in these back rows (wide: slot j's own)."""
    at = 2 * rows.hidden * j if rows.wide else 0
    return picked[:, at:at + 2 * rows.hidden].copy().view(bf16)


class ElasticEP:
    """The dispatch / combine engine of an ``ElasticBuffer`` (numpy in, numpy out).

    Args:
        me, n_pes: this rank and P.
        budget: the most heap bytes its workspace may take (the buffer's ``num_bytes``).
        scaleout: the scale-out domains (1: the direct routing; more: hybrid, ``n_pes / scaleout`` ranks each).
        wide: one reduction only, at the source (``allow_multiple_reduction=False``): the combine's rows carry a
            partial per top-k slot and nothing is summed on the way.
    """

    def __init__(self, me: int, n_pes: int, budget: int, scaleout: int = 1, wide: bool = False):
        self.me, self.n_pes, self.budget, self.scaleout = me, n_pes, budget, max(int(scaleout), 1)
        self.wide = bool(wide)
        self.block = None
        self.key = None
        self.route: list[Hop] = []
        self.views: dict = {}
        self.seq: dict = {}

    def _ensure(self, max_tokens: int, rows: Rows) -> None:
        """The workspace for these shapes (collective: every rank calls with the same shapes)."""
        key = (max_tokens, rows.size, rows.back)
        if self.key is not None and self.key[0] >= key[0] and self.key[1] >= key[1] and self.key[2] >= key[2]:
            return
        route = hops(self.me, self.n_pes, self.scaleout, max_tokens)
        layout = _layout(route, rows)
        if layout.total > self.budget:
            raise ValueError(f"pe {self.me}: ElasticBuffer: dispatch of up to {max_tokens} tokens per rank (rows "
                             f"of {rows.size} B, top-{rows.k}) needs {layout.total} B of buffer, num_bytes is "
                             f"{self.budget}: size it with ElasticBuffer.get_buffer_size_hint")
        self.close()
        self.block = shmemx.aclshmem_malloc(layout.total, name="deep_ep.elastic", prefault=False)
        self.views = layout.views(self.block)
        for hop in route:
            for word in _WORDS:
                self.views[f"{hop.name}.{word}"][...] = 0
        self.key, self.route, self.seq = key, route, {}
        shmemx.aclshmem_barrier_all()  # every rank zeroed its words before anyone posts

    def close(self) -> None:
        """Free the workspace (collective)."""
        if self.block is not None:
            shmemx.aclshmem_free(self.block)
            self.block, self.key, self.views, self.route = None, None, {}, []

    # --- the transport ---------------------------------------------------------------------------------------

    def _hop(self, hop: Hop, kind: str, row_bytes: int, parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Send ``parts[i]`` (``[c, row_bytes] uint8``) to peer i of ``hop``; returns the rows every peer sent me
        (concatenated in peer order) and how many came from each. Signals and credits: the module docstring."""
        send, recv = (f"{hop.name}.send", f"{hop.name}.recv") if kind == "dispatch" else \
            (f"{hop.name}.back_send", f"{hop.name}.back_recv")
        for i, part in enumerate(parts):
            block = self.views[send][i]
            block[HEADER:HEADER + part.size] = part.reshape(-1)
            block[:8].view(np.int64)[0] = len(part)
        seq = self._exchange(hop, kind, [HEADER + p.size for p in parts], send, recv)
        counts = np.array([int(self.views[recv][i, :8].view(np.int64)[0]) for i in range(hop.n)], np.int64)
        got = np.concatenate([self.views[recv][i, HEADER:HEADER + c * row_bytes].reshape(c, row_bytes)
                              for i, c in enumerate(counts.tolist())])
        self._finish(hop, kind, seq)
        return got, counts

    def _exchange(self, hop: Hop, kind: str, nbytes: list[int], send: str, recv: str) -> int:
        """Put ``send[i, :nbytes[i]]`` into every peer i's ``recv[my index]`` with the signal; wait for every
        peer's; return the call's sequence number."""
        seq = self.seq.get((hop.name, kind), 0) + 1
        self.seq[hop.name, kind] = seq
        signal, credit = self.views[f"{hop.name}.{kind}_signal"], self.views[f"{hop.name}.{kind}_credit"]
        me = hop.mine
        others = (np.arange(hop.n) == me).astype(np.int32)
        if seq > 1 and hop.n > 1:  # every peer consumed my previous block
            shmemx.aclshmem_wait_until_all(credit, GE, seq - 1, status=others)
        for i in hop.order():
            if i == me:
                self.views[recv][me, :nbytes[i]] = self.views[send][me, :nbytes[i]]
                signal[me] = seq
                continue
            shmemx.aclshmemx_udma_put_signal_nbi(self.views[recv][me, :nbytes[i]], self.views[send][i, :nbytes[i]],
                                                 nbytes[i], signal[me:me + 1], seq, hop.peers[i])
        if hop.n > 1:
            shmemx.aclshmem_wait_until_all(signal, GE, seq, status=others)
        return seq

    def _finish(self, hop: Hop, kind: str, seq: int) -> None:
        """Credit every peer (its block was consumed) and retire this call's puts."""
        word = self.views[f"{hop.name}.{kind}_credit"][hop.mine:hop.mine + 1]
        for i, pe in enumerate(hop.peers):
            if i != hop.mine:
                shmemx.aclshmemx_signal_op(word, seq, SET, pe)
                shmemx.aclshmemx_udma_quiet(pe)

    def _owner(self, hop: Hop, idx: np.ndarray, local: int) -> np.ndarray:
        """``[R, K]``: the index in ``hop`` of the peer each top-k slot goes to (-1: none, or not through it)."""
        rank = np.where(idx >= 0, idx // local, -1)
        if hop.name == "all":
            return rank
        su = self.n_pes // self.scaleout
        if hop.name == "out":
            return np.where(rank >= 0, rank // su, -1)
        return np.where((rank >= 0) & (rank // su == self.me // su), rank % su, -1)

    # --- dispatch --------------------------------------------------------------------------------------------

    def dispatch(self, x: np.ndarray, sf: np.ndarray | None, topk_idx: np.ndarray, topk_weights: np.ndarray | None,
                 max_tokens: int, num_experts: int) -> dict:
        """Send every token to the ranks of its experts (collective).

        Returns:
            dict: ``x [n, H]``, ``sf [n, H/128]`` or None, ``topk_idx [n, K] int64`` (local experts, -1 for the
            others), ``topk_weights [n, K] float32``, ``src [n] int32`` (source global token index),
            ``per_block [B]`` (rows from each peer of the last hop: each source rank, or each scale-up forwarder),
            ``slot [T, G] int32`` (a token's row in the block to each peer of the first hop, -1 if not sent),
            ``forward`` (hybrid: a ``Forward``; else None).
        """
        me = self.me
        n_tok, hidden = x.shape
        k = topk_idx.shape[1]
        local = num_experts // self.n_pes
        if n_tok > max_tokens:
            raise ValueError(f"pe {me}: ElasticBuffer.dispatch: {n_tok} tokens, more than num_max_tokens_per_rank="
                             f"{max_tokens}")
        rows = Rows(k, x.dtype.itemsize * hidden, 0 if sf is None else sf.dtype.itemsize * sf.shape[1], hidden,
                    self.wide)
        self._ensure(max_tokens, rows)
        idx = topk_idx.astype(np.int64)
        weights = np.zeros(idx.shape, np.float32) if topk_weights is None else topk_weights.astype(np.float32)
        packed = self._pack_rows(rows, x, sf, idx, weights, me * max_tokens)
        first = self.route[0]
        slot = _places(self._owner(first, idx, local), first.n)
        got, counts = self._hop(first, "dispatch", rows.size, [packed[slot[:, i] >= 0] for i in range(first.n)])
        forward = None
        if len(self.route) > 1:
            got, counts, forward = self._forward(rows, got, counts, local)
        out = self._unpack_rows(rows, got, x.dtype, None if sf is None else sf.dtype, local)
        out["per_block"], out["slot"], out["forward"] = counts, slot, forward
        return out

    def _forward(self, rows: Rows, got: np.ndarray, counts: np.ndarray, local: int) -> tuple:
        """Hybrid hop ``up``: the rows from every source domain on to the ranks of mine with an expert of them."""
        up = self.route[1]
        idx = got[:, rows.idx:rows.w].copy().view(np.int32).astype(np.int64).reshape(len(got), rows.k)
        pos = _places(self._owner(up, idx, local), up.n)
        got2, counts2 = self._hop(up, "dispatch", rows.size, [got[pos[:, v] >= 0] for v in range(up.n)])
        src = got[:, :8].copy().view(np.int64)[:, 0] if len(got) else np.zeros(0, np.int64)
        return got2, counts2, Forward(src, idx, counts, pos)

    def _pack_rows(self, rows: Rows, x, sf, idx, weights, first_token: int) -> np.ndarray:
        n_tok = x.shape[0]
        packed = np.zeros((n_tok, rows.size), np.uint8)
        packed[:, :8].view(np.int64)[:, 0] = first_token + np.arange(n_tok)
        packed[:, rows.idx:rows.w] = idx.astype(np.int32).view(np.uint8).reshape(n_tok, -1)
        packed[:, rows.w:rows.x] = weights.view(np.uint8).reshape(n_tok, -1)
        packed[:, rows.x:rows.sf] = np.ascontiguousarray(x).view(np.uint8).reshape(n_tok, -1)
        if sf is not None:
            packed[:, rows.sf:rows.sf + rows.sf_bytes] = np.ascontiguousarray(sf).view(np.uint8).reshape(n_tok, -1)
        return packed

    def _unpack_rows(self, rows: Rows, got, x_dtype, sf_dtype, local: int) -> dict:
        r = len(got)
        token = got[:, :8].copy().view(np.int64)[:, 0] if r else np.zeros(0, np.int64)
        idx = got[:, rows.idx:rows.w].copy().view(np.int32).astype(np.int64).reshape(r, rows.k)
        lo = self.me * local
        local_idx = np.where((idx >= lo) & (idx < lo + local), idx - lo, -1)
        return {"x": got[:, rows.x:rows.sf].copy().view(x_dtype).reshape(r, -1),
                "sf": None if sf_dtype is None else got[:, rows.sf:rows.sf + rows.sf_bytes].copy().view(sf_dtype)
                .reshape(r, -1),
                "topk_idx": local_idx, "topk_weights": got[:, rows.w:rows.x].copy().view(np.float32).reshape(r, rows.k),
                "src": token.astype(np.int32)}

    # --- combine ---------------------------------------------------------------------------------------------

    def combine(self, partial: np.ndarray, weights: np.ndarray, per_block: np.ndarray, topk_idx: np.ndarray,
                slot: np.ndarray, num_experts: int, bias_sum: np.ndarray | None,
                forward: Forward | None = None) -> tuple:
        """Send each received token's partial ``[n, H] bfloat16`` (reduced within this rank; wide: ``[n, K, H]``, one
        per slot) and its local slots' weights ``[n, K] float32`` back the way it came, summing on the way unless
        wide (collective).

        Args:
            per_block: the dispatch's rows from each peer of its last hop.
            topk_idx, slot: this rank's own tokens' ``[T, K]`` experts and ``[T, G]`` rows (the dispatch's).
            bias_sum: ``[T, H] float32`` or None: the sum starts from it.
            forward: the hybrid dispatch's ``Forward`` (None: direct).

        Returns:
            ``(combined_x [T, H] bfloat16, combined_topk_weights [T, K] float32)``.
        """
        hidden, k = partial.shape[-1], topk_idx.shape[1]
        rows = Rows(k, 2 * hidden, 0, hidden, self.wide)
        if self.block is None or rows.back > self.key[2]:
            raise ValueError(f"pe {self.me}: ElasticBuffer.combine: the handle's dispatch had other shapes (hidden "
                             f"{hidden}, top-{k}); dispatch with them first")
        local = num_experts // self.n_pes
        back = self._back_rows(rows, partial, weights)
        got, _ = self._hop(self.route[-1], "combine", rows.back, _split(back, per_block))
        if forward is not None:  # the forwarder sums its domain's partials and sends them on to the sources
            up = self.route[1]
            part, w = reduce_by_owner(rows, self._owner(up, forward.topk_idx, local), forward.pos,
                                      _split(got, (forward.pos >= 0).sum(0)), merge=self.wide)
            got, _ = self._hop(self.route[0], "combine", rows.back,
                               _split(self._back_rows(rows, part, w), forward.counts))
        first = self.route[0]
        return reduce_by_owner(rows, self._owner(first, topk_idx.astype(np.int64), local), slot,
                               _split(got, (slot >= 0).sum(0)), bias_sum)

    @staticmethod
    def _back_rows(rows: Rows, partial: np.ndarray, weights: np.ndarray) -> np.ndarray:
        n = len(partial)
        back = np.zeros((n, rows.back), np.uint8)
        back[:, :rows.back_w] = np.ascontiguousarray(partial.astype(bf16, copy=False)).view(np.uint8).reshape(n, -1)
        back[:, rows.back_w:rows.back_w + 4 * rows.k] = np.ascontiguousarray(weights, np.float32).view(np.uint8) \
            .reshape(n, -1)
        return back

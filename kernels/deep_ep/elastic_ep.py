"""DeepEP V2's expert-parallel dispatch and combine (``ElasticBuffer.dispatch`` / ``combine``) over UDMA.

No layout step: the sender knows from ``topk_idx`` which ranks each token goes to, and one WRITE_WITH_NOTIFY per
(source, destination) pair carries them all, with the count in its first 16 bytes:

* **dispatch** (call k): source s packs, for every destination d, the tokens with an expert on d (token order)
  as rows ``[int64 token index][int32 topk_idx x K][float32 topk_weights x K][x bytes][scale bytes]`` into its
  send region ``send[d]``, and puts ``16 + count * row`` bytes into d's ``recv[s]`` with the signal
  ``d.dispatch_signal[s]`` SET to k (``aclshmemx_udma_put_signal_nbi``: the payload lands before the signal). The
  destination waits for all P signals, reads the sources in rank order (so the rows come sorted by
  ``src_rank * num_max_tokens_per_rank + token``, DeepEP's reference order), then SETs ``s.dispatch_credit[d] =
  k`` on every source: s may write ``d.recv[s]`` again (call k + 1) only after it saw that credit.
* **combine** (call k): the expert rank d reduces each received token's rows over its local top-k slots (float32,
  in top-k order, rounded once to bfloat16: DeepEP's reduction within a rank) and puts them back to the source,
  in the order that source sent them, with the weights of its local slots; the source adds the ranks' partials
  to the bias in the order of each rank's last top-k slot (DeepEP's reference: a rank's partial stands at its
  last slot, the slots are summed in order), in float32, rounded once. Credits as in dispatch.

The own rank is served by a local copy and a local signal store. Every call quiets its puts (QP 0 of each
peer) before it returns: the send regions are reused by the next call.
"""

from __future__ import annotations

import numpy as np

import shmemx
from shmemx.kernels.moe.workspace import WorkspaceLayout

from .tensors import bf16

__all__ = ["ElasticEP", "Rows", "HEADER"]

GE = shmemx.ACLSHMEM_CMP_GE
SET = shmemx.ACLSHMEM_SIGNAL_SET
HEADER = 16  # bytes before a block's rows: int64 count, 8 reserved


class Rows:
    """The byte layout of one dispatch row and one combine row (``K`` top-k slots, ``x_bytes`` of data,
    ``sf_bytes`` of scales)."""

    def __init__(self, num_topk: int, x_bytes: int, sf_bytes: int, hidden: int):
        self.k, self.x_bytes, self.sf_bytes, self.hidden = num_topk, x_bytes, sf_bytes, hidden
        self.idx = 8
        self.w = self.idx + 4 * num_topk
        self.x = self.w + 4 * num_topk
        self.sf = self.x + x_bytes
        self.size = -(-(self.sf + sf_bytes) // 16) * 16
        self.back_w = 2 * hidden
        self.back = -(-(self.back_w + 4 * num_topk) // 16) * 16


def workspace_bytes(n_pes: int, max_tokens: int, rows: Rows) -> int:
    return _layout(n_pes, max_tokens, rows).total


def _layout(n_pes: int, max_tokens: int, rows: Rows) -> WorkspaceLayout:
    ws = WorkspaceLayout()
    block, back = HEADER + max_tokens * rows.size, HEADER + max_tokens * rows.back
    ws.append("send", (n_pes, block), np.uint8)
    ws.append("recv", (n_pes, block), np.uint8)
    ws.append("back_send", (n_pes, back), np.uint8)
    ws.append("back_recv", (n_pes, back), np.uint8)
    for name in ("dispatch_signal", "combine_signal", "dispatch_credit", "combine_credit"):
        ws.append(name, (n_pes,), np.uint64 if name.endswith("signal") else np.int64)
    return ws


class ElasticEP:
    """The dispatch / combine engine of an ``ElasticBuffer`` (numpy in, numpy out).

    Args:
        me, n_pes: this rank and P.
        budget: the most heap bytes its workspace may take (the buffer's ``num_bytes``).
    """

    def __init__(self, me: int, n_pes: int, budget: int):
        self.me, self.n_pes, self.budget = me, n_pes, budget
        self.block = None
        self.key = None
        self.views: dict = {}
        self.seq = {"dispatch": 0, "combine": 0}

    def _ensure(self, max_tokens: int, rows: Rows) -> None:
        """The workspace for these shapes (collective: every rank calls with the same shapes)."""
        key = (max_tokens, rows.size, rows.back)
        if self.key is not None and self.key[0] >= key[0] and self.key[1] >= key[1] and self.key[2] >= key[2]:
            return
        layout = _layout(self.n_pes, max_tokens, rows)
        if layout.total > self.budget:
            raise ValueError(f"pe {self.me}: ElasticBuffer: dispatch of up to {max_tokens} tokens per rank (rows "
                             f"of {rows.size} B, top-{rows.k}) needs {layout.total} B of buffer, num_bytes is "
                             f"{self.budget}: size it with ElasticBuffer.get_buffer_size_hint")
        self.close()
        self.block = shmemx.aclshmem_malloc(layout.total, name="deep_ep.elastic", prefault=False)
        self.views = layout.views(self.block)
        for name in ("dispatch_signal", "combine_signal", "dispatch_credit", "combine_credit"):
            self.views[name][...] = 0
        self.key, self.seq = key, {"dispatch": 0, "combine": 0}
        shmemx.aclshmem_barrier_all()  # every rank zeroed its words before anyone posts

    def close(self) -> None:
        """Free the workspace (collective)."""
        if self.block is not None:
            shmemx.aclshmem_free(self.block)
            self.block, self.key, self.views = None, None, {}

    # --- the transport ---------------------------------------------------------------------------------------

    def _exchange(self, kind: str, blocks: dict, send: str, recv: str) -> int:
        """Put ``blocks[d]`` (bytes: header + rows, already in ``send[d]``) into every d's ``recv[me]`` with the
        signal; wait for every source's; return the call's sequence number. Credits: see the module docstring."""
        me, n = self.me, self.n_pes
        self.seq[kind] += 1
        seq = self.seq[kind]
        signal, credit = self.views[f"{kind}_signal"], self.views[f"{kind}_credit"]
        ring = [(me + i) % n for i in range(n)]
        if seq > 1 and n > 1:  # every destination consumed my previous block
            shmemx.aclshmem_wait_until_all(credit, GE, seq - 1, status=(np.arange(n) == me).astype(np.int32))
        for d in ring:
            nbytes = blocks[d]
            if d == me:
                self.views[recv][me, :nbytes] = self.views[send][me, :nbytes]
                signal[me] = seq
                continue
            shmemx.aclshmemx_udma_put_signal_nbi(self.views[recv][me, :nbytes], self.views[send][d, :nbytes], nbytes,
                                                 signal[me:me + 1], seq, d)
        if n > 1:
            shmemx.aclshmem_wait_until_all(signal, GE, seq, status=(np.arange(n) == me).astype(np.int32))
        return seq

    def _finish(self, kind: str, seq: int) -> None:
        """Credit every source (its block was consumed) and retire this call's puts."""
        me = self.me
        word = self.views[f"{kind}_credit"][me:me + 1]
        for pe in range(self.n_pes):
            if pe != me:
                shmemx.aclshmemx_signal_op(word, seq, SET, pe)
                shmemx.aclshmemx_udma_quiet(pe)

    def _count(self, region: str, s: int) -> int:
        return int(self.views[region][s, :8].view(np.int64)[0])

    # --- dispatch --------------------------------------------------------------------------------------------

    def dispatch(self, x: np.ndarray, sf: np.ndarray | None, topk_idx: np.ndarray, topk_weights: np.ndarray | None,
                 max_tokens: int, num_experts: int) -> dict:
        """Send every token to the ranks of its experts (collective).

        Returns:
            dict: ``x [n, H]``, ``sf [n, H/128]`` or None, ``topk_idx [n, K] int64`` (local experts, -1 for the
            others), ``topk_weights [n, K] float32``, ``src [n] int32`` (source global token index),
            ``per_rank [P] int64`` (rows from each source), ``slot [T, P] int32`` (a token's row in each
            destination's block from me, -1 if not sent).
        """
        me, n = self.me, self.n_pes
        n_tok, hidden = x.shape
        k = topk_idx.shape[1]
        local = num_experts // n
        if n_tok > max_tokens:
            raise ValueError(f"pe {me}: ElasticBuffer.dispatch: {n_tok} tokens, more than num_max_tokens_per_rank="
                             f"{max_tokens}")
        rows = Rows(k, x.dtype.itemsize * hidden, 0 if sf is None else sf.dtype.itemsize * sf.shape[1], hidden)
        self._ensure(max_tokens, rows)
        idx = topk_idx.astype(np.int64)
        dest = np.where(idx >= 0, idx // local, -1)
        in_rank = (dest[:, :, None] == np.arange(n)).any(1)  # [T, P]
        slot = np.where(in_rank, np.cumsum(in_rank, axis=0) - 1, -1).astype(np.int32)
        weights = np.zeros(idx.shape, np.float32) if topk_weights is None else topk_weights.astype(np.float32)
        packed = self._pack_rows(rows, x, sf, idx, weights)
        blocks = {}
        send = self.views["send"]
        for d in range(n):
            toks = np.flatnonzero(in_rank[:, d])
            view = send[d, HEADER:HEADER + len(toks) * rows.size].reshape(len(toks), rows.size)
            view[...] = packed[toks]
            send[d, :8].view(np.int64)[0] = len(toks)
            blocks[d] = HEADER + len(toks) * rows.size
        seq = self._exchange("dispatch", blocks, "send", "recv")
        per_rank = np.array([self._count("recv", s) for s in range(n)], np.int64)
        got = np.concatenate([self.views["recv"][s, HEADER:HEADER + c * rows.size].reshape(c, rows.size)
                              for s, c in enumerate(per_rank)]) if per_rank.sum() else np.zeros((0, rows.size),
                                                                                              np.uint8)
        out = self._unpack_rows(rows, got, x.dtype, None if sf is None else sf.dtype, per_rank, max_tokens, local)
        out["per_rank"], out["slot"] = per_rank, slot
        self._finish("dispatch", seq)
        return out

    def _pack_rows(self, rows: Rows, x, sf, idx, weights) -> np.ndarray:
        n_tok = x.shape[0]
        packed = np.zeros((n_tok, rows.size), np.uint8)
        packed[:, :8].view(np.int64)[:, 0] = np.arange(n_tok)
        packed[:, rows.idx:rows.w] = idx.astype(np.int32).view(np.uint8).reshape(n_tok, -1)
        packed[:, rows.w:rows.x] = weights.view(np.uint8).reshape(n_tok, -1)
        packed[:, rows.x:rows.sf] = np.ascontiguousarray(x).view(np.uint8).reshape(n_tok, -1)
        if sf is not None:
            packed[:, rows.sf:rows.sf + rows.sf_bytes] = np.ascontiguousarray(sf).view(np.uint8).reshape(n_tok, -1)
        return packed

    def _unpack_rows(self, rows: Rows, got, x_dtype, sf_dtype, per_rank, max_tokens: int, local: int) -> dict:
        r = len(got)
        src_rank = np.repeat(np.arange(self.n_pes), per_rank)
        token = got[:, :8].copy().view(np.int64)[:, 0] if r else np.zeros(0, np.int64)
        idx = got[:, rows.idx:rows.w].copy().view(np.int32).astype(np.int64).reshape(r, rows.k)
        lo = self.me * local
        local_idx = np.where((idx >= lo) & (idx < lo + local), idx - lo, -1)
        out = {"x": got[:, rows.x:rows.sf].copy().view(x_dtype).reshape(r, -1),
               "sf": None if sf_dtype is None else got[:, rows.sf:rows.sf + rows.sf_bytes].copy().view(sf_dtype)
               .reshape(r, -1),
               "topk_idx": local_idx, "topk_weights": got[:, rows.w:rows.x].copy().view(np.float32).reshape(r, rows.k),
               "src": (src_rank * max_tokens + token).astype(np.int32)}
        return out

    # --- combine ---------------------------------------------------------------------------------------------

    def combine(self, partial: np.ndarray, weights: np.ndarray, per_rank: np.ndarray, topk_idx: np.ndarray,
                slot: np.ndarray, num_experts: int, bias_sum: np.ndarray | None) -> dict:
        """Send each received token's partial ``[n, H] bfloat16`` (reduced within this rank) and its local slots'
        weights ``[n, K] float32`` back to its source, and sum there (collective).

        Args:
            per_rank: ``[P]`` rows this rank received from each source (the dispatch's).
            topk_idx, slot: this rank's own tokens' ``[T, K]`` experts and ``[T, P]`` rows (the dispatch's).
            bias_sum: ``[T, H] float32`` or None: the sum starts from it.

        Returns:
            ``(combined_x [T, H] bfloat16, combined_topk_weights [T, K] float32)``.
        """
        me, n = self.me, self.n_pes
        hidden, k = partial.shape[1], topk_idx.shape[1]
        rows = Rows(k, 2 * hidden, 0, hidden)
        if self.block is None or rows.back > self.key[2]:
            raise ValueError(f"pe {me}: ElasticBuffer.combine: the handle's dispatch had other shapes (hidden "
                             f"{hidden}, top-{k}); dispatch with them first")
        starts = np.concatenate([[0], np.cumsum(per_rank)])
        send, blocks = self.views["back_send"], {}
        for s in range(n):
            c = int(per_rank[s])
            view = send[s, HEADER:HEADER + c * rows.back].reshape(c, rows.back)
            view[:, :rows.back_w] = np.ascontiguousarray(partial[starts[s]:starts[s] + c]).view(np.uint8) \
                .reshape(c, -1)
            view[:, rows.back_w:rows.back_w + 4 * k] = np.ascontiguousarray(weights[starts[s]:starts[s] + c]) \
                .view(np.uint8).reshape(c, -1)
            send[s, :8].view(np.int64)[0] = c
            blocks[s] = HEADER + c * rows.back
        seq = self._exchange("combine", blocks, "back_send", "back_recv")
        combined, combined_w = self._sum(rows, topk_idx, slot, num_experts, bias_sum)
        self._finish("combine", seq)
        return combined, combined_w

    def _sum(self, rows: Rows, topk_idx, slot, num_experts: int, bias_sum):
        n_tok, k = topk_idx.shape
        local, hidden = num_experts // self.n_pes, rows.hidden
        recv = self.views["back_recv"]
        back = [recv[r, HEADER:HEADER + self._count("back_recv", r) * rows.back].reshape(-1, rows.back)
                for r in range(self.n_pes)]
        idx = topk_idx.astype(np.int64)
        owner = np.where(idx >= 0, idx // local, -1)
        acc = np.zeros((n_tok, hidden), np.float32) if bias_sum is None else bias_sum.astype(np.float32).copy()
        weights = np.zeros((n_tok, k), np.float32)
        last = np.zeros_like(owner, bool)  # the last top-k slot of each rank: where its partial is added
        for j in range(k):
            last[:, j] = (owner[:, j] >= 0) & ~(owner[:, j + 1:] == owner[:, j:j + 1]).any(1)
        for j in range(k):
            for r in range(self.n_pes):
                mine = owner[:, j] == r
                if not mine.any():
                    continue
                toks = np.flatnonzero(mine)
                got = back[r][slot[toks, r]]
                weights[toks, j] = got[:, rows.back_w + 4 * j:rows.back_w + 4 * j + 4].copy().view(np.float32)[:, 0]
                add = toks[last[toks, j]]
                if len(add):
                    acc[add] += back[r][slot[add, r], :rows.back_w].copy().view(bf16).astype(np.float32)
        return acc.astype(bf16), weights

"""Low-latency mode: DeepEP's ``low_latency_dispatch`` / ``low_latency_combine`` over UDMA, double buffered.

Every rank sends to every (rank, local expert) pair, always, so that the receiver knows when it has everything:

* **dispatch** (call k, half h = k % 2): each token is packed once into the half's send buffer as a message
  (16-byte header: int32 source token index, 3 reserved; then FP8 data and float32 per-128-column scales, or
  BF16 data). For each destination expert g = (rank d, local expert e), the tokens that chose g are put, one
  WRITE per message as DeepEP's IBGDA puts, into d's receive buffer ``[e][me][slot]`` on QP ``e % qp_num`` (one
  QP per local expert when there are enough), then one WRITE_WITH_NOTIFY: an 8-byte count record and the
  signal ``d.signal[h][e, me]`` SET to k (the put + signal). The payload WRITEs are RO and the signal SO without
  a fence: SO executes after every earlier RO/SO WQE of its QP, as DeepEP's count atomic follows its puts on the
  same in-order QP, with no wait for their acknowledgements. Lanes are posted expert-major (each local expert's
  lanes to every rank, then the next expert), so that every destination is fed from the start, as DeepEP's
  token-parallel warps feed all of them at once. The receiver waits for its E signals and packs the
  rows of each local expert, sources in ascending order (DeepEP's order is the atomic's arrival order):
  ``recv_x [E_loc, P * N_max, H]``, ``recv_count``, ``src_info``, ``layout_range = begin << 32 | count``.
* **combine** (call k): the owner of expert g = (me, e) puts each row back, one WRITE per row, into source s's
  receive buffer ``[g][source token]``, then the signal ``s.signal[h][g]`` = k the same way; the source waits
  for all E and sums ``w[t, k] * row`` in float32 over k (DeepEP's weighted combine), rounded once.
* **double buffering with credits**: DeepEP's two halves alternate per call, and a sender may write half h of
  call k only after every peer consumed half h of call k - 2; DeepEP trusts the call pattern for it, here each
  receiver SETs a credit word on every peer once it has consumed a half (what makes a hooked overlap of two
  calls safe), and the sender waits for them (asleep) before posting. The send side does not quiet (DeepEP's
  send phase does not wait for acknowledgements): a call's lanes are quieted once its receive side has everything
  (so that no call leaves unretired WQEs behind; their acknowledgements are mostly in by then).

* **blocks**: a call not hooked is one kernel of up to ``blocks`` AIV blocks (``shmemx.launch``; the largest
  divisor of the QP count up to 8): block b posts the lanes of the QPs q with q % blocks == b (each lane has one
  submitter), all blocks at once, as DeepEP's warps post for their experts in parallel; block 0 then receives,
  and every block quiets its own lanes before it returns.

The own rank is served by direct copies and stores (no QP), as DeepEP's NVLink path serves local peers.
``return_recv_hook=True`` posts from the calling thread and returns a hook that receives (the outputs are filled
when it is called) and quiets the lanes.

* **shrink mode** (``Buffer(enable_shrink=True)``): a rank may stop calling (it failed). The workspace is the
  whole ``num_rdma_bytes``, allocated when the Buffer is made (so no later call is collective over the job), and
  every wait for a peer (its signals, its credits, the clean barrier) has a deadline of ``shrink_timeout``
  seconds: a peer that misses it is masked (``mask[peer] = 1``, DeepEP's mask buffer) and skipped from then on,
  never sent to nor waited for; a combine drops the top-k slots of experts on masked ranks (they contribute 0).
  A masked rank stays masked until ``Buffer.low_latency_clean_mask_buffer`` / ``update_mask_buffer``.
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np

import shmemx
from shmemx.kernels.moe.lanes import Lanes
from shmemx.kernels.moe.peers import Peers
from shmemx.kernels.moe.workspace import WorkspaceLayout

from .handles import LowLatencyHandle

__all__ = ["LowLatency", "ll_layout", "cast_fp8_per_128", "LL_ALIGN_SLACK", "SHRINK_TIMEOUT_ENV"]

bf16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
GE = shmemx.ACLSHMEM_CMP_GE
SET = shmemx.ACLSHMEM_SIGNAL_SET
HEADER = 16  # bytes before a dispatch message's payload
RO = shmemx.OpConfig(cqe=1, odr=shmemx.ACLSHMEMX_UDMA_ODR_RO).flag  # a payload WRITE
SO = shmemx.OpConfig(cqe=1, odr=shmemx.ACLSHMEMX_UDMA_ODR_SO).flag  # its lane's put + signal, after the RO WRITEs
FP8_MARGIN = 1e-4
FP8_MAX = 448.0
_REDUCE_CHUNK = 64
LL_ALIGN_SLACK = 9 * 512  # the workspace's regions are 512-byte aligned: tiny shapes may pass the hint by this
SHRINK_TIMEOUT_ENV = "SHMEMX_SHRINK_TIMEOUT"  # seconds a shrink-mode wait gives a peer before masking it


def _message_bytes(hidden: int) -> int:
    return HEADER + max(2 * hidden, hidden + 4 * (hidden // 128))


def ll_layout(n_pes: int, max_tokens: int, hidden: int, num_experts: int) -> WorkspaceLayout:
    """The low-latency workspace: per half ``send{h}`` (dispatch: N_max messages; combine: ``[E_loc, P*N_max, H]``
    bf16 rows), ``recv{h}`` (dispatch: ``[E_loc, P, N_max]`` messages; combine: ``[E, N_max, H]`` bf16 rows),
    ``signal{h}`` (``[E, 2]`` uint64: the signal, then the count record), ``records{h}`` (``[P, E_loc]`` int64:
    the counts sent); ``credits [2, P]`` int64."""
    local, slots, msg = num_experts // n_pes, n_pes * max_tokens, _message_bytes(hidden)
    ws = WorkspaceLayout()
    for h in (0, 1):
        ws.append(f"send{h}", (max(max_tokens * msg, local * slots * 2 * hidden),), np.uint8)
        ws.append(f"recv{h}", (max(local * slots * msg, num_experts * max_tokens * 2 * hidden),), np.uint8)
        ws.append(f"signal{h}", (num_experts, 2), np.uint64)
        ws.append(f"records{h}", (n_pes, local), np.int64)
    ws.append("credits", (2, n_pes), np.int64)
    return ws


def cast_fp8_per_128(x: np.ndarray, round_scale: bool) -> tuple[np.ndarray, np.ndarray]:
    """DeepEP's low-latency cast of ``[T, H]``: per 128-column block, amax (at least 1e-4) maps to 448, or with
    ``round_scale`` the scale is rounded up to a power of two. Returns ``(float8_e4m3fn [T, H], scale_inv
    [T, H/128] float32)`` with x ~= data * scale_inv."""
    t, h = x.shape
    blocks = x.astype(np.float32).reshape(t, h // 128, 128)
    amax = np.maximum(np.abs(blocks).max(2), FP8_MARGIN)
    if round_scale:
        scale_inv = np.exp2(np.ceil(np.log2(amax / FP8_MAX))).astype(np.float32)
        scale = (1.0 / scale_inv).astype(np.float32)
    else:
        scale = (FP8_MAX / amax).astype(np.float32)
        scale_inv = (amax / FP8_MAX).astype(np.float32)
    data = np.clip(blocks * scale[:, :, None], -FP8_MAX, FP8_MAX).astype(FP8).reshape(t, h)
    return data, scale_inv


class _Pending:
    """One call's receive side, run now or by the hook."""

    def __init__(self, run):
        self._run, self.done = run, False

    def __call__(self) -> None:
        if self.done:
            raise RuntimeError("low-latency hook called twice")
        self.done = True
        self._run()


class LowLatency:
    """The low-latency engine of a ``deep_ep.Buffer``.

    Args:
        me, n_pes: this rank and P.
        budget: ``num_rdma_bytes``: the most heap bytes the workspace may take.
        blocks: the most AIV blocks that post a call's lanes in parallel (``shmemx.launch``; the largest divisor
            of the QP count up to it: one submitter per lane).
    """

    def __init__(self, me: int, n_pes: int, budget: int, blocks: int = 8, *, mask: np.ndarray | None = None,
                 shrink_timeout: float | None = None):
        self.me, self.n_pes, self.budget, self.blocks = me, n_pes, budget, max(1, int(blocks))
        self.mask = np.zeros(n_pes, np.int32) if mask is None else mask  # [P] int32, 1 = masked (shrink mode)
        self.shrink_timeout = shrink_timeout  # None: no shrink mode (a silent peer is a timeout error)
        self.shape: tuple[int, int, int] | None = None
        self.block = None
        self.views: dict = {}
        self.offsets: dict = {}
        self.lanes: Lanes | None = None
        self.seq = 0
        self.pending: dict[int, _Pending] = {}  # half -> the receive side of the last call on it
        self.unquieted: dict[int, set] = {}  # half -> the lanes its last call posted, not quieted yet
        self.arena = self.barrier_words = None  # shrink mode: the whole budget, and the clean barrier's [P] words
        self.barrier_epoch = 0
        if shrink_timeout is not None:
            self.arena = shmemx.aclshmem_malloc(budget + LL_ALIGN_SLACK, name="deep_ep.low_latency", prefault=False)
            self.barrier_words = shmemx.zeros((n_pes,), np.int64)
            shmemx.aclshmem_barrier_all()  # (every rank is alive while the Buffer is made)

    # --- shrink mode: waits that mask a silent peer ------------------------------------------------------------

    def live(self) -> list[int]:
        """The peers not masked, this rank first, then in ring order."""
        return [p for p in ((self.me + i) % self.n_pes for i in range(self.n_pes)) if not self.mask[p]]

    def _wait_peers(self, words: np.ndarray, value: int, peers) -> None:
        """Wait until ``words[p] >= value`` for every peer p in ``peers`` (``words``: one word per peer, a heap
        view). Shrink mode: a peer that misses the deadline is masked, not an error."""
        peers = [p for p in peers if p != self.me and not self.mask[p]]
        if not peers:
            return
        status = np.ones(len(words), np.int32)
        status[peers] = 0
        if self.shrink_timeout is None:
            shmemx.aclshmem_wait_until_all(words, GE, value, status=status)
            return
        try:
            shmemx.aclshmem_wait_until_all(words, GE, value, status=status, timeout=self.shrink_timeout)
        except shmemx.WaitTimeoutError:
            for p in peers:
                if not shmemx.aclshmem_test(words[p:p + 1], GE, value):
                    self.mask[p] = 1

    def _group_barrier(self) -> None:
        """A barrier of the live ranks (shrink mode's clean): SET my epoch in every live peer's word for me, wait
        for theirs; a rank that does not arrive is masked."""
        self.barrier_epoch += 1
        word = self.barrier_words[self.me:self.me + 1]
        for pe in self.live()[1:]:
            shmemx.aclshmemx_signal_op(word, self.barrier_epoch, SET, pe)
        self._wait_peers(self.barrier_words, self.barrier_epoch, range(self.n_pes))

    # --- the workspace -----------------------------------------------------------------------------------------

    def _ensure(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        shape = (max_tokens, hidden, num_experts)
        if shape == self.shape:
            return
        if num_experts % self.n_pes:
            raise ValueError(f"pe {self.me}: low-latency: num_experts {num_experts} is not a multiple of the "
                             f"{self.n_pes} ranks")
        if hidden % 128:
            raise ValueError(f"pe {self.me}: low-latency: hidden {hidden} must be a multiple of 128")
        if self.arena is None:
            self.close()
        layout = ll_layout(self.n_pes, max_tokens, hidden, num_experts)
        if layout.total > self.budget + LL_ALIGN_SLACK:
            raise ValueError(f"pe {self.me}: low-latency mode with num_max_dispatch_tokens_per_rank={max_tokens}, "
                             f"hidden={hidden}, num_experts={num_experts} needs {layout.total} B, more than "
                             f"num_rdma_bytes={self.budget}: size it with Buffer.get_low_latency_rdma_size_hint("
                             f"{max_tokens}, {hidden}, {self.n_pes}, {num_experts})")
        if self.arena is None:
            self.block = shmemx.aclshmem_malloc(layout.total, name="deep_ep.low_latency", prefault=False)
        else:
            self._quiet_all()
            self.block = self.arena[:layout.total]
        self.views = layout.views(self.block)
        self.offsets = {name: r.offset for name, r in layout.regions.items()}
        for name in ("signal0", "signal1", "credits"):
            self.views[name][...] = 0
        local = num_experts // self.n_pes
        self.lanes = Lanes(self.block, Peers.of(), max(1, min(local, shmemx.qp_num())))
        self.shape, self.seq, self.pending, self.unquieted = shape, 0, {}, {}
        self._barrier()  # every rank zeroed its signals before anyone posts

    def _barrier(self) -> None:
        if self.shrink_timeout is None:
            shmemx.aclshmem_barrier_all()
        else:
            self._group_barrier()

    def _quiet_all(self) -> None:
        for half in sorted(self.unquieted):
            self._quiet(half)

    def close(self) -> None:
        """Free the workspace (collective)."""
        if self.block is not None or self.arena is not None:
            if self.block is not None:
                self._quiet_all()
            for block in (self.arena, self.barrier_words) if self.arena is not None else (self.block,):
                shmemx.aclshmem_free(block)
            self.block, self.shape, self.lanes, self.arena, self.barrier_words = None, None, None, None, None

    def clean(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        """DeepEP's ``clean_low_latency_buffer``: zero the signals of both halves (collective)."""
        self._ensure(max_tokens, hidden, num_experts)
        self._barrier()
        for h in (0, 1):
            self.views[f"signal{h}"][...] = 0
        self._barrier()

    def _begin(self) -> tuple[int, int]:
        """The next call's sequence number and half, after every peer consumed that half two calls ago."""
        half = (self.seq + 1) % 2
        waiting = self.pending.get(half)
        if waiting is not None and not waiting.done:
            raise RuntimeError(f"pe {self.me}: low-latency call #{self.seq + 1} reuses the buffer half of call "
                               f"#{self.seq - 1}, whose receive hook was not called: at most two calls may be in "
                               f"flight (call the older hook first)")
        self.seq += 1
        if self.seq > 2 and self.n_pes > 1:
            self._wait_peers(self.views["credits"][half], self.seq - 2, range(self.n_pes))
        return self.seq, half

    def _quiet(self, half: int) -> None:
        for peer, qp in sorted(self.unquieted.pop(half, ())):
            self.lanes.quiet(peer, qp)

    def _credit(self, seq: int, half: int) -> None:
        word = self.views["credits"][half, self.me:self.me + 1]
        for pe in self.live()[1:]:
            shmemx.aclshmemx_signal_op(word, seq, SET, pe)

    def _va(self, region: str, offset: int = 0) -> int:
        return self.offsets[region] + offset

    def _post(self, peer: int, qp: int, rmt: np.ndarray, sge: np.ndarray, nbytes: int, signal_index: int,
              record_index: tuple[int, int], half: int, seq: int) -> None:
        """WRITEs of ``nbytes`` each (remote / local offsets in the workspace), then the count record and the
        signal ``peer.signal{half}[signal_index]`` = seq, fenced, in one doorbell on lane (peer, qp)."""
        lanes = self.lanes
        base = np.uint64(lanes.remote_base[peer])
        sig = int(base) + self._va(f"signal{half}", signal_index * 16)
        src = lanes.local_base + self._va(f"records{half}", (record_index[0] * self.views[f"records{half}"].shape[1]
                                                            + record_index[1]) * 8)
        lanes.post(peer, qp, base + rmt.astype(np.uint64), np.uint64(lanes.local_base) + sge.astype(np.uint64),
                   np.full(len(rmt), nbytes, np.uint64), close=(sig + 8, src, 8, sig, seq), flag=RO, close_flag=SO)

    def _send(self, lanes: list, half: int, seq: int, recv: "_Pending", hooked: bool) -> None:
        """Post every lane ``(peer, qp, rmt, sge, nbytes, signal index, record index)`` of a call, in the order
        given, then (unless ``hooked``) run its receive side ``recv``.

        Hooked, or with one block: the calling thread posts, and the receive side (now or in the hook) quiets the
        lanes once it has everything. Otherwise the call is one kernel of ``_blocks()`` AIV blocks, as DeepEP's
        warps post for their experts in parallel: block b posts the lanes of the QPs q with q % blocks == b (one
        submitter per lane), block 0 then runs the receive side, and each block quiets its own lanes before it
        returns (a kernel leaves no unretired WQEs behind)."""
        nb = 1 if hooked else self._blocks()
        if nb == 1:
            for peer, qp, rmt, sge, nbytes, sig, rec in lanes:
                self._post(peer, qp, rmt, sge, nbytes, sig, rec, half, seq)
            self.unquieted[half] = {(peer, qp) for peer, qp, *_ in lanes}
            if not hooked:
                recv()
            return
        self.unquieted[half] = set()

        def body() -> None:
            b = shmemx.get_block_idx()
            mine = sorted({(peer, qp) for peer, qp, *_ in lanes if qp % nb == b})
            for peer, qp, rmt, sge, nbytes, sig, rec in lanes:
                if qp % nb == b:
                    self._post(peer, qp, rmt, sge, nbytes, sig, rec, half, seq)
            if b == 0:
                recv()
            for peer, qp in mine:
                self.lanes.quiet(peer, qp)

        shmemx.launch(body, nb)

    def _blocks(self) -> int:
        """How many AIV blocks post a call's lanes: the largest divisor of the QP count up to ``self.blocks``."""
        qps = self.lanes.qp_num
        return max(b for b in range(1, min(self.blocks, qps) + 1) if qps % b == 0)

    # --- dispatch ----------------------------------------------------------------------------------------------

    def dispatch(self, x: np.ndarray, topk_idx: np.ndarray, max_tokens: int, num_experts: int, *,
                 stats: np.ndarray | None = None, wait_stats: np.ndarray | None = None, use_fp8: bool = True,
                 round_scale: bool = False, use_ue8m0: bool = False, return_recv_hook: bool = False) -> tuple:
        """Returns ``(recv_x, recv_count, LowLatencyHandle, hook or None)`` (see ``Buffer.low_latency_dispatch``)."""
        me, n = self.me, self.n_pes
        if x.ndim != 2 or x.dtype != np.dtype(bf16):
            raise ValueError(f"pe {me}: low_latency_dispatch: x must be [num_tokens, hidden] bfloat16, got {x.shape} "
                             f"{x.dtype}")
        n_tok, hidden = x.shape
        if n_tok > max_tokens:
            raise ValueError(f"pe {me}: low_latency_dispatch: {n_tok} tokens, more than "
                             f"num_max_dispatch_tokens_per_rank={max_tokens}")
        if use_ue8m0 and not round_scale:
            raise ValueError("low_latency_dispatch: use_ue8m0 needs round_scale=True (as in DeepEP)")
        if topk_idx.shape[0] != n_tok or topk_idx.ndim != 2:
            raise ValueError(f"pe {me}: low_latency_dispatch: topk_idx must be [{n_tok}, num_topk], got "
                             f"{topk_idx.shape}")
        self._ensure(max_tokens, hidden, num_experts)
        shmemx.compute(0.0, name="kernel")  # one kernel call (its fixed cost in the replay: host.kernel_us)
        local, slots, msg = num_experts // n, n * max_tokens, _message_bytes(hidden)
        used = HEADER + (hidden + 4 * (hidden // 128) if use_fp8 else 2 * hidden)  # what a message carries
        seq, half = self._begin()
        send = self.views[f"send{half}"][:max_tokens * msg].reshape(max_tokens, msg)
        self._pack(send, x, use_fp8, round_scale)
        idx = topk_idx.astype(np.int64)
        records = self.views[f"records{half}"]
        recv_view = self.views[f"recv{half}"][:local * slots * msg].reshape(local, n, max_tokens, msg)
        targets = []
        live = self.live()
        for e in range(local):  # every (live rank, local expert) pair gets its put + signal, expert-major
            for d in live:
                toks = np.flatnonzero((idx == d * local + e).any(1))
                records[d, e] = len(toks)
                targets.append((d, e, toks))
        remote = []
        for d, e, toks in targets:
            if d == me:
                recv_view[e, me, :len(toks)] = send[toks]
                sig = self.views[f"signal{half}"][e * n + me]
                sig[1], sig[0] = len(toks), seq
                continue
            rmt = self._va(f"recv{half}", ((e * n + me) * max_tokens) * msg) + np.arange(len(toks)) * msg
            sge = self._va(f"send{half}") + toks * msg
            remote.append((d, e % self.lanes.qp_num, rmt, sge, used, e * n + me, (d, e)))
        out = self._dispatch_outputs(local, slots, hidden, use_fp8, use_ue8m0)
        recv = self.pending[half] = _Pending(
            lambda: self._dispatch_recv(out, seq, half, max_tokens, hidden, use_fp8, use_ue8m0, stats, wait_stats))
        self._send(remote, half, seq, recv, return_recv_hook)
        recv_x = (out["x"], out["scales"]) if use_fp8 else out["x"]
        handle = LowLatencyHandle(out["src_info"], out["layout_range"], max_tokens, hidden, num_experts)
        return recv_x, out["count"], handle, (recv if return_recv_hook else None)

    @staticmethod
    def _pack(send: np.ndarray, x: np.ndarray, use_fp8: bool, round_scale: bool) -> None:
        """The messages of this rank's tokens: header (source token index), then the payload."""
        n_tok, hidden = x.shape
        rows = send[:n_tok]
        rows[:, :HEADER] = 0
        rows[:, :4].view(np.int32)[:, 0] = np.arange(n_tok, dtype=np.int32)
        if use_fp8:
            data, scale_inv = cast_fp8_per_128(x, round_scale)
            rows[:, HEADER:HEADER + hidden] = data.view(np.uint8)
            rows[:, HEADER + hidden:HEADER + hidden + 4 * (hidden // 128)] = scale_inv.view(np.uint8)
        else:
            rows[:, HEADER:HEADER + 2 * hidden] = np.ascontiguousarray(x).view(np.uint8)

    def _dispatch_outputs(self, local: int, slots: int, hidden: int, use_fp8: bool, use_ue8m0: bool) -> dict:
        """DeepEP's packed outputs (fresh; untouched rows stay unmapped zero pages)."""
        out = {"x": np.empty((local, slots, hidden), FP8 if use_fp8 else bf16),
               "count": np.zeros(local, np.int32), "src_info": np.zeros((local, slots), np.int32),
               "layout_range": np.zeros((local, self.n_pes), np.int64), "scales": None}
        if use_fp8:  # column-major in the last two dimensions, as DeepEP's TMA-friendly layout
            cols = hidden // 512 if use_ue8m0 else hidden // 128
            out["scales"] = np.zeros((local, cols, slots), np.int32 if use_ue8m0 else np.float32).transpose(0, 2, 1)
        return out

    def _dispatch_recv(self, out: dict, seq: int, half: int, max_tokens: int, hidden: int, use_fp8: bool,
                       use_ue8m0: bool, stats, wait_stats) -> None:
        n = self.n_pes
        local, slots, msg = out["x"].shape[0], out["x"].shape[1], _message_bytes(hidden)
        sig = self.views[f"signal{half}"].reshape(local, n, 2)
        for s in self.live():
            t = time.perf_counter()
            self._wait_source(sig[:, s, 0], seq, s)
            if wait_stats is not None:
                wait_stats.reshape(-1)[s] += int((time.perf_counter() - t) * 1e9)
        counts = sig[:, :, 1].astype(np.int64)  # [E_loc, P]
        counts[:, self.mask != 0] = 0  # (masked sources sent nothing this call)
        recv = self.views[f"recv{half}"][:local * slots * msg].reshape(local, n * max_tokens, msg)
        begins = np.cumsum(counts, axis=1) - counts
        out["layout_range"][...] = (begins << 32) | counts
        out["count"][...] = counts.sum(1)
        for e in range(local):
            take = np.concatenate([s * max_tokens + np.arange(counts[e, s]) for s in range(n)]).astype(np.int64)
            if not len(take):
                continue
            msgs = recv[e][take]
            rows = len(take)
            out["src_info"][e, :rows] = msgs[:, :4].copy().view(np.int32)[:, 0]
            if use_fp8:
                out["x"][e, :rows].view(np.uint8)[...] = msgs[:, HEADER:HEADER + hidden]
                scale_inv = msgs[:, HEADER + hidden:HEADER + hidden + 4 * (hidden // 128)].copy().view(np.float32)
                if use_ue8m0:  # the exponent byte of each (power-of-two) scale, four to an int32
                    exps = ((scale_inv.view(np.uint32) >> 23) & 0xFF).astype(np.uint8)
                    out["scales"][e, :rows] = exps.reshape(rows, -1, 4).copy().view(np.int32)[:, :, 0]
                else:
                    out["scales"][e, :rows] = scale_inv
            else:
                out["x"][e, :rows].view(np.uint8).reshape(rows, -1)[...] = msgs[:, HEADER:HEADER + 2 * hidden]
        if stats is not None:
            stats += out["count"].astype(stats.dtype)
        self._quiet(half)  # (the lanes posted by the calling thread; blocks quiet their own)
        self._credit(seq, half)

    def _wait_source(self, words: np.ndarray, seq: int, s: int) -> None:
        """Wait for the signals ``words`` (a strided heap view) of source ``s`` to reach ``seq``; shrink mode:
        mask ``s`` if they do not in time."""
        if s == self.me:
            return
        if self.shrink_timeout is None:
            shmemx.aclshmem_wait_until_all(words, GE, seq)
            return
        try:
            shmemx.aclshmem_wait_until_all(words, GE, seq, timeout=self.shrink_timeout)
        except shmemx.WaitTimeoutError:
            self.mask[s] = 1

    # --- combine -----------------------------------------------------------------------------------------------

    def next_combine_buffer(self, handle: LowLatencyHandle) -> np.ndarray:
        """``[E_loc, P * N_max, H] bfloat16`` view of the next call's send half (``zero_copy`` combine)."""
        self._ensure(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        return self._combine_send((self.seq + 1) % 2)

    def _combine_send(self, half: int) -> np.ndarray:
        max_tokens, hidden, num_experts = self.shape
        local, slots = num_experts // self.n_pes, self.n_pes * max_tokens
        return self.views[f"send{half}"][:local * slots * 2 * hidden].view(bf16).reshape(local, slots, hidden)

    def combine(self, x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray, handle: LowLatencyHandle, *,
                use_logfmt: bool = False, zero_copy: bool = False, return_recv_hook: bool = False,
                out: np.ndarray | None = None, wait_stats: np.ndarray | None = None) -> tuple:
        """Returns ``(combined_x [T, H] bfloat16, hook or None)``; ``use_logfmt`` is accepted and sends BF16
        (exact: LogFMT's 10-bit encoding is not emulated)."""
        me, n = self.me, self.n_pes
        max_tokens, hidden, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        self._ensure(max_tokens, hidden, num_experts)
        local, slots = num_experts // n, n * max_tokens
        if x.shape != (local, slots, hidden) or x.dtype != np.dtype(bf16):
            raise ValueError(f"pe {me}: low_latency_combine: x must be [{local}, {slots}, {hidden}] bfloat16, got "
                             f"{x.shape} {x.dtype}")
        n_tok = topk_idx.shape[0]
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"pe {me}: low_latency_combine: topk_weights {topk_weights.shape} must match topk_idx "
                             f"{topk_idx.shape}")
        shmemx.compute(0.0, name="kernel")
        seq, half = self._begin()
        send = self._combine_send(half)
        ranges = np.asarray(handle.layout_range, np.int64)
        begins, counts = ranges >> 32, ranges & 0xFFFF_FFFF
        src_info = np.asarray(handle.src_info)
        records = self.views[f"records{half}"]
        recv_rows = self.views[f"recv{half}"][:num_experts * max_tokens * 2 * hidden].view(bf16) \
            .reshape(num_experts, max_tokens, hidden)
        remote = []
        row_bytes = 2 * hidden
        live = self.live()
        for e in range(local):  # expert-major, as the dispatch
            for s in live:
                b, c = int(begins[e, s]), int(counts[e, s])
                if c and not zero_copy:
                    send[e, b:b + c] = x[e, b:b + c]
                g = me * local + e
                toks = src_info[e, b:b + c].astype(np.int64)
                records[s, e] = c
                if s == me:
                    recv_rows[g, toks] = send[e, b:b + c]
                    sig = self.views[f"signal{half}"][g]
                    sig[1], sig[0] = c, seq
                    continue
                rmt = self._va(f"recv{half}", g * max_tokens * row_bytes) + toks * row_bytes
                sge = self._va(f"send{half}", (e * slots + b) * row_bytes) + np.arange(c) * row_bytes
                remote.append((s, e % self.lanes.qp_num, rmt, sge, row_bytes, g, (s, e)))
        result = out if out is not None else np.empty((n_tok, hidden), bf16)
        recv = self.pending[half] = _Pending(
            lambda: self._combine_recv(result, topk_idx, topk_weights, seq, half, wait_stats))
        self._send(remote, half, seq, recv, return_recv_hook)
        return result, (recv if return_recv_hook else None)

    def _combine_recv(self, result: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray, seq: int, half: int,
                      wait_stats) -> None:
        n = self.n_pes
        max_tokens, hidden, num_experts = self.shape
        local = num_experts // n
        sig = self.views[f"signal{half}"]
        for s in self.live():
            t = time.perf_counter()
            self._wait_source(sig[s * local:(s + 1) * local, 0], seq, s)
            if wait_stats is not None:
                wait_stats.reshape(-1)[s] += int((time.perf_counter() - t) * 1e9)
        rows = self.views[f"recv{half}"][:num_experts * max_tokens * 2 * hidden].view(bf16) \
            .reshape(num_experts, max_tokens, hidden)
        idx = np.asarray(topk_idx, np.int64)
        if self.mask.any():  # experts on masked ranks contribute nothing (DeepEP's shrink mode)
            idx = np.where((idx >= 0) & (self.mask[np.maximum(idx, 0) // local] != 0), -1, idx)
        w = np.where(idx >= 0, np.asarray(topk_weights, np.float32), 0).astype(np.float32)
        acc = np.empty((_REDUCE_CHUNK, hidden), np.float32)
        for t0 in range(0, idx.shape[0], _REDUCE_CHUNK):
            t1 = min(t0 + _REDUCE_CHUNK, idx.shape[0])
            part = acc[:t1 - t0]
            part.fill(0)
            toks = np.arange(t0, t1)
            for k in range(idx.shape[1]):  # in top-k order, as DeepEP's reduction
                g = idx[t0:t1, k]
                ok = g >= 0
                if ok.any():
                    part[ok] += w[t0:t1, k][ok, None] * rows[g[ok], toks[ok]].astype(np.float32)
            result[t0:t1] = part
        self._quiet(half)  # (the lanes posted by the calling thread; blocks quiet their own)
        self._credit(seq, half)

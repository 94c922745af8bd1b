"""``deep_ep.ElasticBuffer`` and ``EPHandle``: DeepEP V2's buffer (names, arguments, return tuples) on shmemx.

One buffer for the expert-parallel dispatch / combine (``elastic_ep``: no layout step, expand and expert
alignment, FP8, bias, cached handles), the barrier, pipeline-parallel send / receive, the all-gather sessions and
Engram's remote fetch (``elastic_comm``), all over the UDMA engine. Tensors are numpy arrays or torch CPU tensors,
answered in kind (``tensors``).

What differs from DeepEP, and why:

* Every call returns after its work completed: events are complete (``EventOverlap``), so ``previous_event``,
  ``async_with_compute_stream``, ``allocate_on_comm_stream``, ``num_sms`` and ``num_qps`` are accepted, checked
  as DeepEP checks them, and change nothing; ``do_cpu_sync=False`` returns worst-case sized outputs
  (``num_ranks * num_max_tokens_per_rank`` rows) as DeepEP does without the CPU sync.
* Alignment padding rows are always zero (``do_zero_padding`` asks for what is already there).
* The logical domain is one scale-up domain of every rank unless the job spans servers (``SHMEMX_SERVER_SIZE``
  ranks each; ``torch.multiprocessing.spawn(nprocs=...)`` under ``--deepep`` sets it) and ``allow_hybrid_mode`` is
  set: then dispatch and combine take DeepEP's hybrid route, through a forwarder of each scale-out domain
  (``elastic_ep``), and a handle's ``token_metadata_at_forward`` is ``[R, 1 + S_up] int32`` (the source global
  token index of each row this rank forwarded, then its row in the block to each rank of the domain, -1: none).
* ``deterministic`` is accepted: the order of the received rows is already deterministic (sorted by source).
* ``num_cpu_bytes`` (CPU-side Engram storage) is accepted: the storage is on the symmetric heap.
"""

from __future__ import annotations

from typing import Any
from .tensors import TensorLike

import math
import os
from contextlib import contextmanager

import numpy as np

import shmemx

from .buffer import SERVER_SIZE_ENV
from .config import NUM_MAX_NVL_PEERS
from .elastic_comm import Barrier, Engram, PipeChannels, Sessions
from .elastic_ep import ElasticEP, Rows, workspace_bytes
from .event import EventHandle, EventOverlap
from .kernel_times import timed
from .tensors import Converter, bf16, is_torch, to_numpy, torch_module

__all__ = ["ElasticBuffer", "EPHandle", "ALIGNMENT"]

ALIGNMENT = 2 << 20  # DeepEP's buffer alignment (get_elastic_buffer_alignment): 2 MB
_HEAP_MARGIN = 64 << 20
_MAX_QPS = 32


def _align(x: int, to: int) -> int:
    return -(-int(x) // to) * to


class EPHandle:
    """DeepEP V2's dispatch handle: the routing of one dispatch, for cached dispatches and the combine.

    Attributes (as in DeepEP): ``do_expand``, ``num_experts``, ``expert_alignment``, ``num_max_tokens_per_rank``,
    ``num_sms``, ``topk_idx [T, K]`` (the caller's, or a clone with ``do_handle_copy``), ``num_recv_tokens``,
    ``num_expanded_tokens``, ``num_recv_tokens_per_expert_list`` (aligned counts), ``psum_num_recv_tokens_per_
    scaleup_rank [P_su] int32`` (inclusive), ``psum_num_recv_tokens_per_expert [E_loc] int32``,
    ``num_unaligned_recv_tokens_per_expert [E_loc] int32``, ``recv_src_metadata [n, 2 + K] int32`` (source global
    token index, source rank, then the expanded slot of each top-k entry or -1), ``dst_buffer_slot_idx [T, P]
    int32`` (each token's row among those sent to each rank, or each scale-out domain in hybrid mode, -1 if not
    sent), ``token_metadata_at_forward`` (hybrid mode: see the module docstring; else None) and
    ``channel_linked_list`` (None).
    """

    def __init__(self, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int, num_sms: int, topk_idx: TensorLike,
                 num_recv_tokens: int, num_expanded_tokens: int, num_recv_tokens_per_expert_list: list,
                 psum_num_recv_tokens_per_scaleup_rank: TensorLike, psum_num_recv_tokens_per_expert: TensorLike,
                 num_unaligned_recv_tokens_per_expert: TensorLike, recv_src_metadata: TensorLike, dst_buffer_slot_idx: TensorLike,
                 token_metadata_at_forward: Any=None, channel_linked_list: Any=None):
        if topk_idx is None:
            raise ValueError("EPHandle: topk_idx is required")
        self.do_expand, self.num_experts, self.expert_alignment = do_expand, num_experts, expert_alignment
        self.num_max_tokens_per_rank, self.num_sms, self.topk_idx = num_max_tokens_per_rank, num_sms, topk_idx
        self.num_recv_tokens, self.num_expanded_tokens = num_recv_tokens, num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.per_block: np.ndarray | None = None  # rows from each peer of the last hop (numpy, for the combine)
        self.forward = None  # hybrid: what this rank forwarded (elastic_ep.Forward), for the combine
        self.local_slots: np.ndarray | None = None  # [n, K] bool: the received top-k slots of this rank's experts

    def __repr__(self) -> str:
        return (f"EPHandle(num_recv_tokens={self.num_recv_tokens}, num_expanded_tokens={self.num_expanded_tokens}, "
                f"do_expand={self.do_expand}, num_experts={self.num_experts}, "
                f"expert_alignment={self.expert_alignment})")


def _event(previous_event, async_with_compute_stream: bool, allocate_on_comm_stream: bool) -> EventOverlap:
    if previous_event is not None and not isinstance(previous_event, (EventHandle, EventOverlap)):
        raise TypeError(f"previous_event must be an EventHandle (ElasticBuffer.capture()), got "
                        f"{type(previous_event).__name__}")
    if previous_event is not None and not allocate_on_comm_stream:
        raise ValueError("previous_event needs allocate_on_comm_stream=True (as in DeepEP)")
    return EventOverlap(EventHandle())


class ElasticBuffer:
    """DeepEP V2's communication buffer. Collective: every rank of the job makes it with the same arguments.

    Args:
        group: a torch.distributed group spanning the job in rank order, or None (the whole job).
        num_bytes: buffer bytes; default: ``get_buffer_size_hint`` of the MoE settings below.
        num_cpu_bytes, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, deterministic,
        allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute, sl_idx, num_allocated_qps,
        num_cpu_timeout_secs, num_gpu_timeout_secs, explicitly_destroy: DeepEP's (see the module docstring).
    """

    def __init__(self, group: Any=None, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False):
        if num_bytes is None:
            num_bytes = ElasticBuffer.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk,
                                                           use_fp8_dispatch, allow_hybrid_mode,
                                                           allow_multiple_reduction)
        self.num_bytes, self.num_cpu_bytes = int(num_bytes), int(num_cpu_bytes)
        self.num_max_tokens_per_rank = int(num_max_tokens_per_rank)
        self.deterministic, self.allow_hybrid_mode = bool(deterministic), bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.num_allocated_qps = int(num_allocated_qps) or (129 if allow_hybrid_mode else 17)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.timeout = float(num_gpu_timeout_secs)
        if not shmemx.is_initialized():
            shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, min(self.num_allocated_qps, 8))
            shmemx.init(min_heap_size=self.num_bytes + self.num_cpu_bytes + _HEAP_MARGIN)
        self.rank_idx, self.num_ranks = shmemx.my_pe(), shmemx.n_pes()
        if group is not None and (int(group.rank()), int(group.size())) != (self.rank_idx, self.num_ranks):
            raise ValueError(f"pe {self.rank_idx}: ElasticBuffer: the group has this process as rank {group.rank()} "
                             f"of {group.size()}; a shmemx ElasticBuffer spans the whole job in its order (pe "
                             f"{self.rank_idx} of {self.num_ranks}); sub-groups are not supported")
        self.group = group
        self.num_rdma_ranks, self.num_nvlink_ranks = self.get_physical_domain_size()
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx, self.scaleup_rank_idx = divmod(self.rank_idx, self.num_scaleup_ranks)
        self._ep = ElasticEP(self.rank_idx, self.num_ranks, self.num_bytes, self.num_scaleout_ranks,
                             wide=not self.allow_multiple_reduction)
        self._barrier = Barrier(self.rank_idx, self.num_ranks)
        self._pp: PipeChannels | None = None
        self._agrs: Sessions | None = None
        self._engram: Engram | None = None
        self.runtime = self  # (DeepEP's C++ runtime; None once destroyed)

    # --- lifecycle ---------------------------------------------------------------------------------------------

    def destroy(self) -> None:
        """Release the buffer (collective; needs ``explicitly_destroy=True``, as in DeepEP)."""
        if not self.explicitly_destroy:
            raise ValueError("ElasticBuffer.destroy: the buffer was made without explicitly_destroy=True")
        if self.runtime is None:
            return
        for part in (self._pp, self._agrs, self._engram):
            if part is not None:
                part.close()
        self._ep.close()
        self._barrier.close()
        self._pp = self._agrs = self._engram = None
        self.runtime = None

    def _check_alive(self, call: str) -> None:
        if self.runtime is None:
            raise shmemx.ClosedError(f"pe {self.rank_idx}: ElasticBuffer.{call}: the buffer was destroyed")

    # --- size hints (DeepEP's static methods) ------------------------------------------------------------------

    @staticmethod
    def get_buffer_size_hint(group: Any, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes (2 MB-aligned) the dispatch / combine of these settings needs; ``num_topk = 0``: room for 32."""
        n = group.size() if group is not None else shmemx.n_pes() if shmemx.is_initialized() else \
            int(os.environ.get("SHMEMX_SIZE", "1"))
        k = num_topk or 32
        x_bytes = hidden if use_fp8_dispatch else 2 * hidden
        sf_bytes = 4 * -(-hidden // 128) if use_fp8_dispatch else 0
        rows = Rows(k, max(x_bytes, 2 * hidden), sf_bytes, hidden, not allow_multiple_reduction)
        scaleout = _domains(n, allow_hybrid_mode)[0]
        return _align(max(workspace_bytes(n, max(num_max_tokens_per_rank, 1), rows, scaleout), 1), ALIGNMENT)

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: Any=None) -> tuple[int, int]:
        """``(fetch area bytes, storage bytes)``, each 2 MB-aligned (entries 32-byte aligned)."""
        itemsize = 2 if dtype is None else (dtype.itemsize if hasattr(dtype, "itemsize") else np.dtype(dtype).itemsize)
        entry = _align(hidden * itemsize, 32)
        return _align(entry * num_max_tokens_per_rank, ALIGNMENT), _align(entry * num_entries, ALIGNMENT)

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """Bytes (2 MB-aligned) of PP channels: send and receive, to the previous and the next rank."""
        return _align(_align(num_max_tensor_bytes, 32) * num_max_inflight_tensors * 2 * 2, ALIGNMENT)

    @staticmethod
    def get_agrs_num_max_session_bytes(group: Any, shapes: Any, dtype: Any) -> int:
        """Bytes one session of all-gathers of these local shapes takes (each output 32-byte aligned)."""
        if not isinstance(shapes[0], (tuple, list)) and not _is_size(shapes[0]):
            shapes = (shapes,)
        n = group.size() if group is not None else shmemx.n_pes()
        return sum(_align(n * math.prod(s) * _itemsize(dtype), 32) for s in shapes)

    @staticmethod
    def get_agrs_buffer_size_hint(group: Any, num_max_session_bytes: int) -> int:
        return _align(num_max_session_bytes, ALIGNMENT)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0, *args: Any,
                                **kwargs: Any) -> int:
        """DeepEP's SM count for the kernels: no SMs here (accepted, no effect); answers 20."""
        return 20

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        return min(self.num_allocated_qps, max(1, int(num_sms)))

    # --- topology, streams, events -----------------------------------------------------------------------------

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(servers, ranks per server)`` (``SHMEMX_SERVER_SIZE``, default 8)."""
        return _domains(self.num_ranks, True)

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(scale-out, scale-up)``: the servers with hybrid mode, else one scale-up domain of every rank."""
        return _domains(self.num_ranks, self.allow_hybrid_mode)

    @staticmethod
    def capture() -> EventHandle:
        return EventHandle()

    def get_comm_stream(self) -> Any:
        """None: no streams (every call completes before it returns)."""
        return None

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """A barrier of every rank (collective) over UDMA signals."""
        self._check_alive("barrier")
        with timed("barrier"):
            self._barrier()

    # --- dispatch / combine ------------------------------------------------------------------------------------

    def dispatch(self, x: TensorLike, topk_idx: TensorLike=None, topk_weights: TensorLike=None, cumulative_local_expert_recv_stats: TensorLike=None,
                 num_experts: int | None = None, num_max_tokens_per_rank: int | None = None,
                 expert_alignment: int | None = None, num_sms: int = 0, num_qps: int = 0, previous_event: Any=None,
                 previous_event_before_epilogue: Any=None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: EPHandle | None = None, do_handle_copy: bool = True,
                 do_cpu_sync: bool | None = None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False) -> tuple:
        """DeepEP V2's dispatch (collective).

        Args:
            x: ``[T, H] bfloat16`` or ``(float8_e4m3fn [T, H], float32 [T, H/128])``.
            topk_idx: ``[T, K] int64`` (-1: none); None with a cached ``handle``.
            topk_weights: ``[T, K] float32`` or None.
            handle: an earlier dispatch's ``EPHandle``: the same routing (its ``topk_idx``), no new handle.
            do_expand: one row per (token, local expert), each expert's rows starting at a multiple of
                ``expert_alignment``; else one row per (token, rank).

        Returns:
            ``(recv_x, recv_topk_idx [n, K] int64 (local experts, -1 elsewhere; None when expanded),
            recv_topk_weights ([n, K], or [rows] per slot when expanded; None without weights), handle, event)``.
        """
        self._check_alive("dispatch")
        event = _event(previous_event, async_with_compute_stream, allocate_on_comm_stream)
        cached = handle is not None
        if cached:
            topk_idx, num_experts, expert_alignment, num_max_tokens_per_rank = _cached_routing(
                handle, topk_idx, do_cpu_sync, num_experts, expert_alignment, num_max_tokens_per_rank)
            do_cpu_sync = False
        max_tokens, alignment = self._check_routing(topk_idx, num_experts, num_max_tokens_per_rank, expert_alignment)
        conv = Converter(x, topk_idx, topk_weights)
        data, sf = (x[0], x[1]) if isinstance(x, (tuple, list)) else (x, None)
        with timed(self._kernel("dispatch_impl")):
            out = self._ep.dispatch(to_numpy(data, "x"), None if sf is None else to_numpy(sf, "x scales"),
                                    to_numpy(topk_idx, "topk_idx"), to_numpy(topk_weights, "topk_weights"),
                                    max_tokens, int(num_experts))
        with timed("dispatch_copy_epilogue_impl"):
            result = self._dispatch_outputs(out, int(num_experts), max_tokens, alignment, bool(do_expand),
                                            do_cpu_sync is not False or cached, bool(use_tma_aligned_col_major_sf),
                                            topk_weights is not None)
        if cumulative_local_expert_recv_stats is not None:
            stats = to_numpy(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats")
            stats += result["unaligned"].astype(stats.dtype)
        recv_x = conv.out((result["x"], result["sf"])) if sf is not None else conv.out(result["x"])
        recv_topk_idx = None if do_expand else conv.out(result["topk_idx"])
        recv_w = conv.out(result["weights"]) if topk_weights is not None else None
        if handle is None:
            kept = topk_idx.clone() if do_handle_copy and is_torch(topk_idx) else \
                np.array(topk_idx, copy=True) if do_handle_copy else topk_idx
            handle = _new_handle(conv, out, result, bool(do_expand), int(num_experts), alignment, max_tokens, num_sms,
                                 kept)
        return recv_x, recv_topk_idx, recv_w, handle, event

    def _check_routing(self, topk_idx, num_experts: int | None, num_max_tokens_per_rank: int | None,
                       expert_alignment: int | None) -> tuple[int, int]:
        """(max tokens per rank, expert alignment) of a dispatch; ValueError for what DeepEP refuses too."""
        if topk_idx is None or num_experts is None:
            raise ValueError("dispatch: topk_idx and num_experts are required without a handle")
        max_tokens = int(num_max_tokens_per_rank or self.num_max_tokens_per_rank)
        if max_tokens < 1:
            raise ValueError("dispatch: num_max_tokens_per_rank is required (here or at construction)")
        if num_experts % self.num_ranks:
            raise ValueError(f"dispatch: num_experts {num_experts} is not a multiple of the {self.num_ranks} ranks")
        return max_tokens, int(expert_alignment or 1)

    def _kernel(self, name: str) -> str:
        """DeepEP's kernel name: ``hybrid_`` + name on the hybrid route."""
        return f"hybrid_{name}" if self.num_scaleout_ranks > 1 else name

    def _dispatch_outputs(self, out: dict, num_experts: int, max_tokens: int, alignment: int, expand: bool,
                          exact: bool, col_major_sf: bool, with_weights: bool) -> dict:
        """The V2 layout of the received rows (see ``dispatch``)."""
        local = num_experts // self.num_ranks
        idx, n = out["topk_idx"], len(out["topk_idx"])
        k = idx.shape[1]
        hits = (idx[:, :, None] == np.arange(local)).any(1)  # [n, E_loc]
        unaligned = hits.sum(0).astype(np.int32)
        aligned = np.array([_align(c, alignment) for c in unaligned], np.int64)
        psum_rank = np.cumsum(out["per_block"])  # rows from each scale-up peer (each rank, or each forwarder)
        metadata = np.full((n, 2 + k), -1, np.int32)
        metadata[:, 0] = out["src"]
        metadata[:, 1] = out["src"] // max_tokens
        res = {"unaligned": unaligned, "aligned": aligned, "num_recv": n, "psum_rank": psum_rank.astype(np.int32)}
        worst = self.num_ranks * max_tokens  # the rows DeepEP allocates without the CPU sync
        if not expand:
            rows = n if exact else max(worst, n)
            res["x"] = _pad(out["x"], rows)
            res["sf"] = None if out["sf"] is None else _pad(out["sf"], rows)
            res["topk_idx"] = _pad(idx, rows, -1)
            res["weights"] = _pad(out["topk_weights"], rows)
            res["metadata"] = metadata if exact else _pad(metadata, rows, -1)
            res["psum_expert"] = np.cumsum(aligned).astype(np.int32)
            res["num_expanded"] = n
            return res
        starts = np.zeros(local, np.int64)
        psum = np.zeros(local, np.int64)
        cursor = 0
        for e in range(local):
            starts[e] = _align(cursor, alignment)
            psum[e] = starts[e] + unaligned[e]
            cursor = psum[e]
        total = int(_align(cursor, alignment))
        rows = total if exact else max(total, _align(worst * min(k, local), alignment))
        x = np.zeros((rows, out["x"].shape[1]), out["x"].dtype)
        sf = None
        if out["sf"] is not None:
            sf = np.zeros((out["sf"].shape[1], rows), out["sf"].dtype).T if col_major_sf else \
                np.zeros((rows, out["sf"].shape[1]), out["sf"].dtype)
        weights = np.zeros(rows, np.float32)
        for e in range(local):
            toks, slots = np.nonzero(idx == e)  # (row, top-k slot) pairs of expert e, in row order
            first = np.unique(toks, return_index=True)[1]
            toks, slots = toks[first], slots[first]
            where = starts[e] + np.arange(len(toks))
            x[where] = out["x"][toks]
            if sf is not None:
                sf[where] = out["sf"][toks]
            weights[where] = out["topk_weights"][toks, slots]
            metadata[toks, 2 + slots] = where
        res.update(x=x, sf=sf, topk_idx=None, weights=weights, metadata=metadata,
                   psum_expert=psum.astype(np.int32), num_expanded=int(cursor))
        return res

    def combine(self, x: TensorLike, handle: EPHandle, topk_weights: TensorLike=None, bias: TensorLike=None, num_sms: int = 0, num_qps: int = 0,
                previous_event: Any=None, previous_event_before_epilogue: Any=None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple:
        """DeepEP V2's combine (collective): every received row back to its token, summed there with the bias.

        Args:
            x: ``[n, H] bfloat16`` aligned with the dispatch's rows (expanded: one row per slot).
            handle: the dispatch's ``EPHandle``.
            topk_weights: ``[n, K] float32`` (expanded: ``[rows]``) or None.
            bias: None, one ``[T, H] bfloat16`` or a pair.

        Returns:
            ``(combined_x [T, H] bfloat16, combined_topk_weights [T, K] float32 or None, event)``.
        """
        self._check_alive("combine")
        event = _event(previous_event, async_with_compute_stream, allocate_on_comm_stream)
        if not isinstance(handle, EPHandle) or handle.per_block is None:
            raise TypeError(f"combine: handle must be the EPHandle of a dispatch on this buffer, got "
                            f"{type(handle).__name__}")
        conv = Converter(x, topk_weights)
        rows = to_numpy(x, "x")
        meta = to_numpy(handle.recv_src_metadata)[:handle.num_recv_tokens]
        n = handle.num_recv_tokens
        k = meta.shape[1] - 2
        if handle.do_expand:
            partial, weights = self._reduce_expanded(rows, meta, to_numpy(topk_weights, "topk_weights"), k,
                                                     self._ep.wide)
        else:
            partial = _at_last_slot(rows[:n], handle.local_slots) if self._ep.wide else \
                np.ascontiguousarray(rows[:n]).astype(bf16, copy=False)
            w = to_numpy(topk_weights, "topk_weights")
            weights = np.zeros((n, k), np.float32) if w is None else np.asarray(w[:n], np.float32).copy()
            weights[~handle.local_slots] = 0  # (the other slots' weights come back from their ranks)
        bias_sum = _bias_sum(bias)
        with timed(self._kernel("combine_impl")):
            combined, combined_w = self._ep.combine(partial, weights, handle.per_block, to_numpy(handle.topk_idx),
                                                    to_numpy(handle.dst_buffer_slot_idx), handle.num_experts,
                                                    bias_sum, handle.forward)
        with timed("combine_reduce_epilogue_impl"):
            pass  # (the reduction ran inside the combine above: it needs every rank's rows)
        return conv.out(combined), (conv.out(combined_w) if topk_weights is not None else None), event

    @staticmethod
    def _reduce_expanded(rows: np.ndarray, meta: np.ndarray, w, k: int, wide: bool):
        """Each received token's local slots summed in top-k order (float32, rounded once), or (``wide``: no
        multiple reduction) each slot's row in its place ``[n, K, H]``; the slots' weights."""
        n, hidden = len(meta), rows.shape[1]
        acc = np.zeros((n, k, hidden) if wide else (n, hidden), np.float32)
        weights = np.zeros((n, k), np.float32)
        for j in range(k):
            slot = meta[:, 2 + j]
            ok = slot >= 0
            if ok.any():
                if wide:
                    acc[ok, j] = rows[slot[ok]].astype(np.float32)
                else:
                    acc[ok] += rows[slot[ok]].astype(np.float32)
                if w is not None:
                    weights[ok, j] = np.asarray(w, np.float32)[slot[ok]]
        return acc.astype(bf16), weights

    # --- pipeline parallel -------------------------------------------------------------------------------------

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Make the PP channels (collective; a barrier)."""
        self._check_alive("pp_set_config")
        need = self.get_pp_buffer_size_hint(num_max_tensor_bytes, num_max_inflight_tensors) // 2
        if need > self.num_bytes:
            raise ValueError(f"pe {self.rank_idx}: pp_set_config: needs {need} B, num_bytes is {self.num_bytes}")
        if self._pp is not None:
            self._pp.close()
        self._pp = PipeChannels(self.rank_idx, self.num_ranks, int(num_max_tensor_bytes),
                                int(num_max_inflight_tensors))

    def _pipes(self, call: str) -> PipeChannels:
        self._check_alive(call)
        if self._pp is None:
            raise RuntimeError(f"pe {self.rank_idx}: {call}: call pp_set_config first")
        return self._pp

    def pp_send(self, t: TensorLike, dst_rank_idx: int, num_sms: int = 0) -> None:
        """Send ``t`` (contiguous) to a ring neighbour; returns once it is in the peer's slot."""
        pipes = self._pipes("pp_send")
        with timed("send_impl"):
            pipes.send(to_numpy(t, "t"), int(dst_rank_idx))

    def pp_recv(self, t: TensorLike, src_rank_idx: int, num_sms: int = 0) -> None:
        """Receive the next tensor from a ring neighbour into ``t`` (in place)."""
        pipes = self._pipes("pp_recv")
        with timed("recv_impl"):
            pipes.recv(to_numpy(t, "t"), int(src_rank_idx))

    # --- all-gather sessions -----------------------------------------------------------------------------------

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """Make the AGRS region (collective; a barrier)."""
        self._check_alive("agrs_set_config")
        if num_max_session_bytes > self.num_bytes:
            raise ValueError(f"pe {self.rank_idx}: agrs_set_config: {num_max_session_bytes} B per session, more "
                             f"than num_bytes={self.num_bytes}")
        if self._agrs is not None:
            self._agrs.close()
        self._agrs = Sessions(self.rank_idx, self.num_ranks, num_max_session_bytes, num_max_all_gathers_per_session)

    def _sessions(self, call: str) -> Sessions:
        self._check_alive(call)
        if self._agrs is None:
            raise RuntimeError(f"pe {self.rank_idx}: {call}: call agrs_set_config first")
        return self._agrs

    def create_agrs_session(self) -> None:
        self._sessions("create_agrs_session").create()

    def destroy_agrs_session(self) -> None:
        self._sessions("destroy_agrs_session").destroy()

    @contextmanager
    def agrs_new_session(self, enabled: bool = True) -> Any:
        if not enabled:
            yield
            return
        self.create_agrs_session()
        try:
            yield
        finally:
            self.destroy_agrs_session()

    def agrs_get_inplace_tensor(self, shapes: Any, dtype: Any) -> Any:
        """This rank's slot of the next all-gather(s) of these shapes, as tensors to fill (no copy then)."""
        sessions = self._sessions("agrs_get_inplace_tensor")
        batched = isinstance(shapes[0], (tuple, list)) or _is_size(shapes[0])
        shapes = tuple(shapes) if batched else (shapes,)
        places = sessions.slots([math.prod(s) * _itemsize(dtype) for s in shapes], "agrs_get_inplace_tensor")
        out = tuple(_typed(sessions.mine(off, size), dtype, tuple(s)) for (off, size), s in zip(places, shapes))
        return out if batched else out[0]

    def all_gather(self, t: TensorLike) -> Any:
        """All-gather ``t`` (or each tensor of a sequence) in the open session: ``(gathered [P, *shape], handle)``
        or ``(*gathered, handle)``; call ``handle()`` before reading them."""
        sessions = self._sessions("all_gather")
        single = not isinstance(t, (tuple, list))
        tensors = [t] if single else list(t)
        with timed("all_gather"):
            outs, indices = sessions.gather([to_numpy(x, "t") for x in tensors])
        gathered = [_typed(o, x.dtype, (self.num_ranks, *tuple(x.shape))) for o, x in zip(outs, tensors)]

        def handle() -> None:
            with timed("all_gather"):
                sessions.wait(indices)

        return (gathered[0], handle) if single else (*gathered, handle)

    # --- Engram ------------------------------------------------------------------------------------------------

    def engram_write(self, storage: TensorLike, sf: TensorLike=None) -> None:
        """Store this rank's entries ``[num_entries, hidden]`` (collective; barriers before and after)."""
        self._check_alive("engram_write")
        data = to_numpy(storage, "storage")
        rows = np.ascontiguousarray(data).view(np.uint8).reshape(len(data), -1)
        if self._engram is None or self._engram.entries != len(data) or self._engram.row_bytes != rows.shape[1]:
            if self._engram is not None:
                self._engram.close()
            fetch_rows = max((self.num_bytes - self.num_cpu_bytes) // rows.shape[1], 1)  # DeepEP's GPU part
            self._engram = Engram(self.rank_idx, self.num_ranks, len(data), rows.shape[1], fetch_rows)
        self._engram_dtype, self._engram_hidden, self._engram_sf = data.dtype, data.shape[1], \
            None if sf is None else to_numpy(sf, "sf")
        self._engram_kind = Converter(storage)
        self._engram.write(rows)

    def engram_fetch(self, indices: TensorLike, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False) -> Any:
        """READ the entries ``indices [T, k] int32`` from their ranks; returns a hook giving ``(data [T, k * hidden]
        (each token's entries concatenated), sf [T, k * packs] or None)``."""
        self._check_alive("engram_fetch")
        if self._engram is None:
            raise RuntimeError(f"pe {self.rank_idx}: engram_fetch: call engram_write first")
        idx = to_numpy(indices, "indices").astype(np.int64)
        with timed("engram_fetch_impl"):
            area = self._engram.fetch(idx.reshape(-1))

        def hook():
            with timed("engram_fetch_wait_impl"):
                self._engram.quiet()
            data = area.copy().view(self._engram_dtype).reshape(idx.shape[0], -1)
            sf = None
            if self._engram_sf is not None:
                sf = self._engram_sf[idx.reshape(-1)].reshape(idx.shape[0], -1)
                if use_tma_aligned_col_major_sf:
                    sf = np.asfortranarray(sf)
            return self._engram_kind.out(data), self._engram_kind.out(sf)

        return hook


def _domains(n: int, hybrid: bool) -> tuple[int, int]:
    """``(scale-out, scale-up)`` ranks of a job of ``n``: its servers of ``SHMEMX_SERVER_SIZE`` ranks (default 8)
    with ``hybrid``, else ``(1, n)``."""
    nvl = min(int(os.environ.get(SERVER_SIZE_ENV) or NUM_MAX_NVL_PEERS), n)
    return (n // nvl, nvl) if hybrid else (1, n)


def _is_size(x) -> bool:
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Size)


def _itemsize(dtype) -> int:
    return dtype.itemsize if hasattr(dtype, "itemsize") and not isinstance(dtype, type) else np.dtype(dtype).itemsize


def _typed(raw: np.ndarray, dtype, shape: tuple):
    """``raw`` (heap bytes) as a tensor of ``dtype`` and ``shape``: torch for a torch dtype, else numpy."""
    torch = torch_module()
    if torch is not None and isinstance(dtype, torch.dtype):
        return torch.from_numpy(raw).view(dtype).view(shape) if raw.size else torch.empty(shape, dtype=dtype)
    return raw.view(np.dtype(dtype)).reshape(shape)


def _pad(a: np.ndarray, rows: int, fill=0) -> np.ndarray:
    if len(a) >= rows:
        return a
    out = np.full((rows, *a.shape[1:]), fill, a.dtype)
    out[:len(a)] = a
    return out


def _at_last_slot(rows: np.ndarray, local_slots: np.ndarray) -> np.ndarray:
    """``[n, K, H] bfloat16``: each token's row (the caller's sum over its local slots) at its last local slot."""
    n, k = local_slots.shape
    out = np.zeros((n, k, rows.shape[1]), bf16)
    last = k - 1 - np.argmax(local_slots[:, ::-1], axis=1)
    out[np.arange(n), last] = rows
    return out


def _bias_sum(bias):
    if bias is None:
        return None
    parts = bias if isinstance(bias, (tuple, list)) else (bias,)
    total = None
    for b in parts:
        v = to_numpy(b, "bias").astype(np.float32)
        total = v if total is None else total + v
    return total


def _cached_routing(handle: EPHandle, topk_idx, do_cpu_sync: bool | None, num_experts: int | None,
                    expert_alignment: int | None, num_max_tokens_per_rank: int | None) -> tuple:
    """A cached dispatch's routing: the handle's (topk_idx, num_experts, expert_alignment, max tokens per rank),
    after refusing what DeepEP refuses (a topk_idx, a CPU sync, a setting that differs from the handle's)."""
    if topk_idx is not None:
        raise ValueError("dispatch: a cached dispatch (handle given) takes no topk_idx (the handle's is used)")
    if do_cpu_sync:
        raise ValueError("dispatch: cannot do CPU sync with a cached handle (as in DeepEP)")
    for name, value in (("num_experts", num_experts), ("expert_alignment", expert_alignment),
                        ("num_max_tokens_per_rank", num_max_tokens_per_rank)):
        if value is not None and value != getattr(handle, name):
            raise ValueError(f"dispatch: {name}={value} differs from the handle's {getattr(handle, name)}")
    return handle.topk_idx, handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank


def _new_handle(conv: Converter, out: dict, result: dict, expand: bool, num_experts: int, alignment: int,
                max_tokens: int, num_sms: int, topk_idx) -> EPHandle:
    """The EPHandle of a fresh dispatch: its routing and the layout of what it received."""
    handle = EPHandle(expand, num_experts, alignment, max_tokens, num_sms, topk_idx, result["num_recv"],
                      result["num_expanded"], result["aligned"].tolist(), conv.out(result["psum_rank"]),
                      conv.out(result["psum_expert"]), conv.out(result["unaligned"]), conv.out(result["metadata"]),
                      conv.out(out["slot"]))
    handle.per_block, handle.local_slots, handle.forward = out["per_block"], out["topk_idx"] >= 0, out["forward"]
    if out["forward"] is not None:
        fwd = out["forward"]
        handle.token_metadata_at_forward = conv.out(np.column_stack([fwd.src, fwd.pos]).astype(np.int32))
    return handle

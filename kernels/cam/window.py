"""The emulated HCCL window context (``HcclOpResParam``) and the seed's window address helpers.

On the device, HCCL allocates per communicator and per rank an input window (``localWindowsIn``, ``winSize``
bytes, set by the ``HCCL_BUFFSIZE`` environment variable in MB), a reserved output window and an extension window
(``localWindowsExp``), and gives each rank the addresses of every peer's windows (``remoteRes[r]`` ->
``HcclRankRelationResV2 {windowsIn, windowsOut, windowsExp}``). The CAM kernels address everything by fixed
offsets into these windows; nothing is allocated per call. Here a window is a symmetric heap allocation, and a
peer's window is its ``aclshmem_ptr`` view: loads and stores through it are MTE accesses to the peer's memory.

Memory map of one In window (``W = winSize``; half ``p`` is selected by dispatch's ``dataState`` and combine's
``magic``; offsets from the window base)::

    p*W/2                         notify_dispatch area        NOTIFY_DISPATCH_BUFF_OFFSET = 204 MB
    p*W/2 + 204 MB                combine flag area           COMBINE_STATE_WIN_OFFSET = 4 MB, 32 B per (t, k)
    p*W/2 + 208 MB                combine data area           maxBs*K rows of h512AlignRecvXLen
    p*W/2 + 208 MB + combineArea  dispatch data area          bs*K rows of hOutGMAlignSize (the sender's own rows)

and of the Exp window (1 MB here; the seed leaves ``winExpSize`` open)::

    0                  dispatch flag area, half 0      32 B per (local expert, source rank)
    500 KB             dispatch flag area, half 1      WIN_STATE_OFFSET
    950 KB + 512*b     dataState word of AIV block b   STATE_WIN_OFFSET
    975 KB + 512*b     combine magic word of block b   MAGIC_WIN_OFFSET

Windows are allocated without pre-faulting (the heap is a sparse /dev/shm file), so the 204 MB notify areas and
the unused tail of each half cost nothing; only the Exp window and the two combine flag areas are zeroed at
creation (flags must start at 0, and the ping-pong words must start at half 0). The context lives across calls:
the dataState and magic words in it carry the ping-pong state from one call to the next.

Across hosts (``shmemx run --hosts``) a rank of another host has no views here (``HcclOpResParam.near`` is
False): the kernels reach its windows over UDMA at the same offsets (``far``), as CAM does across servers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

import shmemx

from .constants import (COMBINE_STATE_WIN_OFFSET, COMM_EP_IDX, HCCL_BUFFSIZE_DEFAULT_MB,
                        MAGIC_WIN_OFFSET, MAX_AIV_NUM, MB, NOTIFY_DISPATCH_BUFF_OFFSET, STATE_WIN_OFFSET,
                        WIN_ADDR_ALIGN, WIN_EXP_SIZE, WIN_STATE_OFFSET)

__all__ = ["HcclRankRelationResV2", "HcclOpResParam", "WindowContext", "flip_half", "hccl_buffsize_mb"]


def flip_half(word: np.ndarray) -> int:
    """The ping-pong half (0 or 1) a block uses in this call, read from ``word[0]`` (``[1] int32``: its dataState
    or magic word), which is flipped for its next call (the seeds' Init / InitMagic)."""
    half = int(word[0])
    word[0] = 1 if half == 0 else 0
    return half


def hccl_buffsize_mb(value: int | None = None) -> int:
    """The window size in MB: ``value``, else the ``HCCL_BUFFSIZE`` environment variable, else 200 (the seed's
    default)."""
    if value is None:
        env = os.environ.get("HCCL_BUFFSIZE")
        if env is None:
            return HCCL_BUFFSIZE_DEFAULT_MB
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"HCCL_BUFFSIZE={env!r} is not an integer number of MB") from None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"hccl_buffsize must be a positive number of MB, got {value!r}")
    return int(value)


@dataclass
class HcclRankRelationResV2:
    """One rank's windows as another rank sees them (``remoteRes[r].nextDevicePtr``).

    Attributes:
        windows_in: ``[winSize] uint8`` view of rank r's input window; None when rank r is on another host (its
            windows are reached over UDMA: ``far``).
        windows_out: reserved by HCCL ("预留"); never touched by these kernels, so None here.
        windows_exp: ``[WIN_EXP_SIZE] uint8`` view of rank r's extension window (None: another host).
    """

    windows_in: np.ndarray | None
    windows_exp: np.ndarray | None
    windows_out: None = None


@dataclass
class HcclOpResParam:
    """The window resources of one communication domain on this PE (``GetHcclContext<id>()``).

    Attributes:
        rank_id: this PE's rank in the domain.
        rank_size: ranks in the domain.
        pes: the shmemx PE of each domain rank (``[rank_size]``).
        win_size: ``winSize`` in bytes (``HCCL_BUFFSIZE`` MB).
        local_windows_in, local_windows_exp: this PE's windows (``[win_size]`` / ``[WIN_EXP_SIZE]`` uint8).
        remote_res: per domain rank, its windows as views from this PE (the own entry is the local windows).
    """

    rank_id: int
    rank_size: int
    pes: list[int]
    win_size: int
    local_windows_in: np.ndarray
    local_windows_exp: np.ndarray
    remote_res: list[HcclRankRelationResV2] = field(default_factory=list)
    local_windows_out: None = None

    def near(self, rank_id: int) -> bool:
        """Whether rank ``rank_id``'s windows are mapped here (the same host: MTE loads and stores reach them);
        a rank of another host is reached over UDMA (``far``)."""
        return self.remote_res[rank_id].windows_in is not None

    @property
    def any_far(self) -> bool:
        """Whether some rank of the domain is on another host (a job of several hosts)."""
        return not all(map(self.near, range(self.rank_size)))

    def windows_in(self, rank_id: int) -> np.ndarray:
        """``[win_size] uint8``: the own ``localWindowsIn`` for ``rank_id == self.rank_id``, else the remote one."""
        if rank_id == self.rank_id:
            return self.local_windows_in
        return self._mapped(rank_id).windows_in

    def windows_exp(self, rank_id: int) -> np.ndarray:
        """``[WIN_EXP_SIZE] uint8``: the own ``localWindowsExp`` or rank ``rank_id``'s ``windowsExp``."""
        if rank_id == self.rank_id:
            return self.local_windows_exp
        return self._mapped(rank_id).windows_exp

    def _mapped(self, rank_id: int) -> HcclRankRelationResV2:
        res = self.remote_res[rank_id]
        if res.windows_in is None:
            raise shmemx.OtherHostError(f"pe {self.pes[self.rank_id]}: rank {rank_id} (pe {self.pes[rank_id]}) is on "
                                        f"another host: its windows are not mapped here; CAM reaches them over "
                                        f"UDMA (kernels/cam/far.py)")
        return res


def _allocate_domain(rank_id: int, pes: list[int], win_size: int, label: str) -> HcclOpResParam:
    """Allocate one domain's windows on every PE (collective) and build this PE's view of them."""
    win_in = shmemx.aclshmem_malloc(win_size, name=f"HCCL windowsIn {label}", prefault=False)
    win_exp = shmemx.aclshmem_malloc(WIN_EXP_SIZE, name=f"HCCL windowsExp {label}", prefault=True)
    win_exp.fill(0)
    for half in (0, 1):  # the combine flag areas must start at 0 (only the part inside the window exists)
        lo = half * (win_size // 2) + NOTIFY_DISPATCH_BUFF_OFFSET
        hi = min(lo + COMBINE_STATE_WIN_OFFSET, win_size)
        if lo < hi:
            win_in[lo:hi] = 0
    res = HcclOpResParam(rank_id=rank_id, rank_size=len(pes), pes=list(pes), win_size=win_size,
                         local_windows_in=win_in, local_windows_exp=win_exp)
    for r, pe in enumerate(pes):
        if r == rank_id:
            res.remote_res.append(HcclRankRelationResV2(win_in, win_exp))
        else:
            res.remote_res.append(HcclRankRelationResV2(_peer_view(win_in, pe), _peer_view(win_exp, pe)))
    return res


def _peer_view(arr: np.ndarray, pe: int) -> np.ndarray | None:
    """``aclshmem_ptr(arr, pe)``, or None when ``pe`` is on another host (its memory is not mapped here)."""
    try:
        return shmemx.aclshmem_ptr(arr, pe)
    except shmemx.OtherHostError:
        return None


class WindowContext:
    """The HCCL op resources of the EP domain (all PEs) and, with ``tp_world_size == 2``, a TP domain.

    Collective: every PE creates it with the same arguments, and keeps it for all calls of the kernels (the
    ping-pong state lives in its Exp windows). The heap must hold ``hccl_buffsize`` MB + 1 MB per domain.

    Args:
        hccl_buffsize: window size in MB (``HCCL_BUFFSIZE``); default the environment variable, else 200.
        tp_world_size: 0 or 1 (no TP domain) or 2 (TP pairs of consecutive PEs: ranks ``2i`` and ``2i+1``).
            The kernels validate the TP attributes and can address the TP windows, but move no data over them
            (the seed has no TP data path; README, ambiguity A16).
        aiv_num: AIV blocks per kernel launch (``aivNum``), 1..50 (the dataState region holds 50 block slots).

    Attributes:
        ep, tp: ``HcclOpResParam`` of each domain (``tp`` is None without a TP domain).
        win_context: ``[ep, tp]``, indexed by ``COMM_EP_IDX`` / ``COMM_TP_IDX`` as ``winContext_`` is.
        aiv_num, tp_world_size, hccl_buffsize_mb, total_win_size (bytes).
    """

    def __init__(self, *, hccl_buffsize: int | None = None, tp_world_size: int = 0, aiv_num: int = 2):
        me, n = shmemx.my_pe(), shmemx.n_pes()
        self.hccl_buffsize_mb = hccl_buffsize_mb(hccl_buffsize)
        self.total_win_size = self.hccl_buffsize_mb * MB
        if isinstance(aiv_num, bool) or not isinstance(aiv_num, (int, np.integer)) or not 1 <= aiv_num <= MAX_AIV_NUM:
            raise ValueError(f"pe {me}: WindowContext: aiv_num {aiv_num!r} out of range 1..{MAX_AIV_NUM} (the Exp "
                             f"window's dataState region [950 KB, 975 KB) holds {MAX_AIV_NUM} 512 B block slots)")
        if tp_world_size not in (0, 1, 2):
            raise ValueError(f"pe {me}: WindowContext: tpWorldSize is invalid, only support [0, 2], but got "
                             f"tpWorldSize={tp_world_size}.")
        if tp_world_size == 2 and n % 2:
            raise ValueError(f"pe {me}: WindowContext: tp_world_size 2 pairs PEs (2i, 2i+1), but the job has {n} "
                             f"PEs")
        self.aiv_num = int(aiv_num)
        self.tp_world_size = int(tp_world_size)
        self.ep = _allocate_domain(me, list(range(n)), self.total_win_size, "EP")
        self.tp = None
        if tp_world_size == 2:
            self.tp = _allocate_domain(me % 2, [me - me % 2, me - me % 2 + 1], self.total_win_size, "TP")
        self.win_context = [self.ep, self.tp]
        self.notify_calls = 0  # notify_dispatch alternates between the notify areas of the two halves
        self._closed = False
        shmemx.aclshmem_barrier_all()  # every PE's flags are zero before any PE's kernel writes into them

    @property
    def ep_rank_id(self) -> int:
        return self.ep.rank_id

    @property
    def ep_world_size(self) -> int:
        return self.ep.rank_size

    @property
    def tp_rank_id(self) -> int:
        return 0 if self.tp is None else self.tp.rank_id

    def context(self, ctx_idx: int) -> HcclOpResParam:
        """``winContext_[ctx_idx]``; ValueError for the TP index without a TP domain."""
        res = self.win_context[ctx_idx]
        if res is None:
            raise ValueError(f"pe {self.ep.rank_id}: no TP window context (tp_world_size {self.tp_world_size})")
        return res

    # --- per-block ping-pong words (local Exp window) ----------------------------------------------------------

    def data_state_word(self, block_idx: int) -> np.ndarray:
        """``[1] int32``: block ``block_idx``'s dataState at ``localWindowsExp + STATE_WIN_OFFSET + b*512``."""
        off = STATE_WIN_OFFSET + block_idx * WIN_ADDR_ALIGN
        return self.ep.local_windows_exp[off:off + 4].view(np.int32)

    def magic_word(self, block_idx: int) -> np.ndarray:
        """``[1] int32``: block ``block_idx``'s combine magic at ``localWindowsExp + MAGIC_WIN_OFFSET + b*512``."""
        off = MAGIC_WIN_OFFSET + block_idx * WIN_ADDR_ALIGN
        return self.ep.local_windows_exp[off:off + 4].view(np.int32)

    # --- the seed's address helpers, as byte offsets and views -------------------------------------------------

    def dispatch_data_offset(self, data_state: int, win_data_size_offset_extra: int) -> int:
        """Offset of the dispatch data area in an In window: ``winDataSizeOffset + 4 MB + 204 MB`` where
        ``winDataSizeOffset = dataState * W/2 + globalBs / R * K * hSizeAlignCombine`` (the extra term)."""
        win_data_size_offset = data_state * (self.total_win_size // 2) + win_data_size_offset_extra
        return win_data_size_offset + COMBINE_STATE_WIN_OFFSET + NOTIFY_DISPATCH_BUFF_OFFSET

    def get_wind_addr_by_rank_id(self, ctx_idx: int, rank_id: int, offset: int, nbytes: int) -> np.ndarray:
        """``GetWindAddrByRankId`` (+ ``offset``): ``[nbytes] uint8`` of rank ``rank_id``'s In window."""
        return self.context(ctx_idx).windows_in(rank_id)[offset:offset + nbytes]

    def get_wind_state_addr_by_rank_id(self, ctx_idx: int, rank_id: int, data_state: int,
                                       nbytes: int) -> np.ndarray:
        """``GetWindStateAddrByRankId``: ``[nbytes] uint8`` at ``windowsExp + dataState * WIN_STATE_OFFSET``."""
        off = data_state * WIN_STATE_OFFSET
        return self.context(ctx_idx).windows_exp(rank_id)[off:off + nbytes]

    def get_state_addr_by_rank_id(self, rank_id: int, magic: int, nbytes: int) -> np.ndarray:
        """Combine's ``GetStateAddrByRankId``: ``[nbytes] uint8`` at ``windowsIn + magic*W/2 + 204 MB``."""
        off = magic * (self.total_win_size // 2) + NOTIFY_DISPATCH_BUFF_OFFSET
        return self.ep.windows_in(rank_id)[off:off + nbytes]

    def get_buffer_addr_by_rank_id(self, rank_id: int, magic: int, nbytes: int) -> np.ndarray:
        """Combine's ``GetBufferAddrByRankId``: ``GetStateAddrByRankId + COMBINE_STATE_WIN_OFFSET``."""
        off = magic * (self.total_win_size // 2) + NOTIFY_DISPATCH_BUFF_OFFSET + COMBINE_STATE_WIN_OFFSET
        return self.ep.windows_in(rank_id)[off:off + nbytes]

    def prefault(self, global_bs: int, k: int, h: int, *, out_size: int = 2, x_size: int = 2) -> None:
        """Map, in this process, the window pages the kernels of this shape store into or load from: every EP
        rank's combine data and dispatch data areas, both halves (``shmemx.prefault``).

        On the device there are no page faults. Here a process maps a peer's window page by page on first touch,
        and since routing changes every call, a (token, k) row lands on pages this process has not touched yet
        for dozens of calls (~6000 minor faults per pair and rank at T=512, K=8, H=7168). Benchmarks call this
        once, like a warm-up. The notify areas and the tails of the halves stay untouched (they cost nothing).
        """
        from .tiling import DispatchLayout

        lay = DispatchLayout(h, out_size, x_size)
        max_rows = global_bs // self.ep_world_size * k
        combine_area = max_rows * lay.h_size_align_combine
        for rank in filter(self.ep.near, range(self.ep_world_size)):  # (a far rank's windows: not mapped here)
            for half in (0, 1):
                shmemx.prefault(self.get_buffer_addr_by_rank_id(rank, half, max_rows * lay.h512_align_recv_x_len))
                shmemx.prefault(self.get_wind_addr_by_rank_id(COMM_EP_IDX, rank,
                                                             self.dispatch_data_offset(half, combine_area),
                                                             max_rows * lay.h_out_gm_align_size))

    # --- lifecycle ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the windows (collective, idempotent)."""
        if self._closed:
            return
        self._closed = True
        shmemx.aclshmem_barrier_all()  # no peer may still read or write our windows
        for res in (self.tp, self.ep):
            if res is not None:
                shmemx.aclshmem_free(res.local_windows_exp)
                shmemx.aclshmem_free(res.local_windows_in)

    def __enter__(self) -> "WindowContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        tp = f", tp rank {self.tp.rank_id}/2" if self.tp is not None else ""
        return (f"WindowContext(ep rank {self.ep.rank_id}/{self.ep.rank_size}{tp}, "
                f"HCCL_BUFFSIZE={self.hccl_buffsize_mb}MB, aiv_num={self.aiv_num})")

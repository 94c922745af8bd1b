"""The symmetric workspace of a ``Buffer``: one heap allocation cut into regions by a cursor.

As in ascend_deepep's ``MakeDispatchWorkspaceLayout``, a cursor walks one symmetric allocation and appends
non-overlapping regions, each aligned to 512 bytes, so that every PE finds a region at the same offset in every
peer's workspace. S is ``max_tokens``, P the number of PEs, C the channels, K ``num_topk``, E_loc the local
experts, Hs = ceil(hidden / 128) scale columns, Q ``qp_num``:

=====================  ==========================  ==========================================================
region                 shape, dtype                written by
=====================  ==========================  ==========================================================
notify                 [P, W] int32                source s (notify): header, its per-rank counts, its counts
                                                   of my local experts, where its channel c starts in its block
notify_signal          [P, 8] uint64               source s: word 0 = call sequence number, after its record
credits                [2, P, 8] int64             peer p: word 0 = last call (0 dispatch, 1 combine) whose
                                                   rows p has consumed; a sender waits for it before reuse
config                 [8] int64                   me: my schedule code, read by peers to check agreement
round_credits          [2, P] int64                groups: word L * rounds + g = the credit of my lane L's
                                                   destination of round g (seq * (rounds + 1) + g)
x                      [S*P, 2*hidden] uint8       dispatch senders: received rows (row = hidden * itemsize)
src_idx                [S*P] int32                 dispatch senders: source token index of each row
topk_idx               [S*P, K] int64              dispatch senders: the token's global experts
topk_weights           [S*P, K] float32            dispatch senders
x_scales               [S*P, Hs] float32           dispatch senders (int8 / float8 payloads)
signals                [2, P, Q, 64] uint64        lane (source, qp): word 0 = completion signal (sequence
                                                   number), words 8..11 = its record (rows, bytes, WQEs, seq)
send_x ... send_scales as x ... x_scales       me: aggregate packing and metadata staging (UDMA sources)
send_record            [P, Q, 8] int64             me: the completion records I send
combine_x              [S*P + 1, hidden] bfloat16  combine senders; the last row stays zero (padding)
combine_weights        [S*P + 1, K] float32        combine senders
=====================  ==========================  ==========================================================

The x, staging and combine regions are S*P rows (every source could send every token here), most of which a
call never touches: the allocation is not pre-faulted, and untouched pages of the heap file cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import numpy.typing as npt

__all__ = ["Region", "WorkspaceLayout", "plan_workspace", "REGION_ALIGN", "NOTIFY_HEADER", "SIGNAL_WORDS",
           "RECORD_WORD"]

REGION_ALIGN = 512
NOTIFY_HEADER = 9  # int32 words of the notify record before the counts
SIGNAL_WORDS = 64  # uint64 words per (source, qp) completion slot: 512 bytes
RECORD_WORD = 8  # the completion record starts at word 8 of the slot (its own cache line)


@dataclass(frozen=True)
class Region:
    """One region of the workspace: ``shape`` of ``dtype`` at byte ``offset``."""

    name: str
    offset: int
    shape: tuple
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class WorkspaceLayout:
    """The regions of a workspace, in cursor order; ``total`` bytes in all."""

    def __init__(self):
        self.regions: dict[str, Region] = {}
        self.total = 0

    def append(self, name: str, shape: tuple[int, ...], dtype: npt.DTypeLike) -> Region:
        shape = tuple(int(s) for s in shape)
        offset = -(-self.total // REGION_ALIGN) * REGION_ALIGN
        region = Region(name, offset, shape, np.dtype(dtype))
        self.regions[name] = region
        self.total = offset + region.nbytes
        return region

    def __getitem__(self, name: str) -> Region:
        return self.regions[name]

    def views(self, block: np.ndarray) -> dict[str, np.ndarray]:
        """Typed views of every region into ``block`` (the uint8 heap allocation)."""
        return {r.name: block[r.offset:r.offset + r.nbytes].view(r.dtype).reshape(r.shape)
                for r in self.regions.values()}

    def describe(self) -> str:
        lines = [f"{'region':<20} {'offset':>12} {'bytes':>12}  shape, dtype"]
        for r in self.regions.values():
            lines.append(f"{r.name:<20} {r.offset:>#12x} {r.nbytes:>12}  {list(r.shape)}, {r.dtype}")
        lines.append(f"{'total':<20} {'':>12} {self.total:>12}")
        return "\n".join(lines)


def notify_words(n_pes: int, num_experts: int, num_channels: int) -> int:
    """int32 words of one notify record (header, P counts, E_loc counts, C channel starts), rounded up to 16 (64
    bytes)."""
    return -(-(NOTIFY_HEADER + n_pes + num_experts // n_pes + num_channels) // 16) * 16


def plan_workspace(*, n_pes: int, max_tokens: int, hidden: int, num_topk: int, num_experts: int,
                   num_channels: int, qp_num: int) -> WorkspaceLayout:
    """The cursor layout of a workspace (see the module docstring)."""
    rows = max_tokens * n_pes
    scale_cols = -(-hidden // 128)
    ws = WorkspaceLayout()
    ws.append("notify", (n_pes, notify_words(n_pes, num_experts, num_channels)), np.int32)
    ws.append("notify_signal", (n_pes, 8), np.uint64)
    ws.append("credits", (2, n_pes, 8), np.int64)
    ws.append("config", (8,), np.int64)
    ws.append("round_credits", (2, n_pes), np.int64)
    ws.append("x", (rows * 2 * hidden,), np.uint8)
    ws.append("src_idx", (rows,), np.int32)
    ws.append("topk_idx", (rows, num_topk), np.int64)
    ws.append("topk_weights", (rows, num_topk), np.float32)
    ws.append("x_scales", (rows, scale_cols), np.float32)
    ws.append("signals", (2, n_pes, qp_num, SIGNAL_WORDS), np.uint64)
    ws.append("send_x", (rows * 2 * hidden,), np.uint8)
    ws.append("send_src_idx", (rows,), np.int32)
    ws.append("send_topk_idx", (rows, num_topk), np.int64)
    ws.append("send_topk_weights", (rows, num_topk), np.float32)
    ws.append("send_x_scales", (rows, scale_cols), np.float32)
    ws.append("send_record", (n_pes, qp_num, 8), np.int64)
    ws.append("combine_x", (rows + 1, hidden), ml_dtypes.bfloat16)
    ws.append("combine_weights", (rows + 1, num_topk), np.float32)
    return ws

"""The symmetric workspace of a ``Buffer``: one heap allocation cut into regions by a cursor.

As in ascend_deepep's ``MakeDispatchWorkspaceLayout``, a cursor walks one symmetric allocation and appends
non-overlapping regions, each aligned to 512 bytes, so that every PE finds a region at the same offset in every
peer's workspace. S is ``max_tokens``, P the number of PEs, C the channels, K ``num_topk``, E_loc the local
experts, Hs = ceil(hidden / 128) scale columns, Q ``qp_num``, R the ``MetaRecord`` width (12 K + 4 bytes, rounded
up to 8):

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
meta                   [S*P * R] uint8             dispatch senders: one ``MetaRecord`` per received row (the
                                                   token's global experts, weights and source index)
x_scales               [S*P, Hs] float32           dispatch senders (int8 / float8 payloads)
signals                [2, P, Q, 64] uint64        lane (source, qp): word 0 = completion signal (sequence
                                                   number), words 8..11 = its record (rows, bytes, WQEs, seq)
send_x ... send_scales as x ... x_scales       me: aggregate packing and metadata staging (UDMA sources)
send_record            [P, Q, 8] int64             me: the completion records I send
combine_x              [S*P + 1, hidden] bfloat16  combine senders; the last row stays zero (padding)
combine_weights        [S*P + 1, K] float32        combine senders
=====================  ==========================  ==========================================================

The x, meta, staging and combine regions are S*P rows (every source could send every token here), most of which
a call never touches: the allocation is not pre-faulted, and untouched pages of the heap file cost nothing.

A dispatch's top-k metadata and source index ride in one record per row (``MetaRecord``), so that a unit's
metadata is one WQE (one contiguous range on both sides) beside its rows' WQE, not three: at 256 PEs the WQEs per
peer are what grows with the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import ml_dtypes
import numpy as np
import numpy.typing as npt

__all__ = ["Region", "WorkspaceLayout", "MetaRecord", "plan_workspace", "REGION_ALIGN", "NOTIFY_HEADER",
           "SIGNAL_WORDS", "RECORD_WORD"]

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


class MetaRecord(NamedTuple):
    """The top-k metadata of one dispatched row as one record of ``width`` bytes: ``topk_idx [K] int64`` at byte
    0, ``topk_weights [K] float32`` after it, then the source token index (int32), the width rounded up to 8
    bytes so that every record's experts are aligned. Records of consecutive rows are consecutive (``rows``): a
    unit's metadata is one range. The width is the Buffer's (its K), the same for every call, with top-k or
    without (a cached dispatch leaves the top-k fields unread): a source's rows of a cached call land on the
    bytes of its rows of the fresh call, as its hidden rows do, which the credit given per source relies on."""

    width: int
    num_topk: int

    @classmethod
    def of(cls, num_topk: int) -> "MetaRecord":
        return cls(-(-(12 * num_topk + 4) // 8) * 8, num_topk)

    def rows(self, region: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """``[hi - lo, width] uint8``: the records of rows [lo, hi) of a ``meta`` region (flat uint8)."""
        return region[lo * self.width:hi * self.width].reshape(hi - lo, self.width)

    def table(self, region: np.ndarray) -> np.ndarray:
        """``[rows, width] uint8``: every record of a ``meta`` region."""
        return self.rows(region, 0, region.size // self.width)

    def pack(self, src_idx: np.ndarray, topk_idx: np.ndarray | None = None,
             topk_weights: np.ndarray | None = None) -> np.ndarray:
        """``[n, width] uint8``: the records of ``n`` rows, a local array; without top-k their source index only,
        the top-k fields zero."""
        recs = np.zeros((len(src_idx), self.width), np.uint8)
        self.src_idx(recs)[:] = src_idx
        if topk_idx is not None:
            self.topk_idx(recs)[:] = topk_idx
            self.topk_weights(recs)[:] = topk_weights
        return recs

    def src_idx(self, recs: np.ndarray) -> np.ndarray:
        """``[n] int32`` view of the records' source token indices."""
        at = 12 * self.num_topk
        return recs[:, at:at + 4].view(np.int32)[:, 0]

    def topk_idx(self, recs: np.ndarray) -> np.ndarray:
        """``[n, K] int64`` view."""
        return recs[:, :8 * self.num_topk].view(np.int64)

    def topk_weights(self, recs: np.ndarray) -> np.ndarray:
        """``[n, K] float32`` view."""
        return recs[:, 8 * self.num_topk:12 * self.num_topk].view(np.float32)


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
    width = MetaRecord.of(num_topk).width
    ws.append("meta", (rows * width,), np.uint8)
    ws.append("x_scales", (rows, scale_cols), np.float32)
    ws.append("signals", (2, n_pes, qp_num, SIGNAL_WORDS), np.uint64)
    ws.append("send_x", (rows * 2 * hidden,), np.uint8)
    ws.append("send_meta", (rows * width,), np.uint8)
    ws.append("send_x_scales", (rows, scale_cols), np.float32)
    ws.append("send_record", (n_pes, qp_num, 8), np.int64)
    ws.append("combine_x", (rows + 1, hidden), ml_dtypes.bfloat16)
    ws.append("combine_weights", (rows + 1, num_topk), np.float32)
    return ws

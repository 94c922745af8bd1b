"""WQEs, CQEs and emulated addresses in words: the one-line decodes and the VA names that dumps, traces and
error messages share.

``format_wqe`` / ``format_cqe`` print every field of a decoded WQE / CQE by name; ``VaNames`` turns an emulated
device VA into ``pe 3 heap +0x1200 ('recv_x'+0x200)``, ``pe 0 amo scratch -> pe 3 qp 1 +0x0`` or ``pe 0 local
0x8000...``. A live rank builds its ``VaNames`` from the control segment's allocation tables, a dump from the
tables it saved, so a saved dump names addresses exactly as a live error message does.
"""

from __future__ import annotations

from collections.abc import Callable

from ..shm.heap import HEAP_VA_BASE, HEAP_VA_STRIDE
from .layout import REDUCE_FLAG, REMOTE_JETTY_TYPE, Cqe, Opcode, Wqe, odr_name, split_flag
from .segment import LOCAL_VA_BASE, UDMA_VA_BASE, UDMA_VA_STRIDE

__all__ = ["format_flag", "format_wqe", "format_cqe", "VaNames"]



def format_flag(flag: int) -> str:
    f = split_flag(flag)
    parts = [f"odr={odr_name(f['odr'])}"] + [name for name in ("fence", "se", "cqe", "reduce") if f[name]]
    return f"{flag:#04x}({','.join(parts)})"


def format_wqe(w: Wqe, describe_va: Callable[[int], str] | None = None) -> str:
    """One line, every field by name. ``describe_va(va)`` may turn a VA into "pe 3 heap +0x1200 ('recv_x'+0x200)"."""
    dva = describe_va or (lambda va: f"{va:#x}")
    text = (f"{w.opcode_name} flag={format_flag(w.flag)} tp_id={w.tp_id:#x} tokenId={w.rmt_seg_id:#x} "
            f"eid={w.rmt_eid:#034x} token={w.rmt_token_value:#010x} remote={dva(w.rmt_va)} len={w.sge_len} "
            f"local={dva(w.sge_va)}")
    if w.opcode == Opcode.WRITE_WITH_NOTIFY:
        text += (f" signal={dva(w.notify_va)} value={w.notify_value:#x} notify_tokenId={w.notify_tid:#x} "
                 f"notify_token={w.notify_token:#010x}")
    elif w.opcode == Opcode.FAA:
        text += f" add={w.operand:#x}"
    elif w.opcode == Opcode.CAS:
        text += f" swap={w.operand:#x} compare={w.compare:#x}"
    if w.flag & REDUCE_FLAG:
        text += f" reduce_dtype={w.reduce_dtype:#x} reduce_op={w.reduce_op:#x}"
    if w.sge_num != 1 or w.rmt_jetty_type != REMOTE_JETTY_TYPE or not w.token_en:
        text += f" sge_num={w.sge_num} jetty_type={w.rmt_jetty_type} token_en={w.token_en}"
    rare = {"sqe_bb_idx": w.sqe_bb_idx, "owner": w.owner, "target_hint": w.target_hint,
            "inline_msg_len": w.inline_msg_len, "sge_token_id": w.sge_token_id}
    text += "".join(f" {name}={value:#x}" for name, value in rare.items() if value)  # shown when not the usual 0
    return text


def format_cqe(c: Cqe) -> str:
    return (f"{c.status_name} substatus={c.substatus} opcode={c.opcode} entry_idx={c.entry_idx:#06x} tpn={c.tpn:#x} "
            f"bytes={c.byte_cnt} wqe_pos={c.user_data} owner={c.owner} eid={c.rmt_eid:#034x}"
            + (f" data={c.data:#x}" if c.data else ""))


class VaNames:
    """Names the emulated device VAs of a job.

    Args:
        n_pes: PEs of the job.
        describe_offset: ``(pe, heap offset) -> "'recv_x'+0x200"`` (or ``"heap+0x1200"`` outside allocations).
        udma: the UDMA segment layout (``UdmaSegment.layout()``), or None when no PE has one.
    """

    def __init__(self, n_pes: int, describe_offset: Callable[[int, int], str], udma: dict | None = None):
        self.n_pes = n_pes
        self.describe_offset = describe_offset
        self.udma = udma

    def describe(self, va: int, local_pe: int | None = None) -> str:
        """``pe 3 heap +0x1200 ('recv_x'+0x200)``, ``pe 0 amo scratch -> pe 3 qp 1 +0x0``, ``pe 0 local 0x..``."""
        if HEAP_VA_BASE <= va < HEAP_VA_BASE + self.n_pes * HEAP_VA_STRIDE:
            pe, off = divmod(va - HEAP_VA_BASE, HEAP_VA_STRIDE)
            name = self.describe_offset(pe, off)
            return f"pe {pe} heap +{off:#x}" + (f" ({name})" if not name.startswith("heap") else "")
        if UDMA_VA_BASE <= va < UDMA_VA_BASE + self.n_pes * UDMA_VA_STRIDE:
            pe, off = divmod(va - UDMA_VA_BASE, UDMA_VA_STRIDE)
            return f"pe {pe} {self._udma_part(off)}"
        if LOCAL_VA_BASE <= va < UDMA_VA_BASE:
            return f"pe {local_pe} local {va:#x}" if local_pe is not None else f"local {va:#x}"
        return f"{va:#x} (unmapped)"

    def _udma_part(self, off: int) -> str:
        u = self.udma
        if u is None:
            return f"udma +{off:#x}"
        qp_num = u["qp_num"]
        for what, base, stride, count in (("amo scratch", u["amo_offset"], 64, u["n_slots"]),
                                          ("SQ", u["sq_offset"], u["sq_bytes"], u["n_slots"]),
                                          ("CQ", u["cq_offset"], u["cq_bytes"], u["n_slots"])):
            if base <= off < base + stride * count:
                index, within = divmod(off - base, stride)
                return f"{what} -> pe {index // qp_num} qp {index % qp_num} +{within:#x}"
        return f"udma +{off:#x}"

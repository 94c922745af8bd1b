"""Binary layouts of the UDMA data plane, declared once: WQE, CQE, op configs, opcodes and statuses.

Faithful to CANN SHMEM's UDMA engine on Ascend 950 (``shmemi_device_udma.h``; see DESIGN.md section 3 and
``reference/cann_shmem_udma.md``). Little-endian; bit fields are numbered from the least significant bit of each
32-bit word. One WQE basic block (BB) is 64 bytes; WRITE, READ and NOP use one BB, WRITE_WITH_NOTIFY, FAA and CAS
two (a two-BB WQE that starts at the last ring slot wraps its second half to the ring start).

=========  ====================================================================================================
bytes      field
=========  ====================================================================================================
0-3        [15:0] sqe_bb_idx, [23:16] flag = odr[2:0] | fence<<3 | se<<4 | cqe<<5 (| 0x80 reduce),
           [28] token_en, [30:29] rmt_jetty_type (=1), [31] owner
4-7        [7:0] target_hint, [15:8] opcode, [31:22] inline_msg_len
8-11       [23:0] tp_id, [31:24] sge_num (=1)
12-15      [19:0] rmt_jetty_or_seg_id: the remote segment's tokenId (not a jetty id on the WRITE path)
16-31      remote EID (128 bit: low u64, high u64)
32-35      remote token value
36-39      [11:8] reduce data type, [15:12] reduce opcode
40-47      remote VA
48-63      WRITE / READ: SGE = length u32, token_id u32 (0), local VA u64
48-95      WRITE_WITH_NOTIFY: notify ctx q0 = tid | token<<32, q1 = signal VA, q2 = signal value, q3 = 0;
           SGE at 80-95
48-..      FAA: SGE (-> fetch scratch) at 48, operand at 64. CAS: SGE at 48, swap at 64, compare at 64+size
=========  ====================================================================================================

CQE (64 bytes): word 0 [0] s_r, [1] is_jetty, [2] owner, [3] inline_en, [6:4] opcode, [7] fd, [23:16]
substatus, [31:24] status; word 1 [15:0] entry_idx (the next-BB counter after the WQE; the poller restores the
SQ tail from it); word 3 [23:0] tpn; word 4 byte_cnt; words 5-6 user_data; words 7-10 remote EID; words 11-12
data. shmemx puts the WQE's BB position (monotonic) in user_data, so a CQE always leads back to its WQE, and the
fetched old value of FAA/CAS in data. Success is status == substatus == 0; the error statuses are shmemx's own
(the hardware's codes are not public), listed in ``CqeStatus``.

Everything that decodes (dumps, traces, error messages) goes through ``decode_wqe`` / ``decode_cqe`` and
``format_wqe`` / ``format_cqe``.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "WQEBB_SIZE",
    "CQE_SIZE",
    "MAX_MSG_BYTES",
    "Opcode",
    "Odr",
    "CqeStatus",
    "OpConfig",
    "ACLSHMEMX_UDMA_ODR_NO",
    "ACLSHMEMX_UDMA_ODR_RO",
    "ACLSHMEMX_UDMA_ODR_SO",
    "ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT",
    "ACLSHMEMX_UDMA_OP_CONFIG_SO",
    "ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE",
    "REDUCE_FLAG",
    "wqe_bbs",
    "odr_name",
    "make_flag",
    "split_flag",
    "Wqe",
    "Cqe",
    "pack_wqe",
    "decode_wqe",
    "decode_cqe",
    "pack_cqe",
    "format_wqe",
    "format_cqe",
    "build_write_batch",
    "WQE_DTYPE",
    "CQE_DTYPE",
    "REMOTE_MEM_INFO_DTYPE",
    "WQ_CTX_DTYPE",
    "CQ_CTX_DTYPE",
]

WQEBB_SIZE = 64
CQE_SIZE = 64
MAX_MSG_BYTES = 256 << 20  # one UDMA request is at most 256 MiB (the SGE length field is 32-bit)
REMOTE_JETTY_TYPE = 1
REDUCE_FLAG = 0x80


class Opcode(enum.IntEnum):
    """URMA opcodes (``aclshmemi_udma_opcode_t``). shmemx executes WRITE, WRITE_WITH_NOTIFY, READ, CAS, FAA, NOP
    and WRITE with the reduce flag; the others are decoded and named but rejected with ``BAD_OPCODE``."""

    SEND = 0x0
    SEND_WITH_IMM = 0x1
    SEND_WITH_INV = 0x2
    WRITE = 0x3
    WRITE_WITH_IMM = 0x4
    WRITE_WITH_NOTIFY = 0x5
    READ = 0x6
    CAS = 0x7
    ATOMIC_SWAP = 0x8
    ATOMIC_STORE = 0x9
    ATOMIC_LOAD = 0xA
    FAA = 0xB
    NOP = 0x11


TWO_BB_OPCODES = frozenset({Opcode.WRITE_WITH_NOTIFY, Opcode.FAA, Opcode.CAS})


def wqe_bbs(opcode: int) -> int:
    """Basic blocks a WQE of ``opcode`` occupies: 2 for WRITE_WITH_NOTIFY, FAA and CAS, else 1."""
    return 2 if opcode in TWO_BB_OPCODES else 1


class Odr(enum.IntEnum):
    """Ordering mode, the 3-bit odr field of the flag byte.

    The hardware splits it into a 2-bit placement order ([1:0]) and a 1-bit completion order ([2]). NO = 0 and
    SO = 6 are fixed by SHMEM (the SO op config gives flag 0x26, seed 002; an older SHMEM build hard-coded 0x22
    for the same intent, i.e. placement order 2 without the completion bit). RO = 1 is inferred, unconfirmed.
    """

    NO = 0
    RO = 1
    SO = 6


ACLSHMEMX_UDMA_ODR_NO = Odr.NO
ACLSHMEMX_UDMA_ODR_RO = Odr.RO
ACLSHMEMX_UDMA_ODR_SO = Odr.SO


def odr_name(odr: int) -> str:
    """Name any 3-bit odr value: the three known ones by name, others by their two parts."""
    try:
        return Odr(odr).name
    except ValueError:
        return f"odr{odr}(placement {odr & 3}, completion {odr >> 2 & 1})"


class CqeStatus(enum.IntEnum):
    """CQE status byte. 0 is success; the error codes are shmemx's (documented in the README)."""

    SUCCESS = 0x00
    BAD_OPCODE = 0x01  # an opcode shmemx does not execute, or a malformed WQE (sge_num, jetty type)
    BAD_EID = 0x02  # the remote EID names no PE of the job
    BAD_TP = 0x03  # tp_id is not a transport of this PE to the EID's PE
    BAD_TOKEN_ID = 0x04  # tokenId names no segment registered on the target
    TOKEN_MISMATCH = 0x05  # the token value does not match the segment's
    REMOTE_OUT_OF_BOUNDS = 0x06  # the remote range is not inside the segment
    LOCAL_ACCESS = 0x07  # the SGE's local VA range is not registered memory of this PE
    LENGTH_TOO_LARGE = 0x08  # more than 256 MiB in one request
    BAD_ATOMIC = 0x09  # atomic size not 4/8, misaligned target, unsupported reduce type
    FLUSHED = 0x0A  # not executed: the QP was in error after an earlier WQE failed
    ENGINE_FAULT = 0x0F  # an unexpected exception inside the DMA engine (a shmemx bug): see the message


def make_flag(odr: int = 0, fence: int = 0, se: int = 0, cqe: int = 1, reduce: int = 0) -> int:
    return (odr & 7) | (fence & 1) << 3 | (se & 1) << 4 | (cqe & 1) << 5 | (REDUCE_FLAG if reduce else 0)


@dataclass(frozen=True)
class OpConfig:
    """``aclshmemx_udma_op_config_t``, aggregate-initialised ``{cqe, se, fence, odr}`` as in CANN code.

    Attributes:
        cqe: 1 = the WQE produces a completion (counted by quiet), 0 = silent (defer batches).
        se: solicited event; must be 0 (SHMEM static-asserts it).
        fence: 1 = wait for all earlier WQEs of the QP before executing.
        odr: ordering mode (``Odr``), 0..7.
    """

    cqe: int = 1
    se: int = 0
    fence: int = 0
    odr: int = Odr.NO

    def __post_init__(self):
        for name, value, hi in (("cqe", self.cqe, 1), ("fence", self.fence, 1), ("odr", self.odr, 7)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= hi:
                raise ValueError(f"OpConfig.{name} must be 0..{hi}, got {value!r}")
        if self.se != 0:
            raise ValueError(f"OpConfig.se must be 0 (solicited events are not supported by SHMEM UDMA), "
                             f"got {self.se!r}")
        object.__setattr__(self, "flag", make_flag(self.odr, self.fence, self.se, self.cqe))

    flag: int = field(init=False, repr=False, compare=False)  # the flag byte, computed once


ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT = OpConfig(1, 0, 0, Odr.NO)  # flag 0x20
ACLSHMEMX_UDMA_OP_CONFIG_SO = OpConfig(1, 0, 0, Odr.SO)  # flag 0x26
ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE = OpConfig(0, 0, 0, Odr.NO)  # flag 0x00


def split_flag(flag: int) -> dict:
    return {"odr": flag & 7, "fence": flag >> 3 & 1, "se": flag >> 4 & 1, "cqe": flag >> 5 & 1,
            "reduce": flag >> 7 & 1}


# --- WQE ---------------------------------------------------------------------------------------------------

_SQE = struct.Struct("<IIIIQQIIQ")  # the 48-byte SQE base
_SGE = struct.Struct("<IIQ")
_WRITE = struct.Struct("<IIIIQQIIQIIQ")  # SQE base + SGE: one whole 64-byte WRITE/READ WQE
_NOTIFY = struct.Struct("<QQQQ")
_NOTIFY_WQE = struct.Struct("<IIIIQQIIQQQQQIIQ32x")  # SQE base + notify ctx + SGE: a whole 128-byte NOTIFY WQE

WQE_DTYPE = np.dtype(
    [
        ("dw0", "<u4"),  # sqe_bb_idx | flag<<16 | token_en<<28 | rmt_jetty_type<<29 | owner<<31
        ("dw1", "<u4"),  # target_hint | opcode<<8 | inline_msg_len<<22
        ("tp_sge", "<u4"),  # tp_id | sge_num<<24
        ("rmt_seg_id", "<u4"),
        ("rmt_eid", "<u8", (2,)),
        ("rmt_token_value", "<u4"),
        ("reduce_attr", "<u4"),
        ("rmt_va", "<u8"),
        ("sge_len", "<u4"),
        ("sge_token_id", "<u4"),
        ("sge_va", "<u8"),
    ]
)
assert WQE_DTYPE.itemsize == WQEBB_SIZE


@dataclass
class Wqe:
    """A decoded WQE, every field by name (``decode_wqe``)."""

    sqe_bb_idx: int
    flag: int
    token_en: int
    rmt_jetty_type: int
    owner: int
    target_hint: int
    opcode: int
    inline_msg_len: int
    tp_id: int
    sge_num: int
    rmt_seg_id: int
    rmt_eid: int  # 128-bit
    rmt_token_value: int
    reduce_dtype: int
    reduce_op: int
    rmt_va: int
    sge_len: int = 0
    sge_token_id: int = 0
    sge_va: int = 0
    notify_tid: int = 0
    notify_token: int = 0
    notify_va: int = 0
    notify_value: int = 0
    operand: int = 0  # FAA add operand / CAS swap value
    compare: int = 0  # CAS compare value

    @property
    def bbs(self) -> int:
        return wqe_bbs(self.opcode)

    @property
    def opcode_name(self) -> str:
        try:
            name = Opcode(self.opcode).name
        except ValueError:
            return f"opcode {self.opcode:#x}"
        return "WRITE_WITH_REDUCE" if self.opcode == Opcode.WRITE and self.flag & REDUCE_FLAG else name

    @property
    def cqe(self) -> int:
        return self.flag >> 5 & 1

    @property
    def length(self) -> int:
        return self.sge_len


def pack_wqe(
    *,
    opcode: int,
    flag: int,
    tp_id: int,
    rmt_seg_id: int,
    rmt_eid: int,
    rmt_token_value: int,
    rmt_va: int,
    sge_len: int = 0,
    sge_va: int = 0,
    notify_tid: int = 0,
    notify_token: int = 0,
    notify_va: int = 0,
    notify_value: int = 0,
    operand: int = 0,
    compare: int = 0,
    reduce_dtype: int = 0,
    reduce_op: int = 0,
    token_en: int = 1,
    sqe_bb_idx: int = 0,
    target_hint: int = 0,
) -> bytes:
    """One WQE as bytes (64 or 128, by opcode). The hot posting path packs straight into the ring instead."""
    bbs = wqe_bbs(opcode)
    buf = bytearray(64 * bbs)
    dw0 = (sqe_bb_idx & 0xFFFF) | (flag & 0xFF) << 16 | (token_en & 1) << 28 | REMOTE_JETTY_TYPE << 29
    dw1 = (target_hint & 0xFF) | (opcode & 0xFF) << 8
    _SQE.pack_into(buf, 0, dw0, dw1, (tp_id & 0xFFFFFF) | 1 << 24, rmt_seg_id & 0xFFFFF,
                   rmt_eid & (2**64 - 1), rmt_eid >> 64 & (2**64 - 1), rmt_token_value & 0xFFFF_FFFF,
                   (reduce_dtype & 0xF) << 8 | (reduce_op & 0xF) << 12, rmt_va)
    if opcode == Opcode.WRITE_WITH_NOTIFY:
        _NOTIFY.pack_into(buf, 48, (notify_tid & 0xFFFFF) | (notify_token & 0xFFFF_FFFF) << 32, notify_va,
                          notify_value & (2**64 - 1), 0)
        _SGE.pack_into(buf, 80, sge_len, 0, sge_va)
    else:
        _SGE.pack_into(buf, 48, sge_len, 0, sge_va)
    if opcode in (Opcode.FAA, Opcode.CAS):
        size = 8 if sge_len == 8 else 4
        fmt = "<Q" if size == 8 else "<I"
        struct.pack_into(fmt, buf, 64, operand & (2 ** (8 * size) - 1))
        if opcode == Opcode.CAS:
            struct.pack_into(fmt, buf, 64 + size, compare & (2 ** (8 * size) - 1))
    return bytes(buf)


def decode_wqe(data) -> Wqe:
    """Decode a WQE from its bytes (64 or 128; a buffer of a two-BB WQE must hold both BBs, unwrapped)."""
    data = bytes(data)
    dw0, dw1, dw2, dw3, eid_lo, eid_hi, token, reduce_attr, rmt_va = _SQE.unpack_from(data, 0)
    opcode = dw1 >> 8 & 0xFF
    w = Wqe(
        sqe_bb_idx=dw0 & 0xFFFF, flag=dw0 >> 16 & 0xFF, token_en=dw0 >> 28 & 1, rmt_jetty_type=dw0 >> 29 & 3,
        owner=dw0 >> 31 & 1, target_hint=dw1 & 0xFF, opcode=opcode, inline_msg_len=dw1 >> 22 & 0x3FF,
        tp_id=dw2 & 0xFFFFFF, sge_num=dw2 >> 24 & 0xFF, rmt_seg_id=dw3 & 0xFFFFF, rmt_eid=eid_hi << 64 | eid_lo,
        rmt_token_value=token, reduce_dtype=reduce_attr >> 8 & 0xF, reduce_op=reduce_attr >> 12 & 0xF,
        rmt_va=rmt_va,
    )
    if opcode == Opcode.WRITE_WITH_NOTIFY and len(data) >= 96:
        q0, w.notify_va, w.notify_value, _ = _NOTIFY.unpack_from(data, 48)
        w.notify_tid, w.notify_token = q0 & 0xFFFFF, q0 >> 32
        w.sge_len, w.sge_token_id, w.sge_va = _SGE.unpack_from(data, 80)
    else:
        w.sge_len, w.sge_token_id, w.sge_va = _SGE.unpack_from(data, 48)
    if opcode in (Opcode.FAA, Opcode.CAS) and len(data) >= 80:
        size = 8 if w.sge_len == 8 else 4
        fmt = "<Q" if size == 8 else "<I"
        (w.operand,) = struct.unpack_from(fmt, data, 64)
        if opcode == Opcode.CAS:
            (w.compare,) = struct.unpack_from(fmt, data, 64 + size)
    return w


def build_write_batch(
    n: int,
    *,
    tp_id,
    rmt_seg_id,
    rmt_eid: int,
    rmt_token_value,
    rmt_va,
    sge_len,
    sge_va,
    flag=0x20,
    opcode: int = Opcode.WRITE,
) -> np.ndarray:
    """``n`` one-BB WQEs (WRITE or READ) built in one numpy operation, as an ``[n, 8] uint64`` array.

    Every argument may be a scalar or an array of ``n`` values (rmt_va, sge_len and sge_va usually are). Copy the
    result into the SQ ring (``ring[slots] = batch``), then ring the doorbell once: the raw path of DeepEP-style
    kernels that post thousands of WQEs per call.
    """
    if wqe_bbs(opcode) != 1:
        raise ValueError(f"build_write_batch builds one-BB WQEs (WRITE, READ, NOP), not {Opcode(opcode).name}")
    out = np.empty((n, 8), np.uint64)
    flag = np.asarray(flag, np.uint64)
    out[:, 0] = (flag << np.uint64(16)) | np.uint64(1 << 28 | REMOTE_JETTY_TYPE << 29) | (
        np.uint64(opcode << 8) << np.uint64(32))
    tp = np.asarray(tp_id, np.uint64) & np.uint64(0xFFFFFF) | np.uint64(1 << 24)
    out[:, 1] = tp | (np.asarray(rmt_seg_id, np.uint64) & np.uint64(0xFFFFF)) << np.uint64(32)
    out[:, 2] = np.uint64(rmt_eid & (2**64 - 1))
    out[:, 3] = np.uint64(rmt_eid >> 64 & (2**64 - 1))
    out[:, 4] = np.asarray(rmt_token_value, np.uint64) & np.uint64(0xFFFF_FFFF)
    out[:, 5] = np.asarray(rmt_va, np.uint64)
    out[:, 6] = np.asarray(sge_len, np.uint64) & np.uint64(0xFFFF_FFFF)
    out[:, 7] = np.asarray(sge_va, np.uint64)
    return out


# --- CQE ---------------------------------------------------------------------------------------------------

_CQE = struct.Struct("<IIIIIQQQQ")  # dw0..dw4, user_data, eid lo, eid hi, data; inline data stays 0

CQE_DTYPE = np.dtype(
    [
        ("dw0", "<u4"),  # s_r | is_jetty<<1 | owner<<2 | inline_en<<3 | opcode<<4 | fd<<7 | substatus<<16 | status<<24
        ("dw1", "<u4"),  # entry_idx | local_num_l<<16
        ("dw2", "<u4"),  # local_num_h | rmt_idx<<4
        ("tpn", "<u4"),
        ("byte_cnt", "<u4"),
        ("user_data", "<u4", (2,)),
        ("rmt_eid", "<u4", (4,)),
        ("data", "<u4", (2,)),
        ("inline_data", "<u4", (3,)),
    ]
)
assert CQE_DTYPE.itemsize == CQE_SIZE


@dataclass
class Cqe:
    """A decoded CQE (``decode_cqe``). ``user_data`` is the BB position of the WQE it completes."""

    owner: int
    opcode: int
    status: int
    substatus: int
    entry_idx: int
    tpn: int
    byte_cnt: int
    user_data: int
    rmt_eid: int
    data: int

    @property
    def ok(self) -> bool:
        return self.status == 0 and self.substatus == 0

    @property
    def status_name(self) -> str:
        try:
            return CqeStatus(self.status).name
        except ValueError:
            return f"status {self.status:#x}"


def pack_cqe(*, owner: int, opcode: int, status: int, substatus: int, entry_idx: int, tpn: int, byte_cnt: int,
             user_data: int, rmt_eid: int, data: int = 0) -> bytes:
    dw0 = (owner & 1) << 2 | (opcode & 7) << 4 | (substatus & 0xFF) << 16 | (status & 0xFF) << 24
    buf = bytearray(64)
    _CQE.pack_into(buf, 0, dw0, entry_idx & 0xFFFF, 0, tpn & 0xFFFFFF, byte_cnt & 0xFFFF_FFFF,
                   user_data & (2**64 - 1), rmt_eid & (2**64 - 1), rmt_eid >> 64 & (2**64 - 1),
                   data & (2**64 - 1))
    return bytes(buf)


def decode_cqe(data) -> Cqe:
    dw0, dw1, _, dw3, byte_cnt, user_data, eid_lo, eid_hi, value = _CQE.unpack_from(bytes(data), 0)
    return Cqe(owner=dw0 >> 2 & 1, opcode=dw0 >> 4 & 7, status=dw0 >> 24 & 0xFF, substatus=dw0 >> 16 & 0xFF,
               entry_idx=dw1 & 0xFFFF, tpn=dw3 & 0xFFFFFF, byte_cnt=byte_cnt, user_data=user_data,
               rmt_eid=eid_hi << 64 | eid_lo, data=value)


# --- formatting (shared by dumps, traces and error messages) ------------------------------------------------


def format_flag(flag: int) -> str:
    f = split_flag(flag)
    parts = [f"odr={odr_name(f['odr'])}"] + [name for name in ("fence", "se", "cqe", "reduce") if f[name]]
    return f"{flag:#04x}({','.join(parts)})"


def format_wqe(w: Wqe, describe_va=None) -> str:
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


# --- queue context tables -------------------------------------------------------------------------------------

REMOTE_MEM_INFO_DTYPE = np.dtype(
    [
        ("token_value_valid", "u1"),
        ("rmt_jetty_type", "u1"),
        ("target_hint", "u1"),
        ("_rsv", "u1"),
        ("tpn", "<u4"),
        ("tid", "<u4"),
        ("rmt_token_value", "<u4"),
        ("len", "<u8"),
        ("addr", "<u8"),
        ("eid_addr", "<u8"),
        ("eid", "<u8", (2,)),
        ("_pad", "V8"),
    ]
)
assert REMOTE_MEM_INFO_DTYPE.itemsize == 64

WQ_CTX_DTYPE = np.dtype(
    {
        "names": ["wqn", "buf_addr", "wqe_size", "depth", "head", "tail", "db_mode", "db_addr", "sl", "cqe_cnt",
                  "amo_addr"],
        "formats": ["<u4", "<u8", "<u4", "<u4", "<u4", "<u4", "<i4", "<u8", "<u4", "<u4", "<u8"],
        "offsets": [0, 8, 16, 20, 24, 28, 32, 40, 48, 52, 56],
        "itemsize": 64,
    }
)
CQ_CTX_DTYPE = np.dtype(
    {
        "names": ["cqn", "buf_addr", "cqe_size", "depth", "head", "tail", "db_mode", "db_addr"],
        "formats": ["<u4", "<u8", "<u4", "<u4", "<u4", "<u4", "<i4", "<u8"],
        "offsets": [0, 8, 16, 20, 24, 28, 32, 40],
        "itemsize": 64,
    }
)

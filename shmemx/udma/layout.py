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

Everything that decodes (dumps, traces, error messages) goes through ``decode_wqe`` / ``decode_cqe``, and puts
them into words with ``describe`` (``format_wqe``, ``format_cqe``, ``VaNames``); how WQEs sit in an SQ ring (two-BB
wrap, the sidecar word of each slot, scanning a span of BBs) is ``rings``. Code that reads WQEs or CQEs as
rows of words uses the named positions here (``W_*``, ``Q_*``, ``C_*``), never numbers of its own.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "M32",
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
    "wqe_bbs_of",
    "odr_name",
    "opcode_name",
    "make_flag",
    "split_flag",
    "Wqe",
    "Cqe",
    "pack_wqe",
    "decode_wqe",
    "wqe_columns",
    "decode_cqe",
    "pack_cqe",
    "build_write_batch",
    "WQE_DTYPE",
    "CQE_DTYPE",
    "REMOTE_MEM_INFO_DTYPE",
    "WQ_CTX_DTYPE",
    "CQ_CTX_DTYPE",
    "TWO_BB_OPCODES",
    "RW_WQE",
    "NOTIFY_WQE",
    "DW0",
    "DW1",
    "tp_word",
    "sge_len_word",
    "wqe_length",
    "cqe_status_word",
    "cqe_words",
    "cqe_rows",
]

M32 = 0xFFFF_FFFF  # positions, heads and counters are monotonic 32-bit BB / CQE counts
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
_TWO_BB_LIST = sorted(int(op) for op in TWO_BB_OPCODES)  # for np.isin


def opcode_name(opcode: int) -> str:
    """``WRITE``, ``FAA``, ... or ``opcode 0x1f`` for a value that is no URMA opcode."""
    try:
        return Opcode(opcode).name
    except ValueError:
        return f"opcode {opcode:#x}"


def wqe_bbs(opcode: int) -> int:
    """Basic blocks a WQE of ``opcode`` occupies: 2 for WRITE_WITH_NOTIFY, FAA and CAS, else 1."""
    return 2 if opcode in TWO_BB_OPCODES else 1


def wqe_bbs_of(opcodes: np.ndarray) -> np.ndarray:
    """``wqe_bbs`` of every opcode of an array."""
    return np.where(np.isin(opcodes, _TWO_BB_LIST), 2, 1)


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
_NOTIFY = struct.Struct("<QQQQ")
# Whole WQEs in one pack, for the posting paths: the SQE base (dw0, dw1, tp word, tokenId, EID lo, EID hi, token
# value, reduce attributes, remote VA), then the SGE (length, token id, local VA); a WRITE_WITH_NOTIFY has the
# notify context (tid | token << 32, signal VA, signal value, 0) between them and 32 bytes of padding after.
RW_WQE = struct.Struct("<IIIIQQIIQIIQ")  # one 64-byte WRITE / READ
NOTIFY_WQE = struct.Struct("<IIIIQQIIQQQQQIIQ32x")  # one 128-byte WRITE_WITH_NOTIFY


def _dw0(flag: int, token_en: int = 1, sqe_bb_idx: int = 0) -> int:
    return (sqe_bb_idx & 0xFFFF) | (flag & 0xFF) << 16 | (token_en & 1) << 28 | REMOTE_JETTY_TYPE << 29


DW0 = tuple(_dw0(flag) for flag in range(256))  # word 0 of a WQE by its flag byte (token_en 1, jetty type 1)
DW1 = tuple(opcode << 8 for opcode in range(256))  # word 1 by opcode (target_hint 0, no inline data)


def tp_word(tp_id: int) -> int:
    """Word 2 of a WQE: the TP id and sge_num = 1."""
    return (tp_id & 0xFFFFFF) | 1 << 24

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

# u32 word positions of a WQE's first BB, for code that reads rings as ``[n, 16] uint32`` rows (the vectorised
# engine paths, ring scans), and u64 positions for ``[n, 8] uint64`` rows
W_DW0, W_DW1, W_TP, W_SEG = (WQE_DTYPE.fields[f][1] // 4 for f in ("dw0", "dw1", "tp_sge", "rmt_seg_id"))
W_TOKEN, W_SGE_LEN = WQE_DTYPE.fields["rmt_token_value"][1] // 4, WQE_DTYPE.fields["sge_len"][1] // 4
W_REDUCE = WQE_DTYPE.fields["reduce_attr"][1] // 4
Q_EID_LO = WQE_DTYPE.fields["rmt_eid"][1] // 8
Q_EID_HI = Q_EID_LO + 1
Q_RMT_VA, Q_SGE_VA = WQE_DTYPE.fields["rmt_va"][1] // 8, WQE_DTYPE.fields["sge_va"][1] // 8
OPCODE_BYTE = WQE_DTYPE.fields["dw1"][1] + 1  # byte 5 of a WQE holds its opcode
FLAG_BYTE = WQE_DTYPE.fields["dw0"][1] + 2  # byte 2 its flag
NOTIFY_CTX_OFFSET = 48  # byte offsets in a two-BB WQE: a WRITE_WITH_NOTIFY's notify context (tid | token << 32,
NOTIFY_SGE_OFFSET = 80  # signal VA, signal value, 0), its SGE after it; an FAA/CAS operand (swap, then compare)
AMO_OPERAND_OFFSET = 64


# Fields of a WQE's words, for ints and numpy arrays of words alike
def opcode_of(dw1: int) -> int:
    return (dw1 >> 8) & 0xFF


def flag_of(dw0: int) -> int:
    return (dw0 >> 16) & 0xFF


def jetty_type_of(dw0: int) -> int:
    return (dw0 >> 29) & 3


def tp_id_of(tp: int) -> int:
    return tp & 0xFFFFFF


def sge_num_of(tp: int) -> int:
    return tp >> 24


def seg_id_of(seg: int) -> int:
    return seg & 0xFFFFF


def sge_len_word(opcode: int) -> int:
    """u32 index, from the WQE's first byte, of the SGE length of a WQE of ``opcode`` (word 20, in the second BB,
    for WRITE_WITH_NOTIFY; word 12 otherwise)."""
    return NOTIFY_SGE_OFFSET // 4 if opcode == Opcode.WRITE_WITH_NOTIFY else W_SGE_LEN


def wqe_length(wqe: bytes) -> int:
    """The SGE length (payload bytes) of a WQE given as its 64 or 128 bytes."""
    (length,) = struct.unpack_from("<I", wqe, 4 * sge_len_word(wqe[OPCODE_BYTE]))
    return length


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
        if self.opcode == Opcode.WRITE and self.flag & REDUCE_FLAG:
            return "WRITE_WITH_REDUCE"
        return opcode_name(self.opcode)

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
    dw1 = (target_hint & 0xFF) | (opcode & 0xFF) << 8
    _SQE.pack_into(buf, 0, _dw0(flag, token_en, sqe_bb_idx), dw1, tp_word(tp_id), rmt_seg_id & 0xFFFFF,
                   rmt_eid & (2**64 - 1), rmt_eid >> 64 & (2**64 - 1), rmt_token_value & 0xFFFF_FFFF,
                   (reduce_dtype & 0xF) << 8 | (reduce_op & 0xF) << 12, rmt_va)
    if opcode == Opcode.WRITE_WITH_NOTIFY:
        _NOTIFY.pack_into(buf, NOTIFY_CTX_OFFSET, (notify_tid & 0xFFFFF) | (notify_token & 0xFFFF_FFFF) << 32, notify_va,
                          notify_value & (2**64 - 1), 0)
        _SGE.pack_into(buf, NOTIFY_SGE_OFFSET, sge_len, 0, sge_va)
    else:
        _SGE.pack_into(buf, 48, sge_len, 0, sge_va)
    if opcode in (Opcode.FAA, Opcode.CAS):
        size = 8 if sge_len == 8 else 4
        fmt = "<Q" if size == 8 else "<I"
        struct.pack_into(fmt, buf, AMO_OPERAND_OFFSET, operand & (2 ** (8 * size) - 1))
        if opcode == Opcode.CAS:
            struct.pack_into(fmt, buf, AMO_OPERAND_OFFSET + size, compare & (2 ** (8 * size) - 1))
    return bytes(buf)


def decode_wqe(data: bytes) -> Wqe:
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
        q0, w.notify_va, w.notify_value, _ = _NOTIFY.unpack_from(data, NOTIFY_CTX_OFFSET)
        w.notify_tid, w.notify_token = q0 & 0xFFFFF, q0 >> 32
        w.sge_len, w.sge_token_id, w.sge_va = _SGE.unpack_from(data, NOTIFY_SGE_OFFSET)
    else:
        w.sge_len, w.sge_token_id, w.sge_va = _SGE.unpack_from(data, 48)
    if opcode in (Opcode.FAA, Opcode.CAS) and len(data) >= 80:
        size = 8 if w.sge_len == 8 else 4
        fmt = "<Q" if size == 8 else "<I"
        (w.operand,) = struct.unpack_from(fmt, data, AMO_OPERAND_OFFSET)
        if opcode == Opcode.CAS:
            (w.compare,) = struct.unpack_from(fmt, data, AMO_OPERAND_OFFSET + size)
    return w


def wqe_columns(bbs: np.ndarray, starts: np.ndarray) -> dict:
    """The fields of the WQEs that start at rows ``starts`` of ``bbs`` (``[m, 64] uint8``: a two-BB WQE's
    second BB in the next row), decoded at once from the named positions above: the vectorised twin of
    ``decode_wqe`` (a test pins them equal). Columns: ``opcode``, ``flag``, ``length`` (SGE bytes), ``rmt_va``,
    ``sge_va`` (the local side), ``notify_va``, ``notify_value`` (a WRITE_WITH_NOTIFY's), ``operand`` (an FAA's
    add, a CAS's swap), ``compare`` (a CAS's); int64 or uint64, zero where a field does not apply."""
    m = len(bbs)
    w32 = np.ascontiguousarray(bbs).view("<u4").reshape(m, 16)
    w64 = np.ascontiguousarray(bbs).view("<u8").reshape(m, 8)
    st = np.asarray(starts, np.int64)
    nxt = np.minimum(st + 1, max(m - 1, 0))
    opcode = opcode_of(w32[st, W_DW1]).astype(np.int64)
    notify = opcode == Opcode.WRITE_WITH_NOTIFY
    atomic = (opcode == Opcode.FAA) | (opcode == Opcode.CAS)

    def second(byte: int, words) -> np.ndarray:  # a field of the second BB (byte offset from the WQE's start)
        return words[nxt, (byte - WQEBB_SIZE) // (4 if words is w32 else 8)]

    sge_len = np.where(notify, second(NOTIFY_SGE_OFFSET, w32), w32[st, W_SGE_LEN]).astype(np.int64)
    size4 = sge_len == 4
    operand64, compare64 = second(AMO_OPERAND_OFFSET, w64), second(AMO_OPERAND_OFFSET + 8, w64)
    operand32, compare32 = second(AMO_OPERAND_OFFSET, w32), second(AMO_OPERAND_OFFSET + 4, w32)
    cas = opcode == Opcode.CAS
    return dict(
        opcode=opcode, flag=flag_of(w32[st, W_DW0]).astype(np.int64), length=sge_len,
        rmt_va=w64[st, Q_RMT_VA].astype(np.uint64),
        sge_va=np.where(notify, second(NOTIFY_SGE_OFFSET + 8, w64), w64[st, Q_SGE_VA]).astype(np.uint64),
        notify_va=np.where(notify, w64[st, NOTIFY_CTX_OFFSET // 8 + 1], 0).astype(np.uint64),
        notify_value=np.where(notify, second(NOTIFY_CTX_OFFSET + 16, w64), 0).astype(np.uint64),
        operand=np.where(atomic, np.where(size4, operand32, operand64), 0).astype(np.uint64),
        compare=np.where(cas, np.where(size4, compare32, compare64), 0).astype(np.uint64))


def build_write_batch(n: int, *, tp_id: int | np.ndarray, rmt_seg_id: int | np.ndarray, rmt_eid: int,
                      rmt_token_value: int | np.ndarray, rmt_va: int | np.ndarray, sge_len: int | np.ndarray,
                      sge_va: int | np.ndarray, flag: int | np.ndarray = 0x20,
                      opcode: int = Opcode.WRITE) -> np.ndarray:
    """``n`` one-BB WQEs (WRITE or READ) built in one numpy operation, as an ``[n, 8] uint64`` array.

    Every argument may be a scalar or an array of ``n`` values (rmt_va, sge_len and sge_va usually are). Copy the
    result into the SQ ring (``ring[slots] = batch``), then ring the doorbell once: the raw path of DeepEP-style
    kernels that post thousands of WQEs per call.
    """
    if wqe_bbs(opcode) != 1:
        raise ValueError(f"build_write_batch builds one-BB WQEs (WRITE, READ, NOP), not {Opcode(opcode).name}")
    out = np.empty((n, 8), np.uint64)
    flag = np.asarray(flag, np.uint64)
    out[:, 0] = (flag << np.uint64(16)) | np.uint64(_dw0(0)) | (np.uint64(DW1[opcode]) << np.uint64(32))
    tp = np.asarray(tp_id, np.uint64) & np.uint64(0xFFFFFF) | np.uint64(tp_word(0))
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


# u32 word positions of a CQE
C_STATUS, C_ENTRY_IDX, C_TPN, C_BYTE_CNT, C_USER_DATA, C_EID, C_DATA = 0, 1, 3, 4, 5, 7, 11
OWNER_SHIFT = 2  # the owner bit of word 0


def cqe_status_word(owner: int, opcode: int, status: int = 0, substatus: int = 0) -> int:
    """Word 0 of a CQE: owner bit, opcode (low 3 bits), substatus and status. The engine stores it last."""
    return (owner & 1) << OWNER_SHIFT | (opcode & 7) << 4 | (substatus & 0xFF) << 16 | (status & 0xFF) << 24


def cqe_owner(cq_pos: int, cq_depth: int) -> int:
    """The owner bit a CQE at monotonic position ``cq_pos`` carries: 1 on even laps of the CQ ring, 0 on odd."""
    return (cq_pos // cq_depth) & 1 ^ 1


def cqe_words(*, pos: int, bbs: int, tpn: int, byte_cnt: int, eid: int, data: int = 0) -> list[int]:
    """Words 1-15 of the CQE of the WQE at BB position ``pos`` (``bbs`` long): entry_idx (the next BB), tpn,
    byte_cnt, user_data (``pos``), remote EID and the fetched data; word 0 (``cqe_status_word``) is separate."""
    return [(pos + bbs) & 0xFFFF, 0, tpn & 0xFFFFFF, byte_cnt & M32, pos & M32, 0, eid & M32, eid >> 32 & M32,
            eid >> 64 & M32, eid >> 96 & M32, data & M32, data >> 32 & M32, 0, 0, 0]


def cqe_rows(pos: np.ndarray, tpn: int, byte_cnt: int | np.ndarray, eid_lo: int | np.ndarray,
             eid_hi: int | np.ndarray) -> np.ndarray:
    """``[m, 16] uint32``: successful CQEs for one-BB WQEs at BB positions ``pos`` (``cqe_words`` vectorised),
    word 0 left 0 for the caller (who stores it last). ``eid_lo`` / ``eid_hi``: uint64, one per CQE or one for
    all."""
    rows = np.zeros((len(pos), 16), np.uint32)
    rows[:, C_ENTRY_IDX] = (pos + 1) & 0xFFFF
    rows[:, C_TPN] = tpn & 0xFFFFFF
    rows[:, C_BYTE_CNT] = byte_cnt
    rows[:, C_USER_DATA] = pos
    rows[:, C_EID:C_EID + 2] = np.ascontiguousarray(eid_lo, np.uint64).view(np.uint32).reshape(-1, 2)
    rows[:, C_EID + 2:C_EID + 4] = np.ascontiguousarray(eid_hi, np.uint64).view(np.uint32).reshape(-1, 2)
    return rows


def pack_cqe(*, owner: int, opcode: int, status: int, substatus: int, entry_idx: int, tpn: int, byte_cnt: int,
             user_data: int, rmt_eid: int, data: int = 0) -> bytes:
    """One CQE as 64 bytes (the engine writes the same words, ``cqe_words``, straight into the ring)."""
    buf = bytearray(64)
    _CQE.pack_into(buf, 0, cqe_status_word(owner, opcode, status, substatus), entry_idx & 0xFFFF, 0, tpn & 0xFFFFFF,
                   byte_cnt & M32, user_data & (2**64 - 1), rmt_eid & (2**64 - 1), rmt_eid >> 64 & (2**64 - 1),
                   data & (2**64 - 1))
    return bytes(buf)


def decode_cqe(data: bytes) -> Cqe:
    dw0, dw1, _, dw3, byte_cnt, user_data, eid_lo, eid_hi, value = _CQE.unpack_from(bytes(data), 0)
    return Cqe(owner=dw0 >> 2 & 1, opcode=dw0 >> 4 & 7, status=dw0 >> 24 & 0xFF, substatus=dw0 >> 16 & 0xFF,
               entry_idx=dw1 & 0xFFFF, tpn=dw3 & 0xFFFFFF, byte_cnt=byte_cnt, user_data=user_data,
               rmt_eid=eid_hi << 64 | eid_lo, data=value)


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

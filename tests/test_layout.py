"""The binary layouts of the UDMA data plane, pinned against DESIGN.md section 3.

Every WQE / CQE field is encoded here a second time, independently, with ``struct`` at the byte offsets and bit
positions DESIGN.md gives (``_ref_wqe`` / ``_ref_cqe``), and ``layout.pack_wqe`` / ``pack_cqe`` must produce the
very same bytes; ``decode_wqe`` / ``decode_cqe`` must give every field back (property tests over random values).
The context tables (wq_ctx, cq_ctx, remote_mem_info) are pinned field by field against their CANN structs.
"""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmemx import layout
from shmemx.udma import describe
from shmemx.layout import (ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT, ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE,
                           ACLSHMEMX_UDMA_OP_CONFIG_SO, CqeStatus, Odr, Opcode, OpConfig)
from shmemx.udma.segment import CQ_TAIL, HW_DTYPE, WQ_CQE_CNT, WQ_HEAD, WQ_TAIL

U = lambda bits: st.integers(0, (1 << bits) - 1)  # noqa: E731  an unsigned field of `bits` bits


# --- the reference encoding, straight from DESIGN.md section 3 --------------------------------------------


def _ref_wqe(f: dict) -> bytes:
    """A WQE encoded by hand at DESIGN.md's offsets (64 bytes for WRITE/READ/NOP, 128 for NOTIFY/FAA/CAS)."""
    op = f["opcode"]
    buf = bytearray(128 if op in (Opcode.WRITE_WITH_NOTIFY, Opcode.FAA, Opcode.CAS) else 64)
    dw0 = f.get("sqe_bb_idx", 0) | f["flag"] << 16 | f.get("token_en", 1) << 28 | 1 << 29  # rmt_jetty_type = 1
    dw1 = f.get("target_hint", 0) | op << 8
    struct.pack_into("<I", buf, 0, dw0)
    struct.pack_into("<I", buf, 4, dw1)
    struct.pack_into("<I", buf, 8, f["tp_id"] | 1 << 24)  # sge_num = 1
    struct.pack_into("<I", buf, 12, f["rmt_seg_id"])
    struct.pack_into("<QQ", buf, 16, f["rmt_eid"] & (2**64 - 1), f["rmt_eid"] >> 64)
    struct.pack_into("<I", buf, 32, f["rmt_token_value"])
    struct.pack_into("<I", buf, 36, f.get("reduce_dtype", 0) << 8 | f.get("reduce_op", 0) << 12)
    struct.pack_into("<Q", buf, 40, f["rmt_va"])
    sge = 80 if op == Opcode.WRITE_WITH_NOTIFY else 48
    struct.pack_into("<IIQ", buf, sge, f.get("sge_len", 0), 0, f.get("sge_va", 0))
    if op == Opcode.WRITE_WITH_NOTIFY:
        struct.pack_into("<QQQQ", buf, 48, f["notify_tid"] | f["notify_token"] << 32, f["notify_va"],
                         f["notify_value"], 0)
    if op in (Opcode.FAA, Opcode.CAS):
        size = f["sge_len"]
        fmt = "<Q" if size == 8 else "<I"
        struct.pack_into(fmt, buf, 64, f["operand"])
        if op == Opcode.CAS:
            struct.pack_into(fmt, buf, 64 + size, f["compare"])
    return bytes(buf)


def _ref_cqe(f: dict) -> bytes:
    buf = bytearray(64)
    struct.pack_into("<I", buf, 0, f["owner"] << 2 | f["opcode"] << 4 | f["substatus"] << 16 | f["status"] << 24)
    struct.pack_into("<I", buf, 4, f["entry_idx"])
    struct.pack_into("<I", buf, 12, f["tpn"])
    struct.pack_into("<I", buf, 16, f["byte_cnt"])
    struct.pack_into("<Q", buf, 20, f["user_data"])
    struct.pack_into("<IIII", buf, 28, *((f["rmt_eid"] >> (32 * i)) & 0xFFFF_FFFF for i in range(4)))
    struct.pack_into("<Q", buf, 44, f["data"])
    return bytes(buf)


# --- constants -----------------------------------------------------------------------------------------------


def test_opcodes_and_basic_blocks():
    assert (Opcode.WRITE, Opcode.WRITE_WITH_NOTIFY, Opcode.READ, Opcode.CAS, Opcode.FAA, Opcode.NOP) == \
        (3, 5, 6, 7, 0xB, 0x11)
    assert layout.WQEBB_SIZE == 64 and layout.CQE_SIZE == 64 and layout.MAX_MSG_BYTES == 256 << 20
    for op in Opcode:
        expected = 2 if op in (Opcode.WRITE_WITH_NOTIFY, Opcode.FAA, Opcode.CAS) else 1
        assert layout.wqe_bbs(op) == expected, op.name


def test_flag_byte_and_op_configs():
    assert layout.make_flag(odr=6, fence=1, se=0, cqe=1, reduce=1) == 6 | 1 << 3 | 1 << 5 | 0x80
    for odr in range(8):
        for fence in (0, 1):
            for cqe in (0, 1):
                for reduce in (0, 1):
                    flag = layout.make_flag(odr, fence, 0, cqe, reduce)
                    assert flag == odr | fence << 3 | cqe << 5 | reduce * 0x80
                    assert layout.split_flag(flag) == {"odr": odr, "fence": fence, "se": 0, "cqe": cqe,
                                                       "reduce": reduce}
    assert layout.make_flag(se=1, cqe=0) == 0x10
    assert (Odr.NO, Odr.RO, Odr.SO) == (0, 1, 6)
    assert ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT.flag == 0x20
    assert ACLSHMEMX_UDMA_OP_CONFIG_SO.flag == 0x26
    assert ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE.flag == 0x00
    assert (ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT.cqe, ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT.se,
            ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT.fence, ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT.odr) == (1, 0, 0, Odr.NO)
    assert OpConfig(1, 0, 1, Odr.RO).flag == 0x29  # aggregate order {cqe, se, fence, odr} as in CANN


@pytest.mark.parametrize("kwargs, message", [
    ({"se": 1}, "se must be 0"),
    ({"cqe": 2}, "cqe must be 0..1"),
    ({"fence": -1}, "fence must be 0..1"),
    ({"odr": 8}, "odr must be 0..7"),
    ({"cqe": True}, "cqe must be 0..1"),
])
def test_op_config_rejects_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OpConfig(**kwargs)


def test_odr_name_names_every_value():
    names = [layout.odr_name(v) for v in range(8)]
    assert names[0] == "NO" and names[1] == "RO" and names[6] == "SO"
    assert len(set(names)) == 8
    for v in (2, 3, 4, 5, 7):
        assert names[v] == f"odr{v}(placement {v & 3}, completion {v >> 2})"


def test_cqe_statuses_are_distinct_and_success_is_zero():
    values = [s.value for s in CqeStatus]
    assert CqeStatus.SUCCESS == 0 and len(values) == len(set(values)) and max(values) <= 0xFF


# --- WQE: byte offsets and bit positions --------------------------------------------------------------------

EID = 0x0123_4567_89AB_CDEF_FEDC_BA98_7654_3210


def _fields(opcode, **extra):
    f = dict(opcode=opcode, flag=0x26, tp_id=0xABCDEF, rmt_seg_id=0xFEDCB, rmt_eid=EID,
             rmt_token_value=0xDEADBEEF, rmt_va=0x1000_0000_1234, sge_len=4096, sge_va=0x0800_0000_0040)
    f.update(extra)
    return f


def test_write_wqe_offsets():
    raw = layout.pack_wqe(**_fields(Opcode.WRITE, sqe_bb_idx=0x1234, target_hint=0x5A))
    assert len(raw) == 64
    dw0, dw1, dw2, dw3 = struct.unpack_from("<IIII", raw, 0)
    assert dw0 & 0xFFFF == 0x1234  # [15:0] sqe_bb_idx
    assert dw0 >> 16 & 0xFF == 0x26  # [23:16] flag
    assert dw0 >> 24 & 0xF == 0  # rsv, nf
    assert dw0 >> 28 & 1 == 1  # [28] token_en
    assert dw0 >> 29 & 3 == 1  # [30:29] rmt_jetty_type
    assert dw0 >> 31 == 0  # [31] owner
    assert dw1 & 0xFF == 0x5A and dw1 >> 8 & 0xFF == Opcode.WRITE and dw1 >> 22 == 0
    assert dw2 & 0xFFFFFF == 0xABCDEF and dw2 >> 24 == 1  # tp_id, sge_num
    assert dw3 == 0xFEDCB  # [19:0] tokenId, [31:20] rsv
    assert raw[16:32] == EID.to_bytes(16, "little")
    assert struct.unpack_from("<I", raw, 32)[0] == 0xDEADBEEF
    assert struct.unpack_from("<I", raw, 36)[0] == 0
    assert struct.unpack_from("<Q", raw, 40)[0] == 0x1000_0000_1234
    assert struct.unpack_from("<IIQ", raw, 48) == (4096, 0, 0x0800_0000_0040)
    assert raw == _ref_wqe(_fields(Opcode.WRITE, sqe_bb_idx=0x1234, target_hint=0x5A))


def test_notify_wqe_offsets():
    f = _fields(Opcode.WRITE_WITH_NOTIFY, notify_tid=0x12345, notify_token=0xCAFEF00D,
                notify_va=0x1000_0000_2000, notify_value=0xFFFF_0000_1111_2222)
    raw = layout.pack_wqe(**f)
    assert len(raw) == 128
    q0, q1, q2, q3 = struct.unpack_from("<QQQQ", raw, 48)
    assert q0 == 0x12345 | 0xCAFEF00D << 32 and q1 == 0x1000_0000_2000 and q2 == 0xFFFF_0000_1111_2222 and q3 == 0
    assert struct.unpack_from("<IIQ", raw, 80) == (4096, 0, 0x0800_0000_0040)  # the SGE moves to 80
    assert raw[96:] == bytes(32)
    assert raw == _ref_wqe(f)


@pytest.mark.parametrize("size", [4, 8])
def test_atomic_wqe_offsets(size):
    mask = (1 << 8 * size) - 1
    faa = _fields(Opcode.FAA, sge_len=size, operand=0x1122_3344_5566_7788 & mask)
    raw = layout.pack_wqe(**faa)
    assert len(raw) == 128 and struct.unpack_from("<IIQ", raw, 48)[0] == size
    assert int.from_bytes(raw[64:64 + size], "little") == faa["operand"]
    assert raw == _ref_wqe(faa)
    cas = _fields(Opcode.CAS, sge_len=size, operand=0xA1A2_A3A4_A5A6_A7A8 & mask, compare=0xB1B2_B3B4_B5B6_B7B8 & mask)
    raw = layout.pack_wqe(**cas)
    assert int.from_bytes(raw[64:64 + size], "little") == cas["operand"]  # swap at 64
    assert int.from_bytes(raw[64 + size:64 + 2 * size], "little") == cas["compare"]  # compare at 64 + size
    assert raw == _ref_wqe(cas)


def test_reduce_fields():
    f = _fields(Opcode.WRITE, flag=0x20 | layout.REDUCE_FLAG, sge_len=4, reduce_dtype=0x7, reduce_op=0xA)
    raw = layout.pack_wqe(**f)
    assert struct.unpack_from("<I", raw, 36)[0] == 0x7 << 8 | 0xA << 12
    w = layout.decode_wqe(raw)
    assert (w.reduce_dtype, w.reduce_op, w.opcode_name) == (0x7, 0xA, "WRITE_WITH_REDUCE")


def test_fields_do_not_bleed_into_their_neighbours():
    """Over-wide values are masked to their field; nothing spills into the next one."""
    raw = layout.pack_wqe(opcode=Opcode.WRITE, flag=0x1FF, tp_id=2**32 - 1, rmt_seg_id=2**32 - 1, rmt_eid=0,
                          rmt_token_value=2**40 - 1, rmt_va=0, sqe_bb_idx=2**20 - 1, target_hint=0x1FF)
    w = layout.decode_wqe(raw)
    assert (w.sqe_bb_idx, w.flag, w.tp_id, w.sge_num, w.rmt_seg_id, w.rmt_token_value) == \
        (0xFFFF, 0xFF, 0xFFFFFF, 1, 0xFFFFF, 0xFFFF_FFFF)
    assert (w.token_en, w.rmt_jetty_type, w.owner, w.target_hint, w.opcode) == (1, 1, 0, 0xFF, Opcode.WRITE)


def test_decode_reads_owner_and_inline_len():
    raw = bytearray(layout.pack_wqe(**_fields(Opcode.READ)))
    struct.pack_into("<I", raw, 0, struct.unpack_from("<I", raw, 0)[0] | 1 << 31)
    struct.pack_into("<I", raw, 4, struct.unpack_from("<I", raw, 4)[0] | 0x3FF << 22)
    struct.pack_into("<I", raw, 52, 0x777)
    w = layout.decode_wqe(raw)
    assert (w.owner, w.inline_msg_len, w.sge_token_id, w.opcode) == (1, 0x3FF, 0x777, Opcode.READ)


# --- WQE: encode/decode round trips over random values -----------------------------------------------------

_common = dict(flag=U(8), tp_id=U(24), rmt_seg_id=U(20), rmt_eid=U(128), rmt_token_value=U(32), rmt_va=U(64),
               sqe_bb_idx=U(16), target_hint=U(8), token_en=U(1), reduce_dtype=U(4), reduce_op=U(4))


@settings(max_examples=150, deadline=None)
@given(opcode=st.sampled_from([Opcode.WRITE, Opcode.READ, Opcode.NOP]), sge_len=U(32), sge_va=U(64), **_common)
def test_roundtrip_one_bb(**f):
    _roundtrip(f)


@settings(max_examples=150, deadline=None)
@given(sge_len=U(32), sge_va=U(64), notify_tid=U(20), notify_token=U(32), notify_va=U(64), notify_value=U(64),
       **_common)
def test_roundtrip_notify(**f):
    _roundtrip(dict(f, opcode=Opcode.WRITE_WITH_NOTIFY))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), opcode=st.sampled_from([Opcode.FAA, Opcode.CAS]), size=st.sampled_from([4, 8]),
       sge_va=U(64), **_common)
def test_roundtrip_atomics(data, opcode, size, **f):
    f = dict(f, opcode=opcode, sge_len=size, operand=data.draw(U(8 * size)))
    if opcode == Opcode.CAS:
        f["compare"] = data.draw(U(8 * size))
    _roundtrip(f)


def _roundtrip(f: dict) -> None:
    raw = layout.pack_wqe(**f)
    assert raw == _ref_wqe(f)
    w = layout.decode_wqe(raw)
    for name, value in f.items():
        assert getattr(w, name) == value, name
    assert (w.sge_num, w.rmt_jetty_type, w.owner, w.inline_msg_len, w.sge_token_id) == (1, 1, 0, 0, 0)
    assert w.bbs * 64 == len(raw)
    assert w.cqe == f["flag"] >> 5 & 1
    text = describe.format_wqe(w)
    assert "\n" not in text
    _columns_match(raw, w)


def _columns_match(raw: bytes, w) -> None:
    """``wqe_columns`` (the vectorised decoder the replay uses) reads the fields ``decode_wqe`` reads."""
    col = {k: int(v[0]) for k, v in layout.wqe_columns(np.frombuffer(raw, np.uint8).reshape(-1, 64), [0]).items()}
    notify, atomic = w.opcode == Opcode.WRITE_WITH_NOTIFY, w.opcode in (Opcode.FAA, Opcode.CAS)
    want = dict(opcode=w.opcode, flag=w.flag, length=w.sge_len, rmt_va=w.rmt_va, sge_va=w.sge_va,
                notify_va=w.notify_va if notify else 0, notify_value=w.notify_value if notify else 0,
                operand=w.operand if atomic else 0, compare=w.compare if w.opcode == Opcode.CAS else 0)
    assert col == want


# --- CQE --------------------------------------------------------------------------------------------------------


def test_cqe_offsets():
    f = dict(owner=1, opcode=5, status=0x06, substatus=0x42, entry_idx=0xBEEF, tpn=0xABCDEF, byte_cnt=0x1234_5678,
             user_data=0x1122_3344_5566_7788, rmt_eid=EID, data=0x99AA_BBCC_DDEE_FF00)
    raw = layout.pack_cqe(**f)
    dw = struct.unpack("<16I", raw)
    assert dw[0] >> 2 & 1 == 1 and dw[0] >> 4 & 7 == 5 and dw[0] >> 16 & 0xFF == 0x42 and dw[0] >> 24 == 0x06
    assert dw[0] & 0b1000_1011 == 0  # s_r, is_jetty, inline_en, fd
    assert dw[1] == 0xBEEF and dw[2] == 0 and dw[3] == 0xABCDEF and dw[4] == 0x1234_5678
    assert dw[5] | dw[6] << 32 == f["user_data"]
    assert sum(dw[7 + i] << (32 * i) for i in range(4)) == EID
    assert dw[11] | dw[12] << 32 == f["data"] and dw[13:] == (0, 0, 0)
    assert raw == _ref_cqe(f)


@settings(max_examples=200, deadline=None)
@given(owner=U(1), opcode=U(3), status=U(8), substatus=U(8), entry_idx=U(16), tpn=U(24), byte_cnt=U(32),
       user_data=U(64), rmt_eid=U(128), data=U(64))
def test_cqe_roundtrip(**f):
    raw = layout.pack_cqe(**f)
    assert raw == _ref_cqe(f)
    c = layout.decode_cqe(raw)
    for name, value in f.items():
        assert getattr(c, name) == value, name
    assert c.ok == (f["status"] == 0 and f["substatus"] == 0)


def test_cqe_dtype_matches_the_packer():
    f = dict(owner=1, opcode=3, status=2, substatus=9, entry_idx=77, tpn=0x123, byte_cnt=4096, user_data=2**40 + 5,
             rmt_eid=EID, data=2**63 + 1)
    rec = np.frombuffer(layout.pack_cqe(**f), layout.CQE_DTYPE)[0]
    assert rec["dw0"] >> 24 == 2 and rec["dw1"] & 0xFFFF == 77 and rec["tpn"] == 0x123 and rec["byte_cnt"] == 4096
    assert int(rec["user_data"][0]) | int(rec["user_data"][1]) << 32 == 2**40 + 5
    assert int(rec["data"][0]) | int(rec["data"][1]) << 32 == 2**63 + 1
    offsets = {name: layout.CQE_DTYPE.fields[name][1] for name in layout.CQE_DTYPE.names}
    assert offsets == {"dw0": 0, "dw1": 4, "dw2": 8, "tpn": 12, "byte_cnt": 16, "user_data": 20, "rmt_eid": 28,
                       "data": 44, "inline_data": 52}


def test_wqe_dtype_matches_the_packer():
    raw = layout.pack_wqe(**_fields(Opcode.WRITE))
    rec = np.frombuffer(raw, layout.WQE_DTYPE)[0]
    offsets = {name: layout.WQE_DTYPE.fields[name][1] for name in layout.WQE_DTYPE.names}
    assert offsets == {"dw0": 0, "dw1": 4, "tp_sge": 8, "rmt_seg_id": 12, "rmt_eid": 16, "rmt_token_value": 32,
                       "reduce_attr": 36, "rmt_va": 40, "sge_len": 48, "sge_token_id": 52, "sge_va": 56}
    assert rec["tp_sge"] & 0xFFFFFF == 0xABCDEF and rec["rmt_va"] == 0x1000_0000_1234 and rec["sge_len"] == 4096


# --- the vectorised builder ----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 40), opcode=st.sampled_from([Opcode.WRITE, Opcode.READ]), tp_id=U(24),
       rmt_seg_id=U(20), rmt_eid=U(128), rmt_token_value=U(32))
def test_build_write_batch_rows_equal_pack_wqe(data, n, opcode, tp_id, rmt_seg_id, rmt_eid, rmt_token_value):
    rmt_va = data.draw(st.lists(U(64), min_size=n, max_size=n))
    sge_len = data.draw(st.lists(U(32), min_size=n, max_size=n))
    sge_va = data.draw(st.lists(U(64), min_size=n, max_size=n))
    flag = data.draw(st.lists(st.sampled_from([0x00, 0x20, 0x26, 0x28]), min_size=n, max_size=n))
    batch = layout.build_write_batch(n, tp_id=tp_id, rmt_seg_id=rmt_seg_id, rmt_eid=rmt_eid,
                                     rmt_token_value=rmt_token_value, rmt_va=np.array(rmt_va, np.uint64),
                                     sge_len=np.array(sge_len, np.uint64), sge_va=np.array(sge_va, np.uint64),
                                     flag=np.array(flag, np.uint64), opcode=opcode)
    assert batch.shape == (n, 8) and batch.dtype == np.uint64
    for i in range(n):
        expected = layout.pack_wqe(opcode=opcode, flag=flag[i], tp_id=tp_id, rmt_seg_id=rmt_seg_id, rmt_eid=rmt_eid,
                                   rmt_token_value=rmt_token_value, rmt_va=rmt_va[i], sge_len=sge_len[i],
                                   sge_va=sge_va[i])
        assert batch[i].tobytes() == expected, i


def test_build_write_batch_scalars_broadcast_and_two_bb_opcodes_are_refused():
    batch = layout.build_write_batch(3, tp_id=5, rmt_seg_id=6, rmt_eid=7, rmt_token_value=8, rmt_va=9, sge_len=64,
                                     sge_va=10)
    assert len({row.tobytes() for row in batch}) == 1
    with pytest.raises(ValueError, match="one-BB"):
        layout.build_write_batch(1, tp_id=0, rmt_seg_id=0, rmt_eid=0, rmt_token_value=0, rmt_va=0, sge_len=0,
                                 sge_va=0, opcode=Opcode.FAA)


# --- formatting -----------------------------------------------------------------------------------------------


def _hexes(text: str) -> set[int]:
    return {int(h, 16) for h in re.findall(r"0x[0-9a-fA-F]+", text)} | {int(d) for d in re.findall(r"\b\d+\b", text)}


@pytest.mark.parametrize("opcode", [Opcode.WRITE, Opcode.READ, Opcode.WRITE_WITH_NOTIFY, Opcode.FAA, Opcode.CAS,
                                    Opcode.NOP])
def test_format_wqe_mentions_every_field(opcode):
    """Every field set to a distinct non-default value must show up (by name and value) in the one-line format."""
    raw = bytearray(layout.pack_wqe(
        opcode=opcode, flag=0x2B | layout.REDUCE_FLAG, tp_id=0xA1B2C3, rmt_seg_id=0x5D6E7, rmt_eid=EID,
        rmt_token_value=0xC0FFEE11, rmt_va=0x1000_0000_4440, sge_len=8, sge_va=0x0800_0000_0880, notify_tid=0x3A3A3,
        notify_token=0xFACEB00C, notify_va=0x1000_0000_7770, notify_value=0x5151_5151_5151, operand=0x1313_1313,
        compare=0x2424_2424, reduce_dtype=0x7, reduce_op=0xA, token_en=0, sqe_bb_idx=0x4321, target_hint=0x66))
    dw0 = struct.unpack_from("<I", raw, 0)[0] | 1 << 31  # owner
    struct.pack_into("<I", raw, 0, dw0 & ~(3 << 29) | 2 << 29)  # rmt_jetty_type 2
    struct.pack_into("<I", raw, 4, struct.unpack_from("<I", raw, 4)[0] | 0x155 << 22)  # inline_msg_len
    struct.pack_into("<I", raw, 8, 0xA1B2C3 | 3 << 24)  # sge_num 3
    sge = 80 if opcode == Opcode.WRITE_WITH_NOTIFY else 48
    struct.pack_into("<I", raw, sge + 4, 0x9F9F)  # sge token_id
    w = layout.decode_wqe(raw)
    text = describe.format_wqe(w)
    values = _hexes(text)
    expected = {"sqe_bb_idx": 0x4321, "flag": 0xAB, "token_en": 0, "rmt_jetty_type": 2, "owner": 1,
                "target_hint": 0x66, "inline_msg_len": 0x155, "tp_id": 0xA1B2C3, "sge_num": 3,
                "rmt_seg_id": 0x5D6E7, "rmt_eid": EID, "rmt_token_value": 0xC0FFEE11, "reduce_dtype": 0x7,
                "reduce_op": 0xA, "rmt_va": 0x1000_0000_4440, "sge_len": 8, "sge_token_id": 0x9F9F,
                "sge_va": 0x0800_0000_0880}
    if opcode == Opcode.WRITE_WITH_NOTIFY:
        expected.update(notify_tid=0x3A3A3, notify_token=0xFACEB00C, notify_va=0x1000_0000_7770,
                        notify_value=0x5151_5151_5151)
    if opcode in (Opcode.FAA, Opcode.CAS):
        expected["operand"] = 0x1313_1313
    if opcode == Opcode.CAS:
        expected["compare"] = 0x2424_2424
    assert w.opcode_name.split("_WITH_REDUCE")[0] in text or Opcode(opcode).name in text
    missing = {name: value for name, value in expected.items() if getattr(w, name) != value or value not in values}
    assert not missing, f"{missing} not in {text!r}"
    assert "odr=RO" not in text and "odr=odr3" in text and "fence" in text and "cqe" in text and "reduce" in text


def test_format_wqe_uses_describe_va():
    w = layout.decode_wqe(layout.pack_wqe(**_fields(Opcode.WRITE)))
    text = describe.format_wqe(w, describe_va=lambda va: f"<va {va:#x}>")
    assert "<va 0x100000001234>" in text and "<va 0x80000000040>" in text


def test_format_cqe_mentions_every_field():
    c = layout.decode_cqe(layout.pack_cqe(owner=1, opcode=6, status=CqeStatus.TOKEN_MISMATCH, substatus=0x17,
                                          entry_idx=0x2345, tpn=0xABCDE, byte_cnt=777, user_data=0x9876_5432,
                                          rmt_eid=EID, data=0xD00D))
    text = describe.format_cqe(c)
    values = _hexes(text)
    assert "TOKEN_MISMATCH" in text
    for name in ("owner", "opcode", "substatus", "entry_idx", "tpn", "byte_cnt", "user_data", "rmt_eid", "data"):
        assert getattr(c, name) in values, f"{name}={getattr(c, name)} not in {text!r}"
    ok = describe.format_cqe(layout.decode_cqe(layout.pack_cqe(owner=0, opcode=3, status=0, substatus=0, entry_idx=1,
                                                              tpn=1, byte_cnt=64, user_data=0, rmt_eid=1)))
    assert ok.startswith("SUCCESS")
    assert "status 0x77" in describe.format_cqe(layout.decode_cqe(layout.pack_cqe(
        owner=0, opcode=3, status=0x77, substatus=0, entry_idx=1, tpn=1, byte_cnt=0, user_data=0, rmt_eid=1)))


# --- context tables ----------------------------------------------------------------------------------------------


def _offsets(dtype: np.dtype) -> dict:
    return {name: (dtype.fields[name][1], dtype.fields[name][0].itemsize) for name in dtype.names}


def test_wq_ctx_layout():
    """``wq_ctx``: u32 wqn; u64 buf_addr; u32 wqe_size; u32 depth; u32 head; u32 tail; i32 db_mode; u64 db_addr;
    u32 sl; u32 cqe_cnt; u64 amo_addr (natural C alignment), 64 bytes."""
    assert layout.WQ_CTX_DTYPE.itemsize == 64
    assert _offsets(layout.WQ_CTX_DTYPE) == {
        "wqn": (0, 4), "buf_addr": (8, 8), "wqe_size": (16, 4), "depth": (20, 4), "head": (24, 4), "tail": (28, 4),
        "db_mode": (32, 4), "db_addr": (40, 8), "sl": (48, 4), "cqe_cnt": (52, 4), "amo_addr": (56, 8)}
    assert layout.WQ_CTX_DTYPE["db_mode"].kind == "i"
    assert (WQ_HEAD * 4, WQ_TAIL * 4, WQ_CQE_CNT * 4) == (24, 28, 52)  # the word indices queues.py stores through


def test_cq_ctx_layout():
    assert layout.CQ_CTX_DTYPE.itemsize == 64
    assert _offsets(layout.CQ_CTX_DTYPE) == {
        "cqn": (0, 4), "buf_addr": (8, 8), "cqe_size": (16, 4), "depth": (20, 4), "head": (24, 4), "tail": (28, 4),
        "db_mode": (32, 4), "db_addr": (40, 8)}
    assert CQ_TAIL * 4 == 28


def test_remote_mem_info_layout():
    assert layout.REMOTE_MEM_INFO_DTYPE.itemsize == 64
    assert _offsets(layout.REMOTE_MEM_INFO_DTYPE) == {
        "token_value_valid": (0, 1), "rmt_jetty_type": (1, 1), "target_hint": (2, 1), "_rsv": (3, 1), "tpn": (4, 4),
        "tid": (8, 4), "rmt_token_value": (12, 4), "len": (16, 8), "addr": (24, 8), "eid_addr": (32, 8),
        "eid": (40, 16), "_pad": (56, 8)}


def test_hw_record_layout():
    assert HW_DTYPE.itemsize == 64
    assert _offsets(HW_DTYPE)["sq_db"] == (0, 4) and _offsets(HW_DTYPE)["cq_db"] == (4, 4)
    assert _offsets(HW_DTYPE)["executed"] == (32, 8) and _offsets(HW_DTYPE)["bytes"] == (40, 8)

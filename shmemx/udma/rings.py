"""How WQEs sit in an SQ ring: a two-BB WQE at the last slot wraps its second half to the ring start, a span of
BBs holds WQEs of one or two BBs, and beside each slot a sidecar word says which call and AIV block posted it
(metadata next to the WQE, never inside it: the 64 bytes stay bit-exact).

Rings are ``[depth, 64] uint8`` (``[depth, 16] uint32`` views for scans); positions are the monotonic 32-bit BB
counters of the data plane, ``mask`` = depth - 1.
"""

from __future__ import annotations

import enum

import numpy as np

from .layout import _TWO_BB_LIST, M32, OPCODE_BYTE, W_DW1, W_SGE_LEN, opcode_of, sge_len_word, wqe_bbs

__all__ = ["Api", "sidecar_word", "decode_sidecar", "read_wqe", "scan_wqes"]




class Api(enum.IntEnum):
    """Which call posted a WQE (low byte of the sidecar word; the posting AIV block is above it)."""

    RAW = 0
    PUT_NBI = 1
    GET_NBI = 2
    QP_PUT_NBI = 3
    QP_GET_NBI = 4
    PUT_SIGNAL_NBI = 5
    QP_PUT_SIGNAL_NBI = 6
    ATOMIC = 7
    SUBMIT = 8
    DEFER = 9

    @property
    def call(self) -> str:
        return "raw post" if self is Api.RAW else f"aclshmemx_udma_{self.name.lower()}"


def sidecar_word(api: int, block: int) -> int:
    return api | block << 8


def decode_sidecar(word: int) -> tuple[str, int]:
    """(the posting call's name, its AIV block) of a sidecar word."""
    try:
        call = Api(word & 0xFF).call
    except ValueError:
        call = f"api {word & 0xFF}"
    return call, word >> 8


def read_wqe(ring: np.ndarray, mask: int, pos: int) -> bytes:
    """The bytes (64 or 128) of the WQE at BB position ``pos`` of an SQ ring (``[depth, 64] uint8``, ``mask`` =
    depth - 1), its second BB taken from the ring start when it wrapped."""
    first = bytes(ring[pos & mask])
    if wqe_bbs(first[OPCODE_BYTE]) == 1:
        return first
    return first + bytes(ring[(pos + 1) & mask])


def scan_wqes(sq32: np.ndarray, mask: int, head: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(BB positions, SGE lengths, opcodes), as int64 arrays, of the WQEs in the ``n`` BBs of an SQ ring (``[depth,
    16] uint32``, ``mask`` = depth - 1) that start at BB position ``head``; two-BB WQEs count once."""
    slots = (head + np.arange(n)) & mask
    ops = opcode_of(sq32[slots, W_DW1])
    if not np.isin(ops, _TWO_BB_LIST).any():
        return (head + np.arange(n)) & M32, sq32[slots, W_SGE_LEN].astype(np.int64), ops.astype(np.int64)
    positions, lengths, opcodes = [], [], []
    i = 0
    while i < n:
        op = int(ops[i])
        word = sge_len_word(op)  # beyond 16 it lies in the next BB, which wraps like the slot
        lengths.append(int(sq32[(int(slots[i]) + word // 16) & mask, word % 16]))
        positions.append((head + i) & M32)
        opcodes.append(op)
        i += wqe_bbs(op)
    return np.array(positions, np.int64), np.array(lengths, np.int64), np.array(opcodes, np.int64)

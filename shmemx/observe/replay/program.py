"""A recording as programs: per PE its WQEs (decoded from the recorded bytes) and per thread its operations.

The recorded BBs are the exact WQEs the engine executed; what the timing model needs of each is decoded here
once, vectorised, into ``Wqes`` columns: opcode, flag (fence, CQE), payload bytes, the target word range at
the peer (its heap offset), and for WRITE_WITH_NOTIFY / FAA / CAS the value they write. A thread's program is its
recorded rows in order, each a tuple ``(kind, f1, ..., f9)``; a POST row is rewritten to ``(POST, queue,
first WQE, end WQE, ...)`` indices into its PE's ``Wqes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..record import FORMATS, Ev, Recording
from ...udma.layout import TWO_BB_OPCODES, W_DW1, Opcode, opcode_of, wqe_columns

__all__ = ["Program", "Wqes", "Words", "load_program", "REDUCE"]

REDUCE = 0x80
_TWO_BB = sorted(int(op) for op in TWO_BB_OPCODES)


@dataclass
class Wqes:
    """One PE's posted WQEs in posting order (all ``[n] int64`` but ``value``/``compare`` ``[n] uint64``).

    ``peer``: the queue's peer; ``qp``: its QP; ``offset``: heap offset of the remote range (a READ's source)
    at the peer, -1 outside its heap; ``local``: a READ's destination offset in this PE's heap (-1 elsewhere);
    ``value``: a notify's signal value, an FAA's operand, a CAS's swap; ``sig_offset``: a notify's signal word.
    """

    queue: np.ndarray
    peer: np.ndarray
    qp: np.ndarray
    opcode: np.ndarray
    flag: np.ndarray
    nbytes: np.ndarray
    offset: np.ndarray
    local: np.ndarray
    sig_offset: np.ndarray
    value: np.ndarray
    compare: np.ndarray
    pos: np.ndarray

    def __len__(self) -> int:
        return len(self.opcode)


@dataclass
class Words:
    """The words a wait or test watches: ``pe``, ``offsets`` (list), ``size``, ``signed``, and per word the value
    to compare with and whether it is active (the status mask)."""

    pe: int
    offsets: list
    size: int
    signed: bool
    values: list
    active: list
    cmp: int
    call: int
    result: int
    test: bool
    floating: bool = False  # float32 words: values (and the words read) compare as floats


@dataclass
class Program:
    """Every PE's WQEs and threads (``threads[pe][slot]`` = list of op tuples), from one recording."""

    n_pes: int
    qp_num: int
    wqes: list[Wqes]
    threads: list[dict[int, list[tuple]]]
    names: list[list[str]]
    words: list[Words] = field(default_factory=list)  # WAIT/TEST ops refer to these by index (field 1)
    payloads: list[dict] = field(default_factory=list)  # per PE: {WQE index: bytes} of the small payloads
    watched: dict = field(default_factory=dict)  # pe -> sorted [k] int64 offsets of words some wait watches
    mte_nbi: bool = True  # MTE copies complete at MTE_QUIET ops (False: format /1, each copy blocks its thread)


def load_program(recording: "Recording | str") -> Program:
    rec = Recording.load(recording) if isinstance(recording, str) else recording
    parts = rec.parts
    qp_num = parts[0].meta["qp_num"]
    prog = Program(rec.n_pes, qp_num, [], [], [p.meta["names"] for p in parts],
                   mte_nbi=rec.job.get("format") != FORMATS[0])
    for part in parts:
        base, stride = part.meta["heap_va_base"], part.meta["heap_va_stride"]
        wq, post_ranges, row_base = _decode_wqes(part, qp_num, base, stride)
        prog.wqes.append(wq)
        payloads: dict = {}
        prog.payloads.append(payloads)
        prog.threads.append({slot: _ops(prog, part, rows, post_ranges, row_base[slot], wq, payloads)
                             for slot, rows in sorted(part.slots.items())})
    watched: dict[int, set] = {}
    for w in prog.words:
        watched.setdefault(w.pe, set()).update(w.offsets)
    prog.watched = {pe: np.array(sorted(s), np.int64) for pe, s in watched.items()}
    return prog


def _ops(prog: Program, part, rows: np.ndarray, post_ranges: dict, row_base: int, wq: Wqes,
         payloads: dict) -> list[tuple]:
    ops = []
    copies = False  # MTE copies since the last MTE_QUIET (completed implicitly by a barrier, sync_all, a block's end)
    for row in rows.tolist():
        kind = row[0]
        if prog.mte_nbi:
            if kind == Ev.MTE and row[1] != part.pe:
                copies = True
            elif kind == Ev.MTE_QUIET:
                copies = False
            elif copies and (kind in (Ev.BARRIER, Ev.SYNC) or (kind == Ev.BLOCK and not row[2])):
                ops.append((Ev.MTE_QUIET,))
                copies = False
        if kind == Ev.VALUE:  # the bytes of a small payload of the POST (or MTE) before it
            data = np.array(row[3:7], "<i8").tobytes()[:row[2]]
            last = ops[-1]
            if last[0] in (Ev.MTE, Ev.SDMA):
                ops[-1] = last + (data,)
            else:
                first, end = last[2], last[3]
                i = first + int(np.searchsorted(wq.pos[first:end], row[1]))
                if i < end and wq.pos[i] == row[1]:
                    payloads[i] = data
        elif kind == Ev.POST:
            first, end = post_ranges[row_base + row[4]]
            ops.append((Ev.POST, row[1], first, end))
        elif kind == Ev.WAIT or kind == Ev.TEST:
            ops.append((kind, len(prog.words)))
            prog.words.append(_words(part, row, kind == Ev.TEST))
        else:
            ops.append(tuple(row[:_WIDTH.get(kind, 10)]))
    if copies:
        ops.append((Ev.MTE_QUIET,))
    return ops


_WIDTH = {Ev.MTE_QUIET: 1, Ev.QUIET: 4, Ev.SIGNAL: 6, Ev.MTE: 5, Ev.BARRIER: 6, Ev.REGION: 3, Ev.COMPUTE: 3,
          Ev.LAUNCH: 3, Ev.BLOCK: 3, Ev.SYNC: 2, Ev.JOIN: 2, Ev.SDMA: 5, Ev.SDMA_QUIET: 1, Ev.SDMA_NOTIFY: 1}


def _words(part, row: list, test: bool) -> Words:
    _, call, pe, offset, stride, code, count, cmp, value, result = row
    size, signed = code & 0xFF, bool(code >> 8 & 1)
    extra = code >> 16
    offsets = [offset + i * stride for i in range(count)]
    values, active = [value] * count, [True] * count
    if extra:
        ex = part.meta["extras"][extra - 1]
        if ex["values"] is not None:
            values = list(ex["values"])
        if ex["active"] is not None:
            active = list(ex["active"])
    if not signed:  # recorded as int64 bits: back to the word's unsigned value
        values = [v & ((1 << 8 * size) - 1) for v in values]
    floating = bool(code >> 9 & 1)
    if floating:  # recorded as the float32's bits
        values = [float(np.array(v & 0xFFFF_FFFF, "<u4").view("<f4")) for v in values]
    return Words(pe, offsets, size, signed, values, active, cmp, call, result, test, floating)


def _decode_wqes(part, qp_num: int, heap_base: int, heap_stride: int) -> tuple[Wqes, dict]:
    """Decode every WQE of one PE's recorded BBs (the threads' blobs one after the other); returns the columns,
    ``{first BB row of a POST in the joined blobs: (first WQE, end WQE)}`` and each thread's first row there."""
    posts = []  # (bb row, bbs, queue, pos)
    row_base, blobs, n_rows = {}, [], 0
    for slot, rows in sorted(part.slots.items()):
        row_base[slot] = n_rows
        blob = part.bbs.get(slot, np.zeros((0, 64), np.uint8))
        blobs.append(blob)
        p = rows[rows[:, 0] == Ev.POST]
        posts.extend(zip((p[:, 4] + n_rows).tolist(), p[:, 3].tolist(), p[:, 1].tolist(), p[:, 2].tolist()))
        n_rows += len(blob)
    posts.sort()
    bbs = np.ascontiguousarray(np.concatenate(blobs)) if blobs else np.zeros((0, 64), np.uint8)
    m = len(bbs)
    op_all = opcode_of(bbs.view("<u4").reshape(m, 16)[:, W_DW1])
    two = np.isin(op_all, _TWO_BB)
    is_start = np.ones(m, bool)
    queue_of = np.zeros(m, np.int64)
    pos_of = np.zeros(m, np.int64)
    for row, n, queue, pos in posts:
        queue_of[row:row + n] = queue
        pos_of[row:row + n] = pos + np.arange(n)
        if two[row:row + n].any():  # a two-BB WQE's second BB is no WQE of its own
            i = row
            while i < row + n:
                if two[i]:
                    is_start[i + 1] = False
                    i += 2
                else:
                    i += 1
    st = np.flatnonzero(is_start)
    col = wqe_columns(bbs, st)  # the one decoder of WQE words (udma.layout)
    op = col["opcode"]
    notify = op == Opcode.WRITE_WITH_NOTIFY
    queue = queue_of[st]
    peer = queue // qp_num
    offset = col["rmt_va"].astype(np.int64) - (heap_base + peer * heap_stride)
    offset[(offset < 0) | (offset >= heap_stride)] = -1
    local = col["sge_va"].astype(np.int64) - (heap_base + part.pe * heap_stride)
    local[(local < 0) | (local >= heap_stride) | (op != Opcode.READ)] = -1
    sig = np.where(notify, col["notify_va"].astype(np.int64) - (heap_base + peer * heap_stride), -1)
    value = np.where(notify, col["notify_value"], col["operand"])
    wq = Wqes(queue=queue, peer=peer, qp=queue % qp_num, opcode=op, flag=col["flag"], nbytes=col["length"],
              offset=offset, local=local, sig_offset=sig, value=value, compare=col["compare"], pos=pos_of[st])
    index_of_row = np.cumsum(is_start) - 1  # WQE index of each start row
    ranges = {}
    for row, n, _, _ in posts:
        first = int(index_of_row[row]) if n else 0
        ranges[row] = (first, int(index_of_row[row + n - 1]) + 1 if n else first)
    return wq, ranges, row_base

"""WQE traces: record cheaply while the job runs, export Chrome trace-event JSON (Perfetto) at the end.

``shmemx run --trace out.json`` sets ``SHMEMX_TRACE_DIR`` for the ranks; each rank then runs with its event log
on (``udma.events``: the same code as any run, which writes its events itself) and makes a ``Tracer`` at init,
which reads two sources at the end:

* the event log: a POST record per WQE (time, queue, BB position, bytes, opcode, block), stamped before its
  doorbell by the native posting path and the Python one alike; a QUIET record per quiet (its start and end), a
  WAIT and WAIT_INFO per wait or test (start, end, the words and the comparison), ARRIVE / DEPART per barrier and
  REGION per user region (``with shmemx.region("notify"):``, ``api.inspection``);
* the DMA engine's own records (flat ``array('q')``): five per turn on a queue (start, end, queue, first BB
  position, BBs covered); under ``--chaos`` one per completed WQE (and one with 0 BBs per earlier piece of a split
  one), and six per decision of its chaos policy (``decisions``: time, kind, queue, BB position, two arguments;
  ``udma/_chaos.c``).

At finalize (or when a failing rank tears down) each rank expands its records into events and writes them to
``<dir>/pe<N>.json``; the launcher concatenates the parts into one JSON document. Times are nanoseconds of the
monotonic clock (``time.perf_counter_ns``, the same in every process), relative to the launcher's start.

The document has one process per PE (``pid`` = pe + 1, named "pe N") with these thread tracks (``tid`` =
(pe + 1) * 100000 + k, so ids are unique across the job):

* "block B" (k = B): posts as instant events "post OPCODE" (category ``wqe``; args peer, qp, pos, bytes), and
  complete events for waits (``wait``; args pe, offset, where, cmp, value, dtype, count), quiets (``quiet``),
  barriers (``barrier``, including init/finalize/malloc/free) and regions (``region``);
* "DMA engine" (k = 999): one complete event per engine turn (``engine``; the queue, first BB, BBs); under
  ``--chaos`` also an instant event per decision of the scheduler (``chaos``: "piece" with the byte range, "hold
  queue" / "hold peer" with steps and ns, "change point" with the new priority, "budget");
* "-> pe P qp Q" (k = 1000 + P * qp_num + Q): one complete event per executed WQE, named by opcode (``wqe``;
  args pos, bytes), ending when its turn completed it. A turn executes a run of WQEs in one vectorised copy,
  so times inside a turn are not observable: each WQE gets an equal share of its turn (the engine track shows
  the real interval).

So every WQE has exactly one post event and one completion event, matched by (pe, peer, qp, pos). The records
keep what a replay needs: BB positions, bytes, the posting block, and for waits the address and condition.
Memory while tracing: 24 bytes per WQE in the rank; the file takes about 250 bytes per WQE.
"""

from __future__ import annotations

import array
import json
import os
import time
from typing import Callable

import numpy as np

from ..shm.control import CMP_SYMBOLS, WaitCall
from ..udma.events import BitFields, Kind, Log, POST_A, QUIET_A, WAIT_A
from ..udma.layout import M32, opcode_name, wqe_bbs_of

__all__ = ["Tracer", "merge_parts", "TRACE_DIR_ENV", "TRACE_T0_ENV"]

TRACE_DIR_ENV = "SHMEMX_TRACE_DIR"
TRACE_T0_ENV = "SHMEMX_TRACE_T0"
_TID_STRIDE = 100_000
_QUEUE_TID = 1000
_ENGINE_TID = 999
_now = time.perf_counter_ns
_PACKED = BitFields(block=8, opcode=8, nbytes=48)  # the third word of a queue's post record


_DECISIONS = {1: ("piece", ("byte_lo", "byte_hi")), 2: ("hold queue", ("steps", "ns")),
              3: ("change point", ("priority", "_")), 4: ("hold peer", ("steps", "ns")),
              5: ("budget", ("credit_ns", "cap_ns")), 6: ("starve", ("quiet_ns", "_")),
              7: ("release", ("starved_ns", "after_quiet"))}  # the chaos policy's decision kinds (udma/_chaos.c)


def _us(ns: int) -> str:
    """Nanoseconds as exact decimal microseconds (the unit of trace-event timestamps)."""
    ns = max(0, int(ns))
    return f"{ns // 1000}.{ns % 1000:03d}"


class Tracer:
    """The records of one PE (see the module docstring).

    Attributes:
        queues: ``{queue index: array('q')}``: post records of each queue (time ns, BB position, bytes << 16 |
            opcode << 8 | block), made from the event log (``take``).
        engine: the engine's turn records.
        decisions: the engine's chaos decisions (under ``--chaos``).
        spans: waits, quiets, barriers and regions of every thread of this PE, made from the event log.
    """

    def __init__(self, out_dir: str, t0: int):
        self.out_dir = out_dir
        self.t0 = t0
        self.queues: dict[int, array.array] = {}
        self.engine = array.array("q")
        self.decisions = array.array("q")
        self.spans: list = []
        self.written: str | None = None

    @classmethod
    def from_env(cls) -> "Tracer | None":
        out_dir = os.environ.get(TRACE_DIR_ENV)
        if not out_dir:
            return None
        t0 = os.environ.get(TRACE_T0_ENV)
        return cls(out_dir, int(t0) if t0 else _now())

    # --- reading the event log --------------------------------------------------------------------------------

    def take(self, log: Log, qp_num: int) -> None:
        """The posts and spans of this PE's event log (``queues``, ``spans``)."""
        r = log.records
        open_spans: dict = {}  # (block, what) -> (start, name) of an arrival or a region's enter
        queue_of: dict[int, int] = {}  # block -> the queue of its last doorbell (its POSTs follow it)
        waits: dict[int, tuple] = {}  # block -> its last WAIT record, until its WAIT_INFO
        cols = ("ts", "kind", "block", "flags", "a", "b", "c", "d", "e", "f")
        for ts, kind, block, flags, a, b, c, d, e, f in zip(*(r[k].tolist() for k in cols)):
            if kind == Kind.DOORBELL:
                queue_of[block] = a
            elif kind == Kind.POST:
                pos, _peer, _qp, op = POST_A.unpack(a)
                self.queues.setdefault(queue_of.get(block, 0), array.array("q")).extend(
                    (ts, pos, _PACKED.pack(block=block, opcode=op, nbytes=f)))
            elif kind == Kind.QUIET:
                peer, qp, call = QUIET_A.unpack(a)
                self.spans.append((d, ts, block, "quiet", WaitCall(call).name.lower(), (peer, qp, c)))
            elif kind == Kind.WAIT:
                waits[block] = (a, b, c, d, e)
            elif kind == Kind.WAIT_INFO and block in waits:
                self._wait(ts, block, a, b, waits.pop(block))
            elif kind == Kind.ARRIVE:
                open_spans[block, "barrier"] = (ts, WaitCall(b).name.lower())
            elif kind == Kind.DEPART and (block, "barrier") in open_spans:
                start, name = open_spans.pop((block, "barrier"))
                self.spans.append((start, ts, block, "barrier", name, (a,)))
            elif kind == Kind.REGION:
                name = log.string(a, b)
                if c:
                    open_spans[block, "region", name] = (ts, name)
                elif (block, "region", name) in open_spans:
                    start, _ = open_spans.pop((block, "region", name))
                    self.spans.append((start, ts, block, "region", name, ()))

    def _wait(self, end: int, block: int, start: int, code: int, wait: tuple) -> None:
        """A wait's span (``WAIT`` fields ``wait``, its start and dtype code from ``WAIT_INFO``)."""
        a, offset, _stride, count, value = wait
        pe, cmp, size, call = WAIT_A.unpack(a)
        kind = "f" if code >> 9 & 1 else "i" if code >> 8 & 1 else "u"
        self.spans.append((start, end, block, "wait", WaitCall(call).name.lower(),
                           (pe, offset, cmp, value, f"<{kind}{size}", count)))

    def write(self, pe: int, qp_num: int, describe_offset: Callable[[int, int], str] | None = None,
              log: Log | None = None) -> str:
        """Write this PE's events (from its event log ``log`` and the engine's records) to
        ``<out_dir>/pe<pe>.json`` (comma-separated event objects); returns the path."""
        if log is not None:
            self.take(log, qp_num)
        lines = _Export(self, pe, qp_num, describe_offset).events()
        path = os.path.join(self.out_dir, f"pe{pe}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(",\n".join(lines))
        os.replace(tmp, path)  # the launcher never sees half a part
        self.written = path
        return path


class _Export:
    """Expands one PE's records into trace-event JSON lines."""

    def __init__(self, tracer: Tracer, pe: int, qp_num: int, describe_offset: Callable[[int, int], str] | None):
        self.tr = tracer
        self.pe = pe
        self.pid = pe + 1
        self.qp_num = qp_num
        self.describe_offset = describe_offset
        self.lines: list[str] = []
        self.blocks: set[int] = set()

    def tid_block(self, slot: int) -> int:
        self.blocks.add(slot)
        return self.pid * _TID_STRIDE + slot

    def tid_queue(self, index: int) -> int:
        return self.pid * _TID_STRIDE + _QUEUE_TID + index

    def events(self) -> list[str]:
        batches = self._batches()
        queues = sorted({i for i, posts in self.tr.queues.items() if posts} | set(batches))
        for index in queues:
            self._queue(index, self.tr.queues.get(index, array.array("q")), batches.get(index))
        for rec in self.tr.spans:
            self._span(*rec)
        self._turns()
        return self._metadata(queues) + self.lines

    def _metadata(self, queues: list[int]) -> list[str]:
        pid = self.pid

        def meta(name: str, args: dict, tid: int | None = None) -> str:
            where = f'"pid":{pid}' + (f',"tid":{tid}' if tid is not None else "")
            return f'{{"ph":"M",{where},"ts":0,"name":"{name}","args":{json.dumps(args)}}}'

        def thread(tid: int, name: str, order: int) -> list[str]:
            return [meta("thread_name", {"name": name}, tid), meta("thread_sort_index", {"sort_index": order}, tid)]

        out = [meta("process_name", {"name": f"pe {self.pe}"}), meta("process_sort_index", {"sort_index": self.pe})]
        for slot in sorted(self.blocks):
            out += thread(pid * _TID_STRIDE + slot, f"block {slot}", slot)
        if self.tr.engine:
            out += thread(pid * _TID_STRIDE + _ENGINE_TID, "DMA engine", _ENGINE_TID)
        for index in queues:
            peer, qp = divmod(index, self.qp_num)
            out += thread(self.tid_queue(index), f"-> pe {peer} qp {qp}", _QUEUE_TID + index)
        return out

    def _batches(self) -> dict[int, np.ndarray]:
        """Engine turns per queue: ``[k, 4] int64`` rows (start ns, end ns, first BB position unwrapped, BBs)."""
        turns = np.frombuffer(self.tr.engine, np.int64).reshape(-1, 5)
        turns = turns[turns[:, 4] > 0]
        out = {}
        for index in np.unique(turns[:, 2]).tolist():
            arr = turns[turns[:, 2] == index][:, [0, 1, 3, 4]].copy()
            arr[:, 2] = _unwrap_near(arr[:, 2])  # a chaos run completes WQEs out of order (never a ring apart)
            out[index] = arr[np.argsort(arr[:, 2], kind="stable")]
        return out

    def _queue(self, index: int, posts: array.array, batches: np.ndarray | None) -> None:
        peer, qp = divmod(index, self.qp_num)
        rows = np.frombuffer(posts, np.int64).reshape(-1, 3)
        if not len(rows):
            return
        t_post, pos, packed = rows[:, 0], _unwrap(rows[:, 1]), rows[:, 2]
        block, ops, nbytes = _PACKED.unpack(packed)
        bbs = wqe_bbs_of(ops)
        t0 = self.tr.t0
        if batches is not None and len(batches):
            k = np.searchsorted(batches[:, 2], pos, side="right") - 1
            b = batches[np.maximum(k, 0)]
            done = (k >= 0) & (pos < b[:, 2] + b[:, 3])
            span, n_bbs = b[:, 1] - b[:, 0], np.maximum(b[:, 3], 1)
            start = b[:, 0] + span * (pos - b[:, 2]) // n_bbs - t0
            end = b[:, 0] + span * (pos - b[:, 2] + bbs) // n_bbs - t0
            dur = np.maximum(end - start - 1, 0)  # 1 ns apart, so that rounding never makes neighbours overlap
        else:
            done = np.zeros(len(pos), bool)
            start = dur = np.zeros(len(pos), np.int64)
        pid, qtid = self.pid, self.tid_queue(index)
        tids = {b: self.tid_block(b) for b in set(block.tolist())}
        names = {op: opcode_name(op) for op in set(ops.tolist())}
        lines = self.lines
        # microseconds as floats with 3 decimals: exact for whole nanoseconds below 2**53 ns (104 days)
        posted, start_us, dur_us = (np.maximum(a, 0) / 1000 for a in (t_post - t0, start, dur))
        for t, blk, p, nb, op, ok, s, d in zip(posted.tolist(), block.tolist(), pos.tolist(), nbytes.tolist(),
                                               ops.tolist(), done.tolist(), start_us.tolist(), dur_us.tolist()):
            name = names[op]
            lines.append(f'{{"ph":"i","s":"t","pid":{pid},"tid":{tids[blk]},"ts":{t:.3f},"name":"post {name}",'
                         f'"cat":"wqe","args":{{"peer":{peer},"qp":{qp},"pos":{p},"bytes":{nb}}}}}')
            if ok:
                lines.append(f'{{"ph":"X","pid":{pid},"tid":{qtid},"ts":{s:.3f},"dur":{d:.3f},"name":"{name}",'
                             f'"cat":"wqe","args":{{"pos":{p},"bytes":{nb}}}}}')

    def _turns(self) -> None:
        """One slice per engine turn on the engine's track: which queue, how many BBs, the real interval; an
        instant event per chaos decision."""
        tid = self.pid * _TID_STRIDE + _ENGINE_TID
        t0 = self.tr.t0
        for ts, kind, index, pos, a, b in np.frombuffer(self.tr.decisions, np.int64).reshape(-1, 6).tolist():
            name, args = _DECISIONS.get(kind, ("decision", ("a", "b")))
            target = f"pe {index} (every qp)" if kind == 4 else f"pe {index // self.qp_num} qp {index % self.qp_num}"
            self.lines.append(f'{{"ph":"i","s":"t","pid":{self.pid},"tid":{tid},"ts":{_us(ts - t0)},'
                              f'"name":"chaos {name}","cat":"chaos","args":{{"queue":"{target}","pos":{pos},'
                              f'"{args[0]}":{a},"{args[1]}":{b}}}}}')
        for start, end, index, ci, n in np.frombuffer(self.tr.engine, np.int64).reshape(-1, 5).tolist():
            if n:
                peer, qp = divmod(index, self.qp_num)
                self.lines.append(f'{{"ph":"X","pid":{self.pid},"tid":{tid},"ts":{_us(start - t0)},'
                                  f'"dur":{_us(end - start)},"name":"-> pe {peer} qp {qp}","cat":"engine",'
                                  f'"args":{{"first_pos":{ci},"bbs":{n}}}}}')

    def _span(self, start: int, end: int, slot: int, kind: str, name: str, args: tuple) -> None:
        detail: dict = {}
        if kind == "wait":
            pe, offset, cmp, value, dtype, count = args
            where = self.describe_offset(pe, offset) if self.describe_offset else f"heap+{offset:#x}"
            detail = {"pe": pe, "offset": offset, "where": where, "cmp": CMP_SYMBOLS[cmp] if 0 <= cmp < 6 else cmp,
                      "value": value, "dtype": dtype, "count": count}
        elif kind == "quiet":
            peer, qp, target = args
            detail = {"peer": peer, "qp": qp, "cqe_cnt": target}
        elif kind == "barrier":
            detail = {"number": args[0]}
        self.lines.append(f'{{"ph":"X","pid":{self.pid},"tid":{self.tid_block(slot)},"ts":{_us(start - self.tr.t0)},'
                          f'"dur":{_us(end - start)},"name":{json.dumps(name)},"cat":"{kind}",'
                          f'"args":{json.dumps(detail)}}}')


def _unwrap(x: np.ndarray) -> np.ndarray:
    """Monotonic 32-bit BB positions as int64, unwrapped across 2**32."""
    x = np.asarray(x, np.int64)
    if len(x) < 2:
        return x
    return np.concatenate([x[:1], x[0] + np.cumsum(np.diff(x) & M32)])


def _unwrap_near(x: np.ndarray) -> np.ndarray:
    """32-bit BB positions that may step back by less than 2**31 (out-of-order completions), as int64."""
    x = np.asarray(x, np.int64)
    if len(x) < 2:
        return x
    return np.concatenate([x[:1], x[0] + np.cumsum(((np.diff(x) + (1 << 31)) & M32) - (1 << 31))])


def merge_parts(out_path: str, part_dir: str, n_pes: int, meta: dict | None = None) -> list[int]:
    """Concatenate ``pe<N>.json`` parts of ``part_dir`` into one trace-event document; returns the PEs missing."""
    missing = []
    tmp = out_path + ".tmp"
    with open(tmp, "w") as out:
        out.write('{"traceEvents":[\n')
        first = True
        for pe in range(n_pes):
            path = os.path.join(part_dir, f"pe{pe}.json")
            if not os.path.exists(path) or os.path.getsize(path) == 0:
                missing.append(pe)
                continue
            if not first:
                out.write(",\n")
            first = False
            with open(path) as part:
                while chunk := part.read(1 << 20):
                    out.write(chunk)
        other = dict(meta or {}, missing_pes=missing, clock="perf_counter_ns relative to the launcher start")
        out.write(f'\n],"displayTimeUnit":"ns","otherData":{json.dumps(other)}}}\n')
    os.replace(tmp, out_path)
    return missing

"""Recordings for virtual time: every event of every thread of a job, in program order, for ``shmemx replay``.

``shmemx run --record FILE`` sets ``SHMEMX_RECORD_DIR`` for the ranks; each rank then runs with its event log on
(``udma.events``, ``Mask.RECORD``: the log keeps the BBs of every doorbell and the bytes of small payloads), the
same code as any run, and at finalize its ``Recorder`` turns its own log into rows, one row of ten int64 per event
in the array of the thread that made it:

=================  ==========================================================================================
event              row (after the kind)
=================  ==========================================================================================
POST               queue, first BB position, BBs, first row in the thread's BB blob (the exact WQEs the engine
                   executes: opcode, flag, length, remote VA, signal VA and value, as copied from the ring
                   before the doorbell); then a VALUE row for each payload of at most 32 bytes (a flag or
                   generation number written as data: its source bytes, so that a replay knows what it writes)
QUIET              queue, the CQE count it waited for, the call
WAIT / TEST        the words (pe, offset, stride, dtype, count), the comparison, the value, the call's result;
SIGNAL             ``signal_op``
MTE / MTE_QUIET    the peer, its heap offset, bytes, direction (and a VALUE row if small) / the thread's copies
                   are complete (``aclshmemx_mte_quiet``)
SDMA ...           SDMA: as MTE, on the calling block's channel; SDMA_QUIET (the block's channel is done);
                   SDMA_NOTIFY (a notify record on the block's channel)
BARRIER            which call, its number (a team barrier: its job-wide key, and the team's start, stride, size)
LAUNCH ... JOIN    LAUNCH / BLOCK begin and end / SYNC (``sync_all``) / JOIN
REGION / COMPUTE   a user region's enter and exit, ``shmemx.compute(us=...)``
=================  ==========================================================================================

Nothing host-dependent is recorded: the rows keep no clock, and a wait is recorded whether it blocked or not, so
the same kernel gives the same recording however loaded the host is (only results that depend on timing, such as
which word a ``wait_until_any`` saw first, can differ, and the replay says where they mattered). At finalize each
rank writes ``<dir>/pe<N>.npz``; the launcher stores the parts in one zip file (``merge_parts``), read back with
``Recording``.
"""

from __future__ import annotations

import array
import enum
import io
import json
import os
import zipfile

import numpy as np

from ..shm.heap import HEAP_VA_BASE, HEAP_VA_STRIDE
from ..udma.events import Kind, Log, QUIET_A, SIGNAL_A, WAIT_A, dtype_code

__all__ = ["Recorder", "Recording", "Ev", "ROW", "RECORD_DIR_ENV", "merge_parts", "FORMAT", "FORMATS", "dtype_code"]

RECORD_DIR_ENV = "SHMEMX_RECORD_DIR"
FORMAT = "shmemx-record/2"
# /1 had no MTE_QUIET rows: its MTE copies are replayed as blocking (each complete before the thread goes on), the
# model of /1; from /2 on a copy is non-blocking and completes at the thread's next MTE_QUIET (or barrier,
# sync_all, its block's end)
FORMATS = ("shmemx-record/1", FORMAT)
ROW = 10  # int64 per event: the kind, then nine fields
_NO_BLOB = (1 << 64) - 1


class Ev(enum.IntEnum):
    """Event kinds, and what their fields hold (after the kind)."""

    POST = 1  # queue index, first BB position, BBs, first row in the thread's BB blob
    QUIET = 2  # queue index, target cqe_cnt, call
    WAIT = 3  # call, pe, offset, stride, dtype code (| extra + 1 << 16), count, cmp, value, result
    TEST = 4  # as WAIT (a non-blocking test: the result is what it returned)
    SIGNAL = 5  # pe, offset, dtype code, op (0 SET, 1 ADD), value
    MTE = 6  # pe, heap offset, bytes, 1 put / 0 get
    BARRIER = 7  # call, number (a team barrier: barrier_key(uid, number), start, stride, size; else 0, 0, 0) (a team barrier: barrier_key(uid, number), start, stride, size; else 0, 0, 0)
    REGION = 8  # name id, 1 enter / 0 exit
    COMPUTE = 9  # microseconds (the float64's bits), name id
    LAUNCH = 10  # launch id, block_dim
    BLOCK = 11  # launch id, 1 begin / 0 end
    SYNC = 12  # launch id
    JOIN = 13  # launch id
    VALUE = 14  # BB position (MTE: -1), bytes, then up to four u64 words: a small payload's bytes (after its POST)
    MTE_QUIET = 15  # (no fields): the calling thread's MTE copies so far are complete (format /2 on)
    SDMA = 16  # pe, heap offset, bytes, 1 put / 0 get: a copy on the calling thread's SDMA channel
    SDMA_QUIET = 17  # (no fields): the calling thread's SDMA copies so far are complete
    SDMA_NOTIFY = 18  # (no fields): a notify record on the calling thread's SDMA channel


SMALL_PAYLOAD = 32  # payloads up to this many bytes (flags, generation numbers) are recorded with their value


def _s64(v: int) -> int:
    v &= 0xFFFF_FFFF_FFFF_FFFF
    return v - (1 << 64) if v >> 63 else v


class Recorder:
    """The recording of one PE: ``Recorder.from_env()`` is None unless recording; ``write`` turns the PE's event
    log into its part (see the module docstring)."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.written: str | None = None

    @classmethod
    def from_env(cls) -> "Recorder | None":
        out_dir = os.environ.get(RECORD_DIR_ENV)
        return cls(out_dir) if out_dir else None

    def write(self, pe: int, n_pes: int, qp_num: int, log: Log) -> str:
        """Write this PE's part, made from its event log, to ``<out_dir>/pe<pe>.npz``; returns the path."""
        rows = _Rows(log, qp_num)
        rows.convert()
        meta = {"pe": pe, "n_pes": n_pes, "qp_num": qp_num, "names": list(rows.names), "extras": rows.extras,
                "heap_va_base": HEAP_VA_BASE, "heap_va_stride": HEAP_VA_STRIDE}
        arrays = {f"slot{s}": np.frombuffer(r, np.int64).reshape(-1, ROW) for s, r in rows.slots.items()}
        arrays.update({f"bbs{s}": np.frombuffer(bytes(b), np.uint8).reshape(-1, 64) for s, b in rows.bbs.items()})
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        path = os.path.join(self.out_dir, f"pe{pe}.npz")
        tmp = path + ".tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, path)  # the launcher never sees half a part
        self.written = path
        return path


class _Rows:
    """The rows of one PE's recording, made from its event log (``convert``): per thread slot its rows and its
    BB blob, the names of regions and compute annotations, the extras of waits."""

    def __init__(self, log: Log, qp_num: int):
        self.log = log
        self.qp_num = qp_num
        self.slots: dict[int, array.array] = {}
        self.bbs: dict[int, bytearray] = {}
        self.names: dict[str, int] = {}
        self.extras: list[dict] = []
        self.waits: dict[int, tuple] = {}  # block -> its WAIT record, until its WAIT_INFO

    def add(self, block: int, *fields: int) -> None:
        self._thread(block).extend([_s64(f) for f in fields] + [0] * (ROW - len(fields)))

    def _thread(self, block: int) -> array.array:
        """The rows of thread slot ``block`` (made, with its BB blob, at its first event)."""
        rows = self.slots.get(block)
        if rows is None:
            rows = self.slots[block] = array.array("q")
            self.bbs[block] = bytearray()
        return rows

    def name(self, offset: int, length: int) -> int:
        text = self.log.string(offset, length)
        return self.names.setdefault(text, len(self.names))

    def convert(self) -> None:
        handlers = {Kind.DOORBELL: self._doorbell, Kind.VALUE: self._value, Kind.QUIET: self._quiet,
                    Kind.WAIT: self._wait, Kind.WAIT_INFO: self._wait_info, Kind.SIGNAL: self._signal,
                    Kind.MTE: self._mte, Kind.ARRIVE: self._barrier, Kind.REGION: self._region,
                    Kind.COMPUTE: self._compute}
        simple = {Kind.MTE_QUIET: lambda r: (Ev.MTE_QUIET,), Kind.SDMA_QUIET: lambda r: (Ev.SDMA_QUIET,),
                  Kind.SDMA_NOTIFY: lambda r: (Ev.SDMA_NOTIFY,),
                  Kind.SDMA: lambda r: (Ev.SDMA, r["a"], r["b"], r["c"], r["d"]), Kind.LAUNCH: lambda r: (Ev.LAUNCH, r["a"], r["b"]),
                  Kind.BLOCK_BEGIN: lambda r: (Ev.BLOCK, r["a"], 1), Kind.BLOCK_END: lambda r: (Ev.BLOCK, r["a"], 0),
                  Kind.SYNC_ARRIVE: lambda r: (Ev.SYNC, r["a"]), Kind.JOIN: lambda r: (Ev.JOIN, r["a"])}
        for r in self.log.records.tolist():
            rec = dict(zip(("ts", "kind", "block", "flags", "site", "a", "b", "c", "d", "e", "f", "g"), r))
            kind = rec["kind"]
            if kind in handlers:
                handlers[kind](rec)
            elif kind in simple:
                self.add(rec["block"], *simple[kind](rec))

    def _doorbell(self, r: dict) -> None:
        block, q, pos, bbs, at = r["block"], r["a"], r["b"], r["c"], r["d"]
        self._thread(block)
        blob = self.bbs[block]
        row = len(blob) // 64
        blob += self.log.blob(at, 64 * bbs) if at != _NO_BLOB else bytes(64 * bbs)
        self.add(block, Ev.POST, q, pos, bbs, row)

    def _value(self, r: dict) -> None:
        pos = -1 if r["a"] == (1 << 64) - 1 else r["a"]
        self.add(r["block"], Ev.VALUE, pos, r["b"], r["c"], r["d"], r["e"], r["f"] | r["g"] << 32)

    def _quiet(self, r: dict) -> None:
        peer, qp, call = QUIET_A.unpack(r["a"])
        self.add(r["block"], Ev.QUIET, peer * self.qp_num + qp, r["c"], call)

    def _wait(self, r: dict) -> None:
        self.waits[r["block"]] = r

    def _wait_info(self, r: dict) -> None:
        w = self.waits.pop(r["block"], None)
        extras = json.loads(self.log.blob(r["d"], r["e"])) if r["d"] != _NO_BLOB and r["e"] else {}
        if w is not None:
            pe, cmp, _size, call = WAIT_A.unpack(w["a"])
            where = (call, pe, w["b"], w["c"], w["d"], cmp, w["e"])
        else:  # a test that did not hold: the words are in its extras
            where = tuple(extras.pop(k) for k in ("call", "pe", "offset", "stride", "count", "cmp", "value"))
        call, pe, offset, stride, count, cmp, value = where
        code = r["b"]
        kept = {k: extras.get(k) for k in ("active", "values")}
        if kept["active"] is not None or kept["values"] is not None:
            self.extras.append(kept)
            code |= len(self.extras) << 16
        self.add(r["block"], Ev.TEST if r["flags"] & 1 else Ev.WAIT, call, pe, offset, stride, code, count, cmp,
                 value, r["c"])

    def _signal(self, r: dict) -> None:
        pe, op, _size = SIGNAL_A.unpack(r["a"])
        self.add(r["block"], Ev.SIGNAL, pe, r["b"], r["c"], op, r["e"])

    def _mte(self, r: dict) -> None:
        self.add(r["block"], Ev.MTE, r["a"], r["b"], r["c"], r["d"])

    def _barrier(self, r: dict) -> None:
        team = (r["c"], r["d"], r["e"]) if r["e"] else ()  # a team barrier: start, stride, size
        self.add(r["block"], Ev.BARRIER, r["b"], r["a"], *team)

    def _region(self, r: dict) -> None:
        self.add(r["block"], Ev.REGION, self.name(r["a"], r["b"]), r["c"])

    def _compute(self, r: dict) -> None:
        self.add(r["block"], Ev.COMPUTE, r["a"], self.name(r["b"], r["c"]))


def merge_parts(out_path: str, part_dir: str, n_pes: int, meta: dict | None = None) -> list[int]:
    """Store the ranks' ``pe<N>.npz`` parts of ``part_dir`` in one zip file; returns the PEs missing."""
    missing = [pe for pe in range(n_pes) if not os.path.exists(os.path.join(part_dir, f"pe{pe}.npz"))]
    tmp = out_path + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
        z.writestr("job.json", json.dumps(dict(meta or {}, format=FORMAT, n_pes=n_pes, missing_pes=missing)))
        for pe in range(n_pes):
            if pe not in missing:
                z.write(os.path.join(part_dir, f"pe{pe}.npz"), f"pe{pe}.npz")
    os.replace(tmp, out_path)
    return missing


class Part:
    """One PE's recorded events: ``slots`` ``{slot: [n, ROW] int64}``, ``bbs`` ``{slot: [m, 64] uint8}`` (the
    BBs that thread posted), ``meta``."""

    def __init__(self, data: bytes):
        self.meta = json.loads(bytes(data["meta"]).decode())
        self.slots = {int(k[4:]): data[k] for k in data.files if k.startswith("slot")}
        self.bbs = {int(k[3:]): data[k] for k in data.files if k.startswith("bbs")}
        self.pe = self.meta["pe"]


class Recording:
    """A recording file written by ``shmemx run --record FILE`` (``merge_parts``)."""

    def __init__(self, job: dict, parts: list[Part]):
        self.job = job
        self.parts = parts
        self.n_pes = job["n_pes"]

    @classmethod
    def load(cls, path: str) -> "Recording":
        try:
            z = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise ValueError(f"{path}: not a shmemx recording ({exc})") from None
        with z:
            job = json.loads(z.read("job.json"))
            if job.get("format") not in FORMATS:
                raise ValueError(f"{path}: format {job.get('format')!r}, expected one of {FORMATS!r}")
            if job.get("missing_pes"):
                raise ValueError(f"{path}: the recording lacks pe(s) {job['missing_pes']} (killed before "
                                 f"finalize?); a replay needs every PE")
            parts = [Part(np.load(io.BytesIO(z.read(f"pe{pe}.npz")))) for pe in range(job["n_pes"])]
        return cls(job, parts)

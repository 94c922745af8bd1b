"""Recordings for virtual time: every event of every thread of a job, in program order, for ``shmemx replay``.

``shmemx run --record FILE`` sets ``SHMEMX_RECORD_DIR`` for the ranks; each rank makes a ``Recorder`` at init
(``rt.recorder``, None when off) that the places where events happen call, never import:

=================================  ===========================================================================
where                              what (one row of ten int64 per event, in the calling thread's own array)
=================================  ===========================================================================
``QueuePair.post_rw`` /            POST: queue, first BB position, BBs, and the BBs themselves, copied from the
``post_bytes`` / ``ring_doorbell``  ring after the WQEs were written and before the doorbell (the exact WQEs the
                                   engine executes: opcode, flag, length, remote VA, signal VA and value); then a
                                   VALUE row for each payload of at most 32 bytes (a flag or generation number
                                   written as data: its source bytes, so that a replay knows what it writes)
``QueuePair.poll``                 QUIET: queue, the CQE count it waits for
``shm.barrier.barrier``            BARRIER: which call, its number (``team_barrier``: its job-wide key, and the
                                   team's start, stride and size)
``api.signals``                    WAIT / TEST: the words (pe, offset, stride, dtype, count), the comparison,
                                   the value, and the result the call returned; SIGNAL (``signal_op``)
``api.rma`` MTE copies             MTE: the peer, its heap offset, bytes, direction (and a VALUE row if small);
                                   MTE_QUIET (``aclshmemx_mte_quiet``: the thread's copies are complete)
``api.sdma`` SDMA copies           SDMA: the peer, its heap offset, bytes, direction (and a VALUE row if small),
                                   on the calling block's channel; SDMA_QUIET (the block's channel is done);
                                   SDMA_NOTIFY (a notify record on the block's channel)
``api.blocks``                     LAUNCH / BLOCK begin and end / SYNC (``sync_all``) / JOIN
``api.inspection``                 REGION enter and exit, COMPUTE (``shmemx.compute(us=...)``)
=================================  ===========================================================================

Nothing host-dependent is recorded: no clock is read, and a wait is recorded whether it blocked or not, so the
same kernel gives the same recording however loaded the host is (only results that depend on timing, such as
which word a ``wait_until_any`` saw first, can differ, and the replay says where they mattered). Each thread
appends to an array of its own (threads of a PE interleave in host order; a thread's own order is its program
order), so rows need no lock. At finalize each rank writes ``<dir>/pe<N>.npz``; the launcher stores the parts
in one zip file (``merge_parts``), read back with ``Recording``.
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
from ..shm.waits import thread_slot

__all__ = ["Recorder", "Recording", "Ev", "ROW", "RECORD_DIR_ENV", "merge_parts", "FORMAT", "FORMATS"]

RECORD_DIR_ENV = "SHMEMX_RECORD_DIR"
FORMAT = "shmemx-record/2"
# /1 had no MTE_QUIET rows: its MTE copies are replayed as blocking (each complete before the thread goes on), the
# model of /1; from /2 on a copy is non-blocking and completes at the thread's next MTE_QUIET (or barrier,
# sync_all, its block's end)
FORMATS = ("shmemx-record/1", FORMAT)
ROW = 10  # int64 per event: the kind, then nine fields


class Ev(enum.IntEnum):
    """Event kinds, and what their fields hold (after the kind)."""

    POST = 1  # queue index, first BB position, BBs, first row in the thread's BB blob
    QUIET = 2  # queue index, target cqe_cnt, call
    WAIT = 3  # call, pe, offset, stride, dtype code (| extra + 1 << 16), count, cmp, value, result
    TEST = 4  # as WAIT (a non-blocking test: the result is what it returned)
    SIGNAL = 5  # pe, offset, dtype code, op (0 SET, 1 ADD), value
    MTE = 6  # pe, heap offset, bytes, 1 put / 0 get
    BARRIER = 7  # call, number (a team barrier: barrier_key(uid, number), start, stride, size; else 0, 0, 0)
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
_WRITE, _NOTIFY = 0x3, 0x5


def dtype_code(dtype: np.dtype) -> int:
    """A word's dtype as an int: itemsize | signed << 8 (| float << 9)."""
    return dtype.itemsize | (dtype.kind == "i") << 8 | (dtype.kind == "f") << 9


def _s64(v: int) -> int:
    v &= 0xFFFF_FFFF_FFFF_FFFF
    return v - (1 << 64) if v >> 63 else v


class Recorder:
    """The recording of one PE (see the module docstring); ``Recorder.from_env()`` is None unless recording."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.slots: dict[int, array.array] = {}
        self.bbs: dict[int, bytearray] = {}  # per thread slot: its posted WQEs' BBs, 64 bytes each, in POST order
        self.names: dict[str, int] = {}
        self.extras: list[dict] = []
        self.launches = 0
        self.written: str | None = None

    @classmethod
    def from_env(cls) -> "Recorder | None":
        out_dir = os.environ.get(RECORD_DIR_ENV)
        return cls(out_dir) if out_dir else None

    def _rows(self, slot: int | None = None) -> array.array:
        slot = thread_slot() if slot is None else slot
        rows = self.slots.get(slot)
        if rows is None:
            rows = self.slots[slot] = array.array("q")
            self.bbs[slot] = bytearray()
        return rows

    def _add(self, *fields: int) -> None:
        self._rows().extend(fields + (0,) * (ROW - len(fields)))

    def _name(self, name: str) -> int:
        i = self.names.get(name)
        if i is None:
            i = self.names[name] = len(self.names)
        return i

    # --- the hooks (each an append or two) ----------------------------------------------------------------

    def post(self, q, pos: int, bbs: int) -> None:
        """WQEs of queue ``q`` at BB positions ``[pos, pos + bbs)``, written and about to be doorbelled."""
        thread = thread_slot()
        rows = self._rows(thread)
        blob = self.bbs[thread]  # (the thread's own: posts of other threads cannot interleave with its rows)
        row = len(blob) // 64
        base, slot = q.sq_base, pos & q.mask
        first = min(bbs, q.depth - slot)
        blob += q.mm[base + 64 * slot:base + 64 * (slot + first)]
        if first < bbs:  # wrapped at the ring end
            blob += q.mm[base:base + 64 * (bbs - first)]
        rows.extend((Ev.POST, q.index, pos, bbs, row, 0, 0, 0, 0, 0))
        self._small_payloads(q, rows, blob, row, pos, bbs)

    def _small_payloads(self, q, rows: array.array, blob: bytearray, row: int, pos: int, bbs: int) -> None:
        """VALUE rows for the WRITEs / notifies among these BBs whose payload is small: a flag or a generation
        number written as data, which a wait may watch (their source bytes, read now: a correct kernel does not
        change a source before its WQE completed)."""
        w32 = np.frombuffer(bytes(blob[64 * row:]), "<u4").reshape(bbs, 16)
        ops = w32[:, 1] >> 8 & 0xFF
        small = ((ops == _WRITE) & (w32[:, 12] <= SMALL_PAYLOAD)) | (ops == _NOTIFY)
        for i in np.flatnonzero(small).tolist():
            if ops[i] == _NOTIFY:
                if i + 1 >= bbs or w32[i + 1, 4] > SMALL_PAYLOAD:
                    continue
                length, va = int(w32[i + 1, 4]), int(w32[i + 1, 6]) | int(w32[i + 1, 7]) << 32
            else:
                length, va = int(w32[i, 12]), int(w32[i, 14]) | int(w32[i, 15]) << 32
            where = q.udma.registry.resolve(va, length) if length else None
            if where is not None:
                buf, off = where
                rows.extend(_value_row(pos + i, bytes(buf[off:off + length])))

    def quiet(self, q, target: int, call: int) -> None:
        self._add(Ev.QUIET, q.index, target, int(call))

    def barrier(self, call: int, number: int, team: tuple | None = None) -> None:
        """A barrier of the job, or with ``team`` = (start, stride, size) one of a team (``number`` its key)."""
        self._add(Ev.BARRIER, int(call), number, *(team or ()))

    def wait(self, call: int, pe: int, offset: int, stride: int, dtype: np.dtype, count: int, cmp: int, value: int,
             result: int, *, test: bool = False, active=None, values=None) -> None:
        """A wait_until-family call (or a test) on ``count`` words at ``offset + i * stride`` of PE ``pe``;
        ``result`` what it returned (a value, an index, a count of indices, a bool; -1 for none). ``active``
        (the status mask) and ``values`` (one value per word) only when the call had them."""
        code = dtype_code(dtype)
        if active is not None or values is not None:
            self.extras.append({"active": None if active is None else [bool(a) for a in active],
                                "values": None if values is None else [int(v) for v in values]})
            code |= len(self.extras) << 16
        self._add(Ev.TEST if test else Ev.WAIT, int(call), pe, offset, stride, code, count, cmp, _s64(value),
                  _s64(result))

    def signal(self, pe: int, offset: int, dtype: np.dtype, op: int, value: int) -> None:
        self._add(Ev.SIGNAL, pe, offset, dtype_code(dtype), op, _s64(value))

    def mte(self, pe: int, offset: int, nbytes: int, put: bool, src=None) -> None:
        """An MTE copy to (``put``) or from PE ``pe``'s heap at ``offset``; ``src`` (a put's source array) is
        recorded when the copy is small (a flag)."""
        self._add(Ev.MTE, pe, offset, nbytes, int(put))
        if put and src is not None and nbytes <= SMALL_PAYLOAD:
            self._rows().extend(_value_row(-1, np.ascontiguousarray(src).reshape(-1).view(np.uint8)[:nbytes]
                                           .tobytes()))

    def mte_quiet(self) -> None:
        self._add(Ev.MTE_QUIET)

    def sdma(self, pe: int, offset: int, nbytes: int, put: bool, src=None) -> None:
        """An SDMA copy posted on the calling thread's channel (as ``mte``: a small put's source is recorded)."""
        self._add(Ev.SDMA, pe, offset, nbytes, int(put))
        if put and src is not None and nbytes <= SMALL_PAYLOAD:
            self._rows().extend(_value_row(-1, np.ascontiguousarray(src).reshape(-1).view(np.uint8)[:nbytes]
                                           .tobytes()))

    def sdma_quiet(self) -> None:
        self._add(Ev.SDMA_QUIET)

    def sdma_notify(self) -> None:
        self._add(Ev.SDMA_NOTIFY)

    def region(self, name: str, enter: bool) -> None:
        self._add(Ev.REGION, self._name(name), int(enter))

    def compute(self, us: float, name: str) -> None:
        self._add(Ev.COMPUTE, int(np.float64(us).view(np.int64)), self._name(name))

    def launch(self, block_dim: int) -> int:
        """A kernel launch by the calling thread; returns its id (for ``block``, ``sync``, ``join``)."""
        self.launches += 1
        self._add(Ev.LAUNCH, self.launches, block_dim)
        return self.launches

    def block(self, launch_id: int, begin: bool) -> None:
        self._add(Ev.BLOCK, launch_id, int(begin))

    def sync(self, launch_id: int) -> None:
        self._add(Ev.SYNC, launch_id)

    def join(self, launch_id: int) -> None:
        self._add(Ev.JOIN, launch_id)

    # --- export -------------------------------------------------------------------------------------------

    def write(self, pe: int, n_pes: int, qp_num: int) -> str:
        """Write this PE's part to ``<out_dir>/pe<pe>.npz``; returns the path."""
        meta = {"pe": pe, "n_pes": n_pes, "qp_num": qp_num, "names": list(self.names), "extras": self.extras,
                "heap_va_base": HEAP_VA_BASE, "heap_va_stride": HEAP_VA_STRIDE}
        arrays = {f"slot{s}": np.frombuffer(rows, np.int64).reshape(-1, ROW) for s, rows in self.slots.items()}
        arrays.update({f"bbs{s}": np.frombuffer(bytes(b), np.uint8).reshape(-1, 64) for s, b in self.bbs.items()})
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        path = os.path.join(self.out_dir, f"pe{pe}.npz")
        tmp = path + ".tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, path)  # the launcher never sees half a part
        self.written = path
        return path


def _value_row(pos: int, data: bytes) -> tuple:
    words = np.frombuffer(data.ljust(SMALL_PAYLOAD, b"\0"), "<i8").tolist()
    return (Ev.VALUE, pos, len(data), *words, 0, 0, 0)


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

    def __init__(self, data):
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

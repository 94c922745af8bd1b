"""The event stream of a PE: what observation reads, written by the code that runs, observed or not.

``--check``, ``--trace`` and ``--record`` never select other code. They switch on this PE's ``EventLog``
(``rt.events``, None when nothing observes), and every place where an event happens writes it: the native posting
path and quiets (``_post.c``, through the native writer ``_events.c``: a DOORBELL record per doorbell, a POST record
per WQE decoded from the ring, a QUIET record per quiet), and the Python places (the posting and polling paths of
``queues``, which call the same native writer, signal_op, waits and tests, barriers, launches, blocks and
``sync_all``, MTE copies, allocations, regions, compute annotations, and under ``--check`` the heap accesses that
``check.array.CheckedArray`` sees). When the log is off each place costs one ``is None`` check (one predictable
branch in C). The consumers read the log: the launcher's happens-before analysis (``check.analyze``) after the
ranks ended, the recording (``observe.record``) and the trace (``observe.trace``) at finalize.

The log is one shared-memory segment per PE (``shmemx_<job>_events<pe>``, sparse: a page costs memory only once
written), so that it survives the rank: a page-aligned header, ``capacity`` fixed 64-byte records, then a blob
area (strings, the BBs of posted WQEs for a recording, the extras of a wait). Every writer holds the interpreter
lock, so the records of one thread are in its program order; records of a PE's threads interleave, each naming
its block.

Every record carries a time stamp of the monotonic clock (one clock for every process of the machine), taken
*before* a release becomes visible (a post before its doorbell, a signal_op before its store, a barrier arrival
before its add) and *after* an acquire is observed (a wait after its word met the condition, a quiet after its
CQEs, a barrier departure). So sorting the records of all PEs by time stamp gives an order in which every release
precedes the acquires that saw it: the analysis replays the job in that order and never needs the engine's timing.

Record layout (little-endian): ``ts u64, kind u8, block u8, flags u16, site u32, a..e u64, f u32, g u32``; what
``flags`` and ``a..g`` hold per kind is in ``Kind``'s comments, and the words that pack several fields are
declared once as ``BitFields`` (``POST_A``, ``WAIT_A``, ...), which the writers and the readers share.
"""

from __future__ import annotations

import enum
import json
import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..shm.segment import SHM_DIR, Segment, segment_name
from ..shm.waits import thread_slot
from . import _engine

__all__ = ["Kind", "Mask", "BitFields", "POST_A", "POST_FLAGS", "MET_WORD", "LANE_A", "SIGNAL_A", "WAIT_A", "QUIET_A", "ACCESS_A", "RECORD",
           "RECORD_SIZE", "RECORD_DTYPE", "HEADER_SIZE", "DEFAULT_EVENTS", "EVENTS_ENV", "LOCAL_HEAP", "EventLog",
           "Access", "Watched", "Log", "read_log", "read_job_logs", "dtype_code", "log_size"]

RECORD = struct.Struct("<QBBHIQQQQQII")
RECORD_SIZE = RECORD.size
assert RECORD_SIZE == 64
HEADER = struct.Struct("<8sIIQQQQQ")  # magic, version, pe, capacity, records written, blob bytes used, mask, blob cap
HEADER_SIZE = 4096
MAGIC = b"SHMXEVT2"
DEFAULT_EVENTS = 4 << 20  # records per PE (256 MiB of sparse address space)
DEFAULT_BLOB = 256 << 20  # bytes of blob per PE (sparse)
EVENTS_ENV = "SHMEMX_EVENTS"  # records per PE
BLOB_ENV = "SHMEMX_EVENTS_BLOB"  # blob bytes per PE
RECORD_DTYPE = np.dtype([("ts", "<u8"), ("kind", "u1"), ("block", "u1"), ("flags", "<u2"), ("site", "<u4"),
                         ("a", "<u8"), ("b", "<u8"), ("c", "<u8"), ("d", "<u8"), ("e", "<u8"), ("f", "<u4"),
                         ("g", "<u4")])
assert RECORD_DTYPE.itemsize == RECORD_SIZE
_NO_BLOB = (1 << 64) - 1  # a blob offset that says "none"
_U64 = (1 << 64) - 1
_now = time.perf_counter_ns


class Kind(enum.IntEnum):
    """Record kinds. ``block`` is the AIV block (0: the main thread), ``site`` the kernel's source line (a SITE id,
    under ``--check``; 0 otherwise)."""

    NONE = 0  # an unwritten slot
    SITE = 1  # a = site id, b = blob offset, c = string length ("file\0function"), f = line
    ALLOC = 2  # a = heap offset, b = size, c = blob offset, d = string length; flags 1: zero-filled
    FREE = 3  # a = heap offset, b = size
    # one WQE: a = POST_A (BB position, peer, qp, opcode), b = remote heap offset, c = local heap offset (flags &
    # LOCAL_HEAP) or local VA, d = signal word's heap offset (WRITE_WITH_NOTIFY), e = signal value, FAA operand or
    # CAS swap or the bytes of a WRITE of at most 8, f = length, g = CAS compare (low 32 bits) or a WRITE's source
    # fingerprint at post (low 32 bits; two unordered writes of the same bytes to one range are not a race);
    # flags = WQE flag byte | api << 8 | LOCAL_HEAP
    POST = 4
    # a quiet that returned: a = QUIET_A (peer, qp, call), b = the SQ tail after it (every WQE before it retired),
    # c = the CQE count it waited for, d = its start (ns), e = CQEs it consumed
    QUIET = 5
    SIGNAL = 6  # signal_op: a = SIGNAL_A (pe, op, size), b = heap offset, c = dtype_code, e = value (two's complement)
    # a wait that returned (or a test that found its condition met): a = WAIT_A (pe, cmp, size, call), b = heap
    # offset of the first word, c = stride in bytes, d = words, e = compared value; f = value seen (low 32 bits),
    # g = high 32 bits; flags 1: a test. The words that met an any/some form follow as MET records, then (when
    # the log records or traces) a WAIT_INFO record; a test that found its condition unmet has only WAIT_INFO
    WAIT = 7
    MET = 8  # indices (u16 each) of words that met a wait: a..e hold up to 20, f = how many in this record
    # barrier arrival: a = barrier number (per PE, from 1; a team barrier's job-wide key), b = WaitCall; a team
    # barrier: c, d, e = the team's start, stride, size (e 0: the whole job)
    ARRIVE = 9
    DEPART = 10  # barrier departure: a, b as ARRIVE
    LAUNCH = 11  # kernel launch by the main thread: a = launch id, b = blocks
    JOIN = 12  # the launch returned: a = launch id
    BLOCK_BEGIN = 13  # a = launch id
    BLOCK_END = 14  # a = launch id
    SYNC_ARRIVE = 15  # sync_all: a = launch id, b = the block's sync count in the launch (from 1)
    SYNC_DEPART = 16
    # a heap access by a kernel thread: a = ACCESS_A (pe, write, value known, approximate, direct: an MTE copy or a
    # store through an aclshmem_ptr view, which orders like signal_op), b = heap offset, c = bytes, d = value (the
    # first 8 bytes, when known)
    ACCESS = 17
    SRC_CHANGED = 18  # a WRITE's source changed before its quiet: a = LANE_A (peer, qp), b = BB position, c = length
    CLAIM = 19  # a post refused with SubmitterError (another block owns the queue): a = LANE_A (peer, qp)
    UNSUBMITTED = 20  # a defer batch never submitted (its block ended, or the job): a = LANE_A, b = WQEs
    # a doorbell: a = queue index, b = first BB position, c = BBs, d = blob offset of the BBs (when the log keeps
    # WQE bytes; else none), e = CQEs added to cqe_cnt; flags = api. Precedes the POST records of its WQEs
    DOORBELL = 21
    # a small payload (at most 32 bytes: a flag or generation number written as data): a = BB position (-1: an
    # MTE copy), b = bytes, c, d, e, f | g << 32 = the bytes; follows its POST (or MTE) when the log keeps bytes
    VALUE = 22
    # what a recording and a trace need of a wait beside WAIT: a = its start (ns), b = dtype_code, c = the call's
    # result (a value, an index, a count, a bool; -1 for none), d = blob offset of its extras (the status mask and
    # per-word values as JSON; none: all ones), e = their length; flags 1: a test
    WAIT_INFO = 23
    MTE = 24  # an MTE copy: a = pe, b = heap offset, c = bytes, d = 1 put / 0 get; a put's small source: VALUE
    MTE_QUIET = 25  # aclshmemx_mte_quiet: the thread's MTE copies so far are complete
    REGION = 26  # a user region: a = blob offset of its name, b = name length, c = 1 enter / 0 exit
    COMPUTE = 27  # shmemx.compute: a = microseconds (the float64's bits), b = blob offset of its name, c = length
    SDMA = 28  # an SDMA copy posted on the calling block's channel: a = pe, b = heap offset, c = bytes, d = 1 put
    SDMA_QUIET = 29  # the calling block's SDMA channel is done (aclshmemx_sdma_quiet)
    SDMA_NOTIFY = 30  # a notify record on the calling block's SDMA channel
    # (31-33: local buffers and fetching atomics, under --check; check/recorder.py writes them)
    # a local (non-heap) array registered for the data plane (``LocalRegistry``): a = its local VA (what POST's c
    # holds for it), b = the process address of its first byte, c = bytes, d = blob offset of its name (the
    # kernel's variable that held it, or "local array at 0x..."), e = name length. Written when the registration
    # is made, before the POST that uses it
    REGISTER = 31
    # a kernel thread's load (or store: a & 1) of a registered local array while a WQE that uses it may still run
    # (seen by line tracing, ``check.watch``): b = process address, c = bytes; a & 2: the line's access was taken
    # as the whole array (a subscript that is not a constant)
    LOCAL_ACCESS = 32
    # a fetching atomic's old value, read by its thread after the quiet that retired the WQE (an acquire of the
    # write it read): a = LANE_A (peer, qp), b = the WQE's BB position, e = the value (the word's bits)
    FETCH = 33


LOCAL_HEAP = 1 << 15  # POST flags bit: c is a heap offset of this PE


class Mask(enum.IntFlag):
    """What a log records beyond the events themselves (``EventLog.mask``)."""

    SITES = 1  # every record's kernel source line (--check)
    FINGERPRINTS = 2  # WRITE sources fingerprinted at post and at their quiet: SRC_CHANGED (--check)
    WQE_BYTES = 4  # the BBs of every doorbell and small payloads' bytes (--record)
    TRACE = 8  # the start of every wait, as WAIT_INFO (--trace)
    CHECK = SITES | FINGERPRINTS
    RECORD = WQE_BYTES


def native_codes() -> dict:
    """The record kinds and mask bits the native writer uses, by name (handed to ``_engine.Events``)."""
    return dict(site=Kind.SITE, post=Kind.POST, quiet=Kind.QUIET, doorbell=Kind.DOORBELL, value=Kind.VALUE,
                src_changed=Kind.SRC_CHANGED, local_heap=LOCAL_HEAP, sites=Mask.SITES,
                fingerprints=Mask.FINGERPRINTS, wqe_bytes=Mask.WQE_BYTES)


class BitFields:
    """A u64 word that packs several fields, declared once: ``POST_A.pack(pos=.., peer=..)`` and
    ``POST_A.unpack(a)`` (a tuple in declaration order; works on ints and on numpy arrays of words)."""

    def __init__(self, **widths: int):
        self.names = tuple(widths)
        self.shifts, self.masks = {}, {}
        at = 0
        for name, width in widths.items():
            self.shifts[name], self.masks[name] = at, (1 << width) - 1
            at += width
        assert at <= 64, widths

    def pack(self, **values) -> int:
        word = 0
        for name, v in values.items():
            word |= (int(v) & self.masks[name]) << self.shifts[name]
        return word

    def field(self, word, name: str):
        return (word >> self.shifts[name]) & self.masks[name]

    def unpack(self, word) -> tuple:
        return tuple((word >> self.shifts[n]) & self.masks[n] for n in self.names)


POST_A = BitFields(pos=32, peer=16, qp=8, opcode=8)
POST_FLAGS = BitFields(flag=8, api=7, local_heap=1)  # a POST record's flags
MET_WORD = BitFields(i0=16, i1=16, i2=16, i3=16)  # four word indices in each of a MET record's a..e
QUIET_A = BitFields(peer=16, qp=8, call=8)
LANE_A = BitFields(peer=16, qp=16)
SIGNAL_A = BitFields(pe=16, op=8, size=8)
WAIT_A = BitFields(pe=16, cmp=8, size=8, call=8)
ACCESS_A = BitFields(pe=16, write=1, value_known=1, approx=1, direct=1)


def dtype_code(dtype: np.dtype) -> int:
    """A word's dtype as an int: itemsize | signed << 8 (| float << 9)."""
    return dtype.itemsize | (dtype.kind == "i") << 8 | (dtype.kind == "f") << 9


def log_size(events: int, blob: int) -> int:
    return HEADER_SIZE + events * RECORD_SIZE + blob


def _classify(internal: tuple, numpy_dir: str, array_file: str):
    """The native writer's question about a code object: 0 numpy or the checked-array module (look further),
    -1 shmemx or threading (internal), 1 the kernel's."""

    def classify(code) -> int:
        name = code.co_filename
        if name.startswith(numpy_dir) or name == array_file:
            return 0
        return -1 if name.startswith(internal) else 1

    return classify


_SHMEMX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_NUMPY_DIR = os.path.dirname(np.__file__) + os.sep
_THREADING = os.path.dirname(threading.__file__) + os.sep + "threading.py"
_ARRAY_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check", "array.py")
CLASSIFY = _classify((_SHMEMX_DIR, _THREADING), _NUMPY_DIR, _ARRAY_FILE)


@dataclass(frozen=True)
class Watched:
    """The words a wait or test watches, as its WAIT record says them: the call, ``count`` words of ``dtype`` at
    ``offset + i * stride`` of PE ``pe``, compared with ``cmp`` against ``value``."""

    call: int
    pe: int
    offset: int
    stride: int
    count: int
    dtype: np.dtype
    cmp: int
    value: int


class EventLog:
    """This PE's event log (``rt.events``); see the module docstring. The native writer is ``native``; the
    posting path hands it to the poster (``Poster.set_events``)."""

    def __init__(self, job_id: str, pe: int, mask: Mask, events: int = DEFAULT_EVENTS, blob: int = DEFAULT_BLOB):
        self.pe = pe
        self.mask = Mask(mask)
        self.capacity = events
        self.segment = Segment(segment_name(job_id, f"events{pe}"), log_size(events, blob), create=True)
        HEADER.pack_into(self.segment.mm, 0, MAGIC, 2, pe, events, 0, 0, int(mask), blob)
        self.native = _engine.Events(self.segment.addr, events, blob, int(mask), CLASSIFY, native_codes())
        self._put = self.native.put
        self.checker = None  # check.recorder.Checker under --check (derived heap views, defer batches)
        self.sites = bool(mask & Mask.SITES)
        self.infos = bool(mask & (Mask.WQE_BYTES | Mask.TRACE))  # WAIT_INFO records wanted
        self.bytes = bool(mask & Mask.WQE_BYTES)
        self._launches = 0
        self._tls = threading.local()

    @classmethod
    def from_env(cls, job_id: str, pe: int, mask: Mask) -> "EventLog | None":
        if not mask:
            return None
        return cls(job_id, pe, mask, int(os.environ.get(EVENTS_ENV) or DEFAULT_EVENTS),
                   int(os.environ.get(BLOB_ENV) or DEFAULT_BLOB))

    @property
    def full(self) -> bool:
        return self.native.written > self.capacity

    # --- writing --------------------------------------------------------------------------------------------

    def put(self, kind: int, *fields: int, flags: int = 0, site: int = -1, ts: int = 0) -> None:
        """One record of the calling thread: ``fields`` are a..g (missing ones 0); ``site`` -1: its kernel line,
        when the log has sites; ``ts`` 0: now."""
        if self.checker is not None:
            self.checker.event()
        a, b, c, d, e, f, g = fields + (0,) * (7 - len(fields))
        self._put(ts, kind, thread_slot() & 0xFF, flags, site, a & _U64, b & _U64, c & _U64, d & _U64, e & _U64,
                  f & 0xFFFF_FFFF, g & 0xFFFF_FFFF)

    def blob(self, data: bytes) -> int:
        """Append bytes to the blob area; their offset (``_NO_BLOB`` when full)."""
        at = self.native.blob(data)
        return _NO_BLOB if at < 0 else at

    def string(self, text: str) -> tuple[int, int]:
        data = text.encode()[:4096]
        return self.blob(data), len(data)

    def site(self) -> int:
        """The site id of the calling kernel line (0 without sites)."""
        return self.native.site() if self.sites else 0

    # --- the events of the Python places --------------------------------------------------------------------

    def signal(self, pe: int, offset: int, dtype: np.dtype, op: int, value: int) -> None:
        """``aclshmemx_signal_op`` (before its store)."""
        self.put(Kind.SIGNAL, SIGNAL_A.pack(pe=pe, op=op, size=dtype.itemsize), offset, dtype_code(dtype), 0, value)

    def wait(self, w: "Watched", seen: int = 0, *, test: bool = False, met=None, result: int | None = None,
             t0: int = 0, extras: dict | None = None) -> None:
        """A wait on the words ``w`` that returned, or a test whose condition held (``seen``: the value that met
        it; ``met``: the indices that met it, for the any/some forms; ``result``: what the call returned, for the
        recording; ``t0``: its start); a test that did not hold is ``unmet``."""
        ts = _now()
        seen &= _U64
        self.put(Kind.WAIT, WAIT_A.pack(pe=w.pe, cmp=w.cmp, size=w.dtype.itemsize, call=w.call), w.offset, w.stride,
                 w.count, w.value, seen, seen >> 32, flags=int(test), ts=ts)
        if met is not None:
            self._met(met, ts)
        if self.infos:
            self._info(w.dtype, result if result is not None else seen, t0 or ts, extras, test, ts)

    def unmet(self, w: "Watched", result: int, extras: dict | None = None) -> None:
        """A test on the words ``w`` whose condition did not hold: only what the recording needs (the analysis
        sees no edge)."""
        if self.infos:
            ts = _now()
            self._info(w.dtype, result, ts, extras, True, ts, call=int(w.call), pe=w.pe, offset=w.offset,
                       stride=w.stride, count=w.count, cmp=w.cmp, value=w.value)

    def _met(self, met, ts: int) -> None:
        met = [int(i) for i in met]
        for k in range(0, max(len(met), 1), 20):
            part = met[k:k + 20] + [0] * (20 - len(met[k:k + 20]))
            words = [MET_WORD.pack(i0=part[4 * j], i1=part[4 * j + 1], i2=part[4 * j + 2], i3=part[4 * j + 3])
                     for j in range(5)]
            self.put(Kind.MET, *words, len(met[k:k + 20]), ts=ts)

    def _info(self, dtype, result: int, t0: int, extras, test: bool, ts: int, **unmet) -> None:
        off = length = 0
        if extras or unmet:
            data = json.dumps(dict(extras or {}, **unmet)).encode()
            off, length = self.blob(data), len(data)
        else:
            off = _NO_BLOB
        self.put(Kind.WAIT_INFO, t0, dtype_code(dtype), result, off, length, flags=int(test), ts=ts)

    def barrier(self, number: int, call: int, arrive: bool, team: tuple = ()) -> None:
        """A barrier's arrival (before) or departure (after); ``team``: (start, stride, size) of a team's."""
        self.put(Kind.ARRIVE if arrive else Kind.DEPART, number, int(call), *team)

    def launch(self, blocks: int) -> int:
        self._launches += 1
        self.put(Kind.LAUNCH, self._launches, blocks)
        return self._launches

    def join(self, launch_id: int) -> None:
        self.put(Kind.JOIN, launch_id, site=0)

    def block(self, launch_id: int, begin: bool) -> None:
        tls = self._tls
        if begin:
            tls.launch, tls.syncs = launch_id, 0
            if self.checker is not None:
                self.checker.begin_block()
            self.put(Kind.BLOCK_BEGIN, launch_id, site=0)
        else:
            if self.checker is not None:
                self.checker.end_block()
            self.put(Kind.BLOCK_END, launch_id, site=0)

    def sync(self, arrive: bool) -> None:
        tls = self._tls
        if arrive:
            tls.syncs = getattr(tls, "syncs", 0) + 1
        self.put(Kind.SYNC_ARRIVE if arrive else Kind.SYNC_DEPART, getattr(tls, "launch", 0),
                 getattr(tls, "syncs", 0))

    def mte(self, pe: int, offset: int, nbytes: int, put: bool, src=None) -> None:
        """An MTE copy to (``put``) or from PE ``pe``'s heap at ``offset`` (before a put copies, after a get);
        ``src``: a put's source, whose bytes a recording keeps when small."""
        self.put(Kind.MTE, pe, offset, nbytes, int(put))
        if put and src is not None and self.bytes and nbytes <= 32:
            data = np.ascontiguousarray(src).reshape(-1).view(np.uint8)[:nbytes].tobytes()
            self.value(-1, data)

    def value(self, pos: int, data: bytes) -> None:
        words = np.frombuffer(data.ljust(32, b"\0"), "<u8").tolist()
        self.put(Kind.VALUE, pos, len(data), words[0], words[1], words[2], words[3], words[3] >> 32)

    def mte_quiet(self) -> None:
        self.put(Kind.MTE_QUIET)

    def sdma(self, pe: int, offset: int, nbytes: int, put: bool, src=None) -> None:
        """An SDMA copy posted on the calling block's channel (as ``mte``: a small put's source is kept)."""
        self.put(Kind.SDMA, pe, offset, nbytes, int(put))
        if put and src is not None and self.bytes and nbytes <= 32:
            self.value(-1, np.ascontiguousarray(src).reshape(-1).view(np.uint8)[:nbytes].tobytes())

    def sdma_quiet(self) -> None:
        self.put(Kind.SDMA_QUIET)

    def sdma_notify(self) -> None:
        self.put(Kind.SDMA_NOTIFY)

    def alloc(self, offset: int, size: int, name: str, zero: bool) -> None:
        at, n = self.string(name)
        self.put(Kind.ALLOC, offset, size, at, n, flags=int(zero))

    def free(self, offset: int, size: int) -> None:
        self.put(Kind.FREE, offset, size)

    def region(self, name: str, enter: bool) -> None:
        at, n = self.string(name)
        self.put(Kind.REGION, at, n, int(enter))

    def compute(self, us: float, name: str) -> None:
        at, n = self.string(name)
        self.put(Kind.COMPUTE, int(np.float64(us).view(np.int64)), at, n)

    def claim(self, peer: int, qp_idx: int) -> None:
        self.put(Kind.CLAIM, LANE_A.pack(peer=peer, qp=qp_idx))

    def read(self) -> "Log":
        """This log as read back (``read_log``), e.g. for the recording and the trace at finalize."""
        return read_log(self.segment.mm)

    def close(self) -> None:
        if self.checker is not None:
            self.checker.close()
        self.segment.close()


# --- reading ------------------------------------------------------------------------------------------------


@dataclass
class Access:
    """The ``a`` word of an ACCESS record, decoded (``ACCESS_A``)."""

    pe: int
    write: bool
    value_known: bool
    approx: bool
    direct: bool

    @classmethod
    def unpack(cls, a: int) -> "Access":
        pe, write, known, approx, direct = ACCESS_A.unpack(a)
        return cls(pe, bool(write), bool(known), bool(approx), bool(direct))


@dataclass
class Log:
    """One PE's log as read back: ``records`` (a structured array, ``RECORD_DTYPE``), its sites and blob."""

    pe: int
    records: np.ndarray
    sites: dict  # site id -> (file, function, line)
    strings: bytes  # the blob area (strings, WQE bytes, extras)
    full: bool  # the log ran out of room: events after that were dropped
    mask: int = 0

    def string(self, offset: int, length: int) -> str:
        return self.strings[offset:offset + length].decode(errors="replace")

    def blob(self, offset: int, length: int) -> bytes:
        return self.strings[offset:offset + length]


def read_log(data) -> Log:
    """Parse a log segment's bytes (a ``bytes``-like of the whole segment)."""
    magic, _version, pe, capacity, written, used, mask, blob_cap = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError("not a shmemx event log")
    body = np.frombuffer(data, RECORD_DTYPE, count=capacity, offset=HEADER_SIZE)
    n = min(written, capacity)
    # a rank killed between taking a slot and filling it leaves a hole (kind 0): dropped
    records = body[:n].copy()
    records = records[records["kind"] != 0]
    start = HEADER_SIZE + capacity * RECORD_SIZE
    strings = bytes(data[start:start + min(used, blob_cap)])
    log = Log(pe, records, {}, strings, written > capacity, mask)
    for r in records[records["kind"] == Kind.SITE]:
        file, _, function = log.string(int(r["b"]), int(r["c"])).partition("\0")
        log.sites[int(r["a"])] = (file, function, int(r["f"]))
    return log


def read_segment(path: str) -> Log:
    """Read the log in the segment file ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        return read_log(mm)
    finally:
        mm.close()


def read_job_logs(job_id: str, n_pes: int) -> tuple[list[Log], list[int]]:
    """The logs of a job's PEs that exist (a rank that died before init has none), and the PEs whose log was full."""
    logs, full = [], []
    for pe in range(n_pes):
        path = os.path.join(SHM_DIR, segment_name(job_id, f"events{pe}"))
        if not os.path.exists(path):
            continue
        log = read_segment(path)
        logs.append(log)
        if log.full:
            full.append(pe)
    return logs, full

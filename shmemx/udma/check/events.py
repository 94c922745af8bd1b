"""The event log of ``shmemx run --check``: what each rank records, and how the launcher reads it back.

Each PE writes its events into its own shared-memory segment ``shmemx_<job>_check<pe>`` (sparse: a page costs
memory only once written), so that the log survives the rank (a failing or hung rank leaves everything it logged
for the launcher to analyse). A segment is a header page, then fixed 64-byte records, then a string area (file
names, function names, allocation names) that records point into.

Every record carries a time stamp of the monotonic clock (``time.perf_counter_ns``: one clock for every process
of the machine), taken *before* a release becomes visible (a post before its doorbell, a signal_op before its
store, a barrier arrival before its add) and *after* an acquire is observed (a wait after its word met the
condition, a quiet after its CQEs, a barrier departure). So sorting the records of all PEs by time stamp gives
an order in which every release precedes the acquires that saw it: the analysis (``analyze``) replays the job in
that order and never needs the engine's timing.

Record layout (little-endian): ``ts u64, kind u8, block u8, flags u16, site u32, a..e u64, f u32, g u32``; the
meaning of ``flags`` and ``a..g`` per kind is in ``Kind``'s comments.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np

__all__ = ["Kind", "RECORD", "RECORD_SIZE", "HEADER_SIZE", "STRINGS_SIZE", "DEFAULT_EVENTS", "EVENTS_ENV",
           "Access", "Log", "log_size", "read_log"]

RECORD = struct.Struct("<QBBHIQQQQQII")
RECORD_SIZE = RECORD.size
assert RECORD_SIZE == 64
HEADER = struct.Struct("<8sIIQQQ")  # magic, version, pe, capacity (records), records written, string bytes used
HEADER_SIZE = 4096
STRINGS_SIZE = 8 << 20
MAGIC = b"SHMXCHK1"
DEFAULT_EVENTS = 4 << 20  # records per PE (256 MiB of sparse address space)
EVENTS_ENV = "SHMEMX_CHECK_EVENTS"
RECORD_DTYPE = np.dtype([("ts", "<u8"), ("kind", "u1"), ("block", "u1"), ("flags", "<u2"), ("site", "<u4"),
                         ("a", "<u8"), ("b", "<u8"), ("c", "<u8"), ("d", "<u8"), ("e", "<u8"), ("f", "<u4"),
                         ("g", "<u4")])
assert RECORD_DTYPE.itemsize == RECORD_SIZE


class Kind(enum.IntEnum):
    """Record kinds. ``block`` is the AIV block (0: the main thread), ``site`` the kernel's source line (a SITE id)."""

    NONE = 0  # an unwritten slot
    SITE = 1  # a = site id, b = string offset, c = string length ("file\0function"), f = line
    ALLOC = 2  # a = heap offset, b = size, c = string offset, d = string length; flags 1: zero-filled
    FREE = 3  # a = heap offset, b = size
    # one WQE: a = BB position | peer << 32 | qp << 48 | opcode << 56, b = remote heap offset, c = local heap
    # offset (flags & LOCAL_HEAP) or local VA, d = signal word's heap offset (WRITE_WITH_NOTIFY), e = signal value,
    # FAA operand or CAS swap or the bytes of a WRITE of at most 8, f = length, g = CAS compare (low 32 bits) or a WRITE's source crc32 at post (two
    # unordered writes of the same bytes to one range are not a race); flags = WQE flag byte | api << 8 |
    # (LOCAL_HEAP << 15)
    POST = 4
    QUIET = 5  # a = peer | qp << 16, b = the SQ tail after the quiet (BB position: every WQE before it retired)
    SIGNAL = 6  # signal_op: a = pe | op << 16 | size << 24, b = heap offset, e = value (two's complement)
    # a wait that returned (or a test that found its condition met): a = pe | cmp << 16 | size << 24 | call << 32,
    # b = heap offset of the first word, c = stride in bytes, d = words, e = compared value; f = value seen (low 32
    # bits), g = high 32 bits; flags 1: a test. For the any/some forms the words that met it follow as MET records
    WAIT = 7
    MET = 8  # indices (u16 each) of words that met a wait: a..e hold up to 20, f = how many in this record
    ARRIVE = 9  # barrier arrival: a = barrier number (per PE, from 1), b = WaitCall
    DEPART = 10  # barrier departure: a, b as ARRIVE
    LAUNCH = 11  # kernel launch by the main thread: a = launch id, b = blocks
    JOIN = 12  # the launch returned: a = launch id
    BLOCK_BEGIN = 13  # a = launch id
    BLOCK_END = 14  # a = launch id
    SYNC_ARRIVE = 15  # sync_all: a = launch id, b = the block's sync count in the launch (from 1)
    SYNC_DEPART = 16
    # a heap access by a kernel thread: a = pe | write << 16 | value_known << 17 | approx << 18 | direct << 19
    # (an MTE copy, or a store through an aclshmem_ptr view: a direct store, which orders like signal_op),
    # b = heap offset, c = bytes, d = value (the first 8 bytes, when known)
    ACCESS = 17
    SRC_CHANGED = 18  # a WRITE's source changed before its quiet: a = peer | qp << 16, b = BB position, c = length
    CLAIM = 19  # a post refused with SubmitterError (another block owns the queue): a = peer | qp << 16
    UNSUBMITTED = 20  # a defer batch never submitted (its block ended, or the job): a = peer | qp << 16, b = WQEs


LOCAL_HEAP = 1 << 15  # POST flags bit: c is a heap offset of this PE


def log_size(events: int) -> int:
    return HEADER_SIZE + events * RECORD_SIZE + STRINGS_SIZE


@dataclass
class Access:
    """Decoded ``a`` word of an ACCESS record."""

    pe: int
    write: bool
    value_known: bool
    approx: bool
    direct: bool

    @staticmethod
    def pack(pe: int, write: bool, value_known: bool = False, approx: bool = False, direct: bool = False) -> int:
        return pe | write << 16 | value_known << 17 | approx << 18 | direct << 19

    @classmethod
    def unpack(cls, a: int) -> "Access":
        return cls(a & 0xFFFF, bool(a >> 16 & 1), bool(a >> 17 & 1), bool(a >> 18 & 1), bool(a >> 19 & 1))


@dataclass
class Log:
    """One PE's log as read back: ``records`` (a structured array, ``RECORD_DTYPE``), its sites and strings."""

    pe: int
    records: np.ndarray
    sites: dict  # site id -> (file, function, line)
    strings: bytes
    full: bool  # the log ran out of room: events after that were dropped

    def string(self, offset: int, length: int) -> str:
        return self.strings[offset:offset + length].decode(errors="replace")


def read_log(data) -> Log:
    """Parse a log segment's bytes (a ``bytes``-like of the whole segment)."""
    magic, _version, pe, capacity, written, used = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError("not a shmemx check log")
    body = np.frombuffer(data, RECORD_DTYPE, count=capacity, offset=HEADER_SIZE)
    n = min(written, capacity)
    # a rank killed between taking a slot and filling it leaves a hole; slots after the count may be written by a
    # thread whose count store lost a race: read on until the first empty slot
    while n < capacity and body[n]["kind"] != 0:
        n += 1
    records = body[:n].copy()
    records = records[records["kind"] != 0]
    start = HEADER_SIZE + capacity * RECORD_SIZE
    strings = bytes(data[start:start + used])
    log = Log(pe, records, {}, strings, written > capacity)
    for r in records[records["kind"] == Kind.SITE]:
        file, _, function = log.string(int(r["b"]), int(r["c"])).partition("\0")
        log.sites[int(r["a"])] = (file, function, int(r["f"]))
    return log


def read_job_logs(job_id: str, n_pes: int) -> tuple[list[Log], list[int]]:
    """The logs of a job's PEs that exist (a rank that died before init has none), and the PEs whose log was full."""
    import mmap
    import os

    from ...shm.segment import SHM_DIR, segment_name

    logs, full = [], []
    for pe in range(n_pes):
        path = os.path.join(SHM_DIR, segment_name(job_id, f"check{pe}"))
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            log = read_log(mm)
        finally:
            mm.close()
        logs.append(log)
        if log.full:
            full.append(pe)
    return logs, full

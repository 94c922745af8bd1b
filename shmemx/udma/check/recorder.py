"""The rank side of ``--check``: ``Checker`` (``rt.checker``) records every event the analysis needs.

The layers call it at the one place each event happens, and only while it is installed (``rt.checker`` is None
otherwise, and every hook is a None check): posts (``QueuePair.post_rw`` / ``post_bytes`` / ``ring_doorbell``,
before the doorbell), quiets (``QueuePair.poll``, after the CQEs), signal_op (before the store), waits and tests
(after they returned), barriers (arrival before, departure after), kernel launches, blocks and ``sync_all``, MTE
copies, allocations, and heap reads and writes by kernel code (``array.CheckedArray``). It decides nothing: it
appends 64-byte records to this PE's log (``events``), with the kernel's file:line of every event (the first
frame outside shmemx and numpy), and the launcher's analysis (``analyze``) replays them once the ranks ended.

It also keeps the one fact the log alone cannot give: a WRITE's source bytes are summed (crc32) at post and
again when the quiet that retires the WQE returns; a difference is logged (``SRC_CHANGED``), so that a source
refilled before its quiet is caught even when the store went through memory the checker cannot observe (a local
numpy array, a raw memoryview).
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
import threading
import time
import weakref
import zlib

import numpy as np

from ...shm.heap import HEAP_VA_BASE, HEAP_VA_STRIDE
from ...shm.segment import Segment, segment_name
from ...shm.waits import thread_slot
from ..layout import M32, Opcode, Q_RMT_VA, Q_SGE_VA, W_DW0, W_DW1, W_SGE_LEN, decode_wqe, wqe_bbs
from ..rings import read_wqe
from .events import (DEFAULT_EVENTS, EVENTS_ENV, HEADER, HEADER_SIZE, LOCAL_HEAP, MAGIC, RECORD, RECORD_SIZE,
                     Access, Kind, log_size)

__all__ = ["Checker", "CHECK_ENV"]

CHECK_ENV = "SHMEMX_CHECK"
_now = time.perf_counter_ns
_pack = RECORD.pack_into
_SHMEMX_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_NUMPY_DIR = os.path.dirname(np.__file__) + os.sep
_INTERNAL = (_SHMEMX_DIR, _NUMPY_DIR, os.path.dirname(threading.__file__) + os.sep + "threading.py")
_WRITE, _READ, _NOTIFY, _FAA, _CAS = (int(Opcode.WRITE), int(Opcode.READ), int(Opcode.WRITE_WITH_NOTIFY),
                                      int(Opcode.FAA), int(Opcode.CAS))
_ARRAY_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "array.py")
_HALF = 1 << 31
_U64 = (1 << 64) - 1


class _Thread(threading.local):
    pending = None  # [(weakref to a derived heap view, pe, ranges)]: read if it dies unused (array.CheckedArray)
    sync_count = 0  # sync_all calls of this block in the current launch
    launch = 0
    batches = None  # id(submit state) -> (peer, qp, deferred WQEs, site) of defer batches not submitted yet


class Checker:
    """Records this PE's events for ``shmemx run --check`` (see the module docstring)."""

    def __init__(self, rt, events: int = DEFAULT_EVENTS):
        self.rt = rt
        self.pe = rt.my_pe
        self.capacity = events
        self.segment = Segment(segment_name(rt.job_id, f"check{rt.my_pe}"), log_size(events), create=True)
        self.mm = self.segment.mm
        self.strings_at = HEADER_SIZE + events * RECORD_SIZE
        self.strings_used = 0
        HEADER.pack_into(self.mm, 0, MAGIC, 1, rt.my_pe, events, 0, 0)
        self._header = memoryview(self.mm)[:HEADER.size].cast("Q")  # [3]: records written, [4]: string bytes
        self._slots = itertools.count()
        self._lock = threading.Lock()
        self._sites: dict = {}  # (code, line) -> site id
        self._internal: dict = {}  # code -> bool (a frame of shmemx or numpy)
        self._kinds: dict = {}  # code -> 0 (numpy, array.py: look further), -1 (shmemx: internal), 1 (kernel)
        self._tls = _Thread()
        self._launches = itertools.count(1)
        self._pins: dict[int, collections.deque] = collections.defaultdict(collections.deque)  # queue -> sources
        self.heap_size = rt.heap.size
        self.heap_bytes = rt.heap.segments[rt.my_pe].bytes
        self.full = False
        self._written = 0

    @classmethod
    def from_env(cls, rt) -> "Checker | None":
        if not os.environ.get(CHECK_ENV):
            return None
        return cls(rt, int(os.environ.get(EVENTS_ENV) or DEFAULT_EVENTS))

    # --- writing records -------------------------------------------------------------------------------

    def _put(self, ts: int, kind: int, site: int, flags: int = 0, a: int = 0, b: int = 0, c: int = 0, d: int = 0,
             e: int = 0, f: int = 0, g: int = 0) -> None:
        i = next(self._slots)
        if i >= self.capacity:
            self.full = True
            self._header[3] = i + 1
            return
        _pack(self.mm, HEADER_SIZE + i * RECORD_SIZE, ts, kind, thread_slot() & 0xFF, flags, site, a, b, c, d, e,
              f & M32, g & M32)
        if i >= self._written:
            self._written = i + 1
            self._header[3] = i + 1

    def _string(self, text: str) -> tuple[int, int]:
        data = text.encode()[:4096]
        with self._lock:
            at = self.strings_used
            if at + len(data) > self.segment.size - self.strings_at:
                return 0, 0
            self.mm[self.strings_at + at:self.strings_at + at + len(data)] = data
            self.strings_used = at + len(data)
            self._header[4] = self.strings_used
        return at, len(data)

    def site(self, depth: int = 2) -> int:
        """The site id of the kernel line that called into shmemx (0 when the whole stack is internal)."""
        f = sys._getframe(depth)
        internal = self._internal
        while f is not None:
            code = f.f_code
            inside = internal.get(code)
            if inside is None:
                inside = internal[code] = code.co_filename.startswith(_INTERNAL)
            if not inside:
                return self._site_of(code, f.f_lineno)
            f = f.f_back
        return 0

    def _site_of(self, code, line: int) -> int:
        sid = self._sites.get((code, line))
        if sid is None:
            with self._lock:
                sid = self._sites.get((code, line))
                if sid is None:
                    sid = len(self._sites) + 1
                    self._sites[(code, line)] = sid
            at, n = self._string(f"{code.co_filename}\0{code.co_name}")
            self._put(_now(), Kind.SITE, sid, a=sid, b=at, c=n, f=line)
        return sid

    def caller(self, depth: int = 2) -> int:
        """Like ``site``, but -1 when the first frame outside numpy (and ``array``'s own) is shmemx's code (an
        internal access, which the events of the call itself model)."""
        f = sys._getframe(depth)
        kinds = self._kinds
        while f is not None:
            code = f.f_code
            kind = kinds.get(code)
            if kind is None:
                name = code.co_filename
                kind = kinds[code] = (0 if name.startswith(_NUMPY_DIR) or name == _ARRAY_FILE else
                                      -1 if name.startswith(_SHMEMX_DIR) else 1)
            if kind:
                return -1 if kind < 0 else self._site_of(code, f.f_lineno)
            f = f.f_back
        return -1

    # --- derived heap views (array.CheckedArray) ------------------------------------------------------------

    def flush(self) -> None:
        """Views derived since the last event that died unused were read by C code that consumed them (``dst[:] =
        heap[a:b]``): log them as reads; views still alive were kept or passed on, so drop them."""
        tls = self._tls
        pending = tls.pending
        if pending:
            tls.pending = None
            ts = _now()
            for ref, pe, ranges, site in pending:
                if ref() is None:
                    if type(ranges) is int:  # a contiguous view: pe is its address, ranges its bytes
                        found = self.rt.heap.locate_address(pe)
                        if found is None or not ranges:
                            continue
                        pe, ranges = found[0], ((found[1], ranges),)
                    for off, n in ranges:
                        self._put(ts, Kind.ACCESS, site, a=Access.pack(pe, False), b=off, c=n)

    def derived(self, view, pe: int, ranges, site: int) -> None:
        """A view derived by kernel code: ``pe`` and ``ranges`` ([(offset, bytes)]), or for a contiguous one its
        address and byte count."""
        tls = self._tls
        if tls.pending is None:
            tls.pending = []
        tls.pending.append((weakref.ref(view), pe, ranges, site))

    def access(self, pe: int, ranges, write: bool, site: int, ts: int | None = None, value: int | None = None,
               approx: bool = False, direct: bool = False) -> None:
        """Heap bytes ``ranges`` ([(offset, length)]) of PE ``pe`` read or written by kernel code (``direct``: a
        store through an aclshmem_ptr view or by MTE)."""
        a = Access.pack(pe, write, value is not None, approx, direct)
        ts = _now() if ts is None else ts
        v = 0 if value is None else value & 0xFFFF_FFFF_FFFF_FFFF
        for off, n in ranges:
            self._put(ts, Kind.ACCESS, site, a=a, b=off, c=n, d=v)

    # --- the data plane ------------------------------------------------------------------------------------

    def post(self, qp, pos: int, opcode: int, flag: int, rmt_va: int, length: int, local_va: int, api: int,
             *, sig_off: int = 0, value: int = 0, compare: int = 0, peer: int | None = None, ts: int | None = None,
             site: int | None = None) -> None:
        """One WQE at BB ``pos`` of ``qp`` (called before its doorbell). A WRITE's source is summed now; ``quiet``
        sums it again once the WQE retired."""
        if self._tls.pending:
            self.flush()
        peer = qp.peer if peer is None else peer & 0xFFFF
        registry = qp.udma.registry
        off = local_va - registry.heap_va
        if 0 <= off and off + length <= self.heap_size:
            lflag, lref = LOCAL_HEAP, off
            buf = self.heap_bytes
        else:
            lflag, lref = 0, local_va
            found = registry.resolve(local_va, length)
            buf, off = (None, 0) if found is None or found[0] is registry.amo_bytes else found
        if length and buf is not None and (opcode == _WRITE or opcode == _NOTIFY):
            compare = zlib.crc32(buf[off:off + length])  # (g: the source's checksum, for a WRITE)
            if length <= 8 and opcode == _WRITE:  # (e: a small WRITE's bytes: a flag or count sent by a put)
                value = int.from_bytes(buf[off:off + length].tobytes(), "little")
            self._pins[qp.index].append(((pos + (2 if opcode == _NOTIFY else 1)) & M32, pos, buf, off, length,
                                         compare))
        self._put(_now() if ts is None else ts, Kind.POST, self.site(3) if site is None else site,
                  flag | api << 8 | lflag, pos | peer << 32 | qp.qp_idx << 48 | opcode << 56,
                  (rmt_va - _heap_va(peer)) & _U64, lref, sig_off, value & _U64, length, compare)

    def post_wqe(self, qp, pos: int, wqe, api: int) -> None:
        """A WQE given as its 64 or 128 bytes (``post_bytes``)."""
        w = decode_wqe(wqe)
        self._post_decoded(qp, pos, w, api, self.site(3))

    def _post_decoded(self, qp, pos: int, w, api: int, site: int, ts: int | None = None) -> None:
        peer = w.rmt_eid & M32
        sig_off = (w.notify_va - _heap_va(peer)) & _U64 if w.opcode == _NOTIFY else 0
        value = w.notify_value if w.opcode == _NOTIFY else w.operand
        self.post(qp, pos, w.opcode, w.flag, w.rmt_va, w.sge_len, w.sge_va, api, sig_off=sig_off, value=value,
                  compare=w.compare, peer=peer, ts=ts, site=site)

    def doorbell(self, qp, n: int, api: int) -> None:
        """The ``n`` BBs from ``qp.head`` a raw doorbell (or a defer/submit chunk) publishes."""
        self.flush()
        site = self.site(3)
        ts = _now()
        head, mask = qp.head, qp.mask
        slots = (head + np.arange(n)) & mask
        rows32 = qp.sq32[slots]
        ops = (rows32[:, W_DW1] >> 8) & 0xFF
        i = 0
        plain = (ops == _WRITE) | (ops == _READ)
        rows64 = rows32.view(np.uint64)
        flags = (rows32[:, W_DW0] >> 16) & 0xFF
        lengths = rows32[:, W_SGE_LEN]
        while i < n:
            pos = (head + i) & M32
            op = int(ops[i])
            if plain[i]:
                self.post(qp, pos, op, int(flags[i]), int(rows64[i, Q_RMT_VA]), int(lengths[i]),
                          int(rows64[i, Q_SGE_VA]), api, ts=ts, site=site)
                i += 1
                continue
            self._post_decoded(qp, pos, decode_wqe(read_wqe(qp.sq, mask, pos)), api, site, ts)
            i += wqe_bbs(op)

    def batch(self, state, qp, pending: int, submit: bool) -> None:
        """A defer/submit call: a batch that is never submitted is reported when its block (or the job) ends."""
        batches = self._tls.batches
        if batches is None:
            batches = self._tls.batches = {}
        if submit:
            batches.pop(id(state), None)
        else:
            batches[id(state)] = (qp.peer, qp.qp_idx, pending, self.site(3))

    def _unsubmitted(self) -> None:
        batches = self._tls.batches
        if batches:
            for peer, qp_idx, pending, site in batches.values():
                self._put(_now(), Kind.UNSUBMITTED, site, a=peer | qp_idx << 16, b=pending)
            batches.clear()

    def claim(self, qp) -> None:
        """A post to ``qp`` refused because another block owns it (``QueuePair.claim`` raises next)."""
        self._put(_now(), Kind.CLAIM, self.site(3), a=qp.peer | qp.qp_idx << 16)

    def quiet(self, qp) -> None:
        """A quiet of ``qp`` returned: every WQE before ``qp.tail`` retired (called after the CQEs)."""
        self.flush()
        tail = qp.tail
        pins = self._pins.get(qp.index)
        ts = _now()
        site = self.site(3)  # the quiet's line: the finding of a changed source names it
        while pins and ((tail - pins[0][0]) & M32) < _HALF:
            _end, pos, buf, off, length, crc = pins.popleft()
            if zlib.crc32(buf[off:off + length]) != crc:
                self._put(ts, Kind.SRC_CHANGED, site, a=qp.peer | qp.qp_idx << 16, b=pos, c=length)
        self._put(ts, Kind.QUIET, site, a=qp.peer | qp.qp_idx << 16, b=tail)

    # --- signals, waits, barriers, blocks ------------------------------------------------------------------

    def signal(self, pe: int, offset: int, size: int, op: int, value: int) -> None:
        """``aclshmemx_signal_op`` (before its store)."""
        self.flush()
        self._put(_now(), Kind.SIGNAL, self.site(3), a=pe | op << 16 | size << 24, b=offset,
                  e=value & 0xFFFF_FFFF_FFFF_FFFF)

    def wait(self, call: int, pe: int, offset: int, stride: int, count: int, size: int, cmp: int, value: int,
             seen: int = 0, *, test: bool = False, met=None) -> None:
        """A wait that returned (or a test that found its condition met); ``met``: the indices that met it (the
        any/some forms)."""
        ts = _now()
        self.flush()
        site = self.site(3)
        seen &= 0xFFFF_FFFF_FFFF_FFFF
        self._put(ts, Kind.WAIT, site, int(test), pe | cmp << 16 | size << 24 | int(call) << 32, offset, stride,
                  count, value & 0xFFFF_FFFF_FFFF_FFFF, seen & M32, seen >> 32)
        if met is not None:
            met = [int(i) for i in met]
            for k in range(0, max(len(met), 1), 20):
                part = met[k:k + 20] + [0] * (20 - len(met[k:k + 20]))
                words = [sum(part[j * 4 + i] << 16 * i for i in range(4)) for j in range(5)]
                self._put(ts, Kind.MET, site, 0, *words, f=len(met[k:k + 20]))

    def barrier(self, number: int, call: int, arrive: bool) -> None:
        if arrive:
            self.flush()
            self._put(_now(), Kind.ARRIVE, self.site(3), a=number, b=int(call))
        else:
            self._put(_now(), Kind.DEPART, self.site(3), a=number, b=int(call))

    def launch(self, blocks: int) -> int:
        self.flush()
        launch_id = next(self._launches)
        self._put(_now(), Kind.LAUNCH, self.site(3), a=launch_id, b=blocks)
        return launch_id

    def join(self, launch_id: int) -> None:
        self._put(_now(), Kind.JOIN, 0, a=launch_id)

    def block(self, launch_id: int, begin: bool) -> None:
        tls = self._tls
        if begin:
            tls.launch, tls.sync_count, tls.pending = launch_id, 0, None
            self._put(_now(), Kind.BLOCK_BEGIN, 0, a=launch_id)
        else:
            self.flush()
            self._unsubmitted()
            self._put(_now(), Kind.BLOCK_END, 0, a=launch_id)

    def sync(self, arrive: bool) -> None:
        tls = self._tls
        if arrive:
            self.flush()
            tls.sync_count += 1
            self._put(_now(), Kind.SYNC_ARRIVE, self.site(3), a=tls.launch, b=tls.sync_count)
        else:
            self._put(_now(), Kind.SYNC_DEPART, self.site(3), a=tls.launch, b=tls.sync_count)

    def mte(self, remote_pe: int, remote_off: int, nbytes: int, write: bool, local) -> None:
        """An MTE copy: ``nbytes`` at ``remote_off`` of PE ``remote_pe`` written (put) or read (get) by this thread,
        and the other side ``local`` (an array: logged when it is heap memory). A put is logged before it copies,
        a get after."""
        self.flush()
        site = self.site(3)
        ts = _now()
        value = None
        if write and nbytes <= 65536:
            data = np.ascontiguousarray(local).view(np.uint8).reshape(-1)[:nbytes].tobytes()
            value = int.from_bytes(data, "little") if nbytes <= 8 else (0 if data.count(0) == nbytes else None)
        self.access(remote_pe, [(remote_off, nbytes)], write, site, ts, value, direct=True)
        found = self.rt.heap.locate_address(_address(local))
        if found is not None:
            self.access(found[0], [(found[1], nbytes)], not write, site, ts)

    # --- allocations -------------------------------------------------------------------------------------

    def alloc(self, offset: int, size: int, name: str, zero: bool) -> None:
        self.flush()
        at, n = self._string(name)
        self._put(_now(), Kind.ALLOC, self.site(3), int(zero), offset, size, at, n)

    def free(self, offset: int, size: int) -> None:
        self.flush()
        self._put(_now(), Kind.FREE, self.site(3), a=offset, b=size)

    def close(self) -> None:
        self.flush()
        self._unsubmitted()
        self.segment.close()


def _heap_va(pe: int) -> int:
    return HEAP_VA_BASE + pe * HEAP_VA_STRIDE


def _address(arr) -> int:
    try:
        return arr.__array_interface__["data"][0]
    except (AttributeError, TypeError, KeyError):
        return 0

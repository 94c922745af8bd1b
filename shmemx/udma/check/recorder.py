"""The rank side of ``--check`` beyond the event stream: what only Python sees.

Every event the analysis needs is written into the PE's event log (``udma.events``) by the place where it happens,
the native posting path and quiets included; under ``--check`` the log also names each record's kernel line and
fingerprints WRITE sources (``Mask.CHECK``). ``Checker`` (``rt.events.checker``) adds the two things the stream
cannot know by itself: the heap accesses of kernel code that ``array.CheckedArray`` sees (including a derived view
that dies unused, which C code consumed: a read, stamped when the view was made), and defer batches that are
never submitted. It decides nothing; the launcher's analysis (``analyze``) replays the logs once the ranks ended.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..events import ACCESS_A, CLASSIFY, LANE_A, Kind, EventLog
from ...shm.heap import data_address
from ...shm.waits import thread_slot
from .watch import LocalWatch

__all__ = ["Checker", "CHECK_ENV"]

CHECK_ENV = "SHMEMX_CHECK"
_now = time.perf_counter_ns
_U64 = (1 << 64) - 1


class _Thread(threading.local):
    pending = None  # [(weakref to a derived heap view, pe, ranges, site, ts)]: read if it dies unused
    batches = None  # id(submit state) -> (peer, qp, deferred WQEs, site) of defer batches not submitted yet


class Checker:
    """The Python side of ``--check`` (see the module docstring)."""

    def __init__(self, rt: Any, log: EventLog):
        self.rt = rt
        self.log = log
        self._put = log.native.put
        self._put_ranges = log.native.put_ranges
        self._site_of = log.native.site_of
        self._kinds: dict = {}  # code -> 0 (numpy, array.py: look further), -1 (shmemx: internal), 1 (kernel)
        self._tls = _Thread()
        self.watch = LocalWatch(self._local_access)  # loads and stores of local arrays while WQEs use them

    def _record(self, ts: int, kind: int, site: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> None:
        self._put(ts, kind, thread_slot() & 0xFF, 0, site, a & _U64, b & _U64, c & _U64, d & _U64, 0, 0, 0)

    def caller(self, depth: int = 2) -> int:
        """The site id of the kernel line that made an access, or -1 when the first frame outside numpy (and
        ``array``'s own) is shmemx's code (an internal access, which the events of the call itself model)."""
        f = sys._getframe(depth)
        kinds = self._kinds
        while f is not None:
            code = f.f_code
            kind = kinds.get(code)
            if kind is None:
                kind = kinds[code] = CLASSIFY(code)
            if kind:
                return -1 if kind < 0 else self._site_of(code, f.f_lineno)
            f = f.f_back
        return -1

    # --- derived heap views (array.CheckedArray) ------------------------------------------------------------

    def flush(self) -> None:
        """Views derived since the last event that died unused were read by C code that consumed them (``dst[:] =
        heap[a:b]``): log them as reads, stamped when they were made; views still alive were kept or passed on,
        so drop them."""
        tls = self._tls
        pending = tls.pending
        if not pending:
            return
        tls.pending = None
        for ref, pe, ranges, site, ts in pending:
            if ref() is None:
                for pe_, off, n in self._read_ranges(pe, ranges):
                    self._record(ts, Kind.ACCESS, site, ACCESS_A.pack(pe=pe_), off, n)

    def _read_ranges(self, pe: int, ranges) -> list:
        """[(pe, offset, bytes)] of a derived view's memory (``derived``'s two forms)."""
        if type(ranges) is not int:
            return [(pe, off, n) for off, n in ranges]
        found = self.rt.heap.locate_address(pe)  # a contiguous view: pe is its address, ranges its bytes
        return [] if found is None or not ranges else [(found[0], found[1], ranges)]

    def derived(self, view: np.ndarray, pe: int, ranges: Iterable[tuple[int, int]], site: int) -> None:
        """A view derived by kernel code: ``pe`` and ``ranges`` ([(offset, bytes)]), or for a contiguous one its
        address and byte count."""
        tls = self._tls
        if tls.pending is None:
            tls.pending = []
        tls.pending.append((weakref.ref(view), pe, ranges, site, _now()))

    def access(self, pe: int, ranges: Iterable[tuple[int, int]], write: bool, site: int, ts: int | None = None,
               value: int | None = None, approx: bool = False, direct: bool = False) -> None:
        """Heap bytes ``ranges`` ([(offset, length)]) of PE ``pe`` read or written by kernel code (``direct``: a
        store through an aclshmem_ptr view or by MTE)."""
        self.flush()
        a = ACCESS_A.pack(pe=pe, write=write, value_known=value is not None, approx=approx, direct=direct)
        ts = _now() if ts is None else ts
        v = 0 if value is None else value & _U64
        self._put_ranges(ts, Kind.ACCESS, thread_slot() & 0xFF, 0, site, a & _U64, ranges, v)  # a record per range

    def mte(self, remote_pe: int, remote_off: int, nbytes: int, write: bool, local: np.ndarray | None) -> None:
        """An MTE copy: ``nbytes`` at ``remote_off`` of PE ``remote_pe`` written (put) or read (get) by this thread,
        and the other side ``local`` (an array: logged when it is heap memory). A put is logged before it copies,
        a get after."""
        site = self.log.site()
        ts = _now()
        value = None
        if write and nbytes <= 65536:
            data = np.ascontiguousarray(local).view(np.uint8).reshape(-1)[:nbytes].tobytes()
            value = int.from_bytes(data, "little") if nbytes <= 8 else (0 if data.count(0) == nbytes else None)
        self.access(remote_pe, [(remote_off, nbytes)], write, site, ts, value, direct=True)
        found = self.rt.heap.locate_address(_address(local))
        if found is not None:
            self.access(found[0], [(found[1], nbytes)], not write, site, ts)

    # --- defer batches, blocks -------------------------------------------------------------------------------

    def batch(self, state: Any, qp: Any, pending: int, submit: bool) -> None:
        """A defer/submit call: a batch that is never submitted is reported when its block (or the job) ends."""
        batches = self._tls.batches
        if batches is None:
            batches = self._tls.batches = {}
        if submit:
            batches.pop(id(state), None)
        else:
            batches[id(state)] = (qp.peer, qp.qp_idx, pending, self.log.site())

    def _unsubmitted(self) -> None:
        batches = self._tls.batches
        if batches:
            for peer, qp_idx, pending, site in batches.values():
                self._record(_now(), Kind.UNSUBMITTED, site, LANE_A.pack(peer=peer, qp=qp_idx), pending)
            batches.clear()

    # --- local arrays and fetching atomics ------------------------------------------------------------------

    def event(self) -> None:
        """A Python-side event of this thread: flush the derived views; start (or stop) watching local arrays if
        the ones in flight changed since this thread's last event (``watch``)."""
        self.flush()
        if self.watch.gen:
            self.watch.sync(sys._getframe(2))

    def attach(self, registry: Any, poster: Any) -> None:
        """Be told of every local array ``registry`` registers (``LocalRegistry.watch``), and by the native posting
        path (``poster``) of every WQE over one and of every quiet."""
        registry.watch = self.registered
        self._registry = registry
        self._last = None
        poster.set_watch(self.in_flight, self.retired, self.flush)

    def registered(self, reg: Any) -> None:
        """A REGISTER record for a new registration, named by the kernel variable that holds the array."""
        name = _name_of(sys._getframe(2), reg.address, reg.nbytes) or f"local array at {reg.address:#x}"
        at, n = self.log.string(name)
        self._put(_now(), Kind.REGISTER, thread_slot() & 0xFF, 0, self.log.site(), reg.va, reg.address,
                  reg.nbytes, at, n, 0, 0)

    def in_flight(self, words: bytes) -> None:
        """The native posting path posted WQEs whose local side is part of a registered local array: ``words``
        holds (queue, end BB, local VA, bytes) of each, as native uint64, in posting order. Watch each array until
        the quiet retires it: one ``watch.add`` per queue and array, with the hull of its WQEs' bytes and the end
        of its last (what one ``add`` per WQE would leave)."""
        queue, end, va, length = np.frombuffer(words, np.uint64).reshape(-1, 4).astype(np.int64).T
        todo = np.ones(len(va), bool)
        frame = sys._getframe(1)
        while todo.any():
            first = int(np.argmax(todo))
            reg = self._registration(int(va[first]), int(length[first]))
            if reg is None:
                todo[first] = False
                continue
            va0, va1, root, nbytes = reg
            mine = np.flatnonzero(todo & (va >= va0) & (va + length <= va1))  # a kernel posts rows of one array
            todo[mine] = False
            lo = va[mine] - va0 + root
            for q, last, lo_, hi_ in _per_queue(queue[mine], end[mine], lo, lo + length[mine]):
                self.watch.add(q, last, root, nbytes, lo_, hi_, frame)

    def _registration(self, va: int, length: int) -> tuple | None:
        """(first VA, end VA, root address, bytes) of the registered local array holding [va, va + length), or
        None (not one: the atomics' scratch)."""
        last = self._last  # the registration resolved last (its VAs are never given again: it cannot go stale)
        if last and last[0] <= va and va + length <= last[1]:
            return last
        found = self._registry.resolve(va, length)
        if found is None or found[0] is self._registry.amo_bytes:
            return None
        buf, off = found
        self._last = (va - off, va - off + buf.nbytes, data_address(buf), buf.nbytes)
        return self._last

    def retired(self, queue: int, tail: int) -> None:
        """A quiet of ``queue`` returned with every WQE before BB ``tail`` retired."""
        if self.watch.spans:
            self.watch.retire(queue, tail)

    def _local_access(self, write: bool, address: int, nbytes: int, code, line: int, whole: bool) -> None:
        self._put(_now(), Kind.LOCAL_ACCESS, thread_slot() & 0xFF, 0, self._site_of(code, line),
                  int(write) | int(whole) << 1, address, nbytes, 0, 0, 0, 0)

    def fetched(self, qp: Any, pos: int, value: int) -> None:
        """A fetching atomic's old value, read after the quiet that retired its WQE at BB ``pos`` of ``qp``."""
        self._put(_now(), Kind.FETCH, thread_slot() & 0xFF, 0, self.log.site(), LANE_A.pack(peer=qp.peer, qp=qp.qp_idx),
                  pos & 0xFFFF_FFFF, 0, 0, value & _U64, 0, 0)

    def begin_block(self) -> None:
        self._tls.pending = None

    def end_block(self) -> None:
        self.flush()
        self._unsubmitted()

    def close(self) -> None:
        self.flush()
        self._unsubmitted()


def _per_queue(queue: np.ndarray, end: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> zip:
    """(queue, end BB of its last WQE, lowest lo, highest hi) of each queue's WQEs, given in posting order."""
    order = np.argsort(queue, kind="stable")
    queue, end, lo, hi = queue[order], end[order], lo[order], hi[order]
    starts = np.flatnonzero(np.r_[True, queue[1:] != queue[:-1]])
    stops = np.r_[starts[1:], len(queue)] - 1
    return zip(queue[starts].tolist(), end[stops].tolist(), np.minimum.reduceat(lo, starts).tolist(),
               np.maximum.reduceat(hi, starts).tolist())


def _name_of(frame, address: int, nbytes: int) -> str | None:
    """The name of the innermost kernel variable bound to an array over [address, address + nbytes)."""
    f = frame
    while f is not None:
        name = _array_in(f, address, nbytes) if CLASSIFY(f.f_code) > 0 else None
        if name is not None:
            return name
        f = f.f_back
    return None


def _array_in(frame, address: int, nbytes: int) -> str | None:
    """The first local of ``frame`` bound to a non-empty array starting inside [address, address + nbytes)."""
    for name, value in list(frame.f_locals.items()):
        if isinstance(value, np.ndarray) and value.nbytes and address <= data_address(value) < address + max(nbytes, 1):
            return name
    return None


def _address(arr) -> int:
    try:
        return arr.__array_interface__["data"][0]
    except (AttributeError, TypeError, KeyError):
        return 0

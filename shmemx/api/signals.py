"""Signals and point-to-point waits: signal_op, signal_wait_until, wait_until, test and the all/any/some family.

A signal word is the first element of a heap view, of dtype int32, uint32, int64 or uint64; a wait word may also
be int8, uint8, int16, uint16 or float32 (the typed waits of CANN's P2P types); the view's dtype decides the word
size and the comparison (float32 words compare as floats; their comparison values are rounded to float32).
``aclshmemx_signal_op`` stores into the target PE's heap
directly (as MTE does on the device): SET is one aligned store, ADD an atomic add, then the target's wake word is
bumped (a locked add, which orders the update before it) so that its waiters re-check. A wait sleeps on the
wake word of the PE whose memory holds the word (the calling PE's own, or a peer's when the view came from
``aclshmem_ptr``), see ``shm.waits``.

Semantics follow OpenSHMEM 1.5: ``signal_wait_until`` returns the value that met the condition; ``status``
entries that are nonzero exclude that word; an empty set makes ``*_all`` return at once, ``*_any`` return None
(SIZE_MAX in C) and ``*_some`` return an empty list.
"""

from __future__ import annotations

import enum
import operator
import time
import weakref

import numpy as np
import numpy.typing as npt

from ..runtime import Runtime, runtime
from ..shm import _native, atomics
from ..shm.control import CMP_SYMBOLS, WaitCall
from ..shm.waits import PATIENCE, WORD_KINDS, Patience, Sleep, Wait, block_on_word, block_on_words, block_until
from ..udma.events import Watched
from ..udma.layout import Opcode
from ..udma.rings import Api
from .checks import check_pe

__all__ = [
    "CmpOp",
    "SignalOp",
    "ACLSHMEM_CMP_EQ",
    "ACLSHMEM_CMP_NE",
    "ACLSHMEM_CMP_GT",
    "ACLSHMEM_CMP_GE",
    "ACLSHMEM_CMP_LT",
    "ACLSHMEM_CMP_LE",
    "ACLSHMEM_SIGNAL_SET",
    "ACLSHMEM_SIGNAL_ADD",
    "aclshmemx_signal_op",
    "aclshmemx_signal_op_many",
    "aclshmem_signal_wait_until",
    "aclshmem_wait_until",
    "aclshmem_test",
    "aclshmem_wait_until_all",
    "aclshmem_wait_until_any",
    "aclshmem_wait_until_some",
    "aclshmem_test_all",
    "aclshmem_test_any",
    "aclshmem_test_some",
    "word_view",
]

class CmpOp(enum.IntEnum):
    """``aclshmem_cmp_op_type_t``: how a wait compares its word with the value (``ACLSHMEM_CMP_*``)."""

    EQ = 0
    NE = 1
    GT = 2
    GE = 3
    LT = 4
    LE = 5


class SignalOp(enum.IntEnum):
    """``aclshmem_signal_op_type_t``: how ``aclshmemx_signal_op`` updates its word (``ACLSHMEM_SIGNAL_*``)."""

    SET = 0
    ADD = 1


ACLSHMEM_CMP_EQ, ACLSHMEM_CMP_NE, ACLSHMEM_CMP_GT, ACLSHMEM_CMP_GE, ACLSHMEM_CMP_LT, ACLSHMEM_CMP_LE = CmpOp
ACLSHMEM_SIGNAL_SET, ACLSHMEM_SIGNAL_ADD = SignalOp

_OPS = (operator.eq, operator.ne, operator.gt, operator.ge, operator.lt, operator.le)  # by ACLSHMEM_CMP_*
_SIGNAL_DTYPES = {np.dtype(t) for t in ("<i4", "<u4", "<i8", "<u8")}  # what signal_op stores or adds to
_WORD_DTYPES = _SIGNAL_DTYPES | {np.dtype(t) for t in ("<i1", "<u1", "<i2", "<u2", "<f4")}  # what waits read
_F32 = np.dtype("<f4")
_FLOAT_KIND = 8  # WORD_KINDS of float32
_BOUNDS = {dt: (int(np.iinfo(dt).min), int(np.iinfo(dt).max)) for dt in _WORD_DTYPES - {_F32}}
_BOUNDS[_F32] = (-float("inf"), float("inf"))
_U64 = 2**64 - 1
_now = time.perf_counter_ns


def _check_cmp(cmp) -> int:
    if (type(cmp) is CmpOp) or (type(cmp) is int and 0 <= cmp <= 5):  # the common cases, checked first
        return cmp
    if isinstance(cmp, bool) or not isinstance(cmp, (int, np.integer)) or not 0 <= cmp <= 5:
        raise ValueError(f"comparison {cmp!r} is not one of ACLSHMEM_CMP_EQ..ACLSHMEM_CMP_LE (0..5)")
    return int(cmp)


# --- resolving a word: which PE, which offset, a view of it -------------------------------------------------
#
# A signal or wait word is resolved on every call (a wait, a signal_op); the full resolution (locate the view,
# check it lies in a live allocation, build a 0-d view) costs ~6 us, more than a futex wake-up. Words are
# mostly the same array object call after call, so the resolution is cached per array object and reused while
# that object is alive, keeps its dtype (its data pointer cannot change), and the allocation it lies in is still
# the same live allocation (freeing it or reusing its memory misses the cache, so freed memory still raises).
# A word is read through a memoryview of its PE's heap cast to the word's format: an int in 20 ns, where a numpy
# 0-d view gives a numpy scalar in 60-100 ns and compares slower.


class _Word:
    __slots__ = ("ref", "dtype", "start", "record", "pe", "offset", "words", "idx", "dtype_str", "fmt", "lo", "hi",
                 "kind")


_FORMATS = {np.dtype("<i4"): "i", np.dtype("<u4"): "I", np.dtype("<i8"): "q", np.dtype("<u8"): "Q",
            np.dtype("<i1"): "b", np.dtype("<u1"): "B", np.dtype("<i2"): "h", np.dtype("<u2"): "H", _F32: "f"}


def raw_bits(dtype: np.dtype, value: int | float) -> int:
    """A comparison value as the integer the native waits and the recorders take: the value itself for integer
    words, the IEEE bits for float32 words."""
    if dtype == _F32:
        return int(np.array(value, _F32).view(np.uint32))
    return int(value)
_cache: dict[int, _Word] = {}
_heap_words: dict[tuple[int, str], memoryview] = {}  # (pe, format) -> that PE's heap as words
_cache_heap = None  # the heap the caches belong to (a new init starts new caches)
_CACHE_MAX = 4096


def _words_of(heap, pe: int, fmt: str) -> memoryview:
    words = _heap_words.get((pe, fmt))
    if words is None:
        mm = heap.segments[pe].mm
        words = _heap_words[(pe, fmt)] = memoryview(mm)[:len(mm) - len(mm) % 8].cast(fmt)
    return words


def _word(rt, arr: np.ndarray, what: str) -> _Word:
    """Resolve the signal/wait word given as a heap view (its first element); see above for the cache."""
    global _cache_heap
    heap = rt.heap
    w = _cache.get(id(arr))
    # (an array's data pointer never changes; its dtype can, in place, and with it the word's size)
    if (w is not None and _cache_heap is heap and w.ref() is arr and arr.dtype is w.dtype
            and heap.allocations.get(w.start) is w.record):
        return w
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"pe {rt.my_pe}: {what} must be a heap array view, got {type(arr).__name__}")
    if arr.dtype not in _WORD_DTYPES:
        raise TypeError(f"pe {rt.my_pe}: {what} has dtype {arr.dtype}; signal words are int32, uint32, int64 or "
                        f"uint64, and wait words also int8, uint8, int16, uint16 or float32")
    if arr.size == 0:
        raise ValueError(f"pe {rt.my_pe}: {what} is empty")
    pe, offset = heap.locate(arr, what)
    if offset % arr.itemsize:
        raise ValueError(f"pe {rt.my_pe}: {what} at heap+{offset:#x} is not {arr.itemsize}-byte aligned")
    if _cache_heap is not heap or len(_cache) >= _CACHE_MAX:
        _cache.clear()
        _heap_words.clear()
        _cache_heap = heap
    w = _Word()
    w.dtype, w.pe, w.offset = arr.dtype, pe, offset
    w.fmt = _FORMATS[arr.dtype]
    w.words, w.idx = _words_of(heap, pe, w.fmt), offset // arr.itemsize
    w.lo, w.hi = _BOUNDS[arr.dtype]
    w.dtype_str = arr.dtype.str.encode()
    w.kind = WORD_KINDS[arr.dtype.str]
    w.start = heap.allocation_start(offset)
    w.record = heap.allocations.get(w.start)
    w.ref = weakref.ref(arr)
    _cache[id(arr)] = w
    return w


def word_view(rt: Runtime, arr: np.ndarray, what: str) -> tuple[int, int, np.ndarray]:
    """(pe, heap offset, 0-d view of the first element) of a signal/wait word given as a heap view."""
    w = _word(rt, arr, what)
    return w.pe, w.offset, rt.heap.view(w.pe, w.offset, (), w.dtype)


def _as_int(rt, value, dtype: np.dtype, what: str) -> int:
    """``value`` as an int that fits the word's dtype (a float32 word: the value rounded to float32); ValueError
    quoting it when it does not."""
    if dtype == _F32:
        try:
            return float(np.float32(value))
        except (TypeError, ValueError):
            raise ValueError(f"pe {rt.my_pe}: {what}: value {value!r} is not a number") from None
    if type(value) is int:
        v = value
    else:
        try:
            v = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"pe {rt.my_pe}: {what}: value {value!r} is not an integer") from None
    lo, hi = _BOUNDS[dtype]
    if v < lo or v > hi:
        raise ValueError(f"pe {rt.my_pe}: {what}: value {value!r} does not fit the word's dtype {dtype}")
    return v


def _word_value(rt, w: _Word, value, what: str) -> int:
    """``value`` as an int that fits word ``w`` (``_as_int``, with a plain int in range checked first)."""
    if type(value) is int and w.lo <= value <= w.hi:
        return value
    return _as_int(rt, value, w.dtype, what)


def _as_word(rt, value, dtype: np.dtype, what: str):
    """``value`` as a numpy scalar of the word's dtype; ValueError quoting it when it does not fit."""
    return dtype.type(_as_int(rt, value, dtype, what))


def aclshmemx_signal_op(sig_addr: np.ndarray, signal: int, sig_op: int, pe: int) -> None:
    """Update the signal word ``sig_addr`` on PE ``pe``: SET stores ``signal``, ADD adds it atomically.

    Args:
        sig_addr: heap view whose first element is the word (int32/uint32/int64/uint64), e.g. ``flags[3:4]``.
        signal: the value to store or add.
        sig_op: ACLSHMEM_SIGNAL_SET (0) or ACLSHMEM_SIGNAL_ADD (1).
        pe: target PE; may be this PE.

    The update is visible, and PE ``pe``'s waiters are woken, when the call returns.
    """
    rt = runtime()
    if type(pe) is not int or not 0 <= pe < rt.n_pes:
        pe = check_pe(rt, "aclshmemx_signal_op", pe)
    w, value = _signal_word(rt, "aclshmemx_signal_op", sig_addr, signal, sig_op)
    if rt.chaos is not None:
        rt.chaos.jitter()
    if rt.events is not None:  # a release: recorded before the store
        rt.events.signal(pe, w.offset, w.dtype, sig_op, value)
    remote = rt.hosts.multi and not rt.hosts.local(pe)
    if remote:  # another host: through its NIC, complete when the call returns
        _remote_signal_op(rt, w, value, sig_op, pe)
    elif sig_op == ACLSHMEM_SIGNAL_SET:
        # One aligned store (single-copy atomic on x86-64); the locked add on the wake word in ctl.wake orders
        # it before any waiter can see the wake.
        _words_of(rt.heap, pe, w.fmt)[w.idx] = value
    else:
        addr = rt.heap.segments[pe].addr + w.offset  # the same word in PE pe's heap, as mapped here
        atomics.fetch_op("add", addr, value, w.dtype.itemsize)
    if not remote:
        rt.ctl.wake(pe)
    if rt.chaos is not None:
        rt.chaos.after_release()


def aclshmemx_signal_op_many(sig_addr: np.ndarray, signal: int, sig_op: int, pes: npt.ArrayLike) -> None:
    """``aclshmemx_signal_op(sig_addr, signal, sig_op, pe)`` for every PE of ``pes``, in one call: the word is
    resolved and checked once, and the stores and wake-ups of the PEs on this host are one native loop (a PE of
    another host: its own signal_op, through its NIC).

    Args:
        sig_addr: heap view whose first element is the word (int32/uint32/int64/uint64); the same word on each PE.
        signal: the value to store or add.
        sig_op: ACLSHMEM_SIGNAL_SET (0) or ACLSHMEM_SIGNAL_ADD (1).
        pes: ``[n]`` integer target PEs, in the order their updates are made; may include this PE.

    Each update is visible, and its PE's waiters are woken, when the call returns. Observed, the call writes
    what ``aclshmemx_signal_op`` writes for each PE of ``pes`` (a SIGNAL record, before the stores).
    """
    rt = runtime()
    pes = _check_pes(rt, pes)
    w, value = _signal_word(rt, "aclshmemx_signal_op_many", sig_addr, signal, sig_op)
    if rt.chaos is not None:
        rt.chaos.jitter()
    if rt.events is not None:  # releases: recorded before the stores
        for pe in pes.tolist():
            rt.events.signal(pe, w.offset, w.dtype, sig_op, value)
    if rt.hosts.multi:  # the PEs of other hosts through their NICs, one by one
        near = np.fromiter((rt.hosts.local(pe) for pe in pes.tolist()), bool, len(pes))
        for pe in pes[~near].tolist():
            _remote_signal_op(rt, w, value, sig_op, pe)
        pes = pes[near]
    heap, wake, sleepers = _targets(rt)
    _native.signal_many(heap[pes] + w.offset, value, w.dtype.itemsize, sig_op == ACLSHMEM_SIGNAL_ADD, wake[pes],
                        sleepers[pes])
    if rt.chaos is not None:
        rt.chaos.after_release(len(pes))


def _signal_word(rt, call: str, sig_addr: np.ndarray, signal: int, sig_op: int) -> tuple[_Word, int]:
    """``sig_addr``'s word and ``signal`` as its value, for ``call`` (signal_op, signal_op_many); ValueError for a
    sig_op that is not SET or ADD, TypeError for a word that is not a signal word."""
    if sig_op != ACLSHMEM_SIGNAL_SET and sig_op != ACLSHMEM_SIGNAL_ADD:
        raise ValueError(f"pe {rt.my_pe}: {call}: sig_op {sig_op!r} is not ACLSHMEM_SIGNAL_SET (0) "
                         f"or ACLSHMEM_SIGNAL_ADD (1)")
    w = _word(rt, sig_addr, f"{call} sig_addr")
    if w.dtype not in _SIGNAL_DTYPES:
        raise TypeError(f"pe {rt.my_pe}: {call}: sig_addr has dtype {w.dtype}; signal words are "
                        f"int32, uint32, int64 or uint64")
    return w, _word_value(rt, w, signal, call)


def _check_pes(rt, pes) -> np.ndarray:
    """``pes`` as ``[n] int64``; ValueError quoting a PE out of range."""
    arr = np.asarray(pes)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"pe {rt.my_pe}: aclshmemx_signal_op_many: pes must be a sequence of integer PEs, got "
                         f"{pes!r}")
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero((arr < 0) | (arr >= rt.n_pes))
    if len(bad):
        raise ValueError(f"pe {rt.my_pe}: aclshmemx_signal_op_many: pe {int(arr[bad[0]])} out of range "
                         f"0..{rt.n_pes - 1}")
    return arr


_target_cache: dict[int, tuple] = {}  # id(heap) -> (heap, [P] heap addresses, wake words, sleeper pairs)


def _targets(rt) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[P] int64`` arrays of every PE mapped here: its heap's address, its wake word's, its sleeper pair's (0
    for a PE of another host); made once per heap."""
    found = _target_cache.get(id(rt.heap))
    if found is None or found[0] is not rt.heap:
        _target_cache.clear()
        heap = np.array([0 if s is None else s.addr for s in rt.heap.segments], np.int64)
        found = _target_cache[id(rt.heap)] = (rt.heap, heap, np.array(rt.ctl.wake_addrs, np.int64),
                                              np.array(rt.ctl.sleepers_addrs, np.int64))
    return found[1:]


def _raw(w: _Word, value) -> int:
    """``raw_bits`` of a value of word ``w`` (integer words: the value)."""
    return value if w.kind != _FLOAT_KIND else raw_bits(_F32, value)


def _describe_word(rt, call: str, w: _Word, cond: str) -> str:
    where = rt.ctl.describe_offset(w.pe, w.offset)
    owner = "" if w.pe == rt.my_pe else f" of pe {w.pe}"
    return f"pe {rt.my_pe}: {call} on {where}{owner} {cond}: current value {w.words[w.idx]}"


def _wait_word(call: WaitCall, name: str, ivar, cmp, value) -> int:
    """Wait until word ``ivar[0] <cmp> value``: met already, or asleep in native code (``block_on_word``);
    returns the value that met it. One path, observed or not: the event log only hears of it afterwards."""
    rt = runtime()
    if type(cmp) is not int or not 0 <= cmp <= 5:
        cmp = _check_cmp(cmp)
    w = _word(rt, ivar, name + " ivar")
    target = _word_value(rt, w, value, name)
    chaos, ev = rt.chaos, rt.events
    if chaos is not None:
        chaos.jitter()
    t0 = _now() if ev is not None else 0
    v = w.words[w.idx]
    if not _OPS[cmp](v, target):
        v = block_on_word(rt, rt.heap.segments[w.pe].addr + w.offset, w.kind, cmp, _raw(w, target),
                          Wait(call, w.pe, w.offset, cmp, _raw(w, target) & _U64, w.dtype_str,
                               describe=lambda: _describe_word(rt, name, w, f"{CMP_SYMBOLS[cmp]} {target}")))
    if ev is not None:  # an acquire: recorded after the word met the condition
        ev.wait(Watched(call, w.pe, w.offset, w.dtype.itemsize, 1, w.dtype, cmp, _raw(w, target)), _raw(w, v),
                t0=t0)
    if chaos is not None:
        chaos.jitter()
    return v


def aclshmem_signal_wait_until(sig_addr: np.ndarray, cmp: int, value: int) -> int:
    """Block until ``sig_addr[0] <cmp> value``; return the value that met the condition."""
    return _wait_word(WaitCall.SIGNAL_WAIT_UNTIL, "signal_wait_until", sig_addr, cmp, value)


def aclshmem_wait_until(ivar: np.ndarray, cmp: int, value: int) -> None:
    """Block until ``ivar[0] <cmp> value``."""
    _wait_word(WaitCall.WAIT_UNTIL, "wait_until", ivar, cmp, value)


def aclshmem_test(ivar: np.ndarray, cmp: int, value: int) -> bool:
    """True when ``ivar[0] <cmp> value`` holds now; never blocks."""
    rt = runtime()
    cmp = _check_cmp(cmp)
    w = _word(rt, ivar, "test ivar")
    target = _as_int(rt, value, w.dtype, "test")
    v = w.words[w.idx]
    met = _OPS[cmp](v, target)
    ev = rt.events
    if ev is not None:
        words = Watched(WaitCall.WAIT_UNTIL, w.pe, w.offset, w.dtype.itemsize, 1, w.dtype, cmp, _raw(w, target))
        if met:
            ev.wait(words, _raw(w, v), test=True, result=1)
        else:
            ev.unmet(words, 0)
    return met


# --- arrays of words -----------------------------------------------------------------------------------------


class _Words:
    """A 1-D heap array of words, the status mask and the comparison of the all/any/some family."""

    def __init__(self, rt, name: str, ivars, cmp, value, status):
        self.name = name
        if not isinstance(ivars, np.ndarray) or ivars.ndim != 1:
            raise TypeError(f"pe {rt.my_pe}: {name}: ivars must be a 1-D heap array, got "
                            f"{getattr(ivars, 'shape', type(ivars).__name__)}")
        self.cmp = _check_cmp(cmp)
        if ivars.size:
            self.pe, self.offset, _ = word_view(rt, ivars, f"{name} ivars")
            self.ivars = rt.heap.view(self.pe, self.offset, ivars.shape, ivars.dtype, ivars.strides)
        else:
            self.pe, self.offset, self.ivars = rt.my_pe, 0, ivars
        values = np.asarray(value)
        if values.ndim == 0:
            self.values = _as_word(rt, value, ivars.dtype, name)
        else:  # the *_vector forms: one comparison value per word
            if values.shape != ivars.shape:
                raise ValueError(f"pe {rt.my_pe}: {name}: {values.shape[0]} values for {ivars.shape[0]} ivars")
            self.values = values.astype(ivars.dtype)
        if status is None:
            self.active = np.ones(ivars.shape, bool)
        else:
            status = np.asarray(status)
            if status.shape != ivars.shape:
                raise ValueError(f"pe {rt.my_pe}: {name}: status has shape {status.shape}, ivars {ivars.shape}")
            self.active = status == 0
        self.op = _OPS[self.cmp]

    def matches(self) -> np.ndarray:
        return self.op(self.ivars, self.values) & self.active

    def describe(self, rt) -> str:
        where = rt.ctl.describe_offset(self.pe, self.offset)
        n_active = int(self.active.sum())
        met = int(self.matches().sum())
        return (f"pe {rt.my_pe}: {self.name} on {n_active} words at {where} (pe {self.pe}) "
                f"{CMP_SYMBOLS[self.cmp]} {self.values if np.ndim(self.values) == 0 else self.values.tolist()}: "
                f"{met} of {n_active} met; values {self.ivars[self.active][:16].tolist()}")

    def block(self, rt, call: WaitCall, ready, timeout: float | None = None) -> int:
        """Wait until ``ready()`` (the call's condition on the words): asleep in native code when the words allow
        it (``native_block``: the all form), else through ``block_until``; returns its start (ns) for the event
        log. Chaos jitters the thread around it."""
        t0 = _now()
        if rt.chaos is not None:
            rt.chaos.jitter()
        if not (call == WaitCall.WAIT_UNTIL_ALL and self.native_block(rt, call, timeout)):
            value = raw_bits(self.ivars.dtype, self.values) if np.ndim(self.values) == 0 else 0
            wait = Wait(call, pe=self.pe, offset=self.offset, cmp=self.cmp, value=value & _U64,
                        dtype=self.ivars.dtype.str.encode(), count=len(self.ivars), describe=lambda: self.describe(rt))
            block_until(rt, ready, wait, sleep=Sleep.wake(self.pe), timeout=timeout)
        if rt.chaos is not None:
            rt.chaos.jitter()
        return t0

    def native_block(self, rt, call: WaitCall, timeout: float | None = None) -> bool:
        """Wait until every active word meets the comparison, asleep in native code (``block_on_words``) when
        the words allow it (one comparison value, an integer dtype of the native waits, a positive stride);
        False when the caller must take ``block_until``."""
        ivars = self.ivars
        kind = WORD_KINDS.get(ivars.dtype.str)
        if kind is None or np.ndim(self.values) != 0 or not ivars.size:
            return False
        stride = ivars.strides[0]
        if stride <= 0 and len(ivars) > 1:
            return False
        ready = lambda: bool(np.all(self.matches() | ~self.active))  # noqa: E731 (the spin's predicate)
        if ready():
            return True
        target = raw_bits(ivars.dtype, self.values)
        wait = Wait(call, pe=self.pe, offset=self.offset, cmp=self.cmp, value=target & _U64,
                    dtype=ivars.dtype.str.encode(), count=len(ivars), describe=lambda: self.describe(rt))
        block_on_words(rt, rt.heap.segments[self.pe].addr + self.offset, max(stride, 1),
                       self.active.astype(np.uint8).tobytes(), kind, self.cmp, target, wait, ready,
                       patience=PATIENCE if timeout is None else Patience(timeout=timeout))
        return True

    def event(self, rt, call: WaitCall, met, result: int, *, test: bool = False, t0: int = 0) -> None:
        """Tell the event log of this wait or test: the words that met it (``met``: their indices; None: every
        active one; an empty list: a test that did not hold) and what the call returned."""
        ev = rt.events
        if ev is None:
            return
        if met is None:
            met = np.flatnonzero(self.active)
        vector = np.ndim(self.values) != 0
        stride = self.ivars.strides[0] if self.ivars.ndim else self.ivars.itemsize
        value = 0 if vector else raw_bits(self.ivars.dtype, self.values)
        extras = {}
        if not self.active.all():
            extras["active"] = [bool(a) for a in self.active]
        if vector:
            bits = self.values.view(np.uint32) if self.values.dtype == _F32 else self.values
            extras["values"] = [int(v) for v in bits]
        words = Watched(call, self.pe, self.offset, stride, len(self.ivars), self.ivars.dtype, self.cmp, value)
        if len(self.ivars) and len(met):
            ev.wait(words, test=test, met=met, result=result, t0=t0, extras=extras or None)
        else:
            ev.unmet(words, result, extras or None)


def aclshmem_wait_until_all(ivars: np.ndarray, cmp: int, value: int | float | np.ndarray,
                            status: np.ndarray | None = None, *, timeout: float | None = None) -> None:
    """Block until every active word satisfies the comparison (``value`` may be one value per word).

    ``timeout``: seconds before ``WaitTimeoutError`` (default: the job's wait timeout); for protocols that
    treat a silent peer as failed (DeepEP's shrink mode) rather than as a hang."""
    rt = runtime()
    w = _Words(rt, "wait_until_all", ivars, cmp, value, status)
    t0 = w.block(rt, WaitCall.WAIT_UNTIL_ALL, lambda: bool(np.all(w.matches() | ~w.active)), timeout)
    w.event(rt, WaitCall.WAIT_UNTIL_ALL, None, 1, t0=t0)


def aclshmem_wait_until_any(ivars: np.ndarray, cmp: int, value: int | float | np.ndarray,
                            status: np.ndarray | None = None) -> int | None:
    """Block until some active word satisfies the comparison; return its index (None if none is active)."""
    rt = runtime()
    w = _Words(rt, "wait_until_any", ivars, cmp, value, status)
    if not w.active.any():
        w.event(rt, WaitCall.WAIT_UNTIL_ANY, [], -1)
        return None
    found = []

    def ready() -> bool:
        hits = np.flatnonzero(w.matches())
        if len(hits):
            found.append(int(hits[0]))
            return True
        return False

    t0 = w.block(rt, WaitCall.WAIT_UNTIL_ANY, ready)
    w.event(rt, WaitCall.WAIT_UNTIL_ANY, found[:1], found[0], t0=t0)
    return found[0]


def aclshmem_wait_until_some(ivars: np.ndarray, cmp: int, value: int | float | np.ndarray,
                             status: np.ndarray | None = None) -> list[int]:
    """Block until at least one active word satisfies the comparison; return the indices of all that do."""
    rt = runtime()
    w = _Words(rt, "wait_until_some", ivars, cmp, value, status)
    if not w.active.any():
        w.event(rt, WaitCall.WAIT_UNTIL_SOME, [], 0)
        return []
    found: list[int] = []

    def ready() -> bool:
        hits = np.flatnonzero(w.matches())
        if len(hits):
            found.extend(int(i) for i in hits)
            return True
        return False

    t0 = w.block(rt, WaitCall.WAIT_UNTIL_SOME, ready)
    w.event(rt, WaitCall.WAIT_UNTIL_SOME, found, len(found), t0=t0)
    return found


def aclshmem_test_all(ivars: np.ndarray, cmp: int, value: int | float | np.ndarray,
                      status: np.ndarray | None = None) -> bool:
    rt = runtime()
    w = _Words(rt, "test_all", ivars, cmp, value, status)
    met = bool(np.all(w.matches() | ~w.active))
    w.event(rt, WaitCall.WAIT_UNTIL_ALL, None if met else [], int(met), test=True)
    return met


def aclshmem_test_any(ivars: np.ndarray, cmp: int, value: int | float | np.ndarray,
                      status: np.ndarray | None = None) -> int | None:
    rt = runtime()
    w = _Words(rt, "test_any", ivars, cmp, value, status)
    hits = np.flatnonzero(w.matches())
    w.event(rt, WaitCall.WAIT_UNTIL_ANY, hits[:1], int(hits[0]) if len(hits) else -1, test=True)
    return int(hits[0]) if len(hits) else None


def aclshmem_test_some(ivars: np.ndarray, cmp: int, value: int | float | np.ndarray,
                       status: np.ndarray | None = None) -> list[int]:
    rt = runtime()
    w = _Words(rt, "test_some", ivars, cmp, value, status)
    hits = [int(i) for i in np.flatnonzero(w.matches())]
    w.event(rt, WaitCall.WAIT_UNTIL_SOME, hits, len(hits), test=True)
    return hits


_CQE_FLAG = 0x20


def _remote_signal_op(rt, w: _Word, value: int, sig_op: int, pe: int) -> None:
    """signal_op on a PE of another host: a WRITE of the word (SET; the NIC stores an aligned word of 4 or 8 bytes
    as one atomic store) or an FAA (ADD) on QP 0 of the PE, from its amo scratch, quieted before returning."""
    qp = rt.udma.qp(pe, 0)
    what = "aclshmemx_signal_op"
    qp.poll(qp.cqe_cnt, what, call=WaitCall.QUIET)  # the scratch is free once every earlier WQE completed
    size = w.dtype.itemsize
    bits = int(value) & ((1 << 8 * size) - 1)
    va = qp.remote_base + w.offset
    if sig_op == ACLSHMEM_SIGNAL_SET:
        qp.amo[0] = bits
        qp.post_rw(Opcode.WRITE, _CQE_FLAG, va, size, qp.amo_va, Api.ATOMIC, what)
    else:
        wqe = qp.build(Opcode.FAA, _CQE_FLAG, va, sge_len=size, sge_va=qp.amo_va, operand=bits)
        qp.post_bytes(wqe, _CQE_FLAG, Api.ATOMIC, what)
    qp.poll(qp.cqe_cnt, what, call=WaitCall.QUIET)

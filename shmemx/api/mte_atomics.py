"""MTE atomics: ``aclshmemx_mte_atomic_*`` on a word of any PE's heap, the own PE's included, executed by the
calling thread with the host atomics of ``shm.atomics`` on the target's heap word (as CANN's MTE path does them
with the scalar unit's atomics on the target's GM).

``dst`` (``src`` for ``fetch``) is a heap view whose first element is the word; its dtype is the type:
int32/uint32/int64/uint64 for every operation, float32 for fetch, set, swap, add, inc and their fetch forms, and
int8/int16/float16/bfloat16 for add (CANN's MTE add types). 4- and 8-byte integer operations are one locked
instruction (fetch-add, exchange, compare-exchange); float32 operations and the 1- and 2-byte adds are a
compare-and-swap loop: read the word (the aligned 4-byte word that holds a 1- or 2-byte element), compute the new
value in the element's own arithmetic (wrapping integers; float16/bfloat16/float32 rounded as numpy rounds),
swap it in if the word did not change, else retry.

What is atomic with respect to what: every operation here is atomic with respect to every other atomic on the same
word by any PE and thread: these MTE atomics, the UDMA atomics (the engines' FAA and CAS are locked instructions
on the same memory), ``aclshmemx_signal_op`` ADD and SET. A compare-and-swap loop on a 1- or 2-byte element
never loses a concurrent store to the other bytes of its 4-byte word (the swap fails and retries). None of them
is atomic with respect to a non-atomic copy that covers the word (an MTE or SDMA copy, a UDMA WRITE): as on the
device, mixing those on one word is a race.

Completion: the update is visible, and the target's waiters are woken, when the call returns (CANN: "asynchronous
... insert synchronization"; here every MTE operation is synchronous). Each update is recorded and checked as a
``signal_op`` would be: an ADD of the operand for integer add/inc, a SET of the new value otherwise; ``fetch``
is a plain read.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..runtime import runtime
from ..shm import atomics
from .checks import check_pe, symmetric_offset
from .signals import ACLSHMEM_SIGNAL_ADD, ACLSHMEM_SIGNAL_SET

__all__ = ["aclshmemx_mte_atomic_fetch", "aclshmemx_mte_atomic_set", "aclshmemx_mte_atomic_compare_swap",
           "aclshmemx_mte_atomic_swap", "aclshmemx_mte_atomic_inc", "aclshmemx_mte_atomic_add",
           "aclshmemx_mte_atomic_fetch_inc", "aclshmemx_mte_atomic_fetch_add", "mte_atomic", "MTE_TYPES"]

_INTS = {np.dtype(t) for t in ("<i4", "<u4", "<i8", "<u8")}
_F32 = np.dtype(np.float32)
_SMALL = {np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}
MTE_TYPES = {"add": _INTS | {_F32} | _SMALL, "arith": _INTS | {_F32}, "bits": _INTS | {_F32}, "cas": _INTS,
             "logic": _INTS}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_MAX_TRIES = 1_000_000


class _Word:
    """The checked target word of one MTE atomic: its address in this process, PE, heap offset, dtype."""

    def __init__(self, what: str, arr, pe, allowed: set, role: str = "dst"):
        rt = runtime()
        pe = check_pe(rt, what, pe)
        where = f"{what} to pe {pe}"
        if not isinstance(arr, np.ndarray) or arr.size == 0:
            raise TypeError(f"pe {rt.my_pe}: {where}: {role} must be a non-empty heap view")
        if arr.dtype not in allowed:
            names = ", ".join(sorted(str(d) for d in allowed))
            raise TypeError(f"pe {rt.my_pe}: {where}: {role} dtype {arr.dtype} not supported ({names})")
        size = arr.itemsize
        off = symmetric_offset(rt, where, arr, size, pe, role)
        if off % size:
            raise ValueError(f"pe {rt.my_pe}: {where}: {role} at heap+{off:#x} is not {size}-byte aligned")
        self.rt, self.what, self.pe, self.offset, self.dtype, self.size = rt, where, pe, off, arr.dtype, size
        self.addr = rt.heap.segment(pe).addr + off

    def bits(self, value) -> int:
        """``value`` as the word's unsigned bits; ValueError quoting it when it does not fit the dtype."""
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not info.min <= value <= info.max:
                raise ValueError(f"pe {self.rt.my_pe}: {self.what}: value {value!r} does not fit dtype {self.dtype}")
            return int(value) & ((1 << 8 * self.size) - 1)
        try:
            return int(np.array(value, self.dtype).view(_UINT[self.size]))
        except (TypeError, ValueError):
            raise ValueError(f"pe {self.rt.my_pe}: {self.what}: value {value!r} is not a number") from None

    def value(self, bits: int):
        """The word's bits as a numpy scalar of its dtype."""
        return np.array(bits, _UINT[self.size]).view(self.dtype)[()]

    def published(self, op: int, value: int) -> None:
        """The update is in memory: record it (as signal_op), wake the target's waiters."""
        rt = self.rt
        if rt.events is not None:
            rt.events.signal(self.pe, self.offset, self.dtype, op, value)
        rt.ctl.wake(self.pe)

    def update(self, fn) -> int:
        """Replace the element by ``fn(old bits) -> new bits`` atomically (a compare-and-swap loop on the aligned
        word that holds it); returns the old bits."""
        if self.rt.chaos is not None:
            self.rt.chaos.jitter()
        word = self.addr & ~3 if self.size < 4 else self.addr
        wsize = max(self.size, 4)
        shift, mask = 8 * (self.addr - word), (1 << 8 * self.size) - 1
        for _ in range(_MAX_TRIES):
            cur = atomics.fetch_op("or", word, 0, wsize)
            old = cur >> shift & mask
            new = cur & ~(mask << shift) | (fn(old) & mask) << shift
            if atomics.compare_exchange(word, cur, new, wsize) == cur:
                return old
        raise RuntimeError(f"pe {self.rt.my_pe}: {self.what}: no compare-and-swap won in {_MAX_TRIES} tries")


def _arith(w: _Word, op: str, operand) -> int:
    """An arithmetic update: integer fetch-add directly, floats through ``update``; returns the old bits."""
    if w.dtype in _INTS and op == "add":
        if w.rt.chaos is not None:
            w.rt.chaos.jitter()
        old = atomics.fetch_op("add", w.addr, w.bits(operand), w.size)
        w.published(ACLSHMEM_SIGNAL_ADD, int(operand))
        return old
    v = np.array(operand).astype(w.dtype)
    old = w.update(lambda b: int(np.array(w.value(b) + v, w.dtype).view(_UINT[w.size])))
    w.published(ACLSHMEM_SIGNAL_SET, int(np.array(w.value(old) + v, w.dtype).view(_UINT[w.size])))
    return old


def mte_atomic(what: str, kind: str, dst: np.ndarray, pe: int, value: int | float = 0,
               cond: int | float = 0) -> int | float:
    """One MTE atomic ``kind`` (fetch, set, swap, cas, add, and, or, xor) on ``dst[0]`` of ``pe``; returns the old
    value (a numpy scalar of the word's dtype). The engine of the typed atomics for own-PE and same-server words."""
    allowed = {"add": MTE_TYPES["add"], "cas": MTE_TYPES["cas"], "fetch": MTE_TYPES["bits"],
               "set": MTE_TYPES["bits"], "swap": MTE_TYPES["bits"]}.get(kind, MTE_TYPES["logic"])
    w = _Word(what, dst, pe, allowed, "src" if kind == "fetch" else "dst")
    if kind == "fetch":
        return w.value(atomics.fetch_op("or", w.addr, 0, w.size) if w.size >= 4 else w.update(lambda b: b))
    if kind == "add":
        return w.value(_arith(w, "add", value))
    if w.rt.chaos is not None:
        w.rt.chaos.jitter()
    if kind in ("set", "swap"):
        bits = w.bits(value)
        old = atomics.exchange(w.addr, bits, w.size)
    elif kind == "cas":
        bits, expect = w.bits(value), w.bits(cond)
        old = atomics.compare_exchange(w.addr, expect, bits, w.size)
        bits = bits if old == expect else old
    else:
        operand = w.bits(value)
        old = atomics.fetch_op(kind, w.addr, operand, w.size)
        bits = {"and": old & operand, "or": old | operand, "xor": old ^ operand}[kind]
    w.published(ACLSHMEM_SIGNAL_SET, int(w.value(bits)) if w.dtype.kind in "iu" else bits)
    return w.value(old)


def aclshmemx_mte_atomic_fetch(src: np.ndarray, pe: int) -> int | float:
    """The value of ``src[0]`` on ``pe`` (an atomic read)."""
    return mte_atomic("aclshmemx_mte_atomic_fetch", "fetch", src, pe)


def aclshmemx_mte_atomic_set(dst: np.ndarray, value: int | float, pe: int) -> None:
    """Atomically store ``value`` into ``dst[0]`` on ``pe``."""
    mte_atomic("aclshmemx_mte_atomic_set", "set", dst, pe, value)


def aclshmemx_mte_atomic_compare_swap(dst: np.ndarray, cond: int | float, value: int | float, pe: int) -> int | float:
    """If ``dst[0] == cond`` on ``pe`` store ``value``; returns the old value either way."""
    return mte_atomic("aclshmemx_mte_atomic_compare_swap", "cas", dst, pe, value, cond)


def aclshmemx_mte_atomic_swap(dst: np.ndarray, value: int | float, pe: int) -> int | float:
    """Atomically store ``value`` into ``dst[0]`` on ``pe``; returns the old value."""
    return mte_atomic("aclshmemx_mte_atomic_swap", "swap", dst, pe, value)


def aclshmemx_mte_atomic_inc(dst: np.ndarray, pe: int) -> None:
    """Atomically add 1 to ``dst[0]`` on ``pe``."""
    mte_atomic("aclshmemx_mte_atomic_inc", "add", dst, pe, 1)


def aclshmemx_mte_atomic_add(dst: np.ndarray, value: int | float, pe: int) -> None:
    """Atomically add ``value`` to ``dst[0]`` on ``pe`` (int8/int16/float16/bfloat16 too)."""
    mte_atomic("aclshmemx_mte_atomic_add", "add", dst, pe, value)


def aclshmemx_mte_atomic_fetch_inc(dst: np.ndarray, pe: int) -> int | float:
    """Atomically add 1 to ``dst[0]`` on ``pe``; returns the old value."""
    return mte_atomic("aclshmemx_mte_atomic_fetch_inc", "add", dst, pe, 1)


def aclshmemx_mte_atomic_fetch_add(dst: np.ndarray, value: int | float, pe: int) -> int | float:
    """Atomically add ``value`` to ``dst[0]`` on ``pe``; returns the old value."""
    return mte_atomic("aclshmemx_mte_atomic_fetch_add", "add", dst, pe, value)

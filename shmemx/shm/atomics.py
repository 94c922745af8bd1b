"""Host atomics: read-modify-write on words in shared memory, through libatomic.

Python has neither atomics nor memory fences, and several processes write the same words (signal ADD, FAA/CAS
executed by different DMA engines, barrier counters). Every such word is changed through the functions here,
which call libatomic's ``__atomic_*`` entry points through ctypes: each is a locked instruction, a full fence on
x86, at about 0.45 us a call. ctypes releases the GIL around each call. (Sleeping on a word is ``futex``.)

All addresses are plain integers (``address_of``); callers bound-check before they get here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import numpy as np

__all__ = [
    "address_of",
    "fetch_add_u32",
    "fetch_add_u64",
    "fetch_op",
    "compare_exchange",
    "exchange",
    "load_u32",
]

_SEQ_CST = 5


def _load_libatomic() -> ctypes.CDLL:
    for name in ("libatomic.so.1", ctypes.util.find_library("atomic")):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    raise ImportError(
        "shmemx needs libatomic (the GCC runtime for atomic builtins) for cross-process atomics; "
        "install it, e.g. `apt-get install libatomic1`"
    )


_lib = _load_libatomic()

_CTYPE = {4: ctypes.c_uint32, 8: ctypes.c_uint64}
_MASK = {4: 0xFFFF_FFFF, 8: 0xFFFF_FFFF_FFFF_FFFF}


def _bind(name: str, size: int, n_value_args: int):
    fn = getattr(_lib, f"__atomic_{name}_{size}")
    fn.restype = _CTYPE[size]
    fn.argtypes = [ctypes.c_void_p] + [_CTYPE[size]] * n_value_args + [ctypes.c_int]
    return fn


_FETCH = {
    (op, size): _bind(f"fetch_{op}", size, 1) for op in ("add", "sub", "and", "or", "xor") for size in (4, 8)
}
_EXCHANGE = {size: _bind("exchange", size, 1) for size in (4, 8)}
_LOAD = {size: _bind("load", size, 0) for size in (4, 8)}
_CAS = {}
for _size in (4, 8):
    _fn = getattr(_lib, f"__atomic_compare_exchange_{_size}")
    _fn.restype = ctypes.c_bool
    _fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, _CTYPE[_size], ctypes.c_bool, ctypes.c_int, ctypes.c_int]
    _CAS[_size] = _fn

_fetch_add_u32 = _FETCH[("add", 4)]
_fetch_add_u64 = _FETCH[("add", 8)]


def address_of(buf: np.ndarray | memoryview) -> int:
    """The address of the first byte of a writable buffer (mmap, bytearray, numpy array)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def fetch_add_u32(addr: int, value: int) -> int:
    """Atomically add ``value`` (mod 2**32) to the u32 at ``addr``; return the old value."""
    return _fetch_add_u32(addr, value & 0xFFFF_FFFF, _SEQ_CST)


def fetch_add_u64(addr: int, value: int) -> int:
    """Atomically add ``value`` (mod 2**64) to the u64 at ``addr``; return the old value."""
    return _fetch_add_u64(addr, value & 0xFFFF_FFFF_FFFF_FFFF, _SEQ_CST)


def fetch_op(op: str, addr: int, value: int, size: int) -> int:
    """Atomic ``old = *addr; *addr = old <op> value; return old`` on an unsigned word of ``size`` bytes.

    Args:
        op: one of "add", "sub", "and", "or", "xor".
        size: 4 or 8; ``addr`` must be aligned to it.
    """
    return _FETCH[(op, size)](addr, value & _MASK[size], _SEQ_CST)


def exchange(addr: int, value: int, size: int) -> int:
    """Atomically store ``value`` and return the old unsigned word."""
    return _EXCHANGE[size](addr, value & _MASK[size], _SEQ_CST)


def load_u32(addr: int) -> int:
    """A fenced load (sequentially consistent) of the u32 at ``addr``."""
    return _LOAD[4](addr, _SEQ_CST)


_tls = threading.local()


def compare_exchange(addr: int, expected: int, desired: int, size: int) -> int:
    """Atomic compare-and-swap on an unsigned word; returns the old value (== expected when it swapped)."""
    slot = getattr(_tls, "slot", None)
    if slot is None:
        slot = _tls.slot = ctypes.c_uint64(0)
    slot.value = expected & _MASK[size]
    # Little-endian: the low 4 bytes of the u64 slot are the u32 expected value.
    _CAS[size](addr, ctypes.addressof(slot), desired & _MASK[size], False, _SEQ_CST, _SEQ_CST)
    return slot.value & _MASK[size]

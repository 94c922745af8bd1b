"""Atomic read-modify-write and futex wait/wake on words in shared memory.

Python has neither atomics nor memory fences, and several processes write the same words (signal ADD, FAA/CAS
executed by different DMA engines, barrier counters). Every such word is changed through the functions here,
which call libatomic's ``__atomic_*`` entry points through ctypes: each is a locked instruction, a full fence on
x86, at about 0.45 us a call. ctypes releases the GIL around each call.

Waiting uses Linux futexes on 32-bit words of the shared segments (shared, not PRIVATE, so that they work across
processes). ``machine_limits.md`` section 3 measured them against semaphores, eventfd and pipes: all cost the
same ~20 us per wake-up on this VM, and a futex needs no handle passed between processes.

All addresses are plain integers (``address_of``); callers bound-check before they get here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import threading

__all__ = [
    "address_of",
    "fetch_add_u32",
    "fetch_add_u64",
    "fetch_op",
    "compare_exchange",
    "exchange",
    "load_u32",
    "futex_wait",
    "futex_wake",
    "futex_wake_add",
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
_libc = ctypes.CDLL(None, use_errno=True)

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


def address_of(buf) -> int:
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


# --- futex -------------------------------------------------------------------------------------------------

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
if _SYS_FUTEX is None:  # pragma: no cover - other architectures are not supported yet
    raise ImportError(f"shmemx: futex syscall number unknown for {platform.machine()}")
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_FUTEX_WAKE_OP = 5
_ADD_ONE = 1 << 28 | 1 << 12  # FUTEX_OP(FUTEX_OP_ADD, 1, FUTEX_OP_CMP_EQ, 0): *uaddr2 += 1
_INT_MAX = 0x7FFF_FFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_int]


class _ThreadTimespec(threading.local):
    """Each thread's own timespec for futex_wait, built once (a fresh one and its byref cost ~1 us a wait)."""

    def __init__(self):
        self.ts = _Timespec(0, 0)
        self.addr = ctypes.addressof(self.ts)


_thread_ts = _ThreadTimespec()


def futex_wait(addr: int, expected: int, timeout: float) -> bool:
    """Sleep while the u32 at ``addr`` equals ``expected``, at most ``timeout`` seconds.

    Returns True when woken or when the word already differed, False on timeout. Callers recheck their
    condition either way: futex wake-ups can be spurious.
    """
    t = _thread_ts
    ts = t.ts
    timeout = max(timeout, 0.0)
    sec = int(timeout)
    ts.tv_sec, ts.tv_nsec = sec, int((timeout - sec) * 1e9)
    rc = _syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, expected & 0xFFFF_FFFF, t.addr, None, 0)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ETIMEDOUT:
        return False
    if err in (errno.EAGAIN, errno.EINTR):
        return True
    raise OSError(err, f"futex wait: {os.strerror(err)}")


def futex_wake(addr: int, n: int = _INT_MAX) -> int:
    """Wake up to ``n`` threads (of any process) sleeping on the u32 at ``addr``; returns how many woke."""
    return _syscall(_SYS_FUTEX, addr, _FUTEX_WAKE, n, None, None, 0)


def futex_wake_add(addr: int) -> int:
    """Atomically add 1 to the u32 at ``addr`` (a locked add: a full fence) and wake every thread sleeping on it,
    in one system call (FUTEX_WAKE_OP with the word as both addresses); returns how many woke."""
    return _syscall(_SYS_FUTEX, addr, _FUTEX_WAKE_OP, _INT_MAX, None, addr, _ADD_ONE)

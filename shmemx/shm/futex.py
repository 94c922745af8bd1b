"""Sleeping on a word of shared memory and waking its sleepers: Linux futexes, through ctypes.

Futexes on 32-bit words of the shared segments (shared, not PRIVATE, so that they work across processes).
``machine_limits.md`` section 3 measured them against semaphores, eventfd and pipes: all cost the same ~20 us per
wake-up on this VM, and a futex needs no handle passed between processes. The sleep is native (``_native``,
without the interpreter lock); the wakes go through ctypes, which releases it around each system call.
Addresses are plain integers; callers bound-check before they get here.
"""

from __future__ import annotations

import ctypes
import platform

from . import _native

__all__ = ["futex_wait", "futex_wake", "futex_wake_add"]

_libc = ctypes.CDLL(None, use_errno=True)

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
if _SYS_FUTEX is None:  # pragma: no cover - other architectures are not supported yet
    raise ImportError(f"shmemx: futex syscall number unknown for {platform.machine()}")
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_FUTEX_WAKE_OP = 5
_ADD_ONE = 1 << 28 | 1 << 12  # FUTEX_OP(FUTEX_OP_ADD, 1, FUTEX_OP_CMP_EQ, 0): *uaddr2 += 1
_INT_MAX = 0x7FFF_FFFF

_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_int]


def futex_wait(addr: int, expected: int, timeout: float) -> bool:
    """Sleep while the u32 at ``addr`` equals ``expected``, at most ``timeout`` seconds (native, without the
    interpreter lock).

    Returns True when woken or when the word already differed, False on timeout. Callers recheck their
    condition either way: futex wake-ups can be spurious.
    """
    return _native.futex_wait(addr, expected & 0xFFFF_FFFF, timeout)


def futex_wake(addr: int, n: int = _INT_MAX) -> int:
    """Wake up to ``n`` threads (of any process) sleeping on the u32 at ``addr``; returns how many woke."""
    return _syscall(_SYS_FUTEX, addr, _FUTEX_WAKE, n, None, None, 0)


def futex_wake_add(addr: int) -> int:
    """Atomically add 1 to the u32 at ``addr`` (a locked add: a full fence) and wake every thread sleeping on it,
    in one system call (FUTEX_WAKE_OP with the word as both addresses); returns how many woke."""
    return _syscall(_SYS_FUTEX, addr, _FUTEX_WAKE_OP, _INT_MAX, None, addr, _ADD_ONE)

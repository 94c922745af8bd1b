"""UDMA atomics: FAA and CAS on QP 0 of the target PE, and CAS loops for the operations without an opcode.

As in CANN SHMEM (reference/cann_shmem_udma.md 2.3): the fetched old value lands in the per-(peer, qp) 8-byte
amo scratch (``wq_ctx.amo_addr``); fetching atomics post, quiet QP 0 of the PE, and read the scratch. Integer
``atomic_add`` / ``atomic_inc`` post an FAA and return at once (complete at ``aclshmemx_udma_quiet``); float32
``atomic_add`` is a WRITE with the reduce flag (fp32 add) whose operand goes through the scratch, so it quiets
before returning. ``set``, ``swap``, ``and``, ``or`` and ``xor`` (and their fetch forms) loop
{READ the word; quiet; CAS(old, new); quiet} until the CAS wins, at most 1,000,000 times.

``dst`` is a heap view whose first element is the target word; its dtype (int32, uint32, int64, uint64; float32
for add) decides the size. Atomics are atomic per word across every PE's engine.
"""

from __future__ import annotations

import numpy as np

from ..runtime import runtime
from ..shm.control import WaitCall
from ..udma.layout import REDUCE_FLAG, Opcode
from ..udma.rings import Api
from .checks import check_target, symmetric_offset

__all__ = [
    "aclshmemx_udma_atomic_add",
    "aclshmemx_udma_atomic_fetch_add",
    "aclshmemx_udma_atomic_compare_swap",
    "aclshmemx_udma_atomic_fetch",
    "aclshmemx_udma_atomic_inc",
    "aclshmemx_udma_atomic_fetch_inc",
    "aclshmemx_udma_atomic_set",
    "aclshmemx_udma_atomic_swap",
    "aclshmemx_udma_atomic_and",
    "aclshmemx_udma_atomic_or",
    "aclshmemx_udma_atomic_xor",
    "aclshmemx_udma_atomic_fetch_and",
    "aclshmemx_udma_atomic_fetch_or",
    "aclshmemx_udma_atomic_fetch_xor",
]

_INT_DTYPES = {np.dtype(t) for t in ("<i4", "<u4", "<i8", "<u8")}
_MAX_TRIES = 1_000_000
_CQE = 0x20


class _Target:
    """The checked target word of one atomic call."""

    def __init__(self, what: str, dst, pe, *, floats: bool = False):
        rt = runtime()
        pe, _ = check_target(rt, what, pe, 0)
        if not isinstance(dst, np.ndarray) or dst.size == 0:
            raise TypeError(f"pe {rt.my_pe}: {what} to pe {pe}: dst must be a non-empty heap view")
        allowed = _INT_DTYPES | ({np.dtype("<f4")} if floats else set())
        if dst.dtype not in allowed:
            raise TypeError(f"pe {rt.my_pe}: {what} to pe {pe}: dst dtype {dst.dtype} not supported (int32, uint32, "
                            f"int64, uint64{', float32' if floats else ''})")
        self.rt = rt
        self.what = what
        self.dtype = dst.dtype
        self.size = dst.itemsize
        self.qp = rt.udma.qp(pe, 0)
        self.va = self.qp.remote_base + symmetric_offset(rt, f"{what} to pe {pe}", dst, self.size, pe, "dst")
        if self.va % self.size:
            raise ValueError(f"pe {rt.my_pe}: {what} to pe {pe}: dst is not {self.size}-byte aligned")
        self.mask = (1 << 8 * self.size) - 1
        self.pos = None  # BB position of the last WQE posted (for --check: the fetch it retires)

    def bits(self, value) -> int:
        """``value`` as the word's unsigned bits; ValueError quoting it when it does not fit the dtype."""
        if self.dtype.kind == "f":
            return int(np.array(value, self.dtype).view(np.uint32))
        info = np.iinfo(self.dtype)
        if not isinstance(value, (int, np.integer)) or not info.min <= int(value) <= info.max:
            raise ValueError(f"pe {self.rt.my_pe}: {self.what}: value {value!r} does not fit dst dtype {self.dtype}")
        return int(value) & self.mask

    def value(self, bits: int):
        return np.array([bits], np.uint64).view(np.uint8)[: self.size].view(self.dtype)[0].item()

    def post(self, opcode: int, operand: int = 0, compare: int = 0, flag: int = _CQE) -> None:
        """Post the atomic WQE (``flag``: its flag byte; a CQE always, a fence when a caller orders it)."""
        qp = self.qp
        wqe = qp.build(opcode, flag, self.va, sge_len=self.size, sge_va=qp.amo_va, operand=operand, compare=compare)
        self.pos = qp.post_bytes(wqe, flag, Api.ATOMIC, self.what)

    def read(self) -> None:
        self.pos = self.qp.post_rw(Opcode.READ, _CQE, self.va, self.size, self.qp.amo_va, Api.ATOMIC, self.what)

    def quiet(self) -> int:
        qp = self.qp
        qp.poll(qp.cqe_cnt, self.what, call=WaitCall.QUIET)
        old = int(qp.amo[0]) & self.mask
        ev = self.rt.events
        if ev is not None and ev.checker is not None and self.pos is not None:  # the value read: an acquire
            ev.checker.fetched(qp, self.pos, old)
        return old

    def cas_loop(self, update) -> int:
        """Replace the word by ``update(old bits)`` atomically; returns the old bits."""
        for _ in range(_MAX_TRIES):
            self.read()
            old = self.quiet()
            self.post(Opcode.CAS, update(old) & self.mask, old)
            if self.quiet() == old:
                return old
        raise RuntimeError(f"pe {self.rt.my_pe}: {self.what}: no CAS won in {_MAX_TRIES} tries")


def aclshmemx_udma_atomic_add(dst, value, pe) -> None:
    """Atomically add ``value`` to ``dst[0]`` on PE ``pe`` (FAA; float32: fp32-add reduce, quieted)."""
    t = _Target("aclshmemx_udma_atomic_add", dst, pe, floats=True)
    if t.dtype.kind == "f":
        qp = t.qp
        qp.poll(qp.cqe_cnt, t.what, call=WaitCall.QUIET)  # the scratch holds the operand until the WQE ran
        qp.amo.view(np.float32)[0] = np.float32(value)
        wqe = qp.build(Opcode.WRITE, _CQE | REDUCE_FLAG, t.va, sge_len=4, sge_va=qp.amo_va, reduce_dtype=0x7,
                       reduce_op=0xA)
        qp.post_bytes(wqe, _CQE | REDUCE_FLAG, Api.ATOMIC, t.what)
        t.quiet()
        return
    t.post(Opcode.FAA, t.bits(value))


def aclshmemx_udma_atomic_fetch_add(dst, value, pe):
    """Atomically add ``value`` to ``dst[0]`` on ``pe``; return the old value."""
    t = _Target("aclshmemx_udma_atomic_fetch_add", dst, pe)
    t.post(Opcode.FAA, t.bits(value))
    return t.value(t.quiet())


def aclshmemx_udma_atomic_compare_swap(dst, cond, value, pe):
    """If ``dst[0] == cond`` on ``pe``, store ``value``; return the old value either way."""
    t = _Target("aclshmemx_udma_atomic_compare_swap", dst, pe)
    t.post(Opcode.CAS, t.bits(value), t.bits(cond))
    return t.value(t.quiet())


def aclshmemx_udma_atomic_fetch(dst, pe):
    """Atomically read ``dst[0]`` on ``pe`` (an FAA of 0)."""
    t = _Target("aclshmemx_udma_atomic_fetch", dst, pe)
    t.post(Opcode.FAA, 0)
    return t.value(t.quiet())


def aclshmemx_udma_atomic_inc(dst, pe) -> None:
    """Atomically add 1 to ``dst[0]`` on ``pe``."""
    t = _Target("aclshmemx_udma_atomic_inc", dst, pe)
    t.post(Opcode.FAA, 1)


def aclshmemx_udma_atomic_fetch_inc(dst, pe):
    """Atomically add 1 to ``dst[0]`` on ``pe``; return the old value."""
    t = _Target("aclshmemx_udma_atomic_fetch_inc", dst, pe)
    t.post(Opcode.FAA, 1)
    return t.value(t.quiet())


def _loop(name: str, dst, value, pe, update, fetch: bool):
    t = _Target(f"aclshmemx_udma_atomic_{name}", dst, pe)
    operand = t.bits(value)
    old = t.cas_loop(lambda o: update(o, operand))
    return t.value(old) if fetch else None


def aclshmemx_udma_atomic_set(dst, value, pe) -> None:
    """Atomically store ``value`` into ``dst[0]`` on ``pe`` (a CAS loop)."""
    _loop("set", dst, value, pe, lambda o, v: v, False)


def aclshmemx_udma_atomic_swap(dst, value, pe):
    """Atomically store ``value`` into ``dst[0]`` on ``pe``; return the old value."""
    return _loop("swap", dst, value, pe, lambda o, v: v, True)


def aclshmemx_udma_atomic_and(dst, value, pe) -> None:
    _loop("and", dst, value, pe, lambda o, v: o & v, False)


def aclshmemx_udma_atomic_or(dst, value, pe) -> None:
    _loop("or", dst, value, pe, lambda o, v: o | v, False)


def aclshmemx_udma_atomic_xor(dst, value, pe) -> None:
    _loop("xor", dst, value, pe, lambda o, v: o ^ v, False)


def aclshmemx_udma_atomic_fetch_and(dst, value, pe):
    return _loop("fetch_and", dst, value, pe, lambda o, v: o & v, True)


def aclshmemx_udma_atomic_fetch_or(dst, value, pe):
    return _loop("fetch_or", dst, value, pe, lambda o, v: o | v, True)


def aclshmemx_udma_atomic_fetch_xor(dst, value, pe):
    return _loop("fetch_xor", dst, value, pe, lambda o, v: o ^ v, True)

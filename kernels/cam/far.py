"""CAM's traffic to ranks of other hosts: UDMA writes, reads and flags, as on the hardware.

On an Ascend cluster CAM reaches the windows of its own server's ranks with MTE loads and stores, and another
server's over UDMA. Here a rank's windows are mapped into this process when it is on the same host
(``aclshmem_ptr`` gives a view) and not when it is on another host of a ``shmemx run --hosts`` job
(``aclshmem_ptr`` raises ``OtherHostError``): the window context keeps a view of every near rank and None for the
far ones (``HcclOpResParam.near``). The kernels do what they always did for near ranks, and for far ranks the same
stores and loads as UDMA requests of the same bytes, addressed by the symmetric address (the same offset in this
PE's own window): ``put`` and ``get`` for rows, ``flag`` for a 32-byte flag slot of eight 1.0f. Everything a
section posted is complete (quiet) when the section ends; rows are quiet before their flags are written. The
reader finds complete flags with plain loads, as on one host, and then takes them with a wait that is met at once
(``acquire``): a plain load of what an engine wrote orders nothing after it, a wait does. A single host has no far
rank: nothing here runs there.

One submitter per send queue (as on the hardware): the far traffic of a kernel launch is posted by its AIV block
0 alone (the kernels hand it the other blocks' share of it), on QP 0, and the host thread's (``notify_dispatch``)
never overlaps a launch.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np

import shmemx

__all__ = ["FarSection", "section", "acquire", "MAX_BYTES", "ONE_BITS"]

MAX_BYTES = 128 << 20  # bytes per UDMA request at most (the engine takes up to 256 MiB)
_ONES8 = np.ones(8, np.float32)
ONE_BITS = int(np.float32(1.0).view(np.int32))  # a flag word once set: 1.0f


class FarSection:
    """UDMA traffic to far ranks on QP 0: every request posted is complete (its effect at the target, a read's
    data here) once ``quiet`` or the section's end returned."""

    def __init__(self) -> None:
        self.pes: set[int] = set()

    def put(self, dst: np.ndarray, src: np.ndarray, pe: int) -> None:
        """Write local ``src`` into ``dst`` (a view of this PE's own window: the symmetric address) on PE ``pe``."""
        for d, s in _pieces(dst, src):
            shmemx.aclshmemx_udma_put_nbi(d, s, d.size, pe)
        self.pes.add(pe)

    def get(self, dst: np.ndarray, src: np.ndarray, pe: int) -> None:
        """Read ``src`` (a view of this PE's own window: the symmetric address) of PE ``pe`` into local ``dst``."""
        for d, s in _pieces(dst, src):
            shmemx.aclshmemx_udma_get_nbi(d, s, d.size, pe)
        self.pes.add(pe)

    def flag(self, slot: np.ndarray, pe: int) -> None:
        """Set the flag slot ``slot`` (``[8] float32``, a view of this PE's own window) on PE ``pe`` to eight
        1.0f."""
        shmemx.aclshmemx_udma_put_nbi(slot, _ONES8, 8, pe)
        self.pes.add(pe)

    def quiet(self) -> None:
        for pe in sorted(self.pes):
            shmemx.aclshmemx_udma_quiet(pe)
        self.pes.clear()


def acquire(bits: np.ndarray, ready: np.ndarray, width: int) -> None:
    """Take the flag writes of groups ``ready`` of ``bits`` (``width`` int32 words each, every one 1.0f now) with a
    wait on them, met at once: a reader's plain loads of words a UDMA write set order nothing after that write
    (the engine's writes are not a thread's stores); the wait does, as a wait for any remote write does."""
    skip = np.ones(bits.size, np.int32)
    skip[(np.asarray(ready)[:, None] * width + np.arange(width)).reshape(-1)] = 0
    shmemx.aclshmem_wait_until_all(bits, shmemx.ACLSHMEM_CMP_EQ, ONE_BITS, status=skip)


@contextmanager
def section() -> Iterator[FarSection]:
    """A section of far traffic, quiet at its end."""
    far = FarSection()
    try:
        yield far
    finally:
        far.quiet()


def _pieces(dst: np.ndarray, src: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """``dst`` and ``src`` (C-contiguous, the same number of bytes) as byte vectors, in pieces of at most
    ``MAX_BYTES`` (all cut before any is posted: a read's destination is not touched while it is in flight)."""
    d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
    if d.size != s.size:
        raise ValueError(f"pe {shmemx.my_pe()}: CAM far copy of {s.size} B into {d.size} B")
    if d.size <= MAX_BYTES:
        return [(d, s)]
    return [(d[lo:lo + MAX_BYTES], s[lo:lo + MAX_BYTES]) for lo in range(0, d.size, MAX_BYTES)]

"""CANN's cycle profiling: ``SHMEMI_PROF_START`` / ``SHMEMI_PROF_END`` in a kernel, ``aclshmemx_get_prof`` on the host.

A kernel brackets a stretch of code with ``SHMEMI_PROF_START(frame)`` and ``SHMEMI_PROF_END(frame)`` (frame ids
0 .. 1023); on the one PE named by the environment variable ``SHMEM_CYCLE_PROF_PE`` each pair adds the cycles it
spans and one to the count of (this block, that frame). ``aclshmemx_get_prof(verbose)`` on that PE returns the
table (and prints it when ``verbose``); on every other PE, and when the variable is not set, nothing is collected
and it returns None. ``aclshmemx_show_prof()`` prints it.

As in CANN: one PE is profiled (an unparsable or out-of-range ``SHMEM_CYCLE_PROF_PE`` falls back to PE 0 with a
warning), 64 blocks x 1024 frames, the counters accumulate over the whole run, and the table prints only the
(block, frame) pairs that ran. The cycle counter is the Ascend 950's system cycle at 1000 cycles per microsecond,
read here from the host's monotonic nanosecond clock, so a cycle is a nanosecond of this process's wall time.
CANN's out-parameter ``aclshmem_prof_pe_t **out_profs`` becomes the return value; ``block_prof`` is a record
array, so ``prof.block_prof[b].ccount[f]`` and ``.cycles[f]`` read as in C.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..runtime import runtime
from .blocks import get_block_idx
from .log import LogLevel, log

__all__ = ["ACLSHMEM_CYCLE_PROF_MAX_BLOCK", "ACLSHMEM_CYCLE_PROF_FRAME_CNT", "aclshmem_prof_pe_t",
           "SHMEMI_PROF_START", "SHMEMI_PROF_END", "aclshmemx_get_prof", "aclshmemx_show_prof"]

ACLSHMEM_CYCLE_PROF_MAX_BLOCK = 64
ACLSHMEM_CYCLE_PROF_FRAME_CNT = 1024
CYCLES_PER_US = 1000  # the Ascend 950's system cycle (CANN's A2/A3 count 50 per microsecond)
_BLOCK = np.dtype([("ccount", np.int64, (ACLSHMEM_CYCLE_PROF_FRAME_CNT,)),
                   ("cycles", np.int64, (ACLSHMEM_CYCLE_PROF_FRAME_CNT,))])
_RULE = "=" * 60


@dataclass
class aclshmem_prof_pe_t:  # noqa: N801 (CANN's type name)
    """The profile of one PE: ``block_prof[block].ccount[frame]`` pairs run, ``.cycles[frame]`` cycles spent."""

    pe_id: int
    block_prof: np.recarray

    def rows(self) -> list[tuple[int, int, int, int, float]]:
        """(block, frame, cycles, count, average microseconds) of every pair that ran, by block then frame."""
        counts = self.block_prof.ccount
        return [(int(b), int(f), int(self.block_prof.cycles[b, f]), int(counts[b, f]),
                 self.block_prof.cycles[b, f] / counts[b, f] / CYCLES_PER_US) for b, f in np.argwhere(counts > 0)]

    def table(self) -> str:
        """The table CANN prints: BlockID, FrameID, Cycles, Count, AvgTime(us)."""
        head = f"{'BlockID':<10}{'FrameID':<10}{'Cycles':<15}{'Count':<15}{'AvgTime(us)':<15}"
        lines = [f"{b:<10}{f:<10}{c:<15}{n:<15}{us:<15.3f}" for b, f, c, n, us in self.rows()]
        return "\n".join([_RULE, head, "-" * 60, *lines, _RULE])


_state: dict[int, aclshmem_prof_pe_t | None] = {}  # id(runtime) -> this PE's profile (None: not profiled)
_made = threading.Lock()


def _profiled_pe(me: int, n_pes: int) -> int | None:
    text = os.environ.get("SHMEM_CYCLE_PROF_PE")
    if text is None:
        return None
    try:
        pe = int(text)
    except ValueError:
        pe = -1
    if not 0 <= pe < n_pes:
        log(LogLevel.WARN, me, f"SHMEM_CYCLE_PROF_PE={text!r} is not a PE of this job (0..{n_pes - 1}): "
                               f"profiling PE 0")
        pe = 0
    return pe


def _profile() -> aclshmem_prof_pe_t | None:
    rt = runtime()
    key = id(rt)
    if key in _state:
        return _state[key]
    with _made:  # the blocks of a launch may come here first together
        if key in _state:
            return _state[key]
        _state.clear()  # a new init: the counters of an earlier runtime are gone with it
        pe = _profiled_pe(rt.my_pe, rt.n_pes)
        _state[key] = None if pe != rt.my_pe else aclshmem_prof_pe_t(
            pe, np.zeros(ACLSHMEM_CYCLE_PROF_MAX_BLOCK, _BLOCK).view(np.recarray))
    return _state[key]


def _slot(pf_id: int) -> tuple[np.recarray, int] | None:
    prof = _profile()
    block = get_block_idx()
    if prof is None or not 0 <= pf_id < ACLSHMEM_CYCLE_PROF_FRAME_CNT or block >= ACLSHMEM_CYCLE_PROF_MAX_BLOCK:
        return None
    return prof.block_prof[block], pf_id


def SHMEMI_PROF_START(pf_id: int) -> None:  # noqa: N802 (CANN's macro name)
    """Open frame ``pf_id`` of this block: its cycles count from now (on the profiled PE only)."""
    slot = _slot(pf_id)
    if slot is not None:
        slot[0].cycles[slot[1]] -= time.perf_counter_ns()


def SHMEMI_PROF_END(pf_id: int) -> None:  # noqa: N802 (CANN's macro name)
    """Close frame ``pf_id`` of this block: add the cycles since its START and one to its count."""
    now = time.perf_counter_ns()
    slot = _slot(pf_id)
    if slot is not None:
        slot[0].cycles[slot[1]] += now
        slot[0].ccount[slot[1]] += 1


def aclshmemx_get_prof(verbose: bool = False) -> aclshmem_prof_pe_t | None:
    """This PE's profile when it is the one ``SHMEM_CYCLE_PROF_PE`` names (printed if ``verbose``), else None."""
    prof = _profile()
    if prof is not None and verbose:
        print(prof.table(), file=sys.stdout, flush=True)
    return prof


def aclshmemx_show_prof() -> None:
    """Print the profile on the profiled PE (CANN's older spelling of ``aclshmemx_get_prof(verbose=True)``)."""
    aclshmemx_get_prof(verbose=True)

"""The job's control segment: who is in the job, what each PE is doing, and the words everyone waits on.

The launcher creates one control segment per job (``shmemx_<job>_ctl``) before it starts the ranks; every rank
and every inspection tool maps it. It holds no payload, only small fixed-layout records:

* the job header: size, launcher pid, job state, the barrier counter and generation word;
* one block per PE: its status and pid, its wake word (a futex that every writer into this PE's memory bumps),
  its URMA identity (EID, heap tokenId and token value), its collective-call log (the symmetry check of malloc
  and free), the barriers it entered on each team slot, the wait slot of each of its threads (what it waits on,
  so that a hang can be diagnosed from outside), its live heap allocations with their names, and its failure
  summary;
* after the PE blocks, the team table: one 64-byte entry per team slot (``MAX_TEAMS``), with the slot's barrier
  counter and generation word, the team's shape and job-wide id, and the mailbox of its collective calls (see
  ``shm.teams``).

Who writes what: a PE writes only its own block, except the wake word (every writer bumps it atomically); the
header's barrier words and a team entry's counter and generation are changed atomically by every PE (of the job,
of the team); a team entry's shape and mailbox by the team's leader. The launcher writes the header.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Iterable

import numpy as np

from . import _native
from .segment import Segment, segment_name

__all__ = [
    "JobState",
    "PeStatus",
    "WaitCall",
    "WAIT_CALLS",
    "BARRIER_CALLS",
    "QUIET_CALLS",
    "CMP_SYMBOLS",
    "BARRIER_WAIT_NAMES",
    "find_allocation",
    "HEADER_DTYPE",
    "PE_DTYPE",
    "WAIT_DTYPE",
    "ALLOC_DTYPE",
    "COLL_DTYPE",
    "MAX_WAIT_SLOTS",
    "MAX_ALLOCS",
    "MAX_TEAMS",
    "TEAM_DTYPE",
    "Control",
    "format_heap_offset",
]

MAGIC = 0x31305F584D454D48  # "HMEMX_01"
VERSION = 1
MAX_WAIT_SLOTS = 130  # AIV blocks 0..127, the main thread outside a launch (slot 0), the engine (last slot)
MAX_ALLOCS = 512
COLL_LOG = 4
MAX_TEAMS = 256  # team slots of a job (CANN: ACLSHMEM_MAX_TEAMS = 2048); slot 0 is ACLSHMEM_TEAM_WORLD


class JobState(enum.IntEnum):
    STARTING = 0
    RUNNING = 1
    ABORTING = 2
    DONE = 3


class PeStatus(enum.IntEnum):
    NOT_STARTED = 0
    STARTED = 1  # process runs, shmemx not initialised
    READY = 2  # initialised
    FINALIZED = 3
    FAILED = 4
    EXITED = 5


class WaitCall(enum.IntEnum):
    """What a thread waits in; recorded in its wait slot while it waits."""

    NONE = 0
    WAIT_UNTIL = 1
    SIGNAL_WAIT_UNTIL = 2
    WAIT_UNTIL_ALL = 3
    WAIT_UNTIL_ANY = 4
    WAIT_UNTIL_SOME = 5
    BARRIER_ALL = 6
    SYNC_ALL = 7
    INIT = 8
    FINALIZE = 9
    MALLOC = 10
    FREE = 11
    QUIET = 12
    QP_QUIET = 13
    SYNC_VEC_ALL = 14
    BLOCK_SYNC = 15
    SQ_CREDIT = 16
    TEAM_BARRIER = 17  # aclshmem_barrier(team) / aclshmem_sync(team) / the _vec forms, on a team other than WORLD
    TEAM_SPLIT = 18  # the meeting of a collective team call (split_strided, split_2d, destroy)
    SDMA_QUIET = 19  # aclshmemx_sdma_quiet: the calling block's SDMA channel
    STREAM_SYNC = 20  # aclrtSynchronizeStream / a notify wait on an emulated stream


# What each kind of wait is counted as (the stats' quiet / barrier / wait timers; init, finalize, malloc and free
# count as none of them)
WAIT_CALLS = frozenset({WaitCall.WAIT_UNTIL, WaitCall.SIGNAL_WAIT_UNTIL, WaitCall.WAIT_UNTIL_ALL,
                        WaitCall.WAIT_UNTIL_ANY, WaitCall.WAIT_UNTIL_SOME})
BARRIER_CALLS = frozenset({WaitCall.BARRIER_ALL, WaitCall.SYNC_ALL, WaitCall.SYNC_VEC_ALL})
QUIET_CALLS = frozenset({WaitCall.QUIET, WaitCall.QP_QUIET, WaitCall.SQ_CREDIT})
# The calls that wait in the job-wide barrier (a report lists them after the other waits, grouped by barrier)
BARRIER_WAIT_NAMES = frozenset(c.name.lower() for c in BARRIER_CALLS | {WaitCall.INIT, WaitCall.FINALIZE,
                                                                           WaitCall.MALLOC, WaitCall.FREE})
# The comparison a wait slot records (``cmp``, ACLSHMEM_CMP_EQ..LE = 0..5), as dumps, traces and messages write it
CMP_SYMBOLS = ("==", "!=", ">", ">=", "<", "<=")


def _line(name):  # a u32 alone on its own 64-byte cache line
    return [(name, "<u4"), (f"_{name}_pad", "V60")]


HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u8"),
        ("version", "<u4"),
        ("n_pes", "<u4"),
        ("launcher_pid", "<u4"),
        ("state", "<u4"),
        ("failed_pe", "<i4"),
        ("n_ready", "<u4"),
        ("start_time", "<f8"),
        ("heap_size", "<u8"),
        ("timeout", "<f8"),
        ("job_id", "S32"),
        ("script", "S256"),
        ("team_uids", "<u4"),  # the last job-wide team id handed out (shm.teams; ACLSHMEM_TEAM_WORLD's is 1)
        ("n_hosts", "<u4"),  # a job of several hosts (shm.hosts): how many, and this segment's host: its index,
        ("host", "<u4"),  # its first PE and its number of PEs (1, 0, 0, n_pes for a job of one host)
        ("host_first_pe", "<u4"),
        ("host_pes", "<u4"),
        ("_pad0", "V100"),
        *_line("barrier_count"),
        *_line("barrier_gen"),
    ]
)

WAIT_DTYPE = np.dtype(
    [
        ("call", "<u4"),  # WaitCall; 0 = not waiting
        ("cmp", "<i4"),  # ACLSHMEM_CMP_*, -1 when not a comparison
        ("pe", "<i4"),  # whose memory (a heap word's PE, a quiet's peer); -1 when none
        ("qp", "<i4"),
        ("offset", "<u8"),  # heap offset of the (first) word waited on
        ("value", "<u8"),  # the comparison value, raw bits
        ("dtype", "S8"),  # numpy dtype string of the word, e.g. b"<i4"
        ("count", "<u4"),  # number of words (wait_until_all/any/some), else 1
        ("target", "<u4"),  # quiet: the CQE count waited for; barrier: the barrier number
        ("since", "<f8"),  # time.time() when the wait started
        ("_pad", "V8"),
    ]
)
assert WAIT_DTYPE.itemsize == 64

ALLOC_DTYPE = np.dtype(
    [("offset", "<u8"), ("size", "<u8"), ("live", "<u4"), ("seq", "<u4"), ("name", "S40")]
)
assert ALLOC_DTYPE.itemsize == 64

COLL_DTYPE = np.dtype(
    [
        ("seq", "<u4"),
        ("op", "<u4"),  # WaitCall.MALLOC / FREE / INIT ...
        ("size", "<u8"),
        ("align", "<u8"),
        ("offset", "<i8"),  # the offset this PE computed (-1: did not fit)
        ("name", "S32"),
    ]
)

_PE_HEAD = [
    ("pid", "<u4"),
    ("status", "<u4"),
    ("qp_num", "<u4"),
    ("sq_depth", "<u4"),
    ("cq_depth", "<u4"),
    ("heap_tid", "<u4"),
    ("heap_token", "<u4"),
    ("coll_seq", "<u4"),
    ("heap_size", "<u8"),
    ("barriers", "<u8"),  # number of barriers this PE has entered
    ("eid", "<u8", (2,)),
    ("start_time", "<f8"),
    ("heap_used", "<u8"),
]
_PE_HEAD.append(("_pad0", "V%d" % (128 - np.dtype(_PE_HEAD).itemsize)))
# n_sleepers counts this PE's own threads asleep on its wake word (changed only under this process's GIL, by
# plain stores); n_remote_sleepers counts other PEs' threads asleep on it (atomic adds). One cache line: a waker
# reads both.
_SLEEPERS = [("n_sleepers", "<u4"), ("n_remote_sleepers", "<u4"), ("_n_sleepers_pad", "V56")]
# team_barriers[s]: the barriers this PE entered on team slot s since it joined the team there (shm.barrier);
# team_relayed[s]: in a job of several hosts, (team uid << 32) | the arrivals of those its host's NIC has taken
# to the other hosts (written by the NIC, udma.nic; api.teams waits on it before a slot's counter is reused)
_PE_WORDS = [*_line("wake_seq"), *_SLEEPERS, ("error", "S512"), ("coll", COLL_DTYPE, (COLL_LOG,)),
             ("team_barriers", "<u4", (MAX_TEAMS,)), ("team_relayed", "<u8", (MAX_TEAMS,))]
_PAD1 = 4096 - 128 - np.dtype(_PE_WORDS).itemsize
if _PAD1:
    _PE_WORDS.append(("_pad1", "V%d" % _PAD1))
PE_DTYPE = np.dtype(
    _PE_HEAD + _PE_WORDS + [("waits", WAIT_DTYPE, (MAX_WAIT_SLOTS,)), ("allocs", ALLOC_DTYPE, (MAX_ALLOCS,))]
)
assert PE_DTYPE.fields["waits"][1] == 4096
PE_STRIDE = -(-PE_DTYPE.itemsize // 4096) * 4096
HEADER_SIZE = 4096

# One team slot (shm.teams): its barrier counter and generation (the futex word), then what its leader writes:
# the team's job-wide id (0: the slot is free), shape, and the mailbox of the team's collective calls.
TEAM_DTYPE = np.dtype(
    [
        ("count", "<u4"),  # members arrived at the current barrier
        ("gen", "<u4"),  # barrier generation: bumped (and woken) by the last arrival
        ("uid", "<u4"),  # the team's job-wide id; 0 = free slot
        ("size", "<i4"),
        ("start", "<i4"),  # global PE of team PE 0
        ("stride", "<i4"),  # global stride
        ("coll_seq", "<u4"),  # the leader's count of collective calls on this team (the mailbox's call)
        ("coll_op", "<u4"),  # WaitCall of that call's kind (TEAM_SPLIT ...) | sub-op << 8
        ("coll_args", "<i4", (3,)),  # the leader's arguments
        ("coll_result", "<i4"),  # the slot it allocated (-1: none free)
        ("coll_bad", "<i4"),  # 1 + the team index of the first member that disagreed (0: none)
        ("released", "<u4"),  # the uid of the team whose leader released the slot last (teams.release)
        ("_pad", "V8"),
    ]
)
assert TEAM_DTYPE.itemsize == 64


def control_size(n_pes: int) -> int:
    return HEADER_SIZE + n_pes * PE_STRIDE + MAX_TEAMS * TEAM_DTYPE.itemsize


class Control:
    """Typed access to a job's control segment.

    ``header`` is a 0-d structured array over the job header; ``pes[p]`` a 0-d structured array over PE p's
    block. Fields read and written through them are plain loads and stores; words that several processes change
    are changed through ``atomics`` at the addresses ``*_addr`` give.
    """

    def __init__(self, segment: Segment):
        self.segment = segment
        self.header = segment.view(HEADER_DTYPE, 0, (1,))[0:1].reshape(())
        n = int(self.header["n_pes"])
        if int(self.header["magic"]) != MAGIC:
            raise ValueError(f"{segment.name}: not a shmemx control segment (bad magic)")
        self.n_pes = n
        self.job_id = self.header["job_id"].item().decode()
        self.pes = [segment.view(PE_DTYPE, HEADER_SIZE + p * PE_STRIDE, (1,)).reshape(()) for p in range(n)]
        self.teams_offset = HEADER_SIZE + n * PE_STRIDE
        self.teams = segment.view(TEAM_DTYPE, self.teams_offset, (MAX_TEAMS,))
        # The wake path runs on every signal and put: its addresses and words, computed once.
        self.u32 = segment.view("<u4", 0, (segment.size // 4,))
        self.words = memoryview(segment.mm).cast("I")  # the same words; a read gives an int in 20 ns, not 80
        self.wake_addrs = [self.pe_addr(p, "wake_seq") for p in range(n)]
        self.sleepers_addrs = [self.pe_addr(p, "n_sleepers") for p in range(n)]
        self.remote_sleepers_addrs = [self.pe_addr(p, "n_remote_sleepers") for p in range(n)]
        self.wake_idx = [(a - segment.addr) // 4 for a in self.wake_addrs]  # the same words in ``self.words``
        self._sleepers_idx = [(a - segment.addr) // 4 for a in self.sleepers_addrs]  # +1: n_remote_sleepers

    # --- creation / attachment -----------------------------------------------------------------------------

    @classmethod
    def create(cls, job_id: str, n_pes: int, *, heap_size: int, timeout: float, script: str = "",
               host: tuple[int, int, int, int] | None = None) -> "Control":
        """A new control segment; ``host`` = (hosts, this host, its first PE, its PEs) in a job of several hosts."""
        seg = Segment(segment_name(job_id, "ctl"), control_size(n_pes), create=True)
        hdr = seg.view(HEADER_DTYPE, 0, (1,)).reshape(())
        hdr["n_pes"] = n_pes
        hdr["n_hosts"], hdr["host"], hdr["host_first_pe"], hdr["host_pes"] = host or (1, 0, 0, n_pes)
        hdr["version"] = VERSION
        hdr["launcher_pid"] = os.getpid()
        hdr["state"] = JobState.STARTING
        hdr["failed_pe"] = -1
        hdr["start_time"] = time.time()
        hdr["heap_size"] = heap_size
        hdr["timeout"] = timeout
        hdr["job_id"] = job_id.encode()
        hdr["script"] = script.encode()[:255]
        hdr["magic"] = MAGIC  # last: a reader that sees the magic sees a complete header
        return cls(seg)

    @classmethod
    def attach(cls, job_id: str, *, readonly: bool = False) -> "Control":
        return cls(Segment(segment_name(job_id, "ctl"), readonly=readonly))

    def close(self) -> None:
        self.header = None
        self.pes = []
        self.teams = None
        self.u32 = None
        self.words = None
        self.segment.close()

    # --- addresses of shared words -------------------------------------------------------------------------

    def header_addr(self, field: str) -> int:
        return self.segment.addr + HEADER_DTYPE.fields[field][1]

    def pe_addr(self, pe: int, field: str) -> int:
        return self.segment.addr + HEADER_SIZE + pe * PE_STRIDE + PE_DTYPE.fields[field][1]

    def team_addr(self, slot: int, field: str) -> int:
        """The address of a word of team slot ``slot``'s entry (``TEAM_DTYPE``)."""
        return self.segment.addr + self.teams_offset + slot * TEAM_DTYPE.itemsize + TEAM_DTYPE.fields[field][1]

    # --- helpers -------------------------------------------------------------------------------------------

    def wake(self, pe: int) -> None:
        """Tell PE ``pe`` that its memory changed: bump its wake word, wake its sleepers if it has any."""
        # wake.h: a locked add (a full fence: the data stores before it are visible first), then a wake only if a
        # sleeper announced itself; one FUTEX_WAKE_OP when one already had
        _native.wake(self.wake_addrs[pe], self.sleepers_addrs[pe])

    def live_allocations(self, pe: int) -> np.ndarray:
        allocs = self.pes[pe]["allocs"]
        return allocs[allocs["live"] != 0]

    def allocations(self, pe: int) -> list[tuple[str, int, int]]:
        """PE ``pe``'s live heap allocations: (name, offset, size), by offset."""
        live = self.live_allocations(pe)
        return sorted(((a["name"].decode(errors="replace"), int(a["offset"]), int(a["size"])) for a in live),
                      key=lambda a: a[1])

    def allocation_at(self, pe: int, offset: int) -> tuple[str, int, int] | None:
        """(name, start offset, size) of PE ``pe``'s live allocation holding heap ``offset``, or None."""
        return find_allocation(self.allocations(pe), offset)

    def describe_offset(self, pe: int, offset: int) -> str:
        """``'recv_x'+0x200`` for a heap offset inside a named allocation, else ``heap+0x1200``."""
        return format_heap_offset(self.allocation_at(pe, offset), offset)


def find_allocation(allocations: Iterable[tuple[str, int, int]], offset: int) -> tuple[str, int, int] | None:
    """The (name, start, size) of ``allocations`` (such triples) that holds heap ``offset``, or None."""
    for name, start, size in allocations:
        if start <= offset < start + max(size, 1):
            return name, start, size
    return None


def format_heap_offset(found: tuple | None, offset: int) -> str:
    """``'recv_x'+0x200`` given the (name, start, size) of the allocation holding heap ``offset``, else
    ``heap+0x1200``: how dumps, traces and error messages name a heap address."""
    if found is None:
        return f"heap+{offset:#x}"
    name, start, _ = found
    return f"'{name}'+{offset - start:#x}"

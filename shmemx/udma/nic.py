"""The NIC of a host: executes the WQEs its PEs post to PEs of other hosts, over MPI.

A job of several hosts (``shmemx run --hosts``) has one NIC per host, a thread of that host's launcher (the one
process per host that MPI started). Within a host nothing changes: each PE's engine executes the queues to the
host's PEs. The queues to another host's PEs are the NIC's (the engine skips them, ``_engine.c`` ``remote``): the
NIC polls their doorbells, reads the rung WQEs from the SQ rings in shared memory, resolves the local side (the
source of a write, the destination of a read: this host's heap or amo scratch) and sends each WQE with its
payload to the target host's NIC, which executes it there with the engine's checks (EID, tokenId, token value,
bounds, signal alignment, atomic size) and answers with a status, the fetched value or the read data. The
initiator's NIC then writes the CQE into the poster's CQ, advances the queue's consumer index and wakes the PE:
a CQE only after the remote effect, as within a host.

Ordering (DESIGN section 5). A queue's WQEs travel in SQ order in one MPI stream (one communicator, one tag,
one pair of ranks: MPI keeps their order) and the target's NIC executes them in that order, so every queue is
executed in order, which is stronger than RO/SO/fence need; a WRITE_WITH_NOTIFY's payload is stored before its
signal (an atomic exchange); completions are written in SQ order. A failure puts the queue into error at both
ends: the initiator stops sending the queue's WQEs, the target flushes those of it already on the way
(FLUSHED), the initiator completes every later WQE as FLUSHED, and the record (``HW_DTYPE``'s err_*) names the
status and check exactly as the engine's does, so ``CompletionError`` reads the same.

Barriers. The job barrier's counter lives in each host's control segment. Each NIC watches its PEs' barrier
counts (``pes[p]['barriers']``) and, for each arrival, sends the PE's row of the control segment (identity,
allocations, waits, barrier count) to every other host; a NIC that receives an arrival copies the row in and
adds the arrival to its host's counter once the host has completed the barrier before it, waking the sleepers
when it was the last. So every host's counter sees every PE once per barrier, init's barrier exchanges the
identities, and ``shmemx dump`` on any host names every PE.

Failure: every NIC sends a heartbeat four times a second; a host silent for ``DEAD_AFTER`` seconds, or one that says
it aborts, ends the job on every host (``failure`` names it; the launcher stops its ranks). The launcher's main
thread checks the silence too (``check_heard``), so that a NIC thread held inside an MPI call still ends the job.
"""

from __future__ import annotations

import collections
import ctypes
import os
import random
import struct
import threading
import time
from typing import Any

import numpy as np

from ..shm import atomics
from ..shm.control import HEADER_SIZE, MAX_TEAMS, PE_STRIDE, Control, PeStatus
from ..shm.hosts import HostMap
from ..shm.teams import released_elsewhere, slot_host
from ..shm.futex import futex_wake
from ..shm.heap import HEAP_VA_BASE, HEAP_VA_STRIDE
from ..shm.segment import Segment, segment_name
from .engine import Where
from .layout import (C_BYTE_CNT, C_DATA, C_EID, C_ENTRY_IDX, C_STATUS, C_TPN, C_USER_DATA, MAX_MSG_BYTES,
                     NOTIFY_CTX_OFFSET, NOTIFY_SGE_OFFSET, AMO_OPERAND_OFFSET, OWNER_SHIFT, REDUCE_FLAG,
                     REMOTE_JETTY_TYPE, CqeStatus, Opcode)
from .registry import SharedLocals
from .segment import (HW_BYTES, HW_CI, HW_CQ_PI, HW_ERR_ARG, HW_ERR_POS, HW_ERR_STATUS, HW_ERR_SUBSTATUS,
                      HW_ERR_WHERE, HW_EXECUTED, HW_SQ_DB, HW_STATE, UdmaSegment)

__all__ = ["Nic", "DEAD_AFTER"]

# Requests and replies share one tag (a leading kind byte tells them apart), so that a host takes them in the
# order they were sent, and with them the payloads sent apart (TAG_DATA), which follow in that same order
TAG_BATCH, TAG_CTL, TAG_DATA = 11, 13, 14
TAG_REQ, TAG_REP = b"Q", b"P"
LARGE = 64 << 10  # payloads of at least this many bytes travel as messages of their own, from and into the heap
APART = 0xFFFFFFFF  # a request's / reply's payload size field: the payload follows as a TAG_DATA message
RUN = 0xFFFFFFFE  # ... a run of plain small WRITEs of one queue follows (_RUN, the WQEs' first BBs, payloads)
RUN_MIN = 4  # consecutive plain WRITEs that go as one run
RUN_MAX = 4096
CTL_ARRIVE, CTL_BEAT, CTL_ABORT, CTL_TEAM = 1, 2, 3, 4
HEARTBEAT = 0.25
DEAD_AFTER = 3.0
NOTICED_DEAD_AFTER = 0.75  # ... once mpiexec said that a process of the job ended (``notice``)
_LAST_WORDS = 0.5
MEET_TIMEOUT = 30.0  # seconds a finished host waits for the others in the NICs' last meeting
CHAOS_HOLD = 0.002  # --chaos: the longest a queue or a batch is held back
SPIN_AFTER = 0.005  # seconds the NIC keeps polling after its last work
NAP_MAX = 0.001  # its longest nap when idle (the latency a quiet host adds to the first WQE that arrives)
MAX_INFLIGHT_BYTES = 64 << 20  # per queue: a queue's WQEs in flight carry at most this much payload

_RUN = struct.Struct("<II")  # WQEs, payload bytes
_REQ = struct.Struct("<iiIII")  # src pe, queue, BB position, payload bytes, queue epoch; the WQE's 128 bytes, payload
_REP = struct.Struct("<iiIIIIQI")  # src pe, queue, position, status, where, byte count, data, payload bytes
_HDR32 = struct.Struct("<16I")
_KNOWN = frozenset(int(op) for op in (Opcode.WRITE, Opcode.WRITE_WITH_NOTIFY, Opcode.READ, Opcode.CAS,
                                      Opcode.FAA, Opcode.NOP))
_TWO_BB = frozenset(int(op) for op in (Opcode.WRITE_WITH_NOTIFY, Opcode.FAA, Opcode.CAS))
_CQE_FLAG = 0x20
assert C_STATUS == 0  # a run's CQEs are written as words 1-15, then word 0
_CQE_ZERO = sorted(set(range(16)) - {C_STATUS, C_ENTRY_IDX, C_TPN, C_BYTE_CNT, C_USER_DATA, C_EID, C_EID + 1,
                                     C_EID + 2, C_EID + 3, C_DATA, C_DATA + 1})
_FP32, _REDUCE_ADD = 0x7, 0xA
_S = CqeStatus


class _Entry:
    """A WQE of a queue between its send and its completion."""

    __slots__ = ("pos", "bbs", "opcode", "flag", "eid", "local", "length", "result")

    def __init__(self, pos, bbs, opcode, flag, eid, local, length, result=None):
        self.pos, self.bbs, self.opcode, self.flag, self.eid = pos, bbs, opcode, flag, eid
        self.local, self.length, self.result = local, length, result


class _Run:
    """A run of plain WRITEs of one queue between its send and its completion (``RUN``): one batch record each
    way when every WQE passes (completed at once: ``all_ok``); per-WQE replies when one fails (its WQEs then
    complete one by one, ``entries``)."""

    __slots__ = ("pos", "k", "flags", "lens", "offs", "eid", "mv", "results", "left", "result", "all_ok")

    def __init__(self, pos: int, flags: list, lens: list, offs: list, eid: tuple, mv):
        self.pos, self.k, self.flags, self.lens, self.offs, self.eid, self.mv = pos, len(lens), flags, lens, offs, \
            eid, mv
        self.results: dict[int, tuple] = {}
        self.left = self.k
        self.result = None  # True once every WQE has its result
        self.all_ok = False

    def covers(self, pos: int) -> bool:
        return ((pos - self.pos) & 0xFFFFFFFF) < self.k

    def set(self, pos: int, result) -> None:
        j = (pos - self.pos) & 0xFFFFFFFF
        if j not in self.results:
            self.results[j] = result
            self.left -= 1
            if not self.left:
                self.result = True

    def set_all_ok(self) -> None:
        self.all_ok = self.result = True
        self.left = 0

    def entries(self) -> list:
        out = []
        for j in range(self.k):
            result = (0, 0, self.lens[j], 0, b"") if self.all_ok else self.results[j]
            out.append(_Entry((self.pos + j) & 0xFFFFFFFF, 1, Opcode.WRITE, self.flags[j], self.eid,
                              (self.mv, self.offs[j]), self.lens[j], result))
        return out


class _LocalPe:
    """A PE of this host as its NIC sees it: its UDMA segment and heap, mapped read-write."""

    def __init__(self, job_id: str, pe: int, pid: int, remote_slots: np.ndarray):
        self.pe = pe
        self.udma = UdmaSegment.attach(job_id, pe, readonly=False)
        self.heap = Segment(segment_name(job_id, f"heap{pe}"))
        self.hw32 = self.udma.hw32
        self.tp_base = int(self.udma.header["tp_base"])
        self.rings = {}
        self.remote_slots = remote_slots
        self.sent = np.zeros(len(remote_slots), np.uint32)  # next BB to send, per remote slot
        self.flight = {int(q): collections.deque() for q in remote_slots}
        self.flight_bytes = dict.fromkeys(self.flight, 0)
        self.broken = dict.fromkeys(self.flight, False)  # a failure stopped sending this queue
        self.reported = dict.fromkeys(self.flight, False)  # its failure is in the record (state 1) ...
        self.epoch = dict.fromkeys(self.flight, 0)  # ... and once a quiet reported it (state 0 again), a new epoch
        self.seg_mv = memoryview(self.udma.segment.mm)  # the UDMA segment and heap as bytes (fast slices)
        self.heap_mv = memoryview(self.heap.mm)
        self.sq_offset, self.sq_bytes, self.depth = self.udma.sq_offset, self.udma.sq_bytes, self.udma.sq_depth
        self.u32, self.u64 = self.seg_mv.cast("I"), self.seg_mv.cast("Q")  # the segment as words (ints, fast)
        self.hw_word = self.udma.hw_offset // 4
        self.cq_word, self.cq_words, self.cq_depth = self.udma.cq_offset // 4, self.udma.cq_bytes // 4, \
            self.udma.cq_depth
        self.by_pos = {int(q): {} for q in remote_slots}
        self.cq_rings: dict[int, np.ndarray] = {}  # queue -> BB position -> its entry in flight
        self.amo_va = self.udma.va(pe, self.udma.amo_offset)
        self.amo_len = 64 * self.udma.n_slots
        self.heap_va = HEAP_VA_BASE + pe * HEAP_VA_STRIDE
        self.job_id = job_id
        self.pid = pid
        self.locals = None  # the PE's registrations of local arrays (registry.SharedLocals), once it has any
        self.local_words = None

    def ring(self, q: int) -> np.ndarray:
        r = self.rings.get(q)
        if r is None:
            r = self.rings[q] = self.udma.sq_ring(q)
        return r

    def resolve(self, va: int, length: int):
        """(segment bytes, offset) of a local range of this PE (its heap or amo scratch), (None, process
        address) of a registered local array of its process, or None when the range is not registered."""
        if self.heap_va <= va and va - self.heap_va + length <= self.heap.size:
            return self.heap_mv, va - self.heap_va
        if self.amo_va <= va and va - self.amo_va + length <= self.amo_len:
            return self.seg_mv, self.udma.amo_offset + va - self.amo_va
        if self.locals is None:
            try:
                self.locals = Segment(segment_name(self.job_id, f"locals{self.pe}"))
            except FileNotFoundError:
                return None
            self.local_words = self.locals.view("<u8", 0, (2 + 3 * SharedLocals.MAX,))
        addr = SharedLocals.lookup(self.local_words, va, length)
        return None if addr is None else (None, addr)

    def read_local(self, local, length: int) -> bytes:
        seg, off = local
        if seg is not None:
            return seg[off:off + length].tobytes()
        return _process_vm(self.pid, off, length, None)

    def wqe(self, q: int, pos: int, bbs: int) -> bytes:
        """The WQE at BB ``pos`` of SQ ``q``, unwrapped into 128 bytes."""
        ring = self.sq_offset + q * self.sq_bytes
        mask = self.depth - 1
        first = ring + 64 * (pos & mask)
        if bbs == 1:
            return self.seg_mv[first:first + 64].tobytes() + bytes(64)
        second = ring + 64 * ((pos + 1) & mask)
        return self.seg_mv[first:first + 64].tobytes() + self.seg_mv[second:second + 64].tobytes()

    def opcode_at(self, q: int, pos: int) -> int:
        return self.seg_mv[self.sq_offset + q * self.sq_bytes + 64 * (pos & (self.depth - 1)) + 5]

    def write_local(self, local, data) -> None:
        seg, off = local
        if seg is not None:
            seg[off:off + len(data)] = data
        else:
            _process_vm(self.pid, off, len(data), bytes(data))

    def close(self) -> None:
        self.rings.clear()
        self.cq_rings.clear()
        self.u32.release()
        self.u64.release()
        self.seg_mv.release()
        self.heap_mv.release()
        if self.locals is not None:
            self.local_words = None
            self.locals.close()
        self.udma.close()
        self.heap.close()


class Nic:
    """The NIC of this host (see the module docstring). ``comm``: an mpi4py communicator of one rank per host,
    rank = host index."""

    def __init__(self, job_id: str, hosts: HostMap, ctl: Control, comm: Any, heap_size: int, chaos: int | None = None):
        self.job_id = job_id
        self.hosts = hosts
        self.ctl = ctl
        self.comm = comm
        self.heap_size = heap_size
        self.n_pes = hosts.n_pes
        self.me = hosts.index
        self.local_pes = list(hosts.pes())
        self.pes: dict[int, _LocalPe] = {}
        self.qp_num = 0
        self.shipped = {p: 0 for p in self.local_pes}  # barrier arrivals of each local PE sent to the others
        self.pending_arrivals: list[tuple[int, int]] = []  # (barrier number, pe) not yet counted here
        self.pending_team: list[tuple[int, int, int, int]] = []  # (slot, uid, number, pe) of team barriers
        self.team_shipped = {p: np.zeros((MAX_TEAMS, 2), np.int64) for p in self.local_pes}  # (uid, count)
        self.team_base: dict[tuple[int, int], int] = {}  # (slot, uid) -> the slot's generation when first seen
        self.target_broken: dict[tuple[int, int], int] = {}  # (src pe, queue) -> the epoch it failed in here
        self.sends: list = []
        self.outbox: dict[int, list] = collections.defaultdict(list)  # host -> request pieces
        self.outdata: dict[int, list] = collections.defaultdict(list)  # host -> payloads sent apart, in order
        self.heard = {h: time.monotonic() for h in range(hosts.n_hosts) if h != self.me}
        self.failure: str | None = None  # why the job must end (a host died or aborted)
        self.noticed: float | None = None  # when mpiexec reported a process of the job gone (``notice``)
        self.stopping = False
        self.meet = True
        self.abort_reason: str | None = None  # to tell the other hosts (abort)
        self._aborted = False
        self.stats = collections.Counter()
        self._thread: threading.Thread | None = None
        self._last_beat = 0.0
        self._heaps: dict[int, Segment] = {}
        # --chaos SEED: the network's share of the seeded chaos (what the rules allow between hosts): queues
        # held back for a while, queues served in a drawn order (different QPs are unordered), and batches
        # that a target host takes late (a source's batches stay in order: each queue stays in order)
        self.chaos = random.Random((chaos << 8) ^ hosts.index) if chaos is not None else None
        self.held: dict[tuple[int, int], float] = {}  # (pe, queue) -> held until
        self.late: dict[int, collections.deque] = collections.defaultdict(collections.deque)  # src -> batches
        self._heap_mvs: dict[int, memoryview] = {}
        self._idents: dict[int, tuple] = {}

    # --- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name=f"shmemx-nic-host{self.me}", daemon=True)
        self._thread.start()

    def stop(self, meet: bool = True) -> None:
        """Stop once every host stopped (a non-blocking barrier of the NICs, serving meanwhile); ``meet=False``:
        at once (this host is failing)."""
        self.meet = meet
        self.stopping = True
        if self._thread is not None:
            # a NIC stuck in MPI on a host that died (a blocking receive of its payload) must not keep this
            # launcher from cleaning up: it is a daemon thread, left behind after a bounded wait
            self._thread.join(MEET_TIMEOUT + 5 if meet else _LAST_WORDS + 0.25)
            self._thread = None

    def abort(self, reason: str) -> None:
        """Tell every other host that this one ends the job (sent by the NIC thread: it alone calls MPI)."""
        self.abort_reason = reason

    def _main(self) -> None:
        last_work = time.monotonic()
        nap = 0.0
        try:
            while True:
                if self.abort_reason is not None and not self._aborted:
                    self._aborted = True
                    data = bytes([CTL_ABORT]) + self.abort_reason.encode()[:400]
                    for h in self.heard:
                        self._send(h, TAG_CTL, data)
                busy = self._poll_network()
                busy |= self._scan_barriers()
                busy |= self._scan_queues()
                self._flush_outbox()
                self._reap_sends()
                now = time.monotonic()
                if now - self._last_beat > HEARTBEAT:
                    self._beat(now)
                if self.stopping and (self._drained() or not self.meet):
                    break
                if self.failure is not None and not self.stopping:
                    time.sleep(0.01)
                    continue
                # spin (yielding the core) while work is under way and for SPIN_AFTER after it, then nap longer
                # and longer up to NAP_MAX: MPI offers no wake-up that a doorbell in shared memory could join
                if busy or self.sends or self._in_flight():
                    last_work, nap = now, 0.0
                    continue
                if now - last_work < SPIN_AFTER:
                    os.sched_yield()
                else:
                    nap = min(NAP_MAX, nap * 2 or 20e-6)
                    time.sleep(nap)
            self._finish()
        except BaseException as exc:  # the NIC must never die silently: the job ends, saying why
            self.failure = self.failure or f"host {self.me}: NIC failed: {type(exc).__name__}: {exc}"
            import traceback
            traceback.print_exc()

    def _in_flight(self) -> bool:
        if self.held or any(self.late.values()):
            return True
        return any(lp.by_pos[q] for lp in self.pes.values() for q in lp.by_pos)

    def _drained(self) -> bool:
        return not self.sends and not any(self.outbox.values())

    def _finish(self) -> None:
        end = time.monotonic() + _LAST_WORDS  # a failing host's last words (abort) get this long to leave
        while not self.meet and self.sends and time.monotonic() < end:
            self._reap_sends()
            time.sleep(0.001)
        req = self.comm.Ibarrier() if self.meet else None
        give_up = time.monotonic() + MEET_TIMEOUT
        while req is not None and not req.Test():
            if time.monotonic() > give_up:  # a host that never comes: its launcher reports it, if it lives
                self.failure = self.failure or f"host {self.me}: the other hosts did not finish within {MEET_TIMEOUT:g} s"
                return
            self._poll_network()
            self._reap_sends()
            now = time.monotonic()
            if now - self._last_beat > HEARTBEAT:
                self._beat(now)
            if self.failure is not None:
                return
            time.sleep(0.0005)
        for mv in self._heap_mvs.values():
            mv.release()
        for lp in self.pes.values():
            lp.close()
        for pe, seg in self._heaps.items():
            if pe not in self.pes:
                seg.close()

    def _beat(self, now: float) -> None:
        self._last_beat = now
        self.check_heard(now)
        for h in self.heard:
            self._send(h, TAG_CTL, bytes([CTL_BEAT]))

    def check_heard(self, now: float | None = None) -> str | None:
        """``failure``, set first if a host has been silent for ``DEAD_AFTER`` seconds (the one heard from least
        recently is named). The NIC calls it with its heartbeats and the launcher's main thread calls it too
        (``HostPart.failure``): a send to a dead host can keep the NIC thread inside MPI (its TCP provider
        retries the connection), and the job must still end."""
        if self.failure is None and self.heard:
            now = time.monotonic() if now is None else now
            h = min(self.heard, key=self.heard.__getitem__)
            silent = now - self.heard[h]
            told = self.noticed is not None
            if silent > (NOTICED_DEAD_AFTER if told else DEAD_AFTER) and self.failure is None:
                self.failure = (f"host {h} ({self._host_name(h)}) stopped answering for {silent:.1f} s"
                                + (" after mpiexec reported a process of the job gone: its launcher died" if told
                                   else ": its launcher died or hangs"))
        return self.failure

    def notice(self) -> None:
        """mpiexec reported that a process of the job (a host's launcher) ended without finalizing MPI: from now
        on a host silent for ``NOTICED_DEAD_AFTER`` seconds is the one (called from a signal handler)."""
        self.noticed = time.monotonic()

    def _host_name(self, h: int) -> str:
        pes = self.hosts.pes(h)
        return f"pes {pes.start}..{pes.stop - 1}"

    # --- MPI -----------------------------------------------------------------------------------------------

    def _send(self, host: int, tag: int, data) -> None:
        buf = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        self.sends.append((self.comm.Isend([buf, len(buf), _byte()], dest=host, tag=tag), buf))

    def _reap_sends(self) -> None:
        if self.sends:
            self.sends = [s for s in self.sends if not s[0].Test()]

    def _poll_network(self) -> bool:
        from mpi4py import MPI
        busy = False
        for src, batches in self.late.items():  # --chaos: batches taken late, in their order
            while batches and batches[0][0] <= time.monotonic():
                _, kind, buf = batches.popleft()
                self._take_batch(src, kind, buf)
                busy = True
        status = MPI.Status()
        for _ in range(64):
            got = False
            for tag in (TAG_BATCH, TAG_CTL):  # never TAG_DATA: a payload sent apart is taken by its batch
                if not self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
                    continue
                got = busy = True
                src, n = status.Get_source(), status.Get_count(MPI.BYTE)
                buf = bytearray(n)
                self.comm.Recv([buf, n, MPI.BYTE], source=src, tag=tag)
                self.heard[src] = time.monotonic()
                if tag == TAG_CTL:
                    self._control(src, buf)
                    continue
                kind, body = bytes(buf[:1]), memoryview(buf)[1:]
                if self.chaos is not None and (self.late[src] or (kind == TAG_REQ and self.chaos.random() < 0.3)):
                    # (a reply waits behind a late batch of its host too: the payloads sent apart keep one order)
                    self.late[src].append((time.monotonic() + self.chaos.uniform(0, CHAOS_HOLD), kind, body))
                    continue
                self._take_batch(src, kind, body)
            if not got:
                break
        return busy

    def _take_batch(self, src: int, kind: bytes, body: memoryview) -> None:
        if kind == TAG_REQ:
            self._serve(src, body)
        else:
            self._complete(body, src)

    # --- barriers (the control plane) ----------------------------------------------------------------------

    def _scan_barriers(self) -> bool:
        busy = False
        for p in self.local_pes:
            row = self.ctl.pes[p]
            n = int(row["barriers"])
            while self.shipped[p] < n:
                self.shipped[p] += 1
                data = struct.pack("<BiQ", CTL_ARRIVE, p, self.shipped[p]) + self._row_bytes(p) + self._table_bytes()
                for h in self.heard:
                    self._send(h, TAG_CTL, data)
                busy = True
            busy |= self._scan_team_barriers(p, row)
        if self.pending_arrivals:
            busy |= self._count_arrivals()
        if self.pending_team:
            busy |= self._count_team_arrivals()
        return busy

    def _scan_team_barriers(self, p: int, row) -> bool:
        """Ship PE ``p``'s arrivals at barriers of teams with members on other hosts (to those hosts)."""
        counts = row["team_barriers"]
        seen = self.team_shipped[p]
        changed = np.flatnonzero(counts != seen[:, 1])
        if not len(changed):
            return False
        teams, relayed = self.ctl.teams, row["team_relayed"]
        for slot in changed.tolist():
            uid, now = int(teams[slot]["uid"]), int(counts[slot])
            first = int(seen[slot, 1]) + 1 if int(seen[slot, 0]) == uid and now > int(seen[slot, 1]) else 1
            seen[slot] = (uid, now)
            hosts = self._team_hosts(slot)
            for number in range(first, now + 1) if hosts else ():
                data = (struct.pack("<BiIIQ", CTL_TEAM, p, slot, uid, number) + self._row_bytes(p)
                        + self._table_bytes())
                for h in hosts:
                    self._send(h, TAG_CTL, data)
            relayed[slot] = uid << 32 | now  # (api.teams waits for it before the counter is reset or released)
        return True

    def _team_hosts(self, slot: int) -> list[int]:
        """The other hosts with members of the team in ``slot``."""
        e = self.ctl.teams[slot]
        start, stride, size = int(e["start"]), int(e["stride"]), int(e["size"])
        found = {self.hosts.host_of(start + i * stride) for i in range(size)} if size > 0 else set()
        return sorted(found - {self.me})

    def _table_bytes(self) -> bytes:
        """The team table rows this host writes (``_merge_table``), nonzero ones only: (slot u16, 56 bytes)."""
        t = self.ctl.segment.bytes[self.ctl.teams_offset:self.ctl.teams_offset + 64 * MAX_TEAMS].reshape(-1, 64)
        live = np.flatnonzero(t[:, 8:].any(axis=1))
        out = [struct.pack("<H", len(live))]
        for slot in live.tolist():
            out.append(struct.pack("<H", slot) + t[slot, 8:].tobytes())
        return b"".join(out)

    def _merge_table(self, src: int, buf, off: int) -> None:
        """Take host ``src``'s writes of the team table: the identity (id, shape) of the slots it claims
        (``slot_host``) and the collective mailbox of the teams its PEs lead (team pe 0 on ``src``)."""
        (n,) = struct.unpack_from("<H", buf, off)
        off += 2
        teams = self.ctl.segment.bytes[self.ctl.teams_offset:self.ctl.teams_offset + 64 * MAX_TEAMS].reshape(-1, 64)
        for _ in range(n):
            (slot,) = struct.unpack_from("<H", buf, off)
            row = np.frombuffer(buf, np.uint8, 56, off + 2)
            off += 58
            if slot_host(slot, self.hosts.n_hosts) == src:
                teams[slot, 8:24] = row[0:16]  # uid, size, start, stride
            start = int(np.frombuffer(row[8:12].tobytes(), "<i4")[0])
            if 0 <= start < self.n_pes and self.hosts.host_of(start) == src:
                teams[slot, 24:64] = row[16:56]  # coll_seq, coll_op, coll_args, coll_result, coll_bad, released
                if slot_host(slot, self.hosts.n_hosts) == self.me:  # the leader there released a slot claimed here
                    released_elsewhere(self.ctl, slot, int(self.ctl.teams[slot]["released"]))

    def _count_team_arrivals(self) -> bool:
        """Add the team arrivals whose slot holds their team here and whose previous barrier completed here."""
        ctl = self.ctl
        later, counted = [], False
        for slot, uid, number, pe in self.pending_team:
            e = ctl.teams[slot]
            if int(e["uid"]) != uid:
                later.append((slot, uid, number, pe))
                continue
            gen_addr, count_addr = ctl.team_addr(slot, "gen"), ctl.team_addr(slot, "count")
            base = self.team_base.setdefault((slot, uid), atomics.load_u32(gen_addr))
            done = (atomics.load_u32(gen_addr) - base) & 0xFFFFFFFF
            if number - 1 > done:
                later.append((slot, uid, number, pe))
                continue
            counted = True
            if atomics.fetch_add_u32(count_addr, 1) == int(e["size"]) - 1:
                ctl.u32[(count_addr - ctl.segment.addr) // 4] = 0
                atomics.fetch_add_u32(gen_addr, 1)
                futex_wake(gen_addr)
        self.pending_team = later
        return counted

    def _row_bytes(self, pe: int) -> bytes:
        off = HEADER_SIZE + pe * PE_STRIDE
        return bytes(self.ctl.segment.bytes[off:off + PE_STRIDE])

    def _control(self, src: int, buf: bytearray) -> None:
        kind = buf[0]
        if kind == CTL_ARRIVE:
            _, pe, number = struct.unpack_from("<BiQ", buf, 0)
            self._take_row(src, pe, buf, struct.calcsize("<BiQ"))
            self.pending_arrivals.append((number, pe))
            self._count_arrivals()
        elif kind == CTL_TEAM:
            _, pe, slot, uid, number = struct.unpack_from("<BiIIQ", buf, 0)
            self._take_row(src, pe, buf, struct.calcsize("<BiIIQ"))
            self.pending_team.append((slot, uid, number, pe))
            self._count_team_arrivals()
        elif kind == CTL_ABORT:
            if self.failure is None:
                self.failure = f"host {src} ({self._host_name(src)}) ended the job: {bytes(buf[1:]).decode()}"

    def _take_row(self, src: int, pe: int, buf, off: int) -> None:
        """An arrival's PE row (its identity, allocations, waits, barrier counts) and its host's team table."""
        at = HEADER_SIZE + pe * PE_STRIDE
        self.ctl.segment.bytes[at:at + PE_STRIDE] = np.frombuffer(buf, np.uint8, PE_STRIDE, off)
        self._merge_table(src, buf, off + PE_STRIDE)

    def _count_arrivals(self) -> bool:
        """Add the arrivals whose barrier this host has reached (its previous barrier completed) to its counter."""
        ctl = self.ctl
        count_addr, gen_addr = ctl.header_addr("barrier_count"), ctl.header_addr("barrier_gen")
        done = atomics.load_u32(gen_addr)
        later, counted = [], False
        for number, pe in self.pending_arrivals:
            if number - 1 > done:
                later.append((number, pe))
                continue
            counted = True
            if atomics.fetch_add_u32(count_addr, 1) == self.n_pes - 1:
                ctl.u32[(count_addr - ctl.segment.addr) // 4] = 0
                atomics.fetch_add_u32(gen_addr, 1)
                futex_wake(gen_addr)
                done += 1
        self.pending_arrivals = later
        return counted

    # --- the initiator's side ------------------------------------------------------------------------------

    def _attach(self) -> None:
        for p in self.local_pes:
            if p not in self.pes and int(self.ctl.pes[p]["status"]) == PeStatus.READY:
                qp_num = int(self.ctl.pes[p]["qp_num"])
                self.qp_num = qp_num
                slots = np.array([peer * qp_num + k for peer in range(self.n_pes) if not self.hosts.local(peer)
                                  for k in range(qp_num)], np.int64)
                self.pes[p] = _LocalPe(self.job_id, p, int(self.ctl.pes[p]["pid"]), slots)

    def _scan_queues(self) -> bool:
        if len(self.pes) < len(self.local_pes):
            self._attach()
        busy = False
        for lp in self.pes.values():
            db = lp.hw32[lp.remote_slots, HW_SQ_DB]
            ready = np.flatnonzero(db != lp.sent).tolist()
            if self.chaos is not None:
                ready = self._chaos_pick(lp, ready)
            for i in ready:
                busy |= self._send_queue(lp, i, int(db[i]))
        return busy

    def _chaos_pick(self, lp: _LocalPe, ready: list[int]) -> list[int]:
        """--chaos: the rung queues in a drawn order, some of them held back up to CHAOS_HOLD seconds."""
        rng, now, picked = self.chaos, time.monotonic(), []
        for i in ready:
            key = (lp.pe, i)
            until = self.held.get(key)
            if until is None and rng.random() < 0.3:
                until = self.held[key] = now + rng.uniform(0, CHAOS_HOLD)
            if until is not None and now < until:
                continue
            self.held.pop(key, None)
            picked.append(i)
        rng.shuffle(picked)
        return picked

    def _send_queue(self, lp: _LocalPe, i: int, db: int) -> bool:
        q = int(lp.remote_slots[i])
        pos = int(lp.sent[i])
        flight = lp.flight[q]
        depth = lp.depth
        sent_any = False
        while pos != db and lp.flight_bytes[q] < MAX_INFLIGHT_BYTES:
            if (db - pos) & 0xFFFFFFFF > depth:  # a corrupted doorbell: the queue fails, its WQEs are dropped
                wqe = lp.wqe(q, pos, 1)
                flight.append(_Entry(pos, 1, _opcode(wqe), _flag(wqe), _eid(wqe), None, 0,
                                     (_S.ENGINE_FAULT, Where.DOORBELL, 0, 0, b"")))
                lp.broken[q] = True
                pos = db
                break
            ran = self._send_run(lp, q, pos, db)
            if ran:
                pos = (pos + ran) & 0xFFFFFFFF
                sent_any = True
                continue
            bbs = 2 if lp.opcode_at(q, pos) in _TWO_BB else 1
            if (db - pos) & 0xFFFFFFFF < bbs:
                break
            wqe = lp.wqe(q, pos, bbs)
            self._send_wqe(lp, q, pos, bbs, wqe)
            pos = (pos + bbs) & 0xFFFFFFFF
            sent_any = True
        lp.sent[i] = pos
        self._retire(lp, q)
        return sent_any

    def _send_wqe(self, lp: _LocalPe, q: int, pos: int, bbs: int, wqe: bytes) -> None:
        """Check the initiator's side of a WQE and send it (or complete it at once when it fails here)."""
        if lp.reported[q] and not lp.u32[lp.hw_word + 16 * q + HW_STATE]:  # a quiet reported the failure: the queue runs again
            lp.broken[q] = lp.reported[q] = False
            lp.epoch[q] += 1
        opcode, flag = _opcode(wqe), _flag(wqe)
        eid = _eid(wqe)
        entry = _Entry(pos, bbs, opcode, flag, eid, None, 0)
        lp.flight[q].append(entry)
        lp.by_pos[q][pos] = entry
        if lp.broken[q]:
            entry.result = (_S.FLUSHED, Where.NONE, 0, 0, b"")
            return
        fault, target, local, length = self._initiator_checks(lp, wqe, opcode, flag)
        if fault is not None:
            entry.result = (fault[0], fault[1], 0, 0, b"")
            lp.broken[q] = True
            return
        entry.local, entry.length = local, length
        if target is None:  # NOP: nothing to carry; it completes in order with the rest
            entry.result = (0, 0, 0, 0, b"")
            return
        payload = b""
        writes = opcode in (Opcode.WRITE, Opcode.WRITE_WITH_NOTIFY)
        lp.flight_bytes[q] += (length if writes else 0) + length
        if writes and length >= LARGE and target != self.me:  # sent from where it lies (no copy when shared)
            seg, off = local
            self.outdata[target].append(seg[off:off + length] if seg is not None else lp.read_local(local, length))
            self.outbox[target].append(_REQ.pack(lp.pe, q, pos, APART, lp.epoch[q]) + wqe)
            return
        if writes:
            payload = lp.read_local(local, length)
        self.outbox[target].append(_REQ.pack(lp.pe, q, pos, len(payload), lp.epoch[q]) + wqe + payload)

    def _send_run(self, lp: _LocalPe, q: int, pos: int, db: int) -> int:
        """Send the plain small WRITEs from this PE's heap at ``pos`` (at least RUN_MIN of them, every initiator
        check passing, one target host) as one run; the number sent (0: none, the WQE-by-WQE path goes on)."""
        m = min((db - pos) & 0xFFFFFFFF, RUN_MAX)
        if m < RUN_MIN or lp.broken[q] or (lp.reported[q] and not lp.u32[lp.hw_word + 16 * q + HW_STATE]):
            return 0
        if lp.opcode_at(q, pos) != Opcode.WRITE:
            return 0
        slots = (pos + np.arange(m, dtype=np.int64)) & (lp.depth - 1)
        rows = lp.ring(q)[slots].view("<u4")  # [m, 16] first BBs
        q64 = rows.view("<u8")
        dw0, dw1, tpw = rows[:, 0], rows[:, 1], rows[:, 2]
        eid_lo = q64[:, 2]
        pe = eid_lo & 0xFFFFFFFF
        length = rows[:, 12].astype(np.int64)
        lva = q64[:, 7].astype(np.int64) - lp.heap_va
        tp = (tpw & 0xFFFFFF).astype(np.int64) - lp.tp_base
        target = int(pe[0]) if int(pe[0]) < self.n_pes else -1
        ok = (((dw1 >> 8) & 0xFF) == Opcode.WRITE) & (((dw0 >> 16) & REDUCE_FLAG) == 0) & ((tpw >> 24) == 1) \
            & (((dw0 >> 29) & 3) == REMOTE_JETTY_TYPE) & (pe == target) & (length < LARGE) & (lva >= 0) \
            & (lva + length <= lp.heap.size) & (tp >= 0) & (tp // max(self.qp_num, 1) == target)
        k = m if ok.all() else int(np.argmin(ok))
        if k < RUN_MIN or target < 0:
            return 0
        host = self.hosts.host_of(target)
        if host == self.me:
            return 0
        flags = ((dw0[:k] >> 16) & 0xFF).tolist()
        lens, offs = length[:k].tolist(), lva[:k].tolist()
        eids = (int(eid_lo[0]), int(q64[0, 3]))
        mv = lp.heap_mv
        run = _Run(pos, flags, lens, offs, eids, mv)
        lp.by_pos[q][pos] = run
        lp.flight[q].append(run)
        payload = b"".join([mv[o:o + n] for o, n in zip(offs, lens)])
        lp.flight_bytes[q] += 2 * len(payload)
        self.outbox[host].append(_REQ.pack(lp.pe, q, pos, RUN, lp.epoch[q]) + _RUN.pack(k, len(payload))
                                 + rows[:k].tobytes() + payload)
        self.stats["runs"] += 1
        return k

    def _initiator_checks(self, lp: _LocalPe, wqe: bytes, opcode: int, flag: int):
        """(fault or None, target host or None, local (bytes, offset) or None, length): the engine's checks of
        the initiator's side (opcode, shape, EID's PE, TP, length, local range)."""
        if opcode not in _KNOWN:
            return (_S.BAD_OPCODE, Where.OPCODE), None, None, 0
        if opcode == Opcode.NOP:
            return None, None, None, 0
        w = _HDR32.unpack_from(wqe, 0)
        if (w[2] >> 24) != 1 or ((w[0] >> 29) & 3) != REMOTE_JETTY_TYPE:
            return (_S.BAD_OPCODE, Where.MALFORMED), None, None, 0
        eid_lo = struct.unpack_from("<Q", wqe, 16)[0]
        pe = eid_lo & 0xFFFFFFFF
        if pe >= self.n_pes:
            return (_S.BAD_EID, Where.EID), None, None, 0
        tp = (w[2] & 0xFFFFFF) - lp.tp_base
        if tp < 0 or tp >= self.n_pes * self.qp_num or tp // self.qp_num != pe:
            return (_S.BAD_TP, Where.TP), None, None, 0
        notify = opcode == Opcode.WRITE_WITH_NOTIFY
        if notify:
            length, _, lva = struct.unpack_from("<IIQ", wqe, NOTIFY_SGE_OFFSET)
        else:
            length, _, lva = struct.unpack_from("<IIQ", wqe, 48)
        if length > MAX_MSG_BYTES:
            return (_S.LENGTH_TOO_LARGE, Where.LENGTH), None, None, 0
        local = lp.resolve(lva, length)
        if local is None:
            return (_S.LOCAL_ACCESS, Where.LOCAL), None, None, 0
        return None, self.hosts.host_of(pe), local, length

    def _flush_outbox(self) -> None:
        for host, pieces in self.outbox.items():
            if pieces:
                data = b"".join(pieces)
                pieces.clear()
                if host == self.me:
                    self._serve(host, memoryview(data))
                else:
                    self._send(host, TAG_BATCH, TAG_REQ + data)
                    self._send_data(host)
                    self.stats["req_msgs"] += 1

    def _send_data(self, host: int) -> None:
        """The payloads sent apart (``APART``), after the batch that announced them, in its order."""
        for part in self.outdata.pop(host, ()):
            self.sends.append((self.comm.Isend([part, len(part), _byte()], dest=host, tag=TAG_DATA), part))

    def _receive_into(self, src: int, target) -> None:
        """Receive the next payload sent apart by host ``src`` into ``target`` (a writable buffer)."""
        from mpi4py import MPI
        self.comm.Recv([target, len(target), MPI.BYTE], source=src, tag=TAG_DATA)

    def _complete(self, buf: memoryview, src: int | None = None) -> None:
        """Replies of a target host: record each WQE's result, retire what completes in order."""
        off, touched = 0, set()
        while off < len(buf):
            pe, q, pos, status, where, byte_cnt, data, n = _REP.unpack_from(buf, off)
            off += _REP.size
            lp = self.pes[pe]
            entry = lp.by_pos[q].get(pos)
            if entry is None:  # a WQE inside a run that failed at the target: its reply, WQE by WQE
                entry = next((r for r in lp.flight[q] if isinstance(r, _Run) and r.covers(pos)), None)
            if n == RUN:  # every WQE of the run at pos passed
                entry.set_all_ok()
                touched.add((pe, q))
                continue
            if isinstance(entry, _Run):
                entry.set(pos, (status, where, byte_cnt, data, buf[off:off + n]))
                off += n
                touched.add((pe, q))
                continue
            if n == APART:  # a large READ's data: straight into its destination when that is shared memory
                seg, loff = entry.local
                if seg is not None:
                    self._receive_into(src, seg[loff:loff + byte_cnt])
                    payload = b""
                else:
                    payload = bytearray(byte_cnt)
                    self._receive_into(src, payload)
            else:
                payload = buf[off:off + n]
                off += n
            if entry is not None and entry.result is None:
                entry.result = (status, where, byte_cnt, data, payload)
            touched.add((pe, q))
        for pe, q in touched:
            self._retire(self.pes[pe], q)

    def _retire(self, lp: _LocalPe, q: int) -> None:
        """Complete the queue's WQEs whose results are in, in SQ order: local effects, CQE, consumer index."""
        flight = lp.flight[q]
        if not flight or flight[0].result is None:
            return
        u32, u64 = lp.u32, lp.u64
        hw = lp.hw_word + 16 * q  # this queue's engine record, as u32 word indices into the segment
        ci = u32[hw + HW_CI]
        by_pos = lp.by_pos[q]
        executed = nbytes = 0
        while flight and flight[0].result is not None:
            e = flight.popleft()
            if isinstance(e, _Run):
                by_pos.pop(e.pos, None)
                if e.all_ok:  # every WQE executed: their completions at once
                    ci = (e.pos + e.k) & 0xFFFFFFFF
                    executed += e.k
                    nbytes += sum(e.lens)
                    lp.flight_bytes[q] -= 2 * sum(e.lens)
                    self._write_run_cqes(lp, q, e)
                    continue
                flight.extendleft(reversed(e.entries()))  # WQE by WQE, with the failure where it happened
                continue
            by_pos.pop(e.pos, None)
            status, where, byte_cnt, data, payload = e.result
            writes = e.opcode == Opcode.WRITE or e.opcode == Opcode.WRITE_WITH_NOTIFY
            lp.flight_bytes[q] -= (e.length if writes else 0) + e.length
            if status == 0 and e.local is not None and not writes:
                if e.opcode == Opcode.READ and len(payload):
                    lp.write_local(e.local, payload)
                elif e.opcode in (Opcode.FAA, Opcode.CAS):
                    lp.write_local(e.local, struct.pack("<Q", data)[:e.length])
            failed = status != 0 and status != _S.FLUSHED
            if failed:
                self._fail_record(lp, q, e, status, where)
            elif status == 0:
                executed += 1
                nbytes += byte_cnt
            if e.flag & _CQE_FLAG:
                self._write_cqe(lp, q, e, status, byte_cnt, data)
            ci = (e.pos + e.bbs) & 0xFFFFFFFF
            if failed:
                u32[hw + HW_STATE] = 1  # after the CQE: a barrier that sees the failure also finds its CQE
                lp.broken[q] = lp.reported[q] = True
        if executed:
            u64[hw // 2 + HW_EXECUTED] += executed
            u64[hw // 2 + HW_BYTES] += nbytes
        u32[hw + HW_CI] = ci
        self.ctl.wake(lp.pe)

    def _write_run_cqes(self, lp: _LocalPe, q: int, run: _Run) -> None:
        """The CQEs of a run whose every WQE succeeded (those that asked for one), as _write_cqe writes them."""
        want = np.flatnonzero(np.asarray(run.flags, np.uint32) & _CQE_FLAG)
        c = len(want)
        if not c:
            return
        u32, hw = lp.u32, lp.hw_word + 16 * q
        pi, depth = u32[hw + HW_CQ_PI], lp.cq_depth
        ring = lp.cq_rings.get(q)
        if ring is None:
            ring = lp.cq_rings[q] = lp.udma.cq_ring(q).view("<u4")
        pos = (run.pos + want) & 0xFFFFFFFF
        rows = np.zeros((c, 16), np.uint32)
        rows[:, C_ENTRY_IDX] = (pos + 1) & 0xFFFF
        rows[:, C_TPN] = (lp.tp_base + q) & 0xFFFFFF
        rows[:, C_BYTE_CNT] = np.asarray(run.lens, np.uint32)[want]
        rows[:, C_USER_DATA] = pos
        lo, hi = run.eid
        rows[:, C_EID:C_EID + 4] = [lo & 0xFFFFFFFF, lo >> 32, hi & 0xFFFFFFFF, hi >> 32]
        cq_pos = pi + np.arange(c, dtype=np.int64)
        slots = cq_pos % depth
        ring[slots, 1:] = rows[:, 1:]  # words 1-15 (word 0, C_STATUS, still the old lap's) ...
        owner = ((cq_pos // depth) & 1) ^ 1
        ring[slots, C_STATUS] = (owner << OWNER_SHIFT) | ((Opcode.WRITE & 7) << 4)  # ... then the status words
        u32[hw + HW_CQ_PI] = (pi + c) & 0xFFFFFFFF

    def _fail_record(self, lp: _LocalPe, q: int, e: _Entry, status: int, where: int) -> None:
        u32, hw = lp.u32, lp.hw_word + 16 * q
        if u32[hw + HW_STATE] == 0:
            u32[hw + HW_ERR_STATUS], u32[hw + HW_ERR_SUBSTATUS], u32[hw + HW_ERR_POS] = status, 0, e.pos
            u32[hw + HW_ERR_WHERE], u32[hw + HW_ERR_ARG] = where, 0

    def _write_cqe(self, lp: _LocalPe, q: int, e: _Entry, status: int, byte_cnt: int, data: int) -> None:
        """The engine's CQE (write_cqe in _engine.c): words 1-15, then word 0 (owner bit, status) last."""
        u32, hw = lp.u32, lp.hw_word + 16 * q
        pi = u32[hw + HW_CQ_PI]
        depth = lp.cq_depth
        row = lp.cq_word + q * lp.cq_words + 16 * (pi % depth)
        lo, hi = e.eid
        u32[row + C_ENTRY_IDX] = (e.pos + e.bbs) & 0xFFFF
        u32[row + C_TPN] = (lp.tp_base + q) & 0xFFFFFF
        u32[row + C_BYTE_CNT] = byte_cnt & 0xFFFFFFFF
        u32[row + C_USER_DATA] = e.pos & 0xFFFFFFFF
        u32[row + C_EID], u32[row + C_EID + 1] = lo & 0xFFFFFFFF, lo >> 32
        u32[row + C_EID + 2], u32[row + C_EID + 3] = hi & 0xFFFFFFFF, hi >> 32
        u32[row + C_DATA], u32[row + C_DATA + 1] = data & 0xFFFFFFFF, (data >> 32) & 0xFFFFFFFF
        for k in _CQE_ZERO:
            u32[row + k] = 0
        owner = ((pi // depth) & 1) ^ 1
        u32[row + C_STATUS] = owner << OWNER_SHIFT | (e.opcode & 7) << 4 | (status & 0xFF) << 24
        u32[hw + HW_CQ_PI] = (pi + 1) & 0xFFFFFFFF

    # --- the target's side ---------------------------------------------------------------------------------

    def _heap(self, pe: int) -> Segment:
        seg = self._heaps.get(pe)
        if seg is None:
            lp = self.pes.get(pe)
            seg = self._heaps[pe] = lp.heap if lp is not None else Segment(segment_name(self.job_id, f"heap{pe}"))
        return seg

    def _serve(self, src: int, buf: memoryview) -> None:
        """Execute a batch of WQEs of host ``src``'s PEs on this host's PEs, in order; answer in one message."""
        off, out, touched, apart = 0, [], set(), []
        while off < len(buf):
            pe, q, pos, n, epoch = _REQ.unpack_from(buf, off)
            off += _REQ.size
            if n == RUN:
                off = self._serve_run(buf, off, pe, q, pos, epoch, out, touched)
                continue
            wqe = bytes(buf[off:off + 128])
            off += 128
            if n == APART:
                payload = _Incoming(self, src)
            else:
                payload = buf[off:off + n]
                off += n
            if self.target_broken.get((pe, q), -1) == epoch:  # the queue failed in this epoch: flush
                status, where, byte_cnt, data, reply, target = _S.FLUSHED, 0, 0, 0, b"", None
            else:
                status, where, byte_cnt, data, reply, target = self._execute(wqe, payload)
            if n == APART:
                payload.drain()  # a payload nothing took (a failed check): received and dropped
            if status:
                self.target_broken[(pe, q)] = epoch
            elif target is not None:
                touched.add(target)
            if len(reply) >= LARGE and src != self.me:
                out.append(_REP.pack(pe, q, pos, status, where, byte_cnt, data, APART))
                apart.append(reply)
            else:
                out.append(_REP.pack(pe, q, pos, status, where, byte_cnt, data, len(reply)) + reply)
        for t in touched:
            self.ctl.wake(t)
        data = b"".join(out)
        if src == self.me:
            self._complete(memoryview(data), src)
        else:
            self._send(src, TAG_BATCH, TAG_REP + data)
            self.outdata[src] = apart
            self._send_data(src)

    def _serve_run(self, buf: memoryview, off: int, pe: int, q: int, pos: int, epoch: int, out: list,
                   touched: set) -> int:
        """Execute a run of plain WRITEs: checked at once (EID, tokenId, token value, bounds) and stored, one
        reply record for the run; WQE by WQE (the engine's path, per-WQE replies) when one fails a check."""
        k, total = _RUN.unpack_from(buf, off)
        off += _RUN.size
        rows = np.frombuffer(buf, "<u4", 16 * k, off).reshape(k, 16)
        off += 64 * k
        payload = buf[off:off + total]
        off += total
        q64 = rows.view("<u8")
        dst = int(q64[0, 2]) & 0xFFFFFFFF
        lens = rows[:, 12].astype(np.int64)
        broken = self.target_broken.get((pe, q), -1) == epoch
        ok = not broken and dst < self.n_pes and self.hosts.local(dst)
        if ok:
            lo, hi, tid, token = self._identity(dst)
            base = HEAP_VA_BASE + dst * HEAP_VA_STRIDE
            rva = q64[:, 5].astype(np.int64) - base
            ok = bool(((q64[:, 2] == lo) & (q64[:, 3] == hi) & ((rows[:, 3] & 0xFFFFF) == tid) & (rows[:, 8] == token)
                       & (rva >= 0) & (rva + lens <= self.heap_size)).all())
        if ok:
            heap = self._heap(dst)
            mv = self._heap_mvs.get(dst)
            if mv is None:
                mv = self._heap_mvs[dst] = memoryview(heap.mm)
            at = 0
            for o, n in zip(rva.tolist(), lens.tolist()):
                mv[o:o + n] = payload[at:at + n]
                at += n
            touched.add(dst)
            out.append(_REP.pack(pe, q, pos, 0, 0, k, 0, RUN))
            return off
        at = 0
        for j, n in enumerate(lens.tolist()):  # the engine's path, WQE by WQE, for the exact failure
            p = (pos + j) & 0xFFFFFFFF
            if self.target_broken.get((pe, q), -1) == epoch:
                out.append(_REP.pack(pe, q, p, _S.FLUSHED, 0, 0, 0, 0))
            else:
                status, where, byte_cnt, data, reply, target = self._execute(rows[j].tobytes() + bytes(64),
                                                                             payload[at:at + n])
                if status:
                    self.target_broken[(pe, q)] = epoch
                elif target is not None:
                    touched.add(target)
                out.append(_REP.pack(pe, q, p, status, where, byte_cnt, data, 0))
            at += n
        return off

    def _identity(self, pe: int) -> tuple[int, int, int, int]:
        """(EID low, EID high, heap tokenId, token value) of a PE of this host (published at its init)."""
        ident = self._idents.get(pe)
        if ident is None:
            row = self.ctl.pes[pe]
            lo, hi = (int(x) for x in row["eid"])
            ident = (lo, hi, int(row["heap_tid"]), int(row["heap_token"]))
            if lo or hi:
                self._idents[pe] = ident
        return ident

    def _segment_check(self, pe: int, tid: int, token: int, va: int, length: int, where: Where):
        _, _, heap_tid, heap_token = self._identity(pe)
        if tid != heap_tid:
            return _S.BAD_TOKEN_ID, where
        if token != heap_token:
            return _S.TOKEN_MISMATCH, where
        base = HEAP_VA_BASE + pe * HEAP_VA_STRIDE
        if not (va >= base and length <= self.heap_size and va - base <= self.heap_size - length):
            return _S.REMOTE_OUT_OF_BOUNDS, where
        return None

    def _execute(self, wqe: bytes, payload: memoryview):
        """(status, where, byte count, data, read bytes, target pe) of one WQE executed on this host."""
        opcode, flag = _opcode(wqe), _flag(wqe)
        eid_lo, eid_hi = struct.unpack_from("<QQ", wqe, 16)
        pe = eid_lo & 0xFFFFFFFF
        if pe >= self.n_pes or not self.hosts.local(pe) or self._identity(pe)[:2] != (eid_lo, eid_hi):
            return _S.BAD_EID, Where.EID, 0, 0, b"", None
        w = _HDR32.unpack_from(wqe, 0)
        rva = struct.unpack_from("<Q", wqe, 40)[0]
        notify = opcode == Opcode.WRITE_WITH_NOTIFY
        length = struct.unpack_from("<I", wqe, NOTIFY_SGE_OFFSET if notify else 48)[0]
        fault = self._segment_check(pe, w[3] & 0xFFFFF, w[8], rva, length, Where.REMOTE)
        if fault:
            return fault[0], fault[1], 0, 0, b"", None
        heap = self._heap(pe)
        mv = self._heap_mvs.get(pe)
        if mv is None:
            mv = self._heap_mvs[pe] = memoryview(heap.mm)
        off = rva - (HEAP_VA_BASE + pe * HEAP_VA_STRIDE)
        if notify:
            q0, sva, value = struct.unpack_from("<QQQ", wqe, NOTIFY_CTX_OFFSET)
            fault = self._segment_check(pe, q0 & 0xFFFFF, q0 >> 32, sva, 8, Where.SIGNAL)
            if fault:
                return fault[0], fault[1], 0, 0, b"", None
            if sva % 8:
                return _S.BAD_ATOMIC, Where.SIGNAL_ALIGN, 0, 0, b"", None
            _store(mv, off, length, payload)
            soff = sva - (HEAP_VA_BASE + pe * HEAP_VA_STRIDE)
            atomics.exchange(heap.addr + soff, value, 8)
            return 0, 0, length, 0, b"", pe
        if opcode == Opcode.READ:
            return 0, 0, length, 0, mv[off:off + length] if length >= LARGE else mv[off:off + length].tobytes(), pe
        atomic = opcode in (Opcode.FAA, Opcode.CAS) or (flag & REDUCE_FLAG)
        if atomic:
            if length not in (4, 8) or rva % length:
                return _S.BAD_ATOMIC, Where.ATOMIC_SIZE, 0, 0, b"", None
        if opcode == Opcode.WRITE and flag & REDUCE_FLAG:
            ra = w[9]
            if ((ra >> 8) & 0xF) != _FP32 or ((ra >> 12) & 0xF) != _REDUCE_ADD or length != 4:
                return _S.BAD_ATOMIC, Where.REDUCE, 0, 0, b"", None
            operand = struct.unpack("<f", bytes(payload[:4]))[0]
            return 0, 0, 4, _fp32_add(heap.addr + off, operand), b"", pe
        if opcode == Opcode.WRITE:
            if length in (4, 8) and off % length == 0:  # an aligned word (signal_op's SET): one atomic store
                atomics.exchange(heap.addr + off, int.from_bytes(payload, "little"), length)
            else:
                _store(mv, off, length, payload)
            return 0, 0, length, 0, b"", pe
        fmt = "<Q" if length == 8 else "<I"
        operand = struct.unpack_from(fmt, wqe, AMO_OPERAND_OFFSET)[0]
        if opcode == Opcode.FAA:
            old = atomics.fetch_op("add", heap.addr + off, operand, length)
        else:
            compare = struct.unpack_from(fmt, wqe, AMO_OPERAND_OFFSET + length)[0]
            old = atomics.compare_exchange(heap.addr + off, compare, operand, length)
        return 0, 0, length, old & ((1 << 8 * length) - 1), b"", pe


class _Incoming:
    """A payload sent apart (``APART``): received where the WQE stores it, or dropped when it fails."""

    def __init__(self, nic: Nic, src: int):
        self.nic, self.src, self.taken = nic, src, False

    def into(self, target) -> None:
        self.taken = True
        self.nic._receive_into(self.src, target)

    def drain(self) -> None:
        if not self.taken:
            from mpi4py import MPI
            status = MPI.Status()
            self.nic.comm.Probe(source=self.src, tag=TAG_DATA, status=status)
            self.into(bytearray(status.Get_count(MPI.BYTE)))


def _store(mv: memoryview, off: int, length: int, payload) -> None:
    if isinstance(payload, _Incoming):
        payload.into(mv[off:off + length])
    else:
        mv[off:off + length] = payload


def _fp32_add(addr: int, operand: float) -> int:
    """Atomically add ``operand`` to the float32 at ``addr``; the old bits."""
    old = atomics.load_u32(addr)
    while True:
        f = struct.unpack("<f", struct.pack("<I", old))[0]
        new = struct.unpack("<I", struct.pack("<f", np.float32(np.float64(f) + operand)))[0]
        seen = atomics.compare_exchange(addr, old, new, 4)
        if seen == old:
            return old
        old = seen


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)


def _process_vm(pid: int, addr: int, length: int, data: bytes | None) -> bytes:
    """Read ``length`` bytes at ``addr`` of process ``pid`` (``data`` None), or write ``data`` there: the NIC's
    DMA into the memory a rank registered (process_vm_readv / writev; the launcher is the ranks' parent)."""
    buf = ctypes.create_string_buffer(data if data is not None else length, length)
    local = _Iovec(ctypes.cast(buf, ctypes.c_void_p), length)
    remote = _Iovec(addr, length)
    call = _libc.process_vm_readv if data is None else _libc.process_vm_writev
    done = call(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if done != length:
        err = ctypes.get_errno()
        raise OSError(err, f"process_vm of pid {pid} at {addr:#x} ({length} B): {os.strerror(err)}")
    return buf.raw


def _opcode(wqe: bytes) -> int:
    return wqe[5]


def _flag(wqe: bytes) -> int:
    return wqe[2]


def _eid(wqe: bytes) -> tuple[int, int]:
    return struct.unpack_from("<QQ", wqe, 16)


def _byte():
    from mpi4py import MPI
    return MPI.BYTE

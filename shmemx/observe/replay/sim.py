"""The discrete-event simulation of a recorded job in virtual time (microseconds).

One event queue, ordered by (time, insertion number): the simulation itself is deterministic, so the order of
equal times is too. What each part does:

* **Threads** (a PE's main thread and its AIV blocks) run their recorded operations in order at their own clock,
  never ahead of the earliest pending event. A post costs ``post_us`` per WQE and ``doorbell_us`` per doorbell;
  its WQEs become ready at the doorbell. ``compute`` annotations add their time. A wait blocks until the words
  it watches meet its condition (``memory``); a quiet until the CQEs it waits for; a barrier until its
  dissemination pattern completes; ``sync_all`` and a launch's join until every block arrived.
* **Engines**, one per PE: a WQE takes ``wqe_us`` of the engine (``intra_wqe_us`` to a rank of its server);
  queues are FIFO and served round-robin among those whose head is ready. A fenced WQE waits until every earlier WQE of its queue was acknowledged.
* **The network** (``network``): the WQE's transfer from its sender's egress to its target's ingress;
  ``landed`` when the last byte arrived: signals and atomics apply then, the CQE is one latency later (a
  READ's CQE at the arrival of its data, which left the peer one latency after the request).
* **MTE copies** (direct copies to a PE of the server, NVLink stores) cost their thread ``post_us`` each and go
  through the intra ports like a WQE without the engine; the thread goes on, and its ``aclshmemx_mte_quiet`` (or a
  barrier, its ``sync_all``, its block's end) waits until the last of its copies landed. (A format /1 recording
  has no quiets: each of its copies blocks its thread until it landed.)
* **SDMA copies** go on their thread's SDMA channel (one per block, FIFO): each costs the thread ``post_us +
  doorbell_us``, waits for the channel (the copy before it), takes the channel ``intra_wqe_us`` per SQE of at
  most 1 MiB (no public SDMA figure: the engine's per-WQE time, an assumption), then goes through the intra
  ports; ``aclshmemx_sdma_quiet`` waits until the thread's last SDMA copy landed. Nothing else waits for them.
* **Small control messages** (``signal_op`` stores, barrier rounds) cost the sender ``post_us + doorbell_us``
  and arrive ``wqe_us + latency`` later, without taking port time.

Every WQE (and control message, MTE copy) has a record (``w_*`` lists by id) of its times and of what held it
(engine, ports, fence), and every thread a list of releases, from which ``critical`` walks the critical path.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Callable

import numpy as np

from ...shm.control import WaitCall
from ...udma.layout import Opcode
from ..record import Ev
from .collectives import Collectives
from .memory import Memory
from .network import Fcfs, MaxMin
from .program import Program
from .topology import Topology

__all__ = ["Sim", "SimError"]

M32 = 0xFFFF_FFFF
W_WQE, W_READ, W_SIGNAL, W_MTE, W_SDMA = 0, 1, 2, 3, 4  # what a record is
SDMA_SQE_BYTES = 1 << 20
_WRITES = frozenset({Opcode.WRITE, Opcode.WRITE_WITH_NOTIFY})


class SimError(Exception):
    """The recording cannot be replayed (it is inconsistent, or the model deadlocks)."""


class Copies:
    """A thread's copies of one engine ("mte" or "sdma") that its quiet waits for."""

    __slots__ = ("pending", "done", "gid")

    def __init__(self):
        self.pending = 0  # copies issued whose landing time is not known yet (non-blocking copies)
        self.done, self.gid = 0.0, -1  # the latest landing among those known, and its copy


class Thread:
    __slots__ = ("pe", "slot", "ops", "pc", "clock", "blocked", "releases", "regions", "syncs", "end", "computes",
                 "blocked_since", "copies", "sdma_free", "sdma_last")

    def __init__(self, pe: int, slot: int, ops: list):
        self.pe, self.slot, self.ops = pe, slot, ops
        self.pc = 0
        self.clock = 0.0
        self.blocked = None  # what the thread waits for, while it does
        self.blocked_since = 0.0
        self.releases: list[tuple] = []  # (release time, blocked since, cause)
        self.regions: list[tuple] = []  # open regions: (name id, enter time)
        self.syncs: dict[int, int] = {}  # launch id -> sync_all calls so far
        self.end: float | None = None
        self.computes: list[tuple] = []  # (start, end) of compute annotations
        self.copies = {"mte": Copies(), "sdma": Copies()}  # its MTE copies, its SDMA channel's
        self.sdma_free, self.sdma_last = 0.0, -1  # when the channel takes its next SQE, and the copy before it

    def __repr__(self) -> str:
        return f"pe {self.pe} block {self.slot}"


class Queue:
    __slots__ = ("pe", "index", "peer", "qp", "tier", "pending", "cqe_posted", "cqe_times", "known", "prefix",
                 "waiters", "unacked", "ack_max", "ack_gid", "fence_wait")

    def __init__(self, pe: int, index: int, qp_num: int, tier: int):
        self.pe, self.index, self.tier = pe, index, tier
        self.peer, self.qp = divmod(index, qp_num)
        self.pending: deque[int] = deque()
        self.cqe_posted = 0
        self.cqe_times: list = []  # per CQE-producing WQE, in posting order: (ack time, id) once known
        self.known = 0  # leading entries of cqe_times known
        self.prefix: list[tuple] = []  # running max of cqe_times: (time, id)
        self.waiters: list[tuple] = []  # (thread, target)
        self.unacked = 0  # WQEs the engine started whose acknowledgement time is not known yet
        self.ack_max, self.ack_gid = 0.0, -1
        self.fence_wait = False


class Engine:
    __slots__ = ("pe", "queues", "active", "last", "busy", "wake_at", "version", "last_gid", "free_at")

    def __init__(self, pe: int):
        self.pe = pe
        self.queues: dict[int, Queue] = {}
        self.active: list[int] = []  # sorted indices of queues with pending WQEs
        self.last = -1
        self.busy = False
        self.wake_at: float | None = None
        self.version = 0
        self.last_gid = -1
        self.free_at = 0.0


class Sim(Collectives):
    """Replays ``prog`` on ``topo``; ``run()`` then read the results off the object (``report`` does)."""

    def __init__(self, prog: Program, topo: Topology):
        self.prog, self.topo = prog, topo
        self.n_pes = n = prog.n_pes
        self.bw = [topo.intra.bytes_per_us, topo.inter.bytes_per_us]
        self.lat = [topo.intra.latency_us, topo.inter.latency_us]
        self.wqe = list(topo.engine_us)  # engine time per WQE, by tier
        self.rps = topo.ranks_per_server
        self.events: list = []
        self.seq = 0
        self.n_events = 0
        self.now = 0.0
        self.engines = [Engine(pe) for pe in range(n)]
        self.mem = Memory(n)
        self.net = MaxMin(self) if topo.sharing == "maxmin" else Fcfs(self)
        self.warnings: dict[str, list] = {}  # kind -> [count, first example]
        self.threads = [{slot: Thread(pe, slot, ops) for slot, ops in prog.threads[pe].items()} for pe in range(n)]
        self.barriers: dict[int, list] = {}
        self.launches: dict[tuple, dict] = {}
        self.region_iv: list[dict[int, list]] = [{} for _ in range(n)]
        self.end = [0.0] * n
        self._handler = [None] * (max(Ev) + 1)
        for kind, fn in self._handlers.items():
            self._handler[kind] = fn
        self._init_records()

    # --- records of WQEs and other transfers ----------------------------------------------------------------

    def _init_records(self) -> None:
        prog = self.prog
        self.base = np.cumsum([0] + [len(w) for w in prog.wqes]).tolist()
        total = self.base[-1]
        for name in ("w_ready", "w_s", "w_T", "w_x", "w_arr", "w_done", "w_ack"):
            setattr(self, name, [0.0] * total)
        for name in ("w_pred_eng", "w_pred_egr", "w_pred_ing", "w_pred_fence", "w_cqe"):
            setattr(self, name, [-1] * total)
        self.w_kind, self.w_src, self.w_dst, self.w_tier, self.w_bytes = [], [], [], [], []
        self.w_pe, self.w_queue, self.w_poster, self.w_fence, self.w_effect = [], [], [], [], []
        watched = {pe: arr.tolist() for pe, arr in prog.watched.items()}
        self.watched = watched
        for pe, wq in enumerate(prog.wqes):
            n = len(wq)
            read = wq.opcode == Opcode.READ
            peer = wq.peer
            self.w_kind += np.where(read, W_READ, W_WQE).tolist()
            self.w_src += np.where(read, peer, pe).tolist()
            self.w_dst += np.where(read, pe, peer).tolist()
            self.w_tier += (peer // self.rps != pe // self.rps).astype(np.int64).tolist()
            self.w_bytes += wq.nbytes.tolist()
            self.w_pe += [pe] * n
            self.w_queue += [None] * n
            self.w_poster += [None] * n
            self.w_fence += (wq.flag >> 3 & 1).tolist()
            effects = [None] * n
            payloads = prog.payloads[pe]
            for i in np.flatnonzero(self._may_touch(pe, wq)).tolist():
                effects[i] = self._effect(pe, int(wq.opcode[i]), int(peer[i]), int(wq.nbytes[i]),
                                          int(wq.offset[i]), int(wq.local[i]), int(wq.sig_offset[i]),
                                          int(wq.value[i]), int(wq.compare[i]), payloads.get(i))
            self.w_effect += effects

    def _may_touch(self, pe: int, wq) -> np.ndarray:
        """Which WQEs may change a watched word: notify signals and atomics, and payloads over a watched word."""
        out = (wq.opcode == Opcode.WRITE_WITH_NOTIFY) | (wq.opcode == Opcode.FAA) | (wq.opcode == Opcode.CAS)
        read = wq.opcode == Opcode.READ
        where = np.where(read, pe, wq.peer)
        start = np.where(read, wq.local, wq.offset)
        for target, words in self.prog.watched.items():
            sel = (where == target) & (start >= 0)
            if sel.any():
                lo = np.searchsorted(words, start[sel] - 7)
                hi = np.searchsorted(words, start[sel] + wq.nbytes[sel])
                out[np.flatnonzero(sel)[hi > lo]] = True
        return out

    def _effect(self, pe, op, peer, nbytes, off, local, sig, value, compare, data):
        """What a WQE does to watched memory when it lands, in order, or None (``data``: its payload's bytes
        when they were recorded, a small payload)."""
        effects = []
        if op in _WRITES or op == Opcode.READ:
            where, start = (pe, local) if op == Opcode.READ else (peer, off)
            if data is not None and op in _WRITES and start >= 0:
                effects.append(("bytes", where, start, data))
            elif start >= 0 and self.watched.get(where):  # (a reduce WRITE adds floats: an unknown value too)
                w = self.watched[where]
                i = bisect.bisect_left(w, start - 7)
                if i < len(w) and w[i] < start + nbytes:
                    effects.append(("cover", where, start, start + nbytes))
        if op == Opcode.WRITE_WITH_NOTIFY and sig >= 0:  # the signal after the payload
            effects.append(("set", peer, sig, 8, value))
        elif op == Opcode.FAA and off >= 0:
            effects.append(("add", peer, off, nbytes or 8, value))
        elif op == Opcode.CAS and off >= 0:
            effects.append(("cas", peer, off, nbytes or 8, compare, value))
        return effects or None

    def _tier(self, a: int, b: int) -> int:
        return 0 if a // self.rps == b // self.rps else 1

    def _new_record(self, kind: int, pe: int, src: int, dst: int, nbytes: int, effect) -> int:
        gid = len(self.w_kind)
        for name in ("w_ready", "w_s", "w_T", "w_x", "w_arr", "w_done", "w_ack"):
            getattr(self, name).append(0.0)
        for name in ("w_pred_eng", "w_pred_egr", "w_pred_ing", "w_pred_fence", "w_cqe"):
            getattr(self, name).append(-1)
        self.w_kind.append(kind)
        self.w_src.append(src)
        self.w_dst.append(dst)
        self.w_tier.append(self._tier(src, dst))
        self.w_bytes.append(nbytes)
        self.w_pe.append(pe)
        self.w_queue.append(None)
        self.w_poster.append(None)
        self.w_fence.append(0)
        self.w_effect.append(effect)
        return gid

    # --- the event queue ---------------------------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., object], arg: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn, arg))

    def run(self) -> None:
        for pe in range(self.n_pes):
            for slot, th in self.threads[pe].items():
                if slot == 0 or not th.ops or th.ops[0][0] != Ev.BLOCK:
                    self.at(0.0, self._thread_event, th)
                else:
                    th.blocked = ("launch", th.ops[0][1])
        events = self.events
        while True:
            while events:
                t, _, fn, arg = heapq.heappop(events)
                self.now = t
                self.n_events += 1
                fn(arg, t)
            if not self._unblock_stuck():
                break
        stuck = [th for pe in self.threads for th in pe.values() if th.end is None]
        if stuck:
            what = "; ".join(f"{th} at op {th.pc} ({th.blocked})" for th in stuck[:6])
            raise SimError(f"the replay deadlocked: {len(stuck)} thread(s) never finished: {what}")
        for pe in range(self.n_pes):
            self.end[pe] = max(th.end for th in self.threads[pe].values())

    def warn(self, kind: str, text: str) -> None:
        entry = self.warnings.get(kind)
        if entry is None:
            self.warnings[kind] = [1, text]
        else:
            entry[0] += 1

    # --- threads -----------------------------------------------------------------------------------------

    def _thread_event(self, th: Thread, t: float) -> None:
        self._run(th)

    def _resume(self, th: Thread, t: float, cause=None) -> None:
        """Release a blocked thread at ``t`` (it then runs from its next operation)."""
        th.releases.append((max(th.clock, t), th.blocked_since, cause))
        th.clock = max(th.clock, t)
        th.blocked = None
        th.pc += 1
        self._run(th)

    def _resume_event(self, arg, t: float) -> None:
        th, cause = arg
        self._resume(th, t, cause)

    def _block(self, th: Thread, what) -> bool:
        th.blocked = what
        th.blocked_since = th.clock
        return False

    def _run(self, th: Thread) -> None:
        ops = th.ops
        events = self.events
        handlers = self._handler
        while th.pc < len(ops):
            if events and th.clock > events[0][0]:
                self.at(th.clock, self._thread_event, th)
                return
            op = ops[th.pc]
            if not handlers[op[0]](self, th, op):
                return  # blocked: whoever releases it calls _resume
            th.pc += 1
        if th.end is None:
            th.end = th.clock

    def _op_post(self, th: Thread, op) -> bool:
        _, qindex, first, end = op
        topo = self.topo
        th.clock += (end - first) * topo.post_us + topo.doorbell_us
        eng = self.engines[th.pe]
        q = eng.queues.get(qindex)
        if q is None:
            q = eng.queues[qindex] = Queue(th.pe, qindex, self.prog.qp_num, self._tier(th.pe, qindex // self.prog.qp_num))
        base = self.base[th.pe]
        wq = self.prog.wqes[th.pe]
        cqe_flags = wq.flag[first:end].tolist()
        ready = th.clock
        if not q.pending and not q.fence_wait:
            bisect.insort(eng.active, qindex)
        for i in range(first, end):
            gid = base + i
            self.w_ready[gid] = ready
            self.w_queue[gid] = q
            self.w_poster[gid] = th
            if cqe_flags[i - first] & 0x20:
                self.w_cqe[gid] = q.cqe_posted
                q.cqe_posted += 1
                q.cqe_times.append(None)
            q.pending.append(gid)
        if not eng.busy:
            self._wake_engine(eng, ready)
        return True

    def _op_quiet(self, th: Thread, op) -> bool:
        _, qindex, target, _call = op
        q = self.engines[th.pe].queues.get(qindex)
        if q is None:
            return True  # nothing was ever posted to that queue
        need = q.cqe_posted - ((q.cqe_posted - target) & M32)  # the recorded 32-bit count, unwrapped
        if need <= 0:
            return True
        if q.known >= need:
            t, gid = q.prefix[need - 1]
            if t > th.clock:
                self._block(th, ("quiet", qindex))
                self.at(t, self._resume_event, (th, ("ack", gid)))
                return False
            return True
        q.waiters.append((th, need))
        return self._block(th, ("quiet", qindex))

    def _op_wait(self, th: Thread, op) -> bool:
        w = self.prog.words[op[1]]
        ok, result, unknown = self.mem.met(w)
        if w.test:
            recorded = w.result >= 0 if w.call == WaitCall.WAIT_UNTIL_ANY else w.result > 0
            if ok != recorded:
                self.warn("test", f"pe {th.pe} block {th.slot}: a test {'met' if recorded else 'failed'} in the "
                                  f"recorded run but {'met' if ok else 'failed'} at its virtual time "
                                  f"{th.clock:.3f} us (a poll whose iterations depended on host timing; a test "
                                  f"the run saw met waits until it is met in virtual time)")
            if ok or not recorded:
                return True
        elif ok:
            self._check_result(th, w, result, unknown)
            return True
        self.mem.watch(w, th)
        return self._block(th, ("wait", op[1]))

    def _check_result(self, th: Thread, w, result: int, unknown: bool) -> None:
        if unknown:
            self.warn("unknown", f"pe {th.pe} block {th.slot}: a wait on pe {w.pe} heap +{w.offsets[0]:#x} was met "
                                 f"by a payload write whose value is not recorded (released at its arrival)")
        elif w.call in (WaitCall.SIGNAL_WAIT_UNTIL, WaitCall.WAIT_UNTIL_ANY, WaitCall.WAIT_UNTIL_SOME) \
                and not w.test and result != w.result:
            self.warn("result", f"pe {th.pe} block {th.slot}: {WaitCall(w.call).name.lower()} returned "
                                f"{w.result} in the recorded run but {result} in virtual time (control flow that "
                                f"depended on host timing; the replay follows the recorded one)")

    def wake_words(self, pe: int, keys: list, t: float, gid: int) -> None:
        waiting = self.mem.waiters[pe]
        for key in keys:
            for th in list(waiting.get(key, ())):
                if th.blocked is None or th.blocked[0] != "wait":
                    continue
                w = self.prog.words[th.blocked[1]]
                ok, result, unknown = self.mem.met(w)
                if ok:
                    self.mem.unwatch(w, th)
                    if not w.test:
                        self._check_result(th, w, result, unknown)
                    self._block_released(th)
                    self.at(t, self._resume_event, (th, ("wqe", gid)))

    def _block_released(self, th: Thread) -> None:
        th.blocked = ("released",)

    def _op_signal(self, th: Thread, op) -> bool:
        _, pe, offset, code, sig_op, value = op
        topo = self.topo
        size = code & 0xFF
        effect = [("add" if sig_op else "set", pe, offset, size, value & ((1 << 8 * size) - 1))]
        gid = self._new_record(W_SIGNAL, th.pe, th.pe, pe, 0, effect)
        self.w_poster[gid] = th
        if pe == th.pe:
            th.clock += topo.post_us
            t = th.clock
            self._stamp(gid, t)
        else:
            th.clock += topo.post_us + topo.doorbell_us
            t = th.clock
            self.w_ready[gid] = self.w_s[gid] = t
            tier = self.w_tier[gid]
            self.w_T[gid] = self.w_x[gid] = t + self.wqe[tier]
            self.w_arr[gid] = self.w_done[gid] = self.w_ack[gid] = t + self.wqe[tier] + self.lat[tier]
        self.at(self.w_done[gid], self._deliver, gid)
        return True

    def _copy(self, th: Thread, op) -> tuple:
        """An MTE or SDMA copy's (pe, offset, nbytes, put, effect): a put into watched memory carries its bytes
        (or, unrecorded, the range it covers) as the effect its delivery applies; None otherwise."""
        pe, offset, nbytes, put = op[1:5]
        data = op[5] if len(op) > 5 else None
        effect = None
        if put and self.watched.get(pe):
            effect = [("bytes", pe, offset, data) if data is not None else ("cover", pe, offset, offset + nbytes)]
        return pe, offset, nbytes, put, effect

    def _stamp(self, gid: int, t: float) -> None:
        """Every time of record ``gid`` (ready, start, executed, arrived, done, acknowledged) at ``t``: a local
        operation, complete as it is issued."""
        for name in ("w_ready", "w_s", "w_T", "w_x", "w_arr", "w_done", "w_ack"):
            getattr(self, name)[gid] = t

    def _op_mte(self, th: Thread, op) -> bool:
        pe, offset, nbytes, put, effect = self._copy(th, op)
        if pe == th.pe:  # a local copy: free (annotate it with compute when it matters), visible at once
            if effect:
                gid = self._new_record(W_MTE, th.pe, th.pe, pe, nbytes, effect)
                self.w_poster[gid] = th
                self._stamp(gid, th.clock)
                self._deliver(gid, th.clock)
            return True
        src, dst = (th.pe, pe) if put else (pe, th.pe)
        gid = self._new_record(W_MTE, th.pe, src, dst, nbytes, effect)
        self.w_poster[gid] = th
        th.clock += self.topo.post_us
        t = th.clock
        self.w_ready[gid] = self.w_s[gid] = self.w_T[gid] = t
        if put:
            self.at(t, self._send, gid)
        else:  # the request goes one latency ahead of the data
            self.at(t + self.lat[self.w_tier[gid]], self._send, gid)
        if self.prog.mte_nbi:  # issued: the thread goes on, the copy completes at its MTE_QUIET
            th.copies["mte"].pending += 1
            return True
        self._block(th, ("mte", gid))  # (a format /1 recording: no quiets recorded, each copy blocks)
        return False

    def _op_mte_quiet(self, th: Thread, op) -> bool:
        """``aclshmemx_mte_quiet``: until every MTE copy this thread issued has landed."""
        return self._quiet_copies(th, "mte")

    def _quiet_copies(self, th: Thread, kind: str) -> bool:
        """A quiet of the thread's ``kind`` copies ("mte" or "sdma"): blocked while some are pending
        (``_copy_landed`` releases it when the last one is known), then until the last one lands."""
        copies = th.copies[kind]
        if copies.pending:
            return self._block(th, (f"{kind}_quiet",))
        if copies.done > th.clock:
            self._block(th, (f"{kind}_quiet",))
            self.at(copies.done, self._resume_event, (th, (kind, copies.gid)))
            return False
        return True

    def _op_sdma(self, th: Thread, op) -> bool:
        """An SDMA copy on the thread's channel (see the module docstring); the thread goes on."""
        pe, offset, nbytes, put, effect = self._copy(th, op)
        src, dst = (th.pe, pe) if put else (pe, th.pe)
        gid = self._new_record(W_SDMA, th.pe, src, dst, nbytes, effect)
        self.w_poster[gid] = th
        th.clock += self.topo.post_us + self.topo.doorbell_us
        start = max(th.clock, th.sdma_free)
        if th.sdma_free > th.clock:
            self.w_pred_eng[gid] = th.sdma_last
        self.w_ready[gid], self.w_s[gid] = th.clock, start
        self.w_T[gid] = self.w_x[gid] = start + self.wqe[0] * max(1, -(-nbytes // SDMA_SQE_BYTES))
        th.sdma_free, th.sdma_last = self.w_T[gid], gid
        th.copies["sdma"].pending += 1
        if put:
            self.at(self.w_T[gid], self._send, gid)
        else:  # the read request goes one latency ahead of the data
            self.at(self.w_T[gid] + self.lat[self.w_tier[gid]], self._send, gid)
        return True

    def _op_sdma_quiet(self, th: Thread, op) -> bool:
        """``aclshmemx_sdma_quiet``: until every SDMA copy of this thread's channel has landed."""
        return self._quiet_copies(th, "sdma")

    def _op_sdma_notify(self, th: Thread, op) -> bool:
        """A notify record: the thread goes on (a host's wait for the notify is not modelled)."""
        th.clock += self.topo.post_us + self.topo.doorbell_us
        return True

    _handlers = {Ev.POST: _op_post, Ev.QUIET: _op_quiet, Ev.WAIT: _op_wait, Ev.TEST: _op_wait,
                 Ev.SIGNAL: _op_signal, Ev.MTE: _op_mte, Ev.MTE_QUIET: _op_mte_quiet,
                 Ev.SDMA: _op_sdma, Ev.SDMA_QUIET: _op_sdma_quiet, Ev.SDMA_NOTIFY: _op_sdma_notify,
                 Ev.BARRIER: Collectives._op_barrier,
                 Ev.REGION: Collectives._op_region, Ev.COMPUTE: Collectives._op_compute,
                 Ev.LAUNCH: Collectives._op_launch, Ev.BLOCK: Collectives._op_block, Ev.SYNC: Collectives._op_sync,
                 Ev.JOIN: Collectives._op_join}

    def _unblock_stuck(self) -> bool:
        """Nothing left to happen, yet threads wait: release the earliest wait that the modelled values never
        met (at the last write to its words), with a warning; False when there is none."""
        stuck = [th for pe in self.threads for th in pe.values() if th.blocked and th.blocked[0] == "wait"]
        if not stuck:
            return False
        th = min(stuck, key=lambda x: (x.clock, x.pe, x.slot))
        w = self.prog.words[th.blocked[1]]
        self.mem.unwatch(w, th)
        t = max(th.clock, self.mem.last_write_to(w))
        self.warn("never", f"pe {th.pe} block {th.slot}: a {WaitCall(w.call).name.lower()} on pe {w.pe} heap "
                           f"+{w.offsets[0]:#x} was never met by the modelled writes (the recorded run saw it met: "
                           f"a store the recording cannot see?); released at the last write to its words")
        self.at(t, self._resume_event, (th, ("never", None)))
        return True

    # --- engines -----------------------------------------------------------------------------------------

    def _wake_engine(self, eng: Engine, t: float) -> None:
        if eng.wake_at is not None and eng.wake_at <= t:
            return
        eng.wake_at = t
        eng.version += 1
        self.at(t, self._engine_event, (eng, eng.version))

    def _engine_event(self, arg, t: float) -> None:
        eng, version = arg
        if version != eng.version:
            return  # superseded by an earlier wake-up
        eng.wake_at = None
        if not eng.busy:  # (else the WQE it runs picks the next one when it is done)
            self._pick(eng, t)

    def _pick(self, eng: Engine, t: float) -> None:
        """Start the next WQE: round-robin over the queues whose head is ready (and not held by a fence)."""
        active = eng.active
        n = len(active)
        if not n:
            eng.busy = False
            return
        start = bisect.bisect_right(active, eng.last)
        later = None
        parked = None
        for k in range(n):
            qindex = active[(start + k) % n]
            q = eng.queues[qindex]
            gid = q.pending[0]
            ready = self.w_ready[gid]
            if ready > t:
                later = ready if later is None or ready < later else later
                continue
            if self.w_fence[gid] and (q.unacked or q.ack_max > t):
                # held by its fence: out of the round-robin until the queue's last acknowledgement (``landed``
                # puts it back), so that picks meanwhile do not scan it again and again
                q.fence_wait = True
                parked = (parked or []) + [qindex]
                if not q.unacked:
                    self.at(q.ack_max, self._unpark, q)
                continue
            self._park(eng, parked)
            self._start(eng, q, gid, t)
            return
        self._park(eng, parked)
        eng.busy = False
        if later is not None:
            self._wake_engine(eng, later)

    @staticmethod
    def _park(eng: Engine, parked: list | None) -> None:
        if parked:
            eng.active = [i for i in eng.active if i not in parked]

    def _unpark(self, q: Queue, t: float) -> None:
        """A fence-held queue's acknowledgements are all in by ``t``: back into the round-robin."""
        if not q.fence_wait:
            return
        q.fence_wait = False
        eng = self.engines[q.pe]
        bisect.insort(eng.active, q.index)
        if not eng.busy:
            self._wake_engine(eng, t)

    def _start(self, eng: Engine, q: Queue, gid: int, t: float) -> None:
        q.pending.popleft()
        if not q.pending:
            eng.active.remove(q.index)
        ready = self.w_ready[gid]
        if t > ready:  # held: by a fence (the queue's last acknowledgement), or by the engine's previous WQE
            if self.w_fence[gid] and q.ack_gid >= 0 and q.ack_max > ready and q.ack_max >= eng.free_at:
                self.w_pred_fence[gid] = q.ack_gid
            elif eng.last_gid >= 0:
                self.w_pred_eng[gid] = eng.last_gid
        self.w_s[gid] = t
        end = t + self.wqe[q.tier]
        self.w_T[gid] = end
        eng.last, eng.last_gid, eng.busy, eng.free_at = q.index, gid, True, end
        q.unacked += 1
        self.at(end, self._engine_done, gid)

    def _engine_done(self, gid: int, t: float) -> None:
        if self.w_kind[gid] == W_READ:
            self.at(t + self.lat[self.w_tier[gid]], self._send, gid)
        else:
            self.net.send(gid, t)
        eng = self.engines[self.w_pe[gid]]
        eng.busy = False
        self._pick(eng, t)

    def _send(self, gid: int, t: float) -> None:
        self.net.send(gid, t)

    # --- arrivals ----------------------------------------------------------------------------------------

    def landed(self, gid: int, done: float, now: float) -> None:
        """The network says: transfer ``gid``'s last byte arrives at ``done`` (called at ``now`` <= done)."""
        self.w_done[gid] = done
        kind = self.w_kind[gid]
        ack = done if kind != W_WQE else done + self.lat[self.w_tier[gid]]
        self.w_ack[gid] = ack
        if self.w_effect[gid] is not None:
            self.at(done, self._deliver, gid)
        if kind == W_MTE and not self.prog.mte_nbi:  # a format /1 recording: the copy blocked its thread
            self.at(done, self._resume_event, (self.w_poster[gid], ("mte", gid)))
            return
        if kind == W_MTE or kind == W_SDMA:
            self._copy_landed(self.w_poster[gid], "mte" if kind == W_MTE else "sdma", gid, done)
            return
        q = self.w_queue[gid]
        q.unacked -= 1
        if ack >= q.ack_max:
            q.ack_max, q.ack_gid = ack, gid
        k = self.w_cqe[gid]
        if k >= 0:
            q.cqe_times[k] = (ack, gid)
            self._advance_cqes(q, now)
        if q.fence_wait and not q.unacked:
            self.at(max(now, q.ack_max), self._unpark, q)

    def _copy_landed(self, th: Thread, kind: str, gid: int, done: float) -> None:
        """Copy ``gid`` of the thread's ``kind`` copies lands at ``done``: when it was the last one pending, a quiet
        of them blocked on it resumes once the latest of them landed."""
        copies = th.copies[kind]
        copies.pending -= 1
        if done >= copies.done:
            copies.done, copies.gid = done, gid
        if not copies.pending and th.blocked == (f"{kind}_quiet",):
            th.blocked = ("released",)
            self.at(max(copies.done, th.clock), self._resume_event, (th, (kind, copies.gid)))

    def _advance_cqes(self, q: Queue, now: float) -> None:
        times = q.cqe_times
        while q.known < len(times) and times[q.known] is not None:
            entry = times[q.known]
            if q.prefix and q.prefix[-1][0] > entry[0]:
                entry = q.prefix[-1]
            q.prefix.append(entry)
            q.known += 1
        if q.waiters:
            still = []
            for th, need in q.waiters:
                if q.known >= need:
                    t, gid = q.prefix[need - 1]
                    th.blocked = ("released",)
                    self.at(max(t, th.clock), self._resume_event, (th, ("ack", gid)))
                else:
                    still.append((th, need))
            q.waiters = still

    def _deliver(self, gid: int, t: float) -> None:
        """Apply a landed transfer's effects on watched memory and wake the waits they meet."""
        mem = self.mem
        for effect in self.w_effect[gid]:
            kind, pe = effect[0], effect[1]
            if kind == "set":
                keys = [mem.write(pe, effect[2], effect[3], effect[4], t)]
            elif kind == "add":
                keys = [mem.add(pe, effect[2], effect[3], effect[4], t)]
            elif kind == "cas":
                keys = [mem.cas(pe, effect[2], effect[3], effect[4], effect[5], t)]
            elif kind == "bytes":
                keys = mem.store(pe, effect[2], effect[3], t)
            else:
                keys = mem.cover(pe, effect[2], effect[3], self.watched.get(pe, []), t)
            self.wake_words(pe, keys, t, gid)

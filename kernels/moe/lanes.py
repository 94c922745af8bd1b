"""The lanes of a ``Buffer``: its (peer, QP) send queues, the addresses of every peer's workspace, and posting.

Payload goes through the raw WQE path (``shmemx.aclshmemx_udma_raw_queue``): a unit's WQEs are built in one
numpy operation, written into the SQ ring after one ``reserve`` and published with one doorbell. A unit that
closes its lane asks for one CQE, its completion's: the completion is fenced (below), so its CQE is written only
after every earlier WQE of the QP has executed, and the lane's quiet, which waits for it, covers them all; its
payload WQEs go without (flag 0x00: NO, no CQE), as a deferred batch's do, which spares the engine a CQE and
the quiet a CQE to consume per row (at 256 PEs about 4 of every 7 CQEs of a call, the CQ ring pages with them).
A unit that does not close its lane (rounds), or one longer than half its ring (the ring frees its WQEs only
at a CQE: ``RawQueue.post`` would find no room), gives every WQE its CQE
(``ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT``, flag 0x20).

The completion signal of a lane is one WRITE_WITH_NOTIFY (the lane's record, then the 64-bit signal SET to the
call's sequence number; what ``aclshmemx_udma_qp_put_signal_nbi`` posts), built in the closing unit's batch
after its payload WQEs and published by the same doorbell, with the op config ``FENCE_SO`` = {cqe 1, fence 1,
SO} (flag 0x2e). Why the fence: the payload WQEs are NO-ordered, and SO only waits for earlier RO/SO WQEs of the
QP; the fence waits for every earlier WQE of the QP, so the signal cannot land before a row of its lane (and the
earlier rounds of the lane were quieted before). Different QPs are not ordered
at all, hence one signal per (peer, QP), and the receiver waits for all of them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import shmemx

from .measure import BlockTimer, CallStats
from .peers import Peers
from .schedule import Plan
from .workspace import RECORD_WORD, SIGNAL_WORDS

__all__ = ["BlockRole", "Lanes", "FENCE_SO"]

FENCE_SO = shmemx.OpConfig(cqe=1, se=0, fence=1, odr=shmemx.ACLSHMEMX_UDMA_ODR_SO)
_FLAG = shmemx.ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT.flag
_NO_CQE = shmemx.OpConfig(cqe=0, se=0, fence=0, odr=shmemx.ACLSHMEMX_UDMA_ODR_NO).flag  # a closed unit's payload


class BlockRole(NamedTuple):
    """What one block of a dispatch or combine kernel does: ``c`` its index; ``solo``: it does every block's work
    (``Lanes.one_block``); ``one``: block 0 posts and waits for every block (``Lanes.one_poster``); ``timer`` its
    phase timer and ``t`` the timer's start mark."""

    c: int
    solo: bool
    one: bool
    timer: object
    t: float


class Lanes:
    """Send queues to every peer on QPs ``0..qp_num-1`` and the VA of the workspace on every PE.

    Args:
        block: this PE's workspace (the uint8 heap allocation).
        peers: the team the lanes join (``peers.Peers``): ``me`` and P are team ranks, ``peers.pe(s)`` the global
            PE of peer ``s`` (the argument of every call that reaches it).
        qp_num: QPs per peer the buffer may use.
        views, offsets: the workspace's regions (typed views of this PE's copy) and their byte offsets.
    """

    def __init__(self, block: np.ndarray, peers: Peers, qp_num: int, views: dict | None = None,
                 offsets: dict | None = None):
        self.views, self.offsets = views, offsets
        self.peers = peers
        self.me = me = peers.me
        self.n_pes = n_pes = peers.n_pes
        self.qp_num = qp_num
        self.block = block
        self.queues: dict[tuple[int, int], shmemx.RawQueue] = {}
        for peer in range(n_pes):
            if peer == me:
                continue
            for q in range(qp_num):
                try:
                    self.queues[peer, q] = shmemx.aclshmemx_udma_raw_queue(peers.pe(peer), q)
                except ValueError as exc:
                    raise ValueError(f"pe {me}: moe.Buffer(qp_num={qp_num}) needs {qp_num} QPs per peer: call "
                                     f"shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, {qp_num}) "
                                     f"before shmemx.init() ({exc})") from None
        order = sorted(self.queues)
        self.batch = shmemx.RawQueues([self.queues[k] for k in order])  # every lane, for posts of many at once
        self.lane_of = np.full((n_pes, qp_num), -1, np.intp)  # (peer, qp) -> its queue's index in ``batch``
        for i, (peer, q) in enumerate(order):
            self.lane_of[peer, q] = i
        self.split_blocks = False  # see ``one_block``: the Buffer's setting (``Buffer.split_blocks``)
        # a closing unit of at most this many BBs asks for its completion's CQE alone (see the module)
        self.one_cqe_bbs = min((q.depth for q in self.queues.values()), default=0) // 2
        # word 0 of a WRITE built with _FLAG, XOR this: the same WRITE with _NO_CQE (no queue: nothing is posted)
        q = next(iter(self.queues.values()), None)
        self.to_no_cqe = np.uint64(0) if q is None else \
            q.build_writes(rmt_va=0, sge_len=0, sge_va=0, flag=_FLAG)[0, 0] ^ \
            q.build_writes(rmt_va=0, sge_len=0, sge_va=0, flag=_NO_CQE)[0, 0]
        self.remote_base = np.zeros(n_pes, np.uint64)
        self.local_base = 0
        self.notify_keys: dict[tuple[int, int], tuple[int, int]] = {}  # (tokenId, token) of the peer's heap
        for (peer, q), queue in self.queues.items():
            info = queue.remote_mem_info
            self.notify_keys[peer, q] = (int(info["tid"]), int(info["rmt_token_value"]))
            if q == 0:
                self.remote_base[peer] = queue.remote_va(block)
                self.local_base = queue.local_va(block)

    def local_va(self, peer: int, qp: int, arr: np.ndarray) -> int:
        """VA of a local array (or of this PE's heap) as a WQE source on lane (peer, qp); pins a registration
        of a non-heap array for the WQEs of that lane."""
        return self.queues[peer, qp].local_va(arr)

    def post(self, peer: int, qp: int, rmt_va: np.ndarray, sge_va: np.ndarray, length: np.ndarray,
             close: tuple[int, int, int, int, int] | None = None, flag: int = _FLAG,
             close_flag: int = FENCE_SO.flag) -> int:
        """Post ``len(rmt_va)`` WRITEs (each with a CQE) on lane (peer, qp), and with ``close`` = (record VA on the
        peer, record VA here, record bytes, signal VA on the peer, value) the lane's completion after them: one
        ``post`` (one reserve, one write, one doorbell). ``flag`` / ``close_flag``: the op config flags of the
        WRITEs and of the completion (default NO, then the fenced SO completion). Returns the number of WQEs
        posted."""
        n = len(rmt_va)
        queue = self.queues[peer, qp]
        parts = []
        if n:
            parts.append(queue.build_writes(rmt_va=rmt_va, sge_len=length, sge_va=sge_va, flag=flag)
                         .view(np.uint8).reshape(-1))
        if close is not None:
            rmt, src, nbytes, sig, value = close
            tid, token = self.notify_keys[peer, qp]
            parts.append(np.frombuffer(queue.build(shmemx.Opcode.WRITE_WITH_NOTIFY, close_flag, rmt,
                                                   sge_len=nbytes, sge_va=src, notify_tid=tid, notify_token=token,
                                                   notify_va=sig, notify_value=value), np.uint8))
        if not parts:
            return 0
        data = np.concatenate(parts) if len(parts) > 1 else parts[0]
        wqes = n + (close is not None)
        queue.post(data, cqes=wqes)
        return wqes

    def one_poster(self, plan: Plan) -> bool:
        """Whether block 0 does the PE's posting and receiving of ``plan`` for every block: a plan of several blocks
        with batched lanes (``Plan.batched``: one round, every remote unit with rows carries its segments).
        Then every lane has one unit, and one build and one native post over all the PE's lanes (then one wait per
        QP over every source) replace one per block: each lane still has one submitter and the same WQEs in the
        same order; the blocks' own rows and the reduction stay split by block (unless ``one_block``). On a host
        whose cores the PEs already fill, the blocks' Python runs one at a time, so per-block copies of these fixed
        costs are time."""
        return plan.batched and len(plan.by_block) > 1

    def block_role(self, plan: Plan, stats: CallStats) -> "BlockRole | None":
        """The calling block's role in a kernel of ``plan``, its phase timer (``stats.timer``) started; None for
        a block that returns at once because block 0 does every block's work (``one_block``)."""
        c = shmemx.get_block_idx()
        solo = self.one_block(plan)
        if solo and c:
            return None
        timer = stats.timer(c)
        t = timer.mark()
        return BlockRole(c, solo, self.one_poster(plan), timer, t)

    def one_block(self, plan: Plan) -> bool:
        """Whether block 0 does the whole kernel of ``plan``, every block's share included (its own rows, for
        combine its part of the reduction), and blocks 1.. return at once: ``one_poster``, unless
        ``split_blocks`` (a setting of the Buffer, the same on every host: ``Buffer(split_blocks=...)``). Where
        the PEs fill the cores, the blocks' shares run one after another anyway (none of them gets a core of its
        own), and splitting them only adds the hand-offs between the blocks' threads and the ``sync_all`` s that
        order them (``scripts/bench_moe.py``: 4 channels against 1); with two cores per PE to spare, splitting
        lets the blocks' native copies and reductions run in parallel. The WQEs, their order per lane, the
        records and the signals are the same either way; so are the results."""
        return not self.split_blocks and self.one_poster(plan)

    def round_units(self, plan: Plan, block: int, k: int, one_poster: bool) -> list:
        """The units block ``block`` posts in round k of ``plan`` (``one_poster``: block 0 every block's remote
        units, each block its own rows for this PE)."""
        mine = plan.by_block[block][k]
        if not one_poster:
            return mine
        local = [u for u in mine if u.peer == self.me]
        if block:
            return local
        return [u for units in plan.by_block for u in units[k] if u.peer != self.me] + local

    def submit_units(self, units: list, plan: Plan, wqes: tuple, stats: CallStats, *, close_kind: int, seq: int,
                     timer: BlockTimer | None = None) -> None:
        """Post a round's ``units`` at once, unit i on its lane (each lane at most once): ``wqes`` = (``wqe_unit``,
        ``rmt_va``, ``sge_va``, ``length``), the one-BB WRITEs of every unit (grouped by unit, each unit's in its
        order; ``wqe_unit[j]``: the unit of WQE j), then, where a unit closes its lane, the lane's completion:
        its record (the lane's rows in ``plan``, bytes, WQEs, seq), then the signal ``signals[close_kind, me,
        qp]`` = seq on the peer (a WRITE_WITH_NOTIFY, fenced: ``FENCE_SO``). The WQEs of all units are built in
        one numpy operation and posted with one ``RawQueues.post`` (a doorbell per lane). A closing unit of at most
        ``one_cqe_bbs`` BBs asks for one CQE, its completion's (see the module); any other WQE for its own."""
        wqe_unit, rmt_va, sge_va, length = wqes
        m, n = len(units), len(wqe_unit)
        peers = np.fromiter((u.peer for u in units), np.intp, m)
        qps = np.fromiter((u.qp for u in units), np.intp, m)
        closes = np.fromiter((u.closes for u in units), bool, m)
        lane_rows = plan.lane_rows[peers, qps]
        lanes = self.lane_of[peers, qps]
        w = np.bincount(wqe_unit, minlength=m)
        nbytes = np.zeros(m, np.int64)
        if n:
            np.add.at(nbytes, wqe_unit, length.astype(np.int64))
        c = np.flatnonzero(closes)
        bbs = w + 2 * closes
        one_cqe = closes & (bbs <= self.one_cqe_bbs)
        offs = np.cumsum(bbs) - bbs  # each unit's first BB in the batch
        data = np.empty((int(bbs.sum()), 8), np.uint64)
        if n:
            first = np.cumsum(w) - w
            rows = offs[wqe_unit] + (np.arange(n) - first[wqe_unit])
            data[rows] = self.batch.build_writes(lanes[wqe_unit], rmt_va=rmt_va, sge_len=length, sge_va=sge_va,
                                                 flag=_FLAG)
            data[rows[one_cqe[wqe_unit]], 0] ^= self.to_no_cqe
        if len(c):
            cp, cq = peers[c], qps[c]
            record = self.views["send_record"]
            record[cp, cq, :4] = np.stack([lane_rows[c], stats.lane_bytes[cp, cq] + nbytes[c] + 32,
                                           stats.lane_wqes[cp, cq] + w[c] + 1, np.full(len(c), seq)], axis=1)
            slot = (self.offsets["signals"]
                    + ((close_kind * self.n_pes + self.me) * self.qp_num + cq) * SIGNAL_WORDS * 8).astype(np.uint64)
            sig = self.remote_base[cp] + slot
            src = np.uint64(self.local_base + self.offsets["send_record"]) + (cp * self.qp_num + cq).astype(
                np.uint64) * np.uint64(64)
            close = self.batch.build_notifies(lanes[c], flag=FENCE_SO.flag, rmt_va=sig + np.uint64(RECORD_WORD * 8),
                                              sge_len=32, sge_va=src, notify_va=sig, notify_value=seq)
            at = offs[c] + w[c]
            data[at] = close[:, :8]
            data[at + 1] = close[:, 8:]
            if timer is not None:
                timer.count("so_writes", len(c))
                timer.count("flag_writes", len(c))
        keep = np.flatnonzero(bbs)
        if len(keep):
            self.batch.post(lanes[keep], bbs[keep], data, cqes=np.where(one_cqe, 1, w + closes)[keep])
        stats.lane_wqes[peers, qps] += w + closes
        stats.lane_bytes[peers, qps] += nbytes + 32 * closes

    def quiet(self, peer: int, qp: int) -> None:
        shmemx.aclshmemx_udma_qp_quiet(self.peers.pe(peer), qp)

    def end_round(self, posted: list[tuple[int, int]], timer: BlockTimer, t: float, last: bool = False) -> float:
        """The end of a block's round: quiet every (peer, qp) it posted to (which releases the lane to the block
        that shares it next round), then SyncAll of the PE's blocks; timed as the "quiet" and "sync" phases.
        ``last``: the call's last round: no block takes a lane over after it, so no SyncAll (the quiets stay:
        the WQEs read the caller's arrays, and the lane is free for the next launch)."""
        if posted:  # one native call for all of them
            self.batch.quiet(self.lane_of[tuple(np.array(posted, np.intp).T)])
        timer.count("quiets", len(posted))
        t = timer.lap("quiet", t)
        if last:
            return t
        shmemx.sync_all()
        timer.count("syncs")
        return timer.lap("sync", t)

    def wait_completions(self, kind: int, sources: list, seq: int, n_qps: int, want: np.ndarray, call: str,
                         expected: str) -> None:
        """Wait (asleep) until every lane of every PE in ``sources`` signalled call ``seq`` into this PE's signal
        slots of ``kind`` (0 dispatch, 1 combine): one ``wait_until_all`` per QP over the sources' signals, not one
        per source (a wait sleeps until the last of them lands); then check their records in one numpy operation:
        rows per source = ``want``, every lane's record of call ``seq``.

        Raises:
            RuntimeError: a source's records do not add up (``call`` names the call, ``expected`` the rows).
        """
        signals = self.views["signals"]
        status = np.ones(self.n_pes, np.int32)
        status[sources] = 0
        for q in range(n_qps):
            shmemx.aclshmem_wait_until_all(signals[kind, :, q, 0], shmemx.ACLSHMEM_CMP_GE, seq, status=status)
        records = signals[kind, sources, :n_qps, RECORD_WORD:RECORD_WORD + 4].view(np.int64)  # [n, Q, 4]
        rows = records[:, :, 0].sum(1)
        bad = np.flatnonzero((rows != want) | (records[:, :, 3] != seq).any(1))
        if len(bad):
            i, s = int(bad[0]), sources[int(bad[0])]
            raise RuntimeError(f"pe {self.me}: {call}: the completion records from pe {s} (rows per qp "
                               f"{records[i, :, 0].tolist()}, seq {records[i, :, 3].tolist()}) do not match the "
                               f"{int(want[i])} {expected}")

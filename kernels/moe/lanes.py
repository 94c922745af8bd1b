"""The lanes of a ``Buffer``: its (peer, QP) send queues, the addresses of every peer's workspace, and posting.

Payload goes through the raw WQE path (``shmemx.aclshmemx_udma_raw_queue``): a unit's WQEs are built in one
numpy operation, written into the SQ ring after one ``reserve`` and published with one doorbell, each with a CQE
(``ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT``, flag 0x20) so that the lane's quiet covers every one of them.

The completion signal of a lane is one ``aclshmemx_udma_qp_put_signal_nbi`` (a WRITE_WITH_NOTIFY: the lane's
record, then the 64-bit signal SET to the call's sequence number) posted last on the lane, with the op config
``FENCE_SO`` = {cqe 1, fence 1, SO} (flag 0x2e). Why the fence: the payload WQEs are NO-ordered, and SO only
waits for earlier RO/SO WQEs of the QP; the fence waits for every earlier WQE of the QP, so the signal cannot land
before a row of its lane (and the earlier rounds of the lane were quieted before). Different QPs are not ordered
at all, hence one signal per (peer, QP), and the receiver waits for all of them.
"""

from __future__ import annotations

import numpy as np

import shmemx

__all__ = ["Lanes", "FENCE_SO"]

FENCE_SO = shmemx.OpConfig(cqe=1, se=0, fence=1, odr=shmemx.ACLSHMEMX_UDMA_ODR_SO)
_FLAG = shmemx.ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT.flag


class Lanes:
    """Send queues to every peer on QPs ``0..qp_num-1`` and the VA of the workspace on every PE.

    Args:
        block: this PE's workspace (the uint8 heap allocation).
        me, n_pes: this PE and P.
        qp_num: QPs per peer the buffer may use.
    """

    def __init__(self, block: np.ndarray, me: int, n_pes: int, qp_num: int):
        self.me = me
        self.n_pes = n_pes
        self.qp_num = qp_num
        self.block = block
        self.queues: dict[tuple[int, int], shmemx.RawQueue] = {}
        for peer in range(n_pes):
            if peer == me:
                continue
            for q in range(qp_num):
                try:
                    self.queues[peer, q] = shmemx.aclshmemx_udma_raw_queue(peer, q)
                except ValueError as exc:
                    raise ValueError(f"pe {me}: moe.Buffer(qp_num={qp_num}) needs {qp_num} QPs per peer: call "
                                     f"shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, {qp_num}) "
                                     f"before shmemx.init() ({exc})") from None
        self.remote_base = np.zeros(n_pes, np.uint64)
        self.local_base = 0
        for (peer, q), queue in self.queues.items():
            if q == 0:
                self.remote_base[peer] = queue.remote_va(block)
                self.local_base = queue.local_va(block)

    def local_va(self, peer: int, qp: int, arr: np.ndarray) -> int:
        """VA of a local array (or of this PE's heap) as a WQE source on lane (peer, qp); pins a registration
        of a non-heap array for the WQEs of that lane."""
        return self.queues[peer, qp].local_va(arr)

    def post(self, peer: int, qp: int, rmt_va: np.ndarray, sge_va: np.ndarray, length: np.ndarray) -> None:
        """Post ``len(rmt_va)`` WRITEs (each with a CQE) on lane (peer, qp): one reserve, one write, one
        doorbell."""
        n = len(rmt_va)
        if n == 0:
            return
        queue = self.queues[peer, qp]
        wqes = queue.build_writes(rmt_va=rmt_va, sge_len=length, sge_va=sge_va, flag=_FLAG)
        head = queue.reserve(n)
        queue.write(head, wqes)
        queue.ring_doorbell(head + n, cqes=n)

    def close(self, peer: int, qp: int, record_dst: np.ndarray, record_src: np.ndarray, signal: np.ndarray,
              seq: int) -> None:
        """The lane's completion: ``record_src`` into the peer's ``record_dst``, then ``signal`` = seq, fenced
        behind every earlier WQE of the lane."""
        shmemx.aclshmemx_udma_qp_put_signal_nbi(record_dst, record_src, record_src.size, signal, seq, peer, qp,
                                                config=FENCE_SO)

    def quiet(self, peer: int, qp: int) -> None:
        shmemx.aclshmemx_udma_qp_quiet(peer, qp)

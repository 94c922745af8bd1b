"""The UDMA segment of a PE: its URMA identity, its queue tables and rings.

Each PE owns one UDMA segment (``shmemx_<job>_udma<pe>``), laid out as on the device: a header, then tables of
``n_pes * qp_num`` 64-byte records indexed ``slot * qp_num + qp_idx`` (slot = peer PE; the self slot stays zero):
``remote_mem_info`` (how to reach the peer's heap: tpn, tokenId, token value, EID, address, length),
``wq_ctx`` and ``cq_ctx`` (ring address, depth, head, tail, doorbell address, cqe_cnt, amo scratch address),
the engine's own per-queue record (``hw``: doorbells, consumer index, error state), the atomic fetch scratch,
the SQ and CQ rings, and a sidecar word per SQ slot saying which API call and block posted it (metadata beside
the WQE, never inside it, so the 64 bytes stay bit-exact). The file is sparse: a ring's pages are touched only as
its head moves, so 128 PEs with 2 QPs and 32768-deep rings reserve 1 GiB of address space per PE but use only what
is posted (see the README for the footprint).

Identity, made at init and exchanged through the control segment:
* EID: 128 bits; the low 32 bits are the PE number, the rest random per PE (the engine checks all 128);
* TP id: 24 bits per (PE, peer, qp): ``tp_base + peer * qp_num + qp`` with a random ``tp_base`` per PE;
* the heap segment's tokenId (20 bits) and token value (32 bits, random: the secret a WQE must carry).

Local memory that is not on the heap (a put's source, a get's destination) is registered for the life of the
WQEs that use it, in a local VA range of its own (``LOCAL_VA_BASE``); see ``registry``.
"""

from __future__ import annotations

import secrets

import numpy as np

from ..shm.heap import HEAP_VA_BASE, HEAP_VA_STRIDE
from ..shm.segment import PAGE_SIZE, Segment, align_up, segment_name
from .layout import CQ_CTX_DTYPE, REMOTE_MEM_INFO_DTYPE, WQ_CTX_DTYPE

__all__ = [
    "UdmaSegment",
    "HW_DTYPE",
    "UDMA_VA_BASE",
    "UDMA_VA_STRIDE",
    "LOCAL_VA_BASE",
    "DEFAULT_DEPTH",
    "RING_BUDGET",
    "MIN_DEFAULT_DEPTH",
    "default_depth",
    "CREDIT_GUARD",
    "make_identity",
]

UDMA_VA_BASE = 0x0C00_0000_0000
UDMA_VA_STRIDE = 1 << 36
LOCAL_VA_BASE = 0x0800_0000_0000
DEFAULT_DEPTH = 32768  # the deepest default ring (BBs / CQEs); default_depth lowers it for large jobs
RING_BUDGET = 2 << 30  # bytes a job's rings may come to by default once every queue has gone around (default_depth)
MIN_DEFAULT_DEPTH = 64  # the shallowest (a MoE call posts up to 24 BBs per peer)
CREDIT_GUARD = 10  # ACLSHMEM_UDMA_AGGREGATE_CREDIT_GUARD
SW_DB = 1

HEADER_DTYPE = np.dtype(
    [
        ("n_pes", "<u4"),
        ("qp_num", "<u4"),
        ("sq_depth", "<u4"),
        ("cq_depth", "<u4"),
        ("tp_base", "<u4"),
        ("heap_tid", "<u4"),
        ("heap_token", "<u4"),
        ("amo_tid", "<u4"),
        ("eid", "<u8", (2,)),
    ]
)

HW_DTYPE = np.dtype(
    {
        "names": ["sq_db", "cq_db", "ci", "cq_pi", "state", "err_status", "err_substatus", "err_pos", "executed",
                  "bytes", "err_where", "err_arg"],
        "formats": ["<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u8", "<u8", "<u4", "<u4"],
        "offsets": [0, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 52],
        "itemsize": 64,
    }
)
# word indices into a record viewed as 16 x u32
HW_SQ_DB, HW_CQ_DB, HW_CI, HW_CQ_PI, HW_STATE = (
    HW_DTYPE.fields[f][1] // 4 for f in ("sq_db", "cq_db", "ci", "cq_pi", "state"))
HW_ERR_STATUS, HW_ERR_SUBSTATUS, HW_ERR_POS, HW_ERR_WHERE, HW_ERR_ARG = (
    HW_DTYPE.fields[f][1] // 4 for f in ("err_status", "err_substatus", "err_pos", "err_where", "err_arg"))
HW_EXECUTED, HW_BYTES = HW_DTYPE.fields["executed"][1] // 8, HW_DTYPE.fields["bytes"][1] // 8  # u64 words
WQ_HEAD, WQ_TAIL, WQ_CQE_CNT = 6, 7, 13
CQ_HEAD, CQ_TAIL = 6, 7


def make_identity(pe: int) -> dict:
    """A fresh URMA identity for PE ``pe``: EID halves, TP base, heap tokenId and token value."""
    return {
        "eid_lo": secrets.randbits(32) << 32 | pe,
        "eid_hi": 0xFE80_0000_0000_0000 | secrets.randbits(48),
        "tp_base": 1 + secrets.randbelow(0x40_0000),
        "heap_tid": 1 + secrets.randbelow(0x7_FFFE),
        "heap_token": secrets.randbits(32),
    }


def default_depth(n_pes: int, qp_num: int) -> int:
    """The ring depth ``init`` takes when none is given: ``DEFAULT_DEPTH``, halved until the job's rings, every
    queue once around its ring (``n_pes x (n_pes - 1) x qp_num`` queues, each an SQ and a CQ of 64 B and a sidecar
    word of 4 B per entry), fit ``RING_BUDGET``; at least ``MIN_DEFAULT_DEPTH``. The ring files are sparse, so a
    page costs memory only once the ring's head reached it, but a long job's rings all go around: at 256 PEs the
    old default of 32768 would have come to 263 GiB. With one QP: 32768 up to 16 PEs, 16384 at 32, 2048 at 64, 512 at
    128, 128 at 256 PEs (1.0 GiB once around; each call of the MoE kernels posts 3-24 BBs per peer). A function of
    the job's size only, so every PE and every host takes the same."""
    depth = DEFAULT_DEPTH
    queues = n_pes * max(n_pes - 1, 1) * max(qp_num, 1)
    while depth > MIN_DEFAULT_DEPTH and queues * depth * (64 + 64 + 4) > RING_BUDGET:
        depth //= 2
    return depth


class UdmaSegment:
    """The UDMA segment of one PE (its own, or a peer's mapped read-only by inspection tools)."""

    def __init__(self, segment: Segment):
        self.segment = segment
        self.header = segment.view(HEADER_DTYPE, 0, (1,)).reshape(())
        self.n_pes = int(self.header["n_pes"])
        self.qp_num = int(self.header["qp_num"])
        self.sq_depth = int(self.header["sq_depth"])
        self.cq_depth = int(self.header["cq_depth"])
        n = self.n_slots = self.n_pes * self.qp_num
        off = 4096
        self.remote_mem_info = segment.view(REMOTE_MEM_INFO_DTYPE, off, (n,))
        off += 64 * n
        self.wq_ctx = segment.view(WQ_CTX_DTYPE, off, (n,))
        self.wq32 = segment.view("<u4", off, (n, 16))
        off += 64 * n
        self.cq_ctx = segment.view(CQ_CTX_DTYPE, off, (n,))
        self.cq32 = segment.view("<u4", off, (n, 16))
        off += 64 * n
        self.hw = segment.view(HW_DTYPE, off, (n,))
        self.hw32 = segment.view("<u4", off, (n, 16))
        self.hw_offset = off
        off += 64 * n
        self.amo_offset = off
        self.amo = segment.view("<u8", off, (n, 8))
        off = align_up(off + 64 * n, PAGE_SIZE)
        self.sq_offset = off
        self.sq_bytes = self.sq_depth * 64
        off += n * self.sq_bytes
        self.cq_offset = off
        self.cq_bytes = self.cq_depth * 64
        off += n * self.cq_bytes
        self.sidecar_offset = off  # one u32 per SQ slot beside the ring: who posted the WQE (never in the WQE)
        off += n * self.sq_depth * 4
        assert off <= segment.size

    @staticmethod
    def size(n_pes: int, qp_num: int, sq_depth: int, cq_depth: int) -> int:
        n = n_pes * qp_num
        return align_up(4096 + 5 * 64 * n, PAGE_SIZE) + n * (64 * (sq_depth + cq_depth) + 4 * sq_depth)

    @classmethod
    def create(cls, job_id: str, pe: int, n_pes: int, qp_num: int, sq_depth: int, cq_depth: int,
               identity: dict, heap_size: int) -> "UdmaSegment":
        seg = Segment(segment_name(job_id, f"udma{pe}"), cls.size(n_pes, qp_num, sq_depth, cq_depth), create=True)
        hdr = seg.view(HEADER_DTYPE, 0, (1,)).reshape(())
        hdr["n_pes"], hdr["qp_num"], hdr["sq_depth"], hdr["cq_depth"] = n_pes, qp_num, sq_depth, cq_depth
        hdr["tp_base"], hdr["heap_tid"], hdr["heap_token"] = (identity["tp_base"], identity["heap_tid"],
                                                               identity["heap_token"])
        hdr["amo_tid"] = identity["heap_tid"] + 1
        hdr["eid"] = (identity["eid_lo"], identity["eid_hi"])
        return cls(seg)

    @classmethod
    def attach(cls, job_id: str, pe: int, readonly: bool = True) -> "UdmaSegment":
        return cls(Segment(segment_name(job_id, f"udma{pe}"), readonly=readonly))

    def layout(self) -> dict:
        """The offsets that name addresses inside a UDMA segment (the same for every PE of a job; dumps save it)."""
        return {"qp_num": self.qp_num, "n_slots": self.n_slots, "sq_depth": self.sq_depth,
                "cq_depth": self.cq_depth, "amo_offset": self.amo_offset, "sq_offset": self.sq_offset,
                "sq_bytes": self.sq_bytes, "cq_offset": self.cq_offset, "cq_bytes": self.cq_bytes}

    def va(self, pe: int, offset: int) -> int:
        """Emulated device VA of byte ``offset`` of PE ``pe``'s UDMA segment."""
        return UDMA_VA_BASE + pe * UDMA_VA_STRIDE + offset

    def sq_ring(self, index: int) -> np.ndarray:
        """``[depth, 64] uint8`` view of SQ ``index`` (= slot * qp_num + qp_idx)."""
        return self.segment.view(np.uint8, self.sq_offset + index * self.sq_bytes, (self.sq_depth, 64))

    def sidecar(self, index: int) -> np.ndarray:
        """``[depth] uint32`` per-slot metadata of SQ ``index``: ``layout.sidecar_word`` (api id | block << 8)."""
        return self.segment.view("<u4", self.sidecar_offset + index * self.sq_depth * 4, (self.sq_depth,))

    def cq_ring(self, index: int) -> np.ndarray:
        return self.segment.view(np.uint8, self.cq_offset + index * self.cq_bytes, (self.cq_depth, 64))

    def fill_tables(self, pe: int, peers: list[dict], heap_size: int) -> None:
        """Fill remote_mem_info, wq_ctx and cq_ctx for every (peer, qp) (after the identities were exchanged): one
        numpy store per field over every queue (a loop of structured-field stores took ~10 ms per rank at 256
        PEs)."""
        tp_base = int(self.header["tp_base"])
        q = self.qp_num
        idx = np.array([p * q + k for p in range(len(peers)) if p != pe for k in range(q)], np.int64)
        if not len(idx):
            return
        of = idx // q  # the peer of each queue
        u = idx.astype(np.uint64)
        rmi = self.remote_mem_info
        rmi["token_value_valid"][idx], rmi["rmt_jetty_type"][idx], rmi["target_hint"][idx] = 1, 1, 0
        rmi["tpn"][idx] = tp_base + idx
        rmi["tid"][idx] = np.array([p["heap_tid"] for p in peers], np.int64)[of]
        rmi["rmt_token_value"][idx] = np.array([p["heap_token"] for p in peers], np.int64)[of]
        rmi["len"][idx] = heap_size
        rmi["addr"][idx] = np.uint64(HEAP_VA_BASE) + of.astype(np.uint64) * np.uint64(HEAP_VA_STRIDE)
        rmi["eid_addr"][idx] = 0
        rmi["eid"][idx] = np.array([(p["eid_lo"], p["eid_hi"]) for p in peers], np.uint64)[of]
        base = np.uint64(self.va(pe, 0))
        wq, cq = self.wq_ctx, self.cq_ctx
        wq["wqn"][idx], wq["buf_addr"][idx] = idx, base + np.uint64(self.sq_offset) + u * np.uint64(self.sq_bytes)
        wq["wqe_size"][idx], wq["depth"][idx], wq["db_mode"][idx] = 64, self.sq_depth, SW_DB
        wq["db_addr"][idx] = base + np.uint64(self.hw_offset) + np.uint64(64) * u
        wq["amo_addr"][idx] = base + np.uint64(self.amo_offset) + np.uint64(64) * u
        cq["cqn"][idx], cq["buf_addr"][idx] = idx, base + np.uint64(self.cq_offset) + u * np.uint64(self.cq_bytes)
        cq["cqe_size"][idx], cq["depth"][idx], cq["db_mode"][idx] = 64, self.cq_depth, SW_DB
        cq["db_addr"][idx] = base + np.uint64(self.hw_offset + 4) + np.uint64(64) * u

    def close(self) -> None:
        self.segment.close()

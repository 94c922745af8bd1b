"""URMA resources of a PE: its identity, its queue tables and rings, and its registered local memory.

Each PE owns one UDMA segment (``shmemx_<job>_udma<pe>``), laid out as on the device: a header, then tables of
``n_pes * qp_num`` 64-byte records indexed ``slot * qp_num + qp_idx`` (slot = peer PE; the self slot stays zero):
``remote_mem_info`` (how to reach the peer's heap: tpn, tokenId, token value, EID, address, length),
``wq_ctx`` and ``cq_ctx`` (ring address, depth, head, tail, doorbell address, cqe_cnt, amo scratch address),
the engine's own per-queue record (``hw``: doorbells, consumer index, error state), the atomic fetch scratch,
the SQ and CQ rings, and a sidecar word per SQ slot saying which API call and block posted it (metadata beside
the WQE, never inside it, so the 64 bytes stay bit-exact). The file is sparse: a ring's pages are touched only as its head moves, so 128 PEs
with 2 QPs and 32768-deep rings reserve 1 GiB of address space per PE but use only what is posted (see the README
for the footprint).

Identity, made at init and exchanged through the control segment:
* EID: 128 bits; the low 32 bits are the PE number, the rest random per PE (the engine checks all 128);
* TP id: 24 bits per (PE, peer, qp): ``tp_base + peer * qp_num + qp`` with a random ``tp_base`` per PE;
* the heap segment's tokenId (20 bits) and token value (32 bits, random: the secret a WQE must carry).

Local memory that is not on the heap (a put's source, a get's destination) is registered for the life of the
WQEs that use it, in a local VA range of its own; see ``LocalRegistry``.
"""

from __future__ import annotations

import bisect
import secrets
import threading

import numpy as np

from .heap import HEAP_VA_BASE, HEAP_VA_STRIDE, data_address
from .layout import CQ_CTX_DTYPE, REMOTE_MEM_INFO_DTYPE, WQ_CTX_DTYPE
from .segment import PAGE_SIZE, Segment, segment_name

__all__ = [
    "UdmaSegment",
    "LocalRegistry",
    "Registration",
    "HW_DTYPE",
    "UDMA_VA_BASE",
    "UDMA_VA_STRIDE",
    "LOCAL_VA_BASE",
    "DEFAULT_DEPTH",
    "CREDIT_GUARD",
    "make_identity",
]

UDMA_VA_BASE = 0x0C00_0000_0000
UDMA_VA_STRIDE = 1 << 36
LOCAL_VA_BASE = 0x0800_0000_0000
DEFAULT_DEPTH = 32768
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
                  "bytes"],
        "formats": ["<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u8", "<u8"],
        "offsets": [0, 4, 8, 12, 16, 20, 24, 28, 32, 40],
        "itemsize": 64,
    }
)
# word indices into a record viewed as 16 x u32
HW_SQ_DB, HW_CQ_DB, HW_CI, HW_CQ_PI, HW_STATE = 0, 1, 2, 3, 4
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


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


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
        off = _align(off + 64 * n, PAGE_SIZE)
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
        return _align(4096 + 5 * 64 * n, PAGE_SIZE) + n * (64 * (sq_depth + cq_depth) + 4 * sq_depth)

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

    def va(self, pe: int, offset: int) -> int:
        """Emulated device VA of byte ``offset`` of PE ``pe``'s UDMA segment."""
        return UDMA_VA_BASE + pe * UDMA_VA_STRIDE + offset

    def sq_ring(self, index: int) -> np.ndarray:
        """``[depth, 64] uint8`` view of SQ ``index`` (= slot * qp_num + qp_idx)."""
        return self.segment.view(np.uint8, self.sq_offset + index * self.sq_bytes, (self.sq_depth, 64))

    def sidecar(self, index: int) -> np.ndarray:
        """``[depth] uint32`` per-slot metadata of SQ ``index``: api id | block << 8 (see ``queues.Api``)."""
        return self.segment.view("<u4", self.sidecar_offset + index * self.sq_depth * 4, (self.sq_depth,))

    def cq_ring(self, index: int) -> np.ndarray:
        return self.segment.view(np.uint8, self.cq_offset + index * self.cq_bytes, (self.cq_depth, 64))

    def fill_tables(self, pe: int, peers: list[dict], heap_size: int) -> None:
        """Fill remote_mem_info, wq_ctx and cq_ctx for every (peer, qp) (after the identities were exchanged)."""
        tp_base = int(self.header["tp_base"])
        for peer, ident in enumerate(peers):
            if peer == pe:
                continue
            for qp in range(self.qp_num):
                i = peer * self.qp_num + qp
                rmi = self.remote_mem_info[i]
                rmi["token_value_valid"], rmi["rmt_jetty_type"], rmi["target_hint"] = 1, 1, 0
                rmi["tpn"] = tp_base + i
                rmi["tid"], rmi["rmt_token_value"] = ident["heap_tid"], ident["heap_token"]
                rmi["len"], rmi["addr"] = heap_size, HEAP_VA_BASE + peer * HEAP_VA_STRIDE
                rmi["eid_addr"] = 0
                rmi["eid"] = (ident["eid_lo"], ident["eid_hi"])
                wq = self.wq_ctx[i]
                wq["wqn"], wq["buf_addr"] = i, self.va(pe, self.sq_offset + i * self.sq_bytes)
                wq["wqe_size"], wq["depth"], wq["db_mode"] = 64, self.sq_depth, SW_DB
                wq["db_addr"] = self.va(pe, self.hw_offset + 64 * i)
                wq["amo_addr"] = self.va(pe, self.amo_offset + 64 * i)
                cq = self.cq_ctx[i]
                cq["cqn"], cq["buf_addr"] = i, self.va(pe, self.cq_offset + i * self.cq_bytes)
                cq["cqe_size"], cq["depth"], cq["db_mode"] = 64, self.cq_depth, SW_DB
                cq["db_addr"] = self.va(pe, self.hw_offset + 64 * i + 4)

    def close(self) -> None:
        self.segment.close()


class Registration:
    """Local memory registered as an URMA segment: ``[va, va + nbytes)`` maps to ``data`` (uint8)."""

    __slots__ = ("va", "nbytes", "tid", "data", "address", "uses", "writable")

    def __init__(self, va: int, data: np.ndarray, tid: int, address: int):
        self.va = va
        self.nbytes = data.nbytes
        self.tid = tid
        self.data = data
        self.address = address
        self.writable = bool(data.flags.writeable)
        self.uses: dict[int, int] = {}  # queue index -> BB position after its last WQE that used this


class LocalRegistry:
    """Local VAs of this PE: its heap, its UDMA segment's amo scratch, and registered local buffers.

    Posting threads register; the engine thread resolves. A registration lives while a WQE that uses it may
    still run: ``collect`` drops those whose last WQE every queue has retired (quiet passed it).
    """

    def __init__(self, pe: int, heap, udma: UdmaSegment, amo_tid: int):
        self.pe = pe
        self.heap = heap
        self.heap_va = HEAP_VA_BASE + pe * HEAP_VA_STRIDE
        self.udma = udma
        self.amo_va = udma.va(pe, udma.amo_offset)
        self.amo_bytes = udma.segment.bytes[udma.amo_offset:udma.amo_offset + 64 * udma.n_slots]
        self.amo_tid = amo_tid
        self._next_va = LOCAL_VA_BASE
        self._next_tid = (amo_tid + 1) & 0xFFFFF or 1
        self._by_address: dict[tuple[int, int], Registration] = {}
        self._lock = threading.Lock()
        self.snapshot: tuple[list[int], list[Registration]] = ([], [])  # sorted VAs, replaced on change
        self._last: Registration | None = None  # the registration va_of returned last (a kernel sends its rows)

    def va_of(self, arr: np.ndarray, writable: bool, what: str, pin: tuple[int, int] | None = None,
              addr: int | None = None) -> tuple[int, Registration | None]:
        """Local VA of a C-contiguous array's first byte; registers it when it is not on this PE's heap.

        Returns (va, registration or None for heap memory). ValueError for another PE's heap memory. ``what``
        (a string, or a function making it) names the argument in errors. ``pin`` = (queue index, BB position):
        record that use under the registry's lock, so that a ``collect`` by another thread (a quiet of another
        queue) cannot drop the registration between this lookup and the caller's post. ``addr``: ``arr``'s
        address, when the caller has it.
        """
        if addr is None:
            addr = data_address(arr)
        last = self._last  # rows of the array used last: no heap lookups, no root walk
        if (last is not None and last.address <= addr and addr + arr.nbytes <= last.address + last.nbytes
                and (last.writable or not writable)):
            with self._lock:
                if last is self._last:  # not collected meanwhile
                    if pin is not None:
                        last.uses[pin[0]] = pin[1]
                    return last.va + (addr - last.address), last
        off = addr - self.heap.base_addr
        if 0 <= off and self.heap.allocated(off, arr.nbytes):
            return self.heap_va + off, None
        if callable(what):
            what = what()
        found = self.heap.locate_address(addr)
        if found is not None:
            pe, off = found
            if pe != self.pe:
                raise ValueError(f"pe {self.pe}: {what} is pe {pe}'s heap memory; it must be local (this PE's "
                                 f"heap or a local array)")
            self.heap.check_allocated(off, arr.nbytes, what, pe)
            return self.heap_va + off, None
        if writable and not arr.flags.writeable:
            raise ValueError(f"pe {self.pe}: {what} is read-only")
        root = arr
        while isinstance(root.base, np.ndarray):
            root = root.base
        if not root.flags.c_contiguous:
            root = arr
        root_addr = data_address(root)
        if not root_addr <= addr <= addr + arr.nbytes <= root_addr + root.nbytes:
            root, root_addr = arr, addr
        with self._lock:
            reg = self._by_address.get((root_addr, root.nbytes))
            if reg is None:
                reg = self._register(root, root_addr)
            if pin is not None:
                reg.uses[pin[0]] = pin[1]
            self._last = reg
        return reg.va + (addr - root_addr), reg

    def _register(self, root: np.ndarray, root_addr: int) -> Registration:
        """A new registration (the caller holds the lock)."""
        data = root.reshape(-1).view(np.uint8) if root.nbytes else np.zeros(0, np.uint8)
        va = self._next_va + root_addr % PAGE_SIZE
        self._next_va = _align(va + max(data.nbytes, 1), PAGE_SIZE)
        reg = Registration(va, data, self._next_tid, root_addr)
        self._next_tid = (self._next_tid + 1) & 0xFFFFF or 1
        self._by_address[(root_addr, root.nbytes)] = reg
        self._publish()
        return reg

    def _publish(self) -> None:
        regs = sorted(self._by_address.values(), key=lambda r: r.va)
        self.snapshot = ([r.va for r in regs], regs)

    def resolve(self, va: int, length: int) -> tuple[np.ndarray, int] | None:
        """(uint8 buffer, offset) of local ``[va, va+length)``, or None when it is not registered memory."""
        off = va - self.heap_va
        if 0 <= off and off + length <= self.heap.size:
            return self.heap.segments[self.pe].bytes, off
        off = va - self.amo_va
        if 0 <= off and off + length <= self.amo_bytes.nbytes:
            return self.amo_bytes, off
        vas, regs = self.snapshot
        i = bisect.bisect_right(vas, va) - 1
        if i >= 0:
            reg = regs[i]
            off = va - reg.va
            if off + length <= reg.nbytes:
                return reg.data, off
        return None

    def collect(self, retired: dict[int, int]) -> None:
        """Drop registrations whose every use is retired (``retired[queue index]`` = BB position done)."""
        with self._lock:
            dead = [key for key, reg in self._by_address.items()
                    if all(((retired.get(q, 0) - pos) & 0xFFFF_FFFF) < 0x8000_0000 for q, pos in reg.uses.items())]
            if dead:
                for key in dead:
                    if self._by_address.pop(key) is self._last:
                        self._last = None
                self._publish()

    def __len__(self) -> int:
        return len(self._by_address)

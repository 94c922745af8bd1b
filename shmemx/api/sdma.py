"""SDMA: copies on the calling block's own DMA channel, its quiet and notify record, and the CMO prefetch.

The engine (``udma.sdma``) has one FIFO channel per AIV block; these calls post to the channel of the calling
block (``get_block_idx()``; the main thread outside a launch is block 0). Ordering, as CANN's SDMA:

* the copies of one block complete in the order it posted them; copies of different blocks in any order;
* ``aclshmemx_sdma_quiet`` waits for the calling block's copies only (other blocks quiet their own), and nothing
  else completes them: not ``aclshmem_quiet``, not a barrier, not the end of the kernel (``shmemx.finalize``
  executes what is left before it meets the other PEs);
* nothing orders an SDMA copy with MTE copies, UDMA WQEs or ``signal_op``: a flag that announces the payload is
  written after the quiet (CANN's double-plane dispatch: "control signals only after all SDMA payloads are
  visible");
* ``aclshmemx_sdma_notify_record`` fires the block's notify (``sdma_notify(block)``) once its earlier copies are
  done; a host thread waits for it with ``aclrtWaitAndResetNotify`` (``api.streams``).

SDMA reaches the PEs of the calling PE's server (``api.engines``), and needs ``ACLSHMEM_DATA_OP_SDMA`` in the
job's ``data_op_engine_type`` (CANN sets up its channels only then). Arguments as the MTE calls: element counts,
``dst``/``src`` C-contiguous arrays of one dtype, the remote side a heap view (the symmetric address); the UB
arguments (``buf``, ``ub_size``, ``sync_id``) are keywords, checked, unused. Every copy is recorded (``SDMA``,
``SDMA_QUIET``, ``SDMA_NOTIFY``) and modelled by ``shmemx replay``; the sanitizer sees it as an MTE copy made at
post time (the engine's later landing is not modelled there yet).
"""

from __future__ import annotations

import enum

import numpy as np

from ..runtime import runtime
from ..shm.control import WaitCall
from ..shm.waits import Sleep, Wait, block_until
from ..udma.sdma import Notify, SdmaEngine
from .blocks import get_block_idx
from .checks import check_pe, symmetric_offset, transfer_bytes
from .engines import Engine, ranks_per_server

__all__ = ["aclshmemx_sdma_put_nbi", "aclshmemx_sdma_get_nbi", "aclshmemx_sdma_quiet",
           "aclshmemx_sdma_notify_record", "aclshmemx_cmo_nbi", "ACLSHMEMCMOTYPE", "sdma_notify", "Notify"]


class ACLSHMEMCMOTYPE(enum.IntEnum):
    """Cache-maintenance operations of ``aclshmemx_cmo_nbi`` (CANN supports PREFETCH only; the others do nothing)."""

    CMO_TYPE_PREFETCH = 6
    CMO_TYPE_WRITEBACK = 7
    CMO_TYPE_INVALID = 8
    CMO_TYPE_FLUSH = 9


def _engine(rt, what: str) -> SdmaEngine:
    if not rt.engine_type & Engine.SDMA:
        raise ValueError(f"pe {rt.my_pe}: {what}: SDMA is not enabled (data_op_engine_type={rt.engine_type:#x}; "
                         f"add ACLSHMEM_DATA_OP_SDMA in OptionalAttr(data_op_engine_type=...) at init)")
    if rt.sdma is None:
        rt.sdma = SdmaEngine(rt.my_pe, rt.ctl.wake)
    return rt.sdma


def _raw_bytes(arr: np.ndarray, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of a C-contiguous array as a plain uint8 array (no checked-array hooks)."""
    return arr.view(np.ndarray).reshape(-1).view(np.uint8)[:nbytes]


def _copy(what: str, dst, src, nelems, pe, put: bool) -> None:
    rt = runtime()
    sdma = _engine(rt, what)
    pe = check_pe(rt, what, pe)
    rps = ranks_per_server()
    if pe // rps != rt.my_pe // rps:
        raise ValueError(f"pe {rt.my_pe}: {what} {'to' if put else 'from'} pe {pe}: SDMA reaches only the PEs of "
                         f"this server (server {rt.my_pe // rps}; pe {pe} is on server {pe // rps}, {rps} ranks "
                         f"per server): use UDMA")
    where = f"{what} {'to' if put else 'from'} pe {pe}"
    nbytes = transfer_bytes(rt, where, nelems, {"dst": dst, "src": src})
    sym, local = (dst, src) if put else (src, dst)
    offset = symmetric_offset(rt, where, sym, nbytes, pe, "dst" if put else "src")
    if nbytes == 0:
        return
    if not put and not local.flags.writeable:
        raise ValueError(f"pe {rt.my_pe}: {where}: dst is read-only")
    remote = rt.heap.view(pe, offset, (nbytes,), np.uint8)
    ev = rt.events
    if ev is not None:
        ev.sdma(pe, offset, nbytes, put, src if put else None)
        if ev.checker is not None:  # (as an MTE copy at post time: see the module docstring)
            ev.checker.mte(pe, offset, nbytes, put, local)
    block = get_block_idx()
    if put:
        sdma.post(block, remote, _raw_bytes(local, nbytes), pe, where)
    else:
        sdma.post(block, _raw_bytes(local, nbytes), remote, rt.my_pe, where)


def aclshmemx_sdma_put_nbi(dst: np.ndarray, src: np.ndarray, nelems: int, pe: int, *, buf: np.ndarray | None = None,
                           ub_size: int | None = None, sync_id: int = 0) -> None:
    """Post the copy of ``nelems`` elements of local ``src`` into ``dst`` on PE ``pe`` (a PE of this server) on
    the calling block's SDMA channel; returns before anything moved. ``src`` must not change, and ``dst`` is
    undefined on ``pe``, until this block's ``aclshmemx_sdma_quiet``."""
    _copy("aclshmemx_sdma_put_nbi", dst, src, nelems, pe, True)


def aclshmemx_sdma_get_nbi(dst: np.ndarray, src: np.ndarray, nelems: int, pe: int, *, buf: np.ndarray | None = None,
                           ub_size: int | None = None, sync_id: int = 0) -> None:
    """Post the copy of ``nelems`` elements of ``src`` on PE ``pe`` (a heap view) into local ``dst`` on the
    calling block's SDMA channel; ``dst`` is undefined until this block's ``aclshmemx_sdma_quiet``."""
    _copy("aclshmemx_sdma_get_nbi", dst, src, nelems, pe, False)


def aclshmemx_sdma_quiet(*, buf: np.ndarray | None = None, ub_size: int | None = None, sync_id: int = 0) -> None:
    """Wait until every SDMA copy the calling block posted has landed (its channel is FIFO, so all of them);
    raises a failed copy of the channel. Other blocks' copies are not waited for."""
    rt = runtime()
    sdma = _engine(rt, "aclshmemx_sdma_quiet")
    block = get_block_idx()
    ch = sdma.channel(block)
    target = ch.posted
    if rt.events is not None:
        rt.events.sdma_quiet()

    def describe() -> str:
        return (f"pe {rt.my_pe}: aclshmemx_sdma_quiet in block {block}: {ch.done} of {target} SDMA SQEs of its "
                f"channel done")

    block_until(rt, lambda: ch.done >= target,
                Wait(WaitCall.SDMA_QUIET, pe=rt.my_pe, qp=block, target=target, describe=describe),
                sleep=Sleep.wake(rt.my_pe), spin=0)
    if ch.error is not None:
        err, ch.error = ch.error, None
        raise err


def aclshmemx_sdma_notify_record(*, buf: np.ndarray | None = None, ub_size: int | None = None,
                                 sync_id: int = 0) -> None:
    """Post a notify record on the calling block's channel: ``sdma_notify(block)`` fires once the block's
    earlier SDMA copies are done (a host waits for it with ``aclrtWaitAndResetNotify``)."""
    rt = runtime()
    sdma = _engine(rt, "aclshmemx_sdma_notify_record")
    if rt.events is not None:
        rt.events.sdma_notify()
    sdma.record_notify(get_block_idx())


def sdma_notify(block: int = 0) -> Notify:
    """The notify that block ``block``'s ``aclshmemx_sdma_notify_record`` fires (CANN keeps them in the host
    state's ``notify_arr``); pass it to ``aclrtWaitAndResetNotify``."""
    rt = runtime()
    return _engine(rt, "sdma_notify").notify(int(block))


def aclshmemx_cmo_nbi(src: np.ndarray, nelems: int, cmo_type: int, *, buf: np.ndarray | None = None,
                      ub_size: int | None = None, sync_id: int = 0) -> None:
    """A cache-maintenance operation on ``nelems`` elements of ``src`` (a heap view of any PE). PREFETCH maps the
    pages into this process now (the emulator's "load into cache": no page faults on first touch later); the
    other types do nothing, as in CANN."""
    rt = runtime()
    what = "aclshmemx_cmo_nbi"
    _engine(rt, what)
    try:
        kind = ACLSHMEMCMOTYPE(cmo_type)
    except ValueError:
        raise ValueError(f"pe {rt.my_pe}: {what}: cmo_type {cmo_type!r} is not an ACLSHMEMCMOTYPE (6..9)") from None
    nbytes = transfer_bytes(rt, what, nelems, {"src": src})
    pe, offset = rt.heap.locate(src, f"{what} src")
    rt.heap.check_allocated(offset, max(nbytes, 1), f"{what} src", pe)
    if kind == ACLSHMEMCMOTYPE.CMO_TYPE_PREFETCH and nbytes:
        rt.heap.segment(pe).prefault(offset, nbytes)

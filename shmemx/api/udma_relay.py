"""UDMA relay put/get: ``aclshmemx_udma_relay_put_nbi`` / ``_get_nbi``, a WQE to ``pe`` that egresses on the
local port that reaches ``relay_pe`` (CANN: the fabric forwards it through ``relay_pe``, to spread the traffic
between two nodes over more links).

CANN keeps a send queue per (pe, relay_pe) slot with that path's EID, and ``aclshmemx_udma_quiet(pe)`` drains all
of a PE's slots. The emulated fabric has one path between any two PEs, so the relayed WQE is the direct one: a
WRITE (READ) on QP 0 of ``pe``, posted by ``aclshmemx_udma_put_nbi`` (``_get_nbi``), completing at
``aclshmemx_udma_quiet(pe)`` as CANN's does. Two differences, both stronger than the hardware: the relay PE's
links carry nothing (the replay models the direct path), and the WQE is ordered with the direct WQEs to ``pe``
on QP 0, which CANN's separate slot is not. The preconditions are CANN's, checked: ``pe`` and ``relay_pe`` are
PEs of the job, differ from each other and from the calling PE (CANN's release build submits nothing and
returns; here the call raises).
"""

from __future__ import annotations

import numpy as np

from ..runtime import runtime
from ..udma.layout import ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT, OpConfig
from .checks import check_pe
from .rma import (
    aclshmemx_defer_t,
    aclshmemx_submit_t,
    aclshmemx_udma_get_nbi,
    aclshmemx_udma_put_nbi,
)

__all__ = ["aclshmemx_udma_relay_put_nbi", "aclshmemx_udma_relay_get_nbi"]


def _check(what: str, pe, relay_pe) -> tuple[int, int]:
    rt = runtime()
    pe, relay_pe = check_pe(rt, what, pe), check_pe(rt, what, relay_pe)
    if pe == relay_pe or rt.my_pe in (pe, relay_pe):
        raise ValueError(f"pe {rt.my_pe}: {what} to pe {pe} via relay_pe {relay_pe}: pe and relay_pe must differ "
                         f"from each other and from the calling PE")
    return pe, relay_pe


def aclshmemx_udma_relay_put_nbi(dst: np.ndarray, src: np.ndarray, nelems: int, pe: int, relay_pe: int, *,
                                 buf: np.ndarray | None = None, sync_id: int = 0,
                                 config: OpConfig = ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT,
                                 batch: aclshmemx_defer_t | aclshmemx_submit_t | None = None) -> None:
    """``aclshmemx_udma_put_nbi(dst, src, nelems, pe)`` routed via ``relay_pe`` (see the module docstring)."""
    pe, _ = _check("aclshmemx_udma_relay_put_nbi", pe, relay_pe)
    aclshmemx_udma_put_nbi(dst, src, nelems, pe, buf=buf, sync_id=sync_id, config=config, batch=batch)


def aclshmemx_udma_relay_get_nbi(dst: np.ndarray, src: np.ndarray, nelems: int, pe: int, relay_pe: int, *,
                                 buf: np.ndarray | None = None, sync_id: int = 0,
                                 config: OpConfig = ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT,
                                 batch: aclshmemx_defer_t | aclshmemx_submit_t | None = None) -> None:
    """``aclshmemx_udma_get_nbi(dst, src, nelems, pe)`` routed via ``relay_pe``."""
    pe, _ = _check("aclshmemx_udma_relay_get_nbi", pe, relay_pe)
    aclshmemx_udma_get_nbi(dst, src, nelems, pe, buf=buf, sync_id=sync_id, config=config, batch=batch)

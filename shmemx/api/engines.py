"""Which engine moves the data of an engine-agnostic call, and the engines' UB configurations.

CANN's high-level calls (``aclshmem_putmem``, ``aclshmem_int32_p``, ``aclshmem_putmem_signal``, the typed atomics)
pick an engine per target PE from the transports that reach it (``topo_list[pe]``) among those the job enabled
(``data_op_engine_type``, a bit mask of ``ACLSHMEM_DATA_OP_MTE`` 1, ``_SDMA`` 2, ``_ROCE`` 4, ``_UDMA`` 8), in the
order SDMA, UDMA, MTE, RoCE. shmemx models what reaches what with servers of ``ranks_per_server()`` consecutive
PEs (``SHMEMX_RANKS_PER_SERVER`` in the environment; default min(16, n_pes), the Ascend 950 server of
``shmemx replay``'s ``ascend950`` topology and of ``kernels/moe/topology.py``):

* the own PE: MTE (a local copy), whatever the mask (CANN sends no UDMA to the own PE either);
* a PE of the same server: SDMA when enabled, else MTE when enabled, else UDMA (the load/store and SDMA paths
  reach only the server; UDMA reaches every PE, and is used inside the server only when nothing nearer is on);
* a PE of another server: UDMA when enabled; nothing else crosses servers (RoCE is not emulated), so a job
  without the UDMA bit cannot reach it and the call raises, naming both servers and the mask.

shmemx's default mask is ``ACLSHMEM_DATA_OP_UDMA`` (every remote PE over UDMA); set
``OptionalAttr(data_op_engine_type=ACLSHMEM_DATA_OP_MTE | ACLSHMEM_DATA_OP_UDMA)`` for MTE inside a server and
UDMA across, the shape of an Ascend 950 cluster.

``aclshmemx_set_mte_config`` / ``_udma_config`` / ``_sdma_config`` set the UB scratch (offset, size, sync id)
CANN's high-level calls stage through; shmemx checks and keeps them (``ub_config``), but its engines stage nothing
through UB, so they change no behaviour.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from ..runtime import (ACLSHMEM_DATA_OP_MTE, ACLSHMEM_DATA_OP_ROCE, ACLSHMEM_DATA_OP_SDMA, ACLSHMEM_DATA_OP_UDMA,
                       runtime, Runtime)
from .blocks import UB_SIZE
from .checks import as_index, check_pe

__all__ = ["Engine", "ranks_per_server", "server_of", "engine_for", "engine_of", "aclshmemx_set_mte_config",
           "aclshmemx_set_udma_config", "aclshmemx_set_sdma_config", "ub_config", "UbConfig",
           "RANKS_PER_SERVER_ENV", "ACLSHMEM_UDMA_MTE_STAGING_UB_SIZE", "ACLSHMEM_SDMA_FLAG_LENGTH"]

RANKS_PER_SERVER_ENV = "SHMEMX_RANKS_PER_SERVER"
DEFAULT_RANKS_PER_SERVER = 16
ACLSHMEM_UDMA_MTE_STAGING_UB_SIZE = 128
ACLSHMEM_SDMA_FLAG_LENGTH = 64


class Engine(enum.IntEnum):
    """A data-op engine (its ``ACLSHMEM_DATA_OP_*`` bit)."""

    MTE = ACLSHMEM_DATA_OP_MTE
    SDMA = ACLSHMEM_DATA_OP_SDMA
    ROCE = ACLSHMEM_DATA_OP_ROCE
    UDMA = ACLSHMEM_DATA_OP_UDMA


def ranks_per_server() -> int:
    """PEs per server of this job's topology (``SHMEMX_RANKS_PER_SERVER``, default min(16, n_pes))."""
    rt = runtime()
    text = os.environ.get(RANKS_PER_SERVER_ENV)
    if not text:
        return min(DEFAULT_RANKS_PER_SERVER, rt.n_pes)
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"pe {rt.my_pe}: {RANKS_PER_SERVER_ENV}={text!r} must be a positive integer")
    return value


def server_of(pe: int) -> int:
    """The server of global PE ``pe``: ``pe // ranks_per_server()``."""
    return pe // ranks_per_server()


_routes: dict = {"rt": None, "table": []}


def _table(rt) -> list[Engine | None]:
    if _routes["rt"] is not rt:
        rps, mask = ranks_per_server(), rt.engine_type
        near = [e for e in (Engine.SDMA, Engine.MTE, Engine.UDMA) if mask & e]
        table = []
        for pe in range(rt.n_pes):
            if pe == rt.my_pe:
                table.append(Engine.MTE)
            elif not rt.hosts.local(pe):  # another host: only its NIC reaches it
                table.append(Engine.UDMA if mask & Engine.UDMA else None)
            elif pe // rps == rt.my_pe // rps:
                table.append(near[0] if near else None)
            else:
                table.append(Engine.UDMA if mask & Engine.UDMA else None)
        _routes["rt"], _routes["table"] = rt, table
    return _routes["table"]


def reaching(rt: Runtime, pe: int) -> Engine | None:
    """The engine of ``pe`` (checked by the caller), None when no enabled engine reaches it."""
    return _table(rt)[pe]


def engine_for(rt: Runtime, what: str, pe: int) -> Engine:
    """The engine a high-level call to ``pe`` (checked by the caller) uses; ValueError when none reaches it."""
    engine = _table(rt)[pe]
    if engine is None:
        rps = ranks_per_server()
        raise ValueError(f"pe {rt.my_pe}: {what} to pe {pe}: no enabled engine reaches it (pe {pe} is on server "
                         f"{pe // rps}, this PE on server {rt.my_pe // rps}, {rps} ranks per server; "
                         f"data_op_engine_type={rt.engine_type:#x}: only UDMA (8) crosses servers here, and MTE, "
                         f"SDMA or UDMA reach the own server)")
    return engine


def engine_of(pe: int) -> Engine:
    """The engine the high-level calls of this PE use for PE ``pe`` (ValueError when none reaches it): for
    programs that complete ``_nbi`` calls themselves (``aclshmemx_udma_quiet(pe)`` after UDMA ones)."""
    rt = runtime()
    return engine_for(rt, "engine_of", check_pe(rt, "engine_of", pe))


@dataclass(frozen=True)
class UbConfig:
    """``aclshmem_ub_config_t``: UB scratch ``offset`` and ``ub_size`` (bytes), pipe ``sync_id``."""

    offset: int = 0
    ub_size: int = 0
    sync_id: int = 0


_configs: dict[Engine, UbConfig] = {}


def _set_config(engine: Engine, what: str, offset, ub_size, sync_id, min_size: int, align: int = 1) -> int:
    rt = runtime()
    offset = as_index(rt, what, "offset", offset)
    ub_size = as_index(rt, what, "ub_size", ub_size)
    sync_id = as_index(rt, what, "sync_id", sync_id)
    if ub_size < min_size or ub_size % align:
        raise ValueError(f"pe {rt.my_pe}: {what}: ub_size {ub_size} B must be at least {min_size} B"
                         + (f" and a multiple of {align}" if align > 1 else ""))
    if offset + ub_size > UB_SIZE:
        raise ValueError(f"pe {rt.my_pe}: {what}: offset {offset} + ub_size {ub_size} is past the {UB_SIZE} B of "
                         f"UB")
    _configs[engine] = UbConfig(offset, ub_size, sync_id)
    return 0


def aclshmemx_set_mte_config(offset: int, ub_size: int, sync_id: int) -> int:
    """The UB scratch of the high-level calls' MTE path (kept; see the module docstring); returns 0."""
    return _set_config(Engine.MTE, "aclshmemx_set_mte_config", offset, ub_size, sync_id, 1)


def aclshmemx_set_udma_config(offset: int, ub_size: int, sync_id: int) -> int:
    """The UB scratch of the high-level calls' UDMA path: at least ``ACLSHMEM_UDMA_MTE_STAGING_UB_SIZE`` (128) B
    (one WQE block); returns 0."""
    return _set_config(Engine.UDMA, "aclshmemx_set_udma_config", offset, ub_size, sync_id,
                ACLSHMEM_UDMA_MTE_STAGING_UB_SIZE)


def aclshmemx_set_sdma_config(offset: int, ub_size: int, sync_id: int) -> int:
    """The UB scratch of the SDMA calls: at least 64 B and a multiple of 64 (CANN's rule); returns 0."""
    return _set_config(Engine.SDMA, "aclshmemx_set_sdma_config", offset, ub_size, sync_id, ACLSHMEM_SDMA_FLAG_LENGTH,
                ACLSHMEM_SDMA_FLAG_LENGTH)


def ub_config(engine: int) -> UbConfig:
    """The UB configuration last set for ``engine`` (``ACLSHMEM_DATA_OP_*``), or the empty default."""
    return _configs.get(Engine(engine), UbConfig())

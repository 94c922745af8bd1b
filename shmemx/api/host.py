"""The host API: init and finalize, who am I, QP count, barriers.

CANN returns negative error codes; shmemx raises (see ``errors``) and returns 0 where CANN returns a status,
so that ported host code that checks ``== 0`` keeps working.
"""

from __future__ import annotations

from .. import runtime as _runtime
from ..runtime import InitAttr, runtime
from ..shm.barrier import barrier
from ..shm.control import WaitCall
from .lifecycle import check_uniqueid

__all__ = [
    "init",
    "finalize",
    "my_pe",
    "n_pes",
    "aclshmemx_init_attr",
    "aclshmem_finalize",
    "aclshmem_my_pe",
    "aclshmem_n_pes",
    "aclshmemx_set_qp_num",
    "qp_num",
    "aclshmem_barrier_all",
    "aclshmem_sync_all",
]


def init(attr: InitAttr | None = None, *, heap_size: int | str | None = None, timeout: float | None = None,
         sq_depth: int | None = None, cq_depth: int | None = None, min_heap_size: int | str | None = None) -> None:
    """Attach to the job (collective).

    Args:
        attr: CANN-style attributes (``InitAttr``); optional.
        heap_size: heap bytes per PE (int or "64M"); overrides the launcher's ``--heap-size``.
        timeout: deadline of every wait, quiet and barrier in seconds; overrides ``--timeout``.
        sq_depth, cq_depth: ring depths (power of two; default 32768 up to 16 PEs, shallower for larger jobs:
            ``default_depth``); small ones make wrap-around testable.
        min_heap_size: at least this many heap bytes (the size above, the launcher's or the default 1 GiB is raised
            to it); every PE must pass the same.
    """
    _runtime.init(attr, heap_size=heap_size, timeout=timeout, sq_depth=sq_depth, cq_depth=cq_depth,
                  min_heap_size=min_heap_size)


def aclshmemx_init_attr(flags: int, attr: InitAttr) -> int:
    """CANN's init (collective). ``flags`` selects the bootstrap (ignored: the launcher bootstraps); returns 0.
    A unique id in ``attr.comm_args`` (``aclshmemx_set_attr_uniqueid_args``) must name this job."""
    if not isinstance(attr, InitAttr):
        raise TypeError(f"aclshmemx_init_attr: attr must be a shmemx.InitAttr, got {type(attr).__name__}")
    check_uniqueid(attr)
    _runtime.init(attr)
    return 0


def finalize() -> int:
    """Detach from the job (collective, idempotent; also runs at interpreter exit)."""
    return _runtime.finalize()


aclshmem_finalize = finalize


def my_pe() -> int:
    """This process's PE number."""
    return runtime().my_pe


def n_pes() -> int:
    """Number of PEs in the job."""
    return runtime().n_pes


aclshmem_my_pe = my_pe
aclshmem_n_pes = n_pes


def aclshmemx_set_qp_num(engine: int, qp_num: int) -> int:
    """QPs per peer for ``engine`` (ACLSHMEM_DATA_OP_UDMA). Before init only, 1..32, the same on every PE."""
    return _runtime.set_qp_num(engine, qp_num)


def qp_num() -> int:
    """UDMA QPs per peer of this job (``aclshmemx_set_qp_num`` before init; 1 by default). Libraries that map
    their lanes onto QPs (``shmemx.deep_ep``'s one QP per local expert) read it instead of probing queues."""
    return runtime().qp_num


def aclshmem_barrier_all() -> None:
    """Block until every PE arrived (collective). Raises a pending data-plane error first.

    Does not complete UDMA work (as in CANN SHMEM): call ``aclshmemx_udma_quiet`` / ``_qp_quiet`` before it.
    """
    rt = runtime()
    rt.check_errors()
    barrier(rt, WaitCall.BARRIER_ALL)


def aclshmem_sync_all() -> None:
    """Same as ``aclshmem_barrier_all`` here: direct stores are complete on return, UDMA work is not."""
    rt = runtime()
    rt.check_errors()
    barrier(rt, WaitCall.SYNC_ALL)

"""shmemx: the CANN SHMEM / URMA (UDMA) programming model of Ascend NPUs, emulated with processes and shared memory.

Names follow CANN SHMEM (``aclshmem_*`` / ``aclshmemx_*``); arrays replace pointers; options are keyword-only.
See README.md for the API table and the design. The package is layered, one folder a layer: ``shm`` (the
shared-memory substrate), ``udma`` (the emulated data plane), ``observe`` (counters, traces, job reader, dumps),
``api`` (the calls re-exported here); ``runtime`` wires them.
"""

import sys as _sys

from .errors import (ClosedError, CompletionError, HeapExhaustedError, InternalError, NotInitializedError,
                     OtherHostError, PeerFailedError, ShmemError, StreamError, SubmitterError, SymmetryError,
                     WaitTimeoutError)
from .api.memory import (DEVICE_SIDE, HOST_SIDE, HeapInfo, aclshmem_align, aclshmem_calloc, aclshmem_free,
                         aclshmem_malloc, aclshmem_ptr, aclshmemx_align, aclshmemx_calloc, aclshmemx_free,
                         aclshmemx_get_heap_base, aclshmemx_malloc, array, empty, full, heap_info, prefault, zeros)
from .runtime import (ACLSHMEM_DATA_OP_MTE, ACLSHMEM_DATA_OP_ROCE, ACLSHMEM_DATA_OP_SDMA, ACLSHMEM_DATA_OP_UDMA,
                      ACLSHMEMX_INIT_WITH_DEFAULT, InitAttr, OptionalAttr, is_initialized)
from .api.signals import (ACLSHMEM_CMP_EQ, ACLSHMEM_CMP_GE, ACLSHMEM_CMP_GT, ACLSHMEM_CMP_LE, ACLSHMEM_CMP_LT,
                          ACLSHMEM_CMP_NE, ACLSHMEM_SIGNAL_ADD, ACLSHMEM_SIGNAL_SET, CmpOp, SignalOp,
                          aclshmem_signal_wait_until, aclshmem_test, aclshmem_test_all, aclshmem_test_any,
                          aclshmem_test_some, aclshmem_wait_until, aclshmem_wait_until_all, aclshmem_wait_until_any,
                          aclshmem_wait_until_some, aclshmemx_signal_op,
                          aclshmemx_signal_op_many)
from .udma import layout
from .udma.layout import (ACLSHMEMX_UDMA_ODR_NO, ACLSHMEMX_UDMA_ODR_RO, ACLSHMEMX_UDMA_ODR_SO,
                          ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT, ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE, ACLSHMEMX_UDMA_OP_CONFIG_SO,
                          CqeStatus, Odr, Opcode, OpConfig)
from .api.rma import (aclshmem_fence, aclshmem_quiet, aclshmemx_defer_t, aclshmemx_mte_get_nbi, aclshmemx_mte_put_nbi,
                      aclshmemx_mte_quiet, aclshmemx_submit_state_t, aclshmemx_submit_t, aclshmemx_udma_get_nbi,
                      aclshmemx_udma_put_nbi, aclshmemx_udma_put_signal_nbi, aclshmemx_udma_qp_get_nbi,
                      aclshmemx_udma_qp_put_nbi, aclshmemx_udma_qp_put_signal_nbi, aclshmemx_udma_qp_quiet,
                      aclshmemx_udma_quiet)
from .api.udma_atomics import (aclshmemx_udma_atomic_add, aclshmemx_udma_atomic_and,
                               aclshmemx_udma_atomic_compare_swap, aclshmemx_udma_atomic_fetch,
                               aclshmemx_udma_atomic_fetch_add, aclshmemx_udma_atomic_fetch_and,
                               aclshmemx_udma_atomic_fetch_inc, aclshmemx_udma_atomic_fetch_or,
                               aclshmemx_udma_atomic_fetch_xor, aclshmemx_udma_atomic_inc, aclshmemx_udma_atomic_or,
                               aclshmemx_udma_atomic_set, aclshmemx_udma_atomic_swap, aclshmemx_udma_atomic_xor)
from .api.blocks import (aclshmemx_barrier_all_vec, aclshmemx_sync_vec_all, get_block_idx, get_block_num, get_ub,
                         launch, sync_all)
from .api.raw import RawQueue, RawQueues, aclshmemx_udma_raw_queue
from .api.inspection import compute, count, native_access, region, stats
from .api import (engines as _engines, generic_rma as _generic_rma, generic_signals as _generic_signals,
                  lifecycle as _lifecycle, log as _log, mte_atomics as _mte_atomics, prof as _prof, sdma as _sdma,
                  streams as _streams, teams as _teams, typed_atomics as _typed_atomics, typed_waits as _typed_waits,
                  udma_relay as _udma_relay)
from .api.engines import *  # noqa: F401,F403 (each module's __all__, listed in __all__ below)
from .api.generic_rma import *  # noqa: F401,F403
from .api.generic_signals import *  # noqa: F401,F403
from .api.typed_waits import *  # noqa: F401,F403
from .api.mte_atomics import *  # noqa: F401,F403
from .api.typed_atomics import *  # noqa: F401,F403
from .api.streams import *  # noqa: F401,F403
from .api.lifecycle import *  # noqa: F401,F403
from .api.log import *  # noqa: F401,F403
from .api.prof import *  # noqa: F401,F403
from .api.udma_relay import *  # noqa: F401,F403
from .api.sdma import *  # noqa: F401,F403
from .api.teams import *  # noqa: F401,F403
from .observe.counters import JobStats
from .api.host import (aclshmem_barrier_all, aclshmem_finalize, aclshmem_my_pe, aclshmem_n_pes, aclshmem_sync_all,
                       aclshmemx_init_attr, aclshmemx_set_qp_num, finalize, init, my_pe, n_pes, qp_num)

# ``shmemx.layout`` (the WQE / CQE layouts, e.g. ``shmemx.layout.pack_wqe``) is the data plane's layout module
_sys.modules[__name__ + ".layout"] = layout

__version__ = "0.1.0"

__all__ = [
    # errors
    "ShmemError", "NotInitializedError", "ClosedError", "SymmetryError", "HeapExhaustedError", "WaitTimeoutError",
    "PeerFailedError", "CompletionError", "SubmitterError", "InternalError", "StreamError", "OtherHostError",
    # host
    "init", "finalize", "my_pe", "n_pes", "InitAttr", "OptionalAttr", "is_initialized",
    "aclshmemx_init_attr", "aclshmem_finalize", "aclshmem_my_pe", "aclshmem_n_pes", "aclshmemx_set_qp_num", "qp_num",
    "aclshmem_barrier_all", "aclshmem_sync_all",
    "ACLSHMEM_DATA_OP_MTE", "ACLSHMEM_DATA_OP_SDMA", "ACLSHMEM_DATA_OP_ROCE", "ACLSHMEM_DATA_OP_UDMA",
    "ACLSHMEMX_INIT_WITH_DEFAULT",
    # memory
    "aclshmem_malloc", "aclshmem_calloc", "aclshmem_align", "aclshmem_free", "aclshmem_ptr",
    "empty", "zeros", "full", "array", "prefault", "heap_info", "HeapInfo",
    "HOST_SIDE", "DEVICE_SIDE", "aclshmemx_malloc", "aclshmemx_calloc", "aclshmemx_align", "aclshmemx_free",
    "aclshmemx_get_heap_base",
    # signals and waits
    "ACLSHMEM_CMP_EQ", "ACLSHMEM_CMP_NE", "ACLSHMEM_CMP_GT", "ACLSHMEM_CMP_GE", "ACLSHMEM_CMP_LT",
    "ACLSHMEM_CMP_LE", "ACLSHMEM_SIGNAL_SET", "ACLSHMEM_SIGNAL_ADD", "CmpOp", "SignalOp",
    "aclshmemx_signal_op", "aclshmemx_signal_op_many", "aclshmem_signal_wait_until", "aclshmem_wait_until", "aclshmem_test",
    "aclshmem_wait_until_all", "aclshmem_wait_until_any", "aclshmem_wait_until_some",
    "aclshmem_test_all", "aclshmem_test_any", "aclshmem_test_some",
    # UDMA layouts and configs
    "Opcode", "Odr", "CqeStatus", "OpConfig", "ACLSHMEMX_UDMA_ODR_NO", "ACLSHMEMX_UDMA_ODR_RO",
    "ACLSHMEMX_UDMA_ODR_SO", "ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT", "ACLSHMEMX_UDMA_OP_CONFIG_SO",
    "ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE",
    # UDMA RMA, quiet, batching, MTE
    "aclshmemx_udma_put_nbi", "aclshmemx_udma_get_nbi", "aclshmemx_udma_qp_put_nbi", "aclshmemx_udma_qp_get_nbi",
    "aclshmemx_udma_put_signal_nbi", "aclshmemx_udma_qp_put_signal_nbi", "aclshmemx_udma_quiet",
    "aclshmemx_udma_qp_quiet", "aclshmemx_submit_state_t", "aclshmemx_defer_t", "aclshmemx_submit_t",
    "aclshmem_quiet", "aclshmem_fence", "aclshmemx_mte_put_nbi", "aclshmemx_mte_get_nbi", "aclshmemx_mte_quiet",
    # UDMA atomics
    "aclshmemx_udma_atomic_add", "aclshmemx_udma_atomic_fetch_add", "aclshmemx_udma_atomic_compare_swap",
    "aclshmemx_udma_atomic_fetch", "aclshmemx_udma_atomic_inc", "aclshmemx_udma_atomic_fetch_inc",
    "aclshmemx_udma_atomic_set", "aclshmemx_udma_atomic_swap", "aclshmemx_udma_atomic_and",
    "aclshmemx_udma_atomic_or", "aclshmemx_udma_atomic_xor", "aclshmemx_udma_atomic_fetch_and",
    "aclshmemx_udma_atomic_fetch_or", "aclshmemx_udma_atomic_fetch_xor",
    # kernels
    "launch", "get_block_idx", "get_block_num", "sync_all", "get_ub", "aclshmemx_sync_vec_all",
    "aclshmemx_barrier_all_vec",
    # raw WQE path
    "RawQueue", "RawQueues", "aclshmemx_udma_raw_queue",
    # inspection: trace regions, counters
    "region", "count", "stats", "JobStats", "compute", "native_access",
    # teams
    *_teams.__all__,
    # engine choice and UB configs; SDMA
    *_engines.__all__, *_sdma.__all__,
    # engine-agnostic RMA: putmem/getmem, typed and sized
    *_generic_rma.__all__, *_generic_signals.__all__,
    # typed waits and tests
    *_typed_waits.__all__,
    # MTE atomics, typed atomics
    *_mte_atomics.__all__, *_typed_atomics.__all__,
    # streams; the rest of init; logging
    *_streams.__all__, *_lifecycle.__all__, *_log.__all__, *_prof.__all__,
    # UDMA relay
    *_udma_relay.__all__,
]

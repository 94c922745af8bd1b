"""shmemx: the CANN SHMEM / URMA (UDMA) programming model of Ascend NPUs, emulated with processes and shared memory.

Names follow CANN SHMEM (``aclshmem_*`` / ``aclshmemx_*``); arrays replace pointers; options are keyword-only.
See README.md for the API table and the design.
"""

from .errors import (ClosedError, CompletionError, HeapExhaustedError, InternalError, NotInitializedError,
                     PeerFailedError, ShmemError, SubmitterError, SymmetryError, WaitTimeoutError)
from .memory import (aclshmem_align, aclshmem_calloc, aclshmem_free, aclshmem_malloc, aclshmem_ptr, array, empty,
                     full, zeros)
from .runtime import (ACLSHMEM_DATA_OP_MTE, ACLSHMEM_DATA_OP_ROCE, ACLSHMEM_DATA_OP_SDMA, ACLSHMEM_DATA_OP_UDMA,
                      ACLSHMEMX_INIT_WITH_DEFAULT, InitAttr, OptionalAttr, is_initialized)
from .signals import (ACLSHMEM_CMP_EQ, ACLSHMEM_CMP_GE, ACLSHMEM_CMP_GT, ACLSHMEM_CMP_LE, ACLSHMEM_CMP_LT,
                      ACLSHMEM_CMP_NE, ACLSHMEM_SIGNAL_ADD, ACLSHMEM_SIGNAL_SET, aclshmem_signal_wait_until,
                      aclshmem_test, aclshmem_test_all, aclshmem_test_any, aclshmem_test_some, aclshmem_wait_until,
                      aclshmem_wait_until_all, aclshmem_wait_until_any, aclshmem_wait_until_some,
                      aclshmemx_signal_op)
from .host import (aclshmem_barrier_all, aclshmem_finalize, aclshmem_my_pe, aclshmem_n_pes, aclshmem_sync_all,
                   aclshmemx_init_attr, aclshmemx_set_qp_num, finalize, init, my_pe, n_pes)

__version__ = "0.1.0"

__all__ = [
    # errors
    "ShmemError", "NotInitializedError", "ClosedError", "SymmetryError", "HeapExhaustedError", "WaitTimeoutError",
    "PeerFailedError", "CompletionError", "SubmitterError", "InternalError",
    # host
    "init", "finalize", "my_pe", "n_pes", "InitAttr", "OptionalAttr", "is_initialized",
    "aclshmemx_init_attr", "aclshmem_finalize", "aclshmem_my_pe", "aclshmem_n_pes", "aclshmemx_set_qp_num",
    "aclshmem_barrier_all", "aclshmem_sync_all",
    "ACLSHMEM_DATA_OP_MTE", "ACLSHMEM_DATA_OP_SDMA", "ACLSHMEM_DATA_OP_ROCE", "ACLSHMEM_DATA_OP_UDMA",
    "ACLSHMEMX_INIT_WITH_DEFAULT",
    # memory
    "aclshmem_malloc", "aclshmem_calloc", "aclshmem_align", "aclshmem_free", "aclshmem_ptr",
    "empty", "zeros", "full", "array",
    # signals and waits
    "ACLSHMEM_CMP_EQ", "ACLSHMEM_CMP_NE", "ACLSHMEM_CMP_GT", "ACLSHMEM_CMP_GE", "ACLSHMEM_CMP_LT",
    "ACLSHMEM_CMP_LE", "ACLSHMEM_SIGNAL_SET", "ACLSHMEM_SIGNAL_ADD",
    "aclshmemx_signal_op", "aclshmem_signal_wait_until", "aclshmem_wait_until", "aclshmem_test",
    "aclshmem_wait_until_all", "aclshmem_wait_until_any", "aclshmem_wait_until_some",
    "aclshmem_test_all", "aclshmem_test_any", "aclshmem_test_some",
]

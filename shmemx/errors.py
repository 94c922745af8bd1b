"""The exceptions shmemx raises.

One small hierarchy, so that a caller can catch every runtime failure with ``ShmemError`` and still tell a
protocol bug (``CompletionError``) from a hang (``WaitTimeoutError``) or a dead peer (``PeerFailedError``).
Every message names the PE and, where they apply, the peer, the QP and the address, e.g.
``pe 3: qp_put_nbi to pe 5 qp 1: remote range 0x1000..0x2000 outside segment tid 7 (len 0x800)``.

Bad arguments are not ``ShmemError``s: they raise ``ValueError`` / ``TypeError`` quoting the value, as numpy does.
"""

from __future__ import annotations

__all__ = [
    "ShmemError",
    "NotInitializedError",
    "ClosedError",
    "SymmetryError",
    "HeapExhaustedError",
    "WaitTimeoutError",
    "PeerFailedError",
    "CompletionError",
    "SubmitterError",
    "InternalError",
    "StreamError",
    "OtherHostError",
]


class ShmemError(RuntimeError):
    """Base class of every runtime failure shmemx reports."""


class NotInitializedError(ShmemError):
    """An API call needs ``shmemx.init()`` / ``aclshmemx_init_attr`` first."""


class ClosedError(ShmemError):
    """The runtime (or a resource of it) was finalized and cannot be used any more."""


class SymmetryError(ShmemError):
    """PEs disagreed on a collective call (different sizes, order or arguments).

    Raised on every PE taking part, before anything was changed, so the heap stays consistent.
    """


class HeapExhaustedError(ShmemError, MemoryError):
    """A symmetric allocation does not fit in what is left of the heap."""


class WaitTimeoutError(ShmemError, TimeoutError):
    """A wait, quiet or barrier passed its deadline.

    The message says who waits on what: the call, the address (allocation and offset), the condition and the
    value seen last.
    """


class PeerFailedError(ShmemError):
    """Another PE of the job failed or exited while this PE depended on it."""


class SubmitterError(ShmemError):
    """A second thread posted to a send queue (peer, qp) that another AIV block is using.

    As on the hardware, each (peer, qp) has one submitter at a time; hand the queue over with a quiet first.
    """


class InternalError(ShmemError):
    """An invariant of shmemx itself broke; please report it with the message."""


class StreamError(ShmemError):
    """An operation queued on an emulated ``aclrtStream`` failed; raised by the synchronize that ran it.

    Attributes:
        operation: what it was (``"aclshmemx_putmem_on_stream(pe=3)"``); index: its position in the stream
        (from 0, since the stream was created). The failure itself is ``__cause__``.
    """

    def __init__(self, message: str, *, operation: str = "", index: int = -1):
        super().__init__(message)
        self.operation = operation
        self.index = index


class CompletionError(ShmemError):
    """A completion queue entry reported an error.

    Attributes:
        cqe: the decoded CQE (a ``layout.Cqe``).
        wqe: the decoded WQE that produced it (a ``layout.Wqe``), when it could be recovered.
        pe, peer, qp_idx: the queue the CQE came from.
    """

    def __init__(self, message: str, *, cqe: object = None, wqe: object = None, pe: int = -1, peer: int = -1,
                 qp_idx: int = -1):
        super().__init__(message)
        self.cqe = cqe
        self.wqe = wqe
        self.pe = pe
        self.peer = peer
        self.qp_idx = qp_idx


class OtherHostError(ValueError):
    """A direct access (MTE copy, ``aclshmem_ptr`` view, load or store) to a PE of another host (``shmemx run
    --hosts``): its memory is not mapped here; the UDMA calls reach it. A ``ValueError``, as other refusals of a
    call's arguments are."""

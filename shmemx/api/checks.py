"""The argument checks of the API calls, each written once.

A check here is the definition of a valid argument: it returns the argument normalised (a numpy integer as an
int) or raises ``ValueError`` / ``TypeError`` naming the rank, the call, the peer and QP where they apply, and the
value. Hot calls (a put per token) first test a *sufficient* condition inline, the plain case that every check
here accepts (``type(pe) is int`` and in range, C-contiguous ndarrays of one dtype, ...), and call these checks
only when it fails; so the inline test can only skip a check that would pass, never accept what a check refuses
(``tests/test_udma.py`` runs every refused case through both).
"""

from __future__ import annotations

import numpy as np

from ..udma.layout import MAX_MSG_BYTES, OpConfig

__all__ = ["as_index", "check_pe", "check_target", "check_config", "transfer_bytes", "symmetric_offset"]


def _is_index(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def as_index(rt, where: str, name: str, value, lo: int = 0) -> int:
    """``value`` as an int >= ``lo`` (numpy integers too, not bools); ValueError quoting it otherwise."""
    if not _is_index(value) or value < lo:
        raise ValueError(f"pe {rt.my_pe}: {where}: {name} must be a non-negative integer, got {value!r}")
    return int(value)


def check_pe(rt, what: str, pe) -> int:
    """``pe`` as a PE number of the job (0..n_pes-1, this one included)."""
    if not _is_index(pe) or not 0 <= pe < rt.n_pes:
        raise ValueError(f"pe {rt.my_pe}: {what}: pe {pe!r} out of range 0..{rt.n_pes - 1}")
    return int(pe)


def check_target(rt, what: str, pe, qp_idx) -> tuple[int, int]:
    """(pe, qp_idx) of a UDMA call: another PE of the job and one of its ``qp_num`` QPs."""
    if not _is_index(pe) or not 0 <= pe < rt.n_pes:
        raise ValueError(f"pe {rt.my_pe}: {what} to pe {pe!r} qp {qp_idx!r}: pe {pe!r} out of range "
                         f"0..{rt.n_pes - 1}")
    if pe == rt.my_pe:
        raise ValueError(f"pe {rt.my_pe}: {what} to itself (pe {pe} qp {qp_idx!r}): UDMA to the own PE is not "
                         f"allowed (use a local copy or aclshmemx_mte_put_nbi)")
    if not _is_index(qp_idx) or not 0 <= qp_idx < rt.qp_num:
        raise ValueError(f"pe {rt.my_pe}: {what} to pe {pe}: qp_idx {qp_idx!r} out of range 0..{rt.qp_num - 1} "
                         f"(qp_num is {rt.qp_num}; raise it with aclshmemx_set_qp_num before init)")
    return int(pe), int(qp_idx)


def check_config(rt, what: str, config) -> OpConfig:
    if not isinstance(config, OpConfig):
        raise TypeError(f"pe {rt.my_pe}: {what}: config must be an OpConfig (e.g. ACLSHMEMX_UDMA_OP_CONFIG_SO), "
                        f"got {config!r}")
    return config


def check_contiguous(rt, where: str, role: str, arr, why: str) -> None:
    """That ``arr`` is a C-contiguous numpy array (``why``: the reason the call needs it, for the message)."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"pe {rt.my_pe}: {where}: {role} must be a numpy array, got {type(arr).__name__}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"pe {rt.my_pe}: {where}: {role} must be C-contiguous {why}")


def transfer_bytes(rt, where: str, nelems, arrays: dict) -> int:
    """Bytes moved by a transfer of ``nelems`` elements between ``arrays`` (``{role: array}``): numpy arrays,
    C-contiguous (one SGE covers one range), of one dtype, each holding ``nelems``; at most 256 MiB."""
    nelems = as_index(rt, where, "nelems", nelems)
    for role, arr in arrays.items():
        check_contiguous(rt, where, role, arr, "(one SGE covers one contiguous range); pass a contiguous slice")
        if arr.size < nelems:
            raise ValueError(f"pe {rt.my_pe}: {where}: nelems {nelems} but {role} has only {arr.size} elements")
    if len({arr.dtype for arr in arrays.values()}) > 1:
        listing = ", ".join(f"{role} {arr.dtype}" for role, arr in arrays.items())
        raise TypeError(f"pe {rt.my_pe}: {where}: dtype mismatch ({listing})")
    nbytes = nelems * next(iter(arrays.values())).itemsize
    if nbytes > MAX_MSG_BYTES:
        raise ValueError(f"pe {rt.my_pe}: {where}: {nbytes} B is over the 256 MiB limit of one UDMA request; "
                         f"split it")
    return nbytes


def symmetric_offset(rt, where: str, arr, nbytes: int, pe: int, role: str) -> int:
    """The heap offset of the symmetric address ``arr`` (a view of any PE's copy of the heap), whose first
    ``nbytes`` (at least one) must lie in a live allocation; used on PE ``pe``."""
    try:
        _, off = rt.heap.locate(arr, role)
    except ValueError as exc:
        raise ValueError(f"pe {rt.my_pe}: {where}: {role} must be a heap array (the symmetric address on the "
                         f"peer): {str(exc).split(': ', 1)[-1]}") from None
    rt.heap.check_allocated(off, max(nbytes, 1), f"{where} {role}", pe)
    return off

"""The typed point-to-point waits and tests, ``aclshmem_<T>_wait_until`` ... ``_test_some_vector``, for CANN's ten
P2P types (float, int8, int16, int32, int64, uint8, uint16, uint32, uint64, char).

Each is the generic word wait of ``api.signals`` (one wait path: the native sleep on the wake word of the PE
whose memory holds the words, the recorders, the checker) after a check that the words are of the named type.
Signatures follow the device header (``include/device/gm2gm/shmem_device_p2p_sync.h``), arrays for pointers:

* ``wait_until(ivar, cmp, cmp_value)``; ``wait(ivar, cmp_value)``: until ``ivar[0] != cmp_value``;
* ``wait_until_all/any/some(ivars, nelems, [indices,] status, cmp, cmp_value)`` over ``ivars[:nelems]``
  (``status``: None or ``nelems`` ints, nonzero excludes a word); ``any`` returns the index of a word that met
  it, ``SIZE_MAX`` when the set is empty; ``some`` writes the indices that met it into ``indices`` and returns
  how many;
* the ``_vector`` forms take ``cmp_values`` (one value per word) in place of ``cmp_value``;
* ``test(ivar, cmp, cmp_value)`` returns 1 or 0; ``test_any`` an index or ``SIZE_MAX``; ``test_some`` a count
  (and ``indices``); ``test_all_vector`` 1 or 0. Tests never block.

A float word compares as a float32 (its comparison value rounded to float32); a ``char`` array may be int8,
uint8 or ``S1`` (compared as uint8).
"""

from __future__ import annotations


import numpy as np

from ..runtime import runtime
from .elements import P2P_TYPES, SIZE_MAX, check_type, install
from .signals import (ACLSHMEM_CMP_NE, aclshmem_test, aclshmem_test_all, aclshmem_test_any, aclshmem_test_some,
                      aclshmem_wait_until, aclshmem_wait_until_all, aclshmem_wait_until_any,
                      aclshmem_wait_until_some)

__all__ = ["SIZE_MAX"]


def _words(rt, what: str, t: str, ivars, nelems=None) -> np.ndarray:
    check_type(rt, what, t, ivars=ivars)
    if ivars.dtype == np.dtype("S1"):
        ivars = ivars.view(np.uint8)
    if nelems is None:
        return ivars
    if isinstance(nelems, bool) or not isinstance(nelems, (int, np.integer)) or not 0 <= nelems <= ivars.size:
        raise ValueError(f"pe {rt.my_pe}: {what}: nelems {nelems!r} out of range 0..{ivars.size} (the size of ivars)")
    return ivars.reshape(-1)[:int(nelems)]


def _status(rt, what: str, status, n: int):
    if status is None:
        return None
    status = np.asarray(status).reshape(-1)
    if status.size < n:
        raise ValueError(f"pe {rt.my_pe}: {what}: status has {status.size} entries for {n} ivars")
    return status[:n]


def _values(rt, what: str, cmp_values, n: int) -> np.ndarray:
    values = np.asarray(cmp_values).reshape(-1)
    if values.size < n:
        raise ValueError(f"pe {rt.my_pe}: {what}: cmp_values has {values.size} entries for {n} ivars")
    return values[:n]


def _fill(rt, what: str, indices, found: list[int]) -> int:
    if not isinstance(indices, np.ndarray) or indices.size < len(found):
        raise ValueError(f"pe {rt.my_pe}: {what}: indices must be an array with room for {len(found)} indices")
    indices.reshape(-1)[:len(found)] = found
    return len(found)


def _make(t: str, op: str):
    """The function ``aclshmem_<t>_<op>``."""
    what = f"aclshmem_{t}_{op}"
    vector = op.endswith("_vector")
    kind = op.removesuffix("_vector")

    def value_of(rt, ivars, value):
        return _values(rt, what, value, ivars.size) if vector else value

    def one(ivar, cmp, cmp_value):  # wait_until, test
        rt = runtime()
        w = _words(rt, what, t, ivar)
        if kind == "test":
            return int(aclshmem_test(w, cmp, cmp_value))
        aclshmem_wait_until(w, cmp, cmp_value)

    def wait(ivar, cmp_value):
        aclshmem_wait_until(_words(runtime(), what, t, ivar), ACLSHMEM_CMP_NE, cmp_value)

    def many(ivars, nelems, status, cmp, cmp_value):  # wait_until_all/any, test_any, test_all
        rt = runtime()
        w = _words(rt, what, t, ivars, nelems)
        st, v = _status(rt, what, status, w.size), value_of(rt, w, cmp_value)
        if kind == "wait_until_all":
            aclshmem_wait_until_all(w, cmp, v, st)
            return None
        if kind == "test_all":
            return int(aclshmem_test_all(w, cmp, v, st))
        found = (aclshmem_wait_until_any if kind == "wait_until_any" else aclshmem_test_any)(w, cmp, v, st)
        return SIZE_MAX if found is None else found

    def some(ivars, nelems, indices, status, cmp, cmp_value):  # wait_until_some, test_some
        rt = runtime()
        w = _words(rt, what, t, ivars, nelems)
        st, v = _status(rt, what, status, w.size), value_of(rt, w, cmp_value)
        found = (aclshmem_wait_until_some if kind == "wait_until_some" else aclshmem_test_some)(w, cmp, v, st)
        return _fill(rt, what, indices, found)

    fn = {"wait_until": one, "test": one, "wait": wait, "wait_until_some": some, "test_some": some}.get(kind, many)
    fn.__doc__ = f"CANN's ``{what}`` on {t} words (see the module docstring)."
    return what, fn


_OPS = ("wait_until", "wait", "wait_until_all", "wait_until_any", "wait_until_some", "wait_until_all_vector",
        "wait_until_any_vector", "wait_until_some_vector", "test", "test_any", "test_some", "test_all_vector",
        "test_any_vector", "test_some_vector")


install(__name__, (_make(t, op) for t in P2P_TYPES for op in _OPS), __all__)

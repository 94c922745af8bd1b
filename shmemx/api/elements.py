"""CANN's element types and sizes as numpy dtypes, and the check that an array is of the type a typed call names.

The typed families (``aclshmem_<T>_put``, ``aclshmem_<T>_wait_until``, ``aclshmem_<T>_atomic_add``, ...) are made
from these tables by the modules that define them; a typed call checks that its arrays have the named type
(``check_type``) and then calls the one generic implementation, so every ``<T>`` behaves the same.

``char`` is any 1-byte element (int8, uint8, ``S1``): C's ``char`` is signed on x86 and unsigned on AArch64
hosts, and a byte array is what a kernel passes for it. Words of ``S1`` arrays compare as uint8.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np

__all__ = ["RMA_TYPES", "P2P_TYPES", "SIZES", "SIZE_DTYPES", "check_type", "type_name", "SIZE_MAX", "install"]

SIZE_MAX = (1 << 64) - 1  # what CANN's size_t results hold for "none" (an empty wait_until_any)

# ACLSHMEM_TYPE_FUNC of include/device/gm2gm/shmem_device_rma.h: the RMA and put_signal types
RMA_TYPES = {
    "half": np.dtype(np.float16), "float": np.dtype(np.float32), "double": np.dtype(np.float64),
    "int8": np.dtype(np.int8), "int16": np.dtype(np.int16), "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64), "uint8": np.dtype(np.uint8), "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32), "uint64": np.dtype(np.uint64), "char": np.dtype(np.int8),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
# ACLSHMEM_P2P_SYNC_TYPE_FUNC of include/host_device/shmem_common_types.h: the wait and test types
P2P_TYPES = {name: RMA_TYPES[name] for name in ("float", "int8", "int16", "int32", "int64", "uint8", "uint16",
                                                 "uint32", "uint64", "char")}
# ACLSHMEM_SIZE_FUNC: the put<N> / get<N> element sizes in bits, and a dtype of that size
SIZES = (8, 16, 32, 64, 128)
SIZE_DTYPES = {8: np.dtype(np.uint8), 16: np.dtype(np.uint16), 32: np.dtype(np.uint32), 64: np.dtype(np.uint64),
               128: np.dtype("V16")}
_CHAR = {np.dtype(np.int8), np.dtype(np.uint8), np.dtype("S1")}


def _matches(name: str, dtype: np.dtype) -> bool:
    if name == "char":
        return dtype in _CHAR
    return dtype == RMA_TYPES[name]


def check_type(rt, what: str, name: str, **arrays) -> None:
    """TypeError unless every array (keyword = the argument's name) is a numpy array of CANN type ``name``."""
    for role, arr in arrays.items():
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"pe {rt.my_pe}: {what}: {role} must be a numpy array of {name}, got "
                            f"{type(arr).__name__}")
        if not _matches(name, arr.dtype):
            raise TypeError(f"pe {rt.my_pe}: {what}: {role} has dtype {arr.dtype}, not {name} "
                            f"({'a 1-byte type' if name == 'char' else RMA_TYPES[name]})")


def type_name(dtype: np.dtype) -> str:
    """The CANN type name of a numpy dtype (the first that matches), or its numpy name."""
    for name in RMA_TYPES:
        if name != "char" and _matches(name, dtype):
            return name
    return str(dtype)


def install(module: str, made: Iterable[tuple[str, Callable]], names: list[str]) -> None:
    """Bind a typed family's functions ``(name, fn)`` in ``module`` under their CANN names and list each in
    ``names`` (the module's ``__all__``)."""
    target = sys.modules[module]
    for name, fn in made:
        fn.__name__ = fn.__qualname__ = name
        setattr(target, name, fn)
        names.append(name)

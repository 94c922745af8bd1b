"""Heap arrays whose reads and writes ``--check`` observes: ``CheckedArray``, an ndarray subclass.

In check mode the allocation calls and ``aclshmem_ptr`` hand out ``CheckedArray`` views of the heap; everything
derived from them (slices, reshapes, ``.view``) is one too. Each way numpy lets Python see an access reports
it to the checker (``recorder.Checker.access``) with the kernel's file:line, then runs on a plain view:

* ufuncs (``a + 1``, ``a == b``, ``a.sum()``, ``np.add(a, b, out=c)``, ``a += 1``): operands read, ``out``
  written; numpy functions (``np.copyto``, ``np.take``, ``np.array_equal``, ``np.concatenate``...): array
  arguments read, ``out=`` and the destination of ``copyto`` / ``put`` / ``place`` / ``putmask`` written;
* indexing: ``a[i]`` giving a scalar, or an index array giving a copy, reads; ``a[k] = v`` writes (the rows of
  an index array exactly, other advanced keys as their hull, marked approximate);
* methods that read or write without a ufunc (``copy``, ``astype``, ``tolist``, ``tobytes``, ``item``,
  ``argmax``, ``fill``, ``sort``...), conversion to a Python number, iteration, printing;
* a derived view that dies unused before the thread's next event was consumed by C code (``dst[:] =
  heap[a:b]``): a read (``Checker.flush``). A view kept in a variable and later read by C code is not seen.

Reads are stamped after the access and writes before it, so that a flag stored with a plain store or polled
with a plain load orders like a release and an acquire (``events``). Accesses made by shmemx's own code (the
API reading a put's source) are not reported: the events of the call model them. Results and copies are plain
ndarrays.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ...shm.heap import data_address

__all__ = ["CheckedArray", "install", "uninstall", "wrap", "note_access", "plain"]

_ck = None  # the process's Checker while installed
_heap = None
_now = time.perf_counter_ns
_MAX_RUNS = 4096  # more separate runs than this in one access: its hull, marked approximate
_WRITES = {"copyto": 0, "put": 0, "place": 0, "putmask": 0, "fill_diagonal": 0, "put_along_axis": 0}


def install(checker: Any, heap: Any) -> None:
    global _ck, _heap
    _ck, _heap = checker, heap


def uninstall() -> None:
    global _ck, _heap
    _ck = _heap = None


def wrap(arr: np.ndarray, direct: bool = False) -> np.ndarray:
    """``arr`` (a heap view) as a CheckedArray, when the checker is installed; ``direct``: an aclshmem_ptr view,
    whose stores are direct stores into that PE's memory (they order like signal_op)."""
    if _ck is None or arr is None:
        return arr
    view = arr.view(CheckedArray)
    view._direct = direct
    return view


def _plain(x):
    return x.view(np.ndarray) if isinstance(x, CheckedArray) else x


def plain(arr: np.ndarray) -> np.ndarray:
    """``arr`` as a plain ndarray of the same memory (a CheckedArray's view; anything else as it is)."""
    return _plain(arr)


def note_access(arr: np.ndarray, key: object = None, write: bool = False) -> None:
    """Native code of a kernel read (or wrote) ``arr[key]`` (the whole view when ``key`` is None): under
    ``--check`` an access of the kernel line that called, as the numpy operation it replaces would be; nothing
    otherwise. ``key`` may be a function that makes the key. Call it after a read, before a write."""
    ck = _ck
    if ck is None or not isinstance(arr, CheckedArray):
        return
    site = ck.caller(3)
    if site < 0:
        return
    if callable(key):
        key = key()
    r = _ranges(arr) if key is None else _key_ranges(arr, key)
    if r is not None and r[1]:
        ck.access(r[0], r[1], write, site, approx=r[2])


def _runs(arr: np.ndarray, base: int) -> tuple[list, bool]:
    """(byte ranges as [(heap offset, length)], approximate) of the memory of ``arr`` whose first element is at
    heap offset ``base``."""
    if arr.size == 0:
        return [], False
    if arr.flags.c_contiguous:
        return [(base, arr.nbytes)], False
    shape, strides, item = arr.shape, arr.strides, arr.itemsize
    inner, k = item, arr.ndim
    while k > 0 and strides[k - 1] == inner:  # the trailing dimensions that are contiguous
        inner *= shape[k - 1]
        k -= 1
    outer = int(np.prod(shape[:k], dtype=np.int64))
    if outer > _MAX_RUNS:
        lo = base + sum(min(0, s * (n - 1)) for s, n in zip(strides, shape))
        hi = base + item + sum(max(0, s * (n - 1)) for s, n in zip(strides, shape))
        return [(lo, hi - lo)], True
    offs = np.zeros(1, np.int64)
    for n, s in zip(shape[:k], strides[:k]):
        offs = (offs[:, None] + np.arange(n, dtype=np.int64) * s).reshape(-1)
    return _merge(base + offs, inner), False


def _merge(starts, length: int) -> list:
    starts = np.sort(np.asarray(starts, np.int64))
    if len(starts) == 1:
        return [(int(starts[0]), length)]
    breaks = np.flatnonzero(starts[1:] > starts[:-1] + length) + 1
    firsts = np.concatenate(([0], breaks))
    lasts = np.concatenate((breaks - 1, [len(starts) - 1]))
    return list(zip(starts[firsts].tolist(), (starts[lasts] - starts[firsts] + length).tolist()))


def _where(arr: np.ndarray):
    """(pe, heap offset of the first element) of a view, or None when it is not heap memory (a copy)."""
    if _heap is None:
        return None
    return _heap.locate_address(data_address(arr))


def _ranges(arr: np.ndarray):
    """(pe, ranges, approximate) of a whole view, or None."""
    found = _where(arr)
    if found is None:
        return None
    runs, approx = _runs(arr, found[1])
    return found[0], runs, approx


def _basic(key) -> bool:
    if type(key) is int or type(key) is slice:
        return True
    parts = key if isinstance(key, tuple) else (key,)
    return all(p is None or p is Ellipsis or isinstance(p, (slice, int, np.integer)) and not isinstance(p, bool)
               for p in parts)


def _key_ranges(arr: np.ndarray, key):
    """(pe, ranges, approximate) of the elements ``arr[key]`` selects, or None. Exact for basic keys and for
    advanced ones whose index arrays (and ints) come first, followed by basic parts (``a[rows]``, ``a[rows, 2:]``,
    ``a[g, toks]``, ``a[g_arr, t_arr]``); other keys give the view's hull, marked approximate."""
    plain = arr.view(np.ndarray)
    if _basic(key):
        parts = key if isinstance(key, tuple) else (key,)
        sel = plain[parts + (Ellipsis,)] if Ellipsis not in parts else plain[key]
        return _ranges(sel)
    parts = key if isinstance(key, tuple) else (key,)
    k = 0
    while k < len(parts) and k < arr.ndim and not (parts[k] is None or parts[k] is Ellipsis
                                                    or isinstance(parts[k], slice)):
        k += 1
    lead, rest = parts[:k], parts[k:]
    if not lead or not _basic(rest) or Ellipsis in rest:
        return _hull(arr)
    found = _where(arr)
    if found is None:
        return None
    try:
        idx = []
        for p, n in zip(lead, arr.shape):
            p = np.asarray(p)
            if p.dtype == bool:
                if p.ndim != 1 or len(lead) != 1:
                    return _hull(arr)
                p = np.flatnonzero(p)
            idx.append(np.where(p < 0, p + n, p).astype(np.int64))
        idx = np.broadcast_arrays(*idx)
    except ValueError:
        return _hull(arr)
    offs = sum(i.reshape(-1) * st for i, st in zip(idx, arr.strides))
    if len(offs) == 0:
        return found[0], [], False
    inner_view = plain[(0,) * k + tuple(rest) + (Ellipsis,)]
    inner, approx = _runs(inner_view, found[1] + (data_address(inner_view) - data_address(plain)))
    if approx or len(offs) * len(inner) > _MAX_RUNS:
        return _hull(arr)
    starts = offs[:, None] + np.array([o for o, _ in inner], np.int64)[None, :]
    if len(inner) == 1:
        return found[0], _merge(starts.reshape(-1), inner[0][1]), False
    return found[0], [(int(x), n) for r in starts for x, (_, n) in zip(r, inner)], False


def _hull(arr: np.ndarray):
    r = _ranges(arr)
    if r is None:
        return None
    pe, runs, _ = r
    if not runs:
        return pe, runs, True
    lo = min(o for o, _ in runs)
    hi = max(o + n for o, n in runs)
    return pe, [(lo, hi - lo)], True


def _value(plain_sel) -> int | None:
    """The bytes of a small selection as an int (little-endian): the first 8 bytes, or 0 when it is all zero."""
    if not isinstance(plain_sel, np.ndarray):
        plain_sel = np.asarray(plain_sel)
    n = plain_sel.nbytes
    if n <= 8:
        return int.from_bytes(plain_sel.tobytes(), "little")
    if n <= 65536:
        data = plain_sel.tobytes()
        if data.count(0) == n:
            return 0
    return None


def _read(x, site: int, ts=None) -> None:
    r = _ranges(x)
    if r is not None and r[1]:
        _ck.access(r[0], r[1], False, site, ts, approx=r[2])


def _write(x, site: int, ts: int, value=None) -> None:
    r = _ranges(x)
    if r is not None and r[1]:
        _ck.access(r[0], r[1], True, site, ts, value, approx=r[2], direct=x._direct)


def _arrays(obj, out: list) -> list:
    """Every CheckedArray in ``obj`` and the lists/tuples it holds (numpy functions take sequences of arrays)."""
    if isinstance(obj, CheckedArray):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _arrays(o, out)
    return out


def _unwrap(obj):
    if isinstance(obj, CheckedArray):
        return obj.view(np.ndarray)
    if isinstance(obj, list):
        return [_unwrap(o) for o in obj]
    if isinstance(obj, tuple):
        return tuple(_unwrap(o) for o in obj)
    return obj


class CheckedArray(np.ndarray):
    """A heap view whose accesses the checker records (see the module docstring)."""

    _direct = False  # an aclshmem_ptr view (and what derives from it)

    def __array_finalize__(self, obj):
        ck = _ck
        if ck is None or not isinstance(obj, CheckedArray):
            return
        if obj._direct:
            self._direct = True
        site = ck.caller(2)
        if site < 0:
            return
        ck.flush()
        if self.flags.c_contiguous:  # the common view: where it is, worked out only if it dies unused
            ck.derived(self, data_address(self), self.nbytes, site)
            return
        r = _ranges(self)
        if r is None:  # a copy made by C code (ravel of a strided view ...): obj was read
            _read(obj, site)
        elif r[1]:
            ck.derived(self, r[0], r[1], site)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        ck = _ck
        out = kwargs.get("out")
        outs = out if isinstance(out, tuple) else (() if out is None else (out,))
        site = ck.caller(2) if ck is not None else -1
        if site >= 0:
            ck.flush()
            ts = _now()
        args = tuple(_plain(x) for x in inputs)
        if outs:
            kwargs["out"] = tuple(_plain(o) for o in outs)
        result = getattr(ufunc, method)(*args, **kwargs)
        if site >= 0:
            written = [o for o in outs if isinstance(o, CheckedArray)]
            if method == "at" and isinstance(inputs[0], CheckedArray):
                written.append(inputs[0])
            for o in written:
                _write(o, site, ts, _value(o.view(np.ndarray)) if o.nbytes <= 8 else None)
            for x in inputs:
                if isinstance(x, CheckedArray):
                    _read(x, site)
        if outs and method != "at":
            return outs[0] if len(outs) == 1 else outs
        return result

    def __array_function__(self, func, types, args, kwargs):
        ck = _ck
        site = ck.caller(2) if ck is not None else -1
        if site < 0:
            return func(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()})
        ck.flush()
        ts = _now()
        name = func.__name__
        written = []
        out = kwargs.get("out")
        if isinstance(out, CheckedArray):
            written.append(out)
        if name in _WRITES and args and isinstance(args[0], CheckedArray):
            written.append(args[0])
        read = [a for a in _arrays(list(args) + [v for k, v in kwargs.items() if k != "out"], [])
                if not any(a is w for w in written) or name not in _WRITES]
        result = func(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()})
        for w in written:
            _write(w, site, ts, _value(w.view(np.ndarray)) if w.nbytes <= 8 else None)
        if name == "take" and read and read[0] is args[0] and len(args) >= 2:
            axis = kwargs.get("axis", args[2] if len(args) > 2 else None)
            r = _key_ranges(args[0], args[1]) if axis == 0 else _ranges(args[0])
            if r is not None and r[1]:
                ck.access(r[0], r[1], False, site, approx=r[2])
            read = read[1:]
        for a in read:
            _read(a, site)
        if isinstance(out, CheckedArray) and isinstance(result, np.ndarray) and not isinstance(result, CheckedArray):
            return out
        return result

    def __getitem__(self, key):
        basic = _basic(key)
        result = np.ndarray.__getitem__(self if basic else self.view(np.ndarray), key)
        ck = _ck
        if ck is None or isinstance(result, CheckedArray):
            return result  # a view: __array_finalize__ took it
        site = ck.caller(2)
        if site < 0:
            return result
        ck.flush()
        r = _key_ranges(self, key)
        if r is not None and r[1]:
            value = _value(np.asarray(result)) if not isinstance(result, np.ndarray) else None
            ck.access(r[0], r[1], False, site, value=value, approx=r[2])
        return result

    def __setitem__(self, key, value):
        ck = _ck
        site = ck.caller(2) if ck is not None else -1
        if site < 0:
            np.ndarray.__setitem__(self, key, _plain(value))
            return
        ck.flush()
        ts = _now()
        np.ndarray.__setitem__(self, key, _plain(value))
        r = _key_ranges(self, key)
        if r is not None and r[1]:
            small = _value(self.view(np.ndarray)[key]) if len(r[1]) == 1 and _basic(key) else None
            ck.access(r[0], r[1], True, site, ts, small, approx=r[2], direct=self._direct)
        if isinstance(value, CheckedArray):
            _read(value, site)

    # methods that read without a ufunc: record, then run on the plain view
    def _reading(name):
        def method(self, *args, **kwargs):
            ck = _ck
            site = ck.caller(2) if ck is not None else -1
            result = getattr(self.view(np.ndarray), name)(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()})
            if site >= 0:
                ck.flush()
                value = _value(self.view(np.ndarray)) if self.nbytes <= 8 else None
                r = _ranges(self)
                if r is not None and r[1]:
                    ck.access(r[0], r[1], False, site, value=value, approx=r[2])
            return result.view(np.ndarray) if isinstance(result, CheckedArray) else result
        method.__name__ = name
        return method

    def _writing(name):
        def method(self, *args, **kwargs):
            ck = _ck
            site = ck.caller(2) if ck is not None else -1
            if site >= 0:
                ck.flush()
                ts = _now()
            result = getattr(self.view(np.ndarray), name)(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()})
            if site >= 0:
                _write(self, site, ts, _value(self.view(np.ndarray)))
            return result
        method.__name__ = name
        return method

    for _name in ("copy", "astype", "tolist", "tobytes", "item", "argmax", "argmin", "argsort", "argpartition",
                  "nonzero", "searchsorted", "dot", "take", "repeat", "cumsum", "cumprod", "flatten", "compress",
                  "choose", "clip", "round", "tofile", "dumps", "sum", "prod", "mean", "std", "var", "min", "max",
                  "all", "any", "ptp", "trace", "__int__", "__float__", "__bool__", "__index__", "__complex__",
                  "__bytes__", "__repr__", "__str__", "__format__", "__reduce__", "__reduce_ex__", "__copy__",
                  "__deepcopy__"):
        if hasattr(np.ndarray, _name):
            locals()[_name] = _reading(_name)
    for _name in ("fill", "sort", "partition", "put", "itemset", "byteswap", "setfield"):
        if hasattr(np.ndarray, _name):
            locals()[_name] = _writing(_name)
    del _name, _reading, _writing

    def __iter__(self):
        if self.ndim <= 1:
            ck = _ck
            site = ck.caller(2) if ck is not None else -1
            if site >= 0:
                ck.flush()
                _read(self, site)
            return iter(self.view(np.ndarray))
        return (self[i] for i in range(len(self)))

"""Loads and stores of registered local arrays while a WQE may still use them: line tracing in check mode.

A put's source or a get's (or fetching atomic's) destination may be a plain numpy array of the posting process.
numpy tells Python nothing about its reads and writes, so ``--check`` watches the *lines* of kernel code instead:
from the post of a WQE whose local side is a registered (non-heap) array until the quiet that retires it, every
kernel frame of the PE's threads that holds a variable bound to that array (or a view of it) is line-traced
(``sys.settrace`` for this thread's new calls, ``frame.f_trace`` for the frames already running). At each line
the variables the line loads are looked up; one that is an ndarray over in-flight bytes is an access of the line:

* a store when the line stores through it (``buf[k] = v``, ``buf[a:b] = v``, ``buf[k] += v``, ``buf.fill(v)`` and
  the other writing methods), else a load (``buf[k]``, ``buf.sum()``, ``print(buf)``, ``f(buf)``), except that an
  array handed whole to a Python function of the kernel's own (``consume(buf)``) is not an access of the line: the
  function's lines are traced;
* of the element or slice a constant subscript names (``buf[3]``, ``buf[8:]``), else of the whole array;
* lines that call the API (a name starting with ``aclshmem``, or a variable holding such a function) are not
  accesses: the call's own events model what it does with the array (a put from it is a POST that reads it).

Each access is one ``LOCAL_ACCESS`` record (``events``) with the line's site; the launcher decides with
happens-before whether it races a WQE (``analyze.on_local_access``). What this cannot see: arrays reached
through attributes, containers or closures' cells other than plain variables (``self.buf[0]``, ``bufs[i][0]``
are not looked up), accesses by C code that got the array earlier (a thread pool), and the accesses of another
thread of the PE before its next checker event after the post (a thread starts tracing at its next event:
a post, quiet, wait, signal, barrier or ``sync_all``). What it costs: nothing while no local array is in flight
(``--check`` only; plain runs never load this module); while one is, a Python call of the posting thread's
costs a trace call, and each line of a frame that holds the array a few microseconds.
"""

from __future__ import annotations

import dis
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType, FunctionType

import numpy as np

from ...shm.heap import data_address

__all__ = ["LocalWatch"]

_M32 = 0xFFFF_FFFF
_HALF = 1 << 31
_LOADS = {"LOAD_FAST", "LOAD_NAME", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLASSDEREF"}
_KEY_PARTS = {"LOAD_CONST", "LOAD_FAST", "LOAD_NAME", "LOAD_GLOBAL", "LOAD_DEREF", "BUILD_SLICE", "BUILD_TUPLE",
              "UNARY_NEGATIVE"}
_WRITING = {"fill", "sort", "partition", "put", "itemset", "byteswap", "setfield", "resize"}
_SHMEMX_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_NUMPY_DIR = os.path.dirname(np.__file__) + os.sep
# the launcher's frames (below every kernel's: they never hold its arrays) are shmemx's too; installed, it lies in
# shmemx's folder; in a source tree (an editable install) beside it
_LAUNCHER = importlib.util.find_spec("shmemx.launcher")
_LAUNCHER_DIRS = tuple(os.path.abspath(d) + os.sep for d in (_LAUNCHER and _LAUNCHER.submodule_search_locations or ()))
_INTERNAL = (_SHMEMX_DIR, _NUMPY_DIR, os.path.dirname(os.__file__) + os.sep) + _LAUNCHER_DIRS


def _extent(arr: np.ndarray) -> tuple[int, int]:
    """[lo, hi) process addresses of an array's bytes (the hull of a strided one)."""
    base = data_address(arr)
    if arr.flags.c_contiguous or arr.size == 0:
        return base, base + arr.nbytes
    lo = base + sum(min(0, s * (n - 1)) for s, n in zip(arr.strides, arr.shape))
    hi = base + arr.itemsize + sum(max(0, s * (n - 1)) for s, n in zip(arr.strides, arr.shape))
    return lo, hi


def _line_uses(code) -> dict:
    """{line: ((name, write, key), ...)} of a code object: the variables each line loads, whether the line stores
    through them, and the constant subscript it applies (None: the whole array); () for a line calling the API."""
    by_line: dict[int, list] = {}
    api_lines = set()
    instrs = list(dis.get_instructions(code))
    for i, ins in enumerate(instrs):
        line = ins.positions.lineno if ins.positions else None
        if line is None:
            continue
        if isinstance(ins.argval, str) and ins.argval.startswith("aclshmem"):
            api_lines.add(line)
        if ins.opname in _LOADS and isinstance(ins.argval, str):
            by_line.setdefault(line, []).append((ins.argval,) + _use(instrs, i))
    return {line: (() if line in api_lines else tuple(uses)) for line, uses in by_line.items()}


def _use(instrs: list, i: int) -> tuple[bool, object]:
    """(write, constant key or None) of the variable loaded by ``instrs[i]``."""
    j, consts, stack = i + 1, True, []
    while j < len(instrs) and instrs[j].opname in _KEY_PARTS:
        ins = instrs[j]
        if ins.opname == "LOAD_CONST":
            stack.append(ins.argval)
        elif ins.opname == "BUILD_SLICE" and consts and len(stack) >= ins.arg:
            stack[-ins.arg:] = [slice(*stack[-ins.arg:])]
        elif ins.opname == "BUILD_TUPLE" and consts and len(stack) >= ins.arg:
            stack[-ins.arg:] = [tuple(stack[-ins.arg:])]
        elif ins.opname == "UNARY_NEGATIVE" and consts and stack and isinstance(stack[-1], int):
            stack[-1] = -stack[-1]
        else:
            consts = False
        j += 1
    nxt = instrs[j].opname if j < len(instrs) else ""
    key = stack[0] if consts and len(stack) == 1 and j > i + 1 else None
    if nxt == "STORE_SUBSCR" and j > i + 1:
        return True, key
    if nxt == "COPY" and j > i + 1:  # buf[k] += v
        return True, key
    if nxt == "BINARY_SUBSCR" and j > i + 1:
        return False, key
    if j == i + 1 and nxt in ("LOAD_METHOD", "LOAD_ATTR") and instrs[j].argval in _WRITING:
        return True, None
    return False, None


class LocalWatch:
    """The in-flight local arrays of this PE and the line tracing that watches them (see the module docstring)."""

    def __init__(self, emit: Callable[..., object]):
        self.emit = emit  # emit(write, address, nbytes, code, line): one LOCAL_ACCESS record
        self.flights: dict[tuple[int, int], tuple] = {}  # (queue index, array address) -> (lo, hi, end BB)
        self.spans: tuple = ()  # the flights' [lo, hi) (a tuple replaced on change: other threads iterate it)
        self._stale = False  # a flight grew since spans was built (_hulls rebuilds it)
        self.gen = 0  # changes whenever flights do: a thread re-arms at its next event
        self.roots: dict[int, int] = {}  # address -> end of every array with a flight (replaced on change)
        self.roots_gen = 0
        self._lock = threading.Lock()
        self._uses: dict = {}  # code -> _line_uses
        self._internal: dict = {}  # code -> bool
        self._tls = threading.local()

    # --- what is in flight -------------------------------------------------------------------------------------

    def add(self, queue: int, end: int, root: int, nbytes: int, lo: int, hi: int, frame: FrameType) -> None:
        """A WQE of ``queue`` ending at BB ``end`` reads or writes local bytes [lo, hi) of the registered array of
        ``nbytes`` at address ``root`` (one flight per queue and array: the hull of its bytes in flight, until the
        last of them retires). A frame is traced when it holds a variable over any byte of such an array, so a
        frame need be looked at again only when another array comes in flight."""
        key = (queue, root)
        with self._lock:
            if root not in self.roots:  # another array: the threads look at their frames again (which frames
                self.roots = {**self.roots, root: root + nbytes}  # are traced depends on the arrays only; a
                self.roots_gen += 1  # kernel posts many WQEs from one array, over many queues, and walking
                self.gen += 1  # the stack for each new flight of it cost more than the kernel)
            old = self.flights.get(key)
            span = (lo, hi) if old is None else (min(lo, old[0]), max(hi, old[1]))
            self.flights[key] = (span[0], span[1], end & _M32)
            if old is None:  # another flight: the spans the traced lines compare against
                self.spans = tuple((a, b) for a, b, _ in self.flights.values())
            elif span != old[:2]:
                self._stale = True  # a flight grew: the spans are rebuilt when a line looks them up (_hulls)
        if getattr(self._tls, "gen", 0) != self.gen:
            self.arm(frame)

    def retire(self, queue: int, tail: int) -> None:
        """The quiet of ``queue`` returned with every WQE before BB ``tail`` retired."""
        with self._lock:
            done = [k for k, v in self.flights.items() if k[0] == queue and ((tail - v[2]) & _M32) < _HALF]
            for k in done:
                del self.flights[k]
            if done:
                self.spans = tuple((a, b) for a, b, _ in self.flights.values())
                self._stale = False
                live = {k[1] for k in self.flights}
                if len(live) != len(self.roots) or not self.spans:  # the threads re-arm or disarm
                    self.roots = {r: e for r, e in self.roots.items() if r in live}
                    self.roots_gen += 1
                    self.gen += 1
        if done and not self.spans:
            self._disarm()

    def _hulls(self) -> tuple:
        """The flights' [lo, hi), up to date."""
        if self._stale:
            with self._lock:
                self._stale = False
                self.spans = tuple((a, b) for a, b, _ in self.flights.values())
        return self.spans

    # --- tracing -------------------------------------------------------------------------------------------------

    def sync(self, frame: FrameType) -> None:
        """A checker event of this thread: start (or stop) tracing if the flights changed since its last one."""
        tls = self._tls
        if getattr(tls, "gen", 0) != self.gen:
            if self.spans:
                self.arm(frame)
            else:
                self._disarm()

    def arm(self, frame: FrameType) -> None:
        tls = self._tls
        tls.gen = self.gen
        if not getattr(tls, "on", False):
            tls.prev = sys.gettrace()
            tls.on = True
            sys.settrace(self._call)
        scanned = getattr(tls, "scanned", None)
        if scanned is None or scanned[0] != self.roots_gen:
            scanned = tls.scanned = (self.roots_gen, set())
        f = frame
        while f is not None:
            if f.f_trace is not self._line and id(f) not in scanned[1] and not self._is_internal(f.f_code):
                if self._holds(f):
                    f.f_trace_lines = True
                    f.f_trace = self._line
                else:  # (a frame that holds one is looked at again once its tracing stopped)
                    scanned[1].add(id(f))
            f = f.f_back

    def _disarm(self) -> None:
        tls = self._tls
        tls.gen = self.gen
        if getattr(tls, "on", False):
            tls.on = False
            sys.settrace(tls.prev)

    def _is_internal(self, code) -> bool:
        inside = self._internal.get(code)
        if inside is None:
            inside = self._internal[code] = code.co_filename.startswith(_INTERNAL) or code.co_filename.startswith("<")
        return inside

    def _in_flight(self, value) -> bool:
        if not isinstance(value, np.ndarray) or not value.size:
            return False
        lo, hi = _extent(value)
        return any(lo < fhi and flo < hi for flo, fhi in self._hulls())

    def _holds(self, frame) -> bool:
        """Whether a frame has a variable bound to an array over bytes of an array in flight."""
        try:
            values = list(frame.f_locals.values())
        except Exception:  # a frame whose locals cannot be read: not watched  # noqa: BLE001
            return False
        roots = self.roots
        for v in values:
            if isinstance(v, np.ndarray) and v.size:
                lo, hi = _extent(v)
                if any(lo < end and root < hi for root, end in roots.items()):
                    return True
        return False

    def _call(self, frame, event, arg):  # (the global trace function: every call of the thread while armed)
        if not self.spans:
            return None
        inside = self._internal.get(frame.f_code)
        if inside or (inside is None and self._is_internal(frame.f_code)):
            return None
        return self._line if self._holds(frame) else None

    def _line(self, frame, event, arg):
        if not self.spans:
            return None
        if event != "line":
            return self._line
        code = frame.f_code
        uses = self._uses.get(code)
        if uses is None:
            uses = self._uses[code] = _line_uses(code)
        found, calls_kernel = [], False
        for name, write, key in uses.get(frame.f_lineno, ()):
            value = frame.f_locals.get(name, frame.f_globals.get(name))
            if _is_api(value):  # the API under another name (get = getattr(shmemx, "aclshmem_int32_get_nbi"))
                return self._line
            calls_kernel = calls_kernel or (type(value) is FunctionType and not self._is_internal(value.__code__))
            if self._in_flight(value):
                found.append((value, write, key))
        for value, write, key in found:
            if calls_kernel and not write and key is None:  # handed to a kernel function, whose lines are traced
                continue
            self._record(value, write, key, code, frame.f_lineno)
        return self._line

    def _record(self, value: np.ndarray, write: bool, key, code, line: int) -> None:
        whole = key is None
        if not whole:
            try:
                value = _select(value, key)
            except (IndexError, TypeError, ValueError):
                whole = True
        lo, hi = _extent(value)
        for flo, fhi in self._hulls():
            a, b = max(lo, flo), min(hi, fhi)
            if a < b:
                self.emit(write, a, b - a, code, line, whole)


def _is_api(value) -> bool:
    """Whether a variable holds one of shmemx's API functions (a line calling it is not an access: its events
    model what it does)."""
    return callable(value) and getattr(value, "__name__", "").startswith("aclshmem")


def _select(arr: np.ndarray, key) -> np.ndarray:
    """The view ``arr[key]`` selects, an int giving a one-element view (its bytes, not a copy)."""
    parts = key if isinstance(key, tuple) else (key,)
    fixed = tuple(slice(p, p + 1 if p != -1 else None) if isinstance(p, int) and not isinstance(p, bool) else p
                  for p in parts)
    return np.ndarray.__getitem__(arr.view(np.ndarray), fixed)

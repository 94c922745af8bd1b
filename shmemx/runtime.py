"""Attaching a process to its job: init, finalize, and the per-process runtime state; the one place that wires
the layers together (``shm`` substrate, ``udma`` data plane, ``observe`` recorders) for the ``api``.

A rank learns who it is from the environment the launcher sets (``SHMEMX_JOB``, ``SHMEMX_RANK``,
``SHMEMX_SIZE``, ``SHMEMX_HEAP_SIZE``, ``SHMEMX_TIMEOUT``). ``init`` maps the job's control segment, creates
this PE's heap (and, with the data plane, its queues), publishes its identity, meets every other PE in a
barrier, then maps the peers' heaps and checks that all PEs agree on the heap size and the QP count.

A script started without the launcher (``python script.py``) runs as a job of one PE that owns, and at
finalize removes, its own segments.
"""

from __future__ import annotations

import atexit
import os
import secrets
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ClosedError, NotInitializedError, SymmetryError
from .observe.counters import StatsSegment
from .observe.record import Recorder
from .observe.trace import Tracer
from .shm import atomics
from .shm.barrier import barrier
from .shm.control import Control, JobState, PeStatus, WaitCall
from .shm.heap import Heap
from .shm.hosts import HostMap
from .shm.segment import SHM_DIR, remove_job_segments, segment_name
from .shm.waits import WaitState, doze_per_word, grace_period
from .udma import plane
from .udma.chaos import Jitter
from .udma.check import array as checked_arrays
from .udma.check.recorder import CHECK_ENV, Checker
from .udma.events import EventLog, Mask

__all__ = [
    "InitAttr",
    "OptionalAttr",
    "Runtime",
    "runtime",
    "init",
    "finalize",
    "is_initialized",
    "set_qp_num",
    "ACLSHMEM_DATA_OP_MTE",
    "ACLSHMEM_DATA_OP_SDMA",
    "ACLSHMEM_DATA_OP_ROCE",
    "ACLSHMEM_DATA_OP_UDMA",
    "ACLSHMEMX_INIT_WITH_DEFAULT",
    "DEFAULT_HEAP_SIZE",
    "parse_size",
]

ACLSHMEM_DATA_OP_MTE = 0x01
ACLSHMEM_DATA_OP_SDMA = 0x02
ACLSHMEM_DATA_OP_ROCE = 0x04
ACLSHMEM_DATA_OP_UDMA = 0x08
ACLSHMEMX_INIT_WITH_DEFAULT = 1 << 0
ACLSHMEM_MAX_QP_NUM = 32
DEFAULT_HEAP_SIZE = 1 << 30  # NVSHMEM's default symmetric heap; sparse: untouched pages cost nothing
DEFAULT_TIMEOUT = 120.0

# data_op_engine_type is a bit mask of the engines (CANN: MTE | SDMA for its double-plane MoE examples)
_ENGINE_MASK = ACLSHMEM_DATA_OP_MTE | ACLSHMEM_DATA_OP_SDMA | ACLSHMEM_DATA_OP_ROCE | ACLSHMEM_DATA_OP_UDMA


def parse_size(text: int | str) -> int:
    """``"64M"`` / ``"1G"`` / ``"4096"`` / ``"512K"`` -> bytes (binary multiples)."""
    if isinstance(text, (int, np.integer)):
        return int(text)
    s = str(text).strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(s[-1:], 1)
    digits = s[:-1] if s[-1:] in "KMGT" else s
    try:
        value = float(digits)
    except ValueError:
        raise ValueError(f"size {text!r}: expected a number with an optional K/M/G suffix") from None
    return int(value * mult)


@dataclass
class OptionalAttr:
    """``aclshmem_init_optional_attr_t``: the engines (a mask of ``ACLSHMEM_DATA_OP_*``; see ``api.engines``) and
    the timeouts (seconds).

    A timeout left at None is not set: ``control_operation_timeout`` (the deadline of every wait) is then the
    launcher's ``--timeout``, else 120 s; ``shm_init_timeout`` (the init barrier's) is 120 s, longer for jobs of more
    than 16 PEs per core (``init_timeout``), and ``shm_create_timeout`` 120 s. A timeout set to any value, 120 s
    included, beats the launcher's.
    """

    data_op_engine_type: int = ACLSHMEM_DATA_OP_UDMA
    shm_init_timeout: float | None = None
    shm_create_timeout: float | None = None
    control_operation_timeout: float | None = None


@dataclass
class InitAttr:
    """``aclshmemx_init_attr_t``. Fields left at -1 / 0 come from the launcher's environment.

    Attributes:
        my_pe, n_pes: checked against the launcher's when given.
        local_mem_size: heap bytes per PE (``--heap-size``); must be the same on every PE.
        option_attr: engine type and timeouts; ``control_operation_timeout`` is the deadline of every wait.
        comm_args: the bootstrap's arguments: an ``aclshmemx_uniqueid_t`` (``aclshmemx_set_attr_uniqueid_args``),
            checked against the job at init.
        instance_id: 0 (one instance per process is emulated).
    """

    my_pe: int = -1
    n_pes: int = -1
    local_mem_size: int = 0
    ip_port: str = ""
    option_attr: OptionalAttr = field(default_factory=OptionalAttr)
    comm_args: object = None
    instance_id: int = 0


class Runtime:
    """Everything one process knows about its job once initialised. One per process."""

    def __init__(self, ctl: Control, my_pe: int, heap: Heap, *, timeout: float, owner: bool, engine_type: int):
        self.ctl = ctl
        self.job_id = ctl.job_id
        self.my_pe = my_pe
        self.n_pes = ctl.n_pes
        self.heap = heap
        self.hosts = HostMap.from_env(self.n_pes)  # which PEs share this host (shm.hosts); one host by default
        self.timeout = timeout
        self.owner = owner  # a launcher-less job of one PE: remove the segments at finalize
        self.engine_type = engine_type
        self.qp_num = 1
        self.udma = None  # the data plane (queues + engine): udma.plane.DataPlane
        self.stats = None  # this PE's counters (observe.counters.StatsSegment)
        self.events = None  # the event log when anything observes the job (udma.events.EventLog), else None
        self.tracer = None  # writes the trace from the event log when the job is traced (observe.trace.Tracer)
        self.recorder = None  # writes the recording from the event log when recorded (observe.record.Recorder)
        self.chaos = None  # the seeded jitter of kernel threads under --chaos (udma.chaos.Jitter), else None
        self.sdma = None  # this PE's SDMA engine (udma.sdma.SdmaEngine), started by the first SDMA call
        self.sq_depth: int | None = None
        self.cq_depth: int | None = None
        self.finalized = False
        # the waits' and the engine's grace period: adapts to the PEs per core, 0 when they outnumber the cores
        cores = len(os.sched_getaffinity(0))
        self.spin = grace_period(self.n_pes, cores, os.environ.get("SHMEMX_SPIN_US"))
        self.doze = doze_per_word(self.n_pes, cores, os.environ.get("SHMEMX_DOZE_US"))  # waits for many words
        self.wake_addr = ctl.pe_addr(my_pe, "wake_seq")
        self.wait_state = WaitState(ctl, my_pe)  # the waits' own state (shm.waits)
        self._words: dict[int, np.ndarray] = {}
        self.lock = threading.Lock()

    def word_view(self, addr: int) -> np.ndarray:
        """A 1-element u32 view of a word of the control segment, by address."""
        view = self._words.get(addr)
        if view is None:
            seg = self.ctl.segment
            view = self._words[addr] = seg.view("<u4", addr - seg.addr, (1,))
        return view

    def check_errors(self) -> None:
        """Raise a pending data-plane error (an error CQE nobody quieted yet, a dead engine)."""
        if self.udma is not None:
            self.udma.check_errors()


_rt: Runtime | None = None
_pending_qp_num = 1
_qp_lock = threading.Lock()


def runtime() -> Runtime:
    """The initialised runtime of this process; NotInitializedError before init, ClosedError after finalize."""
    rt = _rt
    if rt is None:
        raise NotInitializedError("shmemx is not initialised: call shmemx.init() (or aclshmemx_init_attr) first")
    if rt.finalized:
        raise ClosedError(f"pe {rt.my_pe}: shmemx was finalized")
    return rt


def is_initialized() -> bool:
    return _rt is not None and not _rt.finalized


def set_qp_num(engine: int, qp_num: int) -> int:
    """``aclshmemx_set_qp_num``: QPs per peer for the UDMA engine. Before init only; 1..32; same on every PE."""
    global _pending_qp_num
    if engine != ACLSHMEM_DATA_OP_UDMA:
        raise ValueError(f"aclshmemx_set_qp_num: engine {engine!r} not supported (only ACLSHMEM_DATA_OP_UDMA=8)")
    if isinstance(qp_num, bool) or not isinstance(qp_num, (int, np.integer)) or not 1 <= qp_num <= ACLSHMEM_MAX_QP_NUM:
        raise ValueError(f"aclshmemx_set_qp_num: qp_num {qp_num!r} out of range 1..{ACLSHMEM_MAX_QP_NUM}")
    with _qp_lock:
        if is_initialized():
            raise ValueError(f"pe {_rt.my_pe}: aclshmemx_set_qp_num must be called before init "
                             f"(qp_num is {_rt.qp_num})")
        _pending_qp_num = int(qp_num)
    return 0


def first_set(*choices: object) -> Any:
    """The first of ``choices`` that is set (not None): the precedence of every init setting is an argument of init
    (a keyword, then ``attr``), then the launcher's environment, then the default."""
    return next(value for value in choices if value is not None)


def _env(name: str) -> str | None:
    """The launcher's setting ``name`` (None when absent or empty)."""
    return os.environ.get(name) or None


def _heap_size(attr: InitAttr, heap_size, min_heap_size) -> int:
    """Heap bytes per PE: ``heap_size`` > ``attr.local_mem_size`` (0: unset) > ``SHMEMX_HEAP_SIZE`` > 1 GiB, raised
    to ``min_heap_size``."""
    size = parse_size(first_set(heap_size, attr.local_mem_size or None, _env("SHMEMX_HEAP_SIZE"), DEFAULT_HEAP_SIZE))
    return size if min_heap_size is None else max(size, parse_size(min_heap_size))


def _timeout(attr: InitAttr, timeout: float | None) -> float:
    """The deadline of every wait: ``timeout`` > ``attr``'s ``control_operation_timeout`` > ``SHMEMX_TIMEOUT`` >
    120 s."""
    return float(first_set(timeout, attr.option_attr.control_operation_timeout, _env("SHMEMX_TIMEOUT"),
                           DEFAULT_TIMEOUT))


def _identity(attr: InitAttr) -> tuple[str, bool, int, int]:
    """(job id, owner, my_pe, n_pes): the launcher's, or a new job of one PE that this process owns."""
    job_id = _env("SHMEMX_JOB")
    if job_id is None:
        return f"{os.getpid():x}{secrets.token_hex(2)}", True, 0, 1
    me, n = int(first_set(_env("SHMEMX_RANK"), 0)), int(first_set(_env("SHMEMX_SIZE"), 1))
    for name, given, actual in (("my_pe", attr.my_pe, me), ("n_pes", attr.n_pes, n)):
        if given >= 0 and given != actual:
            raise ValueError(f"aclshmemx_init_attr: attr.{name}={given} but the launcher started this "
                             f"process as {name}={actual}")
    return job_id, False, me, n


def _check_engine(attr: InitAttr) -> int:
    engine = attr.option_attr.data_op_engine_type
    if isinstance(engine, bool) or not isinstance(engine, (int, np.integer)) or not 0 < engine <= _ENGINE_MASK:
        raise ValueError(f"aclshmemx_init_attr: data_op_engine_type {engine!r} is not a mask of "
                         f"MTE=1, SDMA=2, ROCE=4, UDMA=8")
    return int(engine)


def init(attr: InitAttr | None = None, *, heap_size: int | str | None = None, timeout: float | None = None,
         sq_depth: int | None = None, cq_depth: int | None = None, min_heap_size: int | str | None = None) -> Runtime:
    """Attach this process to its job (collective). Idempotent: a second call returns the same runtime.

    Every setting is an argument of init when given, else the launcher's (its environment), else the default
    (``first_set``).

    Args:
        attr: CANN-style attributes; see ``InitAttr``.
        heap_size: heap bytes per PE (int or "64M"); overrides ``attr`` and the launcher's ``--heap-size``.
        timeout: deadline of every wait in seconds; overrides ``attr`` and the launcher's ``--timeout``.
        sq_depth, cq_depth: SQ / CQ ring depth in BBs / CQEs (a power of two; default
            ``udma.segment.default_depth``: 32768 up to 16 PEs, shallower for larger jobs; tests use small ones).
        min_heap_size: a heap of at least this many bytes (for libraries that know what they need, such as
            ``shmemx.deep_ep.Buffer``): the size above, or the launcher's, or the default, raised to it.
    """
    global _rt
    if _rt is not None and not _rt.finalized:
        return _rt
    if _rt is not None and not _rt.owner:  # its segments live on until the launcher removes them
        raise ClosedError(f"pe {_rt.my_pe}: shmemx was finalized; a rank of a launched job cannot init again")
    attr = attr or InitAttr()
    engine = _check_engine(attr)
    job_id, owner, my_pe, n_pes = _identity(attr)
    size, timeout = _heap_size(attr, heap_size, min_heap_size), _timeout(attr, timeout)
    if size <= 0:
        raise ValueError(f"pe {my_pe}: heap size must be positive, got {size}")
    ctl, heap = _attach(job_id, owner, my_pe, n_pes, size, timeout)
    rt = Runtime(ctl, my_pe, heap, timeout=timeout, owner=owner, engine_type=engine)
    rt.qp_num = _pending_qp_num
    rt.sq_depth, rt.cq_depth = sq_depth, cq_depth
    _publish(rt)
    _rt = rt
    try:
        _start(rt, first_set(attr.option_attr.shm_init_timeout, init_timeout(n_pes, len(os.sched_getaffinity(0)))))
    except BaseException:
        _rt = None
        _undo_failed_init(rt)
        raise
    atexit.register(_finalize_at_exit)
    return rt


def init_timeout(n_pes: int, cores: int) -> float:
    """The init barrier's default deadline (seconds): ``DEFAULT_TIMEOUT``, longer by the same factor for every 16
    PEs per core beyond the first 16: the last of 256 PEs forked on 2 cores, each attaching 255 peers, can start
    more than 120 s after the first on a loaded host (measured: 106 of 256 missing at 120 s), while 8-32 PEs
    start in under a second."""
    return DEFAULT_TIMEOUT * max(1.0, n_pes / (16 * max(cores, 1)))


def _attach(job_id: str, owner: bool, my_pe: int, n_pes: int, size: int, timeout: float) -> tuple[Control, Heap]:
    """The job's control segment (made here for a job of one PE) and this PE's heap."""
    if owner:
        ctl = Control.create(job_id, 1, heap_size=size, timeout=timeout, script="")
        ctl.header["state"] = JobState.RUNNING
    else:
        ctl = Control.attach(job_id)
    try:
        return ctl, Heap(job_id, my_pe, n_pes, size)
    except BaseException:
        if owner:  # a standalone PE made the job's control segment just now: nothing else holds it
            ctl.close()
            remove_job_segments(job_id)
        raise


def _publish(rt: Runtime) -> None:
    """This PE's identity in the control segment, for the peers and the job's readers."""
    me = rt.ctl.pes[rt.my_pe]
    me["pid"] = os.getpid()
    me["heap_size"] = rt.heap.size
    me["qp_num"] = rt.qp_num
    me["start_time"] = time.time()


def _start(rt: Runtime, init_timeout: float) -> None:
    """The recorders, the data plane, the init barrier and the peers' heaps (undone by the caller on failure)."""
    rt.stats = StatsSegment.create(rt.job_id, rt.my_pe, rt.n_pes, rt.qp_num)
    _observers(rt)
    plane.create(rt)  # this PE's queues and URMA identity
    if rt.events is not None and rt.events.checker is not None:
        rt.udma.array_type = checked_arrays.CheckedArray  # heap arrays post natively too
    rt.ctl.pes[rt.my_pe]["status"] = PeStatus.READY
    atomics.fetch_add_u32(rt.ctl.header_addr("n_ready"), 1)
    barrier(rt, call=WaitCall.INIT, timeout=init_timeout)
    # Before anyone maps a peer: when PEs disagree, every PE fails here and may remove its own segments
    # (_undo_failed_init) without pulling them from under a peer that is still attaching.
    _check_agreement(rt)
    rt.heap.attach_peers(rt.hosts.pes() if rt.hosts.multi else None)
    plane.start(rt)
    if rt.events is not None and rt.events.checker is not None:  # told of every local array the plane registers
        rt.events.checker.attach(rt.udma.registry, rt.udma.poster)


def _observers(rt: Runtime) -> None:
    """The event log and its consumers, as the launcher's environment asks (--check, --trace, --record), and
    the chaos jitter (--chaos). None of them changes which code runs."""
    rt.tracer = Tracer.from_env()
    rt.recorder = Recorder.from_env()
    rt.chaos = Jitter.from_env(rt.my_pe, rt.n_pes)
    check = bool(os.environ.get(CHECK_ENV))
    mask = ((Mask.CHECK if check else 0) | (Mask.RECORD if rt.recorder is not None else 0)
            | (Mask.TRACE if rt.tracer is not None else 0))
    rt.events = EventLog.from_env(rt.job_id, rt.my_pe, Mask(mask))
    if check:
        rt.events.checker = Checker(rt, rt.events)
        checked_arrays.install(rt.events.checker, rt.heap)


def _undo_failed_init(rt: Runtime) -> None:
    """Remove what a failed init created, so that a corrected init can run in the same process."""
    try:
        plane.stop(rt)
    finally:
        rt.ctl.pes[rt.my_pe]["status"] = PeStatus.STARTED
        if rt.stats is not None:
            rt.stats.close()
        if rt.events is not None:
            checked_arrays.uninstall()
            rt.events.close()
            rt.events = None
        for what in (f"heap{rt.my_pe}", f"udma{rt.my_pe}", f"stats{rt.my_pe}", f"events{rt.my_pe}"):
            try:
                os.unlink(os.path.join(SHM_DIR, segment_name(rt.job_id, what)))
            except FileNotFoundError:
                pass
        rt.heap.close()
        if rt.owner:
            rt.ctl.close()
            remove_job_segments(rt.job_id)


def _check_agreement(rt: Runtime) -> None:
    """Raise SymmetryError on every PE when the PEs' heap sizes or QP counts differ (after the init barrier)."""
    pes = rt.ctl.pes
    for what in ("heap_size", "qp_num"):
        values = [int(pes[p][what]) for p in range(rt.n_pes)]
        if len(set(values)) > 1:
            listing = ", ".join(f"pe {p}: {v}" for p, v in enumerate(values))
            # Every PE reads the same values and fails here; meet once more so that no PE retries init (and
            # overwrites its values) before every PE has read them.
            barrier(rt, call=WaitCall.INIT)
            raise SymmetryError(f"pe {rt.my_pe}: init: PEs disagree on {what} ({listing})")


def finalize() -> int:
    """``aclshmem_finalize`` (collective, idempotent; also runs at exit). Raises a pending data-plane error."""
    global _rt
    rt = _rt
    if rt is None or rt.finalized:
        return 0
    try:
        plane.stop(rt)  # the engine first executes everything rung, so that a failure among it is raised here
        if rt.sdma is not None:
            rt.sdma.stop()  # (likewise every SDMA copy posted)
        rt.check_errors()
        barrier(rt, call=WaitCall.FINALIZE)
    finally:
        _teardown(rt)
    return 0


def _teardown(rt: Runtime) -> None:
    global _rt, _pending_qp_num
    rt.finalized = True
    plane.stop(rt)
    if rt.sdma is not None:
        rt.sdma.stop()
    _close_inspection(rt)
    ctl = rt.ctl
    ctl.pes[rt.my_pe]["status"] = PeStatus.FINALIZED
    rt.heap.close()
    if rt.owner:
        ctl.header["state"] = JobState.DONE
        ctl.close()
        remove_job_segments(rt.job_id)
    _pending_qp_num = 1


def _close_inspection(rt: Runtime) -> None:
    """Publish the posted counts, write this PE's part of the trace, unmap the stats (the launcher reads them)."""
    if rt.udma is not None and rt.udma.qps:
        rt.udma.publish_counts()
    ev = rt.events
    rt.events = None  # nothing writes into it from here on (a region left after finalize)
    log = ev.read() if ev is not None and (rt.tracer is not None or rt.recorder is not None) else None
    if rt.tracer is not None:
        try:
            rt.tracer.write(rt.my_pe, rt.qp_num, rt.ctl.describe_offset, log)
        except Exception:  # the job's result stands; the trace part is lost, and we say why
            print(f"shmemx: pe {rt.my_pe}: could not write the trace part:\n{traceback.format_exc()}",
                  file=sys.stderr)
        rt.tracer = None
    if rt.recorder is not None:
        try:
            rt.recorder.write(rt.my_pe, rt.n_pes, rt.qp_num, log)
        except Exception:  # the job's result stands; the recording part is lost, and we say why
            print(f"shmemx: pe {rt.my_pe}: could not write the recording part:\n{traceback.format_exc()}",
                  file=sys.stderr)
        rt.recorder = None
    if rt.stats is not None:
        rt.stats.close()
        rt.stats = None
    if ev is not None:
        checked_arrays.uninstall()
        ev.close()  # the segment stays for the launcher (--check analyses it); it removes the job's segments


def abandon() -> None:
    """Tear down without the collective barrier (used when this rank is failing)."""
    rt = _rt
    if rt is not None and not rt.finalized:
        try:
            rt.ctl.pes[rt.my_pe]["status"] = PeStatus.FAILED
        finally:
            _teardown(rt)


def _finalize_at_exit() -> None:
    rt = _rt
    if rt is not None and not rt.finalized:
        try:
            finalize()
        except Exception as exc:  # at exit there is nobody left to raise to: say it, don't hide it
            print(f"shmemx: pe {rt.my_pe}: finalize at exit failed: {exc}", file=sys.stderr)

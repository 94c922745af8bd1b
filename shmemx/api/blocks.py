"""Kernel launch: running a function on ``block_dim`` AIV blocks (threads) of this PE.

``shmemx.launch(kernel, block_dim, *args)`` runs ``kernel(*args)`` once per block, each in its own thread, and
returns when all blocks returned. Block 0 runs on the calling thread and blocks 1.. on parked threads of this
process, started once and reused by every launch (``_Pool``), observed or not; only a launch made while another
host thread's launch has the parked threads gets fresh threads (the two may wait for each other). Inside,
``get_block_idx()`` /
``get_block_num()`` say which block runs,
``sync_all()`` meets all blocks of this PE (AscendC ``SyncAll``), ``get_ub()`` is the block's UB scratch, and
``aclshmemx_barrier_all_vec()`` / ``aclshmemx_sync_vec_all()`` meet all blocks of all PEs.

If a block raises, the others are released from ``sync_all`` (they get ``BrokenBarrierError``) and ``launch``
re-raises the first failing block's exception. When the launch ends, each block's claim on the send queues it
posted to is released: the next launch may use them from other blocks.

Blocks share one interpreter lock: their Python code interleaves rather than runs in parallel, but what they
post the PE's DMA engine executes without that lock (a native thread), and numpy copies and waits let it go, so a
block's WQEs move while the next block builds its own. For speed, vectorise inside a block.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
from collections.abc import Callable

import numpy as np

from ..errors import WaitTimeoutError
from ..runtime import runtime
from ..shm.barrier import barrier
from ..shm.control import WaitCall
from ..shm.waits import set_thread_slot, thread_slot

__all__ = [
    "launch",
    "get_block_idx",
    "get_block_num",
    "sync_all",
    "get_ub",
    "aclshmemx_sync_vec_all",
    "aclshmemx_barrier_all_vec",
    "UB_SIZE",
    "MAX_BLOCKS",
]

UB_SIZE = 192 * 1024  # bytes of UB scratch per block (Ascend 950 AIV: 192 KiB of the 256 KiB UB are usable)
MAX_BLOCKS = 128


class _Launch:
    def __init__(self, block_dim: int):
        self.block_dim = block_dim
        self.barrier = threading.Barrier(block_dim)
        self.errors: list[tuple[int, BaseException]] = []
        self.ub = [None] * block_dim
        self.launch_id = 0  # the event log's id of this launch (udma.events), 0 when no log is on


_tls = threading.local()


class _Pool:
    """The parked block threads of this process: worker b runs block b (b >= 1) of every launch that has it.

    Starting a thread costs a hand-off of the interpreter lock each way (``Thread.start`` waits until the new
    thread runs), one after the other, milliseconds when PEs outnumber cores; a parked worker is handed its block
    through its queue and runs once the caller lets the lock go. Made on the first launch of more than one
    block, grown to the widest launch, stopped at exit; a forked child starts its own."""

    def __init__(self):
        self.pid = os.getpid()
        self.workers: list[tuple[threading.Thread, queue.SimpleQueue]] = []
        self.busy = threading.Lock()  # held by the launch the workers serve (another one at once: fresh threads)

    def take(self, n: int, pe: int) -> list[tuple[threading.Thread, queue.SimpleQueue]]:
        """Workers 1..n (started where missing)."""
        while len(self.workers) < n:
            tasks: queue.SimpleQueue = queue.SimpleQueue()
            t = threading.Thread(target=_serve, args=(tasks,), name=f"shmemx-pe{pe}-block{len(self.workers) + 1}",
                                 daemon=True)
            t.start()
            self.workers.append((t, tasks))
        return self.workers[:n]

    def stop(self) -> None:
        for _, tasks in self.workers:
            tasks.put(None)
        for t, _ in self.workers:
            t.join(timeout=5)
        self.workers = []


def _serve(tasks: queue.SimpleQueue) -> None:
    while (task := tasks.get()) is not None:
        task()


_pool: _Pool | None = None


def _the_pool() -> _Pool:
    global _pool
    if _pool is None or _pool.pid != os.getpid():
        if _pool is None:
            atexit.register(lambda: _pool is not None and _pool.pid == os.getpid() and _pool.stop())
        _pool = _Pool()
    return _pool


def _current() -> _Launch | None:
    return getattr(_tls, "launch", None)


def launch(kernel: Callable[..., object], block_dim: int, *args: object, **kwargs: object) -> None:
    """Run ``kernel(*args, **kwargs)`` on ``block_dim`` AIV blocks of this PE; re-raise the first block error."""
    rt = runtime()
    if isinstance(block_dim, bool) or not isinstance(block_dim, (int, np.integer)) or not 1 <= block_dim <= MAX_BLOCKS:
        raise ValueError(f"pe {rt.my_pe}: launch: block_dim {block_dim!r} out of range 1..{MAX_BLOCKS}")
    if _current() is not None:
        raise RuntimeError(f"pe {rt.my_pe}: launch inside a kernel: kernels cannot launch kernels")
    state = _Launch(int(block_dim))
    ev = rt.events
    state.launch_id = ev.launch(state.block_dim) if ev is not None else 0

    def body(idx: int) -> None:
        _tls.launch = state
        _tls.block_idx = idx
        set_thread_slot(idx)
        if ev is not None:
            ev.block(state.launch_id, True)
        try:
            kernel(*args, **kwargs)
        except BaseException as exc:
            state.errors.append((idx, exc))
            state.barrier.abort()
        finally:
            if ev is not None:
                ev.block(state.launch_id, False)

    pool = _the_pool() if state.block_dim > 1 else None
    if pool is None or pool.busy.acquire(blocking=False):
        try:
            _run_here(rt, state, body, pool)
        finally:
            if pool is not None:
                pool.busy.release()
    else:  # another host thread's launch has the workers: this one may wait for it, so its blocks must not
        # queue behind that launch's on the same workers
        _run_fresh(rt, state, body)
    if ev is not None:
        ev.join(state.launch_id)
    if state.errors:
        real = [(b, e) for b, e in state.errors if not isinstance(e, threading.BrokenBarrierError)]
        block, exc = min(real or state.errors, key=lambda be: be[0])
        try:
            exc.add_note(f"(raised in AIV block {block} of {block_dim} on pe {rt.my_pe})")
        except AttributeError:
            pass
        raise exc


def _run_fresh(rt, state: _Launch, body) -> None:
    """Every block on a fresh thread of its own (a launch made while another host thread's launch has the parked
    threads); the claims on send queues the blocks made end with the launch."""
    threads = [threading.Thread(target=body, args=(b,), name=f"shmemx-pe{rt.my_pe}-block{b}", daemon=True)
               for b in range(state.block_dim)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if rt.udma is not None:
        rt.udma.release_claims(t.ident for t in threads)


def _run_here(rt, state: _Launch, body, pool: _Pool | None) -> None:
    """Block 0 on the calling thread, blocks 1.. on the pool's workers (the caller holds ``pool.busy``); return
    when every block has. The claims on send queues made in the launch end with it (the caller's own from before
    stay)."""
    udma = rt.udma
    me = threading.get_ident()
    held = None if udma is None else udma.claims(me)
    workers = pool.take(state.block_dim - 1, rt.my_pe) if pool is not None else []
    done = threading.Semaphore(0)

    def task(b: int) -> None:
        try:
            body(b)
        finally:
            _tls.launch = None
            done.release()

    for b, (_, tasks) in enumerate(workers, 1):
        tasks.put(lambda b=b: task(b))
    slot = thread_slot()
    try:
        body(0)
    finally:
        _tls.launch = None
        _tls.block_idx = 0
        set_thread_slot(slot)
        for _ in workers:
            done.acquire()
    if udma is not None:
        udma.release_claims((t.ident for t, _ in workers), me, held)


def get_block_idx() -> int:
    """This block's index in the launch (0 outside a launch)."""
    return getattr(_tls, "block_idx", 0) if _current() is not None else 0


def get_block_num() -> int:
    """Number of blocks of the current launch (1 outside a launch)."""
    state = _current()
    return state.block_dim if state is not None else 1


def sync_all() -> None:
    """Meet every block of this PE's launch (``SyncAll``); a no-op outside a launch."""
    state = _current()
    if state is None or state.block_dim == 1:
        return
    rt = runtime()
    ev = rt.events
    if ev is not None:
        ev.sync(True)
    rt.stats.add_block_sync(thread_slot())
    try:
        state.barrier.wait(timeout=rt.timeout)
        if ev is not None:
            ev.sync(False)
    except threading.BrokenBarrierError:
        if state.errors:
            raise
        raise WaitTimeoutError(f"pe {rt.my_pe}: sync_all in block {get_block_idx()}: not every one of the "
                               f"{state.block_dim} blocks arrived within {rt.timeout:g} s") from None


def get_ub(nbytes: int | None = None) -> np.ndarray:
    """This block's UB scratch: a ``[UB_SIZE] uint8`` array (or its first ``nbytes``), the same on every call."""
    state = _current()
    idx = get_block_idx()
    if state is None:
        ub = getattr(_tls, "ub", None)
        if ub is None:
            ub = _tls.ub = np.zeros(UB_SIZE, np.uint8)
    else:
        ub = state.ub[idx]
        if ub is None:
            ub = state.ub[idx] = np.zeros(UB_SIZE, np.uint8)
    if nbytes is not None and nbytes > UB_SIZE:
        raise ValueError(f"UB scratch is {UB_SIZE} B, asked for {nbytes}")
    return ub if nbytes is None else ub[:nbytes]


def aclshmemx_sync_vec_all() -> None:
    """Meet every block of every PE (collective across the job; call it from every block of a launch).

    Does not complete UDMA work: quiet first. Raises a pending data-plane error.
    """
    rt = runtime()
    sync_all()
    if get_block_idx() == 0:
        rt.check_errors()
        barrier(rt, WaitCall.SYNC_VEC_ALL)
    sync_all()


aclshmemx_barrier_all_vec = aclshmemx_sync_vec_all


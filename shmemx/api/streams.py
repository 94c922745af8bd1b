"""Emulated ``aclrtStream``s and CANN's stream-ordered host calls (``*_on_stream``, ``aclshmemx_handle_wait``).

A stream is an ordered queue of this PE's work: kernel launches (``stream.launch(kernel, block_dim, *args)``,
CANN's ``kernel<<<block_dim, nullptr, stream>>>(args)``) and the ``*_on_stream`` operations. Nothing runs when
it is queued: ``aclrtSynchronizeStream(stream)`` runs the queued work in order on the calling thread and
returns when the last of it is done, as the device would have run it before the synchronize returned. (One
thread of the host runs everything, so a stream's work is ordered with the PE's other host calls the way the
program orders the synchronize; no worker thread shares the host thread's wait slot and recorder rows.) This is
the choice: work runs at synchronize, not in the background, so host code that waits for a stream's effect
without synchronizing it first deadlocks here where the device might have raced ahead; on the device it is a
race.

A failure of a queued operation surfaces at the synchronize that runs it: ``StreamError`` names the stream, the
operation (with its arguments) and its position, with the failure as ``__cause__``; the stream's later work is
dropped (a failed stream stays failed on the device too). ``stream=None`` is the PE's default stream.

The operations mean what their direct forms mean: ``barrier_all_on_stream`` is ``aclshmem_barrier_all``,
``barrier_on_stream(team)`` is ``aclshmem_barrier(team)``, ``putmem/getmem_on_stream`` are the blocking
``aclshmem_putmem/getmem`` (engine-agnostic), ``signal_op_on_stream`` is ``aclshmemx_signal_op``,
``signal_wait_until_on_stream`` is ``aclshmem_signal_wait_until``; ``quiet_on_stream`` completes what the
host issued: UDMA QP 0 to every peer and the host thread's SDMA channel. ``aclshmemx_handle_wait(handle,
stream)`` quiets QP 0 to every other member of the handle's team, then meets the team (CANN: RoCE quiets per
peer, then the team barrier). ``aclrtWaitAndResetNotify(notify, stream, timeout)`` waits for an SDMA notify
record (``api.sdma``) and resets it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import StreamError
from ..runtime import runtime
from ..shm.control import WaitCall
from ..shm.waits import Sleep, Wait, block_until
from .blocks import launch
from .engines import Engine, reaching
from .generic_rma import aclshmem_getmem, aclshmem_putmem
from .host import aclshmem_barrier_all
from .log import LogLevel, log
from .rma import aclshmemx_udma_quiet
from .sdma import Notify, aclshmemx_sdma_quiet
from .signals import aclshmem_signal_wait_until, aclshmemx_signal_op
from .teams import aclshmem_barrier, team_info

__all__ = ["aclrtStream", "aclrtCreateStream", "aclrtDestroyStream", "aclrtSynchronizeStream", "aclshmem_handle_t",
           "aclshmemx_barrier_all_on_stream", "aclshmemx_barrier_on_stream", "aclshmemx_quiet_on_stream",
           "aclshmemx_putmem_on_stream", "aclshmemx_getmem_on_stream", "aclshmemx_signal_op_on_stream",
           "aclshmemx_signal_wait_until_on_stream", "aclshmemx_handle_wait", "aclrtWaitAndResetNotify"]

_ids = itertools.count(1)


@dataclass
class aclshmem_handle_t:
    """CANN's handle of non-blocking operations: the ``team_id`` they were issued on."""

    team_id: int = 0


class aclrtStream:
    """An emulated stream of this PE (see the module docstring): ``launch`` queues a kernel, the ``*_on_stream``
    calls queue their operation, ``aclrtSynchronizeStream`` runs them."""

    def __init__(self):
        self.id = next(_ids)
        self.queued = 0  # operations queued since creation (their positions)
        self.ops: deque = deque()
        self.destroyed = False

    def launch(self, kernel: Callable[..., object], block_dim: int, *args: object, **kwargs: object) -> None:
        """Queue ``shmemx.launch(kernel, block_dim, *args, **kwargs)``."""
        self._queue(f"kernel {getattr(kernel, '__name__', kernel)!s}<<<{block_dim}>>>", launch,
                    (kernel, block_dim, *args), kwargs)

    def _queue(self, name: str, fn, args: tuple = (), kwargs: dict | None = None) -> None:
        if self.destroyed:
            raise ValueError(f"pe {runtime().my_pe}: {name}: stream {self.id} was destroyed")
        self.ops.append((self.queued, name, fn, args, kwargs or {}))
        self.queued += 1

    def __repr__(self) -> str:
        return f"aclrtStream({self.id}, {len(self.ops)} queued)"


_default: dict = {"rt": None, "stream": None}


def _stream(stream) -> aclrtStream:
    if stream is None:
        rt = runtime()
        if _default["rt"] is not rt:
            _default["rt"], _default["stream"] = rt, aclrtStream()
        return _default["stream"]
    if not isinstance(stream, aclrtStream):
        raise TypeError(f"pe {runtime().my_pe}: stream must be an aclrtStream (aclrtCreateStream) or None, got "
                        f"{stream!r}")
    return stream


def aclrtCreateStream() -> aclrtStream:
    """A new stream of this PE (CANN writes it through a pointer and returns 0)."""
    runtime()
    return aclrtStream()


def aclrtSynchronizeStream(stream: aclrtStream | None = None) -> int:
    """Run ``stream``'s queued work in order, on this thread; returns 0 when all of it succeeded, else raises
    ``StreamError`` for the first failure (the rest is dropped)."""
    s = _stream(stream)
    rt = runtime()
    while s.ops:
        index, name, fn, args, kwargs = s.ops.popleft()
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            dropped = len(s.ops)
            s.ops.clear()
            msg = (f"pe {rt.my_pe}: aclrtSynchronizeStream(stream {s.id}): operation #{index} {name} failed: "
                   f"{exc}" + (f" ({dropped} later operations dropped)" if dropped else ""))
            log(LogLevel.ERROR, rt.my_pe, msg)
            raise StreamError(msg, operation=name, index=index) from exc
    return 0


def aclrtDestroyStream(stream: aclrtStream) -> int:
    """Run what is still queued (as a synchronize), then destroy ``stream``; returns 0."""
    s = _stream(stream)
    try:
        aclrtSynchronizeStream(s)
    finally:
        s.destroyed = True
    return 0


def aclshmemx_barrier_all_on_stream(stream: aclrtStream | None = None) -> None:
    """Queue ``aclshmem_barrier_all``."""
    _stream(stream)._queue("aclshmemx_barrier_all_on_stream", aclshmem_barrier_all)


def aclshmemx_barrier_on_stream(team: int, stream: aclrtStream | None = None) -> None:
    """Queue ``aclshmem_barrier(team)``."""
    _stream(stream)._queue(f"aclshmemx_barrier_on_stream(team={team})", aclshmem_barrier, (team,))


def aclshmemx_putmem_on_stream(dst: np.ndarray, src: np.ndarray, elem_size: int, pe: int,
                               stream: aclrtStream | None = None) -> None:
    """Queue ``aclshmem_putmem(dst, src, elem_size, pe)`` (``elem_size`` bytes; complete when it has run)."""
    _stream(stream)._queue(f"aclshmemx_putmem_on_stream(pe={pe}, {elem_size} B)", aclshmem_putmem,
                           (dst, src, elem_size, pe))


def aclshmemx_getmem_on_stream(dst: np.ndarray, src: np.ndarray, elem_size: int, pe: int,
                               stream: aclrtStream | None = None) -> None:
    """Queue ``aclshmem_getmem(dst, src, elem_size, pe)``."""
    _stream(stream)._queue(f"aclshmemx_getmem_on_stream(pe={pe}, {elem_size} B)", aclshmem_getmem,
                           (dst, src, elem_size, pe))


def aclshmemx_signal_op_on_stream(sig_addr: np.ndarray, signal: int, sig_op: int, pe: int,
                                  stream: aclrtStream | None = None) -> None:
    """Queue ``aclshmemx_signal_op(sig_addr, signal, sig_op, pe)``."""
    _stream(stream)._queue(f"aclshmemx_signal_op_on_stream(pe={pe}, signal={signal}, sig_op={sig_op})",
                           aclshmemx_signal_op, (sig_addr, signal, sig_op, pe))


def aclshmemx_signal_wait_until_on_stream(sig_addr: np.ndarray, cmp: int, cmp_val: int,
                                          stream: aclrtStream | None = None) -> None:
    """Queue ``aclshmem_signal_wait_until(sig_addr, cmp, cmp_val)``."""
    _stream(stream)._queue(f"aclshmemx_signal_wait_until_on_stream(cmp={cmp}, cmp_val={cmp_val})",
                           aclshmem_signal_wait_until, (sig_addr, cmp, cmp_val))


def _quiet_peers(peers) -> None:
    rt = runtime()
    for pe in peers:
        if pe != rt.my_pe and reaching(rt, pe) is Engine.UDMA:  # (nothing was sent where nothing reaches)
            aclshmemx_udma_quiet(pe)
    if rt.sdma is not None:
        aclshmemx_sdma_quiet()


def aclshmemx_quiet_on_stream(stream: aclrtStream | None = None) -> None:
    """Queue a quiet of what this PE's host issued: UDMA QP 0 to every peer, the host thread's SDMA channel."""
    _stream(stream)._queue("aclshmemx_quiet_on_stream", lambda: _quiet_peers(range(runtime().n_pes)))


def aclshmemx_handle_wait(handle: aclshmem_handle_t, stream: aclrtStream | None = None) -> None:
    """Queue the completion of ``handle``'s operations: quiet QP 0 to every other member of its team, then the
    team's barrier."""
    if not isinstance(handle, aclshmem_handle_t):
        raise TypeError(f"pe {runtime().my_pe}: aclshmemx_handle_wait: handle must be an aclshmem_handle_t, got "
                        f"{handle!r}")
    team = handle.team_id

    def wait() -> None:
        _quiet_peers(team_info(team).members)
        aclshmem_barrier(team)

    _stream(stream)._queue(f"aclshmemx_handle_wait(team={team})", wait)


def aclrtWaitAndResetNotify(notify: Notify, stream: aclrtStream | None = None, timeout: int = 0) -> int:
    """Queue a wait for ``notify`` (``sdma_notify(block)``) to be recorded, then its reset; ``timeout`` in ms, 0:
    the job's timeout. Returns 0."""
    if not isinstance(notify, Notify):
        raise TypeError(f"pe {runtime().my_pe}: aclrtWaitAndResetNotify: notify must be a shmemx.sdma_notify(...) "
                        f"handle, got {notify!r}")

    def wait() -> None:
        rt = runtime()
        wait = Wait(WaitCall.STREAM_SYNC, pe=rt.my_pe, qp=notify.block,
                    describe=lambda: f"pe {rt.my_pe}: aclrtWaitAndResetNotify: the notify of block {notify.block} "
                                     f"was not recorded")
        block_until(rt, lambda: notify.recorded > 0, wait, sleep=Sleep.wake(rt.my_pe),
                    timeout=timeout / 1000 if timeout else None, spin=0)
        notify.recorded = 0

    _stream(stream)._queue(f"aclrtWaitAndResetNotify(block {notify.block})", wait)
    return 0

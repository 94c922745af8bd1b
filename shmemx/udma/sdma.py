"""The SDMA engine of a PE: a FIFO channel per AIV block, one engine thread that executes them, notifies.

What CANN's SDMA does (``src/device/gm2gm/engine/shmem_device_sdma.hpp``): every AIV block owns a STARS channel,
an SQ the DMA engine executes in order. ``aclshmemx_sdma_put_nbi`` / ``_get_nbi`` split a copy into SQEs of at
most 1 MiB on the calling block's channel and ring its doorbell; ``aclshmemx_sdma_quiet`` submits a flag SQE and
polls it, so it completes the calling block's earlier copies (all of them: the channel is FIFO), not other
blocks'; ``aclshmemx_sdma_notify_record`` submits a notify SQE that fires once the channel's earlier SQEs are
done (a host waits for it with ``aclrtWaitAndResetNotify``). Channels are not ordered with each other, nor with
MTE copies, UDMA WQEs or ``signal_op``: a flag that says "the payload is there" goes after an SDMA quiet.

Here: ``SdmaEngine.post`` appends a copy's SQEs (raw numpy byte views of both sides, resolved and checked by
the caller) to the calling block's channel and wakes the engine thread; the thread serves the channels round
robin, one SQE at a time (so a channel's SQEs complete in order and channels interleave), bumps the channel's
completed count and the wake words of the target PE and of this one (so that waiters on the data and quiets
re-check). ``completed(block)`` / ``posted(block)`` are what a quiet waits on (``api.sdma``, through
``shm.waits``). Who writes what: posting threads append under the engine's lock; only the engine thread pops and
counts. A copy that fails (it cannot, once checked; but the thread never swallows one) breaks its channel: the
channel's next quiet raises it. ``stop`` executes everything posted, then ends the thread (finalize).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

__all__ = ["SdmaEngine", "Notify", "SQE_BYTES", "MAX_CHANNELS"]

SQE_BYTES = 1 << 20  # CANN: one SQE per MiB
MAX_CHANNELS = 128  # one per AIV block (CANN: 48 AIVs per NPU)


@dataclass
class Notify:
    """A notify (``aclrtNotify``) that a block's ``notify_record`` fires after its earlier SDMA copies:
    ``recorded`` counts the records not yet consumed by a wait-and-reset."""

    block: int
    recorded: int = 0


@dataclass
class _Sqe:
    dst: np.ndarray | None  # uint8 views; None for a notify record
    src: np.ndarray | None
    target: int  # the PE whose memory it writes
    notify: Notify | None = None
    what: str = ""


@dataclass
class _Channel:
    block: int
    sqes: deque = field(default_factory=deque)
    posted: int = 0  # SQEs appended (written by posting threads, under the lock)
    done: int = 0  # SQEs executed (written by the engine thread only)
    error: BaseException | None = None


class SdmaEngine:
    """One PE's SDMA engine (see the module docstring). ``wake(pe)`` bumps PE ``pe``'s wake word."""

    def __init__(self, my_pe: int, wake: Callable[[int], object]):
        self.my_pe = my_pe
        self._wake = wake
        self.channels: dict[int, _Channel] = {}
        self.notifies: dict[int, Notify] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"shmemx-pe{my_pe}-sdma", daemon=True)
        self._thread.start()

    def channel(self, block: int) -> _Channel:
        ch = self.channels.get(block)
        if ch is None:
            with self._cond:
                ch = self.channels.setdefault(block, _Channel(block))
        return ch

    def notify(self, block: int) -> Notify:
        """The notify of ``block``'s channel (CANN: ``notify_arr[block]``)."""
        with self._cond:
            return self.notifies.setdefault(block, Notify(block))

    def post(self, block: int, dst: np.ndarray, src: np.ndarray, target: int, what: str) -> int:
        """Append the copy ``src`` -> ``dst`` (uint8 views of equal size) to ``block``'s channel, in SQEs of at
        most ``SQE_BYTES``; returns the channel's posted count after it (what a quiet waits for)."""
        n = dst.nbytes
        sqes = [_Sqe(dst[o:o + SQE_BYTES], src[o:o + SQE_BYTES], target, what=what)
                for o in range(0, max(n, 1), SQE_BYTES)] if n else []
        return self._append(block, sqes)

    def record_notify(self, block: int) -> int:
        """Append a notify record of ``block``'s notify to its channel; returns the posted count."""
        return self._append(block, [_Sqe(None, None, self.my_pe, notify=self.notify(block))])

    def _append(self, block: int, sqes: list) -> int:
        ch = self.channel(block)
        with self._cond:
            if self._stopping:
                raise RuntimeError(f"pe {self.my_pe}: SDMA engine stopped (finalized)")
            ch.sqes.extend(sqes)
            ch.posted += len(sqes)
            self._cond.notify()
            return ch.posted

    def _next(self) -> tuple[_Channel, _Sqe] | None:
        """The next SQE, round robin over the channels (the caller holds the lock); None when idle."""
        for ch in list(self.channels.values()):
            if ch.sqes:
                self.channels[ch.block] = self.channels.pop(ch.block)  # to the back: the next one goes first
                return ch, ch.sqes.popleft()
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                item = self._next()
                while item is None:
                    if self._stopping:
                        return
                    self._cond.wait()
                    item = self._next()
            ch, sqe = item
            try:
                if sqe.notify is not None:
                    sqe.notify.recorded += 1
                elif ch.error is None:
                    np.copyto(sqe.dst, sqe.src)
            except BaseException as exc:  # the next quiet of this channel raises it
                ch.error = RuntimeError(f"pe {self.my_pe}: SDMA SQE of {sqe.what} on block {ch.block}'s channel "
                                        f"failed: {exc!r}")
            ch.done += 1
            self._wake(sqe.target)
            if sqe.target != self.my_pe:
                self._wake(self.my_pe)

    def stop(self) -> None:
        """Execute every posted SQE, then end the engine thread (idempotent)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

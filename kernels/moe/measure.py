"""Per-call measurements of the MoE kernels: where each block spent its time, and what went on each QP.

Every ``Buffer`` call fills a ``CallStats`` (``Buffer.last_stats``; ``Buffer.history`` keeps the recent ones).
Block timers are ``time.perf_counter`` differences taken by the block itself around each phase, written into
the block's own row (no shared counters, as the seed recommends: no hot atomics for measuring):

==========  ============================================================================================
route       route scan: which of the channel's tokens go to which peer
pack        gathering rows and metadata into the staging area (aggregate packing, metadata always)
build       building the WQEs (one numpy operation per unit)
submit      reserve, write into the SQ ring, doorbell (the closer's completion WQE rides in the same batch)
quiet       ``qp_quiet`` of each lane the block posted (the engine copies meanwhile)
sync        ``sync_all`` between rounds (waiting for the slowest block of the round)
wait        waiting for completion signals (and, before the call, for credits)
epilogue    copying received rows out (dispatch) or the reduction (combine)
==========  ============================================================================================

Per lane (peer, QP): WQEs posted and bytes they carry (payload and metadata, not the 64-byte WQEs themselves),
counted when posting. Rows sent to this PE itself are local copies and counted apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PHASES", "CallStats", "BlockTimer"]

PHASES = ("route", "pack", "build", "submit", "quiet", "sync", "wait", "epilogue")
_INDEX = {name: i for i, name in enumerate(PHASES)}


class BlockTimer:
    """Accumulates one block's phase times into its row of ``CallStats.phases``.

    ``mark()`` returns now; ``lap(phase, since)`` adds ``now - since`` to ``phase`` and returns now, so a block
    chains laps without nested context managers: ``t = timer.lap("build", t)``.
    """

    __slots__ = ("row",)

    def __init__(self, row: np.ndarray):
        self.row = row

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    def lap(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.row[_INDEX[phase]] += now - since
        return now


@dataclass
class CallStats:
    """Measurements of one ``Buffer`` call on this PE.

    Attributes:
        kind: ``"dispatch"``, ``"cached_dispatch"`` or ``"combine"``.
        pe: this PE. seq: the call's sequence number (the same on every PE).
        schedule: the ``Schedule`` in force (str).
        rounds: rounds of the send plan.
        wall: seconds of the whole call on this PE (host side, validation to return).
        notify: seconds of the notify kernel (fresh dispatch only).
        kernel: seconds of the main kernel launch.
        phases: ``[blocks, len(PHASES)] float64`` seconds per block and phase.
        lane_wqes, lane_bytes: ``[P, Q] int64`` WQEs and bytes posted per (peer, qp).
        local_rows, local_bytes: rows and bytes copied to this PE itself.
        sent_rows: rows sent to other PEs. recv_rows: rows received (from every PE, this one included).
    """

    kind: str
    pe: int
    seq: int
    schedule: str
    rounds: int
    phases: np.ndarray
    lane_wqes: np.ndarray
    lane_bytes: np.ndarray
    wall: float = 0.0
    notify: float = 0.0
    kernel: float = 0.0
    local_rows: int = 0
    local_bytes: int = 0
    sent_rows: int = 0
    recv_rows: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def empty(cls, kind: str, pe: int, seq: int, schedule, rounds: int, blocks: int, n_pes: int,
              n_qps: int) -> "CallStats":
        return cls(kind, pe, seq, str(schedule), rounds, np.zeros((blocks, len(PHASES))),
                   np.zeros((n_pes, n_qps), np.int64), np.zeros((n_pes, n_qps), np.int64))

    def timer(self, block: int) -> BlockTimer:
        return BlockTimer(self.phases[block])

    @property
    def qp_wqes(self) -> np.ndarray:
        """``[Q] int64`` WQEs per QP (summed over peers)."""
        return self.lane_wqes.sum(0)

    @property
    def qp_bytes(self) -> np.ndarray:
        """``[Q] int64`` bytes per QP (summed over peers)."""
        return self.lane_bytes.sum(0)

    def phase_max(self) -> dict[str, float]:
        """Seconds per phase of the slowest block in that phase."""
        return {name: float(self.phases[:, i].max()) for i, name in enumerate(PHASES)}

    def summary(self) -> str:
        """A few lines: the call, its WQEs and bytes per QP, the phases of the slowest block."""
        qps = ", ".join(f"qp{q} {int(w)} WQEs {int(b) / 1e6:.2f} MB"
                        for q, (w, b) in enumerate(zip(self.qp_wqes, self.qp_bytes)))
        phases = " ".join(f"{k} {v * 1e3:.2f}" for k, v in self.phase_max().items() if v > 0)
        return (f"pe {self.pe} {self.kind} #{self.seq} [{self.schedule}, {self.rounds} rounds]: "
                f"{self.wall * 1e3:.2f} ms (notify {self.notify * 1e3:.2f}, kernel {self.kernel * 1e3:.2f}); "
                f"sent {self.sent_rows} rows + {self.local_rows} local, received {self.recv_rows}; {qps}; "
                f"slowest block ms: {phases}")

    def vector(self, n_qps: int | None = None) -> np.ndarray:
        """The numbers as one float64 vector of ``vector_len(n_qps)`` (for gathering over PEs through the heap;
        the per-QP counts padded with zeros to ``n_qps``); see ``unpack``."""
        head = [self.wall, self.notify, self.kernel, self.local_rows, self.local_bytes, self.sent_rows,
                self.recv_rows, self.rounds]
        n_qps = self.lane_wqes.shape[1] if n_qps is None else n_qps
        qps = np.zeros((2, n_qps))
        qps[0, :self.lane_wqes.shape[1]] = self.qp_wqes
        qps[1, :self.lane_wqes.shape[1]] = self.qp_bytes
        return np.concatenate([np.array(head, np.float64), self.phase_max_array(), qps.reshape(-1)])

    def phase_max_array(self) -> np.ndarray:
        return self.phases.max(0) if len(self.phases) else np.zeros(len(PHASES))

    @staticmethod
    def vector_len(n_qps: int) -> int:
        return 8 + len(PHASES) + 2 * n_qps

    @staticmethod
    def unpack(vec: np.ndarray, n_qps: int) -> dict:
        """Inverse of ``vector``: a dict of the head fields, ``phases`` (slowest block per phase),
        ``qp_wqes`` and ``qp_bytes``."""
        names = ("wall", "notify", "kernel", "local_rows", "local_bytes", "sent_rows", "recv_rows", "rounds")
        out = {n: float(v) for n, v in zip(names, vec[:8])}
        p = 8 + len(PHASES)
        out["phases"] = dict(zip(PHASES, vec[8:p].tolist()))
        out["qp_wqes"] = vec[p:p + n_qps].astype(np.int64)
        out["qp_bytes"] = vec[p + n_qps:p + 2 * n_qps].astype(np.int64)
        return out

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

Counts per block (``COUNTS``, summed over blocks by ``totals()``), also counted where the event happens:

=============  =========================================================================================
so_writes      strong-order (SO) WQEs: fenced completion signals, generation writes, hierarchy records
quiets         ``qp_quiet`` calls
syncs          ``sync_all`` calls of the PE's blocks (per block)
barriers       PE-level barriers (the hierarchy's intra-server flag barrier)
flag_writes    completion signals, end flags, IPC flags (one per written flag word)
credit_writes  credit words written to peers (end-of-call credits, MoonEP's per-round credits)
mte_copies     direct (MTE) copies into a peer's memory (the hierarchy's intra-server forwarding)
route_reads    elements of the routing plan read by the route phase (scan: tokens x P, compact: tokens x K)
=============  =========================================================================================

Per round, the PEs this PE posted to (``round_dsts [rounds, P] bool``); over all PEs of a job its column sums
are the in-degree of each receiver per round (``in_degree``). ``peer_hidden_bytes [P]``: hidden-row bytes this
PE sent to each PE (relays included, metadata not); ``cross_server_bytes`` is their sum over PEs of other
servers (of the Buffer's ``Topology``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = ["PHASES", "COUNTS", "CallStats", "BlockTimer", "over_pes", "in_degree"]

PHASES = ("route", "pack", "build", "submit", "quiet", "sync", "wait", "epilogue")
_INDEX = {name: i for i, name in enumerate(PHASES)}
COUNTS = ("so_writes", "quiets", "syncs", "barriers", "flag_writes", "credit_writes", "mte_copies", "route_reads")
_COUNT = {name: i for i, name in enumerate(COUNTS)}


class BlockTimer:
    """Accumulates one block's phase times into its row of ``CallStats.phases``.

    ``mark()`` returns now; ``lap(phase, since)`` adds ``now - since`` to ``phase`` and returns now, so a block
    chains laps without nested context managers: ``t = timer.lap("build", t)``.
    """

    __slots__ = ("row", "counts")

    def __init__(self, row: np.ndarray, counts: np.ndarray | None = None):
        self.row = row
        self.counts = counts

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to this block's count ``name`` (one of ``COUNTS``)."""
        self.counts[_COUNT[name]] += n

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
        counts: ``[blocks, len(COUNTS)] int64`` (see the module docstring; ``totals()`` sums the blocks).
        round_dsts: ``[rounds, P] bool`` the PEs posted to in each round.
        peer_hidden_bytes: ``[P] int64`` hidden-row bytes sent to each PE; cross_server_bytes: those to other
            servers.
        blocks_launched: AIV blocks of the main kernel's launch; split_blocks: the Buffer's setting (a batched
            fullmesh call of C channels runs on C blocks, or on block 0 alone).
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
    counts: np.ndarray | None = None
    round_dsts: np.ndarray | None = None
    peer_hidden_bytes: np.ndarray | None = None
    cross_server_bytes: int = 0
    blocks_launched: int = 0
    split_blocks: bool = False

    @classmethod
    def empty(cls, kind: str, pe: int, seq: int, schedule: object, rounds: int, blocks: int, n_pes: int,
              n_qps: int) -> "CallStats":
        return cls(kind, pe, seq, str(schedule), rounds, np.zeros((blocks, len(PHASES))),
                   np.zeros((n_pes, n_qps), np.int64), np.zeros((n_pes, n_qps), np.int64),
                   counts=np.zeros((blocks, len(COUNTS)), np.int64), round_dsts=np.zeros((rounds, n_pes), bool),
                   peer_hidden_bytes=np.zeros(n_pes, np.int64))

    def timer(self, block: int) -> BlockTimer:
        return BlockTimer(self.phases[block], self.counts[block])

    def totals(self) -> dict[str, int]:
        """Every count of ``COUNTS`` summed over the blocks."""
        return {name: int(v) for name, v in zip(COUNTS, self.counts.sum(0))}

    @property
    def active_peers(self) -> list[int]:
        """PEs posted to, per round."""
        return [int(v) for v in self.round_dsts.sum(1)]

    @staticmethod
    def max_min(values: npt.ArrayLike) -> float:
        """max / min over the entries that are not zero (1.0 when fewer than two; inf when only some are zero is
        not possible: zeros are left out)."""
        v = np.asarray(values, np.float64)
        v = v[v > 0]
        return float(v.max() / v.min()) if len(v) > 1 else 1.0

    def effective_bandwidth(self, hidden_bytes: int | None = None) -> float:
        """Bytes per second as DeepEP counts it: received rows x H x element size / the call's time (combine: the
        rows this PE got back)."""
        row = self.extra.get("hidden_bytes", hidden_bytes)
        return self.recv_rows * row / self.wall if self.wall > 0 and row else 0.0

    def record(self) -> dict:
        """The numbers as plain Python values (JSON-ready; what the experiments collect per PE)."""
        out = {k: getattr(self, k) for k in ("kind", "pe", "seq", "schedule", "rounds", "wall", "notify",
                                                  "kernel", "local_rows", "local_bytes", "sent_rows", "recv_rows",
                                                  "cross_server_bytes", "blocks_launched", "split_blocks")}
        out.update(self.totals())
        out["phases"] = self.phase_max()
        out["qp_wqes"] = self.qp_wqes.tolist()
        out["qp_bytes"] = self.qp_bytes.tolist()
        out["active_peers"] = self.active_peers
        out["round_dsts"] = [np.flatnonzero(r).tolist() for r in self.round_dsts]
        out["hidden_bytes_sent"] = int(self.peer_hidden_bytes.sum())
        out["block_busy"] = self.phases.sum(1).tolist()
        out["effective_bandwidth"] = self.effective_bandwidth()
        return out

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


def over_pes(values: npt.ArrayLike) -> dict:
    """max (and which PE), p50, p95 and mean of one number over the PEs of a job."""
    v = np.asarray(values, np.float64)
    if not len(v):
        return {"max": 0.0, "max_pe": -1, "p50": 0.0, "p95": 0.0, "mean": 0.0}
    return {"max": float(v.max()), "max_pe": int(v.argmax()), "p50": float(np.percentile(v, 50)),
            "p95": float(np.percentile(v, 95)), "mean": float(v.mean())}


def in_degree(round_dsts: list) -> np.ndarray:
    """``[rounds, P] int64``: per round, how many PEs posted to each PE, from every PE's ``round_dsts`` (a list
    over source PEs of ``[rounds, P]`` bool, or of per-round lists of destinations)."""
    mats = []
    for r in round_dsts:
        if isinstance(r, np.ndarray):
            mats.append(r.astype(np.int64))
        else:
            n = len(round_dsts)
            m = np.zeros((len(r), n), np.int64)
            for k, dsts in enumerate(r):
                m[k, list(dsts)] = 1
            mats.append(m)
    rounds = max(m.shape[0] for m in mats)
    out = np.zeros((rounds, mats[0].shape[1]), np.int64)
    for m in mats:
        out[:m.shape[0]] += m
    return out

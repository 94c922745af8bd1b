"""Per-(pe, block) counters: WQEs and bytes per queue, time in quiet, barriers and waits, and user counters.

The public side is ``shmemx.stats()`` (every PE's counters as arrays), ``shmemx.count(name, n)`` (a user
counter; both in ``api.inspection``) and ``shmemx run --stats`` (a table at the end of the job).

Each PE owns one stats segment (``shmemx_<job>_stats<pe>``). After a 4 KiB header (the slots in use and the names
of the user counters) it holds one record per wait slot of the PE (slot = AIV block index, 0 = the main thread,
the last = the DMA engine), each written by its own thread only, so no word is shared and no atomic is needed:

    record[slot] = timers [TIMERS] u64 | user counters [MAX_USER] u64 | counts [COUNTS] u64
                   | per queue [n_pes * qp_num][2] u64

``timers`` are (quiet ns, quiet calls, barrier ns, barrier calls, wait ns, waits that blocked, region ns,
regions); ``counts`` are (doorbells rung, ``sync_all`` calls, CQEs consumed by quiets); a queue's pair is (WQEs posted, bytes posted) by that slot to (peer, qp) = ``index // qp_num, index %
qp_num``. WQEs and bytes the engine completed come from the engine's own per-queue record in the UDMA segment
(``hw.executed`` / ``hw.bytes``), which it already keeps per batch.

Cost on the posting path: ``post_rw`` adds to two plain Python ints of its ``QueuePair`` (~35 ns); the owning
thread publishes them into its slot at every quiet of that queue, when it hands the queue over, at the end of a
kernel launch and at finalize. So a live reader (``shmemx dump``, ``shmemx.stats()`` of another PE) sees posted
counts as of the last quiet, and every count is exact once the job quieted. Timers are stored directly (they
are per call, not per WQE).

``JobStats`` reads every PE's segment (live or stopped, from any process) into arrays; ``shmemx run --stats``
prints its ``table()``, and ``shmemx.stats()`` returns it inside a rank.
"""

from __future__ import annotations

import threading
from typing import Iterable

import numpy as np

from ..shm.control import MAX_WAIT_SLOTS
from ..shm.segment import Segment, segment_name
from ..udma.segment import UdmaSegment

__all__ = [
    "TIMERS",
    "MAX_USER",
    "StatsSegment",
    "JobStats",
]

MAGIC = 0x31305F5354415453  # "STATS_01"
TIMERS = ("quiet_ns", "quiets", "barrier_ns", "barriers", "wait_ns", "waits", "region_ns", "regions")
T_QUIET, T_BARRIER, T_WAIT, T_REGION = 0, 2, 4, 6  # index of the ns word; the count follows it
MAX_USER = 64
N_TIMERS = len(TIMERS)
COUNTS = ("doorbells", "block_syncs", "cqes_consumed")  # per slot: doorbells rung, sync_all calls, CQEs consumed
C_DOORBELLS, C_BLOCK_SYNCS, C_CQES = range(3)
N_COUNTS = len(COUNTS)
Q0 = N_TIMERS + MAX_USER + N_COUNTS  # a record's first per-queue word
USED_OFFSET = 64  # u8 per slot: 1 once the slot's thread wrote anything
NAMES_OFFSET = 1024  # S32 per user counter
NAME_BYTES = 32
HEADER_SIZE = 4096



def _slot_words(n_queues: int) -> int:
    words = Q0 + 2 * n_queues
    return -(-words // 8) * 8  # a record starts on a cache line


def segment_size(n_pes: int, qp_num: int) -> int:
    return HEADER_SIZE + MAX_WAIT_SLOTS * _slot_words(n_pes * qp_num) * 8


class StatsSegment:
    """One PE's stats segment: its own (writable, inside the rank) or any PE's (read-only, from outside)."""

    def __init__(self, segment: Segment):
        self.segment = segment
        head = segment.view("<u8", 0, (2,))
        if int(head[0]) != MAGIC:
            raise ValueError(f"{segment.name}: not a shmemx stats segment (bad magic)")
        hdr = segment.view("<u4", 8, (4,))
        self.n_pes, self.qp_num = int(hdr[0]), int(hdr[1])
        self.n_queues = self.n_pes * self.qp_num
        self.slot_words = _slot_words(self.n_queues)
        self.used = segment.view("u1", USED_OFFSET, (MAX_WAIT_SLOTS,))
        self.names = segment.view(f"S{NAME_BYTES}", NAMES_OFFSET, (MAX_USER,))
        self.records = segment.view("<u8", HEADER_SIZE, (MAX_WAIT_SLOTS, self.slot_words))
        self.words = None if segment.readonly else memoryview(segment.mm).cast("Q")
        self._user: dict[str, int] = {}
        self._bases: dict[int, int] = {}  # slot -> index of its record in ``words``, once marked used
        self._lock = threading.Lock()

    @classmethod
    def create(cls, job_id: str, pe: int, n_pes: int, qp_num: int) -> "StatsSegment":
        seg = Segment(segment_name(job_id, f"stats{pe}"), segment_size(n_pes, qp_num), create=True)
        seg.view("<u4", 8, (4,))[:2] = (n_pes, qp_num)
        seg.view("<u8", 0, (1,))[0] = MAGIC
        return cls(seg)

    @classmethod
    def attach(cls, job_id: str, pe: int) -> "StatsSegment":
        return cls(Segment(segment_name(job_id, f"stats{pe}"), readonly=True))

    def close(self) -> None:
        self.words = None
        self.records = self.used = self.names = None
        self.segment.close()

    # --- writing (inside the rank; each slot by its own thread) ---------------------------------------------

    def _base(self, slot: int) -> int:
        base = self._bases.get(slot)
        if base is None:  # the slot's first use: mark it (a numpy read costs ~1 us cold, a dict hit 50 ns)
            self.used[slot] = 1
            base = self._bases[slot] = HEADER_SIZE // 8 + slot * self.slot_words
        return base

    def add_posted(self, slot: int, queue: int, wqes: int, nbytes: int) -> None:
        """Add ``wqes`` WQEs of ``nbytes`` posted by ``slot`` to queue ``queue`` (= peer * qp_num + qp)."""
        i = self._base(slot) + Q0 + 2 * queue
        w = self.words
        w[i] += wqes
        w[i + 1] += nbytes

    def add_posted_many(self, slot: int, queues: np.ndarray, wqes: np.ndarray, nbytes: np.ndarray) -> None:
        """``add_posted`` for many queues (distinct indices) at once."""
        i = self._base(slot) - HEADER_SIZE // 8 + Q0 + 2 * np.asarray(queues, np.int64)
        row = self.records.reshape(-1)  # ``words`` from the first record on
        row[i] += np.asarray(wqes, np.uint64)
        row[i + 1] += np.asarray(nbytes, np.uint64)

    def add_time(self, slot: int, timer: int, ns: int) -> None:
        """Add one call of ``ns`` nanoseconds to timer ``timer`` (T_QUIET, T_BARRIER, T_WAIT, T_REGION)."""
        i = self._base(slot) + timer
        w = self.words
        w[i] += ns
        w[i + 1] += 1

    def add_quiet(self, slot: int, ns: int, calls: int = 1) -> None:
        """``calls`` quiets (one native call may quiet several queues) that took ``ns`` together."""
        i = self._base(slot) + T_QUIET
        w = self.words
        w[i] += ns
        w[i + 1] += calls

    def add_counts(self, slot: int, doorbells: int, cqes: int) -> None:
        """Doorbells rung and CQEs consumed by ``slot`` (published with its posted counts)."""
        i = self._base(slot) + N_TIMERS + MAX_USER
        w = self.words
        w[i + C_DOORBELLS] += doorbells
        w[i + C_CQES] += cqes

    def add_block_sync(self, slot: int) -> None:
        """One ``sync_all`` of block ``slot``."""
        self.words[self._base(slot) + N_TIMERS + MAX_USER + C_BLOCK_SYNCS] += 1

    def add_barrier(self, slot: int, ns: int) -> None:
        self.add_time(slot, T_BARRIER, ns)

    def add_wait(self, slot: int, ns: int) -> None:
        self.add_time(slot, T_WAIT, ns)

    def add_region(self, slot: int, ns: int) -> None:
        self.add_time(slot, T_REGION, ns)

    def add_user(self, slot: int, name: str, n: int) -> None:
        index = self._user.get(name)
        if index is None:
            index = self._user_index(name)
        i = self._base(slot) + N_TIMERS + index
        self.words[i] = (self.words[i] + n) & 0xFFFF_FFFF_FFFF_FFFF

    def _user_index(self, name: str) -> int:
        if not isinstance(name, str) or not name:
            raise ValueError(f"shmemx.count: the counter name must be a non-empty string, got {name!r}")
        raw = name.encode()
        if len(raw) > NAME_BYTES:
            raise ValueError(f"shmemx.count: counter name {name!r} is longer than {NAME_BYTES} bytes")
        with self._lock:
            if name in self._user:
                return self._user[name]
            index = len(self._user)
            if index >= MAX_USER:
                raise ValueError(f"shmemx.count: more than {MAX_USER} counter names on one PE "
                                 f"({', '.join(self._user)}, {name})")
            self.names[index] = raw
            self._user[name] = index
            return index


class JobStats:
    """Every PE's counters, read at one moment, as arrays.

    Attributes:
        n_pes, qp_num: the job's shape.
        posted_wqes, posted_bytes: ``[n_pes, n_pes, qp_num] uint64``: [pe, peer, qp], summed over blocks.
        completed_wqes, completed_bytes: ``[n_pes, n_pes, qp_num] uint64``: executed by pe's engine.
        block_posted_wqes, block_posted_bytes: ``[n_pes, slots] uint64``: per (pe, block), summed over queues.
        timers: ``{name: [n_pes, slots] uint64}`` for each of ``TIMERS`` (ns, or number of calls).
        counts: ``{name: [n_pes, slots] uint64}`` for each of ``COUNTS`` (doorbells, block_syncs, cqes_consumed).
        user: ``{counter name: [n_pes, slots] uint64}``.
        missing: PEs whose segments could not be read (not started, or already removed).

    ``slots`` = 130: AIV blocks 0..127 (0 is also the main thread), then one unused, then the engine.
    """

    def __init__(self, n_pes: int, qp_num: int):
        self.n_pes, self.qp_num = n_pes, qp_num
        shape = (n_pes, n_pes, qp_num)
        self.posted_wqes = np.zeros(shape, np.uint64)
        self.posted_bytes = np.zeros(shape, np.uint64)
        self.completed_wqes = np.zeros(shape, np.uint64)
        self.completed_bytes = np.zeros(shape, np.uint64)
        self.block_posted_wqes = np.zeros((n_pes, MAX_WAIT_SLOTS), np.uint64)
        self.block_posted_bytes = np.zeros((n_pes, MAX_WAIT_SLOTS), np.uint64)
        self.timers = {name: np.zeros((n_pes, MAX_WAIT_SLOTS), np.uint64) for name in TIMERS}
        self.counts = {name: np.zeros((n_pes, MAX_WAIT_SLOTS), np.uint64) for name in COUNTS}
        self.user: dict[str, np.ndarray] = {}
        self.missing: list[int] = []

    @classmethod
    def read(cls, job_id: str, n_pes: int, *, segments: dict | None = None) -> "JobStats":
        """Read PE 0..n_pes-1 of ``job_id``; ``segments`` may map a PE to an already mapped ``StatsSegment``."""
        given = segments or {}
        mapped: dict[int, StatsSegment] = {}
        for pe in range(n_pes):
            if pe in given:
                mapped[pe] = given[pe]
                continue
            try:
                mapped[pe] = StatsSegment.attach(job_id, pe)
            except (FileNotFoundError, ValueError):
                pass
        qp_num = next(iter(mapped.values())).qp_num if mapped else 1
        out = cls(n_pes, qp_num)
        out.missing = [pe for pe in range(n_pes) if pe not in mapped]
        try:
            for pe, seg in mapped.items():
                out._take(pe, seg)
                out._take_completed(job_id, pe)
        finally:
            for pe, seg in mapped.items():
                if pe not in given:
                    seg.close()
        return out

    _ROWS = ("posted_wqes", "posted_bytes", "completed_wqes", "completed_bytes", "block_posted_wqes",
             "block_posted_bytes")

    def save(self, path: str, pes: Iterable[int]) -> None:
        """The rows of ``pes`` to ``path`` (``.npz``): a host's part of the counters of a job of several hosts,
        for ``merge``."""
        rows = np.asarray(list(pes), np.int64)
        arrays = {"pes": rows, "shape": np.array([self.n_pes, self.qp_num], np.int64)}
        arrays.update({name: getattr(self, name)[rows] for name in self._ROWS})
        for prefix, table in (("timer__", self.timers), ("count__", self.counts), ("user__", self.user)):
            arrays.update({prefix + name: arr[rows] for name, arr in table.items()})
        np.savez(path, **arrays)

    @classmethod
    def merge(cls, paths: Iterable[str], n_pes: int) -> "JobStats":
        """One job's counters from its hosts' parts (``save``): every PE's rows, whatever host wrote them."""
        out, seen = None, set()
        for path in paths:
            with np.load(path) as z:
                if out is None:
                    out = cls(n_pes, int(z["shape"][1]))
                rows = z["pes"]
                for name in cls._ROWS:
                    getattr(out, name)[rows] = z[name]
                for key in z.files:
                    prefix, _, name = key.partition("__")
                    if prefix in ("timer", "count", "user"):
                        table = {"timer": out.timers, "count": out.counts, "user": out.user}[prefix]
                        table.setdefault(name, np.zeros((n_pes, MAX_WAIT_SLOTS), np.uint64))[rows] = z[key]
                seen.update(rows.tolist())
        out = out or cls(n_pes, 1)
        out.missing = sorted(set(range(n_pes)) - seen)
        return out

    def _take_completed(self, job_id: str, pe: int) -> None:
        try:
            udma = UdmaSegment.attach(job_id, pe)
        except (FileNotFoundError, ValueError):
            return
        try:
            executed = np.array(udma.hw["executed"]).reshape(self.n_pes, self.qp_num)
            nbytes = np.array(udma.hw["bytes"]).reshape(self.n_pes, self.qp_num)
        finally:
            udma.close()
        self.completed_wqes[pe] = executed
        self.completed_bytes[pe] = nbytes

    def _take(self, pe: int, seg: StatsSegment) -> None:
        slots = np.flatnonzero(seg.used)
        rec = np.array(seg.records[slots])  # copy: only the slots in use (the file is sparse)
        q0 = Q0
        queues = rec[:, q0:q0 + 2 * seg.n_queues].reshape(len(slots), seg.n_queues, 2)
        self.posted_wqes[pe] = queues[:, :, 0].sum(axis=0).reshape(self.n_pes, self.qp_num)
        self.posted_bytes[pe] = queues[:, :, 1].sum(axis=0).reshape(self.n_pes, self.qp_num)
        self.block_posted_wqes[pe, slots] = queues[:, :, 0].sum(axis=1)
        self.block_posted_bytes[pe, slots] = queues[:, :, 1].sum(axis=1)
        for t, name in enumerate(TIMERS):
            self.timers[name][pe, slots] = rec[:, t]
        for k, name in enumerate(COUNTS):
            self.counts[name][pe, slots] = rec[:, N_TIMERS + MAX_USER + k]
        for index, raw in enumerate(seg.names):
            if not raw:
                break
            name = raw.decode(errors="replace")
            arr = self.user.setdefault(name, np.zeros((self.n_pes, MAX_WAIT_SLOTS), np.uint64))
            arr[pe, slots] = rec[:, N_TIMERS + index]

    # --- summaries -----------------------------------------------------------------------------------------

    def per_pe(self) -> dict[str, np.ndarray]:
        """``{metric: [n_pes] array}``: every metric summed over blocks and queues (times in seconds, float64)."""
        out = {
            "wqes_posted": self.posted_wqes.sum(axis=(1, 2)),
            "bytes_posted": self.posted_bytes.sum(axis=(1, 2)),
            "wqes_completed": self.completed_wqes.sum(axis=(1, 2)),
            "bytes_completed": self.completed_bytes.sum(axis=(1, 2)),
        }
        for name in COUNTS:
            out[name] = self.counts[name].sum(axis=1)
        for name in TIMERS:
            total = self.timers[name].sum(axis=1)
            out[name.replace("_ns", "_s")] = total / 1e9 if name.endswith("_ns") else total
        for name, arr in self.user.items():
            out[f"user:{name}"] = arr.sum(axis=1)
        return out

    def table(self, pes: bool = True) -> str:
        """The ``--stats`` table: one row per PE (if ``pes``), then avg, max and the PE holding the max."""
        cols = self.per_pe()
        cols = {k: v for k, v in cols.items() if k.startswith(("wqes", "bytes", "user:")) or v.any()}
        names = list(cols)
        header = ["pe"] + [n.removeprefix("user:") for n in names]
        rows = []
        if pes:
            for pe in range(self.n_pes):
                rows.append([str(pe)] + [_fmt(cols[n][pe]) for n in names])
        avg = [_fmt(cols[n].mean()) for n in names]
        top = [_fmt(cols[n].max()) for n in names]
        arg = [str(int(np.argmax(cols[n]))) for n in names]
        rows += [["avg"] + avg, ["max"] + top, ["max pe"] + arg]
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
        for i, r in enumerate(rows):
            if pes and i == self.n_pes:
                lines.append("  ".join("-" * w for w in widths))
            lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        note = "times in seconds; 'waits' counts the waits that blocked"
        if self.missing:
            note += f"; no counters from pe {', '.join(map(str, self.missing))}"
        return "\n".join(lines) + f"\n({note})"

    def to_json(self) -> dict:
        """The per-PE totals as a JSON-able dict (``{metric: [value per pe]}``), used by dumps."""
        return {k: v.tolist() for k, v in self.per_pe().items()}


def _fmt(value) -> str:
    if isinstance(value, (float, np.floating)) and not float(value).is_integer():
        v = float(value)
        return f"{v:.4f}" if abs(v) < 1000 else f"{v:.0f}"
    return f"{int(value):,}"

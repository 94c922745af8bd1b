"""DeepEP V2's small collectives on an ``ElasticBuffer``: the barrier, pipeline-parallel send / receive, the
all-gather sessions (AGRS) and Engram's remote fetch, all over UDMA signals and puts (numpy in, numpy out).

* **barrier**: epoch e: SET ``words[me] = e`` on every peer, wait for every peer's word to reach e.
* **pp_send / pp_recv** between ring neighbours: a channel per (source, destination) pair of
  ``num_max_inflight_tensors`` slots of ``num_max_tensor_bytes``; the n-th send waits for the receiver's credit
  ``>= n - inflight``, puts the bytes into slot ``(n - 1) % inflight`` with the arrival signal SET to n and quiets
  (the source may be reused at once); the n-th receive waits for the signal, copies the slot out and SETs the
  sender's credit to n.
* **AGRS sessions**: a session bump-allocates the region; an all-gather of t (``B`` bytes) takes ``P * B``
  bytes (32-aligned) and every rank puts its ``B`` into slot ``[me]`` of every peer, signal ``[ag, me]`` SET to the
  session number; the handle waits for the P signals. Ending a session SETs ``done[me]`` on every peer; a rank
  writes into a peer in session s only after that peer's ``done`` reached s - 1 (it finished reading s - 1).
* **Engram**: ``engram_write`` stores this rank's entries in the region (collective, barriers around it);
  ``engram_fetch`` READs every requested entry from its owner rank (``entry // entries_per_rank``) into a local
  receive area; the hook quiets the READs and returns the rows.
"""

from __future__ import annotations

import numpy as np

import shmemx

__all__ = ["Barrier", "PipeChannels", "Sessions", "Engram"]

GE = shmemx.ACLSHMEM_CMP_GE
SET = shmemx.ACLSHMEM_SIGNAL_SET


def _others(me: int, n: int) -> np.ndarray:
    return (np.arange(n) == me).astype(np.int32)  # a status vector: skip my own word


def _align(x: int, to: int) -> int:
    return -(-x // to) * to


class Barrier:
    """The buffer's barrier (collective to make, and to call)."""

    def __init__(self, me: int, n: int):
        self.me, self.n, self.epoch = me, n, 0
        self.words = shmemx.zeros((n,), np.int64, name="deep_ep.elastic.barrier")
        shmemx.aclshmem_barrier_all()

    def __call__(self) -> None:
        self.epoch += 1
        word = self.words[self.me:self.me + 1]
        for pe in range(self.n):
            if pe != self.me:
                shmemx.aclshmemx_signal_op(word, self.epoch, SET, pe)
        if self.n > 1:
            shmemx.aclshmem_wait_until_all(self.words, GE, self.epoch, status=_others(self.me, self.n))

    def close(self) -> None:
        shmemx.aclshmem_free(self.words)


class PipeChannels:
    """PP send / receive to the ring neighbours (collective to make)."""

    def __init__(self, me: int, n: int, max_bytes: int, inflight: int):
        if inflight < 1 or max_bytes < 1:
            raise ValueError(f"pp_set_config: num_max_tensor_bytes ({max_bytes}) and num_max_inflight_tensors "
                             f"({inflight}) must be positive")
        self.me, self.n, self.max_bytes, self.inflight = me, n, _align(max_bytes, 32), inflight
        self.slots = shmemx.zeros((2, inflight, self.max_bytes), np.uint8, name="deep_ep.elastic.pp", prefault=False)
        self.arrived = shmemx.zeros((2,), np.uint64, name="deep_ep.elastic.pp_arrived")
        self.credit = shmemx.zeros((2,), np.int64, name="deep_ep.elastic.pp_credit")
        self.sent, self.received = {}, {}
        shmemx.aclshmem_barrier_all()

    def _neighbours(self, rank: int) -> list[int]:
        return sorted({(rank - 1) % self.n, (rank + 1) % self.n} - {rank})

    def _channel(self, at: int, peer: int, call: str) -> int:
        """The index of ``peer``'s channel on rank ``at``."""
        near = self._neighbours(at)
        if peer not in near:
            raise ValueError(f"pe {self.me}: {call}: rank {peer} is not a ring neighbour of rank {at} ({near})")
        return near.index(peer)

    def send(self, data: np.ndarray, dst: int) -> None:
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if raw.size > self.max_bytes:
            raise ValueError(f"pe {self.me}: pp_send: {raw.size} B, more than num_max_tensor_bytes={self.max_bytes}")
        mine, theirs = self._channel(self.me, dst, "pp_send"), self._channel(dst, self.me, "pp_send")
        count = self.sent.get(dst, 0) + 1
        if count > self.inflight:
            shmemx.aclshmem_wait_until(self.credit[mine:mine + 1], GE, count - self.inflight)
        slot = self.slots[theirs, (count - 1) % self.inflight, :raw.size]
        shmemx.aclshmemx_udma_put_signal_nbi(slot, raw, raw.size, self.arrived[theirs:theirs + 1], count, dst)
        shmemx.aclshmemx_udma_quiet(dst)
        self.sent[dst] = count

    def recv(self, out: np.ndarray, src: int) -> None:
        raw = out.reshape(-1).view(np.uint8)
        if raw.size > self.max_bytes:
            raise ValueError(f"pe {self.me}: pp_recv: {raw.size} B, more than num_max_tensor_bytes={self.max_bytes}")
        mine, theirs = self._channel(self.me, src, "pp_recv"), self._channel(src, self.me, "pp_recv")
        count = self.received.get(src, 0) + 1
        shmemx.aclshmem_wait_until(self.arrived[mine:mine + 1], GE, count)
        raw[...] = self.slots[mine, (count - 1) % self.inflight, :raw.size]
        shmemx.aclshmemx_signal_op(self.credit[theirs:theirs + 1], count, SET, src)
        self.received[src] = count

    def close(self) -> None:
        for arr in (self.slots, self.arrived, self.credit):
            shmemx.aclshmem_free(arr)


class Sessions:
    """AGRS sessions over a region of ``max_bytes`` (collective to make)."""

    def __init__(self, me: int, n: int, max_bytes: int, max_gathers: int):
        self.me, self.n, self.max_bytes, self.max_gathers = me, n, int(max_bytes), int(max_gathers)
        self.region = shmemx.zeros((max(self.max_bytes, 1),), np.uint8, name="deep_ep.elastic.agrs", prefault=False)
        self.arrived = shmemx.zeros((max(self.max_gathers, 1), n), np.uint64, name="deep_ep.elastic.agrs_arrived")
        self.done = shmemx.zeros((n,), np.int64, name="deep_ep.elastic.agrs_done")
        self.session, self.open = 0, False
        self.cursor = self.gathers = 0
        self.cleared: set[int] = set()
        self.pending: set[int] = set()
        shmemx.aclshmem_barrier_all()

    def create(self) -> None:
        if self.open:
            raise RuntimeError(f"pe {self.me}: create_agrs_session: a session is open (destroy_agrs_session first)")
        self.session += 1
        self.open, self.cursor, self.gathers, self.cleared = True, 0, 0, set()

    def destroy(self) -> None:
        if not self.open:
            raise RuntimeError(f"pe {self.me}: destroy_agrs_session: no session is open")
        self._quiet()
        word = self.done[self.me:self.me + 1]
        for pe in range(self.n):
            if pe != self.me:
                shmemx.aclshmemx_signal_op(word, self.session, SET, pe)
        self.open = False

    def _quiet(self) -> None:
        for pe in sorted(self.pending):
            shmemx.aclshmemx_udma_quiet(pe)
        self.pending = set()

    def _check_open(self, call: str) -> None:
        if not self.open:
            raise RuntimeError(f"pe {self.me}: {call}: no AGRS session is open (create_agrs_session)")

    def slots(self, sizes: list[int], call: str) -> list[tuple[int, int]]:
        """``(offset, bytes)`` of the next all-gathers of these byte sizes, from the cursor."""
        self._check_open(call)
        out, cursor = [], self.cursor
        for size in sizes:
            out.append((cursor, size))
            cursor += _align(self.n * size, 32)
        if cursor > self.max_bytes:
            raise ValueError(f"pe {self.me}: {call}: the session needs {cursor} B, more than num_max_session_bytes="
                             f"{self.max_bytes}")
        if self.gathers + len(sizes) > self.max_gathers:
            raise ValueError(f"pe {self.me}: {call}: {self.gathers + len(sizes)} all-gathers in one session, more "
                             f"than num_max_all_gathers_per_session={self.max_gathers}")
        return out

    def mine(self, offset: int, size: int) -> np.ndarray:
        """This rank's slot of the all-gather at ``offset`` (bytes)."""
        return self.region[offset + self.me * size:offset + (self.me + 1) * size]

    def gather(self, tensors: list[np.ndarray]) -> tuple[list[np.ndarray], list[int]]:
        """Start the all-gathers of ``tensors``; returns ``([P * B] uint8 outputs, their gather indices)``."""
        raws = [np.ascontiguousarray(t).reshape(-1).view(np.uint8) for t in tensors]
        places = self.slots([r.size for r in raws], "all_gather")
        outs, indices = [], []
        for raw, (offset, size) in zip(raws, places):
            slot = self.mine(offset, size)
            if raw.size and raw.ctypes.data != slot.ctypes.data:
                slot[...] = raw
            g = self.gathers
            self.gathers += 1
            self.arrived[g, self.me] = self.session
            for pe in [(self.me + i) % self.n for i in range(1, self.n)]:
                if pe not in self.cleared:  # the peer finished reading the previous session
                    if self.session > 1:
                        shmemx.aclshmem_wait_until(self.done[pe:pe + 1], GE, self.session - 1)
                    self.cleared.add(pe)
                shmemx.aclshmemx_udma_put_signal_nbi(slot, slot, size, self.arrived[g, self.me:self.me + 1],
                                                     self.session, pe)
                self.pending.add(pe)
            outs.append(self.region[offset:offset + self.n * size])
            indices.append(g)
        self.cursor = places[-1][0] + _align(self.n * places[-1][1], 32) if places else self.cursor
        return outs, indices

    def wait(self, indices: list[int]) -> None:
        """The all-gathers ``indices`` of the current session have arrived from every rank."""
        self._quiet()
        for g in indices:
            if self.n > 1:
                shmemx.aclshmem_wait_until_all(self.arrived[g], GE, self.session, status=_others(self.me, self.n))

    def close(self) -> None:
        self._quiet()
        for arr in (self.region, self.arrived, self.done):
            shmemx.aclshmem_free(arr)


class Engram:
    """Engram storage (``entries_per_rank`` rows of ``row_bytes`` on every rank) and its fetch area."""

    def __init__(self, me: int, n: int, entries_per_rank: int, row_bytes: int, max_fetch_rows: int):
        self.me, self.n, self.entries, self.row_bytes = me, n, entries_per_rank, row_bytes
        self.storage = shmemx.zeros((max(entries_per_rank, 1), row_bytes), np.uint8, name="deep_ep.engram",
                                    prefault=False)
        self.fetched = shmemx.zeros((max(max_fetch_rows, 1), row_bytes), np.uint8, name="deep_ep.engram_fetch",
                                    prefault=False)
        shmemx.aclshmem_barrier_all()

    def write(self, rows: np.ndarray) -> None:
        shmemx.aclshmem_barrier_all()
        self.storage[:len(rows)] = rows
        shmemx.aclshmem_barrier_all()

    def fetch(self, entries: np.ndarray) -> np.ndarray:
        """READ the rows of ``entries [R]`` (global indices) into the fetch area; returns the area's ``[R]`` rows
        (complete after ``quiet``)."""
        if len(entries) > len(self.fetched):
            raise ValueError(f"pe {self.me}: engram_fetch: {len(entries)} entries, more than the "
                             f"{len(self.fetched)} the buffer holds")
        owners, rows = np.divmod(entries.astype(np.int64), self.entries)
        if (entries < 0).any() or (owners >= self.n).any():
            raise ValueError(f"pe {self.me}: engram_fetch: entry indices must lie in 0..{self.n * self.entries - 1}")
        self.owners = set()
        for i, (pe, row) in enumerate(zip(owners.tolist(), rows.tolist())):
            if pe == self.me:
                self.fetched[i] = self.storage[row]
            else:
                shmemx.aclshmemx_udma_get_nbi(self.fetched[i], self.storage[row], self.row_bytes, pe)
                self.owners.add(pe)
        return self.fetched[:len(entries)]

    def quiet(self) -> None:
        for pe in sorted(getattr(self, "owners", ())):
            shmemx.aclshmemx_udma_quiet(pe)
        self.owners = set()

    def close(self) -> None:
        for arr in (self.storage, self.fetched):
            shmemx.aclshmem_free(arr)

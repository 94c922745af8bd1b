"""RMARaceBench's SHMEM cases (conflict, atomic and synchronisation groups) re-expressed for shmemx under CANN
semantics, each labelled race or safe: the set ``--check`` was developed against (``rma_holdout`` is the set it
was not).

Every case is a rank body for ``launch(n, body)`` named after the benchmark case it re-expresses
(``conflict_004`` is ``SHMEM/conflict/004-shmem-conflict-getnbi-load-local-yes.c``). The programs are written
anew from the cases' descriptions: the same two accesses, the same synchronisation, in the CANN SHMEM API. How the
OpenSHMEM calls map:

* ``shmem_put`` / ``shmem_p`` (blocking: the call returns when the source may be reused) is a UDMA put and the
  quiet of its QP (the only completion UDMA has); ``shmem_get`` / ``shmem_g`` a get and its quiet; the ``_nbi``
  forms are the UDMA calls without the quiet; ``iput`` / ``iget`` one put or get per element, then the quiet;
* ``shmem_atomic_*`` are the ``aclshmemx_udma_atomic_*`` calls (QP 0: set is a CAS loop, fetch an FAA of 0);
  the ``_nbi`` fetching atomics, whose old value lands in a local buffer, are raw FAA / CAS WQEs whose SGE is
  that buffer (completed by the raw queue's poll);
* a context is a QP (``shmem_ctx_quiet`` the quiet of that QP, ``shmem_quiet`` the quiet of QP 0);
  ``shmem_fence`` is ``aclshmem_fence`` (which orders no UDMA work), except where the case is about a fence
  that does order two puts: there the second WQE carries ``fence=1``;
* ``shmem_barrier_all`` is ``aclshmem_barrier_all``, which completes no UDMA work on CANN; where the benchmark
  relies on the final barrier to complete a put, the port quiets before it (otherwise every case would also be an
  ``unfinished-work`` finding);
* a lock is a word on PE 1 taken with a CAS loop and given back with ``atomic_set``; a team sync is a signal
  exchange among the team's PEs; a sum reduction is a get of every PE's source, summed into the destination;
* a C ``int`` is one ``int32`` element: ``remote`` a heap array, ``localbuf`` a local numpy array.

Labels are CANN's: where a case's verdict differs from the benchmark's (a barrier does not complete a get, so
``sync/002`` races here; atomics are atomic per word of the same width whatever their type, so ``atomic/006``
does not), ``Case.rrb`` keeps the benchmark's label and ``Case.note`` says why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

import shmemx

SET, ADD = shmemx.ACLSHMEM_SIGNAL_SET, shmemx.ACLSHMEM_SIGNAL_ADD
EQ, GE = shmemx.ACLSHMEM_CMP_EQ, shmemx.ACLSHMEM_CMP_GE
FENCED = shmemx.OpConfig(cqe=1, se=0, fence=1, odr=shmemx.ACLSHMEMX_UDMA_ODR_NO)
FAA, CAS = shmemx.Opcode.FAA, shmemx.Opcode.CAS


@dataclass(frozen=True)
class Case:
    """One corpus program: ``body`` runs on ``n_pes`` PEs; ``label`` is "race" or "safe" under CANN semantics,
    ``rrb`` the benchmark's own label, ``note`` why they differ (or what the port had to choose)."""

    name: str
    n_pes: int
    body: object
    label: str
    rrb: str = ""
    note: str = ""
    qps: int = 1


# --- helpers: the OpenSHMEM calls the benchmark uses, in CANN terms ---------------------------------------------

def start(qps: int = 1) -> int:
    if qps > 1:
        shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, qps)
    shmemx.init()
    return shmemx.my_pe()


def end() -> None:
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def heap_int(value: int = 0, name: str = "remote", dtype=np.int32):
    arr = shmemx.zeros(1, dtype, name=name)
    arr[0] = value
    shmemx.aclshmem_barrier_all()
    return arr


def use(value) -> int:
    """What the benchmark's printf does with a value: read it."""
    return int(np.asarray(value).reshape(-1)[0])


def put(dst, src, pe: int) -> None:
    """``shmem_put``: returns once the source may be reused, which on UDMA is the quiet of the QP."""
    shmemx.aclshmemx_udma_put_nbi(dst, src, src.size, pe)
    shmemx.aclshmemx_udma_quiet(pe)


def get(dst, src, pe: int) -> None:
    shmemx.aclshmemx_udma_get_nbi(dst, src, dst.size, pe)
    shmemx.aclshmemx_udma_quiet(pe)


def amo_nbi(local, target, pe: int, opcode, operand: int = 0, compare: int = 0, qp: int = 0):
    """A fetching atomic whose old value lands in ``local`` (a raw FAA / CAS WQE); returns the queue to poll."""
    q = shmemx.aclshmemx_udma_raw_queue(pe, qp)
    wqe = q.build(opcode, 0x20, q.remote_va(target), sge_len=target.itemsize,
                  sge_va=q.local_va(local, writable=True), operand=operand, compare=compare)
    q.post(wqe, cqes=1)
    return q


def lock(word, pe: int) -> None:
    """``shmem_set_lock``: a CAS loop on a word of PE ``pe``."""
    while shmemx.aclshmemx_udma_atomic_compare_swap(word, 0, 1, pe) != 0:
        time.sleep(0.001)


def unlock(word, pe: int) -> None:
    shmemx.aclshmemx_udma_atomic_set(word, 0, pe)


def team_sync(flags, team: list[int], me: int, round_: int = 1) -> None:
    """``shmem_team_sync`` of ``team``: every member signals every other one and waits for all of them."""
    for pe in team:
        if pe != me:
            shmemx.aclshmemx_signal_op(flags[me:me + 1], round_, SET, pe)
    for pe in team:
        if pe != me:
            shmemx.aclshmem_signal_wait_until(flags[pe:pe + 1], GE, round_)


def sum_reduce(dst, src, me: int, n: int) -> None:
    """``shmem_int_sum_reduce`` over every PE: get each PE's ``src`` and sum them into ``dst``."""
    total = int(src[0])
    tmp = np.zeros(1, src.dtype)
    for pe in range(n):
        if pe != me:
            get(tmp, src, pe)
            total += int(tmp[0])
    dst[0] = total


# --- conflict: local buffers of nonblocking calls ----------------------------------------------------------------

def conflict_001():
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    if me == 0:
        shmemx.aclshmemx_udma_put_nbi(remote, localbuf, 1, 1)
        use(localbuf[0])
        shmemx.aclshmemx_udma_quiet(1)
    end()


def conflict_002():
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    if me == 0:
        shmemx.aclshmemx_udma_put_nbi(remote, localbuf, 1, 1)
        localbuf[0] = 42
        shmemx.aclshmemx_udma_quiet(1)
    end()


def conflict_003():
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    if me == 0:
        shmemx.aclshmemx_udma_put_nbi(remote, localbuf, 1, 1)
        shmemx.aclshmemx_udma_put_nbi(remote, localbuf, 1, 2)
        shmemx.aclshmemx_udma_quiet(1)
        shmemx.aclshmemx_udma_quiet(2)
    end()


def conflict_004():
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    if me == 0:
        shmemx.aclshmemx_udma_get_nbi(localbuf, remote, 1, 1)
        use(localbuf[0])
        shmemx.aclshmemx_udma_quiet(1)
    end()


def conflict_005():
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    if me == 0:
        shmemx.aclshmemx_udma_get_nbi(localbuf, remote, 1, 1)
        localbuf[0] = 42
        shmemx.aclshmemx_udma_quiet(1)
    end()


def conflict_006():
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    if me == 0:
        shmemx.aclshmemx_udma_get_nbi(localbuf, remote, 1, 1)
        shmemx.aclshmemx_udma_put_nbi(remote, localbuf, 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
    end()


def conflict_007():
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    if me == 0:
        shmemx.aclshmemx_udma_get_nbi(localbuf, remote, 1, 1)
        shmemx.aclshmemx_udma_get_nbi(localbuf, remote, 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
    end()


def _put_signal_local(store: bool) -> None:
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    sig = shmemx.zeros(1, np.uint64, name="sig")
    if me == 0:
        shmemx.aclshmemx_udma_put_signal_nbi(remote, localbuf, 1, sig, 1, 1)
        if store:
            localbuf[0] = 42
        else:
            use(localbuf[0])
        shmemx.aclshmemx_udma_quiet(1)
    end()


def conflict_008():
    _put_signal_local(True)


def conflict_009():
    _put_signal_local(False)


def _fetch_nbi_local(opcode, operand: int, compare: int, store: bool) -> None:
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    if me == 0:
        q = amo_nbi(localbuf, remote, 1, opcode, operand, compare)
        if store:
            localbuf[0] = 42
        else:
            use(localbuf[0])
        q.poll()
    end()


def conflict_010():
    _fetch_nbi_local(FAA, 0, 0, True)


def conflict_011():
    _fetch_nbi_local(FAA, 0, 0, False)


def conflict_012():
    _fetch_nbi_local(FAA, 1, 0, True)


def conflict_013():
    _fetch_nbi_local(FAA, 1, 0, False)


def conflict_014():
    _fetch_nbi_local(CAS, 1, 42, False)


def conflict_015():
    _fetch_nbi_local(CAS, 1, 42, True)


# --- conflict: remote memory ------------------------------------------------------------------------------------

def _remote_pair(first, second, n: int = 3) -> None:
    """PE 0 runs ``first(remote, localbuf)`` and PE ``n - 1`` runs ``second(remote, localbuf)``, unordered; the
    memory is PE 1's ``remote`` (PE 1 is the second side itself when ``n`` is 2)."""
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    if me == 0:
        first(remote, localbuf)
    if me == n - 1:
        localbuf[0] = 2
        second(remote, localbuf)
    end()


def _get(remote, localbuf):
    get(localbuf, remote, 1)


def _put(remote, localbuf):
    put(remote, localbuf, 1)


def _load(remote, localbuf):
    use(remote[0])


def _store(remote, localbuf):
    remote[0] = 42


def _atomic_set(remote, localbuf):
    shmemx.aclshmemx_udma_atomic_set(remote, 1, 1)


def _atomic_fetch(remote, localbuf):
    localbuf[0] = shmemx.aclshmemx_udma_atomic_fetch(remote, 1)


def _fetch_inc(remote, localbuf):
    localbuf[0] = shmemx.aclshmemx_udma_atomic_fetch_inc(remote, 1)


def _put_signal(remote, localbuf):
    sig = _SIGNALS[shmemx.my_pe()]
    shmemx.aclshmemx_udma_put_signal_nbi(remote, localbuf, 1, sig, 1, 1)
    shmemx.aclshmemx_udma_quiet(1)


def _g(remote, localbuf):
    tmp = np.zeros(1, np.int32)
    get(tmp, remote, 1)
    localbuf[0] = tmp[0]


def _p(remote, localbuf):
    put(remote, np.full(1, 42, np.int32), 1)


def _iput(remote, localbuf):
    for i in range(remote.size):
        shmemx.aclshmemx_udma_put_nbi(remote[i:i + 1], localbuf[i:i + 1], 1, 1)
    shmemx.aclshmemx_udma_quiet(1)


def _iget(remote, localbuf):
    for i in range(remote.size):
        shmemx.aclshmemx_udma_get_nbi(localbuf[i:i + 1], remote[i:i + 1], 1, 1)
    shmemx.aclshmemx_udma_quiet(1)


def _fetch_nbi(remote, localbuf):
    amo_nbi(localbuf, remote, 1, FAA, 0).poll()


def _cswap_nbi(remote, localbuf):
    amo_nbi(localbuf, remote, 1, CAS, 1, 42).poll()


_SIGNALS: dict = {}


def _with_signals(first, second):
    def body():
        me = start()
        for pe in range(3):  # a signal word per origin (the benchmark's ps_sig_addr and ps_sig_addr2)
            _SIGNALS[pe] = shmemx.zeros(1, np.uint64, name=f"sig{pe}")
        remote, localbuf = heap_int(), np.ones(1, np.int32)
        if me == 0:
            first(remote, localbuf)
        if me == shmemx.n_pes() - 1:
            localbuf[0] = 2
            second(remote, localbuf)
        end()
    return body


def _pair(first, second, n: int = 3):
    def body():
        _remote_pair(first, second, n)
    return body


# --- atomic: atomicity of the UDMA atomics ------------------------------------------------------------------------

def _two_adds(first, second) -> None:
    me = start(qps=2)
    value = shmemx.zeros(1, np.int64, name="value")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        first(value)
    if me == 2:
        second(value)
    if me != 1:
        shmemx.aclshmemx_udma_quiet(1)  # the non-fetching add on QP 0 completes here
    end()


def _add32(value):
    shmemx.aclshmemx_udma_atomic_add(value.view(np.int32)[:1], 1, 1)


def _add64(value):
    shmemx.aclshmemx_udma_atomic_add(value, 1, 1)


def _raw_add64_qp1(value):
    q = shmemx.aclshmemx_udma_raw_queue(1, 1)
    q.post(q.build(FAA, 0x20, q.remote_va(value), sge_len=8, sge_va=q.local_va(_SCRATCH, writable=True),
                   operand=1), cqes=1)
    q.poll()


_SCRATCH = np.zeros(1, np.int64)


def atomic_001():
    _two_adds(_add64, _raw_add64_qp1)


def atomic_002():
    _two_adds(_add64, _add64)


def atomic_003():
    _two_adds(_raw_add64_qp1, _raw_add64_qp1)


def atomic_004():
    me, remote = start(), heap_int()
    if me in (0, 2):
        shmemx.aclshmemx_udma_atomic_add(remote, 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
    end()


def atomic_005():
    me, remote = start(), heap_int()
    if me == 0:
        shmemx.aclshmemx_udma_atomic_add(remote, 1, 1)
        shmemx.aclshmemx_udma_atomic_add(remote, 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
    end()


def atomic_006():
    me = start()
    val = shmemx.zeros(1, np.int64, name="val")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        shmemx.aclshmemx_udma_atomic_set(val, 2, 1)
    if me == 2:
        shmemx.aclshmemx_udma_atomic_set(val.view(np.uint64), 3, 1)
    end()


def atomic_007():
    me = start()
    value = shmemx.zeros(1, np.int64, name="value")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        shmemx.aclshmemx_udma_atomic_add(value.view(np.int32)[:1], 1, 1)
    if me == 2:
        shmemx.aclshmemx_udma_atomic_add(value, 1, 1)
    if me != 1:
        shmemx.aclshmemx_udma_quiet(1)
    end()


def atomic_008():
    me, remote = start(), heap_int()
    if me == 0:
        shmemx.aclshmemx_udma_atomic_set(remote, 1, 1)
    if me == 2:
        shmemx.aclshmemx_udma_atomic_add(remote.view(np.float32), 2.1, 1)
    end()


def atomic_009():
    me, remote = start(), heap_int()
    if me == 0:
        shmemx.aclshmemx_udma_atomic_set(remote, 1, 1)
        shmemx.aclshmemx_udma_atomic_add(remote.view(np.float32), 2.1, 1)
    end()


# --- sync: completion and synchronisation calls ---------------------------------------------------------------------

def _get_then(order: str) -> None:
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    if me == 0:
        shmemx.aclshmemx_udma_get_nbi(localbuf, remote, 1, 1)
        if order == "read-barrier":
            use(localbuf[0])
            shmemx.aclshmem_barrier_all()
        elif order == "barrier-read":
            shmemx.aclshmem_barrier_all()
            use(localbuf[0])
        elif order == "read-quiet":
            use(localbuf[0])
            shmemx.aclshmemx_udma_quiet(1)
        else:
            shmemx.aclshmemx_udma_quiet(1)
            use(localbuf[0])
        shmemx.aclshmemx_udma_quiet(1)
    elif order.endswith("barrier") or order.startswith("barrier"):
        shmemx.aclshmem_barrier_all()
    end()


def sync_001():
    _get_then("read-barrier")


def sync_002():
    _get_then("barrier-read")


def sync_003():
    _get_then("read-quiet")


def sync_004():
    _get_then("quiet-read")


def _ping_pong(pong_waits: bool) -> None:
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    flag = shmemx.zeros(1, np.uint64, name="flag")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        localbuf[0] = 42
        shmemx.aclshmemx_udma_put_signal_nbi(remote, localbuf, 1, flag, 1, 1)  # ping
        shmemx.aclshmem_signal_wait_until(flag, EQ, 1)  # pong
        localbuf[0] = 1337
        shmemx.aclshmemx_udma_quiet(1)
    if me == 1:
        localbuf[0] = 1337
        if pong_waits:
            shmemx.aclshmem_signal_wait_until(flag, EQ, 1)
        shmemx.aclshmemx_udma_put_signal_nbi(remote, localbuf, 1, flag, 1, 0)
        shmemx.aclshmemx_udma_quiet(0)
    end()


def sync_005():
    _ping_pong(True)


def sync_006():
    _ping_pong(False)


def _put_get(between: str) -> None:
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    myval = np.full(1, 42, np.int32)
    if me == 0:
        shmemx.aclshmemx_udma_put_nbi(remote, myval, 1, 1)
        if between == "barrier":
            shmemx.aclshmem_barrier_all()
        shmemx.aclshmemx_udma_get_nbi(localbuf, remote, 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
        if between != "barrier":
            shmemx.aclshmem_barrier_all()
    else:
        shmemx.aclshmem_barrier_all()
    end()


def sync_007():
    _put_get("nothing")


def sync_008():
    _put_get("barrier")


def _quiet_sync(synced: bool) -> None:
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    if me == 0:
        shmemx.aclshmemx_udma_put_nbi(remote, np.full(1, 42, np.int32), 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
    if synced:
        shmemx.aclshmem_barrier_all()
    if me == 1:
        use(remote[0])  # the benchmark's get of its own memory (UDMA has no get from the own PE)
    end()


def sync_009():
    _quiet_sync(True)


def sync_010():
    _quiet_sync(False)


def sync_011():
    me, remote = start(), heap_int()
    if me == 0:
        shmemx.aclshmemx_udma_put_nbi(remote, np.full(1, 1, np.int32), 1, 1)
        shmemx.aclshmemx_udma_put_nbi(remote, np.full(1, 2, np.int32), 1, 1, config=FENCED)
        shmemx.aclshmemx_udma_quiet(1)
    end()


def sync_012():
    me, remote, localbuf = start(), heap_int(), np.ones(1, np.int32)
    if me == 0:
        shmemx.aclshmemx_udma_get_nbi(localbuf, remote, 1, 1)
        shmemx.aclshmem_fence()  # orders no UDMA work (and a get not even in OpenSHMEM)
        shmemx.aclshmemx_udma_put_nbi(remote, np.full(1, 42, np.int32), 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
    end()


def _locked(both_locked: bool) -> None:
    me, remote = start(), heap_int()
    word = shmemx.zeros(1, np.int64, name="lock")
    go = shmemx.zeros(1, np.uint64, name="go")
    shmemx.aclshmem_barrier_all()
    if me == 2:
        lock(word, 1)
        if both_locked:
            put(remote, np.full(1, 1337, np.int32), 1)
        unlock(word, 1)
        if not both_locked:
            shmemx.aclshmemx_signal_op(go, 1, SET, 0)  # pe 0 locks after this (the benchmark sleeps instead)
            put(remote, np.full(1, 1337, np.int32), 1)
    if me == 0:
        if not both_locked:
            shmemx.aclshmem_signal_wait_until(go, EQ, 1)
        lock(word, 1)
        put(remote, np.full(1, 42, np.int32), 1)
        unlock(word, 1)
    end()


def sync_013():
    _locked(True)


def sync_014():
    _locked(False)


def _flag_then_load(wait_first: bool) -> None:
    me, remote = start(), heap_int()
    flag = shmemx.zeros(1, np.int32, name="flag")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        shmemx.aclshmemx_udma_put_nbi(remote, np.full(1, 42, np.int32), 1, 1)
        shmemx.aclshmemx_udma_atomic_set(flag, 1, 1)  # fenced after the put: the CAS loop quiets QP 0 first
    if me == 1:
        if not wait_first:
            use(remote[0])
        shmemx.aclshmem_wait_until(flag, EQ, 1)
        if wait_first:
            use(remote[0])
    end()


def sync_015():
    _flag_then_load(False)


def sync_016():
    _flag_then_load(True)


def _polled_signal(api: bool) -> None:
    me, remote = start(), heap_int()
    signal = shmemx.zeros(1, np.uint64, name="signal")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        if api:
            while not shmemx.aclshmem_test(signal, EQ, 1):  # shmem_signal_fetch in a loop
                time.sleep(0.0005)
        else:
            while signal[0] < 1:  # plain loads of the signal word
                time.sleep(0.0005)
        use(remote[0])
    if me == 1:
        shmemx.aclshmemx_udma_put_signal_nbi(remote, np.full(1, 1, np.int32), 1, signal, 1, 0)
        shmemx.aclshmemx_udma_quiet(0)
    end()


def sync_017():
    _polled_signal(True)


def sync_018():
    _polled_signal(False)


def _ctx_quiet(right: bool) -> None:
    me, remote, localbuf = start(qps=2), heap_int(), np.ones(1, np.int32)
    if me == 0:
        localbuf[0] = 42
        shmemx.aclshmemx_udma_qp_put_nbi(remote, localbuf, 1, 1, 1)
        if right:
            shmemx.aclshmemx_udma_qp_quiet(1, 1)
        else:
            shmemx.aclshmemx_udma_quiet(1)  # QP 0: another context
        localbuf[0] = 1337
        shmemx.aclshmemx_udma_qp_put_nbi(remote, localbuf, 1, 1, 1)
        shmemx.aclshmemx_udma_qp_quiet(1, 1)
    end()


def sync_019():
    _ctx_quiet(True)


def sync_020():
    _ctx_quiet(False)


def _reduce_then_put(synced: bool) -> None:
    me, n = start(), shmemx.n_pes()
    remote = shmemx.zeros(1, np.int32, name="remote")
    source = shmemx.zeros(1, np.int32, name="source")
    reduced = shmemx.zeros(1, np.int32, name="reduced")
    remote[0] = source[0] = 1
    shmemx.aclshmem_barrier_all()
    if synced:  # 021: the reduction reads remote, the put comes after a barrier
        sum_reduce(reduced, remote, me, n)
        shmemx.aclshmem_barrier_all()
        if me == 0:
            put(remote, np.zeros(1, np.int32), 1)
    else:  # 022: the reduction writes reduced while pe 0 puts into pe 1's
        sum_reduce(reduced, source, me, n)
        if me == 0:
            put(reduced, np.zeros(1, np.int32), 1)
    end()


def sync_021():
    _reduce_then_put(True)


def sync_022():
    _reduce_then_put(False)


def _team(outside: bool) -> None:
    me = start()
    remote = shmemx.zeros(1, np.int32, name="remote")
    flags = shmemx.zeros(4, np.uint64, name="team_flags")
    shmemx.aclshmem_barrier_all()
    team = [0, 2]
    writer, reader = (2, 3) if outside else (0, 2)
    if me in team:
        if me == writer:
            put(remote, np.full(1, 42, np.int32), reader)
        team_sync(flags, team, me)
    if me == reader:
        use(remote[0])
    end()


def sync_023():
    _team(True)


def sync_024():
    _team(False)


_BARRIER = "a barrier completes no UDMA work on CANN (only the quiet of the QP does)"
_TYPES = "the UDMA atomics are atomic per word of one width whatever the element type (the engine's CAS)"

CASES = [
    Case("conflict/001 putnbi-load-local", 2, conflict_001, "safe"),
    Case("conflict/002 putnbi-store-local", 2, conflict_002, "race"),
    Case("conflict/003 putnbi-putnbi-local", 3, conflict_003, "safe", note="the second put goes to pe 2 (UDMA "
         "has no put to the own PE)"),
    Case("conflict/004 getnbi-load-local", 2, conflict_004, "race"),
    Case("conflict/005 getnbi-store-local", 2, conflict_005, "race"),
    Case("conflict/006 getnbi-putnbi-local", 2, conflict_006, "race"),
    Case("conflict/007 getnbi-getnbi-local", 2, conflict_007, "race"),
    Case("conflict/008 put_signal_nbi-store-local", 2, conflict_008, "race"),
    Case("conflict/009 put_signal_nbi-load-local", 2, conflict_009, "safe"),
    Case("conflict/010 atomicfetchnbi-store-local", 2, conflict_010, "race"),
    Case("conflict/011 atomicfetchnbi-load-local", 2, conflict_011, "race"),
    Case("conflict/012 atomicfetchincnbi-store-local", 2, conflict_012, "race"),
    Case("conflict/013 atomicfetchincnbi-load-local", 2, conflict_013, "race"),
    Case("conflict/014 atomiccompareswapnbi-load-local", 2, conflict_014, "race"),
    Case("conflict/015 atomiccompareswapnbi-store-local", 2, conflict_015, "race"),
    Case("conflict/016 get-load-remote", 2, _pair(_get, _load, 2), "safe"),
    Case("conflict/017 get-get-remote", 3, _pair(_get, _get), "safe"),
    Case("conflict/018 get-store-remote", 2, _pair(_get, _store, 2), "race"),
    Case("conflict/019 get-put-remote", 3, _pair(_get, _put), "race"),
    Case("conflict/020 get-atomicfetch-remote", 3, _pair(_get, _atomic_fetch), "safe"),
    Case("conflict/021 get-atomicset-remote", 3, _pair(_get, _atomic_set), "race"),
    Case("conflict/022 put-load-remote", 2, _pair(_put, _load, 2), "race"),
    Case("conflict/023 put-store-remote", 2, _pair(_put, _store, 2), "race"),
    Case("conflict/024 put-put-remote", 3, _pair(_put, _put), "race"),
    Case("conflict/025 put-atomicfetch-remote", 3, _pair(_put, _atomic_fetch), "race"),
    Case("conflict/026 put-atomicset-remote", 3, _pair(_put, _atomic_set), "race"),
    Case("conflict/027 atomicset-load-remote", 2, _pair(_atomic_set, _load, 2), "race"),
    Case("conflict/028 atomicset-store-remote", 2, _pair(_atomic_set, _store, 2), "race"),
    Case("conflict/029 atomicset-atomicset-remote", 3, _pair(_atomic_set, _atomic_set), "safe"),
    Case("conflict/030 atomicset-atomicfetch-remote", 3, _pair(_atomic_set, _atomic_fetch), "safe"),
    Case("conflict/031 atomicfetch-atomicfetch-remote", 3, _pair(_atomic_fetch, _atomic_fetch), "safe"),
    Case("conflict/032 atomicfetch-load-remote", 2, _pair(_atomic_fetch, _load, 2), "safe"),
    Case("conflict/033 atomicfetch-store-remote", 2, _pair(_atomic_fetch, _store, 2), "race"),
    Case("conflict/034 put_signal-store-remote", 2, _with_signals(_put_signal, _store), "race"),
    Case("conflict/035 put_signal-put_signal-remote", 3, _with_signals(_put_signal, _put_signal), "race"),
    Case("conflict/036 g-store-remote", 2, _pair(_g, _store, 2), "race"),
    Case("conflict/037 g-put-remote", 3, _pair(_g, _put), "race"),
    Case("conflict/038 p-load-remote", 2, _pair(_p, _load, 2), "race"),
    Case("conflict/039 p-get-remote", 3, _pair(_p, _get), "race"),
    Case("conflict/040 iput-store-remote", 2, _pair(_iput, _store, 2), "race"),
    Case("conflict/041 iput-put-remote", 3, _pair(_iput, _put), "race"),
    Case("conflict/042 iget-store-remote", 2, _pair(_iget, _store, 2), "race"),
    Case("conflict/043 iget-put-remote", 3, _pair(_iget, _put), "race"),
    Case("conflict/044 atomicfetchnbi-atomicfetchnbi-remote", 3, _pair(_fetch_nbi, _fetch_nbi), "safe"),
    Case("conflict/045 atomicfetchnbi-load-remote", 2, _pair(_fetch_nbi, _load, 2), "safe"),
    Case("conflict/046 atomicfetchinc-atomicfetchinc-remote", 3, _pair(_fetch_inc, _fetch_inc), "safe"),
    Case("conflict/047 atomicfetchnbi-store-remote", 2, _pair(_fetch_nbi, _store, 2), "race"),
    Case("conflict/048 atomiccompareswapnbi-store-remote", 2, _pair(_cswap_nbi, _store, 2), "race"),
    Case("conflict/049 atomiccompareswapnbi-atomicfetchnbi-remote", 3, _pair(_cswap_nbi, _fetch_nbi), "safe"),
    Case("atomic/001 different-ctx-remote", 3, atomic_001, "safe", rrb="race",
         note="contexts are QPs here, and the atomics of every QP are atomic per word across engines (there are "
              "no atomicity domains)", qps=2),
    Case("atomic/002 same-ctx-remote", 3, atomic_002, "safe", qps=2),
    Case("atomic/003 same-domain-remote", 3, atomic_003, "safe", qps=2),
    Case("atomic/004 int-int-remote", 3, atomic_004, "safe"),
    Case("atomic/005 int-int-sameorigin-remote", 3, atomic_005, "safe"),
    Case("atomic/006 double-long-remote", 3, atomic_006, "safe", rrb="race", note=_TYPES + " (int64 and uint64 "
         "here: the API has no float64 atomic)"),
    Case("atomic/007 int-long-remote", 3, atomic_007, "race"),
    Case("atomic/008 int-float-remote", 3, atomic_008, "safe", rrb="race", note=_TYPES + " (the fp32 add is a CAS "
         "loop on the same 32-bit word)"),
    Case("atomic/009 int-float-sameorigin-remote", 3, atomic_009, "safe", rrb="race", note=_TYPES + "; besides, "
         "atomic_set and the float add both quiet before they return"),
    Case("sync/001 barrierall-local", 2, sync_001, "race"),
    Case("sync/002 barrierall-local", 2, sync_002, "race", rrb="safe", note=_BARRIER),
    Case("sync/003 quiet-local", 2, sync_003, "race"),
    Case("sync/004 quiet-local", 2, sync_004, "safe"),
    Case("sync/005 waituntil-local", 2, sync_005, "safe"),
    Case("sync/006 waituntil-local", 2, sync_006, "race"),
    Case("sync/007 barrierall-remote", 2, sync_007, "race", note="the put is a put_nbi (a put that quiets is "
         "complete, and the get after it could not race)"),
    Case("sync/008 barrierall-remote", 2, sync_008, "race", rrb="safe", note=_BARRIER),
    Case("sync/009 quiet-sync-remote", 2, sync_009, "safe"),
    Case("sync/010 quiet-sync-remote", 2, sync_010, "race"),
    Case("sync/011 fence-put-put-remote", 2, sync_011, "safe", note="the fence is the second WQE's fence=1 "
         "(aclshmem_fence orders no UDMA work)"),
    Case("sync/012 fence-getnbi-put-remote", 2, sync_012, "race"),
    Case("sync/013 lock-remote", 3, sync_013, "safe", note="both writers on pe 0 and pe 2, the lock on pe 1"),
    Case("sync/014 lock-remote", 3, sync_014, "race", note="a signal makes pe 2 take the lock first (the "
         "benchmark sleeps)"),
    Case("sync/015 waituntil-remote", 2, sync_015, "race"),
    Case("sync/016 waituntil-remote", 2, sync_016, "safe"),
    Case("sync/017 putsignal-remote", 2, sync_017, "safe"),
    Case("sync/018 putsignal-remote", 2, sync_018, "race"),
    Case("sync/019 ctx-remote", 2, sync_019, "safe", qps=2),
    Case("sync/020 ctx-remote", 2, sync_020, "race", qps=2),
    Case("sync/021 collective-reduce-remote", 4, sync_021, "safe"),
    Case("sync/022 collective-reduce-remote", 4, sync_022, "race"),
    Case("sync/023 team-sync-remote", 4, sync_023, "race"),
    Case("sync/024 team-sync-remote", 4, sync_024, "safe"),
]

"""A hold-out corpus of 2-PE protocol bugs, each with its correct twin (for ``shmemx run --check`` / ``--chaos``).

    shmemx run -n 2 --check scripts/holdout/corpus.py early_bell            # the buggy kernel
    shmemx run -n 2 --check scripts/holdout/corpus.py early_bell --twin     # its correct twin

Every kernel checks what it received and fails (exit 1) when the data is wrong, so a chaos run that makes the
bug happen fails; a twin must pass every time. ``KERNELS`` maps a name to (kernel, the kind ``--check`` must
report for the buggy one, the allocation its finding must name, "" where the memory is a local array).
Written from the OpenSHMEM / CANN SHMEM ordering rules: a put is complete only at the quiet of its own QP; a
barrier completes nothing; QPs are not ordered with each other; SO waits for earlier RO/SO WQEs of its QP only
(a fence for every earlier one); a signal value that does not change between rounds cannot tell rounds apart.
"""

from __future__ import annotations

import sys

import numpy as np

import shmemx

SET = shmemx.ACLSHMEM_SIGNAL_SET
GE, EQ = shmemx.ACLSHMEM_CMP_GE, shmemx.ACLSHMEM_CMP_EQ
SO_FENCED = shmemx.OpConfig(cqe=1, se=0, fence=1, odr=shmemx.ACLSHMEMX_UDMA_ODR_SO)
SO_ONLY = shmemx.OpConfig(cqe=1, se=0, fence=0, odr=shmemx.ACLSHMEMX_UDMA_ODR_SO)


def start(qps: int = 1) -> int:
    if qps > 1:
        shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, qps)
    shmemx.init()
    assert shmemx.n_pes() == 2, "the corpus is written for 2 PEs"
    return shmemx.my_pe()


def finish() -> None:
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def expect(what: str, got, want) -> None:
    # compare with a ufunc on the heap view itself, so that --check logs the read at this line (np.asarray of a
    # heap view is invisible to it, and the view's own read would be logged only when it dies: never, if the
    # assertion below ends the rank while the traceback holds the view)
    same = bool(np.all(got == want))
    got, want = np.asarray(got), np.asarray(want)
    if not same:
        raise AssertionError(f"pe {shmemx.my_pe()}: {what}: got {got.ravel()[:4]}..., want {want.ravel()[:4]}...")


# 1. flag before payload: signal_op right after the put, nothing completes the put ---------------------------

def early_bell(fixed: bool) -> None:
    me = start()
    mailbox = shmemx.zeros((3, 40), np.float32, name="mailbox")
    bell = shmemx.zeros(1, np.uint64, name="bell")
    letter = np.linspace(-2.5, 7.5, 120, dtype=np.float32).reshape(3, 40)
    if me == 0:
        shmemx.aclshmemx_udma_put_nbi(mailbox, letter, letter.size, 1)
        if fixed:
            shmemx.aclshmemx_udma_quiet(1)
        shmemx.aclshmemx_signal_op(bell, 5, SET, 1)
        shmemx.aclshmemx_udma_quiet(1)
    else:
        shmemx.aclshmem_signal_wait_until(bell, GE, 5)
        expect("mailbox", mailbox[1:], letter[1:])
    finish()


# 2. quiet on the wrong QP: the parcel goes on QP 3, the quiet polls QP 2 ---------------------------------------

def quiet_other_lane(fixed: bool) -> None:
    me = start(qps=4)
    parcel = shmemx.zeros((7, 9), np.int32, name="parcel")
    go = shmemx.zeros(1, np.uint64, name="go")
    body = (np.arange(63, dtype=np.int32) * 37 - 1000).reshape(7, 9)
    if me == 0:
        shmemx.aclshmemx_udma_qp_put_nbi(parcel, body, body.size, 1, 3)
        shmemx.aclshmemx_udma_qp_quiet(1, 3 if fixed else 2)
        shmemx.aclshmemx_signal_op(go, 1, SET, 1)
        shmemx.aclshmemx_udma_qp_quiet(1, 3)
    else:
        shmemx.aclshmem_signal_wait_until(go, EQ, 1)
        expect("parcel", parcel.sum(axis=0), body.sum(axis=0))
    finish()


# 3. signal on another QP: records on QP 2, header + signal on QP 1 --------------------------------------------

def split_signal(fixed: bool) -> None:
    me = start(qps=4)
    records = shmemx.zeros(200, np.uint16, name="records")
    header = shmemx.zeros(2, np.int64, name="header")
    ready = shmemx.zeros(1, np.uint64, name="ready")
    data = (np.arange(200) * 313 % 65521).astype(np.uint16)
    if me == 0:
        shmemx.aclshmemx_udma_qp_put_nbi(records, data, 200, 1, 2)
        hdr = np.array([200, 0xBEEF], np.int64)
        if fixed:
            shmemx.aclshmemx_udma_qp_put_signal_nbi(header, hdr, 2, ready, 9, 1, 2, config=SO_FENCED)
        else:
            shmemx.aclshmemx_udma_qp_put_signal_nbi(header, hdr, 2, ready, 9, 1, 1, config=SO_FENCED)
        shmemx.aclshmemx_udma_qp_quiet(1, 1)
        shmemx.aclshmemx_udma_qp_quiet(1, 2)
    else:
        shmemx.aclshmem_signal_wait_until(ready, EQ, 9)
        n = int(header[0])
        expect("records", records[:n], data[:n])
    finish()


# 4. a NO-ordered payload before an SO put_signal without fence (same QP 1) -------------------------------------

def so_without_fence(fixed: bool) -> None:
    me = start(qps=2)
    chunk = shmemx.zeros(50, np.float64, name="chunk")
    tag = shmemx.zeros(1, np.int64, name="tag")
    done = shmemx.zeros(1, np.uint64, name="done")
    values = np.geomspace(1e-3, 1e3, 50)
    if me == 0:
        shmemx.aclshmemx_udma_qp_put_nbi(chunk, values, 50, 1, 1)  # default config: NO ordering
        shmemx.aclshmemx_udma_qp_put_signal_nbi(tag, np.array([50], np.int64), 1, done, 1, 1, 1,
                                                config=SO_FENCED if fixed else SO_ONLY)
        shmemx.aclshmemx_udma_qp_quiet(1, 1)
    else:
        shmemx.aclshmem_signal_wait_until(done, EQ, 1)
        expect("chunk", chunk[::7], values[::7])
    finish()


# 5. a heap source refilled before the put's quiet ---------------------------------------------------------------

def refill_heap_source(fixed: bool) -> None:
    me = start()
    outbox = shmemx.zeros(4096, np.uint8, name="outbox")
    intake = shmemx.zeros(4096, np.uint8, name="intake")
    arrived = shmemx.zeros(1, np.uint64, name="arrived")
    first = (np.arange(4096) % 199).astype(np.uint8)
    if me == 0:
        outbox[:] = first
        shmemx.aclshmemx_udma_put_nbi(intake, outbox, 4096, 1)
        if fixed:
            shmemx.aclshmemx_udma_quiet(1)
        outbox[:] = 0xEE  # the next message's bytes
        shmemx.aclshmemx_udma_quiet(1)
        shmemx.aclshmemx_signal_op(arrived, 1, SET, 1)
    else:
        shmemx.aclshmem_signal_wait_until(arrived, EQ, 1)
        expect("intake", intake[::64], first[::64])
    finish()


# 6. a local source array scaled in place before the put's quiet ------------------------------------------------

def refill_local_source(fixed: bool) -> None:
    me = start(qps=2)
    grid = shmemx.zeros((5, 24), np.float32, name="grid")
    arrived = shmemx.zeros(1, np.uint64, name="arrived")
    want = np.arange(120, dtype=np.float32).reshape(5, 24) / 8
    if me == 0:
        src = want.copy()
        shmemx.aclshmemx_udma_qp_put_nbi(grid, src, src.size, 1, 1)
        if fixed:
            shmemx.aclshmemx_udma_qp_quiet(1, 1)
        src *= 2  # reused as scratch
        shmemx.aclshmemx_udma_qp_quiet(1, 1)
        shmemx.aclshmemx_signal_op(arrived, 1, SET, 1)
    else:
        shmemx.aclshmem_signal_wait_until(arrived, EQ, 1)
        expect("grid", grid[4], want[4])
    finish()


# 7. a get's destination read before the get's quiet -------------------------------------------------------------

def peek_get(fixed: bool) -> None:
    me = start()
    table = shmemx.array(np.arange(16, dtype=np.int64) * (me + 3), name="table")
    fetched = shmemx.zeros(16, np.int64, name="fetched")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        shmemx.aclshmemx_udma_get_nbi(fetched, table, 16, 1)
        if fixed:
            shmemx.aclshmemx_udma_quiet(1)
        total = int(fetched.sum())
        shmemx.aclshmemx_udma_quiet(1)
        assert total == sum(range(16)) * 4, f"pe 0: fetched sum {total}"
    finish()


# 8. a put's destination read by the target before the signal that covers it --------------------------------------

def peek_landing(fixed: bool) -> None:
    me = start()
    landing = shmemx.zeros((2, 33), np.float32, name="landing")
    arrived = shmemx.zeros(1, np.uint64, name="arrived")
    rows = np.full((2, 33), 6.5, np.float32)
    if me == 0:
        shmemx.aclshmemx_udma_put_signal_nbi(landing, rows, rows.size, arrived, 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
    else:
        if not fixed:
            early = landing[0].copy()  # read before anything says the rows are there
        shmemx.aclshmem_signal_wait_until(arrived, EQ, 1)
        if fixed:
            early = landing[0].copy()
        expect("landing", early, rows[0])
    finish()


# 9. a barrier taken as completion of a put on QP 1 ---------------------------------------------------------------

def barrier_as_done(fixed: bool) -> None:
    me = start(qps=2)
    result = shmemx.zeros(128, np.int16, name="result")
    vals = (np.arange(128) * 3 - 200).astype(np.int16)
    if me == 0:
        shmemx.aclshmemx_udma_qp_put_nbi(result, vals, 128, 1, 1)
        if fixed:
            shmemx.aclshmemx_udma_qp_quiet(1, 1)
    shmemx.aclshmem_sync_all()
    if me == 1:
        expect("result", result[100:], vals[100:])
    if me == 0 and not fixed:
        shmemx.aclshmemx_udma_qp_quiet(1, 1)
    finish()


# 10. a stale flag: every round signals the same value and nobody resets it ---------------------------------------

def same_flag_value(fixed: bool) -> None:
    me = start()
    pingbuf = shmemx.zeros(24, np.int32, name="pingbuf")
    ping = shmemx.zeros(1, np.uint64, name="ping")
    pong = shmemx.zeros(1, np.uint64, name="pong")
    rounds = 4
    for r in range(rounds):
        if me == 0:
            msg = np.full(24, 100 + r, np.int32)
            shmemx.aclshmemx_udma_put_signal_nbi(pingbuf, msg, 24, ping, r + 1 if fixed else 1, 1)
            shmemx.aclshmemx_udma_quiet(1)
            shmemx.aclshmem_signal_wait_until(pong, GE, r + 1)  # the reader took round r
        else:
            shmemx.aclshmem_signal_wait_until(ping, EQ, r + 1 if fixed else 1)
            got = pingbuf[:3].copy()
            shmemx.aclshmemx_signal_op(pong, r + 1, SET, 0)
            expect(f"pingbuf round {r}", got, np.full(3, 100 + r, np.int32))
    finish()


# 11. a ring slot reused before the consumer's credit -------------------------------------------------------------

def ring_no_credit(fixed: bool) -> None:
    me = start()
    slots, msgs, width = 2, 6, 48
    ring = shmemx.zeros((slots, width), np.int32, name="ring")
    posted = shmemx.zeros(slots, np.uint64, name="posted")
    credit = shmemx.zeros(slots, np.uint64, name="credit")
    for m in range(msgs):
        s = m % slots
        if me == 0:
            if fixed and m >= slots:  # the consumer gave slot s back after message m - slots
                shmemx.aclshmem_signal_wait_until(credit[s:s + 1], GE, m - slots + 1)
            body = np.full(width, 1000 * m + 7, np.int32)
            shmemx.aclshmemx_udma_put_signal_nbi(ring[s], body, width, posted[s:s + 1], m + 1, 1)
            shmemx.aclshmemx_udma_quiet(1)
        else:
            shmemx.aclshmem_signal_wait_until(posted[s:s + 1], GE, m + 1)
            got = ring[s, :5].copy()
            shmemx.aclshmemx_signal_op(credit[s:s + 1], m + 1, SET, 0)
            expect(f"ring message {m}", got, np.full(5, 1000 * m + 7, np.int32))
    finish()


# 12. a lost update: PE 0 reads the tally with a get and writes it back with a put, PE 1 adds to it in place -----

def racing_increment(fixed: bool) -> None:
    me = start()
    tally = shmemx.zeros(1, np.int64, name="tally")
    scratch = shmemx.zeros(1, np.int64, name="scratch")
    turn = shmemx.zeros(1, np.uint64, name="turn")
    if me == 1:
        tally[0] = 40
    shmemx.aclshmem_barrier_all()
    if me == 0:
        if fixed:
            shmemx.aclshmem_signal_wait_until(turn, EQ, 1)
        shmemx.aclshmemx_udma_get_nbi(scratch, tally, 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
        scratch[0] = scratch[0] + 1
        shmemx.aclshmemx_udma_put_nbi(tally, scratch, 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
    else:
        tally[0] = tally[0] + 1
        if fixed:
            shmemx.aclshmemx_signal_op(turn, 1, SET, 0)
    shmemx.aclshmem_barrier_all()
    if me == 1:
        expect("tally", tally[0:1], np.array([42]))
    finish()


KERNELS = {
    "early_bell": (early_bell, "flag-before-payload", "mailbox"),
    "quiet_other_lane": (quiet_other_lane, "quiet-wrong-qp", "parcel"),
    "split_signal": (split_signal, "signal-other-qp", "records"),
    "so_without_fence": (so_without_fence, "unfenced-signal", "chunk"),
    "refill_heap_source": (refill_heap_source, "source-overwrite", "outbox"),
    "refill_local_source": (refill_local_source, "source-overwrite", ""),
    "peek_get": (peek_get, "get-before-quiet", "fetched"),
    "peek_landing": (peek_landing, "unsynchronized-read", "landing"),
    "barrier_as_done": (barrier_as_done, "barrier-not-completion", "result"),
    "same_flag_value": (same_flag_value, "stale-flag", "ping"),
    "ring_no_credit": (ring_no_credit, "slot-reuse", "ring"),
    "racing_increment": (racing_increment, "unordered-writes", "tally"),
}

if __name__ == "__main__":
    name = sys.argv[1]
    KERNELS[name][0]("--twin" in sys.argv[2:])

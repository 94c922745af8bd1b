"""A corpus of protocol bugs for ``--check``: each class is a small buggy kernel and its correct twin.

Every kernel is a rank body for ``launch(n, body)``; ``CASES`` lists (class, PEs, buggy body, twin, the kind the
buggy one must be reported as, the allocation the finding must name). The buggy kernels contain their bug on
every run, whatever the timing: some also compute a wrong result now and then (which they do not check, so that
the finding is what the test sees), the twins check their result. With ``SHMEMX_CORPUS_STRICT=1`` in the
environment the buggy kernels check their result too (``_expect``): that is how chaos makes them fail.
``tests/test_check.py`` runs them; ``scripts/check_corpus.py`` runs them under chaos seeds.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

import shmemx

N = 64  # elements per payload
SET, ADD = shmemx.ACLSHMEM_SIGNAL_SET, shmemx.ACLSHMEM_SIGNAL_ADD
EQ, GE = shmemx.ACLSHMEM_CMP_EQ, shmemx.ACLSHMEM_CMP_GE
FENCED = shmemx.OpConfig(cqe=1, se=0, fence=1, odr=shmemx.ACLSHMEMX_UDMA_ODR_SO)


def _init(qps: int = 1):
    if qps > 1:
        shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, qps)
    shmemx.init()
    return shmemx.my_pe(), shmemx.n_pes()


def _payload(pe: int, k: int = 0) -> np.ndarray:
    """Rows that say who sent them and which round (origin-encoded; never 0, the value of a fresh allocation)."""
    return np.full(N, pe * 1000 + k + 1, np.int64)


STRICT_ENV = "SHMEMX_CORPUS_STRICT"


def _expect(twin: bool, ok) -> None:
    """A twin checks its result; a buggy kernel only when ``SHMEMX_CORPUS_STRICT=1`` (chaos runs)."""
    if twin or os.environ.get(STRICT_ENV) == "1":
        assert ok, "wrong data"


def _done():
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


# --- 1. flag before payload: signal_op after a put, no quiet ------------------------------------------------

def _signal_after_put(quiet: bool) -> None:
    me, n = _init()
    inbox = shmemx.zeros(N, np.int64, name="inbox")
    flag = shmemx.zeros(1, np.uint64, name="flag")
    if me == 0:
        shmemx.aclshmemx_udma_put_nbi(inbox, _payload(0), N, 1)
        if quiet:
            shmemx.aclshmemx_udma_quiet(1)
        shmemx.aclshmemx_signal_op(flag, 1, SET, 1)
        if not quiet:
            shmemx.aclshmemx_udma_quiet(1)
    else:
        shmemx.aclshmem_signal_wait_until(flag, EQ, 1)
        got = inbox.copy()
        _expect(quiet, (got == _payload(0)).all())
    _done()


def flag_before_payload():
    _signal_after_put(False)


def flag_before_payload_twin():
    _signal_after_put(True)


# --- 2. signal on another QP ---------------------------------------------------------------------------------

def _split_qps(quiet: bool) -> None:
    me, n = _init(2)
    inbox = shmemx.zeros(N, np.int64, name="inbox")
    hdr = shmemx.zeros(1, np.int64, name="hdr")
    flag = shmemx.zeros(1, np.uint64, name="flag")
    if me == 0:
        shmemx.aclshmemx_udma_qp_put_nbi(inbox, _payload(0), N, 1, 0)
        if quiet:
            shmemx.aclshmemx_udma_qp_quiet(1, 0)
        shmemx.aclshmemx_udma_qp_put_signal_nbi(hdr, np.ones(1, np.int64), 1, flag, 1, 1, 1)
        shmemx.aclshmemx_udma_qp_quiet(1, 0)
        shmemx.aclshmemx_udma_qp_quiet(1, 1)
    else:
        shmemx.aclshmem_signal_wait_until(flag, EQ, 1)
        got = inbox.copy()
        _expect(quiet, (got == _payload(0)).all())
    _done()


def signal_other_qp():
    _split_qps(False)


def signal_other_qp_twin():
    _split_qps(True)


# --- 3. NO payload, then an SO signal without fence on the same QP -------------------------------------------

def _unfenced(fence: bool) -> None:
    me, n = _init()
    inbox = shmemx.zeros(N, np.int64, name="inbox")
    hdr = shmemx.zeros(1, np.int64, name="hdr")
    flag = shmemx.zeros(1, np.uint64, name="flag")
    if me == 0:
        shmemx.aclshmemx_udma_put_nbi(inbox, _payload(0), N, 1)
        config = FENCED if fence else shmemx.ACLSHMEMX_UDMA_OP_CONFIG_SO
        shmemx.aclshmemx_udma_put_signal_nbi(hdr, np.ones(1, np.int64), 1, flag, 1, 1, config=config)
        shmemx.aclshmemx_udma_quiet(1)
    else:
        shmemx.aclshmem_signal_wait_until(flag, EQ, 1)
        got = inbox.copy()
        _expect(fence, (got == _payload(0)).all())
    _done()


def unfenced_signal():
    _unfenced(False)


def unfenced_signal_twin():
    _unfenced(True)


# --- 4. quiet on the wrong QP --------------------------------------------------------------------------------

def _quiet_qp(right: bool) -> None:
    me, n = _init(2)
    inbox = shmemx.zeros(N, np.int64, name="inbox")
    flag = shmemx.zeros(1, np.uint64, name="flag")
    if me == 0:
        shmemx.aclshmemx_udma_qp_put_nbi(inbox, _payload(0), N, 1, 1)
        if right:
            shmemx.aclshmemx_udma_qp_quiet(1, 1)
        else:
            shmemx.aclshmemx_udma_quiet(1)  # QP 0 only
        shmemx.aclshmemx_signal_op(flag, 1, SET, 1)
        shmemx.aclshmemx_udma_qp_quiet(1, 1)
    else:
        shmemx.aclshmem_signal_wait_until(flag, EQ, 1)
        got = inbox.copy()
        _expect(right, (got == _payload(0)).all())
    _done()


def quiet_wrong_qp():
    _quiet_qp(False)


def quiet_wrong_qp_twin():
    _quiet_qp(True)


# --- 5. a barrier taken as UDMA completion ---------------------------------------------------------------------

def _barrier(quiet: bool) -> None:
    me, n = _init()
    inbox = shmemx.zeros(N, np.int64, name="inbox")
    peer = (me + 1) % n
    shmemx.aclshmemx_udma_put_nbi(inbox, _payload(me), N, peer)
    if quiet:
        shmemx.aclshmemx_udma_quiet(peer)
    shmemx.aclshmem_barrier_all()
    got = inbox.copy()
    _expect(quiet, (got == _payload((me - 1) % n)).all())
    if not quiet:
        shmemx.aclshmemx_udma_quiet(peer)
    _done()


def barrier_not_completion():
    _barrier(False)


def barrier_not_completion_twin():
    _barrier(True)


# --- 6. a get's destination read before its quiet --------------------------------------------------------------

def _get(quiet: bool) -> None:
    me, n = _init()
    src = shmemx.array(_payload(me), name="src")
    dst = shmemx.zeros(N, np.int64, name="got")
    shmemx.aclshmem_barrier_all()
    peer = (me + 1) % n
    shmemx.aclshmemx_udma_get_nbi(dst, src, N, peer)
    if quiet:
        shmemx.aclshmemx_udma_quiet(peer)
    total = int(dst.sum())
    _expect(quiet, total == int(_payload(peer).sum()))
    shmemx.aclshmemx_udma_quiet(peer)
    _done()


def get_before_quiet():
    _get(False)


def get_before_quiet_twin():
    _get(True)


# --- 7. a put's source refilled before its quiet (a heap staging buffer; a local array) ------------------------

def _staging(quiet: bool) -> None:
    me, n = _init()
    inbox = shmemx.zeros((2, N), np.int64, name="inbox")
    staging = shmemx.zeros(N, np.int64, name="staging")
    flag = shmemx.zeros(1, np.uint64, name="flag")
    if me == 0:
        for k in range(2):
            staging[:] = _payload(0, k)  # the bug: the previous token's put may not have read it yet
            shmemx.aclshmemx_udma_put_nbi(inbox[k], staging, N, 1)
            if quiet:
                shmemx.aclshmemx_udma_quiet(1)
        shmemx.aclshmemx_udma_quiet(1)
        shmemx.aclshmemx_signal_op(flag, 1, SET, 1)
    else:
        shmemx.aclshmem_signal_wait_until(flag, EQ, 1)
        got = inbox.copy()
        _expect(quiet, all((got[k] == _payload(0, k)).all() for k in range(2)))
    _done()


def source_overwrite():
    _staging(False)


def source_overwrite_twin():
    _staging(True)


def _local_source(quiet: bool) -> None:
    me, n = _init()
    inbox = shmemx.zeros(N, np.int64, name="inbox")
    if me == 0:
        row = _payload(0)
        shmemx.aclshmemx_udma_put_nbi(inbox, row, N, 1)
        if quiet:
            shmemx.aclshmemx_udma_quiet(1)
        row[:] = -1  # a local numpy array: only the source checksum sees this store
        shmemx.aclshmemx_udma_quiet(1)
    shmemx.aclshmem_barrier_all()
    if me == 1:
        _expect(quiet, (inbox == _payload(0)).all())
    _done()


def source_overwrite_local():
    _local_source(False)


def source_overwrite_local_twin():
    _local_source(True)


# --- 8. a stale flag: a constant flag never reset ----------------------------------------------------------------

def _ping_pong(versioned: bool) -> None:
    me, n = _init()
    inbox = shmemx.zeros(N, np.int64, name="inbox")
    flag = shmemx.zeros(1, np.uint64, name="flag")
    ack = shmemx.zeros(1, np.uint64, name="ack")
    for k in range(2):
        value = k + 1 if versioned else 1
        if me == 0:
            shmemx.aclshmemx_udma_put_signal_nbi(inbox, _payload(0, k), N, flag, value, 1)
            shmemx.aclshmemx_udma_quiet(1)
            shmemx.aclshmem_signal_wait_until(ack, EQ, value)
        else:
            shmemx.aclshmem_signal_wait_until(flag, EQ, value)
            got = inbox.copy()
            _expect(versioned, (got == _payload(0, k)).all())
            shmemx.aclshmemx_signal_op(ack, value, SET, 0)
    _done()


def stale_flag():
    _ping_pong(False)


def stale_flag_twin():
    _ping_pong(True)


# --- 9. a slot reused before its consumer gave it back ---------------------------------------------------------

def _slots(credit: bool, late: bool = False) -> None:
    me, n = _init()
    slots = shmemx.zeros((2, N), np.int64, name="slots")
    ready = shmemx.zeros(2, np.uint64, name="ready")
    credits = shmemx.zeros(2, np.uint64, name="credits")
    rounds = 4
    for k in range(rounds):
        s = k % 2
        if me == 0:
            if credit and k >= 2:
                shmemx.aclshmem_signal_wait_until(credits[s:s + 1], GE, k - 1)  # the consumer read round k - 2
            shmemx.aclshmemx_udma_put_signal_nbi(slots[s], _payload(0, k), N, ready[s:s + 1], k + 1, 1)
            shmemx.aclshmemx_udma_quiet(1)  # its own writes are ordered; the consumer's read is not
        else:
            if late and k == 0:
                time.sleep(0.2)  # the writer runs ahead: this reader sees round 2's signal in round 0
            shmemx.aclshmem_signal_wait_until(ready[s:s + 1], GE, k + 1)
            got = slots[s].copy()
            _expect(credit, (got == _payload(0, k)).all())
            shmemx.aclshmemx_signal_op(credits[s:s + 1], k + 1, SET, 0)
    _done()


def slot_reuse():
    _slots(False)


def slot_reuse_twin():
    _slots(True)


def slot_reuse_late():
    _slots(False, late=True)


def slot_reuse_late_twin():
    _slots(True, late=True)


# --- 10. two origins write one range: offset rank instead of rank * slot ----------------------------------------

def _gather(right: bool) -> None:
    me, n = _init()
    inbox = shmemx.zeros(n * N, np.int64, name="gather")
    if me != 0:
        at = me * N if right else me  # the bug: elements, not slots
        shmemx.aclshmemx_udma_put_nbi(inbox[at:at + N], _payload(me), N, 0)
        shmemx.aclshmemx_udma_quiet(0)
    shmemx.aclshmem_barrier_all()
    if me == 0 and right:
        assert all((inbox[p * N:(p + 1) * N] == _payload(p)).all() for p in range(1, n))
    _done()


def unordered_writes():
    _gather(False)


def unordered_writes_twin():
    _gather(True)


# --- 11. acknowledge, then reset the flag: the next signal can be erased ------------------------------------------

def _ack_reset(reset_first: bool) -> None:
    me, n = _init()
    inbox = shmemx.zeros(N, np.int64, name="inbox")
    flag = shmemx.zeros(1, np.uint64, name="flag")
    ack = shmemx.zeros(1, np.uint64, name="ack")
    for k in range(2):
        if me == 0:
            if k:
                shmemx.aclshmem_signal_wait_until(ack, EQ, k)
            shmemx.aclshmemx_udma_put_signal_nbi(inbox, _payload(0, k), N, flag, 1, 1)
            shmemx.aclshmemx_udma_quiet(1)
        elif k == 0 or reset_first:  # (the buggy consumer stops after round 0: its reset may erase round 1's flag)
            shmemx.aclshmem_signal_wait_until(flag, EQ, 1)
            got = inbox.copy()
            _expect(reset_first, (got == _payload(0, k)).all())
            if reset_first:
                flag[0] = 0
                shmemx.aclshmemx_signal_op(ack, k + 1, SET, 0)
            else:
                shmemx.aclshmemx_signal_op(ack, k + 1, SET, 0)
                flag[0] = 0  # the bug: pe 0 may already have signalled the next round
    shmemx.aclshmem_barrier_all()
    if me == 1 and not reset_first:
        _expect(False, flag[0] == 1)  # round 1's signal was not erased
    _done()


def ack_then_reset():
    _ack_reset(False)


def ack_then_reset_twin():
    _ack_reset(True)


# --- 12. two AIV blocks on one send queue ---------------------------------------------------------------------

def _blocks_kernel(inbox, synced: bool) -> None:
    b = shmemx.get_block_idx()
    if b == 1:
        if synced:
            shmemx.sync_all()
        else:
            time.sleep(0.2)  # after block 0's quiet in time, but nothing orders it
    shmemx.aclshmemx_udma_put_nbi(inbox[b], _payload(0, b), N, 1)
    shmemx.aclshmemx_udma_quiet(1)
    if b == 0 and synced:
        shmemx.sync_all()


def _two_blocks(synced: bool) -> None:
    me, n = _init()
    inbox = shmemx.zeros((2, N), np.int64, name="inbox")
    if me == 0:
        shmemx.launch(_blocks_kernel, 2, inbox, synced)
    shmemx.aclshmem_barrier_all()
    if me == 1 and synced:
        assert (inbox[1] == _payload(0, 1)).all()
    _done()


def two_submitters():
    _two_blocks(False)


def two_submitters_twin():
    _two_blocks(True)


def _overlap_kernel(inbox) -> None:
    b = shmemx.get_block_idx()
    if b == 0:
        shmemx.aclshmemx_udma_put_nbi(inbox[0], _payload(0), N, 1)
        shmemx.sync_all()  # block 1 posts while block 0 still owns the queue
        shmemx.sync_all()
        shmemx.aclshmemx_udma_quiet(1)
    else:
        shmemx.sync_all()
        try:
            shmemx.aclshmemx_udma_put_nbi(inbox[1], _payload(0, 1), N, 1)
        finally:
            shmemx.sync_all()


def two_submitters_overlapping():
    me, n = _init()
    inbox = shmemx.zeros((2, N), np.int64, name="inbox")
    if me == 0:
        shmemx.launch(_overlap_kernel, 2, inbox)  # raises SubmitterError, the job fails
    _done()


# --- a kernel that returns with WQEs no quiet retired ---------------------------------------------------------

def _unquieted_kernel(inbox, quiet: bool) -> None:
    shmemx.aclshmemx_udma_qp_put_nbi(inbox, _payload(0), N, 1, shmemx.get_block_idx())
    if quiet:
        shmemx.aclshmemx_udma_qp_quiet(1, shmemx.get_block_idx())


def _unfinished(quiet: bool) -> None:
    me, n = _init(2)
    inbox = shmemx.zeros(N, np.int64, name="inbox")
    if me == 0:
        shmemx.launch(_unquieted_kernel, 1, inbox, quiet)
    _done()


def _defer_kernel(inbox, submit: bool) -> None:
    state = shmemx.aclshmemx_submit_state_t()
    shmemx.aclshmemx_udma_put_nbi(inbox[0], _payload(0, 0), N, 1, batch=shmemx.aclshmemx_defer_t(state))
    if submit:
        shmemx.aclshmemx_udma_put_nbi(inbox[1], _payload(0, 1), N, 1, batch=shmemx.aclshmemx_submit_t(state))
        shmemx.aclshmemx_udma_quiet(1)


def _deferred(submit: bool) -> None:
    me, n = _init()
    inbox = shmemx.zeros((2, N), np.int64, name="inbox")
    if me == 0:
        shmemx.launch(_defer_kernel, 1, inbox, submit)
    _done()


def unsubmitted_defer():
    _deferred(False)


def unsubmitted_defer_twin():
    _deferred(True)


def unfinished_work():
    _unfinished(False)


def unfinished_work_twin():
    _unfinished(True)


# --- 13. a read with no synchronisation at all -------------------------------------------------------------------

def _no_sync(synced: bool) -> None:
    me, n = _init()
    inbox = shmemx.zeros(N, np.int64, name="inbox")
    flag = shmemx.zeros(1, np.uint64, name="flag")
    if me == 0:
        shmemx.aclshmemx_udma_put_nbi(inbox, _payload(0), N, 1)
        shmemx.aclshmemx_udma_quiet(1)
        if synced:
            shmemx.aclshmemx_signal_op(flag, 1, SET, 1)
    else:
        if synced:
            shmemx.aclshmem_signal_wait_until(flag, EQ, 1)
        else:
            time.sleep(0.1)  # "long enough": nothing orders the read after the put
        got = inbox.copy()
        _expect(synced, (got == _payload(0)).all())
    _done()


def unsynchronized_read():
    _no_sync(False)


def unsynchronized_read_twin():
    _no_sync(True)


# --- a raw poll of a flag (a warning, not a race) ----------------------------------------------------------------

def _poll(api: bool) -> None:
    me, n = _init()
    inbox = shmemx.zeros(N, np.int64, name="inbox")
    flag = shmemx.zeros(1, np.uint64, name="flag")
    if me == 0:
        shmemx.aclshmemx_udma_put_nbi(inbox, _payload(0), N, 1)
        shmemx.aclshmemx_udma_quiet(1)
        time.sleep(0.05)
        shmemx.aclshmemx_signal_op(flag, 1, SET, 1)
    elif api:
        shmemx.aclshmem_signal_wait_until(flag, EQ, 1)
    else:
        while flag[0] != 1:
            pass
    if me == 1:
        assert (inbox == _payload(0)).all()
    _done()


def raw_poll():
    _poll(False)


def raw_poll_twin():
    _poll(True)


@dataclass(frozen=True)
class Case:
    name: str
    n_pes: int
    bug: object
    twin: object
    kind: str
    allocation: str
    severity: str = "error"
    code: int = 3  # the job's exit status (3: it succeeded, the sanitizer found the bug)
    data: bool = False  # the bug can show as wrong data (under SHMEMX_CORPUS_STRICT=1): chaos must make it fail


CASES = [
    Case("flag before payload (signal_op, no quiet)", 2, flag_before_payload, flag_before_payload_twin,
         "flag-before-payload", "inbox", data=True),
    Case("signal on another QP", 2, signal_other_qp, signal_other_qp_twin, "signal-other-qp", "inbox", data=True),
    Case("NO payload before an unfenced SO signal", 2, unfenced_signal, unfenced_signal_twin, "unfenced-signal",
         "inbox", data=True),
    Case("quiet on the wrong QP", 2, quiet_wrong_qp, quiet_wrong_qp_twin, "quiet-wrong-qp", "inbox", data=True),
    Case("barrier taken as UDMA completion", 2, barrier_not_completion, barrier_not_completion_twin,
         "barrier-not-completion", "inbox", data=True),
    Case("get destination read before its quiet", 2, get_before_quiet, get_before_quiet_twin, "get-before-quiet",
         "got", data=True),
    Case("heap staging buffer refilled before its quiet", 2, source_overwrite, source_overwrite_twin,
         "source-overwrite", "staging", data=True),
    Case("local source array refilled before its quiet", 2, source_overwrite_local, source_overwrite_local_twin,
         "source-overwrite", "", data=True),
    Case("stale flag (constant, never reset)", 2, stale_flag, stale_flag_twin, "stale-flag", "flag", data=True),
    Case("slot reused before the consumer's credit", 2, slot_reuse, slot_reuse_twin, "slot-reuse", "slots",
         data=True),
    Case("slot reused before the credit, the reader late", 2, slot_reuse_late, slot_reuse_late_twin, "slot-reuse",
         "slots", data=True),
    Case("two origins write one range", 3, unordered_writes, unordered_writes_twin, "unordered-writes", "gather"),
    Case("acknowledge, then reset the flag", 2, ack_then_reset, ack_then_reset_twin, "unordered-writes", "flag",
         data=True),
    Case("two blocks on one send queue", 2, two_submitters, two_submitters_twin, "two-submitters", "inbox"),
    Case("two blocks on one send queue at once (SubmitterError)", 2, two_submitters_overlapping, two_submitters_twin,
         "two-submitters", "inbox", code=1),
    Case("a kernel returns with WQEs no quiet retired", 2, unfinished_work, unfinished_work_twin, "unfinished-work",
         "inbox"),
    Case("a defer batch never submitted", 2, unsubmitted_defer, unsubmitted_defer_twin, "unfinished-work", ""),
    Case("a read with no synchronisation", 2, unsynchronized_read, unsynchronized_read_twin, "unsynchronized-read",
         "inbox"),
    Case("a flag polled with plain loads", 2, raw_poll, raw_poll_twin, "raw-poll", "flag", severity="warning", code=0),
]

"""The emulated UDMA data plane, end to end: put/get/put_signal, ordering, atomics, ring wrap, errors, batching,
kernel launch, the one-submitter rule and the raw WQE path.

Every body is a module-level function run in every rank through ``launch`` (conftest's ``run_ok``) and works for
any rank count. Payloads encode their origin (``_stamp(src_pe, dst_pe, i)``), so a misrouted, lost or overwritten
element names the put it came from. Tests that must see the engine *not* having run something pause it
(``Engine.pause``) instead of racing it.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

import shmemx
from shmemx import CqeStatus, Opcode
from shmemx.api.blocks import UB_SIZE
from shmemx.layout import decode_wqe
from shmemx.runtime import runtime
from shmemx.udma.plane import _Tails
from shmemx.udma import _engine

MULTI_PES = [2, 4, 8]
EQ = shmemx.ACLSHMEM_CMP_EQ


def _stamp(src: int, dst: int, i) -> np.ndarray:
    """Origin-encoded int64 payload: element i of the put from ``src`` to ``dst``."""
    return (np.int64(src + 1) << 40) | (np.int64(dst + 1) << 32) | np.asarray(i, np.int64)


def _others(me: int, n: int) -> list[int]:
    return [(me + k) % n for k in range(1, n)]


def _wait_for(pred, what: str, timeout: float = 10.0) -> None:
    """Poll a completion the test cannot block on through the API (e.g. an error CQE nobody may quiet yet)."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


# --- put / get then quiet -------------------------------------------------------------------------------------


def _put_get_quiet():
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    m = 1000
    inbox = shmemx.zeros((n, m), np.int64, name="inbox")  # row p: what pe p put here
    qpbox = shmemx.zeros((n, m), np.int64, name="qpbox")
    mine = shmemx.zeros((n, m), np.int64, name="mine")  # row p: what I put to pe p (a heap source)
    for p in range(n):
        mine[p] = _stamp(me, p, np.arange(m))
    shmemx.aclshmem_barrier_all()
    for p in _others(me, n):
        local = _stamp(me, p, np.arange(m))  # a local (non-heap) source: registered for the put's life
        shmemx.aclshmemx_udma_put_nbi(inbox[me], local, m, p)
        del local  # the registration keeps it alive until the put completed
        shmemx.aclshmemx_udma_qp_put_nbi(qpbox[me], mine[p], m, p, 0)
    for p in _others(me, n):
        shmemx.aclshmemx_udma_quiet(p)
    shmemx.aclshmem_barrier_all()
    for p in _others(me, n):
        np.testing.assert_array_equal(inbox[p], _stamp(p, me, np.arange(m)), err_msg=f"put from pe {p}")
        np.testing.assert_array_equal(qpbox[p], _stamp(p, me, np.arange(m)), err_msg=f"qp put from pe {p}")
    # gets: into a local array and into a heap array, a slice at an odd offset, of several dtypes
    got = np.zeros((n, m), np.int64)
    for p in _others(me, n):
        shmemx.aclshmemx_udma_get_nbi(got[p], mine[me], m, p)  # pe p's `mine[me]` = what p put to me
        shmemx.aclshmemx_udma_qp_get_nbi(qpbox[p, 3:10], mine[me, 3:10], 7, p, 0)
    for p in _others(me, n):
        shmemx.aclshmemx_udma_quiet(p)
        np.testing.assert_array_equal(got[p], _stamp(p, me, np.arange(m)), err_msg=f"get from pe {p}")
    shmemx.aclshmem_barrier_all()
    small = shmemx.full(37, me, np.uint8, name="small")
    halves = shmemx.full(5, me + 0.5, np.float16, name="halves")
    shmemx.aclshmem_barrier_all()
    nxt, prev = (me + 1) % n, (me - 1) % n
    b = np.zeros(37, np.uint8)
    h = np.zeros(5, np.float16)
    shmemx.aclshmemx_udma_get_nbi(b[1:], small[1:], 36, nxt)
    shmemx.aclshmemx_udma_get_nbi(h, halves, 5, nxt)
    shmemx.aclshmemx_udma_quiet(nxt)
    assert b[0] == 0 and (b[1:] == nxt).all() and (h == nxt + 0.5).all()
    shmemx.aclshmem_barrier_all()
    shmemx.aclshmemx_udma_put_nbi(small[:10], np.full(10, 200 + me, np.uint8), 10, nxt)
    shmemx.aclshmemx_udma_quiet(nxt)
    shmemx.aclshmem_barrier_all()
    assert (small[:10] == 200 + prev).all() and (small[10:] == me).all()
    shmemx.finalize()


@pytest.mark.parametrize("n", MULTI_PES)
def test_put_and_get_then_quiet(run_ok, n):
    run_ok(n, _put_get_quiet)


def _large_writes(coop_min: int):
    """WRITEs and READs at and past the engine's cooperative-copy threshold (a quiet-ing thread copies chunks of
    them too): every byte lands, whole chunks and a short last one, one put + quiet and several before one quiet,
    a put_signal's signal seen only after its whole payload, gets into a local array."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    native = runtime().udma.engine.native
    native.set_coop(coop_min)
    chunk = _engine.COOP_CHUNK
    sizes = [coop_min, 4 * chunk + 8, 9 * chunk - 16, 16 * chunk]  # bytes, all multiples of 8
    box = shmemx.zeros((n, sum(sizes) // 8), np.int64, name="box")
    sig = shmemx.zeros((n, 4), np.uint64, name="sig")
    shmemx.aclshmem_barrier_all()
    nxt, prv = (me + 1) % n, (me - 1) % n
    offsets = np.cumsum([0] + sizes) // 8
    for rnd in range(3):
        expect = [_stamp(me, nxt, np.arange(a, b)) + (rnd << 24) for a, b in zip(offsets[:-1], offsets[1:])]
        for i, part in enumerate(expect):  # round 0: a quiet per put; round 1: one quiet for all
            shmemx.aclshmemx_udma_put_nbi(box[me, offsets[i]:offsets[i + 1]], part, part.size, nxt)
            if rnd == 0:
                shmemx.aclshmemx_udma_quiet(nxt)
        if rnd == 2:  # a put_signal per size: the signal only after its payload
            for i, part in enumerate(expect):
                shmemx.aclshmemx_udma_put_signal_nbi(box[me, offsets[i]:offsets[i + 1]], part + 1, part.size,
                                                      sig[me, i:i + 1], 100 + i, nxt)
            for i in range(len(sizes)):
                shmemx.aclshmem_signal_wait_until(sig[prv, i:i + 1], EQ, 100 + i)
                np.testing.assert_array_equal(box[prv, offsets[i]:offsets[i + 1]],
                                              _stamp(prv, me, np.arange(offsets[i], offsets[i + 1])) + (rnd << 24) + 1,
                                              err_msg=f"signal {i} seen before its payload")
        shmemx.aclshmemx_udma_quiet(nxt)
        shmemx.aclshmem_barrier_all()
        got = box[prv].copy()
        shmemx.aclshmem_barrier_all()
        want = _stamp(prv, me, np.arange(offsets[-1])) + (rnd << 24) + (rnd == 2)
        np.testing.assert_array_equal(got, want, err_msg=f"round {rnd}")
    back = np.zeros(offsets[-1], np.int64)  # READs: what this PE put to the next, read back from it
    for i in range(len(sizes)):
        shmemx.aclshmemx_udma_get_nbi(back[offsets[i]:offsets[i + 1]], box[me, offsets[i]:offsets[i + 1]],
                                      int(offsets[i + 1] - offsets[i]), nxt)
    shmemx.aclshmemx_udma_quiet(nxt)
    np.testing.assert_array_equal(back, _stamp(me, nxt, np.arange(offsets[-1])) + (2 << 24) + 1, err_msg="gets")
    shmemx.aclshmem_barrier_all()
    copied, helped = native.coop_counts
    assert copied >= 4 * sum((s + chunk - 1) // chunk for s in sizes)
    assert helped <= copied
    shmemx.finalize()


@pytest.mark.parametrize("n", [2, 4])
def test_large_writes_copied_cooperatively_land_whole(run_ok, n):
    run_ok(n, _large_writes, 1 << 20)


# --- put_signal ------------------------------------------------------------------------------------------------


def _put_signal_visibility(rounds: int, m: int):
    """Each PE sends ``rounds`` payloads to every other PE with put_signal and never quiets before the receiver
    looked: a receiver that sees signal r must see payload r whole, in its first read."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    box = shmemx.zeros((n, rounds, m), np.int64, name="box")
    sig = shmemx.zeros((n, rounds), np.uint64, name="sig")
    shmemx.aclshmem_barrier_all()
    payload = [[_stamp(me, p, np.arange(m)) + (r << 20) for r in range(rounds)] for p in range(n)]
    for r in range(rounds):
        for p in _others(me, n):
            shmemx.aclshmemx_udma_put_signal_nbi(box[me, r], payload[p][r], m, sig[me, r:r + 1], 1000 + r, p)
        for p in _others(me, n):
            got = shmemx.aclshmem_signal_wait_until(sig[p, r:r + 1], EQ, 1000 + r)
            assert got == 1000 + r
            np.testing.assert_array_equal(box[p, r], _stamp(p, me, np.arange(m)) + (r << 20),
                                          err_msg=f"round {r}: signal from pe {p} seen before its payload")
    for p in _others(me, n):
        shmemx.aclshmemx_udma_quiet(p)
    shmemx.aclshmem_barrier_all()
    assert (sig[np.arange(n) != me] == 1000 + np.arange(rounds)).all()  # signals from every PE
    assert not sig[me].any()
    shmemx.finalize()


@pytest.mark.parametrize("n", MULTI_PES)
def test_put_signal_receiver_sees_payload_without_quiet(run_ok, n):
    run_ok(n, _put_signal_visibility, 4, 64 * 1024)


def _put_signal_api():
    """qp variant, a 64-bit value with the top bit set, int64 words, zero-length payloads and bad signal words."""
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 2)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt, prev = (me + 1) % n, (me - 1) % n
    data = shmemx.zeros(8, np.float32, name="data")
    sig = shmemx.zeros(4, np.uint64, name="sig")
    isig = shmemx.zeros(2, np.int64, name="isig")
    shmemx.aclshmem_barrier_all()
    value = (1 << 63) | (me << 8) | 1
    shmemx.aclshmemx_udma_qp_put_signal_nbi(data, np.full(8, me, np.float32), 8, sig[1:2], value, nxt, 1)
    shmemx.aclshmemx_udma_put_signal_nbi(data, np.zeros(0, np.float32), 0, isig[1:], -5, nxt)
    assert shmemx.aclshmem_signal_wait_until(sig[1:2], EQ, (1 << 63) | (prev << 8) | 1) == (1 << 63) | (prev << 8) | 1
    assert (data == prev).all()
    assert shmemx.aclshmem_signal_wait_until(isig[1:], EQ, -5) == -5
    for bad, kind in ((sig[1:2].view(np.float64), TypeError), (data[:2].view(np.int32), TypeError),
                      (np.zeros(1, np.uint64), ValueError)):
        with pytest.raises(kind, match=f"pe {me}: aclshmemx_udma_put_signal_nbi to pe {nxt} qp 0: sig"):
            shmemx.aclshmemx_udma_put_signal_nbi(data, data, 1, bad, 1, nxt)
    with pytest.raises(ValueError, match="signal 18446744073709551616 is not a 64-bit integer"):
        shmemx.aclshmemx_udma_put_signal_nbi(data, data, 1, sig[:1], 1 << 64, nxt)
    with pytest.raises(ValueError, match=f"pe {me}: aclshmemx_udma_put_signal_nbi to pe {nxt} qp 0: sig_addr is not "
                                         f"8-byte aligned"):
        shmemx.aclshmemx_udma_put_signal_nbi(data, data, 1, sig.view(np.uint8)[4:12].view(np.uint64), 1, nxt)
    assert shmemx.aclshmemx_udma_raw_queue(nxt, 0).head == 2  # only the zero-length put_signal above
    shmemx.aclshmemx_udma_qp_quiet(nxt, 1)
    shmemx.aclshmemx_udma_quiet(nxt)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_put_signal_variants(run_ok):
    run_ok(3, _put_signal_api)


# --- ordering within one QP ------------------------------------------------------------------------------------


def _ordering(rounds: int, m: int):
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt, prev = (me + 1) % n, (me - 1) % n
    word = shmemx.zeros(4, np.int64, name="word")
    payload = shmemx.zeros((rounds, m), np.int64, name="payload")
    flag = shmemx.zeros(rounds, np.int64, name="flag")
    shmemx.aclshmem_barrier_all()
    # a later put to the same address wins (500 puts, no quiet in between)
    for k in range(500):
        shmemx.aclshmemx_udma_put_nbi(word[:1], np.array([_stamp(me, nxt, k)]), 1, nxt)
    # a flag put (a plain WRITE, not put_signal) after the payload puts on the same QP is never seen first
    for r in range(rounds):
        for c in range(0, m, m // 8):  # the payload in 8 puts, then the flag
            shmemx.aclshmemx_udma_put_nbi(payload[r, c:c + m // 8], _stamp(me, nxt, np.arange(c, c + m // 8)) + r,
                                          m // 8, nxt)
        shmemx.aclshmemx_udma_put_nbi(flag[r:r + 1], np.array([r + 1], np.int64), 1, nxt)
    for r in range(rounds):
        shmemx.aclshmem_wait_until(flag[r:r + 1], EQ, r + 1)
        np.testing.assert_array_equal(payload[r], _stamp(prev, me, np.arange(m)) + r,
                                      err_msg=f"round {r}: flag from pe {prev} seen before its payload")
    shmemx.aclshmemx_udma_quiet(nxt)
    shmemx.aclshmem_barrier_all()
    assert word[0] == _stamp(prev, me, 499)
    shmemx.finalize()


@pytest.mark.parametrize("n", [2, 4])
def test_ordering_within_one_qp(run_ok, n):
    run_ok(n, _ordering, 20, 8192)


# --- atomics ---------------------------------------------------------------------------------------------------


def _tickets(per_peer: int):
    """Every PE takes ``per_peer`` fetch_add tickets on every other PE's counter; the values each counter handed
    out are exactly 0..total-1, each once."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    counter = shmemx.zeros(2, np.int64, name="counter")
    taken = shmemx.full((n, per_peer), -1, np.int64, name="taken")  # row p: tickets I took on pe p
    shmemx.aclshmem_barrier_all()
    for k in range(per_peer):
        for p in _others(me, n):
            taken[p, k] = shmemx.aclshmemx_udma_atomic_fetch_add(counter[:1], 1, p)
    shmemx.aclshmem_barrier_all()
    total = per_peer * (n - 1)
    assert counter[0] == total and counter[1] == 0
    handed = np.concatenate([shmemx.aclshmem_ptr(taken, q)[me] for q in _others(me, n)])
    np.testing.assert_array_equal(np.sort(handed), np.arange(total), err_msg="tickets lost or duplicated")
    for q in _others(me, n):  # each PE saw its own tickets increase
        assert (np.diff(shmemx.aclshmem_ptr(taken, q)[me]) > 0).all()
    shmemx.finalize()


@pytest.mark.parametrize("n", MULTI_PES)
def test_fetch_add_tickets_unique_and_complete(run_ok, n):
    run_ok(n, _tickets, 40 if n < 8 else 15)


def _cas_race(rounds: int):
    """Round r: every PE but the target CASes the target's word r from 0 to its own id; exactly one wins."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    words = shmemx.zeros(rounds, np.int32, name="words")
    won = shmemx.zeros(rounds, np.int32, name="won")
    shmemx.aclshmem_barrier_all()
    for r in range(rounds):
        target = r % n
        if target != me:
            old = shmemx.aclshmemx_udma_atomic_compare_swap(words[r:r + 1], 0, me + 100, target)
            won[r] = old == 0
            assert old == 0 or old - 100 in range(n), old
    shmemx.aclshmem_barrier_all()
    winners = sum(shmemx.aclshmem_ptr(won, q) for q in range(n))
    assert (winners == 1).all(), winners
    for r in range(rounds):
        if r % n == me:
            winner = [q for q in range(n) if shmemx.aclshmem_ptr(won, q)[r]]
            assert words[r] == winner[0] + 100
    shmemx.finalize()


@pytest.mark.parametrize("n", [3, 8])
def test_cas_race_has_exactly_one_winner(run_ok, n):
    run_ok(n, _cas_race, 24)


ATOMIC_DTYPES = [np.int32, np.uint32, np.int64, np.uint64]


def _atomic_variants():
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    for dtype in ATOMIC_DTYPES:
        info = np.iinfo(dtype)
        w = shmemx.zeros(2, dtype, name=f"w_{np.dtype(dtype).name}")
        w[1] = info.max  # the neighbour word must never change
        hi = int(info.max) - 7  # values near the top of the range: sign and width bugs show
        shmemx.aclshmem_barrier_all()
        f = lambda name, *args: getattr(shmemx, f"aclshmemx_udma_atomic_{name}")(w[:1], *args, nxt)  # noqa: E731
        f("set", hi)
        assert f("fetch") == hi
        assert f("swap", 5) == hi
        assert f("compare_swap", 4, 9) == 5  # fails: 5 != 4
        assert f("compare_swap", 5, 12) == 5  # wins
        assert f("fetch_inc") == 12
        f("inc")
        f("add", 3)
        assert f("fetch_add", 0) == 17
        assert f("fetch_and", 0b10101) == 17 and f("fetch") == 0b10001
        assert f("fetch_or", 0b01100) == 0b10001 and f("fetch") == 0b11101
        assert f("fetch_xor", 0b00111) == 0b11101 and f("fetch") == 0b11010
        f("and", 0b01011)
        f("or", 0b100000)
        f("xor", 0b1)
        assert f("fetch") == 0b101011
        v = f("fetch_add", 1)
        assert type(v) is int
        if info.min < 0:
            f("set", -3)
            assert f("fetch_add", -4) == -3 and f("fetch") == -7
            assert f("swap", info.min) == -7 and f("fetch") == info.min
        else:
            f("set", info.max)
            assert f("fetch_inc") == info.max and f("fetch") == 0  # wraps like the hardware
        shmemx.aclshmemx_udma_quiet(nxt)
        shmemx.aclshmem_barrier_all()
        assert w[1] == info.max, f"{np.dtype(dtype).name}: the word after the target changed"
        with pytest.raises(ValueError, match=f"value {int(info.max) + 1} does not fit dst dtype"):
            shmemx.aclshmemx_udma_atomic_add(w[:1], int(info.max) + 1, nxt)
    with pytest.raises(TypeError, match="dst dtype float64 not supported"):
        shmemx.aclshmemx_udma_atomic_add(shmemx.zeros(1, np.float64, name="f64"), 1.0, nxt)
    with pytest.raises(TypeError, match="dst dtype float32 not supported"):
        shmemx.aclshmemx_udma_atomic_fetch_add(shmemx.zeros(1, np.float32, name="f32"), 1.0, nxt)
    with pytest.raises(ValueError, match=f"pe {me}: aclshmemx_udma_atomic_fetch_add to itself"):
        shmemx.aclshmemx_udma_atomic_fetch_add(shmemx.zeros(1, np.int64, name="i64"), 1, me)
    shmemx.finalize()


def test_atomic_variants_every_dtype(run_ok):
    run_ok(2, _atomic_variants)


def _concurrent_bitwise_and_float_add(adds: int):
    """Every PE ORs its bit into, XORs a pattern into and adds floats to every other PE's words at once: the CAS
    loops and the fp32 reduce must be atomic under contention."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    bits = shmemx.zeros(1, np.uint64, name="bits")
    flips = shmemx.zeros(1, np.uint32, name="flips")
    total = shmemx.zeros(2, np.float32, name="total")
    shmemx.aclshmem_barrier_all()
    for p in _others(me, n):
        shmemx.aclshmemx_udma_atomic_or(bits, 1 << (me + 50), p)
        assert shmemx.aclshmemx_udma_atomic_fetch_xor(flips, 0xF0F0 << me, p) is not None
        for k in range(adds):
            shmemx.aclshmemx_udma_atomic_add(total[:1], 0.25 * (me + 1), p)
    shmemx.aclshmem_barrier_all()
    expect_bits = sum(1 << (q + 50) for q in _others(me, n))
    expect_flips = 0
    for q in _others(me, n):
        expect_flips ^= 0xF0F0 << q
    assert int(bits[0]) == expect_bits and int(flips[0]) == expect_flips & 0xFFFF_FFFF
    assert total[0] == np.float32(sum(0.25 * (q + 1) * adds for q in _others(me, n))) and total[1] == 0
    shmemx.finalize()


@pytest.mark.parametrize("n", [4])
def test_atomics_under_contention(run_ok, n):
    run_ok(n, _concurrent_bitwise_and_float_add, 20)


# --- rings: wrap-around and credits ------------------------------------------------------------------------------


def _two_block_wrap():
    """A WRITE_WITH_NOTIFY posted at the last slot of a 16-deep SQ: its first BB is ring slot 15, its second BB
    ring slot 0 (byte k >= 64 of the WQE at ring byte k - 64), and it executes like any other."""
    shmemx.init(sq_depth=16)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt, prev = (me + 1) % n, (me - 1) % n
    src = shmemx.full(32, me + 1, np.int32, name="src")
    dst = shmemx.zeros((20, 32), np.int32, name="dst")
    sig = shmemx.zeros(2, np.uint64, name="sig")
    shmemx.aclshmem_barrier_all()
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    assert q.depth == 16 and q.wq_ctx["depth"] == 16
    for k in range(15):  # head 0 -> 15 (posting drains the CQ whenever the credit guard would be hit)
        shmemx.aclshmemx_udma_put_nbi(dst[k], src, 32, nxt)
    assert q.head == 15
    shmemx.aclshmemx_udma_put_signal_nbi(dst[15], src, 32, sig[1:], 0xABCD_0000 + me, nxt)
    assert q.head == 17 and q.wq_ctx["head"] == 17
    expected = q.build(Opcode.WRITE_WITH_NOTIFY, 0x20, q.remote_va(dst[15]), sge_len=128, sge_va=q.local_va(src),
                       notify_tid=int(q.remote_mem_info["tid"]), notify_token=int(q.remote_mem_info["rmt_token_value"]),
                       notify_va=q.remote_va(sig[1:]), notify_value=0xABCD_0000 + me)
    assert bytes(q.sq[15]) == expected[:64] and bytes(q.sq[0]) == expected[64:]
    w = decode_wqe(bytes(q.sq[15]) + bytes(q.sq[0]))
    assert (w.opcode, w.notify_value, w.sge_len, w.rmt_va) == (Opcode.WRITE_WITH_NOTIFY, 0xABCD_0000 + me, 128,
                                                               q.remote_va(dst[15]))
    shmemx.aclshmemx_udma_put_nbi(dst[16], src, 32, nxt)  # the next WQE goes to slot 1
    assert bytes(q.sq[1])[5] == Opcode.WRITE
    shmemx.aclshmem_signal_wait_until(sig[1:], EQ, 0xABCD_0000 + prev)
    shmemx.aclshmemx_udma_quiet(nxt)
    shmemx.aclshmem_barrier_all()
    assert (dst[:17] == prev + 1).all() and not dst[17:].any()
    # the CQ wrapped too: the owner bit of lap 1 is 0
    assert q.cqe_cnt == 17 and q.cq_ctx["tail"] == 17
    assert (q.cq.view(np.uint32)[0, 0] >> 2) & 1 == 0 and (q.cq.view(np.uint32)[1, 0] >> 2) & 1 == 1
    shmemx.finalize()


def test_two_block_wqe_wraps_to_ring_start(run_ok):
    run_ok(2, _two_block_wrap)


def _many_puts(total: int, every_cqe: int):
    """``total`` puts through an SQ of depth 64 to the next PE, each of one origin-encoded int64 from its own
    source element into its own destination element; only every ``every_cqe``-th asks for a CQE."""
    shmemx.init(sq_depth=64)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt, prev = (me + 1) % n, (me - 1) % n
    src = shmemx.array(_stamp(me, nxt, np.arange(total)), name="src")
    dst = shmemx.zeros(total, np.int64, name="dst")
    shmemx.aclshmem_barrier_all()
    silent = shmemx.ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE
    for i in range(total):
        config = shmemx.ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT if (i + 1) % every_cqe == 0 else silent
        shmemx.aclshmemx_udma_qp_put_nbi(dst[i:i + 1], src[i:i + 1], 1, nxt, 0, config=config)
    shmemx.aclshmemx_udma_put_nbi(dst[:0], src[:1], 0, nxt)  # zero length: posts nothing
    shmemx.aclshmemx_udma_put_nbi(dst[:1], src[:1], 1, nxt)  # a last CQE covers the silent tail
    shmemx.aclshmemx_udma_quiet(nxt)
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    assert q.head == total + 1 and q.wq_ctx["tail"] == total + 1
    shmemx.aclshmem_barrier_all()
    bad = np.flatnonzero(dst != _stamp(prev, me, np.arange(total)))
    assert not len(bad), f"{len(bad)} slots lost or overwritten, first {bad[:5]}: {dst[bad[:5]]}"
    shmemx.finalize()


@pytest.mark.parametrize("n, every_cqe", [(2, 1), (4, 7)])
def test_10000_puts_through_a_64_deep_sq(run_ok, n, every_cqe):
    run_ok(n, _many_puts, 10_000, every_cqe)


def _silent_overflow():
    """Only CQE-less WQEs: the ring cannot be reclaimed, so the post that would overrun it is refused."""
    shmemx.init(sq_depth=16)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.zeros(16, np.int64, name="dst")
    src = np.arange(16, dtype=np.int64)
    for i in range(5):
        shmemx.aclshmemx_udma_put_nbi(dst[i:i + 1], src[i:i + 1], 1, nxt, config=shmemx.ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE)
    with pytest.raises(shmemx.ShmemError, match=f"pe {me}: aclshmemx_udma_put_nbi to pe {nxt} qp 0: send queue full"):
        shmemx.aclshmemx_udma_put_nbi(dst[5:6], src[5:6], 1, nxt, config=shmemx.ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE)
    # a CQE-producing post does not fit either (5 + 1 + 10 = 16): the QP is stuck, as on the hardware, and says so
    with pytest.raises(shmemx.ShmemError, match="post a CQE-producing WQE .config cqe=1. at least every 6 BBs"):
        shmemx.aclshmemx_udma_put_nbi(dst[5:6], src[5:6], 1, nxt)
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    assert q.head == 5 and q.cqe_cnt == 0
    shmemx.aclshmem_wait_until(dst[4:5], EQ, 4)  # the silent ones do execute (in order): nothing completes them
    assert (dst[:5] == np.arange(5)).all() and not dst[5:].any()
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_sq_full_of_cqe_less_wqes_refuses_the_next_post(run_ok):
    run_ok(2, _silent_overflow)


# --- access control and error CQEs ------------------------------------------------------------------------------

MIB = 1 << 20
# case -> (field overrides of a good 64-byte WRITE of 64 bytes, expected status). ``base`` is the good WQE's fields.
BAD_WQES = {
    "wrong token": (lambda b: {"rmt_token_value": b["rmt_token_value"] ^ 0x8000_0000}, CqeStatus.TOKEN_MISMATCH),
    "wrong tokenId": (lambda b: {"rmt_seg_id": b["rmt_seg_id"] ^ 0x40}, CqeStatus.BAD_TOKEN_ID),
    "wrong EID": (lambda b: {"rmt_eid": b["rmt_eid"] ^ (1 << 100)}, CqeStatus.BAD_EID),
    "EID of no PE": (lambda b: {"rmt_eid": b["rmt_eid"] | 0xFFFF}, CqeStatus.BAD_EID),
    "wrong TP": (lambda b: {"tp_id": (b["tp_id"] + 0x10_0000) & 0xFFFFFF}, CqeStatus.BAD_TP),
    "TP of another peer": (lambda b: {"tp_id": b["other_tp"]}, CqeStatus.BAD_TP),
    "out of segment": (lambda b: {"rmt_va": b["heap_end"] - 32}, CqeStatus.REMOTE_OUT_OF_BOUNDS),
    "before the segment": (lambda b: {"rmt_va": b["heap_end"] - 2 * b["heap_size"]}, CqeStatus.REMOTE_OUT_OF_BOUNDS),
    "length > 256 MiB": (lambda b: {"sge_len": 256 * MIB + 64}, CqeStatus.LENGTH_TOO_LARGE),
    "bad local VA": (lambda b: {"sge_va": 0x1234_5000}, CqeStatus.LOCAL_ACCESS),
    "bad opcode": (lambda b: {"opcode": Opcode.SEND}, CqeStatus.BAD_OPCODE),
}


def _good_write_fields(q, dst_row, src) -> dict:
    """The fields of a correct WRITE of ``src`` (64 bytes) to ``dst_row`` on q's peer, from the raw tables."""
    rmi = q.remote_mem_info
    eid_lo, eid_hi = (int(x) for x in rmi["eid"])
    return dict(opcode=Opcode.WRITE, flag=0x20, tp_id=int(rmi["tpn"]), rmt_seg_id=int(rmi["tid"]),
                rmt_eid=eid_hi << 64 | eid_lo, rmt_token_value=int(rmi["rmt_token_value"]),
                rmt_va=q.remote_va(dst_row), sge_len=64, sge_va=q.local_va(src))


def _post_raw(q, wqe: bytes, cqes: int = 1) -> int:
    bbs = len(wqe) // 64
    head = q.reserve(bbs)
    q.ring_doorbell(q.write(head, wqe), cqes=cqes)
    return head


def _bad_wqes(cases: list[str]):
    from shmemx.layout import pack_wqe

    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.full((n, 8), -1, np.int64, name="dst")  # row p: written by pe p only
    src = shmemx.array(_stamp(me, nxt, np.arange(8)), name="src")
    shmemx.aclshmem_barrier_all()
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    peer_dst = shmemx.aclshmem_ptr(dst, nxt)[me]
    rmi = q.remote_mem_info
    base = _good_write_fields(q, dst[me], src)
    other = shmemx.aclshmemx_udma_raw_queue((me + 2) % n, 0) if n > 2 else None
    extra = {"heap_size": int(rmi["len"]), "heap_end": int(rmi["addr"]) + int(rmi["len"]),
             "other_tp": int(other.remote_mem_info["tpn"]) if other else base["tp_id"] ^ 1}
    for case in cases:
        change, status = BAD_WQES[case]
        fields = dict(base, **change(dict(base, **extra)))
        wqe = pack_wqe(**fields)
        head = _post_raw(q, wqe)
        with pytest.raises(shmemx.CompletionError) as info:
            shmemx.aclshmemx_udma_quiet(nxt)
        err = info.value
        assert err.cqe is not None and err.cqe.status == status, (case, err)
        assert err.cqe.user_data == head and err.cqe.entry_idx == (head + 1) & 0xFFFF and err.cqe.byte_cnt == 0
        assert err.wqe == decode_wqe(wqe), case
        assert (err.pe, err.peer, err.qp_idx) == (me, nxt, 0)
        first = str(err).splitlines()[0]
        assert first.startswith(f"pe {me}: raw post to pe {nxt} qp 0 (block 0, WQE at BB {head}): {status.name}: "), \
            first
        assert "  CQE: " in str(err) and "  WQE: " in str(err)
        assert (peer_dst == -1).all(), f"{case}: target bytes changed"
        # the QP is usable again
        shmemx.aclshmemx_udma_put_nbi(dst[me], src, 8, nxt)
        shmemx.aclshmemx_udma_quiet(nxt)
        np.testing.assert_array_equal(peer_dst, src)
        peer_dst[:] = -1
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


@pytest.mark.parametrize("n", [2, 3])
def test_bad_wqes_get_error_cqes_and_leave_the_target_unchanged(run_ok, n):
    run_ok(n, _bad_wqes, list(BAD_WQES))


def _error_messages():
    """The detail each status carries names what is wrong (and where)."""
    from shmemx.layout import pack_wqe

    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.zeros((n, 8), np.int64, name="dst")
    src = shmemx.zeros(8, np.int64, name="src")
    shmemx.aclshmem_barrier_all()
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    base = _good_write_fields(q, dst[me], src)
    rmi = q.remote_mem_info
    end = int(rmi["addr"]) + int(rmi["len"])
    expect = [
        ({"rmt_token_value": 7},
         rf"token value 0x00000007 does not match segment tid {int(rmi['tid']):#x} of pe {nxt}"),
        ({"rmt_va": end - 8}, rf"remote range {end - 8:#x}..{end + 56:#x} outside segment tid {int(rmi['tid']):#x} "
                              rf"of pe {nxt}"),
        ({"sge_va": 0x1234_5000}, rf"local range 0x12345000..0x12345040 is not registered memory of pe {me}"),
        ({"sge_len": 256 * MIB + 1}, r"length 268435457 B is over the 256 MiB limit"),
    ]
    for change, pattern in expect:
        _post_raw(q, pack_wqe(**dict(base, **change)))
        with pytest.raises(shmemx.CompletionError, match=pattern):
            shmemx.aclshmemx_udma_quiet(nxt)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_error_details_name_the_range_and_segment(run_ok):
    run_ok(2, _error_messages)


def _bad_wqe_in_a_vector_run(bad_at: int, count: int):
    """16 WRITEs rung at once (the engine's vectorised path): the ones before the bad WQE execute, the bad one
    fails, the ones after it are flushed (FLUSHED, not executed); the quiet reports the first failure."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.full((n, count, 8), -1, np.int64, name="dst")
    src = shmemx.array(_stamp(me, nxt, np.arange(count * 8)).reshape(count, 8), name="src")
    shmemx.aclshmem_barrier_all()
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    rows = q.build_writes(rmt_va=q.remote_va(dst[me]) + 64 * np.arange(count, dtype=np.uint64), sge_len=64,
                          sge_va=q.local_va(src) + 64 * np.arange(count, dtype=np.uint64))
    rows[bad_at, 4] ^= 0x1  # the token value word (bytes 32-35)
    head = q.reserve(count)
    q.ring_doorbell(q.write(head, rows), cqes=count)
    with pytest.raises(shmemx.CompletionError) as info:
        shmemx.aclshmemx_udma_quiet(nxt)
    assert info.value.cqe.status == CqeStatus.TOKEN_MISMATCH and info.value.cqe.user_data == head + bad_at
    statuses = (q.cq.view(np.uint32)[np.arange(head, head + count) % q.depth, 0] >> 24).tolist()
    assert statuses == [0] * bad_at + [CqeStatus.TOKEN_MISMATCH] + [CqeStatus.FLUSHED] * (count - bad_at - 1)
    peer = shmemx.aclshmem_ptr(dst, nxt)[me]
    np.testing.assert_array_equal(peer[:bad_at], src[:bad_at])
    assert (peer[bad_at:] == -1).all()
    shmemx.aclshmemx_udma_put_nbi(dst[me, -1], src[-1], 8, nxt)
    shmemx.aclshmemx_udma_quiet(nxt)
    np.testing.assert_array_equal(peer[-1], src[-1])
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


@pytest.mark.parametrize("bad_at", [0, 5, 15])
def test_bad_wqe_inside_a_vectorised_run(run_ok, bad_at):
    run_ok(2, _bad_wqe_in_a_vector_run, bad_at, 16)


def _bad_notify_and_atomic():
    """Two-BB WQEs are checked too: a put_signal whose signal token is wrong writes neither payload nor signal;
    an FAA to a misaligned word fails with BAD_ATOMIC."""
    from shmemx.layout import pack_wqe

    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.full((n, 8), -1, np.int64, name="dst")
    sig = shmemx.zeros(n, np.uint64, name="sig")
    src = shmemx.array(_stamp(me, nxt, np.arange(8)), name="src")
    shmemx.aclshmem_barrier_all()
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    base = _good_write_fields(q, dst[me], src)
    rmi = q.remote_mem_info
    notify = dict(base, opcode=Opcode.WRITE_WITH_NOTIFY, notify_tid=int(rmi["tid"]),
                  notify_token=int(rmi["rmt_token_value"]) ^ 4, notify_va=q.remote_va(sig[me:me + 1]), notify_value=9)
    _post_raw(q, pack_wqe(**notify))
    with pytest.raises(shmemx.CompletionError, match="TOKEN_MISMATCH: signal token value") as info:
        shmemx.aclshmemx_udma_quiet(nxt)
    assert info.value.wqe.notify_value == 9
    faa = dict(base, opcode=Opcode.FAA, rmt_va=q.remote_va(dst[me]) + 4, sge_len=8,
               sge_va=int(q.wq_ctx["amo_addr"]), operand=1)
    _post_raw(q, pack_wqe(**faa))
    with pytest.raises(shmemx.CompletionError, match="BAD_ATOMIC: atomic of 8 B"):
        shmemx.aclshmemx_udma_quiet(nxt)
    assert (shmemx.aclshmem_ptr(dst, nxt)[me] == -1).all() and shmemx.aclshmem_ptr(sig, nxt)[me] == 0
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_bad_two_block_wqes(run_ok):
    run_ok(2, _bad_notify_and_atomic)


def _bad_wqe_without_cqe(where: str):
    """A failing WQE that asked for no CQE: a later WQE's FLUSHED CQE (or, with none, the queue's own record)
    reports it, under the failing WQE's status; the flushed WQE did not run either."""
    from shmemx.layout import pack_wqe

    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.full((n, 2, 8), -1, np.int64, name="dst")
    src = shmemx.zeros(8, np.int64, name="src")
    shmemx.aclshmem_barrier_all()
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    bad = pack_wqe(**dict(_good_write_fields(q, dst[me, 0], src), flag=0x00, rmt_token_value=0x1234))
    good = pack_wqe(**_good_write_fields(q, dst[me, 1], src))
    if where == "quiet":
        head = _post_raw(q, bad + good)
        with pytest.raises(shmemx.CompletionError) as info:
            shmemx.aclshmemx_udma_quiet(nxt)
        err = info.value
        assert err.cqe.status == CqeStatus.FLUSHED and err.cqe.user_data == head + 1
        assert f"CQE of the WQE at BB {head + 1} (the failing WQE asked for none): FLUSHED" in str(err)
    else:
        head = _post_raw(q, bad, cqes=0)
        _wait_for(lambda: runtime().udma.qp(nxt, 0).error is not None, "the failure")
        with pytest.raises(shmemx.CompletionError) as info:
            shmemx.aclshmem_barrier_all()
        err = info.value
        assert err.cqe is None and "CQE" not in str(err)
    assert str(err).startswith(f"pe {me}: raw post to pe {nxt} qp 0 (block 0, WQE at BB {head}): TOKEN_MISMATCH: "
                               f"remote token value 0x00001234 does not match")
    assert err.wqe == decode_wqe(bad)
    assert (shmemx.aclshmem_ptr(dst, nxt)[me] == -1).all()
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


@pytest.mark.parametrize("where", ["quiet", "barrier"])
def test_failing_wqe_without_cqe_is_reported_under_its_status(run_ok, where):
    run_ok(2, _bad_wqe_without_cqe, where)


def _cqe_written(q, pos: int) -> bool:
    """Whether the engine wrote the CQE of CQ position ``pos`` (its owner bit is the lap's)."""
    owner = int(q.cq.view(np.uint32)[pos % q.depth, 0]) >> 2 & 1
    return owner == ((pos // q.depth) & 1) ^ 1


def _error_at_barrier(where: str):
    """Nobody quiets a failed WQE: the next barrier (or finalize) raises it, with the CQE and the WQE."""
    from shmemx.layout import pack_wqe

    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.full((n, 8), -1, np.int64, name="dst")
    src = shmemx.zeros(8, np.int64, name="src")
    shmemx.aclshmem_barrier_all()
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    wqe = pack_wqe(**dict(_good_write_fields(q, dst[me], src), rmt_token_value=0))
    head = _post_raw(q, wqe)
    if where == "finalize":  # at once: finalize must not lose a failure the engine has not reached yet
        with pytest.raises(shmemx.CompletionError) as info:
            shmemx.finalize()
    else:
        _wait_for(lambda: _cqe_written(q, 0), "the error CQE")
        with pytest.raises(shmemx.CompletionError) as info:
            getattr(shmemx, where)()
    err = info.value
    assert err.cqe is not None and err.cqe.status == CqeStatus.TOKEN_MISMATCH and err.cqe.user_data == head
    assert err.wqe == decode_wqe(wqe) and (err.pe, err.peer, err.qp_idx) == (me, nxt, 0)
    assert str(err).startswith(f"pe {me}: raw post to pe {nxt} qp 0 (block 0, WQE at BB {head}): TOKEN_MISMATCH")
    if where == "finalize":
        assert not shmemx.is_initialized()
        return
    shmemx.aclshmemx_udma_quiet(nxt)  # reported once: the queue is clean and usable again
    shmemx.aclshmemx_udma_put_nbi(dst[me], src, 8, nxt)
    shmemx.aclshmemx_udma_quiet(nxt)
    shmemx.aclshmem_barrier_all()
    assert (dst[(me - 1) % n] == 0).all()
    shmemx.finalize()


@pytest.mark.parametrize("where", ["aclshmem_barrier_all", "aclshmem_sync_all", "finalize"])
def test_unquieted_error_surfaces_at_barrier_or_finalize(run_ok, where):
    run_ok(3, _error_at_barrier, where)


def _error_at_barrier_all_vec():
    from shmemx.layout import pack_wqe

    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.zeros((n, 8), np.int64, name="dst")
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    _post_raw(q, pack_wqe(**dict(_good_write_fields(q, dst[me], dst[me]), sge_va=64)))
    _wait_for(lambda: _cqe_written(q, 0), "the error CQE")

    def kernel():
        shmemx.aclshmemx_barrier_all_vec()

    with pytest.raises(shmemx.CompletionError, match="LOCAL_ACCESS") as info:
        shmemx.launch(kernel, 2)
    assert info.value.cqe.status == CqeStatus.LOCAL_ACCESS
    shmemx.launch(kernel, 2)
    shmemx.finalize()


def test_unquieted_error_surfaces_at_barrier_all_vec(run_ok):
    run_ok(2, _error_at_barrier_all_vec)


def _engine_fault():
    """A fault inside the engine becomes an ENGINE_FAULT CQE; the engine lives on and the next WQE runs (the
    native engine's fault hook, ``Engine.inject_fault``, stands for a bug)."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.zeros((n, 8), np.int64, name="dst")
    src = shmemx.array(np.arange(8), name="src")
    runtime().udma.engine.inject_fault(1)
    shmemx.aclshmemx_udma_put_nbi(dst[me], src, 8, nxt)
    with pytest.raises(shmemx.CompletionError, match="ENGINE_FAULT: unexpected fault in the DMA engine") as info:
        shmemx.aclshmemx_udma_quiet(nxt)
    assert info.value.cqe.status == CqeStatus.ENGINE_FAULT and "injected" in str(info.value)
    shmemx.aclshmemx_udma_put_nbi(dst[me], src, 8, nxt)
    shmemx.aclshmemx_udma_quiet(nxt)
    shmemx.aclshmem_barrier_all()
    assert (dst[(me - 1) % n] == np.arange(8)).all()
    shmemx.finalize()


def test_engine_exception_becomes_an_error_cqe(run_ok):
    run_ok(2, _engine_fault)


def _engine_fault_in_a_vector_run():
    """The same inside a run of 16 WRITEs rung at once: an ENGINE_FAULT CQE for the first, FLUSHED for the rest,
    not a dead engine; the QP works afterwards."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.zeros((n, 16, 8), np.int64, name="dst")
    src = shmemx.array(_stamp(me, nxt, np.arange(128)).reshape(16, 8), name="src")
    runtime().udma.engine.inject_fault(1)
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    step = np.arange(16, dtype=np.uint64) * np.uint64(64)
    head = q.reserve(16)
    q.ring_doorbell(q.write(head, q.build_writes(rmt_va=q.remote_va(dst[me]) + step, sge_len=64,
                                                 sge_va=q.local_va(src) + step)), cqes=16)
    with pytest.raises(shmemx.CompletionError, match="ENGINE_FAULT: unexpected fault in the DMA engine") as info:
        q.poll()
    assert "injected" in str(info.value)
    assert info.value.cqe.user_data == head
    shmemx.aclshmemx_udma_put_nbi(dst[me, 0], src[0], 8, nxt)
    shmemx.aclshmemx_udma_quiet(nxt)
    shmemx.aclshmem_barrier_all()
    np.testing.assert_array_equal(dst[(me - 1) % n, 0], _stamp((me - 1) % n, me, np.arange(8)))
    shmemx.finalize()


def test_engine_exception_in_the_vector_path_becomes_an_error_cqe(run_ok):
    run_ok(2, _engine_fault_in_a_vector_run)


def _vector_run_through_another_tp():
    """A run of WRITEs on QP 0 that carry QP 1's TP to the same peer (valid: any TP of the target PE) is executed,
    with the same data and CQEs."""
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 2)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.zeros((n, 16, 8), np.int64, name="dst")
    src = shmemx.array(_stamp(me, nxt, np.arange(128)).reshape(16, 8), name="src")
    q, other = shmemx.aclshmemx_udma_raw_queue(nxt, 0), shmemx.aclshmemx_udma_raw_queue(nxt, 1)
    wqes = q.build_writes(rmt_va=q.remote_va(dst[me]) + np.arange(16, dtype=np.uint64) * np.uint64(64),
                          sge_len=64, sge_va=q.local_va(src) + np.arange(16, dtype=np.uint64) * np.uint64(64))
    words = wqes.view(np.uint32)
    words[:, 2] = words[:, 2] & 0xFF00_0000 | other._qp.tpn  # QP 1's TP, sge_num kept
    head = q.reserve(16)
    q.ring_doorbell(q.write(head, wqes), cqes=16)
    q.poll()
    statuses = q.cq.view(np.uint32)[np.arange(head, head + 16) % q.depth, 0] >> 24
    assert not statuses.any()
    shmemx.aclshmem_barrier_all()
    np.testing.assert_array_equal(dst[(me - 1) % n].reshape(-1), _stamp((me - 1) % n, me, np.arange(128)))
    shmemx.finalize()


def test_a_vector_run_through_another_tp_of_the_peer_is_executed(run_ok):
    run_ok(2, _vector_run_through_another_tp)


# --- bad input is rejected before anything is posted -----------------------------------------------------------


def _bad_input(fast: bool):
    from shmemx.api import rma

    rma._FAST = fast  # False: every call runs through the named checks (api.checks), not the inline conditions
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 2)
    shmemx.init(heap_size="300M")
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.zeros(64, np.int32, name="dst")
    big = shmemx.empty(257 << 20, np.uint8, name="big", prefault=False)  # sparse: never touched
    gone = shmemx.zeros(8, np.int32, name="gone")
    shmemx.aclshmem_free(gone)
    src = np.arange(64, dtype=np.int32)
    put, get = shmemx.aclshmemx_udma_qp_put_nbi, shmemx.aclshmemx_udma_qp_get_nbi
    P, G = "aclshmemx_udma_qp_put_nbi", "aclshmemx_udma_qp_get_nbi"
    cases = [
        (lambda: put(dst, src, 4, n, 1), ValueError, f"{P} to pe {n} qp 1: pe {n} out of range 0..{n - 1}"),
        (lambda: put(dst, src, 4, -1, 0), ValueError, f"{P} to pe -1 qp 0: pe -1 out of range"),
        (lambda: put(dst, src, 4, nxt, 2), ValueError, f"{P} to pe {nxt}: qp_idx 2 out of range 0..1 .qp_num is 2"),
        (lambda: put(dst, src, 4, me, 1), ValueError, f"{P} to itself .pe {me} qp 1.: UDMA to the own PE"),
        (lambda: put(src, src, 4, nxt, 1), ValueError, f"{P} to pe {nxt} qp 1: dst must be a heap array"),
        (lambda: get(src, src, 4, nxt, 1), ValueError, f"{G} to pe {nxt} qp 1: src must be a heap array"),
        (lambda: put(gone, src, 4, nxt, 1), ValueError,
         rf"{P} to pe {nxt} qp 1: dst must be a heap array .*: dst \(pe {me} heap 0x[0-9a-f]+\.\.0x[0-9a-f]+\) is not "
         rf"inside a live heap allocation"),
        (lambda: put(big, np.empty(257 << 20, np.uint8), 257 << 20, nxt, 1), ValueError,
         f"{P} to pe {nxt} qp 1: 269484032 B is over the 256 MiB limit of one UDMA request"),
        (lambda: put(dst, src.astype(np.int64), 4, nxt, 1), TypeError,
         rf"{P} to pe {nxt} qp 1: dtype mismatch \(dst int32, src int64\)"),
        (lambda: put(dst[::2], src, 4, nxt, 1), ValueError, f"{P} to pe {nxt} qp 1: dst must be C-contiguous"),
        (lambda: get(src[::2], dst, 4, nxt, 1), ValueError, f"{G} to pe {nxt} qp 1: dst must be C-contiguous"),
        (lambda: put(dst, src, 65, nxt, 1), ValueError, f"{P} to pe {nxt} qp 1: nelems 65 but dst has only 64"),
        (lambda: put(dst, src, -1, nxt, 1), ValueError, f"{P} to pe {nxt} qp 1: nelems must be a non-negative"),
        (lambda: put(dst, [1, 2], 2, nxt, 1), TypeError, f"{P} to pe {nxt} qp 1: src must be a numpy array"),
        (lambda: put(dst, shmemx.aclshmem_ptr(dst, nxt), 4, nxt, 1), ValueError,
         f"{P} to pe {nxt} qp 1 local array is pe {nxt}'s heap memory; it must be local"),
        (lambda: get(np.frombuffer(bytes(256), np.int32), dst, 4, nxt, 1), ValueError,
         f"{G} to pe {nxt} qp 1 local array is read-only"),
        (lambda: get(frozen[4:], dst, 4, nxt, 1), ValueError,  # registered by a put just before: still refused
         f"{G} to pe {nxt} qp 1 local array is read-only"),
        (lambda: put(dst, src, 4, nxt, 1, config=0x20), TypeError, f"{P}: config must be an OpConfig"),
        (lambda: shmemx.aclshmemx_udma_qp_quiet(nxt, 5), ValueError, f"aclshmemx_udma_qp_quiet to pe {nxt}: qp_idx 5"),
        (lambda: shmemx.aclshmemx_udma_quiet(me), ValueError, "aclshmemx_udma_quiet to itself"),
    ]
    frozen = np.frombuffer(np.arange(64, dtype=np.int32).tobytes(), np.int32)
    shmemx.aclshmemx_udma_qp_put_nbi(dst, frozen, 4, nxt, 0)  # a read-only array is a fine put source
    shmemx.aclshmemx_udma_qp_quiet(nxt, 0)
    queues = [shmemx.aclshmemx_udma_raw_queue(p, q) for p in range(n) if p != me for q in range(2)]
    before = [(q.head, q.cqe_cnt) for q in queues]
    for call, kind, pattern in cases:
        with pytest.raises(kind, match=f"^pe {me}: {pattern}"):
            call()
        assert [(q.head, q.cqe_cnt) for q in queues] == before, f"posted despite {pattern!r}"
    shmemx.aclshmem_barrier_all()
    del big
    shmemx.finalize()


@pytest.mark.parametrize("fast", [True, False], ids=["inline checks", "named checks"])
def test_bad_input_is_rejected_before_posting(run_ok, fast):
    """The same refusals, with the same messages, whether a call's inline sufficient conditions run or not."""
    run_ok(2, _bad_input, fast)


def _inline_and_named_checks_post_the_same():
    """Valid calls of every shape post the same WQE bytes whether the inline conditions or the named checks run."""
    from shmemx.api import rma

    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 2)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.zeros(64, np.int32, name="dst")
    src = shmemx.full(64, me, np.int32, name="src")
    sig = shmemx.zeros(2, np.uint64, name="sig")
    local = np.arange(64, dtype=np.int32)
    shmemx.aclshmem_barrier_all()
    calls = [
        lambda: shmemx.aclshmemx_udma_qp_put_nbi(dst, src, 8, nxt, 1),
        lambda: shmemx.aclshmemx_udma_qp_put_nbi(dst[8:], local[4:], 4, np.int64(nxt), np.int32(1)),
        lambda: shmemx.aclshmemx_udma_qp_put_nbi(shmemx.aclshmem_ptr(dst, nxt)[16:], local, 0, nxt, 1),
        lambda: shmemx.aclshmemx_udma_qp_put_nbi(shmemx.aclshmem_ptr(dst, nxt)[16:], local, 3, nxt, 1),
        lambda: shmemx.aclshmemx_udma_qp_get_nbi(local[32:], dst[32:], 16, nxt, 1),
        lambda: shmemx.aclshmemx_udma_qp_put_nbi(dst, src, np.int64(2), nxt, 1,
                                                 config=shmemx.ACLSHMEMX_UDMA_OP_CONFIG_SO),
        lambda: shmemx.aclshmemx_udma_qp_put_signal_nbi(dst, local, 4, sig[1:], 7, nxt, 1),
        lambda: shmemx.aclshmemx_udma_qp_put_signal_nbi(dst, src, 0, sig[:1], np.uint64(1 << 63), nxt, 1),
    ]
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 1)
    runtime().udma.engine.pause()  # keeps the registrations of the local arrays (and so their VAs) alive
    rings = []
    for fast in (True, False):
        rma._FAST = fast
        start = q.head
        for call in calls:
            call()
        rings.append(bytes(q.sq[start:q.head]))
    rma._FAST = True
    runtime().udma.engine.resume()
    shmemx.aclshmemx_udma_qp_quiet(nxt, 1)
    assert len(rings[0]) == 64 * 9  # the zero-length put posts nothing
    assert rings[0] == rings[1]
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_inline_and_named_checks_post_the_same(run_ok):
    run_ok(2, _inline_and_named_checks_post_the_same)


def test_data_address_matches_array_interface():
    """The posting path reads an array's data pointer from the ndarray struct: it must agree with numpy."""
    from shmemx.shm.heap import data_address

    base = np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8)
    frozen = np.frombuffer(bytes(96), np.int16)

    class Sub(np.ndarray):
        pass

    for arr in (base, base[1], base[2, 3:], base[:, ::2], base[::-1], base[..., 5], frozen[3:], base.view(Sub)[1],
                base.T, np.zeros(0), base[1:1]):
        assert data_address(arr) == arr.__array_interface__["data"][0]


def _local_arrays_in_batches():
    """defer/submit batches whose local sides are not on the heap (registered arrays): puts from rows of one
    array, gets into rows of another; every registration is dropped once the quiet retired its WQEs."""
    shmemx.init(sq_depth=64)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt, prev = (me + 1) % n, (me - 1) % n
    dst = shmemx.zeros((16, 8), np.int64, name="dst")
    src = shmemx.array(_stamp(me, nxt, np.arange(128)).reshape(16, 8), name="src")
    rows = _stamp(me, nxt, np.arange(128)).reshape(16, 8) + 1  # local
    back = np.zeros((16, 8), np.int64)  # local
    registry = runtime().udma.registry
    shmemx.aclshmem_barrier_all()
    state = shmemx.aclshmemx_submit_state_t()
    for k in range(15):
        shmemx.aclshmemx_udma_put_nbi(dst[k], rows[k], 8, nxt, batch=shmemx.aclshmemx_defer_t(state))
    shmemx.aclshmemx_udma_put_nbi(dst[15], rows[15], 8, nxt, batch=shmemx.aclshmemx_submit_t(state))
    assert len(registry) == 1
    shmemx.aclshmemx_udma_quiet(nxt)
    assert len(registry) == 0
    for k in range(15):
        shmemx.aclshmemx_udma_get_nbi(back[k], src[k], 8, nxt, batch=shmemx.aclshmemx_defer_t(state))
    shmemx.aclshmemx_udma_get_nbi(back[15], src[15], 8, nxt, batch=shmemx.aclshmemx_submit_t(state))
    shmemx.aclshmemx_udma_quiet(nxt)
    assert len(registry) == 0
    np.testing.assert_array_equal(back, _stamp(nxt, (nxt + 1) % n, np.arange(128)).reshape(16, 8))
    shmemx.aclshmem_barrier_all()
    np.testing.assert_array_equal(dst, _stamp(prev, me, np.arange(128)).reshape(16, 8) + 1)
    shmemx.finalize()


def test_defer_submit_with_local_arrays(run_ok):
    run_ok(2, _local_arrays_in_batches)


# --- what does and does not complete UDMA work ------------------------------------------------------------------


def _generic_quiet_does_not_complete_udma():
    """With this PE's engine held, aclshmem_quiet / aclshmem_fence / barrier_all return at once and the puts are
    still not done; udma_quiet(pe) covers QP 0 only; only the UDMA quiets complete the work."""
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 2)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.zeros((n, 2, 1024), np.int64, name="dst")
    src = shmemx.array(_stamp(me, nxt, np.arange(2048)).reshape(2, 1024), name="src")
    peer = shmemx.aclshmem_ptr(dst, nxt)[me]
    shmemx.aclshmem_barrier_all()
    engine = runtime().udma.engine
    engine.pause()
    shmemx.aclshmemx_udma_qp_put_nbi(dst[me, 0], src[0], 1024, nxt, 0)
    shmemx.aclshmemx_udma_qp_put_nbi(dst[me, 1], src[1], 1024, nxt, 1)
    shmemx.aclshmem_quiet()
    shmemx.aclshmem_fence()
    shmemx.aclshmemx_mte_quiet()
    shmemx.aclshmem_barrier_all()
    q0, q1 = shmemx.aclshmemx_udma_raw_queue(nxt, 0), shmemx.aclshmemx_udma_raw_queue(nxt, 1)
    assert not peer.any() and q0.cq_ctx["tail"] == 0 and q1.cq_ctx["tail"] == 0
    shmemx.aclshmemx_udma_qp_put_nbi(dst[me, 1], src[1], 0, nxt, 1)  # zero length: nothing posted
    # QP 1 alone is outstanding (QP 0 drained below first): udma_quiet(pe) does not wait for it
    engine.resume()
    shmemx.aclshmemx_udma_quiet(nxt)
    np.testing.assert_array_equal(peer[0], src[0])
    engine.pause()
    shmemx.aclshmemx_udma_qp_put_nbi(dst[me, 1], src[0], 1024, nxt, 1)
    shmemx.aclshmemx_udma_quiet(nxt)  # returns: QP 0 has nothing outstanding
    assert q1.cqe_cnt == 2 and q1.cq_ctx["tail"] <= 1
    engine.resume()
    shmemx.aclshmemx_udma_qp_quiet(nxt, 1)
    assert q1.cq_ctx["tail"] == 2
    np.testing.assert_array_equal(peer[1], src[0])
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_generic_quiet_fence_and_barrier_do_not_complete_udma_work(run_ok):
    run_ok(2, _generic_quiet_does_not_complete_udma)


# --- defer / submit batching ---------------------------------------------------------------------------------


def _defer_submit():
    shmemx.init(sq_depth=64)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt, prev = (me + 1) % n, (me - 1) % n
    rows = 40
    dst = shmemx.zeros((rows, 16), np.int64, name="dst")
    src = shmemx.array(_stamp(me, nxt, np.arange(rows * 16)).reshape(rows, 16), name="src")
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    shmemx.aclshmem_barrier_all()
    for k in range(50):  # move the head to 50, so that a batch of 30 wraps (slots 50..63, then 0..15)
        shmemx.aclshmemx_udma_put_nbi(dst[0], src[0], 16, nxt)
    shmemx.aclshmemx_udma_quiet(nxt)
    state = shmemx.aclshmemx_submit_state_t()
    ub = np.zeros(64 * 30, np.uint8)
    for k in range(29):
        shmemx.aclshmemx_udma_put_nbi(dst[k + 1], src[k + 1], 16, nxt, batch=shmemx.aclshmemx_defer_t(state), buf=ub)
        assert state.pending_count == k + 1 and q.head == 50  # staged only
    cqes = q.cqe_cnt
    shmemx.aclshmemx_udma_put_nbi(dst[30], src[30], 16, nxt, batch=shmemx.aclshmemx_submit_t(state), buf=ub)
    assert state.pending_count == 0 and q.head == 80 and q.cqe_cnt == cqes + 1  # one CQE for the batch
    slots = np.arange(50, 80) % 64
    flags = q.sq[slots, 2].tolist()
    assert flags == [0x00] * 29 + [0x20], flags  # deferred WQEs carry no CQE, the submit WQE does
    assert ub.tobytes() == q.sq[slots].tobytes()  # the staging buffer holds the batch as posted
    tail = int(q.cq_ctx["tail"])
    shmemx.aclshmemx_udma_quiet(nxt)
    assert q.cq_ctx["tail"] == tail + 1 and q.wq_ctx["tail"] == 80
    # a batch of gets (no buf: staged in the state)
    back = np.zeros((10, 16), np.int64)
    for k in range(9):
        shmemx.aclshmemx_udma_get_nbi(back[k], src[k], 16, nxt, batch=shmemx.aclshmemx_defer_t(state))
    shmemx.aclshmemx_udma_get_nbi(back[9], src[9], 16, nxt, batch=shmemx.aclshmemx_submit_t(state))
    shmemx.aclshmemx_udma_quiet(nxt)
    np.testing.assert_array_equal(back, _stamp(nxt, (nxt + 1) % n, np.arange(160)).reshape(10, 16))
    shmemx.aclshmem_barrier_all()
    np.testing.assert_array_equal(dst[:31], _stamp(prev, me, np.arange(31 * 16)).reshape(31, 16))
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_defer_submit_batches(run_ok):
    run_ok(3, _defer_submit)


def _defer_submit_contract():
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 2)
    shmemx.init(sq_depth=64)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt, other = (me + 1) % n, (me + 2) % n
    dst = shmemx.zeros((64, 4), np.int32, name="dst")
    src = np.ones((64, 4), np.int32)
    defer, submit = shmemx.aclshmemx_defer_t, shmemx.aclshmemx_submit_t
    P = "aclshmemx_udma_qp_put_nbi"
    state = shmemx.aclshmemx_submit_state_t()
    put = shmemx.aclshmemx_udma_qp_put_nbi
    put(dst[0], src[0], 4, nxt, 0, batch=defer(state))
    same = f"pe {me}: {P} to pe {nxt} qp 1: every call of a defer/submit batch must use the same op kind, PE, QP"
    for call, kind, pattern in [
        (lambda: put(dst[1], src[1], 4, nxt, 1, batch=defer(state)), ValueError, same),
        (lambda: put(dst[1], src[1], 4, other, 0, batch=defer(state)), ValueError, "the same op kind, PE, QP"),
        (lambda: shmemx.aclshmemx_udma_qp_get_nbi(src[1], dst[1], 4, nxt, 0, batch=defer(state)), ValueError,
         "the same op kind, PE, QP"),
        (lambda: put(dst[1], src[1], 4, nxt, 0, batch=defer(state), buf=np.zeros(128, np.uint8)), ValueError,
         "and buf"),
        (lambda: put(dst[1], src[1], 4, nxt, 0, batch=defer(state), config=shmemx.ACLSHMEMX_UDMA_OP_CONFIG_SO),
         ValueError, "a defer call needs a config with cqe=0"),
        (lambda: put(dst[1], src[1], 4, nxt, 0, batch=submit(state), config=shmemx.ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE),
         ValueError, "a submit call needs a config with cqe=1"),
        (lambda: put(dst[1], src[1], 4, nxt, 0, batch=state), TypeError, "batch= takes aclshmemx_defer_t"),
        (lambda: defer(object()), TypeError, "aclshmemx_defer_t takes an aclshmemx_submit_state_t"),
        (lambda: shmemx.aclshmemx_udma_put_signal_nbi(dst[1], src[1], 4, dst[:2].view(np.uint64), 1, nxt,
                                                      batch=defer(state)), TypeError, "batch"),
    ]:
        with pytest.raises(kind, match=pattern):
            call()
        assert state.pending_count == 1, pattern  # a refused call leaves the batch as it was
    assert all(shmemx.aclshmemx_udma_raw_queue(p, q).head == 0 for p in range(n) if p != me for q in range(2))
    for k in range(1, 53):
        put(dst[k], src[k], 4, nxt, 0, batch=defer(state))
    with pytest.raises(ValueError, match="54 WQEs in one batch do not fit an SQ of depth 64"):
        put(dst[53], src[53], 4, nxt, 0, batch=submit(state))
    assert state.pending_count == 53 and shmemx.aclshmemx_udma_raw_queue(nxt, 0).head == 0
    fresh = shmemx.aclshmemx_submit_state_t()
    for k in range(52):
        put(dst[k], src[k], 4, nxt, 0, batch=defer(fresh))
    put(dst[52], src[52], 4, nxt, 0, batch=submit(fresh))  # 53 WQEs + the 10-BB guard < 64
    assert shmemx.aclshmemx_udma_raw_queue(nxt, 0).head == 53
    shmemx.aclshmemx_udma_qp_quiet(nxt, 0)
    s2 = shmemx.aclshmemx_submit_state_t()
    small_ub = np.zeros(128, np.uint8)
    with pytest.raises(ValueError, match=r"buf must be a uint8 array of at least 64 \* 3 bytes"):
        for k in range(3):
            put(dst[k], src[k], 4, nxt, 0, batch=defer(s2), buf=small_ub)
    assert s2.pending_count == 2
    shmemx.aclshmem_barrier_all()
    assert (dst[:53] == 1).all()
    shmemx.finalize()


def test_defer_submit_contract_violations(run_ok):
    run_ok(3, _defer_submit_contract)


# --- kernel launch -----------------------------------------------------------------------------------------------


def _launch_basics(block_dim: int):
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    assert (shmemx.get_block_idx(), shmemx.get_block_num()) == (0, 1)  # the main thread outside a launch
    shmemx.sync_all()  # a no-op outside a launch
    seen = np.full(block_dim, -1)
    arrived = np.zeros(block_dim, bool)
    ubs = [None] * block_dim
    counter = shmemx.zeros(2, np.int64, name="counter")

    def kernel(scale):
        b = shmemx.get_block_idx()
        assert shmemx.get_block_num() == block_dim
        seen[b] = b * scale
        arrived[b] = True
        shmemx.sync_all()
        assert arrived.all(), "a block left sync_all before every block arrived"
        ub = shmemx.get_ub()
        assert ub.dtype == np.uint8 and ub.shape == (UB_SIZE,)
        assert shmemx.get_ub() is ub and shmemx.get_ub(128).base is ub
        ub[:8] = b
        ubs[b] = ub
        shmemx.sync_all()
        arrived[b] = False
        # every block of every PE adds 1 on pe 0, then all meet
        shmemx.aclshmemx_signal_op(counter[:1], 1, shmemx.ACLSHMEM_SIGNAL_ADD, 0)
        shmemx.aclshmemx_barrier_all_vec()
        assert shmemx.aclshmem_ptr(counter, 0)[0] == n * block_dim
        shmemx.aclshmemx_sync_vec_all()
        shmemx.aclshmemx_signal_op(counter[:1], 1, shmemx.ACLSHMEM_SIGNAL_ADD, 0)
        shmemx.aclshmemx_sync_vec_all()
        assert shmemx.aclshmem_ptr(counter, 0)[0] == 2 * n * block_dim

    shmemx.launch(kernel, block_dim, 3)
    assert seen.tolist() == [3 * b for b in range(block_dim)]
    addresses = {ub.__array_interface__["data"][0] for ub in ubs}
    assert len(addresses) == block_dim and all((ub[:8] == b).all() for b, ub in enumerate(ubs))
    with pytest.raises(ValueError, match=r"UB scratch is \d+ B, asked for"):
        shmemx.get_ub(1 << 30)
    for bad in (0, 129, True, 2.0):
        with pytest.raises(ValueError, match=f"pe {me}: launch: block_dim {bad!r} out of range 1..128"):
            shmemx.launch(kernel, bad, 1)

    def nested():
        shmemx.launch(kernel, 1, 1)

    with pytest.raises(RuntimeError, match="kernels cannot launch kernels"):
        shmemx.launch(nested, 1)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


@pytest.mark.parametrize("n, block_dim", [(2, 1), (2, 4), (4, 3), (8, 2)])
def test_launch_block_idx_sync_all_ub_and_barrier_all_vec(run_ok, n, block_dim):
    run_ok(n, _launch_basics, block_dim)


class _Boom(Exception):
    pass


def _launch_exception():
    shmemx.init()
    me = shmemx.my_pe()

    def kernel():
        if shmemx.get_block_idx() == 2:
            raise _Boom(f"block 2 of pe {me}")
        shmemx.sync_all()  # the other blocks are released (BrokenBarrierError), not stuck

    with pytest.raises(_Boom, match=f"block 2 of pe {me}") as info:
        shmemx.launch(kernel, 4)
    assert info.value.__notes__ == [f"(raised in AIV block 2 of 4 on pe {me})"]
    shmemx.launch(lambda: shmemx.sync_all(), 4)  # the next launch is clean
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_exception_in_a_block_propagates_with_the_block_named(run_ok):
    run_ok(2, _launch_exception)


def _launch_reuses_threads():
    """Unobserved launches run block 0 on the calling thread and blocks 1.. on parked threads, the same ones
    launch after launch (no thread is started per launch, none is left over); a wider launch adds workers."""
    import threading

    shmemx.init()
    idents = []

    def kernel(out):
        out[shmemx.get_block_idx()] = threading.get_ident()
        shmemx.sync_all()

    for _ in range(5):
        seen = [0] * 4
        shmemx.launch(kernel, 4, seen)
        idents.append(seen)
        count = threading.active_count()
    assert all(seen == idents[0] for seen in idents), idents
    assert idents[0][0] == threading.get_ident() and len(set(idents[0])) == 4
    wide = [0] * 6
    shmemx.launch(kernel, 6, wide)
    assert wide[:4] == idents[0] and len(set(wide)) == 6
    assert threading.active_count() == count + 2
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_launch_reuses_parked_threads(run_ok):
    run_ok(2, _launch_reuses_threads)


def _concurrent_launches():
    """Two host threads launch at once, and a block of the first waits for a word a block of the second sets: the
    second launch must not queue its blocks behind the first's on the same parked threads (it gets fresh ones)."""
    import threading

    me = shmemx.init() or shmemx.my_pe()
    word = shmemx.zeros(2, np.uint64, name="word")
    shmemx.aclshmem_barrier_all()
    started = threading.Event()

    def waiter():
        if shmemx.get_block_idx() == 1:
            started.set()
            shmemx.aclshmem_signal_wait_until(word[0:1], shmemx.ACLSHMEM_CMP_EQ, 7)

    def setter():
        if shmemx.get_block_idx() == 1:
            shmemx.aclshmemx_signal_op(word[0:1], 7, shmemx.ACLSHMEM_SIGNAL_SET, me)

    first = threading.Thread(target=shmemx.launch, args=(waiter, 2))
    first.start()
    assert started.wait(30)
    shmemx.launch(setter, 2)
    first.join(30)
    assert not first.is_alive()
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_a_launch_beside_another_gets_its_own_threads(run_ok):
    run_ok(2, _concurrent_launches)


# --- one submitter per (peer, qp) -------------------------------------------------------------------------------


def _one_submitter():
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 2)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt, prev = (me + 1) % n, (me - 1) % n
    dst = shmemx.zeros((8, 16), np.int64, name="dst")
    src = shmemx.array(_stamp(me, nxt, np.arange(8 * 16)).reshape(8, 16), name="src")
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)

    def kernel():
        b = shmemx.get_block_idx()
        if b == 0:
            shmemx.aclshmemx_udma_put_nbi(dst[0], src[0], 16, nxt)  # block 0 now submits to (nxt, qp 0)
        shmemx.sync_all()
        if b == 1:
            head = q.head
            with pytest.raises(shmemx.SubmitterError) as info:
                shmemx.aclshmemx_udma_put_nbi(dst[1], src[1], 16, nxt)
            text = str(info.value)
            assert text.startswith(f"pe {me}: aclshmemx_udma_put_nbi to pe {nxt} qp 0: the send queue is in use by "
                                   f"block 0, which has 1 BBs posted and not yet quieted; block 1 may not post"), text
            assert q.head == head  # nothing posted
            with pytest.raises(shmemx.SubmitterError, match="in use by block 0"):
                shmemx.aclshmemx_udma_atomic_fetch_add(dst[7, :1], 1, nxt)  # atomics use QP 0 too
            shmemx.aclshmemx_udma_qp_put_nbi(dst[2], src[2], 16, nxt, 1)  # another QP is free
            shmemx.aclshmemx_udma_qp_quiet(nxt, 1)
        shmemx.sync_all()
        if b == 0:
            shmemx.aclshmemx_udma_quiet(nxt)  # hands the queue over
        shmemx.sync_all()
        if b == 1:
            shmemx.aclshmemx_udma_put_nbi(dst[3], src[3], 16, nxt)
            shmemx.aclshmemx_udma_quiet(nxt)
            shmemx.aclshmemx_udma_put_nbi(dst[4], src[4], 16, nxt)  # left outstanding at the end of the launch
        shmemx.sync_all()

    shmemx.launch(kernel, 2)
    # the launch ended: its blocks' claims are released, so the main thread may take the queue over
    shmemx.aclshmemx_udma_put_nbi(dst[5], src[5], 16, nxt)
    shmemx.aclshmemx_udma_quiet(nxt)
    shmemx.aclshmem_barrier_all()
    for row in (0, 2, 3, 4, 5):
        np.testing.assert_array_equal(dst[row], _stamp(prev, me, np.arange(16 * row, 16 * row + 16)))
    assert not dst[1].any() and not dst[6:].any()
    shmemx.finalize()


def test_one_submitter_per_queue(run_ok):
    run_ok(2, _one_submitter)


def _submitter_from_main_thread():
    """The main thread counts as block 0 outside a launch: a block that posts to a queue the main thread left
    un-quieted is refused too."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.zeros(16, np.int64, name="dst")
    shmemx.aclshmemx_udma_put_nbi(dst, np.ones(16, np.int64), 16, nxt)

    def kernel():
        if shmemx.get_block_idx() == 1:
            with pytest.raises(shmemx.SubmitterError, match="in use by block 0, which has 1 BBs posted"):
                shmemx.aclshmemx_udma_put_nbi(dst, np.ones(16, np.int64), 16, nxt)

    shmemx.launch(kernel, 2)
    shmemx.aclshmemx_udma_quiet(nxt)
    shmemx.launch(lambda: shmemx.get_block_idx() == 1 and shmemx.aclshmemx_udma_quiet(nxt), 2)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_one_submitter_main_thread_and_blocks(run_ok):
    run_ok(2, _submitter_from_main_thread)


# --- multi-QP --------------------------------------------------------------------------------------------------


def _multi_qp(qp_num: int):
    """One block per QP, each sending its slice to every other PE on its own QP (as udma_qp_demo does); the
    tables hold one record per (peer, qp) at slot * qp_num + qp."""
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, qp_num)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    m = 512
    dst = shmemx.zeros((n, qp_num, m), np.int64, name="dst")
    sig = shmemx.zeros((n, qp_num), np.uint64, name="sig")
    src = shmemx.array(_stamp(me, 0, np.arange(qp_num * m)).reshape(qp_num, m), name="src")
    shmemx.aclshmem_barrier_all()

    def kernel():
        qp = shmemx.get_block_idx()
        for p in _others(me, n):
            shmemx.aclshmemx_udma_qp_put_nbi(dst[me, qp, : m // 2], src[qp, : m // 2], m // 2, p, qp)
            shmemx.aclshmemx_udma_qp_put_signal_nbi(dst[me, qp, m // 2:], src[qp, m // 2:], m // 2,
                                                    sig[me, qp:qp + 1], (me + 1) << 32 | (qp + 1), p, qp)
        for p in _others(me, n):
            shmemx.aclshmemx_udma_qp_quiet(p, qp)
            raw = shmemx.aclshmemx_udma_raw_queue(p, qp)
            assert raw.cqe_cnt == 2 and raw.wq_ctx["tail"] == 3  # 1 + 2 BBs, both retired

    shmemx.launch(kernel, qp_num)
    shmemx.aclshmem_barrier_all()
    for p in _others(me, n):
        np.testing.assert_array_equal(dst[p], _stamp(p, 0, np.arange(qp_num * m)).reshape(qp_num, m))
        assert sig[p].tolist() == [(p + 1) << 32 | (q + 1) for q in range(qp_num)]
    seg = runtime().udma.seg
    for p in _others(me, n):
        recs = seg.remote_mem_info[p * qp_num:(p + 1) * qp_num]
        assert len(set(recs["tpn"].tolist())) == qp_num and len(set(recs["tid"].tolist())) == 1
        assert len(set(seg.wq_ctx[p * qp_num:(p + 1) * qp_num]["buf_addr"].tolist())) == qp_num
    assert not seg.remote_mem_info[me * qp_num:(me + 1) * qp_num]["tpn"].any()  # the self slot stays zero
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


@pytest.mark.parametrize("n, qp_num", [(2, 4), (4, 2), (3, 32)])
def test_multi_qp_one_block_per_qp(run_ok, n, qp_num):
    run_ok(n, _multi_qp, qp_num)


# --- the raw WQE path -------------------------------------------------------------------------------------------


def _raw_path(batches: int, count: int):
    """Reserve N slots, write N WQEs built in one numpy operation, ring once, poll; the batches wrap the ring."""
    shmemx.init(sq_depth=64)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt, prev = (me + 1) % n, (me - 1) % n
    m = 8
    dst = shmemx.zeros((batches, count, m), np.int64, name="dst")
    src = shmemx.array(_stamp(me, nxt, np.arange(batches * count * m)).reshape(batches, count, m), name="src")
    local = _stamp(me, nxt, np.arange(batches * count * m)).reshape(batches, count, m) + 7  # a registered array
    back = np.zeros((batches, count, m), np.int64)
    shmemx.aclshmem_barrier_all()
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    assert repr(q).startswith(f"RawQueue(pe {me} -> pe {nxt} qp 0")
    step = np.arange(count, dtype=np.uint64) * np.uint64(8 * m)
    for b in range(batches):
        flags = np.where(np.arange(count) % 4 == 3, 0x20, 0x00).astype(np.uint64)
        flags[-1] = 0x20
        head = q.reserve(count)
        wqes = q.build_writes(rmt_va=q.remote_va(dst[b]) + step, sge_len=8 * m, sge_va=q.local_va(src[b]) + step,
                              flag=flags)
        end = q.write(head, wqes)
        assert end == head + count
        q.ring_doorbell(end, cqes=int((flags & 0x20 != 0).sum()))
        assert q.wq_ctx["head"] == end
        q.poll()
        assert q.cq_ctx["tail"] == q.cqe_cnt and q.wq_ctx["tail"] == end
    head = q.reserve(count)  # reads into a registered local array
    q.write(head, q.build_writes(rmt_va=q.remote_va(src[0]) + step, sge_len=8 * m,
                                 sge_va=q.local_va(back[0], writable=True) + step, opcode=Opcode.READ))
    q.ring_doorbell(head + count, cqes=count)
    q.poll()
    np.testing.assert_array_equal(back[0], _stamp(nxt, (nxt + 1) % n, np.arange(count * m)).reshape(count, m))
    del local
    assert q.head == (batches + 1) * count and q.head > q.depth  # wrapped
    with pytest.raises(ValueError, match="60 BBs do not fit a send queue of depth 64"):
        q.reserve(60)
    with pytest.raises(ValueError, match="reserve.. the room first"):
        q.ring_doorbell(q.head + 60)
    shmemx.aclshmem_barrier_all()
    np.testing.assert_array_equal(dst, _stamp(prev, me, np.arange(batches * count * m)).reshape(batches, count, m))
    shmemx.finalize()


@pytest.mark.parametrize("n", [2, 4])
def test_raw_path_reserve_write_ring_poll_with_wrap(run_ok, n):
    run_ok(n, _raw_path, 3, 40)


def _raw_post():
    """RawQueue.post: WRITEs (build_writes: the bytes of build_write_batch) and a WRITE_WITH_NOTIFY built
    beforehand, posted with one call (wrapping the ring), store the same bytes, sidecar words and counts as
    reserve + write + ring_doorbell, and execute; a batch with another opcode (an FAA) takes the Python path and
    executes too."""
    from shmemx.udma.rings import Api

    shmemx.init(sq_depth=32)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt, prev = (me + 1) % n, (me - 1) % n
    dst = shmemx.zeros((2, 12, 8), np.int64, name="dst")
    sig = shmemx.zeros(2, np.uint64, name="sig")
    word = shmemx.zeros(1, np.int64, name="word")
    src = shmemx.array(_stamp(me, nxt, np.arange(2 * 12 * 8)).reshape(2, 12, 8), name="src")
    shmemx.aclshmem_barrier_all()
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    qp = runtime().udma.qp(nxt, 0)
    rmi = q.remote_mem_info
    step = np.arange(12, dtype=np.uint64) * np.uint64(64)
    for b, via_post in enumerate((True, False)):
        writes = q.build_writes(rmt_va=q.remote_va(dst[b]) + step, sge_len=64, sge_va=q.local_va(src[b]) + step)
        close = q.build(Opcode.WRITE_WITH_NOTIFY, 0x2e, q.remote_va(dst[b, 0]), sge_len=64,
                        sge_va=q.local_va(src[b, 0]),
                        notify_tid=int(rmi["tid"]), notify_token=int(rmi["rmt_token_value"]),
                        notify_va=q.remote_va(sig[b:b + 1]), notify_value=b + 1)
        data = np.concatenate([writes.view(np.uint8).reshape(-1), np.frombuffer(close, np.uint8)])
        from shmemx.udma.layout import build_write_batch  # build_writes' copy of the words every WQE shares
        np.testing.assert_array_equal(writes, build_write_batch(
            12, tp_id=qp.tpn, rmt_seg_id=qp.tid, rmt_eid=qp.eid, rmt_token_value=qp.token,
            rmt_va=q.remote_va(dst[b]) + step, sge_len=64, sge_va=q.local_va(src[b]) + step))
        start, before = q.head, (qp.n_posted, qp.b_posted)
        if via_post:  # the native path takes it (it returns -1 when the Python path must)
            assert runtime().udma.poster.wqes(qp.index, data, 13, int(Api.RAW), 0) == start + 14
            end = q.head
        else:
            end = q.write(q.reserve(14), data)
            q.ring_doorbell(end, cqes=13)
        assert end == start + 14 and q.head == end and q.wq_ctx["head"] == end and q.cqe_cnt == 13 * (b + 1)
        slots = (start + np.arange(14)) % 32
        assert bytes(q.sq[slots].reshape(-1)) == data.tobytes()
        assert (qp.n_posted - before[0], qp.b_posted - before[1]) == (13, 13 * 64)
        assert len(set(qp.sidecar[slots].tolist())) == 1
        sidecar = int(qp.sidecar[slots[0]])
        q.poll()
        if b == 0:
            first_sidecar = sidecar
    assert sidecar == first_sidecar  # the same sidecar word from both paths
    amo = int(q.wq_ctx["amo_addr"])
    end = q.post(q.build(Opcode.FAA, 0x20, q.remote_va(word), sge_len=8, sge_va=amo, operand=3), cqes=1)
    assert end == q.head
    q.poll()
    shmemx.aclshmem_barrier_all()
    np.testing.assert_array_equal(dst, _stamp(prev, me, np.arange(2 * 12 * 8)).reshape(2, 12, 8))
    assert sig.tolist() == [1, 2] and word[0] == 3
    shmemx.finalize()


@pytest.mark.parametrize("n", [2, 3])
def test_raw_post_is_reserve_write_ring(run_ok, n):
    run_ok(n, _raw_post)


def _raw_queues():
    """RawQueues: WRITEs and WRITE_WITH_NOTIFYs for every peer built in one step (the bytes each queue's own
    build_writes / build makes), posted as one segment per peer (one native call; a segment with an FAA takes
    that queue's post, and the segments after it too) and quieted with one call; they execute."""
    shmemx.init(sq_depth=64)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    peers = [(me + i) % n for i in range(1, n)]
    dst = shmemx.zeros((n, 4, 8), np.int64, name="dst")
    sig = shmemx.zeros(n, np.int64, name="sig")
    word = shmemx.zeros(n, np.int64, name="word")
    src = np.stack([_stamp(me, p, np.arange(4 * 8)).reshape(4, 8) for p in range(n)])  # a local array
    shmemx.aclshmem_barrier_all()
    queues = [shmemx.aclshmemx_udma_raw_queue(p, 0) for p in peers]
    batch = shmemx.RawQueues(queues)
    assert len(batch) == n - 1
    va = batch.local_va(src)
    for q in queues:
        assert q.local_va(src) == va  # the same registration
    for round_ in range(2):  # the second round posts past the first (heads move on)
        va = batch.local_va(src)  # registered until the WQEs of this thread's next post retired
        which = np.repeat(np.arange(len(peers)), 3)
        rows = np.tile(np.arange(3), len(peers))
        rmt = np.array([queues[i].remote_va(dst[me, r]) for i, r in zip(which, rows)], np.uint64)
        sge = np.uint64(va) + (np.array(peers)[which] * 256 + rows * 64).astype(np.uint64)
        writes = batch.build_writes(which, rmt_va=rmt, sge_len=64, sge_va=sge, flag=0x20)
        for i, q in enumerate(queues):  # the bytes of each queue's own builder
            np.testing.assert_array_equal(writes[which == i], q.build_writes(rmt_va=rmt[which == i], sge_len=64,
                                                                             sge_va=sge[which == i]))
        last = np.arange(len(peers))
        close = batch.build_notifies(
            last, flag=0x2e, rmt_va=[q.remote_va(dst[me, 3]) for q in queues], sge_len=64,
            sge_va=np.uint64(va) + (np.array(peers) * 256 + 192).astype(np.uint64),
            notify_va=[q.remote_va(sig[me:me + 1]) for q in queues], notify_value=round_ + 1)
        for i, q in enumerate(queues):
            rmi = q.remote_mem_info
            assert bytes(close[i]) == q.build(Opcode.WRITE_WITH_NOTIFY, 0x2e, q.remote_va(dst[me, 3]), sge_len=64,
                                              sge_va=va + peers[i] * 256 + 192, notify_tid=int(rmi["tid"]),
                                              notify_token=int(rmi["rmt_token_value"]),
                                              notify_va=q.remote_va(sig[me:me + 1]), notify_value=round_ + 1)
        data = np.concatenate([np.concatenate([writes[which == i], close[i].reshape(2, 8)]) for i in last])
        parts = [data]
        bbs, cqes = [5] * len(peers), [4] * len(peers)
        if round_:  # an FAA on the last peer's queue: its segment (and only it) takes the queue's own post
            q = queues[-1]
            faa = q.build(Opcode.FAA, 0x20, q.remote_va(word[me:me + 1]), sge_len=8, sge_va=int(q.wq_ctx["amo_addr"]),
                          operand=5)
            parts.append(np.frombuffer(faa, np.uint64).reshape(-1, 8))
            bbs.append(len(faa) // 64)
            cqes.append(1)
            last = np.append(last, len(peers) - 1)
        heads = [q.head for q in queues]
        batch.post(last, bbs, np.concatenate(parts), cqes=cqes)
        for i, q in enumerate(queues):
            grew = 5 + (len(faa) // 64 if round_ and i == len(peers) - 1 else 0)
            assert q.head == heads[i] + grew
            got = q.sq_words[(heads[i] + np.arange(5)) % q.depth]
            np.testing.assert_array_equal(got, data[5 * i:5 * i + 5])
        batch.quiet(np.arange(len(peers)))
        for q in queues:
            assert q.cqe_cnt == runtime().udma.qp(q.peer, 0).cq_tail  # every CQE consumed
        shmemx.aclshmem_barrier_all()
        for p in range(n):
            if p != me:
                np.testing.assert_array_equal(dst[p], _stamp(p, me, np.arange(32)).reshape(4, 8))
                assert sig[p] == round_ + 1
        shmemx.aclshmem_barrier_all()
    assert word[(me + 1) % n] == 5  # from the next PE (its last peer is this one)
    shmemx.finalize()


@pytest.mark.parametrize("n", [2, 3])
def test_raw_queues_build_post_quiet(run_ok, n):
    run_ok(n, _raw_queues)


def _mixed_batch():
    """WRITE, WRITE_WITH_NOTIFY and FAA interleaved on one QP, written into the ring (wrapping) and rung once:
    they execute in program order (only order gives the final values checked)."""
    shmemx.init(sq_depth=32)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt, prev = (me + 1) % n, (me - 1) % n
    word = shmemx.zeros(2, np.int64, name="word")
    sig = shmemx.zeros(2, np.uint64, name="sig")
    payload = shmemx.zeros(16, np.int64, name="payload")
    vals = shmemx.array(np.array([100, 200, 9, 0], np.int64), name="vals")
    body = shmemx.array(_stamp(me, nxt, np.arange(16)), name="body")
    shmemx.aclshmem_barrier_all()
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    for _ in range(30):  # move the head to 30: the batch of 10 BBs wraps, the first FAA straddles slots 31 and 0
        shmemx.aclshmemx_udma_put_nbi(word[1:], vals[3:], 1, nxt)
        shmemx.aclshmemx_udma_quiet(nxt)
    rmi = q.remote_mem_info
    amo = int(q.wq_ctx["amo_addr"])
    notify = dict(notify_tid=int(rmi["tid"]), notify_token=int(rmi["rmt_token_value"]),
                  notify_va=q.remote_va(sig[:1]))
    wqes = [
        q.build(Opcode.WRITE, 0x00, q.remote_va(word[:1]), sge_len=8, sge_va=q.local_va(vals[0:1])),  # = 100
        q.build(Opcode.FAA, 0x00, q.remote_va(word[:1]), sge_len=8, sge_va=amo, operand=7),  # 107
        q.build(Opcode.WRITE_WITH_NOTIFY, 0x00, q.remote_va(payload), sge_len=128, sge_va=q.local_va(body),
                notify_value=5, **notify),
        q.build(Opcode.WRITE, 0x00, q.remote_va(sig[:1]), sge_len=8, sge_va=q.local_va(vals[2:3])),  # sig = 9
        q.build(Opcode.FAA, 0x20, q.remote_va(word[:1]), sge_len=8, sge_va=amo, operand=1),  # 108, fetch 107
        q.build(Opcode.WRITE, 0x00, q.remote_va(word[1:]), sge_len=8, sge_va=q.local_va(vals[1:2])),  # = 200
        q.build(Opcode.NOP, 0x20, 0),
    ]
    blob = b"".join(wqes)
    bbs = len(blob) // 64
    head = q.reserve(bbs)
    assert head == 30 and bbs == 10
    q.ring_doorbell(q.write(head, blob), cqes=2)
    assert bytes(q.sq[31]) == wqes[1][:64] and bytes(q.sq[0]) == wqes[1][64:]
    q.poll()
    assert int(runtime().udma.qp(nxt, 0).amo[0]) == 107  # the fetched value of the last FAA
    shmemx.aclshmem_barrier_all()
    assert word.tolist() == [108, 200] and sig[0] == 9
    np.testing.assert_array_equal(payload, _stamp(prev, me, np.arange(16)))
    shmemx.finalize()


def test_mixed_batch_executes_in_order(run_ok):
    run_ok(2, _mixed_batch)


# --- local registrations shared by blocks -------------------------------------------------------------------


def _registration_pinned_under_the_lock():
    """A registration looked up with ``pin`` survives a collect that runs right after the lookup (the window
    in which another block's quiet used to drop it: the WQE then failed with LOCAL_ACCESS)."""
    shmemx.init()
    rt = runtime()
    registry, qp = rt.udma.registry, rt.udma.qp(1 - shmemx.my_pe(), 0)
    arr = np.arange(256, dtype=np.uint8)
    va, reg = registry.va_of(arr, False, "test array", pin=(qp.index, qp.head + qp.depth))
    registry.collect(_Tails(rt.udma.qstate))  # what a quiet of another queue does
    assert registry.resolve(va, 256) is not None
    assert reg.uses == {qp.index: qp.head + qp.depth}
    other = np.arange(64, dtype=np.uint8)
    va2, _ = registry.va_of(other, False, "unpinned array")
    registry.collect(_Tails(rt.udma.qstate))
    assert registry.resolve(va2, 64) is None  # the unpinned one goes: callers must pin in va_of
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_registration_pinned_under_the_lock(run_ok):
    run_ok(2, _registration_pinned_under_the_lock)


def _blocks_share_a_local_source(rounds: int):
    """Four blocks, one QP each, put from one fresh local array at the same time (each launch a new one, so
    each launch registers it anew while the blocks race to look it up) and quiet. Two blocks used to register
    the same array twice; the registration the dict forgot left its WQEs with LOCAL_ACCESS."""
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 4)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    dst = shmemx.zeros((rounds, 4, 64), np.int64, name="dst")

    def kernel(i, src):
        qp = shmemx.get_block_idx()
        for p in _others(me, n):
            q = shmemx.aclshmemx_udma_raw_queue(p, qp)
            head = q.reserve(1)
            q.write(head, q.build_writes(rmt_va=q.remote_va(dst[i, qp]), sge_len=64 * 8, sge_va=q.local_va(src[qp])))
            q.ring_doorbell(head + 1, cqes=1)
            shmemx.aclshmemx_udma_qp_quiet(p, qp)

    for i in range(rounds):
        shmemx.launch(kernel, 4, i, _stamp(me, i, np.arange(4 * 64)).reshape(4, 64))
    shmemx.aclshmem_barrier_all()
    for p in _others(me, n):
        for i in range(rounds):
            np.testing.assert_array_equal(shmemx.aclshmem_ptr(dst, p)[i],
                                          _stamp(me, i, np.arange(4 * 64)).reshape(4, 64))
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_blocks_share_a_local_source(run_ok):
    run_ok(2, _blocks_share_a_local_source, 100, timeout=60)


# --- ring depths and deadlines ---------------------------------------------------------------------------------


def _depths(expect_sq: int, expect_cq: int, init: dict):
    shmemx.init(**init)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    assert (q.depth, int(q.wq_ctx["depth"]), int(q.cq_ctx["depth"])) == (expect_sq, expect_sq, expect_cq)
    dst = shmemx.zeros((300, 4), np.int32, name="dst")
    for k in range(300):  # the CQ laps at its own depth, independently of the SQ
        shmemx.aclshmemx_udma_put_nbi(dst[k], np.full(4, me * 1000 + k, np.int32), 4, nxt)
        if k % 7 == 6:
            shmemx.aclshmemx_udma_quiet(nxt)
    shmemx.aclshmemx_udma_quiet(nxt)
    shmemx.aclshmem_barrier_all()
    assert (dst[:, 0] == ((me - 1) % n) * 1000 + np.arange(300)).all()
    shmemx.finalize()


@pytest.mark.parametrize("init, env, sq, cq", [
    ({"sq_depth": 16, "cq_depth": 64}, {}, 16, 64),
    ({"sq_depth": 16}, {"SHMEMX_SQ_DEPTH": "64", "SHMEMX_CQ_DEPTH": "128"}, 16, 128),  # the argument wins
    ({}, {"SHMEMX_SQ_DEPTH": "32"}, 32, 32),
])
def test_ring_depths_from_init_and_environment(run_ok, init, env, sq, cq):
    run_ok(2, _depths, sq, cq, init, env=env)


def _bad_depths():
    for kwargs, pattern in (({"sq_depth": 100}, "sq_depth must be a power of two in 16..65536, got 100"),
                            ({"sq_depth": 8}, "got 8"),
                            ({"sq_depth": 64, "cq_depth": 32}, "cq_depth 32 must be at least sq_depth 64")):
        with pytest.raises(ValueError, match=pattern):
            shmemx.init(**kwargs)
        assert not shmemx.is_initialized()
    shmemx.init(sq_depth=16)
    shmemx.finalize()


def test_bad_ring_depths_are_refused(run_ok):
    run_ok(2, _bad_depths)


def _quiet_deadline():
    shmemx.init(timeout=0.3)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    dst = shmemx.zeros(8, np.int64, name="dst")
    engine = runtime().udma.engine
    engine.pause()
    shmemx.aclshmemx_udma_qp_put_nbi(dst, np.ones(8, np.int64), 8, nxt, 0)
    start = time.monotonic()
    with pytest.raises(shmemx.WaitTimeoutError) as info:
        shmemx.aclshmemx_udma_qp_quiet(nxt, 0)
    assert time.monotonic() - start >= 0.3
    assert re.fullmatch(rf"pe {me}: aclshmemx_udma_qp_quiet on pe {nxt} qp 0: 1 CQEs outstanding \(cqe_cnt 1, CQ "
                        rf"tail 0\); the engine executed 0 of 1 posted BBs \(waited \d+\.\d s\)", str(info.value))
    engine.resume()
    shmemx.aclshmemx_udma_qp_quiet(nxt, 0)  # the queue is intact: the late completion is consumed
    shmemx.aclshmem_barrier_all()
    assert (dst == 1).all()
    shmemx.finalize()


def test_quiet_has_a_deadline_naming_the_queue(run_ok):
    run_ok(2, _quiet_deadline)


# --- the native posting path writes what the Python path writes ---------------------------------------------------


def _both_posting_paths():
    """Every plain put/get the native path posts (``_post.c``: heap and registered local buffers, both QPs, a
    CQE-less config) writes the same 64 bytes and sidecar word as ``QueuePair.post_rw`` does for the same call,
    and executes the same way."""
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 2)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    udma = runtime().udma
    dst = shmemx.zeros((8, 16), np.int32, name="dst")
    heap_src = shmemx.array(_stamp(me, nxt, np.arange(16)).astype(np.int32), name="heap_src")
    local = _stamp(me, nxt, np.arange(8 * 16)).astype(np.int32).reshape(8, 16)
    back = np.zeros((2, 16), np.int32)
    sig = shmemx.zeros(2, np.int64, name="sig")
    calls = [(shmemx.aclshmemx_udma_put_nbi, (dst[0], heap_src, 16, nxt), {}),
             (shmemx.aclshmemx_udma_put_nbi, (dst[1], local[1], 16, nxt), {}),
             (shmemx.aclshmemx_udma_qp_put_nbi, (dst[2, 4:], local[2], 12, nxt, 1), {}),
             (shmemx.aclshmemx_udma_put_nbi, (dst[3], local[3], 16, nxt),
              {"config": shmemx.ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE}),
             (shmemx.aclshmemx_udma_get_nbi, (back[0], dst[4], 16, nxt), {}),
             (shmemx.aclshmemx_udma_qp_get_nbi, (back[1], dst[5], 16, nxt, 1), {}),
             (shmemx.aclshmemx_udma_put_signal_nbi, (dst[6], local[6], 16, sig[0:1], 7, nxt), {}),
             (shmemx.aclshmemx_udma_qp_put_signal_nbi, (dst[7], heap_src, 16, sig[1:2], -3, nxt, 1), {})]
    for call, args, kwargs in calls:  # register the local arrays through the Python path (kept: no quiet yet)
        call(*args, **kwargs)
    udma.engine.pause()
    rings, taken = [], []

    class Counting:  # the native path, noting whether it took each call
        def rw(self, *args):
            pos = saved.rw(*args)
            taken.append(pos >= 0)
            return pos

        def notify(self, *args):
            pos = saved.notify(*args)
            taken.append(pos >= 0)
            return pos

        def __getattr__(self, name):
            return getattr(saved, name)

    class Declining(Counting):  # the native path declining every call: the Python path takes them
        def rw(self, *args):
            return -1

        def notify(self, *args):
            return -1

    for native in (True, False):
        saved = udma.poster
        udma.poster = Counting() if native else Declining()
        queues = [udma.qp(nxt, qp) for qp in (0, 1)]
        heads = [q.head for q in queues]
        for call, args, kwargs in calls:
            call(*args, **kwargs)
        udma.poster = saved
        slots = [np.arange(h, q.head) % q.depth for q, h in zip(queues, heads)]
        rings.append([(q.sq[s].tobytes(), q.sidecar[s].tolist()) for q, s in zip(queues, slots)])
    assert taken == [True] * len(calls), f"the native path declined plain calls: {taken}"
    assert rings[0] == rings[1], "the native and the Python posting paths wrote different WQEs"
    udma.engine.resume()
    for qp in (0, 1):
        shmemx.aclshmemx_udma_qp_quiet(nxt, qp)
    shmemx.aclshmem_barrier_all()
    prev = (me - 1) % n
    np.testing.assert_array_equal(dst[0], _stamp(prev, me, np.arange(16)).astype(np.int32))
    np.testing.assert_array_equal(dst[1], _stamp(prev, me, np.arange(16, 32)).astype(np.int32))
    np.testing.assert_array_equal(dst[2, 4:], _stamp(prev, me, np.arange(32, 44)).astype(np.int32))
    np.testing.assert_array_equal(dst[3], _stamp(prev, me, np.arange(48, 64)).astype(np.int32))
    np.testing.assert_array_equal(dst[6], _stamp(prev, me, np.arange(96, 112)).astype(np.int32))
    assert sig.tolist() == [7, -3]
    shmemx.finalize()


def test_native_and_python_posting_paths_write_identical_wqes(run_ok):
    run_ok(2, _both_posting_paths)


# --- the posting thread's turn (_engine.c shmemx_engine_post_turn) -----------------------------------------


def _post_turn():
    """A small put_signal or put on an idle queue is executed by the posting thread before the call returns (its
    payload, signal and CQE are in at once), the same WQE the engine would run; a large one, or one posted while
    the engine is paused, is left to the engine."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    engine = runtime().udma.engine
    box = shmemx.zeros((n, 64), np.int64, name="box")
    sig = shmemx.zeros(n, np.uint64, name="sig")
    shmemx.aclshmem_barrier_all()
    before = engine.native.post_turns
    small = _engine.POST_TURN_BYTES // 8
    for rnd in range(1, 21):
        part = _stamp(me, nxt, np.arange(small)) + (rnd << 24)
        shmemx.aclshmemx_udma_put_signal_nbi(box[me, :small], part, small, sig[me:me + 1], rnd, nxt)
        shmemx.aclshmemx_udma_quiet(nxt)
    ran = engine.native.post_turns - before
    assert ran >= 15, ran  # a turn lock held by the engine at that moment sends a post to the engine instead
    big = np.arange(64, dtype=np.int64)  # 512 bytes: past POST_TURN_BYTES
    shmemx.aclshmemx_udma_put_nbi(box[me], big, 64, nxt)
    shmemx.aclshmemx_udma_quiet(nxt)
    assert engine.native.post_turns - before == ran
    engine.pause()
    shmemx.aclshmemx_udma_put_signal_nbi(box[me, :1], big[:1], 1, sig[me:me + 1], 99, nxt)
    assert engine.native.post_turns - before == ran  # paused: the WQE waits in the ring for the engine
    engine.resume()
    shmemx.aclshmemx_udma_quiet(nxt)
    shmemx.aclshmem_barrier_all()
    prv = (me - 1) % n
    assert int(sig[prv]) == 99 and box[prv, 0] == 0 and np.array_equal(box[prv, 1:64], np.arange(1, 64))
    shmemx.finalize()


def test_small_posts_on_idle_queues_run_at_post_time(run_ok):
    run_ok(2, _post_turn)


def test_default_depth_bounds_the_rings():
    """Without sq_depth the rings of a large job are shallower (``default_depth``): every queue once around its ring
    fits RING_BUDGET, down to MIN_DEFAULT_DEPTH; small jobs keep DEFAULT_DEPTH; the same on every PE (a function
    of the job's size)."""
    from shmemx.udma.segment import DEFAULT_DEPTH, MIN_DEFAULT_DEPTH, RING_BUDGET, default_depth

    assert [default_depth(p, 1) for p in (1, 2, 8, 16, 32, 64, 128, 256)] == [
        DEFAULT_DEPTH, DEFAULT_DEPTH, DEFAULT_DEPTH, DEFAULT_DEPTH, 16384, 2048, 512, 128]
    assert default_depth(256, 2) == 64 and default_depth(4096, 32) == MIN_DEFAULT_DEPTH
    for p in range(2, 300, 7):
        for q in (1, 2, 4):
            d = default_depth(p, q)
            assert d & (d - 1) == 0 and MIN_DEFAULT_DEPTH <= d <= DEFAULT_DEPTH
            assert d == MIN_DEFAULT_DEPTH or p * (p - 1) * q * d * 132 <= RING_BUDGET
            assert d == DEFAULT_DEPTH or p * (p - 1) * q * 2 * d * 132 > RING_BUDGET

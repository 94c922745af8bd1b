"""Signals and point-to-point waits: signal_op SET/ADD, signal_wait_until, wait_until, test and the all/any/some family.

Waits that must block are made to block for real: the PE that will satisfy the condition first waits until the
waiter's wait slot in the control segment shows it asleep in that call (``_await_sleeping``), then writes. So
the tests exercise the sleep / wake-up path, not only the fast path, without relying on sleeps.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest

import shmemx
from shmemx.shm import atomics, futex, waits
from shmemx.shm.control import WaitCall
from shmemx.runtime import runtime

N_PES = [1, 2, 4, 8]
EQ, NE, GT, GE, LT, LE = (shmemx.ACLSHMEM_CMP_EQ, shmemx.ACLSHMEM_CMP_NE, shmemx.ACLSHMEM_CMP_GT,
                          shmemx.ACLSHMEM_CMP_GE, shmemx.ACLSHMEM_CMP_LT, shmemx.ACLSHMEM_CMP_LE)
SET, ADD = shmemx.ACLSHMEM_SIGNAL_SET, shmemx.ACLSHMEM_SIGNAL_ADD

# A base value per word type; the uint64 one makes the comparisons cross 2**63, where a signed compare is wrong.
BASE = {np.int32: -7, np.int64: -(2**40) - 3, np.uint64: 2**63 - 1}
# cmp -> (value compared with, initial word, the word written by the peer), each relative to BASE
CASES = {EQ: (0, 1, 0), NE: (0, 0, 5), GT: (0, 0, 1), GE: (0, -1, 0), LT: (0, 0, -1), LE: (0, 1, 0)}


def test_constants():
    assert (EQ, NE, GT, GE, LT, LE) == (0, 1, 2, 3, 4, 5)
    assert (SET, ADD) == (0, 1)


def _await_sleeping(pe: int, call: WaitCall, offset: int, timeout: float = 10.0) -> None:
    """Wait until PE ``pe``'s main thread is blocked in ``call`` on the word at heap ``offset``."""
    slot = runtime().ctl.pes[pe]["waits"][0]
    deadline = time.monotonic() + timeout
    while int(slot["call"]) != call or int(slot["offset"]) != offset:
        assert time.monotonic() < deadline, f"pe {pe} never blocked in {call.name} on heap+{offset:#x}"
        time.sleep(0.0005)


def _offset(arr: np.ndarray) -> int:
    return runtime().heap.locate(arr)[1]


# --- every comparison, every word type ---------------------------------------------------------------------


def _wait(signal_wait: bool, word: np.ndarray, cmp: int, value: int, expect: int) -> None:
    if signal_wait:
        got = shmemx.aclshmem_signal_wait_until(word, cmp, value)
        assert got == expect and type(got) is int, (cmp, value, got)
    else:
        assert shmemx.aclshmem_wait_until(word, cmp, value) is None


def _every_comparison(dtype, signal_wait: bool):
    """A token ring: PE me sleeps on ``words[cmp]`` until PE me-1 writes the value that meets the condition.

    PE 0 starts each round; a PE of one signals itself before it waits (the fast path only).
    """
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    base = BASE[dtype]
    words = shmemx.zeros(8, dtype, name="words")
    for cmp, (value, initial, _) in CASES.items():
        words[cmp] = base + initial
    shmemx.aclshmem_barrier_all()
    nxt = (me + 1) % n
    call = WaitCall.SIGNAL_WAIT_UNTIL if signal_wait else WaitCall.WAIT_UNTIL
    for cmp, (value, initial, new) in CASES.items():
        word = words[cmp:cmp + 1]
        assert not shmemx.aclshmem_test(word, cmp, base + value)
        if me != 0:
            _wait(signal_wait, word, cmp, base + value, base + new)
        if n > 1:
            _await_sleeping(nxt, call, _offset(word))
        shmemx.aclshmemx_signal_op(word, base + new, SET, nxt)
        if me == 0:
            _wait(signal_wait, word, cmp, base + value, base + new)
        assert shmemx.aclshmem_test(word, cmp, base + value)
        assert int(words[cmp]) == base + new
    shmemx.aclshmem_barrier_all()


@pytest.mark.parametrize("signal_wait", [True, False], ids=["signal_wait_until", "wait_until"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint64], ids=["int32", "int64", "uint64"])
@pytest.mark.parametrize("n", N_PES)
def test_every_comparison(run_ok, n, dtype, signal_wait):
    run_ok(n, _every_comparison, dtype, signal_wait)


# --- signal_op ---------------------------------------------------------------------------------------------


def _signal_add_sums(dtype, rounds: int):
    """Every PE adds (its pe + 1) to a counter on every PE, ``rounds`` times, and subtracts from a second one."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    counters = shmemx.zeros(2, dtype, name="counters")
    start = 2**40 if np.dtype(dtype).itemsize == 8 else 2**20
    counters[1] = start
    shmemx.aclshmem_barrier_all()
    for r in range(rounds):
        for i in range(n):
            p = (me + i + r) % n  # every PE starts at a different target
            shmemx.aclshmemx_signal_op(counters[0:1], me + 1, ADD, p)
            if np.dtype(dtype).kind == "i":
                shmemx.aclshmemx_signal_op(counters[1:2], -(me + 1), ADD, p)
    total = rounds * n * (n + 1) // 2
    assert shmemx.aclshmem_signal_wait_until(counters[0:1], GE, total) == total
    if np.dtype(dtype).kind == "i":
        assert shmemx.aclshmem_signal_wait_until(counters[1:2], LE, start - total) == start - total
    shmemx.aclshmem_barrier_all()
    assert int(counters[0]) == total  # nobody added more after the barrier


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint64], ids=["int32", "int64", "uint64"])
@pytest.mark.parametrize("n", N_PES)
def test_signal_add_from_every_pe_sums(run_ok, n, dtype):
    run_ok(n, _signal_add_sums, dtype, 25)


def _signal_set():
    """Every PE sets its own slot ``flags[me]`` on every PE to a value naming (writer, target)."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    flags = shmemx.zeros(n, np.int64, name="flags")
    for i in range(n):
        p = (me + i) % n
        shmemx.aclshmemx_signal_op(flags[me:], 999, SET, p)  # overwritten below: the last SET wins
        shmemx.aclshmemx_signal_op(flags[me:], 1000 * (me + 1) + p, SET, p)
    expect = 1000 * (np.arange(n) + 1) + me
    shmemx.aclshmem_wait_until_all(flags, EQ, expect)  # the vector form: one value per word
    np.testing.assert_array_equal(flags, expect)
    # SET stores the value as the word's bits: a negative int64, the largest uint64
    big = shmemx.zeros(2, np.uint64, name="big")
    shmemx.aclshmemx_signal_op(flags[me:], -5, SET, me)
    shmemx.aclshmemx_signal_op(big[1:], 2**64 - 1, SET, (me + 1) % n)
    assert shmemx.aclshmem_signal_wait_until(big[1:], EQ, 2**64 - 1) == 2**64 - 1
    assert int(flags[me]) == -5
    shmemx.aclshmem_barrier_all()


@pytest.mark.parametrize("n", N_PES)
def test_signal_set(run_ok, n):
    run_ok(n, _signal_set)


def _signal_op_many(dtype):
    """signal_op_many: ADD from every PE to every PE sums as signal_op's do; SET names the writer and wakes a PE
    asleep on the word; bad arguments raise before anything is written."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    words = shmemx.zeros(n + 1, dtype, name="words")
    everyone = (np.arange(n) + me) % n  # every PE starts at a different target
    for _ in range(3):
        shmemx.aclshmemx_signal_op_many(words[n:], me + 1, ADD, everyone)
    total = 3 * n * (n + 1) // 2
    assert shmemx.aclshmem_signal_wait_until(words[n:], GE, total) == total
    nxt = (me + 1) % n
    if n > 1 and me == 0:
        _await_sleeping(nxt, WaitCall.SIGNAL_WAIT_UNTIL, _offset(words[me:me + 1]))
    shmemx.aclshmemx_signal_op_many(words[me:me + 1], 1000 + me, SET, [nxt])  # pe 1 may be asleep on it
    prev = (me - 1) % n
    assert shmemx.aclshmem_signal_wait_until(words[prev:prev + 1], EQ, 1000 + prev) == 1000 + prev
    shmemx.aclshmemx_signal_op_many(words[:1], 5, SET, [])  # no PE: nothing
    for bad, err in (([n], f"pe {n} out of range"), ([[0]], "sequence of integer PEs"), ([0.5], "integer PEs")):
        with pytest.raises(ValueError, match=err):
            shmemx.aclshmemx_signal_op_many(words[:1], 7, SET, bad)
    with pytest.raises(ValueError, match="sig_op 2 is not"):
        shmemx.aclshmemx_signal_op_many(words[:1], 7, 2, [me])
    with pytest.raises(TypeError, match="has dtype float32"):
        shmemx.aclshmemx_signal_op_many(shmemx.zeros(2, np.float32), 1, SET, [me])
    shmemx.aclshmem_barrier_all()
    assert int(words[n]) == total and 7 not in words


@pytest.mark.parametrize("dtype", [np.int32, np.uint64], ids=["int32", "uint64"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_signal_op_many(run_ok, n, dtype):
    run_ok(n, _signal_op_many, dtype)


def _word_resolution_follows_the_heap():
    """signal_op and the waits cache where a word lives per array object: the cache must follow the heap."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    flags = shmemx.zeros(4, np.int64, name="flags")
    sig, retyped, unsigned = flags[1:2], flags[2:3], flags[3:4]
    for word in (sig, retyped, unsigned):  # each resolved (and cached) once
        shmemx.aclshmemx_signal_op(word, 2**40 + me, SET, me)
        assert shmemx.aclshmem_signal_wait_until(word, EQ, 2**40 + me) == 2**40 + me
    retyped.dtype = np.int32  # the same object, now two int32 words: the int32 rules apply
    with pytest.raises(ValueError, match="does not fit the word's dtype int32"):
        shmemx.aclshmemx_signal_op(retyped, 2**40, SET, me)
    unsigned.dtype = np.uint64  # same shape and strides, other dtype
    with pytest.raises(ValueError, match="value -1 does not fit the word's dtype uint64"):
        shmemx.aclshmemx_signal_op(unsigned, -1, SET, me)
    shmemx.aclshmemx_signal_op(retyped, -3, SET, me)
    assert int(flags[2]) & 0xFFFF_FFFF == 2**32 - 3
    shmemx.aclshmem_barrier_all()
    shmemx.aclshmem_free(flags)
    for call in (lambda: shmemx.aclshmemx_signal_op(sig, 1, SET, me), lambda: shmemx.aclshmem_test(sig, EQ, 0),
                 lambda: shmemx.aclshmem_signal_wait_until(sig, EQ, 2**40 + me)):
        with pytest.raises(ValueError, match="freed, or never allocated"):
            call()
    # the block is allocated again: the old view resolves into the new allocation, as any view of it would
    again = shmemx.full(4, 7, np.int64, name="again")
    assert again.__array_interface__["data"][0] == sig.__array_interface__["data"][0] - 8
    shmemx.aclshmem_barrier_all()
    shmemx.aclshmemx_signal_op(sig, 100 + me, SET, (me + 1) % n)
    assert shmemx.aclshmem_signal_wait_until(again[1:2], EQ, 100 + (me - 1) % n) == 100 + (me - 1) % n
    assert "'again'+0x8" in runtime().ctl.describe_offset(me, _offset(sig))
    shmemx.aclshmem_barrier_all()


@pytest.mark.parametrize("n", [1, 2])
def test_word_resolution_follows_the_heap(run_ok, n):
    run_ok(n, _word_resolution_follows_the_heap)


def _bad_signal_arguments():
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    sig = shmemx.zeros(4, np.int32, name="sig")
    with pytest.raises(ValueError, match=f"pe {me}: aclshmemx_signal_op: pe {n} out of range 0..{n - 1}"):
        shmemx.aclshmemx_signal_op(sig, 1, SET, n)
    with pytest.raises(ValueError, match="sig_op 2 is not ACLSHMEM_SIGNAL_SET"):
        shmemx.aclshmemx_signal_op(sig, 1, 2, me)
    with pytest.raises(ValueError, match="value 4294967296 does not fit the word's dtype int32"):
        shmemx.aclshmemx_signal_op(sig, 2**32, SET, me)
    with pytest.raises(TypeError, match="has dtype float32"):
        shmemx.aclshmemx_signal_op(shmemx.zeros(2, np.float32), 1, SET, me)
    with pytest.raises(ValueError, match="not on the symmetric heap"):
        shmemx.aclshmemx_signal_op(np.zeros(2, np.int32), 1, SET, me)
    with pytest.raises(ValueError, match="not 4-byte aligned"):
        shmemx.aclshmem_wait_until(sig.view(np.uint8)[2:6].view(np.int32), EQ, 0)
    for bad_cmp in (6, -1, True):
        with pytest.raises(ValueError, match=f"comparison {bad_cmp!r} is not one of"):
            shmemx.aclshmem_wait_until(sig, bad_cmp, 0)
    with pytest.raises(ValueError, match="is empty"):
        shmemx.aclshmem_signal_wait_until(sig[:0], EQ, 0)
    with pytest.raises(ValueError, match="value -1 does not fit the word's dtype uint64"):
        shmemx.aclshmem_test(shmemx.zeros(1, np.uint64), EQ, -1)
    assert not sig.any()  # nothing was written by the calls that raised


def test_bad_signal_arguments(run_ok):
    run_ok(2, _bad_signal_arguments)


# --- test / test_all / any / some and the wait_until_* family ----------------------------------------------


def _test_family():
    shmemx.init()
    me = shmemx.my_pe()
    ivars = shmemx.zeros(6, np.int64, name="ivars")
    ivars[:] = [0, 5 + me, 0, 7 + me, 0, 9 + me]
    none, mask_zeros = np.zeros(6, np.int32), np.array([1, 0, 1, 0, 1, 0])
    assert shmemx.aclshmem_test(ivars[1:], EQ, 5 + me) and not shmemx.aclshmem_test(ivars[1:], NE, 5 + me)
    assert not shmemx.aclshmem_test_all(ivars, NE, 0)
    assert shmemx.aclshmem_test_all(ivars, NE, 0, mask_zeros)  # the zero words are excluded
    assert shmemx.aclshmem_test_any(ivars, GT, 4) == 1
    assert shmemx.aclshmem_test_any(ivars, GT, 4, [0, 1, 0, 0, 0, 0]) == 3
    assert shmemx.aclshmem_test_any(ivars, GT, 100) is None
    assert shmemx.aclshmem_test_any(ivars, GT, 4, np.ones(6)) is None
    assert shmemx.aclshmem_test_some(ivars, GT, 4) == [1, 3, 5]
    assert shmemx.aclshmem_test_some(ivars, GE, 7 + me, none) == [3, 5]
    assert shmemx.aclshmem_test_some(ivars, LT, 0) == []
    assert shmemx.aclshmem_test_some(ivars, EQ, [0, 5 + me, 1, 7 + me, 1, 1]) == [0, 1, 3]  # vector values
    # conditions already met: the waits return at once, with the same answers as the tests
    shmemx.aclshmem_wait_until_all(ivars, GE, 0)
    assert shmemx.aclshmem_wait_until_any(ivars, GT, 4, [0, 1, 0, 0, 0, 0]) == 3
    assert shmemx.aclshmem_wait_until_some(ivars, GT, 4, [0, 0, 0, 0, 0, 1]) == [1, 3]
    # empty sets: an empty array, or every word excluded by the status mask
    empty = ivars[:0]
    for words, status in ((empty, None), (ivars, np.ones(6))):
        assert shmemx.aclshmem_test_all(words, EQ, 12345, status)
        assert shmemx.aclshmem_test_any(words, EQ, 0, status) is None
        assert shmemx.aclshmem_test_some(words, EQ, 0, status) == []
        started = time.monotonic()
        assert shmemx.aclshmem_wait_until_all(words, EQ, 12345, status) is None
        assert shmemx.aclshmem_wait_until_any(words, EQ, 12345, status) is None
        assert shmemx.aclshmem_wait_until_some(words, EQ, 12345, status) == []
        assert time.monotonic() - started < 1.0
    with pytest.raises(ValueError, match="status has shape"):
        shmemx.aclshmem_test_all(ivars, EQ, 0, [0, 0])
    with pytest.raises(TypeError, match="ivars must be a 1-D heap array"):
        shmemx.aclshmem_wait_until_all(ivars.reshape(2, 3), EQ, 0)
    assert ivars.tolist() == [0, 5 + me, 0, 7 + me, 0, 9 + me]  # the tests never write


@pytest.mark.parametrize("n", [1, 2])
def test_test_family_and_empty_sets(run_ok, n):
    run_ok(n, _test_family)


def _wait_family_blocks():
    """PE me-1 sets words of PE me one at a time while PE me sleeps in wait_until_any / some / all."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    src, dst = (me - 1) % n, (me + 1) % n
    ivars = shmemx.zeros(8, np.int32, name="ivars")
    offset = _offset(ivars)
    status = np.zeros(8, np.int8)
    status[0] = 1  # word 0 is excluded: setting it must not end any wait
    mine = 1 + src % 7  # the word PE src sets first, named by its pe
    for call, phase in ((WaitCall.WAIT_UNTIL_ANY, 1), (WaitCall.WAIT_UNTIL_SOME, 2), (WaitCall.WAIT_UNTIL_ALL, 3)):
        if me != 0:
            _wait_phase(call, phase, ivars, status, mine)
        if n > 1:
            _await_sleeping(dst, call, offset)
        _wake_phase(phase, ivars, dst, 1 + me % 7)
        if me == 0:
            _wait_phase(call, phase, ivars, status, mine)
    shmemx.aclshmem_barrier_all()


def _wake_phase(phase: int, ivars: np.ndarray, dst: int, first: int) -> None:
    shmemx.aclshmemx_signal_op(ivars[0:1], phase, SET, dst)  # excluded by status: wakes, but must not satisfy
    if phase == 3:  # the remaining words, one at a time
        for i in range(1, 8):
            shmemx.aclshmemx_signal_op(ivars[i:i + 1], phase, SET, dst)
    else:
        shmemx.aclshmemx_signal_op(ivars[first:first + 1], phase, SET, dst)


def _wait_phase(call: WaitCall, phase: int, ivars: np.ndarray, status: np.ndarray, first: int) -> None:
    if call == WaitCall.WAIT_UNTIL_ANY:
        assert shmemx.aclshmem_wait_until_any(ivars, EQ, phase, status) == first
    elif call == WaitCall.WAIT_UNTIL_SOME:
        got = shmemx.aclshmem_wait_until_some(ivars, EQ, phase, status)
        assert got == [first], got
    else:
        assert shmemx.aclshmem_wait_until_all(ivars, EQ, phase, status) is None
        assert (ivars == phase).all()


@pytest.mark.parametrize("n", N_PES)
def test_wait_until_any_some_all_block_and_wake(run_ok, n):
    run_ok(n, _wait_family_blocks)


def _wait_on_peer_word():
    """A wait on a peer's word (through aclshmem_ptr) sleeps on that peer's wake word and wakes on its change."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    flag = shmemx.zeros(1, np.uint64, name="flag")
    shmemx.aclshmem_barrier_all()
    if me == 0 and n > 1:
        _await_sleeping(1, WaitCall.SIGNAL_WAIT_UNTIL, _offset(flag))
    if me == 0:  # PE 0 sets its own word; every other PE sleeps on it
        shmemx.aclshmemx_signal_op(flag, 7, SET, 0)
    else:
        assert shmemx.aclshmem_signal_wait_until(shmemx.aclshmem_ptr(flag, 0), EQ, 7) == 7
    shmemx.aclshmem_barrier_all()
    _assert_no_sleepers(me)


def _assert_no_sleepers(pe: int) -> None:
    """Every wait on PE ``pe``'s wake word has ended: both of its sleeper counts are back at 0."""
    block = runtime().ctl.pes[pe]
    assert (int(block["n_sleepers"]), int(block["n_remote_sleepers"])) == (0, 0), \
        f"pe {pe}: sleeper counts {int(block['n_sleepers'])} / {int(block['n_remote_sleepers'])} after every wait"


@pytest.mark.parametrize("n", [2, 8])
def test_wait_on_a_peers_word(run_ok, n):
    run_ok(n, _wait_on_peer_word)


def _token_ring(rounds: int):
    """A token passed around all PEs ``rounds`` times with signal_op SET / signal_wait_until EQ."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    token = shmemx.zeros(1, np.int64, name="token")
    shmemx.aclshmem_barrier_all()
    started = time.monotonic()
    for r in range(1, rounds + 1):  # the token names the round and the PE that passed it on
        if me == 0:
            shmemx.aclshmemx_signal_op(token, 100 * r + me, SET, (me + 1) % n)
        assert shmemx.aclshmem_signal_wait_until(token, EQ, 100 * r + (me - 1) % n) == 100 * r + (me - 1) % n
        if me != 0:
            shmemx.aclshmemx_signal_op(token, 100 * r + me, SET, (me + 1) % n)
    elapsed = time.monotonic() - started
    # a lost wake-up would cost the 0.25 s backstop of the sleep; the whole ring takes milliseconds
    assert elapsed < 0.25 * rounds / 4, f"{rounds} rounds took {elapsed:.2f} s: wake-ups are late or lost"
    shmemx.aclshmem_barrier_all()


@pytest.mark.parametrize("n", [2, 8])
def test_wake_ups_are_prompt_without_spinning(run_ok, n):
    run_ok(n, _token_ring, 40, env={"SHMEMX_SPIN_US": "0"})


def _block_rings(rounds: int, blocks: int, plain: bool = True):
    """``blocks`` token rings at once, one per AIV block and word: the blocks of a PE sleep on its wake word
    together, counting themselves in and out of n_sleepers concurrently (``plain=False``: as a free-threaded
    build does, with atomic adds on n_remote_sleepers)."""
    waits._PLAIN_SLEEPERS = plain
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    tokens = shmemx.zeros(blocks, np.int64, name="tokens")
    shmemx.aclshmem_barrier_all()

    def ring() -> None:
        b = shmemx.get_block_idx()
        word = tokens[b:b + 1]
        for r in range(1, rounds + 1):
            if me == 0:
                shmemx.aclshmemx_signal_op(word, r, SET, (me + 1) % n)
            assert shmemx.aclshmem_signal_wait_until(word, EQ, r) == r
            if me != 0:
                shmemx.aclshmemx_signal_op(word, r, SET, (me + 1) % n)

    started = time.monotonic()
    shmemx.launch(ring, blocks)
    elapsed = time.monotonic() - started
    assert elapsed < 0.25 * rounds / 4, f"{rounds} rounds took {elapsed:.2f} s: wake-ups are late or lost"
    shmemx.aclshmem_barrier_all()
    _assert_no_sleepers(me)


@pytest.mark.parametrize("n,plain", [(2, True), (8, True), (8, False)])
def test_blocks_sleeping_together_keep_the_sleeper_count(run_ok, n, plain):
    run_ok(n, _block_rings, 30, 4, plain, env={"SHMEMX_SPIN_US": "0"})


def test_futex_wake_add_bumps_the_word_and_wakes_its_sleeper():
    """One FUTEX_WAKE_OP call adds 1 (mod 2**32) to the word and wakes a process asleep on it."""
    mm = mmap.mmap(-1, 4096)  # shared with the forked child
    words = np.frombuffer(mm, np.uint32, count=2)
    addr = atomics.address_of(mm)
    words[0] = 0xFFFF_FFFF
    pid = os.fork()
    if pid == 0:  # the sleeper: records whether it was woken (True) rather than timed out (False)
        code = 1
        try:
            words[1] = 1 + futex.futex_wait(addr, 0xFFFF_FFFF, 10.0)
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 10
    while _state(pid) != "S":  # asleep: the child's only blocking call is the futex wait
        assert time.monotonic() < deadline, "the child never went to sleep"
        time.sleep(0.001)
    woken = futex.futex_wake_add(addr)
    _, status = os.waitpid(pid, 0)
    assert status == 0 and int(words[1]) == 2, "the sleeper timed out instead of being woken"
    assert woken == 1 and int(words[0]) == 0  # 0xFFFFFFFF + 1 wraps
    del words
    mm.close()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _blocked_wait_burns_no_cpu():
    """PE 1 sleeps 0.3 s in signal_wait_until; its thread CPU time over that wait stays far below 0.3 s."""
    shmemx.init()
    me = shmemx.my_pe()
    flag = shmemx.zeros(1, np.int32, name="flag")
    used = shmemx.zeros(1, np.float64, name="used")
    shmemx.aclshmem_barrier_all()
    if me == 1:
        cpu = time.thread_time()
        shmemx.aclshmem_signal_wait_until(flag, EQ, 1)
        used[0] = time.thread_time() - cpu
    elif me == 0:
        _await_sleeping(1, WaitCall.SIGNAL_WAIT_UNTIL, _offset(flag))
        time.sleep(0.3)  # the waiter must stay asleep meanwhile: that is what is measured
        shmemx.aclshmemx_signal_op(flag, 1, SET, 1)
    shmemx.aclshmem_barrier_all()
    if me == 1:
        assert used[0] < 0.05, f"a blocked wait used {used[0]:.3f} s of CPU in 0.3 s"


@pytest.mark.parametrize("n", [2, 4])
def test_blocked_wait_burns_no_cpu(run_ok, n):
    run_ok(n, _blocked_wait_burns_no_cpu)


# --- deadlines ---------------------------------------------------------------------------------------------


def _wait_times_out(which: str):
    shmemx.init(timeout=1)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    flags = shmemx.zeros(4, np.int64, name="flags")
    flags[2] = 40 + me
    shmemx.aclshmem_barrier_all()
    started = time.monotonic()
    with pytest.raises(shmemx.WaitTimeoutError) as info:
        if which == "own":
            shmemx.aclshmem_wait_until(flags[2:], EQ, 5)
        else:  # a word of the next PE's heap, through aclshmem_ptr
            shmemx.aclshmem_signal_wait_until(shmemx.aclshmem_ptr(flags[2:3], (me + 1) % n), GT, 99)
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 3.0, elapsed
    assert isinstance(info.value, shmemx.ShmemError) and isinstance(info.value, TimeoutError)
    message = str(info.value)
    if which == "own":
        expect = f"pe {me}: wait_until on 'flags'+0x10 == 5: current value {40 + me} (waited 1."
    else:
        peer = (me + 1) % n
        owner = f" of pe {peer}" if peer != me else ""
        expect = f"pe {me}: signal_wait_until on 'flags'+0x10{owner} > 99: current value {40 + peer} (waited 1."
    assert message.startswith(expect), message
    assert int(runtime().ctl.pes[me]["waits"][0]["call"]) == 0  # the wait slot was cleared
    shmemx.aclshmem_barrier_all()


@pytest.mark.parametrize("n,which", [(1, "own"), (2, "own"), (4, "own"), (8, "own"), (2, "peer"), (8, "peer")])
def test_wait_timeout_names_pe_address_condition_value(run_ok, n, which):
    run_ok(n, _wait_times_out, which)


def _wait_all_strided():
    """wait_until_all on a strided column of words (every other PE sets its own word of PE 0's column, one at a
    time; the status mask leaves PE 0's out) sleeps and wakes once all are in; past the deadline it names the
    words; no sleeper count is left behind."""
    shmemx.init(timeout=1)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    slots = shmemx.zeros((n, 4), np.uint64, name="slots")
    status = np.zeros(n, np.int32)
    status[0] = 1  # PE 0 does not signal itself
    shmemx.aclshmem_barrier_all()
    if me == 0:
        shmemx.aclshmem_wait_until_all(slots[:, 0], GE, 5, status)
        assert (slots[1:, 0] == 5).all()
        with pytest.raises(shmemx.WaitTimeoutError) as info:
            shmemx.aclshmem_wait_until_all(slots[:, 0], GE, 6, status)
        assert f"wait_until_all on {n - 1} words at 'slots'" in str(info.value), str(info.value)
    else:  # one at a time, after PE 0 went to sleep
        time.sleep(0.05 * me)
        shmemx.aclshmemx_signal_op(slots[me, 0:1], 5, SET, 0)
        time.sleep(1.2)  # PE 0's second wait times out meanwhile (the barrier below has the same 1 s deadline)
    shmemx.aclshmem_barrier_all()
    _assert_no_sleepers(me)


@pytest.mark.parametrize("n", [2, 5])
def test_wait_until_all_strided_words(run_ok, n):
    run_ok(n, _wait_all_strided)


def test_comparison_and_signal_constants_are_int_enums():
    """``ACLSHMEM_CMP_*`` and ``ACLSHMEM_SIGNAL_*`` are members of ``CmpOp`` / ``SignalOp`` with CANN's values."""
    import enum

    assert [(m.name, int(m)) for m in shmemx.CmpOp] == [("EQ", 0), ("NE", 1), ("GT", 2), ("GE", 3), ("LT", 4),
                                                       ("LE", 5)]
    assert [(m.name, int(m)) for m in shmemx.SignalOp] == [("SET", 0), ("ADD", 1)]
    assert issubclass(shmemx.CmpOp, enum.IntEnum) and issubclass(shmemx.SignalOp, enum.IntEnum)
    for name in ("EQ", "NE", "GT", "GE", "LT", "LE"):
        assert getattr(shmemx, f"ACLSHMEM_CMP_{name}") is shmemx.CmpOp[name]
    assert (shmemx.ACLSHMEM_SIGNAL_SET, shmemx.ACLSHMEM_SIGNAL_ADD) == tuple(shmemx.SignalOp) == (0, 1)
    assert {"CmpOp", "SignalOp", "ACLSHMEM_CMP_EQ", "ACLSHMEM_SIGNAL_ADD"} <= set(shmemx.__all__)


def test_grace_period_adapts_to_pes_per_core():
    from shmemx.shm.waits import GRACE, grace_period

    assert grace_period(1, 2) == 2 * GRACE and grace_period(2, 2) == GRACE and grace_period(3, 4) > GRACE
    assert grace_period(3, 2) == 0.0 and grace_period(8, 2) == 0.0 and grace_period(128, 2) == 0.0
    assert abs(grace_period(8, 2, "7") - 7e-6) < 1e-12  # SHMEMX_SPIN_US overrides it


def test_doze_per_word_only_where_pes_outnumber_cores():
    from shmemx.shm.waits import DOZE, doze_per_word

    assert doze_per_word(2, 2) == 0.0 and doze_per_word(8, 2) == DOZE and doze_per_word(256, 2) == DOZE
    assert doze_per_word(8, 2, "0") == 0.0 and abs(doze_per_word(2, 2, "25") - 25e-6) < 1e-12  # SHMEMX_DOZE_US overrides it


def test_native_sleeps_meet_time_out_and_doze():
    """The native sleeps on their own (one process, words a thread writes): sleep (one word) and sleep_all (many
    words, dozing while more than 16 are to come) return (0, value / -1) once met, (1, first unmet) at the
    deadline, (2, ...) when the state word says the job aborts; the sleeper count is back to 0 after each."""
    import threading

    from shmemx.shm import _native

    words = np.zeros(40, np.int64)
    ctl = np.zeros(3, np.uint32)  # wake word, sleeper count, state word
    wake, count, state = (ctl.ctypes.data + 4 * i for i in range(3))
    kind = waits.WORD_KINDS["<i8"]
    active = bytes([1] * 40)

    def write_all():
        for i in range(40):
            time.sleep(0.0005)
            words[i] = 7
        atomics.fetch_add_u32(wake, 1)
        futex.futex_wake(wake)

    for doze_ns in (0, 20_000):
        words[:] = 0
        writer = threading.Thread(target=write_all)
        writer.start()
        got = _native.sleep_all(words.ctypes.data, 8, active, kind, 0, 7, wake, count, False, 10.0, state, 9,
                                0.005, doze_ns)
        writer.join()
        assert got == (0, -1) and ctl[1] == 0, (doze_ns, got)
    words[:] = 0
    words[:5] = 7
    assert _native.sleep_all(words.ctypes.data, 8, active, kind, 0, 7, wake, count, True, 0.02, state, 9, 0.005,
                             20_000) == (1, 5)
    assert _native.sleep(words.ctypes.data + 8 * 5, kind, 0, 7, 0, wake, count, False, 0.02, state, 9, 0.005) \
        == (1, None)
    ctl[2] = 9  # the job aborts
    assert _native.sleep(words.ctypes.data + 8 * 5, kind, 0, 7, 0, wake, count, False, 5.0, state, 9, 0.005)[0] == 2
    ctl[2] = 0
    words[5] = 7
    assert _native.sleep(words.ctypes.data + 8 * 5, kind, 0, 7, 0, wake, count, True, 5.0, state, 9, 0.005) \
        == (0, 7) and ctl[1] == 0


def test_init_timeout_grows_only_for_oversubscribed_jobs():
    from shmemx.runtime import DEFAULT_TIMEOUT, init_timeout

    assert init_timeout(8, 2) == init_timeout(32, 2) == DEFAULT_TIMEOUT
    assert init_timeout(256, 2) == 8 * DEFAULT_TIMEOUT and init_timeout(256, 16) == DEFAULT_TIMEOUT

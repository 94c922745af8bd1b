"""The hold-out set: RMARaceBench-style cases written apart from ``rma_cases`` (the tuning set) and never tuned
against: the same race classes (local buffers of nonblocking calls, remote conflicts, atomics of one or two
widths, completion and synchronisation) with other shapes, dtypes, QPs, PE counts, AIV blocks and calls (MTE,
``aclshmem_ptr``, ``wait_until_any``, the raw queue, generic quiet and fence). Labels follow CANN semantics (see
``rma_cases``): only the quiet of a WQE's QP completes it; barriers, ``aclshmem_quiet`` and ``aclshmem_fence``
complete and order no UDMA work; a put_signal's signal orders its own payload only; UDMA atomics are atomic with
each other per word of one width and race with everything else that touches their bytes unordered.
"""

from __future__ import annotations

import time

import numpy as np

import shmemx
from rma_cases import CAS, EQ, FAA, GE, SET, Case, amo_nbi, end, get, lock, put, start, unlock, use

FENCED = shmemx.OpConfig(cqe=1, se=0, fence=1, odr=shmemx.ACLSHMEMX_UDMA_ODR_SO)


def _rows(pe: int, n: int = 16, dtype=np.int64) -> np.ndarray:
    return (np.arange(n) + 100 * (pe + 1)).astype(dtype)


# --- local buffers -------------------------------------------------------------------------------------------------

def _table_scene(body, at: int = 0, n: int = 16, dtype=np.int64) -> None:
    """Every PE fills a heap ``table`` with its ``_rows``; PE ``at`` runs ``body(table)``: the calls under test."""
    me = start()
    table = shmemx.array(_rows(me, n, dtype), name="table")
    shmemx.aclshmem_barrier_all()
    if me == at:
        body(table)
    end()


def _peek_before_quiet(table):
    mine = np.zeros(16, np.int64)
    shmemx.aclshmemx_udma_get_nbi(mine, table, 16, 1)
    first = int(mine[3])
    shmemx.aclshmemx_udma_quiet(1)


def _sum_after_quiet(table):
    mine = np.zeros(16, np.int64)
    shmemx.aclshmemx_udma_get_nbi(mine, table, 16, 1)
    shmemx.aclshmemx_udma_quiet(1)
    assert int(mine.sum()) == int(_rows(1).sum())


def _get_half_store_other_half(table):
    mine = np.zeros(16, np.int64)
    shmemx.aclshmemx_udma_get_nbi(mine[:8], table[:8], 8, 1)
    mine[8:] = -1
    shmemx.aclshmemx_udma_quiet(1)


def _generic_quiet_then_read(table):
    got = np.zeros(4, np.int32)
    shmemx.aclshmemx_udma_get_nbi(got, table, 4, 0)
    shmemx.aclshmem_quiet()  # completes no UDMA work
    print(got.tolist())
    shmemx.aclshmemx_udma_quiet(0)


def _two_gets(table):
    a, b = np.zeros(8, np.int64), np.zeros(8, np.int64)
    shmemx.aclshmemx_udma_get_nbi(a, table[:8], 8, 1)
    shmemx.aclshmemx_udma_get_nbi(b, table[8:], 8, 1)
    shmemx.aclshmemx_udma_quiet(1)
    assert (np.concatenate([a, b]) == _rows(1)).all()


def h01_get_then_peek():
    _table_scene(_peek_before_quiet)


def h02_get_quiet_sum():
    _table_scene(_sum_after_quiet)


def h03_get_half_store_other_half():
    _table_scene(_get_half_store_other_half)


def _local_put_qp1(quiet: str) -> None:
    me = start(qps=2)
    inbox = shmemx.zeros(32, np.float32, name="inbox")
    if me == 0:
        parcel = np.linspace(0.5, 16.0, 32, dtype=np.float32)
        shmemx.aclshmemx_udma_qp_put_nbi(inbox, parcel, 32, 1, 1)
        if quiet == "qp1":
            shmemx.aclshmemx_udma_qp_quiet(1, 1)
        elif quiet == "qp0":
            shmemx.aclshmemx_udma_quiet(1)
        parcel[:] = 0.0
        shmemx.aclshmemx_udma_qp_quiet(1, 1)
    end()


def h04_put_src_refilled():
    _local_put_qp1("none")


def h05_put_src_refilled_after_wrong_quiet():
    _local_put_qp1("qp0")


def h06_put_src_refilled_after_quiet():
    _local_put_qp1("qp1")


def h07_get_generic_quiet_then_read():
    _table_scene(_generic_quiet_then_read, at=1, n=4, dtype=np.int32)


def h08_two_gets_two_buffers():
    _table_scene(_two_gets)


def _signal_ack(ack_after_read: bool) -> None:
    me = start()
    inbox = shmemx.zeros(8, np.int64, name="inbox")
    ready = shmemx.zeros(1, np.uint64, name="ready")
    ack = shmemx.zeros(1, np.uint64, name="ack")
    if me == 0:
        letter = _rows(0, 8)
        shmemx.aclshmemx_udma_put_signal_nbi(inbox, letter, 8, ready, 7, 1)
        shmemx.aclshmem_signal_wait_until(ack, EQ, 1)
        letter[:] = 0  # reused once the reader said it has the letter
        shmemx.aclshmemx_udma_quiet(1)
    else:
        if not ack_after_read:
            shmemx.aclshmemx_signal_op(ack, 1, SET, 0)
        shmemx.aclshmem_signal_wait_until(ready, EQ, 7)
        use(inbox[0])
        if ack_after_read:
            shmemx.aclshmemx_signal_op(ack, 1, SET, 0)
    end()


def h09_put_signal_source_reused_after_ack():
    _signal_ack(True)


def h10_put_signal_source_reused_after_early_ack():
    _signal_ack(False)


def _faa_poll_then_read(counter):
    old = np.zeros(1, np.uint64)
    q = amo_nbi(old, counter, 1, FAA, 5)
    q.poll()
    assert int(old[0]) == 0


def _cas_read_then_poll(word):
    old = np.full(1, 9, np.uint64)
    q = amo_nbi(old, word, 1, CAS, 3, 0)
    seen = old.item()
    q.poll()


def h11_fetch_into_local_after_poll():
    _word_scene(_faa_poll_then_read, dtype=np.uint64, name="counter")


def h12_cas_into_local_read_early():
    _word_scene(_cas_read_then_poll, dtype=np.uint64)


def _block_reads(buf, quiet_first: bool, table):
    b = shmemx.get_block_idx()
    if b == 0:
        shmemx.aclshmemx_udma_get_nbi(buf, table, 16, 1)
        if quiet_first:
            shmemx.aclshmemx_udma_quiet(1)
        shmemx.sync_all()
        shmemx.sync_all()
        shmemx.aclshmemx_udma_quiet(1)
    else:
        shmemx.sync_all()
        total = buf.sum()
        shmemx.sync_all()


def _blocks(quiet_first: bool) -> None:
    me = start()
    table = shmemx.array(_rows(me), name="table")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        buf = np.zeros(16, np.int64)
        shmemx.launch(_block_reads, 2, buf, quiet_first, table)
    end()


def h13_get_dst_read_by_other_block():
    _blocks(False)


def h14_get_dst_read_by_other_block_after_quiet():
    _blocks(True)


# --- remote memory ---------------------------------------------------------------------------------------------------

def _get_vs_store(elems: slice, store_at: int) -> None:
    me = start()
    vec = shmemx.array(_rows(me, 4), name="vec")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        got = np.zeros(elems.stop - elems.start, np.int64)
        get(got, vec[elems], 1)
    if me == 1:
        vec[store_at] = -5
    end()


def h15_get_vs_store_same_element():
    _get_vs_store(slice(2, 3), 2)


def h16_get_vs_store_other_element():
    _get_vs_store(slice(0, 2), 3)


def _two_putters(overlap: bool) -> None:
    me = start()
    buf = shmemx.zeros(16, np.int32, name="buf")
    shmemx.aclshmem_barrier_all()
    if me in (0, 1):
        at = 0 if overlap else 8 * me
        put(buf[at:at + 8], _rows(me, 8, np.int32), 2)
    end()


def h17_two_puts_disjoint_halves():
    _two_putters(False)


def h18_two_puts_same_range():
    _two_putters(True)


def _signalled(send) -> None:
    """PE 0 sends 24 rows and a signal on ``flag`` with ``send(inbox, data, flag, hdr, one)`` (the calls under
    test), then quiets both QPs; PE 1 waits for the signal and reads the last row."""
    me = start(qps=2)
    inbox = shmemx.zeros(24, np.int64, name="inbox")
    flag = shmemx.zeros(1, np.uint64, name="flag")
    hdr = shmemx.zeros(1, np.int64, name="hdr")
    one = np.ones(1, np.int64)
    if me == 0:
        data = _rows(0, 24)
        send(inbox, data, flag, hdr, one)
        shmemx.aclshmemx_udma_quiet(1)
        shmemx.aclshmemx_udma_qp_quiet(1, 1)
    else:
        shmemx.aclshmem_signal_wait_until(flag, EQ, 1)
        use(inbox[23])
    end()


def _put_signal(inbox, data, flag, hdr, one):
    shmemx.aclshmemx_udma_put_signal_nbi(inbox, data, 24, flag, 1, 1)


def _put_then_signal_op(inbox, data, flag, hdr, one):
    shmemx.aclshmemx_udma_put_nbi(inbox, data, 24, 1)
    shmemx.aclshmemx_signal_op(flag, 1, SET, 1)


def _put_qp1_put_signal_qp0(inbox, data, flag, hdr, one):
    shmemx.aclshmemx_udma_qp_put_nbi(inbox, data, 24, 1, 1)
    shmemx.aclshmemx_udma_put_signal_nbi(hdr, one, 1, flag, 1, 1)


def _put_then_fenced_put_signal(inbox, data, flag, hdr, one):  # a fenced signal on the payload's QP
    shmemx.aclshmemx_udma_put_nbi(inbox, data, 24, 1)
    shmemx.aclshmemx_udma_put_signal_nbi(hdr, one, 1, flag, 1, 1, config=FENCED)


def h19_put_signal_then_read():
    _signalled(_put_signal)


def h20_put_then_signal_op_no_quiet():
    _signalled(_put_then_signal_op)


def h21_signal_on_other_qp():
    _signalled(_put_qp1_put_signal_qp0)


def h22_fenced_signal_same_qp():
    _signalled(_put_then_fenced_put_signal)


def _word_scene(first, second=None, dtype=np.int64, n: int = 1, name: str = "word") -> None:
    """A heap ``word`` (``n`` elements of ``dtype``): PE 0 runs ``first(word)`` and PE 2 ``second(word)``, the
    calls under test, unordered."""
    me = start()
    word = shmemx.zeros(n, dtype, name=name)
    shmemx.aclshmem_barrier_all()
    if me == 0:
        first(word)
    if me == 2 and second is not None:
        second(word)
    end()


def _get_word(word):
    got = np.zeros(1, word.dtype)
    get(got, word[:1], 1)


def _add_word(word):
    shmemx.aclshmemx_udma_atomic_add(word[:1], 3, 1)
    shmemx.aclshmemx_udma_quiet(1)


def _fetch_add_word(word):
    shmemx.aclshmemx_udma_atomic_fetch_add(word[:1], 2, 1)


def _add_int32_half(half: int):
    """An int32 atomic add on half ``half`` of an int64 word, quieted."""
    def add(word):
        shmemx.aclshmemx_udma_atomic_add(word.view(np.int32)[half:half + 1], 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
    return add


def _add_int64_high(word):
    shmemx.aclshmemx_udma_atomic_add(word, 1 << 32, 1)
    shmemx.aclshmemx_udma_quiet(1)


def _inc_uint32_view(word):
    shmemx.aclshmemx_udma_atomic_inc(word.view(np.uint32), 1)
    shmemx.aclshmemx_udma_quiet(1)


def _fetch_inc(word):
    shmemx.aclshmemx_udma_atomic_fetch_inc(word, 1)


def _put_77(word):
    put(word, np.full(1, 77, np.uint64), 1)


def _inc(word):
    shmemx.aclshmemx_udma_atomic_inc(word, 1)
    shmemx.aclshmemx_udma_quiet(1)


def _ptr_store(word):
    shmemx.aclshmem_ptr(word, 1)[0] = 5


def _add_1(word):
    shmemx.aclshmemx_udma_atomic_add(word, 1, 1)
    shmemx.aclshmemx_udma_quiet(1)


def h23_get_vs_atomic_add():
    _word_scene(_get_word, _add_word, n=2)


def h24_fetch_add_vs_fetch_add():
    _word_scene(_fetch_add_word, _fetch_add_word, n=2)


def _write_then_read(write, synced: bool, n: int, dtype, name: str, at: int) -> None:
    """PE 0 writes PE 1's heap array ``name`` with ``write(array)`` (the calls under test), then, when ``synced``,
    sets PE 1's ``flag``; PE 1 reads element ``at`` after waiting for the flag, or after a sleep."""
    me = start()
    data = shmemx.zeros(n, dtype, name=name)
    flag = shmemx.zeros(1, np.uint64, name="flag")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        write(data)
        if synced:
            shmemx.aclshmemx_signal_op(flag, 1, SET, 1)
    else:
        if synced:
            shmemx.aclshmem_signal_wait_until(flag, EQ, 1)
        else:
            time.sleep(0.02)
        use(data[at])
    end()


def _add_11(word):
    shmemx.aclshmemx_udma_atomic_add(word, 11, 1)
    shmemx.aclshmemx_udma_quiet(1)


def _mte_put_rows(buf):
    shmemx.aclshmemx_mte_put_nbi(buf, _rows(0, 8, np.int32), 8, 1)


def h25_atomic_add_vs_plain_load():
    _write_then_read(_add_11, False, 1, np.int64, "word", 0)


def h26_atomic_add_then_signal_then_load():
    _write_then_read(_add_11, True, 1, np.int64, "word", 0)


def h27_int32_high_half_vs_int64():
    _word_scene(_add_int32_half(1), _add_int64_high)


def h28_int32_halves_disjoint():
    _word_scene(_add_int32_half(0), _add_int32_half(1))


def h29_uint32_inc_vs_int32_fetch_inc():
    _word_scene(_inc_uint32_view, _fetch_inc, dtype=np.int32)


def h30_put_over_atomic_word():
    _word_scene(_put_77, _inc, dtype=np.uint64)


def h31_direct_store_vs_atomic():
    _word_scene(_ptr_store, _add_1)


def h32_mte_put_unsynchronized_read():
    _write_then_read(_mte_put_rows, False, 8, np.int32, "buf", 5)


def h33_mte_put_signal_then_read():
    _write_then_read(_mte_put_rows, True, 8, np.int32, "buf", 5)


# --- completion and synchronisation -----------------------------------------------------------------------------------

def _barrier_read(quiet: bool, readers: tuple = (1,), quiet_pes: tuple = (1,)) -> None:
    me = start()
    buf = shmemx.zeros(4, np.int64, name="buf")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        for pe in readers:
            shmemx.aclshmemx_udma_put_nbi(buf, _rows(0, 4), 4, pe)
        if quiet:
            for pe in quiet_pes:
                shmemx.aclshmemx_udma_quiet(pe)
    shmemx.aclshmem_barrier_all()
    if me in readers:
        use(buf[1])
    if me == 0:
        for pe in readers:
            shmemx.aclshmemx_udma_quiet(pe)
    end()


def h34_put_barrier_read():
    _barrier_read(False)


def h35_put_quiet_barrier_read():
    _barrier_read(True)


def h36_put_two_quiet_one_barrier_read():
    _barrier_read(True, readers=(1, 2), quiet_pes=(1,))


def _chain(ordered: bool) -> None:
    me = start()
    buf = shmemx.zeros(4, np.int64, name="buf")
    flags = shmemx.zeros(2, np.uint64, name="flags")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        put(buf, _rows(0, 4), 1)
        shmemx.aclshmemx_signal_op(flags[:1], 1, SET, 1)
    if me == 1:
        if ordered:
            shmemx.aclshmem_signal_wait_until(flags[:1], EQ, 1)
        shmemx.aclshmemx_signal_op(flags[1:], 1, SET, 2)
        if not ordered:
            shmemx.aclshmem_signal_wait_until(flags[:1], EQ, 1)
    if me == 2:
        shmemx.aclshmem_signal_wait_until(flags[1:], EQ, 1)
        got = np.zeros(4, np.int64)
        get(got, buf, 1)
    end()


def h37_transitive_chain():
    _chain(True)


def h38_chain_signalled_too_early():
    _chain(False)


def h39_wait_any_reads_only_its_slot():
    me = start()
    slots = shmemx.zeros((3, 4), np.int64, name="slots")
    flags = shmemx.zeros(3, np.uint64, name="flags")
    shmemx.aclshmem_barrier_all()
    if me in (1, 2):
        shmemx.aclshmemx_udma_put_signal_nbi(slots[me], _rows(me, 4), 4, flags[me:me + 1], 1, 0)
        shmemx.aclshmemx_udma_quiet(0)
    if me == 0:
        status = np.zeros(3, np.int32)
        status[0] = 1
        for _ in range(2):
            i = shmemx.aclshmem_wait_until_any(flags, EQ, 1, status)
            use(slots[i][0])
            status[i] = 1
    end()


def _counter_poll(api: bool) -> None:
    me = start()
    data = shmemx.zeros(4, np.int64, name="data")
    counter = shmemx.zeros(1, np.int64, name="counter")
    shmemx.aclshmem_barrier_all()
    if me == 1:
        put(data, _rows(1, 4), 0)
        shmemx.aclshmemx_udma_atomic_inc(counter, 0)
        shmemx.aclshmemx_udma_quiet(0)
    if me == 0:
        if api:
            shmemx.aclshmem_wait_until(counter, GE, 1)
        else:
            while counter[0] < 1:
                time.sleep(0.0005)
        use(data[2])
    end()


def h40_counter_polled_with_loads():
    _counter_poll(False)


def h41_counter_waited():
    _counter_poll(True)


def h42_locked_read_modify_write():
    me = start()
    total = shmemx.zeros(1, np.int64, name="total")
    word = shmemx.zeros(1, np.int64, name="lock")
    shmemx.aclshmem_barrier_all()
    if me in (0, 2):
        lock(word, 1)
        tmp = np.zeros(1, np.int64)
        get(tmp, total, 1)
        tmp[0] += me + 1
        put(total, tmp, 1)
        unlock(word, 1)
    end()


def h43_same_slot_same_signal_twice():
    me = start()
    slot = shmemx.zeros(4, np.int64, name="slot")
    ready = shmemx.zeros(1, np.uint64, name="ready")
    if me == 0:
        for k in range(2):
            shmemx.aclshmemx_udma_put_signal_nbi(slot, _rows(k, 4), 4, ready, 1, 1)
            shmemx.aclshmemx_udma_quiet(1)
    else:
        for k in range(2):
            shmemx.aclshmem_signal_wait_until(ready, EQ, 1)
            use(slot[0])
    end()


def h44_generic_fence_between_data_and_flag_put():
    me = start()
    data = shmemx.zeros(8, np.int64, name="data")
    flag = shmemx.zeros(1, np.int64, name="flag")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        shmemx.aclshmemx_udma_put_nbi(data, _rows(0, 8), 8, 1)
        shmemx.aclshmem_fence()  # orders no UDMA work
        shmemx.aclshmemx_udma_put_nbi(flag, np.ones(1, np.int64), 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
    else:
        shmemx.aclshmem_wait_until(flag, EQ, 1)
        use(data[7])
    end()


CASES = [
    Case("holdout/01 get into a local array, an element read before the quiet", 2, h01_get_then_peek, "race"),
    Case("holdout/02 get into a local array, summed after the quiet", 2, h02_get_quiet_sum, "safe"),
    Case("holdout/03 get into one half of a local array, the other half stored", 2, h03_get_half_store_other_half,
         "safe"),
    Case("holdout/04 local put source on qp 1 refilled before any quiet", 2, h04_put_src_refilled, "race", qps=2),
    Case("holdout/05 local put source on qp 1 refilled after the quiet of qp 0", 2,
         h05_put_src_refilled_after_wrong_quiet, "race", qps=2),
    Case("holdout/06 local put source on qp 1 refilled after the quiet of qp 1", 2,
         h06_put_src_refilled_after_quiet, "safe", qps=2),
    Case("holdout/07 get into a local array, aclshmem_quiet, read", 2, h07_get_generic_quiet_then_read, "race"),
    Case("holdout/08 two gets into two local arrays, one quiet", 2, h08_two_gets_two_buffers, "safe"),
    Case("holdout/09 put_signal source reused after the reader's ack", 2, h09_put_signal_source_reused_after_ack,
         "safe"),
    Case("holdout/10 put_signal source reused after an ack sent before the read", 2,
         h10_put_signal_source_reused_after_early_ack, "race"),
    Case("holdout/11 raw FAA into a local word, read after the poll", 2, h11_fetch_into_local_after_poll, "safe"),
    Case("holdout/12 raw CAS into a local word, read before the poll", 2, h12_cas_into_local_read_early, "race"),
    Case("holdout/13 get into a local array read by another block before the quiet", 2,
         h13_get_dst_read_by_other_block, "race"),
    Case("holdout/14 get into a local array read by another block after the quiet and sync_all", 2,
         h14_get_dst_read_by_other_block_after_quiet, "safe"),
    Case("holdout/15 get of an element the owner stores", 2, h15_get_vs_store_same_element, "race"),
    Case("holdout/16 get of elements beside the one the owner stores", 2, h16_get_vs_store_other_element, "safe"),
    Case("holdout/17 two puts into the two halves of one array", 3, h17_two_puts_disjoint_halves, "safe"),
    Case("holdout/18 two puts into the same range", 3, h18_two_puts_same_range, "race"),
    Case("holdout/19 put_signal, wait, read", 2, h19_put_signal_then_read, "safe", qps=2),
    Case("holdout/20 put, signal_op without a quiet, wait, read", 2, h20_put_then_signal_op_no_quiet, "race",
         qps=2),
    Case("holdout/21 payload on qp 1, put_signal on qp 0, wait, read", 2, h21_signal_on_other_qp, "race", qps=2),
    Case("holdout/22 payload, fenced put_signal on its qp, wait, read", 2, h22_fenced_signal_same_qp, "safe",
         qps=2),
    Case("holdout/23 get of a word another PE adds to atomically", 3, h23_get_vs_atomic_add, "race"),
    Case("holdout/24 two fetch_adds of one word", 3, h24_fetch_add_vs_fetch_add, "safe"),
    Case("holdout/25 atomic add, plain load by the owner unordered", 2, h25_atomic_add_vs_plain_load, "race"),
    Case("holdout/26 atomic add, quiet, signal, wait, plain load", 2, h26_atomic_add_then_signal_then_load,
         "safe"),
    Case("holdout/27 int32 add on the high half of an int64, int64 add", 3, h27_int32_high_half_vs_int64, "race"),
    Case("holdout/28 int32 adds on the two halves of an int64", 3, h28_int32_halves_disjoint, "safe"),
    Case("holdout/29 uint32 inc and int32 fetch_inc of one word", 3, h29_uint32_inc_vs_int32_fetch_inc, "safe"),
    Case("holdout/30 put over a word another PE increments", 3, h30_put_over_atomic_word, "race"),
    Case("holdout/31 aclshmem_ptr store to a word another PE adds to", 3, h31_direct_store_vs_atomic, "race"),
    Case("holdout/32 MTE put, unsynchronized read", 2, h32_mte_put_unsynchronized_read, "race"),
    Case("holdout/33 MTE put, signal_op, wait, read", 2, h33_mte_put_signal_then_read, "safe"),
    Case("holdout/34 put, barrier, read", 2, h34_put_barrier_read, "race"),
    Case("holdout/35 put, quiet, barrier, read", 2, h35_put_quiet_barrier_read, "safe"),
    Case("holdout/36 puts to two PEs, one quieted, barrier, both read", 3, h36_put_two_quiet_one_barrier_read,
         "race"),
    Case("holdout/37 put, signal, forwarded signal, get", 3, h37_transitive_chain, "safe"),
    Case("holdout/38 forwarded signal sent before the first arrived, get", 3, h38_chain_signalled_too_early,
         "race"),
    Case("holdout/39 wait_until_any, each slot read after its own signal", 3, h39_wait_any_reads_only_its_slot,
         "safe"),
    Case("holdout/40 counter incremented atomically, polled with plain loads", 2, h40_counter_polled_with_loads,
         "race"),
    Case("holdout/41 counter incremented atomically, waited on", 2, h41_counter_waited, "safe"),
    Case("holdout/42 read-modify-write of a total under a CAS lock", 3, h42_locked_read_modify_write, "safe"),
    Case("holdout/43 one slot, the same signal value twice", 2, h43_same_slot_same_signal_twice, "race"),
    Case("holdout/44 data put, aclshmem_fence, flag put, wait on the flag", 2,
         h44_generic_fence_between_data_and_flag_put, "race"),
]

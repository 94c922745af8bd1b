"""The engine-agnostic layer: typed and sized RMA, put with signal (SET and ADD), typed and MTE atomics, strided
copies, UDMA relay, the UB configs; over every engine choice (MTE inside a server and UDMA across; UDMA only;
MTE | SDMA inside a server), with servers of 2 PEs (``SHMEMX_RANKS_PER_SERVER``), and the refusals.

Payloads encode their origin (source PE, element index); counters count arrivals, so a lost or doubled update
shows.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import shmemx

MTE, SDMA, UDMA = shmemx.ACLSHMEM_DATA_OP_MTE, shmemx.ACLSHMEM_DATA_OP_SDMA, shmemx.ACLSHMEM_DATA_OP_UDMA
EQ = shmemx.ACLSHMEM_CMP_EQ
SET, ADD = shmemx.ACLSHMEM_SIGNAL_SET, shmemx.ACLSHMEM_SIGNAL_ADD
TYPES = {"half": np.float16, "float": np.float32, "double": np.float64, "int8": np.int8, "int16": np.int16,
         "int32": np.int32, "int64": np.int64, "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32,
         "uint64": np.uint64, "char": np.int8, "bfloat16": ml_dtypes.bfloat16}


def _init(mask: int) -> tuple[int, int]:
    shmemx.aclshmemx_init_attr(0, shmemx.InitAttr(option_attr=shmemx.OptionalAttr(data_op_engine_type=mask)))
    return shmemx.my_pe(), shmemx.n_pes()


def _reachable(me: int, n: int, mask: int) -> list[int]:
    rps = shmemx.ranks_per_server()
    return [p for p in range(n) if p == me or p // rps == me // rps or mask & UDMA]


def _origin(pe: int, n: int, dtype) -> np.ndarray:
    return ((pe * 8 + np.arange(n)) % 100).astype(dtype)  # small integers: exact in every type


def _quiet_all(me: int, peers: list[int]) -> None:
    """Complete this thread's _nbi calls: UDMA ones to each peer, SDMA ones of its channel."""
    for p in peers:
        engine = shmemx.engine_of(p)
        if engine == shmemx.Engine.UDMA:
            shmemx.aclshmemx_udma_quiet(p)
        elif engine == shmemx.Engine.SDMA:
            shmemx.aclshmemx_sdma_quiet()


def _rma_job(mask: int):
    me, n = _init(mask)
    peers = _reachable(me, n, mask)
    bufs = {t: shmemx.zeros((n, 16), dt, name=t) for t, dt in TYPES.items()}
    for t, dt in TYPES.items():  # typed blocking put, p and g
        for p in peers:
            getattr(shmemx, f"aclshmem_{t}_put")(bufs[t][me], _origin(me, 16, dt), 16, p)
            getattr(shmemx, f"aclshmem_{t}_p")(bufs[t][me, 15:16], dt(me + 1), p)
    shmemx.aclshmem_barrier_all()
    for t, dt in TYPES.items():
        for p in peers:
            want = _origin(p, 16, dt)
            want[15] = dt(p + 1)
            assert np.array_equal(bufs[t][p].view(np.uint8), want.view(np.uint8)), (t, p)
            assert getattr(shmemx, f"aclshmem_{t}_g")(bufs[t][me, 3:4], p) == _origin(me, 16, dt)[3]
    out = np.zeros(8, np.int32)  # strided gets and puts: every other element
    for p in peers:
        shmemx.aclshmem_int32_iget(out, bufs["int32"][p], 1, 2, 8, p)
        assert np.array_equal(out, _origin(p, 16, np.int32)[::2])
    shmemx.aclshmem_barrier_all()
    got = shmemx.zeros(16, np.uint16, name="iput")
    for p in peers:
        if p != me:
            continue
        shmemx.aclshmem_iput16(got, np.arange(8, dtype=np.uint16) + 100, 2, 1, 8, p)
    assert np.array_equal(got[::2], np.arange(8) + 100) and not got[1::2].any()
    # putmem / getmem_nbi and put<N>_nbi: bytes of any dtype
    raw = shmemx.zeros((n, 64), np.uint8, name="raw")
    shmemx.aclshmem_barrier_all()
    for p in peers:
        shmemx.aclshmem_putmem_nbi(raw[me], np.full(64, me + 1, np.uint8), 64, p)
        shmemx.aclshmem_put64_nbi(raw[me, :32], np.full(4, me + 1, np.uint64), 4, p)
    _quiet_all(me, peers)
    shmemx.aclshmem_barrier_all()
    for p in peers:
        assert (raw[p, 32:] == p + 1).all() and (raw[p, :32].view(np.uint64) == p + 1).all()
        back = np.zeros(64, np.uint8)
        shmemx.aclshmem_getmem(back, raw[me], 64, p)
        assert (back[32:] == me + 1).all()
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


@pytest.mark.parametrize("mask", [MTE | UDMA, UDMA, MTE | SDMA])
def test_typed_rma_every_engine(run_ok, monkeypatch, mask):
    monkeypatch.setenv("SHMEMX_RANKS_PER_SERVER", "2")
    run_ok(4, _rma_job, mask, timeout=120)


def _signal_job(mask: int, rounds: int):
    """Every PE puts a payload with an ADD on one counter per PE and a SET on a per-source word, ``rounds``
    times; a PE that sees the counter reach the arrivals sees every payload (checked at each round's count)."""
    me, n = _init(mask)
    peers = _reachable(me, n, mask)
    data = shmemx.zeros((n, 256), np.float32, name="data")
    count = shmemx.zeros(1, np.int32, name="count")  # ADD of a 32-bit word: a fenced FAA over UDMA
    word = shmemx.zeros(n, np.int32, name="word")  # SET of a 32-bit word: a fenced 4-byte WRITE
    word64 = shmemx.zeros(n, np.uint64, name="word64")  # SET of a 64-bit word: one WRITE_WITH_NOTIFY
    senders = [p for p in range(n) if me in _reachable(p, n, mask)]
    shmemx.aclshmem_barrier_all()
    for r in range(1, rounds + 1):
        payload = np.full(256, me * 1000 + r, np.float32)
        for p in peers:
            shmemx.aclshmem_float_put_signal_nbi(data[me], payload, 256, count, 1, ADD, p)
        shmemx.aclshmem_int32_wait_until(count, shmemx.ACLSHMEM_CMP_GE, r * len(senders))
        for s in senders:  # the ADDs of round r cover every sender's payload of round r (or a later one)
            assert data[s, 0] >= s * 1000 + r and data[s, -1] >= s * 1000 + r
        _quiet_all(me, peers)
        shmemx.aclshmem_barrier_all()
    for p in peers:
        shmemx.aclshmem_putmem_signal(data[me], np.full(256, -me, np.float32).view(np.uint8), 1024, word[me:me + 1],
                                      7, SET, p)
        shmemx.aclshmem_put32_signal_nbi(data[me, :8], np.full(8, me, np.float32), 8, word64[me:me + 1], 9, SET, p)
    shmemx.aclshmem_int32_wait_until_all(word, n, [0 if s in senders else 1 for s in range(n)], EQ, 7)
    shmemx.aclshmem_uint64_wait_until_all(word64, n, [0 if s in senders else 1 for s in range(n)], EQ, 9)
    for s in senders:
        assert (data[s, 8:] == -s).all() and (data[s, :8] == s).all()
    _quiet_all(me, peers)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


@pytest.mark.parametrize("mask", [MTE | UDMA, UDMA, MTE | SDMA])
def test_put_signal_set_and_add(run_ok, monkeypatch, mask):
    monkeypatch.setenv("SHMEMX_RANKS_PER_SERVER", "2")
    run_ok(4, _signal_job, mask, 5, timeout=120)


def test_put_signal_add_keeps_payload_order_under_chaos(run_ok, monkeypatch):
    """Chaos reorders what the UDMA rules allow: the fenced signal still lands after its payload."""
    monkeypatch.setenv("SHMEMX_RANKS_PER_SERVER", "1")  # every peer over UDMA
    for seed in (1, 7):
        run_ok(3, _signal_job, UDMA, 4, timeout=180, chaos=seed)


def _atomics_job(mask: int, blocks: int):
    me, n = _init(mask)
    rps = shmemx.ranks_per_server()
    server = [p for p in range(n) if p // rps == me // rps]
    far = [p for p in range(n) if p not in server] if mask & UDMA else []
    c32 = shmemx.zeros(1, np.int32, name="c32")
    small = shmemx.zeros(8, np.int8, name="small")  # int8 at 1, int16 at 2..3 (same aligned word)
    h = shmemx.zeros(4, np.float16, name="h")
    bf = shmemx.zeros(4, ml_dtypes.bfloat16, name="bf")
    f = shmemx.zeros(1, np.float32, name="f")
    bits = shmemx.zeros(1, np.uint64, name="bits")
    shmemx.aclshmem_barrier_all()

    def kernel():  # block b serves the PEs p with p % blocks == b: one submitter per (peer, QP 0)
        b = shmemx.get_block_idx()
        for _ in range(20):
            for p in [p for p in server + far if p % blocks == b]:
                shmemx.aclshmem_int32_atomic_add(c32, 1, p)
                shmemx.aclshmem_float_atomic_add(f, 0.25, p)
                shmemx.aclshmem_uint64_atomic_fetch_or(bits, 1 << me, p)
                if p in server:  # the 1- and 2-byte adds reach the server only
                    shmemx.aclshmem_int8_atomic_add(small[1:2], 1, p)
                    shmemx.aclshmem_int16_atomic_add(small[2:4].view(np.int16), 3, p)
                    shmemx.aclshmem_half_atomic_add(h[1:2], np.float16(0.5), p)
                    shmemx.aclshmem_bfloat16_atomic_add(bf[3:4], ml_dtypes.bfloat16(1), p)

    shmemx.launch(kernel, blocks)
    for p in far:
        shmemx.aclshmemx_udma_quiet(p)
    shmemx.aclshmem_barrier_all()
    senders_here = [p for p in range(n) if me // rps == p // rps]
    all_senders = range(n) if mask & UDMA else senders_here
    assert int(c32[0]) == 20 * len(all_senders) and float(f[0]) == 5.0 * len(all_senders)
    assert int(bits[0]) == sum(1 << p for p in all_senders)
    assert int(small[1]) == 20 * len(senders_here) and int(small[2:4].view(np.int16)[0]) == 60 * len(senders_here)
    assert float(h[1]) == 10.0 * len(senders_here) and float(bf[3]) == 20.0 * len(senders_here)
    assert small[0] == 0 and small[4:].sum() == 0 and h[0] == 0 and bf[2] == 0  # the neighbours untouched
    mine = int(c32[0])  # (every PE's counter holds the same count)
    shmemx.aclshmem_barrier_all()
    target = (me + 1) % n if mask & UDMA else server[(server.index(me) + 1) % len(server)]
    old = shmemx.aclshmem_int32_atomic_compare_swap(c32, mine, -me, target)
    assert int(old) == 20 * len(all_senders)
    assert float(shmemx.aclshmem_float_atomic_swap(f, 1.5, target)) == 5.0 * len(all_senders)
    shmemx.aclshmem_barrier_all()
    assert float(f[0]) == 1.5 and int(shmemx.aclshmem_int32_atomic_fetch(c32, me)) < 1
    # the MTE family directly, on the own PE (UDMA refuses the own PE)
    assert int(shmemx.aclshmemx_mte_atomic_fetch_inc(c32, me)) == int(c32[0]) - 1
    assert int(shmemx.aclshmemx_mte_atomic_swap(bits, 5, me)) == sum(1 << p for p in all_senders)
    assert int(shmemx.aclshmemx_mte_atomic_compare_swap(bits, 5, 6, me)) == 5 and int(bits[0]) == 6
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


@pytest.mark.parametrize("mask", [MTE | UDMA, MTE | SDMA])
def test_typed_atomics(run_ok, monkeypatch, mask):
    monkeypatch.setenv("SHMEMX_RANKS_PER_SERVER", "2")
    run_ok(4, _atomics_job, mask, 2, timeout=120)


def _refusals_job():
    me, n = _init(MTE | SDMA)  # no UDMA: nothing crosses servers
    x = shmemx.zeros(8, np.int32, name="x")
    i8 = shmemx.zeros(4, np.int8, name="i8")
    far = (me + 2) % n
    with pytest.raises(ValueError, match=rf"pe {me}: aclshmem_int32_put to pe {far}: no enabled engine reaches it "
                                         rf"\(pe {far} is on server {far // 2}, this PE on server {me // 2}"):
        shmemx.aclshmem_int32_put(x, x, 8, far)
    with pytest.raises(TypeError, match=rf"pe {me}: aclshmem_float_put: dst has dtype int32, not float"):
        shmemx.aclshmem_float_put(x, x, 8, me)
    with pytest.raises(ValueError, match=rf"SDMA reaches only the PEs of this server"):
        shmemx.aclshmemx_sdma_put_nbi(x, x, 8, far)
    with pytest.raises(ValueError, match="sig_op 5 is not ACLSHMEM_SIGNAL_SET"):
        shmemx.aclshmem_int32_put_signal(x, x, 1, x[:1], 1, 5, me)
    with pytest.raises(ValueError, match=rf"aclshmem_int8_atomic_add to pe {far}: no enabled engine"):
        shmemx.aclshmem_int8_atomic_add(i8, 1, far)
    with pytest.raises(ValueError, match="pe and relay_pe must differ"):
        shmemx.aclshmemx_udma_relay_put_nbi(x, x, 8, far, far)
    with pytest.raises(ValueError, match="ub_size 64 B must be at least 128 B"):
        shmemx.aclshmemx_set_udma_config(0, 64, 0)
    with pytest.raises(ValueError, match="ub_size 100 B must be at least 64 B and a multiple of 64"):
        shmemx.aclshmemx_set_sdma_config(0, 100, 0)
    assert shmemx.aclshmemx_set_mte_config(1024, 4096, 1) == 0
    assert shmemx.ub_config(MTE) == shmemx.UbConfig(1024, 4096, 1)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_refusals_name_pe_engine_and_argument(run_ok, monkeypatch):
    monkeypatch.setenv("SHMEMX_RANKS_PER_SERVER", "2")
    run_ok(4, _refusals_job, timeout=60)


def _strided_relay_job():
    me, n = _init(MTE | UDMA)
    grid = shmemx.zeros((n, 6, 8), np.int32, name="grid")
    src = (me * 100 + np.arange(48, dtype=np.int32)).reshape(6, 8)
    params = shmemx.non_contiguous_copy_param(repeat=3, length=4, src_ld=16, dst_ld=8)  # rows 0, 2, 4: cols 0..3
    for p in range(n):  # MTE to the server, one WQE per row across
        shmemx.aclshmem_int32_put_nbi(grid[me], src, params, p)
    shmemx.aclshmemx_mte_put_nbi(grid[me, 5], src[5], shmemx.non_contiguous_copy_param(2, 2, 4, 4), me)
    for p in range(n):
        if p // 2 != me // 2:
            shmemx.aclshmemx_udma_quiet(p)
    shmemx.aclshmem_barrier_all()
    for s in range(n):
        want = (s * 100 + np.arange(48, dtype=np.int32)).reshape(6, 8)
        assert np.array_equal(grid[s, :3, :4], want[[0, 2, 4], :4]) and not grid[s, :3, 4:].any()
    assert np.array_equal(grid[me, 5, [0, 1, 4, 5]], src[5, [0, 1, 4, 5]])
    relay = shmemx.zeros(4, np.int64, name="relay")  # a relayed put lands like the direct one
    shmemx.aclshmem_barrier_all()
    if n > 2:
        dst, via = (me + 1) % n, (me + 2) % n
        shmemx.aclshmemx_udma_relay_put_nbi(relay[1:2], np.array([me + 10], np.int64), 1, dst, via)
        shmemx.aclshmemx_udma_quiet(dst)
        shmemx.aclshmem_barrier_all()
        assert int(relay[1]) == (me - 1) % n + 10
        back = np.zeros(1, np.int64)
        shmemx.aclshmemx_udma_relay_get_nbi(back, relay[1:2], 1, dst, via)
        shmemx.aclshmemx_udma_quiet(dst)
        assert int(back[0]) == me + 10
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_strided_copies_and_relay(run_ok, monkeypatch):
    monkeypatch.setenv("SHMEMX_RANKS_PER_SERVER", "2")
    run_ok(4, _strided_relay_job, timeout=60)


def test_coverage_of_cann_rows():
    """Every typed family this layer makes exists for each of its CANN types (the counter's bar, in a test)."""
    for t in TYPES:
        for op in ("put", "put_nbi", "get", "get_nbi", "p", "g", "iput", "iget", "put_signal", "put_signal_nbi"):
            assert callable(getattr(shmemx, f"aclshmem_{t}_{op}"))
    for bits in (8, 16, 32, 64, 128):
        for op in ("put{}", "get{}", "put{}_nbi", "get{}_nbi", "iput{}", "iget{}", "put{}_signal",
                   "put{}_signal_nbi"):
            assert callable(getattr(shmemx, "aclshmem_" + op.format(bits)))
    for t in ("float", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "char"):
        for op in ("wait_until", "wait", "wait_until_all", "wait_until_any", "wait_until_some", "test", "test_any",
                   "test_some", "wait_until_all_vector", "test_all_vector"):
            assert callable(getattr(shmemx, f"aclshmem_{t}_{op}"))
    assert set(shmemx.__all__) >= {"aclshmem_int8_atomic_add", "aclshmem_float_atomic_swap",
                                   "aclshmemx_mte_atomic_fetch_add", "aclshmem_team_split_2d"}

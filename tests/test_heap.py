"""The symmetric heap: collective malloc/calloc/align/free, numpy helpers, symmetry checks, exhaustion, aclshmem_ptr.

Every multi-rank body runs through ``launch`` for 1, 2, 4 and 8 PEs and works for any rank count. Payloads encode
the PE that wrote them, so a view that maps to the wrong PE's copy is caught at once.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import shmemx
from shmemx.runtime import runtime

N_PES = [1, 2, 4, 8]
MULTI_PES = [2, 4, 8]

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64, np.float16,
          np.float32, np.float64, np.complex64, np.complex128, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn]


def _address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


def _heap_state():
    """(bytes in use, live allocations) of this PE's heap: what a failed collective must leave unchanged."""
    heap = runtime().heap
    return heap.used, dict(heap.allocations)


def _check_symmetric(arr: np.ndarray, pattern) -> None:
    """Each PE wrote ``pattern(its pe)`` into ``arr``; check every PE's copy through aclshmem_ptr."""
    shmemx.aclshmem_barrier_all()
    for p in range(shmemx.n_pes()):
        np.testing.assert_array_equal(shmemx.aclshmem_ptr(arr, p), pattern(p), err_msg=f"copy of pe {p}")
    shmemx.aclshmem_barrier_all()


# --- malloc / calloc / align / free ------------------------------------------------------------------------


def _malloc_family():
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    a = shmemx.aclshmem_malloc(1000, name="a")
    assert a.dtype == np.uint8 and a.shape == (1000,)
    a[:] = (np.arange(1000) + 31 * me) % 251
    _check_symmetric(a, lambda p: (np.arange(1000) + 31 * p) % 251)

    c = shmemx.aclshmem_calloc(10, 24, name="c")
    assert c.shape == (240,) and not c.any()
    al = shmemx.aclshmem_align(4096, 100, name="al")
    assert al.shape == (100,) and _address(al) % 4096 == 0
    al[:] = me + 1
    _check_symmetric(al, lambda p: np.full(100, p + 1, np.uint8))

    # size 0 is NULL; freeing NULL is a no-op
    assert shmemx.aclshmem_malloc(0) is None
    assert shmemx.aclshmem_calloc(0, 8) is None
    shmemx.aclshmem_free(None)

    # first fit: a freed block is reused at the same offset, and the heap is back where it was
    used = runtime().heap.used
    start_of_a = _address(a)
    shmemx.aclshmem_free(a)
    assert runtime().heap.used == used - 1000
    again = shmemx.aclshmem_malloc(640, name="again")
    assert _address(again) == start_of_a
    again[:] = me
    _check_symmetric(again, lambda p: np.full(640, p, np.uint8))
    for block in (again, al, c):
        shmemx.aclshmem_free(block)
    assert runtime().heap.used == 0 and not runtime().heap.allocations


@pytest.mark.parametrize("n", N_PES)
def test_malloc_calloc_align_free(run_ok, n):
    run_ok(n, _malloc_family)


def _bad_arguments():
    shmemx.init()
    me = shmemx.my_pe()
    for bad in (-1, 1.5, "8", True):
        with pytest.raises(ValueError, match="size must be a non-negative integer"):
            shmemx.aclshmem_malloc(bad)
    with pytest.raises(ValueError, match="power of two, got 48"):
        shmemx.aclshmem_align(48, 64)
    block = shmemx.aclshmem_malloc(256, name="block")
    with pytest.raises(ValueError, match=f"pe {me}: aclshmem_free: pe {me} heap\\+0x40 is not the start"):
        shmemx.aclshmem_free(block[64:])
    with pytest.raises(ValueError, match="not on the symmetric heap"):
        shmemx.aclshmem_free(np.zeros(256, np.uint8))
    with pytest.raises(TypeError, match="must be a numpy array"):
        shmemx.aclshmem_free([1, 2, 3])
    shmemx.aclshmem_free(block)
    with pytest.raises(ValueError, match="not inside a live heap allocation"):
        shmemx.aclshmem_free(block)  # a double free is caught before the collective
    shmemx.aclshmem_barrier_all()


def test_bad_arguments(run_ok):
    run_ok(2, _bad_arguments)


def test_api_before_init_raises():
    """In the pytest process itself (never initialised): every call needs init first."""
    assert not shmemx.is_initialized()
    for call in (shmemx.my_pe, shmemx.n_pes, lambda: shmemx.aclshmem_malloc(8), shmemx.aclshmem_barrier_all):
        with pytest.raises(shmemx.NotInitializedError, match="shmemx.init"):
            call()


# --- numpy helpers, every dtype ----------------------------------------------------------------------------


def _numpy_helpers(dtypes):
    shmemx.init()
    me = shmemx.my_pe()
    for dt in map(np.dtype, dtypes):
        z = shmemx.zeros((3, 5), dt, name=f"z_{dt.name}")
        assert z.shape == (3, 5) and z.dtype == dt and not z.astype(np.float64).any()
        e = shmemx.empty(7, dt)
        assert e.shape == (7,) and e.dtype == dt
        f = shmemx.full((2, 3), me + 1, dt)
        assert f.dtype == dt
        src = (np.arange(12).reshape(3, 4) % 7 + me).astype(dt)
        arr = shmemx.array(src, name="arr")
        assert arr.dtype == dt and arr.shape == (3, 4)
        for a in (z, e, f, arr):
            assert _address(a) % max(dt.alignment, 64) == 0
            assert runtime().heap.locate(a)[0] == me
        # the copies of every PE hold that PE's values (the helpers initialise before anyone returns)
        _check_symmetric(f, lambda p: np.full((2, 3), p + 1, dt))
        _check_symmetric(arr, lambda p: (np.arange(12).reshape(3, 4) % 7 + p).astype(dt))
        for a in (arr, f, e, z):
            shmemx.aclshmem_free(a)
    # full() without a dtype takes the fill value's; 0-size and 0-d arrays are fine too
    assert shmemx.full(4, np.float32(me)).dtype == np.float32
    assert shmemx.zeros((0, 4), np.int32).shape == (0, 4)
    assert shmemx.zeros((), ml_dtypes.bfloat16).shape == ()
    assert runtime().heap.used > 0


@pytest.mark.parametrize("n", N_PES)
def test_numpy_helpers_every_dtype(run_ok, n):
    run_ok(n, _numpy_helpers, DTYPES)


# --- symmetry checks ---------------------------------------------------------------------------------------


def _expect_symmetry_error(call, *match):
    me = shmemx.my_pe()
    state = _heap_state()
    with pytest.raises(shmemx.SymmetryError) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"pe {me}: ") and "the heap is unchanged" in message, message
    for text in match:
        assert text in message, message
    assert _heap_state() == state  # nothing committed, nothing released


def _size_mismatch():
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    keep = shmemx.zeros(16, np.int64, name="keep")
    keep[:] = me
    # only the last PE asks for a different size: every PE must still raise
    _expect_symmetry_error(lambda: shmemx.aclshmem_malloc(128 + 64 * (me == n - 1)), "aclshmem_malloc", "disagree")
    # every PE asks for its own size
    _expect_symmetry_error(lambda: shmemx.aclshmem_malloc(100 + me), f"malloc({100 + me} B")
    # same size, different alignment
    _expect_symmetry_error(lambda: shmemx.aclshmem_align(64 << (me % 2), 64), "align")
    # one PE's request does not fit while the others' do: a symmetry error too, not a half-made allocation
    _expect_symmetry_error(lambda: shmemx.aclshmem_malloc(1 << 20 if me == 0 else 1 << 30), "disagree")
    # malloc on some PEs, free on the others
    doomed = shmemx.aclshmem_malloc(64, name="doomed")
    _expect_symmetry_error(lambda: shmemx.aclshmem_free(doomed) if me == 0 else shmemx.aclshmem_malloc(64))
    # the heap still works: a later symmetric malloc gets the same block everywhere
    later = shmemx.full(8, 100 + me, np.int32, name="later")
    _check_symmetric(later, lambda p: np.full(8, 100 + p, np.int32))
    _check_symmetric(keep, lambda p: np.full(16, p, np.int64))


@pytest.mark.parametrize("n", MULTI_PES)
def test_malloc_size_mismatch_raises_on_every_pe(run_ok, n):
    run_ok(n, _size_mismatch)


def _free_order_mismatch():
    shmemx.init()
    me = shmemx.my_pe()
    a = shmemx.full(32, me, np.int16, name="a")
    b = shmemx.full(32, -me, np.int16, name="b")
    first, second = (a, b) if me == 0 else (b, a)
    _expect_symmetry_error(lambda: shmemx.aclshmem_free(first), "aclshmem_free", "free(heap+")
    # both still allocated, with their contents; freeing in the same order then works
    _check_symmetric(a, lambda p: np.full(32, p, np.int16))
    _check_symmetric(b, lambda p: np.full(32, -p, np.int16))
    shmemx.aclshmem_free(a)
    shmemx.aclshmem_free(b)
    assert runtime().heap.used == 0
    c = shmemx.full(4, me, np.int64)
    _check_symmetric(c, lambda p: np.full(4, p, np.int64))


@pytest.mark.parametrize("n", MULTI_PES)
def test_free_order_mismatch_raises_on_every_pe(run_ok, n):
    run_ok(n, _free_order_mismatch)


# --- exhaustion --------------------------------------------------------------------------------------------


def _exhaustion():
    shmemx.init()
    me = shmemx.my_pe()
    heap = runtime().heap
    assert heap.size == 1 << 20
    half = shmemx.aclshmem_malloc(512 << 10, name="half")
    state = _heap_state()
    with pytest.raises(shmemx.HeapExhaustedError) as info:
        shmemx.aclshmem_malloc(600 << 10, name="too_big")
    message = str(info.value)
    assert isinstance(info.value, MemoryError)
    for text in (f"pe {me}: ", "614400 B", "'too_big'", "heap exhausted", f"{512 << 10} of {1 << 20} B in use",
                 f"largest free block {512 << 10} B", "--heap-size"):
        assert text in message, message
    assert _heap_state() == state
    with pytest.raises(shmemx.HeapExhaustedError, match="2097152 B"):
        shmemx.empty(2 << 20, np.uint8)
    # what fits still fits, exactly up to the last byte
    rest = shmemx.full(512 << 10, me, np.uint8, name="rest")
    _check_symmetric(rest[::4096], lambda p: np.full(128, p, np.uint8))
    with pytest.raises(shmemx.HeapExhaustedError, match="largest free block 0 B"):
        shmemx.aclshmem_malloc(1)
    shmemx.aclshmem_free(half)
    shmemx.aclshmem_free(rest)


@pytest.mark.parametrize("n", N_PES)
def test_heap_exhaustion_names_request_and_space_left(run_ok, n):
    run_ok(n, _exhaustion, heap_size="1M")


# --- aclshmem_ptr ------------------------------------------------------------------------------------------


def _ptr_views():
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    x = shmemx.empty((8, 16), np.int32, name="x")
    x[:] = me * 1000 + np.arange(128).reshape(8, 16)
    shmemx.aclshmem_barrier_all()
    views = {
        "whole": lambda a: a,
        "rows": lambda a: a[2:5],
        "strided 2-D": lambda a: a[1:7:2, ::3],
        "reversed column": lambda a: a[::-1, 5],
        "one element": lambda a: a[3, 4:5],
        "transposed": lambda a: a.T,
        "slice of a slice": lambda a: a[2:6, 3:9][::2, 1:],
        "0-d": lambda a: a[7:8, 15:16].reshape(()),
        "reinterpreted": lambda a: a[4].view(np.int16)[1::2],
    }
    for p in range(n):
        for name, make in views.items():
            view = make(x)
            peer = shmemx.aclshmem_ptr(view, p)
            assert peer.shape == view.shape and peer.strides == view.strides and peer.dtype == view.dtype, name
            expect = make(p * 1000 + np.arange(128, dtype=np.int32).reshape(8, 16))
            np.testing.assert_array_equal(peer, expect, err_msg=f"{name} of pe {p}")
    # stores through the view land in the peer's copy: PE me writes row me of every PE
    y = shmemx.zeros((n, 4), np.int64, name="y")
    for p in range(n):
        shmemx.aclshmem_ptr(y[me, 1:3], p)[:] = [me * 100 + p, me]
    shmemx.aclshmem_barrier_all()
    for q in range(n):
        assert y[q].tolist() == [0, q * 100 + me, q, 0], (q, y[q])
    shmemx.aclshmem_barrier_all()

    # not on the heap, not a view of an allocation, out of range
    with pytest.raises(ValueError, match=f"pe {me}: aclshmem_ptr argument is not on the symmetric heap"):
        shmemx.aclshmem_ptr(np.zeros(4, np.int32), 0)
    with pytest.raises(TypeError, match="must be a numpy array"):
        shmemx.aclshmem_ptr([1, 2], 0)
    for bad_pe in (-1, n, True, 0.0):
        with pytest.raises(ValueError, match=f"pe {bad_pe!r} out of range 0..{n - 1}"):
            shmemx.aclshmem_ptr(x, bad_pe)
    beyond = np.lib.stride_tricks.as_strided(x, shape=(x.size * 2,), strides=(4,))
    with pytest.raises(ValueError, match="not inside a live heap allocation"):
        shmemx.aclshmem_ptr(beyond, 0)
    # freed memory: the old view (and any slice of it) no longer maps
    row = x[3]
    shmemx.aclshmem_free(x)
    for stale in (x, row, x[1:3, ::2]):
        with pytest.raises(ValueError, match="freed, or never allocated"):
            shmemx.aclshmem_ptr(stale, 0)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()
    with pytest.raises(shmemx.ClosedError, match=f"pe {me}: shmemx was finalized"):
        shmemx.aclshmem_ptr(y, 0)


@pytest.mark.parametrize("n", N_PES)
def test_aclshmem_ptr_views(run_ok, n):
    run_ok(n, _ptr_views)


def _prefault_peer_pages():
    import resource

    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    window = shmemx.aclshmem_malloc(4 << 20, name="window", prefault=False)  # 1024 pages, none touched yet
    peer = (me + 1) % n
    view = shmemx.aclshmem_ptr(window, peer)
    half = len(view) // 2

    def faults_while_writing(part) -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        part[:] = me + 1
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    cold = faults_while_writing(view[:half])  # first touch of the peer's pages from this process
    shmemx.prefault(view[half:])  # map the other half now
    warm = faults_while_writing(view[half:])
    assert cold >= 256 and warm < 16, (cold, warm)
    shmemx.aclshmem_barrier_all()
    assert (window == (me - 1) % n + 1).all()  # the writes landed in the peer's memory
    with pytest.raises(ValueError, match="not on the symmetric heap"):
        shmemx.prefault(np.zeros(16))
    shmemx.aclshmem_barrier_all()


@pytest.mark.parametrize("n", [1, 2])
def test_prefault_maps_peer_pages_before_the_first_store(run_ok, n):
    run_ok(n, _prefault_peer_pages)


def _zeros_do_not_touch_pages():
    import os

    shmemx.init()
    me = shmemx.my_pe()
    seg = runtime().heap.segments[me]

    def backed() -> int:  # bytes of this PE's heap file held in memory
        return os.stat(seg.path).st_blocks * 512

    dirty = shmemx.full((8 << 20) + 100, 7, np.uint8, name="dirty")  # touched pages, then freed: recycled below
    offset = _address(dirty) - _address(seg.bytes)
    shmemx.aclshmem_free(dirty)
    before = backed()
    z = shmemx.zeros((8 << 20) + 100, np.uint8, name="zeroed", prefault=False)
    c = shmemx.aclshmem_calloc(3, 1000, name="small")
    assert _address(z) - _address(seg.bytes) == offset  # the same (dirty) bytes came back
    assert backed() < before - (7 << 20), (before, backed())  # its whole pages were released, not written
    assert not z.any() and not c.any()  # and read as zeros, edges included
    shmemx.aclshmem_barrier_all()
    if shmemx.n_pes() > 1:
        assert not shmemx.aclshmem_ptr(z, (me + 1) % shmemx.n_pes()).any()  # a peer's mapping sees the zeros
    shmemx.aclshmem_barrier_all()


@pytest.mark.parametrize("n", [1, 2])
def test_zeros_release_pages_instead_of_writing_them(run_ok, n):
    run_ok(n, _zeros_do_not_touch_pages)

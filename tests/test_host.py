"""The host API: init attributes, aclshmemx_set_qp_num, finalize, barriers, and single-process mode."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import shmemx
from shmemx.runtime import runtime

N_PES = [1, 2, 4, 8]


def _env_pe() -> tuple[int, int]:
    return int(os.environ["SHMEMX_RANK"]), int(os.environ["SHMEMX_SIZE"])


# --- init / finalize ---------------------------------------------------------------------------------------


def _init_attr():
    me, n = _env_pe()
    for call in (shmemx.my_pe, shmemx.n_pes):
        with pytest.raises(shmemx.NotInitializedError):
            call()
    with pytest.raises(ValueError, match=f"attr.my_pe={me + 1} but the launcher started this process as my_pe={me}"):
        shmemx.aclshmemx_init_attr(shmemx.ACLSHMEMX_INIT_WITH_DEFAULT, shmemx.InitAttr(my_pe=me + 1))
    with pytest.raises(ValueError, match=f"attr.n_pes={n * 2} but .* n_pes={n}"):
        shmemx.aclshmemx_init_attr(shmemx.ACLSHMEMX_INIT_WITH_DEFAULT, shmemx.InitAttr(n_pes=n * 2))
    for value in (0, 16):  # a mask of the four engines (3 = MTE | SDMA is valid, as in CANN)
        bad_engine = shmemx.OptionalAttr(data_op_engine_type=value)
        with pytest.raises(ValueError, match=f"data_op_engine_type {value} is not a mask"):
            shmemx.aclshmemx_init_attr(0, shmemx.InitAttr(option_attr=bad_engine))
    with pytest.raises(TypeError, match="must be a shmemx.InitAttr"):
        shmemx.aclshmemx_init_attr(0, {"my_pe": me})
    assert not shmemx.is_initialized()  # failed inits left nothing behind
    attr = shmemx.InitAttr(my_pe=me, n_pes=n, local_mem_size=2 << 20,
                           option_attr=shmemx.OptionalAttr(control_operation_timeout=17.0))
    assert shmemx.aclshmemx_init_attr(shmemx.ACLSHMEMX_INIT_WITH_DEFAULT, attr) == 0
    assert shmemx.is_initialized()
    assert (shmemx.aclshmem_my_pe(), shmemx.aclshmem_n_pes()) == (me, n) == (shmemx.my_pe(), shmemx.n_pes())
    rt = runtime()
    assert rt.heap.size == 2 << 20 and rt.timeout == 17.0
    shmemx.init()  # a second init is a no-op that keeps the first one's settings
    assert runtime() is rt and rt.heap.size == 2 << 20
    with pytest.raises(shmemx.HeapExhaustedError):
        shmemx.aclshmem_malloc(3 << 20)


@pytest.mark.parametrize("n", N_PES)
def test_init_attr(run_ok, n):
    run_ok(n, _init_attr)


def _finalize_idempotent():
    shmemx.init()
    me = shmemx.my_pe()
    a = shmemx.zeros(4, np.int32)
    assert shmemx.finalize() == 0
    assert not shmemx.is_initialized()
    assert shmemx.finalize() == 0 and shmemx.aclshmem_finalize() == 0
    for call in (shmemx.my_pe, shmemx.aclshmem_barrier_all, lambda: shmemx.aclshmem_malloc(8),
                 lambda: shmemx.aclshmem_ptr(a, 0)):
        with pytest.raises(shmemx.ClosedError, match=f"pe {me}: shmemx was finalized"):
            call()
    with pytest.raises(shmemx.ClosedError, match=f"pe {me}: shmemx was finalized; .* cannot init again"):
        shmemx.init()


@pytest.mark.parametrize("n", N_PES)
def test_finalize_is_idempotent(run_ok, n):
    run_ok(n, _finalize_idempotent)


def test_init_settings_precedence(monkeypatch):
    """An argument of init (a keyword, then attr) beats the launcher's environment, which beats the default; an
    attr timeout set to 120 s, the default's value, is still an argument."""
    from shmemx import runtime as rtm

    attr_of = lambda timeout=None, mem=0: shmemx.InitAttr(  # noqa: E731
        local_mem_size=mem, option_attr=shmemx.OptionalAttr(control_operation_timeout=timeout))
    monkeypatch.delenv("SHMEMX_TIMEOUT", raising=False)
    monkeypatch.delenv("SHMEMX_HEAP_SIZE", raising=False)
    assert rtm._timeout(attr_of(), None) == rtm.DEFAULT_TIMEOUT == 120.0
    assert rtm._heap_size(attr_of(), None, None) == rtm.DEFAULT_HEAP_SIZE
    monkeypatch.setenv("SHMEMX_TIMEOUT", "5")
    monkeypatch.setenv("SHMEMX_HEAP_SIZE", "4M")
    assert rtm._timeout(attr_of(), None) == 5.0
    assert rtm._timeout(attr_of(120.0), None) == 120.0  # set explicitly: beats the launcher's 5 s
    assert rtm._timeout(attr_of(17.0), None) == 17.0 and rtm._timeout(attr_of(17.0), 3) == 3.0
    assert rtm._heap_size(attr_of(), None, None) == 4 << 20
    assert rtm._heap_size(attr_of(mem=2 << 20), None, None) == 2 << 20
    assert rtm._heap_size(attr_of(mem=2 << 20), "3M", None) == 3 << 20
    assert rtm._heap_size(attr_of(mem=2 << 20), "3M", "8M") == 8 << 20  # raised to the minimum
    monkeypatch.setenv("SHMEMX_TIMEOUT", "")  # an empty setting is no setting
    assert rtm._timeout(attr_of(), None) == 120.0
    assert rtm.first_set(None, 0, 5) == 0 and rtm.first_set(None, None, "x") == "x"


def _attr_timeout_beats_launcher():
    attr = shmemx.InitAttr(option_attr=shmemx.OptionalAttr(control_operation_timeout=120.0))
    assert float(os.environ["SHMEMX_TIMEOUT"]) != 120.0
    shmemx.aclshmemx_init_attr(shmemx.ACLSHMEMX_INIT_WITH_DEFAULT, attr)
    assert runtime().timeout == 120.0
    shmemx.finalize()


def test_attr_timeout_of_120_s_beats_the_launchers(run_ok):
    run_ok(2, _attr_timeout_beats_launcher)


# --- aclshmemx_set_qp_num ----------------------------------------------------------------------------------


def _qp_num():
    udma = shmemx.ACLSHMEM_DATA_OP_UDMA
    for bad in (0, 33, -1, True, 2.0, "4"):
        with pytest.raises(ValueError, match=f"qp_num {bad!r} out of range 1..32"):
            shmemx.aclshmemx_set_qp_num(udma, bad)
    with pytest.raises(ValueError, match="engine 1 not supported"):
        shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_MTE, 4)
    assert shmemx.aclshmemx_set_qp_num(udma, 32) == 0
    assert shmemx.aclshmemx_set_qp_num(udma, np.int64(4)) == 0  # the last call before init wins
    shmemx.init()
    me = shmemx.my_pe()
    assert runtime().qp_num == 4
    with pytest.raises(ValueError, match=f"pe {me}: aclshmemx_set_qp_num must be called before init .qp_num is 4"):
        shmemx.aclshmemx_set_qp_num(udma, 2)
    assert runtime().qp_num == 4


@pytest.mark.parametrize("n", N_PES)
def test_set_qp_num_validation(run_ok, n):
    run_ok(n, _qp_num)


def _disagree_at_init(what):
    me, n = _env_pe()
    if what == "qp_num":
        shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 2 if me == n - 1 else 1)
        kwargs, listing = {}, ", ".join(f"pe {p}: {2 if p == n - 1 else 1}" for p in range(n))
    else:
        size = (1 << 20) * (1 + me % 2)
        kwargs, listing = {"heap_size": size}, ", ".join(f"pe {p}: {(1 << 20) * (1 + p % 2)}" for p in range(n))
    with pytest.raises(shmemx.SymmetryError) as info:
        shmemx.init(**kwargs)
    assert str(info.value) == f"pe {me}: init: PEs disagree on {what} ({listing})"
    assert not shmemx.is_initialized()
    # a corrected init in the same processes works
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 1)
    shmemx.init(heap_size=1 << 20)
    assert runtime().heap.size == 1 << 20 and runtime().qp_num == 1
    a = shmemx.full(4, me, np.int32)
    shmemx.aclshmem_barrier_all()
    assert (shmemx.aclshmem_ptr(a, (me + 1) % n) == (me + 1) % n).all()
    shmemx.aclshmem_barrier_all()


@pytest.mark.parametrize("what", ["qp_num", "heap_size"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_pes_disagreeing_at_init_get_symmetry_error_on_every_pe(run_ok, n, what):
    run_ok(n, _disagree_at_init, what)


# --- barriers ----------------------------------------------------------------------------------------------


def _barrier_waits_for_last(order: str, rounds: int):
    """No PE leaves a barrier before the last one arrived.

    Each PE records when it arrives and leaves barrier k in every PE's heap (stores through aclshmem_ptr);
    arrival order is forced by sleeping (ascending or descending by PE); after a further barrier every PE
    checks that the earliest departure is later than the latest arrival, and that when it left barrier k, every
    PE's arrival stamp for k was already in its own heap.
    """
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    stamps = shmemx.zeros((rounds, 2, n), np.float64, name="stamps")  # [k, arrive/leave, pe]
    seen = shmemx.zeros((rounds, n), np.int64, name="seen")  # [k, pe] = k + 1 once pe arrived at barrier k
    peers = [(shmemx.aclshmem_ptr(stamps, p), shmemx.aclshmem_ptr(seen, p)) for p in range(n)]
    barrier = shmemx.aclshmem_barrier_all if order != "sync" else shmemx.aclshmem_sync_all
    for k in range(rounds):
        rank_in_order = n - 1 - me if order == "descending" else me
        time.sleep(0.05 * rank_in_order / max(n - 1, 1) if k == 0 else 0.002 * ((me + k) % 3))
        for p_stamps, p_seen in peers:
            p_seen[k, me] = k + 1
        arrive = time.monotonic()
        barrier()
        leave = time.monotonic()
        assert (seen[k] == k + 1).all(), f"left barrier {k} before pes {np.flatnonzero(seen[k] != k + 1)} arrived"
        for p_stamps, _ in peers:
            p_stamps[k, :, me] = arrive, leave
    shmemx.aclshmem_barrier_all()
    for k in range(rounds):
        assert stamps[k, 1].min() >= stamps[k, 0].max(), (k, stamps[k])


@pytest.mark.parametrize("order", ["ascending", "descending", "sync"])
@pytest.mark.parametrize("n", N_PES)
def test_barrier_no_pe_leaves_before_the_last_arrives(run_ok, n, order):
    run_ok(n, _barrier_waits_for_last, order, 10)


def _barrier_times_out():
    """PE n-1 stays out of a barrier: the others' barrier raises after 1 s naming it. Then it arrives late, which
    completes the abandoned barrier, and the next barrier works for everyone."""
    shmemx.init(timeout=1)
    me, n = shmemx.my_pe(), shmemx.n_pes()
    flags = shmemx.zeros(2, np.int64, name="flags")  # [0]: PEs that timed out (on PE n-1), [1]: PE n-1 arrived
    shmemx.aclshmem_barrier_all()
    number = int(runtime().ctl.pes[me]["barriers"]) + 1
    if me != n - 1:
        started = time.monotonic()
        with pytest.raises(shmemx.WaitTimeoutError) as info:
            shmemx.aclshmem_barrier_all()
        assert 1.0 <= time.monotonic() - started < 3.0
        assert str(info.value).startswith(f"pe {me}: barrier_all (barrier #{number}): pe {n - 1} has not arrived "
                                          f"(waited 1."), str(info.value)
        shmemx.aclshmemx_signal_op(flags[0:1], 1, shmemx.ACLSHMEM_SIGNAL_ADD, n - 1)
        shmemx.aclshmem_signal_wait_until(flags[1:2], shmemx.ACLSHMEM_CMP_EQ, 1)
    else:
        deadline = time.monotonic() + 10  # longer than the 1 s wait deadline: poll instead of waiting
        while not shmemx.aclshmem_test(flags[0:1], shmemx.ACLSHMEM_CMP_EQ, n - 1):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        shmemx.aclshmem_barrier_all()  # the last arrival of the barrier the others gave up on: returns at once
        for p in range(n - 1):
            shmemx.aclshmemx_signal_op(flags[1:2], 1, shmemx.ACLSHMEM_SIGNAL_SET, p)
    shmemx.aclshmem_barrier_all()


def test_barrier_timeout_names_the_missing_pe(run_ok):
    run_ok(4, _barrier_times_out)


# --- single-process mode -----------------------------------------------------------------------------------

SINGLE = textwrap.dedent("""
    import os, sys
    import numpy as np
    import shmemx

    shmemx.init(heap_size="1M")
    assert (shmemx.my_pe(), shmemx.n_pes()) == (0, 1)
    sig = shmemx.zeros(2, np.int64, name="sig")
    shmemx.aclshmemx_signal_op(sig[1:], 41, shmemx.ACLSHMEM_SIGNAL_SET, 0)
    shmemx.aclshmemx_signal_op(sig[1:], 1, shmemx.ACLSHMEM_SIGNAL_ADD, 0)
    assert shmemx.aclshmem_signal_wait_until(sig[1:], shmemx.ACLSHMEM_CMP_EQ, 42) == 42
    shmemx.aclshmem_barrier_all()
    job = shmemx.runtime.runtime().job_id
    assert job.startswith(f"{os.getpid():x}")
    mine = {n for n in os.listdir("/dev/shm") if n.startswith(f"shmemx_{job}_")}
    print("has its segments", {f"shmemx_{job}_ctl", f"shmemx_{job}_heap0"} <= mine, "pe", shmemx.my_pe(),
          "of", shmemx.n_pes())
    if sys.argv[1] == "finalize":
        shmemx.finalize()
    elif sys.argv[1] == "raise":
        raise RuntimeError("script fails after init")
""")


@pytest.mark.parametrize("ending", ["finalize", "exit", "raise"])
def test_single_process_mode_without_launcher(tmp_path, ending):
    """``python script.py`` (no launcher) runs as a job of one PE and leaves no segment, however it ends."""
    script = tmp_path / "single.py"
    script.write_text(SINGLE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMEMX_")}
    proc = subprocess.Popen([sys.executable, str(script), ending], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == (1 if ending == "raise" else 0), err
    assert out.splitlines() == ["has its segments True pe 0 of 1"], (out, err)
    if ending == "raise":
        assert "RuntimeError: script fails after init" in err
    assert "finalize at exit failed" not in err
    leaked = [n for n in os.listdir("/dev/shm") if n.startswith(f"shmemx_{proc.pid:x}")]
    assert not leaked, leaked

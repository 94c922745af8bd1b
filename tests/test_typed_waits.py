"""The typed waits and tests for all ten P2P types: each PE stores an origin-encoded value into its slot of every
PE's words (with the typed ``p``, which wakes the waiter), then waits for them with the typed forms (all, any,
some, the vector forms, the status mask) and tests them; the same job under ``--record`` replays without a
warning about its waits, and under ``--check`` without findings."""

from __future__ import annotations

import json

import numpy as np
import pytest

import shmemx

EQ, NE, GE, LT = shmemx.ACLSHMEM_CMP_EQ, shmemx.ACLSHMEM_CMP_NE, shmemx.ACLSHMEM_CMP_GE, shmemx.ACLSHMEM_CMP_LT
P2P = {"float": np.float32, "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
       "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64, "char": np.int8}


def _value(t: str, pe: int):
    """Origin-encoded, and over the signed range where it has one (a sign mistake shows)."""
    if t == "float":
        return np.float32(-1.5 - pe)
    info = np.iinfo(P2P[t])
    return P2P[t](info.min + 3 + pe if info.min < 0 else info.max - 3 - pe)


def _waits_job(full: bool = True):
    """``full``: every form; else one wait per word (what a protocol does: the checker flags a second wait for a
    value already consumed as a stale flag)."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    words = {t: shmemx.zeros(n, dt, name=t) for t, dt in P2P.items()}
    shmemx.aclshmem_barrier_all()
    for t in P2P:
        for p in range(n):
            getattr(shmemx, f"aclshmem_{t}_p")(words[t][me:me + 1], _value(t, me), p)
    for t, dt in P2P.items():
        w, fn = words[t], lambda op: getattr(shmemx, f"aclshmem_{t}_{op}")
        want = np.array([_value(t, p) for p in range(n)], dt)
        fn("wait_until_all_vector")(w, n, None, EQ, want)
        if not full:
            continue
        fn("wait_until")(w[n - 1:n], EQ, want[-1])
        fn("wait")(w[0:1], dt(0))  # until != 0
        assert fn("test")(w[0:1], EQ, want[0]) == 1 and fn("test")(w[0:1], NE, want[0]) == 0
        status = np.zeros(n, np.int32)
        status[0] = 1  # PE 0's word excluded
        assert fn("wait_until_any")(w, n, status, EQ, want[n - 1]) == n - 1
        idx = np.full(n, -1, np.int64)
        assert fn("wait_until_some")(w, n, idx, None, EQ, want[1]) == 1 and idx[0] == 1
        assert fn("test_some_vector")(w, n, idx, status, EQ, want) == n - 1
        assert sorted(idx[:n - 1].tolist()) == list(range(1, n))
        assert fn("test_all_vector")(w, n, None, EQ, want) == 1
        assert fn("test_any")(w, 0, None, EQ, want[0]) == shmemx.SIZE_MAX  # an empty set
        assert fn("test_any_vector")(w, n, None, NE, want) == shmemx.SIZE_MAX
        assert fn("wait_until_any_vector")(w, n, None, EQ, want) in range(n)
        assert fn("wait_until_some_vector")(w, n, idx, None, EQ, want) == n
        fn("wait_until_all")(w, n, None, NE, dt(0))
    if full:  # floats order as floats in the run and in the replay (their bits, read unsigned, would not)
        shmemx.aclshmem_float_wait_until_all(words["float"], n, None, LT, -1.0)
    if not full:
        shmemx.aclshmem_barrier_all()
        shmemx.finalize()
        return
    idx = np.full(n, -1, np.int64)
    lower = shmemx.aclshmem_float_test_some(words["float"], n, idx, None, LT, -1.5 - (n - 1) + 0.5)
    assert lower == 1 and idx[0] == n - 1  # floats compare as floats (a sign-magnitude bit order would not)
    byte = words["uint8"].view("S1")  # char accepts any 1-byte array
    shmemx.aclshmem_char_wait_until_all(byte, n, None, GE, 1)
    with pytest.raises(TypeError, match=rf"pe {me}: aclshmem_int16_wait_until: ivars has dtype int32, not int16"):
        shmemx.aclshmem_int16_wait_until(words["int32"], EQ, 0)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_typed_waits_all_types(run_ok):
    run_ok(4, _waits_job, timeout=90)


def test_typed_waits_replay_and_check(run_job, tmp_path, python):
    import subprocess
    import sys

    rec = tmp_path / "w.rec"
    r = run_job(3, _waits_job, record=str(rec), timeout=120)
    assert r.code == 0, r.report()
    doc = json.loads(subprocess.run([sys.executable, "-m", "shmemx", "replay", str(rec), "--json"],
                                    capture_output=True, text=True, check=True).stdout)
    # every wait met in virtual time by the modelled writes, with the result the run saw (floats as floats);
    # ("test" warnings are the tests that failed in the run: the replay cannot know how many times they polled)
    kinds = {w["kind"] for w in doc["warnings"]}
    assert not kinds & {"never", "unknown", "result"}, doc["warnings"]
    r = run_job(3, _waits_job, False, check=True, timeout=120)
    assert r.code == 0 and "no findings" in r.err, r.report()

"""``--chaos SEED``: the engine's chaos policy reorders for real within the ordering rules, one seed gives one
schedule, completions stay in SQ order with the normal CQE bytes, faults behave as under the normal policy, and
the project's kernels stay correct (the many-seed sweeps and the bars are in ``scripts/check_corpus.py``)."""

from __future__ import annotations

import array
import json

import numpy as np
import pytest

W = 24  # single-word puts to one word, posted while the engine is paused
BIG = 4096  # bytes of the last put (split into pieces)
SO_AT, FENCE_AT = (6, 18), 12
PIECE, HOLD = 1, 2


def _schedule_body() -> None:
    """PE 0 posts W one-word puts to one word of PE 1 (two SO, one fenced) and a 4 KiB put while its engine is
    paused, then resumes and quiets; it prints the decision records and PE 1 prints the word."""
    import shmemx
    from shmemx.runtime import runtime

    shmemx.init()
    me = shmemx.my_pe()
    eng = runtime().udma.engine
    if eng.trace is None:  # the decision records come with the engine's trace (--trace gives one)
        eng.trace = array.array("q")
    word = shmemx.zeros(1, np.int64, name="word")
    big = shmemx.zeros(BIG // 8, np.int64, name="big")
    if me == 0:
        so = shmemx.ACLSHMEMX_UDMA_OP_CONFIG_SO
        fenced = shmemx.OpConfig(cqe=1, se=0, fence=1, odr=shmemx.ACLSHMEMX_UDMA_ODR_NO)
        src = np.arange(BIG // 8, dtype=np.int64) + 1
        q = runtime().udma.qps[1 * runtime().udma.qp_num]
        first = q.head
        eng.pause()
        for i in range(W):
            config = so if i in SO_AT else fenced if i == FENCE_AT else shmemx.ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT
            shmemx.aclshmemx_udma_put_nbi(word, np.array([i + 1], np.int64), 1, 1, config=config)
        shmemx.aclshmemx_udma_put_nbi(big, src, BIG // 8, 1)
        eng.resume()
        shmemx.aclshmemx_udma_quiet(1)
        eng.drain_trace()
        rows = np.frombuffer(eng.decisions, np.int64).reshape(-1, 6)[:, 1:].tolist()
        print("decisions " + json.dumps({"first": first, "policy": eng.policy, "rows": rows}), flush=True)
    shmemx.aclshmem_barrier_all()
    if me == 1:
        assert (big == np.arange(BIG // 8) + 1).all()
        print(f"word {int(word[0])}", flush=True)
    shmemx.finalize()


def _schedule(run_ok, seed):
    out = run_ok(2, _schedule_body, chaos=seed).out
    line = next(x for x in out.splitlines() if "decisions " in x)
    got = json.loads(line.split("decisions ", 1)[1])
    word = int(next(x for x in out.splitlines() if "word " in x).split("word ")[1])
    return got, word


def test_chaos_reorders_within_the_ordering_rules(run_ok):
    splits = 0
    for seed in (1, 2):
        got, word = _schedule(run_ok, seed)
        assert got["policy"] == "chaos"
        first = got["first"]
        pieces = {}
        done_order = []  # WQE indices in completion order (a WQE completes with its last piece)
        for kind, q, pos, a, b in got["rows"]:
            if kind == PIECE:
                k = pos - first
                pieces.setdefault(k, []).append((a, b))
                if sum(hi - lo for lo, hi in pieces[k]) == (8 if k < W else BIG):
                    done_order.append(k)
        assert sorted(done_order) == list(range(W + 1))
        assert done_order != sorted(done_order), "NO WQEs of one QP ran in posting order"
        # the pieces of each WQE cover it exactly once, cut at 8-byte boundaries
        for k, ranges in pieces.items():
            ranges.sort()
            assert ranges[0][0] == 0 and ranges[-1][1] == (8 if k < W else BIG)
            assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:])), ranges
            assert all(lo % 8 == 0 for lo, _ in ranges)
        splits += len(pieces[W]) > 1
        # the rules: a fenced WQE after every earlier one, an SO one after every earlier RO/SO one
        finished = {k: i for i, k in enumerate(done_order)}
        assert all(finished[k] < finished[FENCE_AT] for k in range(FENCE_AT))
        assert finished[SO_AT[0]] < finished[SO_AT[1]]
        # memory agrees: the word holds the value of the one-word put that completed last
        assert word == [k for k in done_order if k < W][-1] + 1
    assert splits, "the 4 KiB put was never split"


def test_one_seed_gives_one_schedule(run_ok):
    a, word_a = _schedule(run_ok, 5)
    b, word_b = _schedule(run_ok, 5)
    c, _ = _schedule(run_ok, 6)
    keep = (PIECE, HOLD)  # (the budget's records depend on the time)
    rows = [[r for r in x["rows"] if r[0] in keep] for x in (a, b, c)]
    rel = [[[r[0], r[1], r[2] - x["first"], r[3], r[4] if r[0] == PIECE else 0] for r in rs]
           for x, rs in zip((a, b, c), rows)]
    assert rel[0] == rel[1] and word_a == word_b
    assert rel[0] != rel[2]


def _cqe_body() -> None:
    """Sixteen puts (one without a CQE) rung at once; the CQEs the quiet consumed, as the layout's words."""
    import shmemx
    from shmemx.runtime import runtime
    from shmemx.udma.layout import C_BYTE_CNT, C_DATA, C_ENTRY_IDX, C_STATUS, C_USER_DATA

    shmemx.init()
    me = shmemx.my_pe()
    dst = shmemx.zeros((16, 64), np.int64, name="dst")
    if me == 0:
        eng = runtime().udma.engine
        q = runtime().udma.qps[1 * runtime().udma.qp_num]
        start = q.cq_tail
        eng.pause()
        quiet_one = shmemx.OpConfig(cqe=0, se=0, fence=0, odr=shmemx.ACLSHMEMX_UDMA_ODR_NO)
        for i in range(16):
            config = quiet_one if i == 7 else shmemx.ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT
            shmemx.aclshmemx_udma_put_nbi(dst[i], np.full(64, i, np.int64), 64, 1, config=config)
        eng.resume()
        shmemx.aclshmemx_udma_quiet(1)
        words = [[int(q.cq32[(start + k) % q.cq_depth][w]) for w in (C_STATUS, C_ENTRY_IDX, C_BYTE_CNT,
                                                                       C_USER_DATA, C_DATA, C_DATA + 1)]
                 for k in range(15)]
        print("cqes " + json.dumps({"policy": eng.policy, "words": words}), flush=True)
    shmemx.aclshmem_barrier_all()
    if me == 1:
        assert all((dst[i] == i).all() for i in range(16))
    shmemx.finalize()


def test_completions_keep_sq_order_and_the_cqe_bytes(run_ok):
    """The plain run keeps the round-robin policy; the chaos run writes the same CQEs (SQ order, entry_idx,
    user_data, byte counts, owner and status words), however it ran the WQEs."""
    def cqes(**kw):
        out = run_ok(2, _cqe_body, **kw).out
        return json.loads(next(x for x in out.splitlines() if "cqes " in x).split("cqes ", 1)[1])

    plain, chaos = cqes(), cqes(chaos=3)
    assert plain["policy"] == "round_robin" and chaos["policy"] == "chaos"
    assert chaos["words"] == plain["words"]


@pytest.mark.parametrize("name", ["_engine_fault", "_engine_fault_in_a_vector_run"])
def test_engine_faults_under_chaos(name, run_ok):
    """An engine fault becomes an error CQE at its WQE, the queue flushes and works afterwards, as in order."""
    import test_udma

    for seed in (1, 2):
        run_ok(2, getattr(test_udma, name), chaos=seed)


def test_moe_kernels_stay_correct_under_chaos(run_ok):
    """DeepEP-style dispatch + combine (the CI schedules, quantised rows, error paths) checked against the
    reference under two seeds."""
    from test_moe import CI_SCHEDULES, _moe_job

    for seed in (1, 2):
        run_ok(4, _moe_job, CI_SCHEDULES[4], ["random"], True, True, chaos=seed, timeout=240)


def test_cam_kernels_stay_correct_under_chaos(run_ok):
    from test_cam import HEAP, _pairs

    run_ok(4, _pairs, 4, 2, 2, ["", "one_expert"], heap_size=HEAP, chaos=1, timeout=240)


def test_the_trace_shows_the_decisions(run_ok, tmp_path):
    """--trace under --chaos: the scheduler's decisions on the engine track, one completion per WQE."""
    path = tmp_path / "trace.json"
    run_ok(2, _schedule_body, chaos=1, trace=str(path))
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    chaos = [e for e in events if e.get("cat") == "chaos"]
    assert any(e["name"] == "chaos piece" for e in chaos) and any(e["name"].startswith("chaos hold") for e in chaos)
    done = [e for e in events if e.get("cat") == "wqe" and e["ph"] == "X" and e["pid"] == 1]
    posted = [e for e in events if e.get("cat") == "wqe" and e["ph"] == "i" and e["pid"] == 1]
    assert sorted(e["args"]["pos"] for e in done) == sorted(e["args"]["pos"] for e in posted)


# --- starving writes: a plain WRITE waits until the other queues were quiet; the barrier's laggard -------------

STARVE, RELEASE = 6, 7


def _starve_body() -> None:
    """PE 0 rings a plain 512-B put on QP 2 and a put_signal on QP 1 to PE 1 while its engine is paused, then
    resumes and quiets both; it prints the decision records (with their times) and the two queues' indices."""
    import shmemx
    from shmemx.runtime import runtime

    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 4)
    shmemx.init()
    eng = runtime().udma.engine
    if eng.trace is None:
        eng.trace = array.array("q")
    data = shmemx.zeros(64, np.int64, name="data")
    head = shmemx.zeros(1, np.int64, name="head")
    flag = shmemx.zeros(1, np.uint64, name="flag")
    if shmemx.my_pe() == 0:
        qp_num = runtime().udma.qp_num
        eng.pause()
        shmemx.aclshmemx_udma_qp_put_nbi(data, np.arange(64, dtype=np.int64), 64, 1, 2)
        shmemx.aclshmemx_udma_qp_put_signal_nbi(head, np.ones(1, np.int64), 1, flag, 1, 1, 1)
        eng.resume()
        shmemx.aclshmemx_udma_qp_quiet(1, 1)
        shmemx.aclshmemx_udma_qp_quiet(1, 2)
        eng.drain_trace()
        rows = np.frombuffer(eng.decisions, np.int64).reshape(-1, 6).tolist()
        print("decisions " + json.dumps({"data": qp_num + 2, "signal": qp_num + 1, "rows": rows}), flush=True)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_a_starving_write_runs_after_the_other_queue_was_quiet(run_ok):
    starved = 0
    for seed in range(1, 7):
        out = run_ok(2, _starve_body, chaos=seed).out
        got = json.loads(next(x for x in out.splitlines() if "decisions " in x).split("decisions ", 1)[1])
        rows = got["rows"]
        starve = [r for r in rows if r[1] == STARVE and r[2] == got["data"]]
        if not starve:
            continue
        starved += 1
        quiet = starve[0][4]
        signal = [r[0] for r in rows if r[1] == PIECE and r[2] == got["signal"]]
        data = [r[0] for r in rows if r[1] == PIECE and r[2] == got["data"]]
        release = [r for r in rows if r[1] == RELEASE and r[2] == got["data"]]
        assert signal and data and release, rows
        assert max(signal) < min(data), "the put_signal on the other QP did not land before the starving put"
        assert release[0][5] == 1 and release[0][0] - max(signal) >= quiet, (release, signal, quiet)
    assert starved, "no seed of 1..6 starved the plain put"


def test_one_pe_lags_at_a_barrier_exit_the_same_draw_on_every_pe(monkeypatch):
    from shmemx.udma import chaos

    slept = {}
    for pe in range(4):
        jit = chaos.Jitter(7, pe)
        monkeypatch.setattr(jit, "_sleep", lambda pause, pe=pe: slept.setdefault(number, []).append((pe, pause)))
        monkeypatch.setattr(jit, "jitter", lambda: None)
        for number in range(1, 41):
            jit.barrier_exit(number, 4)
    assert all(len(v) == 1 for v in slept.values()), slept  # one laggard per barrier, or none
    assert 30 <= len(slept) <= 40 and len({v[0][0] for v in slept.values()}) == 4
    assert all(5e-4 <= v[0][1] <= 3e-3 for v in slept.values())


def test_the_sleep_budget_is_a_bucket_refilled_at_the_share_over_the_pes(monkeypatch):
    """A PE's threads sleep at most BUDGET_BASE at once; the budget refills at BUDGET_SHARE / n_pes of the time
    that passes and never beyond BUDGET_BASE, so a long quiet stretch does not buy a long burst of sleeps."""
    from shmemx.udma import chaos

    clock, slept = [100.0], []
    monkeypatch.setattr(chaos.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(chaos.time, "sleep", lambda s: slept.append(s))
    jit = chaos.Jitter(1, 0, n_pes=8)
    pause = chaos.BUDGET_BASE / 4
    for _ in range(6):
        jit._sleep(pause)
    assert slept.count(pause) == 4 and slept.count(0) == 2  # the base, then only yields
    clock[0] += 1000.0  # a long quiet stretch refills the budget to the base, no further
    slept.clear()
    for _ in range(6):
        jit._sleep(pause)
    assert slept.count(pause) == 4
    clock[0] += pause * 8 / chaos.BUDGET_SHARE * 1.001  # refills one pause at the share over 8 PEs
    slept.clear()
    jit._sleep(pause)
    jit._sleep(pause)
    assert slept == [pause, 0]

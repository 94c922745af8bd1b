"""``--check``: every bug class of the corpus is reported with its kind and allocation, every twin is clean, and the
project's own kernels run clean (the heavier sweeps are in ``scripts/check_corpus.py``)."""

from __future__ import annotations

import glob
import json
import os

import pytest

from check_corpus import CASES


def _findings(run_job, tmp_path, n, body, *args, **kw):
    result = run_job(n, body, *args, check=True, dump_dir=str(tmp_path), **kw)
    found = []
    for path in glob.glob(os.path.join(tmp_path, "shmemx-check-*.jsonl")):
        with open(path) as f:
            found += [json.loads(line) for line in f]
        os.unlink(path)
    return result, found


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bug_is_reported(case, run_job, tmp_path, no_leak):
    result, found = _findings(run_job, tmp_path, case.n_pes, case.bug)
    hits = [f for f in found if f["kind"] == case.kind and f["severity"] == case.severity]
    assert hits, result.report() + f"\nfindings: {[f['kind'] for f in found]}"
    assert any((f["allocation"] or "") == case.allocation for f in hits), [f["text"] for f in hits]
    lines = [line for line in result.err.splitlines() if line.startswith("shmemx check:")]
    assert any(case.kind in line for line in lines), result.err
    assert result.code == case.code, result.report()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_twin_is_clean(case, run_job, tmp_path, no_leak):
    result, found = _findings(run_job, tmp_path, case.n_pes, case.twin)
    assert result.code == 0, result.report()
    assert not found, [f["text"] for f in found]
    assert "--check: no findings" in result.err, result.err


# --- the project's kernels run clean (all of them, at 8 PEs: scripts/check_kernels.py) -------------------------

def _clean(result, found):
    assert result.code == 0, result.report()
    errors = [f["text"] for f in found if f["severity"] == "error"]
    assert not errors, "\n".join(errors)


def test_moe_kernels_are_clean(run_job, tmp_path, no_leak):
    """DeepEP-style dispatch + combine: the CI schedules, quantised rows, error paths, zero copy and cached."""
    from test_moe import CI_SCHEDULES, _moe_job, _zero_copy_job

    _clean(*_findings(run_job, tmp_path, 4, _moe_job, CI_SCHEDULES[4], ["random"], True, True, timeout=240))
    _clean(*_findings(run_job, tmp_path, 2, _zero_copy_job, timeout=240))


def test_cam_kernels_are_clean(run_job, tmp_path, no_leak):
    """CAM window mode: dispatch + combine pairs (bf16, fp16, a skewed routing), and the int8 path."""
    from test_cam import HEAP, _pairs, _quant_and_diagnose

    _clean(*_findings(run_job, tmp_path, 4, _pairs, 4, 2, 2, ["", "one_expert"], heap_size=HEAP, timeout=240))
    _clean(*_findings(run_job, tmp_path, 4, _quant_and_diagnose, 3, 2, heap_size="880M", timeout=240))


def test_flag_demo_is_found_and_its_fix_is_clean(tmp_path, python):
    """The README's worked example, through the real command: the finding line, exit 3; the fix: exit 0."""
    import subprocess

    demo = os.path.join(os.path.dirname(__file__), "..", "scripts", "examples", "flag_demo.py")
    env = dict(os.environ, SHMEMX_DUMP_DIR=str(tmp_path))
    bug = subprocess.run([python, "-m", "shmemx", "run", "-n", "2", "--check", demo], capture_output=True, text=True,
                         env=env, timeout=120)
    assert bug.returncode == 3, bug.stderr
    line = next(x for x in bug.stderr.splitlines() if x.startswith("shmemx check:"))
    assert "quiet-wrong-qp" in line and "'inbox'+0x0" in line and "flag_demo.py:26" in line and "qp 1" in line
    assert "aclshmemx_udma_qp_quiet(1, 1)" in line
    assert glob.glob(os.path.join(tmp_path, "shmemx-check-*.jsonl"))
    fixed = subprocess.run([python, "-m", "shmemx", "run", "-n", "2", "--check", demo, "--fixed"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert fixed.returncode == 0 and "no findings" in fixed.stderr, fixed.stderr


@pytest.mark.parametrize("example", ["udma_hello.py", "allgather.py"])
def test_examples_with_views_handed_to_the_api_are_clean(example, tmp_path, python):
    """Heap views made for an API call and dead after it (``signals[qp:qp + 1]`` handed to a native post) are not
    reads of the kernel; an API function held in a variable (``get = getattr(shmemx, ...)``) and an array handed
    to a kernel function (``consume(b, out)``) are not accesses of the calling line."""
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "examples", example)
    env = dict(os.environ, SHMEMX_DUMP_DIR=str(tmp_path))
    proc = subprocess.run([python, "-m", "shmemx", "run", "-n", "4", "--check", script], capture_output=True,
                          text=True, env=env, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0 and "no findings" in proc.stderr, proc.stderr[-3000:]


def _reads_body(lines: dict) -> None:
    """PE 0 puts into PE 1's inbox and never signals; PE 1 reads it every way numpy lets Python see (one per
    line, recorded in ``lines``); each read must be a finding at its own line."""
    import inspect
    import time

    import numpy as np

    import shmemx

    shmemx.init()
    me = shmemx.my_pe()
    inbox = shmemx.zeros((4, 16), np.int64, name="inbox")
    local = np.zeros((4, 16), np.int64)
    if me == 0:
        shmemx.aclshmemx_udma_put_nbi(inbox, np.ones((4, 16), np.int64), 64, 1)
        shmemx.aclshmemx_udma_quiet(1)
    else:
        time.sleep(0.05)
        here = inspect.currentframe()
        checks = [
            lambda: inbox.copy(),
            lambda: int(inbox[1, 2]),
            lambda: (inbox == 1).all(),
            lambda: np.array_equal(inbox, local),
            lambda: inbox.sum(),
            lambda: inbox.tolist(),
            lambda: np.copyto(local, inbox),
            lambda: local.__setitem__(slice(None), inbox[0:2].reshape(2, 16)[0]),
            lambda: np.take(inbox, [0, 3], axis=0),
            lambda: inbox[[1, 2]],
        ]
        del here
        for check in checks:
            check()
            lines.setdefault("lines", []).append(check.__code__.co_firstlineno)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_reads_are_observed(run_job, tmp_path, no_leak):
    import inspect

    src, first = inspect.getsourcelines(_reads_body)
    want = [first + i for i, line in enumerate(src) if line.strip().startswith("lambda:")]
    result, found = _findings(run_job, tmp_path, 2, _reads_body, {})
    assert result.code == 3, result.report()
    seen = {f["a"]["line"] for f in found if f["kind"] == "unsynchronized-read"}
    missing = [line for line in want if line not in seen]
    assert not missing, (missing, sorted(seen), [f["text"][:200] for f in found])


# --- --chaos: the seed reaches every rank, random picks one and prints it; twins stay correct under chaos ------

def _chaos_body(out: dict) -> None:
    import shmemx
    from shmemx.runtime import runtime

    shmemx.init()
    chaos = runtime().chaos
    print(f"seed {chaos.seed if chaos is not None else None} pe {shmemx.my_pe()} "
          f"draws {[round(chaos.rng().random(), 6) for _ in range(3)] if chaos is not None else None}")
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_chaos_seed_reaches_every_rank_and_fixes_the_draws(run_ok):
    first = run_ok(3, _chaos_body, {}, chaos=1234)
    again = run_ok(3, _chaos_body, {}, chaos=1234)
    other = run_ok(3, _chaos_body, {}, chaos=99)
    lines = sorted(line.split("] ", 1)[-1] for line in first.out.splitlines() if "seed" in line)
    assert [line.split()[1] for line in lines] == ["1234"] * 3
    assert lines == sorted(line.split("] ", 1)[-1] for line in again.out.splitlines() if "seed" in line)
    assert lines != sorted(line.split("] ", 1)[-1] for line in other.out.splitlines() if "seed" in line)
    assert len({line.split("draws")[1] for line in lines}) == 3  # each PE (and block) has a generator of its own


def test_chaos_random_picks_and_prints_a_seed(tmp_path, python):
    import subprocess

    script = tmp_path / "seed.py"
    script.write_text("import shmemx\nfrom shmemx.runtime import runtime\nshmemx.init()\n"
                      "print('rank seed', runtime().chaos.seed)\nshmemx.finalize()\n")
    proc = subprocess.run([python, "-m", "shmemx", "run", "-n", "2", "--chaos", "random", str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    seed = int(proc.stderr.split("chaos seed ")[1].split()[0])
    assert f"--chaos {seed}" in proc.stderr
    assert proc.stdout.count(f"rank seed {seed}") == 2
    bad = subprocess.run([python, "-m", "shmemx", "run", "-n", "2", "--chaos", "often", str(script)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--chaos" in bad.stderr


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_twins_stay_correct_and_clean_under_chaos(seed, run_job, tmp_path, no_leak):
    """Every twin, under --check and the chaos engine (scripts/check_corpus.py runs 20 seeds)."""
    for case in CASES:
        result, found = _findings(run_job, tmp_path, case.n_pes, case.twin, chaos=seed)
        assert result.code == 0 and not found, (case.name, result.report(), [f["text"] for f in found])


def _row_size_change_job():
    """A fresh bf16 dispatch, then a cached fp8 dispatch through its handle: the same routing, another row size,
    so each source's rows land where other sources' rows were (kernels/moe/dispatch.py gives credits only after
    every block copied out; before, this was a slot-reuse finding)."""
    import numpy as np

    import shmemx
    from shmemx.kernels import moe
    from shmemx.kernels.moe import reference as ref
    from test_moe import CHANNELS, E, H, K, T, _inputs

    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 4)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    buf = moe.Buffer(T, H, K, E, num_channels=CHANNELS, qp_num=4)
    allin = [_inputs(r, n) for r in range(n)]
    x, idx, w = allin[me]
    for _ in range(2):
        res = buf.dispatch(x, topk_idx=idx, topk_weights=w)
        fp8 = ref.per_token_cast_to_fp8(x)
        got = buf.dispatch(fp8, handle=res.handle)
        want = ref.reference_dispatch([ref.per_token_cast_to_fp8(a[0]) for a in allin], [a[1] for a in allin], None,
                                      E, me)
        np.testing.assert_array_equal(got.recv_x[0].view(np.uint8), want.recv_x[0].view(np.uint8))
    buf.close()
    shmemx.finalize()


def test_moe_row_size_change_is_clean(run_job, tmp_path, no_leak):
    _clean(*_findings(run_job, tmp_path, 4, _row_size_change_job, timeout=240))


def test_schedules_are_clean(run_job, tmp_path, no_leak):
    """Every schedule of the schedules helper (fullmesh, groups, hierarchy; scan and compact routing) at 4 PEs in
    2 servers (8 and 16 PEs: scripts/check_kernels.py)."""
    from test_schedules import ALL_NAMES, _schedules_job

    _clean(*_findings(run_job, tmp_path, 4, _schedules_job, 2, ("uniform", "zipf"), ALL_NAMES, 16, 8, timeout=300,
                      heap_size="32M"))


def _landing_and_flag():
    """Init, then 16 float32 of ``landing`` and the uint64 ``arrived`` on every PE, past a barrier: the pair PE 0's
    put_signal fills for PE 1."""
    import numpy as np

    import shmemx

    shmemx.init()
    landing = shmemx.zeros(16, np.float32, name="landing")
    arrived = shmemx.zeros(1, np.uint64, name="arrived")
    shmemx.aclshmem_barrier_all()
    return shmemx.my_pe(), landing, arrived


def _read_before_signal(read_first: bool) -> None:
    """PE 1 reads fresh memory that PE 0's put_signal writes, before waiting for the signal; sleeps choose which of
    the two comes first in time (nothing orders them)."""
    import time

    import numpy as np

    import shmemx

    me, landing, arrived = _landing_and_flag()
    if me == 0:
        if read_first:
            time.sleep(0.3)
        shmemx.aclshmemx_udma_put_signal_nbi(landing, np.ones(16, np.float32), 16, arrived, 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
    else:
        if not read_first:
            time.sleep(0.3)
        float(landing[0:4].sum())  # read before the wait: a bug
        shmemx.aclshmem_signal_wait_until(arrived, shmemx.ACLSHMEM_CMP_EQ, 1)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


@pytest.mark.parametrize("read_first", [True, False], ids=["read-first", "post-first"])
def test_read_racing_a_first_write_has_one_kind_whatever_came_first(read_first, run_job, tmp_path, no_leak):
    """A read of memory no one wrote before, unordered with the WQE that writes it, is an unsynchronized read in
    both time orders (it was reported as slot-reuse, with a credit as the fix, when the read came first)."""
    result, found = _findings(run_job, tmp_path, 2, _read_before_signal, read_first)
    kinds = {f["kind"] for f in found}
    assert kinds == {"unsynchronized-read"}, [f["text"] for f in found]
    assert all(f["allocation"] == "landing" for f in found)
    assert result.code == 3, result.report()


def test_a_refilled_source_is_one_finding_naming_both_lines(run_job, tmp_path, no_leak):
    """A heap source rewritten before its quiet is reported once (the store), not again by the checksum at the
    quiet; a local source's finding (the checksum) names the quiet's line."""
    from check_corpus import source_overwrite, source_overwrite_local

    _, found = _findings(run_job, tmp_path, 2, source_overwrite)
    hits = [f for f in found if f["kind"] == "source-overwrite"]
    assert len(hits) == 1 and hits[0]["count"] == 1, [f["text"] for f in hits]
    _, found = _findings(run_job, tmp_path, 2, source_overwrite_local)
    hits = [f for f in found if f["kind"] == "source-overwrite"]
    assert hits and all("<unknown line>" not in f["text"] and f["a"]["line"] for f in hits), [f["text"] for f in hits]


# --- a rank that dies of an exception: the reads of the heap views its traceback held are logged -----------------

def _dies_holding_a_view() -> None:
    import numpy as np

    import shmemx

    EQ = shmemx.ACLSHMEM_CMP_EQ
    shmemx.init()
    landing = shmemx.zeros(64, np.int64, name="landing")
    arrived = shmemx.zeros(1, np.uint64, name="arrived")
    if shmemx.my_pe() == 0:
        shmemx.aclshmemx_udma_put_signal_nbi(landing, np.arange(64, dtype=np.int64), 64, arrived, 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
        shmemx.aclshmem_barrier_all()
        shmemx.finalize()
    else:
        def compare(got) -> None:  # the heap view, read by C code through np.asarray: logged only when it dies
            plain = np.asarray(got)
            if plain[0] != -1:
                raise AssertionError("pe 1: landing read before its signal")

        compare(landing[8:])  # the bug: no wait on arrived; the assertion ends the rank while the frame holds it
        shmemx.aclshmem_signal_wait_until(arrived, EQ, 1)


def test_a_read_held_by_a_failing_ranks_traceback_is_logged(run_job, tmp_path, no_leak):
    result, found = _findings(run_job, tmp_path, 2, _dies_holding_a_view)
    assert result.code == 1, result.report()
    hits = [f for f in found if f["kind"] == "unsynchronized-read" and (f["allocation"] or "") == "landing"]
    assert hits, (result.report(), [f["text"][:200] for f in found])


def _met_after_another_threads_record() -> None:
    """PE 1 waits (wait_until_all on one word) for PE 0's put_signal, then reads the payload; while it records the
    wait, another thread of PE 1 logs a record between the wait's WAIT and MET records (a block descheduled there
    on a loaded machine)."""
    import threading

    import numpy as np

    import shmemx
    from shmemx.runtime import runtime
    from shmemx.shm.waits import set_thread_slot
    from shmemx.udma.events import Kind

    me, landing, arrived = _landing_and_flag()
    if me == 0:
        shmemx.aclshmemx_udma_put_signal_nbi(landing, np.ones(16, np.float32), 16, arrived, 1, 1)
        shmemx.aclshmemx_udma_quiet(1)
    else:
        log = runtime().events
        put = log.put

        def another(ts):  # a record of block 1 (a JOIN of no launch: it orders nothing)
            set_thread_slot(1)
            put(Kind.JOIN, 0, site=0, ts=ts)

        def put_after_another(kind, *args, **kw):
            if kind == Kind.MET:  # another thread's record lands between this thread's WAIT and MET
                other = threading.Thread(target=another, args=(kw.get("ts", 0),))
                other.start()
                other.join()
            put(kind, *args, **kw)

        log.put = put_after_another
        shmemx.aclshmem_wait_until_all(arrived, shmemx.ACLSHMEM_CMP_EQ, 1)
        log.put = put
        assert float(landing[0:16].sum()) == 16.0
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_a_wait_keeps_its_met_words_when_another_thread_logs_in_between(run_job, tmp_path, no_leak):
    """The threads of a PE share its log: the words that met a wait are found by the waiting thread's own WAIT
    record, not by the record just before (a block descheduled between the two on a loaded machine made its wait
    look met by the word's initial value, and its reads of the payload slot-reuse findings)."""
    result, found = _findings(run_job, tmp_path, 2, _met_after_another_threads_record)
    assert result.code == 0 and not found, [f["text"] for f in found]


def _quiet_put() -> None:
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    x = shmemx.zeros(4, np.int64, name="x")
    shmemx.aclshmemx_udma_put_nbi(x, x, 4, (me + 1) % n)
    shmemx.aclshmemx_udma_quiet((me + 1) % n)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_an_analysis_that_fails_fails_the_job(run_job, monkeypatch, no_leak):
    """A clean job whose --check analysis raises exits 1 with the traceback: it never passes unchecked."""
    import shmemx.launcher.job as job

    def broken(logs, heap):
        raise RuntimeError("analysis bug")

    monkeypatch.setattr(job, "analyze", broken)
    result = run_job(2, _quiet_put, check=True)
    assert result.code == 1, result.report()
    assert "--check: the analysis failed (a shmemx bug)" in result.err and "analysis bug" in result.err

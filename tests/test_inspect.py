"""Inspection: the hang diagnosis and post-mortem dump, live dumps of stalled queues, saved dumps, traces, counters.

Stalls are made deterministic with the engine's ``pause()`` hook: a PE pauses its own DMA engine, posts, and the
WQEs stay in the SQ until it resumes (no sleeps, no races). A live dump is taken from another process (the real
``shmemx dump`` command, started by the stalled rank itself while its WQEs are pending).

Payloads and sizes encode their origin: a WQE's length is ``1 + (7 * k + peer) % 64`` for the k-th put to
``peer``, so a count or byte total that is off by one WQE, or charged to the wrong queue, shows up.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict

import numpy as np
import pytest

import shmemx
from shmemx.observe import dump as dumps
from shmemx.shm.control import Control
from shmemx.observe.counters import TIMERS
from shmemx.runtime import runtime

EQ = shmemx.ACLSHMEM_CMP_EQ
UDMA = shmemx.ACLSHMEM_DATA_OP_UDMA


def _shmemx(*args, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "shmemx", *args], capture_output=True, text=True, timeout=60,
                          **kwargs)
    if check:
        assert proc.returncode == 0, f"shmemx {' '.join(args)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


# --- a hung job: the diagnosis and the post-mortem dump -------------------------------------------------------

HUNG = '''
import numpy as np
import shmemx
from shmemx.runtime import runtime

shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 2)
shmemx.init()
me = shmemx.my_pe()
flags = shmemx.zeros(16, np.uint64, name="flags")
recv = shmemx.zeros(4096, np.uint8, name="recv_x")
src = shmemx.full(64, me, np.uint8, name="src")
shmemx.aclshmem_barrier_all()
if me == 5:
    runtime().udma.engine.pause()  # its WQEs stay in the SQ: the diagnosis must name them
    for i in range(12):
        shmemx.aclshmemx_udma_qp_put_nbi(recv[64 * i:], src, 64, 3, 1)
if me == 3:
    shmemx.aclshmem_signal_wait_until(flags[8:9], shmemx.ACLSHMEM_CMP_EQ, 1)  # nobody ever signals
shmemx.aclshmem_barrier_all()
'''


def test_hung_job_ends_at_timeout_with_diagnosis_and_dump(tmp_path):
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    started = time.monotonic()
    proc = _shmemx("run", "-n", "8", "--timeout", "5", "--dump-dir", str(tmp_path), str(script), check=False,
                   cwd=tmp_path)
    elapsed = time.monotonic() - started
    err = proc.stderr
    assert proc.returncode == 124, err
    assert elapsed < 10, f"an 8-PE job with --timeout 5 took {elapsed:.1f} s to end\n{err}"
    lines = err.splitlines()
    title = lines.index(next(line for line in lines if "timed out after 5 s" in line))
    assert re.search(r"^shmemx:   pe 3 waits in signal_wait_until on 'flags'\+0x40 == 1, current value 0 "
                     r"\(for [0-9.]+ s\)$", err, re.M), err
    assert "shmemx:   pe 5 has 12 WQEs posted, 0 completed on qp 1 to pe 3" in lines, err
    for p in (0, 1, 2, 4, 5, 6, 7):  # pe 5 posted (non-blocking) and went on into the barrier
        assert re.search(rf"^shmemx:   pe {p} waits in barrier_all \(barrier #\d+\) for [0-9.]+ s; not arrived: "
                         rf"pe 3$", err, re.M), err
    found = re.search(r"^shmemx: dump of every queue, wait and allocation: (\S+) \(read it with", err, re.M)
    assert found, err
    assert err.index(found.group(0)) > err.index(lines[title])  # the diagnosis first, then the path

    path = os.path.join(tmp_path, found.group(1))
    doc = dumps.load(path)
    assert doc["reason"] == "timed out after 5 s"
    (wait,) = doc["pes"][3]["waits"]
    flags = next(a for a in doc["pes"][3]["allocations"] if a["name"] == "flags")
    assert (wait["call"], wait["target_pe"], wait["offset"], wait["cmp"], wait["value"], wait["current"]) == \
        ("signal_wait_until", 3, flags["offset"] + 0x40, EQ, 1, 0)
    (queue,) = doc["pes"][5]["queues"]
    assert (queue["peer"], queue["qp"], queue["counts"]["unexecuted_wqes"], len(queue["pending"])) == (3, 1, 12, 12)
    recv = next(a["offset"] for a in doc["pes"][3]["allocations"] if a["name"] == "recv_x")
    assert [w["remote"] for w in queue["pending"]] == [f"pe 3 heap +{recv + 64 * i:#x} ('recv_x'+{64 * i:#x})"
                                                       for i in range(12)]
    # the saved dump reads back as the live one did: the same diagnosis, the same WQEs
    text = _shmemx("dump", "--file", path).stdout
    assert "  pe 5 has 12 WQEs posted, 0 completed on qp 1 to pe 3" in text
    assert "reason: timed out after 5 s" in text
    assert text.count("aclshmemx_udma_qp_put_nbi, block 0: WRITE flag=0x20(odr=NO,cqe)") == 12


# --- a live dump of a stalled queue, from another process ---------------------------------------------------


def _stalled_queue(out_dir: str):
    """pe 0 pauses its engine, posts six WQEs of every kind to pe 1 qp 1 and has `shmemx dump` read them."""
    shmemx.aclshmemx_set_qp_num(UDMA, 2)
    shmemx.init(sq_depth=64)
    me = shmemx.my_pe()
    recv = shmemx.zeros(1024, np.uint8, name="recv_x")
    flags = shmemx.zeros(16, np.uint64, name="flags")
    src = shmemx.full(512, 0x50 + me, np.uint8, name="src")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        rt = runtime()
        rt.udma.engine.pause()
        put = shmemx.aclshmemx_udma_qp_put_nbi
        put(recv[0x40:], src, 64, 1, 1)
        put(recv[0x80:], src[0x10:], 100, 1, 1)
        put(recv[0xC0:], src, 8, 1, 1)
        shmemx.aclshmemx_udma_qp_put_signal_nbi(recv[0x100:], src[0x20:], 32, flags[8:9], 7, 1, 1)
        shmemx.aclshmemx_udma_qp_get_nbi(src[0x100:], recv[0x200:], 16, 1, 1)
        put(recv[0x300:], src, 4, 1, 1, config=shmemx.ACLSHMEMX_UDMA_OP_CONFIG_SO)
        job = rt.job_id
        doc = json.loads(_shmemx("dump", job, "--json").stdout)
        text = _shmemx("dump", job).stdout
        every = json.loads(_shmemx("dump", job, "--json", "--all-queues", "--pe", "0").stdout)
        pe0_text = _shmemx("dump", job, "--pe", "0", "--peer", "1", "--qp", "1").stdout
        snap = dumps.snapshot(_reader(job), limit=-1)  # in-process, then saved and read back by another process
        dumps.save(snap, os.path.join(out_dir, "saved.json"))
        reread = _shmemx("dump", "--file", os.path.join(out_dir, "saved.json")).stdout
        rt.udma.engine.resume()
        shmemx.aclshmemx_udma_qp_quiet(1, 1)
        with open(os.path.join(out_dir, "live.json"), "w") as f:
            json.dump({"doc": doc, "text": text, "every": every, "rendered": dumps.render(snap), "reread": reread,
                       "pe0_text": pe0_text, "expect": _expected(rt)}, f)
    shmemx.aclshmem_barrier_all()
    if me == 1:
        assert (recv[0x40:0x80] == 0x50).all() and flags[8] == 7  # the stalled WQEs did run after resume()


def _reader(job: str):
    from shmemx.observe.reader import JobReader

    return JobReader.attach(job)


def _expected(rt) -> dict:
    q = rt.udma.qp(1, 1)
    pe1 = rt.ctl.pes[1]
    eid = [int(x) for x in pe1["eid"]]
    return {"tp_id": q.tpn, "tid": int(pe1["heap_tid"]), "token": int(pe1["heap_token"]),
            "eid": f"{eid[1] << 64 | eid[0]:#034x}"}


def test_live_dump_shows_the_stalled_wqes_field_by_field(run_ok, no_leak, tmp_path):
    run_ok(2, _stalled_queue, str(tmp_path))
    with open(tmp_path / "live.json") as f:
        got = json.load(f)
    doc, expect = got["doc"], got["expect"]
    assert doc["schema"] == "shmemx-dump/1"
    pe0 = doc["pes"][0]
    (queue,) = pe0["queues"]  # only the non-idle queue of the 2 x 1 x 2 queue pairs
    assert (queue["peer"], queue["qp"]) == (1, 1)
    assert queue["counts"] == {"posted_wqes": 6, "executed_wqes": 0, "unexecuted_wqes": 6, "unexecuted_bbs": 7,
                               "cqes_outstanding": 6, "cqes_unconsumed": 0}
    assert (queue["wq_ctx"]["head"], queue["wq_ctx"]["tail"], queue["wq_ctx"]["cqe_cnt"], queue["engine"]["ci"],
            queue["engine"]["sq_db"]) == (7, 0, 6, 0, 7)
    pending = queue["pending"]
    assert [w["pos"] for w in pending] == [0, 1, 2, 3, 5, 6]
    assert [w["opcode"] for w in pending] == ["WRITE", "WRITE", "WRITE", "WRITE_WITH_NOTIFY", "READ", "WRITE"]
    assert [w["call"] for w in pending] == ["aclshmemx_udma_qp_put_nbi"] * 3 + [
        "aclshmemx_udma_qp_put_signal_nbi", "aclshmemx_udma_qp_get_nbi", "aclshmemx_udma_qp_put_nbi"]
    assert [w["flag"]["odr"] for w in pending] == ["NO"] * 5 + ["SO"]
    assert all(w["flag"]["cqe"] == 1 and w["block"] == 0 and w["bbs"] == (2 if i == 3 else 1)
               for i, w in enumerate(pending))
    for w in pending:
        f = w["fields"]
        assert (f["tp_id"], f["rmt_seg_id"], f["rmt_token_value"], f["rmt_eid"]) == \
            (expect["tp_id"], expect["tid"], expect["token"], expect["eid"]), w
    assert [w["fields"]["sge_len"] for w in pending] == [64, 100, 8, 32, 16, 4]
    assert [w["remote"] for w in pending] == [
        "pe 1 heap +0x40 ('recv_x'+0x40)", "pe 1 heap +0x80 ('recv_x'+0x80)", "pe 1 heap +0xc0 ('recv_x'+0xc0)",
        "pe 1 heap +0x100 ('recv_x'+0x100)", "pe 1 heap +0x200 ('recv_x'+0x200)", "pe 1 heap +0x300 ('recv_x'+0x300)"]
    src_off = next(a["offset"] for a in pe0["allocations"] if a["name"] == "src")
    assert [w["local"] for w in pending] == [f"pe 0 heap +{src_off + d:#x} ('src'+{d:#x})"
                                             for d in (0, 0x10, 0, 0x20, 0x100, 0)]
    assert pending[3]["fields"]["notify_value"] == 7
    flags_off = next(a["offset"] for a in doc["pes"][1]["allocations"] if a["name"] == "flags")
    assert "signal=pe 1 heap +%#x ('flags'+0x40) value=0x7" % (flags_off + 0x40) in pending[3]["text"]
    # text: one line per WQE, every field by name
    text = got["text"]
    assert "queue pe 0 -> pe 1 qp 1 [stalled]: 6 WQEs posted since the last retired CQE, 0 executed, 6 not " \
           "executed" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("BB 1 "))
    assert line.strip().startswith("BB 1 aclshmemx_udma_qp_put_nbi, block 0: WRITE flag=0x20(odr=NO,cqe) "
                                   f"tp_id={expect['tp_id']:#x} tokenId={expect['tid']:#x} eid={expect['eid']} "
                                   f"token={expect['token']:#010x} remote=pe 1 heap +0x80 ('recv_x'+0x80) len=100 "
                                   f"local=pe 0 heap +{src_off + 0x10:#x} ('src'+0x10)"), line
    assert "BB 6 aclshmemx_udma_qp_put_nbi, block 0: WRITE flag=0x26(odr=SO,cqe)" in text
    assert "pe 0 has 6 WQEs posted, 0 completed on qp 1 to pe 1" in text
    # --all-queues lists the idle queue pair too; --pe narrows to one PE
    assert [(q["peer"], q["qp"]) for q in got["every"]["pes"][0]["queues"]] == [(1, 0), (1, 1)]
    assert [p["pe"] for p in got["every"]["pes"]] == [0]
    assert "remote=pe 1 heap +0x80 ('recv_x'+0x80) len=100" in got["pe0_text"]  # named though pe 1 is not shown
    assert "\npe 1:" not in got["pe0_text"] and "pe 0 has 6 WQEs posted" in got["pe0_text"]
    # a saved dump renders exactly as the live document it was saved from
    assert got["reread"] == got["rendered"]


def test_dump_file_that_is_not_a_dump(tmp_path):
    for name, content in (("list.json", "[1, 2]"), ("other.json", '{"schema": "x"}'), ("broken.json", "{")):
        bad = tmp_path / name
        bad.write_text(content)
        with pytest.raises(ValueError, match="not a shmemx dump"):
            dumps.load(str(bad))
        proc = _shmemx("dump", "--file", str(bad), check=False)
        assert proc.returncode == 1 and "not a shmemx dump" in proc.stderr, proc.stderr


# --- an error CQE: the failing rank, the diagnosis, the dump -------------------------------------------------


def _bad_token():
    shmemx.init()
    me = shmemx.my_pe()
    dst = shmemx.zeros(256, np.uint8, name="dst")
    src = shmemx.full(256, 1, np.uint8, name="src")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        q = shmemx.aclshmemx_udma_raw_queue(1, 0)
        wqes = q.build_writes(rmt_va=q.remote_va(dst) + np.arange(3) * 64, sge_len=64, sge_va=q.local_va(src))
        wqes[1, 4] ^= 0xFF  # the second WQE carries a wrong token value
        head = q.reserve(3)
        q.ring_doorbell(q.write(head, wqes), cqes=3)
        q.poll()  # raises CompletionError (TOKEN_MISMATCH)
    shmemx.aclshmem_barrier_all()


def test_error_cqe_post_mortem(run_job, no_leak, tmp_path):
    result = run_job(2, _bad_token, dump_dir=str(tmp_path))
    assert result.code == 1, result.report()
    assert "shmemx: pe 0 failed with exit code 1: CompletionError: pe 0: raw post to pe 1 qp 0 (block 0, WQE at " \
           "BB 1): TOKEN_MISMATCH" in result.err, result.report()
    assert "shmemx:   pe 0 on qp 0 to pe 1: TOKEN_MISMATCH at WQE BB 1 (raw post, block 0), reported" in result.err
    (path,) = tmp_path.glob("shmemx-dump-*.json")
    doc = dumps.load(str(path))
    assert doc["reason"].startswith("pe 0 failed with exit code 1: CompletionError")
    (queue,) = doc["pes"][0]["queues"]
    err = queue["error"]
    assert (err["status"], err["pos"], err["active"], err["wqe"]["opcode"]) == ("TOKEN_MISMATCH", 1, False, "WRITE")
    assert err["wqe"]["fields"]["rmt_token_value"] != doc["pes"][1]["heap_token"]


# --- traces and counters of one known workload -----------------------------------------------------------------

K = 40  # puts per (peer, qp)


def _size(k: int, peer: int) -> int:
    return 1 + (7 * k + peer) % 64


def _workload():
    """Each PE: block b puts K WQEs to every peer on qp b and quiets; then one put_signal per peer on qp 0."""
    shmemx.aclshmemx_set_qp_num(UDMA, 2)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    peers = [p for p in range(n) if p != me]
    dst = shmemx.zeros((n, 2, K, 64), np.uint8, name="dst")
    flags = shmemx.zeros(n, np.uint64, name="flags")
    src = shmemx.full((2, K, 64), me, np.uint8, name="src")

    def kernel():
        qp = shmemx.get_block_idx()
        with shmemx.region(f"send qp {qp}"):
            for peer in peers:
                for k in range(K):
                    shmemx.aclshmemx_udma_qp_put_nbi(dst[me, qp, k], src[qp, k], _size(k, peer), peer, qp)
                shmemx.aclshmemx_udma_qp_quiet(peer, qp)
                shmemx.count("puts", K)

    shmemx.launch(kernel, 2)
    for peer in peers:
        shmemx.aclshmemx_udma_put_signal_nbi(dst[me, 0, 0], src[0, 0], 8, flags[me:me + 1], me + 1, peer)
        shmemx.aclshmemx_udma_quiet(peer)
    for peer in peers:
        shmemx.aclshmem_signal_wait_until(flags[peer:peer + 1], EQ, peer + 1)
    shmemx.aclshmem_barrier_all()
    _check_counters(shmemx.stats(), n)
    shmemx.aclshmem_barrier_all()


def _expected_queue(pe: int, peer: int, qp: int) -> tuple[int, int]:
    """(WQEs, bytes) pe posts to (peer, qp) in ``_workload``."""
    if peer == pe:
        return 0, 0
    wqes, nbytes = K, sum(_size(k, peer) for k in range(K))
    return (wqes + 1, nbytes + 8) if qp == 0 else (wqes, nbytes)


def _check_counters(s, n: int) -> None:
    want_wqes = np.array([[[_expected_queue(p, q, k)[0] for k in range(2)] for q in range(n)] for p in range(n)])
    want_bytes = np.array([[[_expected_queue(p, q, k)[1] for k in range(2)] for q in range(n)] for p in range(n)])
    for name, got, want in (("posted_wqes", s.posted_wqes, want_wqes), ("posted_bytes", s.posted_bytes, want_bytes),
                            ("completed_wqes", s.completed_wqes, want_wqes),
                            ("completed_bytes", s.completed_bytes, want_bytes)):
        assert (got == want).all(), f"pe {shmemx.my_pe()}: {name}:\n{got}\n!=\n{want}"
    assert s.missing == []
    per_block = s.block_posted_wqes
    assert (per_block[:, 0] == K * (n - 1) + (n - 1)).all() and (per_block[:, 1] == K * (n - 1)).all(), per_block[:, :2]
    assert (per_block[:, 2:] == 0).all()
    assert (s.user["puts"].sum(axis=1) == 2 * K * (n - 1)).all(), s.user["puts"][:, :2]
    assert (s.timers["regions"][:, :2] == 1).all() and (s.timers["region_ns"][:, :2] > 0).all()
    assert (s.timers["quiets"][:, 1] == n - 1).all() and (s.timers["quiets"][:, 0] >= 2 * (n - 1)).all()
    # a barrier is counted when it returns, so another PE's last barrier may not be in yet: check mine
    assert s.timers["barriers"][shmemx.my_pe(), 0] >= 1
    totals = s.per_pe()
    assert (totals["wqes_posted"] == want_wqes.sum(axis=(1, 2))).all()
    assert set(totals) >= {f"{t.replace('_ns', '_s')}" for t in TIMERS} | {"user:puts"}


def _every_posting_path():
    """pe 0 posts to pe 1 qp 0 through every path: raw doorbells (small and large), defer/submit, FAA, put_signal."""
    shmemx.init()
    me = shmemx.my_pe()
    dst = shmemx.zeros(4096, np.uint8, name="dst")
    word = shmemx.zeros(2, np.int64, name="word")
    src = shmemx.full(4096, 3, np.uint8, name="src")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        q = shmemx.aclshmemx_udma_raw_queue(1, 0)
        for lengths in (np.arange(1, 6), np.full(40, 10)):  # 5 WQEs read word by word, 40 through numpy
            wqes = q.build_writes(rmt_va=q.remote_va(dst) + 64 * np.arange(len(lengths)), sge_len=lengths,
                                  sge_va=q.local_va(src))
            q.ring_doorbell(q.write(q.reserve(len(wqes)), wqes), cqes=len(wqes))
            q.poll()
        state = shmemx.aclshmemx_submit_state_t()
        for i in range(3):
            kind = shmemx.aclshmemx_submit_t if i == 2 else shmemx.aclshmemx_defer_t
            shmemx.aclshmemx_udma_put_nbi(dst[64 * i:], src, 16, 1, batch=kind(state))
        shmemx.aclshmemx_udma_quiet(1)
        assert shmemx.aclshmemx_udma_atomic_fetch_add(word, 5, 1) == 0  # one FAA (two BBs), quieted
        shmemx.aclshmemx_udma_put_signal_nbi(dst[1024:], src, 24, word[1:], 9, 1)  # two BBs
        shmemx.aclshmemx_udma_quiet(1)
    shmemx.aclshmem_barrier_all()
    s = shmemx.stats()
    want = (5 + 40 + 3 + 1 + 1, 15 + 400 + 3 * 16 + 8 + 24)
    for name, got in (("posted", (s.posted_wqes[0, 1, 0], s.posted_bytes[0, 1, 0])),
                      ("completed", (s.completed_wqes[0, 1, 0], s.completed_bytes[0, 1, 0]))):
        assert tuple(map(int, got)) == want, f"{name} WQEs, bytes {tuple(map(int, got))} != {want}"
    assert int(s.posted_wqes.sum()) == want[0] and int(s.block_posted_wqes[0, 0]) == want[0]
    shmemx.aclshmem_barrier_all()


def test_counters_and_trace_of_every_posting_path(run_ok, no_leak, tmp_path):
    run_ok(2, _every_posting_path, trace=str(tmp_path / "t.json"))
    with open(tmp_path / "t.json") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "wqe" and e["pid"] == 1]
    posts = sorted((e["args"]["pos"], e["args"]["bytes"], e["name"]) for e in events if e["ph"] == "i")
    done = sorted((e["args"]["pos"], e["args"]["bytes"], "post " + e["name"]) for e in events if e["ph"] == "X")
    assert posts == done and len(posts) == 50 and sum(p[1] for p in posts) == 495
    assert [p[2] for p in posts[-2:]] == ["post FAA", "post WRITE_WITH_NOTIFY"] and posts[-1][0] == posts[-2][0] + 2


N_TRACE = 3


@pytest.fixture(scope="module")
def traced_job(tmp_path_factory):
    """The workload on 3 PEs with --trace and --stats; the counters are checked inside every rank."""
    from conftest import _run_job

    path = tmp_path_factory.mktemp("trace") / "out.json"
    result = _run_job(N_TRACE, _workload, trace=str(path), stats=True)
    assert result.code == 0, result.report()
    with open(path) as f:
        return json.load(f), result


def test_counters_equal_the_workload_on_every_pe(traced_job):
    _, result = traced_job  # _check_counters ran in every rank; here the --stats table
    err = result.err
    assert "shmemx: counters of job" in err
    rows = {line.split()[0]: line.split() for line in err.splitlines()
            if re.match(r"^\s*(\d+|avg|max|max pe)\s", line)}
    header = next(line.split() for line in err.splitlines() if line.split()[:2] == ["pe", "wqes_posted"])
    per_pe = sum(_expected_queue(0, q, k)[0] for q in range(N_TRACE) for k in range(2))
    for p in range(N_TRACE):
        assert rows[str(p)][header.index("wqes_posted")] == f"{per_pe:,}", err
        assert rows[str(p)][header.index("wqes_completed")] == f"{per_pe:,}", err
        assert rows[str(p)][header.index("puts")] == f"{2 * K * (N_TRACE - 1):,}", err
    assert "max" in rows and "avg" in rows


def test_trace_has_perfetto_structure_and_one_post_complete_pair_per_wqe(traced_job):
    doc, _ = traced_job
    events = doc["traceEvents"]
    assert doc["displayTimeUnit"] == "ns" and doc["otherData"]["missing_pes"] == []
    for e in events:
        assert {"ph", "pid", "name"} <= set(e) and isinstance(e["pid"], int), e
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
        if e["ph"] == "i":
            assert e["s"] == "t", e
    meta = {(e["pid"], e.get("tid"), e["name"]): e["args"] for e in events if e["ph"] == "M"}
    assert {meta[(pe + 1, None, "process_name")]["name"] for pe in range(N_TRACE)} == {f"pe {p}" for p in
                                                                                        range(N_TRACE)}
    threads = {(pid, tid): a["name"] for (pid, tid, name), a in meta.items() if name == "thread_name"}
    for pe in range(N_TRACE):
        pid = pe + 1
        assert threads[(pid, pid * 100000)] == "block 0" and threads[(pid, pid * 100000 + 1)] == "block 1"
        for peer in range(N_TRACE):
            for qp in range(2):
                if peer != pe:
                    assert threads[(pid, pid * 100000 + 1000 + peer * 2 + qp)] == f"-> pe {peer} qp {qp}"
    posts, completes = defaultdict(list), defaultdict(list)
    queue_of = {(pid, tid): name for (pid, tid), name in threads.items() if name.startswith("-> pe")}
    for e in events:
        if e.get("cat") != "wqe":
            continue
        if e["ph"] == "i":
            a = e["args"]
            posts[(e["pid"] - 1, a["peer"], a["qp"])].append((a["pos"], a["bytes"], e["ts"]))
        else:
            peer, qp = map(int, re.match(r"-> pe (\d+) qp (\d+)", queue_of[(e["pid"], e["tid"])]).groups())
            completes[(e["pid"] - 1, peer, qp)].append((e["args"]["pos"], e["args"]["bytes"], e["ts"], e["dur"]))
    for pe in range(N_TRACE):
        for peer in range(N_TRACE):
            for qp in range(2):
                wqes, nbytes = _expected_queue(pe, peer, qp)
                key = (pe, peer, qp)
                if not wqes:
                    assert key not in posts and key not in completes
                    continue
                p, c = sorted(posts[key]), sorted(completes[key])
                bbs = [1] * K + ([2] if qp == 0 else [])  # the put_signal is one two-BB WQE
                positions = list(np.cumsum([0] + bbs[:-1]))
                assert [x[0] for x in p] == positions == [x[0] for x in c], key  # exactly one post, one complete
                assert sum(x[1] for x in p) == nbytes == sum(x[1] for x in c), key
                assert all(post[2] <= done[2] + done[3] for post, done in zip(p, c)), key  # posted before done
                ends = [x[2] + x[3] for x in c]
                assert all(c[i + 1][2] >= ends[i] for i in range(len(c) - 1)), key  # in order, never overlapping
    cats = Counter(e.get("cat") for e in events)
    assert cats["region"] == 2 * N_TRACE and cats["engine"] > 0 and cats["quiet"] >= 3 * 2 * (N_TRACE - 1)
    waits = [e for e in events if e.get("cat") == "wait"]
    assert len(waits) == N_TRACE * (N_TRACE - 1)  # every signal_wait_until, blocked or not
    assert all(e["args"]["cmp"] == "==" and e["args"]["where"].startswith("'flags'+") for e in waits)
    assert {e["name"] for e in events if e.get("cat") == "barrier"} >= {"init", "malloc", "barrier_all", "finalize"}


# --- shmemx ps / clean ---------------------------------------------------------------------------------------------


def _lists_itself():
    shmemx.init()
    if shmemx.my_pe() == 0:
        job = runtime().job_id
        jobs = {j["job"]: j for j in json.loads(_shmemx("ps", "--json").stdout)}
        me = jobs[job]
        assert (me["n_pes"], me["state"], me["stale"], me["pes"]) == (2, "RUNNING", False, {"READY": 2}), me
        text = _shmemx("ps").stdout
        assert re.search(rf"^{job}\s+2\s+running\s", text, re.M), text
        refused = _shmemx("clean", job, check=False)
        assert refused.returncode == 1 and "is alive" in refused.stderr, refused.stderr
    shmemx.aclshmem_barrier_all()


def test_ps_lists_a_running_job(run_ok, no_leak):
    run_ok(2, _lists_itself)


def test_ps_shows_a_stale_job_and_clean_removes_it(no_leak):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    job = f"{os.getpid():x}dead{dead.pid % 1000:03d}"
    ctl = Control.create(job, 3, heap_size=1 << 20, timeout=0.0, script="left_behind.py")
    ctl.header["launcher_pid"] = dead.pid  # as if the launcher had been SIGKILLed
    ctl.close()
    with open(f"/dev/shm/shmemx_{job}_heap0", "wb") as f:
        f.write(b"\0" * 4096)
    try:
        rec = {j["job"]: j for j in json.loads(_shmemx("ps", "--json").stdout)}[job]
        assert (rec["stale"], rec["n_pes"], rec["script"], rec["segments"]) == (True, 3, "left_behind.py", 2)
        assert re.search(rf"^{job}\s+3\s+starting\s.*{dead.pid} \(stale\).*left_behind\.py$",
                         _shmemx("ps").stdout, re.M)
        assert _shmemx("clean", job).stdout.strip() == f"job {job}: removed 2 segments"
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"shmemx_{job}_")]
        missing = _shmemx("clean", job, check=False)
        assert missing.returncode == 1 and "no shmemx job" in missing.stderr
    finally:
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"shmemx_{job}_"):
                os.unlink(f"/dev/shm/{name}")


# --- a bug in the dump never keeps the launcher from stopping the job --------------------------------------------


def _pe1_fails():
    shmemx.init()
    if shmemx.my_pe() == 1:
        raise RuntimeError("pe 1 fails on purpose")
    shmemx.aclshmem_barrier_all()


def test_a_failing_snapshot_does_not_stop_the_launcher(run_job, no_leak, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("broken snapshot")

    monkeypatch.setattr(dumps, "snapshot", broken)
    result = run_job(2, _pe1_fails)
    assert result.code == 1 and result.seconds < 10, result.report()
    assert "shmemx: pe 1 failed with exit code 1: RuntimeError: pe 1 fails on purpose" in result.err
    assert "(could not read the job for the diagnosis, a shmemx bug:" in result.err and "KeyError" in result.err


def test_bench_trace_quick_prints_one_table():
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_trace.py")
    proc = subprocess.run([sys.executable, script, "--quick"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("  ")[0].strip(): line for line in proc.stdout.splitlines()[3:]}
    assert set(rows) == {"untraced", "traced (--trace)"}, proc.stdout
    assert re.search(r"\s1\.00\s", rows["untraced"]) and float(rows["traced (--trace)"].split()[-3]) > 0, proc.stdout


def test_diagnosis_puts_culprits_first_and_groups_large_barriers():
    def pe(p, waits=(), queues=None, state="runs, not in a shmemx wait"):
        return {"pe": p, "waits": list(waits), "queues": queues, "state": state, "error": ""}

    def barrier_wait(p):
        return {"pe": p, "call": "barrier_all", "target": 4, "seconds": 1.0 + p / 100,
                "text": f"pe {p} waits in barrier_all (barrier #4) for 1.0 s; not arrived: pe 3"}

    culprit = {"pe": 3, "call": "signal_wait_until", "target": 0, "seconds": 2.0,
               "text": "pe 3 waits in signal_wait_until on 'flags'+0x40 == 1, current value 0 (for 2.0 s)"}
    stalled = {"peer": 3, "qp": 1, "error": None, "counts": {"unexecuted_wqes": 12, "posted_wqes": 12,
                                                             "executed_wqes": 0, "cqes_unconsumed": 0,
                                                             "cqes_outstanding": 12}}
    n = 12
    doc = {"pes": [pe(p, [culprit] if p == 3 else [barrier_wait(p)], [stalled] if p == 5 else []) for p in range(n)]
           + [pe(n, state="has exited")]}
    assert dumps.diagnosis(doc) == [
        culprit["text"],
        "pe 5 has 12 WQEs posted, 0 completed on qp 1 to pe 3",
        "pes 0-2, 4-11 (11 PEs) wait in barrier_all (barrier #4) for up to 1.1 s; not arrived: pe 3",
        "pe 12 has exited",
    ]
    small = {"pes": doc["pes"][:3]}  # few enough: one line per PE, as the launcher's tests expect
    assert dumps.diagnosis(small) == [barrier_wait(p)["text"] for p in range(3)]

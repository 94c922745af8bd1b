"""Virtual time: recordings (``--record``) replayed on a modelled topology (``shmemx replay``).

The closed forms hold exactly (1e-9 relative) on small kernels here; ``scripts/replay/closed_forms.py`` checks
them on others (1 MiB puts, a 7-to-1 incast, the 128-PE all-to-all). Replays are deterministic functions of the
recording, and recordings do not depend on the host's timing (``test_host_independence``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

import shmemx
from shmemx.observe.record import Ev, Recording
from shmemx.observe.replay import load_topology, modelled_columns, replay
from shmemx.observe.replay.program import load_program
from shmemx.observe.replay.topology import builtin_topologies

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A2A = os.path.join(ROOT, "scripts", "replay", "alltoall_kernel.py")
HOST = os.path.join(ROOT, "scripts", "replay", "host_independence.py")
TOPO = load_topology("ascend950")
POST, DB, WQE = TOPO.post_us, TOPO.doorbell_us, TOPO.wqe_us
B = {"intra": TOPO.intra.bytes_per_us, "inter": TOPO.inter.bytes_per_us}
L = {"intra": TOPO.intra.latency_us, "inter": TOPO.inter.latency_us}
ACROSS = {"ranks_per_server": 1}  # every pair of PEs on different servers


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-12)


@pytest.fixture
def record(run_ok, tmp_path):
    """``record(n, fn, *args) -> path`` of the recording of a job."""
    counter = [0]

    def rec(n, fn, *args, **kw):
        counter[0] += 1
        path = str(tmp_path / f"job{counter[0]}.rec")
        run_ok(n, fn, *args, record=path, **kw)
        return path

    return rec


# --- kernels ---------------------------------------------------------------------------------------------------

def put_quiet_body(nbytes: int, get: bool = False) -> None:
    shmemx.init()
    me = shmemx.my_pe()
    buf = shmemx.zeros(nbytes, np.uint8, name="buf")
    local = np.full(nbytes, 7, np.uint8)
    if me == 0:
        with shmemx.region("rma"):
            if get:
                shmemx.aclshmemx_udma_get_nbi(local, buf, nbytes, 1)
            else:
                shmemx.aclshmemx_udma_put_nbi(buf, local, nbytes, 1)
            shmemx.aclshmemx_udma_quiet(1)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def incast_body(nbytes: int) -> None:
    """Every PE but 0 put_signals ``nbytes`` into its row of PE 0's inbox; PE 0 waits for all (region)."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    inbox = shmemx.zeros((n, nbytes), np.uint8, name="inbox")
    sig = shmemx.zeros((n, 1), np.uint64, name="sig")
    src = np.full(nbytes, me, np.uint8)
    if me == 0:
        with shmemx.region("incast"):
            shmemx.aclshmem_wait_until_all(sig[1:, 0], shmemx.ACLSHMEM_CMP_GE, 1)
        assert all((inbox[p] == p).all() for p in range(1, n))
    else:
        shmemx.aclshmemx_udma_put_signal_nbi(inbox[me], src, nbytes, sig[me], 1, 0)
        shmemx.aclshmemx_udma_quiet(0)
    shmemx.finalize()


def fence_body(nbytes: int) -> None:
    """PE 0: a put, then a fenced put_signal to PE 1 on the same QP; PE 1 waits for the signal (region)."""
    shmemx.init()
    me = shmemx.my_pe()
    data = shmemx.zeros(2 * nbytes, np.uint8, name="data")
    sig = shmemx.zeros(1, np.uint64, name="sig")
    src = np.ones(2 * nbytes, np.uint8)
    fenced = shmemx.OpConfig(cqe=1, se=0, fence=1, odr=shmemx.ACLSHMEMX_UDMA_ODR_SO)
    with shmemx.region("k"):
        if me == 0:
            shmemx.aclshmemx_udma_put_nbi(data[:nbytes], src, nbytes, 1)
            shmemx.aclshmemx_udma_put_signal_nbi(data[nbytes:], src, nbytes, sig, 5, 1, config=fenced)
            shmemx.aclshmemx_udma_quiet(1)
        else:
            shmemx.aclshmem_signal_wait_until(sig, shmemx.ACLSHMEM_CMP_EQ, 5)
    shmemx.finalize()


def signal_compute_body() -> None:
    """PE 0 computes 5 us (annotation) then signal_op's PE 1, which waits; a barrier at the end (regions)."""
    shmemx.init()
    me = shmemx.my_pe()
    flag = shmemx.zeros(1, np.int32, name="flag")
    with shmemx.region("k"):
        if me == 0:
            shmemx.compute(us=5.0, name="ffn")
            shmemx.aclshmemx_signal_op(flag, 3, shmemx.ACLSHMEM_SIGNAL_SET, 1)
        elif me == 1:
            assert shmemx.aclshmem_signal_wait_until(flag, shmemx.ACLSHMEM_CMP_GE, 3) == 3
    with shmemx.region("barrier"):
        shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def kernel_mark_body() -> None:
    """One PE: a kernel call mark (1 us of its own), then 2 us of other compute, in a region."""
    shmemx.init()
    with shmemx.region("k"):
        shmemx.compute(us=1.0, name="kernel")
        shmemx.compute(us=2.0, name="ffn")
    shmemx.finalize()


def _block_work() -> None:
    b = shmemx.get_block_idx()
    shmemx.compute(us=1.0 + 2.0 * b)
    shmemx.sync_all()
    shmemx.compute(us=4.0 if b == 0 else 0.5)


def blocks_body() -> None:
    """A launch of 3 blocks: 1, 3, 5 us, sync_all, then 4, 0.5, 0.5 us; the join is at 5 + 4 = 9 us."""
    shmemx.init()
    with shmemx.region("launch"):
        shmemx.launch(_block_work, 3)
    shmemx.finalize()


def poll_body() -> None:
    """PE 1 polls with test() until PE 0's signal_op (after 2 us of compute) arrives: a poll whose iteration
    count is host timing; then a wait_until_any whose recorded answer differs from virtual time's."""
    shmemx.init()
    me = shmemx.my_pe()
    flag = shmemx.zeros(1, np.int64, name="flag")
    two = shmemx.zeros(2, np.int64, name="two")
    if me == 0:
        shmemx.compute(us=2.0)
        shmemx.aclshmemx_signal_op(flag, 1, shmemx.ACLSHMEM_SIGNAL_SET, 1)
        time.sleep(0.2)  # host time: in the run, PE 2's word comes first; in virtual time, this one
        shmemx.aclshmemx_signal_op(two[1:2], 1, shmemx.ACLSHMEM_SIGNAL_SET, 1)
    elif me == 1:
        while not shmemx.aclshmem_test(flag, shmemx.ACLSHMEM_CMP_EQ, 1):
            time.sleep(0.001)
        assert shmemx.aclshmem_wait_until_any(two, shmemx.ACLSHMEM_CMP_EQ, 1) == 0
    else:
        shmemx.compute(us=50.0)
        shmemx.aclshmemx_signal_op(two[0:1], 1, shmemx.ACLSHMEM_SIGNAL_SET, 1)
    shmemx.finalize()


def generation_body() -> None:
    """PE 0 writes generation numbers 1 then 2 into PE 1's flag as 8-byte data (WRITEs, not signals), 10 us of
    compute apart; PE 1 waits for each (regions "g1", "g2")."""
    shmemx.init()
    me = shmemx.my_pe()
    flag = shmemx.zeros(1, np.int64, name="flag")
    if me == 0:
        for g in (1, 2):
            shmemx.aclshmemx_udma_put_nbi(flag, np.array([g], np.int64), 1, 1)
            shmemx.aclshmemx_udma_quiet(1)
            shmemx.compute(us=10.0)
    else:
        for g in (1, 2):
            with shmemx.region(f"g{g}"):
                shmemx.aclshmem_wait_until(flag, shmemx.ACLSHMEM_CMP_GE, g)
    shmemx.finalize()


def mte_body(nbytes: int, quiet: bool = True) -> None:
    """PE 0 MTE-puts ``nbytes`` to every other PE, then quiets them (``quiet``; else the barrier completes them),
    in a region."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    buf = shmemx.zeros(nbytes, np.uint8, name="buf")
    src = np.full(nbytes, 5, np.uint8)
    if me == 0:
        with shmemx.region("mte"):
            for peer in range(1, n):
                shmemx.aclshmemx_mte_put_nbi(buf, src, nbytes, peer)
            if quiet:
                shmemx.aclshmemx_mte_quiet()
    shmemx.aclshmem_barrier_all()
    assert (buf == 5).all() or me == 0
    shmemx.finalize()


def plain_store_body() -> None:
    """PE 0 sets PE 1's flag with a plain numpy store (invisible to a recording); PE 1 waits on it."""
    shmemx.init()
    me = shmemx.my_pe()
    flag = shmemx.zeros(1, np.int64, name="flag")
    if me == 0:
        shmemx.aclshmem_ptr(flag, 1)[0] = 9
        shmemx.aclshmemx_signal_op(flag, 0, shmemx.ACLSHMEM_SIGNAL_ADD, 1)  # (only to wake PE 1)
    else:
        shmemx.aclshmem_wait_until(flag, shmemx.ACLSHMEM_CMP_EQ, 9)
    shmemx.finalize()


def get_watched_body() -> None:
    """PE 0's block 0 gets PE 1's word into PE 0's own heap word; its block 1 waits on that word."""
    shmemx.init()
    me = shmemx.my_pe()
    word = shmemx.zeros(1, np.int64, name="word")
    src = shmemx.full(1, 7, np.int64, name="src")
    shmemx.aclshmem_barrier_all()
    if me == 0:
        def kernel():
            if shmemx.get_block_idx() == 0:
                shmemx.aclshmemx_udma_get_nbi(word, src, 1, 1)
                shmemx.aclshmemx_udma_quiet(1)
            else:
                shmemx.aclshmem_wait_until(word, shmemx.ACLSHMEM_CMP_EQ, 7)

        shmemx.launch(kernel, 2)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


# --- topology ----------------------------------------------------------------------------------------------------

def test_builtin_topologies_name_a_source_for_every_value():
    assert set(builtin_topologies()) >= {"ascend950", "h800_cx7"}
    folder = os.path.join(ROOT, "shmemx", "observe", "replay", "topologies")
    for name in builtin_topologies():
        topo = load_topology(name)
        assert topo.name == name and topo.sharing == "fcfs"
        for line in open(os.path.join(folder, f"{name}.toml")):
            if "=" in line.split("#")[0] and not line.startswith("name"):
                assert "#" in line and len(line.split("#", 1)[1].strip()) > 10, f"{name}: no source in {line!r}"


def test_topology_overrides_and_errors(tmp_path):
    topo = load_topology("ascend950", {"intra.bandwidth_GBps": "100", "network.sharing": "maxmin",
                                       "ranks_per_server": 8})
    assert topo.intra.bandwidth_GBps == 100.0 and topo.sharing == "maxmin" and topo.ranks_per_server == 8
    assert topo.tier(7, 8) == 1 and topo.tier(8, 15) == 0
    with pytest.raises(ValueError, match="unknown key.*intra.bandwith_GBps"):
        load_topology(None, {"intra.bandwith_GBps": 1})
    with pytest.raises(ValueError, match="must be > 0"):
        load_topology(None, {"inter.bandwidth_GBps": 0})
    with pytest.raises(ValueError, match="not a built-in"):
        load_topology("no-such-machine")
    own = tmp_path / "mine.toml"
    own.write_text(open(os.path.join(ROOT, "shmemx/observe/replay/topologies/h800_cx7.toml")).read()
                   .replace("ranks_per_server = 8", "ranks_per_server = 4"))
    assert load_topology(str(own)).ranks_per_server == 4
    assert load_topology(str(own)).kernel_us == 0.0 and load_topology(None, {"host.kernel_us": 3}).kernel_us == 3.0
    older = tmp_path / "older.toml"  # a file written before host.kernel_us existed still loads (it defaults to 0)
    older.write_text("".join(line for line in open(own) if not line.startswith("kernel_us")))
    assert "kernel_us" not in older.read_text() and load_topology(str(older)).kernel_us == 0.0


def test_topology_optional_keys_take_their_defaults(tmp_path, record):
    """A file with only the required keys (as the README's table lists them) loads; each optional key gets its
    documented default; a required key left out is refused by name."""
    minimal = tmp_path / "cluster.toml"
    minimal.write_text("ranks_per_server = 4\n[intra]\nbandwidth_GBps = 100\nlatency_us = 0.4\n"
                       "[inter]\nbandwidth_GBps = 25\nlatency_us = 1.5\n[engine]\nwqe_us = 0.07\n"
                       "[host]\npost_us = 0.03\ndoorbell_us = 0.2\n")
    topo = load_topology(str(minimal))
    assert (topo.name, topo.ranks_per_server, topo.sharing, topo.kernel_us) == ("cluster", 4, "fcfs", 0.0)
    assert topo.engine_us == (0.07, 0.07) and topo.intra.bandwidth_GBps == 100.0 and topo.inter.latency_us == 1.5
    assert load_topology(str(minimal), {"network.sharing": "maxmin"}).sharing == "maxmin"
    nbytes = 64 << 10  # one put + quiet inside a server, at the file's own values
    doc = replay(record(2, put_quiet_body, nbytes), topo)
    assert close(doc["regions"]["rma"]["max_us"], 0.03 + 0.2 + 0.07 + 0.4 + nbytes / 100e3 + 0.4), doc["regions"]
    for required in ("ranks_per_server", "latency_us = 1.5", "wqe_us", "doorbell_us"):
        broken = tmp_path / "broken.toml"
        broken.write_text("".join(line for line in minimal.read_text().splitlines(True)
                                  if not line.startswith(required)))
        with pytest.raises(ValueError, match="missing key"):
            load_topology(str(broken))


def test_deepep_fit_skips_a_fit_whose_eps_were_not_recorded():
    """``scripts/replay/deepep_fit.py --mode ll --eps 8,16,32`` runs its 'cost' fit (on EP 16) and says that its
    'kernel' fit, which fits on EP 16 and 64 (``--fit-eps``'s default), has no recording of EP 64 and is skipped
    (it died with KeyError: 64)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "replay" / "deepep_fit.py"
    spec = importlib.util.spec_from_file_location("deepep_fit", path)
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    recorded, fit_eps, tier_eps = [8, 16, 32], (16, 64), (8, 64)
    assert fit.unfit("cost", fit_eps, tier_eps, recorded) is None
    assert fit.unfit("kernel", fit_eps, tier_eps, recorded) == (
        "fit 'kernel': skipped: it fits on EP 64 (--fit-eps), which was not recorded (recorded: EP 8, 16, 32); "
        "name recorded EPs with --fit-eps")
    assert "EP 64 (--tier-eps)" in fit.unfit("tiers", fit_eps, tier_eps, recorded)
    assert fit.unfit("none", fit_eps, tier_eps, []) is None


# --- recordings ----------------------------------------------------------------------------------------------------

def test_recording_holds_the_exact_wqes(record):
    path = record(2, fence_body, 4096)
    prog = load_program(path)
    wq = prog.wqes[0]
    assert wq.opcode.tolist() == [shmemx.Opcode.WRITE, shmemx.Opcode.WRITE_WITH_NOTIFY]
    assert wq.nbytes.tolist() == [4096, 4096] and wq.peer.tolist() == [1, 1] and wq.pos.tolist() == [0, 1]
    assert wq.flag.tolist() == [0x20, 0x2E] and wq.value.tolist()[1] == 5
    assert wq.offset[1] == wq.offset[0] + 4096 and wq.sig_offset[1] >= 0
    ops = [op[0] for op in prog.threads[0][0]]
    assert ops.count(Ev.POST) == 2 and ops.count(Ev.QUIET) == 1 and ops.count(Ev.REGION) == 2
    w = prog.words[[op for op in prog.threads[1][0] if op[0] == Ev.WAIT][0][1]]
    assert (w.pe, w.offsets, w.size, w.cmp, w.values, w.result) == (1, [int(wq.sig_offset[1])], 8, 0, [5], 5)


def test_replay_is_deterministic_and_cli_matches_the_api(record, tmp_path):
    path = record(3, incast_body, 8192)
    doc = replay(path)
    assert json.dumps(doc) == json.dumps(replay(path))
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "shmemx", "replay", path, "--json", "--perfetto",
                          str(tmp_path / "v.json")], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == json.loads(json.dumps(doc))
    trace = json.load(open(tmp_path / "v.json"))
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"WRITE_WITH_NOTIFY", "process_name"} <= names
    text = subprocess.run([sys.executable, "-m", "shmemx", "replay", path, "--topology", "h800_cx7", "--set",
                           "inter.latency_us=3"], capture_output=True, text=True, timeout=60).stdout
    assert "makespan" in text and "critical path" in text and "inter 50 GB/s 3 us" in text


def test_run_record_through_the_command(tmp_path, python):
    script = tmp_path / "k.py"
    script.write_text("import numpy as np, shmemx\nshmemx.init()\nx = shmemx.zeros(64, np.uint8, name='x')\n"
                      "if shmemx.my_pe() == 0:\n    shmemx.aclshmemx_udma_put_nbi(x, np.ones(64, np.uint8), 64, 1)\n"
                      "    shmemx.aclshmemx_udma_quiet(1)\nshmemx.finalize()\n")
    rec = tmp_path / "k.rec"
    out = subprocess.run([python, "-m", "shmemx", "run", "-n", "2", "--record", str(rec), str(script)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "recording written to" in out.stderr, out.stderr
    r = Recording.load(str(rec))
    assert r.n_pes == 2 and r.job["script"].endswith("k.py")
    doc = replay(str(rec))
    assert doc["pes"][0]["wqes"] == 1 and doc["pes"][0]["bytes"] == 64
    bad = subprocess.run([python, "-m", "shmemx", "run", "-n", "2", "--record", str(tmp_path / "no" / "k.rec"),
                          str(script)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "could not write the recording" in bad.stderr  # a job without its recording


# --- closed forms ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tier", ["intra", "inter"])
def test_put_and_quiet_closed_form(record, tier):
    nbytes = 256 << 10
    path = record(2, put_quiet_body, nbytes)
    doc = replay(path, overrides=ACROSS if tier == "inter" else None)
    want = POST + DB + WQE + L[tier] + nbytes / B[tier] + L[tier]
    assert close(doc["regions"]["rma"]["max_us"], want), (doc["regions"], want)
    cp = doc["critical_path"]
    assert close(sum(cp["breakdown"].values()), doc["makespan_us"])


def test_engine_time_per_tier(record):
    """``engine.intra_wqe_us`` is the engine's time for a WQE to a rank of the same server (default: wqe_us)."""
    nbytes = 256 << 10
    path = record(2, put_quiet_body, nbytes)
    for over, tier, wqe in (({"engine.intra_wqe_us": 0.0}, "intra", 0.0), ({"engine.intra_wqe_us": 0.0}, "inter", WQE),
                            ({"engine.intra_wqe_us": 1.0, "engine.wqe_us": 0.5}, "intra", 1.0),
                            ({"engine.wqe_us": 0.5}, "intra", 0.5)):
        doc = replay(path, overrides=dict(over, **(ACROSS if tier == "inter" else {})))
        want = POST + DB + wqe + L[tier] + nbytes / B[tier] + L[tier]
        assert close(doc["regions"]["rma"]["max_us"], want), (over, tier, doc["regions"], want)
    assert load_topology("ascend950").engine_us == (WQE, WQE)
    assert "intra_wqe_us" not in load_topology("ascend950").as_dict()["engine"]
    h800 = load_topology("h800_cx7")
    assert h800.engine_us == (0.0, h800.wqe_us)  # NVLink peers are reached by the GPU's stores, not by the NIC
    assert load_topology(h800, {"engine.wqe_us": 0.2}).engine_us == (0.0, 0.2)


def test_get_and_quiet_closed_form(record):
    nbytes = 100_000
    doc = replay(record(2, put_quiet_body, nbytes, True))
    want = POST + DB + WQE + L["intra"] + L["intra"] + nbytes / B["intra"]  # request, data back; CQE on arrival
    assert close(doc["regions"]["rma"]["max_us"], want)


@pytest.mark.parametrize("sharing", ["fcfs", "maxmin"])
def test_incast_closed_form(record, sharing):
    n, nbytes = 4, 128 << 10
    doc = replay(record(n, incast_body, nbytes), overrides={"network.sharing": sharing})
    want = POST + DB + WQE + L["intra"] + (n - 1) * nbytes / B["intra"]
    assert close(doc["regions"]["incast"]["max_us"], want), (doc["regions"], want)
    assert doc["links"]["ingress intra"]["max_pe"] == 0 and doc["warnings"] == []
    port = doc["pes"][0]["links"]["ingress intra"]  # PE 0's own ingress: every byte, busy for the region's tail
    assert port["bytes"] == (n - 1) * nbytes and set(doc["pes"][0]["links"]) == {"ingress intra"}
    assert close(port["util"], (n - 1) * nbytes / B["intra"] / doc["makespan_us"])
    assert all(set(doc["pes"][p]["links"]) == {"egress intra"} for p in range(1, n))


def test_mte_puts_are_non_blocking_until_their_quiet(record, tmp_path):
    """n MTE puts to distinct peers, then ``aclshmemx_mte_quiet``: a post cost each, the transfers through the
    poster's intra egress one after the other (FCFS), the quiet at the last one's arrival; not the sum of blocking
    copies. A format /1 recording (no quiets recorded) still replays, each copy blocking as /1 modelled it."""
    n, nbytes = 4, 64 << 10
    path = record(n, mte_body, nbytes)
    prog = load_program(path)
    assert prog.mte_nbi and [op[0] for op in prog.threads[0][0] if op[0] in (Ev.MTE, Ev.MTE_QUIET)] == \
        [Ev.MTE] * (n - 1) + [Ev.MTE_QUIET]
    doc = replay(path)
    want = POST + (n - 1) * nbytes / B["intra"] + L["intra"]
    assert close(doc["regions"]["mte"]["max_us"], want), (doc["regions"], want)
    assert doc["warnings"] == [] and doc["pes"][0]["links"]["egress intra"]["bytes"] == (n - 1) * nbytes
    # without the quiet, the copies are still in flight at the region's end and complete by the barrier
    doc2 = replay(record(n, mte_body, nbytes, False))
    assert close(doc2["regions"]["mte"]["max_us"], (n - 1) * POST)
    assert doc2["makespan_us"] >= want
    # the same file as format /1: blocking copies
    old = str(tmp_path / "v1.rec")
    with zipfile.ZipFile(path) as z, zipfile.ZipFile(old, "w") as out:
        for item in z.namelist():
            data = z.read(item)
            if item == "job.json":
                data = json.dumps(dict(json.loads(data), format="shmemx-record/1")).encode()
            out.writestr(item, data)
    assert not load_program(old).mte_nbi
    blocking = replay(old)["regions"]["mte"]["max_us"]
    assert close(blocking, (n - 1) * (POST + L["intra"] + nbytes / B["intra"])), blocking


def test_fence_waits_for_the_acknowledgement(record):
    nbytes = 32 << 10
    doc = replay(record(2, fence_body, nbytes))
    ready1 = POST + DB
    ack1 = ready1 + WQE + L["intra"] + nbytes / B["intra"] + L["intra"]
    done2 = max(ready1 + POST + DB, ack1) + WQE + L["intra"] + nbytes / B["intra"]
    assert close(doc["pes"][1]["regions"]["k"], done2)
    assert close(doc["pes"][0]["regions"]["k"], done2 + L["intra"])


def test_signal_compute_and_dissemination_barrier(record):
    n = 4
    doc = replay(record(n, signal_compute_body))
    assert close(doc["pes"][0]["regions"]["k"], 5.0 + POST + DB)
    assert close(doc["pes"][1]["regions"]["k"], 5.0 + POST + DB + WQE + L["intra"])
    # everybody enters the barrier at a different time; the dissemination pattern decides who leaves when
    a = [doc["pes"][p]["regions"]["k"] for p in range(n)]
    t = list(a)
    for d in (1, 2):
        t = [max(t[i] + POST + DB, t[(i - d) % n] + POST + DB + WQE + L["intra"]) for i in range(n)]
    for p in range(n):
        assert close(doc["pes"][p]["regions"]["barrier"], t[p] - a[p]), (p, doc["pes"][p], t)
    assert doc["warnings"] == []


def test_kernel_call_cost_is_charged_at_kernel_marks_only(record):
    path = record(1, kernel_mark_body)
    assert close(replay(path)["regions"]["k"]["max_us"], 3.0)
    assert close(replay(path, None, {"host.kernel_us": 4.0})["regions"]["k"]["max_us"], 7.0)


def test_blocks_launch_sync_and_join(record):
    doc = replay(record(1, blocks_body))
    assert close(doc["regions"]["launch"]["max_us"], 9.0)
    assert doc["critical_path"]["breakdown"] == {"compute": 9.0}


@pytest.mark.parametrize("order, overrides, bound", [
    ("inter", {}, "inter"),
    ("intra", {"inter.bandwidth_GBps": 1e6, "inter.latency_us": 0.1}, "intra"),
    ("intra", {"engine.wqe_us": 1.0}, "engine"),
])
def test_alltoall_closed_form(record, order, overrides, bound):
    """P = 6, 3 per server: the all-to-all of the reference notes, in its three regimes."""
    n, per, nbytes = 6, 3, 256 << 10
    small = 64 if bound == "engine" else nbytes
    if bound == "engine":  # one server: the peers in cyclic order, which is also the engine's round-robin order
        per = n
    path = record(n, A2A, "--bytes", str(small), "--ranks-per-server", str(per), "--order", order)
    topo = load_topology("ascend950", dict(overrides, ranks_per_server=per))
    doc = replay(path, topo)
    tiers = {"intra": (topo.intra, per - 1), "inter": (topo.inter, n - per)}
    if bound == "engine":  # the engine is the slowest: the last WQE starts (P - 2) wqe after the first
        last = POST + DB + (n - 1) * topo.wqe_us + topo.intra.latency_us + small / topo.intra.bytes_per_us
        want = last + topo.intra.latency_us  # its acknowledgement ends the region
    else:
        tier, peers = tiers[bound]
        t0 = POST + DB + WQE + tier.latency_us
        want = t0 + peers * nbytes / tier.bytes_per_us + tier.latency_us
    assert close(doc["regions"]["alltoall"]["max_us"], want), (doc["regions"], want)
    assert close(doc["regions"]["alltoall"]["mean_us"], want)


# --- timing-dependent control flow -----------------------------------------------------------------------------

def test_polls_and_any_waits_that_depended_on_timing_are_reported(record):
    doc = replay(record(3, poll_body))
    kinds = {w["kind"]: w for w in doc["warnings"]}
    assert "test" in kinds and "result" in kinds, doc["warnings"]
    assert "wait_until_any returned 0 in the recorded run but 1" in kinds["result"]["example"]
    # the poll is still a wait in virtual time: PE 1 goes on when the signal arrives
    assert doc["pes"][1]["end_us"] >= 2.0 + POST + DB + WQE + L["intra"]


def test_small_payloads_carry_their_value(record):
    """A generation number written as data is recorded with its bytes: the second wait waits for the second
    write (it does not take the first write's arrival as meeting it)."""
    doc = replay(record(2, generation_body))
    arrive = POST + DB + WQE + L["intra"] + 8 / B["intra"]
    assert close(doc["pes"][1]["regions"]["g1"], arrive)
    assert close(doc["pes"][1]["regions"]["g2"], L["intra"] + 10.0 + arrive)
    assert doc["warnings"] == []


def test_a_get_lands_on_the_word_a_wait_watches(record):
    """A READ's local side is decoded from the WQE's SGE (``layout.wqe_columns``): the get into PE 0's own word
    releases the wait of PE 0's other block at the get's arrival (its bytes were not recorded: an unknown word,
    met with a warning), not never."""
    doc = replay(record(2, get_watched_body))
    kinds = [w["kind"] for w in doc["warnings"]]
    assert "never" not in kinds, doc["warnings"]
    arrive = POST + DB + WQE + 2 * L["intra"] + 8 / B["intra"]  # the request there, the data back
    assert doc["pes"][0]["end_us"] >= arrive


def test_a_wait_met_by_an_unrecorded_store_is_released_with_a_warning(record):
    doc = replay(record(2, plain_store_body))
    assert [w["kind"] for w in doc["warnings"]] == ["never"]


def test_perfetto_trace_is_chrome_trace_json_in_virtual_time(record, tmp_path):
    """The trace loads as Chrome trace-event JSON (what Perfetto's importer reads): metadata and complete events
    with integer pid/tid and non-negative ts/dur in microseconds of virtual time, ending at the makespan."""
    path = record(2, fence_body, 32 << 10)
    out = str(tmp_path / "virtual.json")
    doc = replay(path, perfetto=out)
    trace = json.load(open(out))
    events = trace["traceEvents"]
    assert trace["otherData"]["clock"].startswith("virtual time")
    assert {e["ph"] for e in events} == {"M", "X"}
    for e in events:
        assert isinstance(e["pid"], int) and isinstance(e.get("tid", 0), int) and isinstance(e["name"], str)
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0
    slices = [e for e in events if e["ph"] == "X"]
    assert close(max(e["ts"] + e["dur"] for e in slices), doc["makespan_us"])
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"block 0", "engine", "regions", "-> pe 1 qp 0"} <= tracks
    assert {"WRITE", "WRITE_WITH_NOTIFY", "k", "wait", "quiet"} <= {e["name"] for e in slices}
    wait = [e for e in slices if e["name"] == "wait"][0]
    assert wait["pid"] == 2 and wait["args"]["released by"].startswith("WRITE_WITH_NOTIFY pe 0 -> pe 1")


def deep_ep_ll_body(hidden: int, experts: int, tokens: int) -> None:
    """deep_ep's low-latency dispatch + combine, twice (both buffer halves, then the credits), in regions."""
    import ml_dtypes
    from shmemx import deep_ep

    n = int(os.environ["SHMEMX_SIZE"])
    buf = deep_ep.Buffer(None, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, n,
                                                                                          experts),
                         low_latency_mode=True, num_qps_per_rank=experts // n, server_size=2)
    rng = np.random.default_rng(buf.rank)
    topk = np.argsort(-rng.random((tokens, experts)), axis=1)[:, :4].astype(np.int64)
    x = rng.standard_normal((tokens, hidden)).astype(ml_dtypes.bfloat16)
    w = np.ones(topk.shape, np.float32)
    for call in range(3):
        with shmemx.region("dispatch"):
            recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, topk, tokens, experts)
        with shmemx.region("combine"):
            buf.low_latency_combine(recv_x[0].astype(ml_dtypes.bfloat16), topk, w, handle)
    shmemx.finalize()


def test_deep_ep_low_latency_replays_without_warnings(record):
    """A real kernel (double buffered, credits, put + signal per (rank, expert)) replays with every wait met by
    a modelled write; its dispatch WRITEs carry DeepEP's FP8 message (header + H + H/128 float32 scales)."""
    hidden, experts, tokens, n = 256, 8, 8, 4
    path = record(n, deep_ep_ll_body, hidden, experts, tokens)
    doc = replay(path, "h800_cx7", {"ranks_per_server": 2})
    assert doc["warnings"] == [], doc["warnings"]
    assert doc["regions"]["dispatch"]["calls"] == 3 and doc["regions"]["combine"]["calls"] == 3
    assert 0 < doc["regions"]["dispatch"]["max_us"] < doc["makespan_us"]
    prog = load_program(path)
    sizes = set(prog.wqes[0].nbytes[prog.wqes[0].opcode == shmemx.Opcode.WRITE].tolist())
    assert 16 + hidden + 4 * (hidden // 128) in sizes and 2 * hidden in sizes  # dispatch messages, combine rows
    assert doc["links"]["egress inter"]["bytes"] > 0 and doc["links"]["egress intra"]["bytes"] > 0
    # DeepEP's ordering: RO payload WRITEs, then per lane an SO put + signal without a fence (no ack round trip)
    wq = prog.wqes[0]
    flags = {(int(op), int(f)) for op, f in zip(wq.opcode, wq.flag)}
    assert flags == {(shmemx.Opcode.WRITE, 0x21), (shmemx.Opcode.WRITE_WITH_NOTIFY, 0x26)}, flags
    # a call not hooked is one kernel of as many blocks as QPs (2 here): each block posts its QPs' lanes
    posters = {slot for slot, ops in prog.threads[0].items() if any(op[0] == Ev.POST for op in ops)}
    assert posters == {0, 1}, posters
    # each call is one kernel call: host.kernel_us adds to each of the three dispatches of every PE (and the
    # shifted calls may wait a little differently for each other's credits: within a doorbell or so)
    more = replay(path, "h800_cx7", {"ranks_per_server": 2, "host.kernel_us": 10.0})
    for a, b in zip(doc["pes"], more["pes"]):
        assert 30.0 - 1e-6 < b["regions"]["dispatch"] - a["regions"]["dispatch"] < 30.5, (a, b)


def deep_ep_internode_body(hidden: int, experts: int, tokens: int) -> None:
    """deep_ep's internode dispatch (float8) + combine over 2 servers of 2, twice, in regions."""
    import ml_dtypes
    from shmemx import deep_ep

    buf = deep_ep.Buffer(None, int(2e7), int(2e7), server_size=2)
    rng = np.random.default_rng(buf.rank)
    topk = np.argsort(-rng.random((tokens, experts)), axis=1)[:, :4].astype(np.int64)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    scales = (np.abs(x).reshape(tokens, -1, 128).max(-1) / 448.0).astype(np.float32)
    x8 = (x / np.repeat(scales, 128, axis=1)).astype(ml_dtypes.float8_e4m3fn)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, experts)
    for call in range(2):
        with shmemx.region("dispatch"):
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(
                (x8, scales), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk,
                topk_weights=np.ones(topk.shape, np.float32))
        with shmemx.region("combine"):
            buf.combine(recv_x[0].astype(np.float32).astype(ml_dtypes.bfloat16), handle, topk_weights=recv_w)
    shmemx.finalize()


def test_deep_ep_internode_replays_as_deepep_runs(record):
    """deep_ep's internode kernels replay with every wait met by a modelled write (no flag by a plain store), the
    float8 rows packed (x H bytes, not the 2H slot), the RDMA in chunks of put + signal, and the forwarder's
    non-blocking MTE copies quieted (MTE_QUIET recorded)."""
    from shmemx.deep_ep.internode import RDMA_CHUNK, RowLayout

    hidden, experts, tokens, n = 256, 16, 40, 4
    path = record(n, deep_ep_internode_body, hidden, experts, tokens)
    doc = replay(path, "h800_cx7", {"ranks_per_server": 2})
    assert doc["warnings"] == [], doc["warnings"]
    assert doc["regions"]["dispatch"]["calls"] == 2 and doc["regions"]["combine"]["calls"] == 2
    prog = load_program(path)
    assert prog.mte_nbi and any(op[0] == Ev.MTE_QUIET for op in prog.threads[0][0])
    row = RowLayout(hidden, 4).packed(hidden).bytes
    assert row < RowLayout(hidden, 4).bytes
    wq = prog.wqes[0]
    chunks = wq.nbytes[(wq.opcode == shmemx.Opcode.WRITE_WITH_NOTIFY) & (wq.nbytes % row == 0)]
    assert len(chunks) and set((chunks // row).tolist()) <= set(range(1, RDMA_CHUNK + 1))
    assert (chunks == RDMA_CHUNK * row).any()  # full chunks, then the remainder


# --- host independence -------------------------------------------------------------------------------------------

def test_host_independence(tmp_path):
    """The same kernels recorded twice, the second time with the other core busy and random sleeps injected
    into every rank, replay to the identical JSON document (scripts/replay/host_independence.py)."""
    out = subprocess.run([sys.executable, HOST, "--pes", "4", "--dir", str(tmp_path)], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "identical" in out.stdout


def test_modelled_columns(record):
    cols = modelled_columns(record(2, put_quiet_body, 4096), regions=("rma", "absent"))
    assert set(cols) == {"model_makespan_us", "model_mean_end_us", "model_rma_us", "model_absent_us",
                         "model_rma_calls", "model_absent_calls", "model_bound", "model_warnings"}
    assert cols["model_rma_calls"] == 1
    assert cols["model_absent_us"] == 0.0 and cols["model_warnings"] == 0 and cols["model_rma_us"] > 0


def test_experiment_rows_get_modelled_columns():
    """``shmemx experiment --model TOPO``: each configuration's job is recorded and replayed (issue 12's table)."""
    from shmemx.launcher.experiment import BASE, run_config

    cfg = dict(BASE, n=4, tokens=16, hidden=256, reps=2, model="ascend950")
    row, _ = run_config(cfg, timeout=120)
    assert row["model_dispatch_us"] > 0 and row["model_combine_us"] > 0 and row["model_warnings"] == 0
    assert row["model_makespan_us"] >= 2 * (row["model_dispatch_us"] + row["model_combine_us"])
    assert row["model_bound"] in ("host", "engine", "bytes intra", "latency intra", "barrier")
    plain, _ = run_config(dict(cfg, model=None), timeout=120)
    assert not any(k.startswith("model_") for k in plain)

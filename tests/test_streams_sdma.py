"""Emulated streams (work queued, run in order at synchronize, failures surfacing there) and the SDMA engine
(per-block FIFO channels, quiet, notify record and the host's wait for it, refusals, recording and replay)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import shmemx

MTE, SDMA, UDMA = shmemx.ACLSHMEM_DATA_OP_MTE, shmemx.ACLSHMEM_DATA_OP_SDMA, shmemx.ACLSHMEM_DATA_OP_UDMA
EQ, SET = shmemx.ACLSHMEM_CMP_EQ, shmemx.ACLSHMEM_SIGNAL_SET


def _init(mask: int = MTE | UDMA) -> tuple[int, int]:
    shmemx.aclshmemx_init_attr(0, shmemx.InitAttr(option_attr=shmemx.OptionalAttr(data_op_engine_type=mask)))
    return shmemx.my_pe(), shmemx.n_pes()


def _streams_job():
    me, n = _init()
    data = shmemx.zeros((n, 32), np.int64, name="data")
    flag = shmemx.zeros(1, np.int32, name="flag")
    log = []
    s = shmemx.aclrtCreateStream()
    nxt = (me + 1) % n
    shmemx.aclshmemx_barrier_all_on_stream(s)
    s.launch(lambda tag: log.append((tag, shmemx.get_block_num())), 2, "kernel")  # two blocks, one entry each
    shmemx.aclshmemx_putmem_on_stream(data[me], np.full(32, me + 7, np.int64), 256, nxt, s)
    shmemx.aclshmemx_signal_op_on_stream(flag, 1, SET, nxt, s)
    shmemx.aclshmemx_signal_wait_until_on_stream(flag, EQ, 1, s)
    shmemx.aclshmemx_quiet_on_stream(s)
    shmemx.aclshmemx_barrier_on_stream(shmemx.ACLSHMEM_TEAM_WORLD, s)
    assert not log and not data.any() and flag[0] == 0  # queued, nothing ran yet
    assert shmemx.aclrtSynchronizeStream(s) == 0
    prev = (me - 1) % n
    assert log == [("kernel", 2), ("kernel", 2)] and (data[prev] == prev + 7).all() and flag[0] == 1
    # a failure surfaces at the synchronize, naming the operation; the rest of the stream is dropped
    shmemx.aclshmemx_putmem_on_stream(data[me], np.zeros(32, np.int64), 256, n + 3, s)
    s.launch(lambda: log.append("dropped"), 1)
    with pytest.raises(shmemx.StreamError, match=rf"pe {me}: aclrtSynchronizeStream\(stream {s.id}\): operation "
                                                 rf"#7 aclshmemx_putmem_on_stream\(pe={n + 3}, 256 B\) failed: .*out "
                                                 rf"of range .*\(1 later operations dropped\)") as info:
        shmemx.aclrtSynchronizeStream(s)
    assert info.value.index == 7 and isinstance(info.value.__cause__, ValueError) and "dropped" not in log
    # the default stream, a team barrier on a stream, handle_wait over a team
    odd = shmemx.aclshmem_team_split_strided(shmemx.ACLSHMEM_TEAM_WORLD, 1, 2, n // 2)
    if odd != shmemx.ACLSHMEM_TEAM_INVALID:
        shmemx.aclshmemx_barrier_on_stream(odd)
        shmemx.aclshmemx_handle_wait(shmemx.aclshmem_handle_t(odd))
        shmemx.aclrtSynchronizeStream()
    shmemx.aclshmem_team_destroy(odd)
    shmemx.aclrtDestroyStream(s)
    with pytest.raises(ValueError, match="was destroyed"):
        shmemx.aclshmemx_quiet_on_stream(s)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_streams(run_ok):
    run_ok(4, _streams_job, timeout=60)


def _sdma_job(blocks: int, rounds: int):
    """Every block copies its slice of a contribution to every PE of the server over SDMA, quiets its own channel,
    then flags it; the readers check every slice the flags announce. Then a notify record and the host's wait."""
    me, n = _init(MTE | SDMA)
    width = 3 * (1 << 18) // 4  # 3/4 MiB of int32 per block: 1 SQE (and 2 for the get below)
    data = shmemx.zeros((n, blocks, width), np.int32, name="data")
    flags = shmemx.zeros((n, blocks), np.int32, name="flags")
    shmemx.aclshmem_barrier_all()

    def kernel(r: int):
        b = shmemx.get_block_idx()
        src = np.full(width, me * 1000 + b * 10 + r, np.int32)
        for p in range(n):
            shmemx.aclshmemx_sdma_put_nbi(data[me, b], src, width, p)
        shmemx.aclshmemx_sdma_quiet()  # this block's copies only: its flags may go now
        for p in range(n):
            shmemx.aclshmemx_signal_op(flags[me, b:b + 1], r, SET, p)

    for r in range(1, rounds + 1):
        shmemx.launch(kernel, blocks, r)
        shmemx.aclshmem_int32_wait_until_all(flags.reshape(-1), n * blocks, None, EQ, r)
        for p in range(n):
            for b in range(blocks):
                assert (data[p, b] == p * 1000 + b * 10 + r).all(), (p, b, r)
        shmemx.aclshmem_barrier_all()
    back = np.zeros((2, width), np.int32)  # a get of 1.5 MiB: two SQEs on block 0's channel, then its notify
    shmemx.aclshmemx_sdma_get_nbi(back.reshape(-1), data[(me + 1) % n, :2].reshape(-1), 2 * width, (me + 1) % n)
    shmemx.aclshmemx_sdma_notify_record()
    stream = shmemx.aclrtCreateStream()
    shmemx.aclrtWaitAndResetNotify(shmemx.sdma_notify(0), stream, 0)
    shmemx.aclrtSynchronizeStream(stream)
    assert (back[0] == ((me + 1) % n) * 1000 + rounds).all() and (back[1] == ((me + 1) % n) * 1000 + 10 + rounds).all()
    assert shmemx.sdma_notify(0).recorded == 0  # reset by the wait
    shmemx.aclshmemx_cmo_nbi(data[me, 0], width, shmemx.ACLSHMEMCMOTYPE.CMO_TYPE_PREFETCH)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_sdma_channels_quiet_notify(run_ok):
    run_ok(4, _sdma_job, 3, 3, timeout=120)


def _sdma_refusals_job():
    me, n = _init(MTE | UDMA)
    x = shmemx.zeros(4, np.int32, name="x")
    with pytest.raises(ValueError, match=rf"pe {me}: aclshmemx_sdma_put_nbi: SDMA is not enabled"):
        shmemx.aclshmemx_sdma_put_nbi(x, x, 4, me)
    with pytest.raises(ValueError, match="SDMA is not enabled"):
        shmemx.aclshmemx_sdma_quiet()
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_sdma_refusals(run_ok):
    run_ok(2, _sdma_refusals_job, timeout=60)


def _replay_job():
    me, n = _init(MTE | SDMA)
    data = shmemx.zeros((n, 1 << 18), np.float32, name="data")  # 1 MiB per PE
    flag = shmemx.zeros(n, np.int32, name="flag")
    shmemx.aclshmem_barrier_all()
    dst = (me + 1) % n
    shmemx.aclshmemx_sdma_put_nbi(data[me], np.full(1 << 18, me, np.float32), 1 << 18, dst)
    shmemx.aclshmemx_sdma_quiet()
    shmemx.aclshmemx_signal_op(flag[me:me + 1], 1, SET, dst)
    shmemx.aclshmem_wait_until(flag[(me - 1) % n:(me - 1) % n + 1], EQ, 1)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_sdma_copy_replays(run_job, tmp_path):
    """A recorded SDMA copy replays: on its channel, through the intra ports (1 MiB at 150 GB/s: 7 us at least,
    before the flag), and on the critical path of the reader."""
    rec = tmp_path / "sdma.rec"
    r = run_job(2, _replay_job, record=str(rec), timeout=60)
    assert r.code == 0, r.report()
    out = subprocess.run([sys.executable, "-m", "shmemx", "replay", str(rec), "--json"], capture_output=True,
                         text=True, check=True).stdout
    doc = json.loads(out)
    assert doc["makespan_us"] > (1 << 20) / 150e3, doc["makespan_us"]
    steps = doc["critical_path"]["steps"]
    assert any("SDMA copy" in s["where"] + s.get("detail", "") for s in steps), steps
    assert not doc["warnings"], doc["warnings"]


def _quiet_where_nothing_reaches_job():
    me, n = _init(MTE | SDMA)  # servers of 2: the other server is reached by nothing
    shmemx.aclshmemx_quiet_on_stream()
    assert shmemx.aclrtSynchronizeStream() == 0
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_quiet_on_stream_skips_unreachable_pes(run_ok, monkeypatch):
    monkeypatch.setenv("SHMEMX_RANKS_PER_SERVER", "2")
    run_ok(4, _quiet_where_nothing_reaches_job, timeout=60)

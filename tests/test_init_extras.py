"""CANN's init and memory calls beyond init/finalize: the unique-id bootstrap every CANN example starts with, init
status, version and name, single-instance finalize and context, global exit, ``aclshmemx_malloc`` with
``mem_type``, the heap base, and the logger."""

from __future__ import annotations

import numpy as np
import pytest

import shmemx


def _uid_job(tmp: str):
    me, n = int(__import__("os").environ["SHMEMX_RANK"]), int(__import__("os").environ["SHMEMX_SIZE"])
    assert shmemx.aclshmemx_init_status() == shmemx.ACLSHMEM_STATUS_NOT_INITIALIZED
    uid = shmemx.aclshmemx_get_uniqueid()  # (on the device, PE 0 would make it and send it to the others)
    assert uid.version == shmemx.ACLSHMEM_UNIQUEID_VERSION and len(uid.internal) == shmemx.ACLSHMEM_UNIQUE_ID_INNER_LEN
    attr = shmemx.InitAttr()
    assert shmemx.aclshmemx_set_attr_uniqueid_args(me, n, 4 << 20, uid, attr) == 0
    foreign = shmemx.aclshmemx_uniqueid_t(internal=b"another-job".ljust(124, b"\0"))
    bad = shmemx.InitAttr()
    shmemx.aclshmemx_set_attr_uniqueid_args(me, n, 4 << 20, foreign, bad)
    with pytest.raises(ValueError, match="the unique id names job 'another-job'"):
        shmemx.aclshmemx_init_attr(shmemx.ACLSHMEMX_INIT_WITH_UNIQUEID, bad)
    assert shmemx.aclshmemx_init_attr(shmemx.ACLSHMEMX_INIT_WITH_UNIQUEID, attr) == 0
    assert shmemx.aclshmemx_init_status() == shmemx.ACLSHMEM_STATUS_IS_INITIALIZED
    assert shmemx.aclshmem_info_get_version() == (1, 1)
    assert shmemx.aclshmem_info_get_name().startswith("ACLSHMEM v1.1.1")
    assert shmemx.aclshmemx_instance_ctx_get().id == 0 and shmemx.aclshmemx_instance_ctx_set(0) == 0
    with pytest.raises(ValueError, match="instance 3 does not exist"):
        shmemx.aclshmemx_instance_ctx_set(3)
    assert shmemx.util_get_ffts_config() == 0
    shmemx.util_set_ffts_config(0)
    # the config store's TLS, as CANN's quickstart turns it off before init (kept: there is no store here)
    assert shmemx.aclshmemx_set_conf_store_tls(False, None, 0) == 0 and not shmemx.conf_store_tls().enable
    with pytest.raises(ValueError, match="enabling TLS needs tls_info"):
        shmemx.aclshmemx_set_conf_store_tls(True, "", 0)
    with pytest.raises(ValueError, match=r"tls_pk_len 9 is not 0..3"):
        shmemx.aclshmemx_set_config_store_tls_key("key", 9, "pw", 2, None)
    assert shmemx.aclshmemx_set_config_store_tls_key(b"key", 3, "cipher", 6, str.upper) == 0
    assert shmemx.conf_store_tls().decrypt_handler("cipher") == "CIPHER"
    # memory with mem_type, and the heap base
    host = shmemx.aclshmemx_calloc(16, 4, shmemx.HOST_SIDE)
    dev = shmemx.aclshmemx_malloc(64)
    base = shmemx.aclshmemx_get_heap_base()
    assert base.dtype == np.uint8 and base.size >= 128
    host[:] = me + 1
    assert base[shmemx._lifecycle.runtime().heap.locate(host)[1]] == me + 1  # the base views the same memory
    with pytest.raises(ValueError, match=rf"pe {me}: aclshmemx_free: heap\+0x[0-9a-f]+ was allocated as HOST_SIDE, "
                                         rf"freed as DEVICE_SIDE"):
        shmemx.aclshmemx_free(host, shmemx.DEVICE_SIDE)
    shmemx.aclshmemx_free(host, shmemx.HOST_SIDE)
    shmemx.aclshmemx_free(dev)
    with pytest.raises(ValueError, match="mem_type 7"):
        shmemx.aclshmemx_malloc(64, 7)
    # the logger: team creation and destruction are logged at info, which the default level (error) hides
    got = []
    shmemx.aclshmemx_set_extern_logger(lambda level, msg: got.append((level, msg)))
    shmemx.aclshmem_team_destroy(shmemx.aclshmem_team_split_strided(shmemx.ACLSHMEM_TEAM_WORLD, 0, 1, n))
    assert got == []
    shmemx.aclshmemx_set_log_level(shmemx.LogLevel.INFO)
    team = shmemx.aclshmem_team_split_strided(shmemx.ACLSHMEM_TEAM_WORLD, 0, 1, n)
    shmemx.aclshmem_team_destroy(team)
    assert [level for level, _ in got] == [1, 1] and f"created team {team}" in got[0][1], got
    shmemx.aclshmemx_set_extern_logger(None)
    with pytest.raises(ValueError, match="level 9"):
        shmemx.aclshmemx_set_log_level(9)
    with pytest.raises(ValueError, match="instance 1 does not exist"):
        shmemx.aclshmemx_finalize(1)
    assert shmemx.aclshmemx_finalize(0) == 0
    assert shmemx.aclshmemx_init_status() == shmemx.ACLSHMEM_STATUS_NOT_INITIALIZED


def test_uniqueid_init_and_memory(run_ok, tmp_path):
    run_ok(3, _uid_job, str(tmp_path), timeout=60)


def _exit_job():
    shmemx.init()
    if shmemx.my_pe() == 1:
        shmemx.aclshmem_global_exit(5)
    shmemx.aclshmem_barrier_all()  # the others: stopped here (the job aborts)
    raise AssertionError("not reached")


def test_global_exit_stops_every_pe(run_job):
    r = run_job(3, _exit_job, timeout=60)
    assert r.code != 0 and "aclshmem_global_exit(5)" in r.err, r.report()
    assert "not reached" not in r.err, r.report()


def _prof_job(profiled: str):
    import os
    os.environ["SHMEM_CYCLE_PROF_PE"] = profiled
    os.environ["SHMEM_LOG_LEVEL"] = "WARN"  # the fallback's warning (hidden at the default level, error)
    shmemx.init()
    me = shmemx.my_pe()

    def kernel():
        for _ in range(3):
            shmemx.SHMEMI_PROF_START(7)
            shmemx.SHMEMI_PROF_END(7)
        if shmemx.get_block_idx() == 1:
            shmemx.SHMEMI_PROF_START(1000)
            shmemx.aclshmem_barrier_all()  # inside a launch: one block of each PE meets the others
            shmemx.SHMEMI_PROF_END(1000)
        shmemx.SHMEMI_PROF_END(2000)  # frame ids past 1023 are ignored, as in CANN

    shmemx.launch(kernel, 2)
    prof = shmemx.aclshmemx_get_prof(verbose=True)
    expect = int(profiled) if profiled.isdigit() and int(profiled) < shmemx.n_pes() else 0
    if me != expect:
        assert prof is None
    else:
        assert prof.pe_id == me
        assert [(b, f, n) for b, f, _, n, _ in prof.rows()] == [(0, 7, 3), (1, 7, 3), (1, 1000, 1)]
        assert prof.block_prof[1].ccount[1000] == 1 and prof.block_prof[1].cycles[1000] > 0
        assert (prof.block_prof.cycles >= 0).all()
    shmemx.finalize()


@pytest.mark.parametrize("profiled", ["1", "nine"])
def test_cycle_profiling_counts_frames_per_block_on_the_profiled_pe(run_job, profiled):
    r = run_job(3, _prof_job, profiled, timeout=60)
    assert r.code == 0, r.report()
    assert r.out.count("BlockID   FrameID   Cycles") == 1 and "1         1000      " in r.out, r.report()
    if profiled == "nine":
        assert "SHMEM_CYCLE_PROF_PE='nine' is not a PE of this job (0..2): profiling PE 0" in r.err, r.report()

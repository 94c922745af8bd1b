"""Benchmark of the UDMA data plane: put bandwidth beside np.copyto, 64-byte message rates, put_signal latency.

Prints one table. Every figure is the median over samples (min..max in brackets), and each stands beside a
reference measured in the same run, alternating with it so that drift of this shared host hits both:

* put bandwidth, PE 0 -> PE 1, 64 B .. 64 MiB: ``k`` ``aclshmemx_udma_qp_put_nbi`` of the size, then one
  ``aclshmemx_udma_qp_quiet``, timed until the quiet returns; beside ``np.copyto`` of the same size from the same
  source into the same destination (PE 1's heap through ``aclshmem_ptr``), ``k`` times. Both buffers are heap
  allocations pre-faulted by their owners and warmed by one full-size copy and put before timing;
* 64-byte message rate of one PE, counted end to end (every WQE executed and completed: the clock stops when the
  last quiet returns), through ``qp_put_nbi`` in a loop with one quiet per 1024, through defer/submit batches of
  1024, and through the raw vectorised path (reserve N, one ``build_writes``, one ring, one poll per batch);
  beside ``np.copyto`` of the same 64-byte rows in a Python loop (the reference for a per-call cost);
  with ``--both``, the same with both PEs sending at once (per-PE figure);
* put_signal -> signal_wait_until ping-pong between 2 PEs (half round trip), beside the same ping-pong done with
  ``aclshmemx_signal_op`` SET (a direct store, no engine);
* MPI_Put + MPI_Win_flush columns for the bandwidth rows when mpi4py is importable (skipped otherwise).

Bars (issue 3): puts of 1 MiB and more >= 0.8x np.copyto; qp_put_nbi 64 B >= 150,000 completed WQE/s per PE; the
raw vectorised path >= 2,000,000 completed 64-B WQE/s per PE.

Usage: ``python scripts/bench_rma.py [--quick] [--check] [--both]``. ``--quick`` is a smoke run of a few seconds
(rough numbers); ``--check`` exits 1 when a bar is missed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

import shmemx
from shmemx.launcher import launch

EQ, SET = shmemx.ACLSHMEM_CMP_EQ, shmemx.ACLSHMEM_SIGNAL_SET
KIB, MIB = 1 << 10, 1 << 20
SIZES = [64 << (2 * i) for i in range(11)]  # 64 B, 256 B, ..., 16 MiB, 64 MiB
WQE = 64


@dataclass
class Config:
    samples: int  # timed samples per figure (medians over them)
    bw_bytes: int  # bytes moved per bandwidth sample (k = bw_bytes / size, 1..bw_max_k)
    bw_max_k: int
    sizes: list
    rate_wqes: int  # WQEs per message-rate sample
    raw_batch: int  # WQEs per raw batch
    pingpong_rounds: int


FULL = Config(samples=7, bw_bytes=128 * MIB, bw_max_k=4096, sizes=SIZES, rate_wqes=1 << 17, raw_batch=16384,
              pingpong_rounds=2000)
QUICK = Config(samples=3, bw_bytes=16 * MIB, bw_max_k=256, sizes=[64, 4 * KIB, 1 * MIB, 16 * MIB],
               rate_wqes=1 << 13, raw_batch=4096, pingpong_rounds=200)


def _median(values):
    return statistics.median(values)


# --- rank bodies: PE 0 prints one JSON document --------------------------------------------------------------


def _bandwidth_body(cfg: Config) -> None:
    shmemx.init()
    me = shmemx.my_pe()
    top = max(cfg.sizes)
    src = shmemx.full(top, 7, np.uint8, name="src")  # allocations are pre-faulted by their owner
    dst = shmemx.zeros(top, np.uint8, name="dst")
    shmemx.aclshmem_barrier_all()
    result = {}
    if me == 0:
        peer = shmemx.aclshmem_ptr(dst, 1)
        np.copyto(peer, src)  # this process's first touch of pe 1's pages
        shmemx.aclshmemx_udma_qp_put_nbi(dst, src, top, 1, 0)
        shmemx.aclshmemx_udma_qp_quiet(1, 0)
        for size in cfg.sizes:
            k = max(1, min(cfg.bw_max_k, cfg.bw_bytes // size))
            s, d, p = src[:size], dst[:size], peer[:size]
            puts, copies = [], []
            for _ in range(cfg.samples):
                t0 = time.perf_counter()
                for _ in range(k):
                    np.copyto(p, s)
                copies.append(k * size / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                for _ in range(k):
                    shmemx.aclshmemx_udma_qp_put_nbi(d, s, size, 1, 0)
                shmemx.aclshmemx_udma_qp_quiet(1, 0)
                puts.append(k * size / (time.perf_counter() - t0))
            result[size] = {"k": k, "put": puts, "copyto": copies}
        print(json.dumps(result))
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def _rate_body(cfg: Config, both: bool) -> None:
    """64-byte message rates; PE 0 (or every PE with ``both``) sends to the next PE."""
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    nxt = (me + 1) % n
    slots = cfg.raw_batch
    src = shmemx.array(np.arange(slots * 8, dtype=np.int64).reshape(slots, 8) + (me << 40), name="src")
    dst = shmemx.zeros((slots, 8), np.int64, name="dst")
    shmemx.aclshmem_barrier_all()
    sending = both or me == 0
    result = {"loop": [], "batch": [], "raw": [], "copyto": []}
    q = shmemx.aclshmemx_udma_raw_queue(nxt, 0)
    step = np.arange(slots, dtype=np.uint64) * np.uint64(WQE)
    remote, local = q.remote_va(dst), q.local_va(src)
    flags = np.zeros(slots, np.uint64)
    flags[-1] = 0x20  # one CQE per batch: the last WQE's
    peer = shmemx.aclshmem_ptr(dst, nxt)
    total = cfg.rate_wqes

    def loop() -> None:
        put = shmemx.aclshmemx_udma_qp_put_nbi
        for base in range(0, total, 1024):
            for i in range(base % slots, base % slots + 1024):
                put(dst[i], src[i], 8, nxt, 0)
            shmemx.aclshmemx_udma_qp_quiet(nxt, 0)

    def batch() -> None:
        put = shmemx.aclshmemx_udma_qp_put_nbi
        state = shmemx.aclshmemx_submit_state_t()
        defer, submit = shmemx.aclshmemx_defer_t(state), shmemx.aclshmemx_submit_t(state)
        for base in range(0, total, 1024):
            first = base % slots
            for i in range(first, first + 1023):
                put(dst[i], src[i], 8, nxt, 0, batch=defer)
            put(dst[first + 1023], src[first + 1023], 8, nxt, 0, batch=submit)
            shmemx.aclshmemx_udma_qp_quiet(nxt, 0)

    def raw() -> None:
        for _ in range(total // slots):
            head = q.reserve(slots)
            q.write(head, q.build_writes(rmt_va=remote + step, sge_len=WQE, sge_va=local + step, flag=flags))
            q.ring_doorbell(head + slots, cqes=1)
            q.poll()

    def copyto() -> None:
        for base in range(0, total, 1024):
            for i in range(base % slots, base % slots + 1024):
                np.copyto(peer[i], src[i])

    for name, fn in (("loop", loop), ("batch", batch), ("raw", raw), ("copyto", copyto)):
        fn_total = total if name != "raw" else total // slots * slots
        for rep in range(cfg.samples + 1):  # sample 0 warms up
            shmemx.aclshmem_barrier_all()
            if sending:
                t0 = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - t0
                if rep:
                    result[name].append(fn_total / elapsed)
            shmemx.aclshmem_barrier_all()
    expect = np.arange(slots * 8, dtype=np.int64).reshape(slots, 8) + (((me - 1) % n) << 40)
    if both or me == 1:
        assert np.array_equal(dst, expect), "a 64-byte put landed in the wrong place"
    if both:
        mine = json.dumps(result)
        shmemx.aclshmem_barrier_all()
        print(mine, flush=True)  # every PE prints one line
    elif me == 0:
        print(json.dumps(result), flush=True)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def _pingpong_body(cfg: Config) -> None:
    shmemx.init()
    me = shmemx.my_pe()
    other = 1 - me
    box = shmemx.zeros(8, np.int64, name="box")
    sig = shmemx.zeros(1, np.uint64, name="sig")
    word = shmemx.zeros(1, np.uint64, name="word")
    payload = np.arange(8, dtype=np.int64)
    shmemx.aclshmem_barrier_all()
    rounds = cfg.pingpong_rounds
    result = {"put_signal": [], "signal_op": []}
    value = 0
    for rep in range(cfg.samples + 1):
        for kind in ("put_signal", "signal_op"):
            shmemx.aclshmem_barrier_all()
            t0 = time.perf_counter()
            for _ in range(rounds):
                value += 1
                for turn in (0, 1):
                    if me == turn:
                        if kind == "put_signal":
                            shmemx.aclshmemx_udma_put_signal_nbi(box, payload, 8, sig, value, other)
                        else:
                            shmemx.aclshmemx_signal_op(word, value, SET, other)
                    else:
                        shmemx.aclshmem_signal_wait_until(sig if kind == "put_signal" else word, EQ, value)
            elapsed = time.perf_counter() - t0
            if rep:
                result[kind].append(elapsed / rounds / 2)  # half a round trip
            shmemx.aclshmemx_udma_quiet(other)
    if me == 0:
        print(json.dumps(result))
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


# --- MPI reference (only when mpi4py is importable) ----------------------------------------------------------


def mpi_available() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def _mpi_bandwidth(cfg: Config) -> dict | None:
    """MPI_Put + MPI_Win_flush bandwidth between 2 ranks (mpiexec), or None when that cannot run here."""
    import shutil
    import subprocess
    import tempfile

    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        return None
    code = f"""
import json, time, numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
sizes, samples, total, max_k = {cfg.sizes!r}, {cfg.samples}, {cfg.bw_bytes}, {cfg.bw_max_k}
buf = np.zeros(max(sizes), np.uint8); src = np.full(max(sizes), 7, np.uint8)
win = MPI.Win.Create(buf, comm=comm)
out = {{}}
win.Lock_all()
for size in sizes:
    k = max(1, min(max_k, total // size)); rates = []
    for _ in range(samples):
        comm.Barrier()
        if comm.rank == 0:
            t0 = time.perf_counter()
            for _ in range(k):
                win.Put(src[:size], 1)
            win.Flush(1)
            rates.append(k * size / (time.perf_counter() - t0))
    out[size] = rates
win.Unlock_all()
if comm.rank == 0:
    print(json.dumps(out))
win.Free()
"""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    try:
        proc = subprocess.run([mpiexec, "-n", "2", sys.executable, f.name], capture_output=True, text=True,
                              timeout=600)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        return None
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


# --- running and printing ----------------------------------------------------------------------------------


def _job(body, *args, heap="16M") -> list:
    out, err = io.StringIO(), io.StringIO()
    code = launch(2, body, args, timeout=900, heap_size=heap, tag_output=False, stdout=out, stderr=err)
    if code != 0:
        raise RuntimeError(f"{body.__name__} exited {code}:\n{err.getvalue()}")
    return [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB" if n >= KIB else f"{n} B"


def _fmt(values, unit: str) -> str:
    scale, fmt = {"GB/s": (1e-9, "{:.2f}"), "WQE/s": (1e-3, "{:,.0f}k"), "us": (1e6, "{:.1f}")}[unit]
    med = fmt.format(_median(values) * scale)
    lo, hi = (fmt.format(v * scale) for v in (min(values), max(values)))
    return f"{med} [{lo}..{hi}]"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds (rough numbers)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a bar is missed")
    parser.add_argument("--both", action="store_true", help="also measure the message rates with both PEs sending")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    heap = f"{2 * max(cfg.sizes) // MIB + 8}M"
    rows = []  # (measurement, unit, shmemx values, reference name, reference values, bar, ok, MPI values)
    load_before = os.getloadavg()[0]

    (bw,) = _job(_bandwidth_body, cfg, heap=heap)
    mpi = _mpi_bandwidth(cfg) if mpi_available() else None
    for size in cfg.sizes:
        r = bw[str(size)]
        ratio = _median(r["put"]) / _median(r["copyto"])
        bar, ok = ("", None) if size < MIB else (">= 0.8x copyto", ratio >= 0.8)
        rows.append((f"put {_size(size)} (x{r['k']}) + quiet", "GB/s", r["put"], "np.copyto", r["copyto"], bar, ok,
                     None if mpi is None else mpi[size]))
    (rate,) = _job(_rate_body, cfg, False)
    refs = rate["copyto"]
    bars = {"loop": (150_000, ">= 150k WQE/s"), "raw": (2_000_000, ">= 2M WQE/s"), "batch": (None, "")}
    names = {"loop": "64 B qp_put_nbi loop, quiet/1024", "batch": "64 B defer/submit, batches of 1024",
             "raw": f"64 B raw path, batches of {cfg.raw_batch}"}
    for key in ("loop", "batch", "raw"):
        floor, bar = bars[key]
        ok = None if floor is None else _median(rate[key]) >= floor
        rows.append((names[key] + ", 1 sender", "WQE/s", rate[key], "copyto loop", refs, bar, ok, None))
    if args.both:
        per_pe = _job(_rate_body, cfg, True)
        for key in ("loop", "batch", "raw"):
            values = [v for pe in per_pe for v in pe[key]]
            rows.append((names[key] + ", both send (per PE)", "WQE/s", values, "copyto loop",
                         [v for pe in per_pe for v in pe["copyto"]], "", None, None))
    (pp,) = _job(_pingpong_body, cfg)
    rows.append(("put_signal -> wait_until, half round trip", "us", pp["put_signal"], "signal_op SET",
                 pp["signal_op"], "", None, None))

    cores = len(os.sched_getaffinity(0))
    print(f"shmemx bench_rma ({'quick' if args.quick else 'full'} run; {cores} cores; 2 PEs; medians over "
          f"{cfg.samples} samples, min..max in brackets; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after: figures are wall time, a loaded host lowers them)")
    if mpi is None:
        print("MPI_Put columns skipped: " + ("mpi4py is not importable" if not mpi_available() else
                                             "mpiexec missing or the MPI job failed"))
    mpi_col = f" {'MPI_Put+flush':>26}" if mpi is not None else ""
    header = (f"{'measurement':<56} {'unit':>5} {'shmemx':>26} {'reference':>13} {'reference value':>26} "
              f"{'ratio':>6}{mpi_col}  {'bar':<15} result")
    print(header)
    print("-" * len(header))
    missed = 0
    for what, unit, values, ref_name, ref_values, bar, ok, mpi_values in rows:
        ref = _fmt(ref_values, unit) if ref_values else ""
        ratio = f"{_median(values) / _median(ref_values):.2f}x" if ref_values else ""
        result = "" if ok is None else ("PASS" if ok else "FAIL")
        missed += ok is False
        extra = f" {_fmt(mpi_values, unit) if mpi_values else '':>26}" if mpi is not None else ""
        print(f"{what:<56} {unit:>5} {_fmt(values, unit):>26} {ref_name:>13} {ref:>26} {ratio:>6}{extra}  "
              f"{bar:<15} {result}")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())

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
* one put of 1 MiB and more followed by its quiet, repeated ``k`` times, beside the same ``np.copyto``s;
* the user's 64-byte pattern: ``aclshmemx_udma_put_nbi(dst[i], src[i], 8, pe)`` from the rows of a local numpy
  array into the rows of a heap array, one quiet per 1024 (the plain API path);
* put_signal -> signal_wait_until ping-pong between 2 PEs (half round trip), beside the same ping-pong done with
  ``aclshmemx_signal_op`` SET (a direct store, no engine);
* peer columns, measured in the same run on the same sizes and patterns when ``scripts/install_peers.sh`` has
  installed them (``scripts/peers.py``): shmem4py over Open MPI's OSHMEM (``put_nbi`` + ``quiet``; ``put``,
  ``fence``, ``atomic_set`` / ``wait_until`` for the ping-pong) and mpi4py over MPICH (``Put`` + ``Win_flush``;
  ``Send`` / ``Recv`` for the ping-pong). The shmemx jobs and the peer jobs alternate, twice, and each figure is
  the median of both rounds' samples, so that drift of this shared host hits all columns.

Bars: puts of 1 MiB and more >= 0.8x np.copyto (issue 3), a 4 MiB put + quiet repeated >= 0.9x np.copyto and >=
shmem4py's (issue 11); qp_put_nbi 64 B >= 150,000 completed WQE/s per PE and the raw vectorised path >= 2,000,000
(issue 3); the user's 64-byte put_nbi pattern >= 370,000 and >= shmem4py's (issue 11); put_signal half round trip
<= 25 us (issue 11), then <= 5 us and at most shmem4py's in the same run (issue 29).

Usage: ``python scripts/bench_rma.py [--quick] [--check] [--both] [--peers | --no-peers] [--bw-only] [--sizes 1M,4M]
[--rounds N] [--coop-ab] [--pingpong]``. ``--quick`` is a smoke run of a few seconds (rough numbers; no peers unless ``--peers``);
``--check`` exits 1 when a bar is missed; ``--bw-only`` / ``--sizes`` / ``--rounds`` focus a run on some put sizes;
``--coop-ab`` adds, under each put row of 1 MiB and more, the same puts with the engine's cooperative copy off
(``_engine.c``: the engine and the thread waiting in quiet copy a large payload together), measured sample by
sample beside it on; ``--pingpong`` measures the ping-pong row only (with the peers' unless ``--no-peers``).
"""

from __future__ import annotations

import argparse
import dataclasses
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


def _set_coop(value) -> None:
    """The engine's cooperative-copy threshold (bytes; 0 = off), where the engine has one."""
    from shmemx.runtime import runtime

    native = runtime().udma.engine.native
    if hasattr(native, "set_coop"):
        native.set_coop(value)


def _engine_chunk() -> int:
    from shmemx.udma import _engine

    return getattr(_engine, "COOP_CHUNK", 0)


def _bandwidth_body(cfg: Config, ab: bool = False) -> None:
    shmemx.init()
    me = shmemx.my_pe()
    top = max(cfg.sizes)
    src = shmemx.full(top, 7, np.uint8, name="src")  # allocations are pre-faulted by their owner
    dst = shmemx.zeros(top, np.uint8, name="dst")
    shmemx.aclshmem_barrier_all()
    result = {}
    if me == 0:
        from shmemx.runtime import runtime

        native = runtime().udma.engine.native
        default = getattr(native, "coop_min", None)
        variants = [("", default)] + ([("_off", 0)] if ab and default is not None else [])
        peer = shmemx.aclshmem_ptr(dst, 1)
        np.copyto(peer, src)  # this process's first touch of pe 1's pages
        shmemx.aclshmemx_udma_qp_put_nbi(dst, src, top, 1, 0)
        shmemx.aclshmemx_udma_qp_quiet(1, 0)
        for size in cfg.sizes:
            k = max(1, min(cfg.bw_max_k, cfg.bw_bytes // size))
            s, d, p = src[:size], dst[:size], peer[:size]
            r = {"k": k, "copyto": []}
            for _ in range(cfg.samples):
                t0 = time.perf_counter()
                for _ in range(k):
                    np.copyto(p, s)
                r["copyto"].append(k * size / (time.perf_counter() - t0))
                for tag, coop in variants:  # with --coop-ab: the cooperative copy on and off, sample by sample
                    if tag and size < MIB:
                        continue
                    if coop is not None:
                        _set_coop(coop)
                    t0 = time.perf_counter()
                    for _ in range(k):
                        shmemx.aclshmemx_udma_qp_put_nbi(d, s, size, 1, 0)
                    shmemx.aclshmemx_udma_qp_quiet(1, 0)
                    r.setdefault("put" + tag, []).append(k * size / (time.perf_counter() - t0))
                    if size >= MIB:  # one put and its quiet, k times
                        t0 = time.perf_counter()
                        for _ in range(k):
                            shmemx.aclshmemx_udma_qp_put_nbi(d, s, size, 1, 0)
                            shmemx.aclshmemx_udma_qp_quiet(1, 0)
                        r.setdefault("put1" + tag, []).append(k * size / (time.perf_counter() - t0))
            if default is not None:
                _set_coop(default)
            r.setdefault("put1", [])
            result[size] = r
        assert np.array_equal(p, s), "a put landed the wrong bytes"
        result["coop"] = {"min": default, "counts": list(getattr(native, "coop_counts", (0, 0)))}
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
    result = {"loop": [], "local": [], "batch": [], "raw": [], "copyto": []}
    rows = np.arange(slots * 8, dtype=np.int64).reshape(slots, 8) + (me << 40)  # a local array, not the heap
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

    def local_rows() -> None:
        put = shmemx.aclshmemx_udma_put_nbi
        for base in range(0, total, 1024):
            for i in range(base % slots, base % slots + 1024):
                put(dst[i], rows[i], 8, nxt)
            shmemx.aclshmemx_udma_quiet(nxt)

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

    for name, fn in (("loop", loop), ("local", local_rows), ("batch", batch), ("raw", raw), ("copyto", copyto)):
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


def _peer_cfg(cfg: Config) -> dict:
    return {"sizes": cfg.sizes, "bw_bytes": cfg.bw_bytes, "bw_max_k": cfg.bw_max_k, "samples": cfg.samples,
            "slots": cfg.raw_batch, "rate_wqes": cfg.rate_wqes, "pingpong_rounds": cfg.pingpong_rounds}


class _Pool:
    """Samples of every figure, pooled over the rounds: ``pool[source][key]`` lists."""

    def __init__(self):
        self.data: dict = {}

    def add(self, source: str, key, values) -> None:
        if values:
            self.data.setdefault(source, {}).setdefault(key, []).extend(values)

    def get(self, source: str, key):
        return self.data.get(source, {}).get(key)


def _measure(cfg: Config, heap: str, peer_names: list, rounds: int, ab: bool = False, bw_only: bool = False,
             pingpong_only: bool = False) -> _Pool:
    """Every job, shmemx's and each peer's alternating, ``rounds`` times (``bw_only``: the bandwidth jobs only;
    ``pingpong_only``: the ping-pong jobs only)."""
    import peers

    pool = _Pool()
    pcfg = _peer_cfg(cfg)
    for _ in range(rounds):
        if pingpong_only:
            (pp,) = _job(_pingpong_body, cfg)
            for key, values in pp.items():
                pool.add("shmemx", key, values)
            for peer in peer_names:
                pool.add(peer, "put_signal", (peers.run(peer, "pingpong", 2, pcfg) or {}).get("pingpong"))
            continue
        (bw,) = _job(_bandwidth_body, cfg, ab, heap=heap)
        for size in cfg.sizes:
            r = bw[str(size)]
            pool.add("k", size, [r["k"]])
            for key in ("put", "copyto", "put1", "put_off", "put1_off"):
                pool.add("shmemx", (key, size), r.get(key))
        coop = bw.get("coop", {})
        pool.add("coop", "min", [coop.get("min")])
        pool.add("coop", "counts", [coop.get("counts", [0, 0])])
        for peer in peer_names:
            got = peers.run(peer, "bw", 2, pcfg) or {}
            for size, r in got.items():
                pool.add(peer, ("put", int(size)), r["put"])
                pool.add(peer, ("put1", int(size)), r["put1"])
        if bw_only:
            continue
        (rate,) = _job(_rate_body, cfg, False)
        for key, values in rate.items():
            pool.add("shmemx", key, values)
        for peer in peer_names:
            pool.add(peer, "local", (peers.run(peer, "rate", 2, pcfg) or {}).get("rate"))
        (pp,) = _job(_pingpong_body, cfg)
        for key, values in pp.items():
            pool.add("shmemx", key, values)
        for peer in peer_names:
            pool.add(peer, "put_signal", (peers.run(peer, "pingpong", 2, pcfg) or {}).get("pingpong"))
    return pool


HOST_SIZES = [KIB << (2 * i) for i in range(9)]  # 1 KiB, 4 KiB, ..., 64 MiB


def _hosts_job(engine: str, sizes, samples: int, rate_n: int, pings: int, hosts: int) -> dict:
    """One shmemx job over ``hosts`` hosts, or one MPI job of as many processes with the same network settings
    (``launcher.hosts``: MPI's network path, no shared memory), running scripts/bench_hosts_body.py."""
    import subprocess

    from shmemx.launcher.hosts import _NOLOCAL, _mpiexec

    body = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_hosts_body.py")
    args = ["--engine", engine, "--sizes", ",".join(map(str, sizes)), "--samples", str(samples), "--rate-n",
            str(rate_n), "--pings", str(pings)]
    if engine == "shmemx":
        cmd = [sys.executable, "-m", "shmemx", "run", "-n", "2", "--hosts", str(hosts), "--timeout", "600", body]
    else:
        cmd = [_mpiexec(), "-n", "2", sys.executable, body]
    proc = subprocess.run(cmd + args, capture_output=True, text=True, env=dict(os.environ, **_NOLOCAL), timeout=900)
    for line in proc.stdout.splitlines():
        if "BENCH " in line:
            return json.loads(line.split("BENCH ", 1)[1])
    raise RuntimeError(f"{engine} job failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def _hfmt(values, unit: str) -> str:
    """The --hosts rows' values (GB/s, msg/s and us as measured): median [min..max]."""
    scale, fmt = {"GB/s": (1, "{:.2f}"), "msg/s": (1e-3, "{:,.1f}k"), "us": (1, "{:.1f}")}[unit]
    med = fmt.format(_median(values) * scale)
    lo, hi = (fmt.format(v * scale) for v in (min(values), max(values)))
    return f"{med} [{lo}..{hi}]"


def _hosts_main(args) -> int:
    """bench_rma.py --hosts H: cross-host put bandwidth (1 KiB .. 64 MiB), 64 B message rate and ping-pong, shmemx
    (PE 0 on host 0 -> PE 1 on host 1) beside MPI's own between two processes, the jobs alternating twice."""
    from shmemx.launcher.hosts import mpi_versions

    sizes = [KIB, 64 * KIB, MIB, 4 * MIB] if args.quick else HOST_SIZES
    if args.sizes:
        units = {"K": KIB, "M": MIB}
        sizes = [int(t[:-1]) * units[t[-1].upper()] if t[-1].upper() in units else int(t)
                 for t in args.sizes.split(",")]
    samples, rate_n, pings = (2, 4096, 50) if args.quick else (5, 16384, 300)
    rounds = args.rounds or (1 if args.quick else 2)
    got = {"shmemx": [], "mpi": []}
    load_before = os.getloadavg()[0]
    for _ in range(rounds):
        for engine in ("shmemx", "mpi"):
            got[engine].append(_hosts_job(engine, sizes, samples, rate_n, pings, args.hosts))

    def pooled(engine, key, size=None):
        out = []
        for r in got[engine]:
            v = r[key] if size is None else r[key][str(size)]
            out += v
        return out

    rows = []
    for size in sizes:
        ours, theirs = pooled("shmemx", "bw", size), pooled("mpi", "bw", size)
        bar = ">= 0.8x MPI_Put+flush" if size == 4 * MIB else ""
        rows.append((f"put {_size(size)} x{max(1, min(256, (16 * MIB) // size))} + quiet", "GB/s", ours, theirs,
                     bar, (_median(ours) / _median(theirs) >= 0.8) if bar else None))
    ours, theirs = pooled("shmemx", "rate"), pooled("mpi", "rate")
    rows.append(("64 B put rate, quiet/1024", "msg/s", ours, theirs, ">= 0.5x MPI's",
                 _median(ours) / _median(theirs) >= 0.5))
    ours, theirs = pooled("shmemx", "pingpong_us"), pooled("mpi", "pingpong_us")
    rows.append(("ping-pong half round trip", "us", ours, theirs, "", None))
    print(f"bench_rma --hosts {args.hosts}: PE 0 (host 0) -> PE 1 (host 1); MPI: {mpi_versions()}, "
          f"network path (MPIR_CVAR_NOLOCAL=1, ofi tcp); shmemx put_signal + wait vs MPI Send/Recv for the ping-pong")
    print(f"{'measurement':36} {'unit':6} {'shmemx':>28} {'MPI':>28} {'ratio':>6}  bar")
    missed = 0
    for name, unit, ours, theirs, bar, ok in rows:
        ratio = _median(ours) / _median(theirs)
        mark = "" if ok is None else (" ok" if ok else " MISSED")
        missed += ok is False
        print(f"{name:36} {unit:6} {_hfmt(ours, unit):>28} {_hfmt(theirs, unit):>28} {ratio:6.2f}  {bar}{mark}")
    print(f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}; {rounds} rounds, medians (min..max)")
    return 1 if args.check and missed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds (rough numbers)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a bar is missed")
    parser.add_argument("--both", action="store_true", help="also measure the message rates with both PEs sending")
    parser.add_argument("--peers", dest="peers", action="store_true", default=None,
                        help="measure the installed peers (the default of a full run)")
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="measure shmemx only")
    parser.add_argument("--bw-only", action="store_true", help="the put bandwidth rows only")
    parser.add_argument("--pingpong", action="store_true", help="the put_signal ping-pong row only")
    parser.add_argument("--sizes", help="put sizes to measure, e.g. 1M,4M (default: 64 B .. 64 MiB)")
    parser.add_argument("--rounds", type=int, help="rounds of the shmemx and peer jobs (default 2; 1 with --quick)")
    parser.add_argument("--coop-ab", action="store_true",
                        help="also measure puts of 1 MiB and more with the engine's cooperative copy off, sample by "
                             "sample beside it on")
    parser.add_argument("--hosts", type=int, default=None,
                        help="across H emulated hosts joined by MPI (shmemx run --hosts): shmemx beside MPI's own "
                             "MPI_Put + Win_flush and Send/Recv, measured in the same run")
    args = parser.parse_args(argv)
    if args.hosts:
        return _hosts_main(args)
    cfg = QUICK if args.quick else FULL
    if args.sizes:
        units = {"K": KIB, "M": MIB}
        cfg = dataclasses.replace(cfg, sizes=[int(t[:-1]) * units[t[-1].upper()] if t[-1].upper() in units else int(t)
                                              for t in args.sizes.split(",")])
    heap = f"{2 * max(cfg.sizes, default=0) // MIB + 8}M"
    load_before = os.getloadavg()[0]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import peers

    installed = peers.available()
    want = (not args.quick) if args.peers is None else args.peers
    peer_names = [p for p in peers.PEERS if want and installed[p]]
    rounds = args.rounds or (1 if args.quick else 2)
    if args.pingpong:
        cfg = dataclasses.replace(cfg, sizes=[])
    pool = _measure(cfg, heap, peer_names, rounds, args.coop_ab, args.bw_only, args.pingpong)

    rows = []  # (measurement, unit, shmemx values, reference name, reference values, bar, ok, {peer: values})
    sh = lambda key: pool.get("shmemx", key)  # noqa: E731
    level = {}  # bars "at least level with shmem4py"
    for size in cfg.sizes:
        k = pool.get("k", size)[0]
        ratio = _median(sh(("put", size))) / _median(sh(("copyto", size)))
        bar, ok = ("", None) if size < MIB else (">= 0.8x copyto", ratio >= 0.8)
        rows.append((f"put {_size(size)} (x{k}) + quiet", "GB/s", sh(("put", size)), "np.copyto",
                     sh(("copyto", size)), bar, ok, {p: pool.get(p, ("put", size)) for p in peer_names}))
        if sh(("put_off", size)):  # --coop-ab: the same puts with the cooperative copy off
            rows.append(("  the same, cooperative copy off", "GB/s", sh(("put_off", size)), "np.copyto",
                         sh(("copyto", size)), "", None, {}))
    for size in cfg.sizes:
        if size < MIB:
            continue
        k = pool.get("k", size)[0]
        values = sh(("put1", size))
        ratio = _median(values) / _median(sh(("copyto", size)))
        bar, ok = ("", None)
        if size == 4 * MIB:
            bar, ok = ">= 0.9x copyto", ratio >= 0.9
            theirs = pool.get("shmem4py", ("put1", size))
            if theirs:
                level["4 MiB put + quiet"] = (_median(values), _median(theirs))
        rows.append((f"(put {_size(size)} + quiet) x{k}", "GB/s", values, "np.copyto", sh(("copyto", size)), bar, ok,
                     {p: pool.get(p, ("put1", size)) for p in peer_names}))
        if sh(("put1_off", size)):
            rows.append(("  the same, cooperative copy off", "GB/s", sh(("put1_off", size)), "np.copyto",
                         sh(("copyto", size)), "", None, {}))
    refs = sh("copyto") if not (args.bw_only or args.pingpong) else None
    bars = {"loop": (150_000, ">= 150k WQE/s"), "local": (370_000, ">= 370k WQE/s"), "raw": (2_000_000, ">= 2M WQE/s"),
            "batch": (None, "")}
    names = {"loop": "64 B qp_put_nbi loop, quiet/1024", "local": "64 B put_nbi local->heap rows, quiet/1024",
             "batch": "64 B defer/submit, batches of 1024", "raw": f"64 B raw path, batches of {cfg.raw_batch}"}
    for key in ("loop", "local", "batch", "raw") if not (args.bw_only or args.pingpong) else ():
        floor, bar = bars[key]
        ok = None if floor is None else _median(sh(key)) >= floor
        extra = {p: pool.get(p, "local") for p in peer_names} if key == "local" else {}
        if key == "local" and pool.get("shmem4py", "local"):
            level["64 B put_nbi rate"] = (_median(sh(key)), _median(pool.get("shmem4py", "local")))
        rows.append((names[key] + ", 1 sender", "WQE/s", sh(key), "copyto loop", refs, bar, ok, extra))
    if args.both:
        per_pe = _job(_rate_body, cfg, True)
        for key in ("loop", "local", "batch", "raw"):
            values = [v for pe in per_pe for v in pe[key]]
            rows.append((names[key] + ", both send (per PE)", "WQE/s", values, "copyto loop",
                         [v for pe in per_pe for v in pe["copyto"]], "", None, {}))
    half = sh("put_signal")
    if not args.bw_only:
        rows.append(("put_signal -> wait_until, half round trip", "us", half, "signal_op SET", sh("signal_op"),
                     "<= 5 us", _median(half) <= 5e-6, {p: pool.get(p, "put_signal") for p in peer_names}))
        theirs = pool.get("shmem4py", "put_signal")
        if theirs:  # a latency: level means at most theirs, so the ratio is theirs / ours
            level["put_signal half round trip"] = (_median(theirs), _median(half))

    cores = len(os.sched_getaffinity(0))
    print(f"shmemx bench_rma ({'quick' if args.quick else 'full'} run; {cores} cores; 2 PEs; medians over "
          f"{cfg.samples} samples{f' x {rounds} rounds' if rounds > 1 else ''}, min..max in brackets; load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after: figures are wall time, a loaded host lowers "
          "them)")
    missing = [p for p in peers.PEERS if p not in peer_names]
    if missing:
        why = "not requested" if not want else "not installed (bash scripts/install_peers.sh)"
        print(f"peer columns skipped ({why}): {', '.join(missing)}")
    if peer_names:
        print("peers: shmem4py = put_nbi + quiet / put, fence, atomic_set -> wait_until over Open MPI OSHMEM; "
              "mpi = Put + Win_flush / Send -> Recv over MPICH")
    coop_min = (pool.get("coop", "min") or [None])[0]
    if coop_min is not None:
        copied = sum(c[0] for c in pool.get("coop", "counts"))
        helped = sum(c[1] for c in pool.get("coop", "counts"))
        sized = _size(coop_min) if coop_min else "no size (off)"
        print(f"cooperative copy: READ / WRITE payloads of {sized} and more; "
              f"{copied} chunks of {_size(_engine_chunk())} copied so, {helped} of them by the quiet-ing thread"
              + (f" ({helped / copied:.0%})" if copied else ""))
    peer_cols = "".join(f" {p:>26}" for p in peer_names)
    header = (f"{'measurement':<56} {'unit':>5} {'shmemx':>26} {'reference':>13} {'reference value':>26} "
              f"{'ratio':>6}{peer_cols}  {'bar':<15} result")
    print(header)
    print("-" * len(header))
    missed = 0
    for what, unit, values, ref_name, ref_values, bar, ok, peer_values in rows:
        ref = _fmt(ref_values, unit) if ref_values else ""
        ratio = f"{_median(values) / _median(ref_values):.2f}x" if ref_values else ""
        result = "" if ok is None else ("PASS" if ok else "FAIL")
        missed += ok is False
        extra = "".join(f" {_fmt(peer_values[p], unit) if peer_values.get(p) else '':>26}" for p in peer_names)
        print(f"{what:<56} {unit:>5} {_fmt(values, unit):>26} {ref_name:>13} {ref:>26} {ratio:>6}{extra}  "
              f"{bar:<15} {result}")
    for what, (ours, theirs) in level.items():
        ok = ours >= theirs
        missed += not ok
        print(f"level with shmem4py, {what}: shmemx / shmem4py = {ours / theirs:.2f}x (bar >= 1.00x)  "
              f"{'PASS' if ok else 'FAIL'}")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())

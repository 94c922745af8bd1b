"""Host independence of virtual time: one kernel recorded twice, the second time on a loaded machine with random
sleeps injected into every rank, must replay to the identical JSON document.

    python scripts/replay/host_independence.py [--pes 4] [--tokens 64] [--hidden 1024] [--dir DIR]

The kernel (``--kernel``, run by this file in every rank): a DeepEP-style dispatch + combine (``moe.Buffer``,
two rounds, fresh then cached) and a small hand-written exchange (four blocks, a QP each, put_signal to their peers, wait,
quiet, ``compute`` annotations, a barrier). The second recording runs with a busy-looping process beside the job
(the other core loaded) and with every quiet, signal, wait, doorbell and block sync of every rank preceded by a
random sleep of 0-2 ms (seeded per rank): the host interleaving changes completely, the recording and so the
replay must not. Prints both makespans and "identical" (exit 0), or the first difference (exit 1).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)


def kernel(tokens: int, hidden: int) -> None:
    import ml_dtypes
    import numpy as np

    import shmemx
    from shmemx.kernels import moe

    jitter = os.environ.get("SHMEMX_JITTER")
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, 4)  # (the Buffer uses 2, the exchange a QP a block)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    if jitter:
        _inject_sleeps(random.Random(int(jitter) * 1000 + me))
    experts = 8 * n
    rng = np.random.default_rng(me)
    topk = np.argsort(rng.random((tokens, experts)), axis=1)[:, :8].astype(np.int64)
    x = rng.standard_normal((tokens, hidden)).astype(ml_dtypes.bfloat16)
    buf = moe.Buffer(tokens, hidden, 8, experts, qp_policy="two_3_1")
    with shmemx.region("moe"):
        layout = buf.get_dispatch_layout(topk)
        got = buf.dispatch(x, topk_idx=topk, topk_weights=np.ones(topk.shape, np.float32),
                           num_tokens_per_rank=layout.num_tokens_per_rank, is_token_in_rank=layout.is_token_in_rank,
                           num_tokens_per_expert=layout.num_tokens_per_expert)
        shmemx.compute(us=20.0, name="experts")
        buf.combine(got.recv_x, got.handle, got.recv_topk_weights)
        again = buf.dispatch(x, handle=got.handle)
        buf.combine(again.recv_x, got.handle, got.recv_topk_weights)
    inbox = shmemx.zeros((4, n, 4096), np.uint8, name="inbox")
    sig = shmemx.zeros((4, n, 1), np.uint64, name="sig")

    def exchange():
        b = shmemx.get_block_idx()
        src = np.full(4096, me, np.uint8)
        for k in range(1, n):
            peer = (me + k) % n
            shmemx.aclshmemx_udma_qp_put_signal_nbi(inbox[b, me], src, 4096 - 512 * b, sig[b, me], 1 + b, peer, b)
        shmemx.compute(us=1.0 + b)
        for k in range(1, n):
            shmemx.aclshmemx_udma_qp_quiet((me + k) % n, b)
        shmemx.sync_all()
        shmemx.aclshmem_wait_until_all(sig[b, :, 0], shmemx.ACLSHMEM_CMP_GE, 1 + b,
                                       status=np.arange(n) == me)

    with shmemx.region("exchange"):
        shmemx.launch(exchange, 4)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def _inject_sleeps(rng: random.Random) -> None:
    """Precede the calls kernels make (module attributes, looked up at call time) with random sleeps."""
    import shmemx
    from shmemx.api.raw import RawQueue

    def sleepy(fn):
        def wrapped(*args, **kwargs):
            time.sleep(rng.random() * 0.002)
            return fn(*args, **kwargs)
        return wrapped

    for name in ("aclshmemx_udma_qp_quiet", "aclshmemx_udma_quiet", "aclshmemx_signal_op", "aclshmem_wait_until_all",
                 "aclshmemx_udma_qp_put_signal_nbi", "aclshmemx_udma_put_signal_nbi", "sync_all",
                 "aclshmem_barrier_all"):
        setattr(shmemx, name, sleepy(getattr(shmemx, name)))
    RawQueue.ring_doorbell = sleepy(RawQueue.ring_doorbell)


def record(pes: int, path: str, args, *, loaded: bool) -> float:
    env = dict(os.environ)
    hog = None
    if loaded:
        env["SHMEMX_JITTER"] = "7"
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        start = time.monotonic()
        cmd = [sys.executable, "-m", "shmemx", "run", "-n", str(pes), "--record", path, HERE, "--kernel",
               "--tokens", str(args.tokens), "--hidden", str(args.hidden)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if out.returncode:
            raise SystemExit(f"recording failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return time.monotonic() - start
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def first_difference(a, b, where="") -> str:
    if type(a) is not type(b):
        return f"{where}: {a!r} vs {b!r}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return first_difference(a.get(k), b.get(k), f"{where}.{k}")
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{where}[{i}]")
        return f"{where}: lengths {len(a)} vs {len(b)}"
    return f"{where}: {a!r} vs {b!r}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", action="store_true", help="(internal) run the kernel in a rank")
    ap.add_argument("--pes", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dir", default=None, help="where the two recordings go (default: a temporary folder)")
    args = ap.parse_args()
    if args.kernel:
        kernel(args.tokens, args.hidden)
        return
    from shmemx.observe.replay import replay

    folder = args.dir or tempfile.mkdtemp(prefix="shmemx-hostind-")
    os.makedirs(folder, exist_ok=True)
    quiet, loaded = os.path.join(folder, "quiet.rec"), os.path.join(folder, "loaded.rec")
    t_quiet = record(args.pes, quiet, args, loaded=False)
    t_loaded = record(args.pes, loaded, args, loaded=True)
    a, b = replay(quiet), replay(loaded)
    ja, jb = json.dumps(a, sort_keys=True), json.dumps(b, sort_keys=True)
    print(f"{args.pes} PEs, T={args.tokens} H={args.hidden}: recorded in {t_quiet:.1f} s (quiet) and "
          f"{t_loaded:.1f} s (the other core busy, 0-2 ms sleeps before every quiet, signal, wait, doorbell, sync)")
    print(f"replayed makespan {a['makespan_us']:.3f} us vs {b['makespan_us']:.3f} us; {a['wqes']} WQEs, "
          f"{len(a['warnings'])} warning kinds; JSON {len(ja)} bytes")
    if ja == jb:
        print("identical: the two replays are the same JSON document, byte for byte")
        return
    print("DIFFERENT:", first_difference(a, b))
    sys.exit(1)


if __name__ == "__main__":
    main()

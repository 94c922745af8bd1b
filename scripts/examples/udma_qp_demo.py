"""Multi-QP UDMA ring (CANN SHMEM's ``udma_qp_demo``): one AIV block per QP, each moving its slice of a buffer.

    shmemx run -n 4 scripts/examples/udma_qp_demo.py --qp-count 4 --op put_signal --elems 4194304

``aclshmemx_set_qp_num`` (before init) gives every peer ``--qp-count`` QPs; the kernel runs with
``block_dim = qp_count`` and block b uses QP ``qp_idx = get_block_idx()`` (one submitter per QP). The buffer of
``--elems`` bytes is cut into ``qp_count`` slices:

* ``put``: block b writes slice b of its ``src`` into the next PE's ``dst`` (``aclshmemx_udma_qp_put_nbi``);
* ``get``: block b reads slice b of the next PE's ``src`` into its own ``dst`` (``aclshmemx_udma_qp_get_nbi``);
* ``put_signal``: as put, and the WQE also sets the per-QP signal word ``signals[b]`` on the next PE to
  ``((pe + 1) << 32) | (b + 1)`` (``aclshmemx_udma_qp_put_signal_nbi``).

Each block then quiets its own QP (``aclshmemx_udma_qp_quiet``). The kernel runs on an emulated stream between two
``aclshmemx_barrier_all_on_stream`` calls, as CANN's newer demo does, then ``aclrtSynchronizeStream``. Byte i of PE
p's ``src`` is ``((p + 1) * 37 + i % 251) & 0xFF``; ``dst`` must equal the previous PE's pattern (put, put_signal) or the next
PE's (get). Prints ``[PASS] op=... pe=... elements=...`` or ``[FAIL] ...`` per PE; exits 0 only if all pass.
"""

import argparse
import sys

import numpy as np

import shmemx

MAX_ELEMS = 256 << 20  # one UDMA request is at most 256 MiB


def pattern(pe: int, n: int) -> np.ndarray:
    return (((pe + 1) * 37 + np.arange(n) % 251) & 0xFF).astype(np.uint8)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--qp-count", type=int, default=2, help="QPs per peer and AIV blocks, 1..32 (default 2)")
    ap.add_argument("--op", choices=["put", "get", "put_signal"], default="put")
    ap.add_argument("--elems", type=int, default=1 << 20,
                    help="bytes to move, divisible by --qp-count, at most 256 MiB (default 1 MiB)")
    ap.add_argument("--heap-mb", type=int, default=0, help="heap per PE in MiB (default: what the buffers need)")
    args = ap.parse_args()
    if not 1 <= args.qp_count <= 32:
        ap.error(f"--qp-count {args.qp_count} out of range 1..32")
    if args.elems <= 0 or args.elems % args.qp_count or args.elems > MAX_ELEMS:
        ap.error(f"--elems {args.elems} must be positive, divisible by --qp-count {args.qp_count} and at most "
                 f"{MAX_ELEMS}")
    return args


args = parse()
q, elems = args.qp_count, args.elems
shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, q)
shmemx.init(heap_size=(args.heap_mb << 20) or 2 * elems + (1 << 20))
me, n = shmemx.my_pe(), shmemx.n_pes()
if n < 2:
    print("udma_qp_demo needs at least 2 PEs (UDMA to the own PE is not allowed)", file=sys.stderr)
    raise SystemExit(2)
nxt, prev = (me + 1) % n, (me - 1) % n
src = shmemx.array(pattern(me, elems), name="src")
dst = shmemx.zeros(elems, np.uint8, name="dst")
signals = shmemx.zeros(q, np.uint64, name="signals")
shmemx.aclshmem_barrier_all()


def kernel():
    qp = shmemx.get_block_idx()
    piece = slice(qp * (elems // q), (qp + 1) * (elems // q))
    count = elems // q
    if args.op == "put":
        shmemx.aclshmemx_udma_qp_put_nbi(dst[piece], src[piece], count, nxt, qp)
    elif args.op == "get":
        shmemx.aclshmemx_udma_qp_get_nbi(dst[piece], src[piece], count, nxt, qp)
    else:
        shmemx.aclshmemx_udma_qp_put_signal_nbi(dst[piece], src[piece], count, signals[qp:qp + 1],
                                                ((me + 1) << 32) | (qp + 1), nxt, qp)
    shmemx.aclshmemx_udma_qp_quiet(nxt, qp)


stream = shmemx.aclrtCreateStream()  # as CANN's newer demo: barrier, kernel, barrier, all on one stream
shmemx.aclshmemx_barrier_all_on_stream(stream)
stream.launch(kernel, q)  # (kernel<<<q, nullptr, stream>>>())
shmemx.aclshmemx_barrier_all_on_stream(stream)  # every PE's blocks have quieted: all puts into me are complete
shmemx.aclrtSynchronizeStream(stream)
shmemx.aclrtDestroyStream(stream)
origin = nxt if args.op == "get" else prev
wrong = np.flatnonzero(dst != pattern(origin, elems))
ok = not len(wrong)
detail = f"op={args.op} pe={me} elements={elems}"
if args.op == "put_signal":
    want = [((prev + 1) << 32) | (qp + 1) for qp in range(q)]
    bad_sig = [qp for qp in range(q) if int(signals[qp]) != want[qp]]
    ok = ok and not bad_sig
    detail += f" signals={q - len(bad_sig)}/{q}"
if not len(wrong):
    print(f"[{'PASS' if ok else 'FAIL'}] {detail}")
else:
    print(f"[FAIL] {detail}: {len(wrong)} bytes differ from pe {origin}'s pattern, first at {int(wrong[0])}")
shmemx.finalize()
raise SystemExit(0 if ok else 1)

"""MTE allgather synchronised with signals (CANN SHMEM's ``allgather`` example, small-message path).

    shmemx run -n 8 scripts/examples/mte_allgather.py --len 4096 --dtype bfloat16 --blocks 8 --iters 5

Every PE contributes ``--len`` elements; ``--blocks`` AIV blocks each own one chunk of them. Per iteration, block b
of PE p:

1. ``aclshmemx_mte_put_nbi``-s its chunk of the input into PE p's own symmetric buffer, ``aclshmemx_mte_quiet``,
   ``sync_all``;
2. publishes it: ``aclshmemx_signal_op(flag[b], magic, ACLSHMEM_SIGNAL_SET, p)`` (its own flag word);
3. for every PE x: ``aclshmem_signal_wait_until(aclshmem_ptr(flag, x)[b], EQ, magic)`` (PE x's flag, read in
   place), then ``aclshmemx_mte_get_nbi`` of chunk b of PE x's symmetric buffer into ``output[x]``;
4. meets every block of every PE (``aclshmemx_barrier_all_vec``) before the buffer is reused.

``magic`` changes every iteration, so a flag of the previous one never satisfies a wait. The output must equal
the PE-ordered concatenation of every PE's input (a numpy reference). Prints PASS or FAIL per PE; exits 1 on a
mismatch.
"""

import argparse

import ml_dtypes
import numpy as np

import shmemx

DTYPES = {"int32": np.int32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--len", type=int, default=4096, help="elements per PE (default 4096)")
ap.add_argument("--dtype", choices=sorted(DTYPES), default="int32")
ap.add_argument("--blocks", type=int, default=8, help="AIV blocks; --len must be divisible by it (default 8)")
ap.add_argument("--iters", type=int, default=3)
args = ap.parse_args()
if args.len <= 0 or args.len % args.blocks:
    ap.error(f"--len {args.len} must be positive and divisible by --blocks {args.blocks}")
dtype = DTYPES[args.dtype]
length, blocks = args.len, args.blocks
chunk = length // blocks

shmemx.init()
me, n = shmemx.my_pe(), shmemx.n_pes()
sym = shmemx.zeros(length, dtype, name="sym")  # each PE's contribution, readable by every PE
flag = shmemx.zeros(blocks, np.int32, name="flag")  # one flag word per block


def contribution(pe: int, it: int) -> np.ndarray:
    # small integers: exact in bfloat16 and float16 too, and they name their PE, position and iteration
    return ((pe * 16 + np.arange(length) % 16 + it) % 256).astype(dtype)


def kernel(inp: np.ndarray, out: np.ndarray, magic: int) -> None:
    b = shmemx.get_block_idx()
    mine = slice(b * chunk, (b + 1) * chunk)
    shmemx.aclshmemx_mte_put_nbi(sym[mine], inp[mine], chunk, me)
    shmemx.aclshmemx_mte_quiet()
    shmemx.sync_all()
    shmemx.aclshmemx_signal_op(flag[b:b + 1], magic, shmemx.ACLSHMEM_SIGNAL_SET, me)
    for x in range(n):
        shmemx.aclshmem_signal_wait_until(shmemx.aclshmem_ptr(flag, x)[b:b + 1], shmemx.ACLSHMEM_CMP_EQ, magic)
        shmemx.aclshmemx_mte_get_nbi(out[x, mine], sym[mine], chunk, x)
    shmemx.aclshmemx_barrier_all_vec()


ok = True
for it in range(args.iters):
    inp = contribution(me, it)
    out = np.zeros((n, length), dtype)
    shmemx.launch(kernel, blocks, inp, out, (it + 1) * 1024)
    golden = np.stack([contribution(pe, it) for pe in range(n)])
    if not np.array_equal(out.view(np.uint8), golden.view(np.uint8)):
        rows = [x for x in range(n) if not np.array_equal(out[x], golden[x])]
        print(f"FAIL: pe {me}: iteration {it}: the parts of pes {rows} differ from the reference")
        ok = False
if ok:
    print(f"PASS: pe {me}: {args.iters} iterations, {n} x {length} {args.dtype} gathered, {blocks} blocks")
shmemx.finalize()
raise SystemExit(0 if ok else 1)

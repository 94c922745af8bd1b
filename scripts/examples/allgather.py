"""CANN SHMEM's ``allgather`` example (examples/allgather, its large-data kernel) re-expressed with shmemx.

    shmemx run -n 4 scripts/examples/allgather.py --len 65536 --dtype bfloat16 --blocks 8 --chunk 4096

The kernel runs on ``--blocks`` AIV blocks, in two halves, as CANN's ``all_gather_origin``:

* **producers** (the first half): block b owns slice b of the PE's input; it copies it into the PE's own
  symmetric buffer chunk by chunk (``aclshmemx_mte_put_nbi`` to itself, ``--chunk`` elements a time, CANN's UB
  size) and after each chunk publishes how many are in: ``aclshmemx_signal_op(flag[b], magic + chunks, SET, me)``;
* **consumers** (the second half): block j serves the PEs ``x = j, j + half, ...``; it reads every producer's
  flag on x with ``aclshmem_int32_atomic_fetch`` (CANN's kernel polls with ``aclshmem_int32_get_nbi``, a get that
  races the flag's signal_op: ``--check`` names that race), copies the chunks
  that are ready from x's symmetric buffer into ``output[x]`` with ``aclshmem_<T>_get_nbi``, and goes on until
  every slice of every PE it serves is in. Where CANN's kernel polls in a loop, this one, when a poll finds nothing
  new, sleeps on the flag (``aclshmem_int32_wait_until`` on x's flag): PEs outnumber cores here.

``magic`` grows by 1024 per call (CANN's ``magic * 1024``), so a flag of an earlier call is never mistaken for this
one's. The host launches the kernel on an emulated stream (``aclrtStream``) after ``aclshmemx_barrier_all_on_stream``
and synchronizes it, as CANN's ``main.cpp`` does. The output must equal the PE-ordered concatenation of every PE's
input (numpy). Prints PASS or FAIL per PE; exits 1 on a mismatch.
"""

import argparse

import ml_dtypes
import numpy as np

import shmemx

DTYPES = {"int32": np.int32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
CANN_TYPE = {"int32": "int32", "float16": "half", "bfloat16": "bfloat16"}  # the <T> of aclshmem_<T>_get_nbi
SYNC_FLAG_INTERVAL = 16  # int32 words between two blocks' flags (CANN's SYNC_FLAG_INTERVAL)

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--len", type=int, default=16384, help="elements per PE (default 16384)")
ap.add_argument("--dtype", choices=sorted(DTYPES), default="int32")
ap.add_argument("--blocks", type=int, default=8, help="AIV blocks, even; half produce, half consume (default 8)")
ap.add_argument("--chunk", type=int, default=1024, help="elements per copy (CANN: its UB buffer; default 1024)")
ap.add_argument("--iters", type=int, default=2)
args = ap.parse_args()
if args.blocks < 2 or args.blocks % 2 or args.len % (args.blocks // 2):
    ap.error(f"--blocks {args.blocks} must be even, and --len {args.len} divisible by half of it")
dtype, length, half = DTYPES[args.dtype], args.len, args.blocks // 2
per_block = length // half

shmemx.init()
me, n = shmemx.my_pe(), shmemx.n_pes()
flags = shmemx.zeros(half * SYNC_FLAG_INTERVAL, np.int32, name="flags")  # CANN: the front of its gva buffer
data = shmemx.zeros(length, dtype, name="data")  # CANN: the rest of it


def contribution(pe: int, it: int) -> np.ndarray:
    return ((pe * 16 + np.arange(length) % 16 + it) % 256).astype(dtype)  # exact in every dtype, names its PE


def produce(b: int, inp: np.ndarray, magic: int) -> None:
    mine = slice(b * per_block, (b + 1) * per_block)
    for k, start in enumerate(range(mine.start, mine.stop, args.chunk), 1):
        count = min(args.chunk, mine.stop - start)
        shmemx.aclshmemx_mte_put_nbi(data[start:start + count], inp[start:start + count], count, me)
        shmemx.aclshmemx_mte_quiet()
        shmemx.aclshmemx_signal_op(flags[b * SYNC_FLAG_INTERVAL:b * SYNC_FLAG_INTERVAL + 1], magic + k,
                                   shmemx.ACLSHMEM_SIGNAL_SET, me)


def consume(j: int, out: np.ndarray, magic: int) -> None:
    get = getattr(shmemx, f"aclshmem_{CANN_TYPE[args.dtype]}_get_nbi")
    chunks = -(-per_block // args.chunk)
    for x in range(j, n, half):
        done = [0] * half  # chunks of producer g already copied
        while min(done) < chunks:
            progress = False
            for g in range(half):
                if done[g] == chunks:
                    continue
                word = flags[g * SYNC_FLAG_INTERVAL:g * SYNC_FLAG_INTERVAL + 1]
                # CANN's kernel polls with aclshmem_int32_get_nbi; a get of the word racing the producer's
                # signal_op is a data race by the memory model (--check names it: source-overwrite), so this
                # port polls with the atomic fetch of the same 32-bit word
                polled = int(shmemx.aclshmem_int32_atomic_fetch(word, x))
                ready = polled - magic
                if (polled >> 10) != (magic >> 10) or ready <= done[g]:
                    continue
                # the acquire of what the poll saw (met at once; a get is not one the sanitizer can see)
                shmemx.aclshmem_int32_wait_until(shmemx.aclshmem_ptr(word, x), shmemx.ACLSHMEM_CMP_GE, magic + ready)
                lo = g * per_block + done[g] * args.chunk
                hi = min(g * per_block + ready * args.chunk, (g + 1) * per_block)
                get(out[x, lo:hi], data[lo:hi], hi - lo, x)
                done[g], progress = ready, True
            if not progress:  # nothing new: sleep until some flag of x moves (CANN polls here)
                g = done.index(min(done))
                word = shmemx.aclshmem_ptr(flags, x)[g * SYNC_FLAG_INTERVAL:g * SYNC_FLAG_INTERVAL + 1]
                shmemx.aclshmem_int32_wait_until(word, shmemx.ACLSHMEM_CMP_GT, magic + done[g])
        if shmemx.engine_of(x) == shmemx.Engine.UDMA:
            shmemx.aclshmemx_udma_quiet(x)


def kernel(inp: np.ndarray, out: np.ndarray, magic: int) -> None:
    b = shmemx.get_block_idx()
    if b < half:
        produce(b, inp, magic)
    else:
        consume(b - half, out, magic)
    shmemx.aclshmemx_mte_quiet()


ok = True
stream = shmemx.aclrtCreateStream()
for it in range(args.iters):
    inp = contribution(me, it)
    out = np.zeros((n, length), dtype)
    shmemx.aclshmemx_barrier_all_on_stream(stream)  # nobody still reads the previous call's buffer
    stream.launch(kernel, args.blocks, inp, out, (it + 2) * 1024)
    shmemx.aclrtSynchronizeStream(stream)
    golden = np.stack([contribution(pe, it) for pe in range(n)])
    if not np.array_equal(out.view(np.uint8), golden.view(np.uint8)):
        rows = [x for x in range(n) if not np.array_equal(out[x].view(np.uint8), golden[x].view(np.uint8))]
        print(f"FAIL: pe {me}: iteration {it}: the parts of pes {rows} differ from the reference")
        ok = False
shmemx.aclshmemx_barrier_all_on_stream(stream)
shmemx.aclrtDestroyStream(stream)
if ok:
    print(f"PASS: pe {me}: {args.iters} iterations, {n} x {length} {args.dtype} gathered, {half} producer and "
          f"{half} consumer blocks")
shmemx.finalize()
raise SystemExit(0 if ok else 1)

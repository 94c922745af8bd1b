"""CANN SHMEM's double-plane MoE dispatch and combine (examples/dispatch/dispatch_doubleplane,
examples/combine/combine_doubleplane) re-expressed with shmemx: large segments over SDMA, the rest and every
control word over MTE.

    shmemx run -n 4 scripts/examples/sdma_moe.py --tokens 64 --hidden 256 --topk 2 --experts-per-rank 2

Init enables ``ACLSHMEM_DATA_OP_MTE | ACLSHMEM_DATA_OP_SDMA``; every PE is in one server (SDMA reaches the server
only). Each PE routes its ``--tokens`` tokens (rows of ``--hidden`` float32, ``x[t] = pe * 1000 + t`` in every
column) to ``--topk`` of the ``n * L`` experts (a skewed, seeded routing, so that some segments are large). The
kernel has one block per destination rank (CANN: one AIV core per target rank), and block d:

1. counts the tokens of each segment (d, local expert e) and marks it for SDMA when it goes to another PE, is at
   least ``--sdma-min-kib`` and is larger than this PE's average remote segment (CANN's rule, 2 MiB there);
2. posts the SDMA segments (``aclshmemx_sdma_put_nbi`` of the staged rows into d's receive slots; a quiet every
   256 issues), then ``aclshmemx_sdma_quiet`` (its own channel);
3. copies the other segments with MTE (``aclshmemx_mte_put_nbi``);
4. writes the control plane with MTE only: the segment counts, then the ready flag on d
   (``aclshmemx_signal_op``), so that d never sees "ready" before a payload (the README's rule).

Each PE waits for every source's flag, "computes" (expert g scales its rows by g + 1) and combines back the same
way: the processed segment to the source's landing rows (SDMA when large), the count-free done flag over MTE.
Each source sums its tokens' rows weighted by their top-k weights. Both outputs are checked against numpy (the
received rows per expert, and the combined tokens). Prints PASS or FAIL per PE; exits 1 on a mismatch.
"""

import argparse

import numpy as np

import shmemx

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--hidden", type=int, default=256)
ap.add_argument("--topk", type=int, default=2)
ap.add_argument("--experts-per-rank", type=int, default=2)
ap.add_argument("--sdma-min-kib", type=int, default=16, help="smallest SDMA segment (CANN: 2048 KiB)")
ap.add_argument("--seed", type=int, default=1)
args = ap.parse_args()
T, H, K, L = args.tokens, args.hidden, args.topk, args.experts_per_rank
MTE, SDMA = shmemx.ACLSHMEM_DATA_OP_MTE, shmemx.ACLSHMEM_DATA_OP_SDMA
EQ, SET = shmemx.ACLSHMEM_CMP_EQ, shmemx.ACLSHMEM_SIGNAL_SET
SDMA_ISSUE_LIMIT = 256

shmemx.aclshmemx_init_attr(0, shmemx.InitAttr(option_attr=shmemx.OptionalAttr(data_op_engine_type=MTE | SDMA)))
me, n = shmemx.my_pe(), shmemx.n_pes()
if n > shmemx.ranks_per_server():
    raise SystemExit(f"sdma_moe: {n} PEs span more than one server of {shmemx.ranks_per_server()}: SDMA reaches one")
E = n * L
recv = shmemx.zeros((L, n, T, H), np.float32, name="recv")  # [local expert, source, slot, hidden]
counts = shmemx.zeros((n, L), np.int32, name="counts")  # [source, local expert]
ready = shmemx.zeros(n, np.int32, name="ready")  # per source: dispatch done
back = shmemx.zeros((E, T, H), np.float32, name="back")  # combine landing rows, per global expert
done = shmemx.zeros(n, np.int32, name="done")  # per expert rank: combine done


def routing(pe: int):
    rng = np.random.default_rng(args.seed * 1000 + pe)
    weights = 1.0 / np.arange(1, E + 1) ** 1.2  # skewed: low experts get most tokens
    experts = np.stack([rng.choice(E, K, replace=False, p=weights / weights.sum()) for _ in range(T)])
    return experts.astype(np.int64), rng.random((T, K)).astype(np.float32)


def tokens(pe: int) -> np.ndarray:
    return np.repeat((pe * 1000 + np.arange(T, dtype=np.float32))[:, None], H, axis=1)


experts, weights = routing(me)
x = tokens(me)
segments = [np.flatnonzero((experts == g).any(axis=1)) for g in range(E)]  # tokens of expert g, ascending
row_bytes = H * 4
remote_rows = sum(len(segments[g]) for g in range(E) if g // L != me)


def use_sdma(dst: int, rows: int) -> bool:
    nbytes = rows * row_bytes  # CANN: > 2 MB and above this PE's average remote segment (cross-multiplied)
    return (dst != me and rows > 0 and nbytes >= args.sdma_min_kib * 1024
            and nbytes * max(n - 1, 1) * L > remote_rows * row_bytes)


def send(dst: int, pieces: list, flag, flag_value: int, extra=None) -> int:
    """Block ``dst``'s plane split: ``pieces`` = (remote rows view, staged rows) per segment; SDMA for the large
    ones (quieted on this block's channel), MTE for the rest, then the control words over MTE. Returns the
    number of SDMA segments."""
    issued = on_sdma = 0
    for remote, staged in pieces:
        if use_sdma(dst, len(staged)):
            shmemx.aclshmemx_sdma_put_nbi(remote, staged, staged.size, dst)
            issued, on_sdma = issued + 1, on_sdma + 1
            if issued >= SDMA_ISSUE_LIMIT:
                shmemx.aclshmemx_sdma_quiet()
                issued = 0
    if on_sdma:
        shmemx.aclshmemx_sdma_quiet()  # every SDMA payload of this block is in before any control word
    for remote, staged in pieces:
        if not use_sdma(dst, len(staged)) and len(staged):
            shmemx.aclshmemx_mte_put_nbi(remote, staged, staged.size, dst)
    if extra is not None:
        extra()
    shmemx.aclshmemx_mte_quiet()
    shmemx.aclshmemx_signal_op(flag, flag_value, SET, dst)
    return on_sdma


def dispatch_kernel(stats: list) -> None:
    d = shmemx.get_block_idx()
    pieces = [(recv[e, me, :len(segments[d * L + e])], x[segments[d * L + e]]) for e in range(L)]
    mine = np.array([len(segments[d * L + e]) for e in range(L)], np.int32)
    put_counts = lambda: shmemx.aclshmemx_mte_put_nbi(counts[me], mine, L, d)  # noqa: E731
    stats[d] = send(d, pieces, ready[me:me + 1], 1, put_counts)


def combine_kernel(out: list) -> None:
    src = shmemx.get_block_idx()
    pieces = []
    for e in range(L):
        rows = recv[e, src, :counts[src, e]] * np.float32(me * L + e + 1)  # the expert's "compute"
        out.append(rows)
        pieces.append((back[me * L + e, :len(rows)], rows))
    send(src, pieces, done[me:me + 1], 1)


sdma_counts = [0] * n
shmemx.launch(dispatch_kernel, n, sdma_counts)
shmemx.aclshmem_int32_wait_until_all(ready, n, None, EQ, 1)
ok = True
for e in range(L):  # the dispatch: expert e's rows from each source, in token order
    for s in range(n):
        s_exp, _ = routing(s)
        want = tokens(s)[np.flatnonzero((s_exp == me * L + e).any(axis=1))]
        if counts[s, e] != len(want) or not np.array_equal(recv[e, s, :len(want)], want):
            print(f"FAIL: pe {me}: dispatch: expert {me * L + e} got the wrong rows from pe {s}")
            ok = False
keep = []
shmemx.launch(combine_kernel, n, keep)
shmemx.aclshmem_int32_wait_until_all(done, n, None, EQ, 1)
combined = np.zeros((T, H), np.float32)
for g in range(E):
    for i, t in enumerate(segments[g]):
        k = int(np.flatnonzero(experts[t] == g)[0])
        combined[t] += weights[t, k] * back[g, i]
golden = np.zeros((T, H), np.float32)
for t in range(T):
    for k in range(K):
        golden[t] += weights[t, k] * x[t] * np.float32(experts[t, k] + 1)
if not np.allclose(combined, golden, rtol=1e-6):
    print(f"FAIL: pe {me}: combine differs from the reference at tokens "
          f"{np.flatnonzero(~np.isclose(combined, golden).all(axis=1)).tolist()[:8]}")
    ok = False
shmemx.aclshmem_barrier_all()
if ok:
    print(f"PASS: pe {me}: {T} tokens dispatched to {E} experts and combined; {sum(sdma_counts)} segments over "
          f"SDMA, the rest over MTE")
shmemx.finalize()
raise SystemExit(0 if ok else 1)

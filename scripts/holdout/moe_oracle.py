"""Rank script: moe.Buffer dispatch + combine against the hold-out's own model (``moe_ref``).

    shmemx run -n 4 scripts/holdout/moe_oracle.py --tokens 96 --hidden 512 --topk 4 --experts 16
    shmemx run -n 16 scripts/holdout/moe_oracle.py --qps 4 --configs '[{"schedule": "groups", "group_width": 4}]'

Without ``--configs`` the Buffer is made exactly as a DeepEP user would, ``moe.Buffer(T, H, K, E)`` after a plain
``shmemx.init()`` (no QP count, no heap size). With ``--configs`` (a JSON list of dicts), each dict holds
constructor options (``server_size``, ``rank_table``: "servers" for a rank table of servers of ``server_size``,
``qp_num``) and ``set_schedule`` options (``schedule``, ``routing``, ``qp_policy``, ``group_width``,
``token_blocks``, ``weight_blocks``, ``rotate``, ``aggregate``); a config that has the same constructor options as
the one before reuses its Buffer through ``set_schedule``.

Per configuration: a fresh bf16 dispatch with top-k (rows, order, sources, local top-k, weights, per-expert counts,
rank prefix matrix, ``cross_server_bytes`` against the pairs counted here), combine of a stand-in expert's rows (bit-exact float32 sum in rank order, or within the
documented bound for the hierarchy), a cached dispatch of other rows through the handle (and the first call's
outputs still intact), combine again, then a fresh int8 + scales dispatch (``--pair``: only the first dispatch and
combine, inside regions "dispatch" and "combine", for a recording). Each PE prints one line
``HOLDOUT {json}``; the exit status is 1 if any check failed on this PE.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shmemx  # noqa: E402
from shmemx.kernels import moe  # noqa: E402

import moe_ref as ref  # noqa: E402

CTOR_KEYS = ("server_size", "rank_table", "qp_num", "num_channels")


class Checks:
    def __init__(self):
        self.failed: list[str] = []
        self.count = 0

    def eq(self, what: str, got, want) -> bool:
        self.count += 1
        got_a, want_a = np.asarray(got), np.asarray(want)
        if got_a.shape != want_a.shape:
            self.failed.append(f"{what}: shape {got_a.shape} != {want_a.shape}")
            return False
        if got_a.dtype.kind == "V" or want_a.dtype.kind == "V" or got_a.dtype != want_a.dtype:
            same = got_a.view(np.uint8).tobytes() == want_a.astype(got_a.dtype).view(np.uint8).tobytes() \
                if got_a.size else True
        else:
            same = np.array_equal(got_a.view(np.uint8), want_a.view(np.uint8)) if got_a.size else True
        if not same:
            bad = np.argwhere(got_a.view(np.uint8).reshape(got_a.shape[0], -1) !=
                              want_a.astype(got_a.dtype).view(np.uint8).reshape(got_a.shape[0], -1))
            self.failed.append(f"{what}: {len(bad)} bytes differ, first at row {bad[0][0] if len(bad) else '?'}")
        return same

    def true(self, what: str, cond: bool) -> None:
        self.count += 1
        if not cond:
            self.failed.append(what)


class KeptRows:
    """The rows of one payload field of another rank that this rank receives (the oracle reads no others):
    ``rows[t]`` for a kept token t, with the field's ``shape`` and ``dtype``."""

    def __init__(self, full: np.ndarray, tokens: np.ndarray):
        self.shape, self.dtype = full.shape, full.dtype
        self.rows = {int(t): full[t].copy() for t in tokens}

    def __getitem__(self, t):
        return self.rows[int(t)]


def kept_inputs(inp, mine: bool, me: int, n: int, experts: int):
    """Rank ``inp``'s inputs as this rank keeps them: its own whole, another rank's routing whole and only the
    payload rows of the tokens that come here (every rank rebuilding every rank's whole inputs holds n ranks'
    payloads: 84 MB per rank at 256 ranks)."""
    if mine:
        return inp
    tokens = np.flatnonzero(ref.goes_to(inp.topk_idx, me, n, experts))
    return ref.Inputs(*(KeptRows(getattr(inp, f), tokens) for f in ("x", "x2", "q", "q_scales")),
                      inp.topk_idx, inp.topk_weights)


def rank_table(n: int, server_size: int) -> dict:
    return {"server_size": server_size,
            "ranks": [{"rank": r, "server": r // server_size, "lane": r % server_size} for r in range(n)]}


def make_buffer(args, ctor: dict):
    if not ctor and args.configs is None:
        return moe.Buffer(args.tokens, args.hidden, args.topk, args.experts)  # exactly as it comes
    kw = {k: v for k, v in ctor.items() if k not in ("rank_table",)}
    if ctor.get("rank_table") == "servers":
        kw["topology"] = rank_table(shmemx.n_pes(), ctor["server_size"])
    return moe.Buffer(args.tokens, args.hidden, args.topk, args.experts, **kw)


def run_config(buf, inputs, cfg: dict, me: int, n: int, args, c: Checks) -> dict:
    mine = inputs[me]
    exp = ref.expected_dispatch(me, inputs, n, args.experts)
    hier = cfg.get("schedule") == "hierarchy"
    t0 = time.perf_counter()
    with shmemx.region("dispatch"):
        d = buf.dispatch(mine.x, topk_idx=mine.topk_idx, topk_weights=mine.topk_weights)
    recv_x, recv_idx, recv_w, per_expert, handle = d
    c.eq("dispatch recv_x", recv_x, ref.gather_rows(exp, inputs, "x"))
    c.eq("dispatch recv_topk_idx", recv_idx, exp.topk_idx)
    c.eq("dispatch recv_topk_weights", recv_w, exp.topk_weights)
    c.eq("dispatch recv_src_idx", np.asarray(handle.recv_src_idx, np.int64), exp.src_token)
    c.eq("dispatch rank_prefix_matrix", np.asarray(handle.rank_prefix_matrix, np.int64), exp.rank_prefix)
    c.true(f"dispatch per-expert list {list(per_expert)} != {exp.per_expert}", list(per_expert) == exp.per_expert)
    c.true("dispatch num_recv_tokens", handle.num_recv_tokens == len(exp.src_rank))
    # sources in ascending order: the rows of source i are [M[i-1][me], M[i][me])
    bounds = [0] + [int(v) for v in exp.rank_prefix[:, me]]
    c.true("dispatch source blocks", all((exp.src_rank[bounds[i]:bounds[i + 1]] == i).all() for i in range(n)))
    first_x = np.array(recv_x, copy=True)
    # hidden-row bytes sent across servers (issue 12's bar): the hierarchy one row per (token, remote server),
    # the others one per (token, remote-server rank); servers of server_size ranks (16 when not given)
    size = cfg.get("server_size") or 16
    mine_srv = me // size
    to_rank = np.stack([ref.goes_to(mine.topk_idx, r, n, args.experts) for r in range(n)], axis=1)  # [T, P]
    remote = np.array([r // size != mine_srv for r in range(n)])
    if hier:
        servers = sorted({r // size for r in range(n)} - {mine_srv})
        pairs = sum(int(to_rank[:, [r for r in range(n) if r // size == sv]].any(axis=1).sum()) for sv in servers)
    else:
        pairs = int(to_rank[:, remote].sum())
    want_xsb = pairs * args.hidden * 2
    got_xsb = int(buf.last_stats.cross_server_bytes)
    c.true(f"cross_server_bytes {got_xsb} != {pairs} pairs x H x 2 = {want_xsb}", got_xsb == want_xsb)

    y = ref.expert_rows(me, np.asarray(recv_x), np.asarray(recv_w))
    with shmemx.region("combine"):
        comb_x, comb_w = buf.combine(y, handle, topk_weights=recv_w)
    want_x, want_w, abs_sum = ref.expected_combine(me, inputs, n, args.experts, "x")
    exact = bool(np.array_equal(np.asarray(comb_x).view(np.uint16), want_x.view(np.uint16)))
    err = np.abs(np.asarray(comb_x).astype(np.float64) - want_x.astype(np.float64))
    if hier:  # two bf16 roundings: |combined - float32 sum| <= 2^-7 sum |rows|
        c.true(f"combine outside the bound (max excess {float((err - 2.0 ** -7 * abs_sum).max(initial=0)):.3g})",
               bool((err <= 2.0 ** -7 * abs_sum + 0).all()))
    else:
        c.true(f"combine not bit-exact ({int((err > 0).sum())} elements differ, max {float(err.max(initial=0)):.3g})",
               exact)
    c.eq("combine topk_weights", comb_w, want_w)
    result = {"rows": int(len(exp.src_rank)), "combine_exact": exact, "combine_max_err": float(err.max(initial=0)),
              "cross_server_bytes": got_xsb}
    if args.pair:  # only the one dispatch + combine (a recording for the replay)
        return dict(result, s=round(time.perf_counter() - t0, 3))

    d2 = buf.dispatch(mine.x2, handle=handle)
    c.eq("cached dispatch recv_x", d2[0], ref.gather_rows(exp, inputs, "x2"))
    c.eq("first dispatch's recv_x intact after the cached one", recv_x, first_x)
    y2 = ref.expert_rows(me, np.asarray(d2[0]), np.asarray(recv_w))
    comb2, _ = buf.combine(y2, handle, topk_weights=recv_w)
    want2, _, abs2 = ref.expected_combine(me, inputs, n, args.experts, "x2")
    err2 = np.abs(np.asarray(comb2).astype(np.float64) - want2.astype(np.float64))
    if hier:
        c.true("cached combine outside the bound", bool((err2 <= 2.0 ** -7 * abs2).all()))
    else:
        c.true(f"cached combine not bit-exact ({int((err2 > 0).sum())} differ)",
               bool(np.array_equal(np.asarray(comb2).view(np.uint16), want2.view(np.uint16))))

    d3 = buf.dispatch((mine.q, mine.q_scales), topk_idx=mine.topk_idx, topk_weights=mine.topk_weights)
    c.eq("int8 dispatch data", d3[0][0], ref.gather_rows(exp, inputs, "q"))
    c.eq("int8 dispatch scales", d3[0][1], ref.gather_rows(exp, inputs, "q_scales"))
    c.eq("int8 dispatch recv_topk_idx", d3[1], exp.topk_idx)
    return dict(result, s=round(time.perf_counter() - t0, 3))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--seed", type=int, default=2027)
    ap.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of the expert choice (0: uniform)")
    ap.add_argument("--qps", type=int, default=0, help="aclshmemx_set_qp_num before init (0: a plain init)")
    ap.add_argument("--configs", type=json.loads, default=None)
    ap.add_argument("--pair", action="store_true", help="only one dispatch + combine (regions 'dispatch', "
                                                        "'combine')")
    args = ap.parse_args()

    if args.qps:
        shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, args.qps)
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    inputs = [kept_inputs(ref.make_inputs(s, n, args.tokens, args.hidden, args.topk, args.experts, args.seed,
                                          args.skew), s == me, me, n, args.experts) for s in range(n)]
    results = []
    buf, ctor_of_buf = None, None
    failed_total = 0
    for cfg in (args.configs if args.configs is not None else [{}]):
        ctor = {k: cfg[k] for k in CTOR_KEYS if k in cfg}
        sched = {k: v for k, v in cfg.items() if k not in CTOR_KEYS}
        c = Checks()
        try:
            if buf is None or ctor != ctor_of_buf:
                if buf is not None:
                    buf.close()
                buf, ctor_of_buf = make_buffer(args, ctor), ctor
            if sched:
                buf.set_schedule(**sched)
            row = run_config(buf, inputs, cfg, me, n, args, c)
        except Exception as exc:  # a crash is a failed check, reported with the others
            row = {}
            c.failed.append(f"raised {type(exc).__name__}: {exc}")
            shmemx.aclshmem_barrier_all()
        row.update(config=cfg, checks=c.count, failed=c.failed[:4])
        failed_total += len(c.failed)
        results.append(row)
    if buf is not None:
        buf.close()
    print("HOLDOUT " + json.dumps({"pe": me, "results": results}), flush=True)
    shmemx.finalize()
    return 1 if failed_total else 0


if __name__ == "__main__":
    sys.exit(main())

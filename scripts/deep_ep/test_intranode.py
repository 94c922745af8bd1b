"""DeepEP's tests/legacy/test_intranode.py, ported to shmemx.deep_ep with torch CPU tensors.

    shmemx run -n 8 scripts/deep_ep/test_intranode.py                    # DeepEP's sizes: T=4096 H=7168 K=8 E=256
    shmemx run -n 8 scripts/deep_ep/test_intranode.py --num-tokens 64 --hidden 256 --num-experts 32 --no-tune

The same checks and oracles as DeepEP's test, in the same order: the layout against a torch reference; then for
previous-event x async x {random, rank-valued, FP8 of rank-valued} x {without, with top-k}: received counts
against the all-reduced counts, rows of source i equal to i in ``[M[i-1][me], M[i][me])``, top-k indices
local or -1 with per-expert counts matching the list, weights equal to the source rank, ``num_worst_tokens``
padding equal to the normal result, a cached dispatch (without top-k), and combine(dispatch(x)) / #ranks = x
(calc_diff < 5e-6; weights < 1e-9). The tuning sweep of chunk sizes has nothing to sweep here (no rings): it
times the default configuration instead (``--no-tune`` skips it). ``--ll-compat`` then runs the low-latency
test on the same buffer, as DeepEP's ``test_ll_compatibility`` does.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from shmemx import deep_ep
from shmemx.deep_ep.utils import all_reduce, bench, calc_diff, init_dist, inplace_unique, per_token_cast_back, \
    per_token_cast_to_fp8, return_freed_memory

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_low_latency  # noqa: E402


def say(rank: int, *args, **kwargs) -> None:
    if rank == 0:
        print(*args, **kwargs, flush=True)


def reference_layout(topk_idx: torch.Tensor, num_ranks: int, num_experts: int):
    """(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank) computed with plain torch."""
    rank_idx = topk_idx // (num_experts // num_ranks)
    rank_idx.masked_fill_(topk_idx == -1, -1)
    inplace_unique(rank_idx, num_ranks)
    per_expert = torch.stack([(topk_idx == e).sum() for e in range(num_experts)]).to(torch.int)
    per_rank = torch.stack([(rank_idx == r).sum() for r in range(num_ranks)]).to(torch.int)
    in_rank = torch.stack([(rank_idx == r).any(dim=1) for r in range(num_ranks)], dim=1)
    return per_rank, per_expert, in_rank


def check_rank_blocks(rows: torch.Tensor, rank_prefix_matrix: torch.Tensor, rank: int, num_ranks: int) -> None:
    """Every row is constant, and the rows from source i (``[M[i-1][rank], M[i][rank])``) all equal i."""
    assert torch.equal(rows.amin(dim=1), rows.amax(dim=1))
    start = 0
    for src in range(num_ranks):
        end = int(rank_prefix_matrix[src][rank])
        assert (rows[start:end].int() - src).abs().sum().item() == 0, f"rows of source {src} are not {src}"
        start = end


def cached_dispatch(buffer, x, handle, config, async_mode: bool, previous_mode: bool, fp8: bool):
    """A dispatch through ``handle`` (the layout it holds; no routing arguments), its rows cast back from FP8
    (shared by the intranode and internode tests)."""
    args = {"x": x, "handle": handle, "config": config, "async_finish": async_mode}
    if previous_mode:
        args["previous_event"] = buffer.capture()
    cached_x, *_, event = buffer.dispatch(**args)
    if async_mode:
        event.current_stream_wait()
    return per_token_cast_back(*cached_x) if fp8 else cached_x


def check_worst_tokens(buffer, dispatch_args: dict, num_worst_tokens: int, fp8: bool, async_mode: bool, recv_x,
                       recv_topk_idx, weights_before_fill) -> None:
    """Dispatch again with ``num_worst_tokens`` (fixed-size outputs): the head equals the normal result, the rest
    is padding with index -1 (shared by the intranode and internode tests; ``dispatch_args`` keeps the option)."""
    dispatch_args["num_worst_tokens"] = num_worst_tokens
    worst_x, worst_idx, worst_w, empty_list, _, event = buffer.dispatch(**dispatch_args)
    if async_mode:
        event.current_stream_wait()
    worst_x = per_token_cast_back(*worst_x) if fp8 else worst_x
    n = recv_x.size(0)
    assert len(empty_list) == 0
    assert worst_x.size(0) == worst_idx.size(0) == worst_w.size(0) == num_worst_tokens
    assert torch.equal(recv_x, worst_x[:n])
    assert torch.equal(recv_topk_idx, worst_idx[:n])
    assert torch.equal(weights_before_fill, worst_w[:n])
    assert bool((worst_idx[n:] == -1).all())


def test_main(args, num_sms: int, rank: int, num_ranks: int, buffer: deep_ep.Buffer) -> None:
    num_tokens, hidden, num_topk, num_experts = args.num_tokens, args.hidden, args.num_topk, args.num_experts
    assert num_experts % num_ranks == 0
    say(rank, f"[config] num_tokens={num_tokens}, hidden={hidden}, num_topk={num_topk}")

    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * rank
    x_pure_rand = torch.randn((num_tokens, hidden), dtype=torch.bfloat16)
    x_e4m3 = per_token_cast_to_fp8(x) if deep_ep.Buffer.is_sm90_compiled() else None
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T) if x_e4m3 is not None else None  # column-major scales
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=False)[1].to(torch.int64)
    topk_weights = torch.ones((num_tokens, num_topk), dtype=torch.float32) * rank
    topk_weights_pure_rand = torch.randn((num_tokens, num_topk), dtype=torch.float32)

    num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = reference_layout(topk_idx.clone(), num_ranks,
                                                                                    num_experts)
    gbl_num_tokens_per_rank = all_reduce(num_tokens_per_rank)
    gbl_num_tokens_per_expert = all_reduce(num_tokens_per_expert)

    got_per_rank, got_per_rdma, got_per_expert, got_in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    assert got_per_rdma is None
    assert torch.equal(got_per_rank, num_tokens_per_rank)
    assert torch.equal(got_per_expert, num_tokens_per_expert)
    assert torch.equal(got_in_rank, is_token_in_rank)
    t = bench(lambda: buffer.get_dispatch_layout(topk_idx, num_experts), num_tests=3)[0]
    say(rank, f"[layout] Kernel performance: {t * 1000:.3f} ms\n")

    config = deep_ep.Config(num_sms, 8, 256)
    local_experts = num_experts // num_ranks
    for previous_mode in (False, True):
        for async_mode in (False, True):
            for current_x in [v for v in (x_pure_rand, x, x_e4m3) if v is not None]:
                for with_topk in (False, True):
                    fp8 = isinstance(current_x, tuple)
                    say(rank, f"[testing] Running with {'FP8' if fp8 else 'BF16'}, {'with' if with_topk else 'without'}"
                              f" top-k (async={async_mode}, previous={previous_mode}) ...", end="")
                    dispatch_args = {"x": current_x, "num_tokens_per_rank": num_tokens_per_rank,
                                     "is_token_in_rank": is_token_in_rank,
                                     "num_tokens_per_expert": num_tokens_per_expert, "config": config,
                                     "async_finish": async_mode}
                    if with_topk:
                        dispatch_args.update(topk_idx=topk_idx, topk_weights=topk_weights_pure_rand
                                             if current_x is x_pure_rand else topk_weights)
                    if previous_mode:
                        dispatch_args["previous_event"] = buffer.capture()
                    recv_x, recv_topk_idx, recv_topk_weights, recv_list, handle, event = \
                        buffer.dispatch(**dispatch_args)
                    if async_mode:
                        event.current_stream_wait()
                    recv_x = per_token_cast_back(*recv_x) if fp8 else recv_x

                    rank_prefix_matrix = handle[0]
                    assert int(gbl_num_tokens_per_rank[rank]) == recv_x.size(0), \
                        f"{int(gbl_num_tokens_per_rank[rank])} != {recv_x.size(0)}"
                    assert gbl_num_tokens_per_expert.view(num_ranks, -1)[rank].tolist() == recv_list
                    if current_x is not x_pure_rand:
                        check_rank_blocks(recv_x, rank_prefix_matrix, rank, num_ranks)
                    weights_before_fill = None
                    if with_topk:
                        valid = recv_topk_idx.eq(-1) | ((recv_topk_idx >= 0) & (recv_topk_idx < local_experts))
                        assert bool(valid.all())
                        for e, count in enumerate(recv_list):
                            assert int(recv_topk_idx.eq(e).sum()) == count
                        weights_before_fill = recv_topk_weights.clone()
                        if current_x is not x_pure_rand:  # slots of other ranks' experts: fill with the row max
                            empty = recv_topk_idx.eq(-1)
                            recv_topk_weights[empty] = recv_topk_weights.amax(dim=1, keepdim=True) \
                                .expand_as(recv_topk_weights)[empty]
                            check_rank_blocks(recv_topk_weights, rank_prefix_matrix, rank, num_ranks)

                    if with_topk:  # num_worst_tokens: fixed-size outputs, the head equal to the normal result
                        check_worst_tokens(buffer, dispatch_args, num_tokens * num_ranks, fp8, async_mode, recv_x,
                                           recv_topk_idx, weights_before_fill)

                    if not with_topk:  # a cached dispatch reuses the handle's layout
                        cached_x = cached_dispatch(buffer, current_x, handle, config, async_mode, previous_mode, fp8)
                        if current_x is not x_pure_rand:
                            check_rank_blocks(cached_x, rank_prefix_matrix, rank, num_ranks)
                        del cached_x

                    combine_args = {"x": recv_x, "handle": handle, "config": config, "async_finish": async_mode}
                    if with_topk:
                        combine_args["topk_weights"] = recv_topk_weights
                    if previous_mode:
                        combine_args["previous_event"] = buffer.capture()
                    combined_x, combined_topk_weights, event = buffer.combine(**combine_args)
                    if async_mode:
                        event.current_stream_wait()
                    went = is_token_in_rank.sum(dim=1).unsqueeze(1)
                    ref_x = x_pure_rand if current_x is x_pure_rand else x
                    assert calc_diff(combined_x.float() / went, ref_x) < 5e-6
                    if with_topk:
                        check_w = combined_topk_weights if current_x is x_pure_rand else combined_topk_weights / went
                        ref_w = topk_weights_pure_rand if current_x is x_pure_rand else topk_weights
                        assert calc_diff(check_w, ref_w) < 1e-9
                    del recv_x, recv_topk_idx, recv_topk_weights, handle, combined_x, combined_topk_weights
                    say(rank, " passed")
    say(rank, "")

    if args.tune:  # DeepEP sweeps NVL chunk sizes; there are no rings here: time the default configuration
        recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=num_tokens_per_rank,
                                                     is_token_in_rank=is_token_in_rank,
                                                     num_tokens_per_expert=num_tokens_per_expert)
        nvl_bytes = recv_x.numel() * 2
        fp8_factor = (1 + 4 / 128) / 2
        for current_x in [v for v in (x_e4m3, x) if v is not None]:
            t = bench(lambda: buffer.dispatch(current_x, handle=handle), num_tests=args.tune_iters)[0]  # noqa: B023
            nbytes = nvl_bytes * fp8_factor if isinstance(current_x, tuple) else nvl_bytes
            say(rank, f"[tuning] dispatch ({'FP8' if isinstance(current_x, tuple) else 'BF16'}), default config: "
                      f"{nbytes / 1e9 / t:.2f} GB/s (NVL), {t * 1e6:.2f} us")
        t = bench(lambda: buffer.combine(recv_x, handle), num_tests=args.tune_iters)[0]
        say(rank, f"[tuning] combine, default config: {nvl_bytes / 1e9 / t:.2f} GB/s (NVL), {t * 1e6:.2f} us\n")


def main() -> None:
    ap = argparse.ArgumentParser(description="DeepEP's intranode test on shmemx (run with shmemx run -n 8)")
    ap.add_argument("--num-tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--num-topk", type=int, default=8)
    ap.add_argument("--num-experts", type=int, default=256)
    ap.add_argument("--num-sms", type=int, default=24)
    ap.add_argument("--no-tune", dest="tune", action="store_false", help="skip the timing of the default config")
    ap.add_argument("--tune-iters", type=int, default=5)
    ap.add_argument("--ll-compat", action="store_true", help="then run the low-latency test on the same buffer")
    ap.add_argument("--ll-num-tokens", type=int, default=16)
    ap.add_argument("--ll-hidden", type=int, default=5120)
    ap.add_argument("--ll-num-experts", type=int, default=256)
    ap.add_argument("--ll-num-topk", type=int, default=9)
    args = ap.parse_args()

    torch.set_num_threads(1)  # one interpreter thread per rank: torch's spinning pool would starve the engines
    return_freed_memory()  # 8 ranks of DeepEP-size tensors on one machine: freed temporaries go back at once
    _, num_ranks, _ = init_dist()
    num_rdma_bytes = 0
    if args.ll_compat:
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(args.ll_num_tokens, args.ll_hidden, num_ranks,
                                                                        args.ll_num_experts)
    buffer = deep_ep.Buffer(None, int(2e9), num_rdma_bytes, low_latency_mode=args.ll_compat,
                            num_qps_per_rank=args.ll_num_experts // num_ranks if args.ll_compat else 1,
                            explicitly_destroy=True)
    rank = buffer.rank
    torch.manual_seed(rank)
    test_main(args, args.num_sms, rank, buffer.group_size, buffer)
    if args.ll_compat:
        buffer.clean_low_latency_buffer(args.ll_num_tokens, args.ll_hidden, args.ll_num_experts)
        test_low_latency.test_main(args.ll_num_tokens, args.ll_hidden, args.ll_num_experts, args.ll_num_topk, rank,
                                   buffer.group_size, buffer, seed=1)
    buffer.destroy()
    say(rank, "test_intranode: PASS")


if __name__ == "__main__":
    main()

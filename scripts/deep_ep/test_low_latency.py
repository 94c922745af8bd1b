"""DeepEP's tests/legacy/test_low_latency.py, ported to shmemx.deep_ep with torch CPU tensors.

    shmemx run -n 8 scripts/deep_ep/test_low_latency.py                   # DeepEP's sizes: T=128 H=7168 K=8 E=288
    shmemx run -n 8 scripts/deep_ep/test_low_latency.py --num-tokens 16 --hidden 512 --num-experts 32 --no-bench

The same checks and oracles as DeepEP's test: x = rank - 128 with the last 128 columns the token index; 10
random top-k slots masked; for hook {no, yes} x {BF16, FP8, FP8 + round_scale, FP8 + round_scale + UE8M0}, the
dispatch run once or twice (the two buffer halves), then per local expert: the cumulative stats, recv_count, the
layout ranges and the all-gathered top-k all agree; rows are constant but for the tail, which equals the source
token index; each source's rows ``[begin, begin + count)`` equal that source's value; then combine (zero copy
{no, yes}, into a preallocated ``out``) equals x * sum of the unmasked weights (calc_diff < 9e-4 FP8, 1e-5 BF16;
no NaN). What differs: the expert outputs are cast back only for the valid rows (DeepEP casts the whole
``[E_loc, P * N, H]`` tensor, gigabytes here), and the mask / shrink test is not ported.
"""

from __future__ import annotations

import argparse
import random

import torch

from shmemx import deep_ep
from shmemx.deep_ep.utils import all_gather, bench, calc_diff, hash_tensor, init_dist, per_token_cast_back, \
    return_freed_memory

RANK_OFFSET = 128  # x = rank - 128: exact in bfloat16 for up to 256 ranks


def say(rank: int, *args, **kwargs) -> None:
    if rank == 0:
        print(*args, **kwargs, flush=True)


def cast_back_valid(recv_x, counts, hidden: int) -> torch.Tensor:
    """The expert outputs of this test ("simulated GEMM"): the received rows cast back to bfloat16, valid rows
    only (the rest zero)."""
    data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    out = torch.zeros(data.shape, dtype=torch.bfloat16)
    for e, count in enumerate(counts.tolist()):
        if count:
            out[e, :count] = per_token_cast_back(recv_x[0][e, :count], recv_x[1][e, :count]) \
                if isinstance(recv_x, tuple) else recv_x[e, :count]
    return out


def test_main(num_tokens: int, hidden: int, num_experts: int, num_topk: int, rank: int, num_ranks: int,
              buffer: deep_ep.Buffer, seed: int = 0) -> int:
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    assert num_experts % num_ranks == 0
    local_experts = num_experts // num_ranks

    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * (rank - RANK_OFFSET)
    x[:, -128:] = torch.arange(num_tokens).to(torch.bfloat16).view(-1, 1)
    x_list = [x, torch.randn((num_tokens, hidden), dtype=torch.bfloat16) * 0.1]  # the last: for timing
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=True)[1].to(torch.int64)
    topk_weights = torch.randn((num_tokens, num_topk), dtype=torch.float32).abs()
    for _ in range(10):
        topk_idx[random.randint(0, num_tokens - 1), random.randint(0, num_topk - 1)] = -1
    all_topk_idx = all_gather(topk_idx)  # [P, T, K]

    hash_value, num_times = 0, 0
    for current_x in x_list:
        for return_recv_hook in (False, True):
            for use_fp8 in (False, True):
                for round_scale in ((False, True) if use_fp8 else (False,)):
                    for use_ue8m0 in ((False, True) if round_scale else (False,)):
                        num_times += 1
                        for _ in range(num_times % 2 + 1):  # once or twice: both halves of the buffer
                            stats = torch.zeros((local_experts,), dtype=torch.int)
                            recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
                                current_x, topk_idx, num_tokens, num_experts, use_fp8=use_fp8,
                                round_scale=round_scale, use_ue8m0=use_ue8m0,
                                cumulative_local_expert_recv_stats=stats, async_finish=not return_recv_hook,
                                return_recv_hook=return_recv_hook)
                            hook() if return_recv_hook else event.current_stream_wait()
                        if use_fp8:
                            recv_x = (recv_x[0], recv_x[1].contiguous())
                        for e in range(local_experts):
                            expert = rank * local_experts + e
                            count = int(recv_count[e])
                            src_info, layout_range = handle[0][e], handle[1][e]
                            assert int(stats[e]) == count, f"{int(stats[e])} != {count}"
                            assert int((layout_range & (2**32 - 1)).sum()) == count
                            assert int((all_topk_idx == expert).sum()) == count
                            if count == 0:
                                continue
                            if current_x is x:
                                rows = per_token_cast_back(recv_x[0][e, :count], recv_x[1][e, :count]) \
                                    if use_fp8 else recv_x[e, :count]
                                body_min = rows[:, :-128].amin(dim=-1)
                                assert torch.equal(body_min, rows[:, :-128].amax(dim=-1))
                                src = src_info[:count]
                                if round_scale:
                                    assert calc_diff(rows[:, -1], src) < 0.007
                                else:
                                    assert (rows[:, -128:] - src.view(-1, 1) % num_tokens).abs().sum().item() == 0
                                for j in range(num_ranks):
                                    begin, n = int(layout_range[j] >> 32), int(layout_range[j] & (2**32 - 1))
                                    if not round_scale:
                                        assert int((body_min == j - RANK_OFFSET).sum()) == \
                                            int((all_topk_idx[j] == expert).sum())
                                        assert (rows[begin:begin + n, :-128] - j + RANK_OFFSET).abs().sum() == 0
                            if use_fp8:
                                hash_value ^= hash_tensor(recv_x[0][e, :count])
                                hash_value ^= hash_tensor(recv_x[1][e, :count])
                            else:
                                hash_value ^= hash_tensor(recv_x[e, :count])

                        expert_out = cast_back_valid(recv_x, recv_count, hidden)
                        for zero_copy in (False, True):
                            if zero_copy:
                                target = buffer.get_next_low_latency_combine_buffer(handle)
                                for e, count in enumerate(recv_count.tolist()):
                                    target[e, :count] = expert_out[e, :count]
                            out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16)
                            combined_x, event, hook = buffer.low_latency_combine(
                                expert_out, topk_idx, topk_weights, handle, async_finish=not return_recv_hook,
                                zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=out)
                            hook() if return_recv_hook else event.current_stream_wait()
                            assert combined_x is out
                            want = current_x * topk_weights.masked_fill(topk_idx == -1, 0).sum(dim=1).view(-1, 1)
                            diff = calc_diff(want, combined_x)
                            assert torch.isnan(combined_x).sum().item() == 0
                            if not round_scale:
                                assert diff < (9e-4 if use_fp8 else 1e-5), f"{diff=}, {use_fp8=}, {zero_copy=}"
                            hash_value ^= hash_tensor(combined_x)
    return hash_value


def bench_pair(args, rank: int, num_ranks: int, buffer: deep_ep.Buffer) -> None:
    """DeepEP's benchmark part: dispatch (FP8) + combine, timed, with DeepEP's byte counts."""
    torch.manual_seed(rank)
    x = torch.randn((args.num_tokens, args.hidden), dtype=torch.bfloat16) * 0.1
    scores = torch.randn((args.num_tokens, args.num_experts), dtype=torch.float32).abs() + 1
    topk_idx = torch.topk(scores, args.num_topk, dim=-1, largest=True, sorted=True)[1].to(torch.int64)
    topk_weights = torch.randn((args.num_tokens, args.num_topk), dtype=torch.float32).abs()
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, args.num_tokens, args.num_experts)
    expert_out = cast_back_valid(recv_x, recv_count, args.hidden)

    def pair():
        buffer.low_latency_dispatch(x, topk_idx, args.num_tokens, args.num_experts)
        buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

    selections = int((topk_idx != -1).sum())
    fp8_bytes = selections * (args.hidden + args.hidden // 128 * 4 + 16)
    bf16_bytes = selections * args.hidden * 2
    t = bench(pair, num_tests=args.bench_iters)[0]
    say(rank, f"[bench] dispatch + combine: {(fp8_bytes + bf16_bytes) / 1e9 / t:.2f} GB/s per rank, "
              f"avg {t * 1e6:.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description="DeepEP's low-latency test on shmemx (run with shmemx run -n 8)")
    ap.add_argument("--num-tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--num-topk", type=int, default=8)
    ap.add_argument("--num-experts", type=int, default=288)
    ap.add_argument("--no-bench", dest="bench", action="store_false")
    ap.add_argument("--bench-iters", type=int, default=5)
    ap.add_argument("--pressure-test", action="store_true", help="repeat with the same seed: identical hashes")
    args = ap.parse_args()

    torch.set_num_threads(1)  # one interpreter thread per rank: torch's spinning pool would starve the engines
    return_freed_memory()  # 8 ranks of DeepEP-size tensors on one machine: freed temporaries go back at once
    _, num_ranks, _ = init_dist()
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(args.num_tokens, args.hidden, num_ranks,
                                                                    args.num_experts)
    buffer = deep_ep.Buffer(None, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=args.num_experts // num_ranks, explicitly_destroy=True)
    rank = buffer.rank
    say(rank, f"[config] num_tokens={args.num_tokens}, hidden={args.hidden}, num_topk={args.num_topk}, "
              f"num_experts={args.num_experts}, num_rdma_bytes={num_rdma_bytes}")
    ref_hash = test_main(args.num_tokens, args.hidden, args.num_experts, args.num_topk, rank, num_ranks, buffer,
                         seed=1)
    say(rank, "[testing] dispatch and combine: passed")
    if args.pressure_test:
        for i in range(3):
            assert test_main(args.num_tokens, args.hidden, args.num_experts, args.num_topk, rank, num_ranks, buffer,
                             seed=1) == ref_hash, f"run {i}: hash differs"
        say(rank, "[testing] pressure: identical hashes")
    if args.bench:
        bench_pair(args, rank, num_ranks, buffer)
    buffer.destroy()
    say(rank, "test_low_latency: PASS")


if __name__ == "__main__":
    main()

"""A DeepEP-style shrink-mode script: rank 1 stops calling at its first dispatch; the others mask it."""
import argparse

import torch
import torch.distributed as dist

import deep_ep
from deep_ep.utils.envs import init_dist


def test_loop(local_rank: int, num_local_ranks: int, args: argparse.Namespace):
    rank, num_ranks, group = init_dist(local_rank, num_local_ranks)
    num_tokens, hidden, num_experts = 8, 256, 2 * num_ranks
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=2,
                            explicitly_destroy=True, enable_shrink=True)
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16, device='cuda') * rank
    topk_idx = torch.arange(num_experts, device='cuda').repeat(num_tokens, 1)[:, :num_experts].to(deep_ep.topk_idx_t)
    weights = torch.ones(topk_idx.shape, dtype=torch.float32, device='cuda')
    mask = torch.zeros((num_ranks, ), dtype=torch.int, device='cuda')
    if rank != 1:
        for _ in range(2):
            recv, count, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts,
                                                                           use_fp8=False)
            buffer.low_latency_query_mask_buffer(mask)
            assert mask.tolist() == [int(r == 1) for r in range(num_ranks)], mask.tolist()
            assert count.tolist() == [num_tokens * (num_ranks - 1)] * 2
            out, _, _ = buffer.low_latency_combine(recv, topk_idx, weights, handle)
            live_experts = num_experts - 2  # the two experts of rank 1 are dropped
            assert torch.equal(out[:, 0].float(), torch.full((num_tokens, ), float(rank * live_experts)))
        buffer.clean_low_latency_buffer(num_tokens, hidden, num_experts)
        buffer.low_latency_clean_mask_buffer()
        buffer.low_latency_query_mask_buffer(mask)
        assert mask.sum().item() == 0
    buffer.destroy()
    dist.barrier()
    if rank == 0:
        print('shrink ok', flush=True)
    dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--num-processes', type=int, default=4)
    args = parser.parse_args()
    torch.multiprocessing.spawn(test_loop, args=(args.num_processes, args), nprocs=args.num_processes)

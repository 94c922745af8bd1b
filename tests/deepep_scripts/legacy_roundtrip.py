"""A DeepEP-style legacy script (written for shmemx's tests, in the shape of DeepEP's tests/legacy): run it with
``shmemx run -n 4 --deepep legacy_roundtrip.py --num-processes 4``."""
import argparse

import torch
import torch.distributed as dist

import deep_ep
from deep_ep.utils.envs import init_dist
from deep_ep.utils.math import per_token_cast_back
from deep_ep.utils.testing import bench, bench_kineto


def test_loop(local_rank: int, num_local_ranks: int, args: argparse.Namespace):
    rank, num_ranks, group = init_dist(local_rank, num_local_ranks)
    num_tokens, hidden, num_topk, num_experts = args.num_tokens, args.hidden, 4, 4 * num_ranks
    assert deep_ep.topk_idx_t is torch.int64
    torch.manual_seed(rank)

    # Normal mode: DeepEP's constructor order (explicitly_destroy is the 8th positional argument)
    buffer = deep_ep.Buffer(group, int(1e8), 0, False, 1, True, False, True)
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16, device='cuda') * rank
    x[:, -1] = torch.arange(num_tokens, device='cuda').to(torch.bfloat16)
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32, device='cuda').abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1)[1].to(deep_ep.topk_idx_t)
    topk_weights = torch.ones((num_tokens, num_topk), dtype=torch.float32, device='cuda')
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(topk_idx,
                                                                                                    num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
        async_finish=True)
    event.current_stream_wait()
    prefix = handle[0]  # rank_prefix_matrix: rows from source i end at prefix[i][rank]
    start = 0
    for i in range(num_ranks):
        end = prefix[i][rank].item()
        assert (recv_x[start:end, :-1].float() == i).all(), f'rows from rank {i} misplaced'
        start = end
    combined_x, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_topk_weights)
    assert torch.equal(combined_x.float()[:, 0], is_token_in_rank.sum(1).float() * rank)
    total = torch.tensor([recv_x.size(0)], dtype=torch.int64, device='cuda')
    dist.all_reduce(total, group=group)  # (nccl in DeepEP: gloo here)
    sent = torch.tensor([int(is_token_in_rank.sum().item())], dtype=torch.int64, device='cuda')
    dist.all_reduce(sent, group=group)
    assert total.item() == sent.item()
    raw = buffer.get_local_buffer_tensor(torch.int32, torch.Size((4, 8)))
    raw.fill_(rank)
    assert raw.shape == (4, 8) and raw.dtype == torch.int32
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_event.record()
    torch.cuda.synchronize()
    end_event.record()
    assert start_event.elapsed_time(end_event) >= 0
    buffer.destroy()

    # Low-latency mode: UE8M0 scales read back by element count, the kernels' own times
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_experts // num_ranks, explicitly_destroy=True)
    recv, count, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts,
                                                                   use_fp8=True, round_scale=True, use_ue8m0=True)
    back = per_token_cast_back(recv[0].view(-1, hidden), recv[1].contiguous().view(-1, hidden // 128))
    back = back.view(recv[0].shape)
    for e in range(num_experts // num_ranks):
        rows = back[e, :count[e].item(), :-1].float()
        assert (rows.amin(1) == rows.amax(1)).all()

    def round_trip():
        bf16_x, _, bf16_handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts, use_fp8=False)
        buffer.low_latency_combine(bf16_x, topk_idx, topk_weights, bf16_handle)

    t_dispatch, t_combine = bench_kineto(round_trip, kernel_names=('dispatch', 'combine'), num_tests=3,
                                         barrier_comm_profiling=True)
    assert t_dispatch > 0 and t_combine > 0
    assert bench(lambda: None, num_warmups=1, num_tests=3)[0] >= 0
    buffer.destroy()
    dist.barrier()
    if rank == 0:
        print('legacy ok', flush=True)
    dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--num-processes', type=int, default=4)
    parser.add_argument('--num-tokens', type=int, default=16)
    parser.add_argument('--hidden', type=int, default=512)
    args = parser.parse_args()
    torch.multiprocessing.spawn(test_loop, args=(args.num_processes, args), nprocs=args.num_processes)

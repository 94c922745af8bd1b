"""A DeepEP-style V2 script (written for shmemx's tests, in the shape of DeepEP's tests/elastic): ElasticBuffer's
dispatch / combine against deep_ep.utils.refs, bit for bit, then the barrier, PP, AGRS and Engram. With
--num-processes below the job's ranks the job is several nodes and the buffer takes the hybrid route;
--allow-multiple-reduction 0: one reduction only, at the source."""
import argparse

import torch
import torch.distributed as dist

import deep_ep
from deep_ep.utils.envs import init_dist
from deep_ep.utils.math import per_token_cast_back, per_token_cast_to_fp8
from deep_ep.utils.refs import combine as ref_combine
from deep_ep.utils.refs import dispatch as ref_dispatch
from deep_ep.utils.refs import generate_pre_combine_data, ordered_accumulate


@torch.inference_mode()
def test_loop(local_rank: int, num_local_ranks: int, args: argparse.Namespace):
    rank, num_ranks, group = init_dist(local_rank, num_local_ranks)
    max_tokens, hidden, num_topk, num_experts = 16, 256, 4, 4 * num_ranks
    num_tokens = max_tokens - rank
    multiple = bool(args.allow_multiple_reduction)
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=max_tokens, hidden=hidden, num_topk=num_topk,
                                   use_fp8_dispatch=True, explicitly_destroy=True, allow_multiple_reduction=multiple)
    scaleout, scaleup = buffer.get_logical_domain_size()
    assert (scaleout, scaleup) == (num_ranks // num_local_ranks, num_local_ranks)
    # hybrid: reduced within each scale-up domain on the way back; without multiple reduction, only at the source
    recipe = (True, scaleout > 1 and multiple)
    expanded_recipe = recipe if multiple else (False, False)
    scores = torch.rand((num_tokens, num_experts), dtype=torch.float32, device='cuda')
    topk_weights, topk_idx = torch.topk(scores, num_topk, dim=-1)
    topk_idx = topk_idx.to(deep_ep.topk_idx_t)
    for use_fp8 in (False, True):
        x = torch.randn((num_tokens, hidden), dtype=torch.bfloat16, device='cuda')
        x = per_token_cast_to_fp8(x) if use_fp8 else x
        bias = torch.randn((num_tokens, hidden), dtype=torch.bfloat16, device='cuda')
        ref_x, ref_idx, ref_w, ref_src, ref_counts = ref_dispatch(x, topk_idx, topk_weights, max_tokens,
                                                                  num_experts)
        recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                                                  num_experts=num_experts, expert_alignment=4)
        # rows come grouped by the scale-up peer that forwarded them (every rank, direct), then by source token
        assert torch.equal(handle.psum_num_recv_tokens_per_scaleup_rank,
                           ref_counts.view(scaleout, scaleup).sum(0).cumsum(0).to(torch.int32))
        order = torch.argsort(ref_src % (scaleup * max_tokens) // max_tokens, stable=True)
        assert torch.equal(handle.recv_src_metadata[:, 0], ref_src[order])
        ref_x = tuple(t[order] for t in ref_x) if use_fp8 else ref_x[order]
        ref_idx, ref_w = ref_idx[order], ref_w[order]
        got, want = (recv_x[0], ref_x[0]) if use_fp8 else (recv_x, ref_x)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(recv_idx, ref_idx) and torch.equal(recv_w, ref_w)
        ex_x, _, ex_w, ex_handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                                      num_experts=num_experts, expert_alignment=4, do_expand=True)
        cached_x, _, _, cached_handle, _ = buffer.dispatch(x, handle=handle)
        assert cached_handle is handle
        # Combine: rows that are a function of (source token, slot), reduced per rank, then summed at the source
        n = handle.num_recv_tokens
        y = generate_pre_combine_data(handle.recv_src_metadata[:n, 0], max_tokens, num_topk, hidden)
        y[recv_idx == -1] = 0
        combined, combined_w, _ = buffer.combine(ordered_accumulate(y), handle, topk_weights=recv_w, bias=bias)
        ref_y = generate_pre_combine_data(rank * max_tokens + torch.arange(num_tokens), max_tokens, num_topk, hidden)
        assert torch.equal(combined, ref_combine(ref_y, topk_idx, scaleout, scaleup, num_experts, bias, *recipe))
        assert torch.equal(combined_w, topk_weights)
        slots = ex_handle.recv_src_metadata[:n, 2:]
        rows = torch.zeros((ex_x[0].shape[0] if use_fp8 else ex_x.shape[0]) + 1, hidden, dtype=torch.bfloat16)
        rows[slots.flatten()] = y.view(-1, hidden)
        combined2, combined_w2, _ = buffer.combine(rows[:-1], ex_handle, topk_weights=ex_w)
        assert torch.equal(combined2, ref_combine(ref_y, topk_idx, scaleout, scaleup, num_experts, None,
                                                  *expanded_recipe))
        assert torch.equal(combined_w2, topk_weights)
        if use_fp8:
            assert torch.equal(per_token_cast_back(*recv_x), per_token_cast_back(*ref_x))

    buffer.barrier()
    buffer.destroy()

    # PP ring, AGRS session, Engram
    buffer = deep_ep.ElasticBuffer(group, num_bytes=32 << 20, explicitly_destroy=True, allow_hybrid_mode=False)
    buffer.pp_set_config(4096, 4)
    t = torch.full((1024, ), rank, dtype=torch.int32, device='cuda')
    out = torch.empty_like(t)
    for _ in range(3):
        buffer.pp_send(t, (rank + 1) % num_ranks)
    for _ in range(3):
        buffer.pp_recv(out, (rank - 1) % num_ranks)
        assert (out == (rank - 1) % num_ranks).all()
    buffer.agrs_set_config(1 << 20, 4)
    with buffer.agrs_new_session():
        inplace = buffer.agrs_get_inplace_tensor((8, 4), torch.bfloat16)
        inplace.fill_(rank)
        gathered, wait = buffer.all_gather(inplace)
        other, wait2 = buffer.all_gather(torch.full((3, ), rank + 10, dtype=torch.int64, device='cuda'))
        wait()
        wait2()
        assert torch.equal(gathered[:, 0, 0].float(), torch.arange(num_ranks).float())
        assert torch.equal(other[:, 0], torch.arange(num_ranks) + 10)
    def entries(owner: int) -> torch.Tensor:  # [8, 16] bfloat16 rows that encode their owner rank and row
        return (torch.arange(8 * 16, dtype=torch.float32).view(8, 16) / 128 + owner).to(torch.bfloat16)

    buffer.engram_write(entries(rank))
    hook = buffer.engram_fetch(torch.tensor([[0, 8 * num_ranks - 1]], dtype=torch.int))
    data, sf = hook()
    assert sf is None and torch.equal(data[0, :16], entries(0)[0])
    assert torch.equal(data[0, 16:], entries(num_ranks - 1)[7])
    buffer.destroy()
    dist.barrier()
    if rank == 0:
        print('elastic ok', flush=True)
    dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--num-processes', type=int, default=4)
    parser.add_argument('--allow-multiple-reduction', type=int, default=1)
    args = parser.parse_args()
    torch.multiprocessing.spawn(test_loop, args=(args.num_processes, args), nprocs=args.num_processes)

"""Internode notify_dispatch (seed 003) and cached_notify, as one-block kernels on the emulated engine.

Ranks are (server a, lane l) = divmod(rank, S); a rank's *same-lane* peers are (b, l) for the other servers b
(DeepEP's "same GPU index"), reached over RDMA (here: UDMA WQEs); its *NVL* peers are (a, j), the ranks of its
server, reached by direct copies (here: MTE puts and direct atomics on the peer's words, as NVLink stores and
``atomicAdd_system``). notify_dispatch, in the seed's seven phases:

1. quiet every QP to the same-lane peers (no WQE of an earlier call still in flight);
2. a cross-server sync of the same-lane ranks, then ``barrier_block`` within the server;
3. per destination server b, the record ``[tokens to each of b's S ranks | tokens to each of b's E/N experts |
   tokens to b]`` in the send buffer;
4. a UDMA put of record b to (b, l)'s ``rdma_notify[a]`` (a local copy for b = a);
5. quiet, and the same-lane sync again: every record of this lane has landed;
6. the NVL side: per expert of this server, the sum over source servers; ``recv_rdma_rank_prefix_sum`` (the rows
   this rank forwards, per source server); to each NVL peer j, the tokens from each (b, l) to (a, j) and the
   summed counts of j's experts (MTE puts); ``barrier_block``; then ``recv_gbl_rank_prefix_sum`` (by global
   source rank i, the rows forwarder (a, i % S) holds from server i // S for this rank) and the per-local-expert
   counts, aligned;
7. the same-lane sync and ``barrier_block`` once more, so that the next notify may overwrite the buffers.

``barrier_block`` is the seed's: each rank adds FINISHED_SUM_TAG to its own S slots and subtracts it from its
slot in every peer's, then waits until all its slots are <= 0; a timeout names the rank, the slot (the peer that
did not arrive) and its value. cached_notify (a dispatch or combine on a cached handle) runs phases 1, 2 and 7:
nothing to count, only the quiets and the barriers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import shmemx

__all__ = ["FINISHED_SUM_TAG", "Notified", "Tiers", "notify_dispatch", "cached_notify", "barrier_block"]

FINISHED_SUM_TAG = 1024
GE, LE = shmemx.ACLSHMEM_CMP_GE, shmemx.ACLSHMEM_CMP_LE
ADD = shmemx.ACLSHMEM_SIGNAL_ADD


@dataclass
class Tiers:
    """Who is who in a job of N servers of S ranks, and the words the syncs use.

    Attributes:
        me, n_pes, server_size: this rank, P and S.
        views: the workspace regions (``barrier [S] int32``, ``sync [N, 4] uint64``, ``sync_payload [N, 2]
            int64``, ``rdma_notify`` / ``rdma_send_notify [N, W] int32``, ``nvl_notify_rank [S, N] int32``,
            ``nvl_notify_expert [S, E_loc] int32``).
        rdma_qps: QPs per same-lane peer the RDMA tier uses.
    """

    me: int
    n_pes: int
    server_size: int
    views: dict
    rdma_qps: int
    syncs: int = 0  # same-lane syncs so far (the same count on every rank of a lane)

    @property
    def servers(self) -> int:
        return self.n_pes // self.server_size

    @property
    def server(self) -> int:
        return self.me // self.server_size

    @property
    def lane(self) -> int:
        return self.me % self.server_size

    def same_lane(self) -> list[int]:
        """Ranks (b, l) of the other servers, nearest server first."""
        n, s, a, lane = self.servers, self.server_size, self.server, self.lane
        return [((a + i) % n) * s + lane for i in range(1, n)]

    def nvl_peers(self) -> list[int]:
        """Ranks of this server, this one included."""
        base = self.server * self.server_size
        return list(range(base, base + self.server_size))


def _quiet_rdma(t: Tiers) -> None:
    """Phase 1 / 5: complete every WQE posted to the same-lane peers."""
    for peer in t.same_lane():
        for q in range(t.rdma_qps):
            shmemx.aclshmemx_udma_qp_quiet(peer, q)


def sync_same_lane(t: Tiers) -> None:
    """DeepEP's ``nvshmem_sync_with_same_gpu_idx``: meet the ranks of this lane on every server (UDMA put + signal
    to each, then a wait for all of theirs)."""
    peers = t.same_lane()
    if not peers:
        return
    t.syncs += 1
    a = t.server
    payload = t.views["sync_payload"]
    payload[a, 0] = t.syncs
    for peer in peers:
        shmemx.aclshmemx_udma_qp_put_signal_nbi(payload[a:a + 1, 0], payload[a:a + 1, 0], 1,
                                                t.views["sync"][a:a + 1, 0], t.syncs, peer, 0)
    for peer in peers:
        shmemx.aclshmemx_udma_qp_quiet(peer, 0)
    status = np.ones(t.servers, np.int32)
    status[[p // t.server_size for p in peers]] = 0
    shmemx.aclshmem_wait_until_all(t.views["sync"][:, 0], GE, t.syncs, status=status)


def barrier_block(t: Tiers, *, sync_only: bool = False) -> None:
    """The seed's intra-server barrier: +TAG on each of my S slots, -TAG on my slot of each peer, then wait until
    all my slots are <= 0. Without ``sync_only``, this rank's direct copies are completed first (the fence)."""
    if not sync_only:
        shmemx.aclshmemx_mte_quiet()
    slots = t.views["barrier"]
    lane = t.lane
    for j, peer in enumerate(t.nvl_peers()):
        shmemx.aclshmemx_signal_op(slots[j:j + 1], FINISHED_SUM_TAG, ADD, t.me)
        shmemx.aclshmemx_signal_op(slots[lane:lane + 1], -FINISHED_SUM_TAG, ADD, peer)
    try:
        shmemx.aclshmem_wait_until_all(slots, LE, 0)
    except shmemx.WaitTimeoutError as exc:
        stuck = [(j, int(v)) for j, v in enumerate(slots) if v > 0]
        j, value = stuck[0] if stuck else (-1, 0)
        raise shmemx.WaitTimeoutError(
            f"DeepEP timeout check failed: rank = {t.me}, thread = {j}, value = {value}: barrier_block waits for "
            f"rank {t.server * t.server_size + j} of its server (slot {j} = {value} > 0; stuck slots {stuck}) "
            f"({exc})") from None


@dataclass
class Notified:
    """What notify_dispatch computes on this rank.

    Attributes:
        recv_rdma_rank_prefix_sum: ``[N] int32``, inclusive prefix over source servers of the rows this rank
            receives as forwarder (from the same-lane rank of each server).
        forward_counts: ``[N, S] int64``, rows from source server b for each rank of this server.
        recv_gbl_rank_prefix_sum: ``[P] int32``, inclusive prefix over global source ranks of the rows received.
        num_recv_tokens_per_expert_list: per local expert, selections received, aligned up.
    """

    recv_rdma_rank_prefix_sum: np.ndarray
    forward_counts: np.ndarray
    recv_gbl_rank_prefix_sum: np.ndarray
    num_recv_tokens_per_expert_list: list


def _records(t: Tiers, num_tokens_per_rank, num_tokens_per_expert, num_tokens_per_rdma_rank) -> None:
    """Phase 3: record b = (counts to b's ranks, to b's experts, to b) in ``rdma_send_notify[b]``."""
    s, n = t.server_size, t.servers
    per_server = len(num_tokens_per_expert) // n
    send = t.views["rdma_send_notify"]
    send[:, :s] = np.asarray(num_tokens_per_rank).reshape(n, s)
    send[:, s:s + per_server] = np.asarray(num_tokens_per_expert).reshape(n, per_server)
    send[:, s + per_server] = num_tokens_per_rdma_rank


def _notify_kernel(t: Tiers, num_tokens_per_rank, num_tokens_per_expert, num_tokens_per_rdma_rank,
                   out: dict) -> None:
    v, s, n, a, lane = t.views, t.server_size, t.servers, t.server, t.lane
    per_server = len(num_tokens_per_expert) // n
    local = per_server // s
    _quiet_rdma(t)  # 1
    sync_same_lane(t)  # 2
    barrier_block(t, sync_only=True)
    _records(t, num_tokens_per_rank, num_tokens_per_expert, num_tokens_per_rdma_rank)  # 3
    width = v["rdma_send_notify"].shape[1]
    for peer in t.same_lane():  # 4
        b = peer // s
        shmemx.aclshmemx_udma_qp_put_nbi(v["rdma_notify"][a], v["rdma_send_notify"][b], width, peer, 0)
    v["rdma_notify"][a] = v["rdma_send_notify"][a]
    for peer in t.same_lane():  # 5
        shmemx.aclshmemx_udma_qp_quiet(peer, 0)
    sync_same_lane(t)
    got = v["rdma_notify"].astype(np.int64)  # 6: [N, W], row b from (b, lane)
    reduced = got[:, s:s + per_server].sum(0)  # this server's experts, summed over source servers
    out["rdma_prefix"] = np.cumsum(got[:, s + per_server]).astype(np.int32)
    out["forward"] = got[:, :s].copy()
    for j, peer in enumerate(t.nvl_peers()):
        rank_counts = np.ascontiguousarray(got[:, j], np.int32)
        expert_counts = np.ascontiguousarray(reduced[j * local:(j + 1) * local], np.int32)
        shmemx.aclshmemx_mte_put_nbi(v["nvl_notify_rank"][lane], rank_counts, n, peer)
        shmemx.aclshmemx_mte_put_nbi(v["nvl_notify_expert"][lane], expert_counts, local, peer)
    barrier_block(t)  # completes the puts first
    by_forwarder = v["nvl_notify_rank"].astype(np.int64)  # [S, N]: forwarder j's rows from server b for me
    out["gbl_prefix"] = np.cumsum(by_forwarder.T.reshape(-1)).astype(np.int32)  # global rank i = b * S + j
    out["per_expert"] = v["nvl_notify_expert"].astype(np.int64).sum(0)
    sync_same_lane(t)  # 7
    barrier_block(t, sync_only=True)


def notify_dispatch(t: Tiers, *, num_tokens_per_rank: np.ndarray, num_tokens_per_rdma_rank: np.ndarray,
                    num_tokens_per_expert: np.ndarray, expert_alignment: int = 1) -> Notified:
    """Run the notify kernel (collective: every rank of the job).

    Args:
        t: the tiers of this rank.
        num_tokens_per_rank: ``[P]``, num_tokens_per_rdma_rank: ``[N]``, num_tokens_per_expert: ``[E]``: this
            rank's layout (``get_dispatch_layout``).
        expert_alignment: round each local expert's count up to a multiple of this.
    """
    out: dict = {}
    shmemx.launch(_notify_kernel, 1, t, num_tokens_per_rank, num_tokens_per_expert, num_tokens_per_rdma_rank, out)
    aligned = [int(-(-int(c) // expert_alignment) * expert_alignment) for c in out["per_expert"]]
    return Notified(out["rdma_prefix"], out["forward"], out["gbl_prefix"], aligned)


def _cached_kernel(t: Tiers) -> None:
    _quiet_rdma(t)
    sync_same_lane(t)
    barrier_block(t, sync_only=True)
    sync_same_lane(t)
    barrier_block(t, sync_only=True)


def cached_notify(t: Tiers) -> None:
    """The cached-handle notify (collective): quiets and barriers, no counts."""
    shmemx.launch(_cached_kernel, 1, t)

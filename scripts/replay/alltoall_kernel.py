"""A uniform all-to-all for the replay's closed form: every PE puts ``--bytes`` to every other PE, one WQE each.

    shmemx run -n 128 --record a2a.rec scripts/replay/alltoall_kernel.py --ranks-per-server 16 --order inter

PE i posts one ``aclshmemx_udma_put_nbi`` per peer (each with its own doorbell), the peers of the other tier
first (``--order``), then quiets every peer, all inside the region "alltoall". The k-th peer of every PE is a
permutation of the PEs (per tier: server offset 1 + k // n, local offset k % n; inside the server local offset
1 + k), so at every step each port receives from exactly one sender, and the ports of the tier posted first are
busy from the first WQE on. Then (``scripts/replay/closed_forms.py`` checks it) the last byte of that tier lands
at ``t0 + N_t * bytes / B_t`` with ``t0 = post_us + doorbell_us + wqe_us + L_t`` and ``N_t`` the peers in that
tier, as long as posting (``post_us + doorbell_us`` per WQE) is faster than a port (``bytes / B_t``).
"""

import argparse

import numpy as np

import shmemx


def peers(me: int, n_pes: int, per_server: int, order: str) -> list[int]:
    """The peers of PE ``me`` in posting order (see the module docstring)."""
    server, local = divmod(me, per_server)
    servers = n_pes // per_server
    inter = [((server + 1 + k // per_server) % servers) * per_server + (local + k % per_server) % per_server
             for k in range((servers - 1) * per_server)]
    intra = [server * per_server + (local + 1 + k) % per_server for k in range(per_server - 1)]
    return inter + intra if order == "inter" else intra + inter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=65536)
    ap.add_argument("--ranks-per-server", type=int, default=16)
    ap.add_argument("--order", choices=("inter", "intra"), default="inter")
    args = ap.parse_args()
    shmemx.init()
    me, n = shmemx.my_pe(), shmemx.n_pes()
    if n % args.ranks_per_server:
        raise SystemExit(f"{n} PEs are not whole servers of {args.ranks_per_server}")
    recv = shmemx.zeros((n, args.bytes), np.uint8, name="recv")
    src = shmemx.full(args.bytes, me % 251, np.uint8, name="src")
    order = peers(me, n, args.ranks_per_server, args.order)
    with shmemx.region("alltoall"):
        for p in order:
            shmemx.aclshmemx_udma_put_nbi(recv[me], src, args.bytes, p)
        for p in order:
            shmemx.aclshmemx_udma_quiet(p)
    shmemx.aclshmem_barrier_all()
    assert all((recv[p] == p % 251).all() for p in range(n) if p != me), "a row did not arrive"
    shmemx.finalize()


if __name__ == "__main__":
    main()

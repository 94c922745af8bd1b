"""Routing plans: which of a block's tokens go to which destination (rank, or server), as every schedule asks it.

Two plans, chosen per Buffer (``routing=``), both giving the same answer:

* ``scan``: the ``[T, P]`` ``is_token_in_rank`` mask, read whole: ``np.nonzero(mask[t0:t1].T)``. Work and memory
  grow with P, however few ranks a token goes to (seed 001, "P-dimension routing").
* ``compact``: per token its unique destinations (``dest [T, K] int32``, -1 padded, from ``topk_idx`` directly:
  expert -> rank -> deduplicated), then per destination one contiguous segment of tokens (a sort of the
  (destination, token) keys). Work grows with T x K, not T x P. For servers the same with ``rank // server_size``.

``route_reads`` counts the elements a plan reads (T x P for a scan, T x K for a compact plan): a count beside the
route phase's time.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ROUTINGS", "compact_dests", "dests_from_mask", "peer_tokens"]

ROUTINGS = ("scan", "compact")


def _dedupe_rows(d: np.ndarray) -> np.ndarray:
    """Each row sorted, repeats and negatives as -1 (``[T, K]`` int32)."""
    d = np.sort(d, axis=1)
    if d.shape[1] > 1:
        rep = np.zeros(d.shape, bool)
        rep[:, 1:] = d[:, 1:] == d[:, :-1]
        d = np.where(rep, -1, d)
    return d


def compact_dests(topk_idx: np.ndarray, num_local_experts: int, div: int = 1) -> np.ndarray:
    """``[T, K] int32``: per token, its unique destination ranks (``div`` > 1: servers of ``div`` ranks),
    -1 padded; from ``topk_idx [T, K] int64`` (-1 = none)."""
    idx = np.asarray(topk_idx)
    d = np.where(idx >= 0, idx // (num_local_experts * div), -1).astype(np.int32)
    return _dedupe_rows(d)


def dests_from_mask(is_token_in_rank: np.ndarray, width: int) -> np.ndarray:
    """The compact plan of a routing known only as a ``[T, P]`` mask (a cached dispatch without ``topk_idx``): one
    scan, once per handle."""
    n_tok = is_token_in_rank.shape[0]
    out = np.full((n_tok, max(width, 1)), -1, np.int32)
    toks, ranks = np.nonzero(is_token_in_rank)
    slot = np.arange(len(toks)) - np.searchsorted(toks, toks)
    keep = slot < width
    out[toks[keep], slot[keep]] = ranks[keep]
    return out


def peer_tokens(t0: int, t1: int, n_dst: int, *, routing: str, mask: np.ndarray | None = None,
                dests: np.ndarray | None = None, div: int = 1) -> tuple[np.ndarray, np.ndarray, int]:
    """The tokens of ``[t0, t1)`` grouped by destination.

    Args:
        t0, t1: the block's tokens.
        n_dst: destinations (P ranks, or P / div servers).
        routing: ``"scan"`` (reads ``mask [T, P] bool``) or ``"compact"`` (reads ``dests [T, K] int32``).
        div: ranks per destination (servers: ``server_size``); the scan folds the mask, the compact plan
            divides and deduplicates again.

    Returns:
        ``(toks [n] int64, split [n_dst + 1] int64, reads)``: destination d's tokens are
        ``toks[split[d]:split[d + 1]]``, ascending; ``reads`` elements of the routing read.
    """
    if routing == "scan":
        m = mask[t0:t1]
        if div > 1:
            m = m.reshape(m.shape[0], n_dst, div).any(2)
        peers, toks = np.nonzero(m.T)
        reads = m.shape[0] * mask.shape[1]
    elif routing == "compact":
        d = dests[t0:t1]
        reads = d.size
        if div > 1:
            d = _dedupe_rows(np.where(d >= 0, d // div, -1))
        rows = np.broadcast_to(np.arange(t0, t1, dtype=np.int64)[:, None], d.shape)
        ok = d >= 0
        key = np.sort(d[ok].astype(np.int64) * (t1 + 1) + rows[ok])
        peers, toks = key // (t1 + 1), key % (t1 + 1) - t0
    else:
        raise ValueError(f"routing {routing!r} is not one of {', '.join(ROUTINGS)}")
    split = np.searchsorted(peers, np.arange(n_dst + 1))
    return toks.astype(np.int64) + t0, split, int(reads)

"""A plain-numpy reference of the window-mode pair over every rank's inputs, for tests and the demo.

It knows nothing of windows, halves, flags or blocks: it states what the kernels must produce.

- ``reference_notify``: the four routing vectors of every rank (``notify.py`` gives their definition).
- ``reference_dispatch``: on receiver d, for local expert le, then source rank src, every (t, k) of src with
  ``topk_idx_src[t, k] == d * E_loc + le`` in (t, k) order: the row ``x_src[t]`` (or its int8 quantisation and
  scale) and the triple ``(src, t, k)``.
- ``reference_combine``: on token owner o, ``x[t] = bf16_rne(sum over k in order of fp32(y(o, t, k)) * w[t, k])``
  with float32 accumulation, where y(o, t, k) is the expert-output row whose triple is (o, t, k).
"""

from __future__ import annotations

import numpy as np

from .notify import NotifyDispatchOutput, send_layout
from .quant import dynamic_quant

__all__ = ["reference_notify", "reference_dispatch", "reference_combine"]


def reference_notify(topk_all: list[np.ndarray], moe_expert_num: int) -> list[NotifyDispatchOutput]:
    """Per rank: (send_offset, send_token_idx, recv_offset, recv_count), int32, from every rank's topk_idx."""
    R, E = len(topk_all), moe_expert_num
    e_loc = E // R
    layouts = [send_layout(t, E) for t in topk_all]
    out = []
    for d in range(R):
        recv_offset = np.zeros(E, np.int32)
        per_status = np.zeros(E, np.int64)
        for le in range(e_loc):
            for src in range(R):
                s, g = le * R + src, d * e_loc + le
                recv_offset[s] = layouts[src][1][g]
                per_status[s] = layouts[src][0][g]
        cnt, send_offset, send_token_idx = layouts[d]
        out.append(NotifyDispatchOutput(send_offset, send_token_idx, recv_offset,
                                        np.cumsum(per_status).astype(np.int32)))
    return out


def reference_dispatch(xs: list[np.ndarray], topk_all: list[np.ndarray], moe_expert_num: int,
                       quant_mode: int = 0) -> list[dict]:
    """Per receiver: dict(recv_x [A, H], x_scales [A] or None, assist_info_for_combine [3A] int32,
    recv_counts [E_loc, R] int32)."""
    R, E = len(xs), moe_expert_num
    e_loc = E // R
    results = []
    for d in range(R):
        rows, scales, triples = [], [], []
        counts = np.zeros((e_loc, R), np.int32)
        for le in range(e_loc):
            g = d * e_loc + le
            for src in range(R):
                t, k = np.nonzero(np.asarray(topk_all[src]) == g)  # row-major: (t, k) order
                counts[le, src] = len(t)
                x = xs[src][t]
                if quant_mode == 2:
                    x, sc = dynamic_quant(x)
                    scales.append(sc)
                rows.append(x)
                triples.append(np.stack([np.full(len(t), src), t, k], axis=1).astype(np.int32))
        dtype = np.int8 if quant_mode == 2 else xs[d].dtype
        H = xs[d].shape[1]
        results.append(dict(
            recv_x=np.concatenate(rows).astype(dtype) if rows else np.empty((0, H), dtype),
            x_scales=np.concatenate(scales).astype(np.float32) if quant_mode == 2 else None,
            assist_info_for_combine=np.concatenate(triples).reshape(-1),
            recv_counts=counts))
    return results


def reference_combine(expert_out: list[np.ndarray], assist: list[np.ndarray], weights: list[np.ndarray]
                      ) -> list[np.ndarray]:
    """Per token owner: ``[bs, H]`` combined rows (dtype of expert_out), from every rank's expert outputs
    ``[A_r, H]``, their triples ``[3 A_r]`` and every owner's ``weights [bs, K] float32``."""
    R = len(expert_out)
    H = expert_out[0].shape[1]
    dtype = expert_out[0].dtype
    ys = [np.zeros((w.shape[0], w.shape[1], H), dtype) for w in weights]
    seen = [np.zeros(w.shape, bool) for w in weights]
    for r in range(R):
        trip = np.asarray(assist[r]).reshape(-1, 3)
        for row, (o, t, k) in enumerate(trip):
            assert not seen[o][t, k], f"(rank {o}, token {t}, topk {k}) returned twice"
            seen[o][t, k] = True
            ys[o][t, k] = expert_out[r][row]
    out = []
    for o in range(R):
        assert seen[o].all(), f"rank {o}: some (token, topk) pairs never came back"
        acc = np.zeros((weights[o].shape[0], H), np.float32)
        for k in range(weights[o].shape[1]):
            acc = acc + ys[o][:, k].astype(np.float32) * weights[o][:, k].astype(np.float32)[:, None]
        out.append(acc.astype(dtype))
    return out

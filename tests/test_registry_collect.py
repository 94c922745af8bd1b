"""The all-retired check of ``LocalRegistry.collect``: the same answer as checking every use, whatever the order
of the quiets, the cached busy queue and the 32-bit wrap of BB positions."""

from __future__ import annotations

import numpy as np

from shmemx.udma.registry import Registration, _all_retired


def _brute(uses: dict, tails: dict) -> bool:
    return all(((tails.get(q, 0) - pos) & 0xFFFF_FFFF) < 0x8000_0000 for q, pos in uses.items())


def _reg() -> Registration:
    return Registration(0x1000, np.zeros(64, np.uint8), 1, 0)


def test_quiets_in_post_order_keep_it_until_the_last():
    reg = _reg()
    n = 127
    for q in range(n):
        reg.uses[q] = 5
    tails = {}
    for q in range(n):
        assert _all_retired(reg, tails) is False
        tails[q] = 5
        assert _all_retired(reg, tails) is (q == n - 1)


def test_random_orders_repins_and_wrap_match_every_use_checked():
    rng = np.random.default_rng(7)
    for _ in range(200):
        reg = _reg()
        n = int(rng.integers(1, 9))
        base = int(rng.choice([0, 0xFFFF_FFF0]))
        tails = {q: base for q in range(n)}
        for q in range(n):
            reg.uses[q] = (base + int(rng.integers(1, 20))) & 0xFFFF_FFFF
        for _step in range(30):
            q = int(rng.integers(0, n))
            if rng.random() < 0.2:  # posted again on q: a later position
                reg.uses[q] = (tails[q] + int(rng.integers(1, 20))) & 0xFFFF_FFFF
            else:  # a quiet of q passes some or all of its WQEs
                tails[q] = (tails[q] + int(rng.integers(0, 20))) & 0xFFFF_FFFF
            assert _all_retired(reg, tails) == _brute(reg.uses, tails)

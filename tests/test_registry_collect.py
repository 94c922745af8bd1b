"""The all-retired check of ``LocalRegistry.collect``: the same answer as checking every use, whatever the order
of the quiets, the cached busy queue and the 32-bit wrap of BB positions."""

from __future__ import annotations

import numpy as np

from shmemx.udma.registry import Registration, _all_retired


def _brute(uses: dict, tails: dict) -> bool:
    return all(((tails.get(q, 0) - pos) & 0xFFFF_FFFF) < 0x8000_0000 for q, pos in uses.items())


def _of(tails: dict):
    """``tails`` as ``collect`` reads them: a function of queue indices."""
    return lambda queues: np.array([tails.get(int(q), 0) for q in queues], np.int64)


def _reg() -> Registration:
    return Registration(0x1000, np.zeros(64, np.uint8), 1, 0)


def test_quiets_in_post_order_keep_it_until_the_last():
    reg = _reg()
    n = 127
    for q in range(n):
        reg.uses[q] = 5
    tails = {}
    for q in range(n):
        assert _all_retired(reg, _of(tails)) is False
        tails[q] = 5
        assert _all_retired(reg, _of(tails)) is (q == n - 1)


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
            assert _all_retired(reg, _of(tails)) == _brute(reg.uses, tails)


def test_tails_of_keys_that_are_no_queue_read_zero():
    """A thread's own pin key (negative) and an index past the queues read as tail 0: never retired."""
    from shmemx.udma import _engine
    from shmemx.udma.plane import _Tails

    qstate = np.zeros((4, _engine.ST_WORDS), np.int64)
    qstate[:, _engine.ST_TAIL] = [10, 11, 12, 13]
    tails = _Tails(qstate)
    np.testing.assert_array_equal(tails(np.array([3, 0], np.int64)), [13, 10])
    np.testing.assert_array_equal(tails(np.array([-1 - 12345, 2, 4], np.int64)), [0, 12, 0])
    reg = _reg()
    reg.uses.update({0: 10, -7: 1})
    assert _all_retired(reg, tails) is False
    del reg.uses[-7]
    assert _all_retired(reg, tails) is True

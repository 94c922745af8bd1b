"""What is left of the pairs of implementations, driven through both sides and compared (DESIGN section 9).

Observed or not, a call runs one path; but a call has a native side and a Python side where the native code
declines the case (the first post from an array not registered yet, a queue another block owns, a ring short of
room, a quiet whose CQEs are not all in, an error). ``test_random_sequences_take_either_side_alike`` draws
random sequences of puts, gets, put_signals, raw posts, atomics, quiets, signal_ops and waits (hypothesis) and
runs each twice on PE 0 of a 2-PE job under ``--check``: with the native side taking every case it takes, and
with it declining every case (``Declining``: the Python side takes them all, waits included). Both runs must
write the same WQE bytes and sidecar words into every send queue, move the context words alike, land the same
bytes on PE 1, return the same values, and write the same event records (kind, flags, fields; not the time).
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmemx
from shmemx.api import signals
from shmemx.runtime import runtime
from shmemx.udma.check.report import EXIT_FINDINGS
from shmemx.udma.events import Kind
from shmemx.udma.layout import M32
from shmemx.udma.segment import CQ_TAIL, LOCAL_VA_BASE, WQ_CQE_CNT, WQ_HEAD, WQ_TAIL

N = 32  # elements per slot
SLOTS = 8
QPS = 2

_k = st.integers(0, SLOTS // QPS - 1)  # slot k of a QP's own slots (slot = k * QPS + qp): no two QPs race
_op = st.one_of(
    st.tuples(st.just("put"), st.integers(0, QPS - 1), _k, st.integers(1, N), st.sampled_from(["heap", "local"]),
              st.sampled_from(["default", "no_cqe", "so"])),
    st.tuples(st.just("get"), st.integers(0, QPS - 1), _k, st.integers(1, N), st.sampled_from(["heap", "local"])),
    st.tuples(st.just("put_signal"), st.integers(0, QPS - 1), _k, st.integers(1, N), st.integers(-2**40, 2**40)),
    st.tuples(st.just("raw"), st.integers(0, QPS - 1), st.integers(1, SLOTS // QPS)),
    st.tuples(st.just("fetch_add"), st.integers(1, 1000)),
    st.tuples(st.just("quiet"), st.integers(0, QPS - 1)),
    st.tuples(st.just("signal"), st.integers(0, 3), st.integers(1, 100), st.sampled_from(["set", "add"])),
    st.tuples(st.just("wait_all"), st.integers(1, 4)),
)


class Declining:
    """The native posting path declining every case it could take: the Python side takes them all."""

    def __init__(self, poster):
        self._poster = poster

    def __getattr__(self, name):
        return getattr(self._poster, name)

    def rw(self, *args):
        return -1

    def notify(self, *args):
        return -1

    def wqes(self, *args):
        return -1

    def wqes_many(self, *args):
        return 0

    def quiet(self, *args):
        return -1

    def quiet_many(self, *args):
        return 0


class _Job:
    """PE 0's side of the comparison: the arrays, one run of a sequence, and what it left behind."""

    def __init__(self):
        self.dst = shmemx.zeros((SLOTS, N), np.int64, name="dst")
        self.src = shmemx.zeros((SLOTS, N), np.int64, name="src")
        self.sig = shmemx.zeros(QPS, np.int64, name="sig")
        self.words = shmemx.zeros(4, np.int64, name="words")
        self.counter = shmemx.zeros(1, np.int64, name="counter")
        self.closer = shmemx.zeros(1, np.int64, name="closer")
        self.local = np.zeros((SLOTS, N), np.int64)
        self.back = np.zeros((SLOTS, N), np.int64)
        self.udma = runtime().udma
        if shmemx.my_pe() == 0:
            self.raw = [shmemx.aclshmemx_udma_raw_queue(1, q) for q in range(QPS)]
            self.queues = [self.udma.qp(1, q) for q in range(QPS)]
            self.remote = shmemx.aclshmem_ptr(self.dst, 1)
            self.remote_counter = shmemx.aclshmem_ptr(self.counter, 1)

    def run(self, ops, declining: bool) -> dict:
        """Run ``ops`` (from fresh arrays); returns what the run wrote and returned."""
        udma, log = self.udma, runtime().events
        self.dst[:] = self.src[:] = self.local[:] = self.back[:] = self.words[:] = self.counter[:] = 0
        self.remote[:] = self.remote_counter[:] = 0
        self.src[:] = np.arange(SLOTS * N).reshape(SLOTS, N) + 1
        self.local[:] = -(np.arange(SLOTS * N).reshape(SLOTS, N) + 1)
        self._close()  # every queue retired to its head: both runs start from the same queue state
        heads = [q.head for q in self.queues]
        state = [(q.cqe_cnt, q.cq_tail, q.tail) for q in self.queues]
        first = log.native.written
        saved, native_block = udma.poster, signals._Words.native_block
        if declining:
            udma.poster = Declining(saved)
            signals._Words.native_block = lambda self, rt, call, timeout=None: False
        try:
            returned = [self._one(op) for op in ops]
            self._close()
        finally:
            udma.poster, signals._Words.native_block = saved, native_block
        return {"rings": [self._ring(q, h) for q, h in zip(self.queues, heads)],
                "contexts": [((q.head - h) & M32, (q.cqe_cnt - c) & M32, (q.head - q.tail) & M32,
                              (q.cqe_cnt - q.cq_tail) & M32, int(q.wq32[WQ_HEAD]) - (q.head & M32), int(q.wq32[WQ_CQE_CNT]) - q.cqe_cnt,
                              int(q.wq32[WQ_TAIL]) - q.tail, int(q.cq_ctx32[CQ_TAIL]) - q.cq_tail)
                             for q, h, (c, _t, _tl) in zip(self.queues, heads, state)],
                "pe1": self.remote.copy(), "back": self.back.copy(), "returned": returned,
                "events": self._events(log.read(), first)}

    def _close(self) -> None:
        """A WQE with a CQE on every QP, then its quiet: everything posted before it has executed (in order)."""
        for qp in range(QPS):
            shmemx.aclshmemx_udma_qp_put_nbi(self.closer, self.closer, 1, 1, qp)
            shmemx.aclshmemx_udma_qp_quiet(1, qp)

    def _one(self, op):
        kind = op[0]
        if kind == "put":
            _, qp, k, n, side, cfg = op
            slot = k * QPS + qp
            src = self.src[slot] if side == "heap" else self.local[slot]
            config = {"default": shmemx.ACLSHMEMX_UDMA_OP_CONFIG_DEFAULT, "no_cqe": shmemx.ACLSHMEMX_UDMA_OP_CONFIG_NO_CQE,
                      "so": shmemx.ACLSHMEMX_UDMA_OP_CONFIG_SO}[cfg]
            shmemx.aclshmemx_udma_qp_put_nbi(self.dst[slot], src, n, 1, qp, config=config)
        elif kind == "get":
            _, qp, k, n, side = op
            slot = k * QPS + qp
            dst = self.dst[slot] if side == "heap" else self.back[slot]
            shmemx.aclshmemx_udma_qp_get_nbi(dst, self.dst[slot], n, 1, qp)
        elif kind == "put_signal":
            _, qp, k, n, value = op
            slot = k * QPS + qp
            shmemx.aclshmemx_udma_qp_put_signal_nbi(self.dst[slot], self.local[slot], n, self.sig[qp:qp + 1],
                                                    value, 1, qp)
        elif kind == "raw":
            _, qp, n = op
            q = self.raw[qp]
            offs = (np.arange(n, dtype=np.uint64) * np.uint64(QPS) + np.uint64(qp)) * np.uint64(8 * N)  # its slots
            q.post(q.build_writes(rmt_va=q.remote_va(self.dst) + offs, sge_len=8 * N,
                                  sge_va=q.local_va(self.src) + offs), cqes=n)
        elif kind == "fetch_add":
            return int(shmemx.aclshmemx_udma_atomic_fetch_add(self.counter, op[1], 1))
        elif kind == "quiet":
            shmemx.aclshmemx_udma_qp_quiet(1, op[1])
        elif kind == "signal":
            _, i, value, how = op
            how = shmemx.ACLSHMEM_SIGNAL_SET if how == "set" else shmemx.ACLSHMEM_SIGNAL_ADD
            shmemx.aclshmemx_signal_op(self.words[i:i + 1], value, how, 0)
        elif kind == "wait_all":
            shmemx.aclshmemx_signal_op(self.words, op[1], shmemx.ACLSHMEM_SIGNAL_ADD, 0)  # (word 0 only)
            shmemx.aclshmem_wait_until_all(self.words[:1], shmemx.ACLSHMEM_CMP_GE, op[1])
            return int(self.words[0])
        return None

    def _ring(self, q, head: int) -> list:
        """The BBs and sidecar words posted from ``head`` on, local VAs named by (array, offset)."""
        out = []
        for pos in range(head, q.head):
            bb = bytearray(q.sq[pos & q.mask].tobytes())
            out.append((self._named(bb), int(q.sidecar[pos & q.mask])))
        return out

    def _named(self, bb: bytearray) -> bytes:
        """A BB with a registered local array's VA (words 7 and, in a notify's second BB, 3) made its array's
        name and offset: a registration made again after it was collected gets another VA."""
        words = np.frombuffer(bytes(bb), np.uint64).copy()
        for k in (3, 7):
            va = int(words[k])
            if LOCAL_VA_BASE <= va < LOCAL_VA_BASE + (1 << 40):
                words[k] = 0  # compared through the event records' local references instead
        return words.tobytes()

    @staticmethod
    def _events(log, first: int) -> list:
        """The records this run wrote, without their time stamps, BB positions and local VAs."""
        r = log.records[first:]
        out = []
        for row in r.tolist():
            ts, kind, block, flags, site, a, b, c, d, e, f, g = row
            if kind in (Kind.SITE, Kind.REGISTER):  # (a registration is made once: by whichever run comes first)
                continue
            if kind == Kind.POST:  # BB positions differ run by run (the heads move on), and so do local VAs
                a &= ~M32
                c = c if flags >> 15 & 1 else 0
            if kind == Kind.FETCH:
                b = 0  # the BB position of the atomic it read
            if kind == Kind.QUIET:
                b = c = d = 0  # the tail and CQE count it reached (positions), its start time
            if kind == Kind.DOORBELL:
                b = d = 0  # its first BB position, its BBs' place in the blob
            out.append((kind, block, flags, a, b, c, d, e, f, g))
        return out


def _sequences(examples: int) -> None:
    shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, QPS)
    shmemx.init()
    me = shmemx.my_pe()
    done = shmemx.zeros(1, np.int64, name="done")
    job = _Job()
    shmemx.aclshmem_barrier_all()
    if me == 0:
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(st.lists(_op, min_size=1, max_size=24))
        def same(ops):
            a, b = job.run(ops, False), job.run(ops, True)
            for key in ("rings", "contexts", "returned", "events"):
                assert a[key] == b[key], (key, ops)
            for key in ("pe1", "back"):
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"{key}: {ops}")

        same()
        shmemx.aclshmemx_signal_op(done, 1, shmemx.ACLSHMEM_SIGNAL_SET, 1)
    else:
        shmemx.aclshmem_signal_wait_until(done, shmemx.ACLSHMEM_CMP_EQ, 1)
    shmemx.aclshmem_barrier_all()
    shmemx.finalize()


def test_random_sequences_take_either_side_alike(run_job, no_leak):
    # (the sequences race by the ordering rules, NO-ordered WQEs of one QP included, so --check reports them and
    # the job exits 3; the normal engine runs each SQ in order, so both runs of a sequence land the same bytes)
    result = run_job(2, _sequences, 40, check=True, timeout=600)
    assert result.code in (0, EXIT_FINDINGS), result.report()


def _fingerprints() -> None:
    shmemx.init()
    fp = runtime().udma.poster.fingerprint
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 40_000, dtype=np.uint8)
    for n in (1, 7, 511, 1024, 5000, 40_000 - 3):
        base = fp(data[:n])
        for shift in (1, 8, 512, 777):  # the same bytes elsewhere (another alignment): the same fingerprint
            moved = np.zeros(n + shift, np.uint8)
            moved[shift:] = data[:n]
            assert fp(moved[shift:]) == base, (n, shift)
        for at in (0, n // 2, n - 1):  # one byte changed anywhere: another fingerprint
            changed = data[:n].copy()
            changed[at] ^= 1
            assert fp(changed) != base, (n, at)
    shmemx.finalize()


def test_source_fingerprints_are_functions_of_the_bytes(run_ok):
    """``--check`` fingerprints a WRITE's source at post and at its quiet (``_post.c``, ``fp_range``): the
    value depends on the bytes alone (two writes of equal bytes from different sources compare equal), and a
    change of any byte changes it."""
    run_ok(1, _fingerprints)

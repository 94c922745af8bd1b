"""The peers that bench_rma.py and bench_sync.py measure beside shmemx, in the same run, on the same patterns:
shmem4py over Open MPI's OSHMEM (``oshrun``) and mpi4py over MPICH (``mpiexec.mpich``), as
``scripts/install_peers.sh`` installs them (../shared/reference/peers.md has why each setting below is needed).

``available()`` says which peers this machine has; ``run(peer, kind, n, cfg)`` runs one peer job of ``n`` ranks
and returns its rank 0's JSON result; this file is also the job's body (``--worker``). Kinds:

* ``bw``: put bandwidth PE 0 -> PE 1 for each size: ``k`` puts then one completion (shmem4py ``put_nbi`` x k +
  ``quiet``; MPI ``Put`` x k + ``Win_flush``), and ``put1``: one put + its completion, repeated;
* ``rate``: 64-byte puts from a local numpy array's rows into rows of a symmetric / window array, one completion
  per 1024 (shmem4py ``put_nbi`` of ``src[i]`` into ``dst[i]``; MPI ``Put`` at row offsets);
* ``pingpong``: a 64-byte payload then a flag, the partner waits for the flag (shmem4py: ``put``, ``fence``,
  ``atomic_set`` / ``wait_until``: OpenSHMEM 1.4 has no put_signal; MPI: a 64-byte ``Send`` / ``Recv``, its
  signalled message, since a polled one-sided flag stalled under MPICH 4.0.2 here); half a round trip;
* ``barrier``: ``barrier_all`` / ``MPI_Barrier`` latency.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

__all__ = ["available", "run", "PEERS"]

PEERS = ("shmem4py", "mpi")
_OMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_osc": "^rdma",
             "SHMEM_SYMMETRIC_HEAP_SIZE": "512M"}


def _launcher(peer: str) -> str | None:
    if peer == "shmem4py":
        return shutil.which("oshrun") if importlib.util.find_spec("shmem4py") else None
    return shutil.which("mpiexec.mpich") if importlib.util.find_spec("mpi4py") else None


def available() -> dict:
    """``{peer: launcher path or None}`` for shmem4py and mpi (with the reason in ``why`` when None)."""
    return {peer: _launcher(peer) for peer in PEERS}


def run(peer: str, kind: str, n: int, cfg: dict, timeout: float = 900) -> dict | None:
    """Run one peer job; its rank 0's result, or None (with the reason on stderr) when it failed."""
    launcher = _launcher(peer)
    if launcher is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        if peer == "shmem4py":
            cmd = [launcher, "-np", str(n)] + (["--oversubscribe"] if n > 2 else [])
            env = {**os.environ, **_OMPI_ENV}
        else:
            cmd = [launcher, "-n", str(n)]
            env = dict(os.environ)
        cmd += [sys.executable, os.path.abspath(__file__), "--worker", peer, kind, json.dumps(cfg), out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"peer {peer} {kind}: failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}",
                  file=sys.stderr)
            return None
        with open(out) as f:
            return json.load(f)


# --- the job bodies ------------------------------------------------------------------------------------------


class _Shmem:
    """shmem4py's calls, named as the bodies use them."""

    def __init__(self):
        from shmem4py import shmem
        self.s = shmem
        self.me, self.n = shmem.my_pe(), shmem.n_pes()

    def zeros(self, shape, dtype):
        return self.s.zeros(shape, dtype)

    def barrier(self):
        self.s.barrier_all()

    def put_nbi(self, dst, src, pe):
        self.s.put_nbi(dst, src, pe)

    def put(self, dst, src, pe):
        self.s.put(dst, src, pe)

    def quiet(self, pe):
        self.s.quiet()

    def signal(self, dst, src, flag, value, pe):
        self.s.put(dst, src, pe)
        self.s.fence()
        self.s.atomic_set(flag, value, pe)

    def wait(self, flag, value):
        self.s.wait_until(flag, self.s.CMP.EQ, value)

    def finish(self):
        self.s.barrier_all()


class _Mpi:
    """MPI one-sided calls: a window per array (``Win.Allocate``: shared memory within a node for MPICH),
    passive target (``Lock_all``); a wait polls the flag, driving MPI's progress with ``Iprobe``."""

    def __init__(self):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.me, self.n = self.comm.rank, self.comm.size
        self.wins = {}
        import numpy as np
        self._inbox = np.zeros(8, np.int64)

    def zeros(self, shape, dtype):
        import numpy as np
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        win = self.MPI.Win.Allocate(max(count * dtype.itemsize, 1), 1, comm=self.comm)
        arr = np.frombuffer(win.tomemory(), np.uint8)[:count * dtype.itemsize].view(dtype).reshape(shape)
        arr[...] = 0
        self.comm.Barrier()
        win.Lock_all()
        self.wins[id(arr)] = (arr, win)
        return arr

    def _target(self, dst):
        for base, win in self.wins.values():
            if base.__array_interface__["data"][0] <= dst.__array_interface__["data"][0] < \
                    base.__array_interface__["data"][0] + base.nbytes:
                return win, dst.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        raise ValueError("not a window array")

    def barrier(self):
        self.comm.Barrier()

    def put_nbi(self, dst, src, pe):
        win, off = self._target(dst)
        win.Put(src, pe, target=(off, src.nbytes, self.MPI.BYTE))

    put = put_nbi

    def quiet(self, pe):
        for _, win in self.wins.values():
            win.Flush(pe)

    def signal(self, dst, src, flag, value, pe):
        # a polled one-sided flag stalled here (MPICH 4.0.2 ch4:ucx: the target never saw some Puts), so MPI's
        # signalled message is its own idiom: a 64-byte Send, received by a Recv
        self.comm.Send(src, pe, tag=1)

    def wait(self, flag, value):
        self.comm.Recv(self._inbox, 1 - self.me, tag=1)

    def finish(self):
        self.comm.Barrier()
        for _, win in self.wins.values():
            win.Unlock_all()
            win.Free()


def _bw(lib, cfg) -> dict:
    import numpy as np
    top = max(cfg["sizes"])
    src = np.full(top, 7, np.uint8)
    dst = lib.zeros(top, np.uint8)
    lib.barrier()
    out = {}
    for size in cfg["sizes"]:
        k = max(1, min(cfg["bw_max_k"], cfg["bw_bytes"] // size))
        puts, singles = [], []
        for rep in range(cfg["samples"] + 1):
            lib.barrier()
            if lib.me == 0:
                t0 = time.perf_counter()
                for _ in range(k):
                    lib.put_nbi(dst[:size], src[:size], 1)
                lib.quiet(1)
                t1 = time.perf_counter()
                for _ in range(k):
                    lib.put_nbi(dst[:size], src[:size], 1)
                    lib.quiet(1)
                t2 = time.perf_counter()
                if rep:
                    puts.append(k * size / (t1 - t0))
                    singles.append(k * size / (t2 - t1))
        out[size] = {"put": puts, "put1": singles}
    return out


def _rate(lib, cfg) -> dict:
    import numpy as np
    slots, total = cfg["slots"], cfg["rate_wqes"]
    src = np.arange(slots * 8, dtype=np.int64).reshape(slots, 8)
    dst = lib.zeros((slots, 8), np.int64)
    lib.barrier()
    rates = []
    for rep in range(cfg["samples"] + 1):
        lib.barrier()
        if lib.me == 0:
            t0 = time.perf_counter()
            for base in range(0, total, 1024):
                for i in range(base % slots, base % slots + 1024):
                    lib.put_nbi(dst[i], src[i], 1)
                lib.quiet(1)
            if rep:
                rates.append(total / (time.perf_counter() - t0))
    return {"rate": rates}


def _pingpong(lib, cfg) -> dict:
    import numpy as np
    box = lib.zeros(8, np.int64)
    flag = lib.zeros(1, np.int64)
    payload = np.arange(8, dtype=np.int64)
    other = 1 - lib.me
    lib.barrier()
    value, halves = 0, []
    for rep in range(cfg["samples"] + 1):
        lib.barrier()
        t0 = time.perf_counter()
        for _ in range(cfg["pingpong_rounds"]):
            value += 1
            for turn in (0, 1):
                if lib.me == turn:
                    lib.signal(box, payload, flag, value, other)
                else:
                    lib.wait(flag, value)
        if rep:
            halves.append((time.perf_counter() - t0) / cfg["pingpong_rounds"] / 2)
    return {"pingpong": halves}


def _barrier(lib, cfg) -> dict:
    lib.barrier()
    times = []
    for rep in range(cfg["samples"] + 1):
        lib.barrier()
        t0 = time.perf_counter()
        for _ in range(cfg["barriers"]):
            lib.barrier()
        if rep:
            times.append((time.perf_counter() - t0) / cfg["barriers"])
    return {"barrier": times}


def _worker(peer: str, kind: str, cfg: dict, out: str) -> None:
    lib = _Shmem() if peer == "shmem4py" else _Mpi()
    result = {"bw": _bw, "rate": _rate, "pingpong": _pingpong, "barrier": _barrier}[kind](lib, cfg)
    lib.finish()
    if lib.me == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=4, metavar=("PEER", "KIND", "CONFIG", "OUT"), required=True)
    a = ap.parse_args()
    _worker(a.worker[0], a.worker[1], json.loads(a.worker[2]), a.worker[3])

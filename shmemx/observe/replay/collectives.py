"""The operations of a replayed thread that meet other threads: barriers, kernel launches and their blocks,
``sync_all``, joins; and the thread-local ones that only keep books (regions, ``compute``).

A mixin of ``sim.Sim`` (it uses the event queue, the threads and ``_block`` / ``_resume_event`` there). Each
handler returns True when the thread goes on, False when it blocked (its release is scheduled by whoever
completes the collective). A release records its cause with the releasing thread and how many releases that
thread had when it arrived, so that ``critical`` can continue the walk on it without looping.
"""

from __future__ import annotations

import numpy as np

from ...shm.control import WaitCall

__all__ = ["Collectives"]

# host-side setup (init, allocation, a team's creation): no cost
_FREE_BARRIERS = frozenset({WaitCall.INIT, WaitCall.MALLOC, WaitCall.FREE, WaitCall.TEAM_SPLIT})


class Collectives:
    def _op_barrier(self, th, op) -> bool:
        """A barrier of the job, or of a team (a row with the team's start, stride and size: its members only)."""
        _, call, number = op[:3]
        if call == WaitCall.FINALIZE:
            th.end = th.clock
            return True
        size = op[5] if len(op) > 5 and op[5] else self.n_pes
        arrivals = self.barriers.setdefault(number, [])
        arrivals.append((th.pe, th, th.clock, call))
        self._block(th, ("barrier", number))
        if len(arrivals) == size:
            self._release_barrier(number, arrivals)
        return False

    def _release_barrier(self, number: int, arrivals: list) -> None:
        """Every member arrived: the release times of a dissemination barrier over the arrived PEs (ceil(log2 n)
        rounds; in round r member i signals member i + 2^r and waits for member i - 2^r), each signal a small
        control message."""
        del self.barriers[number]
        n, topo = len(arrivals), self.topo
        arrivals.sort(key=lambda a: a[0])
        a = np.array([x[2] for x in arrivals])
        last = int(np.argmax(a))
        if arrivals[0][3] in _FREE_BARRIERS or n == 1:
            times = np.full(n, a.max())
        else:
            idx = np.arange(n)
            servers = np.array([x[0] for x in arrivals]) // self.rps
            send = topo.post_us + topo.doorbell_us
            times = a.copy()
            d = 1
            while d < n:
                src = (idx - d) % n
                lat = np.where(servers[src] == servers, self.lat[0], self.lat[1])
                times = np.maximum(times + send, times[src] + send + topo.wqe_us + lat)
                d *= 2
        last_th = arrivals[last][1]
        cause = ("barrier", last_th, float(a[last]), len(last_th.releases))
        for (pe, th, _, _), t in zip(arrivals, times.tolist()):
            self.at(t, self._resume_event, (th, cause))

    def _op_region(self, th, op) -> bool:
        _, name, enter = op
        if enter:
            th.regions.append((name, th.clock))
        else:
            for i in range(len(th.regions) - 1, -1, -1):
                if th.regions[i][0] == name:
                    _, start = th.regions.pop(i)
                    self.region_iv[th.pe].setdefault(name, []).append((start, th.clock))
                    break
        return True

    def _op_compute(self, th, op) -> bool:
        us = float(np.int64(op[1]).view(np.float64))
        if self.prog.names[th.pe][op[2]] == "kernel":  # a kernel call: its fixed cost too (host.kernel_us)
            us += self.topo.kernel_us
        th.computes.append((th.clock, th.clock + us))
        th.clock += us
        return True

    def _op_launch(self, th, op) -> bool:
        _, launch_id, dim = op
        self.launches[(th.pe, launch_id)] = {"t": th.clock, "dim": dim, "ended": 0, "end": th.clock,
                                             "last": th, "syncs": {}, "joiner": None}
        for slot in range(1, dim):
            other = self.threads[th.pe].get(slot)
            if other is not None and other.blocked == ("launch", launch_id):
                other.blocked_since = other.clock
                self.at(th.clock, self._resume_event, (other, ("launch", th, th.clock, len(th.releases))))
        return True

    def _op_block(self, th, op) -> bool:
        _, launch_id, begin = op
        launch = self.launches.get((th.pe, launch_id))
        if begin:
            if launch is None:  # a block that starts before its launch was replayed: wait for it
                return self._block(th, ("launch", launch_id))
            th.clock = max(th.clock, launch["t"])
            return True
        launch["ended"] += 1
        if th.clock >= launch["end"]:
            launch["end"], launch["last"] = th.clock, th
        joiner = launch["joiner"]
        if joiner is not None and launch["ended"] == launch["dim"]:
            launch["joiner"] = None
            self.at(max(joiner.clock, launch["end"]), self._resume_event, (joiner, self._join_cause(launch)))
        return True

    def _op_join(self, th, op) -> bool:
        launch = self.launches[(th.pe, op[1])]
        if launch["ended"] == launch["dim"]:
            if launch["end"] > th.clock:
                self._block(th, ("join", op[1]))
                self.at(launch["end"], self._resume_event, (th, self._join_cause(launch)))
                return False
            return True
        launch["joiner"] = th
        return self._block(th, ("join", op[1]))

    @staticmethod
    def _join_cause(launch: dict) -> tuple:
        last = launch["last"]
        return ("join", last, launch["end"], len(last.releases))

    def _op_sync(self, th, op) -> bool:
        launch = self.launches[(th.pe, op[1])]
        k = th.syncs.get(op[1], 0) + 1
        th.syncs[op[1]] = k
        arrived = launch["syncs"].setdefault(k, [])
        arrived.append(th)
        self._block(th, ("sync", op[1], k))
        if len(arrived) == launch["dim"]:
            last = max(arrived, key=lambda x: x.clock)
            cause = ("sync", last, last.clock, len(last.releases))
            for other in arrived:
                self.at(last.clock, self._resume_event, (other, cause))
            del launch["syncs"][k]
        return False


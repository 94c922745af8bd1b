"""The ports of the modelled network: per rank an egress and an ingress port per tier.

A transfer of ``b`` bytes from rank ``s`` to rank ``d`` over tier ``t`` (latency ``L``, bandwidth ``B`` per
port and direction) leaves the sender's engine at ``T``; ``landed(id, done)`` is called once its last byte has
arrived. Two ways of sharing a port:

* ``Fcfs`` (the default), busy-until reservations committed in virtual-time order (LogGOPSim, ASTRA-sim's
  congestion-aware links): the egress serves transfers first-come-first-served, ``x = max(T, egress_free)``,
  ``egress_free = x + b/B``; the first byte reaches the ingress at ``x + L`` and the ingress serves arrivals in
  their order, ``done = max(x + L, ingress_free) + b/B``, ``ingress_free = done``. A transfer holds a port for
  its whole length: WQEs are what is queued, as on an engine that does not interleave a WQE's packets.
* ``MaxMin``, for validation: every transfer in flight is a fluid flow through its two ports, rates by
  max-min fairness (progressive filling, SimGrid's LMM without weights), recomputed at every start and end;
  ``done`` = the end of the flow + ``L``. One transfer alone gets the same ``T + b/B + L`` as with ``Fcfs``.

Both count each port's bytes; utilisation is bytes / (B x makespan).
"""

from __future__ import annotations

import math
from typing import Any


__all__ = ["Fcfs", "MaxMin"]


class _Ports:
    def __init__(self, sim):
        self.sim = sim
        n = sim.n_pes
        self.egress_bytes = [[0, 0] for _ in range(n)]
        self.ingress_bytes = [[0, 0] for _ in range(n)]


class Fcfs(_Ports):
    """Busy-until ports (see the module docstring); ``pred_*`` name the transfer that held a port last, for the
    critical path."""

    def __init__(self, sim: Any):
        super().__init__(sim)
        n = sim.n_pes
        self.egress_free = [[0.0, 0.0] for _ in range(n)]
        self.ingress_free = [[0.0, 0.0] for _ in range(n)]
        self.egress_last = [[-1, -1] for _ in range(n)]
        self.ingress_last = [[-1, -1] for _ in range(n)]

    def send(self, gid: int, t: float) -> None:
        """Transfer ``gid`` (its src, dst, tier, bytes in the sim's records) leaves the engine at ``t`` (called at
        virtual time ``t``)."""
        sim = self.sim
        src, tier, b = sim.w_src[gid], sim.w_tier[gid], sim.w_bytes[gid]
        free = self.egress_free[src]
        x = t
        if free[tier] > t:
            x = free[tier]
            sim.w_pred_egr[gid] = self.egress_last[src][tier]
        free[tier] = x + b / sim.bw[tier]
        self.egress_last[src][tier] = gid
        self.egress_bytes[src][tier] += b
        sim.w_x[gid] = x
        sim.at(x + sim.lat[tier], self.arrive, gid)

    def arrive(self, gid: int, t: float) -> None:
        sim = self.sim
        dst, tier, b = sim.w_dst[gid], sim.w_tier[gid], sim.w_bytes[gid]
        sim.w_arr[gid] = t
        free = self.ingress_free[dst]
        start = t
        if free[tier] > t:
            start = free[tier]
            sim.w_pred_ing[gid] = self.ingress_last[dst][tier]
        done = start + b / sim.bw[tier]
        free[tier] = done
        self.ingress_last[dst][tier] = gid
        self.ingress_bytes[dst][tier] += b
        sim.landed(gid, done, t)


class MaxMin(_Ports):
    """Max-min fair fluid flows (see the module docstring)."""

    def __init__(self, sim: Any):
        super().__init__(sim)
        self.flows: dict[int, list] = {}  # gid -> [remaining bytes, rate]
        self.t = 0.0
        self.version = 0

    def send(self, gid: int, t: float) -> None:
        sim = self.sim
        self._advance(t)
        sim.w_x[gid] = t
        src, dst, tier, b = sim.w_src[gid], sim.w_dst[gid], sim.w_tier[gid], sim.w_bytes[gid]
        self.egress_bytes[src][tier] += b
        self.ingress_bytes[dst][tier] += b
        self.flows[gid] = [float(b), 0.0]
        self._reschedule(t)

    def _advance(self, t: float) -> None:
        dt = t - self.t
        if dt > 0:
            for f in self.flows.values():
                f[0] -= f[1] * dt
        self.t = t

    def _rates(self) -> None:
        """Progressive filling over the egress and ingress constraints of the flows in flight."""
        sim = self.sim
        users: dict[tuple, list[int]] = {}
        for gid in self.flows:
            tier = sim.w_tier[gid]
            users.setdefault(("e", sim.w_src[gid], tier), []).append(gid)
            users.setdefault(("i", sim.w_dst[gid], tier), []).append(gid)
        cap = {k: sim.bw[k[2]] for k in users}
        left = {k: len(v) for k, v in users.items()}
        frozen: set[int] = set()
        while len(frozen) < len(self.flows):
            key = min((k for k in users if left[k]), key=lambda k: (cap[k] / left[k], k))
            share = cap[key] / left[key]
            for gid in users[key]:
                if gid in frozen:
                    continue
                frozen.add(gid)
                self.flows[gid][1] = share
                tier = sim.w_tier[gid]
                for k in (("e", sim.w_src[gid], tier), ("i", sim.w_dst[gid], tier)):
                    cap[k] -= share
                    left[k] -= 1

    def _reschedule(self, t: float) -> None:
        self.version += 1
        if not self.flows:
            return
        self._rates()
        end = min(t + f[0] / f[1] for f in self.flows.values())
        self.sim.at(end, self._finish, self.version)

    def _finish(self, version: int, t: float) -> None:
        if version != self.version:
            return
        self._advance(t)
        sim = self.sim
        done = [g for g, f in self.flows.items() if f[0] <= 1e-9 * max(1.0, sim.w_bytes[g]) or
                math.isclose(t + f[0] / f[1], t, rel_tol=1e-12, abs_tol=1e-12)]
        for gid in sorted(done):
            del self.flows[gid]
            sim.w_arr[gid] = t
            sim.landed(gid, t + sim.lat[sim.w_tier[gid]], t)
        self._reschedule(t)

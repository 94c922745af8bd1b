"""The critical path of a replay: what made the slowest PE as slow as it is, walked back from its end.

Every release of a blocked thread records its cause (the WQE whose write met the wait, the CQE a quiet waited
for, the last PE into a barrier, the last block into a join); every WQE records what held it (the engine's
previous WQE, a fence, the transfer ahead of it at a port). From the slowest PE's end the walk follows the
binding cause each time, back to time 0, and labels each stretch: ``host`` (posting: post_us and doorbell_us),
``compute`` (annotations), ``engine`` (wqe_us), ``bytes intra|inter`` (a transfer's length at a port),
``latency intra|inter``, ``barrier`` (a barrier's dissemination rounds). The stretches add up to the end time.
"""

from __future__ import annotations

import bisect

from ...udma.layout import opcode_name
from .sim import W_MTE, W_SDMA, W_SIGNAL, Sim

__all__ = ["critical_path", "CATEGORIES"]

CATEGORIES = ("host", "compute", "engine", "bytes intra", "bytes inter", "latency intra", "latency inter",
              "barrier", "other")
_TIER = ("intra", "inter")


def critical_path(sim: Sim, pe: int, max_steps: int = 40) -> dict:
    """``{"pe", "end_us", "bound": the largest category, "breakdown": {category: us}, "n_steps", "steps"}``:
    ``steps`` are the ``max_steps`` longest stretches of the path (runs of one kind at one place merged, with a
    ``count``), in time order; ``n_steps`` how many the whole path has."""
    walk = _Walk(sim)
    th = max(sim.threads[pe].values(), key=lambda t: (t.end, -t.slot))
    walk.run(th, th.end)
    breakdown = {c: 0.0 for c in CATEGORIES}
    for s in walk.steps:
        breakdown[s["what"]] += s["us"]
    steps = _merge(walk.steps)
    longest = sorted(sorted(range(len(steps)), key=lambda i: -steps[i]["us"])[:max_steps])
    bound = max(CATEGORIES, key=lambda c: breakdown[c])
    return {"pe": pe, "end_us": th.end, "bound": bound,
            "breakdown": {k: v for k, v in breakdown.items() if v > 0}, "n_steps": len(steps),
            "steps": [steps[i] for i in longest]}


class _Walk:
    def __init__(self, sim: Sim):
        self.sim = sim
        self.steps: list[dict] = []
        self._times: dict[int, list] = {}

    def add(self, t0: float, t1: float, what: str, where: str, detail: str = "") -> None:
        if t1 > t0:
            self.steps.append({"t0": t0, "t1": t1, "us": t1 - t0, "what": what, "where": where, "detail": detail})

    def run(self, th, t: float) -> None:
        node = ("thread", th, t)
        for _ in range(10_000_000):
            node = getattr(self, "_" + node[0])(*node[1:])
            if node is None:
                return

    def _wqe_name(self, gid: int) -> str:
        sim = self.sim
        kind = sim.w_kind[gid]
        if kind == W_SIGNAL:
            return f"signal_op pe {sim.w_pe[gid]} -> pe {sim.w_dst[gid]}"
        if kind == W_MTE:
            return f"MTE copy pe {sim.w_src[gid]} -> pe {sim.w_dst[gid]} {sim.w_bytes[gid]} B"
        if kind == W_SDMA:
            return f"SDMA copy pe {sim.w_src[gid]} -> pe {sim.w_dst[gid]} {sim.w_bytes[gid]} B"
        pe = sim.w_pe[gid]
        i = gid - sim.base[pe]
        wq = sim.prog.wqes[pe]
        return (f"{opcode_name(int(wq.opcode[i]))} pe {pe} -> pe {int(wq.peer[i])} qp {int(wq.qp[i])} "
                f"{sim.w_bytes[gid]} B at BB {int(wq.pos[i])}")

    # --- nodes: each adds its stretch and returns the next node (None at time 0) ---------------------------

    def _thread(self, th, t: float, limit: int | None = None):
        """Thread ``th`` at time ``t``: its own work back to its last release (among the first ``limit``)."""
        times = self._times.get(id(th))
        if times is None:
            times = self._times[id(th)] = [r[0] for r in th.releases]
        k = bisect.bisect_right(times, t, 0, len(times) if limit is None else limit) - 1
        r_t = th.releases[k][0] if k >= 0 else 0.0
        self._host(th, r_t, t)
        if k < 0:
            return None
        _, since, cause = th.releases[k]
        kind = cause[0] if cause else "never"
        if kind == "wqe" or kind == "mte" or kind == "sdma":
            return ("done", cause[1])
        if kind == "ack":
            return ("ack", cause[1])
        if kind in ("barrier", "join", "sync", "launch"):  # (the other thread as it arrived: its first n releases)
            other, when, n_releases = cause[1], cause[2], cause[3]
            if kind == "barrier":
                self.add(when, r_t, "barrier", f"pe {th.pe}", f"barrier released; pe {other.pe} arrived last")
            return ("thread", other, when, n_releases)
        self.add(since, r_t, "other", f"pe {th.pe}", "a wait released without a modelled cause")
        return ("thread", th, since, k)

    def _host(self, th, t0: float, t1: float) -> None:
        if t1 <= t0:
            return
        compute = 0.0
        for a, b in th.computes:
            lo, hi = max(a, t0), min(b, t1)
            if hi > lo:
                compute += hi - lo
        where = f"pe {th.pe} block {th.slot}"
        if compute:
            self.steps.append({"t0": t0, "t1": t1, "us": compute, "what": "compute", "where": where,
                               "detail": "compute annotations"})
        if t1 - t0 - compute > 1e-12 * max(1.0, t1):
            self.steps.append({"t0": t0, "t1": t1, "us": t1 - t0 - compute, "what": "host", "where": where,
                               "detail": "posting (post_us per WQE, doorbell_us per doorbell)"})

    def _ack(self, gid: int):
        sim = self.sim
        self.add(sim.w_done[gid], sim.w_ack[gid], "latency " + _TIER[sim.w_tier[gid]], self._wqe_name(gid),
                 "acknowledgement")
        return ("done", gid)

    def _done(self, gid: int):
        sim = self.sim
        kind, tier = sim.w_kind[gid], sim.w_tier[gid]
        name, lat, nbytes = self._wqe_name(gid), "latency " + _TIER[tier], "bytes " + _TIER[tier]
        if kind == W_SIGNAL:
            self.add(sim.w_T[gid], sim.w_done[gid], lat, name)
            return ("engine", gid)
        if sim.topo.sharing == "maxmin":  # a fluid flow from x to arr (its sharing included), then the latency
            self.add(sim.w_arr[gid], sim.w_done[gid], lat, name)
            self.add(sim.w_x[gid], sim.w_arr[gid], nbytes, name, "a flow (max-min shared)")
            return ("engine", gid)
        pred = sim.w_pred_ing[gid]  # set only when the ingress was still busy with it on arrival
        start = sim.w_done[pred] if pred >= 0 else sim.w_arr[gid]
        self.add(start, sim.w_done[gid], nbytes, name, f"into pe {sim.w_dst[gid]}")
        if pred >= 0:
            return ("done", pred)
        self.add(sim.w_x[gid], sim.w_arr[gid], lat, name)
        return ("x", gid)

    def _x(self, gid: int):
        sim = self.sim
        tier = sim.w_tier[gid]
        pred = sim.w_pred_egr[gid]  # set only when the egress was still busy when this one wanted it
        if pred >= 0:
            self.add(sim.w_x[pred], sim.w_x[gid], "bytes " + _TIER[tier], self._wqe_name(pred),
                     f"out of pe {sim.w_src[gid]}, ahead of this one")
            return ("x", pred)
        if sim.w_x[gid] > sim.w_T[gid]:  # a READ's (or MTE get's) request went first
            self.add(sim.w_T[gid], sim.w_x[gid], "latency " + _TIER[tier], self._wqe_name(gid), "read request")
        return ("engine", gid)

    def _engine(self, gid: int):
        sim = self.sim
        poster = sim.w_poster[gid]
        if sim.w_kind[gid] == W_MTE:
            return ("thread", poster, sim.w_ready[gid])
        where = "sdma" if sim.w_kind[gid] == W_SDMA else "engine"
        self.add(sim.w_s[gid], sim.w_T[gid], "engine", f"pe {sim.w_pe[gid]} {where}", self._wqe_name(gid))
        if sim.w_pred_fence[gid] >= 0:
            return ("ack", sim.w_pred_fence[gid])
        if sim.w_pred_eng[gid] >= 0:
            return ("engine", sim.w_pred_eng[gid])
        return ("thread", poster, sim.w_ready[gid])


def _merge(steps: list[dict]) -> list[dict]:
    """Runs of steps of the same kind at the same place, as one step (with a count), in time order."""
    out: list[dict] = []
    for s in reversed(steps):
        last = out[-1] if out else None
        if last is not None and last["what"] == s["what"] and last["where"].split(" ->")[0] == \
                s["where"].split(" ->")[0]:
            last["t1"] = max(last["t1"], s["t1"])
            last["us"] += s["us"]
            last["count"] += 1
            if last["detail"] != s["detail"]:
                last["detail"] = "" if last["count"] > 2 else last["detail"]
            continue
        out.append(dict(s, count=1))
    for s in out:
        s["where"] = s["where"] if s["count"] == 1 else s["where"].split(" ->")[0] + (" ..." if " ->" in s["where"]
                                                                                       else "")
    return out

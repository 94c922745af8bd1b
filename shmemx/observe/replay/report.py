"""What a replay says: the JSON document, its text rendering, and a Perfetto trace in virtual time.

The document (``--json``), schema ``shmemx-replay/1``; times in microseconds of virtual time::

    {"schema", "recording": {"script", "n_pes"}, "topology": {as the TOML}, "makespan_us",
     "max_pe": the slowest PE, "mean_end_us",
     "pes": [{"pe", "end_us", "regions": {name: us}, "wqes", "bytes",
              "links": {"egress intra": {"bytes", "util"}, ...}}],    # this PE's own ports (those used)
     "regions": {name: {"max_us", "mean_us", "max_pe", "calls"}},  # a PE's time in a region: the union of its
                                                                   # blocks' intervals; calls: most entries per PE
     "links": {"egress intra": {"bytes", "max_util", "mean_util", "max_pe"}, "ingress intra": ..., ...},
     "critical_path": {"pe", "end_us", "bound", "breakdown": {category: us}, "n_steps",
                       "steps": [{"t0", "t1", "us", "what", "where", "detail", "count"}] (the longest 40)},
     "warnings": [{"kind", "count", "example"}], "events", "wqes"}

``utilisation`` of a port = its bytes / (bandwidth x makespan).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

from ...udma.layout import opcode_name
from .critical import critical_path
from .sim import W_MTE, W_SDMA, W_SIGNAL, Sim

__all__ = ["summary", "render", "write_perfetto", "SCHEMA"]

SCHEMA = "shmemx-replay/1"
_TIER = ("intra", "inter")


def _union(intervals: list) -> float:
    total, end = 0.0, None
    start = None
    for a, b in sorted(intervals):
        if end is None or a > end:
            if end is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None:
        total += end - start
    return total


def summary(sim: Sim, job: dict | None = None) -> dict:
    """The replay's document (see the module docstring)."""
    n = sim.n_pes
    names = sim.prog.names
    pes = []
    for pe in range(n):
        regions = {names[pe][k]: _union(iv) for k, iv in sorted(sim.region_iv[pe].items())}
        wq = sim.prog.wqes[pe]
        pes.append({"pe": pe, "end_us": sim.end[pe], "regions": regions, "wqes": len(wq),
                    "bytes": int(wq.nbytes.sum())})
    makespan = max(sim.end) if n else 0.0
    for pe, entry in enumerate(pes):
        entry["links"] = _pe_links(sim, pe, makespan)
    max_pe = max(range(n), key=lambda p: (sim.end[p], -p))
    region_names = sorted({r for p in pes for r in p["regions"]})
    regions = {}
    calls = {}
    for pe in range(n):
        for k, iv in sim.region_iv[pe].items():
            calls[names[pe][k]] = max(calls.get(names[pe][k], 0), len(iv))
    for r in region_names:
        vals = [p["regions"].get(r, 0.0) for p in pes]
        top = max(range(n), key=lambda p: (vals[p], -p))
        regions[r] = {"max_us": vals[top], "mean_us": sum(vals) / n, "max_pe": top, "calls": calls[r]}
    doc = {"schema": SCHEMA, "recording": {k: v for k, v in (job or {}).items() if k in ("script", "n_pes")},
           "topology": sim.topo.as_dict(), "makespan_us": makespan, "max_pe": max_pe,
           "mean_end_us": sum(sim.end) / n, "pes": pes, "regions": regions, "links": _links(sim, makespan),
           "critical_path": critical_path(sim, max_pe),
           "warnings": [{"kind": k, "count": c, "example": text} for k, (c, text) in sorted(sim.warnings.items())],
           "events": sim.n_events, "wqes": sim.base[-1]}
    return doc


def _pe_links(sim: Sim, pe: int, makespan: float) -> dict:
    """One PE's ports: bytes through each, and its utilisation (bytes / (bandwidth x makespan))."""
    out = {}
    for direction, table in (("egress", sim.net.egress_bytes), ("ingress", sim.net.ingress_bytes)):
        for tier in (0, 1):
            b = table[pe][tier]
            if b:
                out[f"{direction} {_TIER[tier]}"] = {"bytes": int(b), "util": b / (sim.bw[tier] * makespan)
                                                     if makespan > 0 else 0.0}
    return out


def _links(sim: Sim, makespan: float) -> dict:
    out = {}
    for direction, table in (("egress", sim.net.egress_bytes), ("ingress", sim.net.ingress_bytes)):
        for tier in (0, 1):
            per_pe = [row[tier] for row in table]
            total = sum(per_pe)
            if not total:
                continue
            cap = sim.bw[tier] * makespan if makespan > 0 else 1.0
            top = max(range(len(per_pe)), key=lambda p: (per_pe[p], -p))
            out[f"{direction} {_TIER[tier]}"] = {"bytes": total, "max_util": per_pe[top] / cap,
                                                 "mean_util": total / len(per_pe) / cap, "max_pe": top}
    return out


def render(doc: dict, *, top: int = 8) -> str:
    """The document as text: the headline, per-PE end times (the slowest ``top``), regions, links, the critical
    path and the warnings."""
    topo = doc["topology"]
    lines = [f"replay of {doc['recording'].get('script', '?')} ({len(doc['pes'])} PEs) on {topo['name']}: "
             f"{topo['ranks_per_server']} ranks/server, intra {topo['intra']['bandwidth_GBps']:g} GB/s "
             f"{topo['intra']['latency_us']:g} us, inter {topo['inter']['bandwidth_GBps']:g} GB/s "
             f"{topo['inter']['latency_us']:g} us, wqe {topo['engine']['wqe_us']:g} us"
             + (f" (intra {topo['engine']['intra_wqe_us']:g} us)" if "intra_wqe_us" in topo["engine"] else "")
             + f", post "
             f"{topo['host']['post_us']:g} us, doorbell {topo['host']['doorbell_us']:g} us, {topo['network']['sharing']}",
             f"makespan {doc['makespan_us']:.3f} us (pe {doc['max_pe']}), mean PE end {doc['mean_end_us']:.3f} us; "
             f"{doc['wqes']:,} WQEs, {doc['events']:,} events"]
    if doc["regions"]:
        lines.append("regions (a PE's time in it; max over PEs, mean):")
        for name, r in doc["regions"].items():
            lines.append(f"  {name:<24} max {r['max_us']:12.3f} us (pe {r['max_pe']})   mean {r['mean_us']:12.3f} us")
    slow = sorted(doc["pes"], key=lambda p: (-p["end_us"], p["pe"]))[:top]
    lines.append("slowest PEs: " + ", ".join(f"pe {p['pe']} {p['end_us']:.3f} us" for p in slow))
    if doc["links"]:
        lines.append("ports (utilisation = bytes / (bandwidth x makespan)):")
        for name, link in doc["links"].items():
            lines.append(f"  {name:<14} {link['bytes'] / 1e6:10.3f} MB   max {link['max_util']:6.1%} (pe "
                         f"{link['max_pe']})   mean {link['mean_util']:6.1%}")
        busiest = sorted(((u["util"], p["pe"], name) for p in doc["pes"] for name, u in p.get("links", {}).items()),
                         key=lambda x: (-x[0], x[1], x[2]))[:min(top, 4)]
        lines.append("  busiest ports: " + ", ".join(f"pe {pe} {name} {u:.1%}" for u, pe, name in busiest)
                     + " (--json: every PE's under pes[].links)")
    cp = doc["critical_path"]
    parts = ", ".join(f"{k} {v:.3f}" for k, v in sorted(cp["breakdown"].items(), key=lambda kv: -kv[1]))
    lines.append(f"critical path to pe {cp['pe']}'s end ({cp['end_us']:.3f} us): bound by {cp['bound']}; {parts} us")
    shown = sorted(sorted(cp["steps"], key=lambda s: -s["us"])[:12], key=lambda s: s["t0"])
    for s in shown:
        count = f" x{s['count']}" if s["count"] > 1 else ""
        detail = f" ({s['detail']})" if s["detail"] else ""
        lines.append(f"  {s['t0']:12.3f} .. {s['t1']:12.3f}  {s['us']:10.3f} us  {s['what']:<13} {s['where']}"
                     f"{count}{detail}")
    if cp["n_steps"] > len(shown):
        lines.append(f"  (the {len(shown)} longest of {cp['n_steps']} stretches; --json lists {len(cp['steps'])})")
    for w in doc["warnings"]:
        lines.append(f"warning: {w['kind']} x{w['count']}: {w['example']}")
    if not doc["warnings"]:
        lines.append("no warnings: no recorded control flow depended on host timing")
    return "\n".join(lines) + "\n"


_BLOCKED = {"wqe": "wait", "mte": "mte copy", "sdma": "sdma quiet", "ack": "quiet", "barrier": "barrier", "join": "join",
            "sync": "sync_all", "launch": "launch", "never": "wait (never met)"}


def _blocked_slice(sim: Sim, cause) -> tuple[str, dict]:
    """A blocked stretch of a thread: its name (what it waited in) and what released it."""
    kind = cause[0] if cause else "never"
    args: dict = {}
    if kind in ("wqe", "ack", "mte", "sdma") and cause[1] is not None and cause[1] >= 0:
        gid = cause[1]
        what = {W_SIGNAL: "signal_op", W_MTE: "MTE copy", W_SDMA: "SDMA copy"}.get(sim.w_kind[gid])
        if what is None:
            pe = sim.w_pe[gid]
            what = opcode_name(int(sim.prog.wqes[pe].opcode[gid - sim.base[pe]]))
        args["released by"] = f"{what} pe {sim.w_src[gid]} -> pe {sim.w_dst[gid]}, {sim.w_bytes[gid]} B"
    elif kind in ("barrier", "join", "sync", "launch"):
        args["last in"] = repr(cause[1])
    return _BLOCKED.get(kind, kind), args


_REGIONS_TRACK, _ENGINE_TRACK = 99998, 99999  # tids (within a PE's 100000) of the regions and engine tracks


def _tid(pe: int, track: int) -> int:
    """The trace tid of a PE's track: blocks are tracks 0.., queues 1000+index, then regions and engine."""
    return (pe + 1) * 100000 + track


def _thread_events(sim: Sim, pe: int, slot: int, th) -> Iterator[dict]:
    """One block's track: its name, then its blocked stretches and its compute slices."""
    pid, tid = pe + 1, _tid(pe, slot)
    yield {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": f"block {slot}"}}
    for release, since, cause in th.releases:
        if release > since:
            name, args = _blocked_slice(sim, cause)
            yield {"ph": "X", "pid": pid, "tid": tid, "ts": since, "dur": release - since,
                   "name": name, "cat": "wait", "args": args}
    for a, b in th.computes:
        yield {"ph": "X", "pid": pid, "tid": tid, "ts": a, "dur": b - a, "name": "compute", "cat": "compute"}


def _pe_events(sim: Sim, pe: int) -> Iterator[dict]:
    """A PE's process: its name and order, a track per block, its regions, and the names of the two fixed tracks."""
    pid = pe + 1
    yield {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"pe {pe}"}}
    yield {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pe}}
    for slot, th in sim.threads[pe].items():
        yield from _thread_events(sim, pe, slot, th)
    regions = _tid(pe, _REGIONS_TRACK)
    for name, ivs in sim.region_iv[pe].items():
        for a, b in ivs:
            yield {"ph": "X", "pid": pid, "tid": regions, "ts": a, "dur": b - a,
                   "name": sim.prog.names[pe][name], "cat": "region"}
    yield {"ph": "M", "pid": pid, "tid": regions, "name": "thread_name", "args": {"name": "regions"}}
    yield {"ph": "M", "pid": pid, "tid": _tid(pe, _ENGINE_TRACK), "name": "thread_name", "args": {"name": "engine"}}


def _wqe_events(sim: Sim) -> Iterator[dict]:
    """Per WQE on a queue: a slice on its PE's engine track (executing) and one on its queue's track (from engine
    to acknowledgement); a queue's track is named before its first slice."""
    named = set()
    for gid in range(len(sim.w_kind)):
        kind, pe = sim.w_kind[gid], sim.w_pe[gid]
        if kind in (W_SIGNAL, W_MTE, W_SDMA) or sim.w_queue[gid] is None:
            continue
        pid, i, wq, q = pe + 1, gid - sim.base[pe], sim.prog.wqes[pe], sim.w_queue[gid]
        op = opcode_name(int(wq.opcode[i]))
        args = {"peer": int(wq.peer[i]), "qp": int(wq.qp[i]), "pos": int(wq.pos[i]), "bytes": sim.w_bytes[gid],
                "ready": sim.w_ready[gid], "done": sim.w_done[gid]}
        yield {"ph": "X", "pid": pid, "tid": _tid(pe, _ENGINE_TRACK), "ts": sim.w_s[gid],
               "dur": sim.w_T[gid] - sim.w_s[gid], "name": op, "cat": "engine", "args": args}
        tid = _tid(pe, 1000 + q.index)
        if (pe, q.index) not in named:
            named.add((pe, q.index))
            yield {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                   "args": {"name": f"-> pe {q.peer} qp {q.qp}"}}
        yield {"ph": "X", "pid": pid, "tid": tid, "ts": sim.w_s[gid], "dur": sim.w_ack[gid] - sim.w_s[gid],
               "name": op, "cat": "wqe", "args": args}


def write_perfetto(sim: Sim, path: str) -> None:
    """A Chrome trace-event JSON of the replay in virtual time: per PE a process with a track per block (waits,
    quiets, barriers, regions, compute), the engine (one slice per WQE) and one per queue (from engine to
    acknowledgement)."""
    events = itertools.chain(itertools.chain.from_iterable(_pe_events(sim, pe) for pe in range(sim.n_pes)),
                             _wqe_events(sim))
    with open(path, "w") as f:
        f.write('{"traceEvents":[\n')
        f.write(",\n".join(json.dumps(ev, separators=(",", ":")) for ev in events))
        f.write('\n],"displayTimeUnit":"ns","otherData":{"clock":"virtual time (us) of shmemx replay"}}\n')

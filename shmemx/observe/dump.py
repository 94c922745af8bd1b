"""``shmemx dump``: every queue, wait and allocation of a job, as one JSON document and as text.

``snapshot(reader)`` reads a live or stopped job (read-only, see ``reader``) into a plain dict, the document
``shmemx dump --json`` prints and the launcher saves after a timeout or failure (schema ``shmemx-dump/1``, in
the README). ``render(doc)`` turns a document into text and ``diagnosis(doc)`` into the short who-waits-on-what
lines; both work only from the document, so a saved dump (``shmemx dump --file F``) reads exactly like a live
one. WQEs and CQEs are kept as raw bytes (hex) and decoded with the one decoder of ``layout``, beside their
decoded fields for tools.

Per queue (pe -> peer, qp) the positions are the monotonic 32-bit BB counters of the data plane: ``tail`` (the
poller retired everything before it), ``ci`` (the engine executed everything before it) and ``head`` (posted),
so that ``[ci, head)`` holds the WQEs posted but not executed and ``[cq tail, cq_pi)`` the CQEs written but not
consumed by a quiet. Only queues with something in flight (or a recorded error) are listed unless
``all_queues``: an 8-PE job has 56 queue pairs per QP index.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from collections.abc import Iterable

import numpy as np

from ..shm.control import BARRIER_WAIT_NAMES, JobState, PeStatus
from ..udma.describe import VaNames, format_cqe, format_wqe
from ..udma.layout import M32, CqeStatus, decode_cqe, decode_wqe, odr_name, split_flag
from ..udma.rings import decode_sidecar, read_wqe, scan_wqes
from .counters import JobStats
from .jobs import pid_alive
from .reader import Allocations, JobReader

__all__ = ["SCHEMA", "snapshot", "render", "diagnosis", "load", "save", "DEFAULT_LIMIT"]

SCHEMA = "shmemx-dump/1"
DEFAULT_LIMIT = 64  # WQEs and CQEs listed per queue (the counts are always complete)


# --- reading ---------------------------------------------------------------------------------------------------


def snapshot(reader: JobReader, *, pes: Iterable[int] | None = None, peers: Iterable[int] | None = None,
             qps: Iterable[int] | None = None, all_queues: bool = False, limit: int = DEFAULT_LIMIT, reason: str = "",
             stats: bool = True) -> dict:
    """Read the job into a JSON-able document (see the README's schema).

    Args:
        reader: the job, mapped read-only.
        pes, peers, qps: only these PEs / peers / QP indices (iterables of ints; None = all).
        all_queues: list idle queues too.
        limit: WQEs and CQEs listed per queue (0 = none, -1 = all); the counts are always complete.
        reason: why the dump was taken ("timeout", "pe 3 failed: ..."), for post-mortem files.
        stats: include every PE's counters (``counters.JobStats.per_pe``).
    """
    ctl = reader.ctl
    hdr = ctl.header
    allocations = reader.allocation_tables()
    vamap = reader.va_names(allocations)
    pes = sorted(set(pes)) if pes is not None else list(range(reader.n_pes))
    doc = {
        "schema": SCHEMA,
        "job": {
            "id": reader.job_id,
            "n_pes": reader.n_pes,
            "script": hdr["script"].item().decode(errors="replace"),
            "launcher_pid": int(hdr["launcher_pid"]),
            "launcher_alive": pid_alive(int(hdr["launcher_pid"])),
            "state": JobState(int(hdr["state"])).name,
            "start_time": float(hdr["start_time"]),
            "heap_size": int(hdr["heap_size"]),
            "timeout": float(hdr["timeout"]),
        },
        "taken_at": time.time(),
        "reason": reason,
        "udma_layout": vamap.udma,
        # every PE's allocations, also those of PEs filtered out: they name the remote VAs of the WQEs shown
        "va_names": {str(pe): [[name, off, size] for name, off, size in allocs]
                     for pe, allocs in allocations.tables.items()},
        "filters": {"pes": pes if len(pes) < reader.n_pes else None,
                    "peers": sorted(set(peers)) if peers is not None else None,
                    "qps": sorted(set(qps)) if qps is not None else None, "all_queues": all_queues, "limit": limit},
        "pes": [],
    }
    waits = reader.waits()
    for w in waits:
        w["text"] = reader.describe_wait(w)
    for pe in pes:
        doc["pes"].append(_pe(reader, pe, vamap, [w for w in waits if w["pe"] == pe], peers, qps, all_queues,
                              limit))
    doc["stats"] = _stats(reader) if stats else None
    doc["diagnosis"] = diagnosis(doc)
    return doc


def _pe(reader: JobReader, pe: int, vamap: VaNames, waits: list, peers, qps, all_queues: bool, limit: int) -> dict:
    rec = reader.ctl.pes[pe]
    eid = [int(x) for x in rec["eid"]]
    out = {
        "pe": pe,
        "pid": int(rec["pid"]),
        "status": PeStatus(int(rec["status"])).name,
        "state": f"waits in {waits[0]['call']}" if waits else reader.pe_state(pe),
        "error": rec["error"].item().decode(errors="replace"),
        "eid": f"{eid[1] << 64 | eid[0]:#034x}",
        "heap_tid": int(rec["heap_tid"]),
        "heap_token": int(rec["heap_token"]),
        "qp_num": int(rec["qp_num"]),
        "sq_depth": int(rec["sq_depth"]),
        "cq_depth": int(rec["cq_depth"]),
        "heap_size": int(rec["heap_size"]),
        "heap_used": int(rec["heap_used"]),
        "barriers": int(rec["barriers"]),
        "waits": waits,
        "allocations": [{"name": n, "offset": o, "size": s} for n, o, s in reader.allocations(pe)],
        "queues": None,
    }
    udma = reader.udma(pe)
    if udma is not None:
        out["queues"] = _queues(udma, pe, vamap, peers, qps, all_queues, limit)
    return out


def _queues(udma, pe: int, vamap: VaNames, peers, qps, all_queues: bool, limit: int) -> list[dict]:
    wq, cq, hw = (np.array(t) for t in (udma.wq_ctx, udma.cq_ctx, udma.hw))  # one copy of every context now
    index = np.arange(udma.n_slots)
    peer_of, qp_of = index // udma.qp_num, index % udma.qp_num
    busy = ((wq["head"] != hw["ci"]) | (hw["cq_pi"] != cq["tail"]) | (wq["cqe_cnt"] != cq["tail"])
            | (hw["err_status"] != 0) | (hw["state"] != 0))
    keep = (peer_of != pe) & (busy | all_queues)
    if peers is not None:
        keep &= np.isin(peer_of, list(peers))
    if qps is not None:
        keep &= np.isin(qp_of, list(qps))
    return [_queue(udma, pe, int(i), wq[i], cq[i], hw[i], vamap, limit) for i in np.flatnonzero(keep)]


def _fields(record) -> dict:
    return {name: int(record[name]) for name in record.dtype.names if not name.startswith("_")}


def _queue(udma, pe: int, i: int, wq, cq, hw, vamap: VaNames, limit: int) -> dict:
    peer, qp = divmod(i, udma.qp_num)
    depth, mask = udma.sq_depth, udma.sq_depth - 1
    head, tail, ci = int(wq["head"]), int(wq["tail"]), int(hw["ci"])
    cq_tail, cq_pi, cqe_cnt = int(cq["tail"]), int(hw["cq_pi"]), int(wq["cqe_cnt"])
    sq32 = udma.sq_ring(i).view("<u4")
    sidecar = udma.sidecar(i)
    unexecuted_bbs = min((head - ci) & M32, depth)
    executed_bbs = min((ci - tail) & M32, depth)
    pending_pos = scan_wqes(sq32, mask, ci, unexecuted_bbs)[0] if unexecuted_bbs else np.zeros(0, np.int64)
    executed_pos = scan_wqes(sq32, mask, tail, executed_bbs)[0] if executed_bbs else np.zeros(0, np.int64)
    out = {
        "peer": peer,
        "qp": qp,
        "index": i,
        "wq_ctx": _fields(wq),
        "cq_ctx": _fields(cq),
        "engine": _fields(hw),
        "counts": {
            "posted_wqes": len(executed_pos) + len(pending_pos),  # since the last retired CQE
            "executed_wqes": len(executed_pos),
            "unexecuted_wqes": len(pending_pos),
            "unexecuted_bbs": unexecuted_bbs,
            "cqes_outstanding": (cqe_cnt - cq_tail) & M32,
            "cqes_unconsumed": min((cq_pi - cq_tail) & M32, udma.cq_depth),
        },
        "pending": [],
        "pending_omitted": 0,
        "cqes": [],
        "cqes_omitted": 0,
        "error": None,
    }
    shown = len(pending_pos) if limit < 0 else min(limit, len(pending_pos))
    out["pending_omitted"] = len(pending_pos) - shown
    ring = udma.sq_ring(i)
    for pos in pending_pos[:shown].tolist():
        out["pending"].append(_wqe_record(ring, sidecar, mask, pos, vamap, pe))
    m = out["counts"]["cqes_unconsumed"]
    shown = m if limit < 0 else min(limit, m)
    out["cqes_omitted"] = m - shown
    cring = udma.cq_ring(i)
    for k in range(shown):
        cpos = (cq_tail + k) & M32
        raw = bytes(cring[cpos % udma.cq_depth])
        c = decode_cqe(raw)
        out["cqes"].append({"cq_pos": cpos, "raw": raw.hex(), "status": c.status_name,
                            "fields": dataclasses.asdict(c) | {"rmt_eid": f"{c.rmt_eid:#034x}"},
                            "text": format_cqe(c)})
    if int(hw["err_status"]) or int(hw["state"]):
        pos = int(hw["err_pos"])
        err = {"status": _status_name(int(hw["err_status"])), "substatus": int(hw["err_substatus"]), "pos": pos,
               "active": bool(int(hw["state"]))}
        err["wqe"] = _wqe_record(ring, sidecar, mask, pos, vamap, pe)
        out["error"] = err
    return out


def _status_name(status: int) -> str:
    try:
        return CqeStatus(status).name
    except ValueError:
        return f"status {status:#x}"


def _wqe_record(ring, sidecar, mask: int, pos: int, vamap: VaNames, pe: int) -> dict:
    raw = read_wqe(ring, mask, pos)
    w = decode_wqe(raw)
    call, block = decode_sidecar(int(sidecar[pos & mask]))
    fields = dataclasses.asdict(w)
    fields["rmt_eid"] = f"{w.rmt_eid:#034x}"
    flag = split_flag(w.flag)
    flag["odr"] = odr_name(flag["odr"])
    return {"pos": pos, "bbs": w.bbs, "call": call, "block": block, "opcode": w.opcode_name, "flag": flag,
            "remote": vamap.describe(w.rmt_va, pe), "local": vamap.describe(w.sge_va, pe), "raw": raw.hex(),
            "fields": fields, "text": _wqe_text(raw, vamap, pe)}


def _wqe_text(raw: bytes, vamap: VaNames, pe: int) -> str:
    return format_wqe(decode_wqe(raw), lambda va: vamap.describe(va, pe))


def _stats(reader: JobReader) -> dict | None:
    try:
        return JobStats.read(reader.job_id, reader.n_pes).to_json()
    except (OSError, ValueError):
        return None


# --- the short diagnosis -------------------------------------------------------------------------------------


def diagnosis(doc: dict, max_queues: int = 16, group: int = 8) -> list[str]:
    """The short report: waits other than barriers first (the likely culprits), then queues holding WQEs the
    engine has not executed or in error, then barrier waits, then the state of every PE that waits on nothing.

    E.g. ``pe 3 waits in signal_wait_until on 'flags'+0x40 == 1, current value 0 (for 5.0 s)``, ``pe 5 has 12
    WQEs posted, 0 completed on qp 1 to pe 3``. When more than ``group`` PEs wait in the same barrier they share
    one line (``pes 0-2, 4-31 (31 PEs) wait in barrier_all (barrier #4) ...``).
    """
    culprits, barriers, queue_lines = [], {}, []
    waiting = set()
    for p in doc["pes"]:
        for w in p["waits"]:
            waiting.add(p["pe"])
            if w["call"] in BARRIER_WAIT_NAMES:
                barriers.setdefault((w["call"], w["target"]), []).append(w)
            else:
                culprits.append(w["text"])
    for p in doc["pes"]:
        for q in p["queues"] or []:
            queue_lines += _queue_lines(p["pe"], q)
    if len(queue_lines) > max_queues:
        queue_lines = queue_lines[:max_queues] + [f"... and {len(queue_lines) - max_queues} more queue lines "
                                                  f"(see the dump)"]
    lines = culprits + queue_lines
    for (call, number), ws in barriers.items():
        if len(ws) <= group:
            lines += [w["text"] for w in ws]
            continue
        pes = sorted({w["pe"] for w in ws})
        rest = ws[0]["text"].split("; ", 1)[1] if "; " in ws[0]["text"] else ""
        lines.append(f"pes {_ranges(pes)} ({len(pes)} PEs) wait in {call} (barrier #{number}) for up to "
                     f"{max(w['seconds'] for w in ws):.1f} s" + (f"; {rest}" if rest else ""))
    for p in doc["pes"]:
        if p["pe"] not in waiting:
            lines.append(f"pe {p['pe']} {p['state']}" + (f": {p['error']}" if p["error"] else ""))
    return lines


def _queue_lines(pe: int, q: dict) -> list[str]:
    c, where, out = q["counts"], f"on qp {q['qp']} to pe {q['peer']}", []
    if q["error"] is not None:
        e = q["error"]
        out.append(f"pe {pe} {where}: {e['status']} at WQE BB {e['pos']} ({e['wqe']['call']}, block "
                   f"{e['wqe']['block']})" + ("" if e["active"] else ", reported"))
    if c["unexecuted_wqes"]:
        out.append(f"pe {pe} has {c['posted_wqes']} WQEs posted, {c['executed_wqes']} completed {where}")
    elif c["cqes_unconsumed"] and c["cqes_outstanding"]:
        out.append(f"pe {pe} {where}: {c['cqes_unconsumed']} CQEs completed, not yet consumed by a quiet")
    return out


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 4, 5, 9]`` -> ``0-2, 4-5, 9``."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v != start else f"{v}")
            start = None
    return ", ".join(out)


# --- text ---------------------------------------------------------------------------------------------------------


def render(doc: dict, *, pes: Iterable[int] | None = None, peers: Iterable[int] | None = None,
           qps: Iterable[int] | None = None) -> str:
    """The document as text: job, diagnosis, then per PE its waits, allocations and queues (WQEs field by field).

    ``pes``/``peers``/``qps`` narrow a document further (e.g. one read from a file).
    """
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"not a shmemx dump (schema {doc.get('schema')!r}, expected {SCHEMA!r})")
    job = doc["job"]
    allocations = Allocations({int(pe): allocs for pe, allocs in doc["va_names"].items()})
    vamap = VaNames(job["n_pes"], allocations.describe_offset, doc["udma_layout"])
    started = datetime.datetime.fromtimestamp(job["start_time"]).strftime("%Y-%m-%d %H:%M:%S")
    taken = datetime.datetime.fromtimestamp(doc["taken_at"]).strftime("%H:%M:%S")
    launcher = "alive" if job["launcher_alive"] else "gone"  # when the dump was taken
    out = [f"job {job['id']}: {job['n_pes']} PEs, {job['script'] or '(no script)'}; launcher pid "
           f"{job['launcher_pid']} ({launcher} at the dump), state {job['state']}, started {started}, dump taken "
           f"{taken} ({doc['taken_at'] - job['start_time']:.1f} s in)"]
    if doc.get("reason"):
        out.append(f"reason: {doc['reason']}")
    out.append("diagnosis:")
    out += [f"  {line}" for line in doc["diagnosis"]]
    for p in doc["pes"]:
        if pes is not None and p["pe"] not in pes:
            continue
        out.append("")
        out += _render_pe(p, vamap, peers, qps)
    return "\n".join(out) + "\n"


def _render_pe(p: dict, vamap: VaNames, peers, qps) -> list[str]:
    out = [f"pe {p['pe']}: pid {p['pid']}, {p['status']}, eid {p['eid']}, heap tokenId {p['heap_tid']:#x} token "
           f"{p['heap_token']:#010x}, qp_num {p['qp_num']}, sq/cq depth {p['sq_depth']}/{p['cq_depth']}, "
           f"{p['barriers']} barriers entered" + (f"; error: {p['error']}" if p["error"] else "")]
    if p["waits"]:
        out.append("  waits:")
        out += [f"    {w['text']}" for w in p["waits"]]
    else:
        out.append(f"  waits: none ({p['state']})")
    out.append(f"  allocations ({len(p['allocations'])} live, {p['heap_used']:#x} of {p['heap_size']:#x} B used):")
    for a in p["allocations"]:
        out.append(f"    {a['name']!r:24} +{a['offset']:#010x}  {a['size']:>10} B")
    if p["queues"] is None:
        out.append("  queues: no UDMA segment (not initialised, or already removed)")
        return out
    queues = [q for q in p["queues"] if (peers is None or q["peer"] in peers) and (qps is None or q["qp"] in qps)]
    if not queues:
        out.append("  queues: all idle")
    for q in queues:
        out += _render_queue(p["pe"], q, vamap)
    return out


def _render_queue(pe: int, q: dict, vamap: VaNames) -> list[str]:
    c, wq, cq, hw = q["counts"], q["wq_ctx"], q["cq_ctx"], q["engine"]
    state = "error" if q["error"] and q["error"]["active"] else ("stalled" if c["unexecuted_wqes"] else "busy")
    out = [f"  queue pe {pe} -> pe {q['peer']} qp {q['qp']} [{state}]: {c['posted_wqes']} WQEs posted since the "
           f"last retired CQE, {c['executed_wqes']} executed, {c['unexecuted_wqes']} not executed; "
           f"{c['cqes_outstanding']} CQEs outstanding, {c['cqes_unconsumed']} written and not consumed"]
    out.append("    wq_ctx: " + " ".join(f"{k}={_num(k, v)}" for k, v in wq.items()))
    out.append("    cq_ctx: " + " ".join(f"{k}={_num(k, v)}" for k, v in cq.items()))
    out.append("    engine: " + " ".join(f"{k}={_num(k, v)}" for k, v in hw.items()))
    if q["error"] is not None:
        e = q["error"]
        out.append(f"    error: {e['status']} substatus {e['substatus']} at BB {e['pos']}"
                   f"{'' if e['active'] else ' (already reported to the poller)'}; {e['wqe']['call']}, block "
                   f"{e['wqe']['block']}: {_wqe_text(bytes.fromhex(e['wqe']['raw']), vamap, pe)}")
    if q["pending"]:
        out.append("    not executed:")
        for w in q["pending"]:
            out.append(f"      BB {w['pos']} {w['call']}, block {w['block']}: "
                       f"{_wqe_text(bytes.fromhex(w['raw']), vamap, pe)}")
        if q["pending_omitted"]:
            out.append(f"      ... {q['pending_omitted']} more (--limit)")
    if q["cqes"]:
        out.append("    CQEs not consumed:")
        for x in q["cqes"]:
            out.append(f"      CQ {x['cq_pos']}: {format_cqe(decode_cqe(bytes.fromhex(x['raw'])))}")
        if q["cqes_omitted"]:
            out.append(f"      ... {q['cqes_omitted']} more (--limit)")
    return out


def _num(name: str, value: int) -> str:
    return f"{value:#x}" if name.endswith("addr") else str(value)


# --- files ------------------------------------------------------------------------------------------------------


def save(doc: dict, path: str) -> str:
    """Write ``doc`` as JSON (atomically: a reader never sees half a file); returns the path."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load(path: str) -> dict:
    """Read a saved dump; ValueError if the file is not one."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a shmemx dump (invalid JSON: {exc})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a shmemx dump (schema {doc.get('schema') if isinstance(doc, dict) else None!r}"
                         f", expected {SCHEMA!r})")
    return doc


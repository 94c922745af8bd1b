"""Findings of ``--check`` in words: one ``shmemx check:`` line each, and JSON lines beside the dump.

A finding names its kind, the two sides (PE, AIV block, file:line, what each did), the memory as dumps write it
(``'inbox'+0x40``) and its PE, the target PE and QP, the WQE (BB position, opcode, flag with its ordering), why the
two are unordered and what to add. Findings with the same kind, site pair and allocation are one line with a
count (the PEs that hit it are listed).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..describe import format_flag
from ..layout import M32, opcode_name

__all__ = ["Side", "Finding", "Findings", "describe_wqe", "kind_text", "KINDS", "EXIT_FINDINGS"]

EXIT_FINDINGS = 3  # the job's exit status when it otherwise succeeded and --check found something

KINDS = {
    "flag-before-payload": "a flag became visible before a payload its reader then read",
    "signal-other-qp": "the payload's signal went on another QP",
    "unfenced-signal": "the signal on the payload's QP was not ordered after it (no fence)",
    "quiet-wrong-qp": "the quiet before the signal covered another QP",
    "barrier-not-completion": "a barrier taken as UDMA completion",
    "get-before-quiet": "a get's destination used before its quiet",
    "source-overwrite": "a WQE's source changed before the WQE was known complete",
    "stale-flag": "a wait met by a value it already consumed",
    "slot-reuse": "a slot written again before its reader gave it back",
    "unordered-writes": "two unordered writes of one range",
    "unsynchronized-read": "a read of memory a WQE or a peer writes, with no synchronisation at all",
    "block-race": "two AIV blocks of a PE access one range with no sync_all between",
    "two-submitters": "two AIV blocks post to one send queue with nothing ordering them",
    "unfinished-work": "a kernel returned (or the job finalized) with WQEs no quiet retired",
    "atomic-race": "an atomic and a plain access of the same bytes, unordered",
    "mixed-width-atomics": "two atomics of different widths over common bytes, unordered",
    "raw-poll": "a flag polled with plain loads (a warning)",
}


def kind_text(kind: str) -> str:
    return KINDS.get(kind, kind)


def describe_wqe(w) -> str:
    """``WRITE to pe 1 qp 0 at BB 12 (flag 0x20(odr=NO,cqe))``."""
    return f"{opcode_name(w.opcode)} to pe {w.target} qp {w.qp} at BB {w.pos & M32} (flag {format_flag(w.flag)})"


def site_text(site) -> str:
    if site is None:
        return "<unknown line>"
    file, _function, line = site
    rel = os.path.relpath(file) if os.path.isabs(file) else file
    return f"{file if rel.startswith('..') else rel}:{line}"


@dataclass
class Side:
    pe: int
    block: int
    site: tuple | None  # (file, function, line)
    what: object  # the text, or a function making it (sides are built for every event, texts only for findings)

    def with_what(self, what: str) -> "Side":
        return Side(self.pe, self.block, self.site, what)

    def describe(self) -> str:
        if callable(self.what):
            self.what = self.what()
        return self.what

    def text(self) -> str:
        return f"pe {self.pe} block {self.block} at {site_text(self.site)} {self.describe()}"

    def doc(self) -> dict:
        file, function, line = self.site if self.site else (None, None, None)
        return {"pe": self.pe, "block": self.block, "file": file, "line": line, "function": function,
                "what": self.describe()}


@dataclass
class Finding:
    kind: str
    a: Side  # the access (or post, or wait) that found it
    b: Side | None  # the other side
    target_pe: int | None
    qp: int | None
    mem: tuple  # (pe, heap offset or None, bytes)
    wqe: object | None  # the conflicting WQE (analyze.Wqe)
    engine: object | None = None  # a WQE whose execution is the reading side, when it is not a thread
    why: str = ""
    fix: str = ""
    severity: str = "error"
    memory: str = ""
    count: int = 1
    pes: set = field(default_factory=set)

    def key(self) -> tuple:
        b = self.b.site if self.b else None
        return (self.kind, self.a.site, b, self.memory.split("'+")[0] if "'+" in self.memory else self.memory)

    def text(self) -> str:
        head = "warning: " if self.severity == "warning" else ""
        parts = [f"{head}{self.kind}: {self.a.text()} {self.memory} of pe {self.mem[0]}"]
        if self.b is not None:
            parts.append(self.b.text())
        where = []
        if self.target_pe is not None:
            where.append(f"target pe {self.target_pe}")
        if self.qp is not None:
            where.append(f"qp {self.qp}")
        if where:
            parts.append(", ".join(where))
        parts.append(f"why: {self.why}")
        parts.append(f"fix: {self.fix}")
        line = " | ".join(parts)
        if self.count > 1:
            pes = sorted(self.pes)
            shown = ", ".join(map(str, pes[:8])) + (", ..." if len(pes) > 8 else "")
            line += f" (x{self.count}, pe{'s' if len(pes) > 1 else ''} {shown})"
        return line

    def doc(self) -> dict:
        w = self.wqe
        wqe = None if w is None else {"pos": w.pos & M32, "opcode": opcode_name(w.opcode), "flag": w.flag,
                                      "odr": w.flag & 7, "fence": bool(w.flag >> 3 & 1), "pe": w.pe,
                                      "peer": w.target, "qp": w.qp, "text": describe_wqe(w)}
        return {"kind": self.kind, "severity": self.severity, "count": self.count, "pes": sorted(self.pes),
                "a": self.a.doc(), "b": self.b.doc() if self.b else None, "target_pe": self.target_pe,
                "qp": self.qp, "memory_pe": self.mem[0], "offset": self.mem[1], "memory": self.memory,
                "allocation": self.memory.split("'")[1] if self.memory.startswith("'") else None, "wqe": wqe,
                "why": self.why, "fix": self.fix, "text": self.text()}


class Findings:
    """The job's findings, deduplicated by (kind, site pair, allocation)."""

    def __init__(self):
        self.by_key: dict[tuple, Finding] = {}

    def add(self, f: Finding) -> None:
        key = f.key()
        old = self.by_key.get(key)
        if old is None:
            f.pes = {f.a.pe}
            self.by_key[key] = f
        else:
            old.count += f.count
            old.pes.add(f.a.pe)

    def site_text(self, site) -> str:
        return site_text(site)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.by_key.values() if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.by_key.values() if f.severity != "error"]

    def all(self) -> list[Finding]:
        return self.errors + self.warnings

    def lines(self) -> list[str]:
        return [f"shmemx check: {f.text()}" for f in self.all()]

    def write_jsonl(self, path: str) -> None:
        with open(path, "w") as out:
            for f in self.all():
                out.write(json.dumps(f.doc()) + "\n")

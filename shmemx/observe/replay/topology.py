"""The modelled machine of a replay: two tiers of ports (inside a server, between servers), an engine, a host.

A topology file is TOML (read with the standard library's ``tomllib``)::

    ranks_per_server = 16
    [intra]  bandwidth_GBps = 150.0   latency_us = 0.5     # per rank port, each direction
    [inter]  bandwidth_GBps = 22.5    latency_us = 2.0
    [engine] wqe_us = 0.05                                  # per WQE at the engine
             intra_wqe_us = 0.05                            # per WQE to a rank of the same server (optional,
                                                            #   default wqe_us)
    [host]   post_us = 0.02   doorbell_us = 0.1             # per WQE built, per doorbell
             kernel_us = 0.0                                # per kernel call (optional, default 0)
    [network] sharing = "fcfs"                              # or "maxmin" (max-min fair flows, for validation;
                                                            #   optional, default "fcfs")

Every key is required except the optional ones, which take their default when a file leaves them out
(``engine.intra_wqe_us``, ``host.kernel_us``, ``network.sharing``, and ``name``: the file's name). Built-in files
(``topologies/``): ``ascend950`` (the default) and ``h800_cx7``, each value with its source in a
comment. ``--set intra.bandwidth_GBps=100`` (``overrides``) changes one value, for sweeps. Ranks ``a`` and ``b``
share a server when ``a // ranks_per_server == b // ranks_per_server``.

``host.kernel_us`` is the fixed time of one kernel call beyond what it posts and waits for (launch, grid syncs,
the per-call work it does not post): the replay charges it at every ``shmemx.compute(..., name="kernel")``
annotation, on top of the annotation's own time (a kernel marks its calls that way; nothing else does).

``engine.intra_wqe_us`` is the engine's time for a WQE to a rank of the same server, when that differs from
``wqe_us``: on ``h800_cx7`` it is 0, since a GPU reaches the GPUs of its node through NVLink with its own stores
(DeepEP's low-latency kernels copy to NVLink peers through P2P pointers instead of posting to the NIC), so such a
WQE costs its poster ``post_us`` and its bytes at the NVLink ports, but no NIC time. Without the key it is
``wqe_us`` (one engine for both tiers, as the Ascend default has it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass

__all__ = ["Topology", "Tier", "load_topology", "builtin_topologies", "INTRA", "INTER"]

INTRA, INTER = 0, 1
_DIR = os.path.join(os.path.dirname(__file__), "topologies")
_SHARING = ("fcfs", "maxmin")
# every key a file may set, and its type
_KEYS = {"name": str, "ranks_per_server": int, "intra.bandwidth_GBps": float, "intra.latency_us": float,
         "inter.bandwidth_GBps": float, "inter.latency_us": float, "engine.wqe_us": float,
         "engine.intra_wqe_us": float, "host.post_us": float,
         "host.doorbell_us": float, "host.kernel_us": float, "network.sharing": str}
# keys a file may leave out, and their value then (the README's topology table documents them)
_OPTIONAL = {"host.kernel_us": 0.0, "network.sharing": "fcfs"}
_SAME_AS = {"engine.intra_wqe_us": "engine.wqe_us"}  # optional keys that default to another key's value


@dataclass(frozen=True)
class Tier:
    """One tier's ports: ``bandwidth_GBps`` per rank port and direction (1e9 bytes/s), ``latency_us``."""

    bandwidth_GBps: float
    latency_us: float

    @property
    def bytes_per_us(self) -> float:
        return self.bandwidth_GBps * 1e3


@dataclass(frozen=True)
class Topology:
    """A modelled machine (see the module docstring)."""

    name: str
    ranks_per_server: int
    intra: Tier
    inter: Tier
    wqe_us: float
    post_us: float
    doorbell_us: float
    sharing: str = "fcfs"
    kernel_us: float = 0.0
    intra_wqe_us: float | None = None  # None: wqe_us

    @property
    def engine_us(self) -> tuple[float, float]:
        """The engine's time per WQE to a rank of the same server (INTRA) and of another (INTER)."""
        return (self.wqe_us if self.intra_wqe_us is None else self.intra_wqe_us), self.wqe_us

    def tier(self, a: int, b: int) -> int:
        """INTRA when ranks ``a`` and ``b`` share a server, else INTER."""
        return INTRA if a // self.ranks_per_server == b // self.ranks_per_server else INTER

    @property
    def tiers(self) -> tuple[Tier, Tier]:
        return self.intra, self.inter

    def as_dict(self) -> dict:
        engine = {"wqe_us": self.wqe_us}
        if self.intra_wqe_us is not None and self.intra_wqe_us != self.wqe_us:
            engine["intra_wqe_us"] = self.intra_wqe_us
        return {"name": self.name, "ranks_per_server": self.ranks_per_server,
                "intra": dataclasses.asdict(self.intra), "inter": dataclasses.asdict(self.inter),
                "engine": engine, "host": {"post_us": self.post_us, "doorbell_us": self.doorbell_us,
                                                               "kernel_us": self.kernel_us},
                "network": {"sharing": self.sharing}}


def builtin_topologies() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(_DIR) if f.endswith(".toml"))


def load_topology(source: "str | os.PathLike | Topology | None" = None, overrides: dict | None = None) -> Topology:
    """A topology from a built-in name (default ``ascend950``), a TOML file, or a ``Topology``, with
    ``overrides`` (``{"intra.bandwidth_GBps": 100, ...}``; values may be strings, as ``--set`` gives them).

    Raises:
        ValueError: an unknown file or key, a value of the wrong type, or an out-of-range value.
    """
    if isinstance(source, Topology):
        flat = _flatten(source.as_dict())
        where = source.name
    else:
        path = _path_of(source)
        with open(path, "rb") as f:
            try:
                doc = tomllib.load(f)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"topology {path}: {exc}") from None
        flat = _flatten(doc)
        where = path
        flat.setdefault("name", os.path.basename(path)[:-5] if path.endswith(".toml") else os.path.basename(path))
    for key, value in (overrides or {}).items():
        flat[key] = _parse_value(value) if isinstance(value, str) else value
    return _build(flat, where)


def _path_of(source) -> str:
    if source is None:
        source = "ascend950"
    source = os.fspath(source)
    if os.path.exists(source):
        return source
    builtin = os.path.join(_DIR, f"{source}.toml")
    if os.path.exists(builtin):
        return builtin
    raise ValueError(f"topology {source!r}: no such file, and not a built-in topology "
                     f"({', '.join(builtin_topologies())})")


def _flatten(doc: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in doc.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _parse_value(text: str):
    """``--set`` values: TOML scalars (``100``, ``2.5``, ``"maxmin"``), or a bare word as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _build(flat: dict, where: str) -> Topology:
    unknown = sorted(set(flat) - set(_KEYS))
    if unknown:
        raise ValueError(f"topology {where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}")
    flat = dict(_OPTIONAL, **flat)
    for key, other in _SAME_AS.items():
        if key not in flat and other in flat:
            flat[key] = flat[other]
    same = {key for key, other in _SAME_AS.items() if flat.get(key) == flat.get(other)}
    missing = sorted(set(_KEYS) - set(flat))
    if missing:
        raise ValueError(f"topology {where}: missing key(s) {', '.join(missing)}")
    vals = {}
    for key, kind in _KEYS.items():
        v = flat[key]
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise ValueError(f"topology {where}: {key} = {v!r} is not a{'n' if kind is int else ''} "
                             f"{kind.__name__}")
        if kind is float and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"topology {where}: {key} = {v!r} must be a finite number >= 0")
        vals[key] = v
    if vals["ranks_per_server"] < 1:
        raise ValueError(f"topology {where}: ranks_per_server = {vals['ranks_per_server']} must be >= 1")
    for tier in ("intra", "inter"):
        if vals[f"{tier}.bandwidth_GBps"] <= 0:
            raise ValueError(f"topology {where}: {tier}.bandwidth_GBps must be > 0")
    if vals["network.sharing"] not in _SHARING:
        raise ValueError(f"topology {where}: network.sharing = {vals['network.sharing']!r}: one of {_SHARING}")
    return Topology(name=vals["name"], ranks_per_server=vals["ranks_per_server"],
                    intra=Tier(vals["intra.bandwidth_GBps"], vals["intra.latency_us"]),
                    inter=Tier(vals["inter.bandwidth_GBps"], vals["inter.latency_us"]),
                    wqe_us=vals["engine.wqe_us"], post_us=vals["host.post_us"],
                    doorbell_us=vals["host.doorbell_us"], sharing=vals["network.sharing"],
                    kernel_us=vals["host.kernel_us"],
                    intra_wqe_us=None if "engine.intra_wqe_us" in same else vals["engine.intra_wqe_us"])

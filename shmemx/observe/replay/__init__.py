"""Virtual time: replay a recording (``shmemx run --record``) on a modelled two-tier topology.

The functional run records what every thread posted and waited for (``observe.record``); the replay runs one
deterministic discrete-event simulation of exactly that in virtual time (``sim``) on a ``Topology``, so the
figures depend on the kernel and the model only, never on how loaded the host was. ``shmemx replay FILE
--topology TOPO.toml [--json]`` prints ``report.render`` / the ``report.summary`` document.

    doc = replay("run.rec", "ascend950", overrides={"inter.bandwidth_GBps": 50})   # the JSON document
    cols = modelled_columns("run.rec", regions=("dispatch", "combine"))          # for experiment tables
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..record import Recording
from .program import load_program
from .report import render, summary, write_perfetto
from .sim import Sim, SimError
from .topology import Topology, builtin_topologies, load_topology

__all__ = ["replay", "simulate", "modelled_columns", "load_topology", "Topology", "builtin_topologies", "render",
           "SimError"]


def simulate(recording: "str | os.PathLike | Recording", topology: str | os.PathLike | Topology | None = None,
             overrides: dict | None = None) -> tuple:
    """Run the simulation; returns ``(sim, recording)`` (the ``Sim`` holds every record, for tools)."""
    rec = recording if isinstance(recording, Recording) else Recording.load(os.fspath(recording))
    topo = load_topology(topology, overrides)
    sim = Sim(load_program(rec), topo)
    sim.run()
    return sim, rec


def replay(recording: str | os.PathLike | Recording, topology: str | os.PathLike | Topology | None = None,
           overrides: dict | None = None, *, perfetto: str | None = None) -> dict:
    """The replay's document (``report.summary``); with ``perfetto``, also a trace in virtual time there.

    Args:
        recording: a path written by ``shmemx run --record`` (or a loaded ``Recording``).
        topology: a built-in name (``ascend950``, ``h800_cx7``), a TOML path, or a ``Topology``; default ascend950.
        overrides: ``{"intra.bandwidth_GBps": 100, ...}`` (the ``--set`` pairs).
    """
    sim, rec = simulate(recording, topology, overrides)
    if perfetto:
        write_perfetto(sim, perfetto)
    return summary(sim, dict(rec.job))


def modelled_columns(recording: str | os.PathLike | Recording, topology: str | os.PathLike | Topology | None = None,
                     overrides: dict | None = None, regions: Iterable[str] = ()) -> dict:
    """The modelled columns of an experiment table row, from one recording.

    Returns ``{"model_makespan_us", "model_mean_end_us", "model_<region>_us" (for each region asked for: the max
    over PEs of a PE's time in it, all its calls together; 0.0 when absent), "model_<region>_calls" (the most
    calls of it a PE made), "model_bound" (the critical path's largest category: "host", "engine",
    "bytes inter", ...), "model_warnings" (count; 0 = no recorded control flow depended on host timing)}``.
    """
    doc = replay(recording, topology, overrides)
    cols = {"model_makespan_us": doc["makespan_us"], "model_mean_end_us": doc["mean_end_us"]}
    for name in regions:
        cols[f"model_{name}_us"] = doc["regions"].get(name, {}).get("max_us", 0.0)
        cols[f"model_{name}_calls"] = doc["regions"].get(name, {}).get("calls", 0)
    cols["model_bound"] = doc["critical_path"]["bound"]
    cols["model_warnings"] = sum(w["count"] for w in doc["warnings"])
    return cols

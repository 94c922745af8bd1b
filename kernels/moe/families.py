"""The kernel families of a ``Buffer``: what each schedule checks, plans and launches.

A ``Buffer`` has one object per family (``FAMILIES``), made with it; the family named by the current
``Schedule`` answers, for a call: whether the schedule fits the buffer (``check``), the shape of its dispatch and
of its combine (``Shape``: rounds, blocks, QPs, and the family's own plan), and how to launch each kernel. The
buffer does the rest (notify, outputs, credits, stats) the same way for every family.

* ``fullmesh``: the channel rounds of ``schedule.plan_rounds`` (``dispatch.py``, ``combine.py``);
* ``groups``: MoonEP's group waves (``groups.py``);
* ``hierarchy``: HiSilicon's layered relay (``hierarchy.py``), with a second workspace made at its first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import shmemx

from . import groups as _groups
from . import hierarchy as _hier
from .combine import CombineArgs, combine_kernel
from .dispatch import DispatchArgs, dispatch_kernel
from .records import DispatchHandle, Routing
from .schedule import Plan, Schedule, plan_rounds
from .topology import GroupMap

__all__ = ["Shape", "FAMILIES", "families"]


@dataclass
class Shape:
    """One call's shape: its rounds, blocks and QPs (for its ``CallStats``), and the family's own plan (the
    fullmesh ``Plan``, the groups' ``Waves``)."""

    rounds: int
    blocks: int
    n_qps: int
    plan: Plan | None = None
    waves: "_groups.Waves | None" = None


class _Family:
    """What every family shares: the buffer it serves, no extra QP, the topology's check of the schedule."""

    name = ""

    def __init__(self, buf):
        self.buf = buf

    def extra_qps(self, sched) -> int:
        """QPs the schedule needs beyond its QP policy's."""
        return 0

    def check(self, sched) -> None:
        """Raise ValueError when ``sched`` does not fit the buffer (before any PE changes anything)."""
        self.buf.topology.check(sched.name, self.buf.me)

    def prepare(self) -> None:
        """Collective: what the family needs before its first call (after every PE agreed on the schedule)."""

    def close(self) -> None:
        """Collective: what the family made for itself goes (the buffer is closing)."""

    def relay(self, relay_out: list):
        """What a dispatch's handle keeps of it for the combine (the hierarchy's relays), or None."""
        return None


class FullMesh(_Family):
    name = "fullmesh"

    def check(self, sched: Schedule) -> None:
        pass

    def _plan(self, rows: np.ndarray) -> Shape:
        buf = self.buf
        plan = plan_rounds(buf.me, buf.n_pes, rows, buf.schedule, buf.shared_lanes == "batch",
                           servers=buf.tier_servers)
        return Shape(plan.rounds, buf.num_channels, plan.lane_rows.shape[1], plan=plan)

    def dispatch_shape(self, routing: Routing) -> Shape:
        return self._plan(routing.per_channel.T)

    def combine_shape(self, handle: DispatchHandle, rows: np.ndarray) -> Shape:
        return self._plan(rows.T)

    def _blocks(self, shape: Shape) -> int:
        # one block when it does every block's work (``Lanes.one_block``): parked blocks woken only to return
        # would each give this PE's core away for a wake-up
        return 1 if self.buf.lanes.one_block(shape.plan) else shape.blocks

    def dispatch(self, args: DispatchArgs, shape: Shape, prefix: np.ndarray, relay_out: list) -> int:
        blocks = self._blocks(shape)
        shmemx.launch(dispatch_kernel, blocks, args)
        return blocks

    def combine(self, args: CombineArgs, shape: Shape, prefix: np.ndarray, handle: DispatchHandle) -> int:
        blocks = self._blocks(shape)
        shmemx.launch(combine_kernel, blocks, args)
        return blocks


class Groups(_Family):
    name = "groups"

    def extra_qps(self, sched: Schedule) -> int:
        return 1 if sched.weight_blocks else 0  # the weight blocks' own QP

    def check(self, sched: Schedule) -> None:
        gm = GroupMap(self.buf.n_pes, sched.group_width or None)
        if (sched.token_blocks or gm.width) + sched.weight_blocks > 128:
            raise ValueError(f"pe {self.buf.me}: groups: {sched.token_blocks or gm.width} token blocks + "
                             f"{sched.weight_blocks} weight blocks exceed 128 AIV blocks")
        super().check(sched)

    def _waves(self) -> "_groups.Waves":
        sched = self.buf.schedule
        gm = GroupMap(self.buf.n_pes, sched.group_width or None)
        return _groups.Waves(gm, sched.token_blocks or gm.width, sched.weight_blocks, sched.qp_policy,
                             sched.num_qps)

    def dispatch_shape(self, routing: Routing) -> Shape:
        waves = self._waves()
        return Shape(waves.gmap.rounds, waves.token_blocks + waves.weight_blocks, waves.used_qps, waves=waves)

    def combine_shape(self, handle: DispatchHandle, rows: np.ndarray) -> Shape:
        waves = self._waves()
        return Shape(waves.gmap.rounds, waves.token_blocks, waves.token_qps, waves=waves)

    def dispatch(self, args: DispatchArgs, shape: Shape, prefix: np.ndarray, relay_out: list) -> int:
        shmemx.launch(_groups.groups_dispatch_kernel, shape.blocks, args, shape.waves)
        return shape.blocks

    def combine(self, args: CombineArgs, shape: Shape, prefix: np.ndarray, handle: DispatchHandle) -> int:
        shmemx.launch(_groups.groups_combine_kernel, shape.blocks, args, shape.waves)
        return shape.blocks


class Hierarchy(_Family):
    name = "hierarchy"

    def __init__(self, buf: Any):
        super().__init__(buf)
        self.regions = None  # (views, offsets, remote bases, local base) of its workspace, once made
        self.team = None  # the team of this PE's server (its barrier is the schedule's server barrier)

    def check(self, sched: Schedule) -> None:
        if self.buf.topology.server_size > 64:
            raise ValueError(f"pe {self.buf.me}: hierarchy: server_size {self.buf.topology.server_size} is over "
                             f"64 (the record's rank mask is 64 bits)")
        super().check(sched)

    def prepare(self) -> None:
        """The hierarchy's regions and server team (collective; once): relay records, end flags, combine
        partials."""
        if self.regions is not None:
            return
        buf = self.buf
        layout = _hier.plan_hier_workspace(topo=buf.topology, max_tokens=buf.max_tokens, hidden=buf.hidden,
                                          num_topk=buf.num_topk)
        try:
            block = shmemx.aclshmem_malloc(layout.total, name="moe_hierarchy", prefault=False)
        except shmemx.HeapExhaustedError as exc:
            raise shmemx.HeapExhaustedError(
                f"pe {buf.me}: moe.Buffer: the hierarchy schedule needs {layout.total} B "
                f"({layout.total / 2**20:.1f} MiB) more on every PE: start the job with a larger --heap-size "
                f"({exc})") from None
        views = layout.views(block)
        for name in ("relay_end", "relay_in"):
            views[name][...] = 0
        remote, local = np.zeros(buf.n_pes, np.uint64), 0
        for (peer, q), queue in buf.lanes.queues.items():
            if q == 0:
                remote[peer] = queue.remote_va(block)
                local = queue.local_va(block)
        self.regions = (views, {n: r.offset for n, r in layout.regions.items()}, remote, local)
        self.team = self._server_team()
        self.buf.peers.barrier()  # every PE's regions are zero before anyone writes into them

    def _server_team(self) -> int:
        """The team of this PE's server (collective: one split of the buffer's team per server, as split_2d's rows)."""
        size, mine = self.buf.topology.server_size, shmemx.ACLSHMEM_TEAM_INVALID
        for start in range(0, self.buf.n_pes, size):
            team = shmemx.aclshmem_team_split_strided(self.buf.peers.team, start, 1, size)
            mine = team if team != shmemx.ACLSHMEM_TEAM_INVALID else mine
        return mine

    def close(self) -> None:
        if self.team is not None:
            shmemx.aclshmem_team_destroy(self.team)
            self.team = None

    def _spec(self, prefix: np.ndarray, relay=None) -> "_hier.HierSpec":
        return _hier.HierSpec(self.buf.topology, *self.regions, prefix, relay, self.team)

    def dispatch_shape(self, routing: Routing) -> Shape:
        return Shape(2, self.buf.topology.num_servers, 1)

    def combine_shape(self, handle: DispatchHandle, rows: np.ndarray) -> Shape:
        if handle.relay is None:
            raise ValueError(f"pe {self.buf.me}: hierarchy combine needs the handle of a hierarchy dispatch (this "
                             f"one was made by another schedule)")
        return Shape(2, self.buf.topology.num_servers, 1)

    def dispatch(self, args: DispatchArgs, shape: Shape, prefix: np.ndarray, relay_out: list) -> int:
        shmemx.launch(_hier.hier_dispatch_kernel, shape.blocks, args, self._spec(prefix), relay_out)
        return shape.blocks

    def combine(self, args: CombineArgs, shape: Shape, prefix: np.ndarray, handle: DispatchHandle) -> int:
        self._own_tokens(args, handle)
        shmemx.launch(_hier.hier_combine_kernel, shape.blocks, args, self._spec(prefix, handle.relay))
        return shape.blocks

    def _own_tokens(self, args, handle) -> None:
        """What the hierarchy combine reads about this PE's own tokens: the servers each went to, its row among
        a server's records, and the rank mask of its own server's ranks."""
        topo = self.buf.topology
        s, n = topo.server_size, topo.num_servers
        mask = handle.is_token_in_rank
        args.server_mask = mask.reshape(mask.shape[0], n, s).any(2)
        args.server_pos = np.cumsum(args.server_mask, axis=0) - 1
        lo = (self.buf.me // s) * s
        args.own_masks = (mask[:, lo:lo + s].astype(np.uint64) << np.arange(s, dtype=np.uint64)).sum(
            1, dtype=np.uint64)

    def relay(self, relay_out: list) -> "_hier.RelayInfo":
        return _hier.RelayInfo([r[0] if r else None for r in relay_out], [r[1] if r else None for r in relay_out])


FAMILIES = (FullMesh, Groups, Hierarchy)


def families(buf: Any) -> dict:
    """One object per family for ``buf``: ``{name: family}``."""
    return {cls.name: cls(buf) for cls in FAMILIES}

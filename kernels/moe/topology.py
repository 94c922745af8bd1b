"""Where each rank sits: servers and lanes (HiSilicon's hierarchy), frames, rows, columns and groups (MoonEP).

Both seed-001 kernels read rank ids as physical coordinates:

* hierarchy (ops-transformer's layered kernel): ``server = rank // server_size``, ``lane = rank % server_size``
  (16 ranks per server); cross-server traffic goes only to the same lane of the destination server,
  ``relay = dst_server * server_size + lane``.
* MoonEP (128 ranks): two frames of 64, each 8 direct rows x 8 columns, cut into four 4 x 4 groups of 16:
  ``frame = r // 64``, ``row = (r % 64) // 8``, ``column = r % 8``, ``group = frame * 4 + (row // 4) * 2 +
  column // 4``, and the rank's position in its group ``(row % 4) * 4 + column % 4``. Round g of 8 sends every
  source group to one destination group (``group_dst``), a bijection on the 8 groups in every round, and over
  the 8 rounds every source meets every group once.

Other sizes and widths (``group_width`` w, a divisor of P): the cyclic-half form of the same kernel family. A
group is w/2 consecutive ranks of the lower half of the ranks and the matching w/2 of the upper half; round g
sends group i to group ``(i + g) mod (P / w)``, again a bijection per round covering every peer in P / w rounds.
With w = P there is one group and one round.

A rank table (JSON) gives each rank's real server and lane; the schedules keep computing from rank ids, as the
seed's kernels do, and ``Topology.check`` warns when the table says otherwise (the formulas then send traffic
where the table does not expect it). The metrics (``cross_server_bytes``) are counted against the table.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Place", "Topology", "GroupMap", "DEFAULT_SERVER_SIZE", "MOONEP_WIDTH"]

DEFAULT_SERVER_SIZE = 16
MOONEP_WIDTH = 16  # ranks per group of the 128-rank two-frame map
MOONEP_RANKS = 128


@dataclass(frozen=True)
class Place:
    """One rank's coordinates: its server and lane (from the table, if any), and the MoonEP frame, row, column,
    group and position in the group computed from its id."""

    rank: int
    server: int
    lane: int
    frame: int
    row: int
    column: int
    group: int
    position: int


class GroupMap:
    """MoonEP's group waves for P ranks and groups of ``width``: who sends to whom in each round.

    ``dst(r, g, lane)``: the rank at position ``lane`` of the group rank r sends to in round g;
    ``incoming(r, g, lane)``: the rank at position ``lane`` of the group that sends to r in round g.

    Raises:
        ValueError: a width that does not divide P, or an odd width below P (the half form needs w/2 ranks
            per half).
    """

    def __init__(self, n_pes: int, width: int | None = None):
        width = min(n_pes, MOONEP_WIDTH) if width is None else int(width)
        if width < 1 or n_pes % width:
            raise ValueError(f"group_width {width} must be a divisor of the {n_pes} PEs")
        if width != n_pes and (width % 2 or n_pes % 2):
            raise ValueError(f"group_width {width} below P={n_pes} must be even (half a group in each half of "
                             f"the ranks)")
        self.n_pes, self.width = n_pes, width
        self.rounds = n_pes // width
        self.two_frame = n_pes == MOONEP_RANKS and width == MOONEP_WIDTH
        pos = np.array([self._locate(r) for r in range(n_pes)], np.int64).reshape(n_pes, 2)
        self.group_of, self.position_of = pos[:, 0], pos[:, 1]
        self.members = np.zeros((self.rounds, width), np.int64)
        self.members[self.group_of, self.position_of] = np.arange(n_pes)
        self.dst_group = np.array([[self._dst_group(i, g) for g in range(self.rounds)] for i in range(self.rounds)],
                                  np.int64)  # [group, round]
        self.src_group = np.zeros_like(self.dst_group)
        for i in range(self.rounds):
            for g in range(self.rounds):
                self.src_group[self.dst_group[i, g], g] = i

    # the two-frame form: group = frame * 4 + group_row * 2 + side
    def _locate(self, r: int) -> tuple[int, int]:
        if self.width == self.n_pes:
            return 0, r
        if self.two_frame:
            frame, local = divmod(r, 64)
            row, col = divmod(local, 8)
            return frame * 4 + (row // 4) * 2 + col // 4, (row % 4) * 4 + col % 4
        half, off = divmod(r, self.n_pes // 2)
        hgw = self.width // 2
        return off // hgw, half * hgw + off % hgw

    def _dst_group(self, group: int, g: int) -> int:
        if not self.two_frame:
            return (group + g) % self.rounds
        frame, gr, side = group // 4, (group // 2) % 2, group % 2
        t, sub = divmod(g, 4)
        row_delta, side_delta = divmod(sub, 2)
        return (frame ^ side ^ t) * 4 + ((gr + row_delta) % 2) * 2 + (side ^ side_delta)

    def dst(self, r: int, g: int, lane: int) -> int:
        return int(self.members[self.dst_group[self.group_of[r], g], lane])

    def incoming(self, r: int, g: int, lane: int) -> int:
        return int(self.members[self.src_group[self.group_of[r], g], lane])

    def check(self) -> None:
        """Every round a bijection on the groups, every source meeting every peer once (raises AssertionError)."""
        for g in range(self.rounds):
            assert sorted(self.dst_group[:, g].tolist()) == list(range(self.rounds)), f"round {g} not bijective"
        for r in range(self.n_pes):
            seen = sorted(self.dst(r, g, lane) for g in range(self.rounds) for lane in range(self.width))
            assert seen == list(range(self.n_pes)), f"rank {r} does not meet every peer"


class Topology:
    """Servers, lanes and MoonEP coordinates of P ranks.

    Args:
        n_pes: P.
        server_size: ranks per server (default 16, or P when P < 16); must divide P.
        rank_table: a path to a JSON file, or its parsed content: ``{"server_size": S (optional), "ranks":
            [{"rank": r, "server": s, "lane": l}, ...]}`` (or the list alone). Every rank once, each
            (server, lane) once, S ranks per server.

    Attributes:
        server, lane: ``[P] int64`` from the table, or from rank ids without one.
    """

    def __init__(self, n_pes: int, server_size: int | None = None, *, rank_table: str | Path | dict | None = None):
        table = _load_table(rank_table) if rank_table is not None else None
        if server_size is None and table is not None:
            server_size = table.get("server_size")
        if server_size is None:
            server_size = min(DEFAULT_SERVER_SIZE, n_pes)
        server_size = int(server_size)
        if server_size < 1 or n_pes % server_size:
            raise ValueError(f"server_size {server_size} must divide the {n_pes} PEs")
        self.n_pes, self.server_size = n_pes, server_size
        self.num_servers = n_pes // server_size
        ids = np.arange(n_pes, dtype=np.int64)
        self.server, self.lane = ids // server_size, ids % server_size
        self.from_table = table is not None
        if table is not None:
            self.server, self.lane = _table_places(table["ranks"], n_pes, server_size)

    def place(self, rank: int, group_width: int | None = None) -> Place:
        groups = GroupMap(self.n_pes, group_width)
        local = rank % 64
        return Place(rank, int(self.server[rank]), int(self.lane[rank]), rank // 64, local // 8, rank % 8,
                     int(groups.group_of[rank]), int(groups.position_of[rank]))

    def relay(self, rank: int, dst_server: int) -> int:
        """The rank of ``dst_server`` at ``rank``'s lane, from rank ids (as the layered kernel computes it)."""
        return dst_server * self.server_size + rank % self.server_size

    def mismatches(self) -> list[int]:
        """Ranks whose table place differs from ``(rank // server_size, rank % server_size)``."""
        ids = np.arange(self.n_pes)
        bad = (self.server != ids // self.server_size) | (self.lane != ids % self.server_size)
        return np.flatnonzero(bad).tolist()

    def check(self, schedule: str, me: int = 0) -> bool:
        """Warn (``UserWarning``) when the schedule's rank-id arithmetic is not the table's map; True if they
        agree."""
        bad = self.mismatches()
        if not bad or schedule == "fullmesh":
            return True
        r = bad[0]
        warnings.warn(f"pe {me}: schedule {schedule!r} places rank r on server r // {self.server_size}, lane "
                      f"r % {self.server_size} (rank ids read as coordinates, as the seed's kernels do), but the rank "
                      f"table puts {len(bad)} ranks elsewhere, e.g. rank {r} on server {int(self.server[r])} lane "
                      f"{int(self.lane[r])}: its traffic crosses servers where the schedule assumes it does not "
                      f"(cross_server_bytes counts against the table)", UserWarning, stacklevel=3)
        return False

    def __repr__(self) -> str:
        return (f"Topology({self.n_pes} ranks, {self.num_servers} servers of {self.server_size}"
                f"{', from a rank table' if self.from_table else ''})")


def _load_table(rank_table) -> dict:
    if isinstance(rank_table, (str, Path)):
        rank_table = json.loads(Path(rank_table).read_text())
    if isinstance(rank_table, list):
        rank_table = {"ranks": rank_table}
    if not isinstance(rank_table, dict) or not isinstance(rank_table.get("ranks"), list):
        raise ValueError(f"rank table must be {{'ranks': [{{'rank', 'server', 'lane'}}, ...]}}, got "
                         f"{type(rank_table).__name__}")
    return rank_table


def _table_places(entries: list, n_pes: int, server_size: int) -> tuple[np.ndarray, np.ndarray]:
    server = np.full(n_pes, -1, np.int64)
    lane = np.full(n_pes, -1, np.int64)
    for e in entries:
        r, s, l = int(e["rank"]), int(e["server"]), int(e["lane"])
        if not 0 <= r < n_pes or server[r] >= 0:
            raise ValueError(f"rank table: rank {r} is outside 0..{n_pes - 1} or listed twice")
        if not 0 <= s < n_pes // server_size or not 0 <= l < server_size:
            raise ValueError(f"rank table: rank {r} on server {s} lane {l}: servers are 0..{n_pes // server_size - 1}"
                             f", lanes 0..{server_size - 1}")
        server[r], lane[r] = s, l
    missing = np.flatnonzero(server < 0)
    if len(missing):
        raise ValueError(f"rank table: rank {int(missing[0])} is missing ({len(missing)} of {n_pes} missing)")
    keys = server * server_size + lane
    if len(np.unique(keys)) != n_pes:
        dup = int(np.flatnonzero(np.bincount(keys) > 1)[0])
        raise ValueError(f"rank table: server {dup // server_size} lane {dup % server_size} holds two ranks")
    return server, lane

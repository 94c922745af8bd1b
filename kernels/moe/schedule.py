"""Which block posts what to which (peer, QP), and when: QP policies, source-rank rotation, rounds.

A dispatch (or combine) call on one PE is a set of *units*: channel c sends its rows for peer r. A unit runs on
the channel's AIV block and is posted on one QP of the peer, chosen by the QP policy:

============  ==========================================================================================
``one``       every channel on QP 0
``two_1_1``   two QPs, channel & 1
``two_3_1``   two QPs 3:1 as in ascend_deepep (``channel & 3 == 3`` -> QP 1, the rest QP 0)
``two_1_3``   the mirror, 1:3 (``channel & 3 == 3`` -> QP 0, the rest QP 1)
``bytes``     two QPs, per peer: the units, largest first, each to the QP with fewer bytes so far
``four_rr``   four QPs round-robin, channel % 4
============  ==========================================================================================

A *lane* is one (peer, QP): one send queue, which has one submitter at a time (as on the hardware; a second block
posting while the first has WQEs in flight gets ``SubmitterError``). The channels that use a lane take turns in
*rounds*: in round k the m sharers of a lane are served in a Latin-square order, sharer j in round
``(l - j) mod m`` where l is the peer's logical index, so that no lane has two blocks in one round and every block
works on about ``lanes / m`` lanes per round. A block posts its units of a round, quiets each lane it posted
(the quiet retires its WQEs and so releases the lane), and all blocks meet (``sync_all``) before the next round.
The number of rounds is the largest number of sharers of a lane: 8 for ``one`` with 8 channels, 2 for
``four_rr``. ``rotate`` makes logical index ``l = (peer - me) mod P`` (each source rank starts at itself and
wraps, so the ranks do not all hit peer 0 first); without it ``l = peer``.

*Batched lanes* (``plan_rounds(..., batch=True)``, ``Buffer(shared_lanes="batch")``, the Buffer's default): a
shared lane is not taken in turns; one of its sharers (sharer ``l mod m``) posts every sharer's rows of it as one
unit (its ``segments``: the sharers as runs of consecutive channels; a run is one contiguous range of the
destination), one doorbell, closed by the lane's completion signal. The plan is one round, with no quiet and no
``sync_all`` between the sharers: what a lane carries (rows, record, signal) is the same, and each SQ still has
one submitter. With ``one`` and C channels each block posts about (P - 1) / C whole lanes; with ``two_3_1`` the QP 0
lanes go to channels 0-2 and the QP 1 lanes to channel 3, the same rows per block as the turns.

The last round ends with its quiets and no ``sync_all`` (no block takes a lane over after it); dispatch copies
this PE's own rows out after the blocks' one ``sync_all`` of the receive side (every channel writes its own).

Each lane gets exactly one completion signal per call, posted by its *closer*: the unit of the lane's last round
(a lane with no rows gets an empty closer unit). The closer posts its rows and then the signal, with a fence, on
the same QP; since the earlier rounds' units of that lane were quieted before the closer's round began, the
signal lands after every row of the lane. The own rank (``peer == me``) is a local copy: no QP, no signal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["QP_POLICIES", "POLICY_QPS", "SCHEDULES", "Schedule", "Unit", "Plan", "channel_qp", "plan_rounds"]

POLICY_QPS = {"one": 1, "two_1_1": 2, "two_3_1": 2, "two_1_3": 2, "bytes": 2, "four_rr": 4}
QP_POLICIES = tuple(POLICY_QPS)
SCHEDULES = ("fullmesh", "groups", "hierarchy")  # the kernels: this module (fullmesh), groups.py, hierarchy.py
_ROUTINGS = ("scan", "compact")


@dataclass(frozen=True)
class Schedule:
    """How a ``Buffer`` posts its units; the same on every PE (``Buffer.set_schedule`` checks it).

    Attributes:
        qp_policy: one of ``QP_POLICIES``.
        rotate: source-rank rotation of the peer order.
        aggregate: True = a channel's rows for a peer are packed contiguously and sent with one WQE;
            False = no staging copy: the hidden rows go straight from ``x``, one WQE per run of consecutive
            tokens (the small per-token metadata is packed either way). Combine sends each unit's rows (contiguous
            on both sides) with one WQE either way.
        name: the kernel, one of ``SCHEDULES``: ``fullmesh`` (this module's rounds), ``groups`` (MoonEP's group
            waves, ``groups.py``), ``hierarchy`` (HiSilicon's layered relay, ``hierarchy.py``).
        routing: ``"scan"`` (the ``[T, P]`` mask) or ``"compact"`` (per-token destination lists): ``routes``.
        group_width: groups: ranks per group (0 = min(P, 16)).
        token_blocks, weight_blocks: groups: AIV blocks for the hidden rows (0 = one per lane of a group) and for
            the top-k metadata (0 = none: the token blocks send it with the rows; > 0 needs a QP of its own).
    """

    qp_policy: str = "two_3_1"
    rotate: bool = True
    aggregate: bool = True
    name: str = "fullmesh"
    routing: str = "scan"
    group_width: int = 0
    token_blocks: int = 0
    weight_blocks: int = 0

    def __post_init__(self):
        if self.qp_policy not in POLICY_QPS:
            raise ValueError(f"qp_policy {self.qp_policy!r} is not one of {', '.join(QP_POLICIES)}")
        for name in ("rotate", "aggregate"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.name not in SCHEDULES:
            raise ValueError(f"schedule {self.name!r} is not one of {', '.join(SCHEDULES)}")
        if self.routing not in _ROUTINGS:
            raise ValueError(f"routing {self.routing!r} is not one of {', '.join(_ROUTINGS)}")
        for name, hi in (("group_width", 4095), ("token_blocks", 63), ("weight_blocks", 31)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= hi:
                raise ValueError(f"{name} must be an integer in 0..{hi} (0 = the default), got {v!r}")

    @property
    def num_qps(self) -> int:
        return POLICY_QPS[self.qp_policy]

    @property
    def code(self) -> int:
        """A small integer (31 bits) that identifies the schedule (exchanged by notify to check agreement)."""
        return (QP_POLICIES.index(self.qp_policy) << 2 | int(self.rotate) << 1 | int(self.aggregate)
                | SCHEDULES.index(self.name) << 5 | _ROUTINGS.index(self.routing) << 7 | int(self.group_width) << 8
                | int(self.token_blocks) << 20 | int(self.weight_blocks) << 26)

    @classmethod
    def from_code(cls, code: int) -> "Schedule":
        return cls(QP_POLICIES[code >> 2 & 7], bool(code >> 1 & 1), bool(code & 1), SCHEDULES[code >> 5 & 3],
                   _ROUTINGS[code >> 7 & 1], code >> 8 & 4095, code >> 20 & 63, code >> 26 & 31)

    def __str__(self) -> str:
        base = (f"{self.qp_policy}, rotate {'on' if self.rotate else 'off'}, "
                f"aggregate {'on' if self.aggregate else 'off'}")
        if self.name == "groups":
            base = (f"groups width {self.group_width or 'default'} blocks {self.token_blocks or 'lanes'}:"
                    f"{self.weight_blocks}, " + base)
        elif self.name == "hierarchy":
            base = "hierarchy, " + base
        return base + (", routing compact" if self.routing == "compact" else "")


class Unit(NamedTuple):
    """Channel ``channel`` sends ``rows`` rows to ``peer`` on ``qp`` in ``round``.

    ``closes``: this unit posts the lane's completion signal after its rows (the lane's last unit). A named tuple:
    a plan makes one per peer on every call (255 at 256 PEs), where a frozen dataclass costs 4x to make.
    """

    channel: int
    peer: int
    qp: int
    rows: int
    round: int
    closes: bool = False
    segments: tuple = ()  # batched lanes: ((first channel, end channel, rows), ...) this unit carries

    def parts(self) -> tuple:
        """``((c0, c1, rows), ...)``: the runs of consecutive channels whose rows this unit sends (its own channel
        alone, unless a batched lane gave it every sharer's rows)."""
        return self.segments or ((self.channel, self.channel + 1, self.rows),)


@dataclass
class Plan:
    """The units of one call, by block and round (``by_block[c][k]``: block c's units of round k, in posting
    order), and each lane's expected row count."""

    rounds: int
    by_block: list
    lane_rows: np.ndarray  # [P, num_qps] int64: rows sent on each lane
    units: list = field(default_factory=list)
    batched: bool = False  # shared lanes batched: one round, every remote unit with rows carries its segments


def channel_qp(policy: str, channel: int) -> int:
    """The QP of a channel under a static policy (not ``bytes``, which depends on the data)."""
    if policy == "one":
        return 0
    if policy == "two_1_1":
        return channel & 1
    if policy == "two_3_1":
        return int(channel & 3 == 3)
    if policy == "two_1_3":
        return int(channel & 3 != 3)
    if policy == "four_rr":
        return channel & 3
    raise ValueError(f"qp_policy {policy!r} assigns QPs per unit, not per channel")


def _assign_qps(schedule: Schedule, rows: np.ndarray) -> np.ndarray:
    """``[C, P]`` QP of each (channel, peer) unit."""
    n_channels, n_peers = rows.shape
    if schedule.qp_policy != "bytes":
        per_channel = np.array([channel_qp(schedule.qp_policy, c) for c in range(n_channels)], np.int64)
        return np.repeat(per_channel[:, None], n_peers, axis=1)
    qps = np.zeros(rows.shape, np.int64)
    for peer in range(n_peers):
        load = [0, 0]
        for c in np.argsort(-rows[:, peer], kind="stable"):  # largest first; ties by channel
            q = int(load[1] < load[0])
            qps[c, peer] = q
            load[q] += int(rows[c, peer])
    return qps


def plan_rounds(me: int, n_pes: int, rows: np.ndarray, schedule: Schedule, batch: bool = False,
                servers: npt.ArrayLike | None = None) -> Plan:
    """Assign the units of one call to blocks and rounds.

    Args:
        me: this PE.
        n_pes: P.
        rows: ``[C, P]`` rows channel c sends to peer r (``[C, P]`` int).
        schedule: policy, rotation, aggregation.
        batch: shared lanes are *batched* instead of taken in turns: the rows of every channel that shares a
            lane are posted by one of those channels' blocks (the lane's owner: sharer ``l mod m``, l the peer's
            logical index) as one unit, one doorbell, closed by its completion signal; the plan has one round.
            The lane's WQEs are those the turns would post (a run of consecutive channels is one range of the
            destination, so its per-token runs join across the channel bounds), with no quiet and no
            ``sync_all`` between the channels. This PE's own rows stay one local copy per channel.
        servers: ``[P]`` the server of each rank, or None. With one channel, rotation and more than one server,
            the peers are ordered per tier (``tier_order``) instead of by rank.

    Returns:
        A ``Plan``. Invariants (tested): every (channel, peer) with rows > 0 is sent once; no lane has two blocks
        in a round; every lane to another PE has exactly one closing unit, in its last round.
    """
    rows = np.asarray(rows, np.int64)
    n_channels = rows.shape[0]
    if n_channels == 1:
        order = None
        if servers is not None and schedule.rotate and len(set(np.asarray(servers).tolist())) > 1:
            order = tier_order(me, servers)
        return _plan_one_channel(me, n_pes, rows[0], schedule, order)
    if batch:
        return _plan_batched(me, n_pes, rows, schedule)
    return _plan_general(me, n_pes, rows, schedule)


def tier_order(me: int, servers: npt.ArrayLike) -> list[int]:
    """The peers of ``me`` (``me`` first) so that each port of a two-tier machine is fed from the start and, at
    every step, the senders of one server reach different receivers.

    Rotating by rank (``me + 1, me + 2, ...``) does not: a rank walks its own server's peers first, and all ranks
    of a server then reach the ranks of the next server in the same order, so they queue at one receiver's
    inter-server ingress after the other while the other receivers idle (measured in the replay: the combine's
    inter ingress busy 9% in its first 10 us, rising to 100% only after 90 us). Here the other servers come in
    rotated order and, inside each, the ranks from this rank's own position in its server on (a permutation of
    the receivers at every step, as the lanes of DeepEP's internode kernel); the own server's ranks rotated
    from this one; the two lists are merged in proportion, so that both tiers' ports start at once."""
    servers = np.asarray(servers).tolist()
    mine = servers[me]
    by_server: dict[int, list[int]] = {}
    for r, sv in enumerate(servers):
        by_server.setdefault(sv, []).append(r)
    ids = sorted(by_server)
    local = by_server[mine].index(me)
    intra = [by_server[mine][(local + i) % len(by_server[mine])] for i in range(1, len(by_server[mine]))]
    inter = []
    for j in range(1, len(ids)):
        ranks = by_server[ids[(ids.index(mine) + j) % len(ids)]]
        inter += [ranks[(local + i) % len(ranks)] for i in range(len(ranks))]
    keyed = [((j + 0.5) / len(inter), 0, r) for j, r in enumerate(inter)]
    keyed += [((i + 0.5) / len(intra), 1, r) for i, r in enumerate(intra)]
    return [me] + [r for _, _, r in sorted(keyed)]


def _segments(sharers: list[int], rows) -> tuple:
    """``((c0, c1, rows), ...)``: ``sharers`` (ascending) as runs of consecutive channels, with their rows
    (``rows[c]``: a list or an array, by channel)."""
    out = []
    for c in sharers:
        if out and out[-1][1] == c:
            out[-1] = (out[-1][0], c + 1, out[-1][2] + int(rows[c]))
        else:
            out.append((c, c + 1, int(rows[c])))
    return tuple(out)


def _plan_general(me: int, n_pes: int, rows: np.ndarray, schedule: Schedule, batch: bool = False) -> Plan:
    """``plan_rounds`` for any number of channels: the lanes' sharers, rounds by rotation (or one batched unit
    per lane: the reference that ``_plan_batched`` follows), the closers."""
    n_channels = rows.shape[0]
    n_qps = schedule.num_qps
    qps = _assign_qps(schedule, rows)
    logical = [(peer - me) % n_pes if schedule.rotate else peer for peer in range(n_pes)]
    units: list[Unit] = []
    lane_rows = np.zeros((n_pes, n_qps), np.int64)
    by_peer, qp_of = rows.T.tolist(), qps.T.tolist()  # Python ints: this loop runs on every call
    for peer in range(n_pes):
        prow, pqp = by_peer[peer], qp_of[peer]
        for q in range(n_qps):
            sharers = [c for c in range(n_channels) if pqp[c] == q and prow[c] > 0]
            lane_rows[peer, q] = total = sum(prow[c] for c in sharers)
            m = len(sharers)
            if batch and peer != me and m:
                owner = sharers[logical[peer] % m]
                units.append(Unit(owner, peer, q, total, 0, True, _segments(sharers, prow)))
                continue
            if batch:  # this PE's own rows (one local copy per channel) or a lane without rows: round 0
                lane = [Unit(c, peer, q, prow[c], 0) for c in sharers]
                if peer != me:
                    lane = [Unit((logical[peer] * n_qps + q) % n_channels, peer, q, 0, 0, True)]
                units.extend(lane)
                continue
            lane = [Unit(c, peer, q, prow[c], (logical[peer] - j) % m) for j, c in enumerate(sharers)]
            if peer != me:
                if not lane:  # nothing to send on this lane: an empty unit carries its completion signal
                    lane = [Unit((logical[peer] * n_qps + q) % n_channels, peer, q, 0, 0)]
                last = max(range(len(lane)), key=lambda i: lane[i].round)
                u = lane[last]
                lane[last] = Unit(u.channel, u.peer, u.qp, u.rows, u.round, True)
            units.extend(lane)
    n_rounds = max([u.round + 1 for u in units], default=1)
    by_block = [[[] for _ in range(n_rounds)] for _ in range(n_channels)]
    for u in sorted(units, key=lambda u: (logical[u.peer], u.qp)):
        by_block[u.channel][u.round].append(u)
    return Plan(n_rounds, by_block, lane_rows, units, batched=batch)


def _plan_batched(me: int, n_pes: int, rows: np.ndarray, schedule: Schedule) -> Plan:
    """``_plan_general(batch=True)`` without its per-lane searches and its final sort (it runs on every call): the
    peers are walked in logical order and each peer's QPs ascending, which is the posting order, so each unit goes
    straight to its block. The same units in the same order (tested)."""
    n_channels = rows.shape[0]
    n_qps = schedule.num_qps
    qps = _assign_qps(schedule, rows)
    lane_rows = np.zeros((n_pes, n_qps), np.int64)
    by_block = [[[]] for _ in range(n_channels)]
    units: list[Unit] = []
    by_peer, qp_of = rows.T.tolist(), qps.T.tolist()
    order = [(me + i) % n_pes for i in range(n_pes)] if schedule.rotate else range(n_pes)
    for logical, peer in enumerate(order):
        prow, pqp = by_peer[peer], qp_of[peer]
        lanes: list[list[int]] = [[] for _ in range(n_qps)]  # each QP's sharers with rows, ascending
        for c in range(n_channels):
            if prow[c] > 0:
                lanes[pqp[c]].append(c)
        for q, sharers in enumerate(lanes):
            if peer == me:  # this PE's own rows: one local copy per channel
                lane = [Unit(c, peer, q, prow[c], 0) for c in sharers]
            elif sharers:
                lane = [Unit(sharers[logical % len(sharers)], peer, q, sum(prow[c] for c in sharers), 0, True,
                             _segments(sharers, prow))]
            else:  # a lane without rows: its completion only
                lane = [Unit((logical * n_qps + q) % n_channels, peer, q, 0, 0, True)]
            for u in lane:
                lane_rows[peer, q] += u.rows
                by_block[u.channel][0].append(u)
            units.extend(lane)
    return Plan(1, by_block, lane_rows, units, batched=True)


def _plan_one_channel(me: int, n_pes: int, rows: np.ndarray, schedule: Schedule, order=None) -> Plan:
    """``plan_rounds`` for one channel (the default Buffer), without its per-lane search: one round; the channel's
    QP (every policy puts channel 0 on one QP: the static ones by ``channel_qp``, ``bytes`` on the emptier QP,
    which is QP 0 for the first channel) carries each peer's rows and its completion, every other QP of the peer
    only its completion; this PE's own rows are a unit without one. The same units, in the same order (the
    peers in rotated order, QPs ascending), as the general loop gives; ``order`` (every PE once) replaces the
    rotated order."""
    n_qps = schedule.num_qps
    q0 = 0 if schedule.qp_policy == "bytes" else channel_qp(schedule.qp_policy, 0)
    lane_rows = np.zeros((n_pes, n_qps), np.int64)
    lane_rows[:, q0] = rows
    counts = rows.tolist()
    if order is None:
        order = [(me + i) % n_pes for i in range(n_pes)] if schedule.rotate else range(n_pes)
    units = []
    for peer in order:
        if peer == me:
            if counts[peer] > 0:
                units.append(Unit(0, peer, q0, counts[peer], 0))
            continue
        for q in range(n_qps):
            units.append(Unit(0, peer, q, counts[peer] if q == q0 else 0, 0, True))
    return Plan(1, [[units]], lane_rows, units)

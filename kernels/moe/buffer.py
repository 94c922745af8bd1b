"""``Buffer``: DeepEP's normal-mode API (layout, notify, dispatch fresh and cached, combine) on the UDMA engine.

Every method that moves data is collective: every PE of the job calls it, in the same order, with the same
buffer settings. A call gets a sequence number (the same on every PE); completion signals carry it, so a signal
left from an earlier call can never release a later one.

Buffer reuse without barriers (credits): a region a peer writes into (dispatch: notify area, rows and metadata;
combine: the returned rows) may be written again only after its owner consumed it. When a PE has copied out (or
reduced) the rows a source sent, it SETs its word in that source's ``credits`` to the call's sequence number
(``aclshmemx_signal_op``); before a call writes into peers' regions of a kind, the host waits (asleep) until every
peer's credit for the previous call of that kind arrived. In a dispatch/combine loop the credits are in long
before they are needed, so the wait costs nothing; it is what makes back-to-back dispatches (fresh then cached)
safe, where DeepEP's cached notify uses a barrier.
"""

from __future__ import annotations

import collections
import time

import ml_dtypes
import numpy as np

import shmemx

from .combine import REDUCE_CHUNK, CombineArgs
from .config import Config
from .dispatch import DispatchArgs
from .families import Shape, families
from .lanes import Lanes
from .notify import notify_dispatch
from .pool import OutputPool
from .routing import DispatchLayout, RankRows, channel_bounds, channel_counts, check_topk_idx, get_dispatch_layout, \
    make_send_head, rows_before_rank
from .schedule import POLICY_QPS, Schedule
from .measure import CallStats
from .records import CombineResult, DispatchHandle, DispatchResult, DispatchCall, Payload, Recv, Routing
from .workspace import MetaRecord, plan_workspace
from .routes import compact_dests, dests_from_mask
from .topology import Topology
from .peers import Peers
from .slots import RecvSlots

__all__ = ["Buffer", "Config", "DispatchHandle", "DispatchResult", "CombineResult"]

bf16 = ml_dtypes.bfloat16
_KINDS = {np.dtype(bf16): 0, np.dtype(np.int8): 1, np.dtype(ml_dtypes.float8_e4m3fn): 2}
GE = shmemx.ACLSHMEM_CMP_GE
DISPATCH, COMBINE = 0, 1


class Buffer:
    """A DeepEP-style communication buffer over the UDMA engine. Collective.

    Args:
        max_tokens: S, the most tokens a PE passes to one dispatch.
        hidden: H.
        num_topk: K, the top-k width of ``topk_idx``.
        num_experts: E, a multiple of the number of PEs.
        config: a ``Config`` of the settings below (default: ``Config()``); any of them may also be given as a
            keyword (``moe.Buffer(T, H, K, E, num_channels=4)``), which replaces the config's.
        num_channels: C, AIV blocks (channels) of the dispatch and combine kernels. The default is 1, not DeepEP's
            10 (nor the Ascend port's 4): level with 4 on the reference machine and the one that needs the fewest
            QPs (``scripts/bench_moe.py --repeat``; README "Performance").
        split_blocks: whether the C channels of a batched fullmesh call run on C blocks (True) or on block 0
            alone (False, the default, on every host: the same WQEs, order and results, ``Lanes.one_block``). An
            emulated PE's blocks are threads of one process: on a host whose cores the PEs fill (fewer than two
            per PE) they could only take turns on the PE's core, and one block saves their hand-offs; with cores
            to spare, splitting runs the blocks' copies and reductions in parallel. Reported in ``CallStats``
            (``blocks_launched``, ``split_blocks``); settable as ``buffer.split_blocks``.
        qp_num: QPs per peer the buffer may use (default: what ``qp_policy`` needs); the job needs at least as
            many (``aclshmemx_set_qp_num`` before init).
        qp_policy, rotate, aggregate: the initial ``Schedule`` (change it with ``set_schedule``). The default
            policy, ``one``, needs one QP per peer: what a plain ``shmemx.init()`` gives. ``aggregate`` defaults
            to False: dispatch sends the rows straight from ``x`` (a WQE per run of consecutive tokens) instead of
            packing them into the staging area first, one copy of every sent row less (bench_moe).
        server_size: ranks per server for ``num_tokens_per_rdma_rank`` (None: one server).
        schedule: the kernel: ``"fullmesh"`` (the channel rounds above), ``"groups"`` (MoonEP's group waves) or
            ``"hierarchy"`` (HiSilicon's layered relay); see README "Topology-aware schedules".
        topology: a ``Topology``, or a rank table (a JSON path or its content) for one; default: servers of
            ``server_size`` (or 16) ranks from rank ids. Counts ``cross_server_bytes``; the hierarchy uses its
            server size.
        routing: ``"scan"`` (the ``[T, P]`` mask) or ``"compact"`` (per-token destination lists, ``routes``).
        group_width, token_blocks, weight_blocks: the groups schedule's width (default min(P, 16)), lane
            worker blocks (default one per lane) and metadata blocks (default 0; > 0 needs ``qp_num`` one more
            than the QP policy's QPs).
        shared_lanes: how the fullmesh kernel's channels use a lane (peer, QP) that several of them share (with
            ``one``, every lane when C > 1): ``"batch"`` (default): one of them, the lane's owner, posts every
            sharer's rows in one batch (one unit, one doorbell, one round: no quiet and no ``sync_all`` between
            the channels); ``"rounds"``: the sharers take turns, one round each, a quiet and a ``sync_all``
            between rounds (``schedule.plan_rounds``). A local choice of each PE (the lanes carry the same rows,
            records and completion signals either way); settable as ``buffer.shared_lanes``.
        history: how many recent ``CallStats`` to keep.
        zero_copy: dispatch returns ``recv_x`` (and its scales stay copies) as a view of the workspace's receive
            rows instead of a fresh array, as the Ascend port does (``MakeShmemTensor``): one copy of every
            received row less. The view is valid until this PE's next dispatch; this PE gives its sources the
            credit for the rows only then (at the start of its next dispatch), not when the call returns.

    Raises:
        HeapExhaustedError: the heap cannot hold the workspace; the message names the size needed.
    """

    def __init__(self, max_tokens: int, hidden: int, num_topk: int, num_experts: int, config: Config | None = None,
                 **options: object):
        self.peers = Peers.of(options.pop("team", None))  # team ranks; Peers.pe(s) is peer s's global PE
        self.me, self.n_pes = self.peers.me, self.peers.n_pes
        cfg = self.config = Config.of(config, options, self.me)
        self._check_sizes(max_tokens, hidden, num_topk, num_experts, cfg.num_channels)
        first = Schedule(cfg.qp_policy, cfg.rotate, cfg.aggregate, cfg.schedule, cfg.routing, cfg.group_width or 0,
                         cfg.token_blocks or 0, cfg.weight_blocks or 0)
        self.qp_num = first.num_qps + (1 if first.weight_blocks else 0) if cfg.qp_num is None else int(cfg.qp_num)
        if not 1 <= self.qp_num <= 32:
            raise ValueError(f"pe {self.me}: moe.Buffer: qp_num {cfg.qp_num!r} out of range 1..32")
        self.max_tokens, self.hidden, self.num_topk = int(max_tokens), int(hidden), int(num_topk)
        self.num_experts, self.num_channels = int(num_experts), int(cfg.num_channels)
        self.num_local_experts = self.num_experts // self.n_pes
        self.server_size = cfg.server_size
        self.shared_lanes = cfg.shared_lanes
        self._topology(cfg)
        self._workspace()
        self.lanes.split_blocks = bool(cfg.split_blocks)
        self.zero_copy = bool(cfg.zero_copy)
        self._owed: list[int] = []  # zero copy: sources owed the credit of the last dispatch's rows
        self._seq = 0
        self._last = [0, 0]  # sequence number of the last dispatch / combine
        self._schedule = Schedule(cfg.qp_policy, cfg.rotate, cfg.aggregate)
        self._families = families(self)
        self.history: collections.deque = collections.deque(maxlen=cfg.history)
        self._pool = OutputPool()
        self._scratches: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.closed = False
        self.set_schedule(qp_policy=first.qp_policy, rotate=first.rotate, aggregate=first.aggregate,
                          schedule=first.name, routing=first.routing, group_width=first.group_width,
                          token_blocks=first.token_blocks, weight_blocks=first.weight_blocks)

    def _check_sizes(self, max_tokens, hidden, num_topk, num_experts, num_channels) -> None:
        for name, value, lo in (("max_tokens", max_tokens, 0), ("hidden", hidden, 1), ("num_topk", num_topk, 1),
                                ("num_experts", num_experts, 1), ("num_channels", num_channels, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
                raise ValueError(f"pe {self.me}: moe.Buffer: {name} must be an integer >= {lo}, got {value!r}")
        if num_experts % self.n_pes:
            raise ValueError(f"pe {self.me}: moe.Buffer: num_experts {num_experts} is not a multiple of the "
                             f"{self.n_pes} PEs")
        if num_channels > 128:
            raise ValueError(f"pe {self.me}: moe.Buffer: num_channels {num_channels} is over 128 AIV blocks")

    def _topology(self, cfg: Config) -> None:
        """The servers the ranks sit on (``Topology``), and the full mesh's per-tier order when told them."""
        topology = cfg.topology
        if isinstance(topology, Topology):
            self.topology = topology
        else:
            self.topology = Topology(self.n_pes, cfg.server_size, rank_table=topology)
        if self.topology.n_pes != self.n_pes:
            raise ValueError(f"pe {self.me}: moe.Buffer: the topology has {self.topology.n_pes} ranks, the job "
                             f"{self.n_pes}")
        # the full mesh orders its peers per tier when told the servers (``schedule.tier_order``)
        told = cfg.server_size is not None or topology is not None
        self.tier_servers = self.topology.server if told and self.topology.num_servers > 1 else None

    def _workspace(self) -> None:
        """The symmetric workspace (collective), its views, and the lanes to every peer's copy of it."""
        self.layout = plan_workspace(n_pes=self.n_pes, max_tokens=self.max_tokens, hidden=self.hidden,
                                     num_topk=self.num_topk, num_experts=self.num_experts,
                                     num_channels=self.num_channels, qp_num=self.qp_num)
        try:
            self._block = shmemx.aclshmem_malloc(self.layout.total, name="moe_workspace", prefault=False)
        except shmemx.HeapExhaustedError as exc:
            raise shmemx.HeapExhaustedError(
                f"pe {self.me}: moe.Buffer(max_tokens={self.max_tokens}, hidden={self.hidden}, "
                f"num_topk={self.num_topk}, num_experts={self.num_experts}) needs a workspace of "
                f"{self.layout.total} B ({self.layout.total / 2**20:.1f} MiB) on every PE: start the job with a "
                f"larger --heap-size ({exc})") from None
        self.views = self.layout.views(self._block)
        self.offsets = {name: r.offset for name, r in self.layout.regions.items()}
        self.record = MetaRecord.of(self.num_topk)  # the layout of the meta region's records
        for name in ("notify_signal", "credits", "signals", "config", "round_credits"):
            self.views[name][...] = 0
        self.views["combine_x"][-1] = 0
        self.views["combine_weights"][-1] = 0
        try:
            self.lanes = Lanes(self._block, self.peers, self.qp_num, self.views, self.offsets)
        except ValueError:
            shmemx.aclshmem_free(self._block)
            raise
        self.slots = RecvSlots(self._block, self.offsets["x"], self.views["x"].nbytes, self.me)

    # --- settings --------------------------------------------------------------------------------------------

    @property
    def schedule(self) -> Schedule:
        return self._schedule

    @property
    def shared_lanes(self) -> str:
        """``"batch"`` or ``"rounds"``: how channels that share a lane post on it (see the class docstring)."""
        return self._shared_lanes

    @shared_lanes.setter
    def shared_lanes(self, value: str) -> None:
        if value not in ("batch", "rounds"):
            raise ValueError(f"pe {self.me}: moe.Buffer: shared_lanes must be 'batch' or 'rounds', got {value!r}")
        self._shared_lanes = value

    def set_schedule(self, *, qp_policy: str | None = None, rotate: bool | None = None,
                     aggregate: bool | None = None, schedule: str | None = None, routing: str | None = None,
                     group_width: int | None = None, token_blocks: int | None = None,
                     weight_blocks: int | None = None) -> Schedule:
        """Change the kernel (``schedule``), routing plan, QP policy, rotation, aggregation or the groups
        settings (collective: every PE the same; checked). Unnamed settings keep their values.

        Raises:
            ValueError: an unknown policy, one that needs more QPs than ``qp_num``, a group width that does not
                fit P, or PEs that disagree.
        """
        self._check_open()
        old = self._schedule

        def pick(value, current):
            return current if value is None else value

        new = Schedule(pick(qp_policy, old.qp_policy), pick(rotate, old.rotate), pick(aggregate, old.aggregate),
                       pick(schedule, old.name), pick(routing, old.routing), pick(group_width, old.group_width),
                       pick(token_blocks, old.token_blocks), pick(weight_blocks, old.weight_blocks))
        family = self._families[new.name]
        extra_qp = family.extra_qps(new)
        if new.num_qps + extra_qp > self.qp_num:
            raise ValueError(f"pe {self.me}: qp_policy {new.qp_policy!r} needs {POLICY_QPS[new.qp_policy]} QPs "
                             f"per peer{' and the weight blocks one more' if extra_qp else ''}; this Buffer was "
                             f"made with qp_num={self.qp_num}")
        family.check(new)
        config = self.views["config"]
        self.peers.barrier()  # nobody still reads the previous code
        config[0] = new.code
        self.peers.barrier()
        codes = np.zeros(self.n_pes, config.dtype)  # every PE's code, read by the engine that reaches it
        for pe in range(self.n_pes):
            shmemx.aclshmem_getmem(codes[pe:pe + 1], config[:1], config.itemsize, self.peers.pe(pe))
        codes = codes.tolist()
        bad = [pe for pe, code in enumerate(codes) if code != new.code]
        if bad:
            raise ValueError(f"pe {self.me}: set_schedule: pe {bad[0]} chose [{Schedule.from_code(codes[bad[0]])}], "
                             f"this pe [{new}]: every pe must use the same schedule")
        self._schedule = new
        family.prepare()
        return new

    @property
    def last_stats(self) -> CallStats | None:
        """Measurements of the most recent call on this PE."""
        return self.history[-1] if self.history else None

    # --- layout ----------------------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: np.ndarray, num_experts: int | None = None) -> DispatchLayout:
        """``(num_tokens_per_rank [P], num_tokens_per_rdma_rank, num_tokens_per_expert [E], is_token_in_rank
        [T, P])`` of this PE's routing (local; see ``routing.get_dispatch_layout``)."""
        return get_dispatch_layout(topk_idx, self.num_experts if num_experts is None else num_experts,
                                   self.n_pes, server_size=self.server_size)

    # --- dispatch --------------------------------------------------------------------------------------------

    def dispatch(self, x: np.ndarray | tuple[np.ndarray, np.ndarray], handle: DispatchHandle | None = None,
                 num_tokens_per_rank: np.ndarray | None = None, is_token_in_rank: np.ndarray | None = None,
                 num_tokens_per_expert: np.ndarray | None = None, topk_idx: np.ndarray | None = None,
                 topk_weights: np.ndarray | None = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0) -> DispatchResult:
        """Send each token to every rank that holds one of its experts (collective).

        Args:
            x: ``[T, H] bfloat16``, or a pair (``[T, H]`` int8 or float8_e4m3fn, ``[T, ceil(H/128)] float32``
                scales), T <= max_tokens.
            handle: a ``DispatchHandle`` of an earlier dispatch with the same routing: skip notify (cached
                dispatch; top-k arguments must then be None).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: the layout (``get_dispatch_layout``);
                computed from ``topk_idx`` when omitted.
            topk_idx: ``[T, K] int64`` global experts (-1 = none), K = num_topk; topk_weights: ``[T, K] float32``.
                Both or neither.
            expert_alignment: round the per-expert counts up to a multiple of this.
            num_worst_tokens: > 0: the outputs have exactly this many rows (tail: x 0, topk_idx -1, weights 0)
                and the per-expert list is empty.

        Returns:
            ``DispatchResult(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)``;
            rows grouped by source rank, in source-token order within a source.

        Raises:
            ValueError: bad arguments; or, after the exchange completed, more rows arrived on this PE than
                num_worst_tokens (nothing is truncated; the other PEs are not affected).
        """
        self._check_open()
        start = time.perf_counter()
        payload = self._payload(x)
        if not isinstance(num_worst_tokens, (int, np.integer)) or num_worst_tokens < 0:
            raise ValueError(f"pe {self.me}: dispatch: num_worst_tokens must be an integer >= 0, got "
                             f"{num_worst_tokens!r}")
        if not isinstance(expert_alignment, (int, np.integer)) or expert_alignment < 1:
            raise ValueError(f"pe {self.me}: dispatch: expert_alignment must be an integer >= 1, got "
                             f"{expert_alignment!r}")
        if handle is not None:
            result, stats = self._cached_dispatch(payload, handle, topk_idx, topk_weights, int(num_worst_tokens))
        else:
            result, stats = self._fresh_dispatch(payload, num_tokens_per_rank, is_token_in_rank,
                                                 num_tokens_per_expert, topk_idx, topk_weights,
                                                 int(expert_alignment), int(num_worst_tokens))
        stats.wall = time.perf_counter() - start
        self._raise_overflow(stats, num_worst_tokens)
        return result

    def _fresh_dispatch(self, payload: Payload, per_rank, in_rank, per_expert, topk_idx, topk_weights,
                        expert_alignment: int, num_worst_tokens: int):
        """notify_dispatch (the routing every PE agrees on), then the dispatch kernel."""
        n_tok = payload.num_tokens
        topk = self._topk(n_tok, topk_idx, topk_weights)
        layout = self._layout(n_tok, per_rank, in_rank, per_expert, topk[0])
        seq, credit_wait = self._next(DISPATCH)
        t_plan = time.perf_counter()
        dests = None
        if self._schedule.routing == "compact":  # the plan from topk_idx (or the mask once), counts from it
            dests = compact_dests(topk[0], self.num_local_experts) if topk[0] is not None else \
                dests_from_mask(layout.is_token_in_rank, self.num_topk)
            per_channel = _compact_channel_counts(dests, self.num_channels, self.n_pes)
        else:
            per_channel = channel_counts(layout.is_token_in_rank, self.num_channels)
        t_plan = time.perf_counter() - t_plan
        t_notify = time.perf_counter()
        slot = self._pick_slot(num_worst_tokens, payload.rows.shape[1])
        header = dict(schedule=self._schedule.code, num_tokens=n_tok, row_bytes=payload.rows.shape[1],
                      x_kind=payload.kind, with_topk=int(topk[0] is not None), num_channels=self.num_channels,
                      num_topk=self.num_topk, recv_slot=slot)
        note = notify_dispatch(self.views, self.me, self.n_pes, seq, num_tokens_per_rank=layout.num_tokens_per_rank,
                               num_tokens_per_expert=layout.num_tokens_per_expert, channel_counts=per_channel,
                               header=header, expert_alignment=expert_alignment, lanes=self.lanes)
        t_notify = time.perf_counter() - t_notify
        routing = Routing(layout.is_token_in_rank, per_channel, note.rank_prefix_matrix, note.channel_prefix_matrix,
                           note.recv_channel_prefix_matrix)
        call = DispatchCall("dispatch", seq, num_worst_tokens, *topk)
        result, stats = self._run_dispatch(call, payload, routing,
                                           None if num_worst_tokens else note.num_recv_tokens_per_expert_list,
                                           dests=dests, slots=note.recv_slots)
        stats.phases[0, 0] += t_plan  # the plan is route work: counted in block 0's route phase
        stats.extra["plan"] = t_plan
        stats.notify = t_notify
        stats.extra["credit_wait"] = credit_wait
        return result, stats

    def _cached_dispatch(self, payload: Payload, handle, topk_idx, topk_weights, num_worst_tokens: int):
        """The dispatch kernel on the routing of an earlier dispatch's handle (no notify)."""
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"pe {self.me}: dispatch: handle must be the DispatchHandle of an earlier dispatch, "
                            f"got {type(handle).__name__}")
        if topk_idx is not None or topk_weights is not None:
            raise ValueError(f"pe {self.me}: cached dispatch (handle given) takes no topk_idx/topk_weights: the "
                             f"routing is the handle's")
        if payload.num_tokens != handle.num_tokens or handle.hidden != self.hidden:
            raise ValueError(f"pe {self.me}: cached dispatch: x has {payload.num_tokens} tokens of hidden "
                             f"{self.hidden}, the handle was made for {handle.num_tokens} tokens of hidden "
                             f"{handle.hidden}")
        seq, credit_wait = self._next(DISPATCH)
        routing = Routing(handle.is_token_in_rank, channel_counts(handle.is_token_in_rank, self.num_channels),
                           handle.rank_prefix_matrix, handle.channel_prefix_matrix,
                           handle.recv_channel_prefix_matrix)
        result, stats = self._run_dispatch(DispatchCall("cached_dispatch", seq, num_worst_tokens), payload, routing,
                                           None, handle=handle)
        stats.extra["credit_wait"] = credit_wait
        return result, stats

    def _run_dispatch(self, call: DispatchCall, payload: Payload, routing: Routing, expert_list,
                      handle: DispatchHandle | None = None, dests: np.ndarray | None = None,
                      slots: np.ndarray | None = None):
        """Run the dispatch kernel of one call: outputs, kernel arguments, launch, then the result and its stats.
        ``slots``: the receive slot every PE named in its notify record (None: a cached call, every PE's ``x``).

        Returns ``(DispatchResult or None on a num_worst_tokens overflow, CallStats)``."""
        me, sched = self.me, self._schedule
        prefix = np.asarray(routing.rank_prefix_matrix, np.int32)  # DeepEP's dtype: no [P, P] int64 copy per call
        mine = RankRows.of(prefix, me)
        num_recv = mine.num_recv
        if sched.routing == "compact" and dests is None:
            dests = handle.dest_ranks if handle is not None and handle.dest_ranks is not None else \
                dests_from_mask(routing.is_token_in_rank, self.num_topk)
        family = self._families[sched.name]
        shape = family.dispatch_shape(routing)
        overflow = bool(call.num_worst_tokens) and num_recv > call.num_worst_tokens
        slot = 0 if slots is None else int(slots[me])
        recv = self._recv_outputs(call, payload, num_recv, overflow, slot)
        stats = CallStats.empty(call.kind_name, me, call.seq, sched, shape.rounds, shape.blocks, self.n_pes,
                                shape.n_qps)
        args = self._dispatch_args(call, payload, routing, mine, shape, stats, None if overflow else recv, dests)
        if slots is not None:  # where each destination's rows go, and where this PE's land
            args.x_offsets = self.slots.remote_offsets(slots)
            args.recv_region = self.slots.region(slot) if slot else None
        stats.extra["recv_slot"] = slot
        relay_out: list = [None] * self.topology.num_servers
        t_kernel = time.perf_counter()
        self._launched(stats, family.dispatch(args, shape, prefix, relay_out))
        stats.kernel = time.perf_counter() - t_kernel
        self._cross_server(stats)
        if self.zero_copy:
            self._owed = [s for s in np.flatnonzero(mine.recv).tolist() if s != me]
        self._count_rows(stats, mine, payload.rows.shape[1])
        self._last[DISPATCH] = call.seq
        self.history.append(stats)
        if overflow:
            return None, stats
        if handle is None:
            handle = DispatchHandle(np.asarray(routing.rank_prefix_matrix, np.int32), np.asarray(routing.channel_prefix_matrix, np.int32),
                                    np.asarray(routing.recv_channel_prefix_matrix, np.int32),
                                    recv.src_idx[:num_recv].copy(), routing.is_token_in_rank,
                                    make_send_head(routing.is_token_in_rank), num_recv, self.hidden, dests,
                                    family.relay(relay_out))
        x_out = (recv.x, recv.scales) if payload.scales is not None else recv.x
        return DispatchResult(x_out, recv.topk_idx, recv.topk_weights,
                              [] if call.num_worst_tokens else expert_list, handle), stats

    def _dispatch_args(self, call: DispatchCall, payload: Payload, routing: Routing, mine: RankRows, shape: Shape,
                       stats: CallStats, recv: Recv | None, dests) -> DispatchArgs:
        """What the dispatch kernel's blocks read (``recv`` None: the rows overflow num_worst_tokens)."""
        me, n_pes = self.me, self.n_pes
        return DispatchArgs(
            me=me, n_pes=n_pes, seq=call.seq, num_local_experts=self.num_local_experts, views=self.views,
            lanes=self.lanes, plan=shape.plan, stats=stats, xb=payload.rows, topk_idx=call.topk_idx,
            topk_weights=call.topk_weights, scales=payload.scales, is_token_in_rank=routing.is_token_in_rank,
            bounds=channel_bounds(payload.num_tokens, self.num_channels),
            rank_base=mine.rank_base,
            channel_start=np.asarray(routing.channel_prefix_matrix, np.int64) - routing.per_channel,
            send_base=np.cumsum(mine.sent) - mine.sent, recv_lo=mine.recv_lo, recv_hi=mine.recv_hi, out=None if recv is None else recv.kernel_outputs(payload, not self.zero_copy),
            aggregate=self._schedule.aggregate, region_offsets=self.offsets, record=self.record,
            routing=self._schedule.routing, dests=dests)

    def _recv_outputs(self, call: DispatchCall, payload: Payload, num_recv: int, overflow: bool,
                      slot: int = 0) -> Recv:
        """The arrays a dispatch returns: ``num_worst_tokens`` rows (its padding filled) or the rows received; with
        ``zero_copy`` recv_x is a view of the workspace's receive rows, in receive slot ``slot`` (1..) an array
        over that slot (``RecvSlots.hand_out``), else an array of its own the rows are copied into."""
        rows = call.num_worst_tokens or num_recv
        take = self._pool.take
        rb = payload.rows.shape[1]
        zero_copy = self.zero_copy and not overflow and rows * rb <= self.views["x"].size
        if slot and not overflow:  # the rows land in the slot: no copy-out
            x, zero_copy = self.slots.hand_out(slot, rows, self.hidden, payload.dtype), True
        elif zero_copy:  # the receive rows themselves, in the order dispatch returns them
            x = self.views["x"][:rows * rb].view(payload.dtype).reshape(rows, self.hidden)
        else:
            x = take((rows, self.hidden), payload.dtype)
        recv = Recv(x, zero_copy, take(rows, np.int32),
                     take((rows, payload.scales.shape[1]), np.float32) if payload.scales is not None else None,
                     take((rows, self.num_topk), np.int64) if call.topk_idx is not None else None,
                     take((rows, self.num_topk), np.float32) if call.topk_idx is not None else None)
        if call.num_worst_tokens and not overflow:  # the padding rows: x 0, topk_idx -1, weights 0
            tail = slice(num_recv, rows)
            for arr, fill in ((recv.x.view(np.uint8), 0), (recv.src_idx, 0), (recv.scales, 0), (recv.topk_idx, -1),
                              (recv.topk_weights, 0)):
                if arr is not None:
                    arr[tail] = fill
        return recv

    def _pick_slot(self, num_worst_tokens: int, row_bytes: int) -> int:
        """The receive slot of a fresh dispatch (``RecvSlots``): one for the full mesh's rows when recv_x is an
        array of its own (not ``zero_copy``) and the outputs fit a slot; 0 (``x``, copied out) otherwise."""
        if self.zero_copy or self._schedule.name != "fullmesh" or num_worst_tokens * row_bytes > self.slots.nbytes:
            return 0
        return self.slots.pick()

    def _count_rows(self, stats: CallStats, mine: RankRows, row_bytes: int) -> None:
        me, num_recv = self.me, mine.num_recv
        stats.local_rows = int(mine.sent[me])
        stats.local_bytes = stats.local_rows * row_bytes
        stats.sent_rows = int(mine.sent.sum()) - stats.local_rows
        stats.recv_rows = num_recv
        stats.extra.update(num_recv=num_recv, row_bytes=row_bytes, hidden_bytes=row_bytes)

    def _raise_overflow(self, stats: CallStats, num_worst_tokens: int) -> None:
        if num_worst_tokens and stats.recv_rows > num_worst_tokens:
            raise ValueError(f"pe {self.me}: dispatch #{stats.seq}: {stats.recv_rows} tokens arrived, more than "
                             f"num_worst_tokens={num_worst_tokens}; nothing was returned (no silent truncation): "
                             f"call again with num_worst_tokens >= {stats.recv_rows}, or 0")

    # --- combine ---------------------------------------------------------------------------------------------

    def combine(self, x: np.ndarray, handle: DispatchHandle, topk_weights: np.ndarray | None = None,
                bias: np.ndarray | tuple | None = None) -> CombineResult:
        """Send every received row back to its source token and sum there (collective).

        Args:
            x: ``[num_recv, H] bfloat16`` (more rows allowed, e.g. num_worst_tokens padding: only the first
                ``handle.num_recv_tokens`` are used), aligned with the dispatch's recv_x; the expert outputs are
                already weighted (as in DeepEP).
            handle: the dispatch's ``DispatchHandle``.
            topk_weights: ``[num_recv, K] float32`` summed back the same way, or None.
            bias: ``[T, H] bfloat16``, or a pair of them (DeepEP's ``bias_0, bias_1``), or None.

        Returns:
            ``CombineResult(combined_x [T, H] bfloat16, combined_topk_weights [T, K] float32 or None)``: per
            token, the float32 sum of the biases, then in ascending rank order of the rows of the ranks it went
            to, rounded once to bfloat16 (the bias alone for a token that went nowhere).
        """
        self._check_open()
        start = time.perf_counter()
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"pe {self.me}: combine: handle must be a DispatchHandle, got {type(handle).__name__}")
        num_recv = handle.num_recv_tokens
        xb = self._combine_rows(x, num_recv)
        weights = self._combine_weights(topk_weights, num_recv)
        seq, credit_wait = self._next(COMBINE)
        me = self.me
        prefix = np.asarray(handle.rank_prefix_matrix, np.int32)
        mine = RankRows.of(prefix, me)
        starts = np.asarray(handle.recv_channel_prefix_matrix, np.int64)
        ends = np.concatenate([starts[:, 1:], mine.recv[:, None]], axis=1)
        family = self._families[self._schedule.name]
        shape = family.combine_shape(handle, ends - starts)
        stats = CallStats.empty("combine", me, seq, self._schedule, shape.rounds, shape.blocks, self.n_pes,
                                shape.n_qps)
        args = self._combine_args(seq, shape, stats, xb, weights, handle, bias, mine)
        t_kernel = time.perf_counter()
        self._launched(stats, family.combine(args, shape, prefix, handle))
        stats.kernel = time.perf_counter() - t_kernel
        self._cross_server(stats)
        stats.local_rows = int(mine.sent[me])
        stats.local_bytes = stats.local_rows * xb.shape[1]
        stats.sent_rows = num_recv - stats.local_rows
        stats.recv_rows = int(mine.sent.sum())
        stats.extra.update(credit_wait=credit_wait, num_recv=num_recv, row_bytes=xb.shape[1],
                           hidden_bytes=xb.shape[1])
        stats.wall = time.perf_counter() - start
        self._last[COMBINE] = seq
        self.history.append(stats)
        return CombineResult(args.out_x, args.out_weights)

    def _combine_weights(self, topk_weights, num_recv: int) -> np.ndarray | None:
        """combine's ``topk_weights`` (``[num_recv, K] float32``, more rows allowed), checked; or None."""
        if topk_weights is None:
            return None
        w = np.asarray(topk_weights)
        if w.ndim != 2 or w.shape[0] < num_recv or w.shape[1] != self.num_topk or w.dtype != np.float32:
            raise ValueError(f"pe {self.me}: combine: topk_weights must be [{num_recv}, {self.num_topk}] "
                             f"float32, got {w.shape} {w.dtype}")
        return np.ascontiguousarray(w[:num_recv])

    def _combine_args(self, seq: int, shape: Shape, stats: CallStats, xb: np.ndarray, weights, handle,
                      bias, mine: RankRows) -> CombineArgs:
        """What the combine kernel's blocks read: where each row goes back to, the outputs, the reduction's split."""
        me, n_tok = self.me, handle.num_tokens
        out_w = self._pool.take((n_tok, self.num_topk), np.float32) if weights is not None else None
        return CombineArgs(
            me=me, n_pes=self.n_pes, seq=seq, views=self.views, lanes=self.lanes, plan=shape.plan, stats=stats,
            aggregate=self._schedule.aggregate, region_offsets=self.offsets, xb=xb, weights=weights,
            recv_lo=mine.recv_lo, recv_channel_start=np.asarray(handle.recv_channel_prefix_matrix, np.int64),
            dest_base=rows_before_rank(handle.rank_prefix_matrix, me), back_base=np.cumsum(mine.sent) - mine.sent,
            back_rows=mine.sent, send_head=handle.send_head,
            bounds=channel_bounds(n_tok, shape.blocks), zero_row=self.views["combine_x"].shape[0] - 1,
            out_x=self._pool.take((n_tok, self.hidden), bf16), out_weights=out_w, scratch=self._scratch,
            recv_rows=mine.recv, bias=self._bias(bias, n_tok))

    # --- helpers ---------------------------------------------------------------------------------------------

    @property
    def split_blocks(self) -> bool:
        """Whether a batched fullmesh call of C channels runs on C blocks (True) or on block 0 alone (False)."""
        return self.lanes.split_blocks

    @split_blocks.setter
    def split_blocks(self, value: bool) -> None:
        self.lanes.split_blocks = bool(value)

    def _launched(self, stats: CallStats, blocks: int) -> None:
        """Note the main kernel's block count (what the family launched) and the setting that chose it."""
        stats.blocks_launched = blocks
        stats.split_blocks = self.lanes.split_blocks

    def _cross_server(self, stats: CallStats) -> None:
        """Hidden-row bytes this PE sent to PEs of other servers (of the Buffer's topology)."""
        other = self.topology.server != self.topology.server[self.me]
        stats.cross_server_bytes = int(stats.peer_hidden_bytes[other].sum())

    def _scratch(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``block``'s reduction scratch (made once, then reused: no page faults per call)."""
        found = self._scratches.get(block)
        if found is None:
            found = self._scratches[block] = (np.zeros((REDUCE_CHUNK, self.hidden), np.float32),
                                              np.zeros((REDUCE_CHUNK, self.hidden), np.uint16))
        return found

    def _check_open(self) -> None:
        if self.closed:
            raise shmemx.ClosedError(f"pe {self.me}: this moe.Buffer was closed")

    def _give_credits(self, seq: int) -> None:
        """Zero copy: tell every source of dispatch ``seq`` that its rows here may be overwritten."""
        # every source, also those that sent nothing: each waits for every peer's word
        sources = np.delete(self.peers.pes, self.me)
        shmemx.aclshmemx_signal_op_many(self.views["credits"][DISPATCH, self.me, 0:1], seq, shmemx.ACLSHMEM_SIGNAL_SET,
                                        sources)
        self._owed = []

    def _next(self, kind: int) -> tuple[int, float]:
        """The next call's sequence number, after every peer's credit for the previous call of ``kind``."""
        self._seq += 1
        t = time.perf_counter()
        prev = self._last[kind]
        if kind == DISPATCH and self.zero_copy and prev:  # the last dispatch's rows are no longer read
            self._give_credits(prev)
        if prev and self.n_pes > 1:
            shmemx.aclshmem_wait_until_all(self.views["credits"][kind, :, 0], GE, prev,
                                           status=(np.arange(self.n_pes) == self.me).astype(np.int32))
        return self._seq, time.perf_counter() - t

    def _payload(self, x) -> Payload:
        """dispatch's ``x`` (bfloat16, or a quantised pair with its scales), checked, as row bytes."""
        scales = None
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ValueError(f"pe {self.me}: dispatch: x must be a bfloat16 array or a pair (data, scales), "
                                 f"got a sequence of {len(x)}")
            data, scales = np.asarray(x[0]), np.asarray(x[1])
            if data.dtype not in (np.dtype(np.int8), np.dtype(ml_dtypes.float8_e4m3fn)):
                raise TypeError(f"pe {self.me}: dispatch: quantised x must be int8 or float8_e4m3fn, got "
                                f"{data.dtype}")
        else:
            data = np.asarray(x)
            if data.dtype != np.dtype(bf16):
                raise TypeError(f"pe {self.me}: dispatch: x must be bfloat16 [T, H] or a pair (int8/float8_e4m3fn "
                                f"[T, H], float32 scales [T, H/128]), got {data.dtype}")
        if data.ndim != 2 or data.shape[1] != self.hidden:
            raise ValueError(f"pe {self.me}: dispatch: x must be [num_tokens, {self.hidden}], got {data.shape}")
        n_tok = data.shape[0]
        if n_tok > self.max_tokens:
            raise ValueError(f"pe {self.me}: dispatch: {n_tok} tokens, more than max_tokens={self.max_tokens} of "
                             f"this Buffer (make the Buffer with a larger max_tokens)")
        if scales is not None:
            cols = -(-self.hidden // 128)
            if scales.shape != (n_tok, cols):
                raise ValueError(f"pe {self.me}: dispatch: scales must be [{n_tok}, {cols}] float32, got "
                                 f"{scales.shape}")
            scales = np.ascontiguousarray(scales, np.float32)
        data = np.ascontiguousarray(data)
        return Payload(data.view(np.uint8).reshape(n_tok, self.hidden * data.itemsize), _KINDS[data.dtype],
                        data.dtype, scales)

    def _topk(self, n_tok, topk_idx, topk_weights):
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError(f"pe {self.me}: dispatch: give topk_idx and topk_weights together, or neither")
        if topk_idx is None:
            return None, None
        idx = check_topk_idx(topk_idx, self.num_experts)
        if idx.shape != (n_tok, self.num_topk):
            raise ValueError(f"pe {self.me}: dispatch: topk_idx must be [{n_tok}, {self.num_topk}], got {idx.shape}")
        w = np.asarray(topk_weights)
        if w.shape != idx.shape or w.dtype != np.float32:
            raise ValueError(f"pe {self.me}: dispatch: topk_weights must be [{n_tok}, {self.num_topk}] float32, "
                             f"got {w.shape} {w.dtype}")
        return np.ascontiguousarray(idx), np.ascontiguousarray(w)

    def _layout(self, n_tok, per_rank, in_rank, per_expert, topk_idx) -> DispatchLayout:
        if per_rank is None and in_rank is None and per_expert is None:
            if topk_idx is None:
                raise ValueError(f"pe {self.me}: fresh dispatch needs num_tokens_per_rank, is_token_in_rank and "
                                 f"num_tokens_per_expert (get_dispatch_layout), or topk_idx to compute them")
            return self.get_dispatch_layout(topk_idx)
        if per_rank is None or in_rank is None or per_expert is None:
            raise ValueError(f"pe {self.me}: dispatch: give num_tokens_per_rank, is_token_in_rank and "
                             f"num_tokens_per_expert together")
        in_rank = np.asarray(in_rank)
        if in_rank.shape != (n_tok, self.n_pes) or in_rank.dtype != bool:
            raise ValueError(f"pe {self.me}: dispatch: is_token_in_rank must be [{n_tok}, {self.n_pes}] bool, got "
                             f"{in_rank.shape} {in_rank.dtype}")
        per_rank = np.asarray(per_rank)
        if per_rank.shape != (self.n_pes,) or (per_rank != in_rank.sum(0)).any():
            raise ValueError(f"pe {self.me}: dispatch: num_tokens_per_rank {per_rank.tolist()} does not match "
                             f"is_token_in_rank (column sums {in_rank.sum(0).tolist()})")
        per_expert = np.asarray(per_expert)
        if per_expert.shape != (self.num_experts,):
            raise ValueError(f"pe {self.me}: dispatch: num_tokens_per_expert must be [{self.num_experts}], got "
                             f"{per_expert.shape}")
        return DispatchLayout(per_rank.astype(np.int32), None, per_expert.astype(np.int32),
                              np.ascontiguousarray(in_rank))

    def _bias(self, bias, n_tok: int) -> np.ndarray | None:
        """combine's ``bias`` (one ``[T, H] bfloat16`` or a pair) as their float32 sum, or None."""
        if bias is None:
            return None
        parts = [np.asarray(b) for b in (bias if isinstance(bias, (tuple, list)) else (bias,)) if b is not None]
        for b in parts:
            if b.shape != (n_tok, self.hidden) or b.dtype != np.dtype(bf16):
                raise ValueError(f"pe {self.me}: combine: bias must be [{n_tok}, {self.hidden}] bfloat16, got "
                                 f"{b.shape} {b.dtype}")
        if not parts:
            return None
        total = parts[0].astype(np.float32)
        for b in parts[1:]:
            total += b.astype(np.float32)
        return total

    def _combine_rows(self, x, num_recv: int) -> np.ndarray:
        data = np.asarray(x)
        if data.dtype != np.dtype(bf16) or data.ndim != 2 or data.shape[1] != self.hidden \
                or data.shape[0] < num_recv:
            raise ValueError(f"pe {self.me}: combine: x must be [{num_recv}, {self.hidden}] bfloat16 (the "
                             f"dispatch's rows), got {data.shape} {data.dtype}")
        data = np.ascontiguousarray(data[:num_recv])
        return data.view(np.uint8).reshape(num_recv, 2 * self.hidden)

    def close(self) -> None:
        """Free the workspace (collective; idempotent)."""
        if not self.closed:
            self.closed = True
            for family in self._families.values():
                family.close()
            self.slots.close()
            shmemx.aclshmem_free(self._block)

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"moe.Buffer(pe {self.me}/{self.n_pes}, max_tokens={self.max_tokens}, hidden={self.hidden}, "
                f"num_topk={self.num_topk}, num_experts={self.num_experts}, channels={self.num_channels}, "
                f"qp_num={self.qp_num}, [{self._schedule}])")


def _compact_channel_counts(dests: np.ndarray, num_channels: int, n_pes: int) -> np.ndarray:
    """``[P, C] int64`` tokens channel c sends to rank r, from the compact plan ``dests [T, K]`` (no mask)."""
    n_tok = dests.shape[0]
    per = -(-n_tok // num_channels) if n_tok else 1
    ch = np.broadcast_to((np.arange(n_tok) // per)[:, None], dests.shape)
    ok = dests >= 0
    flat = np.bincount(dests[ok].astype(np.int64) * num_channels + ch[ok], minlength=n_pes * num_channels)
    return flat.reshape(n_pes, num_channels).astype(np.int64)

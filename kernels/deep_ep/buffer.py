"""``shmemx.deep_ep.Buffer``: DeepEP's legacy ``Buffer`` (names, argument order, return tuples) on shmemx.

Three engines behind one surface, chosen as DeepEP chooses them:

* intranode (the job fits one server, P <= server_size): ``intranode.Intranode`` on ``moe.Buffer``;
* internode (P > server_size, P a multiple of it): ``internode.Internode``, seed 003's notify_dispatch and the
  two-tier dispatch / combine (UDMA between servers, MTE within one);
* low latency (``low_latency_dispatch`` / ``low_latency_combine``): ``low_latency.LowLatency``.

What differs from DeepEP, and why (see also the README's "Coming from DeepEP"):

* ``group=None`` means the whole job; a torch.distributed group (or an mpi4py ``comm``) is accepted when it spans
  the job's ranks in the job's order. When shmemx is not initialised yet, the constructor initialises it, with a
  heap that holds ``num_nvl_bytes + num_rdma_bytes`` and the QPs ``num_qps_per_rank`` asks for (at most 32).
* Every call returns after its work completed: events are complete (``EventOverlap``), so ``previous_event``,
  ``async_finish`` and ``allocate_on_comm_stream`` are accepted, checked as DeepEP checks them, and change
  nothing; ``Config`` and ``num_sms`` have no effect (no SMs, no ring buffers).
* ``num_nvl_bytes`` (and ``num_rdma_bytes`` internode) bound the normal-mode workspace: a dispatch moves whole
  per-destination ranges, not chunks through a ring, so the bytes bound the tokens per rank (the error names the
  size needed); ``num_rdma_bytes`` must hold the low-latency workspace (``get_low_latency_rdma_size_hint``).
* numpy arrays in, numpy out; torch CPU tensors in, torch CPU tensors out (``tensors``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import shmemx
from shmemx.kernels import moe

from shmemx.kernels.moe.peers import Peers

from . import config as _config
from . import team as _team
from .config import Config
from .event import EventHandle, EventOverlap
from .handles import InternodeHandle, IntranodeHandle, LowLatencyHandle
from .intranode import Intranode
from .kernel_times import record, timed
from .tensors import Converter, TensorLike, to_numpy

__all__ = ["Buffer", "SERVER_SIZE_ENV"]

SERVER_SIZE_ENV = "SHMEMX_SERVER_SIZE"
NormalHandle = IntranodeHandle | InternodeHandle  # a normal-mode dispatch's handle (the job's kind)
_HEAP_MARGIN = 64 << 20  # heap bytes beyond the two buffers: small allocations of the job and the kernels
_MAX_QPS = 32


def _check_bytes(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"deep_ep.Buffer: {name} must be an integer number of bytes >= 0, got {value!r}")
    return int(value)


def _event(previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> EventOverlap:
    """Check the stream arguments as DeepEP does; they change nothing here (every call completes)."""
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise TypeError(f"previous_event must be an EventOverlap (Buffer.capture()), got {type(previous_event)}")
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError("allocate_on_comm_stream=True needs previous_event and async_finish=True (as in DeepEP)")
    return EventOverlap(EventHandle())


def _timed_hook(kernel: str, hook):
    """A receive hook whose call is recorded as one more ``kernel`` (DeepEP's hooked receive is a kernel of its
    own)."""
    if hook is None:
        return None

    def timed_hook() -> None:
        with timed(kernel):
            hook()

    return timed_hook


class Buffer:
    """DeepEP's communication buffer. Collective: every rank of the job constructs it with the same arguments.

    Args:
        group: None (the whole job), or a torch.distributed process group spanning the job in rank order.
        num_nvl_bytes: bytes for normal-mode communication within a server (bounds the tokens per rank).
        num_rdma_bytes: bytes for communication between servers, and for low-latency mode.
        low_latency_mode: the buffer is meant for ``low_latency_dispatch`` / ``low_latency_combine``.
        num_qps_per_rank: UDMA QPs per peer when this constructor initialises shmemx (at most 32). Low-latency
            mode wants one per local expert (DeepEP's docstring); experts beyond the job's QPs share them
            (local expert e on QP ``e % qp_num``).
        allow_nvlink_for_low_latency_mode, allow_mnnvl: accepted, no effect.
        explicitly_destroy: ``destroy()`` must be called (else the workspaces live until finalize).
        enable_shrink: low-latency shrink mode: a rank that stops answering within ``SHMEMX_SHRINK_TIMEOUT``
            seconds (default 3) of a dispatch, combine or clean is masked (``low_latency_query_mask_buffer``) and
            skipped from then on, as DeepEP masks a failed rank, instead of a timeout error.
        use_fabric: keyword-only (DeepEP's later constructors' flag); accepted, no effect.
        comm: an mpi4py communicator instead of ``group``.
        server_size: ranks per server (DeepEP's NUM_MAX_NVL_PEERS, 8); keyword-only; default: the
            ``SHMEMX_SERVER_SIZE`` environment variable, else 8. A job of more ranks runs internode.
        num_channels: channels (AIV blocks) of the normal-mode kernels; keyword-only; default: moe.Buffer's.

    Raises:
        HeapExhaustedError: the heap cannot hold ``num_nvl_bytes + num_rdma_bytes``.
        ValueError: a group that is not the job, a server size that does not divide the ranks.
    """

    num_sms: int = 20

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm: Any = None, *,
                 use_fabric: bool = False, server_size: int | None = None, num_channels: int | None = None):
        self.num_nvl_bytes = _check_bytes("num_nvl_bytes", num_nvl_bytes)
        self.num_rdma_bytes = _check_bytes("num_rdma_bytes", num_rdma_bytes)
        if isinstance(num_qps_per_rank, bool) or not isinstance(num_qps_per_rank, (int, np.integer)) \
                or num_qps_per_rank < 1:
            raise ValueError(f"deep_ep.Buffer: num_qps_per_rank must be an integer >= 1, got {num_qps_per_rank!r}")
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        self.num_qps_per_rank = int(num_qps_per_rank)
        size = self._server_size(server_size)
        self._attach(group, comm)
        self.rank, self.group_size = self.peers.me, self.peers.n_pes  # ranks in the group's team
        self.group = group
        self.server_size = min(size, self.group_size)
        if self.group_size % self.server_size:
            raise ValueError(f"pe {self.rank}: deep_ep.Buffer: {self.group_size} ranks are not a whole number of "
                             f"servers of {self.server_size} (server_size, or {SERVER_SIZE_ENV})")
        self.num_rdma_ranks = self.group_size // self.server_size
        self.rdma_rank, self.nvl_rank = divmod(self.rank, self.server_size)
        self._check_heap()
        self.num_channels = num_channels
        self._normal = None
        self._low_latency = None
        self._raw: dict = {}
        self._mask = np.zeros(self.group_size, np.int32)  # shrink mode: 1 = a rank masked (never answers)
        self.destroyed = False
        if self.enable_shrink:  # the low-latency workspace now: later calls must not be collective over the job
            self._ll_engine()

    # --- construction ------------------------------------------------------------------------------------------

    @staticmethod
    def _server_size(server_size) -> int:
        if server_size is None:
            server_size = int(os.environ.get(SERVER_SIZE_ENV) or _config.NUM_MAX_NVL_PEERS)
        if isinstance(server_size, bool) or not isinstance(server_size, (int, np.integer)) or server_size < 1:
            raise ValueError(f"deep_ep.Buffer: server_size must be an integer >= 1, got {server_size!r}")
        return int(server_size)

    def _attach(self, group, comm) -> None:
        """Initialise shmemx when nobody did (heap and QPs for this buffer), then resolve the group to a team
        (``team.resolve``); an mpi4py ``comm`` must be the whole job."""
        if not shmemx.is_initialized():
            shmemx.aclshmemx_set_qp_num(shmemx.ACLSHMEM_DATA_OP_UDMA, min(self.num_qps_per_rank, _MAX_QPS))
            shmemx.init(min_heap_size=self.num_nvl_bytes + self.num_rdma_bytes + _HEAP_MARGIN)
        me, n = shmemx.my_pe(), shmemx.n_pes()
        if comm is not None:
            got = (int(comm.Get_rank()), int(comm.Get_size()))
            if got != (me, n):
                raise ValueError(f"pe {me}: deep_ep.Buffer: the comm has this process as rank {got[0]} of {got[1]}; "
                                 f"a comm must span the whole job in its order (pe {me} of {n}): pass a "
                                 f"torch.distributed group or a shmemx team for a sub-group")
        self.team, self._own_team = _team.resolve(group)
        self.peers = Peers.of(self.team)

    def _check_heap(self) -> None:
        need = self.num_nvl_bytes + self.num_rdma_bytes
        info = shmemx.heap_info()
        if need > info.largest_free:
            raise shmemx.HeapExhaustedError(
                f"pe {self.rank}: deep_ep.Buffer(num_nvl_bytes={self.num_nvl_bytes}, num_rdma_bytes="
                f"{self.num_rdma_bytes}) needs {need} B of symmetric heap, the heap has {info.largest_free} B free "
                f"(of {info.size}): start the job with --heap-size {-(-(need + _HEAP_MARGIN) // 2**20)}M or more, "
                f"or let deep_ep.Buffer initialise shmemx (it sizes the heap)")

    def destroy(self) -> None:
        """Free the workspaces (collective; needs ``explicitly_destroy=True``, as in DeepEP)."""
        if not self.explicitly_destroy:
            raise ValueError("deep_ep.Buffer.destroy: the Buffer was made without explicitly_destroy=True")
        self._release()

    def _release(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        for engine in (self._normal, self._low_latency):
            if engine is not None:
                engine.close()
        self._normal = self._low_latency = None
        for raw in self._raw.values():
            shmemx.aclshmem_free(raw)
        self._raw = {}
        if self._own_team:
            shmemx.aclshmem_team_destroy(self.team)
            self._own_team = False

    def _check_alive(self) -> None:
        if self.destroyed:
            raise shmemx.ClosedError(f"pe {self.rank}: this deep_ep.Buffer was destroyed")

    # --- static helpers, as in DeepEP --------------------------------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: FP8 (float8_e4m3fn) payloads are supported."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's SM count for the default configs (even); no effect on the kernels here."""
        if new_num_sms % 2:
            raise ValueError(f"set_num_sms: the SM count must be even, got {new_num_sms}")
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the "current stream" (complete)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes the low-latency mode needs in ``num_rdma_bytes`` (DeepEP's formula)."""
        return _config.low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return _config.dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return _config.combine_config(num_ranks, Buffer.num_sms)

    def get_comm_stream(self) -> None:
        """None: there are no streams; every call completes before it returns."""
        return None

    def get_local_buffer_tensor(self, dtype: Any, size: tuple[int, ...] | None = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> TensorLike:
        """The raw communication buffer of this rank as a 1-D tensor of ``dtype`` from element ``offset`` on (a view
        of the symmetric heap), or its first ``size`` elements shaped ``size``; ``use_rdma_buffer``: the
        ``num_rdma_bytes`` buffer instead of the ``num_nvl_bytes`` one. Kind: a torch tensor for a torch dtype,
        else a numpy array. Differs from DeepEP: the kernels' workspaces are allocations of their own, so these
        bytes are a separate heap allocation of the buffer's size, made at the first call (collective then; the
        heap must hold it beside the workspaces: ``--heap-size``)."""
        self._check_alive()
        from .tensors import torch_module  # (never imports torch)

        nbytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        raw = self._raw_buffer(bool(use_rdma_buffer), nbytes)
        torch = torch_module()
        if torch is not None and isinstance(dtype, torch.dtype):
            tensor = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            tensor = tensor[:nbytes // dtype.itemsize * dtype.itemsize].view(dtype)[offset:]
        else:
            dt = np.dtype(dtype)
            tensor = raw[:nbytes // dt.itemsize * dt.itemsize].view(dt)[offset:]
        if size is None:
            return tensor
        shape = tuple(size)
        count = int(np.prod(shape)) if shape else 1
        if count > tensor.shape[0]:
            raise ValueError(f"pe {self.rank}: get_local_buffer_tensor: {shape} needs {count} elements, the buffer "
                             f"has {tensor.shape[0]} from offset {offset}")
        return tensor[:count].view(*shape) if hasattr(tensor, "numel") else tensor[:count].reshape(shape)

    def _raw_buffer(self, rdma: bool, nbytes: int) -> np.ndarray:
        """The ``nbytes`` heap bytes behind ``get_local_buffer_tensor`` (allocated on first use; collective)."""
        key = "rdma" if rdma else "nvl"
        if key not in self._raw:
            self._raw[key] = shmemx.aclshmem_malloc(max(nbytes, 1), name=f"deep_ep.{key}_buffer", prefault=False)
        return self._raw[key]

    def get_num_rdma_ranks(self) -> int:
        return self.num_rdma_ranks

    def get_rdma_rank(self) -> int:
        return self.rdma_rank

    def get_root_rdma_rank(self, global_rank: bool) -> int:
        return self.nvl_rank if global_rank else 0

    # --- normal mode -------------------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: TensorLike, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """Where each token goes (local).

        Args:
            topk_idx: ``[T, K] int64``, -1 = no expert.
            num_experts: E, a multiple of the ranks.

        Returns:
            ``(num_tokens_per_rank [P] int32, num_tokens_per_rdma_rank [N] int32 or None (one server),
            num_tokens_per_expert [E] int32, is_token_in_rank [T, P] bool, event)``.
        """
        self._check_alive()
        event = _event(previous_event, async_finish, allocate_on_comm_stream)
        conv = Converter(topk_idx)
        server = self.server_size if self.num_rdma_ranks > 1 else None
        lay = moe.get_dispatch_layout(to_numpy(topk_idx, "topk_idx"), num_experts, self.group_size,
                                      server_size=server)
        return (*conv.out(tuple(lay)), event)

    def _sub_group_refused(self, what: str) -> None:
        if not self.peers.world:
            raise NotImplementedError(f"pe {shmemx.my_pe()}: deep_ep.Buffer on a sub-group ({self.group_size} of "
                                      f"{shmemx.n_pes()} PEs): {what} runs on the whole job only; a sub-group runs "
                                      f"intranode normal mode (docs/deepep.md)")

    def _normal_engine(self):
        if self._normal is None:
            if self.num_rdma_ranks > 1 and self._low_latency is not None:  # both live in num_rdma_bytes
                self._low_latency.close()
                self._low_latency = None
            if self.num_rdma_ranks > 1:
                self._sub_group_refused("internode dispatch/combine")
                from .internode import Internode  # internode machinery only for jobs that span servers

                self._normal = Internode(self.rank, self.group_size, self.server_size, self.num_nvl_bytes,
                                         self.num_rdma_bytes, self.num_channels)
            else:
                self._normal = Intranode(self.num_nvl_bytes, self.num_channels, peers=self.peers)
        return self._normal

    def dispatch(self, x: TensorLike | tuple, handle: NormalHandle | None = None,
                 num_tokens_per_rank: TensorLike = None, num_tokens_per_rdma_rank: TensorLike = None,
                 is_token_in_rank: TensorLike = None, num_tokens_per_expert: TensorLike = None,
                 topk_idx: TensorLike = None, topk_weights: TensorLike = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Config | None = None, previous_event: EventOverlap | None = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """Send each token to the ranks of its experts (collective), intranode or internode.

        Args:
            x: ``[T, H] bfloat16``, or ``(float8_e4m3fn [T, H], float32 scales [T, H/128])`` (the scales may be
                strided, e.g. column-major).
            handle: the handle of an earlier dispatch: a cached dispatch (same routing, no notify; top-k must
                be None).
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert: the layout
                (``get_dispatch_layout``).
            topk_idx: ``[T, K] int64``; topk_weights: ``[T, K] float32``; both or neither.
            expert_alignment: round each local expert's count up to a multiple of this.
            num_worst_tokens: > 0: outputs of exactly this many rows (tail: top-k -1), an empty list.
            config, previous_event, async_finish, allocate_on_comm_stream: accepted (see the module docstring).

        Returns:
            ``(recv_x or (recv_x, recv_x_scales), recv_topk_idx, recv_topk_weights,
            num_recv_tokens_per_expert_list, handle, event)``; rows grouped by source rank, token order within a
            source; cached: ``(recv_x, None, None, None, None, event)``.
        """
        self._check_alive()
        event = _event(previous_event, async_finish, allocate_on_comm_stream)
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"dispatch: config must be a deep_ep.Config, got {type(config).__name__}")
        conv = Converter(x, topk_idx, topk_weights, is_token_in_rank)
        payload = tuple(to_numpy(v, "x") for v in x) if isinstance(x, (tuple, list)) else to_numpy(x, "x")
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("dispatch: a cached dispatch (handle given) takes no topk_idx / topk_weights")
            handle = self._numpy_handle(handle)
        engine = self._normal_engine()
        args = [to_numpy(a) for a in (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                      topk_weights)]
        if self.num_rdma_ranks > 1:
            args.insert(1, to_numpy(num_tokens_per_rdma_rank))
        t0 = time.perf_counter()
        recv_x, recv_idx, recv_w, counts, new_handle = engine.dispatch(payload, handle, *args, int(expert_alignment),
                                                                        int(num_worst_tokens))
        self._record_normal("dispatch", time.perf_counter() - t0, engine, "cached_notify" if handle is not None
                            else "notify_dispatch")
        if handle is not None:
            return conv.out(recv_x), None, None, None, None, event
        return (conv.out(recv_x), conv.out(recv_idx), conv.out(recv_w), counts,
                type(new_handle)(*conv.out(tuple(new_handle))), event)

    def combine(self, x: TensorLike, handle: NormalHandle, topk_weights: TensorLike = None,
                bias: TensorLike | tuple = None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple:
        """Send every received row back to its token and sum there, without weights (collective).

        Args:
            x: ``[n, H] bfloat16``, aligned with the dispatch's recv_x.
            handle: the dispatch's handle.
            topk_weights: ``[n, K] float32`` summed back the same way, or None.
            bias: None, one ``[T, H] bfloat16`` or a pair, added to every token's sum (first, in float32).

        Returns:
            ``(combined_x [T, H] bfloat16, combined_topk_weights [T, K] float32 or None, event)``.
        """
        self._check_alive()
        event = _event(previous_event, async_finish, allocate_on_comm_stream)
        conv = Converter(x, topk_weights)
        bias_np = None
        if bias is not None:
            bias_np = tuple(to_numpy(b, "bias") for b in bias) if isinstance(bias, (tuple, list)) \
                else to_numpy(bias, "bias")
        engine, t0 = self._normal_engine(), time.perf_counter()
        combined, weights = engine.combine(to_numpy(x, "x"), self._numpy_handle(handle),
                                           to_numpy(topk_weights, "topk_weights"), bias_np)
        self._record_normal("combine", time.perf_counter() - t0, engine, "cached_notify")
        return conv.out(combined), conv.out(weights), event

    @staticmethod
    def _record_normal(kernel: str, seconds: float, engine, notify: str) -> None:
        """The kernel times of a normal-mode call (``kernel_times``): the notify part, where the engine times it
        apart (internode), then the rest under ``kernel``."""
        times = getattr(engine, "last_times", None) or {}
        if "notify" in times:
            record(notify, times["notify"])
            seconds -= times["notify"]
        record(kernel, max(seconds, 0.0))

    def internode_dispatch(self, *args: Any, **kwargs: Any) -> tuple:
        """DeepEP's internode entry point (``dispatch`` picks it when the job spans servers)."""
        if self.num_rdma_ranks == 1:
            raise ValueError(f"pe {self.rank}: internode_dispatch: this job is one server of {self.server_size}")
        return self.dispatch(*args, **kwargs)

    def internode_combine(self, *args: Any, **kwargs: Any) -> tuple:
        if self.num_rdma_ranks == 1:
            raise ValueError(f"pe {self.rank}: internode_combine: this job is one server of {self.server_size}")
        return self.combine(*args, **kwargs)

    def _numpy_handle(self, handle):
        kind = InternodeHandle if self.num_rdma_ranks > 1 else IntranodeHandle
        if not isinstance(handle, tuple) or len(handle) != len(kind._fields):
            raise TypeError(f"pe {self.rank}: expected the {len(kind._fields)}-field handle of a "
                            f"{'internode' if kind is InternodeHandle else 'intranode'} dispatch, got "
                            f"{type(handle).__name__}")
        return kind(*(to_numpy(f, "handle") for f in handle))

    # --- low-latency mode --------------------------------------------------------------------------------------

    def _ll_engine(self):
        if self._low_latency is None:
            self._sub_group_refused("low-latency mode")
            from .low_latency import SHRINK_TIMEOUT_ENV, LowLatency

            if self.num_rdma_ranks > 1 and self._normal is not None:  # both live in num_rdma_bytes: one at a time
                self._normal.close()
                self._normal = None

            timeout = float(os.environ.get(SHRINK_TIMEOUT_ENV) or 3.0) if self.enable_shrink else None
            self._low_latency = LowLatency(self.rank, self.group_size, self.num_rdma_bytes, mask=self._mask,
                                           shrink_timeout=timeout)
        return self._low_latency

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency signals (collective; DeepEP needs it after normal-mode use)."""
        self._check_alive()
        self._ll_engine().clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: TensorLike, topk_idx: TensorLike, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: TensorLike = None,
                             dispatch_wait_recv_cost_stats: TensorLike = None, use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> tuple:
        """DeepEP's low-latency dispatch (collective); see ``low_latency.LowLatency.dispatch``.

        Returns:
            ``(recv_x, recv_count [E_loc] int32, handle, event, hook)``: recv_x is
            ``[E_loc, P * N_max, H] bfloat16``, or with ``use_fp8`` ``(float8_e4m3fn [E_loc, P * N_max, H],
            scales [E_loc, P * N_max, H/128] float32 (column-major))`` (UE8M0: int32 ``[.., H/512]``); only the first
            ``recv_count[e]`` rows of expert e are valid; hook: call it to receive (``return_recv_hook``).
        """
        self._check_alive()
        if async_finish and return_recv_hook:
            raise ValueError("low_latency_dispatch: async_finish and return_recv_hook exclude each other")
        conv = Converter(x, topk_idx, cumulative_local_expert_recv_stats)
        with timed("dispatch"):
            out = self._ll_engine().dispatch(
            to_numpy(x, "x"), to_numpy(topk_idx, "topk_idx"), int(num_max_dispatch_tokens_per_rank), int(num_experts),
            stats=to_numpy(cumulative_local_expert_recv_stats), wait_stats=to_numpy(dispatch_wait_recv_cost_stats),
                use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, return_recv_hook=return_recv_hook)
        recv_x, recv_count, handle, hook = out
        hook = _timed_hook("dispatch", hook)
        handle = LowLatencyHandle(*conv.out(tuple(handle[:2])), *handle[2:])
        return conv.out(recv_x), conv.out(recv_count), handle, EventOverlap(EventHandle()), hook

    def low_latency_combine(self, x: TensorLike, topk_idx: TensorLike, topk_weights: TensorLike,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False, out: TensorLike = None,
                            combine_wait_recv_cost_stats: TensorLike = None) -> tuple:
        """DeepEP's low-latency combine (collective, weighted); see ``low_latency.LowLatency.combine``.

        Returns:
            ``(combined_x [T, H] bfloat16, event, hook)``.
        """
        self._check_alive()
        if async_finish and return_recv_hook:
            raise ValueError("low_latency_combine: async_finish and return_recv_hook exclude each other")
        conv = Converter(x, topk_idx, topk_weights, out)
        h = LowLatencyHandle(*(to_numpy(f) if i < 2 else f for i, f in enumerate(handle)))
        with timed("combine"):
            combined, hook = self._ll_engine().combine(
                to_numpy(x, "x"), to_numpy(topk_idx, "topk_idx"), to_numpy(topk_weights, "topk_weights"), h,
                use_logfmt=use_logfmt, zero_copy=zero_copy, return_recv_hook=return_recv_hook,
                out=to_numpy(out, "out"), wait_stats=to_numpy(combine_wait_recv_cost_stats))
        hook = _timed_hook("combine", hook)
        result = out if out is not None else conv.out(combined)
        return result, EventOverlap(EventHandle()), hook

    # --- shrink mode: the mask buffer --------------------------------------------------------------------------

    def _check_shrink(self, call: str) -> None:
        self._check_alive()
        if not self.enable_shrink:
            raise ValueError(f"pe {self.rank}: {call}: the Buffer was made without enable_shrink=True")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``: neither send to nor wait for it) or unmask a rank, on this rank (local)."""
        self._check_shrink("low_latency_update_mask_buffer")
        if not 0 <= int(rank_to_mask) < self.group_size:
            raise ValueError(f"pe {self.rank}: low_latency_update_mask_buffer: rank {rank_to_mask} is not in 0.."
                             f"{self.group_size - 1}")
        self._mask[int(rank_to_mask)] = int(bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: TensorLike) -> None:
        """Write the mask of every rank (1 = masked: it missed a shrink-mode deadline, or was masked by hand) into
        ``mask_status [num_ranks] int32`` (in place)."""
        self._check_shrink("low_latency_query_mask_buffer")
        out = to_numpy(mask_status, "mask_status")
        if out.shape != (self.group_size,):
            raise ValueError(f"pe {self.rank}: low_latency_query_mask_buffer: mask_status must be [{self.group_size}],"
                             f" got {out.shape}")
        out[...] = self._mask

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (local)."""
        self._check_shrink("low_latency_clean_mask_buffer")
        self._mask[...] = 0

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> TensorLike:
        """The send buffer of the next ``low_latency_combine`` (``[E_loc, P * N_max, H] bfloat16``, a view of the
        symmetric heap): fill it and pass ``zero_copy=True`` to skip the copy."""
        self._check_alive()
        h = LowLatencyHandle(*(to_numpy(f) if i < 2 else f for i, f in enumerate(handle)))
        view = self._ll_engine().next_combine_buffer(h)
        return Converter(handle[0]).out(view)

    def __repr__(self) -> str:
        mode = "internode" if self.num_rdma_ranks > 1 else "intranode"
        return (f"deep_ep.Buffer(rank {self.rank}/{self.group_size}, {mode}, server_size={self.server_size}, "
                f"num_nvl_bytes={self.num_nvl_bytes}, num_rdma_bytes={self.num_rdma_bytes}, "
                f"low_latency_mode={self.low_latency_mode})")

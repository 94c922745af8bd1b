"""CUDA on the CPU, for ``shmemx run --deepep``: what DeepEP's scripts ask of ``torch.cuda`` answered by the CPU.

Mapped (the only changes made to torch, all in this rank process, once):

* devices: every ``device='cuda'`` / ``'cuda:N'`` / ``torch.device('cuda')`` / an integer device given to a torch
  function, ``Tensor.to('cuda')`` and ``Tensor.cuda()`` mean the CPU (a ``TorchFunctionMode``);
  ``torch.set_default_device('cuda')`` sets the CPU; ``Tensor.record_stream`` and ``Tensor.pin_memory`` return at
  once (one memory, no streams); a ``torch.zeros`` of 64 MiB or more is served by untouched zero pages (calloc),
  as a GPU zeroes its own memory (DeepEP's tests allocate 16 GiB of scratch to flush caches).
* ``torch.cuda``: ``synchronize``, ``set_device``, ``current_device`` (0), ``device_count`` (the job's ranks),
  ``get_device_name``, ``get_device_properties`` (a name and ``multi_processor_count``), ``empty_cache``,
  ``manual_seed`` / ``manual_seed_all`` (the CPU generator is torch's one), ``_sleep`` (no GPU to keep busy);
  ``Event`` (``record``, ``wait``, ``query``, ``synchronize``, ``elapsed_time`` in ms from the wall clock),
  ``Stream`` / ``current_stream`` / ``default_stream`` / ``stream(...)`` (one in-order stream: every call has
  completed when it returns, so waits return at once).
* ``torch.distributed``: backend ``'nccl'`` (in ``init_process_group`` and ``new_group``) becomes ``'gloo'``;
  ``device_id`` is dropped; ``all_gather_into_tensor`` takes nccl's stacked output ``[P, *shape]`` too (gloo
  only the concatenated one), and float8 tensors (as their bytes: gloo has no float8).

Refused, with ``NotImplementedError`` naming the call: CUDA graphs (``torch.cuda.CUDAGraph``, ``graph``,
``make_graphed_callables``) and the memory statistics (``memory_allocated``, ``max_memory_allocated``,
``memory_reserved``, ``max_memory_reserved``, ``reset_peak_memory_stats``, ``mem_get_info``, ``memory_stats``):
there is no device memory to report and no graph to capture. ``torch.cuda.is_available()`` stays False (torch's
own code asks it before touching a GPU). Anything else of ``torch.cuda`` is torch's own (on a CPU build it
raises torch's "not compiled with CUDA" error).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = ["install", "Event", "Stream", "REFUSED"]

REFUSED = ("CUDAGraph", "graph", "make_graphed_callables", "memory_allocated", "max_memory_allocated",
           "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats", "mem_get_info", "memory_stats")
_CPU = torch.device("cpu")
_installed = False


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu(device):
    return _CPU if _is_cuda(device) else device


class _CudaOnCpu(TorchFunctionMode):
    """Every CUDA device a torch function is given means the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _RETURN_SELF:
            return args[0]
        if func is _RECORD_STREAM:
            return None
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is _TO:
            args = (args[0], *(_CPU if isinstance(a, (str, torch.device)) and _is_cuda(a) else a for a in args[1:]))
        if func is torch.zeros:
            big = _lazy_zeros(args, kwargs)
            if big is not None:
                return big
        return func(*args, **kwargs)


def _lazy_zeros(args, kwargs):
    """A large ``torch.zeros`` on untouched zero pages (calloc), or None for torch's own path: DeepEP's tests
    allocate GPU-sized scratch (``torch.zeros((131072, 32768), dtype=torch.int)`` = 16 GiB, to flush caches) that a
    GPU zeroes in its own memory; on the host torch would write every page. Same values, same dtype and shape."""
    if set(kwargs) - {"dtype", "device"} or not args:
        return None
    shape = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    if not all(isinstance(d, int) for d in shape):
        return None
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    count = 1
    for d in shape:
        count *= d
    nbytes = count * dtype.itemsize
    if nbytes < _LAZY_ZEROS_BYTES:
        return None
    return torch.from_numpy(np.zeros(nbytes, np.uint8)).view(dtype).view(shape)


_LAZY_ZEROS_BYTES = 64 << 20


_RETURN_SELF = {torch.Tensor.cuda, torch.Tensor.pin_memory}
_RECORD_STREAM = torch.Tensor.record_stream
_TO = torch.Tensor.to


class Event:
    """``torch.cuda.Event``: the wall-clock time of ``record()``; always complete."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False):
        self.enable_timing = enable_timing
        self.t: float | None = None

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def wait(self, stream=None) -> None:
        """Nothing to wait for: the work before ``record`` has completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "Event") -> float:
        """Milliseconds from this event's ``record`` to ``end``'s."""
        if self.t is None or end.t is None:
            raise RuntimeError("torch.cuda.Event.elapsed_time: both events must be recorded first")
        return (end.t - self.t) * 1e3


class Stream:
    """``torch.cuda.Stream``: the one in-order stream of a rank (every call completes before it returns)."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device, self.priority = _CPU, priority

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record()
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _StreamContext:
    def __init__(self, stream=None):
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc) -> None:
        pass


class _Properties:
    def __init__(self) -> None:
        self.name = "shmemx CPU"
        self.multi_processor_count = 20  # DeepEP's default SM count (Buffer.num_sms)
        self.total_memory = 0
        self.major, self.minor = 9, 0  # what DeepEP checks for FP8 (SM90)


def _refuse(name: str):
    def refused(*args, **kwargs):
        raise NotImplementedError(f"shmemx run --deepep: torch.cuda.{name} has no CPU mapping (no device memory "
                                  f"to report, no CUDA graph to capture); see docs/deepep.md")

    refused.__name__ = name
    return refused


_DEFAULT_STREAM = Stream()


def _patch_cuda() -> None:
    c = torch.cuda
    answers = {
        "synchronize": lambda device=None: None,
        "set_device": lambda device: None,
        "current_device": lambda: 0,
        "device_count": lambda: int(os.environ.get("SHMEMX_SIZE", "1")),
        "get_device_name": lambda device=None: "shmemx CPU",
        "get_device_properties": lambda device=None: _Properties(),
        "empty_cache": lambda: None,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "_sleep": lambda cycles: None,
        "Event": Event,
        "Stream": Stream,
        "current_stream": lambda device=None: _DEFAULT_STREAM,
        "default_stream": lambda device=None: _DEFAULT_STREAM,
        "stream": _StreamContext,
    }
    for name, value in answers.items():
        setattr(c, name, value)
    for name in REFUSED:
        setattr(c, name, _refuse(name))


def _patch_distributed() -> None:
    init, new_group = dist.init_process_group, dist.new_group

    def init_process_group(backend=None, *args, **kwargs):
        kwargs.pop("device_id", None)
        return init(_gloo(backend), *args, **kwargs)

    def new_group_gloo(ranks=None, timeout=None, backend=None, *args, **kwargs):
        return new_group(ranks, timeout, _gloo(backend), *args, **kwargs)

    dist.init_process_group, dist.new_group = init_process_group, new_group_gloo
    gather = dist.all_gather_into_tensor

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if output_tensor.dim() == input_tensor.dim() + 1:  # the stacked form nccl takes: [P, *shape]
            output_tensor = output_tensor.view(-1, *input_tensor.shape[1:]) if input_tensor.dim() \
                else output_tensor.view(-1)
        if input_tensor.dtype in _BYTE_TYPES:  # gloo has no float8: gather the bytes (the same bytes)
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return gather(output_tensor, input_tensor, group=group, async_op=async_op)

    dist.all_gather_into_tensor = all_gather_into_tensor


_BYTE_TYPES = {getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
               if hasattr(torch, name)}


def _gloo(backend):
    return "gloo" if backend is None or str(backend).lower() in ("nccl", "cuda:nccl") else backend


def install() -> None:
    """Map CUDA onto the CPU in this process (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    _patch_cuda()
    _patch_distributed()
    set_default_device = torch.set_default_device
    torch.set_default_device = lambda device: set_default_device(_cpu(device))
    _CudaOnCpu().__enter__()  # for the life of the rank

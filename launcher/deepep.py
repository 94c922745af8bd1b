"""``shmemx run --deepep``: run DeepEP's own scripts unchanged on the job's ranks.

What the mode does in every rank, before the script runs (``install``):

* ``import deep_ep`` (and ``deep_ep.X.Y``) resolves to shmemx's implementation, ``shmemx.deep_ep`` (a finder
  first on ``sys.meta_path`` aliases the names, so a DeepEP checkout's own ``deep_ep/`` folder is never
  imported even when it is on the path);
* CUDA means the CPU (``cuda_cpu``: devices, ``torch.cuda``, streams and events, nccl -> gloo);
* ``torch.multiprocessing.spawn(fn, args, nprocs)`` runs ``fn(local_rank, *args)`` in this rank, where the job's
  rank r is local rank ``r % nprocs`` of node ``r // nprocs`` (DeepEP's scripts spawn one process per GPU of a
  node; the launcher already started one process per rank). It sets ``WORLD_SIZE`` (nodes) and ``RANK`` (this
  node), DeepEP's meaning of them, and ``SHMEMX_SERVER_SIZE = nprocs`` (a node is a server) when not set;
* one torch thread per rank (2 cores for 8-16 ranks: torch's spinning pool would starve the engines).

And in the launcher (``rank_env``): ``MASTER_ADDR`` / ``MASTER_PORT`` (a free port of this host, one per job, for
torch.distributed's rendezvous), ``WORLD_SIZE`` / ``RANK`` from the server size, before the script reads them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import socket
import sys

__all__ = ["install", "rank_env", "free_port", "DEEPEP_ENV"]

DEEPEP_ENV = "SHMEMX_DEEPEP"
_TARGET = "shmemx.deep_ep"
_SERVER_SIZE_ENV = "SHMEMX_SERVER_SIZE"


def free_port() -> int:
    """A TCP port of this host free now (the job's torch.distributed rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, n: int, port: int) -> dict:
    """The DeepEP variables of job rank ``rank`` of ``n`` (``SHMEMX_SERVER_SIZE`` ranks per node, default 8)."""
    per_node = min(int(os.environ.get(_SERVER_SIZE_ENV) or 8), n)
    return {DEEPEP_ENV: "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(max(n // per_node, 1)), "RANK": str(rank // per_node)}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``deep_ep[.X]`` is ``shmemx.deep_ep[.X]``: the same module objects under both names."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deep_ep" and not fullname.startswith("deep_ep."):
            return None
        real = _TARGET + fullname[len("deep_ep"):]
        if importlib.util.find_spec(real) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=real)

    def create_module(self, spec):
        return importlib.import_module(spec.origin)

    def exec_module(self, module) -> None:
        pass  # imported under its real name by create_module


def _spawn(fn, args=(), nprocs: int = 1, join: bool = True, daemon: bool = False, start_method: str = "spawn"):
    """``torch.multiprocessing.spawn`` on the job: ``fn(local_rank, *args)`` here, once."""
    rank, n = int(os.environ.get("SHMEMX_RANK", "0")), int(os.environ.get("SHMEMX_SIZE", "1"))
    if nprocs < 1 or n % nprocs:
        raise ValueError(f"pe {rank}: torch.multiprocessing.spawn(nprocs={nprocs}) under shmemx run --deepep: the "
                         f"job's {n} ranks are not whole nodes of {nprocs} processes (run -n a multiple of "
                         f"{nprocs}, e.g. -n {nprocs})")
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(n // nprocs), str(rank // nprocs)
    os.environ.setdefault(_SERVER_SIZE_ENV, str(nprocs))
    fn(rank % nprocs, *args)
    return None if join else _Joined()


class _Joined:
    """What ``spawn(join=False)`` returns: the work has run."""

    def join(self, timeout=None) -> bool:
        return True


def install() -> None:
    """Set up this rank process for a DeepEP script (see the module docstring)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
    for name in [m for m in sys.modules if m == "deep_ep" or m.startswith("deep_ep.")]:
        del sys.modules[name]
    try:
        import torch
    except ImportError:
        raise RuntimeError("shmemx run --deepep needs torch (pip install 'shmemx[torch]'): DeepEP's scripts are "
                           "torch scripts") from None
    from . import cuda_cpu

    cuda_cpu.install()
    torch.set_num_threads(1)
    torch.multiprocessing.spawn = _spawn

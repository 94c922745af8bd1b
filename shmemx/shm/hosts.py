"""Which PEs share a host: the job's host map.

A job may span several hosts (``shmemx run --hosts``). Each host is its own shared-memory domain: its own
control segment, its PEs' heaps and queues, its own launcher; nothing is mapped across hosts. A host is a server
of the topology model: its PEs are consecutive, ``counts[h]`` of them on host ``h``. The launcher tells each rank
the map (``SHMEMX_HOSTS``: the PE counts of every host, comma-separated) and its host (``SHMEMX_HOST``); a job
without them is one host of every PE, the single-host job as it always was.

Each host's segments carry the host in their job id (``<job>.h<k>``, ``host_job_id``), so that emulated hosts on
one machine never share a segment and tools still find every segment of the job under ``shmemx_<job>``.
"""

from __future__ import annotations

from collections.abc import Iterable

import bisect
import os

__all__ = ["HostMap", "HOSTS_ENV", "HOST_ENV", "host_job_id", "base_job_id"]

HOSTS_ENV = "SHMEMX_HOSTS"
HOST_ENV = "SHMEMX_HOST"


def host_job_id(job_id: str, host: int) -> str:
    """The job id of host ``host``'s part of job ``job_id`` (its segments' names carry it)."""
    return f"{job_id}.h{host}"


def base_job_id(job_id: str) -> str:
    """The job a host part belongs to (``abc.h1`` -> ``abc``); a single-host job's id is its own."""
    head, sep, tail = job_id.rpartition(".h")
    return head if sep and tail.isdigit() else job_id


class HostMap:
    """The hosts of a job: ``counts[h]`` PEs on host ``h`` (consecutive PEs), this process on host ``index``."""

    __slots__ = ("counts", "index", "starts", "n_pes", "multi")

    def __init__(self, counts: Iterable[int], index: int = 0):
        self.counts = [int(c) for c in counts]
        if not self.counts or min(self.counts) < 1:
            raise ValueError(f"host map {counts!r}: every host needs at least one PE")
        if not 0 <= index < len(self.counts):
            raise ValueError(f"host index {index} outside the {len(self.counts)} hosts")
        self.index = index
        self.starts = [sum(self.counts[:h]) for h in range(len(self.counts))]
        self.n_pes = sum(self.counts)
        self.multi = len(self.counts) > 1  # a job of several hosts (a plain attribute: hot paths test it)

    @classmethod
    def from_env(cls, n_pes: int) -> "HostMap":
        text = os.environ.get(HOSTS_ENV)
        if not text:
            return cls([n_pes], 0)
        hosts = cls([int(c) for c in text.split(",")], int(os.environ.get(HOST_ENV, "0")))
        if hosts.n_pes != n_pes:
            raise ValueError(f"{HOSTS_ENV}={text!r} counts {hosts.n_pes} PEs, the job has {n_pes}")
        return hosts

    @classmethod
    def even(cls, n_pes: int, n_hosts: int, index: int = 0) -> "HostMap":
        """``n_pes`` PEs over ``n_hosts`` hosts, as evenly as they go (the first hosts take the remainder)."""
        if not 1 <= n_hosts <= n_pes:
            raise ValueError(f"{n_hosts} hosts for {n_pes} PEs: need 1 <= hosts <= PEs")
        q, r = divmod(n_pes, n_hosts)
        return cls([q + (h < r) for h in range(n_hosts)], index)

    @property
    def n_hosts(self) -> int:
        return len(self.counts)

    def host_of(self, pe: int) -> int:
        return bisect.bisect_right(self.starts, pe) - 1

    def pes(self, host: int | None = None) -> range:
        """The PEs of ``host`` (default: this process's)."""
        h = self.index if host is None else host
        return range(self.starts[h], self.starts[h] + self.counts[h])

    def local(self, pe: int) -> bool:
        """Whether PE ``pe`` is on this process's host (its memory is mapped here)."""
        s = self.starts[self.index]
        return s <= pe < s + self.counts[self.index]

    def env(self) -> dict:
        return {HOSTS_ENV: ",".join(map(str, self.counts)), HOST_ENV: str(self.index)}

    def __repr__(self) -> str:
        return f"HostMap({self.counts}, host {self.index})"

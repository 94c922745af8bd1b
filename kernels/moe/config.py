"""``Config``: a ``Buffer``'s settings in one object, as DeepEP's ``Config`` makes its choices explicit.

``moe.Buffer(T, H, K, E, config)`` takes one, and ``moe.Buffer(T, H, K, E, num_channels=4, ...)`` the same
settings as keywords (they replace the config's, or the defaults'). Every setting has the same default on every
host: a kernel's shape never depends on the machine it runs on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["Config"]


@dataclass(frozen=True)
class Config:
    """A ``Buffer``'s settings (see ``Buffer`` for each one's meaning).

    Attributes:
        num_channels: C, AIV blocks (channels) of the dispatch and combine kernels (default 1: level with 4 on
            the reference machine and the one that needs the fewest QPs).
        qp_num: QPs per peer the buffer may use (None: what ``qp_policy`` needs).
        qp_policy, rotate, aggregate: the initial ``Schedule`` (``Buffer.set_schedule`` changes it).
        server_size: ranks per server for ``num_tokens_per_rdma_rank`` (None: one server).
        history: how many recent ``CallStats`` to keep.
        zero_copy: dispatch returns ``recv_x`` as a view of the workspace's receive rows.
        schedule: the kernel family: ``"fullmesh"``, ``"groups"`` or ``"hierarchy"``.
        topology: a ``Topology`` or a rank table for one (None: servers of ``server_size`` ranks).
        routing: ``"scan"`` or ``"compact"``.
        group_width, token_blocks, weight_blocks: the groups schedule's settings (None: its defaults).
        shared_lanes: ``"batch"`` or ``"rounds"``: how channels that share a lane post on it.
        split_blocks: the C channels of a batched fullmesh call on C blocks (True) or on block 0 alone (False).
    """

    num_channels: int = 1
    qp_num: int | None = None
    qp_policy: str = "one"
    rotate: bool = True
    aggregate: bool = False
    server_size: int | None = None
    history: int = 16
    zero_copy: bool = False
    schedule: str = "fullmesh"
    topology: object = None
    routing: str = "scan"
    group_width: int | None = None
    token_blocks: int | None = None
    weight_blocks: int | None = None
    shared_lanes: str = "batch"
    split_blocks: bool = False

    @classmethod
    def of(cls, config: "Config | None", options: dict, me: int) -> "Config":
        """``config`` (or the defaults) with the keyword ``options`` of a ``Buffer`` call in place of its values;
        TypeError naming an option that is not a setting."""
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"pe {me}: moe.Buffer: config must be a moe.Config, got {type(config).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"pe {me}: moe.Buffer: unknown setting(s) {', '.join(unknown)}; the settings are "
                            f"{', '.join(sorted(names))}")
        return dataclasses.replace(config or cls(), **options)

"""How a job runs, apart from what it runs: one frozen record for ``launch``, ``run_hosts`` and ``shmemx run``.

``launch(n, target, args, options=None, **overrides)`` and ``run_hosts(..., options=None, **overrides)`` take the
same ``RunOptions``; a keyword of either call overrides the field of that name (``launch(4, f, timeout=30)`` is
``launch(4, f, options=RunOptions(timeout=30))``). An unknown keyword is a ``TypeError`` naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, TextIO

__all__ = ["RunOptions"]


@dataclass(frozen=True)
class RunOptions:
    """The options of a run (``launch`` documents each; ``shmemx run --help`` the flags that set them).

    Attributes:
        module: the target is a module name (``python -m``), not a script path or a function.
        heap_size: heap bytes per PE (int or "64M"); None: 1 GiB (sparse).
        timeout: stop the job after this many seconds (exit 124) and report what every PE waits on.
        tag_output: prefix every output line with ``[pe N]``.
        env: extra environment variables for the ranks.
        stdout, stderr: text streams for the ranks' output and the launcher's messages (None: sys's).
        trace: write a Chrome trace-event JSON to this path.
        record: write a recording for ``shmemx replay`` to this path.
        stats: print every PE's counters when the job ends.
        dump_dir: where a post-mortem dump goes (None: ``$SHMEMX_DUMP_DIR`` or the current directory).
        dump: write a post-mortem dump at all (the diagnosis is printed either way).
        check: run the protocol sanitizer (``--check``).
        chaos: a seed (int) for the seeded jitter of kernel threads, or "random" to pick one (printed).
        deepep: DeepEP mode (``--deepep``, ``launcher.deepep``).
    """

    module: bool = False
    heap_size: int | str | None = None
    timeout: float | None = None
    tag_output: bool = True
    env: Mapping[str, object] | None = None
    stdout: TextIO | None = None
    stderr: TextIO | None = None
    trace: str | None = None
    record: str | None = None
    stats: bool = False
    dump_dir: str | None = None
    dump: bool = True
    check: bool = False
    chaos: int | str | None = None
    deepep: bool = False

    @classmethod
    def of(cls, options: RunOptions | None, overrides: Mapping[str, object], caller: str) -> RunOptions:
        """``options`` (default: every field's default) with the fields named in ``overrides`` replaced; a name
        that is not a field is a TypeError of ``caller``."""
        base = cls() if options is None else options
        if not isinstance(base, cls):
            raise TypeError(f"{caller}() options must be a RunOptions, got {type(base).__name__}")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
        return dataclasses.replace(base, **overrides) if overrides else base

"""CANN's logger: ``aclshmemx_set_log_level`` and ``aclshmemx_set_extern_logger``, and the messages shmemx logs.

Levels 0 debug, 1 info, 2 warn, 3 error, 4 fatal; the default is error. As in CANN, the environment variable
``SHMEM_LOG_LEVEL`` (DEBUG, INFO, WARN, ERROR, FATAL) takes precedence over the level a program sets. A message at
or above the level goes to the external logger when one is set (``func(level, msg)``), else to stderr as
``shmemx pe 3 [INFO] ...``. shmemx logs team creation and destruction (info), failed stream operations (error)
and ``aclshmem_global_exit`` (error); its errors are raised as exceptions as well, whatever the level.
"""

from __future__ import annotations

import enum
import os
import sys
from collections.abc import Callable

__all__ = ["aclshmemx_set_log_level", "aclshmemx_set_extern_logger", "LogLevel", "log"]


class LogLevel(enum.IntEnum):
    DEBUG = 0
    INFO = 1
    WARN = 2
    ERROR = 3
    FATAL = 4


_state = {"level": LogLevel.ERROR, "logger": None}


def _level() -> int:
    env = os.environ.get("SHMEM_LOG_LEVEL", "").upper()
    return LogLevel[env] if env in LogLevel.__members__ else _state["level"]


def aclshmemx_set_log_level(level: int) -> int:
    """Log messages of ``level`` (0 debug .. 4 fatal) and above; returns 0."""
    if isinstance(level, bool) or not isinstance(level, int) or level not in set(LogLevel):
        raise ValueError(f"aclshmemx_set_log_level: level {level!r} is not 0 (debug) .. 4 (fatal)")
    _state["level"] = LogLevel(level)
    return 0


def aclshmemx_set_extern_logger(func: Callable[[int, str], object] | None) -> int:
    """Send log messages to ``func(level, msg)`` instead of stderr (None: back to stderr); returns 0."""
    if func is not None and not callable(func):
        raise TypeError(f"aclshmemx_set_extern_logger: func must be callable(level, msg), got {func!r}")
    _state["logger"] = func
    return 0


def log(level: LogLevel, pe: int, msg: str) -> None:
    """Log ``msg`` of PE ``pe`` at ``level`` (see the module docstring)."""
    if level < _level():
        return
    logger = _state["logger"]
    if logger is not None:
        logger(int(level), msg)
    else:
        print(f"shmemx pe {pe} [{level.name}] {msg}", file=sys.stderr, flush=True)

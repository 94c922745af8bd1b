"""The rest of CANN's init API: the unique-id bootstrap, the init status, version and name, global exit, the
instance context, the FFTS config.

Every CANN example starts with ``aclshmemx_get_uniqueid`` (on one rank, then sent to the others, e.g. with
torch.distributed) and ``aclshmemx_set_attr_uniqueid_args`` before ``aclshmemx_init_attr``. Here the launcher
bootstraps the job, so the unique id only names it: ``aclshmemx_get_uniqueid`` returns an
``aclshmemx_uniqueid_t`` whose ``internal`` bytes hold this job's id (any rank may call it: all get the same),
``set_attr_uniqueid_args`` writes it with the PE numbers and heap size into an ``InitAttr``, and init checks
that it names this job (a uid of another job is refused, naming both).

One SHMEM instance per process is emulated: ``aclshmemx_finalize(0)`` is ``aclshmem_finalize``, the instance
context is instance 0, and other instance ids are refused. ``aclshmem_global_exit(status)`` stops the job: it
marks this PE failed with a note, aborts the job (every other PE's next wait raises, naming this PE) and exits
with ``status``. ``util_get_ffts_config`` / ``util_set_ffts_config`` (the device's cross-core sync base for
barriers in MIX kernels) have nothing to configure here: the config is 0 and setting it is accepted.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import runtime as _runtime
from ..runtime import InitAttr, is_initialized, runtime
from ..shm.control import JobState, PeStatus
from .log import LogLevel, log

__all__ = [
    "ACLSHMEM_STATUS_NOT_INITIALIZED", "ACLSHMEM_STATUS_SHM_CREATED", "ACLSHMEM_STATUS_IS_INITIALIZED",
    "ACLSHMEM_STATUS_INVALID", "ACLSHMEMX_INIT_WITH_MPI", "ACLSHMEMX_INIT_WITH_UNIQUEID", "ACLSHMEM_MAJOR_VERSION",
    "ACLSHMEM_MINOR_VERSION", "ACLSHMEM_MAX_NAME_LEN", "ACLSHMEM_UNIQUE_ID_INNER_LEN", "ACLSHMEM_UNIQUEID_VERSION",
    "aclshmemx_uniqueid_t", "aclshmem_instance_ctx", "aclshmemx_init_status", "aclshmemx_get_uniqueid",
    "aclshmemx_set_attr_uniqueid_args", "aclshmem_info_get_version", "aclshmem_info_get_name",
    "aclshmem_global_exit", "aclshmemx_finalize", "aclshmemx_instance_ctx_get", "aclshmemx_instance_ctx_set",
    "util_get_ffts_config", "util_set_ffts_config", "check_uniqueid", "aclshmemx_set_conf_store_tls",
    "aclshmemx_set_config_store_tls_key", "conf_store_tls", "ConfStoreTls",
]

ACLSHMEM_STATUS_NOT_INITIALIZED, ACLSHMEM_STATUS_SHM_CREATED, ACLSHMEM_STATUS_IS_INITIALIZED = 0, 1, 2
ACLSHMEM_STATUS_INVALID = 2**31 - 1
ACLSHMEMX_INIT_WITH_MPI, ACLSHMEMX_INIT_WITH_UNIQUEID = 1 << 1, 1 << 3
ACLSHMEM_MAJOR_VERSION, ACLSHMEM_MINOR_VERSION = 1, 1
ACLSHMEM_MAX_NAME_LEN = 256
ACLSHMEM_UNIQUE_ID_INNER_LEN = 124
ACLSHMEM_UNIQUEID_VERSION = (1 << 16) + 4 + 4 + 4 + ACLSHMEM_UNIQUE_ID_INNER_LEN  # (1 << 16) + sizeof
_NAME = "ACLSHMEM v1.1.1 (shmemx emulation)"
_STANDALONE = "standalone"  # the job id a process started without the launcher will have (its own, at init)


@dataclass
class aclshmemx_uniqueid_t:
    """``aclshmemx_uniqueid_t``: ``version``, ``my_pe``, ``n_pes``, and ``internal`` bytes (this job's id)."""

    version: int = ACLSHMEM_UNIQUEID_VERSION
    my_pe: int = -1
    n_pes: int = -1
    internal: bytes = field(default=bytes(ACLSHMEM_UNIQUE_ID_INNER_LEN))


@dataclass
class aclshmem_instance_ctx:
    """``aclshmem_instance_ctx``: the instance ``id`` (always 0 here) and a reserved ``instance``."""

    id: int = 0
    instance: object = None


_CTX = aclshmem_instance_ctx()


def _job_of_env() -> str:
    return os.environ.get("SHMEMX_JOB", _STANDALONE)


def aclshmemx_init_status() -> int:
    """``ACLSHMEM_STATUS_IS_INITIALIZED`` while this process is attached to its job, else
    ``ACLSHMEM_STATUS_NOT_INITIALIZED`` (before init and after finalize)."""
    return ACLSHMEM_STATUS_IS_INITIALIZED if is_initialized() else ACLSHMEM_STATUS_NOT_INITIALIZED


def aclshmemx_get_uniqueid(uid: aclshmemx_uniqueid_t | None = None) -> aclshmemx_uniqueid_t:
    """This job's unique id (filled into ``uid`` when given, and returned). Callable before init."""
    uid = aclshmemx_uniqueid_t() if uid is None else uid
    if not isinstance(uid, aclshmemx_uniqueid_t):
        raise TypeError(f"aclshmemx_get_uniqueid: uid must be an aclshmemx_uniqueid_t, got {uid!r}")
    name = _job_of_env().encode()
    uid.version, uid.internal = ACLSHMEM_UNIQUEID_VERSION, name + bytes(ACLSHMEM_UNIQUE_ID_INNER_LEN - len(name))
    return uid


def aclshmemx_set_attr_uniqueid_args(my_pe: int, n_pes: int, local_mem_size: int, uid: aclshmemx_uniqueid_t,
                                     attr: InitAttr) -> int:
    """Write ``my_pe``, ``n_pes``, ``local_mem_size`` and ``uid`` (as ``comm_args``) into ``attr`` for
    ``aclshmemx_init_attr``; returns 0. (Init checks them against the launcher's.)"""
    if not isinstance(uid, aclshmemx_uniqueid_t):
        raise TypeError(f"aclshmemx_set_attr_uniqueid_args: uid must be an aclshmemx_uniqueid_t, got {uid!r}")
    if not isinstance(attr, InitAttr):
        raise TypeError(f"aclshmemx_set_attr_uniqueid_args: attr must be a shmemx.InitAttr, got {attr!r}")
    for name, value in (("my_pe", my_pe), ("n_pes", n_pes), ("local_mem_size", local_mem_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"aclshmemx_set_attr_uniqueid_args: {name} must be a non-negative integer, got "
                             f"{value!r}")
    uid.my_pe, uid.n_pes = my_pe, n_pes
    attr.my_pe, attr.n_pes, attr.local_mem_size, attr.comm_args = my_pe, n_pes, local_mem_size, uid
    return 0


def check_uniqueid(attr: InitAttr) -> None:
    """Before init: ValueError when ``attr.comm_args`` is a unique id of another job (or of a bad version)."""
    uid = attr.comm_args
    if not isinstance(uid, aclshmemx_uniqueid_t):
        return
    if uid.version != ACLSHMEM_UNIQUEID_VERSION:
        raise ValueError(f"aclshmemx_init_attr: unique id version {uid.version:#x}, expected "
                         f"{ACLSHMEM_UNIQUEID_VERSION:#x}")
    named = bytes(uid.internal).rstrip(b"\0").decode(errors="replace")
    if named != _job_of_env():
        raise ValueError(f"aclshmemx_init_attr: the unique id names job {named!r}, this process belongs to job "
                         f"{_job_of_env()!r} (get the uid with aclshmemx_get_uniqueid in this job)")
    if attr.instance_id != 0:
        raise ValueError(f"aclshmemx_init_attr: instance_id {attr.instance_id} (only instance 0 is emulated)")


def aclshmem_info_get_version() -> tuple[int, int]:
    """``(major, minor)`` of the SHMEM API (CANN writes them through two pointers)."""
    return ACLSHMEM_MAJOR_VERSION, ACLSHMEM_MINOR_VERSION


def aclshmem_info_get_name() -> str:
    """The vendor name string (at most ``ACLSHMEM_MAX_NAME_LEN - 1`` characters)."""
    return _NAME[:ACLSHMEM_MAX_NAME_LEN - 1]


def aclshmem_global_exit(status: int) -> None:
    """Stop every PE of the job and exit this process with ``status`` (see the module docstring). Never returns."""
    rt = runtime()
    note = f"pe {rt.my_pe} called aclshmem_global_exit({status})"
    log(LogLevel.ERROR, rt.my_pe, note)
    me = rt.ctl.pes[rt.my_pe]
    me["error"] = note.encode()[:511]
    rt.ctl.header["failed_pe"] = rt.my_pe
    rt.ctl.header["state"] = JobState.ABORTING
    me["status"] = PeStatus.FAILED
    for peer in range(rt.n_pes):  # wake every sleeper: their waits see the abort now, not at their backstop
        rt.ctl.wake(peer)
    sys.stdout.flush()
    sys.stderr.flush()
    _runtime.abandon()
    os._exit(int(status) & 0xFF)


def aclshmemx_finalize(instance_id: int = 0) -> int:
    """Finalize instance ``instance_id`` (collective): instance 0 is ``aclshmem_finalize``; returns 0."""
    if instance_id != 0:
        raise ValueError(f"aclshmemx_finalize: instance {instance_id!r} does not exist (one instance, 0, is "
                         f"emulated)")
    return _runtime.finalize()


def aclshmemx_instance_ctx_get() -> aclshmem_instance_ctx:
    """The current instance context (instance 0)."""
    return _CTX


def aclshmemx_instance_ctx_set(instance_id: int) -> int:
    """Select instance ``instance_id``: 0 (returns 0); others raise (one instance is emulated)."""
    if instance_id != 0:
        raise ValueError(f"aclshmemx_instance_ctx_set: instance {instance_id!r} does not exist (one instance, 0, "
                         f"is emulated)")
    return 0


def util_get_ffts_config() -> int:
    """The FFTS config a MIX kernel passes to ``util_set_ffts_config``: 0 (nothing to configure here)."""
    return 0


def util_set_ffts_config(config: int) -> None:
    """Accepts the FFTS config at a kernel's entry (no effect: the emulated barriers need none)."""
    if isinstance(config, bool) or not isinstance(config, int):
        raise TypeError(f"util_set_ffts_config: config must be an int, got {config!r}")


@dataclass
class ConfStoreTls:
    """What ``aclshmemx_set_conf_store_tls`` and ``aclshmemx_set_config_store_tls_key`` set (kept, no effect)."""

    enable: bool = False
    tls_info: str = ""
    tls_pk: str = ""
    tls_pk_pw: str = ""
    decrypt_handler: Callable[[str], str] | None = None


_TLS = ConfStoreTls()


def _text(call: str, name: str, value: str | bytes | None, length: int) -> str:
    text = (value.decode() if isinstance(value, bytes) else value) or ""
    if not isinstance(text, str):
        raise TypeError(f"{call}: {name} must be str or bytes, got {type(value).__name__}")
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= len(text):
        raise ValueError(f"{call}: {name}_len {length!r} is not 0..{len(text)} (the length of {name})")
    return text[:length]


def aclshmemx_set_conf_store_tls(enable: bool, tls_info: str | bytes | None, tls_info_len: int) -> int:
    """Turn TLS on or off for CANN's TCP config store (before init); returns 0.

    shmemx has no config store to secure (the launcher bootstraps the job over shared memory, or MPI across
    hosts), so the setting is checked and kept (``conf_store_tls()``) and changes nothing. CANN's examples call
    ``aclshmemx_set_conf_store_tls(False, None, 0)`` before init; a port runs it unchanged.
    """
    call = "aclshmemx_set_conf_store_tls"
    info = _text(call, "tls_info", tls_info, tls_info_len) if enable else ""
    if enable and not info:
        raise ValueError(f"{call}: enabling TLS needs tls_info (memfabric's TLS description), got none")
    _TLS.enable, _TLS.tls_info = bool(enable), info
    return 0


def aclshmemx_set_config_store_tls_key(tls_pk: str | bytes, tls_pk_len: int, tls_pk_pw: str | bytes, tls_pk_pw_len: int,
                                       decrypt_handler: Callable[[str], str] | None) -> int:
    """Set the config store's TLS private key, its password and the password's decryptor (before init); returns 0.

    Checked and kept as ``aclshmemx_set_conf_store_tls`` is: ``decrypt_handler(cipher_text) -> plain_text`` must be
    callable (or None when the password is plain).
    """
    call = "aclshmemx_set_config_store_tls_key"
    if decrypt_handler is not None and not callable(decrypt_handler):
        raise TypeError(f"{call}: decrypt_handler must be callable(cipher_text) -> plain_text, got {decrypt_handler!r}")
    _TLS.tls_pk = _text(call, "tls_pk", tls_pk, tls_pk_len)
    _TLS.tls_pk_pw = _text(call, "tls_pk_pw", tls_pk_pw, tls_pk_pw_len)
    _TLS.decrypt_handler = decrypt_handler
    return 0


def conf_store_tls() -> ConfStoreTls:
    """The config store's TLS settings as the two calls above left them."""
    return _TLS

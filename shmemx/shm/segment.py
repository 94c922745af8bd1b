"""Named shared-memory segments of a job.

Every segment a job creates lives in ``/dev/shm`` and is named ``shmemx_<job id>_<what>``, so that tools and
people can find a job's segments and prove that none are left behind. Files are created with mode 0600: a job's
memory is readable only by its owner's user.

Ownership: ranks create and map segments but never unlink them; the launcher (``shmemx run`` or ``launch``)
removes every ``shmemx_<job id>_*`` file when the job ends, however it ends. This module does not use
``multiprocessing.shared_memory``: in Python 3.11 its resource tracker registers segments on attach and unlinks
them from under the other ranks at exit (``machine_limits.md`` section 4), and it costs a tracker process.
"""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np
import numpy.typing as npt

from ..errors import HeapExhaustedError
from .atomics import address_of

__all__ = ["SHM_DIR", "Segment", "segment_name", "job_segments", "remove_job_segments", "PAGE_SIZE", "align_up",
           "shm_space", "describe_shm_space"]

SHM_DIR = "/dev/shm"
PAGE_SIZE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11 has no constant for it


def align_up(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return -(-n // alignment) * alignment


def shm_space() -> tuple[int, int]:
    """``(total, free)`` bytes of the file system behind /dev/shm (tmpfs: what can back shared pages)."""
    st = os.statvfs(SHM_DIR)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def describe_shm_space() -> str:
    total, free = shm_space()
    return f"{SHM_DIR} has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB"


def segment_name(job_id: str, what: str) -> str:
    """The file name of a job's segment, e.g. ``shmemx_3f9a1c_heap3``."""
    return f"shmemx_{job_id}_{what}"


def job_segments(job_id: str) -> list[str]:
    """Names of every segment of ``job_id`` present in /dev/shm."""
    prefix = f"shmemx_{job_id}_"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def remove_job_segments(job_id: str) -> list[str]:
    """Unlink every segment of ``job_id``; returns the names removed."""
    removed = []
    for name in job_segments(job_id):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


class Segment:
    """One mapped shared-memory file.

    Args:
        name: file name in /dev/shm (see ``segment_name``).
        size: bytes; required when creating, read from the file when attaching.
        create: create the file (it must not exist) instead of attaching to it.
        readonly: map read-only (inspection tools).
    """

    def __init__(self, name: str, size: int | None = None, *, create: bool = False, readonly: bool = False):
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDONLY if readonly else os.O_RDWR
        if create:
            if not size or size <= 0:
                raise ValueError(f"segment {name}: size must be positive, got {size!r}")
            flags |= os.O_CREAT | os.O_EXCL
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        self.size = size
        self.readonly = readonly
        self.addr = 0 if readonly else address_of(self.mm)
        self.bytes = np.frombuffer(self.mm, dtype=np.uint8)

    def view(self, dtype: npt.DTypeLike, offset: int = 0, shape: int | tuple[int, ...] | None = None) -> np.ndarray:
        """A numpy view of the segment starting at byte ``offset``."""
        dtype = np.dtype(dtype)
        if shape is None:
            shape = ((self.size - offset) // dtype.itemsize,)
        count = int(np.prod(shape))
        arr = np.frombuffer(self.mm, dtype=dtype, count=count, offset=offset)
        return arr.reshape(shape)

    def prefault(self, offset: int = 0, length: int | None = None) -> None:
        """Map the pages of ``[offset, offset+length)`` into this process now, so no copy pays for page faults.

        First touch of tmpfs memory runs at ~1.3 GB/s against ~12 GB/s for a warm copy (machine_limits.md 1).
        """
        if length is None:
            length = self.size - offset
        start = offset - offset % PAGE_SIZE
        length = min(self.size, offset + length) - start
        if length <= 0:
            return
        try:
            self.mm.madvise(_MADV_POPULATE_WRITE, start, length)
        except OSError as exc:
            if exc.errno in (errno.EFAULT, errno.ENOMEM, errno.ENOSPC):  # touching the pages would be SIGBUS
                raise HeapExhaustedError(
                    f"segment {self.name}: {SHM_DIR} cannot back {length} B at +{start:#x} ({describe_shm_space()}): "
                    f"run fewer PEs, a smaller --heap-size, or enlarge {SHM_DIR}") from None
            self._touch(start, length)
        except ValueError:
            self._touch(start, length)

    def zero(self, offset: int, length: int) -> None:
        """Zero ``[offset, offset+length)`` without touching the whole pages inside it: they are punched out of the
        file (``MADV_REMOVE``: freed, and read back as zeros by every process mapping the segment), so a large
        zeroed allocation costs memory only where it is later written. The partial pages at either end are
        written (``memset``); so is everything where the kernel refuses the hole punch."""
        end = min(self.size, offset + length)
        lo, hi = align_up(offset, PAGE_SIZE), end - end % PAGE_SIZE
        if hi - lo < PAGE_SIZE:
            self.bytes[offset:end] = 0
            return
        try:
            self.mm.madvise(mmap.MADV_REMOVE, lo, hi - lo)
        except (OSError, ValueError, AttributeError):
            self.bytes[lo:hi] = 0
        self.bytes[offset:lo] = 0
        self.bytes[hi:end] = 0

    def _touch(self, start: int, length: int) -> None:
        """Older kernels (no MADV_POPULATE_WRITE): touch one byte per page (read then write back the same value)."""
        pages = self.bytes[start:start + length:PAGE_SIZE]
        pages[:] = pages

    def close(self) -> None:
        """Unmap, unless numpy views of it are still alive (then the mapping lives on until they die)."""
        self.bytes = None
        try:
            self.mm.close()
        except BufferError:
            pass

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, size={self.size:#x})"

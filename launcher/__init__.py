"""Process management for shmemx jobs: ``shmemx run`` and its Python form ``launch``."""

from .job import EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_TIMEOUT, Job, launch
from .options import RunOptions

__all__ = ["launch", "RunOptions", "Job", "EXIT_TIMEOUT", "EXIT_INTERRUPTED", "EXIT_TERMINATED"]

"""The protocol sanitizer of ``shmemx run --check``.

The ranks record (``recorder``: posts, quiets, signals, waits, barriers, launches, MTE copies, allocations, and the
kernels' heap reads and writes through ``array.CheckedArray``) into one shared-memory log per PE (``events``);
once the ranks ended, the launcher replays the logs in time-stamp order (``analyze``, with the vector clocks of
``clocks`` and the shadow memory of ``shadow``) and decides every finding from happens-before alone, never from
when the engine happened to run a WQE; ``rules`` says which kind each finding is and what to add, ``report``
words it.
"""

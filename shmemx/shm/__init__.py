"""The shared-memory substrate: named segments, host atomics and futexes, the job's control segment, the
symmetric heap, waits and the barrier. Imports nothing above it (``errors`` aside)."""

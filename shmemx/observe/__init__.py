"""Observation from inside and outside a job: counters, traces, the job reader and dumps. Reads ``shm`` and
``udma``; the recorders are handed to the runtime, never imported by the layers they record."""

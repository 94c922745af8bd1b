"""The public ``aclshmem*`` calls (re-exported by ``shmemx``): host, memory, signals, RMA, UDMA atomics, the raw
WQE path, kernel blocks and inspection. The only layer, with ``runtime``, that reaches the process's runtime."""

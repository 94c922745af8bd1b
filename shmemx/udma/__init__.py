"""The emulated UDMA data plane: WQE/CQE layouts, the UDMA segment (contexts, rings), the local registry, send
and completion queues, the DMA engine, and the plane object that wires them (``plane``). Builds on ``shm``."""

"""The UDMA data plane: this PE's URMA identity, its send/completion queues and its DMA engine.

(Filled in by the data-plane work; the runtime calls these four hooks.)
"""


def create(rt) -> None:
    """Create this PE's queues and URMA identity (before the init barrier)."""


def start(rt) -> None:
    """Resolve peers and start the engine (after the init barrier)."""


def stop(rt) -> None:
    """Stop the engine and unmap the queues."""

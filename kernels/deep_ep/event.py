"""``EventOverlap``: DeepEP's event wrapper. Every shmemx call returns after its work completed, so an event is
complete when it is made: ``current_stream_wait()`` returns at once, and ``with event:`` runs its body (DeepEP
overlaps the body with the communication; here the communication has already happened)."""

from __future__ import annotations

from typing import Callable

__all__ = ["EventHandle", "EventOverlap"]


class EventHandle:
    """A CUDA event's stand-in: always complete (``capture()`` and every call's ``event`` hold one)."""

    def current_stream_wait(self) -> None:
        """Nothing to wait for: the work that made this event has completed."""

    def __repr__(self) -> str:
        return "EventHandle(complete)"


class EventOverlap:
    """DeepEP's ``EventOverlap``.

    Args:
        event: the ``EventHandle`` (None for a call that made none).
        extra_tensors: tensors DeepEP keeps alive until the event is waited on (kept here too, for the same code).
    """

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Callable | None = None
        self._release_handle = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Wait for the event (returns at once), then run a registered hook."""
        if self.event is None:
            raise ValueError("EventOverlap.current_stream_wait: this EventOverlap holds no event")
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook: Callable) -> None:
        if self.hook_after_wait is not None:
            raise ValueError("EventOverlap: a hook is already registered")
        self.hook_after_wait = hook

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """``with event(release_handle=True):``."""
        self._release_handle = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc) -> None:
        if self.event is not None:
            self.current_stream_wait(self._release_handle)
        self._release_handle = False

    def __repr__(self) -> str:
        return f"EventOverlap({self.event!r})"

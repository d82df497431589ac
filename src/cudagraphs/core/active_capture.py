"""[active_capture] The capture in progress in this thread, as code recorded inside it sees it.

:func:`cudagraphs.core.capture.capture_call` sets it for the duration of one recording; code that
adds to that recording from inside (a conditional node's body, recorded on a stream of its own)
reads it to allocate from the same memory pool.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import compat

__all__ = ["ActiveCapture", "active_capture"]


@dataclass
class ActiveCapture:
    """One recording in progress: its memory pool and the device it lives on."""

    pool: Any
    device_index: int
    routes_everything: bool = False
    splitter: Any = None  # segments.Splitter: ends the graph at an eager step

    def route_all_allocations(self) -> None:
        """Serve every allocation on this device (any stream, any thread) from the capture's
        pool until the capture ends.

        The capture itself routes only streams that record into its own graph. A conditional
        node's body is recorded on a stream that records into the node's child graph, so its
        tensors would otherwise come from the general pool: memory the graph does not own,
        which eager code could take while the graph still writes to it. The caching allocator
        keeps one routing per pool, so the capture's is replaced, for the rest of the capture,
        by one that takes every allocation: narrower (this thread only) would miss what
        autograd's device threads allocate for a backward captured later in the same graph.
        The capture's end removes it.
        """
        if self.routes_everything:
            return
        compat.end_allocate_to_pool(self.device_index, self.pool)
        # Takes a reference on the pool, given back by finish() once the capture has ended.
        compat.begin_allocate_to_pool(self.device_index, self.pool)
        self.routes_everything = True

    def finish(self) -> None:
        """After the capture ended (or failed): drop the routing and the reference that
        :meth:`route_all_allocations` took, so the pool lives exactly as long as the graph."""
        if not self.routes_everything:
            return
        # capture_end removes the routing unless it failed before reaching that point.
        with contextlib.suppress(RuntimeError):
            compat.end_allocate_to_pool(self.device_index, self.pool)
        compat.release_pool(self.device_index, self.pool)
        self.routes_everything = False


_active: contextvars.ContextVar[ActiveCapture | None] = contextvars.ContextVar(
    "cudagraphs_active_capture", default=None
)


def active_capture() -> ActiveCapture | None:
    """The recording in progress in this thread, or ``None`` outside one."""
    return _active.get()


@contextlib.contextmanager
def capturing(pool: Any, device_index: int) -> Iterator[ActiveCapture]:
    """Mark a recording into ``pool`` as in progress in this thread for the ``with`` block."""
    active = ActiveCapture(pool, device_index)
    token = _active.set(active)
    try:
        yield active
    finally:
        _active.reset(token)

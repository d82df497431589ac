"""A graph memory pool that several captures share (``cg.Pool``), with its one stream order."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import Notices
from .replay import StreamOrder

__all__ = ["Pool"]


class Pool:
    """A graph memory pool that several captures share.

    Graphs captured into one pool reuse each other's scratch memory, so N graphs cost little
    more than the largest of them. The rule that makes this safe: replay them one at a time, on
    one stream (never concurrently). Each graph's outputs stay reserved for it.

    Right::

        pool = cg.Pool()
        prefill = cg.graph(model.prefill, tokens, pool=pool)
        decode = cg.graph(model.decode, token, pool=pool)

    Wrong: replaying graphs of one pool from two threads at once without a lock of your own.
    From one call to the next, another stream is fine: the replay waits for the last one's.
    """

    def __init__(self) -> None:
        self._handle: Any = None
        self._order: StreamOrder | None = None
        self.captures = 0
        self.bytes = 0
        # The graphs of one pool make up one thing (a decoder's rungs, a set of buckets): a
        # warning they would each give is given once.
        self.notices = Notices()

    def stream_order(self, device: int | None) -> StreamOrder:
        """The one stream order of this pool's graphs (see ``replay.StreamOrder``)."""
        if self._order is None:
            self._order = StreamOrder(device)
        return self._order

    @property
    def handle(self) -> Any:
        """The CUDA pool handle, created on first use (``torch.cuda.graph_pool_handle()``)."""
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle

    def record(self, pool_bytes: int) -> None:
        """Account one capture into this pool."""
        self.captures += 1
        self.bytes += pool_bytes

    def __repr__(self) -> str:
        return f"<cudagraphs.Pool captures={self.captures} MiB={self.bytes / 2**20:.1f}>"

"""Inputs the graph copies in itself: the copy-in recorded as the recording's first nodes.

A call with new tensors must have them copied into the static buffers the graph reads before
the replay. Done with ``Tensor.copy_`` that is a launch of its own in front of the graph's, and
on a small graph that host work adds to latency one for one. Recorded instead as a memcpy node
at the start of the (first) graph, a call only points the node at its tensor (one host call
that edits the instantiated graph; no launch), and the graph's launch does the copy.
``reports/gpu.md`` ("copy-in") has the two side by side.

How a node is kept right, since a node pointed at the wrong memory would copy it silently:

- It is recorded only for a contiguous buffer, as a raw device copy from a same-sized source
  made before the capture (a clone of the example), so it is one memcpy node, found again by
  its two addresses; replays made during the capture (segments) copy the example's values.
- After the capture every node is switched off and the sources are freed.
- Before every replay each node is set: pointed at the call's tensor where that tensor has the
  buffer's bytes (a plain contiguous tensor, no conjugate or negative bit, not overlapping the
  buffer), off otherwise (the tensor is the buffer, or is copied with ``copy_`` first, as
  without nodes). A node is edited only when that changes.
- :class:`InputCopying` is what the rest of the library and the user see as the recording:
  its ``replay()`` switches every node off first, so it replays on what the buffers hold.

Needs ``cuda-bindings`` (the CUDA runtime's graph-editing calls); without it, with
``CUDAGRAPHS_NO_COPY_NODES=1``, or where the nodes are not found after the capture (which is
then made again without them), the copy-in stays ``copy_`` before the replay.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from . import compat
from .graph_edits import (
    Edits,
    check_edit,
    cuda_runtime,
    edit_failed,
    native_edits,
)

__all__ = [
    "CopyNodes",
    "CopyNodesUnavailable",
    "InputCopying",
    "Pending",
    "native_edits",
    "record",
    "sources_for",
]

log = logging.getLogger("cudagraphs")
_Plain = torch.Tensor


class CopyNodesUnavailable(Exception):
    """Internal: the recorded copies could not be found or edited; capture again without."""


class Pending:
    """Copies recorded in a capture in progress, before their nodes are found."""

    def __init__(self, buffers: list[torch.Tensor], sources: list[torch.Tensor], slots: list[int]):
        self.buffers, self.sources, self.slots = buffers, sources, slots


def copyable(x: Any) -> bool:
    """A static buffer whose copy-in can be one memcpy node."""
    return type(x) is _Plain and x.is_cuda and x.is_contiguous() and x.numel() > 0


def sources_for(static: Sequence[Any], slots: Sequence[int]) -> Pending | None:
    """Before a capture: the clones the copies will read, allocated outside the graph's pool
    (``None``: no buffer is copyable, or cuda-bindings is missing)."""
    chosen = [i for i in slots if copyable(static[i])]
    if not chosen or cuda_runtime() is None:
        return None
    buffers = [static[i] for i in chosen]
    with torch.no_grad():
        sources = [b.detach().clone() for b in buffers]
    return Pending(buffers, sources, chosen)


def record(pending: Pending, stream: torch.cuda.Stream) -> None:
    """Right after ``capture_begin`` on ``stream``: the copies, as raw device copies. Not
    ``copy_``: they leave the buffers' version counters alone (a bump would read as the
    function writing its inputs) and are memcpy nodes by construction."""
    runtime = cuda_runtime()
    kind = runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    for buf, src in zip(pending.buffers, pending.sources):
        (err,) = runtime.cudaMemcpyAsync(
            buf.data_ptr(), src.data_ptr(), buf.nbytes, kind, stream.cuda_stream
        )
        check_edit(runtime, err, "recording a copy-in")


class CopyNodes:
    """The copy nodes of one recording: found by address, then kept in a known state."""

    def __init__(self, graph: torch.cuda.CUDAGraph, pending: Pending):
        runtime = cuda_runtime()
        self._edits = Edits(runtime)
        self.slots = pending.slots
        self.buffers = pending.buffers
        self._dst = [b.data_ptr() for b in self.buffers]
        self._nbytes = [b.nbytes for b in self.buffers]
        pairs = zip(self.buffers, pending.sources)
        wanted = {(b.data_ptr(), s.data_ptr()): k for k, (b, s) in enumerate(pairs)}
        self.nodes: list[Any] = [None] * len(self.buffers)
        raw = graph.raw_cuda_graph()
        err, _, count = runtime.cudaGraphGetNodes(raw, 0)
        if err == runtime.cudaError_t.cudaSuccess:
            err, nodes, count = runtime.cudaGraphGetNodes(raw, count)
        if err != runtime.cudaError_t.cudaSuccess:
            raise CopyNodesUnavailable(f"listing the graph's nodes failed: {err}")
        memcpy = runtime.cudaGraphNodeType.cudaGraphNodeTypeMemcpy
        for node in nodes[:count]:
            err, kind = runtime.cudaGraphNodeGetType(node)
            if err != runtime.cudaError_t.cudaSuccess or kind != memcpy:
                continue
            err, params = runtime.cudaGraphMemcpyNodeGetParams(node)
            key = (int(params.dstPtr.ptr), int(params.srcPtr.ptr))
            if err == runtime.cudaError_t.cudaSuccess and key in wanted:
                self.nodes[wanted.pop(key)] = node
        if wanted:
            raise CopyNodesUnavailable(f"{len(wanted)} recorded copy-in(s) not among the nodes")
        self._exec = compat.graph_exec(graph)
        self.state = [1] * len(self.nodes)  # 0: off; else the source address it copies
        self.all_off()  # the sources are freed once this returns

    def apply(self, pointed: list[tuple[int, int]]) -> None:
        """Before a call's replay: the nodes in ``pointed`` (index, source address) copy from
        there, every other node is off."""
        if len(self.nodes) == 1:  # the common case: one input
            if pointed:
                self.point(0, pointed[0][1])
            else:
                self.off(0)
            return
        targets = [0] * len(self.nodes)
        for k, address in pointed:
            targets[k] = address
        for k, address in enumerate(targets):
            if address:
                self.point(k, address)
            else:
                self.off(k)

    def takes(self, k: int, x: torch.Tensor, address: int) -> bool:
        """Whether node ``k`` can copy ``x`` (at ``address``) in: whether copying its bytes
        into the buffer is ``buffer.copy_(x)`` (shape, dtype and device already checked
        equal): a plain contiguous tensor with plain values, not overlapping the buffer, and no
        autograd history for ``copy_`` to record."""
        if type(x) is not _Plain or not x.is_contiguous() or x.is_conj() or x.is_neg():
            return False
        if x.requires_grad:
            return False
        start, n = self._dst[k], self._nbytes[k]
        return start + n <= address or address + n <= start

    def point(self, k: int, address: int) -> None:
        """Node ``k`` copies from ``address`` at the next replays (and is on)."""
        state = self.state[k]
        if state == address:
            return
        edits, node = self._edits, self.nodes[k]
        if not edits.set_source(self._exec, node, self._dst[k], address, self._nbytes[k]):
            edit_failed("pointing a copy-in at the call's tensor")
        if state == 0 and not edits.set_enabled(self._exec, node, True):
            edit_failed("switching a copy-in on")
        self.state[k] = address

    def off(self, k: int) -> None:
        if self.state[k] == 0:
            return
        if not self._edits.set_enabled(self._exec, self.nodes[k], False):
            edit_failed("switching a copy-in off")
        self.state[k] = 0

    def all_off(self) -> None:
        for k in range(len(self.nodes)):
            self.off(k)


class InputCopying:
    """A recording whose first graph holds copy nodes, as everyone but the call path sees it:
    ``replay()`` replays on what the static buffers hold (every node off first), through
    ``launch`` (the recording's own launch)."""

    def __init__(self, recording: Any, copies: CopyNodes, launch: Any):
        self.recording = recording
        self.copies = copies
        self._launch = launch

    def replay(self) -> None:
        self.copies.all_off()
        self._launch()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.recording, name)

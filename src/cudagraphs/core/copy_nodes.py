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
- Where the graph is launched with one C call (``launch.py``: it draws no random numbers) and
  holds only plain nodes, up to ``_SPARES`` more instantiations are kept, each pointed at
  sources a recent call had; a call with those sources launches that one, so nothing is
  edited (an edit costs its call and makes the next launch upload the graph again).
- :class:`InputCopying` is what the rest of the library and the user see as the recording:
  its ``replay()`` launches PyTorch's instantiation with every node off, so it replays on what
  the buffers hold.

Needs ``cuda-bindings`` (the CUDA runtime's graph-editing calls); without it, with
``CUDAGRAPHS_NO_COPY_NODES=1``, or where the nodes are not found after the capture (which is
then made again without them), the copy-in stays ``copy_`` before the replay.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch

from . import compat
from .collectives import distributed_active
from .graph_edits import (
    Edits,
    check_edit,
    cuda_runtime,
    destroy,
    edit_failed,
    instantiate,
    native_edits,
)
from .launch import Launcher

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


_SPARES = 8  # instantiations kept pointed at recent sources, besides PyTorch's own
# Node kinds whose graph can be instantiated more than once with the same meaning. Not:
# memory allocation nodes (one instantiation at a time), conditional nodes and child graphs
# (state or contents of their own), host callbacks.
_PLAIN_NODES = ("Kernel", "Memcpy", "Memset", "Empty")


class CopyNodes:
    """The copy nodes of one recording: found by address, then kept in a known state.

    PyTorch's instantiation of the graph has every node off except while a call points one
    (:meth:`apply`). Where the graph is launched with one C call (``launch.Launcher``) and
    holds only plain nodes, a call whose sources were seen recently launches a spare
    instantiation already pointed at them (at most ``_SPARES``, the least recent re-pointed),
    so that no node is edited and the launch does not re-upload an edited graph: 2.7 µs less per
    call on the H200 with inputs that move (``reports/gpu.md``, "launch").
    """

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
        self._raw = graph.raw_cuda_graph()
        err, _, count = runtime.cudaGraphGetNodes(self._raw, 0)
        if err == runtime.cudaError_t.cudaSuccess:
            err, nodes, count = runtime.cudaGraphGetNodes(self._raw, count)
        if err != runtime.cudaError_t.cudaSuccess:
            raise CopyNodesUnavailable(f"listing the graph's nodes failed: {err}")
        types = runtime.cudaGraphNodeType
        memcpy = types.cudaGraphNodeTypeMemcpy
        plain = {getattr(types, f"cudaGraphNodeType{name}") for name in _PLAIN_NODES}
        self._plain = True
        for node in nodes[:count]:
            err, kind = runtime.cudaGraphNodeGetType(node)
            self._plain = self._plain and err == runtime.cudaError_t.cudaSuccess and kind in plain
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
        self._launcher: Launcher | None = None
        # sources (one address, or a tuple per node, 0: off) -> C launch of a spare pointed there
        self._spares: dict[Any, Any] | None = None
        self._spare_execs: dict[Any, tuple[int, list[int]]] = {}
        self._pointed: list[tuple[int, int]] = []  # the current call's, for on_new_stream

    def attach(self, launcher: Launcher) -> None:
        """The launcher of the graph holding the nodes: spares once it launches directly."""
        self._launcher = launcher
        launcher.on_direct = self._on_direct
        launcher.on_new_stream = self._on_new_stream

    def apply(self, pointed: list[tuple[int, int]]) -> None:
        """Before a call's replay: the nodes in ``pointed`` (index, source address) copy from
        there, every other node is off."""
        self._pointed = pointed
        spares = self._spares
        if spares is not None and pointed:
            key = pointed[0][1] if len(self.nodes) == 1 else self._key(pointed)
            go = spares.get(key)
            if go is None:
                go = self._spare_for(key, pointed)
            if go is not None:
                self._launcher.go = go  # type: ignore[union-attr]
                return
        self._apply_base(pointed)

    def use_base(self) -> None:
        """The next launch is of PyTorch's instantiation, with every node off."""
        self._pointed = []
        self.all_off()
        if self._spares is not None:
            self._launcher.go = self._launcher.base_go  # type: ignore[union-attr]

    def _apply_base(self, pointed: list[tuple[int, int]]) -> None:
        if self._spares is not None:
            self._launcher.go = self._launcher.base_go  # type: ignore[union-attr]
        if len(self.nodes) == 1:  # the common case: one input
            if pointed:
                self.point(0, pointed[0][1])
            else:
                self.off(0)
            return
        for k, address in enumerate(self._targets(pointed)):
            if address:
                self.point(k, address)
            else:
                self.off(k)

    def _targets(self, pointed: list[tuple[int, int]]) -> list[int]:
        targets = [0] * len(self.nodes)
        for k, address in pointed:
            targets[k] = address
        return targets

    def _key(self, pointed: list[tuple[int, int]]) -> tuple[int, ...]:
        return tuple(self._targets(pointed))

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
        """Node ``k`` of PyTorch's instantiation copies from ``address`` at the next replays."""
        self._set(self._exec, self.state, k, address)

    def off(self, k: int) -> None:
        self._set(self._exec, self.state, k, 0)

    def all_off(self) -> None:
        for k in range(len(self.nodes)):
            self.off(k)

    def _set(self, exe: int, state: list[int], k: int, address: int) -> None:
        """Node ``k`` of instantiation ``exe`` copies from ``address`` (0: is off); ``state``
        is what that instantiation's nodes do now (-1: not known), edited only on a change."""
        now = state[k]
        if now == address:
            return
        edits, node = self._edits, self.nodes[k]
        if address == 0:
            if not edits.set_enabled(exe, node, False):
                edit_failed("switching a copy-in off")
        else:
            if not edits.set_source(exe, node, self._dst[k], address, self._nbytes[k]):
                edit_failed("pointing a copy-in at the call's tensor")
            if now <= 0 and not edits.set_enabled(exe, node, True):
                edit_failed("switching a copy-in on")
        state[k] = address

    def _on_direct(self) -> None:
        if self._plain and not distributed_active():
            self._spares = {}

    def _spare_for(self, key: Any, pointed: list[tuple[int, int]]) -> Any:
        """A spare instantiation pointed at ``pointed``: a new one while fewer than
        ``_SPARES`` exist, else the least recently made one, re-pointed. ``None`` (and no
        spares from now on) where another instantiation cannot be made."""
        launcher = self._launcher
        assert launcher is not None and self._spares is not None
        if len(self._spare_execs) < _SPARES:
            made = instantiate(self._raw)
            if made is None:
                log.info("cudagraphs: no spare instantiation of the graph could be made")
                self._spares = None
                return None
            exe, state = made, [-1] * len(self.nodes)  # as recorded: pointed at nothing
            launcher.track()
        else:
            oldest = next(iter(self._spare_execs))
            exe, state = self._spare_execs.pop(oldest)
            del self._spares[oldest]
        for k, address in enumerate(self._targets(pointed)):
            self._set(exe, state, k, address)
        go = launcher.go_for(exe)
        self._spare_execs[key] = (exe, state)
        self._spares[key] = go
        return go

    def _on_new_stream(self) -> None:
        """A launch from another stream while spares were in use (the GPU was waited for):
        from now on only PyTorch's instantiation, pointed at this call's sources."""
        self._spares = None
        self._drop_spares()
        launcher = self._launcher
        assert launcher is not None
        launcher.untrack()
        self._apply_base(self._pointed)

    def _drop_spares(self) -> None:
        for exe, _ in self._spare_execs.values():
            destroy(exe)
        self._spare_execs = {}

    def __del__(self) -> None:
        if sys.is_finalizing():  # the process frees them; the runtime may be torn down already
            return
        with contextlib.suppress(Exception):
            self._drop_spares()


class InputCopying:
    """A recording whose first graph holds copy nodes, as everyone but the call path sees it:
    ``replay()`` replays on what the static buffers hold (PyTorch's instantiation, every node
    off), through ``launch`` (the recording's own launch)."""

    def __init__(self, recording: Any, copies: CopyNodes, launch: Any):
        self.recording = recording
        self.copies = copies
        self._launch = launch

    def replay(self) -> None:
        self.copies.use_base()
        self._launch()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.recording, name)

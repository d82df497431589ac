"""Launching a recorded graph, and the input copies recorded into it.

Launch: one C call where that is the launch ``CUDAGraph.replay()`` makes.
``CUDAGraph.replay()`` is a pybind11 call that releases the GIL, advances the offsets of the
random generators the graph draws from, and calls ``cudaGraphLaunch`` on the current stream of
the graph's device. For a graph that draws no random numbers, the compiled module
(``_before_replay.cpp``) makes the same ``cudaGraphLaunch`` of the same instantiation in one C
call (``reports/gpu.md``, "launch", has the saving), which a small graph's latency pays one
for one. Whether a graph draws is seen, not assumed: its first two
launches go through ``replay()``, and only if neither moved the default generator's seed or
offset (a graph that draws advances the offset at every replay) do later launches take the C
call. Being the one instantiation PyTorch made, its launches stay ordered across streams as
CUDA orders them, and its copy nodes (``copy_nodes``) are edited as before.

Copy nodes: the copy-in recorded as the recording's first nodes. A call with new tensors must have them copied into the static buffers the graph reads before
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

Editing an instantiated CUDA graph (the runtime's calls the copy nodes use): each edit is one C call through the compiled module (``_before_replay.cpp``) and the CUDA
runtime PyTorch loaded, where both are found, else a call through ``cuda-bindings``, which is
needed in any case (the nodes are found through it). Without it, or with
``CUDAGRAPHS_NO_COPY_NODES=1``, no copy nodes are recorded.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import CudaGraphsError, explain
from . import compat
from .guards import compiled_module

__all__ = [
    "CopyNodes",
    "CopyNodesUnavailable",
    "Edits",
    "InputCopying",
    "Launcher",
    "Pending",
    "check_edit",
    "cuda_runtime",
    "direct_launches",
    "edit_failed",
    "loaded_libraries",
    "native_edits",
    "record",
    "runtime_functions",
    "sources_for",
]

log = logging.getLogger("cudagraphs")


def loaded_libraries() -> list[str]:
    """Paths of the shared libraries mapped into this process (Linux), else none."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "/" in line and ".so" in line]
    except OSError:
        return []
    return list(dict.fromkeys(paths))


def runtime_functions(*names: str) -> tuple[int, ...] | None:
    """The addresses of CUDA runtime functions in the ``libcudart`` this process loaded
    (PyTorch's), or ``None`` where it or one of them is not found."""
    path = next((p for p in loaded_libraries() if "libcudart.so" in p), None)
    if path is None:
        return None
    try:
        library = ctypes.CDLL(path)  # already loaded: the same library, not a second copy
        pointers = [ctypes.cast(getattr(library, n), ctypes.c_void_p).value for n in names]
    except (OSError, AttributeError) as error:
        log.info("cudagraphs: CUDA runtime functions not found (%s)", error)
        return None
    if not all(pointers):
        return None
    return tuple(pointers)  # type: ignore[arg-type]


@functools.cache
def _native() -> tuple[Callable[..., int], int, int, int, int] | None:
    """The compiled launch and the four functions it calls, or ``None``."""
    module = compiled_module()
    if module is None or not hasattr(module, "launch_graph"):
        return None
    runtime = runtime_functions("cudaGraphLaunch", "cudaGetDevice", "cudaSetDevice")
    stream = compat.current_stream_reader()
    if runtime is None or stream is None:
        return None
    launch, get_device, set_device = runtime
    return module.launch_graph, launch, stream, get_device, set_device


def direct_launches() -> bool:
    """Whether graphs that draw no random numbers are launched with one C call here."""
    return _native() is not None


class Launcher:
    """Launches one recorded graph; ``launcher()`` is ``graph.replay()``, see the module doc."""

    def __init__(self, graph: torch.cuda.CUDAGraph, device: int | None = None):
        self.graph = graph
        self.device = device
        self.go: Callable[[], int] | None = None  # the C launch, once the graph is seen not to draw
        self.direct = False
        # Launches through replay() that left the generator as it was; an object that does not
        # expose its instantiation (not a torch CUDAGraph) is only ever launched by replay().
        self._watched = 0 if hasattr(graph, "raw_cuda_graph_exec") else 2

    def __call__(self) -> None:
        go = self.go
        if go is None:
            self._replay()
        elif code := go():
            self._failed(code)

    def _replay(self) -> None:
        native = _native()
        if self._watched >= 2 or native is None:
            self.graph.replay()
            return
        if self.device is None:
            self.device = torch.cuda.current_device()
        generator = torch.cuda.default_generators[self.device]
        try:
            before = (generator.initial_seed(), generator.get_offset())
        except RuntimeError:  # read inside another capture: no verdict from this launch
            self.graph.replay()
            return
        self.graph.replay()
        if (generator.initial_seed(), generator.get_offset()) != before:
            self._watched = 3  # it draws: every launch advances the offsets through replay()
            return
        self._watched += 1
        if self._watched == 2:
            launch, *functions = native
            graph_exec = compat.graph_exec(self.graph)
            self.go = functools.partial(launch, *functions, graph_exec, self.device)
            self.direct = True

    def _failed(self, code: int) -> None:
        raise CudaGraphsError(
            explain(
                f"launching the graph failed (CUDA error {code})",
                "the CUDA runtime refused the launch; the context may have failed earlier "
                "(an illegal memory access is reported at a later call)",
                "run with CUDA_LAUNCH_BLOCKING=1 to find the first failing kernel",
            )
        )


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


_runtime: Any = None
_looked = False


def cuda_runtime() -> Any:
    """``cuda.bindings.runtime`` or ``None`` (not installed, or switched off)."""
    global _runtime, _looked
    if not _looked:
        _looked = True
        try:
            if os.environ.get("CUDAGRAPHS_NO_COPY_NODES"):
                raise ImportError("CUDAGRAPHS_NO_COPY_NODES is set")
            from cuda.bindings import runtime

            _runtime = runtime
        except ImportError as error:
            log.info("cudagraphs: inputs are copied with copy_ before each replay (%s)", error)
    return _runtime


class Edits:
    """The two edits of an instantiated graph the call path makes, each returning whether it
    succeeded: through the compiled module and the runtime PyTorch loaded where both are found
    (a C call), else through cuda-bindings (a few µs of argument conversion per call)."""

    def __init__(self, runtime: Any):
        self.runtime = runtime
        self.native = _native_edits()

    def set_source(self, exe: int, node: Any, dst: int, src: int, nbytes: int) -> bool:
        if self.native is not None:
            module, set_params, _ = self.native
            if module.set_copy_source(set_params, exe, int(node), dst, src, nbytes) == 0:
                return True
            self._give_up_native()  # then the same edit through cuda-bindings decides
        rt = self.runtime
        kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        (err,) = rt.cudaGraphExecMemcpyNodeSetParams1D(exe, node, dst, src, nbytes, kind)
        return err == rt.cudaError_t.cudaSuccess

    def set_enabled(self, exe: int, node: Any, on: bool) -> bool:
        if self.native is not None:
            module, _, set_enabled = self.native
            if module.set_node_enabled(set_enabled, exe, int(node), int(on)) == 0:
                return True
            self._give_up_native()
        (err,) = self.runtime.cudaGraphNodeSetEnabled(exe, node, int(on))
        return err == self.runtime.cudaError_t.cudaSuccess

    def _give_up_native(self) -> None:
        log.warning("cudagraphs: a native copy-node edit failed; editing through cuda-bindings")
        self.native = None


@functools.cache
def _native_edits() -> tuple[Any, int, int] | None:
    """The compiled module and the addresses of the runtime's two graph-edit functions in the
    CUDA runtime library this process loaded (PyTorch's), or ``None``."""
    module = compiled_module()
    if module is None or not hasattr(module, "set_copy_source"):
        return None
    pointers = runtime_functions("cudaGraphExecMemcpyNodeSetParams1D", "cudaGraphNodeSetEnabled")
    if pointers is None:
        return None
    return module, pointers[0], pointers[1]


def native_edits() -> bool:
    """Whether copy nodes are edited with one C call per edit here (for reports and tests)."""
    return _native_edits() is not None


def check_edit(runtime: Any, err: Any, what: str) -> None:
    if err != runtime.cudaError_t.cudaSuccess:
        edit_failed(f"{what} ({err})")


def edit_failed(what: str) -> None:
    raise CudaGraphsError(
        explain(
            f"{what} failed",
            "the CUDA runtime refused to edit the instantiated graph; the context may "
            "have failed earlier (an illegal memory access is reported at a later call)",
            "run with CUDA_LAUNCH_BLOCKING=1 to find the first failing kernel; set "
            "CUDAGRAPHS_NO_COPY_NODES=1 to copy inputs with copy_ instead",
        )
    )

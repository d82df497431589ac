"""CUDA conditional nodes (IF and WHILE, CUDA 12.4+) in a graph being captured.

While :func:`cudagraphs.graph` captures on a stream, a conditional node is added to the graph
that stream records into, and its body is recorded on a second stream straight into the node's
child graph (``cudaStreamBeginCaptureToGraph``). The node runs its body while (WHILE) or if (IF)
a condition value is non-zero; that value is set on the device by a one-thread kernel reading a
0-dim ``bool`` tensor, so no step involves the host. The kernels are PTX (``kernels``) loaded
through the driver at first use; nothing is compiled or written to disk.

The CUDA runtime is reached through ``cuda-bindings`` (the ``conditional`` extra: ``pip install -e '.[conditional]'`` from a clone),
imported only when a node is made. From the first body on, the caching allocator serves every
allocation of the capture from its own pool (``core.active_capture``), so the body's memory is the
graph's, reused on every iteration.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..core import active_capture, compat
from ..errors import CaptureError, ConditionalNodesUnavailable, explain, install_extra
from . import kernels

__all__ = ["NEEDED_CUDA", "Condition", "available", "prepare"]

NEEDED_CUDA = 12040  # conditional nodes: CUDA 12.4, in the driver and in the runtime

_lock = threading.Lock()
_prepared: dict[int, _Device] = {}


@dataclass
class _Device:
    """What one device needs, made outside any capture (loading a module or making a stream
    inside one is not allowed): the two kernels and the stream bodies are recorded on."""

    loop_kernel: Any
    branch_kernel: Any
    body_stream: torch.cuda.Stream


def _bindings() -> tuple[Any, Any]:
    try:
        from cuda.bindings import driver, runtime
    except ImportError as error:
        raise ConditionalNodesUnavailable(
            explain(
                "loops and branches on the device need the cuda-bindings package, which is "
                "not installed",
                "conditional nodes are made through the CUDA runtime API",
                f"{install_extra('conditional')} (cuda-bindings matching your CUDA)",
            )
        ) from error
    return driver, runtime


def _check(result: Any, call: str) -> Any:
    """cuda-bindings returns (error, *values): the values, or a CaptureError naming the call."""
    error, *values = result if isinstance(result, tuple) else (result,)
    if int(error) != 0:
        raise CaptureError(
            explain(
                f"{call} failed with {error!r}",
                "the CUDA runtime refused a step of building a conditional node",
                "check the CUDA driver (12.4 or newer); report it if the versions are right",
            ),
            kind="conditional-node",
        )
    return values[0] if len(values) == 1 else tuple(values)


def versions() -> tuple[int, int]:
    """(driver, runtime) CUDA versions as integers (12040 is 12.4)."""
    _, runtime = _bindings()
    return (
        _check(runtime.cudaDriverGetVersion(), "cudaDriverGetVersion"),
        _check(runtime.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion"),
    )


@functools.cache
def available() -> str | None:
    """``None`` when this machine can run conditional nodes, else why not, in words."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not compat.routes_allocations_to_pools():
        # a body's tensors must come from the graph's pool (PyTorch 2.8 has the routing)
        return f"PyTorch {torch.__version__} cannot route a body's allocations to the graph's pool"
    try:
        driver_version, runtime_version = versions()
    except ConditionalNodesUnavailable as error:
        return str(error).splitlines()[0]
    if min(driver_version, runtime_version) < NEEDED_CUDA:
        return (
            f"the CUDA driver is {_dotted(driver_version)} and the runtime "
            f"{_dotted(runtime_version)}; conditional nodes need 12.4 or newer in both"
        )
    return None


def _dotted(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def prepare(device: torch.device) -> None:
    """Load the kernels and make the body stream for ``device``; outside a capture (the eager
    path and the library's warm-up call this, so the capture finds them ready)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index in _prepared:
            return
        reason = available()
        if reason is not None:
            raise ConditionalNodesUnavailable(
                explain(
                    f"loops and branches on the device are unavailable here: {reason}",
                    "a conditional node is a CUDA 12.4 feature of the driver and the runtime",
                    "upgrade the driver and CUDA, or call the function without cg.graph "
                    "(then the loop runs in Python)",
                )
            )
        driver, _ = _bindings()
        with torch.cuda.device(index):
            # The driver calls below need the device's context current on this thread; a
            # runtime call makes the primary context (the one PyTorch uses) current.
            torch.cuda.synchronize(index)
            module = _check(driver.cuModuleLoadData(kernels.PTX.encode()), "cuModuleLoadData")
            _prepared[index] = _Device(
                loop_kernel=_check(
                    driver.cuModuleGetFunction(module, kernels.LOOP.encode()),
                    "cuModuleGetFunction",
                ),
                branch_kernel=_check(
                    driver.cuModuleGetFunction(module, kernels.BRANCH.encode()),
                    "cuModuleGetFunction",
                ),
                body_stream=torch.cuda.Stream(index),
            )


def _ready(device: torch.device) -> _Device:
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _prepared.get(index)
    reason = available()
    if reason is not None:
        raise ConditionalNodesUnavailable(
            explain(
                f"cg.while_loop / cg.cond cannot be captured here: {reason}",
                "a loop or branch inside a graph is a CUDA conditional node (CUDA 12.4+)",
                "upgrade the driver and CUDA and install cuda-bindings, or run the function "
                "eagerly (the loop then runs in Python)",
            )
        )
    if found is None:
        raise CaptureError(
            explain(
                "cg.while_loop / cg.cond was first reached inside a capture",
                "its kernels and stream must be made before capturing (CUDA forbids it during)",
                "keep cg.graph's warm-up (warmup=1 or more, the default): it runs the loop once "
                "eagerly first",
            ),
            kind="conditional-node",
        )
    return found


def _launch(kernel: Any, args: tuple[Any, ...], types: tuple[Any, ...], stream: Any) -> None:
    driver, _ = _bindings()
    _check(
        driver.cuLaunchKernel(
            kernel, 1, 1, 1, 1, 1, 1, 0, driver.CUstream(stream.cuda_stream), (args, types), 0
        ),
        "cuLaunchKernel",
    )


class Condition:
    """One conditional node in the graph being captured on the current stream.

    Right::

        node = Condition(device, "while")
        node.set_loop(flag, count, limit, stream)    # before the node: the first test
        with node.body() as stream:                  # the body, recorded into the node
            ...
            node.set_loop(flag, count, limit, stream)  # the test after each iteration

    Wrong: reading a tensor's value on the host inside ``body()``: the body runs on the device
    only, and a host sync there ends the capture with an error.
    """

    def __init__(self, device: torch.device, kind: str):
        _, runtime = _bindings()
        self.device = _ready(device)
        if torch.cuda.current_stream().cuda_stream == self.device.body_stream.cuda_stream:
            raise CaptureError(
                explain(
                    "cg.while_loop / cg.cond inside the body of another one",
                    "nested conditional nodes are not supported yet",
                    "move the inner loop or branch out of the body, or unroll it",
                ),
                kind="conditional-node",
            )
        self.capture = active_capture()
        if self.capture is None:
            raise CaptureError(
                explain(
                    "a conditional node was asked for outside a cudagraphs capture",
                    "the node goes into the graph cg.graph is recording, whose memory pool its "
                    "body must use",
                    "call cg.while_loop / cg.cond inside a function captured by cg.graph",
                ),
                kind="conditional-node",
            )
        self.outer = torch.cuda.current_stream()
        self._runtime, self._kind = runtime, kind
        graph = self._capture_info()[2]
        self.handle = _check(
            runtime.cudaGraphConditionalHandleCreate(graph, 0, 0),
            "cudaGraphConditionalHandleCreate",
        )

    def _capture_info(self) -> tuple[Any, ...]:
        """(status, id, graph, dependencies, edge data, count) of the outer capture."""
        values = _check(
            self._runtime.cudaStreamGetCaptureInfo(self.outer.cuda_stream),
            "cudaStreamGetCaptureInfo",
        )
        if len(values) == 5:  # CUDA 12 bindings: no edge data
            status, capture_id, graph, dependencies, count = values
            return status, capture_id, graph, dependencies, None, count
        return values

    def set_loop(self, flag: torch.Tensor, count: torch.Tensor, limit: int, stream: Any) -> None:
        """Launch the loop test on ``stream``: count += 1, run again while flag and count <= limit."""
        _launch(
            self.device.loop_kernel,
            (flag.data_ptr(), count.data_ptr(), limit, int(self.handle)),
            (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_ulonglong),
            stream,
        )

    def set_branch(self, flag: torch.Tensor, negate: bool, stream: Any) -> None:
        """Launch the branch test on ``stream``: take the body when ``flag != negate``."""
        _launch(
            self.device.branch_kernel,
            (flag.data_ptr(), int(negate), int(self.handle)),
            (ctypes.c_void_p, ctypes.c_uint32, ctypes.c_ulonglong),
            stream,
        )

    @contextlib.contextmanager
    def body(self) -> Iterator[torch.cuda.Stream]:
        """Add the node after what the outer stream recorded so far, and record the ``with``
        block into its body on the body stream (allocations from the capture's pool)."""
        runtime = self._runtime
        _, _, graph, dependencies, edges, count = self._capture_info()
        params = runtime.cudaGraphNodeParams()
        params.type = runtime.cudaGraphNodeType.cudaGraphNodeTypeConditional
        params.conditional.handle = self.handle
        params.conditional.type = (
            runtime.cudaGraphConditionalNodeType.cudaGraphCondTypeWhile
            if self._kind == "while"
            else runtime.cudaGraphConditionalNodeType.cudaGraphCondTypeIf
        )
        params.conditional.size = 1
        node = _check(
            runtime.cudaGraphAddNode(graph, dependencies, edges, count, params), "cudaGraphAddNode"
        )
        body_graph = params.conditional.phGraph_out[0]
        _check(
            runtime.cudaStreamUpdateCaptureDependencies(
                self.outer.cuda_stream,
                [node],
                None,
                1,
                runtime.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies,
            ),
            "cudaStreamUpdateCaptureDependencies",
        )
        stream = self.device.body_stream
        # The body's tensors come from the capture's pool: they are the graph's memory,
        # reused on every iteration.
        self.capture.route_all_allocations()
        _check(
            runtime.cudaStreamBeginCaptureToGraph(
                stream.cuda_stream,
                body_graph,
                None,
                None,
                0,
                runtime.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal,
            ),
            "cudaStreamBeginCaptureToGraph",
        )
        # From here on the body stream is capturing: whatever happens, its capture must end, or
        # every later CUDA call in the process fails.
        # A host sync in the body would invalidate the body's capture, and ending the outer
        # capture over a node with a broken body crashes the process; the sync debug mode turns
        # the sync into a Python error before it reaches CUDA, so both captures end cleanly.
        failure: BaseException | None = None
        sync_mode = torch.cuda.get_sync_debug_mode()
        _set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(stream):
                yield stream
        except BaseException as error:
            failure = error
        finally:
            _set_sync_debug_mode(sync_mode)
            result = runtime.cudaStreamEndCapture(stream.cuda_stream)
        if failure is not None:
            raise failure
        _check(result, "cudaStreamEndCapture")


def _set_sync_debug_mode(mode: int | str) -> None:
    """``torch.cuda.set_sync_debug_mode`` without its "prototype feature" warning, which would
    otherwise reach the user on every capture of a loop or branch."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode(mode)

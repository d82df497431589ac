"""Launching a recorded graph: one C call where that is the launch ``CUDAGraph.replay()`` makes.

``CUDAGraph.replay()`` is a pybind11 call that releases the GIL, advances the offsets of the
random generators the graph draws from, and calls ``cudaGraphLaunch`` on the current stream of
the graph's device. For a graph that draws no random numbers, the compiled module
(``_before_replay.cpp``) makes the same ``cudaGraphLaunch`` of the same instantiation in one C
call: 1.3 to 1.4 µs less per launch on the H200 (``reports/gpu.md``, "launch"), which a small
graph's latency pays one for one. Whether a graph draws is seen, not assumed: its first two
launches go through ``replay()``, and only if neither moved the default generator's seed or
offset (a graph that draws advances the offset at every replay) do later launches take the C
call. Being the one instantiation PyTorch made, its launches stay ordered across streams as
CUDA orders them, and its copy nodes (``copy_nodes``) are edited as before.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch

from ..errors import CudaGraphsError, explain
from . import compat
from .addresses import compiled_module

__all__ = ["Launcher", "direct_launches", "loaded_libraries", "runtime_functions"]

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

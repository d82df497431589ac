"""Launching a recorded graph: one C call where that is the launch ``CUDAGraph.replay()`` makes.

``CUDAGraph.replay()`` is a pybind11 call that releases the GIL, advances the offsets of the
random generators the graph draws from, and calls ``cudaGraphLaunch`` on the current stream of
the graph's device. For a graph that draws no random numbers, the compiled module
(``_before_replay.cpp``) makes the same ``cudaGraphLaunch`` in one C call, about 0.8 µs less
per launch on the H200 (``reports/gpu.md``, "launch"), which a small graph's latency pays one
for one. Whether a graph draws is seen, not assumed: its first two launches go through
``replay()``, and only if neither moved the default generator's seed or offset (a graph that
draws advances the offset at every replay) do later launches take the C call.

A :class:`Launcher` may also launch other instantiations of its graph (``copy_nodes``: one per
recent input address, so that no node is edited at a call). CUDA orders the launches of one
instantiation across streams, but not of two; so while several are in use each launch checks
that it is on the stream of the previous one, and a launch from another stream first waits for
the GPU (once) and goes back to the one instantiation (``on_new_stream``).
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
_STREAM_CHANGED = -2


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
    """Launches one recorded graph; ``launcher()`` is ``graph.replay()``, see the module doc.

    ``go``: the C launch of the instantiation to launch next (``None``: ``replay()``);
    ``base_go``: that of PyTorch's own. ``on_direct`` is called once launches are direct;
    ``on_new_stream`` when a launch came from another stream while several instantiations were
    in use (after the GPU was waited for; it must set ``go`` to one of the one instantiation).
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, device: int | None = None):
        self.graph = graph
        self.device = device
        self.go: Callable[[], int] | None = None
        self.base_go: Callable[[], int] | None = None
        self.direct = False
        self.last: bytearray | None = None  # the previous launch's stream, while tracked
        self.on_direct: Callable[[], None] | None = None
        self.on_new_stream: Callable[[], None] | None = None
        self._watched = 0  # launches through replay() that left the generator as it was

    def __call__(self) -> None:
        go = self.go
        if go is None:
            self._replay()
        elif code := go():
            self._refused(code)

    def go_for(self, graph_exec: int) -> Callable[[], int]:
        """The C launch of ``graph_exec`` (an instantiation of this graph) on the current
        stream, checking the stream while launches are tracked (:meth:`track`)."""
        native = _native()
        assert native is not None and self.direct
        launch, *functions = native
        return functools.partial(launch, *functions, graph_exec, self.device, self.last)

    def track(self) -> None:
        """From now on several instantiations are launched: check each launch's stream. The
        launches made so far (of the one instantiation, on any stream) are waited for once."""
        if self.last is None:
            torch.cuda.synchronize(self.device)
            self.last = bytearray(16)  # launched yet, and on which stream
            self.base_go = self.go_for(compat.graph_exec(self.graph))
            self.go = self.base_go

    def untrack(self) -> None:
        """Back to the one instantiation: CUDA orders its launches across streams itself."""
        self.last = None
        self.base_go = self.go_for(compat.graph_exec(self.graph))
        self.go = self.base_go

    def _replay(self) -> None:
        if self._watched >= 2 or _native() is None:
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
            self.direct = True
            self.base_go = self.go_for(compat.graph_exec(self.graph))
            self.go = self.base_go
            if self.on_direct is not None:
                self.on_direct()

    def _refused(self, code: int) -> None:
        if code == _STREAM_CHANGED and self.on_new_stream is not None:
            torch.cuda.synchronize(self.device)  # every launch so far done, on any stream
            self.on_new_stream()
            assert self.go is not None and self.last is None
            code = self.go()
            if code == 0:
                return
        raise CudaGraphsError(
            explain(
                f"launching the graph failed (CUDA error {code})",
                "the CUDA runtime refused the launch; the context may have failed earlier "
                "(an illegal memory access is reported at a later call)",
                "run with CUDA_LAUNCH_BLOCKING=1 to find the first failing kernel",
            )
        )

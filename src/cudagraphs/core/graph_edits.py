"""Editing an instantiated CUDA graph: the runtime's calls the copy nodes use (copy_nodes.py).

Each edit is one C call through the compiled module (``_before_replay.cpp``) and the CUDA
runtime PyTorch loaded, where both are found, else a call through ``cuda-bindings``, which is
needed in any case (the nodes are found through it). Without it, or with
``CUDAGRAPHS_NO_COPY_NODES=1``, no copy nodes are recorded.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from ..errors import CudaGraphsError, explain
from .addresses import compiled_module
from .launch import runtime_functions

__all__ = ["Edits", "check_edit", "cuda_runtime", "edit_failed", "native_edits"]

log = logging.getLogger("cudagraphs")
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

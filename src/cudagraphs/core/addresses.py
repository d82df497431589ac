"""One call that says whether a list of tensors still lives at the recorded addresses.

The address guard runs this before every replay, so its cost is paid per call. Three ways, the
fastest that works is used:

1. ``compiled``: the small C++ extension of the host-side work before a replay
   (``_before_replay.cpp``: this check, the modules' check, the copy nodes' edits), built when
   the package is installed (optional: installing without a compiler still works). It includes
   ``Python.h`` only and reads each address through the function pointer that PyTorch exports
   for Inductor's C++ wrapper (``compat.tensor_address_reader``), so no Python objects are made
   per tensor: a few ns per tensor.
2. ``torch helper``: the helper cudagraph trees use (``compat.tensors_at_addresses``, CUDA
   builds); pybind11 converts every element, about 80 ns per tensor on a slow host.
3. ``python loop``: ``t.data_ptr()`` per tensor, about 110 ns per tensor.

Nothing is compiled or loaded at run time from anywhere but the installed package: a library
loaded from a shared temporary folder could be planted there by another user.
``CUDAGRAPHS_NO_COMPILE=1`` skips the compiled loop (2 or 3 is used).
"""

from __future__ import annotations

import array
import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import compat

__all__ = ["AddressCheck", "compiled_module"]

log = logging.getLogger("cudagraphs")

_READER = "_torchinductor_pyobject_tensor_data_ptr"
_module: Any = None
_failure: str | None = None


def compiled_module() -> Any:
    """The compiled checker from the installed package; ``None`` (reason in ``_failure``,
    logged once) where it was not built or is switched off."""
    global _module, _failure
    if _module is not None or _failure is not None:
        return _module
    try:
        if os.environ.get("CUDAGRAPHS_NO_COMPILE"):
            raise ImportError("CUDAGRAPHS_NO_COMPILE is set")
        reader = compat.tensor_address_reader()
        if reader is None:
            raise ImportError(f"this PyTorch does not export {_READER}")
        from . import _before_replay  # type: ignore[attr-defined]

        _before_replay.bind(reader)
        _module = _before_replay
    except ImportError as error:
        _failure = (
            f"{error}; the compiled address check is built when cudagraphs is installed "
            "(pip install . with a C++ compiler and the Python headers)"
        )
        log.info("cudagraphs: compiled address check unavailable (%s); using a fallback", error)
    return _module


class AddressCheck:
    """``check()`` is True while every tensor still has the data pointer it had at construction.

    Right::

        check = AddressCheck(list(model.parameters()))
        ...
        if not check():          # one C call, about 10 ns per tensor when compiled
            recapture()

    Wrong: ``[p.data_ptr() for p in params] == saved`` before every replay: about 110 ns per
    tensor, 11 µs for a 100-parameter model.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], *, native: bool = True):
        self.tensors = tuple(tensors)
        self.ptrs = [t.data_ptr() for t in self.tensors]
        self.native = native
        module = compiled_module() if native and self.tensors else None
        # ``unchanged`` is a C-level partial where possible: no Python frame per check.
        self.unchanged: Callable[[], bool]
        if not self.tensors:
            self.unchanged = lambda: True
            self.backend = ""
        elif module is not None:
            packed = array.array("Q", self.ptrs).tobytes()
            self.unchanged = functools.partial(module.same, self.tensors, packed)
            self.backend = "compiled"
        elif (helper := compat.tensors_at_addresses(self.tensors, self.ptrs)) is not None:
            self.unchanged = helper
            self.backend = "torch helper"
        else:
            self.unchanged = lambda: [t.data_ptr() for t in self.tensors] == self.ptrs
            self.backend = "python loop"

    def __call__(self) -> bool:
        return self.unchanged()

    def with_modes(
        self,
        owners: Sequence[Any],
        modes: Sequence[Any],
        entries: Sequence[tuple[dict[str, Any], tuple[Any, ...]]] = (),
    ) -> Callable[[], bool]:
        """One check for a whole guard: True while each owner's ``training`` is still
        ``modes[i]`` (the same object), each ``(mapping, values)`` of ``entries`` still holds
        exactly those objects in that order, and every tensor is at its address. A C-level
        partial when compiled."""
        module = compiled_module() if self.native else None
        if module is not None:
            packed = array.array("Q", self.ptrs).tobytes()
            return functools.partial(
                module.unchanged, self.tensors, packed, tuple(owners), tuple(modes),
                tuple((d, tuple(v)) for d, v in entries),
            )  # fmt: skip
        pairs = tuple(zip(owners, modes))
        held = tuple((d, tuple(v)) for d, v in entries)
        addresses = self.unchanged

        def same_objects(mapping: dict[str, Any], values: tuple[Any, ...]) -> bool:
            return len(mapping) == len(values) and all(
                a is b for a, b in zip(mapping.values(), values)
            )

        def unchanged() -> bool:
            return (
                all(o.training is m for o, m in pairs)
                and all(same_objects(d, v) for d, v in held)
                and addresses()
            )

        return unchanged

    def moved(self) -> list[int]:
        """Indices of the tensors whose data pointer changed, or that no longer have one (a
        parameter swapped for a sparse or storage-less tensor): the slow, exact answer."""
        return [i for i, (t, p) in enumerate(zip(self.tensors, self.ptrs)) if _address(t) != p]


def _address(t: torch.Tensor) -> int | None:
    try:
        return t.data_ptr()
    except RuntimeError:  # no storage to point at
        return None

"""What the doctor watches during a run: Python-level calls, aten ops, synchronizes, steps.

:class:`FunctionWatch` (a TorchFunctionMode) sees ``.item()``, ``bool(t)``, printing and
``torch.tensor(data)``; :class:`DispatchWatch` (a TorchDispatchMode) sees every aten op: shapes
that depend on data, writes into inputs and into state, tensors read by address; the context
managers patch explicit synchronizes, ``GradScaler.step`` and optimizer steps, turn on CUDA's sync
debug mode, and make the run look like a capture to code that asks.

The patches are the one place the library replaces torch attributes, for the doctor's run only,
and they are confined to the doctor's thread: every patched call made from another thread runs
the original, unobserved; on the way out a patch is undone only if it is still the one in place
(another library's wrapper made meanwhile stays).
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode

from ..core import (
    compat,
    current_eager_step,
    is_torch_file,
    storage_key,
    user_frame,
    written_arguments,
)
from .findings import Collector

__all__ = ["DispatchWatch", "FunctionWatch", "as_if_capturing", "patched_calls", "sync_debug"]


_SYNC_METHODS = {
    "item": ".item()",
    "tolist": ".tolist()",
    "numpy": ".numpy()",
    "__bool__": "a Python `if`/`while`/`and` on a tensor (bool(tensor))",
    "__int__": "int(tensor)",
    "__float__": "float(tensor)",
    "__index__": "using a tensor as a Python index",
    "__repr__": "printing a tensor",
    "__str__": "printing a tensor",
    "__format__": "formatting a tensor",
}
_FROM_DATA = {
    "tensor": "torch.tensor(data)",
    "as_tensor": "torch.as_tensor(data)",
    "from_numpy": "torch.from_numpy",
}


class FunctionWatch(TorchFunctionMode):
    """``on_cuda``: the run's inputs are on the GPU (else the doctor judges a CPU run by what
    would happen on CUDA)."""

    def __init__(self, collector: Collector, *, on_cuda: bool):
        super().__init__()
        self.collector = collector
        self.on_cuda = on_cuda
        self.autocast_reported = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _SYNC_METHODS:
            self.collector.add("host-sync", _SYNC_METHODS[name])
        elif name == "cpu" or (name == "to" and _targets_cpu(args, kwargs)):
            self.collector.add("host-sync", "copying a tensor to the CPU (.cpu() / .to('cpu'))")
        elif (name in _FROM_DATA and getattr(func, "__module__", "") == "torch") or (
            name == "new_tensor"
        ):
            out = func(*args, **kwargs)
            # Host data copied to the GPU is recorded once and frozen. On a GPU run, a tensor
            # that stays on the CPU is harmless until it reaches a CUDA op (the dispatch watch
            # sees that); an empty one copies nothing.
            if (
                isinstance(out, torch.Tensor)
                and (not self.on_cuda or out.device.type != "cpu")
                and out.numel()
            ):
                what = _FROM_DATA.get(name, "tensor.new_tensor(data)")
                self.collector.add("cpu-tensor", what)
            return out
        if not self.autocast_reported and torch.is_autocast_cache_enabled() and _autocast_on():
            self.autocast_reported = True
            self.collector.add("autocast-cache", name or "an op")
        return func(*args, **kwargs)


def _targets_cpu(args: Any, kwargs: Any) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(target, (str, torch.device)):
        return (
            torch.device(target).type == "cpu"
            and isinstance(args[0], torch.Tensor)
            and args[0].is_cuda
        )
    return False


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(d) for d in ("cuda", "cpu"))


_DYNAMIC_OPS = {
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::_unique",
    "aten::argwhere",
    "aten::nonzero_static",  # listed so it is *not* flagged below: it has a static size
}


class DispatchWatch(compat.OPS_DISPATCH_MODE):  # type: ignore[misc, valid-type]
    def __init__(
        self,
        collector: Collector,
        inputs: dict[int, str],
        known: set[int],
        names: dict[int, str],
        state: dict[int, str],
    ):
        super().__init__()
        self.collector = collector
        self.inputs = inputs  # storage pointer -> input path
        self.known = known  # storage pointers of inputs, parameters, buffers, created tensors
        self.names = names  # storage pointer -> closure/global name
        self.state = state  # storage pointer -> name, for every tensor the function can reach
        self.created: set[int] = set()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # else Dynamo marks a compiled function's code as never to compile again

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = compat.op_name(func)
        tensors = [t for t in optree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        shapes = tuple(tuple(t.shape) for t in tensors)
        filename, lineno = user_frame()
        if current_eager_step() is None:  # an eager step may take other ops from run to run
            self.collector.ops.append((str(func), shapes, filename, lineno))
        c = self.collector
        if name == "aten::_local_scalar_dense":
            c.add("host-sync", "reading a tensor's value on the host (.item())")
        elif name in _DYNAMIC_OPS and name != "aten::nonzero_static":
            c.add("dynamic-shape", name.removeprefix("aten::"))
        elif name == "aten::repeat_interleave" and kwargs.get("output_size") is None:
            c.add("dynamic-shape", "repeat_interleave without output_size")
        elif name == "aten::index" and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in optree.tree_leaves(args[1:])
        ):
            c.add("dynamic-shape", "boolean-mask indexing x[mask]")
        devices = {t.device for t in tensors if t.device.type != "cpu"}
        if len(devices) > 1:
            c.add("multi-device", name, where=", ".join(sorted(map(str, devices))))
        if devices and any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
            c.add("cpu-tensor", f"{name} with a CPU tensor argument")
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and generator is not _default_generator(
            generator.device
        ):
            c.add("generator", name)
        for index, argument_name in written_arguments(func, args, kwargs):
            value = args[index] if index < len(args) else kwargs.get(argument_name)
            if isinstance(value, torch.Tensor):
                key = storage_key(value)
                path = self.inputs.get(key)
                if path is not None:
                    c.add("input-mutation", name, where=path)
                elif key and key not in self.created:
                    label = self.state.get(key) or f"a tensor of shape {tuple(value.shape)}"
                    c.add("state-write", name, where=label)
        for t in tensors:
            key = storage_key(t)
            if key and key not in self.known:
                label = self.names.get(key, f"of shape {tuple(t.shape)}")
                c.add("closure-tensor", name, where=label)
                self.known.add(key)  # report each external tensor once
        out = func(*args, **kwargs)
        aliasing = compat.op_returns_alias(func)
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.known.add(storage_key(t))
                if not aliasing:
                    self.created.add(storage_key(t))
        return out


def _default_generator(device: torch.device) -> torch.Generator | None:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


@contextmanager
def patched_calls(collector: Collector) -> Iterator[None]:
    """Watch explicit synchronizes, GradScaler.step and optimizer steps for the run."""
    patches: list[tuple[Any, str, Any, Any]] = []
    doctor_thread = threading.get_ident()

    def patch(owner: Any, attr: str, kind: str, what: str, call_through: bool) -> None:
        original = getattr(owner, attr)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != doctor_thread:  # other threads: untouched
                return original(*args, **kwargs)
            collector.add(kind, what)
            if call_through:
                return original(*args, **kwargs)
            return None

        patches.append((owner, attr, original, wrapper))
        setattr(owner, attr, wrapper)

    cuda = torch.cuda.is_available()
    patch(torch.cuda, "synchronize", "sync-call", "torch.cuda.synchronize()", cuda)
    patch(torch.cuda.Stream, "synchronize", "sync-call", "stream.synchronize()", cuda)
    patch(torch.cuda.Event, "synchronize", "sync-call", "event.synchronize()", cuda)
    patch(torch.amp.GradScaler, "step", "grad-scaler", "scaler.step(optimizer)", True)

    def step_hook(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if threading.get_ident() != doctor_thread:
            return
        if "capturable" in optimizer.defaults and not all(
            g.get("capturable", False) for g in optimizer.param_groups
        ):
            collector.add("optimizer", "optimizer.step()", where=type(optimizer).__name__)

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(step_hook)
    try:
        yield
    finally:
        handle.remove()
        for owner, attr, original, wrapper in reversed(patches):
            if getattr(owner, attr) is wrapper:  # else someone wrapped ours since: leave theirs
                setattr(owner, attr, original)


@contextmanager
def as_if_capturing() -> Iterator[None]:
    """Code on the capture path asks whether a stream is capturing (transformers skips its
    host syncs then); judge that path, the one a graph records, not the eager one. PyTorch's
    own callers (an optimizer's capture health check) get the true answer: the run is eager."""
    original = torch.cuda.is_current_stream_capturing
    doctor_thread = threading.get_ident()

    def capturing() -> bool:
        if threading.get_ident() != doctor_thread:  # other threads get the true answer
            return original()
        caller = sys._getframe(1).f_code.co_filename
        return original() if is_torch_file(caller) else True

    torch.cuda.is_current_stream_capturing = capturing  # type: ignore[assignment]
    try:
        yield
    finally:
        if torch.cuda.is_current_stream_capturing is capturing:
            torch.cuda.is_current_stream_capturing = original  # type: ignore[assignment]


@contextmanager
def sync_debug(collector: Collector) -> Iterator[None]:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    original = warnings.showwarning

    doctor_thread = threading.get_ident()

    def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if threading.get_ident() == doctor_thread and "synchroniz" in str(message).lower():
            where = user_frame()
            if not any(key[1:] == where for key in collector.findings):  # not explained yet
                collector.add("host-sync", "an operation that synchronized with the host")
        else:
            original(message, category, filename, lineno, *rest)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            warnings.showwarning = original

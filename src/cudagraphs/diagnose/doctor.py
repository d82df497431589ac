"""``cg.doctor(fn, *args, **kwargs)``: what would break capture, or silently corrupt a graph.

The function runs eagerly (on clones of the inputs) under a TorchFunctionMode, which sees
Python-level tensor calls (``.item()``, ``bool(t)``, ``print(t)``, ``torch.tensor(data)``), and a
TorchDispatchMode, which sees every aten op (data-dependent shapes, in-place writes, which
tensors are read). On CUDA the sync debug mode reports any other host synchronization. A second
run on fresh inputs of the same shapes reveals control flow that depends on values or outside
state. Each finding names the first frame outside torch and cudagraphs, says what goes wrong
and how to fix it. It works on the CPU too, reporting what would break on CUDA.

Every tensor a run writes outside its inputs (module buffers, a KV cache, closure tensors,
optimizer state) is put back to its exact bytes afterwards, and so are the RNG states.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.frames import user_frame
from ..core.guards import closure_tensors, modules_of
from ..core.state import RngState, SideEffects, reachable_tensors, storage_key, written_arguments
from ..core.tree import NAMESPACE, Signature, flatten, leaf_paths
from .findings import KINDS, Collector, Finding, Report
from .verify import random_like

__all__ = ["Finding", "Report", "doctor"]

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


class _FunctionWatch(TorchFunctionMode):
    def __init__(self, collector: Collector):
        super().__init__()
        self.collector = collector
        self.autocast_reported = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _SYNC_METHODS:
            self.collector.add("host-sync", _SYNC_METHODS[name])
        elif name == "cpu" or (name == "to" and _targets_cpu(args, kwargs)):
            self.collector.add("host-sync", "copying a tensor to the CPU (.cpu() / .to('cpu'))")
        elif name in _FROM_DATA and getattr(func, "__module__", "") == "torch":
            self.collector.add("cpu-tensor", _FROM_DATA[name])
        elif name == "new_tensor":
            self.collector.add("cpu-tensor", "tensor.new_tensor(data)")
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


class _DispatchWatch(TorchDispatchMode):
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
        name = func._schema.name
        tensors = [t for t in optree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        shapes = tuple(tuple(t.shape) for t in tensors)
        filename, lineno = user_frame()
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
        for index, argument_name in written_arguments(func):
            value = args[index] if index < len(args) else kwargs.get(argument_name)
            if isinstance(value, torch.Tensor):
                key = _storage(value)
                path = self.inputs.get(key)
                if path is not None:
                    c.add("input-mutation", name, where=path)
                elif key and key not in self.created:
                    label = self.state.get(key) or f"a tensor of shape {tuple(value.shape)}"
                    c.add("state-write", name, where=label)
        for t in tensors:
            key = _storage(t)
            if key and key not in self.known:
                label = self.names.get(key, f"of shape {tuple(t.shape)}")
                c.add("closure-tensor", name, where=label)
                self.known.add(key)  # report each external tensor once
        out = func(*args, **kwargs)
        aliasing = any(r.alias_info is not None for r in func._schema.returns)
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.known.add(_storage(t))
                if not aliasing:
                    self.created.add(_storage(t))
        return out


def _default_generator(device: torch.device) -> torch.Generator | None:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:
        return 0


@contextmanager
def _patched(collector: Collector) -> Iterator[None]:
    """Watch explicit synchronizes, GradScaler.step and optimizer steps for the run."""
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, kind: str, what: str, call_through: bool) -> None:
        original = getattr(owner, attr)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            collector.add(kind, what)
            if call_through:
                return original(*args, **kwargs)
            return None

        patches.append((owner, attr, original))
        setattr(owner, attr, wrapper)

    cuda = torch.cuda.is_available()
    patch(torch.cuda, "synchronize", "sync-call", "torch.cuda.synchronize()", cuda)
    patch(torch.cuda.Stream, "synchronize", "sync-call", "stream.synchronize()", cuda)
    patch(torch.cuda.Event, "synchronize", "sync-call", "event.synchronize()", cuda)
    patch(torch.amp.GradScaler, "step", "grad-scaler", "scaler.step(optimizer)", True)

    def step_hook(optimizer: torch.optim.Optimizer, *_: Any) -> None:
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
        for owner, attr, original in reversed(patches):
            setattr(owner, attr, original)


def _reachable_state(fn: Callable[..., Any], args: Any) -> list[Any]:
    """Modules and optimizers whose state a run may change (restored afterwards)."""

    owner = getattr(fn, "__self__", None)
    owned = (
        [v for v in vars(owner).values() if isinstance(v, torch.nn.Module)]
        if owner is not None
        and not isinstance(owner, torch.nn.Module)
        and hasattr(owner, "__dict__")
        else []
    )
    objects: list[Any] = list(modules_of(fn, owned))
    target = getattr(fn, "__func__", fn)
    cells = [c.cell_contents for c in (getattr(target, "__closure__", None) or ()) if _filled(c)]
    code = getattr(target, "__code__", None)
    names = [getattr(target, "__globals__", {}).get(n) for n in (code.co_names if code else ())]
    for candidate in [*cells, *names, *optree.tree_leaves(args, namespace=NAMESPACE)]:
        if isinstance(candidate, (torch.nn.Module, torch.optim.Optimizer)) and all(
            candidate is not o for o in objects
        ):
            objects.append(candidate)
    return objects


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _external_names(fn: Callable[..., Any]) -> dict[int, str]:

    return {_storage(t): name for name, _, t in closure_tensors(fn)}


def _known_storages(fn: Callable[..., Any], objects: list[Any]) -> set[int]:
    known: set[int] = set()
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for t in [*obj.parameters(), *obj.buffers()]:
                known.add(_storage(t))
    return known


def _run(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], objects: list[Any]
) -> tuple[Collector, Any, dict[int, str]]:
    """One eager run on clones of the inputs, watched; what it writes outside them is put back."""
    signature, leaves = Signature.of_call(args, kwargs)
    clones = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
    inputs = {_storage(clones[i]): signature.paths[i] for i in signature.tensor_index}
    known = _known_storages(fn, objects) | set(inputs)
    collector = Collector()
    call_args, call_kwargs = optree.tree_unflatten(signature.spec, clones)
    tensors = [clones[i] for i in signature.tensor_index]
    plain = [clones[i] for i in signature.frozen_index]
    state = {storage_key(t): name for name, t in reachable_tensors(fn, plain, exclude=tensors)}
    effects = SideEffects(fn, tensors, plain, "restore")
    try:
        with ExitStack() as stack:
            stack.enter_context(_patched(collector))
            stack.enter_context(_as_if_capturing())
            if torch.cuda.is_available():
                stack.enter_context(_sync_debug(collector))
            stack.enter_context(effects.running())
            stack.enter_context(_FunctionWatch(collector))
            stack.enter_context(
                _DispatchWatch(collector, inputs, known, _external_names(fn), state)
            )
            out = fn(*call_args, **call_kwargs)
    finally:
        effects.finish()
    return collector, out, inputs


@contextmanager
def _as_if_capturing() -> Iterator[None]:
    """Code on the capture path asks whether a stream is capturing (transformers skips its
    host syncs then); judge that path, the one a graph records, not the eager one."""
    original = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: True  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = original  # type: ignore[assignment]


@contextmanager
def _sync_debug(collector: Collector) -> Iterator[None]:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    original = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if "synchroniz" in str(message).lower():
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


def doctor(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """List what in ``fn(*args, **kwargs)`` would break capture or corrupt a graph.

    Right::

        report = cg.doctor(step, obs)
        print(report)              # or rich.print(report) for a table
        assert not report.blocking

    The function runs twice, eagerly, on clones of the inputs and then on fresh random floats
    of the same shapes (integer and boolean inputs keep their values); each run is judged as on
    the capture path (``torch.cuda.is_current_stream_capturing()`` answers True), and whatever
    it writes outside its inputs (module buffers, a cache, closure tensors) and the RNG states
    are put back afterwards. Writes to such state are listed (``state-write``).
    """

    rng = RngState()  # the fresh inputs below draw from it too
    try:
        objects = _reachable_state(fn, (args, kwargs))
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        first, out, inputs = _run(fn, args, kwargs, objects)
        findings = dict(first.findings)
        _outputs_aliasing_inputs(fn, first, out, inputs)
        findings.update(first.findings)
        # Fresh floats only: integer and boolean inputs (token ids, positions, indices, masks) keep
        # the example's values, since invented ones could index out of range.
        fresh_args, fresh_kwargs = optree.tree_map(
            lambda x: (
                random_like(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            ),
            (args, kwargs),
            namespace=NAMESPACE,
        )
        second, _, _ = _run(fn, fresh_args, fresh_kwargs, objects)
        dynamic = any(f.kind == "dynamic-shape" for f in findings.values())
        divergence = _first_divergence(first.ops, second.ops, compare_shapes=not dynamic)
        if divergence is not None:
            what, filename, lineno = divergence
            severity, message, fix = KINDS["control-flow"]
            findings[("control-flow", filename, lineno)] = Finding(
                "control-flow", severity, filename, lineno, message.format(what=what), fix
            )
    finally:
        rng.restore()
    ordered = sorted(findings.values(), key=lambda f: (f.filename, f.lineno, f.kind))
    return Report(function=name, findings=ordered)


def _outputs_aliasing_inputs(
    fn: Callable[..., Any], collector: Collector, out: Any, inputs: dict[int, str]
) -> None:

    leaves, spec = flatten(out)
    code = getattr(getattr(fn, "forward", fn), "__code__", None)
    filename, lineno = (code.co_filename, code.co_firstlineno) if code else ("<outputs>", 0)
    for path, leaf in zip(leaf_paths(spec, root="out"), leaves):
        if isinstance(leaf, torch.Tensor) and _storage(leaf) in inputs:
            severity, message, fix = KINDS["output-aliases-input"]
            collector.findings[("output-aliases-input", path, 0)] = Finding(
                "output-aliases-input",
                severity,
                filename,
                lineno,
                message.format(what="", where=path, other=inputs[_storage(leaf)]),
                fix,
            )


def _first_divergence(
    a: list[tuple[Any, ...]], b: list[tuple[Any, ...]], *, compare_shapes: bool
) -> tuple[str, str, int] | None:
    """Where two runs' op sequences part (by op, and by argument shapes unless the shapes are
    known to depend on data already)."""
    width = 2 if compare_shapes else 1
    for x, y in zip(a, b):
        if x[:width] != y[:width]:
            return f"first run: {x[0]}, second run: {y[0]}", y[2], y[3]
    if len(a) != len(b):
        longer, n = (a, len(b)) if len(a) > len(b) else (b, len(a))
        extra = longer[n]
        return f"one run called {len(longer) - n} more op(s), from {extra[0]}", extra[2], extra[3]
    return None

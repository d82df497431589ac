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

import contextlib
import contextvars
import dataclasses
import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import optree
import torch

from ..core import (
    NAMESPACE,
    HostDraws,
    PythonSnapshot,
    Reader,
    RngState,
    SideEffects,
    Signature,
    closure_tensors,
    flatten,
    leaf_paths,
    library_setting,
    modules_of,
    reachable_tensors,
    storage_key,
    user_frame,
)
from .findings import KINDS, Collector, Finding, Report
from .verify import random_like
from .watches import DispatchWatch, FunctionWatch, as_if_capturing, patched_calls, sync_debug

__all__ = ["Finding", "Report", "doctor", "findings_located_at", "relocate"]

# Where a finding goes when no frame on the stack is the user's (set by the command line, whose
# own frames call the user's target).
_FALLBACK_LOCATION: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "cudagraphs_doctor_fallback_location", default=None
)


@contextlib.contextmanager
def findings_located_at(filename: str, lineno: int) -> Iterator[None]:
    """Inside, a finding with no frame of the user's (a BatchNorm's own code, reached from
    library frames only, as from ``python -m cudagraphs doctor``/``auto``) is placed at
    ``filename:lineno`` (the maker that built the model) instead of ``<unknown>:0``; this holds
    for ``cg.auto``'s findings too, which come from the doctor."""
    token = _FALLBACK_LOCATION.set((filename, lineno))
    try:
        yield
    finally:
        _FALLBACK_LOCATION.reset(token)


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

    return {storage_key(t): name for name, _, t in closure_tensors(fn)}


def _known_storages(fn: Callable[..., Any], objects: list[Any]) -> set[int]:
    known: set[int] = set()
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for t in [*obj.parameters(), *obj.buffers()]:
                known.add(storage_key(t))
    return known


def _run(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], objects: list[Any]
) -> tuple[Collector, Any, dict[int, str]]:
    """One eager run on clones of the inputs, watched; what it writes outside them is put back."""
    signature, leaves = Signature.of_call(args, kwargs)
    clones = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
    inputs = {storage_key(clones[i]): signature.paths[i] for i in signature.tensor_index}
    known = _known_storages(fn, objects) | set(inputs)
    collector = Collector()
    call_args, call_kwargs = optree.tree_unflatten(signature.spec, clones)
    tensors = [clones[i] for i in signature.tensor_index]
    plain = [clones[i] for i in signature.frozen_index]
    state = {storage_key(t): name for name, t in reachable_tensors(fn, plain, exclude=tensors)}
    effects = SideEffects(fn, tensors, plain, "restore")
    try:
        with ExitStack() as stack:
            stack.enter_context(patched_calls(collector))
            stack.enter_context(as_if_capturing())
            if torch.cuda.is_available():
                stack.enter_context(sync_debug(collector))
            stack.enter_context(effects.running())
            on_cuda = any(t.is_cuda for t in tensors)
            stack.enter_context(FunctionWatch(collector, on_cuda=on_cuda))
            stack.enter_context(DispatchWatch(collector, inputs, known, _external_names(fn), state))
            out = fn(*call_args, **call_kwargs)
    finally:
        effects.finish()
    return collector, out, inputs


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
    # Where a finding has no frame of the user's (a torch module's own code, called from the
    # library), it is reported at the line that called the doctor.
    caller = user_frame()
    if caller[0] == "<unknown>":
        caller = _FALLBACK_LOCATION.get() or caller
    # Plain Python values the runs change are found (a capture refuses them) and put back.
    leaves = flatten((args, kwargs))[0]
    plain = PythonSnapshot(fn, [x for x in leaves if not isinstance(x, torch.Tensor)])
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    host = HostDraws(name)
    reader = Reader()
    try:
        objects = _reachable_state(fn, (args, kwargs))
        with reader:
            first, out, inputs = _run(fn, args, kwargs, objects)
        plain.take()
        host.take()
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
        plain.take()
        host.take()
        drawn = host.drawn()
        if drawn:
            severity, message, fix = KINDS["host-random"]
            findings[("host-random", *caller)] = Finding(
                "host-random", severity, *caller,
                message.format(what=name, where=" and ".join(drawn)), fix.format(name=drawn[0]),
            )  # fmt: skip
        for label, was, became in plain.changes():
            key, filename, lineno = _python_state(label, was, became, reader, caller)
            findings[key] = findings.get(key) or _state_finding(
                label, was, became, filename, lineno
            )
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
        host.restore()
        plain.restore()  # the user's attributes as they were before the doctor
    placed = [_with_setting(relocate(f, *caller)) for f in findings.values()]
    ordered = sorted(_one_per_cause(placed), key=lambda f: (f.filename, f.lineno, f.kind))
    return Report(function=name, findings=ordered)


def _python_state(
    label: str, was: Any, became: Any, reader: Reader, caller: tuple[str, int]
) -> tuple[tuple[str, str, int], str, int]:
    """Where the code that ran writes ``label``'s attribute (``self.calls += 1``): the first
    such line, or the doctor's caller where none is found."""
    attribute = label.rsplit(".", 1)[-1]
    pattern = re.compile(rf"\.{re.escape(attribute)}\s*(?:[-+*/%&|^@]|//|\*\*|<<|>>)?=(?!=)")
    for code in reader.codes:
        try:
            lines, start = inspect.getsourcelines(code)
        except (OSError, TypeError):
            continue
        for offset, line in enumerate(lines):
            if pattern.search(line):
                return (
                    ("python-state", code.co_filename, start + offset),
                    code.co_filename,
                    start + offset,
                )
    return ("python-state", *caller), *caller


def _state_finding(label: str, was: Any, became: Any, filename: str, lineno: int) -> Finding:
    severity, message, fix = KINDS["python-state"]
    what = f"{label} (was {was!r}, became {became!r})"
    name = label.rsplit(".", 1)[-1]
    return Finding(
        "python-state", severity, filename, lineno,
        message.format(what=what, where="a plain Python value"), fix.format(name=name),
    )  # fmt: skip


def _with_setting(finding: Finding) -> Finding:
    """A break inside a library's code that one of its settings removes: say which."""
    setting = library_setting(finding.filename) if finding.severity == "error" else None
    if setting is None:
        return finding
    return dataclasses.replace(
        finding, fix=f"{finding.fix}; or mark the block eager=[...], or {setting}"
    )


def relocate(finding: Finding, filename: str, lineno: int) -> Finding:
    """``finding`` at ``filename:lineno`` where no frame of the user's was found for it."""
    if finding.filename != "<unknown>" or filename == "<unknown>":
        return finding
    return dataclasses.replace(finding, filename=filename, lineno=lineno)


# A step that is not capturable (optimizer) or a scaler's step (grad-scaler) explains everything
# else its own code does on that line: a host read, a CPU tensor, a branch, its state writes.
_CAUSES = ("optimizer", "grad-scaler")


def _one_per_cause(findings: Any) -> list[Finding]:
    """One finding per cause, with a fix that works on this machine."""
    found = list(findings)
    causes = {(f.filename, f.lineno) for f in found if f.kind in _CAUSES}
    kept = [f for f in found if f.kind in _CAUSES or (f.filename, f.lineno) not in causes]
    if torch.cuda.is_available():
        return kept
    return [
        dataclasses.replace(f, fix=_CPU_OPTIMIZER_FIX) if f.kind == "optimizer" else f for f in kept
    ]


_CPU_OPTIMIZER_FIX = (
    "on this machine (no CUDA) the step runs eagerly and needs no change; on a GPU pass the "
    "optimizer to cg.train_step, which switches it to its fused or capturable form"
)


def _outputs_aliasing_inputs(
    fn: Callable[..., Any], collector: Collector, out: Any, inputs: dict[int, str]
) -> None:

    leaves, spec = flatten(out)
    code = getattr(getattr(fn, "forward", fn), "__code__", None)
    filename, lineno = (code.co_filename, code.co_firstlineno) if code else ("<outputs>", 0)
    for path, leaf in zip(leaf_paths(spec, root="out"), leaves):
        if isinstance(leaf, torch.Tensor) and storage_key(leaf) in inputs:
            severity, message, fix = KINDS["output-aliases-input"]
            collector.findings[("output-aliases-input", path, 0)] = Finding(
                "output-aliases-input",
                severity,
                filename,
                lineno,
                message.format(what="", where=path, other=inputs[storage_key(leaf)]),
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

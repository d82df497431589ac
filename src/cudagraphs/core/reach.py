"""What a function can reach beyond its arguments: the objects the library inspects.

A recording reads and writes more than its inputs: module parameters and buffers, a cache
object's layers, closure tensors, the plain Python values in all of these. :func:`walk` visits
them, named as a user would write them (``model.layers[0].attn``, ``cache.layers[1]``), in a
bounded walk (depth 6, 20000 objects): its module or bound ``self``, its closure cells and the
globals its own code names, the closures of functions found on the way, the objects those hold,
and any extra roots (the call's plain arguments). :func:`reachable_tensors` keeps the tensors
(what warm-up may write); ``python_state`` keeps the plain values (what a recording freezes).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .written_state import storage_key

__all__ = ["is_compiled", "named_roots", "reachable_tensors", "walk"]

_MAX_OBJECTS = 20000
_MAX_DEPTH = 6
_OPAQUE = (str, bytes, int, float, bool, complex, type, type(None), torch.dtype, torch.device)


def walk(fn: Callable[..., Any], roots: Iterable[Any] = ()) -> Iterator[tuple[str, Any]]:
    """``(name, object)`` for each object ``fn`` can reach, once each; tensors are yielded but
    not entered, plain values are not yielded (read them from their owner's ``__dict__``)."""
    seen: set[int] = set()
    stack: list[tuple[str, Any, int]] = [
        (name, value, 0) for name, value in reversed(named_roots(fn))
    ]
    stack.extend((f"argument {type(r).__name__}", r, 0) for r in roots)
    while stack and len(seen) < _MAX_OBJECTS:
        name, obj, depth = stack.pop()
        if isinstance(obj, _OPAQUE) or id(obj) in seen:
            continue
        seen.add(id(obj))
        yield name, obj
        if isinstance(obj, torch.Tensor) or depth >= _MAX_DEPTH:
            continue
        if isinstance(obj, (types.FunctionType, types.MethodType)):
            # A function it calls keeps its own state in its closure (or its bound object).
            stack.extend((f"{name}{suffix}", child, depth + 1) for suffix, child in _closure(obj))
            continue
        if callable(obj) and not isinstance(obj, torch.nn.Module):
            continue
        stack.extend((f"{name}{suffix}", child, depth + 1) for suffix, child in _children(obj))


def reachable_tensors(
    fn: Callable[..., Any], roots: Iterable[Any] = (), exclude: Iterable[torch.Tensor] = ()
) -> list[tuple[str, torch.Tensor]]:
    """Tensors ``fn`` can reach (see :func:`walk`), one entry per storage, named; ``exclude``
    (the inputs) is left out."""
    skip = {storage_key(t) for t in exclude}
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for name, obj in walk(fn, roots):
        if isinstance(obj, torch.Tensor):
            key = storage_key(obj)
            if key and key not in skip and key not in found and obj.device.type != "meta":
                found[key] = (name, obj)
    return list(found.values())


def named_roots(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    """What ``fn`` reads beyond its arguments: its module or bound ``self``, its closure cells and
    the globals its own code names, each with the name it has there."""
    roots: list[tuple[str, Any]] = []
    for candidate in (fn, getattr(fn, "__self__", None), getattr(fn, "_orig_mod", None)):
        if isinstance(candidate, torch.nn.Module) or (
            candidate is not None and candidate is not fn and hasattr(candidate, "__dict__")
        ):
            roots.append((type(candidate).__name__, candidate))
    target = inspect.unwrap(getattr(fn, "__func__", fn))
    code = getattr(target, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, getattr(target, "__closure__", None) or ()):
            with contextlib.suppress(ValueError):
                roots.append((name, cell.cell_contents))
        namespace = getattr(target, "__globals__", {})
        roots.extend((n, namespace[n]) for n in code.co_names if n in namespace)
    return roots


def _closure(fn: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(fn, types.MethodType):
        yield "", fn.__self__
        return
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        with contextlib.suppress(ValueError):
            yield f"->{name}", cell.cell_contents


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, torch.nn.Module):
        for name, t in obj.named_parameters(recurse=False):
            yield f".{name}", t
        for name, t in obj.named_buffers(recurse=False):
            yield f".{name}", t
        for name, child in obj.named_children():
            yield f".{name}", child
        values = obj.__dict__.items()
        for key, value in values:
            if not key.startswith("_") and not isinstance(value, torch.nn.Module):
                yield f".{key}", value
        return
    if isinstance(obj, torch.optim.Optimizer):
        for k, state in enumerate(obj.state.values()):
            yield f".state[{k}]", state
        yield ".param_groups", obj.param_groups
        return
    if isinstance(obj, dict):
        for key, value in list(obj.items())[:1000]:
            yield f"[{key!r}]", value
        return
    if isinstance(obj, (list, tuple)):
        for k, value in enumerate(obj[:1000]):
            yield f"[{k}]", value
        return
    if inspect.ismodule(obj) or not hasattr(obj, "__dict__"):
        return
    for key, value in list(vars(obj).items())[:1000]:
        yield f".{key}", value


def is_compiled(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is, or directly calls through, a ``torch.compile``'d callable."""
    candidates = [fn, getattr(fn, "__self__", None)]
    candidates.extend(value for _, value in named_roots(fn))
    return any(
        hasattr(c, "_torchdynamo_orig_callable") or type(c).__name__ == "OptimizedModule"
        for c in candidates
        if c is not None
    )

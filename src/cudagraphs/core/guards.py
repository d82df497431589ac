"""Address guards: the graph read parameters, buffers and closure tensors by address.

A replay reads every tensor the recording touched at the address it had at capture. If the
program later points a parameter at new memory (``param.data = t``, ``model.to(...)``, a buffer
reassigned with ``module.buf = t``, a global tensor rebound), the replay silently computes with
the old memory. The guard records those addresses at capture and checks them before each replay:

- one C call compares the data pointers of all guarded tensors (``addresses.AddressCheck``: a
  few ns per tensor when its loop could be compiled; cost measured in ``benchmarks/overhead.py``),
  and, in the same call, that every parameter, buffer and child entry of the guarded modules
  still holds the object it held at capture (``module.to()`` and ``module.buf = t`` put new
  objects there while the old ones may stay alive at their old addresses). Nothing in torch is
  patched or hooked for this: the guard reads the user's modules only;
- closure and global tensors, and plain values (bool, int, float, str) that ``fn``'s own code
  reads from its closure or globals, are checked by identity (a global flag that decided a
  branch at capture must not change unnoticed);
- each module's train/eval mode is checked (``model.train()`` after an eval-mode capture).

In-place updates (``load_state_dict``, ``param.copy_(...)``, optimizer steps) keep addresses, so
they need no recapture and replays see the new values.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from . import compat
from .addresses import AddressCheck

__all__ = ["AddressGuard", "closure_tensors", "modules_of"]


def modules_of(fn: Callable[..., Any], extra: Iterable[nn.Module] = ()) -> list[nn.Module]:
    """The modules whose tensors ``fn`` reads: itself, a bound method's owner, ``extra``, and
    modules ``fn``'s own code reads from its closure or globals (``model`` in a step function)."""
    found: list[nn.Module] = []
    referenced = [value for _, _, value in _referenced(fn, (nn.Module,))]
    candidates = (fn, getattr(fn, "__self__", None), getattr(fn, "_orig_mod", None), *extra)
    for candidate in (*candidates, *referenced):
        if isinstance(candidate, nn.Module) and all(candidate is not m for m in found):
            found.append(candidate)
    return found


_FROZEN_TYPES = (bool, int, float, str)


def closure_tensors(
    fn: Callable[..., Any], *, values: bool = False
) -> list[tuple[str, Callable[[], Any], Any]]:
    """Tensors ``fn`` reads from its closure or module globals: ``(name, getter, tensor)``.

    With ``values=True``, plain values (bool, int, float, str) too: a graph freezes the branch
    or constant they decided at capture, so a later change must not go unnoticed. Only ``fn``'s
    own code is inspected (not the functions it calls).
    """
    return _referenced(fn, (torch.Tensor, *_FROZEN_TYPES) if values else (torch.Tensor,))


def _referenced(
    fn: Callable[..., Any], kinds: tuple[type, ...]
) -> list[tuple[str, Callable[[], Any], Any]]:
    """Values of the given types that ``fn``'s own code reads from its closure or globals."""
    target = inspect.unwrap(getattr(fn, "__func__", fn))
    code = getattr(target, "__code__", None)
    if code is None:
        return []
    found = []
    for name, cell in zip(code.co_freevars, getattr(target, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, kinds):
            found.append((f"closure variable {name!r}", lambda c=cell: c.cell_contents, value))
    namespace = getattr(target, "__globals__", {})
    for name in code.co_names:
        value = namespace.get(name)
        if isinstance(value, kinds):
            found.append((f"global {name!r}", lambda n=name: namespace.get(n), value))
    return found


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) < 40 else text[:37] + "..."


class AddressGuard:
    """Checks, before a replay, that every tensor the graph reads by address is still there."""

    def __init__(
        self,
        fn: Callable[..., Any],
        modules: Iterable[nn.Module] = (),
        *,
        extra: Iterable[tuple[str, torch.Tensor]] = (),
        watches: Iterable[Any] = (),
        modes: bool = True,
    ):
        """``extra``: more named tensors read by address (an optimizer's state); ``watches``:
        objects with a ``stale() -> str | None`` method, asked before each replay; ``modes``:
        whether a module's train/eval switch counts as stale (off for callers that route
        calls by mode themselves)."""
        self._modes = modes
        self.fn = fn
        self.modules = modules_of(fn, modules)
        self.closures = closure_tensors(fn, values=True)
        self.extra = list(extra)
        self.watches = list(watches)
        self._record()

    def _module_tensors(self) -> list[tuple[str, torch.Tensor]]:
        named = []
        for k, module in enumerate(self.modules):
            prefix = type(module).__name__ if len(self.modules) == 1 else f"modules[{k}]"
            for name, t in module.named_parameters():
                named.append((f"{prefix}.{name}", t))
            for name, t in module.named_buffers():
                named.append((f"{prefix}.{name}", t))
        return named

    def _record(self) -> None:
        named = [
            (n, t)
            for n, t in self._module_tensors() + self.extra
            # CPU tensors too: a CUDA graph reads none, and a tracked one costs a few ns, but
            # the CPU stand-in of the tests reads them, so the guard can be tested there.
            if t is not None and t.device.type != "meta"
        ]
        self.names = [n for n, _ in named]
        self.tensors = [t for _, t in named]
        self.addresses = AddressCheck(self.tensors)
        self.ptrs = self.addresses.ptrs
        self.unchanged = self.addresses.unchanged
        self.closure_ids = [(name, get, t) for name, get, t in self.closures]
        # train()/eval() after capture would silently keep the recorded mode (dropout, BN).
        self.training = [(m, m.training) for m in self.modules] if self._modes else []
        # Which object each parameter, buffer and child slot of the modules holds.
        self.entries = [e for m in self.modules for e in compat.module_entries(m)]
        self.simple = not self.closure_ids and not self.watches  # addresses and modes only
        # ``check()``: True when nothing watched changed. Addresses, modes and module slots are
        # one call (C where compiled); rebound names and watched objects, where there are any,
        # are checked after it one by one (a few per guard), never the module tree in Python.
        fast = self.addresses.with_modes(
            [m for m, _ in self.training], [t for _, t in self.training],
            _by_mapping(self.entries),
        )  # fmt: skip
        self.check: Callable[[], bool] = (
            fast if self.simple else _then_each(fast, self.closure_ids, self.watches)
        )

    @property
    def count(self) -> int:
        """How many tensors and values this guard checks before each replay."""
        return len(self.tensors) + len(self.closure_ids) + len(self.training) + len(self.watches)

    def stale(self) -> str | None:
        """``None`` if every guarded address is unchanged; else which tensor moved, in words."""
        if self.check():  # the common answer first: it runs before every replay
            return None
        return self._why_stale()

    def _why_stale(self) -> str | None:
        if self.tensors and not self.unchanged():
            moved = self.addresses.moved() or [0]
            return f"{self.names[moved[0]]} now lives at new memory (param.data = ..., or module.to(...))"
        for name, get, t in self.closure_ids:
            if get() is not t:
                return f"{name} was rebound (was {_short(t)}, now {_short(get())})"
        for watch in self.watches:
            if (reason := watch.stale()) is not None:
                return reason
        for module, training in self.training:
            if module.training is not training:
                return f"{type(module).__name__} was switched to {'train' if module.training else 'eval'} mode"
        for name, mapping, key, value in self.entries:
            if mapping.get(key) is not value:
                return f"{name} was replaced by another object (module.to(...), module.{key} = ...)"
        return None


def _by_mapping(entries: list[tuple[str, Any, str, Any]]) -> list[tuple[Any, tuple[Any, ...]]]:
    """Each slot dict once, with the objects it holds in order (what the check compares)."""
    seen: dict[int, tuple[Any, tuple[Any, ...]]] = {}
    for _, mapping, _, _ in entries:  # (an empty dict has no entry: nothing recorded reads it)
        if id(mapping) not in seen:
            seen[id(mapping)] = (mapping, tuple(mapping.values()))
    return list(seen.values())


def _then_each(
    fast: Callable[[], bool],
    closures: list[tuple[str, Callable[[], Any], Any]],
    watches: list[Any],
) -> Callable[[], bool]:
    """``fast()``, then that each closure or global name still holds its object and that no
    watched object reports a change: the per-replay check of a guard with those."""
    held = tuple((get, value) for _, get, value in closures)
    watched = tuple(watches)

    def check() -> bool:
        return (
            fast()
            and all(get() is value for get, value in held)
            and all(watch.stale() is None for watch in watched)
        )

    return check

"""What a replay checks before it runs: tensors still at their addresses, and the Python
objects around them (the modes are ``modes.py``'s).

The graph read parameters, buffers and closure tensors by address.

A replay reads every tensor the recording touched at the address it had at capture. If the
program later points a parameter at new memory (``param.data = t``, ``model.to(...)``, a buffer
reassigned with ``module.buf = t``, a global tensor rebound), the replay silently computes with
the old memory. The guard records those addresses at capture and checks them before each replay:

- one C call compares the data pointers of all guarded tensors (:class:`AddressCheck`; its cost
  per tensor is measured by ``benchmarks/overhead.py``),
  and, in the same call, that every parameter, buffer and child entry of the guarded modules
  still holds the object it held at capture (``module.to()`` and ``module.buf = t`` put new
  objects there while the old ones may stay alive at their old addresses), and that every plain
  value the recording read (``python_values.ValueWatch``) is still the same object or an equal
  one of the same type. Nothing in torch is patched or hooked for this: the guard reads the
  user's modules and namespaces only;
- closure and global tensors, and plain values (bool, int, float, str) that ``fn``'s own code
  reads from its closure or globals, are checked by identity (a global flag that decided a
  branch at capture must not change unnoticed);
- each module's train/eval mode is checked (``model.train()`` after an eval-mode capture).

In-place updates (``load_state_dict``, ``param.copy_(...)``, optimizer steps) keep addresses, so
they need no recapture and replays see the new values.

How the addresses are read: one call over all guarded tensors, before every replay, so its
cost is paid per call. Three ways, the fastest that works is used:

1. ``compiled``: the small C++ extension of the host-side work before a replay
   (``_before_replay.cpp``: this check, the modules' check, the copy nodes' edits), built when
   the package is installed (optional: installing without a compiler still works). It includes
   ``Python.h`` only and reads each address through the function pointer that PyTorch exports
   for Inductor's C++ wrapper (``compat.tensor_address_reader``), so no Python objects are made
   per tensor.
2. ``torch helper``: the helper cudagraph trees use (``compat.tensors_at_addresses``, CUDA
   builds); pybind11 converts every element.
3. ``python loop``: ``t.data_ptr()`` per tensor, the slowest.

Nothing is compiled or loaded at run time from anywhere but the installed package: a library
loaded from a shared temporary folder could be planted there by another user.
``CUDAGRAPHS_NO_COMPILE=1`` skips the compiled loop (2 or 3 is used).
"""

from __future__ import annotations

import array
import functools
import inspect
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from . import compat
from .frames import class_names, is_model_class
from .signature import CLASS_OF, held_value_still, is_plain
from .writes import walk

__all__ = [
    "AddressCheck",
    "AddressGuard",
    "closure_tensors",
    "compiled_module",
    "modules_of",
]


def modules_of(fn: Callable[..., Any], extra: Iterable[nn.Module] = ()) -> list[nn.Module]:
    """The modules whose tensors ``fn`` reads: itself, a bound method's owner, ``extra``,
    modules ``fn``'s own code reads from its closure or globals (``model`` in a step function),
    and modules held by an object of the user's classes that ``fn`` reaches (an RL policy
    object with ``__call__`` holding its networks; an agent in a global)."""
    found: list[nn.Module] = []
    referenced = [value for _, _, value in _referenced(fn, (nn.Module,))]
    candidates = (fn, getattr(fn, "__self__", None), getattr(fn, "_orig_mod", None), *extra)
    for candidate in (*candidates, *referenced, *_held_by_user_objects(fn)):
        if isinstance(candidate, nn.Module) and all(candidate is not m for m in found):
            found.append(candidate)
    return found


def _held_by_user_objects(fn: Callable[..., Any]) -> list[nn.Module]:
    """The outermost modules :func:`writes.walk` reaches from ``fn`` outside any module: those
    an object of the user's classes holds (a module's own children are its parameters' owner's
    business)."""
    inside: set[int] = set()
    held: list[nn.Module] = []
    for _, obj in walk(fn):  # breadth first: an outer module comes before what it holds
        if isinstance(obj, nn.Module) and id(obj) not in inside:
            held.append(obj)
            inside.update(id(m) for m in obj.modules())
    return held


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
        backward: bool = False,
    ):
        """``extra``: more named tensors read by address (an optimizer's state); ``watches``:
        objects with a ``stale() -> str | None`` method, asked before each replay; ``modes``:
        whether a module's train/eval switch counts as stale (off for callers that route
        calls by mode themselves); ``backward``: watch backward hooks too (a training graph)."""
        self._modes = modes
        self._backward = backward
        self.fn = fn
        self.modules = modules_of(fn, modules)
        self.closures = closure_tensors(fn, values=True)
        self.watches = list(watches)
        # Tensors a value watch holds by identity are read by address as parameters are.
        self.extra = list(extra) + [t for w in self.watches for t in getattr(w, "tensors", ())]
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
        # A sharded tensor (a DTensor: FSDP2's parameters, their gradients and optimizer
        # state) is read through the shard it holds: the shard's address, and which shard its
        # slot holds (``model.to(...)`` swaps it under the same DTensor).
        self.shards = [(n, t, *found) for n, t in named if (found := compat.tensor_shard(t))]
        named += [(f"{n} (its shard)", shard) for n, _, _, shard in self.shards]
        self.names = [n for n, _ in named]
        self.tensors = [t for _, t in named]
        self.addresses = AddressCheck(self.tensors)
        self.ptrs = self.addresses.ptrs
        self.unchanged = self.addresses.unchanged
        self.closure_ids = [(name, get, t) for name, get, t in self.closures]
        # Every module of the tree: its class (``module.__class__ = Other`` swaps its forward),
        # and its train/eval mode where its code reads it (dropout, BN, a model's own branch):
        # a switch after capture (``bn.eval()`` on one layer) would keep the recorded mode.
        tree = list({id(m): (n, m) for r in self.modules for n, m in _named_tree(r)}.values())
        self.classes = [(name, m, type(m)) for name, m in tree]
        moded = [m for _, m in tree if m in self.modules or "training" in class_names(type(m))]
        self.training = [(m, m.training) for m in moded] if self._modes else []
        # The settings torch's own modules read in their forward (``LayerNorm.eps``, ``p`` of
        # a dropout, a slope, a softmax's ``dim``): model code's are the value watch's.
        self.settings = [
            (f"{name}.{key}", m.__dict__, key, m.__dict__[key])
            for name, m, cls in self.classes if not is_model_class(cls)
            for key in class_names(cls) & m.__dict__.keys()
            if key != "training" and is_plain(m.__dict__[key])
        ]  # fmt: skip
        # Which object each parameter, buffer and child slot of the modules holds; the dicts
        # themselves, empty ones too, so that a slot added since is seen.
        slots = [s for m in self.modules for s in compat.module_slot_dicts(m)]
        self.slots = [(name, d, tuple(dict.values(d))) for name, d in slots]
        # Hooks ran at capture: one added or removed since would silently not (or still) run.
        hooks = [h for m in self.modules for h in compat.module_hook_dicts(m, self._backward)]
        hooks += compat.global_hook_dicts(self._backward) if self.modules else []
        self.hooks = [(name, d, tuple(dict.values(d))) for name, d in hooks]
        # A watch that holds plain values (``held``: (dict, key, value) triples) is checked
        # inside the one call below; any other watch is asked after it.
        held = tuple(v for w in self.watches for v in getattr(w, "held", ()))
        held += tuple((m, CLASS_OF, cls) for _, m, cls in self.classes)
        held += tuple((d, key, value) for _, d, key, value in self.settings)
        held += tuple((t, slot, shard) for _, t, slot, shard in self.shards)
        # A child's mode as a dict entry (cheaper than an attribute lookup); the roots' below.
        is_root = {id(m) for m in self.modules}
        roots = [(m, t) for m, t in self.training if id(m) in is_root]
        held += tuple((m.__dict__, "training", t) for m, t in self.training if id(m) not in is_root)
        others = [w for w in self.watches if not hasattr(w, "held")]
        self.simple = not self.closure_ids and not others  # one call checks everything
        # ``check()``: True when nothing watched changed. Addresses, modes, module slots and
        # plain values are one call (C where compiled): a Python frame per watch would be paid
        # by every replay. Rebound names and other watched objects, where there are any, are
        # checked after it one by one (a few per guard), never the module tree in Python.
        fast = self.addresses.with_modes(
            [m for m, _ in roots], [t for _, t in roots],
            [(d, values) for _, d, values in self.slots + self.hooks], held,
        )  # fmt: skip
        self.check: Callable[[], bool] = (
            fast if self.simple else _then_each(fast, self.closure_ids, others)
        )

    def untraced_changes(self) -> list[type]:
        """The classes the guarded modules were switched away from since the capture (which
        ``torch.compile``'s own guards do not cover)."""
        return [cls for _, module, cls in self.classes if type(module) is not cls]

    @property
    def count(self) -> int:
        """How many tensors and values this guard checks before each replay."""
        watched = (
            self.tensors,
            self.closure_ids,
            self.training,
            self.shards,
            self.watches,
            self.slots,
            self.hooks,
        )
        return sum(map(len, watched))

    def stale(self) -> str | None:
        """``None`` if every guarded address is unchanged; else which tensor moved, in words."""
        if self.check():  # the common answer first: it runs before every replay
            return None
        # A failed check is never overruled: without a named cause it still captures again.
        return self._why_stale() or "a guarded object changed (no single cause was found)"

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
        for name, module, cls in self.classes:
            if type(module) is not cls:
                return f"{name}'s class was changed from {cls.__name__} to {type(module).__name__}"
        for name, d, key, value in self.settings:
            if not held_value_still((d, key, value)):
                return f"{name} was changed from {value!r} to {d.get(key)!r}"
        for name, t, slot, shard in self.shards:
            if not held_value_still((t, slot, shard)):
                return f"{name} holds another shard now (module.to(...) on a sharded model)"
        for name, slot, recorded in self.slots:
            if _same_objects(slot, recorded):
                continue
            if len(slot) == len(recorded):  # the same keys: one holds another object
                for key, now, was in zip(dict.keys(slot), dict.values(slot), recorded):
                    if now is not was:
                        return f"{name}.{key} was replaced by another object (module.to(...), module.{key} = ...)"
            return f"a parameter, buffer or submodule was added to or removed from {name}"
        for name, hooks, recorded in self.hooks:
            if not _same_objects(hooks, recorded):
                return f"{name} changed: a hook was added or removed after the capture"
        return None


def _named_tree(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in root.named_modules():
        yield f"{type(root).__name__}{'.' + name if name else ''}", module


def _same_objects(mapping: dict[Any, Any], values: tuple[Any, ...]) -> bool:
    """``mapping`` holds exactly ``values`` in storage order (the C check's; ``OrderedDict``'s own
    order differs after ``move_to_end``)."""
    return len(mapping) == len(values) and all(a is b for a, b in zip(dict.values(mapping), values))


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

        if not hasattr(_before_replay, "reads_nested_lists_and_getters"):  # older entries
            raise ImportError("the compiled check was built from an older cudagraphs")
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
        if not check():          # one C call over all the tensors
            recapture()

    Wrong: ``[p.data_ptr() for p in params] == saved`` before every replay: a Python call per
    tensor, paid by every replay.
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
        values: Sequence[tuple[Any, ...]] = (),
    ) -> Callable[[], bool]:
        """One check for a whole guard: True while each owner's ``training`` is still
        ``modes[i]`` (the same object), each ``(mapping, values)`` of ``entries`` still holds
        exactly those objects in that order (an empty one: is still empty, checked as a bare
        dict, most of a model's hook and slot dicts), each entry of ``values`` still holds
        (:func:`held_value_still`), and every
        tensor is at its address. A C-level partial when compiled."""
        module = compiled_module() if self.native else None
        held = tuple((d, tuple(v)) if v else d for d, v in entries)
        if module is not None:
            packed = array.array("Q", self.ptrs).tobytes()
            held_values = (tuple(values),) if values else ()
            return functools.partial(
                module.unchanged, self.tensors, packed, tuple(owners), tuple(modes), held,
                *held_values,
            )  # fmt: skip
        pairs = tuple(zip(owners, modes))
        plain = tuple(values)
        addresses = self.unchanged

        def unchanged() -> bool:
            return (
                all(o.training is m for o, m in pairs)
                and all(_same_objects(*d) if type(d) is tuple else not d for d in held)
                and all(held_value_still(entry) for entry in plain)
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

"""[tree] Call signatures: what a graph was captured for, and why a later call does not match it.

Inputs are pytrees (optree) of tensors and plain values. A graph reads each tensor leaf from a
fixed buffer, so a call must bring the same tree structure and, per tensor leaf, the same shape,
dtype and device. Plain values were seen once, at capture, and baked into the recording, so a
call must bring equal values. This module records that signature and turns a mismatch into an
:class:`~cudagraphs.errors.InputMismatchError` that names the leaf (``args[0]['obs']``).

The fast per-call check lives in :mod:`cudagraphs.core.replay`; everything here runs at
capture time or after a mismatch, where clarity beats speed.

The same equality rule decides whether a Python value a recording read still holds: the entry
shapes of a value watch (:func:`held_value_still`, the Python form of the compiled check).
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
from collections.abc import Sequence
from typing import Any

import optree
import torch

from ..errors import InputMismatchError, StaleOutputError, explain

__all__ = [
    "CLASS_OF",
    "MISSING",
    "NAMESPACE",
    "Signature",
    "buffer_holds",
    "by_value_types",
    "flatten",
    "held_value_now",
    "held_value_still",
    "is_plain",
    "leaf_paths",
    "same_value",
]

#: optree namespace in which stdlib dataclasses are registered as pytree nodes.
NAMESPACE = "cudagraphs"

_registered_dataclasses: set[type] = set()


def _register_dataclass(cls: type) -> None:
    """Make a stdlib dataclass a pytree node whose children are its ``init`` fields."""
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init)

    def flatten_fn(obj: Any) -> tuple[tuple[Any, ...], tuple[str, ...], tuple[str, ...]]:
        return tuple(getattr(obj, n) for n in names), names, names

    def unflatten_fn(field_names: tuple[str, ...], children: Sequence[Any]) -> Any:
        return cls(**dict(zip(field_names, children)))

    optree.register_pytree_node(
        cls, flatten_fn, unflatten_fn, namespace=NAMESPACE, path_entry_type=optree.GetAttrEntry
    )
    _registered_dataclasses.add(cls)


def flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``tree``, registering any dataclass type met on the way as a pytree node.

    Registration is global and happens once per type, so the fast path can later flatten with a
    plain ``optree.tree_flatten(..., namespace=NAMESPACE)`` and see the same structure.
    """
    while True:
        leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
        new = {
            type(leaf)
            for leaf in leaves
            if dataclasses.is_dataclass(leaf)
            and not isinstance(leaf, type)
            and type(leaf) not in _registered_dataclasses
        }
        if not new:
            return leaves, spec
        for cls in new:
            _register_dataclass(cls)


def leaf_paths(spec: optree.PyTreeSpec, root: str | None = None) -> list[str]:
    """Readable paths of every leaf: ``args[0]['obs']``, ``kwargs['temperature']``.

    With ``root=None`` the tree is taken to be the ``(args, kwargs)`` pair of a call.
    """
    paths = []
    for accessor in spec.accessors():
        code = accessor.codify("")
        if root is not None:
            paths.append(root + code)
        elif code.startswith("[0]"):
            paths.append("args" + code[3:])
        elif code.startswith("[1]"):
            paths.append("kwargs" + code[3:])
        else:  # pragma: no cover - the call tree always has two children
            paths.append(code)
    return paths


_PLAIN = (bool, int, float, complex, str, bytes, type(None), enum.Enum)


def is_plain(value: Any, depth: int = 0) -> bool:
    """An immutable plain value whose changes a recording would not see: a number, string,
    enum or ``None``, a NumPy scalar (``np.float32(2.0)``), or a tuple of such values."""
    if isinstance(value, tuple) and depth < 3 and len(value) <= 64:
        return all(is_plain(v, depth + 1) for v in value)
    return isinstance(value, _PLAIN) or _is_numpy_scalar(value)


def by_value_types() -> tuple[type, ...]:
    """Types beyond Python's own numbers, strings and tuples whose values are compared by
    equality: NumPy's scalars, once NumPy is imported (this library never imports it)."""
    numpy = sys.modules.get("numpy")
    return (numpy.generic,) if numpy is not None and hasattr(numpy, "generic") else ()


def _is_numpy_scalar(value: Any) -> bool:
    numpy = sys.modules.get("numpy")
    if numpy is None or not isinstance(value, getattr(numpy, "generic", ())):
        return False
    # A structured scalar (numpy.void) may view an array's memory: not immutable.
    return not isinstance(value, (numpy.void, numpy.object_))


def buffer_holds(now: Any, snapshot: tuple[bytes, str, tuple[int, ...]]) -> bool:
    """Whether ``now`` (a NumPy array, read through the buffer protocol) still holds the
    ``snapshot`` of its memory: its bytes, element format and shape (the Python form of
    ``_before_replay.cpp``'s ``buffer_holds``)."""
    try:
        view = memoryview(now)
    except (TypeError, ValueError):
        return False
    with view:
        return view.c_contiguous and (view.tobytes(), view.format, view.shape) == snapshot


def same_value(given: Any, frozen: Any) -> bool:
    """Whether a plain (non-tensor) leaf equals the value frozen at capture.

    Types must match too (``True`` is not ``1`` here), and values whose ``==`` does not give a
    plain bool (numpy arrays, exotic objects) must be the very same object.
    """
    if given is frozen:
        return True
    if type(given) is not type(frozen):
        return False
    try:
        return bool(given == frozen)
    except Exception:
        return False


#: What a lookup finds under a key nothing holds (deleted since the recording read it).
MISSING = object()
#: The key of a value-watch entry that holds an object's class: ``(obj, CLASS_OF, cls)``.
CLASS_OF = None


def held_value_now(owner: Any, key: str | None) -> Any:
    """What ``owner`` holds under ``key`` now: a dict's item, a class's attribute lookup (bases
    in order, no descriptor run), a closure cell's contents, its class for :data:`CLASS_OF`,
    a list's item (an ``int`` key), a host getter's result (key ``Ellipsis``), or another
    object's attribute (a slot); else :data:`MISSING`."""
    if key is CLASS_OF:
        return type(owner)
    if isinstance(owner, types.CellType):  # a closure variable (key "cell_contents")
        try:
            return owner.cell_contents
        except ValueError:  # an emptied cell
            return MISSING
    if isinstance(owner, dict):
        return owner.get(key, MISSING)
    if isinstance(owner, list) and isinstance(key, int):  # an item of a list inside a list
        return owner[key] if 0 <= key < len(owner) else MISSING
    if key is Ellipsis:  # a host setting: what its getter returns now
        try:
            return owner()
        except Exception:  # a getter that raises now: a change
            return MISSING
    if not isinstance(owner, type):
        return getattr(owner, key, MISSING)
    for klass in owner.__mro__:
        found = vars(klass).get(key, MISSING)
        if found is not MISSING:
            return found
    return MISSING


def held_value_still(entry: tuple[Any, ...]) -> bool:
    """Whether one entry of a value watch (``python_values.ValueWatch``) holds: the Python form of ``values_hold`` in
    ``_before_replay.cpp``, whose comment lists the entry shapes."""
    if entry[1] is CLASS_OF:
        return type(entry[0]) is entry[2]
    now = held_value_now(entry[0], entry[1])
    if len(entry) == 2:
        return now is MISSING
    if now is MISSING:
        return False
    if len(entry) == 3:
        return _same(now, entry[2])
    if now is not entry[2]:
        return False
    if not isinstance(now, list):  # an array: the same object with the same memory
        return buffer_holds(now, entry[3])
    items = entry[3]
    return len(now) == len(items) and all(map(_same, now, items))


def _same(now: Any, was: Any) -> bool:
    """``values_hold``'s rule: the same object, or an equal one where equality decides (a
    number, string or tuple; a tensor must be the very same object)."""
    if now is was:
        return True
    return (isinstance(was, _BY_EQUALITY) or _is_numpy_scalar(was)) and same_value(now, was)


_BY_EQUALITY = (int, float, complex, str, bytes, tuple)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_stale(tensor: torch.Tensor) -> str | None:
    """The access error of a tensor whose storage was invalidated by a later replay, if any."""
    try:
        tensor.data_ptr()
    except RuntimeError as error:
        if "StaleOutputError" in str(error):
            return str(error)
        raise
    return None


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """What a tensor leaf must look like: the graph's buffer has exactly this layout."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tensor.shape, tensor.dtype, tensor.device)

    def __str__(self) -> str:
        return f"Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


@dataclasses.dataclass
class Signature:
    """The structure of a call: tree spec, leaf paths, tensor metadata and frozen plain values."""

    spec: optree.PyTreeSpec
    paths: list[str]
    tensor_index: tuple[int, ...]
    tensor_meta: tuple[TensorMeta, ...]
    frozen_index: tuple[int, ...]
    frozen_values: tuple[Any, ...]

    @classmethod
    def of_call(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Signature, list[Any]]:
        """Record the signature of ``fn(*args, **kwargs)`` and return it with the call's leaves."""
        leaves, spec = flatten((args, kwargs))
        tensor_index = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        tensor_set = set(tensor_index)
        frozen_index = tuple(i for i in range(len(leaves)) if i not in tensor_set)
        signature = cls(
            spec=spec,
            paths=leaf_paths(spec),
            tensor_index=tensor_index,
            tensor_meta=tuple(TensorMeta.of(leaves[i]) for i in tensor_index),
            frozen_index=frozen_index,
            frozen_values=tuple(leaves[i] for i in frozen_index),
        )
        return signature, leaves

    @property
    def is_flat(self) -> bool:
        """True when the call is positional leaves only: ``fn(x, y, 3)`` with no kwargs.

        Such calls can be checked without flattening, which is the common case and the fast one.
        """
        return self.spec == optree.tree_structure(
            (tuple(range(self.spec.num_leaves)), {}), namespace=NAMESPACE
        )

    def tensor_paths(self) -> list[str]:
        return [self.paths[i] for i in self.tensor_index]

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Return the call's leaves, or raise the error that explains the first mismatch."""
        try:
            leaves, spec = flatten((args, kwargs))
        except Exception as error:  # an object optree cannot walk
            raise InputMismatchError(
                explain(
                    "the call's arguments could not be flattened into a pytree",
                    f"optree raised {type(error).__name__}: {error}",
                    "pass tensors and plain values in tuples, lists, dicts, namedtuples or "
                    "dataclasses",
                )
            ) from error
        if spec != self.spec:
            raise InputMismatchError(self._structure_message(spec))
        for i, meta in zip(self.tensor_index, self.tensor_meta):
            self._check_tensor(self.paths[i], leaves[i], meta)
        for i, frozen in zip(self.frozen_index, self.frozen_values):
            if not same_value(leaves[i], frozen):
                raise InputMismatchError(
                    explain(
                        f"{self.paths[i]} is {_describe(leaves[i])} but the graph was captured "
                        f"with {_describe(frozen)}",
                        "plain Python values are read once, at capture, and frozen into the "
                        "recording; a replay would silently ignore the new value",
                        "pass the value as a tensor if it must change per call (e.g. "
                        "torch.tensor(v, device='cuda')), or capture one graph per value",
                    )
                )
        return leaves

    def _check_tensor(self, path: str, value: Any, meta: TensorMeta) -> None:
        if not isinstance(value, torch.Tensor):
            raise InputMismatchError(
                explain(
                    f"{path} is {_describe(value)} but the graph was captured with {meta}",
                    "the graph reads this input from a fixed tensor buffer",
                    f"pass a tensor of shape {tuple(meta.shape)}, dtype {meta.dtype} on "
                    f"{meta.device}",
                )
            )
        stale = _is_stale(value)
        if stale is not None:
            raise StaleOutputError(
                explain(
                    f"{path} is an output of an earlier replay that a later replay overwrote",
                    "its memory now holds a newer result, so reading it would return wrong data",
                    "use the latest output, or call .clone() on an output you want to keep "
                    "(or capture with outputs='clone')",
                )
            ) from None
        problems = []
        if value.shape != meta.shape:
            problems.append(f"shape {tuple(value.shape)} (captured {tuple(meta.shape)})")
        if value.dtype != meta.dtype:
            problems.append(f"dtype {value.dtype} (captured {meta.dtype})")
        if value.device != meta.device:
            problems.append(f"device {value.device} (captured {meta.device})")
        if not problems:
            return
        if value.shape != meta.shape:
            why = (
                "a graph replays kernels recorded for one shape; copying a different shape into "
                "its buffer would broadcast or fail, never compute the right answer"
            )
            fix = (
                "pad or slice the input to the captured shape, or capture a separate graph for "
                "this shape: cg.graph(fn, example_of_that_shape)"
            )
        elif value.dtype != meta.dtype:
            why = "the copy into the graph's buffer would silently cast the values"
            fix = f"convert it first with .to({meta.dtype}), or capture another graph for {value.dtype}"
        else:
            why = "the graph's kernels and buffers live on one device"
            fix = f"move the input first: .to('{meta.device}')"
        raise InputMismatchError(explain(f"{path} has " + ", ".join(problems), why, fix))

    def _structure_message(self, given: optree.PyTreeSpec) -> str:
        expected_paths = set(self.paths)
        given_paths = leaf_paths(given)
        missing = [p for p in self.paths if p not in set(given_paths)]
        extra = [p for p in given_paths if p not in expected_paths]
        if missing or extra:
            what = "the call's structure differs from the capture's: " + "; ".join(
                part
                for part in (
                    f"missing {', '.join(missing[:4])}" if missing else "",
                    f"unexpected {', '.join(extra[:4])}" if extra else "",
                )
                if part
            )
        else:
            what = (
                "the call's containers differ from the capture's (same leaves, different "
                f"container types): captured {self.spec}, given {given}"
            )
        return explain(
            what,
            "a graph is recorded for one arrangement of inputs; it has no buffer for a new leaf "
            "and would silently ignore a missing one",
            "call with the same arguments, keywords and containers as at capture, or capture "
            "another graph for this arrangement",
        )

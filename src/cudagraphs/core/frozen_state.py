"""What a recording would freeze or repeat, refused at capture: plain Python values the
function changes from run to run, random ops in a loop body (numbers drawn on the host:
``host_draws``).

Values the function changes. A recording runs the function's Python code once: every plain
value it read (a step counter, a "cache is full" flag, a cache's Python position) is baked into
the kernels it launched. If the function changes such a value from run to run, every replay
repeats the first run's choice, silently. So around warm-up and capture a
:class:`PythonSnapshot` holds the plain values (:func:`is_plain`) in the instance dictionaries
of every object the function reaches (``writes.walk``: the module tree, a bound method's
``self``, closure cells, globals its code names, attributes of its plain arguments). One that
differs between two runs after the first (which may set things up once) raises
:class:`~cudagraphs.errors.FrozenStateError` at capture, naming it.

Right::

    class Counted(nn.Module):
        def forward(self, x):
            self.calls += 1                      # a logging counter: harmless
            return self.net(x)

    g = cg.graph(model, x, harmless_state=("calls",))

Wrong::

    class Stepper(nn.Module):
        def forward(self, x):
            self.step += 1
            return x * 2 if self.step % 2 else x  # FrozenStateError: Stepper.step changed

A CUDA graph replays random ops with fresh numbers on every replay (PyTorch advances the
generator's offset per replay), but a loop body recorded once inside a graph (``cg.while_loop``)
runs the same recorded draws on every iteration of one replay: an 8-step random walk would add
the same step 8 times. :class:`RandomDraws` sees each seeded random op (``randn``, ``rand``,
``dropout``, ``multinomial``, ``normal_``...) while such a body is recorded, so the loop can
refuse it with the fix instead of repeating noise silently.

A number drawn on the host (Python's ``random``, NumPy's global generator) is refused at
capture by ``host_draws``.

Which values count (:func:`is_watched`: plain values, short lists of them, and functions,
modules and tensors by identity) is decided here, for the snapshot and for ``python_values``,
which guards after the capture the values a recording read.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..errors import FrozenStateError, explain
from .compat import OPS_DISPATCH_MODE, op_argument_defaults, op_argument_names, op_name
from .frames import callable_name, slot_values, user_frame
from .signature import is_plain
from .writes import walk

__all__ = [
    "ARRAY_BYTES",
    "Contents",
    "Items",
    "LARGEST_HOLDER",
    "LIST_ITEMS",
    "PythonSnapshot",
    "RandomDraws",
    "held_by",
    "held_value",
    "is_harmless",
    "is_watched",
    "short_repr",
]

#: Compared by identity: callables (``self.activation = torch.relu``; an equal new partial costs
#: a recapture, never a wrong answer), modules held outside a module (a policy's ``self.head``),
#: and tensors that are not parameters or buffers (``self.mask = t``), read at their address.
_BY_IDENTITY = (
    types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial,
    torch.nn.Module, torch.Tensor,
)  # fmt: skip
# nn.Module's own bookkeeping: not the model's state.
_MODULE_INTERNALS = frozenset({"training", "_is_full_backward_hook"})


#: The largest NumPy array whose memory a guard compares before each replay (a copy is kept);
#: a larger one read by a recording is refused at capture.
ARRAY_BYTES = 64 * 1024
#: The most values of one object (or dict) a walk reads, and the most a guard holds of an
#: object that code reads under computed names.
LARGEST_HOLDER = 1000
#: The most items (nested lists counted through) of a list a guard compares item by item.
LIST_ITEMS = 4096


def is_watched(value: Any) -> bool:
    """A value the guard compares before each replay: a plain value (NumPy scalars too), a list
    of such values (``self.mix = [0.5, 0.5]``: its items, which ``self.mix[0] = 0.9`` changes in
    place), a NumPy array (its memory, which ``self.table[1] = 5.0`` changes), or a function,
    module or tensor held by identity (:data:`_BY_IDENTITY`)."""
    return (
        is_plain(value)
        or isinstance(value, _BY_IDENTITY)
        or _is_watched_list(value)
        or _is_array(value)
    )


def _is_array(value: Any) -> bool:
    numpy = sys.modules.get("numpy")  # never imported here: a program that made one did
    return numpy is not None and isinstance(value, getattr(numpy, "ndarray", ()))


def _is_watched_list(value: Any) -> bool:
    """A list whose items (through nested lists, at most :data:`LIST_ITEMS` in all) are plain
    values or held by identity."""
    if type(value) is not list:
        return False
    budget = LIST_ITEMS
    stack = [value]
    while stack:
        items = stack.pop()
        budget -= len(items)
        if budget < 0:
            return False
        for item in items:
            if type(item) is list:
                stack.append(item)
            elif not (is_plain(item, 1) or isinstance(item, _BY_IDENTITY)):
                return False
    return True


class Items:
    """What a guard holds for a list the recording read: the list itself and its items then."""

    __slots__ = ("items", "list")

    def __init__(self, held: list[Any]) -> None:
        self.list, self.items = held, tuple(held)

    def __repr__(self) -> str:
        return repr(list(self.items))


class Contents:
    """What a guard holds for a NumPy array the recording read: the array itself and, where it
    is C-contiguous, of plain elements and at most :data:`ARRAY_BYTES`, a copy of its memory
    then (``snapshot``: bytes, element format, shape; else ``None``, identity only)."""

    __slots__ = ("_then", "array", "snapshot")

    def __init__(self, array: Any) -> None:
        self.array, self.snapshot = array, _memory_of(array)
        self._then = array.copy() if self.snapshot is not None else array  # for messages

    def __repr__(self) -> str:
        return short_repr(self._then)


def _memory_of(array: Any) -> tuple[bytes, str, tuple[int, ...]] | None:
    try:
        view = memoryview(array)  # object and datetime arrays have no buffer
    except (TypeError, ValueError):
        return None
    with view:
        if not view.c_contiguous or view.nbytes > ARRAY_BYTES or view.format == "O":
            return None
        return view.tobytes(), view.format, view.shape


def held_value(value: Any) -> Any:
    """What a guard keeps for ``value``: a list's items (:class:`Items`), an array's memory
    (:class:`Contents`), else the value itself."""
    if type(value) is list:
        return Items(value)
    return Contents(value) if _is_array(value) else value


_Key = tuple[int, str]  # (id of the owner, attribute)


def held_by(obj: Any) -> tuple[Any, dict[str, Any]] | None:
    """Where ``obj`` keeps the values a program reads by name, as (what a guard entry reads,
    those values): an object's ``__dict__``, a plain dict itself (``self.cfg["scale"]``), or
    a model object's ``__slots__`` (``@dataclass(slots=True)``), read through the object."""
    if isinstance(obj, dict):  # an OrderedDict's or a defaultdict's items too
        return (obj, obj) if all(isinstance(k, str) for k in list(obj)[:LARGEST_HOLDER]) else None
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict):
        return attributes, attributes
    slots = slot_values(obj)
    return (obj, slots) if slots else None


class PythonSnapshot:
    """The plain values ``fn`` can reach; :meth:`take` after each run, :meth:`check` at the
    end of the capture."""

    def __init__(
        self, fn: Callable[..., Any], roots: Iterable[Any] = (), harmless: Sequence[str] = ()
    ):
        self.fn = fn
        self.roots = tuple(roots)
        self.harmless = tuple(harmless)
        self.first = self._values()
        self.runs: list[dict[_Key, tuple[str, Any, Any]]] = []
        # What the lists and arrays among them held after each run: changed in place, they
        # keep their identity, so the values above cannot tell.
        self.first_contents = _contents(self.first)
        self.contents: list[dict[_Key, Any]] = []

    def _values(self) -> dict[_Key, tuple[str, Any, Any]]:
        values: dict[_Key, tuple[str, Any, Any]] = {}
        # The dicts the library's own objects hold (a graph's registry, its counters) are no
        # more the user's state than those objects' attributes are. Breadth first, an owner
        # comes before what it holds.
        owned: set[int] = set()
        fn = getattr(self.fn, "__func__", self.fn)  # its own closure cells are read too
        graphed = isinstance(fn, (types.FunctionType, functools.partial))
        self.objects = [(callable_name(fn), fn)] if graphed else []
        for name, obj in walk(self.fn, self.roots):
            held = held_by(obj)
            if held is None or id(obj) in owned:
                continue
            attributes = held[1]
            if _not_state(obj):
                owned.update(
                    id(v) for v in list(attributes.values())[:LARGEST_HOLDER] if isinstance(v, dict)
                )
                continue
            self.objects.append((name, obj))
            for key, value in list(attributes.items())[:LARGEST_HOLDER]:
                if key in _MODULE_INTERNALS or not is_watched(value):
                    continue
                label = f"{name}[{key!r}]" if attributes is obj else f"{name}.{key}"
                values[(id(obj), key)] = (label, value, obj)
        return values

    def take(self) -> None:
        """After a run: what the plain values are now."""
        self.runs.append(self._values())
        self.contents.append(_contents(self.runs[-1]))

    def changes(self) -> list[tuple[str, Any, Any]]:
        """``(name, was, became)`` for each value that differs between two consecutive runs
        after the first, harmless names left out."""
        found: dict[str, tuple[str, Any, Any]] = {}
        for before, after in zip(self.runs, self.runs[1:]):
            for key, (name, was, _) in before.items():
                if key not in after or name in found or is_harmless(name, self.harmless):
                    continue
                if not is_plain(was):  # a held function: guarded after the capture only
                    continue
                now = after[key][1]
                if not _same(now, was):
                    found[name] = (name, was, now)
        for before, after, runs in zip(self.contents, self.contents[1:], self.runs[1:]):
            for key, held in before.items():
                name = runs[key][0] if key in runs else ""
                if key not in after or name in found or is_harmless(name, self.harmless):
                    continue
                if not _same_contents(held, after[key]):
                    found[name] = (name, held, after[key])
        return list(found.values())

    def restore(self) -> None:
        """Put back every plain value the runs changed (the library's own runs leave no
        trace), harmless ones included."""
        latest = self.runs[-1] if self.runs else {}
        for key, (_, was, obj) in self.first.items():
            now = latest.get(key)
            if now is not None and is_plain(was) and not _same(now[1], was):
                try:
                    if isinstance(obj, dict):
                        obj[key[1]] = was
                    else:
                        setattr(obj, key[1], was)
                except (AttributeError, TypeError):  # a read-only or slotted attribute
                    continue
        latest_contents = self.contents[-1] if self.contents else {}
        for key, held in self.first_contents.items():
            now = latest_contents.get(key)
            if now is not None and not _same_contents(held, now):
                _put_back(held, now)

    def check(self, *, restore: bool) -> None:
        """Raise :class:`FrozenStateError` if the function changes a plain value from run to
        run (after putting values back when ``restore``)."""
        changes = self.changes()
        if restore or changes:
            self.restore()
        if not changes:
            return
        listed = "; ".join(
            f"{n} was {short_repr(a)}, became {short_repr(b)}" for n, a, b in changes[:5]
        )
        more = f" (and {len(changes) - 5} more)" if len(changes) > 5 else ""
        first = changes[0][0].rsplit(".", 1)[-1]
        raise FrozenStateError(
            explain(
                f"{callable_name(self.fn)} changes plain Python state from one run to the next: "
                f"{listed}{more}",
                "a recording runs the Python code once, so every replay would repeat the "
                "branch, index or constant of that run while eager would use the new value",
                "keep such state in a tensor on the device (updated in place), or move it out "
                "of the graphed function; if the value decides nothing the GPU does (a logging "
                f"counter), declare it with harmless_state=({first!r},)",
            ),
            names=[n for n, _, _ in changes],
        )


def _contents(values: dict[_Key, tuple[str, Any, Any]]) -> dict[_Key, Any]:
    """The items of each list of plain values and the memory of each array among ``values``."""
    found: dict[_Key, Any] = {}
    for key, (_, value, _) in values.items():
        if type(value) is list and all(is_plain(v, 1) for v in value):
            found[key] = Items(value)
        elif _is_array(value):
            held = Contents(value)
            if held.snapshot is not None:
                found[key] = held
    return found


def _same_contents(was: Any, now: Any) -> bool:
    if isinstance(was, Items) and isinstance(now, Items):
        return len(was.items) == len(now.items) and all(map(_same, now.items, was.items))
    return isinstance(now, Contents) and now.snapshot == was.snapshot


def _put_back(was: Any, now: Any) -> None:
    """Put a list's items or an array's memory back as they were, where the object is the same."""
    if isinstance(was, Items) and now.list is was.list:
        was.list[:] = was.items
    elif isinstance(was, Contents) and now.array is was.array:
        with contextlib.suppress(ValueError, TypeError):  # read-only, or reshaped since
            was.array[...] = was._then


def _same(now: Any, was: Any) -> bool:
    if now is was:
        return True
    if type(now) is not type(was):
        return False
    if isinstance(now, float) and now != now and was != was:  # NaN stays NaN
        return True
    return bool(now == was)


def _not_state(obj: Any) -> bool:
    """Objects whose attributes are not the user's state: Python modules (their globals) and
    classes, and the library's own objects (a pool's capture count, a graph's counters)."""
    if isinstance(obj, (types.ModuleType, type)):
        return True
    return type(obj).__module__.split(".", 1)[0] == "cudagraphs"


def short_repr(value: Any) -> str:
    """``repr(value)``, cut to 40 characters for a message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_harmless(label: str, harmless: Iterable[str]) -> bool:
    """Whether the user declared ``label`` harmless (``harmless_state``): the name itself, or
    its last dotted parts (``"calls"`` covers ``model.counter.calls``)."""
    return any(label == h or label.endswith("." + h) for h in harmless)


class RandomDraws(OPS_DISPATCH_MODE):  # type: ignore[misc, valid-type]
    """``with RandomDraws() as draws: ...``; then ``draws.found``: ``(op, file:line)`` of each
    random op run inside (eager code; compiled kernels are not seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, str]] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # else Dynamo marks a compiled function's code as never to compile again

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs):
            filename, line = user_frame()
            self.found.append((op_name(func), f"{filename}:{line}"))
        return func(*args, **kwargs)


def _draws(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a seeded op draws here: attention and dropout kernels carry the tag but draw
    nothing with a dropout probability of 0 or outside training."""
    values = op_argument_defaults(func)
    values.update(zip(op_argument_names(func), args))
    values.update(kwargs)
    for name in ("dropout_p", "p"):
        if name in values and isinstance(values[name], (int, float)) and values[name] == 0:
            return False
    return values.get("train", True) is not False

"""Plain Python values a recording freezes: refused where the function changes them, guarded
where the program might.

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

Values the program changes after the capture. A recording runs the function's Python code once: every plain value it read then (a module's
``scale``, a config flag, a module-level ``GAIN``) is baked into the kernels it launched. If
the program changes such a value after the capture, every replay would silently repeat the old
answer. So while the capture runs, :class:`Reader` notes which code ran (every Python function
outside torch, the standard library and this library: the user's model and third-party model
code such as transformers) and the names that code loads (and its identifier-like string
constants, for ``getattr(obj, "name")``); :func:`read_values` keeps what the reached objects
and that code's module globals hold under those names (:func:`is_watched`: plain values, and by
identity functions, modules, tensors and the reached objects themselves). :class:`ValueWatch`
compares them before each replay (identity, then equality where it decides), and a change
captures again (``on_stale="recapture"``, logged once per value) or raises
:class:`~cudagraphs.errors.StaleGraphError` naming it (``on_stale="raise"``).

A name the code loads in a branch it did not take is guarded too: a change of it may be
harmless, and then costs a recapture, never a wrong answer. Values declared with
``harmless_state=`` are not guarded.

Values read from the class rather than the instance (:func:`class_values`: a class-level
default read as ``self.scale``, a method that ran), the class of each module and model object
the recording reached (``module.__class__ = Other``), and the items of a list of plain values
(``self.mix[0] = 3.0``) are guarded the same way.

Right::

    g = cg.graph(model, x)
    model.scale = 2.0          # seen at the next call: captured again, eager's answer
    type(model).scale = 2.0    # a class-level default changed: seen the same way
    model.mix[0] = 3.0         # a list item changed in place: seen
    model.head.__class__ = Patched  # another class, other methods: seen
    model.mask = new_mask      # a tensor attribute (not a buffer) replaced: seen, by identity
    model.activation = torch.tanh   # a held function, compared by identity: the same
    y = g(x)

Wrong (a value the guard cannot see)::

    model.fn = functools.partial(scaled, factor=1.0)
    g = cg.graph(model, x)
    model.fn.keywords["factor"] = 2.0   # a partial changed in place: bind a new partial
"""

from __future__ import annotations

import functools
import gc
import sys
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..errors import FrozenStateError, explain
from . import compat
from .frames import callable_name, is_model_code
from .guards import compiled_module
from .signature import CLASS_OF, MISSING, held_value_now, held_value_still, is_plain
from .writes import is_compiled, is_model_class, walk

__all__ = [
    "READS_LIKE",
    "Reader",
    "PythonSnapshot",
    "Items",
    "ValueWatch",
    "class_values",
    "is_plain",
    "is_watched",
    "read_values",
    "retrace_after_class_change",
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


def is_watched(value: Any) -> bool:
    """A value the guard compares before each replay: a plain value, a list of such values
    (``self.mix = [0.5, 0.5]``: its items, which ``self.mix[0] = 0.9`` changes in place), or a
    function, module or tensor held by identity (:data:`_BY_IDENTITY`)."""
    return is_plain(value) or isinstance(value, _BY_IDENTITY) or _is_watched_list(value)


def _is_watched_list(value: Any) -> bool:
    if type(value) is not list or len(value) > 64:
        return False
    return all(is_plain(v, 1) or isinstance(v, _BY_IDENTITY) for v in value)


class Items:
    """What a guard holds for a list the recording read: the list itself and its items then."""

    __slots__ = ("items", "list")

    def __init__(self, held: list[Any]) -> None:
        self.list, self.items = held, tuple(held)

    def __repr__(self) -> str:
        return repr(list(self.items))


_Key = tuple[int, str]  # (id of the owner, attribute)


def _slots_of(obj: Any) -> dict[str, Any] | None:
    """Where ``obj`` keeps the values a program reads by name: an object's ``__dict__``, or a
    plain dict itself (``self.nets["value"]``, ``self.cfg["scale"]``); ``None`` for others."""
    if type(obj) is dict:
        return obj if all(isinstance(k, str) for k in list(obj)[:1000]) else None
    attributes = getattr(obj, "__dict__", None)
    return attributes if isinstance(attributes, dict) else None


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

    def _values(self) -> dict[_Key, tuple[str, Any, Any]]:
        values: dict[_Key, tuple[str, Any, Any]] = {}
        # The dicts the library's own objects hold (a graph's registry, its counters) are no
        # more the user's state than those objects' attributes are. Breadth first, an owner
        # comes before what it holds.
        owned: set[int] = set()
        fn = getattr(self.fn, "__func__", self.fn)  # its own closure cells are read too
        self.objects = [(callable_name(fn), fn)] if isinstance(fn, types.FunctionType) else []
        for name, obj in walk(self.fn, self.roots):
            attributes = _slots_of(obj)
            if attributes is None or id(obj) in owned:
                continue
            if _not_state(obj):
                owned.update(id(v) for v in list(attributes.values())[:1000] if type(v) is dict)
                continue
            self.objects.append((name, obj))
            for key, value in list(attributes.items())[:1000]:
                if key in _MODULE_INTERNALS or not is_watched(value):
                    continue
                label = f"{name}[{key!r}]" if attributes is obj else f"{name}.{key}"
                values[(id(obj), key)] = (label, value, obj)
        return values

    def take(self) -> None:
        """After a run: what the plain values are now."""
        self.runs.append(self._values())

    def changes(self) -> list[tuple[str, Any, Any]]:
        """``(name, was, became)`` for each value that differs between two consecutive runs
        after the first, harmless names left out."""
        found: dict[str, tuple[str, Any, Any]] = {}
        for before, after in zip(self.runs, self.runs[1:]):
            for key, (name, was, _) in before.items():
                if key not in after or name in found or self._is_harmless(name):
                    continue
                if not is_plain(was):  # a held function: guarded after the capture only
                    continue
                now = after[key][1]
                if not _same(now, was):
                    found[name] = (name, was, now)
        return list(found.values())

    def _is_harmless(self, name: str) -> bool:
        return any(name == h or name.endswith("." + h) for h in self.harmless)

    def restore(self) -> None:
        """Put back every plain value the runs changed (the library's own runs leave no
        trace), harmless ones included."""
        latest = self.runs[-1] if self.runs else {}
        for key, (_, was, obj) in self.first.items():
            now = latest.get(key)
            if now is not None and is_plain(was) and not _same(now[1], was):
                try:
                    if type(obj) is dict:
                        obj[key[1]] = was
                    else:
                        setattr(obj, key[1], was)
                except (AttributeError, TypeError):  # a read-only or slotted attribute
                    continue

    def check(self, *, restore: bool) -> None:
        """Raise :class:`FrozenStateError` if the function changes a plain value from run to
        run (after putting values back when ``restore``)."""
        changes = self.changes()
        if restore or changes:
            self.restore()
        if not changes:
            return
        listed = "; ".join(f"{n} was {_short(a)}, became {_short(b)}" for n, a, b in changes[:5])
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


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


#: The attribute by which a callable that runs compiled code in place of the Python code it was
#: made from names that code (``{code object: its module globals}``, as a :class:`Reader` of
#: the Python code's run noted them): a compile loaded from disk runs none of the model's code
#: during a capture, so a :class:`Reader` there would see no value to guard.
READS_LIKE = "cudagraphs_reads_like"


class Reader:
    """While active (one thread: the capture's), the code objects that run outside the
    libraries, with their module globals; the names they load are what :func:`read_values`
    keeps. Another profiler of this thread (a debugger, cProfile) is chained, not replaced.

    ``of``: the callable about to run; the code it stands in for (:data:`READS_LIKE`) counts
    as run."""

    def __init__(self, of: Any = None) -> None:
        self.codes: dict[types.CodeType, dict[str, Any]] = dict(getattr(of, READS_LIKE, None) or {})
        if of is not None and is_compiled(of):
            self.codes.update(compiled_code(of))
        self._outside: dict[str, bool] = {}  # filename -> user code?
        self._previous: Any = None

    def __enter__(self) -> Reader:
        # Code that runs inside the recording without being called by it is not what the
        # graph computes: a garbage collection's callbacks (a test tool's timestamp global)
        # would be guarded and recapture at every collection. No collection runs meanwhile.
        self._collecting = gc.isenabled()
        gc.disable()
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self._previous)
        if self._collecting:
            gc.enable()

    def _profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code not in self.codes:
                outside = self._outside.get(code.co_filename)
                if outside is None:
                    outside = self._outside[code.co_filename] = is_model_code(code.co_filename)
                if outside:
                    self.codes[code] = frame.f_globals
        if self._previous is not None:
            self._previous(frame, event, arg)

    @property
    def names(self) -> set[str]:
        """Every attribute or global name the code that ran loads, and every identifier among
        its string constants (``getattr(config, "output_hidden_states")``)."""
        names: set[str] = set()
        for code in self.codes:
            names.update(code.co_names)
            names.update(_identifiers(code.co_consts))
        return names


def compiled_code(fn: Any, limit: int = 20000) -> dict[types.CodeType, dict[str, Any]]:
    """The model code a ``torch.compile``'d ``fn`` may stand in for, with its globals.

    Dynamo inlines the forwards of child modules and the helpers they call into one compiled
    frame, so their own frames never run and a :class:`Reader` would miss the names they load
    (``self.gain`` in a child's forward). So every function of each module class ``fn``
    reaches (its methods, through the classes it derives from), each function ``fn`` reaches,
    the functions their code names as globals, and the code nested in theirs, count as run.
    More than ran: a name loaded by code that did not run is guarded too, and its change costs
    a recapture, never a wrong answer."""
    found: dict[types.CodeType, dict[str, Any]] = {}
    stack: list[Any] = []
    classes: set[type] = set()
    for _, obj in walk(fn):
        if isinstance(obj, (types.FunctionType, types.MethodType)):
            stack.append(getattr(obj, "__func__", obj))
        elif isinstance(obj, torch.nn.Module) and type(obj) not in classes:
            classes.add(type(obj))
            for cls in type(obj).__mro__:
                for member in vars(cls).values():
                    member = getattr(member, "__func__", member)  # static and class methods
                    if isinstance(member, types.FunctionType):
                        stack.append(member)
    seen: set[int] = set()
    while stack and len(seen) < limit:
        function = stack.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        namespace = function.__globals__
        codes = [function.__code__]
        while codes:
            code = codes.pop()
            if code in found or not is_model_code(code.co_filename):
                continue
            found[code] = namespace
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            stack.extend(
                namespace[name] for name in code.co_names
                if isinstance(namespace.get(name), types.FunctionType)
            )  # fmt: skip
    return found


def _identifiers(constants: tuple[Any, ...]) -> Iterable[str]:
    for constant in constants:
        if isinstance(constant, str) and constant.isidentifier():
            yield constant
        elif isinstance(constant, (tuple, frozenset)):
            yield from _identifiers(tuple(constant))


def read_values(
    reader: Reader,
    reached: dict[Any, tuple[str, Any, Any]],
    harmless: Sequence[str] = (),
    objects: Iterable[tuple[str, Any]] = (),
) -> list[tuple[str, Any, str, Any]]:
    """``(label, owner, key, value)`` for each plain value the recorded code read:
    attributes of reached objects (``reached``: ``PythonSnapshot``'s values after the
    capture), module globals, and values the classes of the reached ``objects`` hold
    (:func:`class_values`), under the names that code loads, harmless ones left out. The
    owner is a dict (an instance's, a module's globals) or a class; a list's value is its
    :class:`Items`. An object the walk reached through such a name (a config, a namespace, a
    dict whose items the code reads) is held by identity too: another one bound in its place
    holds values the recording never read."""
    names = reader.names
    objects = list(objects)
    holders = {id(obj) for _, obj in objects}
    found: list[tuple[str, Any, str, Any]] = []
    for (_, key), (label, value, owner) in reached.items():
        if key in names and not _harmless(label, harmless):
            namespace = _slots_of(owner)
            if namespace is not None and namespace.get(key, MISSING) is value:
                found.append((label, namespace, key, _held_value(value)))
    for label, obj in objects:
        namespace = _slots_of(obj)
        for key, value in list(namespace.items() if namespace is not None else ())[:1000]:
            if key in names and id(value) in holders and not is_watched(value):
                held = f"{label}[{key!r}]" if namespace is obj else f"{label}.{key}"
                if not _harmless(held, harmless):
                    found.append((held, namespace, key, value))
    found.extend(v for v in class_values(reader, objects) if not _harmless(v[0], harmless))
    found.extend(v for v in _cells_read(reader, objects) if not _harmless(v[0], harmless))
    seen: set[tuple[int, str]] = set()
    for code, namespace in reader.codes.items():
        module = namespace.get("__name__", "?")
        if module.startswith("torch."):  # Inductor's generated code: its kernels, not a model's
            continue
        for name in code.co_names:
            value = namespace.get(name, MISSING)
            if (id(namespace), name) in seen or value is MISSING:
                continue
            if not (is_watched(value) or id(value) in holders):
                continue
            seen.add((id(namespace), name))
            label = f"global {module}.{name}"
            if not _harmless(label, harmless):
                found.append((label, namespace, name, _held_value(value)))
    return found


def _cells_read(reader: Reader, objects: list[tuple[str, Any]]) -> list[tuple[str, Any, str, Any]]:
    """The closure cells of the reached functions whose code ran (a helper's ``k``, a lambda's
    list), held like attributes (the code loads them as free variables, not by name)."""
    found = []
    for label, fn in objects:
        if isinstance(fn, types.FunctionType) and fn.__code__ in reader.codes:
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
                value = held_value_now(cell, "cell_contents")
                if value is not MISSING and is_watched(value):
                    held = _held_value(value)
                    found.append(
                        (f"{label}'s closure variable {name!r}", cell, "cell_contents", held)
                    )
    return found


def _held_value(value: Any) -> Any:
    return Items(value) if type(value) is list else value


def class_values(
    reader: Reader, objects: Iterable[tuple[str, Any]]
) -> list[tuple[str, Any, str, Any]]:
    """The values a recording read from the classes of model code rather than from the
    instance: a class-level default (``class M: scale = 1.0``, read as ``self.scale``) and each
    method that ran. Two entries guard each: the class's lookup (the class, or a base before the
    one that held it, given another value: ``M.scale = 2.0``, ``M.forward = patched``), and,
    per instance, the key's absence from the instance's dict (``model.scale = 2.0`` shadows
    the class's value; ``model.forward = f`` replaces the method). Only classes of model code
    count: torch's and the standard library's classes are not changed by a program."""
    names = reader.names
    found: list[tuple[str, Any, str, Any]] = []
    keys_of: dict[type, tuple[str, ...]] = {}
    for label, obj in objects:
        cls = type(obj)
        keys = keys_of.get(cls)
        if keys is None:
            keys = keys_of[cls] = _class_reads(cls, names, reader.codes)
            found.extend(
                (f"class {cls.__qualname__}.{key}", cls, key, held_value_now(cls, key))
                for key in keys
            )  # fmt: skip
        attributes = getattr(obj, "__dict__", None)
        if type(attributes) is dict:
            found.extend(
                (f"{label}.{key}", attributes, key, MISSING)
                for key in keys if key not in attributes
            )  # fmt: skip
        if _class_assignable(obj):
            # ``obj.__class__ = Other`` gives it other methods and class values: the lookups
            # above would still find the old class's, unchanged, so the class is guarded too.
            found.append((f"{label}.__class__", obj, CLASS_OF, cls))
    return found


def _class_assignable(obj: Any) -> bool:
    """Objects of model code's classes other than modules (the address guard holds each
    module's class): a policy object given another class has other methods."""
    if isinstance(obj, (torch.Tensor, torch.nn.Module)):
        return False
    return is_model_class(type(obj))


def _class_reads(cls: type, names: set[str], ran: dict[types.CodeType, Any]) -> tuple[str, ...]:
    """The attributes of ``cls`` (through its bases) that the recording read from the class:
    watched values under a name the code loads, and functions whose code ran."""
    keys: list[str] = []
    seen: set[str] = set()
    for klass in cls.__mro__:
        model_code = is_model_class(klass)
        for key, raw in list(vars(klass).items()):
            if key in seen:
                continue
            seen.add(key)  # a base's value under this name is not the one the lookup finds
            if not model_code or key.startswith("__"):
                continue
            function = getattr(raw, "__func__", raw)  # static and class methods
            if isinstance(function, types.FunctionType):
                if function.__code__ in ran:
                    keys.append(key)
            elif key in names and is_watched(raw):
                keys.append(key)
    return tuple(keys)


def _harmless(label: str, harmless: Iterable[str]) -> bool:
    return any(label == h or label.endswith("." + h) for h in harmless)


class ValueWatch:
    """The guard's watch over the plain values a recording read (see the module doc)."""

    def __init__(self, values: Sequence[tuple[str, Any, str, Any]]):
        self.values = tuple(values)
        #: What a guard checks inside its one C call (``_before_replay.cpp``'s ``values_hold``).
        self.held = tuple(_entry(owner, key, value) for _, owner, key, value in values)
        compiled = compiled_module()
        self._same = (
            functools.partial(compiled.values_same, self.held)
            if compiled is not None and hasattr(compiled, "values_same")
            else self._same_in_python
        )

    def __len__(self) -> int:
        return len(self.values)

    @property
    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors held by identity (also in lists): the guard checks their addresses too,
        as it does a parameter's (``t.data = other`` keeps the object, moves the memory)."""
        found = []
        for label, _, _, value in self.values:
            items = value.items if isinstance(value, Items) else (value,)
            found += [(label, t) for t in items if isinstance(t, torch.Tensor)]
        return found

    def stale(self) -> str | None:
        """``None`` while every value is what the recording read; else which one changed.
        One C call where the extension is built (identity, then type and equality)."""
        return None if self._same() else self._why()

    def _same_in_python(self) -> bool:
        return all(held_value_still(entry) for entry in self.held)

    def classes_changed(self) -> list[type]:
        """The classes whose watched values no longer hold (:func:`class_values`), and the
        classes an object was switched away from (``obj.__class__ = Other``)."""
        return [
            owner if isinstance(owner, type) else value
            for (_, owner, key, value), entry in zip(self.values, self.held)
            if (isinstance(owner, type) or key is CLASS_OF) and not held_value_still(entry)
        ]  # fmt: skip

    def _why(self) -> str | None:
        for (label, owner, key, value), entry in zip(self.values, self.held):
            if held_value_still(entry):
                continue
            now = held_value_now(owner, key)
            was = "the class's value" if value is MISSING else _words(value)
            became = "deleted" if now is MISSING else _words(now)
            return (
                f"{label} changed from {was} to {became} (the recording froze the value "
                "it read; keep a value that changes in a tensor on the device)"
            )
        return None


def _words(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} at {value.data_ptr():#x}"
    return repr(value) if is_watched(value) else f"{_short(value)} (another object)"


def _entry(owner: Any, key: str, value: Any) -> tuple[Any, ...]:
    if value is MISSING:
        return (owner, key)
    if isinstance(value, Items):
        return (owner, key, value.list, value.items)
    return (owner, key, value)


def retrace_after_class_change(fn: Callable[..., Any], watch: Any) -> None:
    """Before capturing again for a changed value: where a class's value changed, drop what
    ``torch.compile`` traced for the code ``fn`` reaches, so the new capture traces with the
    new value (``compat.forget_compiled_frames`` says why). Nothing is dropped for a change on
    an instance, which Dynamo's own guards see."""
    if watch.classes_changed():
        compat.forget_compiled_frames(compiled_code(fn))

"""Plain Python values a recording read, guarded where the program might change them after
the capture (``frozen_state`` refuses those the function itself changes).

Values the program changes after the capture (a module's ``scale``, a config flag, a
module-level ``GAIN``) would be replayed as they were, silently. So while the capture runs,
:class:`Reader` notes which code ran (every Python function outside torch, the standard library
and this library: the user's model and third-party model code such as transformers) and the
names that code loads (and its identifier-like string constants, for ``getattr(obj, "name")``);
:func:`read_values` keeps what the reached objects and that code's module globals hold under
those names (``frozen_state.is_watched``: plain values, NumPy values, and by identity
functions, modules, tensors and the reached objects themselves). :class:`ValueWatch` compares
them before each replay (identity, then equality where it decides), and a change
captures again (``on_stale="recapture"``, logged once per value) or raises
:class:`~cudagraphs.errors.StaleGraphError` naming it (``on_stale="raise"``).

A name the code loads in a branch it did not take is guarded too: a change of it may be
harmless, and then costs a recapture, never a wrong answer.

Values read from the class rather than the instance (:func:`class_values`: a class-level
default read as ``self.scale``, a method that ran), the class of each module and model object
the recording reached (``module.__class__ = Other``), the items of a list of plain values
(``self.mix[0] = 3.0``), and what a reached ``functools.partial`` binds
(``writes.bound_arguments``) are guarded the same way.

Right::

    g = cg.graph(model, x)
    model.scale = 2.0          # seen at the next call: captured again, eager's answer
    type(model).scale = 2.0    # a class-level default changed: seen the same way
    model.mix[0] = 3.0         # a list item changed in place: seen
    model.head.__class__ = Patched  # another class, other methods: seen
    model.mask = new_mask      # a tensor attribute (not a buffer) replaced: seen, by identity
    model.activation = torch.tanh   # a held function, compared by identity: the same
    model.fn.keywords["factor"] = 2.0   # a value bound to a held partial: the same
    model.table[1] = 5.0       # a NumPy array read: its memory is compared (up to 64 KiB)
    y = g(x)

Wrong::

    g = cg.graph(model, x, harmless_state=("scale",))   # names what is not guarded:
    model.scale = 2.0                                   # the old answer
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
from .dynamic_reads import (
    CLOCKS,
    ENVIRON_READ,
    ENVIRON_WRAPPERS,
    HOST_GETTERS,
    computed_reads,
    environment_getter,
    environment_keys,
    host_getter,
    host_getter_label,
    is_environment_getter,
    where_read,
)
from .frames import is_model_class, is_model_code
from .frozen_state import (
    LARGEST_HOLDER,
    Contents,
    Items,
    held_by,
    held_value,
    is_harmless,
    is_watched,
    short_repr,
)
from .guards import compiled_module
from .signature import CLASS_OF, MISSING, by_value_types, held_value_now, held_value_still
from .writes import bound_arguments, is_compiled, walk

__all__ = [
    "READS_LIKE",
    "Reader",
    "ValueWatch",
    "class_values",
    "read_values",
    "retrace_after_untraced_change",
]


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
        #: The host-setting getters the run called (``dynamic_reads.HOST_GETTERS``): a branch
        #: on ``torch.get_num_threads()`` reads no attribute the names above could match.
        self.getters: set[Any] = set()
        #: The environment variables model code read (``os.environ[key]``, ``.get``, ``getenv``),
        #: and those the code standing in for what runs names (no read of it is seen).
        self.environment: set[str] = environment_keys(self.codes)
        #: The clocks model code read, each with the ``file:line`` that called it first.
        self.clocks: dict[str, str] = {}

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
        if event == "c_call":
            if arg in HOST_GETTERS:
                self.getters.add(arg)
            elif _hashable(arg) and arg in CLOCKS and self._from_model_code(frame):
                self.clocks.setdefault(CLOCKS[arg], f"{frame.f_code.co_filename}:{frame.f_lineno}")
        elif event == "call":
            code = frame.f_code
            if code in HOST_GETTERS:
                self.getters.add(code)
            elif code is ENVIRON_READ and self._from_model_code(frame.f_back):
                key = frame.f_locals.get("key")
                if isinstance(key, str):
                    self.environment.add(key)
            if code not in self.codes:
                outside = self._outside.get(code.co_filename)
                if outside is None:
                    outside = self._outside[code.co_filename] = is_model_code(code.co_filename)
                if outside:
                    self.codes[code] = frame.f_globals
        if self._previous is not None:
            self._previous(frame, event, arg)

    def _from_model_code(self, frame: types.FrameType | None) -> bool:
        """Whether the call was made by model code, through the standard library's own
        wrappers (``os.environ.get`` runs ``Mapping.get``, then ``os.environ[key]``)."""
        while frame is not None and frame.f_code.co_filename in ENVIRON_WRAPPERS:
            frame = frame.f_back
        if frame is None:
            return False
        filename = frame.f_code.co_filename
        outside = self._outside.get(filename)
        if outside is None:
            outside = self._outside[filename] = is_model_code(filename)
        return outside

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
    """The model code a ``torch.compile``'d ``fn`` may stand in for, with its globals. Dynamo
    inlines child modules' forwards and their helpers into one frame, so a :class:`Reader`
    would miss the names they load (``self.gain`` in a child's forward): the methods of each
    module class ``fn`` reaches (through its bases), the functions it reaches, the functions
    their code names as globals, and the code nested in theirs count as run. A name loaded by
    code that did not run is guarded too: its change costs a recapture, never a wrong answer."""
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
    """``(label, owner, key, value)`` for each value the recorded code read, harmless ones
    left out: under the names that code loads, the reached objects' attributes (``reached``:
    ``PythonSnapshot``'s values after the capture), module globals and values of the
    ``objects``' classes (:func:`class_values`); closure cells; what a partial binds. The
    owner is a dict, a class or a cell; a list's value is its :class:`Items`, an array's its
    :class:`Contents`. An object reached
    through such a name (a config, a dict whose items the code reads) is held by identity too:
    another one bound in its place holds values the recording never read."""
    names = reader.names
    objects = list(objects)
    holders = {id(obj) for _, obj in objects}
    found: list[tuple[str, Any, str, Any]] = []
    held_under: dict[int, set[str]] = {}  # reached object -> the names it is held under
    for (_, key), (label, value, owner) in reached.items():
        if key in names and not is_harmless(label, harmless):
            held = held_by(owner)
            if held is not None and held_value_now(held[0], key) is value:
                found.append((label, held[0], key, held_value(value)))
    for label, obj in objects:
        held = held_by(obj)
        for key, value in list(held[1].items() if held is not None else ())[:LARGEST_HOLDER]:
            if id(value) in holders:
                held_under.setdefault(id(value), set()).add(key)
            if key in names and id(value) in holders and not is_watched(value):
                named = f"{label}[{key!r}]" if held[1] is obj else f"{label}.{key}"
                if not is_harmless(named, harmless):
                    found.append((named, held[0], key, value))
    found.extend(_computed_reads(reader, reached, objects, held_under, harmless))
    found.extend(v for v in class_values(reader, objects) if not is_harmless(v[0], harmless))
    found.extend(v for v in _cells_read(reader, objects) if not is_harmless(v[0], harmless))
    bound = bound_arguments(objects)  # a partial's arguments: read under no name
    found.extend((*v[:3], held_value(v[3])) for v in bound if not is_harmless(v[0], harmless))
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
            if not is_harmless(label, harmless):
                found.append((label, namespace, name, held_value(value)))
    for seen in reader.getters:
        getter, label = host_getter(seen), host_getter_label(seen)
        if not is_harmless(label, harmless):
            found.append((f"{label} (a host setting read)", getter, Ellipsis, getter()))
    for key in sorted(reader.environment):
        label = f"os.environ[{key!r}]"
        if not is_harmless(label, harmless) and not is_harmless(key, harmless):
            getter = environment_getter(key)
            found.append((f"{label} (an environment variable read)", getter, Ellipsis, getter()))
    _refuse_clocks(reader, harmless)
    return _refuse_unseen_arrays(_with_nested_lists(_unique(found)), reader)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _refuse_clocks(reader: Reader, harmless: Sequence[str]) -> None:
    """A clock the recording's model code read is refused at capture: its result differs on
    every call, and a replay would repeat what the capture's reading decided."""
    for label, where in reader.clocks.items():
        name = label.removesuffix("()")
        if is_harmless(name, harmless) or is_harmless(label, harmless):
            continue
        raise FrozenStateError(
            explain(
                f"the recorded code read the clock {label} at {where}",
                "a graph replays what the capture computed: whatever that reading decided (a "
                "branch, a value on the device) is repeated on every replay, and no guard can "
                "compare a clock before a replay",
                "pass the time in as a tensor input, or move the reading outside the graphed "
                f"function; if it decides nothing on the GPU (logging), declare "
                f"harmless_state=({name!r},)",
            ),
            names=[label],
        )


def _unique(found: list[tuple[str, Any, Any, Any]]) -> list[tuple[str, Any, Any, Any]]:
    seen: set[tuple[int, Any]] = set()
    kept = []
    for entry in found:
        key = (id(entry[1]), entry[2] if isinstance(entry[2], (str, int)) else id(entry[2]))
        if key not in seen:
            seen.add(key)
            kept.append(entry)
    return kept


def _computed_reads(
    reader: Reader,
    reached: dict[Any, tuple[str, Any, Any]],
    objects: list[tuple[str, Any]],
    held_under: dict[int, set[str]],
    harmless: Sequence[str],
) -> list[tuple[str, Any, str, Any]]:
    """Every watched value of the objects that code reading under computed names can reach:
    ``getattr(self, f"w{i}")`` reads an attribute no name of the code gives, ``ws[key]`` an
    item, so all of the object's (or dict's) plain values are held, not only those under the
    code's names. Which objects: those held under a name such code loads, and, for computed
    attribute names, every object of a model class the recording reached. An object with more
    values than a guard compares is refused (``LARGEST_HOLDER``)."""
    by_attribute = [c for c in reader.codes if computed_reads(c).attributes]
    by_item = [c for c in reader.codes if computed_reads(c).items]
    if not by_attribute and not by_item:
        return []
    loaded_by = lambda codes: {n for c in codes for n in c.co_names}  # noqa: E731
    attribute_names, item_names = loaded_by(by_attribute), loaded_by(by_item)
    targets = []
    for label, obj in objects:
        keys = held_under.get(id(obj), set())
        if (
            (by_attribute and (keys & attribute_names or _class_assignable(obj)
                               or (isinstance(obj, torch.nn.Module) and is_model_class(type(obj)))))
            or (by_item and isinstance(obj, dict) and keys & item_names)
        ):  # fmt: skip
            targets.append((label, obj))
    found = []
    for label, obj in targets:
        held = held_by(obj)
        if held is None:
            continue
        if len(held[1]) > LARGEST_HOLDER:
            codes = by_attribute if not isinstance(obj, dict) else by_item
            raise FrozenStateError(
                explain(
                    f"{label} holds {len(held[1])} values, and code the recording ran reads "
                    f"it under names computed at run time (at {codes[0].co_filename}:"
                    f"{codes[0].co_firstlineno})",
                    "a graph freezes every value it read; with names built at run time, "
                    "which ones cannot be told, and comparing all of them before every "
                    f"replay is more than the guard's {LARGEST_HOLDER}",
                    "pass the values the forward needs as a tensor input, or read them "
                    f"under fixed names; if none of them changes, declare "
                    f"harmless_state=({label.rsplit('.', 1)[-1]!r},)",
                ),
                names=[label],
            )
        for key in list(held[1]):
            entry = reached.get((id(obj), key))
            if entry is not None and not is_harmless(entry[0], harmless):
                found.append((entry[0], held[0], key, held_value(entry[1])))
    return found


def _with_nested_lists(found: list[tuple[str, Any, Any, Any]]) -> list[tuple[str, Any, Any, Any]]:
    """Each list inside a held list gets an entry of its own (read by index through the outer
    list): ``self.mix[0][1] = 3.0`` keeps every item of ``self.mix`` the same object."""
    out = list(found)
    stack = [(label, value.list) for label, _, _, value in found if isinstance(value, Items)]
    while stack:
        label, outer = stack.pop()
        for index, inner in enumerate(outer):
            if type(inner) is list:
                out.append((f"{label}[{index}]", outer, index, Items(inner)))
                stack.append((f"{label}[{index}]", inner))
    return out


def _refuse_unseen_arrays(
    found: list[tuple[str, Any, Any, Any]], reader: Reader
) -> list[tuple[str, Any, Any, Any]]:
    """A NumPy array read whose memory a guard cannot compare (over ``ARRAY_BYTES``, strided,
    of objects) is refused at capture: held by identity only, a change in place would give
    the recorded answer."""
    for label, _, key, value in found:
        if isinstance(value, Contents) and value.snapshot is None:
            where = where_read(reader.codes, key) if isinstance(key, str) else "?"
            raise FrozenStateError(
                explain(
                    f"{label} is a NumPy array of {value.array.nbytes} bytes that the recording "
                    f"read (at {where}), too large or not C-contiguous for the guard to compare "
                    "before every replay",
                    "a graph freezes what it read: a change in place (table[1] = 5.0) would "
                    "give the recorded answer, and only arrays of C-contiguous plain elements "
                    "up to 64 KiB are compared",
                    "keep the table in a tensor on the device (changes in place are then "
                    "replayed), or pass it as a tensor input; if it never changes after the "
                    f"capture, declare harmless_state=({label.rsplit('.', 1)[-1]!r},)",
                ),
                names=[label],
            )
    return found


def _cells_read(reader: Reader, objects: list[tuple[str, Any]]) -> list[tuple[str, Any, str, Any]]:
    """The closure cells of the functions whose code ran (a helper's ``k``, a lambda's list, the
    variables of the function that defined a forward), held like attributes: the code loads
    them as free variables, not by name. The reached functions come with the walk's labels;
    any other function whose code ran and has free variables (a module-level helper made by a
    factory, a method of a class defined in a function) is found among the live functions."""
    found = []
    reached = {id(fn) for _, fn in objects}
    closed = {code for code in reader.codes if code.co_freevars}
    if closed:
        objects = objects + [
            (fn.__qualname__, fn)
            for fn in gc.get_objects()
            if type(fn) is types.FunctionType and fn.__code__ in closed and id(fn) not in reached
        ]  # fmt: skip
    for label, fn in objects:
        if isinstance(fn, types.FunctionType) and fn.__code__ in reader.codes:
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
                value = held_value_now(cell, "cell_contents")
                if value is not MISSING and is_watched(value):
                    held = held_value(value)
                    found.append(
                        (f"{label}'s closure variable {name!r}", cell, "cell_contents", held)
                    )
    return found


def class_values(
    reader: Reader, objects: Iterable[tuple[str, Any]]
) -> list[tuple[str, Any, str, Any]]:
    """The values a recording read from model code's classes rather than the instance: a
    class-level default (``class M: scale = 1.0``, read as ``self.scale``) and each method that
    ran. Two entries guard each: the class's lookup (the class, or a base before the one that
    held it, given another value: ``M.scale = 2.0``, ``M.forward = patched``), and per
    instance the key's absence from its dict (``model.scale = 2.0``, ``model.forward = f``).
    torch's and the standard library's classes are not changed by a program."""
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


class ValueWatch:
    """The guard's watch over the plain values a recording read (see the module doc)."""

    def __init__(self, values: Sequence[tuple[str, Any, str, Any]]):
        self.values = tuple(values)
        #: What a guard checks inside its one C call (``_before_replay.cpp``'s ``values_hold``).
        self.held = tuple(_entry(owner, key, value) for _, owner, key, value in values)
        compiled = compiled_module()
        if compiled is not None:  # NumPy's scalars compare by value, as Python's numbers do
            compiled.compare_by_value(by_value_types())
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

    def untraced_changes(self) -> list[Any]:
        """The changed values ``torch.compile``'s own guards do not cover: the classes whose
        watched values no longer hold (:func:`class_values`), the classes an object was
        switched away from (``obj.__class__ = Other``), and the environment variables read
        (Dynamo folds a variable's value into its trace as a constant)."""
        return [
            owner if isinstance(owner, type) or key is Ellipsis else value
            for (_, owner, key, value), entry in zip(self.values, self.held)
            if (isinstance(owner, type) or key is CLASS_OF or is_environment_getter(owner))
            and not held_value_still(entry)
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
    if isinstance(value, Contents) or (is_watched(value) and hasattr(value, "__array__")):
        return short_repr(value)  # an array: its first elements
    return repr(value) if is_watched(value) else f"{short_repr(value)} (another object)"


def _entry(owner: Any, key: str, value: Any) -> tuple[Any, ...]:
    if value is MISSING:
        return (owner, key)
    if isinstance(value, Items):
        return (owner, key, value.list, value.items)
    if isinstance(value, Contents):  # an array too large to copy: the same object, no more
        snapshot = value.snapshot
        return (
            (owner, key, value.array) if snapshot is None else (owner, key, value.array, snapshot)
        )
    return (owner, key, value)


def retrace_after_untraced_change(fn: Callable[..., Any], watch: Any) -> None:
    """Before capturing again for a changed value: where a class's value or an environment
    variable changed, drop what ``torch.compile`` traced for the code ``fn`` reaches, so the
    new capture traces with the new value (``compat.forget_compiled_frames`` says why).
    Nothing is dropped for a change on an instance, which Dynamo's own guards see."""
    if watch.untraced_changes():
        compat.forget_compiled_frames(compiled_code(fn))

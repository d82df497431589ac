"""Plain Python values a recording read, checked again before every replay.

A recording runs the function's Python code once: every plain value it read then (a module's
``scale``, a config flag, a module-level ``GAIN``) is baked into the kernels it launched. If
the program changes such a value after the capture, every replay would silently repeat the old
answer. So while the capture runs, :class:`Reader` notes which code ran (every Python function
outside torch, the standard library and this library: the user's model and third-party model
code such as transformers) and the names that code loads (and its identifier-like string
constants, for ``getattr(obj, "name")``); :func:`read_values` keeps the plain
values (``python_state.is_plain``) that objects the function reaches hold under those names,
and the module globals of that code under those names. :class:`ValueWatch` compares them
before each replay (identity first, then equality), and a changed value makes the guard stale:
the graph captures again for the new value (``on_stale="recapture"``, logged once per value)
or raises :class:`~cudagraphs.errors.StaleGraphError` naming it (``on_stale="raise"``).

A name the code loads in a branch it did not take is guarded too: a change of it may be
harmless, and then costs a recapture, never a wrong answer. Values declared with
``harmless_state=`` are not guarded.

Right::

    g = cg.graph(model, x)
    model.scale = 2.0          # seen at the next call: captured again, eager's answer
    y = g(x)

Wrong (a value the graph cannot see, so no guard can either)::

    model.scale = torch.tensor(2.0)   # fine: a tensor is read by address, not frozen
    model.scales[0] = 2.0             # a list's items are not plain values: frozen silently
"""

from __future__ import annotations

import functools
import gc
import sys
import types
from collections.abc import Iterable, Sequence
from typing import Any

from .addresses import compiled_module
from .frames import is_model_code
from .python_state import is_plain
from .tree import same_value

__all__ = ["Reader", "ValueWatch", "read_values"]

_MISSING = object()


class Reader:
    """While active (one thread: the capture's), the code objects that run outside the
    libraries, with their module globals; the names they load are what :func:`read_values`
    keeps. Another profiler of this thread (a debugger, cProfile) is chained, not replaced."""

    def __init__(self) -> None:
        self.codes: dict[types.CodeType, dict[str, Any]] = {}
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


def _identifiers(constants: tuple[Any, ...]) -> Iterable[str]:
    for constant in constants:
        if isinstance(constant, str) and constant.isidentifier():
            yield constant
        elif isinstance(constant, (tuple, frozenset)):
            yield from _identifiers(tuple(constant))


def read_values(
    reader: Reader, reached: dict[Any, tuple[str, Any, Any]], harmless: Sequence[str] = ()
) -> list[tuple[str, dict[str, Any], str, Any]]:
    """``(label, namespace, key, value)`` for each plain value the recorded code read:
    attributes of reached objects (``reached``: ``python_state.Snapshot``'s values after the
    capture) and module globals, under the names that code loads, harmless ones left out."""
    names = reader.names
    found: list[tuple[str, dict[str, Any], str, Any]] = []
    for (_, key), (label, value, owner) in reached.items():
        if key in names and not _harmless(label, harmless):
            namespace = getattr(owner, "__dict__", None)
            if isinstance(namespace, dict) and namespace.get(key, _MISSING) is value:
                found.append((label, namespace, key, value))
    seen: set[tuple[int, str]] = set()
    for code, namespace in reader.codes.items():
        module = namespace.get("__name__", "?")
        for name in code.co_names:
            value = namespace.get(name, _MISSING)
            if (id(namespace), name) in seen or value is _MISSING or not is_plain(value):
                continue
            seen.add((id(namespace), name))
            label = f"global {module}.{name}"
            if not _harmless(label, harmless):
                found.append((label, namespace, name, value))
    return found


def _harmless(label: str, harmless: Iterable[str]) -> bool:
    return any(label == h or label.endswith("." + h) for h in harmless)


class ValueWatch:
    """The guard's watch over the plain values a recording read (see the module doc)."""

    def __init__(self, values: Sequence[tuple[str, dict[str, Any], str, Any]]):
        self.values = tuple(values)
        self._held = tuple((namespace, key, value) for _, namespace, key, value in values)
        compiled = compiled_module()
        self._same = (
            functools.partial(compiled.values_same, self._held)
            if compiled is not None and hasattr(compiled, "values_same")
            else self._same_in_python
        )

    def __len__(self) -> int:
        return len(self.values)

    def stale(self) -> str | None:
        """``None`` while every value is what the recording read; else which one changed.
        One C call where the extension is built (identity, then type and equality)."""
        return None if self._same() else self._why()

    def _same_in_python(self) -> bool:
        for namespace, key, value in self._held:
            now = namespace.get(key, _MISSING)
            if now is not value and not same_value(now, value):
                return False
        return True

    def _why(self) -> str | None:
        for label, namespace, key, value in self.values:
            now = namespace.get(key, _MISSING)
            if now is not value and not same_value(now, value):
                became = "deleted" if now is _MISSING else repr(now)
                return (
                    f"{label} changed from {value!r} to {became} (the recording froze the value "
                    "it read; keep a value that changes in a tensor on the device)"
                )
        return None

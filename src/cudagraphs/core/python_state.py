"""Plain Python values a recording would freeze: found at capture, never checked at replay.

A recording runs the function's Python code once. Every plain value it read then (a step
counter, a "cache is full" flag, a sliding-window cache's Python position) is baked into the
kernels it launched: which branch, which index, which constant. If the function itself changes
such a value from one run to the next, every replay repeats the first run's choice, silently
(or, for a position that indexes a cache, with an out-of-bounds write on the device).

So around warm-up and capture the library takes a :class:`Snapshot` of the plain values (int,
float, bool, complex, str, bytes, None, enums, and tuples of these) in the instance dictionaries
of every object the function reaches (``reach.walk``: the module tree, a bound method's
``self``, closure cells, globals its code names, attributes of its plain arguments such as a
cache object). A value that differs between two runs after the first (the first may set things
up once: a lazily built table, a compile) raises :class:`~cudagraphs.errors.FrozenStateError`
at capture, naming ``object.attribute``, what it was and what it became.

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
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import FrozenStateError, explain
from .frames import callable_name
from .reach import walk

__all__ = ["Snapshot", "is_plain"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None), enum.Enum)
# nn.Module's own bookkeeping: not the model's state.
_MODULE_INTERNALS = frozenset({"training", "_is_full_backward_hook"})


def is_plain(value: Any, depth: int = 0) -> bool:
    """An immutable plain value whose changes a recording would not see."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, tuple) and depth < 3 and len(value) <= 64:
        return all(is_plain(v, depth + 1) for v in value)
    return False


_Key = tuple[int, str]  # (id of the owner, attribute)


class Snapshot:
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
        for name, obj in walk(self.fn, self.roots):
            attributes = getattr(obj, "__dict__", None)
            if not isinstance(attributes, dict) or _not_state(obj):
                continue
            for key, value in list(attributes.items())[:1000]:
                if key in _MODULE_INTERNALS or not is_plain(value):
                    continue
                values[(id(obj), key)] = (f"{name}.{key}", value, obj)
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
            if now is not None and not _same(now[1], was):
                try:
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

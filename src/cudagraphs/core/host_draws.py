"""Numbers drawn on the host while a capture runs the function: refused, since a recording
bakes each one in and every replay would repeat the recorded run's draw.

Python's ``random`` and NumPy's global generator are shared by every thread of the process.
:class:`HostDraws` compares their states around the runs before a capture (warm-up runs and
the recording); a move of ``random``'s state is charged to the function only where this thread
was seen calling it during the run (:class:`DrawWatch`, a profile of the thread's C calls): a
server's other thread drawing meanwhile moves the state too, and is not the function's draw.
NumPy's generator cannot be watched so: any move of it counts.

Right::

    keep = torch.rand((), device=x.device) < 0.5      # drawn on the device at every replay
    return torch.where(keep, self.layer(x), x)

Wrong::

    return self.layer(x) if random.random() < 0.5 else x   # FrozenStateError: draws from random

What the watch cannot see: a C extension that calls ``random`` from C, not from Python.
"""

from __future__ import annotations

import random
import sys
import types
from collections.abc import Collection, Sequence
from typing import Any

from ..errors import FrozenStateError, explain

__all__ = ["WATCHED", "DrawWatch", "HostDraws"]


#: The shared generators a :class:`DrawWatch` can see drawn from: every draw of Python's
#: ``random`` (``randint``, ``choice``, ``gauss``...) ends in a C call of the module's hidden
#: ``Random`` instance (``random()`` or ``getrandbits()``). NumPy's global generator is not
#: watched: its methods are Cython functions, which a profile does not see called, so every
#: move of its state counts.
WATCHED = frozenset({"random"})


#: The C methods of ``random.Random`` that draw (``getstate``, ``setstate`` and ``seed``, which
#: this module and a seeding function call, do not).
_DRAWS = frozenset({"random", "getrandbits"})


class DrawWatch:
    """``with DrawWatch() as watch:``, then :meth:`start` when the runs to watch begin: from
    then on, whether this thread calls Python's shared ``random`` generator. :meth:`pop` hands
    back the watched generators seen since the last pop. The first run is not watched (no pair
    of runs reads it), so a compile in it runs without the profile's cost. Another profile of
    this thread (a debugger, cProfile, the value reader) is chained, not replaced."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self._shared = getattr(random, "_inst", None)
        self._previous: Any = None
        self._started = False

    def __enter__(self) -> DrawWatch:
        return self

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._previous = sys.getprofile()
            sys.setprofile(self._profile)

    def __exit__(self, *exc: object) -> None:
        if self._started:
            sys.setprofile(self._previous)

    def pop(self) -> set[str] | None:
        """The watched generators seen since the last pop; ``None`` before :meth:`start` (not
        watched: every move counts)."""
        if not self._started:
            return None
        seen, self.seen = self.seen, set()
        return seen

    def _profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if (
            event == "c_call"
            and getattr(arg, "__self__", None) is self._shared
            and getattr(arg, "__name__", None) in _DRAWS
        ):
            self.seen.add("random")
        if self._previous is not None:
            self._previous(frame, event, arg)


class HostDraws:
    """The host's global random generators around the runs before a capture: :meth:`take`
    after each run, :meth:`check` at the end. A run after the first that drew from one (the
    first may set things up once: a compile, a table built on first use) raises
    :class:`FrozenStateError` naming it, after putting the generators back. ``harmless``
    names a generator whose draws decide nothing the GPU does (``"random"``,
    ``"numpy.random"``)."""

    def __init__(self, name: str, harmless: Sequence[str] = ()) -> None:
        self.name = name
        self.harmless = tuple(harmless)
        self.start = _states()
        self.runs: list[dict[str, Any]] = []
        self.seen: list[Collection[str] | None] = []

    def take(self, seen: Collection[str] | None = None) -> None:
        """After a run: the generators' states now. ``seen``: the :data:`WATCHED` generators
        this thread was seen calling in the run (:class:`DrawWatch`); a watched state that
        moved without that was moved by another thread. ``None``: the run was not watched,
        every move counts."""
        self.runs.append(_states())
        self.seen.append(seen)

    def drawn(self) -> list[str]:
        """The generators a run after the first drew from, harmless ones left out."""
        drawn: list[str] = []
        for before, after, seen in zip(self.runs, self.runs[1:], self.seen[1:]):
            for generator, state in before.items():
                moved = generator in after and not _same_state(state, after[generator])
                ours = seen is None or generator not in WATCHED or generator in seen
                if moved and ours and generator not in drawn and generator not in self.harmless:
                    drawn.append(generator)
        return drawn

    def restore(self) -> None:
        """The generators as they were before the runs."""
        random.setstate(self.start["random"])
        if "numpy.random" in self.start:
            sys.modules["numpy.random"].set_state(self.start["numpy.random"])

    def check(self) -> None:
        drawn = self.drawn()
        if not drawn:
            return
        self.restore()  # the library's runs leave no trace
        raise FrozenStateError(
            explain(
                f"{self.name} draws from {' and '.join(drawn)} at every run",
                "a recording bakes in each number drawn on the host, so every replay would "
                "repeat the recorded run's draw (a layer dropped at random stays dropped) "
                "while eager draws afresh",
                "draw on the device with torch (torch.rand((), device=x.device) < p), which a "
                "graph replays with fresh numbers; if the draw decides nothing the GPU does, "
                f"declare it with harmless_state=({drawn[0]!r},)",
            ),
            names=drawn,
        )


def _states() -> dict[str, Any]:
    states: dict[str, Any] = {"random": random.getstate()}
    numpy_random = sys.modules.get("numpy.random")  # not imported here: unused, nothing drew
    if numpy_random is not None:
        states["numpy.random"] = numpy_random.get_state()
    return states


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and len(a) == 5 and hasattr(a[1], "tobytes"):  # NumPy's MT19937
        return a[0] == b[0] and a[1].tobytes() == b[1].tobytes() and a[2:] == b[2:]
    return bool(a == b)

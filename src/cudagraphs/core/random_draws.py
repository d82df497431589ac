"""Random numbers a recording would repeat.

A CUDA graph replays random ops with fresh numbers on every replay (PyTorch advances the
generator's offset per replay), but a loop body recorded once inside a graph (``cg.while_loop``)
runs the same recorded draws on every iteration of one replay: an 8-step random walk would add
the same step 8 times. :class:`RandomDraws` sees each seeded random op (``randn``, ``rand``,
``dropout``, ``multinomial``, ``normal_``...) while such a body is recorded, so the loop can
refuse it with the fix instead of repeating noise silently.

A number drawn on the host (Python's ``random``, NumPy's global generator) is a plain value the
recording bakes in: every replay repeats the recorded run's draw. :class:`HostDraws` compares
the generators' states around the runs before a capture and refuses a function that draws at
every run.

Right::

    keep = torch.rand((), device=x.device) < 0.5      # drawn on the device at every replay
    return torch.where(keep, self.layer(x), x)

Wrong::

    return self.layer(x) if random.random() < 0.5 else x   # FrozenStateError: draws from random
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import FrozenStateError, explain
from .compat import OPS_DISPATCH_MODE, op_argument_defaults, op_argument_names, op_name
from .frames import user_frame

__all__ = ["HostDraws", "RandomDraws"]


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

    def take(self) -> None:
        """After a run: the generators' states now."""
        self.runs.append(_states())

    def drawn(self) -> list[str]:
        """The generators a run after the first drew from, harmless ones left out."""
        drawn: list[str] = []
        for before, after in zip(self.runs, self.runs[1:]):
            for generator, state in before.items():
                moved = generator in after and not _same_state(state, after[generator])
                if moved and generator not in drawn and generator not in self.harmless:
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

"""A CUDA graph replays random ops with fresh numbers on every replay (PyTorch advances the
generator's offset per replay), but a loop body recorded once inside a graph (``cg.while_loop``)
runs the same recorded draws on every iteration of one replay: an 8-step random walk would add
the same step 8 times. :class:`RandomDraws` sees each seeded random op (``randn``, ``rand``,
``dropout``, ``multinomial``, ``normal_``...) while such a body is recorded, so the loop can
refuse it with the fix instead of repeating noise silently.
"""

from __future__ import annotations

from typing import Any

import torch

from .compat import OPS_DISPATCH_MODE, op_argument_defaults, op_argument_names, op_name
from .frames import user_frame

__all__ = ["RandomDraws"]


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

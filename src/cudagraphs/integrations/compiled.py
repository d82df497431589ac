"""The decoder's forward under ``torch.compile``: one compiled variant per shape (batch rung and
cache-length rung)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core import compat

__all__ = ["compiled_forward"]


def compiled_forward(
    fn: Callable[..., Any], compile: bool | str, shapes: int
) -> Callable[..., Any]:
    mode = None if compile is True else compile
    compiled = torch.compile(fn, mode=mode, dynamic=False)
    # One compiled variant per shape: Dynamo's recompile limit must admit them all, raised only
    # around this function's calls (warm-up, capture), not for the rest of the process.
    limits = compat.raise_compile_limits(2 * shapes + 8)

    def within_limits(*args: Any, **kwargs: Any) -> Any:
        with compat.compile_config_patch(limits):
            return compiled(*args, **kwargs)

    return within_limits if limits else compiled

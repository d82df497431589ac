"""The decoder's forward under ``torch.compile``: compiled per shape class, not per (batch
rung, cache-length rung).

The batch and the cache length are marked as dynamic dimensions of the tensors the forward
reads, so Dynamo traces with symbolic sizes instead of once per shape, and every rung's graph
is captured over the same compiled code. Two shape classes remain: batch 1, which Dynamo
specialises (a size of 1 broadcasts), and every larger batch. An unbacked batch would make one
class, but each tensor's batch is then a size of its own and transformers' broadcasts between
them (the cache's ``index_copy_``, attention) cannot be decided while tracing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..core import compat

__all__ = ["compiled_forward", "compiled_tail", "mark_rung_dims"]


def compiled_forward(
    fn: Callable[..., Any], compile: bool | str, *, dynamic: bool
) -> Callable[..., Any]:
    """``fn(token, position, cache, *rows)`` through ``torch.compile`` (``compile`` is
    ``True`` or a mode name). ``dynamic``: the batch dimension of the token and of each of
    ``rows`` (``[batch, ...]``; a 4-D mask also ``[..., length]``) is marked at each call: they
    are made per graph at capture (the token is the graph's own input buffer), so they cannot
    be marked ahead like the cache. Otherwise every size is a constant: for a decoder of one
    (batch, length) shape, whose static trace is faster and whose kernels are specialised."""
    mode = None if compile is True else compile
    compiled = torch.compile(fn, mode=mode, dynamic=None if dynamic else False)
    if not dynamic:
        return compiled

    def forward(token: torch.Tensor, position: torch.Tensor, cache: Any, *rows: Any) -> Any:
        mark_rung_dims([token, *rows], batch=0)
        mark_rung_dims([row for row in rows if row.dim() == 4], length=3)
        return compiled(token, position, cache, *rows)

    return forward


def mark_rung_dims(
    tensors: Iterable[torch.Tensor], *, batch: int | None = None, length: int | None = None
) -> None:
    """Mark dimension ``batch`` of each tensor as the batch rung and ``length`` as the cache
    length, both varying between the graphs' calls of the compiled forward."""
    for tensor in tensors:
        if batch is not None:
            compat.mark_dynamic(tensor, batch)
        if length is not None:
            compat.mark_dynamic(tensor, length)


def compiled_tail(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, the small in-place step after the logits, through ``torch.compile`` with its
    default mode (nothing there to autotune). Its batch becomes dynamic on the second batch size
    it sees (Dynamo's default), so it compiles once for batch 1 and once for larger batches."""
    return torch.compile(fn, dynamic=None)

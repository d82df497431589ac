"""The decoder's forward under ``torch.compile``: compiled per shape class, not per (batch
rung, cache-length rung).

The batch and the cache length are dynamic dimensions, so Dynamo traces with symbolic sizes
instead of once per shape, and every rung's graph is captured over the same compiled code. The
step is handed the rung's cache and a tensor of the rung's shape (batch by length, only its
sizes read), and cuts the layers' keys and values out of the one full-size cache itself
(``RungCaches.cut``): two symbols instead of two per cache tensor, 13% less to trace
under torch 2.11 and 30% less under 2.13 (``reports/decode-compile-cost.md``, ``sliced``
against ``both``). Where
the cache's layers cannot be cut (no tensor write position), the rung views are marked instead.

Two shape classes remain: batch 1, which Dynamo specialises (a size of 1 broadcasts), and
every larger batch. An unbacked batch would make one class under torch 2.13, but under 2.11
the attention's fake implementation asks whether the batch is 1, and the graph breaks there
(the same report).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..core import compat

__all__ = [
    "compile_settings",
    "compiled_forward",
    "compiled_tail",
    "mark_cut_sizes",
    "mark_rung_dims",
]


def compile_settings(compile: bool | str | Mapping[str, Any]) -> dict[str, Any]:
    """``torch.compile``'s ``mode`` and ``options`` for a ``Decoder``'s ``compile=``: ``True``
    (the default mode), a mode name, or a mapping of Inductor options (e.g.
    ``{"coordinate_descent_tuning": True}``, with which Inductor turns a batch-1 projection
    into a tuned reduction instead of a cuBLAS matrix-vector kernel). ``torch.compile`` takes
    one or the other, never both."""
    if isinstance(compile, Mapping):
        return {"mode": None, "options": dict(compile)}
    return {"mode": None if compile is True else compile, "options": None}


def compiled_forward(
    fn: Callable[..., Any],
    compile: bool | str | Mapping[str, Any],
    *,
    dynamic: bool,
    caches: Any = None,
) -> Callable[..., Any]:
    """``fn(token, position, cache, *rows)`` through ``torch.compile`` (``compile`` as
    :func:`compile_settings` takes it). ``dynamic``: the batch dimension of the token and of each of
    ``rows`` (``[batch, ...]``; a 4-D mask also ``[..., length]``) is marked at each call: they
    are made per graph at capture (the token is the graph's own input buffer), so they cannot
    be marked ahead. With ``caches`` (a ``RungCaches`` after ``write_through()``) the step cuts
    the rung's cache itself; without, the caller marks the cache views. Not ``dynamic``: every
    size is a constant, for a decoder of one (batch, length) shape, whose static trace is
    faster and whose kernels are specialised."""
    settings = compile_settings(compile)
    if not dynamic:
        return torch.compile(fn, dynamic=False, **settings)
    if caches is None:
        compiled = torch.compile(fn, **settings)

        def forward(token: torch.Tensor, position: torch.Tensor, cache: Any, *rows: Any) -> Any:
            _mark_call(token, rows)
            return compiled(token, position, cache, *rows)

        return forward

    def cut_step(
        token: torch.Tensor, position: torch.Tensor, cache: Any, span: torch.Tensor, *rows: Any
    ) -> Any:
        caches.cut(cache, span.shape[0], span.shape[1])
        return fn(token, position, cache, *rows)

    cut_compiled = torch.compile(cut_step, **settings)

    def cut_forward(token: torch.Tensor, position: torch.Tensor, cache: Any, *rows: Any) -> Any:
        span = caches.span(cache)
        mark_cut_sizes(span, caches)
        _mark_call(token, rows)
        return cut_compiled(token, position, cache, span, *rows)

    return cut_forward


def mark_cut_sizes(span: torch.Tensor, caches: Any) -> None:
    """Mark the two sizes a cut step reads off ``span`` (``RungCaches.span``: the rung's batch
    and length) with their bounds, the largest batch rung and the cache's length: each slice
    of the full-size cache to them is then known to fit, as ``torch._check`` in the step would
    tell the trace, but with no call in the graph, which AOTAutograd under torch 2.11 would
    refuse to save for a second process (``reports/decode-cache.md``). The bounds go on the
    span, not the token, since the token is also handed to the greedy tail's compile, which
    specialises its batch at first."""
    compat.mark_dynamic(span, 0, high=caches.largest)
    compat.mark_dynamic(span, 1, high=caches.max_length)


def _mark_call(token: torch.Tensor, rows: tuple[Any, ...]) -> None:
    mark_rung_dims([token, *rows], batch=0)
    mark_rung_dims([row for row in rows if row.dim() == 4], length=3)


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


def compiled_tail(fn: Callable[..., Any], *, dynamic: bool) -> Callable[..., Any]:
    """``fn``, the small in-place greedy step after the logits (``decode_steps.greedy_tail``),
    through ``torch.compile`` with its default mode (nothing there to autotune).

    ``dynamic`` (more than one batch rung): each call of a batch above 1 marks the batch
    dimension of the logits, the token, the finished flags and the history, as the forward's
    calls are marked, so one compile serves every batch above 1 (batch 1, which Dynamo
    specialises, is a compile of its own). Left to Dynamo, the first batch would be compiled
    statically and the second again with a dynamic batch: one compile more at every start.
    Not ``dynamic``: the one batch is a constant."""
    compiled = torch.compile(fn, dynamic=None if dynamic else False)
    if not dynamic:
        return compiled

    def tail(
        logits: torch.Tensor,
        token: torch.Tensor,
        position: torch.Tensor,
        finished: torch.Tensor,
        history: torch.Tensor,
        *rest: Any,
    ) -> Any:
        if token.shape[0] > 1:
            mark_rung_dims([logits, token, finished, history], batch=0)
        return compiled(logits, token, position, finished, history, *rest)

    return tail

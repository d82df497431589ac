"""The decoder's forward under ``torch.compile``: compiled per shape class, not per (batch
rung, cache-length rung).

The batch and the cache length are dynamic dimensions, so Dynamo traces with symbolic sizes
instead of once per shape, and every rung's graph is captured over the same compiled code. The
step is handed the rung's cache and a tensor of the rung's shape (batch by length, only its
sizes read), and cuts the layers' keys and values out of the one full-size cache itself
(``RungCaches.cut``): two symbols instead of two per cache tensor, and less to trace
(``reports/decode-compile-cost.md``, ``sliced`` against ``both``). Where
the cache's layers cannot be cut (no tensor write position), the rung views are marked instead.

Two shape classes remain: batch 1, which Dynamo specialises (a size of 1 broadcasts), and
every larger batch. An unbacked batch would make one class under torch 2.13, but under 2.11
the attention's fake implementation asks whether the batch is 1, and the graph breaks there
(the same report).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..core import compat
from ..integrations import SavedCompile, compile_key
from .matvec import pdl_requested

__all__ = [
    "STEP_OPTIONS",
    "compile_settings",
    "compiled_forward",
    "compiled_tail",
    "compiled_unsaved",
    "cut_step",
    "mark_cut_sizes",
    "mark_rung_dims",
    "step_logits",
    "step_settings",
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


#: Inductor options a decode step is compiled with, under the default mode, unless ``compile=``
#: names them. ``combo_kernels``: independent small kernels run side by side in one launch. In
#: a decode step each layer writes its new keys (with their rotary) and values into the cache
#: and rotates its query, three kernels that read the same product and do not depend on each
#: other; as one combo kernel, two launches fewer per layer and token, in the code Inductor
#: writes for a GPU (``reports/step-kernels.md``).
STEP_OPTIONS: Mapping[str, Any] = {"combo_kernels": True}


def step_settings(compile: bool | str | Mapping[str, Any]) -> dict[str, Any]:
    """:func:`compile_settings` for a decode step: :data:`STEP_OPTIONS` under ``True`` or a
    mapping (whose own entries win, ``{"combo_kernels": False}`` turns it off), and Inductor's
    programmatic dependent launch (``triton.enable_pdl``) as the library's one-row kernels use
    it, unless ``CUDAGRAPHS_PDL=0`` (Inductor applies it on Hopper and later GPUs only; each of
    its kernels waits for the one before it before touching what that one wrote). A mode name
    is passed as it is (``torch.compile`` takes a mode or options, never both)."""
    settings = compile_settings(compile)
    if settings["mode"] is None:
        launch = {"triton.enable_pdl": True} if pdl_requested() else {}
        settings["options"] = {**STEP_OPTIONS, **launch, **(settings["options"] or {})}
    return settings


def step_logits(
    model: Any, cache_arg: str, token: torch.Tensor, position: torch.Tensor, cache: Any, *rows: Any
) -> torch.Tensor:
    """The last position's logits of one decode step of ``model`` on ``cache`` (its forward's
    cache keyword ``cache_arg``); ``rows``: none, or a left-padded batch's ``(attends,
    position_ids)``, a prepared 4-D mask the model uses as given (nothing built from the
    padding)."""
    extra: dict[str, Any] = {cache_arg: cache}
    if rows:
        extra.update(attention_mask=rows[0], position_ids=rows[1])
    out = model(input_ids=token, cache_position=position, use_cache=True, **extra)
    return out.logits[:, -1, :]


def cut_step(
    model: Any,
    cache_arg: str,
    caches: Any,
    token: torch.Tensor,
    position: torch.Tensor,
    cache: Any,
    span: torch.Tensor,
    *rows: Any,
) -> torch.Tensor:
    """:func:`step_logits` on the rung of ``span``'s shape, cut out of the one full-size
    cache (``RungCaches.cut``)."""
    try:
        caches.cut(cache, span.shape[0], span.shape[1])
        return step_logits(model, cache_arg, token, position, cache, *rows)
    finally:  # the layers' position counters, all in one operation, whatever happened
        caches.advance(cache)


def compiled_forward(
    model: Any,
    cache_arg: str,
    compile: bool | str | Mapping[str, Any],
    *,
    dynamic: bool,
    padded: bool,
    caches: Any = None,
    save: bool = True,
    dynamic_length: bool = True,
) -> tuple[Callable[..., Any], SavedCompile]:
    """``forward(token, position, cache, *rows)``: :func:`step_logits` compiled (``compile``
    as :func:`step_settings` takes it) and saved for a second process (``SavedCompile``);
    ``padded``: the forward of left-padded batches (``rows`` given); ``save=False``: plain
    ``torch.compile``, as a first process of a configuration that never starts again would
    want (the saving costs part of a cold compile).

    ``dynamic``: the batch dimension of the token and of each of ``rows`` (``[batch, ...]``;
    a 4-D mask also ``[..., length]``) is marked before each trace: they are made per graph at
    capture (the token is the graph's own input buffer), so they cannot be marked ahead. With
    ``caches`` (a ``RungCaches`` after ``write_through()``) the step cuts the rung's cache
    itself, static shapes too (a write through a cache view made outside the step compiles
    as a copy of the layer's whole cache); without, a dynamic step's caller marks the cache
    views, and the step is not saved.
    ``dynamic_length``: the cache length varies too (length rungs); with one length rung it
    stays a constant, whose kernels are specialised (a marked length made batch-16 decoding at
    a short cache slower than the reduce-overhead loop, ``reports/gpu.md``). Not ``dynamic``: every size is a
    constant, for a decoder of one (batch, length) shape, whose static trace is faster and
    whose kernels are specialised."""
    settings = step_settings(compile)
    unsaved = "" if save else "save_compile=False"
    if not dynamic and caches is None:
        key = compile_key(model, step_logits, settings, cache_arg, padded)
        saved = SavedCompile(step_logits, settings, dynamic=False, key=key, unsaved=unsaved)
        return functools.partial(saved, model, cache_arg), saved
    if caches is None:
        saved = SavedCompile(
            step_logits,
            settings,
            dynamic=None,
            key=compile_key(model, step_logits, settings, cache_arg, padded, "marked"),
            # step_logits' arguments; without length rungs the length stays a constant
            mark=lambda args: _mark_call(args[2], args[5:], length=dynamic_length),
            unsaved=unsaved or "the cache views stay marked, which a loaded step's guards refuse",
        )
        return functools.partial(saved, model, cache_arg), saved

    def mark(args: tuple[Any, ...]) -> None:  # cut_step's arguments
        mark_cut_sizes(args[6], caches)
        _mark_call(args[3], args[7:], length=dynamic_length)

    key = compile_key(
        model, cut_step, settings, cache_arg, padded, caches.largest, caches.max_length,
        dynamic_length, dynamic,
    )  # fmt: skip
    saved = SavedCompile(
        cut_step, settings, dynamic=None if dynamic else False, key=key,
        mark=mark if dynamic else None, unsaved=unsaved,
    )  # fmt: skip

    def cut_forward(token: torch.Tensor, position: torch.Tensor, cache: Any, *rows: Any) -> Any:
        return saved(model, cache_arg, caches, token, position, cache, caches.span(cache), *rows)

    return cut_forward, saved


def compiled_unsaved(
    fn: Callable[..., Any],
    compile: bool | str | Mapping[str, Any],
    *,
    why: str,
    dims: Iterable[tuple[int, int]],
) -> SavedCompile:
    """``fn`` compiled as a step is (:func:`step_settings`), in this process only (``why``:
    the reason it is not saved), each ``(argument, dimension)`` of ``dims`` marked dynamic
    without a bound before a trace: a branch of the model's on a size then splits the trace
    instead of refusing it (an engine's steps and prompt chunks)."""
    marked = list(dims)

    def mark(args: tuple[Any, ...]) -> None:
        for argument, dim in marked:
            compat.mark_dynamic(args[argument], dim)

    key = f"unsaved-{fn.__name__}"  # names no file: nothing is read or written
    return SavedCompile(fn, step_settings(compile), dynamic=None, key=key, mark=mark, unsaved=why)


def mark_cut_sizes(span: torch.Tensor, caches: Any) -> None:
    """Mark the two sizes a cut step reads off ``span`` (``RungCaches.span``: the rung's batch
    and length) with their bounds, the largest batch rung and the cache's length: each slice
    of the full-size cache to them is then known to fit, as ``torch._check`` in the step would
    tell the trace, but with no call in the graph, which AOTAutograd under torch 2.11 would
    refuse to save for a second process (``reports/decode-cache.md``). The bounds go on the
    span, not the token, since the token is also handed to the greedy tail's compile, which
    specialises its batch at first. With one length rung the length stays a constant."""
    compat.mark_dynamic(span, 0, high=caches.largest)
    if len(caches.lengths) > 1:
        compat.mark_dynamic(span, 1, high=caches.max_length)


def _mark_call(token: torch.Tensor, rows: tuple[Any, ...], length: bool) -> None:
    mark_rung_dims([token, *rows], batch=0)
    if length:
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


def compiled_tail(
    model: Any, fn: Callable[..., Any], *, dynamic: bool, save: bool = True
) -> tuple[Callable[..., Any], SavedCompile]:
    """``fn``, the small in-place greedy step after the logits (``decode_steps.greedy_tail``),
    compiled with the default mode (nothing there to autotune) and saved for a second process
    as the forward is (``model``: only part of the file's key).

    ``dynamic`` (more than one batch rung): each call of a batch above 1 marks the batch
    dimension of the logits, the token, the finished flags and the history, as the forward's
    calls are marked, so one compile serves every batch above 1 (batch 1, which Dynamo
    specialises, is a compile of its own). Left to Dynamo, the first batch would be compiled
    statically and the second again with a dynamic batch: one compile more at every start.
    Not ``dynamic``: the one batch is a constant."""
    settings, unsaved = compile_settings(True), "" if save else "save_compile=False"
    key = compile_key(model, fn, settings, dynamic)
    if not dynamic:
        saved = SavedCompile(fn, settings, dynamic=False, key=key, unsaved=unsaved)
        return saved, saved

    def mark(args: tuple[Any, ...]) -> None:  # (logits, token, position, finished, history, ...)
        if args[1].shape[0] > 1:
            mark_rung_dims([args[0], args[1], args[3], args[4]], batch=0)

    saved = SavedCompile(fn, settings, dynamic=None, key=key, mark=mark, unsaved=unsaved)
    return saved, saved

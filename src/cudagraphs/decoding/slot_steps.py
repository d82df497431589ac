"""The captured decode step of an engine's running batch: rows at their own lengths, each with
its own settings, one graph per (batch rung, cache-length rung, mode).

Everything a step needs is a device tensor of one entry per slot (:class:`SlotState`), read
and written in place, so the host changes who is in the batch between steps by writing a few
entries, never by capturing again. In one step, for the first ``n`` slots:

- a row is *live* when it is decoding and has not ended (``active & ~finished``); the others
  (a slot whose prompt is still going in, a free slot under the rung) run along and are
  ignored: their cache, length and draw count do not move (their length may lie past the
  rung's positions; they write at the cache's spare position, ``SlotCache.point_writes``),
  and what they emit is not read;
- each live row's token goes into the cache at that row's length and attends to its own
  positions (``SlotCache.decode_mask``), with position id its length;
- the next token is chosen per row (``"greedy"``: the argmax for all; ``"mixed"``: each row's
  settings, ``row_sampling.choose``); a row ends on one of its end-of-sequence ids or its last
  allowed token;
- ``emitted[:n]`` holds each row's token and whether it ended: the one thing the host reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..api import graph
from .compiled import compiled_unsaved
from .requests import MAX_EOS
from .row_sampling import RowSettings, choose
from .slot_cache import SlotCache

__all__ = ["SlotState", "capture_slot_step", "compiled_slot_logits", "slot_logits", "slot_step"]

#: A step's logits: ``forward(tokens, span)``, the first ``n`` slots' tokens fed at their
#: lengths on ``length`` cache positions, ``span`` of shape ``[n, length]`` (``SlotCache.span``).
SlotForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class SlotState:
    """The per-slot device state of a running batch (see the module doc)."""

    lengths: torch.Tensor  # [slots] positions in the cache (``SlotCache.lengths``, shared)
    tokens: torch.Tensor  # [slots, 1] the token each row feeds next
    active: torch.Tensor  # [slots] bool: decoding (prompt done, not left)
    finished: torch.Tensor  # [slots] bool: ended (end-of-sequence id or last token)
    left: torch.Tensor  # [slots] tokens each row may still emit
    eos: torch.Tensor  # [slots, MAX_EOS] end-of-sequence ids, -1 unused
    emitted: torch.Tensor  # [slots, 2] the step's token and whether the row ended
    settings: RowSettings

    @classmethod
    def make(cls, cache: SlotCache, vocab_size: int) -> SlotState:
        slots, device = cache.slots, cache.lengths.device
        long = {"dtype": torch.long, "device": device}
        return cls(
            lengths=cache.lengths,
            tokens=torch.zeros(slots, 1, **long),
            active=torch.zeros(slots, dtype=torch.bool, device=device),
            finished=torch.zeros(slots, dtype=torch.bool, device=device),
            left=torch.zeros(slots, **long),
            eos=torch.full((slots, MAX_EOS), -1, **long),
            emitted=torch.zeros(slots, 2, **long),
            settings=RowSettings.make(slots, vocab_size, device),
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every per-slot tensor (the settings' too)."""
        plain = [getattr(self, f.name) for f in fields(self) if f.name != "settings"]
        return [*plain, *self.settings.tensors()]

    def move(self, source: int, target: int) -> None:
        """Slot ``source``'s state into slot ``target``, on the device."""
        for tensor in self.tensors():
            tensor[target].copy_(tensor[source])


def slot_logits(
    model: Any,
    cache_arg: str,
    cache: SlotCache,
    tokens: torch.Tensor,
    span: torch.Tensor,
    view: Any = None,
) -> torch.Tensor:
    """The last position's logits of the first ``n`` slots fed ``tokens[:n]`` (``[slots, 1]``)
    at their lengths, on rung ``span.shape`` (``(n, length)``) of the cache: ``view``
    (``SlotCache.decode``), or by default its cache cut inside the call (``SlotCache.cut``),
    so that a compiled step reads the rung as two sizes."""
    n, length = span.shape
    view = cache.cut(n, length) if view is None else view
    lengths = cache.lengths[:n]
    out = model(
        input_ids=tokens[:n],
        position_ids=lengths[:, None],
        cache_position=lengths[:1],  # unused: the mask is prepared and the cache places rows
        attention_mask=cache.decode_mask(n, length),
        use_cache=True,
        **{cache_arg: view},
    )
    return out.logits[:, -1, :]


def compiled_slot_logits(
    model: Any, cache_arg: str, cache: SlotCache, compile: bool | str | Mapping[str, Any],
    *, dynamic_length: bool,
) -> SlotForward:  # fmt: skip
    """:func:`slot_logits` under ``torch.compile`` (``compile`` as the Decoder's), one trace for
    every batch rung above 1 and, with ``dynamic_length``, every cache-length rung: the two
    sizes of the span are marked dynamic. Without bounds, so that a branch of the model's on
    a size (the one-token attention kernel serves up to 256 positions) splits the trace in
    two instead of refusing it. Each process compiles its own (an engine's cache object is
    read by the trace, which a saved step's guards could not check)."""

    saved = compiled_unsaved(
        slot_logits, compile,
        why="an engine's step reads its cache object, which a saved step cannot guard",
        dims=[(4, 0), (4, 1)] if dynamic_length else [(4, 0)],  # the span: rows, length
    )  # fmt: skip

    def forward(tokens: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
        return saved(model, cache_arg, cache, tokens, span)

    return forward


def slot_step(
    model: Any,
    cache_arg: str,
    cache: SlotCache,
    state: SlotState,
    n: int,
    length: int,
    mode: str,
    forward: SlotForward | None = None,
) -> Callable[[], None]:
    """One decode step of the first ``n`` slots on ``length`` cache positions (see the module
    doc), as a function of no arguments: it reads and writes ``state`` and ``cache``.
    ``forward``: the logits' function (:func:`compiled_slot_logits`); default the model's
    forward as it is."""
    lengths, tokens, active, finished = state.lengths[:n], state.tokens[:n], state.active[:n], state.finished[:n]  # fmt: skip
    left, eos, emitted, settings = state.left[:n], state.eos[:n], state.emitted[:n], state.settings
    rows = slice(0, n)
    span = cache.span(n, length)
    if forward is None:  # the rung's own view, made once
        view = cache.decode(n, length)
        forward = functools.partial(slot_logits, model, cache_arg, cache, view=view)

    def step() -> None:
        live = active & ~finished
        cache.point_writes(n, live)
        logits = forward(state.tokens, span)
        if mode == "greedy":
            chosen = logits.float().argmax(dim=-1, keepdim=True)
        else:
            chosen = choose(logits, settings, rows, live)
        ended = live & ((chosen == eos).any(dim=-1) | (left <= 1))
        moved = live.long()
        lengths.add_(moved)
        left.sub_(moved)
        finished.logical_or_(ended)
        tokens.copy_(chosen)  # a row that is not live is given its token when it goes live
        emitted[:, 0] = chosen[:, 0]
        emitted[:, 1] = ended.long()

    step.__qualname__ = step.__name__ = f"engine_{mode}_batch{n}_len{length}"
    return step


def capture_slot_step(
    model: Any,
    cache_arg: str,
    cache: SlotCache,
    state: SlotState,
    n: int,
    length: int,
    mode: str,
    *,
    pool: Any,
    warmup: int,
    forward: SlotForward | None = None,
) -> Any:
    """:func:`slot_step` as a graph (``cg.graph``'s lazy form: its first ``warmup`` calls run
    eagerly, the next one captures). Each call, those too, is one real step of the slots, and
    so is a call that captures again."""
    step = slot_step(model, cache_arg, cache, state, n, length, mode, forward)
    graphed = graph(
        step,
        pool=pool,
        warmup=warmup,
        # The step reaches the model through a closure: name it, so the guard sees a
        # parameter moved to new memory (and captures again) before a replay.
        modules=[model],
        # The engine owns the cache and the state and keeps them consistent itself: a step
        # leaves the cache of a row that is not live as it was.
        side_effects="keep",
        outputs="alias",
    )
    # A capture again (a parameter given new memory) must not warm up: each warm-up run would
    # be a step of the live rows. It records without running; the call's replay is the step.
    graphed.recapture_warms_up = False
    return graphed

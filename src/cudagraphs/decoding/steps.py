"""The decode graph of one (batch rung, cache-length rung, mode) of a :class:`Decoder`.

A launch runs ``steps_per_graph`` decode steps, or (``until_eos``) a loop on the device until
every row has ended. Everything stays on the device: the token is fed back and the position
advanced in place. A length rung's graph runs on the view of the cache that holds its first
``length`` positions (``kv_cache.RungCaches``), and its mask of attended positions is the same
prefix, so a step reads only that much of the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..api import graph
from ..control import while_loop
from .sampling import greedy, stop_finished

__all__ = ["capture_steps", "compile_forward", "greedy_tail", "rewind"]


def capture_steps(decoder: Any, n: int, length: int, mode: str) -> Any:
    """Capture the decode graph of batch rung ``n`` on cache-length rung ``length`` for
    ``decoder`` (a ``transformers.Decoder``: its buffers, caches, forward and options)."""
    logits_of, choose = _rung_forward(decoder, n, length, mode), decoder.chooser(mode)
    history, eos, pad, steps = decoder.history[:n], decoder.eos, decoder.pad, decoder.steps
    attends, padded = decoder.attends[:n, :, :, :length], mode.endswith("+padded")
    until_eos, limit = decoder.until_eos, decoder.max_length
    tail = decoder.greedy_tail if mode.startswith("greedy") else None

    def one_step(token: torch.Tensor, position: torch.Tensor, finished: torch.Tensor) -> None:
        if padded:  # this position joins every row's view
            attends.index_fill_(3, position, True)
        logits = logits_of(token, position)
        if tail is not None:
            tail(logits, token, position, finished, history, eos, pad)
        else:
            feed_back(choose(logits), token, position, finished, history, eos, pad)

    def decode_steps(
        token: torch.Tensor, position: torch.Tensor, finished: torch.Tensor, left: torch.Tensor
    ) -> None:
        if not until_eos:
            for _ in range(steps):
                one_step(token, position, finished)
            return

        def more(*state: torch.Tensor) -> torch.Tensor:  # a device-side test, no sync
            return (state[3] > 0) & ~state[2].all()

        def step(*state: torch.Tensor) -> tuple[torch.Tensor, ...]:
            one_step(*state[:3])
            state[3].sub_(1)
            return state

        while_loop(more, step, (token, position, finished, left), max_iterations=limit)

    name = mode.replace("+", "_")
    suffix = "" if length == decoder.caches.max_length else f"_len{length}"
    decode_steps.__qualname__ = decode_steps.__name__ = f"decode_{name}_batch{n}{suffix}"
    device = decoder.device
    token = torch.empty(n, 1, dtype=torch.long, device=device)
    position = torch.empty(1, dtype=torch.long, device=device)
    finished = torch.empty(n, dtype=torch.bool, device=device)
    left = torch.empty((), dtype=torch.long, device=device)  # steps left (until_eos)
    rewind(token, position, finished, left)
    with torch.no_grad():
        return graph(
            decode_steps,
            token,
            position,
            finished,
            left,
            pool=decoder.pool,
            warmup=decoder.warmup,
            # The step reaches the model through a bound method: name it, so the guard sees a
            # parameter moved to new memory (and captures again) before a replay.
            modules=[decoder.model],
            # The decoder owns the cache and the buffers and resets them per request, so
            # warm-up's writes need no putting back (that would copy the whole cache).
            side_effects="keep",
            outputs="alias",
            eager=decoder.eager,
        )


def rewind(
    token: torch.Tensor, position: torch.Tensor, finished: torch.Tensor, left: torch.Tensor
) -> None:
    """The decode state a capture starts from: position 0, no row finished, one step left.
    The warm-up before a capture runs steps that advance the position in place, so a capture
    from a request's last position would write past the end of the cache."""
    token.zero_()
    position.zero_()
    finished.zero_()
    left.fill_(1)


def compile_forward(decoder: Any, mode: str) -> None:
    """Run ``decoder``'s compiled forward of ``mode`` once per shape class, on the full length,
    so that it compiles now and the captures after it only capture: the smallest batch rung
    (batch 1 is a class of its own) and the largest, for every other (batch and cache length
    are dynamic dimensions). Its writes to the cache are undone."""
    length, device = decoder.lengths[-1], decoder.device
    for n in sorted({decoder.rungs[0], decoder.rungs[-1]}):
        token = torch.zeros(n, 1, dtype=torch.long, device=device)
        position = torch.zeros(1, dtype=torch.long, device=device)
        with torch.no_grad():
            logits = _rung_forward(decoder, n, length, mode)(token, position)
            if decoder.greedy_tail is not None and mode.startswith("greedy"):
                finished = torch.zeros(n, dtype=torch.bool, device=device)
                history = torch.zeros_like(decoder.history[:n])
                decoder.greedy_tail(
                    logits, token, position, finished, history, decoder.eos, decoder.pad
                )
        decoder.caches[n, length].reset()


def greedy_tail(
    logits: torch.Tensor,
    token: torch.Tensor,
    position: torch.Tensor,
    finished: torch.Tensor,
    history: torch.Tensor,
    eos: torch.Tensor,
    pad: torch.Tensor,
) -> None:
    """A greedy step after its logits: the choice, then :func:`feed_back`. Under
    ``compile=True`` this is compiled too, so its nine small eager kernels become a few fused
    ones inside the graph."""
    feed_back(greedy(logits), token, position, finished, history, eos, pad)


def feed_back(
    chosen: torch.Tensor,
    token: torch.Tensor,
    position: torch.Tensor,
    finished: torch.Tensor,
    history: torch.Tensor,
    eos: torch.Tensor,
    pad: torch.Tensor,
) -> None:
    """In place on the device: the end-of-sequence rule on the ``chosen`` tokens, the position
    advanced, the tokens kept in the history and fed back as the next step's input."""
    chosen = stop_finished(chosen, finished, eos, pad)
    position.add_(1)
    history.scatter_(1, position.view(1, 1).expand(token.shape[0], 1), chosen)
    token.copy_(chosen)


def _rung_forward(
    decoder: Any, n: int, length: int, mode: str
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The logits of one decode step on rung (``n``, ``length``): ``(token, position)`` through
    the decoder's forward, on that rung's view of the cache (``+padded``: with its mask and
    position ids that skip each row's padding)."""
    cache = decoder.caches[n, length]
    if not mode.endswith("+padded"):
        return lambda token, position: decoder.forward(token, position, cache)
    attends, padding = decoder.attends[:n, :, :, :length], decoder.padding[:n]
    return lambda token, position: decoder.forward_padded(
        token, position, cache, attends, position - padding
    )

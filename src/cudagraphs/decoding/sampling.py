"""Choosing the next token on the device, with no host sync: safe to capture in a graph.

:class:`SamplingParams` lives in device tensors, so one captured graph serves any temperature,
top-k and top-p (changing them is a copy into those tensors, never a new capture). The draw is
an exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), which picks token ``i`` with
probability ``p_i`` like ``torch.multinomial`` but needs no host round-trip; its random numbers
come from the device's default generator, so every replay draws fresh ones and
``torch.manual_seed`` makes a run reproducible.

The filters follow transformers' ``generate``: temperature, then top-k, then top-p (a token is
kept while the probability mass ranked above it is below ``top_p``; the most likely token is
always kept).

Right::

    params = SamplingParams.make(vocab_size, device, temperature=0.7, top_p=0.9)
    token = sample(logits, params)            # [batch, 1], no sync: capturable

Wrong: ``torch.multinomial(probs, 1).item()`` or ``if (probs > p).any():`` inside a captured
step: each reads the device from the host and fails capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, CudaGraphsError, explain

__all__ = ["SamplingParams", "check_sampling", "filtered", "greedy", "sample", "stop_finished"]


@dataclass
class SamplingParams:
    """Temperature, top-k and top-p as device tensors (one captured graph serves all values)."""

    temperature: torch.Tensor  # [1] float32
    top_k: torch.Tensor  # [1] int64; the vocabulary size means no top-k
    top_p: torch.Tensor  # [1] float32; 1.0 means no top-p

    @classmethod
    def make(cls, vocab_size: int, device: torch.device | str) -> SamplingParams:
        """Neutral parameters (temperature 1, no top-k, no top-p) on ``device``."""
        return cls(
            temperature=torch.ones(1, device=device),
            top_k=torch.full((1,), vocab_size, dtype=torch.long, device=device),
            top_p=torch.ones(1, device=device),
        )

    def set(self, temperature: float, top_k: int | None, top_p: float | None) -> None:
        """Write new values in place (the graph reads these tensors by address)."""
        check_sampling(temperature, top_k, top_p)
        vocab = self.top_k.new_tensor(torch.iinfo(torch.long).max)
        self.temperature.fill_(float(temperature))
        self.top_k.copy_(vocab if top_k is None else self.top_k.new_tensor(top_k))
        self.top_p.fill_(1.0 if top_p is None else float(top_p))


def check_sampling(
    temperature: Any, top_k: Any, top_p: Any, error: type[CudaGraphsError] = ConfigError
) -> None:
    """Raise ``error`` (saying what, why and the fix) unless ``temperature`` is a positive
    finite number, ``top_k`` a positive int or None, and ``top_p`` in (0, 1] or None."""

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if not number(temperature) or not 0 < temperature < float("inf"):
        raise error(
            explain(
                f"temperature must be > 0, got {temperature!r}",
                "logits are divided by it",
                "pass do_sample=False for greedy decoding, or a temperature such as 0.7",
            )
        )
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise error(
            explain(
                f"top_k must be a positive int or None, got {top_k!r}",
                "it is how many of the most likely tokens stay candidates",
                "pass top_k=50, or top_k=None for no top-k filter",
            )
        )
    if top_p is not None and (not number(top_p) or not 0 < top_p <= 1):
        raise error(
            explain(
                f"top_p must be in (0, 1], got {top_p!r}",
                "it is the probability mass of the candidates kept",
                "pass top_p=0.9, or top_p=None for no top-p filter",
            )
        )


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of each row, ``[batch, 1]`` (``generate``'s greedy choice)."""
    return logits.float().argmax(dim=-1, keepdim=True)


def sample(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One token per row of ``logits`` ``[batch, vocab]``, ``[batch, 1]``; see the module doc."""
    probs, order = filtered(logits.float() / params.temperature, params.top_k, params.top_p)
    race = torch.empty_like(probs).exponential_()
    choice = (probs / race).argmax(dim=-1, keepdim=True)
    return order.gather(-1, choice)


def filtered(
    scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The probabilities of ``scores`` (``[batch, vocab]``, already divided by the
    temperature) ranked from the most likely, after top-k then top-p (``[1]`` for every row,
    or ``[batch, 1]`` one per row), and the vocabulary index of each rank."""
    ranked, order = scores.sort(dim=-1, descending=True)
    rank = torch.arange(ranked.shape[-1], device=ranked.device)
    keep = rank < top_k  # top-k by rank
    ranked = ranked.masked_fill(~keep, float("-inf"))
    probs = ranked.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    keep = (mass_above < top_p) & keep
    keep[..., 0] = True  # the most likely token always stays
    return ranked.masked_fill(~keep, float("-inf")).softmax(dim=-1), order


def stop_finished(
    token: torch.Tensor, finished: torch.Tensor, eos: torch.Tensor, pad: torch.Tensor
) -> torch.Tensor:
    """``generate``'s end-of-sequence rule, in place on the device: rows already finished get
    ``pad``; a row that emits one of ``eos`` (``[k]``; ``-1`` entries never match) is finished
    from then on. ``token``: ``[batch, 1]``; ``finished``: ``[batch]`` bool."""
    token = torch.where(finished[:, None], pad, token)
    finished |= (token == eos).any(dim=-1)
    return token

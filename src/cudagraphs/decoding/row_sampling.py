"""Each row's own token choice in one captured step: greedy or sampled, with its own
temperature, top-k, top-p and seed.

The settings live in device tensors of one entry per slot (:class:`RowSettings`), so one graph
serves any mix of requests. A sampled row's random number comes from its own seed and the
count of tokens it has drawn, through a counter-based hash (:func:`seeded_uniform`), not from
a generator shared by the batch: the same seed gives the same tokens whatever the row's
neighbours are, in a graph or not, and a replay needs no generator state. The draw is the
inverse of the filtered distribution's cumulative sum at that number, over the tokens ranked
from the most likely (:func:`~.sampling.filtered`, the filters of ``generate``).

Right::

    settings.set(slot, temperature=0.7, top_k=50, top_p=0.9, seed=1234)
    token = choose(logits, settings, slice(0, 4), live)   # [4, 1]; temperature 0: argmax

Wrong: ``torch.manual_seed(seed)`` per request around a batched step: the generator is one
stream for the whole batch, so a row's tokens would depend on which rows drew before it.

The tokens of a seeded request are this library's, not those ``model.generate`` draws from
``torch.manual_seed``: the same distribution, another stream of random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import filtered

__all__ = ["RowSettings", "choose", "seeded_uniform"]

_LOW = 0xFFFFFFFF
# Multipliers below 2**31: a product with a 32-bit value stays inside int64.
_MIX = (0x7FEB352D, 0x5BD1E995, 0x27D4EB2F)


@dataclass
class RowSettings:
    """One entry per slot: temperature (0: greedy), top-k (the vocabulary: off), top-p (1:
    off), seed, and tokens drawn so far."""

    temperature: torch.Tensor  # [slots] float32
    top_k: torch.Tensor  # [slots] int64
    top_p: torch.Tensor  # [slots] float32
    seed: torch.Tensor  # [slots] int64
    drawn: torch.Tensor  # [slots] int64

    @classmethod
    def make(cls, slots: int, vocab_size: int, device: torch.device | str) -> RowSettings:
        return cls(
            temperature=torch.zeros(slots, device=device),
            top_k=torch.full((slots,), vocab_size, dtype=torch.long, device=device),
            top_p=torch.ones(slots, device=device),
            seed=torch.zeros(slots, dtype=torch.long, device=device),
            drawn=torch.zeros(slots, dtype=torch.long, device=device),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.temperature, self.top_k, self.top_p, self.seed, self.drawn)

    def set(
        self, slot: int, *, temperature: float, top_k: int | None, top_p: float | None, seed: int
    ) -> None:
        """A request's settings into ``slot`` (checked by the caller); ``temperature`` 0 is
        greedy."""
        self.temperature[slot] = float(temperature)
        self.top_k[slot] = self.top_k.new_tensor(top_k or torch.iinfo(torch.long).max)
        self.top_p[slot] = 1.0 if top_p is None else float(top_p)
        self.seed[slot] = seed
        self.drawn[slot] = 0

    def move(self, source: int, target: int) -> None:
        for tensor in self.tensors():
            tensor[target].copy_(tensor[source])


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift and multiply rounds), in int64 arithmetic."""
    for multiplier in _MIX:
        x = ((x ^ (x >> 16)) * multiplier) & _LOW
    return x ^ (x >> 15)


def seeded_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """A number in ``[0, 1)`` per entry, a function of its ``seed`` and ``counter`` alone."""
    x = _mix((counter & _LOW) ^ 0x3C6EF372)
    x = _mix(x ^ (seed & _LOW))
    x = _mix(x ^ ((seed >> 32) & _LOW))
    return (x >> 8).float() / float(1 << 24)


def choose(
    logits: torch.Tensor, settings: RowSettings, rows: slice, live: torch.Tensor
) -> torch.Tensor:
    """The next token of each row of ``logits`` (``[n, vocab]``: the slots ``rows``),
    ``[n, 1]``: the argmax where the row's temperature is 0, else a seeded draw. Advances the
    draw count of the sampled rows that are ``live`` (``[n]`` bool): a row that is not
    decoding (its prompt still going in) draws nothing, whatever its neighbours do."""
    temperature = settings.temperature[rows, None]
    greedy = logits.float().argmax(dim=-1, keepdim=True)
    sampled = temperature > 0
    scores = logits.float() / torch.where(sampled, temperature, 1.0)
    probs, order = filtered(scores, settings.top_k[rows, None], settings.top_p[rows, None])
    mass = probs.cumsum(dim=-1)
    u = seeded_uniform(settings.seed[rows], settings.drawn[rows])[:, None] * mass[:, -1:]
    rank = torch.searchsorted(mass, u).clamp_(max=probs.shape[-1] - 1)
    settings.drawn[rows] += (sampled[:, 0] & live).long()
    return torch.where(sampled, order.gather(-1, rank), greedy)

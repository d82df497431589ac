"""A prompt chunk of one request into its slot of an engine's cache: recorded per
(chunk-length rung, cache-length rung), or eager.

Run eagerly, a chunk launches every operator of every layer from Python: for a short chunk the
host, not the GPU, sets the time (as for the Decoder's prefill, ``prefill.py``), and while it
runs no row of the batch steps. So a chunk of ``t`` tokens runs on the recorded graph of the
shortest rung ``T >= t`` (16, 32, ..., 256, and on up to the engine's ``prefill_chunk``),
right-padded to ``T``:

- the slot and the first position are device tensors (``SlotCache.chunk_slot`` and
  ``chunk_start``), so one graph serves every slot and every start;
- the padding comes after the chunk's real tokens: under the causal mask no real token
  attends to it, and its keys and values land at positions the next chunk or decode step
  writes before anything attends to them;
- the logits are those of the last real position (the model's ``logits_to_keep``, given as a
  device index).

Every rung is recorded when the engine starts (:meth:`SlotPrefill.prepare`). Eager, at the
chunk's own length: a chunk longer than the longest rung, a padded chunk that
would run past the cache's end, and every chunk of a model whose forward has no
``logits_to_keep``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..api import graph
from .slot_cache import SlotCache

__all__ = ["CHUNK_RUNGS", "SlotPrefill", "chunk_rungs"]

#: The chunk rungs of an engine whose ``prefill_chunk`` is at most 256; a larger budget adds
#: the powers of two up to it, so its full chunks are recorded too.
CHUNK_RUNGS = (16, 32, 64, 128, 256)


def chunk_rungs(budget: int, max_length: int) -> list[int]:
    """The chunk rungs of an engine: :data:`CHUNK_RUNGS`, then doublings up to the first one
    that holds ``budget`` tokens; none past ``max_length``."""
    rungs = list(CHUNK_RUNGS)
    while rungs[-1] < budget:
        rungs.append(rungs[-1] * 2)
    return [r for r in rungs if r <= max_length]


class SlotPrefill:
    """The prompt chunks of one engine; see the module doc."""

    def __init__(
        self,
        model: Any,
        cache_arg: str,
        cache: SlotCache,
        lengths: list[int],
        *,
        budget: int,
        pool: Any,
        warmup: int,
    ):
        self.model, self.cache_arg, self.cache, self.lengths = model, cache_arg, cache, lengths
        self.pool, self.warmup = pool, warmup
        keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.rungs = chunk_rungs(budget, cache.max_length) if keeps else []
        self.graphs: dict[tuple[int, int], Any] = {}
        self.recorded = self.eager = 0  # chunks run each way

    def logits(self, slot: int, start: int, ids: list[int]) -> torch.Tensor:
        """Write ``ids`` into slot ``slot`` from position ``start``; the last one's logits,
        ``[1, vocab]``."""
        device = self.cache.lengths.device
        self.cache.chunk_slot.fill_(slot)
        self.cache.chunk_start.fill_(start)
        take = len(ids)
        rung = next((r for r in self.rungs if r >= take), None)
        if rung is None or start + rung > self.cache.max_length:
            self.eager += 1
            last = torch.tensor([take - 1], device=device)
            chunk = torch.tensor([ids], device=device)
            return self._forward(chunk, last, self._length(start + take))
        length = self._length(start + rung)
        recorded = self.graphs.get((rung, length)) or self._record(rung, length)
        padded = torch.tensor([ids + [0] * (rung - take)], device=device)
        self.recorded += 1
        return recorded(padded, torch.tensor([take - 1], device=device))

    def prepare(self) -> None:
        """Record every (chunk rung, cache-length rung) a chunk can run on, before any request:
        otherwise a rung's first chunk pays its capture while the running rows wait (seconds
        over all rungs of a 1.1 B model). The recordings write into slot 0 from position 0,
        which a request's own chunks write again before anything attends to them."""
        self.cache.chunk_slot.fill_(0)
        self.cache.chunk_start.fill_(0)
        for rung in reversed(self.rungs):  # the largest first: the pool grows once
            for length in [n for n in self.lengths if n >= rung]:
                if (rung, length) not in self.graphs:
                    self._record(rung, length)  # warmed up and captured on its examples

    def _length(self, end: int) -> int:
        return next(size for size in self.lengths if size >= end)

    def _forward(self, ids: torch.Tensor, last: torch.Tensor, length: int) -> torch.Tensor:
        cache = self.cache
        positions = cache.chunk_positions(ids.shape[1])
        extra = {"logits_to_keep": last} if self.rungs else {}
        out = self.model(
            input_ids=ids,
            position_ids=positions[None],
            cache_position=positions,
            attention_mask=cache.chunk_mask(positions, length),
            use_cache=True,
            **{self.cache_arg: cache.chunk(length)},
            **extra,
        )
        logits = out.logits if self.rungs else out.logits.index_select(1, last)
        return logits[:, -1, :]

    def _record(self, rung: int, length: int) -> Any:
        def chunk(ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
            return self._forward(ids, last, length)

        chunk.__qualname__ = chunk.__name__ = f"engine_prefill_{rung}_len{length}"
        device = self.cache.lengths.device
        ids = torch.zeros(1, rung, dtype=torch.long, device=device)
        last = torch.zeros(1, dtype=torch.long, device=device)
        # Captured now, on the chunk's slot and start: the warm-up writes where this chunk
        # writes next, with the real tokens.
        self.graphs[rung, length] = graph(
            chunk, ids, last, pool=self.pool, warmup=self.warmup, modules=[self.model],
            side_effects="keep", outputs="alias",
        )  # fmt: skip
        return self.graphs[rung, length]

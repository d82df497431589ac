"""Prompt chunks into their slots of an engine's cache, several requests in one forward:
recorded per (row rung, chunk-length rung, cache-length rung), or eager.

Each forward of the model costs a fixed few milliseconds of device time at this size whatever
its tokens (hundreds of small kernels: ``reports/gpu.md``, "Engine parts and host profile"),
so the chunks of up to ``rows`` joining requests go in together, as rows of one batch. Run
eagerly, a chunk launches every operator of every layer from Python, and while it runs no row
of the batch steps. So a batch of ``k`` chunks, the longest of ``t`` tokens, runs on the
recorded graph of the smallest row rung ``K >= k`` (1, 2, 4, ...) and the shortest chunk rung
``T >= t`` (16, 32, ..., 256, and on up to the engine's ``prefill_chunk``), each row
right-padded to ``T``:

- each row's slot and first position are device tensors (``SlotCache.chunk_slot`` and
  ``chunk_start``), so one graph serves every slot and every start; a row of the rung that
  holds no request writes into the cache's spare slot, which no step reads;
- the padding comes after a row's real tokens: under the causal mask no real token attends
  to it, and its keys and values land at positions the next chunk or decode step writes
  before anything attends to them;
- each row's logits are those of its last real position (the model's ``logits_to_keep``,
  given as device indices: the model returns those positions for every row, and row ``r``
  keeps its own).

Every rung is recorded when the engine starts (:meth:`SlotPrefill.prepare`). Eager, one
chunk at a time at its own length: a chunk longer than the longest rung, a padded chunk that
would run past the cache's end, and every chunk of a model whose forward has no
``logits_to_keep``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..api import graph
from ..shapes import powers_of_two
from .compiled import compiled_unsaved
from .slot_cache import SlotCache

__all__ = ["CHUNK_RUNGS", "SlotPrefill", "chunk_logits", "chunk_rungs"]

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


def chunk_logits(
    model: Any,
    cache_arg: str,
    cache: SlotCache,
    ids: torch.Tensor,
    last: torch.Tensor,
    span: torch.Tensor,
    view: Any = None,
    keeps: bool = True,
) -> torch.Tensor:
    """The chunks ``ids`` (``[rows, tokens]``) through ``model`` into their slots (``cache``'s
    chunk rows) on the first ``len(span)`` cache positions; row ``r``'s logits at position
    ``last[r]``, ``[rows, vocab]``. ``view``: the rung's cache (``SlotCache.chunk``), or by
    default the cache cut inside the call (``SlotCache.cut_chunk``: what a compiled batch
    reads as sizes). ``keeps``: the model's forward takes ``logits_to_keep``."""
    rows, tokens = ids.shape
    length = span.shape[0]
    view = cache.cut_chunk(rows, length) if view is None else view
    positions = cache.chunk_positions(rows, tokens)
    extra = {"logits_to_keep": last} if keeps else {}
    out = model(
        input_ids=ids,
        position_ids=positions,
        cache_position=positions[0],
        attention_mask=cache.chunk_mask(positions, length),
        use_cache=True,
        **{cache_arg: view},
        **extra,
    )
    # With logits_to_keep every row gives the logits of every row's last position: its own
    # is the diagonal. Without, all positions: each row's own last one.
    kept = out.logits if keeps else out.logits.index_select(1, last)
    return kept[torch.arange(rows, device=ids.device), torch.arange(rows, device=ids.device)]


def compiled_chunk_logits(
    model: Any, cache_arg: str, cache: SlotCache, compile: bool | str | Mapping[str, Any],
    *, dynamic_length: bool,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:  # fmt: skip
    """:func:`chunk_logits` under ``torch.compile``, one trace for every row rung above 1,
    chunk rung and (``dynamic_length``) cache-length rung: the rows and tokens of ``ids``
    and the span's length are marked dynamic, without bounds (as the steps', see
    ``slot_steps.compiled_slot_logits``)."""

    # ids' rows and tokens, last's rows (the same size as ids' first), the span's length.
    dims = [(3, 0), (3, 1), (4, 0), *([(5, 0)] if dynamic_length else [])]
    saved = compiled_unsaved(
        chunk_logits, compile, dims=dims,
        why="an engine's prompt chunks read its cache object, which a saved step cannot guard",
    )  # fmt: skip

    def forward(ids: torch.Tensor, last: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
        return saved(model, cache_arg, cache, ids, last, span)

    return forward


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
        compile: bool | str | Mapping[str, Any] = False,
    ):
        self.model, self.cache_arg, self.cache, self.lengths = model, cache_arg, cache, lengths
        self.pool, self.warmup = pool, warmup
        keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.rungs = chunk_rungs(budget, cache.max_length) if keeps else []
        rows = powers_of_two(cache.chunk_rows)
        # Compiled: from 2 rows (Dynamo traces a size of 1 apart: a second compile).
        self.compiled = bool(compile) and keeps
        if self.compiled and cache.chunk_rows >= 2:
            rows = [r for r in rows if r >= 2]
        self.row_rungs = rows if keeps else []
        # The recorded batches' forward: compiled, or the model's own kernels.
        self.recorded_forward = compiled_chunk_logits(
            model, cache_arg, cache, compile, dynamic_length=len(lengths) > 1
        ) if self.compiled else None  # fmt: skip
        self.graphs: dict[tuple[int, int, int], Any] = {}
        self.recorded = self.eager = 0  # chunks run each way
        self.forwards = 0  # replays of a recording, each one or more chunks

    def logits(self, chunks: Sequence[tuple[int, int, list[int]]]) -> torch.Tensor:
        """Write each ``(slot, start, ids)`` of ``chunks`` (at most ``cache.chunk_rows``, each
        slot once) into its slot from position ``start``; the last id's logits of each, in
        order, ``[len(chunks), vocab]``. A chunk no rung serves (longer than the longest, or
        whose padded rung would pass the cache's end) runs eagerly on its own."""
        longest = max(len(ids) for _, _, ids in chunks)
        rung = next((r for r in self.rungs if r >= longest), None)
        fits = [
            k for k, (_, start, _) in enumerate(chunks)
            if rung is not None and start + rung <= self.cache.max_length
        ]  # fmt: skip
        out: list[torch.Tensor | None] = [None] * len(chunks)
        for k in range(len(chunks)):
            if k not in fits:
                out[k] = self._eager(*chunks[k])
        if fits:
            batched = self._recorded([chunks[k] for k in fits])
            for row, k in enumerate(fits):
                out[k] = batched[row : row + 1]
        return torch.cat(out)  # type: ignore[arg-type]

    def _recorded(self, chunks: Sequence[tuple[int, int, list[int]]]) -> torch.Tensor:
        """``chunks`` on the recording of their rungs (each padded chunk fits the cache)."""
        rung = next(r for r in self.rungs if r >= max(len(ids) for _, _, ids in chunks))
        rows = next(r for r in self.row_rungs if r >= len(chunks))
        length = self._length(max(start for _, start, _ in chunks) + rung)
        self._place(chunks)
        recorded = self.graphs.get((rows, rung, length)) or self._record(rows, rung, length)
        device = self.cache.lengths.device
        padded = [ids + [0] * (rung - len(ids)) for _, _, ids in chunks]
        padded += [[0] * rung] * (rows - len(chunks))
        last = [len(ids) - 1 for _, _, ids in chunks] + [0] * (rows - len(chunks))
        self.recorded += len(chunks)
        self.forwards += 1
        out = recorded(torch.tensor(padded, device=device), torch.tensor(last, device=device))
        return out[: len(chunks)]

    def prepare(self) -> None:
        """Record every (row rung, chunk rung, cache-length rung) a batch can run on, before
        any request: otherwise a rung's first batch pays its capture while the running rows
        wait (seconds over all rungs of a 1.1 B model). The recordings write into the spare
        slot, which no step reads."""
        self.cache.clear_chunk_rows()
        for rows in reversed(self.row_rungs):  # the largest first: the pool grows once
            for rung in reversed(self.rungs):
                for length in [n for n in self.lengths if n >= rung]:
                    if (rows, rung, length) not in self.graphs:
                        self._record(rows, rung, length)  # warmed up and captured on examples

    def _place(self, chunks: Sequence[tuple[int, int, list[int]]]) -> None:
        """Each chunk's slot and start into its row; the rows past them at the spare slot."""
        cache, spare = self.cache, [self.cache.spare, 0]
        rows = [[slot, start] for slot, start, _ in chunks]
        rows += [spare] * (cache.chunk_rows - len(chunks))
        placed = torch.tensor(rows, device=cache.chunk_slot.device).T
        cache.chunk_slot.copy_(placed[0])
        cache.chunk_start.copy_(placed[1])

    def _eager(self, slot: int, start: int, ids: list[int]) -> torch.Tensor:
        """One chunk at its own length, eagerly: its last id's logits, ``[1, vocab]``."""
        device = self.cache.lengths.device
        self._place([(slot, start, ids)])
        self.eager += 1
        last = torch.tensor([len(ids) - 1], device=device)
        return self._forward(
            torch.tensor([ids], device=device), last, self._length(start + len(ids))
        )

    def _length(self, end: int) -> int:
        return next(size for size in self.lengths if size >= end)

    def _forward(self, ids: torch.Tensor, last: torch.Tensor, length: int) -> torch.Tensor:
        """The chunks ``ids`` (``[rows, tokens]``) through the model's own kernels; row
        ``r``'s logits at position ``last[r]``, ``[rows, vocab]``."""
        view = self.cache.chunk(ids.shape[0], length)
        return chunk_logits(
            self.model, self.cache_arg, self.cache, ids, last, self._span(length), view,
            keeps=bool(self.rungs),
        )  # fmt: skip

    def _span(self, length: int) -> torch.Tensor:
        return self.cache.spans[0, :length]  # only its size is read: the attended positions

    def _record(self, rows: int, rung: int, length: int) -> Any:
        compiled, span = self.recorded_forward, self._span(length)

        def chunk(ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
            if compiled is not None:
                return compiled(ids, last, span)
            return self._forward(ids, last, length)

        chunk.__qualname__ = chunk.__name__ = f"engine_prefill_{rows}x{rung}_len{length}"
        device = self.cache.lengths.device
        ids = torch.zeros(rows, rung, dtype=torch.long, device=device)
        last = torch.zeros(rows, dtype=torch.long, device=device)
        # Captured now, on the rows' slots and starts as they are: the spare slot from
        # prepare(), or a batch's own (its warm-up writes where the batch writes next, with
        # its real tokens).
        self.graphs[rows, rung, length] = graph(
            chunk, ids, last, pool=self.pool, warmup=self.warmup, modules=[self.model],
            side_effects="keep", outputs="alias",
        )  # fmt: skip
        return self.graphs[rows, rung, length]

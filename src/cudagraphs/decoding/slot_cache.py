"""One KV cache of fixed rows (slots), each row at a length of its own: what lets requests at
different positions decode in one captured step.

A ``StaticCache`` writes every row of a step at the same position. Here each slot keeps its
own length in a device tensor (``lengths[slot]``: the positions written so far, so the next
write goes there), and the layers write a step's one new key and value per row at that row's
length (an indexed write, no host read). A step attends through a prepared boolean mask, row
``r`` to positions ``[0, lengths[r]]``, so a row never sees another request's positions or
its own slot's stale ones. Prompts are written in chunks (:meth:`SlotCache.chunk`): up to
``chunk_rows`` requests' chunks in one forward, each into its own slot from that slot's
length on; a row of a chunk batch that holds no request writes into one spare slot past the
others, which no step reads. Likewise a row that is not decoding in a step (its prompt still
going in, or a free slot under the rung) writes its step's key and value at one spare position
past the last, which nothing reads: every row writes, at a position the step computes once
for all layers (:attr:`SlotCache.write_at`), so a layer's write is one indexed store.

The views a step runs on (:meth:`SlotCache.decode`) hold the first ``n`` slots and the first
``length`` positions: a step of 3 requests on a 16-slot cache runs on the 4-row rung, and a
step whose longest row holds 200 positions attends to a 256-position prefix. The slots in use
are kept at the front (:meth:`SlotCache.move` fills the hole a finished request leaves).

Right::

    cache = SlotCache(model, slots=16, max_length=1024)
    view = cache.decode(4, 256)         # rows 0..3, positions 0..255, written at lengths[:4]

Wrong: giving the model ``cache_position`` to place the rows: every row would be written at
that one position, and a row that joined later would overwrite an older row's past.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from ..errors import ConfigError, explain
from .kv_cache import allocate_rows, cache_bytes, full_length_layers

__all__ = ["SlotCache"]

_ROWS = ("keys", "values")


class SlotCache:
    """``slots`` rows of ``max_length`` positions, each row's length in :attr:`lengths`."""

    def __init__(self, model: Any, slots: int, max_length: int, chunk_rows: int = 1):
        from transformers import StaticCache

        window = getattr(model.config, "sliding_window", None)
        if isinstance(window, int) and window < max_length:
            raise ConfigError(
                explain(
                    f"the model attends within a sliding window of {window} positions, "
                    f"shorter than max_length={max_length}",
                    "rows at different lengths are given one prepared mask of every position "
                    "each row may see, which has no window",
                    f"pass max_length={window} or less, or decode this model with Decoder",
                )
            )
        # One spare row past the slots: where the unused rows of a chunk batch write. One
        # spare position past the last: every rung, the longest too, is then a prefix of the
        # full tensors, so a compiled step sees one shape class whatever the rung.
        self.base = StaticCache(config=model.config, max_cache_len=max_length + 1)
        full_length_layers(self.base, max_length + 1)
        allocate_rows(model, self.base, slots + 1)
        self.slots, self.spare, self.chunk_rows = slots, slots, chunk_rows
        self.max_length = max_length
        device = self.base.layers[0].keys.device
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        # Where each row of a decode step writes (the step sets it): its length where it
        # decodes, else the spare position ``max_length``.
        self.write_at = torch.full((slots,), max_length, dtype=torch.long, device=device)
        self.row_index = torch.arange(slots, device=device)[:, None]
        self.columns = torch.arange(max_length, device=device)
        self._decode_views: dict[tuple[int, int], Any] = {}
        # A compiled step's one cache, cut to its rung inside the step (:meth:`cut`), and a
        # tensor whose corner of ``n`` by ``length`` carries the rung as two dynamic sizes.
        self._cut = self._view(
            _DecodeLayer, slice(0, slots), max_length, at=self.write_at, row_index=self.row_index
        )
        self.spans = torch.empty(slots, max_length, dtype=torch.uint8, device=device)
        # The slot and first position of each row of the prompt chunks a prefill writes next.
        self.chunk_slot = torch.full((chunk_rows,), slots, dtype=torch.long, device=device)
        self.chunk_start = torch.zeros(chunk_rows, dtype=torch.long, device=device)
        # The positions of the chunks' tokens (:meth:`chunk_positions`), computed once for all
        # layers; one column more than a chunk can hold, as the cache's spare position: a
        # compiled batch's tokens are a prefix of it, whatever their rung.
        self.chunk_at = torch.zeros(chunk_rows, max_length + 1, dtype=torch.long, device=device)
        self._chunk_views: dict[tuple[int, int], Any] = {}
        # A compiled batch of chunks' one cache, cut to its rung inside it (:meth:`cut_chunk`).
        self._chunk_cut = copy.copy(self.chunk(chunk_rows, max_length))
        self._chunk_cut.layers = [copy.copy(layer) for layer in self._chunk_cut.layers]

    @property
    def bytes(self) -> int:
        """Bytes of the keys and values of every slot."""
        return cache_bytes(self.base)

    def decode(self, n: int, length: int) -> Any:
        """The cache a step of the first ``n`` slots runs on: each layer holds their first
        ``length`` positions and writes the step's one new position per row at
        ``write_at[row]`` (:meth:`point_writes`). The same object for the same rung (a graph
        reads it by address)."""
        key = (n, length)
        if key not in self._decode_views:
            self._decode_views[key] = self._view(
                _DecodeLayer,
                slice(0, n),
                length,
                at=self.write_at[:n],
                row_index=self.row_index[:n],
            )
        return self._decode_views[key]

    def span(self, n: int, length: int) -> torch.Tensor:
        """A tensor of the rung's shape, ``[n, length]`` (only its shape is read): the two
        sizes a compiled step cuts its cache to (:meth:`cut`), marked dynamic there."""
        return self.spans[:n, :length]

    def cut(self, n: int, length: int) -> Any:
        """The cache of rung (``n``, ``length``) for a compiled step, called inside it with
        the two sizes of :meth:`span`: one object for every rung, its layers cut to the rung
        each step. The same rows and positions as :meth:`decode`, so both give the same
        step; here the compiler sees two sizes instead of a view per rung, and each write
        goes into a full-size tensor (a graph input, updated in place: a write through a
        view cut inside the step would compile as a copy of the whole prefix)."""
        for layer, base in zip(self._cut.layers, self.base.layers):
            layer.keys = base.keys[:n, :, :length]
            layer.values = base.values[:n, :, :length]
            layer.at, layer.row_index = self.write_at[:n], self.row_index[:n]
        return self._cut

    def point_writes(self, n: int, live: torch.Tensor) -> None:
        """Point the first ``n`` rows' writes of the next step (``live``: ``[n]`` bool, the
        rows decoding) at their lengths, the others at the spare position, which nothing
        reads: no row's past changes, whatever its length."""
        self.write_at[:n].copy_(torch.where(live, self.lengths[:n], self.max_length))

    def decode_mask(self, n: int, length: int) -> torch.Tensor:
        """Which positions each of the first ``n`` rows attends to in a step:
        ``[n, 1, 1, length]``, row ``r`` up to and with its new position ``lengths[r]``."""
        return (self.columns[:length] <= self.lengths[:n, None])[:, None, None, :]

    def chunk(self, rows: int, length: int) -> Any:
        """The cache ``rows`` prompt chunks run on: row ``r`` into the slot
        ``chunk_slot[r]``, written from ``chunk_start[r]`` on, its slot's first ``length``
        positions attended. Both are device tensors the caller fills before the chunks, so
        one recorded batch serves every slot and start. The same object for the same rung."""
        key = (rows, length)
        if key not in self._chunk_views:
            cache = copy.copy(self.base)
            slots, at = self.chunk_slot[:rows], self.chunk_at[:rows]
            cache.layers = [_chunk_layer(layer, slots, at, length) for layer in self.base.layers]
            self._chunk_views[key] = cache
        return self._chunk_views[key]

    def cut_chunk(self, rows: int, length: int) -> Any:
        """:meth:`chunk` for a compiled batch of chunks, called inside it with ``rows`` and
        ``length`` read off the sizes of its arguments: one object for every rung, its layers
        cut to the rung each call (as :meth:`cut` for a step)."""
        for layer, base in zip(self._chunk_cut.layers, self.base.layers):
            layer.keys = base.keys[:rows, :, :length]
            layer.values = base.values[:rows, :, :length]
            layer.slot, layer.at = self.chunk_slot[:rows], self.chunk_at[:rows]
            layer.length = length
        return self._chunk_cut

    def clear_chunk_rows(self) -> None:
        """Point every row of the chunk batch at the spare slot, position 0 (a row the caller
        does not fill then writes where no step reads)."""
        self.chunk_slot.fill_(self.spare)
        self.chunk_start.zero_()

    def chunk_positions(self, rows: int, tokens: int) -> torch.Tensor:
        """The cache positions of ``rows`` chunks of ``tokens``: ``[rows, tokens]``, each row
        from its :attr:`chunk_start` on, kept where the layers' writes read them."""
        positions = self.chunk_at[:rows, :tokens]
        positions.copy_(
            self.chunk_start[:rows, None] + torch.arange(tokens, device=positions.device)
        )
        return positions

    def chunk_mask(self, positions: torch.Tensor, length: int) -> torch.Tensor:
        """The causal mask of chunks at ``positions`` (``[rows, tokens]``):
        ``[rows, 1, tokens, length]``."""
        return (self.columns[:length] <= positions[..., None])[:, None]

    def move(self, source: int, target: int, positions: int) -> None:
        """Copy slot ``source``'s first ``positions`` keys and values into slot ``target``
        (the slot a finished request left), on the device. Its length moves with the rest of
        the slot's state (``SlotState.move``)."""
        for layer in self.base.layers:
            for name in _ROWS:
                rows = getattr(layer, name)
                rows[target, :, :positions].copy_(rows[source, :, :positions])

    def _view(self, kind: type, rows: slice, length: int, **tensors: torch.Tensor) -> Any:
        cache = copy.copy(self.base)
        layers = self.base.layers
        cache.layers = [_layer_view(kind, layer, rows, length, tensors) for layer in layers]
        return cache


def _layer_view(
    kind: type, layer: Any, rows: slice, length: int, tensors: dict[str, torch.Tensor]
) -> Any:
    view = object.__new__(_subclass(kind, type(layer)))
    view.__dict__.update(vars(layer))
    view.__dict__.pop("max_cache_len", None)
    for name in _ROWS:  # [slots, heads, positions, head_dim]
        setattr(view, name, getattr(layer, name)[rows, :, :length])
    view.__dict__.update(tensors)
    view.full = (layer.keys, layer.values)
    view.head_index = torch.arange(layer.keys.shape[1], device=layer.keys.device)[None, :]
    return view


class _DecodeLayer:
    """A layer of a decode step: one new position per row, at ``at[row]``."""

    keys: torch.Tensor
    values: torch.Tensor
    full: tuple[torch.Tensor, torch.Tensor]  # the layer's whole keys and values
    at: torch.Tensor  # [n] where each row writes (``SlotCache.write_at``)
    row_index: torch.Tensor  # [n, 1]
    head_index: torch.Tensor  # [1, kv heads]

    def update(self, keys: torch.Tensor, values: torch.Tensor, *_: Any, **__: Any) -> Any:
        # The rung's rows and positions are the first of the full tensors: the same indices
        # there, and the spare position lies past every rung.
        where = (self.row_index, self.head_index, self.at[:, None])
        for full, new in zip(self.full, (keys, values)):
            full.index_put_(where, new[:, :, 0])
        return self.keys, self.values


class _ChunkLayer:
    """A layer of a batch of prompt chunks: row ``r``'s tokens at positions ``at[r]`` in the
    slot ``slot[r]`` (device tensors, ``SlotCache.chunk_positions``), written into the full
    cache; attention reads a copy of those slots' first ``length`` positions (a gather: the
    slots are not known on the host)."""

    full: tuple[torch.Tensor, torch.Tensor]
    slot: torch.Tensor  # [rows]
    at: torch.Tensor  # [rows, max_length + 1]: the first ``tokens`` of a row are its positions
    head_index: torch.Tensor  # [1, kv heads]
    length: int

    def update(self, keys: torch.Tensor, values: torch.Tensor, *_: Any, **__: Any) -> Any:
        tokens = keys.shape[2]
        where = (
            self.slot[:, None, None],
            self.head_index[:, :, None],
            self.at[:, None, :tokens],
        )
        full_keys, full_values = self.full
        full_keys.index_put_(where, keys)
        full_values.index_put_(where, values)
        # The attended positions first, then the rows: the gather copies only those.
        return (
            full_keys[:, :, : self.length].index_select(0, self.slot),
            full_values[:, :, : self.length].index_select(0, self.slot),
        )


def _chunk_layer(layer: Any, slot: torch.Tensor, at: torch.Tensor, length: int) -> Any:
    view = object.__new__(_subclass(_ChunkLayer, type(layer)))
    view.__dict__.update(vars(layer))
    view.__dict__.pop("max_cache_len", None)
    view.full = (layer.keys, layer.values)
    view.head_index = torch.arange(layer.keys.shape[1], device=layer.keys.device)[None, :]
    rows = slot.shape[0]
    for name in _ROWS:  # the shape a reader of the layer expects: the rows, `length` positions
        setattr(view, name, getattr(layer, name)[:rows, :, :length])
    view.slot, view.at, view.length = slot, at, length
    return view


@functools.cache
def _subclass(kind: type, layer_class: type) -> type:
    """``layer_class`` with ``kind``'s ``update`` and a length read from the view's shape."""

    def max_cache_len(self: Any) -> int:
        return self.keys.shape[2]

    def ignore(self: Any, value: int) -> None:  # the view's shape is its length
        pass

    attributes = {
        "update": kind.update,
        "max_cache_len": property(max_cache_len, ignore),
        "__module__": __name__,
    }
    name = f"{kind.__name__.lstrip('_')}{layer_class.__name__}"
    return type(name, (layer_class,), attributes)

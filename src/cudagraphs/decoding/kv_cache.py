"""One transformers ``StaticCache`` for the largest batch, and per-batch-rung views of it.

A decode graph reads and writes its KV cache by address, so each batch rung needs a cache of
its own batch size; allocating one per rung would cost the sum of the rungs. Instead the largest
rung's cache is allocated once and each smaller rung gets a shallow copy whose key and value
tensors are the first ``n`` rows of it (a view: the same memory) and whose position counters are
its own. Only one rung decodes at a time, so the rungs never see each other's rows in use.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from ..core import compat
from ..errors import ConfigError, explain
from ..shapes import powers_of_two

__all__ = [
    "RungCaches",
    "allocate_rows",
    "cache_bytes",
    "cache_keyword",
    "checked_rungs",
    "default_batch_rungs",
    "full_length_layers",
    "length_rungs",
]

_ROWS = ("keys", "values")  # per-layer tensors with a batch dimension first


class RungCaches:
    """``caches[n]`` or ``caches[n, length]``: a ``StaticCache`` of batch ``n`` and ``length``
    positions (default: all of them) sharing the memory of the largest.

    A length rung's layers hold the first ``length`` positions of its batch rung's keys and
    values (a view) and report that length as ``max_cache_len`` (read from the view's shape),
    from which the model sizes its mask, so a step attends only to that prefix. Its position
    counters are the batch rung's own objects: a request moves to a longer rung between two
    steps with nothing copied.
    """

    def __init__(self, model: Any, rungs: list[int], max_length: int, lengths: Sequence[int] = ()):
        from transformers import StaticCache

        self.max_length = max_length
        self.lengths = sorted({*lengths, max_length})
        largest = max(rungs)
        # One spare position past the longest rung: every rung, the longest too, is then a
        # prefix view with the same strides, so a compiled forward sees one shape class (the
        # length a dynamic dimension) instead of a contiguous tensor and views of it.
        self.base = StaticCache(config=model.config, max_cache_len=max_length + 1)
        full_length_layers(self.base, max_length + 1)
        allocate_rows(model, self.base, largest)
        self.largest = largest
        self.caches: dict[tuple[int, int], Any] = {}
        for n in rungs:
            rows = self.base if n == largest else _view(self.base, n)
            for length in self.lengths:
                self.caches[n, length] = _length_view(rows, length)
        for cache in self.caches.values():
            cache.reset()
        # A tensor whose corner of ``rows`` by ``length`` stands for a rung in a compiled step
        # (see ``cut``): the two dynamic dimensions that carry its batch and length. Only its
        # shape is read.
        device = self.base.layers[0].keys.device
        self.spans = torch.empty(largest, max_length + 1, dtype=torch.uint8, device=device)

    def __getitem__(self, key: int | tuple[int, int]) -> Any:
        return self.caches[key if isinstance(key, tuple) else (key, self.max_length)]

    @property
    def bytes(self) -> int:
        """Bytes of the one set of key/value tensors all rungs share."""
        return cache_bytes(self.base)

    def tensors(self) -> list[torch.Tensor]:
        """Every rung's key and value views (``[batch, heads, positions, head_dim]``)."""
        return [
            getattr(layer, name)
            for cache in self.caches.values()
            for layer in cache.layers
            for name in _ROWS
        ]

    def cuttable(self) -> bool:
        """Whether a compiled step can cut the rungs itself (:meth:`cut`): the layers keep
        their write position in a tensor (transformers' ``StaticLayer``), which
        :func:`_write_through_full` reproduces."""
        return all(
            isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
            for layer in self.base.layers
        )

    def write_through(self) -> None:
        """From now on every rung's layers write new keys into the full-size tensors (the
        same memory their views show), as :meth:`cut` needs."""
        for cache in self.caches.values():
            for layer, full in zip(cache.layers, self.base.layers):
                layer.full = (full.keys, full.values)

    def span(self, cache: Any) -> torch.Tensor:
        """A tensor of ``cache``'s rung's shape, batch by length (a view of one buffer)."""
        keys = cache.layers[0].keys
        return self.spans[: keys.shape[0], : keys.shape[2]]

    def cut(self, cache: Any, rows: int, length: int) -> None:
        """Make ``cache``'s layers hold the first ``rows`` rows and ``length`` positions of
        the one full-size cache (after :meth:`write_through`).

        Called inside a compiled step, with ``rows`` and ``length`` the two sizes of
        :meth:`span`: the step then reads two dynamic sizes instead of two per cache tensor
        (``reports/decode-compile-cost.md``, ``sliced``), and a write goes to the full-size
        tensor, a graph input, which the compiler updates in place (a write through a view cut
        inside the step would be compiled as a copy of the layer's whole prefix)."""
        for layer, full in zip(cache.layers, self.base.layers):
            layer.keys = full.keys[:rows, :, :length]
            layer.values = full.values[:rows, :, :length]
            layer.written = 0  # positions written in this step, counted by advance()

    def advance(self, cache: Any) -> None:
        """End a step begun by :meth:`cut`: add the positions each layer wrote to its position
        counter, all counters in one operation. A compiled step writes each counter back to
        memory after its last change: one kernel per layer and token where each layer
        advanced its own."""
        by_count: dict[int, list[torch.Tensor]] = {}
        for layer in cache.layers:
            written = getattr(layer, "written", None)
            if written:
                by_count.setdefault(written, []).append(layer.cumulative_length)
            layer.written = None  # from now on a layer advances its counter as it writes
        for count, counters in by_count.items():  # one group in a decode step
            compat.foreach_add(counters, count)


def default_batch_rungs(max_batch: int, compiles: bool) -> list[int]:
    """The batch rungs a ``Decoder`` or an ``Engine`` captures unless given: powers of two up
    to ``max_batch``,
    and ``max_batch``. Under ``compile`` they start at 2 where ``max_batch`` is 2 or more:
    Dynamo specialises a batch of 1, so a batch-1 rung would be a second compile of the whole
    model (about half the cold set-up); a single request then runs on the batch-2 graph with
    one padding row (``reports/gpu.md`` has the cost). Pass
    ``batch_sizes=[1, 2, ...]`` to keep a batch-1 rung."""
    rungs = sorted({*powers_of_two(max_batch), max_batch})
    return [n for n in rungs if n >= 2] if compiles and max_batch >= 2 else rungs


def length_rungs(cache_len: int, given: Sequence[int] | None, floor: int = 256) -> list[int]:
    """The cache-length rungs: ``given``, else powers of two from ``floor`` up to half of
    ``cache_len``; always ending at ``cache_len`` (one rung below ``2 * floor``). Each rung at
    least doubles the last: a power of two just under the cache's length (4096 for a cache of
    4099) would be one more graph per batch rung for a few positions."""
    if given is not None:
        checked = checked_rungs(
            "cache_lengths", given, cache_len,
            "each is a prefix of the one cache that a step attends to",
            "pass e.g. cache_lengths=[256, 512, 1024], or leave it out",
        )  # fmt: skip
        return sorted({*checked, cache_len})
    rungs, length = [], floor
    while 2 * length <= cache_len:
        rungs.append(length)
        length *= 2
    return [*rungs, cache_len]


def checked_rungs(name: str, given: Sequence[int], cache_len: int, why: str, fix: str) -> list[int]:
    """``given`` (the argument ``name``) sorted, once each, after checking that every rung is
    a positive int of at most the cache's length; ``why`` and ``fix`` go into the error."""
    bad = [g for g in given if not isinstance(g, int) or g < 1 or g > cache_len]
    if bad:
        raise ConfigError(
            explain(
                f"{name} must be positive ints of at most the cache's length ({cache_len}), "
                f"got {list(given)}",
                why,
                fix,
            )
        )
    return sorted(set(given))


def full_length_layers(cache: Any, max_length: int) -> None:
    """Give every sliding-window layer of ``cache`` a full-length static layer instead.

    A sliding-window layer keeps a plain Python int (its cumulative length) and branches on
    it: a recording would freeze the branch of its first step and, once the window is full,
    keep writing at the growing position, past the layer's end (a device-side assert that
    kills the process). A full-length layer is written at the token's position like any other,
    and the model's sliding-window mask, built from the config, keeps each query within its
    window, so attention sees the same keys. Costs the memory of the full length for those
    layers. Any other layer kind with Python-side state is refused.
    """
    from transformers.cache_utils import StaticLayer

    for k, layer in enumerate(cache.layers):
        if isinstance(layer, StaticLayer) and not getattr(layer, "is_sliding", False):
            continue
        if getattr(layer, "is_sliding", False):
            cache.layers[k] = StaticLayer(max_cache_len=max_length)
            continue
        raise ConfigError(
            explain(
                f"the model's cache layer {k} is a {type(layer).__name__}",
                "decode graphs replay a recorded step; a cache layer that keeps its position "
                "or window on the host would be frozen at the recorded step",
                "use a model whose cache layers are full or sliding-window attention (Llama, "
                "Mistral, Qwen2, Gemma 2, ...), or decode it with model.generate",
            )
        )


def cache_bytes(cache: Any) -> int:
    """Bytes of the key and value tensors of ``cache``'s layers."""
    return sum(
        getattr(layer, name).numel() * getattr(layer, name).element_size()
        for layer in cache.layers
        for name in _ROWS
    )


def cache_keyword(model: Any) -> str:
    """The forward's name for the cache argument: ``cache`` in newer transformers (which warn
    on ``past_key_values``), ``past_key_values`` before."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def allocate_rows(model: Any, cache: Any, batch: int) -> None:
    """Allocate the cache's tensors the way the model itself would: one token through it."""
    device = next(model.parameters()).device
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    with torch.no_grad():
        model(input_ids=token, use_cache=True, **{cache_keyword(model): cache})
    for k, layer in enumerate(cache.layers):
        missing = [
            name for name in _ROWS if not isinstance(getattr(layer, name, None), torch.Tensor)
        ]
        if missing or layer.keys.shape[0] != batch:
            raise ConfigError(
                explain(
                    f"the model's cache layer {k} ({type(layer).__name__}) does not keep "
                    f"{', '.join(missing) or 'its keys'} as one tensor per batch row",
                    "decode graphs read and write the cache by address, so it must be a "
                    "transformers StaticCache of preallocated key and value tensors",
                    "use a model whose generate() supports cache_implementation='static' "
                    "(Llama, Mistral, Qwen2, Gemma, ...)",
                )
            )


def _view(big: Any, batch: int) -> Any:
    """A shallow copy of ``big`` whose layers hold its first ``batch`` rows, with position
    counters of their own."""
    cache = copy.copy(big)
    cache.layers = []
    for layer in big.layers:
        small = copy.copy(layer)
        for name in _ROWS:
            setattr(small, name, getattr(layer, name)[:batch])
        if hasattr(small, "batch_size"):
            small.batch_size = batch
        for name, value in vars(layer).items():  # position counters: one per rung
            if isinstance(value, torch.Tensor) and name not in _ROWS:
                setattr(small, name, value.clone())
        cache.layers.append(small)
    return cache


def _length_view(rows: Any, length: int) -> Any:
    """A shallow copy of ``rows`` (one batch rung's cache) whose layers hold its first
    ``length`` positions, with ``rows``' own counters: the same batch rung, one request at a
    time."""
    cache = copy.copy(rows)
    cache.layers = [_prefix(layer, length) for layer in rows.layers]
    # Older transformers keep the cache's length on the cache too; newer ones ask the layers.
    settable = not isinstance(getattr(type(cache), "max_cache_len", None), property)
    if settable and hasattr(cache, "max_cache_len"):
        cache.max_cache_len = length
    return cache


def _prefix(layer: Any, length: int) -> Any:
    """``layer`` holding its first ``length`` positions, sharing its counters. Its
    ``max_cache_len`` is read from the keys' shape, not kept as a plain int: a compiled
    forward then sizes the mask from the tensor's (dynamic) length instead of specialising
    on one number per rung."""
    small = object.__new__(_prefix_class(type(layer)))
    small.__dict__.update(vars(layer))
    small.__dict__.pop("max_cache_len", None)
    for name in _ROWS:  # [batch, heads, positions, head_dim]: a prefix of positions
        setattr(small, name, getattr(layer, name)[:, :, :length])
    return small


@functools.cache
def _prefix_class(layer_class: type) -> type:
    def max_cache_len(self: Any) -> int:
        return self.keys.shape[2]

    def ignore(self: Any, value: int) -> None:  # the view's shape is its length
        pass

    def update(self: Any, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        if getattr(self, "full", None) is None:  # not cut by a compiled step: the layer's own
            return layer_class.update(self, key_states, value_states, *args, **kwargs)
        return _write_through_full(self, key_states, value_states)

    name = f"Prefix{layer_class.__name__}"
    if layer_class.__module__ != "transformers.cache_utils":  # a subclass elsewhere: unique
        name += "_" + layer_class.__module__.replace(".", "_")
    prefix = type(
        name,
        (layer_class,),
        {
            "max_cache_len": property(max_cache_len, ignore),
            "update": update,
            "__module__": __name__,
        },
    )
    # Reachable by module and name, as pickle finds a class: a saved compile's guards name the
    # class of each layer they check (saved_compile.py).
    globals()[name] = prefix
    return prefix


def _write_through_full(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> Any:
    """``StaticLayer.update`` for a layer cut by :meth:`RungCaches.cut`: the new positions
    are the layer's count so far (which it advances, or within a cut step
    :meth:`RungCaches.advance` does at the step's end), written into the full-size tensors at
    the call's rows and every head; returns the layer's (cut) keys and values, as it does."""
    length = keys.shape[-2]
    written = getattr(layer, "written", None)  # None: not within a cut step
    positions = torch.arange(length, device=keys.device) + layer.cumulative_length
    if written is None:
        layer.cumulative_length.add_(length)
    else:  # the step adds it to the counter at its end (RungCaches.advance)
        positions = positions + written
        layer.written = written + length
    where = (
        torch.arange(keys.shape[0], device=keys.device)[:, None, None],
        torch.arange(keys.shape[1], device=keys.device)[None, :, None],
        positions[None, None, :],
    )
    full_keys, full_values = layer.full
    full_keys.index_put_(where, keys)
    full_values.index_put_(where, values)
    return layer.keys, layer.values

"""One transformers ``StaticCache`` for the largest batch, and per-batch-rung views of it.

A decode graph reads and writes its KV cache by address, so each batch rung needs a cache of
its own batch size; allocating one per rung would cost the sum of the rungs. Instead the largest
rung's cache is allocated once and each smaller rung gets a shallow copy whose key and value
tensors are the first ``n`` rows of it (a view: the same memory) and whose position counters are
its own. Only one rung decodes at a time, so the rungs never see each other's rows in use.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

from ..errors import ConfigError, explain

__all__ = ["RungCaches", "cache_keyword", "full_length_layers"]

_ROWS = ("keys", "values")  # per-layer tensors with a batch dimension first


class RungCaches:
    """``caches[n]``: a ``StaticCache`` of batch ``n`` sharing the memory of the largest."""

    def __init__(self, model: Any, rungs: list[int], max_length: int):
        from transformers import StaticCache

        self.max_length = max_length
        largest = max(rungs)
        big = StaticCache(config=model.config, max_cache_len=max_length)
        full_length_layers(big, max_length)
        _initialize(model, big, largest)
        self.caches: dict[int, Any] = {largest: big}
        for n in rungs:
            if n != largest:
                self.caches[n] = _view(big, n)
        for cache in self.caches.values():
            cache.reset()

    def __getitem__(self, batch: int) -> Any:
        return self.caches[batch]

    @property
    def bytes(self) -> int:
        """Bytes of the one set of key/value tensors all rungs share."""
        largest = self.caches[max(self.caches)]
        return sum(
            getattr(layer, name).numel() * getattr(layer, name).element_size()
            for layer in largest.layers
            for name in _ROWS
        )


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


def cache_keyword(model: Any) -> str:
    """The forward's name for the cache argument: ``cache`` in newer transformers (which warn
    on ``past_key_values``), ``past_key_values`` before."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _initialize(model: Any, cache: Any, batch: int) -> None:
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
    """A shallow copy of ``big`` whose layers hold its first ``batch`` rows."""
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

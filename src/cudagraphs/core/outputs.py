"""The output policies: what a replay hands back, given that the next replay overwrites it.

A graph writes its outputs into the same memory on every replay. Three ways to hand them out:

``"alias"``
    The graph's own output tensors. Fastest; valid until the next replay. Wrong::

        a = g(x1); b = g(x2)      # a now holds g(x2)'s values, silently

    Right::

        a = g(x1).clone(); b = g(x2)

``"guarded"`` (default)
    Tensors that alias the output memory through a storage of their own. The next replay marks
    that storage dead, so any later read of ``a`` (or of a view of ``a``) raises a
    ``RuntimeError`` starting with ``StaleOutputError`` instead of returning ``g(x2)``'s values.
    Costs no kernel launch, only host work per output.
    Once a second thread calls the graph, every output is a copy made under the graph's lock
    instead (see :mod:`cudagraphs.core.replay`).

``"clone"``
    Fresh tensors the caller owns (one extra copy kernel per replay). Right for outputs kept
    across calls (a list of per-step results).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch

from . import compat

__all__ = ["STALE_MESSAGE", "detach_outputs", "make_emitter"]


STALE_MESSAGE = (
    "StaleOutputError: this tensor is an output of a cudagraphs replay that a later replay "
    "overwrote (outputs='guarded'); its memory now holds a newer result. Use the latest "
    "output, or .clone() an output before calling the graph again (or capture with "
    "outputs='clone')."
)


def make_emitter(output: Any, policy: str) -> Callable[[], Any]:
    """Build the per-replay function that returns the graph's outputs under ``policy``.

    ``output`` is what the function returned during capture: a pytree whose tensor leaves are
    the static output buffers. Everything that can be computed once is computed here.
    """
    leaves, spec = optree.tree_flatten(output, namespace="cudagraphs")
    tensor_index = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    single = spec.is_leaf() and len(tensor_index) == 1
    if policy == "alias":
        if single:
            static = leaves[0]
            return lambda: static
        return lambda: spec.unflatten(leaves)
    if policy == "clone":
        return _clone_emitter(leaves, spec, tensor_index)
    if policy == "guarded":
        return _GuardedEmitter(leaves, spec, tensor_index)
    raise AssertionError(policy)  # validated by the caller


def _clone_emitter(
    leaves: list[Any], spec: optree.PyTreeSpec, tensor_index: list[int]
) -> Callable[[], Any]:
    static = [leaves[i] for i in tensor_index]

    def emit() -> Any:
        fresh = [torch.empty_like(t) for t in static]
        if fresh:
            compat.foreach_copy(fresh, static)
        out = list(leaves)
        for i, t in zip(tensor_index, fresh):
            out[i] = t
        return spec.unflatten(out)

    return emit


class _GuardedEmitter:
    """Hands out tensors on throwaway storages over the static output memory.

    Each replay builds one non-owning storage per distinct static storage and rebuilds the
    output tensors on it (keeping offsets, strides and aliasing between outputs). When the next
    replay has been launched, before its call returns, those storages are marked dead: PyTorch
    then refuses any data access through them, including through views the caller took. This
    is the mechanism PyTorch's cudagraph trees use.
    """

    def __init__(self, leaves: list[Any], spec: optree.PyTreeSpec, tensor_index: list[int]):
        self.leaves = list(leaves)
        self.spec = spec
        self.tensor_index = tensor_index
        self.single = spec.is_leaf() and len(tensor_index) == 1
        storages: dict[int, tuple[int, torch.device, int]] = {}
        plan = []
        for i in tensor_index:
            t: torch.Tensor = leaves[i]
            storage = t.untyped_storage()
            key = storage.data_ptr()
            storages.setdefault(key, (storage.data_ptr(), t.device, storage.nbytes()))
            meta = {
                "size": t.shape,
                "stride": t.stride(),
                "storage_offset": t.storage_offset(),
                "dtype": t.dtype,
                "device": t.device,
                "nbytes": storage.nbytes(),
                "data_ptr": storage.data_ptr(),
            }
            plan.append((i, list(storages).index(key), meta))
        self.storage_args = list(storages.values())
        self.plan = plan
        # The storages handed out by the latest replay. Shared with the finalizer below so that
        # outputs still held when the graph is freed are marked dead rather than left dangling.
        self.live: list[Any] = []
        weakref.finalize(self, _invalidate, self.live)

        # What a replay calls: partials over precomputed arguments, no method frames (and no
        # reference back to self, so the finalizer above runs as soon as the graph goes).
        # invalidate marks the latest outputs dead; it runs right after the next launch.
        self.invalidate: Callable[[], None] = functools.partial(_invalidate, self.live)
        if self.single:  # one output tensor: the per-replay work in two C calls
            (_, _, meta), (storage_args,) = self.plan[0], self.storage_args
            self.emit = functools.partial(_emit_one, meta, storage_args, self.live)

    def in_use(self) -> bool:
        """Whether any output (or view of one) handed out by the latest replay is still alive
        somewhere: a replay from another thread would overwrite what it may be reading."""
        return any(compat.storage_use_count(s) > 1 for s in self.live)

    def __call__(self) -> Any:
        make_storage, make_tensor = compat.guarded_storage, compat.guarded_tensor
        storages = [make_storage(*args) for args in self.storage_args]
        self.live[:] = storages
        if self.single:
            _, s, meta = self.plan[0]
            return make_tensor(meta, storages[s])
        out = list(self.leaves)
        for i, s, meta in self.plan:
            out[i] = make_tensor(meta, storages[s])
        return self.spec.unflatten(out)


def _emit_one(meta: dict[str, Any], storage_args: tuple[Any, ...], live: list[Any]) -> Any:
    storage = compat.guarded_storage(*storage_args)
    live.append(storage)  # emptied by the invalidation after every replay
    return compat.guarded_tensor(meta, storage)


def _invalidate(live: list[Any]) -> None:
    if not live:
        return
    for storage in live:
        compat.kill_storage(storage, STALE_MESSAGE)
    live.clear()


def detach_outputs(output: Any) -> Any:
    """Detach tensor outputs once, at capture: a replay records no autograd history (a
    capture whose outputs need gradients is refused before this; a training step's loss is
    handed out detached)."""
    leaves, spec = optree.tree_flatten(output, namespace="cudagraphs")
    return optree.tree_unflatten(
        spec, [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
    )

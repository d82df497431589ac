"""Shape buckets: many input sizes, a ladder of captured graphs, one shared memory pool.

Declare which dimensions vary as named size symbols shared across inputs (batch ``B`` on every
input, sequence ``T`` on tokens and mask) and a ladder of sizes per symbol. One graph is
captured per combination of rungs, largest first, all into one :class:`~cudagraphs.Pool`; each
bucket's static inputs are views of one buffer per input sized for the largest rung. A call
picks the smallest rung at or above each real size (:class:`~.dispatch.Dispatcher`, a table
lookup), copies the inputs into the leading box of that bucket's views, writes the input's pad
value around them, replays, and returns the outputs sliced back to the real sizes.

Right::

    g = cg.graph(model, x, buckets=cg.Buckets({"B": cg.powers_of_two(128)}))
    g(torch.randn(37, 256, device="cuda"))   # replays the B=64 graph, returns 37 rows

Wrong: bucketing a function whose rows are not independent without masking the padding (a
mean over the batch, or attention without a key-padding mask, sees the pad rows).
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ..core import (
    NAMESPACE,
    Graphed,
    OutputsInUse,
    Pool,
    Segments,
    SideEffects,
    Signature,
    State,
    callable_name,
    compat,
    flatten,
)
from ..errors import ConfigError, explain
from ..options import Options
from .bucket_stats import BucketStats
from .dispatch import Dispatcher
from .output_dims import infer_output_dims
from .overflow import Overflow
from .spec import Buckets, declare_inputs, real_sizes
from .staging import SharedInput

__all__ = ["Bucketed"]

_SLOW = object()  # sentinel: the fast path declines, the full path explains or handles it


@dataclass
class _Bucket:
    combo: tuple[int, ...]
    graphed: Graphed[Any]
    views: list[torch.Tensor]  # static input per bucketed input: a view of its shared buffer
    mutated: list[bool]  # per input: the function writes into it
    fast: bool  # captured, and no input is mutated: the fast path may replay it


class Bucketed:
    """A function captured once per bucket of input sizes; call it with any size in range.

    Created by ``cg.graph(fn, *examples, buckets=cg.Buckets(...))``. ``stats`` gives hits per
    bucket, padding waste, overflows and the memory the buckets took (growth of
    ``torch.cuda.memory_reserved()``); ``report()`` prints them. Calls are serialized by
    ``lock``.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        options: Options,
        buckets: Buckets,
        example_args: tuple[Any, ...],
        example_kwargs: dict[str, Any],
    ):
        self.fn = fn
        self.options = options
        self.spec = buckets
        self.dispatch = Dispatcher(buckets)
        self.symbols = self.dispatch.symbols
        self.ladders = self.dispatch.ladders
        self.signature, leaves = Signature.of_call(example_args, example_kwargs)
        self._examples = leaves
        self.inputs = declare_inputs(self.signature, leaves, buckets, self.ladders)
        self.pool = _shared_pool(options.pool)
        self._bucket_options = options.replace(pool=self.pool)
        self._buckets: dict[tuple[int, ...], _Bucket] = {}
        self.lock = threading.RLock()
        self._stats = BucketStats()
        # Fast-path calls counted by real size only; folded into stats when they are read.
        self._fast_counts = [0] * (self.dispatch.largest[self.symbols[0]] + 1)
        self._out_spec, self._out_dims = infer_output_dims(
            lambda combo: self._eager_shapes(combo),
            self.dispatch.combos[0],
            buckets,
            self.ladders,
        )
        self._shared = [
            SharedInput(inp, leaves[inp.index], self.dispatch.largest) for inp in self.inputs
        ]
        self._overflow = Overflow(self, buckets.overflow)
        self._prepare_fast_path()
        if not buckets.lazy:
            self._capture_all()

    def _prepare_fast_path(self) -> None:
        """What the fast path needs, decided once. It takes positional tensors only, one
        symbol, each input bucketed along one dimension with nothing else to check (the
        batch-bucket case): such a call needs no pytree flattening and no second signature
        check below the bucket layer."""
        sig = self.signature
        self._fast = (
            sig.is_flat
            and not sig.frozen_index
            and len(self.symbols) == 1
            and len(self.inputs) == len(sig.tensor_index) == sig.spec.num_leaves
            and all(len(inp.dims) == 1 for inp in self.inputs)
        )
        self._fast_inputs = tuple(
            (
                inp.ndim,
                inp.dims[0][0],
                inp.fixed,
                inp.dtype,
                inp.device.index if inp.device.type == "cuda" else -1,
            )
            for inp in self.inputs
        )
        self._rungs0 = self.dispatch.tables[self.symbols[0]]
        # One input bucketed along its rows: a call at an exact rung needs no padding and no
        # slicing, so the bucket's own one-call replay path (in C where built) does it all.
        self._whole_rung = self._fast and len(self._shared) == 1 and self._shared[0].rows_only

    # ------------------------------------------------------------------ capture

    def _bucket_shape(self, index: int, combo: tuple[int, ...]) -> tuple[int, ...]:
        sizes = dict(zip(self.symbols, combo))
        shape = list(self._examples[self.inputs[index].index].shape)
        for d, symbol in self.inputs[index].dims:
            shape[d] = sizes[symbol]
        return tuple(shape)

    def _fill_example(self, buf: torch.Tensor, index: int) -> torch.Tensor:
        """``buf`` (a bucket-shaped tensor) holding the example's leading box, pad elsewhere."""
        inp = self.inputs[index]
        example: torch.Tensor = self._examples[inp.index]
        buf.fill_(inp.pad)
        src, dst = example, buf
        for d, _ in inp.dims:
            n = min(example.shape[d], buf.shape[d])
            src, dst = src.narrow(d, 0, n), dst.narrow(d, 0, n)
        dst.copy_(src)
        return buf

    def _eager_shapes(self, combo: tuple[int, ...]) -> tuple[Any, list[tuple[int, ...] | None]]:
        """A probe: run ``fn`` eagerly at ``combo`` (on temporaries) for its output shapes."""
        leaves = list(self._examples)
        for k, inp in enumerate(self.inputs):
            buf = torch.empty(self._bucket_shape(k, combo), dtype=inp.dtype, device=inp.device)
            leaves[inp.index] = self._fill_example(buf, k)
        args, kwargs = optree.tree_unflatten(self.signature.spec, leaves)
        # A probe is a run on the library's account: what it writes outside the inputs (module
        # buffers, a cache) is put back, as after warm-up.
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        plain = [x for x in leaves if not isinstance(x, torch.Tensor)]
        effects = SideEffects(self.fn, tensors, plain, self.options.side_effects)
        with effects.running():
            out = self.fn(*args, **kwargs)
        effects.finish()
        out_leaves, _ = flatten(out)
        return out, [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in out_leaves]

    def _capture_all(self) -> None:
        cuda = torch.cuda.is_available() and self.inputs[0].device.type == "cuda"
        reserved = torch.cuda.memory_reserved() if cuda else 0
        for combo in self.dispatch.combos:  # largest first: the pool grows once
            self._bucket(combo)
        if cuda:
            # Warm-ups and probes ran eagerly and left blocks in the caching allocator that no
            # graph uses; hand them back so the buckets cost what their pool holds.
            torch.cuda.empty_cache()
            self._stats.reserved_bytes = torch.cuda.memory_reserved() - reserved

    def _bucket(self, combo: tuple[int, ...]) -> _Bucket:
        bucket = self._buckets.get(combo)
        if bucket is not None:
            return bucket
        leaves = list(self._examples)
        views = []
        for k, inp in enumerate(self.inputs):
            view = self._shared[k].view(self._bucket_shape(k, combo))
            leaves[inp.index] = self._fill_example(view, k)
            self._shared[k].written_by_function(view.shape[0])  # the example is in there now
            views.append(view)
        args, kwargs = optree.tree_unflatten(self.signature.spec, leaves)
        graphed: Graphed[Any] = Graphed(self.fn, self._bucket_options)
        with warnings.catch_warnings():
            if self._stats.capture_s:  # warn about CPU pass-through once, not per bucket
                warnings.simplefilter("ignore")
            graphed.initialize(args, kwargs, adopt_inputs=True)
        mutated = set(graphed.mutated_inputs)
        bucket = _Bucket(
            combo=combo,
            graphed=graphed,
            views=views,
            mutated=[inp.index in mutated for inp in self.inputs],
            fast=graphed.state is State.CAPTURED and not mutated,
        )
        self._buckets[combo] = bucket
        stats = graphed.stats
        self._stats.capture_s[combo] = stats.capture_s + stats.warmup_s
        self._stats.pool_bytes[combo] = stats.pool_bytes
        self._stats.hits.setdefault(combo, 0)
        return bucket

    # ------------------------------------------------------------------ calling

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # One call at a time: buckets share static buffers, a pool and their outputs.
        with self.lock:
            if self._fast and not kwargs and len(args) == len(self._fast_inputs):
                out = self._call_fast(args)
                if out is not _SLOW:
                    return out
            leaves, spec = optree.tree_flatten((args, kwargs), namespace=NAMESPACE)
            if spec != self.signature.spec:
                self.signature.check(args, kwargs)  # raises the structural explanation
            real = real_sizes(leaves, self.inputs, self.symbols)
            combo = self.dispatch.choose(real)
            if combo is None:
                return self._overflow(args, kwargs, leaves, real)
            return self.run(combo, leaves, real)

    def _call_fast(self, args: tuple[Any, ...]) -> Any:
        """The batch-bucket case, kept flat: returns ``_SLOW`` when anything needs the full path."""
        n = -1
        for x, (ndim, dim, fixed, dtype, device) in zip(args, self._fast_inputs):
            try:
                shape = x.shape
                if len(shape) != ndim or x.dtype != dtype or x.get_device() != device:
                    return _SLOW
            except AttributeError:
                return _SLOW
            for d, size in fixed:
                if shape[d] != size:
                    return _SLOW
            if n != shape[dim]:
                if n != -1:
                    return _SLOW
                n = shape[dim]
        rungs = self._rungs0
        if n >= len(rungs):
            return _SLOW
        rung = rungs[n]
        bucket = self._buckets.get((rung,))
        if bucket is None or not bucket.fast:
            return _SLOW  # not captured yet, or it writes its inputs: the full path sees to it
        self._fast_counts[n] += 1
        if n == rung and self._whole_rung:
            # The bucket's call checks its guard (capturing again on the same views), the input,
            # copies it into the view, replays and hands out the outputs, as below.
            self._shared[0].rows_written(rung)
            cut_rows(bucket.graphed, rung, n)
            return bucket.graphed(*args)
        bucket.graphed.refresh()  # a guarded tensor moved: captured again on the same views
        cut_rows(bucket.graphed, rung, n)
        try:
            bucket.graphed.enter_replay(args)  # modes, gradients, thread: before staging
        except OutputsInUse:
            return _SLOW  # the full path answers it eagerly
        for shared, x, view in zip(self._shared, args, bucket.views):
            shared.stage_box(x, view, (n,), bucket.combo)
        out = bucket.graphed.replay_static()
        if n == rung:
            return out
        return self._slice_outputs(out, {self.symbols[0]: n}, {self.symbols[0]: rung})

    def run(self, combo: tuple[int, ...], leaves: list[Any], real: dict[str, int]) -> Any:
        """Replay the bucket ``combo`` on these (checked) leaves of real sizes ``real``."""
        bucket = self._bucket(combo)
        bucket.graphed.refresh()  # a guarded tensor moved: captured again on the same views
        rung = dict(zip(self.symbols, combo))
        if len(self.symbols) == 1:
            cut_rows(bucket.graphed, combo[0], real[self.symbols[0]])
        call_leaves = list(leaves)
        stats = self._stats
        for k, inp in enumerate(self.inputs):
            x: torch.Tensor = leaves[inp.index]
            view = bucket.views[k]
            call_leaves[inp.index] = view
            stats.real_elements += x.numel()
            stats.padded_elements += view.numel() - x.numel()
            self._shared[k].stage_box(x, view, tuple(real[s] for _, s in inp.dims), combo)
        args, kwargs = optree.tree_unflatten(self.signature.spec, call_leaves)
        eager = bucket.graphed.state is State.EAGER
        if eager:  # no capture saw the mutations: watch the version counters instead
            versions = [compat.version(view) for view in bucket.views]
        out = bucket.graphed(*args, **kwargs)
        stats.hits[combo] += 1
        for k, inp in enumerate(self.inputs):
            view = bucket.views[k]
            if bucket.mutated[k] or (eager and compat.version(view) != versions[k]):
                self._shared[k].written_by_function(view.shape[0])
                x = leaves[inp.index]
                if x is not view:
                    prefix = view
                    for d, _ in inp.dims:
                        prefix = prefix.narrow(d, 0, x.shape[d])
                    x.copy_(prefix)
        return self._slice_outputs(out, real, rung)

    def _slice_outputs(self, out: Any, real: dict[str, int], rung: dict[str, int]) -> Any:
        if all(real[s] == rung[s] for s in self.symbols):
            return out
        leaves, spec = optree.tree_flatten(out, namespace=NAMESPACE)
        assert self._out_dims is not None
        for i, dims in self._out_dims:
            t = leaves[i]
            for d, s in dims:
                if real[s] != rung[s]:
                    t = t.narrow(d, 0, real[s])
            leaves[i] = t
        return optree.tree_unflatten(spec, leaves)

    @property
    def output_dims(self) -> tuple[Any, list[tuple[int, tuple[tuple[int, str], ...]]]]:
        """``(output tree spec, [(leaf, ((dimension, symbol), ...)), ...])``."""
        return self._out_spec, self._out_dims

    # ------------------------------------------------------------------ reporting

    @property
    def stats(self) -> BucketStats:
        """Hits per bucket, padding waste, overflows, capture seconds, pool and reserved MiB."""
        merged = copy.deepcopy(self._stats)
        merged.overflows += self._overflow.overflows
        merged.eager_calls += self._overflow.eager_calls
        symbol = self.symbols[0]
        for n, count in enumerate(self._fast_counts):
            if not count:
                continue
            rung = self.dispatch.tables[symbol][n]
            merged.hits[(rung,)] = merged.hits.get((rung,), 0) + count
            for view in self._buckets[(rung,)].views:
                real = view.numel() // rung * n
                merged.real_elements += count * real
                merged.padded_elements += count * (view.numel() - real)
        return merged

    @property
    def state(self) -> State:
        states = {b.graphed.state for b in self._buckets.values()}
        if State.CAPTURED in states:
            return State.CAPTURED
        if State.WARMING_UP in states:  # a bucket's graph was dropped: it captures again
            return State.WARMING_UP
        return State.EAGER if states else State.LAZY

    def report(self, console: Any = None) -> None:
        """Print a rich table: per bucket, capture seconds, pool MiB and hits; then the totals."""
        self.stats.print(self.symbols, f"buckets of {callable_name(self.fn)}", console)

    def __repr__(self) -> str:
        ladders = ", ".join(f"{s}={list(ladder)}" for s, ladder in self.ladders.items())
        return (
            f"<cudagraphs.Bucketed {callable_name(self.fn)} {ladders} "
            f"captured={len(self._buckets)}/{len(self.dispatch.combos)} state={self.state.value}>"
        )


def cut_rows(graphed: Graphed[Any], rung: int, real: int) -> None:
    """A bucket whose recording has eager steps: they see the call's real rows, as eager
    would, not the padding (a decision such as ``h.mean().item() > 0`` reads every row)."""
    graph = graphed.graph
    if isinstance(graph, Segments):
        graph.cut_rows(rung, real)


def _shared_pool(pool: Any) -> Pool:
    """The one :class:`Pool` every bucket is captured into (a new one unless given)."""
    if pool is not None and not isinstance(pool, Pool):
        raise ConfigError(
            explain(
                "buckets share one cg.Pool; a raw pool handle or graphed callable was given",
                "every bucket is captured into the same pool, which cudagraphs accounts",
                "pass pool=cg.Pool() (or leave it out)",
            )
        )
    return pool or Pool()

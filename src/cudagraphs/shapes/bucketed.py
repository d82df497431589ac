"""Shape buckets: many input sizes, a ladder of captured graphs, one shared memory pool.

Declare which dimensions vary as named size symbols shared across inputs (batch ``B`` on every
input, sequence ``T`` on tokens and mask) and a ladder of sizes per symbol. One graph is
captured per combination of rungs, largest first, all into one :class:`~cudagraphs.Pool`. A call
picks the smallest rung at or above each real size (a table lookup), copies the inputs into the
prefix of that bucket's static buffers, fills the tail with the input's pad value, replays, and
returns the outputs sliced back to the real sizes.

Right::

    g = cg.graph(model, x, buckets=cg.Buckets({"B": cg.powers_of_two(128)}))
    g(torch.randn(37, 256, device="cuda"))   # replays the B=64 graph, returns 37 rows

Wrong: bucketing a function whose rows are not independent without masking the padding (a
mean over the batch, or attention without a key-padding mask, sees the pad rows).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch

from ..core.frames import callable_name
from ..core.graphed import Graphed, State
from ..core.pool import Pool
from ..core.side_effects import SideEffects
from ..core.tree import NAMESPACE, Signature, flatten, leaf_paths
from ..errors import ConfigError, explain
from ..options import Options
from .ladders import lookup_table, validate_ladder
from .spec import (
    BucketedInput,
    BucketOverflowError,
    Buckets,
    BucketStats,
    declare_inputs,
    infer_output_dims,
    real_sizes,
)

__all__ = ["Bucketed"]

log = logging.getLogger("cudagraphs")
_SLOW = object()  # sentinel: the fast path declines, the full path explains or handles it


@dataclass
class _Bucket:
    combo: tuple[int, ...]
    graphed: Graphed[Any]
    buffers: list[torch.Tensor]  # static buffer per bucketed input, in _Input order
    clean: list[tuple[int, ...] | None]  # per input: box outside which the buffer holds pad
    mutated: list[bool]  # per input: the function writes into it
    numels: list[int]  # per input: elements of the static buffer
    fast: bool  # captured, and no input is mutated: the fast path may replay it


class Bucketed:
    """A function captured once per bucket of input sizes; call it with any size in range.

    Created by ``cg.graph(fn, *examples, buckets=cg.Buckets(...))``. ``stats`` gives hits per
    bucket, padding waste and overflows; ``report()`` prints capture seconds and MiB per bucket.
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
        if buckets.overflow not in ("raise", "eager", "chunk"):
            raise ConfigError(
                explain(
                    f"overflow must be 'raise', 'eager' or 'chunk'; got {buckets.overflow!r}",
                    "it decides what happens above the largest rung",
                    "pass overflow='raise' (the default)",
                )
            )
        self.symbols = list(buckets.sizes)
        if not self.symbols:
            raise ConfigError(
                explain(
                    "Buckets(sizes={}) declares no symbol",
                    "buckets need at least one varying dimension",
                    "pass e.g. cg.Buckets({'B': cg.powers_of_two(128)})",
                )
            )
        self.ladders = {s: validate_ladder(s, buckets.sizes[s]) for s in self.symbols}
        # O(1) rung lookup: rung_for[s][n] is the smallest rung >= n.
        self._rung_for = {s: lookup_table(self.ladders[s]) for s in self.symbols}
        self.signature, leaves = Signature.of_call(example_args, example_kwargs)
        self._examples = leaves
        self.inputs = declare_inputs(self.signature, leaves, buckets, self.ladders)
        self.pool = options.pool if isinstance(options.pool, Pool) else Pool()
        if options.pool is not None and not isinstance(options.pool, Pool):
            raise ConfigError(
                explain(
                    "buckets share one cg.Pool; a raw pool handle or graphed callable was given",
                    "every bucket is captured into the same pool, which cudagraphs accounts",
                    "pass pool=cg.Pool() (or leave it out)",
                )
            )
        self._bucket_options = options.replace(pool=self.pool)
        self._buckets: dict[tuple[int, ...], _Bucket] = {}
        self.lock = threading.RLock()
        self._stats = BucketStats()
        # Fast-path calls counted by real size only; folded into stats when they are read.
        self._fast_counts = [0] * (self.ladders[self.symbols[0]][-1] + 1)
        self._warned_eager = False
        self._combos = sorted(
            itertools.product(*(self.ladders[s] for s in self.symbols)),
            key=lambda c: math.prod(c),
            reverse=True,
        )
        self._out_spec, self._out_dims = infer_output_dims(
            lambda combo: self._eager_shapes(self._bucket_leaves(combo)),
            self._combos[0],
            buckets,
            self.ladders,
        )
        # The fast path: positional tensors only, one symbol, each input bucketed along one
        # dimension with nothing else to check (the batch-bucket case). Such a call needs no
        # pytree flattening and no second signature check below the bucket layer.
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
        self._rungs0 = self._rung_for[self.symbols[0]]
        if not buckets.lazy:
            self._capture_all()

    # ------------------------------------------------------------------ declaration

    # ------------------------------------------------------------------ sizes

    def _combo_for(self, real: dict[str, int]) -> tuple[int, ...] | None:
        combo = []
        for s in self.symbols:
            table = self._rung_for[s]
            n = real[s]
            if n >= len(table):
                return None
            combo.append(table[n])
        return tuple(combo)

    # ------------------------------------------------------------------ capture

    def _bucket_leaves(self, combo: tuple[int, ...]) -> list[Any]:
        """The example call resized to ``combo``: the example's prefix, pad in the tail."""
        sizes = dict(zip(self.symbols, combo))
        leaves = list(self._examples)
        for inp in self.inputs:
            example: torch.Tensor = self._examples[inp.index]
            shape = list(example.shape)
            for d, symbol in inp.dims:
                shape[d] = sizes[symbol]
            buf = torch.full(shape, inp.pad, dtype=inp.dtype, device=inp.device)
            src = example
            dst = buf
            for d, _ in inp.dims:
                n = min(example.shape[d], buf.shape[d])
                src, dst = src.narrow(d, 0, n), dst.narrow(d, 0, n)
            dst.copy_(src)
            leaves[inp.index] = buf
        return leaves

    def _eager_shapes(self, leaves: list[Any]) -> tuple[Any, list[tuple[int, ...] | None]]:
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
        for combo in self._combos:  # largest first: the pool grows once, smaller ones reuse it
            self._bucket(combo)

    def _bucket(self, combo: tuple[int, ...]) -> _Bucket:
        bucket = self._buckets.get(combo)
        if bucket is not None:
            return bucket
        leaves = self._bucket_leaves(combo)
        args, kwargs = optree.tree_unflatten(self.signature.spec, leaves)
        graphed: Graphed[Any] = Graphed(self.fn, self._bucket_options)
        with warnings.catch_warnings():
            if self._stats.capture_s:  # warn about CPU pass-through once, not per bucket
                warnings.simplefilter("ignore")
            graphed.initialize(args, kwargs)
        bucket = self._describe(combo, graphed)
        self._buckets[combo] = bucket
        stats = graphed.stats
        self._stats.capture_s[combo] = stats.capture_s + stats.warmup_s
        self._stats.pool_bytes[combo] = stats.pool_bytes
        self._stats.hits.setdefault(combo, 0)
        return bucket

    def _describe(self, combo: tuple[int, ...], graphed: Graphed[Any]) -> _Bucket:
        """What the call path needs to know of one bucket's graph and its static buffers."""
        static, _ = optree.tree_flatten((graphed.inputs, graphed.input_kwargs), namespace=NAMESPACE)
        mutated = set(graphed.mutated_inputs)
        return _Bucket(
            combo=combo,
            graphed=graphed,
            buffers=[static[inp.index] for inp in self.inputs],
            clean=[None for _ in self.inputs],
            mutated=[inp.index in mutated for inp in self.inputs],
            numels=[static[inp.index].numel() for inp in self.inputs],
            fast=graphed.state is State.CAPTURED and not mutated,
        )

    def _refresh(self, bucket: _Bucket) -> _Bucket:
        """After a recapture (a guarded tensor moved) the bucket has new static buffers."""
        fresh = self._describe(bucket.combo, bucket.graphed)
        self._buckets[bucket.combo] = fresh
        return fresh

    # ------------------------------------------------------------------ calling

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # One call at a time: buckets share static buffers, a pool and their outputs.
        with self.lock:
            return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._fast and not kwargs and len(args) == len(self._fast_inputs):
            out = self._call_fast(args)
            if out is not _SLOW:
                return out
        leaves, spec = optree.tree_flatten((args, kwargs), namespace=NAMESPACE)
        if spec != self.signature.spec:
            self.signature.check(args, kwargs)  # raises the structural explanation
        real = real_sizes(leaves, self.inputs, self.symbols)
        combo = self._combo_for(real)
        if combo is None:
            return self._overflow(args, kwargs, leaves, real)
        return self._run(combo, leaves, real)

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
            return _SLOW
        if bucket.graphed.refresh():
            bucket = self._refresh(bucket)
        self._fast_counts[n] += 1
        for k, x in enumerate(args):
            buf = bucket.buffers[k]
            if x is buf:
                continue
            if n == rung:
                buf.copy_(x)
                continue
            dim = self._fast_inputs[k][1]
            buf.narrow(dim, 0, n).copy_(x)
            clean = bucket.clean[k]
            if clean is None or clean[0] > n:  # rows n.. may hold an earlier call's data
                buf.narrow(dim, n, rung - n).fill_(self.inputs[k].pad)
            bucket.clean[k] = (n,)
        out = bucket.graphed.replay_static()
        if n == rung:
            return out
        return self._slice_outputs(out, {self.symbols[0]: n}, {self.symbols[0]: rung})

    @property
    def stats(self) -> BucketStats:
        """Hits per bucket, padding waste, overflows, capture seconds and MiB per bucket."""
        merged = copy.deepcopy(self._stats)
        if any(self._fast_counts):
            symbol = self.symbols[0]
            for n, count in enumerate(self._fast_counts):
                if not count:
                    continue
                rung = self._rung_for[symbol][n]
                merged.hits[(rung,)] = merged.hits.get((rung,), 0) + count
                bucket = self._buckets[(rung,)]
                for k in range(len(self.inputs)):
                    real = bucket.numels[k] // rung * n
                    merged.real_elements += count * real
                    merged.padded_elements += count * (bucket.numels[k] - real)
        return merged

    def _run(self, combo: tuple[int, ...], leaves: list[Any], real: dict[str, int]) -> Any:
        bucket = self._bucket(combo)
        if bucket.graphed.refresh():
            bucket = self._refresh(bucket)
        rung = dict(zip(self.symbols, combo))
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        call_leaves = list(leaves)
        stats = self._stats
        for k, inp in enumerate(self.inputs):
            x: torch.Tensor = leaves[inp.index]
            buf = bucket.buffers[k]
            call_leaves[inp.index] = buf
            sizes = tuple(real[s] for _, s in inp.dims)
            stats.real_elements += x.numel()
            stats.padded_elements += buf.numel() - x.numel()
            if x is buf:
                continue
            prefix = buf
            for (d, s), n in zip(inp.dims, sizes):
                if n != rung[s]:
                    prefix = prefix.narrow(d, 0, n)
            dst.append(prefix)
            src.append(x)
            self._fill_tail(bucket, k, inp, buf, sizes)
        if dst:
            torch._foreach_copy_(dst, src)
        args, kwargs = optree.tree_unflatten(self.signature.spec, call_leaves)
        eager = bucket.graphed.state is State.EAGER
        if eager:  # no capture saw the mutations: watch the version counters instead
            versions = [buf._version for buf in bucket.buffers]
        out = bucket.graphed(*args, **kwargs)
        stats.hits[combo] += 1
        for k, inp in enumerate(self.inputs):
            if bucket.mutated[k] or (eager and bucket.buffers[k]._version != versions[k]):
                x = leaves[inp.index]
                buf = bucket.buffers[k]
                bucket.clean[k] = None  # the function wrote into the buffer, tail included
                if x is not buf:
                    prefix = buf
                    for d, _ in inp.dims:
                        prefix = prefix.narrow(d, 0, x.shape[d])
                    x.copy_(prefix)
        return self._slice_outputs(out, real, rung)

    def _fill_tail(
        self, bucket: _Bucket, k: int, inp: BucketedInput, buf: torch.Tensor, sizes: tuple[int, ...]
    ) -> None:
        """Make everything outside the real box hold the pad value (skipping what already does)."""
        clean = bucket.clean[k]
        if clean is not None and all(c <= n for c, n in zip(clean, sizes)):
            bucket.clean[k] = sizes
            return
        view = buf
        for (d, _), n in zip(inp.dims, sizes):
            if n < view.shape[d]:
                view.narrow(d, n, view.shape[d] - n).fill_(inp.pad)
            view = view.narrow(d, 0, n)
        bucket.clean[k] = sizes

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

    def _overflow(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], real: dict[str, int]
    ) -> Any:
        over = [s for s in self.symbols if real[s] > self.ladders[s][-1]]
        self._stats.overflows += 1
        policy = self.spec.overflow
        if policy == "raise":
            s = over[0]
            raise BucketOverflowError(
                explain(
                    f"{s}={real[s]} is above the largest bucket ({self.ladders[s][-1]}; ladder {list(self.ladders[s])})",
                    "no graph was captured for a size this large",
                    "add a larger rung to the ladder, split the input, or pass "
                    "Buckets(overflow='eager' or 'chunk')",
                )
            )
        if policy == "eager":
            if not self._warned_eager:
                log.warning(
                    "cudagraphs: %s above the largest bucket; running eagerly (counted in stats.eager_calls)",
                    ", ".join(f"{s}={real[s]}" for s in over),
                )
                self._warned_eager = True
            self._stats.eager_calls += 1
            return self.fn(*args, **kwargs)
        return self._chunk(leaves, real, over)

    def _chunk(self, leaves: list[Any], real: dict[str, int], over: list[str]) -> Any:
        if len(over) != 1:
            raise BucketOverflowError(
                explain(
                    f"{', '.join(over)} are all above their largest buckets",
                    "overflow='chunk' splits along one symbol at a time",
                    "raise the ladders, or use overflow='eager'",
                )
            )
        symbol = over[0]
        assert self._out_dims is not None and self._out_spec is not None
        out_dim: dict[int, int] = {}
        for i, dims in self._out_dims:
            along = [d for d, s in dims if s == symbol]
            if len(along) != 1:
                raise BucketOverflowError(
                    explain(
                        f"overflow='chunk' needs every tensor output to follow {symbol!r} in exactly one dimension",
                        f"output {leaf_paths(self._out_spec, root='out')[i]} does not, so chunks cannot be concatenated",
                        "use overflow='eager' or 'raise'",
                    )
                )
            out_dim[i] = along[0]
        step = self.ladders[symbol][-1]
        pieces = []
        for start in range(0, real[symbol], step):
            n = min(step, real[symbol] - start)
            chunk_leaves = list(leaves)
            for inp in self.inputs:
                for d, s in inp.dims:
                    if s == symbol:
                        chunk_leaves[inp.index] = chunk_leaves[inp.index].narrow(d, start, n)
            chunk_real = dict(real, **{symbol: n})
            combo = self._combo_for(chunk_real)
            assert combo is not None
            out = self._run(combo, chunk_leaves, chunk_real)
            # The next chunk's replay overwrites this one's outputs: keep copies.
            pieces.append(
                optree.tree_map(
                    lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                    out,
                    namespace=NAMESPACE,
                )
            )
        flat = [optree.tree_flatten(p, namespace=NAMESPACE)[0] for p in pieces]
        spec = optree.tree_flatten(pieces[0], namespace=NAMESPACE)[1]
        merged = list(flat[0])
        for i, d in out_dim.items():
            merged[i] = torch.cat([f[i] for f in flat], dim=d)
        return optree.tree_unflatten(spec, merged)

    # ------------------------------------------------------------------ reporting

    @property
    def state(self) -> State:
        states = {b.graphed.state for b in self._buckets.values()}
        if State.CAPTURED in states:
            return State.CAPTURED
        return State.EAGER if states else State.LAZY

    def report(self, console: Any = None) -> None:
        """Print a rich table: per bucket, capture seconds, pool MiB and hits; then the totals."""
        self.stats.print(self.symbols, f"buckets of {callable_name(self.fn)}", console)

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

import itertools
import logging
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import optree
import torch

from .errors import ConfigError, InputMismatchError, explain
from .graphed import Graphed, Options, State, _name
from .pool import Pool
from .tree import NAMESPACE, Signature, flatten, leaf_paths

__all__ = [
    "BucketOverflowError",
    "BucketStats",
    "Buckets",
    "Bucketed",
    "ExactShapes",
    "powers_of_two",
    "server_sizes",
]

log = logging.getLogger("cudagraphs")

Overflow = Literal["raise", "eager", "chunk"]


class BucketOverflowError(InputMismatchError):
    """A real size is above the largest rung of its ladder (``overflow="raise"``)."""


def powers_of_two(maximum: int, minimum: int = 1) -> list[int]:
    """``[1, 2, 4, ..., maximum]`` (``maximum`` included even when not a power of two)."""
    if minimum < 1 or maximum < minimum:
        raise ConfigError(
            explain(
                f"powers_of_two({maximum}, minimum={minimum}) has no sizes",
                "a ladder needs 1 <= minimum <= maximum",
                "pass a positive maximum, e.g. cg.powers_of_two(128)",
            )
        )
    sizes = [1 << k for k in range(maximum.bit_length()) if minimum <= 1 << k <= maximum]
    return sorted(set([*sizes, maximum]))


def server_sizes(maximum: int, step: int = 8, small: Sequence[int] = (1, 2, 4)) -> list[int]:
    """Small sizes, then every multiple of ``step`` up to ``maximum``: the serving engines' ladder."""
    if maximum < 1 or step < 1:
        raise ConfigError(
            explain(
                f"server_sizes({maximum}, step={step}) has no sizes",
                "a ladder needs a positive maximum and step",
                "pass e.g. cg.server_sizes(256, step=8)",
            )
        )
    sizes = {s for s in small if s <= maximum} | set(range(step, maximum + 1, step)) | {maximum}
    return sorted(sizes)


DimSpec = Sequence[str | None] | Mapping[int, str]


@dataclass
class Buckets:
    """Which dimensions vary, over which sizes, and what to do around them.

    Args:
        sizes: symbol -> ladder of sizes, e.g. ``{"B": cg.powers_of_two(128), "T": [64, 128]}``.
        dims: input path -> the symbol of each dimension (``None`` for fixed ones), as a sequence
            (``("B", "T")``) or a mapping (``{0: "B"}``). Paths are as in errors:
            ``"args[0]"``, ``"kwargs['mask']"``, ``"args[0]['obs']"``. Default, with one symbol:
            dimension 0 of every tensor input follows it.
        pad: the value written into the padded tail, per input path or one for all (default 0;
            e.g. -1 for token ids, or a reserved slot index). Padded rows are computed and thrown
            away, so the pad must be a valid input.
        out_dims: output path (``"out"``, ``"out[0]"``, ``"out['logits']"``) -> symbols per
            dimension, for outputs whose dimensions cannot be inferred (declared ones win).
        overflow: above the largest rung: ``"raise"`` (:class:`BucketOverflowError`),
            ``"eager"`` (run ``fn`` eagerly, logged once, counted) or ``"chunk"`` (split along
            the symbol into pieces of the largest rung, replay each, concatenate).
        lazy: capture each bucket on its first use instead of all up front.
    """

    sizes: Mapping[str, Sequence[int]]
    dims: Mapping[str, DimSpec] | None = None
    pad: Mapping[str, float] | float = 0
    out_dims: Mapping[str, DimSpec] | None = None
    overflow: Overflow = "raise"
    lazy: bool = False


@dataclass
class BucketStats:
    """Per-bucket hits and costs, padding waste and overflows of a :class:`Bucketed`."""

    hits: dict[tuple[int, ...], int] = field(default_factory=dict)
    capture_s: dict[tuple[int, ...], float] = field(default_factory=dict)
    pool_bytes: dict[tuple[int, ...], int] = field(default_factory=dict)
    real_elements: int = 0
    padded_elements: int = 0
    overflows: int = 0
    eager_calls: int = 0

    @property
    def padding_waste(self) -> float:
        """Padded elements over real elements, across all calls (0.0: no padding)."""
        return self.padded_elements / self.real_elements if self.real_elements else 0.0

    @property
    def pool_total_bytes(self) -> int:
        return sum(self.pool_bytes.values())


def _dims_tuple(
    spec: DimSpec, ndim: int, where: str, symbols: Mapping[str, Any]
) -> tuple[str | None, ...]:
    if isinstance(spec, Mapping):
        out: list[str | None] = [None] * ndim
        for dim, symbol in spec.items():
            if not isinstance(dim, int) or not -ndim <= dim < ndim:
                raise ConfigError(
                    explain(
                        f"{where}: dimension {dim!r} is out of range for a {ndim}-d tensor",
                        "each declared dimension must exist in the example",
                        f"use dimensions 0..{ndim - 1}",
                    )
                )
            out[dim % ndim] = symbol
        dims = tuple(out)
    else:
        dims = tuple(spec)
        if len(dims) != ndim:
            raise ConfigError(
                explain(
                    f"{where}: {len(dims)} dimensions declared for a {ndim}-d tensor",
                    "a sequence declaration names one symbol (or None) per dimension",
                    f"pass {ndim} entries, e.g. {('B',) + (None,) * (ndim - 1)}",
                )
            )
    for symbol in dims:
        if symbol is not None and symbol not in symbols:
            raise ConfigError(
                explain(
                    f"{where}: symbol {symbol!r} has no ladder",
                    "every symbol used in dims needs sizes",
                    f"add it to sizes, or use one of {sorted(symbols)}",
                )
            )
    return dims


def _ladder(symbol: str, sizes: Sequence[int]) -> tuple[int, ...]:
    ladder = tuple(sorted(set(sizes)))
    if not ladder or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in ladder):
        raise ConfigError(
            explain(
                f"sizes[{symbol!r}] must be a non-empty list of positive ints, got {list(sizes)!r}",
                "each rung is a size a graph is captured for",
                "pass e.g. cg.powers_of_two(128) or [1, 8, 32, 128]",
            )
        )
    return ladder


@dataclass
class _Input:
    """A tensor input with bucketed dimensions."""

    index: int  # leaf index in the call's flattened (args, kwargs)
    path: str
    dims: tuple[tuple[int, str], ...]  # (dimension, symbol) pairs
    fixed: tuple[tuple[int, int], ...]  # (dimension, size) pairs that must match the example
    pad: float
    ndim: int
    dtype: torch.dtype
    device: torch.device


@dataclass
class _Bucket:
    combo: tuple[int, ...]
    graphed: Graphed[Any]
    buffers: list[torch.Tensor]  # static buffer per bucketed input, in _Input order
    clean: list[tuple[int, ...] | None]  # per input: box outside which the buffer holds pad
    mutated: list[bool]  # per input: the function writes into it


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
        self.ladders = {s: _ladder(s, buckets.sizes[s]) for s in self.symbols}
        # O(1) rung lookup: rung_for[s][n] is the smallest rung >= n.
        self._rung_for = {s: self._lookup_table(self.ladders[s]) for s in self.symbols}
        self.signature, leaves = Signature.of_call(example_args, example_kwargs)
        self._examples = leaves
        self.inputs = self._declare_inputs(leaves)
        self.pool = options.pool if isinstance(options.pool, Pool) else Pool()
        if options.pool is not None and not isinstance(options.pool, Pool):
            raise ConfigError(
                explain(
                    "buckets share one cg.Pool; a raw pool handle or graphed callable was given",
                    "every bucket is captured into the same pool, which cudagraphs accounts",
                    "pass pool=cg.Pool() (or leave it out)",
                )
            )
        self._bucket_options = Options(
            warmup=options.warmup,
            outputs=options.outputs,
            pool=self.pool,
            stream=options.stream,
            capture_error_mode=options.capture_error_mode,
            fallback=options.fallback,
        )
        self._buckets: dict[tuple[int, ...], _Bucket] = {}
        self._out_dims: list[tuple[int, tuple[tuple[int, str], ...]]] | None = None
        self._out_spec: optree.PyTreeSpec | None = None
        self.stats = BucketStats()
        self._warned_eager = False
        self._combos = sorted(
            itertools.product(*(self.ladders[s] for s in self.symbols)),
            key=lambda c: math.prod(c),
            reverse=True,
        )
        self._infer_outputs()
        if not buckets.lazy:
            self._capture_all()

    # ------------------------------------------------------------------ declaration

    @staticmethod
    def _lookup_table(ladder: tuple[int, ...]) -> list[int]:
        table = [ladder[0]] * (ladder[-1] + 1)
        rung = 0
        for n in range(1, ladder[-1] + 1):
            while ladder[rung] < n:
                rung += 1
            table[n] = ladder[rung]
        return table

    def _declare_inputs(self, leaves: list[Any]) -> list[_Input]:
        signature = self.signature
        tensor_paths = {signature.paths[i]: i for i in signature.tensor_index}
        dims_spec = self.spec.dims
        if dims_spec is None:
            if len(self.symbols) != 1:
                raise ConfigError(
                    explain(
                        f"several symbols ({', '.join(self.symbols)}) but no dims declaration",
                        "with more than one symbol cudagraphs cannot guess which dimension follows which",
                        "pass dims={'args[0]': ('B', 'T'), ...}",
                    )
                )
            dims_spec = {path: {0: self.symbols[0]} for path in tensor_paths}
        unknown = [p for p in dims_spec if p not in tensor_paths]
        if unknown:
            raise ConfigError(
                explain(
                    f"dims names {unknown[0]!r}, which is not a tensor input",
                    f"the tensor inputs of this call are {sorted(tensor_paths)}",
                    "use one of those paths",
                )
            )
        pads = self.spec.pad
        if isinstance(pads, Mapping):
            bad = [p for p in pads if p not in dims_spec]
            if bad:
                raise ConfigError(
                    explain(
                        f"pad names {bad[0]!r}, which has no bucketed dimension",
                        "only bucketed inputs are padded",
                        f"use one of {sorted(dims_spec)}",
                    )
                )
        declared = []
        for path, spec in dims_spec.items():
            index = tensor_paths[path]
            example: torch.Tensor = leaves[index]
            dims = _dims_tuple(spec, example.dim(), f"dims[{path!r}]", self.ladders)
            pad = pads.get(path, 0) if isinstance(pads, Mapping) else pads
            declared.append(
                _Input(
                    index=index,
                    path=path,
                    dims=tuple((d, s) for d, s in enumerate(dims) if s is not None),
                    fixed=tuple((d, example.shape[d]) for d, s in enumerate(dims) if s is None),
                    pad=pad,
                    ndim=example.dim(),
                    dtype=example.dtype,
                    device=example.device,
                )
            )
        self._real_sizes(leaves, declared)  # the examples must agree with themselves
        return declared

    # ------------------------------------------------------------------ sizes

    def _real_sizes(
        self, leaves: list[Any], declared: list[_Input] | None = None
    ) -> dict[str, int]:
        sizes: dict[str, tuple[int, str]] = {}
        for inp in declared if declared is not None else self.inputs:
            x = leaves[inp.index]
            if not isinstance(x, torch.Tensor) or x.dim() != inp.ndim:
                what = f"a {x.dim()}-d tensor" if isinstance(x, torch.Tensor) else type(x).__name__
                raise InputMismatchError(
                    explain(
                        f"{inp.path} is {what}; the buckets were declared for a {inp.ndim}-d tensor",
                        "bucketed inputs keep their number of dimensions",
                        f"pass a {inp.ndim}-d tensor",
                    )
                )
            for d, size in inp.fixed:
                if x.shape[d] != size:
                    raise InputMismatchError(
                        explain(
                            f"{inp.path} has size {x.shape[d]} in dimension {d} (captured {size}, not bucketed)",
                            "only declared dimensions may vary",
                            "declare this dimension in Buckets(dims=...) or pass the captured size",
                        )
                    )
            if x.dtype != inp.dtype or x.device != inp.device:
                raise InputMismatchError(
                    explain(
                        f"{inp.path} is {x.dtype} on {x.device} (captured {inp.dtype} on {inp.device})",
                        "the copy into the bucket's buffer would cast or cross devices silently",
                        f"pass {inp.dtype} on {inp.device}",
                    )
                )
            for d, symbol in inp.dims:
                n = x.shape[d]
                seen = sizes.get(symbol)
                if seen is not None and seen[0] != n:
                    raise InputMismatchError(
                        explain(
                            f"symbol {symbol!r} is {seen[0]} in {seen[1]} but {n} in {inp.path} dimension {d}",
                            "inputs that share a symbol share one size per call",
                            "pass inputs of agreeing sizes",
                        )
                    )
                sizes[symbol] = (n, f"{inp.path} dimension {d}")
        missing = [s for s in self.symbols if s not in sizes]
        if missing:
            raise ConfigError(
                explain(
                    f"symbol {missing[0]!r} is used by no input",
                    "each symbol's real size is read from the inputs that declare it",
                    "declare it in dims, or remove it from sizes",
                )
            )
        return {s: n for s, (n, _) in sizes.items()}

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

    def _infer_outputs(self) -> None:
        """Find which output dimensions follow which symbol (eager probes on two sizes each)."""
        base_combo = self._combos[0]
        base_leaves = self._bucket_leaves(base_combo)
        base_out = self._eager_shapes(base_leaves)
        _, out_spec = flatten(base_out[0])
        self._out_spec = out_spec
        shapes = base_out[1]
        follows: list[dict[int, str]] = [{} for _ in shapes]
        for k, symbol in enumerate(self.symbols):
            ladder = self.ladders[symbol]
            other = ladder[-2] if len(ladder) > 1 else ladder[-1] - 1
            if other < 1:
                continue
            combo = list(base_combo)
            combo[k] = other
            probe = self._eager_shapes(self._bucket_leaves(tuple(combo)))[1]
            for i, (a, b) in enumerate(zip(shapes, probe)):
                if a is None:
                    continue
                for d, (na, nb) in enumerate(zip(a, b)):
                    if na == nb:
                        continue
                    if na == base_combo[k] and nb == other and d not in follows[i]:
                        follows[i][d] = symbol
                    else:
                        follows[i][d] = "?"
        declared = self.spec.out_dims or {}
        paths = leaf_paths(out_spec, root="out")
        unknown = [p for p in declared if p not in paths]
        if unknown:
            raise ConfigError(
                explain(
                    f"out_dims names {unknown[0]!r}, which is not an output",
                    f"the outputs are {paths}",
                    "use one of those paths",
                )
            )
        result = []
        for i, shape in enumerate(shapes):
            if shape is None:
                continue
            if paths[i] in declared:
                dims = _dims_tuple(
                    declared[paths[i]], len(shape), f"out_dims[{paths[i]!r}]", self.ladders
                )
                result.append((i, tuple((d, s) for d, s in enumerate(dims) if s is not None)))
                continue
            if "?" in follows[i].values():
                d = next(d for d, s in follows[i].items() if s == "?")
                raise ConfigError(
                    explain(
                        f"cannot tell which symbol output {paths[i]} dimension {d} follows "
                        f"(its size changes with the buckets but equals no single symbol's size)",
                        "outputs are sliced back to the real sizes, which needs a symbol per dimension",
                        f"declare it: Buckets(out_dims={{{paths[i]!r}: (...)}}), or return a shape "
                        "whose varying dimensions each follow one symbol",
                    )
                )
            result.append((i, tuple(sorted(follows[i].items()))))
        self._out_dims = result

    def _eager_shapes(self, leaves: list[Any]) -> tuple[Any, list[tuple[int, ...] | None]]:
        args, kwargs = optree.tree_unflatten(self.signature.spec, leaves)
        out = self.fn(*args, **kwargs)
        out_leaves, _ = flatten(out)
        return out, [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in out_leaves]

    def _capture_all(self) -> None:
        combos = self._combos
        if len(combos) == 1:
            self._bucket(combos[0])
            return
        from rich.progress import Progress

        with Progress(transient=True) as progress:
            task = progress.add_task(f"capturing {len(combos)} buckets", total=len(combos))
            for combo in combos:
                self._bucket(combo)
                progress.advance(task)

    def _bucket(self, combo: tuple[int, ...]) -> _Bucket:
        bucket = self._buckets.get(combo)
        if bucket is not None:
            return bucket
        leaves = self._bucket_leaves(combo)
        args, kwargs = optree.tree_unflatten(self.signature.spec, leaves)
        graphed: Graphed[Any] = Graphed(self.fn, self._bucket_options)
        with warnings.catch_warnings():
            if self.stats.capture_s:  # warn about CPU pass-through once, not per bucket
                warnings.simplefilter("ignore")
            graphed._initialize(args, kwargs)
        static, _ = optree.tree_flatten((graphed.inputs, graphed.input_kwargs), namespace=NAMESPACE)
        mutated = {i for i, _ in graphed._writeback}
        bucket = _Bucket(
            combo=combo,
            graphed=graphed,
            buffers=[static[inp.index] for inp in self.inputs],
            clean=[None for _ in self.inputs],
            mutated=[inp.index in mutated for inp in self.inputs],
        )
        self._buckets[combo] = bucket
        stats = graphed.stats
        self.stats.capture_s[combo] = stats.capture_s + stats.warmup_s
        self.stats.pool_bytes[combo] = stats.pool_bytes
        self.stats.hits.setdefault(combo, 0)
        return bucket

    # ------------------------------------------------------------------ calling

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = optree.tree_flatten((args, kwargs), namespace=NAMESPACE)
        if spec != self.signature.spec:
            self.signature.check(args, kwargs)  # raises the structural explanation
        real = self._real_sizes(leaves)
        combo = self._combo_for(real)
        if combo is None:
            return self._overflow(args, kwargs, leaves, real)
        return self._run(combo, leaves, real)

    def _run(self, combo: tuple[int, ...], leaves: list[Any], real: dict[str, int]) -> Any:
        bucket = self._bucket(combo)
        rung = dict(zip(self.symbols, combo))
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        call_leaves = list(leaves)
        stats = self.stats
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
        self, bucket: _Bucket, k: int, inp: _Input, buf: torch.Tensor, sizes: tuple[int, ...]
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
        self.stats.overflows += 1
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
            self.stats.eager_calls += 1
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
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        table = Table(title=f"buckets of {_name(self.fn)}")
        for column in (*self.symbols, "capture s", "pool MiB", "hits"):
            table.add_column(column, justify="right")
        for combo in sorted(self._buckets, reverse=True):
            table.add_row(
                *map(str, combo),
                f"{self.stats.capture_s[combo]:.3f}",
                f"{self.stats.pool_bytes[combo] / 2**20:.1f}",
                str(self.stats.hits[combo]),
            )
        console.print(table)
        console.print(
            f"pool total {self.stats.pool_total_bytes / 2**20:.1f} MiB; padding waste "
            f"{self.stats.padding_waste:.1%}; overflows {self.stats.overflows}"
        )


class ExactShapes:
    """``buckets="exact"``: one graph per exact input shape seen, least recently used evicted.

    For workloads with a few recurring shapes that are not worth a ladder. Each graph has its own
    pool so that evicting it releases its memory. Warns when shapes keep changing (evictions).
    """

    def __init__(self, fn: Callable[..., Any], options: Options, max_graphs: int = 8):
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ConfigError(
                explain(
                    f"max_graphs must be an int >= 1, got {max_graphs!r}",
                    "it bounds how many shapes keep a captured graph",
                    "pass max_graphs=8 (the default)",
                )
            )
        self.fn = fn
        self.options = options
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple[Any, ...], Graphed[Any]] = OrderedDict()
        self.evictions = 0
        self._warned = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = optree.tree_flatten((args, kwargs), namespace=NAMESPACE)
        key = (spec, *(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves))
        graphed = self._graphs.get(key)
        if graphed is None:
            graphed = Graphed(self.fn, self.options)
            graphed._initialize(args, kwargs)
            self._graphs[key] = graphed
            if len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)  # frees its graph and pool
                self.evictions += 1
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                if not self._warned and self.evictions >= self.max_graphs:
                    warnings.warn(
                        f"cudagraphs: shapes keep changing ({self.evictions} graphs evicted, "
                        f"max_graphs={self.max_graphs}); each new shape costs a capture. Declare "
                        "a ladder with buckets=cg.Buckets(...) or raise max_graphs.",
                        stacklevel=2,
                    )
                    self._warned = True
        else:
            self._graphs.move_to_end(key)
        return graphed(*args, **kwargs)

    @property
    def graphs(self) -> int:
        return len(self._graphs)


def make_bucketed(
    fn: Callable[..., Any],
    options: Options,
    buckets: Any,
    max_graphs: int,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any],
) -> Any:
    """Build the bucketed callable for ``cg.graph(..., buckets=...)`` (examples given)."""
    if buckets == "exact":
        return ExactShapes(fn, options, max_graphs)
    if isinstance(buckets, Mapping):
        buckets = Buckets(sizes=buckets)
    if not isinstance(buckets, Buckets):
        raise ConfigError(
            explain(
                f"buckets must be a cg.Buckets, a {{symbol: sizes}} dict or 'exact'; got {buckets!r}",
                "buckets declare which input dimensions vary and over which sizes",
                "pass buckets=cg.Buckets({'B': cg.powers_of_two(128)})",
            )
        )
    return Bucketed(fn, options, buckets, example_args, example_kwargs)


class LazyBucketed:
    """``@cg.graph(buckets=...)`` without examples: built from the first call's arguments."""

    def __init__(self, fn: Callable[..., Any], options: Options, buckets: Any, max_graphs: int):
        self.fn = fn
        self._make = lambda args, kwargs: make_bucketed(
            fn, options, buckets, max_graphs, args, kwargs
        )
        self._inner: Any = None
        if buckets == "exact":
            self._inner = ExactShapes(fn, options, max_graphs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._inner is None:
            self._inner = self._make(args, kwargs)
        return self._inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(f"{name!r}: not built yet (builds on the first call)")
        return getattr(inner, name)

"""What a bucketed graph is declared with, and how a call's sizes are read and checked.

:class:`Buckets` is the user's declaration; this module resolves it against the example call
(which tensor dimensions follow which size symbol, with which pad value) and reads each call's
real sizes, refusing inputs that disagree. Which output dimensions follow a symbol is found in
``output_dims.py``; the counts a bucketed graph keeps are in ``bucket_stats.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from ..core import Signature
from ..errors import ConfigError, InputMismatchError, explain
from ..options import checked_keywords

__all__ = [
    "BUCKET_OPTIONS",
    "BucketedInput",
    "Buckets",
    "declare_inputs",
    "dims_tuple",
    "real_sizes",
]


Overflow = Literal["raise", "eager", "chunk"]


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
        overflow: above the largest rung: ``"raise"`` (:class:`~cudagraphs.errors.BucketOverflowError`),
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


# A misspelt keyword (overflw=) is a ConfigError with "did you mean", not dataclass's TypeError.
Buckets.__init__ = checked_keywords("cg.Buckets")(Buckets.__init__)  # type: ignore[method-assign]
#: The options of cg.Buckets(...), which cg.graph refuses with a pointer to where they go.
BUCKET_OPTIONS: tuple[str, ...] = tuple(f.name for f in fields(Buckets) if f.name != "sizes")


def dims_tuple(
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


@dataclass
class BucketedInput:
    """A tensor input with bucketed dimensions."""

    index: int  # leaf index in the call's flattened (args, kwargs)
    path: str
    dims: tuple[tuple[int, str], ...]  # (dimension, symbol) pairs
    fixed: tuple[tuple[int, int], ...]  # (dimension, size) pairs that must match the example
    pad: float
    ndim: int
    dtype: torch.dtype
    device: torch.device


def declare_inputs(
    signature: Signature, leaves: list[Any], spec: Buckets, ladders: dict[str, tuple[int, ...]]
) -> list[BucketedInput]:
    """Resolve ``spec.dims`` and ``spec.pad`` against the example call's tensor inputs."""
    symbols = list(ladders)
    tensor_paths = {signature.paths[i]: i for i in signature.tensor_index}
    dims_spec = spec.dims
    if dims_spec is None:
        if len(symbols) != 1:
            raise ConfigError(
                explain(
                    f"several symbols ({', '.join(symbols)}) but no dims declaration",
                    "with more than one symbol cudagraphs cannot guess which dimension follows which",
                    "pass dims={'args[0]': ('B', 'T'), ...}",
                )
            )
        dims_spec = {path: {0: symbols[0]} for path in tensor_paths}
    unknown = [p for p in dims_spec if p not in tensor_paths]
    if unknown:
        raise ConfigError(
            explain(
                f"dims names {unknown[0]!r}, which is not a tensor input",
                f"the tensor inputs of this call are {sorted(tensor_paths)}",
                "use one of those paths",
            )
        )
    pads = spec.pad
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
        dims = dims_tuple(spec, example.dim(), f"dims[{path!r}]", ladders)
        pad = pads.get(path, 0) if isinstance(pads, Mapping) else pads
        declared.append(
            BucketedInput(
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
    real_sizes(leaves, declared, symbols)  # the examples must agree with themselves
    return declared


def real_sizes(
    leaves: list[Any], inputs: list[BucketedInput], symbols: list[str]
) -> dict[str, int]:
    """Each symbol's real size in this call, or the error that names the input at fault."""
    sizes: dict[str, tuple[int, str]] = {}
    for inp in inputs:
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
    missing = [s for s in symbols if s not in sizes]
    if missing:
        raise ConfigError(
            explain(
                f"symbol {missing[0]!r} is used by no input",
                "each symbol's real size is read from the inputs that declare it",
                "declare it in dims, or remove it from sizes",
            )
        )
    return {s: n for s, (n, _) in sizes.items()}

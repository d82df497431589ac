"""Which output dimensions of a bucketed function follow which size symbol, found by running it
at two sizes of each symbol (declared ``Buckets.out_dims`` win): the outputs are sliced back
to the call's real sizes along those dimensions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

from ..core import flatten, leaf_paths
from ..errors import ConfigError, explain
from .spec import Buckets, dims_tuple

__all__ = ["infer_output_dims"]


def infer_output_dims(
    shapes_at: Callable[[tuple[int, ...]], tuple[Any, list[tuple[int, ...] | None]]],
    base_combo: tuple[int, ...],
    spec: Buckets,
    ladders: dict[str, tuple[int, ...]],
) -> tuple[optree.PyTreeSpec, list[tuple[int, tuple[tuple[int, str], ...]]]]:
    """Find which output dimensions follow which symbol.

    ``shapes_at(combo)`` runs the function eagerly on inputs resized to ``combo`` and returns
    its output and output shapes. The largest combination is compared with, per symbol, the
    same combination at another size of that symbol: a dimension follows the symbol when its
    size equals the symbol's in both runs and changes with no other symbol. Declared
    ``spec.out_dims`` win.
    """
    symbols = list(ladders)
    base_out = shapes_at(base_combo)
    _, out_spec = flatten(base_out[0])
    shapes = base_out[1]
    follows: list[dict[int, str]] = [{} for _ in shapes]
    for k, symbol in enumerate(symbols):
        ladder = ladders[symbol]
        other = ladder[-2] if len(ladder) > 1 else ladder[-1] - 1
        if other < 1:
            continue
        combo = list(base_combo)
        combo[k] = other
        probe = shapes_at(tuple(combo))[1]
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
    declared = spec.out_dims or {}
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
            dims = dims_tuple(declared[paths[i]], len(shape), f"out_dims[{paths[i]!r}]", ladders)
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
    return out_spec, result

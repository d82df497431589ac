"""Choosing a graph: from a call's real sizes to the bucket that serves it. Nothing is captured
or replayed here (as vLLM keeps its dispatcher apart from its graph wrapper)."""

from __future__ import annotations

import itertools
import math

from ..errors import ConfigError, explain
from .ladders import lookup_table, validate_ladder
from .spec import Buckets

__all__ = ["Dispatcher"]


class Dispatcher:
    """The ladders of a :class:`Buckets` declaration and an O(1) choice of rungs.

    ``combos`` lists every bucket, largest first (the capture order: the pool grows once and
    smaller graphs reuse it); ``choose(real)`` gives the smallest rung at or above each real
    size, or ``None`` above the largest.
    """

    def __init__(self, buckets: Buckets):
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
        # tables[s][n] is the smallest rung >= n
        self.tables = {s: lookup_table(self.ladders[s]) for s in self.symbols}
        self.combos = sorted(
            itertools.product(*(self.ladders[s] for s in self.symbols)),
            key=math.prod,
            reverse=True,
        )
        self.largest = {s: self.ladders[s][-1] for s in self.symbols}

    def choose(self, real: dict[str, int]) -> tuple[int, ...] | None:
        """The bucket for these real sizes, or ``None`` when one is above its ladder."""
        combo = []
        for s in self.symbols:
            table = self.tables[s]
            n = real[s]
            if n >= len(table):
                return None
            combo.append(table[n])
        return tuple(combo)

    def above(self, real: dict[str, int]) -> list[str]:
        """The symbols whose real size is above their largest rung."""
        return [s for s in self.symbols if real[s] > self.largest[s]]

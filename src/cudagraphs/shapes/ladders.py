"""Ladders of sizes for shape buckets, and the O(1) table that picks a rung."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import ConfigError, explain

__all__ = ["lookup_table", "powers_of_two", "server_sizes", "validate_ladder"]


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


def validate_ladder(symbol: str, sizes: Sequence[int]) -> tuple[int, ...]:
    """The rungs of one symbol's ladder, sorted, or :class:`ConfigError` naming the symbol.

    Right: ``{"B": cg.powers_of_two(8)}`` or ``{"B": [1, 2, 4, 8]}``. Wrong: ``{"B": 8}``
    (one number is not a ladder: which smaller sizes should get a graph?)."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise ConfigError(
            explain(
                f"buckets[{symbol!r}] must be a ladder (a list of sizes), "
                f"got {type(sizes).__name__} {sizes!r}",
                "a ladder is the sizes a graph is captured for; a call of any size up to the "
                "largest runs the graph of the next size up, padded",
                _ladder_fix(sizes),
            )
        )
    rungs = list(sizes)
    if not rungs or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in rungs):
        raise ConfigError(
            explain(
                f"sizes[{symbol!r}] must be a non-empty list of positive ints, got {list(sizes)!r}",
                "each rung is a size a graph is captured for",
                "pass e.g. cg.powers_of_two(128) or [1, 8, 32, 128]",
            )
        )
    return tuple(sorted(set(rungs)))


def _ladder_fix(given: Any) -> str:
    if isinstance(given, int) and not isinstance(given, bool) and given >= 1:
        rungs = ", ".join(map(str, powers_of_two(given)))
        return f"pass cg.powers_of_two({given}) (the sizes {rungs}) or a list of your own"
    return "pass cg.powers_of_two(128) or a list of positive sizes, e.g. [1, 8, 32, 128]"


def lookup_table(ladder: tuple[int, ...]) -> list[int]:
    """``table[n]`` is the smallest rung >= n, for every n up to the largest rung: O(1) choice."""
    table = [ladder[0]] * (ladder[-1] + 1)
    rung = 0
    for n in range(1, ladder[-1] + 1):
        while ladder[rung] < n:
            rung += 1
        table[n] = ladder[rung]
    return table

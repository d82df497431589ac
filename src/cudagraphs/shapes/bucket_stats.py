"""What a bucketed graph counts: per-bucket hits, capture seconds and pool memory, padding
waste and overflows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BucketStats"]


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
    #: growth of torch.cuda.memory_reserved() while all buckets were captured (what a user sees)
    reserved_bytes: int = 0

    @property
    def padding_waste(self) -> float:
        """Padded elements over real elements, across all calls (0.0: no padding)."""
        return self.padded_elements / self.real_elements if self.real_elements else 0.0

    @property
    def pool_total_bytes(self) -> int:
        return sum(self.pool_bytes.values())

    def print(self, symbols: Sequence[str], title: str, console: Any = None) -> None:
        """A rich table: per bucket, capture seconds, pool MiB and hits; then the totals."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        table = Table(title=title)
        for column in (*symbols, "capture s", "pool MiB", "hits"):
            table.add_column(column, justify="right", overflow="fold")
        for combo in sorted(self.capture_s, reverse=True):
            table.add_row(
                *map(str, combo),
                f"{self.capture_s[combo]:.3f}",
                f"{self.pool_bytes[combo] / 2**20:.1f}",
                str(self.hits.get(combo, 0)),
            )
        console.print(table)
        console.print(
            f"pool total {self.pool_total_bytes / 2**20:.1f} MiB; memory reserved by the "
            f"buckets {self.reserved_bytes / 2**20:.1f} MiB; padding waste "
            f"{self.padding_waste:.1%}; overflows {self.overflows}"
        )

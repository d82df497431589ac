"""What ``cg.bench`` measured, as data: a rich table, markdown, JSON and a PNG chart."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from ..errors import ConfigError, explain, install_extra
from .profiling import Profile

__all__ = ["BenchReport", "ModeResult", "Spread"]


@dataclass(frozen=True)
class Spread:
    """Median and the 10th/90th percentiles of a set of samples, in µs."""

    p10: float
    median: float
    p90: float

    @classmethod
    def of(cls, samples: list[float]) -> Spread:
        ordered = sorted(samples)
        if not ordered:
            return cls(math.nan, math.nan, math.nan)

        def at(q: float) -> float:
            return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

        return cls(at(0.1), at(0.5), at(0.9))

    def __str__(self) -> str:
        return f"{self.median:.1f} ({self.p10:.1f}-{self.p90:.1f})"


@dataclass
class ModeResult:
    """One way of running the function, measured side by side with the others."""

    mode: str
    error: str | None = None  # why this mode could not be built or run
    max_abs_error: float | None = None  # against eager on the same fresh inputs
    latency: Spread | None = None  # CUDA events around each call, µs
    wall: Spread | None = None  # synchronized wall time per call, µs
    cpu_us: float | None = None  # time for the call to return (issuing the work), µs
    throughput_us: float | None = None  # per call, one synchronize per window
    setup_s: float | None = None  # warm-up + compile + capture
    extra_memory_bytes: int | None = None
    break_even_calls: float | None = None  # setup cost over per-call saving; inf: never

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class BenchReport:
    """Returned by :func:`cudagraphs.bench`; print it, or write it with :meth:`to_json` and
    :meth:`plot`."""

    name: str
    device: str
    torch_version: str
    input_sets: int
    results: list[ModeResult]
    profile: Profile | None = None
    notes: list[str] = field(default_factory=list)

    def __getitem__(self, mode: str) -> ModeResult:
        for result in self.results:
            if result.mode == mode:
                return result
        raise KeyError(f"no mode {mode!r} in this report; modes: {[r.mode for r in self.results]}")

    @property
    def kernel_floor_us(self) -> float | None:
        return self.profile.gpu_busy_us if self.profile is not None else None

    def speedup(self, mode: str, base: str = "eager") -> float | None:
        """Median wall time of ``base`` over that of ``mode`` (higher is faster)."""
        a, b = self[mode], self[base]
        if a.wall is None or b.wall is None:
            return None
        return b.wall.median / a.wall.median

    # ------------------------------------------------------------------ output

    HEADER = (
        "mode",
        "wall µs [p10-p90]",
        "GPU µs",
        "CPU µs",
        "thr. µs",
        "vs eager",
        "setup s",
        "+MiB",
        "break-even",
        "max |err|",
    )
    LEGEND = (
        "wall: synchronized wall time per call, median [p10-p90]; GPU: CUDA events around each "
        "call; CPU: time to issue a call; thr.: per call with one synchronize per window; "
        "vs eager: median wall-time speed-up; setup: warm-up + compile + capture; +MiB: extra "
        "GPU memory reserved; break-even: calls until the set-up is paid back"
    )

    def rows(self) -> list[list[str]]:
        rows = []
        for r in self.results:
            if not r.ok:
                word = "skipped" if r.error == "needs CUDA" else "failed"
                rows.append([r.mode, f"{word}: {r.error}"] + ["-"] * (len(self.HEADER) - 2))
                continue
            speedup = self.speedup(r.mode)
            rows.append(
                [
                    r.mode,
                    f"{r.wall.median:.1f} [{r.wall.p10:.0f}-{r.wall.p90:.0f}]" if r.wall else "-",
                    f"{r.latency.median:.1f}" if r.latency else "-",
                    _num(r.cpu_us),
                    _num(r.throughput_us),
                    f"{speedup:.2f}×" if speedup else "-",
                    _num(r.setup_s, "{:.2f}"),
                    _num(None if r.extra_memory_bytes is None else r.extra_memory_bytes / 2**20),
                    _break_even(r.break_even_calls),
                    _num(r.max_abs_error, "{:.1e}"),
                ]
            )
        return rows

    def caption(self) -> str:
        parts = [f"{self.input_sets} rotating input sets; medians over interleaved windows"]
        if self.kernel_floor_us is not None and self.profile and self.profile.kernels_per_call:
            parts.append(
                f"kernel floor {self.kernel_floor_us:.1f} µs/call "
                f"({self.profile.kernels_per_call:.0f} kernels)"
            )
        return "; ".join(parts + self.notes)

    def __rich__(self) -> Table:
        rows = self.rows()
        # Columns with nothing measured (GPU figures on a CPU machine) are left out of the view.
        keep = [i for i in range(len(self.HEADER)) if i < 2 or any(row[i] != "-" for row in rows)]
        table = Table(title=f"cg.bench: {self.name} on {self.device}", caption=self.caption())
        for i in keep:
            table.add_column(self.HEADER[i], justify="left" if i == 0 else "right", overflow="fold")
        for row in rows:
            table.add_row(*(row[i] for i in keep))
        return table

    def markdown(self, *, legend: bool = True) -> str:
        lines = [
            f"**{self.name}** on {self.device} (torch {self.torch_version}): {self.caption()}",
            "",
            "| " + " | ".join(map(_cell, self.HEADER)) + " |",
            "|" + "---|" * len(self.HEADER),
        ]
        lines += ["| " + " | ".join(map(_cell, row)) + " |" for row in self.rows()]
        if legend:
            lines += ["", self.LEGEND + "."]
        if self.profile is not None:
            lines += ["", f"Profile: {self.profile.recommendation}"]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["profile"] = self.profile.as_dict() if self.profile else None
        data["kernel_floor_us"] = self.kernel_floor_us
        return _finite(data)

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path

    def plot(self, path: str | Path) -> Path:
        """A bar chart of median wall time per mode (p10-p90 whiskers), with the kernel floor."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as error:
            raise ConfigError(
                explain(
                    "writing a plot needs matplotlib, which is not installed",
                    "BenchReport.plot draws the chart with matplotlib",
                    f"{install_extra('plot')} (or pip install matplotlib)",
                )
            ) from error
        ok = [r for r in self.results if r.ok and r.wall is not None]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(ok) + 2), 4))
        medians = [r.wall.median for r in ok]  # type: ignore[union-attr]
        low = [r.wall.median - r.wall.p10 for r in ok]  # type: ignore[union-attr]
        high = [r.wall.p90 - r.wall.median for r in ok]  # type: ignore[union-attr]
        ax.bar([r.mode for r in ok], medians, yerr=[low, high], capsize=4, color="#4c72b0")
        if self.kernel_floor_us:
            ax.axhline(self.kernel_floor_us, color="#c44e52", linestyle="--", label="kernel floor")
            ax.legend()
        ax.set_ylabel("wall time per call, µs (synchronized)")
        ax.set_title(f"{self.name} on {self.device}", fontsize=10)
        ax.tick_params(axis="x", labelrotation=20)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _cell(text: str) -> str:
    """A markdown table cell: a literal ``|`` (as in ``max |err|``) must not split the column."""
    return text.replace("|", "\\|")


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _break_even(calls: float | None) -> str:
    if calls is None:
        return "-"
    if math.isinf(calls):
        return "never"
    return f"{calls:,.0f}"


def _finite(value: Any) -> Any:
    """JSON has no inf/nan: write them as strings a reader can still recognise."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value

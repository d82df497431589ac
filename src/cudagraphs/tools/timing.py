"""Honest timing of a callable on the GPU: two figures, medians over repeated windows.

- **latency**: every call is followed by ``torch.cuda.synchronize()``: what one request waits,
  CPU launch overhead included.
- **throughput**: ``calls`` calls, then one synchronize: CPU work overlaps the GPU, as in a loop
  that never looks at its results.

Both are wall-clock microseconds per call (``time.perf_counter``), the median over ``windows``
windows after a warm-up window. Inputs rotate over several tensors so no cache flatters a mode.
Timing is a measurement, never a pass/fail test.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Timing", "measure", "measure_side_by_side", "sync"]


@dataclass(frozen=True)
class Timing:
    latency_us: float
    throughput_us: float


def sync() -> None:
    """Wait for the GPU, if there is one: every timer here reads the clock after this."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(
    call: Callable[[Any], Any],
    inputs: Sequence[Any],
    *,
    calls: int = 200,
    windows: int = 7,
) -> Timing:
    """Time ``call(inputs[i % len(inputs)])`` in both regimes; see the module docstring."""
    return measure_side_by_side({"only": call}, inputs, calls=calls, windows=windows)["only"]


def measure_side_by_side(
    modes: dict[str, Callable[[Any], Any]],
    inputs: Sequence[Any],
    *,
    calls: int = 200,
    windows: int = 7,
) -> dict[str, Timing]:
    """Time several ways of doing the same work, interleaved window by window.

    Interleaving means a clock or thermal drift during the run affects every mode alike, so the
    ratios between modes are trustworthy even when absolute times move between runs.
    """
    n = len(inputs)

    def latency(call: Callable[[Any], Any]) -> float:
        start = time.perf_counter()
        for i in range(calls):
            call(inputs[i % n])
            sync()
        return (time.perf_counter() - start) / calls

    def throughput(call: Callable[[Any], Any]) -> float:
        sync()
        start = time.perf_counter()
        for i in range(calls):
            call(inputs[i % n])
        sync()
        return (time.perf_counter() - start) / calls

    for call in modes.values():  # warm-up window
        throughput(call)
    lat: dict[str, list[float]] = {name: [] for name in modes}
    thr: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(windows):
        for name, call in modes.items():
            lat[name].append(latency(call))
            thr[name].append(throughput(call))
    return {
        name: Timing(
            latency_us=statistics.median(lat[name]) * 1e6,
            throughput_us=statistics.median(thr[name]) * 1e6,
        )
        for name in modes
    }

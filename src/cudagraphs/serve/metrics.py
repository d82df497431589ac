"""What a batcher measures about itself: as data (:class:`BatcherMetrics`) and as Prometheus text.

Counted per request and per batch by the worker under one lock: queue depth, requests served
and failed (by kind), batches, batch fill (rows per batch against the largest batch), padding
waste (rows of the chosen rung that no request filled, where the rungs are known), latency from
submission to answer (p50/p90/p99 over the most recent requests), requests per second since
the first request, and the batcher's own time per request (gathering, concatenating, splitting
and copying out: everything but the function's call).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

__all__ = ["BatcherMetrics", "MetricsRecorder", "prometheus"]

_WINDOW = 10_000  # latencies kept for the percentiles


@dataclass(frozen=True)
class BatcherMetrics:
    """A snapshot of a batcher's counters; see the module doc."""

    queue_depth: int
    requests: int
    rows: int
    batches: int
    errors: dict[str, int] = field(default_factory=dict)
    batch_fill: float = 0.0  # mean rows per batch / largest batch
    padding_waste: float = 0.0  # padded rows / rung rows, over all batches (0 without rungs)
    latency_p50_s: float = 0.0
    latency_p90_s: float = 0.0
    latency_p99_s: float = 0.0
    requests_per_s: float = 0.0
    overhead_per_request_s: float = 0.0  # the batcher's own work, the function's call excluded


class MetricsRecorder:
    """The worker's counters; thread-safe; :meth:`snapshot` and :meth:`prometheus` read them."""

    def __init__(self, max_rows: int, rungs: list[int] | None):
        self.max_rows = max_rows
        self.rungs = rungs
        self._lock = threading.Lock()
        self._latencies: deque[float] = deque(maxlen=_WINDOW)
        self._errors: Counter[str] = Counter()
        self._requests = self._rows = self._batches = self._rung_rows = 0
        self._overhead_s = 0.0
        self._first: float | None = None
        self._last = 0.0

    def error(self, kind: str) -> None:
        with self._lock:
            self._errors[kind] += 1

    def batch(self, rows: list[int], overhead_s: float) -> None:
        total = sum(rows)
        rung = next((r for r in self.rungs or () if r >= total), total)
        with self._lock:
            self._batches += 1
            self._rows += total
            self._rung_rows += rung
            self._overhead_s += overhead_s

    def answered(self, submitted: float) -> None:
        now = time.perf_counter()
        with self._lock:
            self._requests += 1
            self._latencies.append(now - submitted)
            self._first = submitted if self._first is None else min(self._first, submitted)
            self._last = now

    def snapshot(self, queue_depth: int) -> BatcherMetrics:
        with self._lock:
            ordered = sorted(self._latencies)

            def pick(q: float) -> float:
                return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

            elapsed = self._last - self._first if self._first is not None else 0.0
            return BatcherMetrics(
                queue_depth=queue_depth,
                requests=self._requests,
                rows=self._rows,
                batches=self._batches,
                errors=dict(self._errors),
                batch_fill=self._rows / (self._batches * self.max_rows) if self._batches else 0.0,
                padding_waste=1 - self._rows / self._rung_rows if self._rung_rows else 0.0,
                latency_p50_s=pick(0.5),
                latency_p90_s=pick(0.9),
                latency_p99_s=pick(0.99),
                requests_per_s=self._requests / elapsed if elapsed > 0 else 0.0,
                overhead_per_request_s=self._overhead_s / self._requests if self._requests else 0.0,
            )


def prometheus(metrics: BatcherMetrics, name: str) -> str:
    """The snapshot in Prometheus' text exposition format (version 0.0.4)."""
    label = f'batcher="{_escape(name)}"'
    lines = []

    def metric(key: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP cudagraphs_batcher_{key} {help_text}")
        lines.append(f"# TYPE cudagraphs_batcher_{key} {kind}")
        for labels, value in samples:
            lines.append(f"cudagraphs_batcher_{key}{{{label}{labels}}} {value:.9g}")

    metric("queue_depth", "gauge", "Requests waiting.", [("", metrics.queue_depth)])
    metric("requests_total", "counter", "Requests answered.", [("", metrics.requests)])
    metric("rows_total", "counter", "Rows run.", [("", metrics.rows)])
    metric("batches_total", "counter", "Batches run.", [("", metrics.batches)])
    errors = [(f',kind="{_escape(k)}"', v) for k, v in sorted(metrics.errors.items())]
    metric("errors_total", "counter", "Requests failed, by error.", errors)
    metric(
        "batch_fill_ratio",
        "gauge",
        "Mean rows per batch over the largest batch.",
        [("", metrics.batch_fill)],
    )
    metric(
        "padding_waste_ratio", "gauge", "Padded rows over rung rows.", [("", metrics.padding_waste)]
    )
    quantiles = [
        (',quantile="0.5"', metrics.latency_p50_s),
        (',quantile="0.9"', metrics.latency_p90_s),
        (',quantile="0.99"', metrics.latency_p99_s),
    ]
    metric("latency_seconds", "summary", "Submission to answer.", quantiles)
    metric(
        "requests_per_second",
        "gauge",
        "Answered per second since the first.",
        [("", metrics.requests_per_s)],
    )
    metric(
        "overhead_seconds_per_request",
        "gauge",
        "The batcher's own work per request, the function's call excluded.",
        [("", metrics.overhead_per_request_s)],
    )
    return "\n".join(lines) + "\n"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

"""What an LLM engine measures about itself: as data (:class:`EngineMetrics`) and as
Prometheus text (:func:`engine_prometheus`).

The worker records every step (rows in it, its rung) and every token's arrival; readers take a
snapshot under one lock. Latencies are over the most recent requests and tokens: time to first
token (submission to the first token's arrival, queueing and prefill included) and inter-token
latency (between two tokens of one request), each at p50 and p99. Tokens per second count the
generated tokens since the first request was submitted.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

__all__ = ["EngineMetrics", "EngineRecorder", "engine_prometheus"]

_WINDOW = 10_000  # latencies kept for the percentiles


@dataclass(frozen=True)
class EngineMetrics:
    """A snapshot of an engine's counters; see the module doc."""

    queue_depth: int
    running: int  # requests holding a slot (decoding, or their prompt going in)
    slots: int
    requests: int  # requests ended, whatever the reason
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    errors: dict[str, int] = field(default_factory=dict)  # refusals and failures, by error
    steps: int = 0
    generated_tokens: int = 0
    tokens_per_s: float = 0.0
    occupancy: float = 0.0  # mean live rows per step / slots
    padding_waste: float = 0.0  # rung rows no live request filled / rung rows, over all steps
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    itl_p50_s: float = 0.0
    itl_p99_s: float = 0.0


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class EngineRecorder:
    """The worker's counters; thread-safe."""

    def __init__(self, slots: int):
        self.slots = slots
        self._lock = threading.Lock()
        self._ttft: deque[float] = deque(maxlen=_WINDOW)
        self._itl: deque[float] = deque(maxlen=_WINDOW)
        self._finished: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._steps = self._live_rows = self._rung_rows = self._tokens = 0
        self._first: float | None = None

    def submitted(self, when: float) -> None:
        with self._lock:
            if self._first is None:
                self._first = when

    def error(self, kind: str) -> None:
        with self._lock:
            self._errors[kind] += 1

    def step(self, live: int, rung: int) -> None:
        with self._lock:
            self._steps += 1
            self._live_rows += live
            self._rung_rows += rung

    def tokens(self, submitted: float, times: list[float], new: int) -> None:
        """``new`` tokens of one request arrived; ``times``: all its arrival times so far."""
        with self._lock:
            self._tokens += new
            start = len(times) - new
            for k in range(start, len(times)):
                if k == 0:
                    self._ttft.append(times[0] - submitted)
                else:
                    self._itl.append(times[k] - times[k - 1])

    def ended(self, reason: str) -> None:
        with self._lock:
            self._finished[reason] += 1

    def snapshot(self, queue_depth: int, running: int) -> EngineMetrics:
        with self._lock:
            ttft, itl = sorted(self._ttft), sorted(self._itl)
            elapsed = time.perf_counter() - self._first if self._first is not None else 0.0
            steps = self._steps
            return EngineMetrics(
                queue_depth=queue_depth,
                running=running,
                slots=self.slots,
                requests=sum(self._finished.values()),
                finished=dict(self._finished),
                errors=dict(self._errors),
                steps=steps,
                generated_tokens=self._tokens,
                tokens_per_s=self._tokens / elapsed if elapsed > 0 else 0.0,
                occupancy=self._live_rows / (steps * self.slots) if steps else 0.0,
                padding_waste=1 - self._live_rows / self._rung_rows if self._rung_rows else 0.0,
                ttft_p50_s=_percentile(ttft, 0.5),
                ttft_p99_s=_percentile(ttft, 0.99),
                itl_p50_s=_percentile(itl, 0.5),
                itl_p99_s=_percentile(itl, 0.99),
            )


def engine_prometheus(metrics: EngineMetrics, name: str) -> str:
    """The snapshot in Prometheus' text exposition format (version 0.0.4)."""
    label = f'engine="{_escape(name)}"'
    lines: list[str] = []

    def metric(key: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP cudagraphs_engine_{key} {help_text}")
        lines.append(f"# TYPE cudagraphs_engine_{key} {kind}")
        for labels, value in samples:
            lines.append(f"cudagraphs_engine_{key}{{{label}{labels}}} {value:.9g}")

    m = metrics
    metric("queue_depth", "gauge", "Requests waiting for a slot.", [("", m.queue_depth)])
    metric("running", "gauge", "Requests holding a slot.", [("", m.running)])
    metric("slots", "gauge", "Rows of the cache.", [("", m.slots)])
    finished = [(f',reason="{_escape(k)}"', v) for k, v in sorted(m.finished.items())]
    metric("requests_total", "counter", "Requests ended, by finish reason.", finished)
    errors = [(f',kind="{_escape(k)}"', v) for k, v in sorted(m.errors.items())]
    metric("errors_total", "counter", "Requests refused or failed, by error.", errors)
    metric("steps_total", "counter", "Decode steps run.", [("", m.steps)])
    metric("generated_tokens_total", "counter", "Tokens generated.", [("", m.generated_tokens)])
    metric("tokens_per_second", "gauge", "Generated since the first request.", [("", m.tokens_per_s)])  # fmt: skip
    metric("occupancy_ratio", "gauge", "Mean live rows per step over slots.", [("", m.occupancy)])
    metric("padding_waste_ratio", "gauge", "Rung rows with no live request.", [("", m.padding_waste)])  # fmt: skip
    quantiles = [(',quantile="0.5"', m.ttft_p50_s), (',quantile="0.99"', m.ttft_p99_s)]
    metric("time_to_first_token_seconds", "summary", "Submission to first token.", quantiles)
    quantiles = [(',quantile="0.5"', m.itl_p50_s), (',quantile="0.99"', m.itl_p99_s)]
    metric("inter_token_latency_seconds", "summary", "Between two tokens of a request.", quantiles)
    return "\n".join(lines) + "\n"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

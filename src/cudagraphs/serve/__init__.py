"""Serving: :class:`Batcher` micro-batches concurrent requests into single calls of a
(bucketed) graph, with back-pressure, deadlines, cancellation, graceful shutdown and metrics."""

from .batcher import Batcher
from .metrics import BatcherMetrics, prometheus

__all__ = ["Batcher", "BatcherMetrics", "prometheus"]

"""Serving: :class:`Batcher` micro-batches concurrent requests into single calls of a
(bucketed) graph, with back-pressure, deadlines, cancellation, graceful shutdown and metrics;
:func:`completions_app` puts an OpenAI-style HTTP front (FastAPI, the ``serve`` extra, imported
when called) on an LLM engine (``cudagraphs.decoding.Engine``)."""

from .batcher import Batcher
from .completions_http import completions_app
from .metrics import BatcherMetrics, prometheus

__all__ = ["Batcher", "BatcherMetrics", "completions_app", "prometheus"]

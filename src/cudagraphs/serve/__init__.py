"""Serving: :class:`~cudagraphs.serve.batcher.Batcher` micro-batches concurrent requests into
single calls of a (bucketed) graph, with back-pressure, deadlines, cancellation, graceful
shutdown and metrics."""

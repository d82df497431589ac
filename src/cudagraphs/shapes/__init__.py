"""Many input sizes: bucket declarations and ladders, choosing a graph, bucketed and exact."""

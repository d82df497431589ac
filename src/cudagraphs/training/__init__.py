"""Training: whole-step capture, graph-safe optimizers, graphed autograd."""

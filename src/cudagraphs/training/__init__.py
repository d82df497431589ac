"""Training: whole-step capture, graph-safe optimizers, graphed autograd."""

from .autograd import GraphedAutograd
from .autograd_chain import graph_autograd, graph_autograd_chain
from .distributed import capture_stream, ddp
from .graphed_module import GraphedModule
from .optimizers import make_graph_safe
from .schedules import GraphSafeAdamW, GraphSafeSGD
from .step import TrainStep, train_step

__all__ = [
    "GraphSafeAdamW",
    "GraphSafeSGD",
    "GraphedAutograd",
    "GraphedModule",
    "TrainStep",
    "capture_stream",
    "ddp",
    "graph_autograd",
    "graph_autograd_chain",
    "make_graph_safe",
    "train_step",
]

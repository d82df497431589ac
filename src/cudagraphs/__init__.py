"""cudagraphs: CUDA graphs in PyTorch, safe, fast and easy.

::

    import cudagraphs as cg

    g = cg.graph(model, x)     # warm-up on a side stream, then capture, on these examples
    y = g(x_new)               # signature check, copy-in, one graph launch, outputs

See :func:`graph` for the options, and the README for when graphs help and when they do not.
"""

from __future__ import annotations

from .api import graph
from .autograd import GraphedAutograd, graph_autograd, graph_autograd_chain
from .bench import bench
from .bench_report import BenchReport, ModeResult
from .bucket_spec import BucketOverflowError, Buckets, BucketStats
from .buckets import Bucketed
from .doctor import Finding, Report, doctor
from .errors import (
    CaptureError,
    ConfigError,
    CudaGraphsError,
    CudaGraphsWarning,
    InputMismatchError,
    StaleGraphError,
    StaleOutputError,
    VerificationError,
)
from .exact import ExactShapes
from .graphed import Graphed, State
from .ladders import powers_of_two, server_sizes
from .optim import make_graph_safe
from .outputs import OutputPolicy
from .pool import Pool
from .profile import Profile, profile
from .stats import Stats
from .train import TrainStep, train_step

__version__ = "0.1.0"

__all__ = [
    "BenchReport",
    "BucketOverflowError",
    "BucketStats",
    "Bucketed",
    "Buckets",
    "CaptureError",
    "ConfigError",
    "CudaGraphsError",
    "CudaGraphsWarning",
    "ExactShapes",
    "Finding",
    "Graphed",
    "GraphedAutograd",
    "InputMismatchError",
    "ModeResult",
    "OutputPolicy",
    "Pool",
    "Profile",
    "Report",
    "StaleGraphError",
    "StaleOutputError",
    "VerificationError",
    "State",
    "Stats",
    "TrainStep",
    "__version__",
    "bench",
    "doctor",
    "graph",
    "graph_autograd",
    "graph_autograd_chain",
    "make_graph_safe",
    "powers_of_two",
    "profile",
    "server_sizes",
    "train_step",
]

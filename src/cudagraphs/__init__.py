"""cudagraphs: CUDA graphs in PyTorch, safe, fast and easy.

::

    import cudagraphs as cg

    g = cg.graph(model, x)     # warm-up on a side stream, then capture, on these examples
    y = g(x_new)               # signature check, copy-in, one graph launch, outputs

See :func:`graph` for the options, and the README for when graphs help and when they do not.
"""

from __future__ import annotations

from .api import graph
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
from .outputs import OutputPolicy
from .pool import Pool
from .stats import Stats

__version__ = "0.1.0"

__all__ = [
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
    "InputMismatchError",
    "OutputPolicy",
    "Pool",
    "Report",
    "StaleGraphError",
    "StaleOutputError",
    "VerificationError",
    "State",
    "Stats",
    "__version__",
    "doctor",
    "graph",
    "powers_of_two",
    "server_sizes",
]

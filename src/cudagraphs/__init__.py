"""cudagraphs: CUDA graphs in PyTorch, safe, fast and easy.

::

    import cudagraphs as cg

    g = cg.graph(model, x)     # warm-up on a side stream, then capture, on these examples
    y = g(x_new)               # signature check, copy-in, one graph launch, outputs

See :func:`graph` for the options, and the README for when graphs help and when they do not.
"""

from __future__ import annotations

from .api import graph
from .errors import (
    CaptureError,
    ConfigError,
    CudaGraphsError,
    CudaGraphsWarning,
    InputMismatchError,
    StaleOutputError,
)
from .graphed import Graphed, State
from .outputs import OutputPolicy
from .stats import Stats

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "ConfigError",
    "CudaGraphsError",
    "CudaGraphsWarning",
    "Graphed",
    "InputMismatchError",
    "OutputPolicy",
    "StaleOutputError",
    "State",
    "Stats",
    "__version__",
    "graph",
]

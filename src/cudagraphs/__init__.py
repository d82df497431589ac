"""cudagraphs: CUDA graphs in PyTorch, safe, fast and easy.

::

    import cudagraphs as cg

    g = cg.graph(model, x)     # warm-up on a side stream, then capture, on these examples
    y = g(x_new)               # signature check, copy-in, one graph launch, outputs

See :func:`graph` for the options, and the README for when graphs help and when they do not.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

with warnings.catch_warnings():
    # numpy is optional: torch warns "Failed to initialize NumPy" when the modules our core
    # imports load without it, which a user who never calls .numpy() should not see.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    from . import api  # noqa: F401  (the core, and the torch modules it imports)

from .api import graph
from .control import cond, while_loop
from .core import Graphed, Pool, State, Stats, eager
from .diagnose import Finding, Report, doctor
from .errors import (
    BadRequestError,
    BatcherClosed,
    BucketOverflowError,
    CaptureError,
    CollectiveMismatchError,
    ConditionalNodesUnavailable,
    ConfigError,
    CudaGraphsError,
    CudaGraphsWarning,
    CudaRequiredError,
    DeadlineExceeded,
    FrozenStateError,
    GradientsNotRecordedError,
    InputMismatchError,
    ModeMismatchError,
    Overloaded,
    RandomInLoopError,
    ReplayTimeoutError,
    RequestCancelled,
    SegmentError,
    StaleGraphError,
    StaleOutputError,
    StateWriteError,
    StepFailedError,
    VerificationError,
)
from .lazy import first_use
from .options import OutputPolicy
from .serve import Batcher
from .shapes import Bucketed, Buckets, BucketStats, ExactShapes, powers_of_two, server_sizes
from .training import (
    GraphedAutograd,
    GraphedModule,
    GraphSafeAdamW,
    GraphSafeSGD,
    TrainStep,
    capture_stream,
    ddp,
    graph_autograd,
    graph_autograd_chain,
    make_graph_safe,
    train_step,
)

if TYPE_CHECKING:
    from .integrations import backend
    from .tools import BenchReport, ModeResult, Profile, auto, bench, profile

# The tools (bench, profile and their reports, which pull in rich) load on first use.
# Loaded on first use (the tools import rich; the integrations, optional libraries).
_LAZY = {
    "auto": "tools",
    "backend": "integrations",
    "bench": "tools",
    "BenchReport": "tools",
    "ModeResult": "tools",
    "Profile": "tools",
    "profile": "tools",
}


__getattr__ = first_use(__name__, _LAZY)

__version__ = "0.1.0"

__all__ = [
    "BadRequestError",
    "Batcher",
    "BatcherClosed",
    "BenchReport",
    "BucketOverflowError",
    "BucketStats",
    "Bucketed",
    "Buckets",
    "CaptureError",
    "CollectiveMismatchError",
    "ConditionalNodesUnavailable",
    "ConfigError",
    "CudaGraphsError",
    "CudaGraphsWarning",
    "CudaRequiredError",
    "DeadlineExceeded",
    "ExactShapes",
    "Finding",
    "FrozenStateError",
    "GradientsNotRecordedError",
    "GraphSafeAdamW",
    "GraphSafeSGD",
    "Graphed",
    "GraphedAutograd",
    "GraphedModule",
    "InputMismatchError",
    "ModeMismatchError",
    "ModeResult",
    "OutputPolicy",
    "Overloaded",
    "Pool",
    "Profile",
    "RandomInLoopError",
    "ReplayTimeoutError",
    "Report",
    "RequestCancelled",
    "SegmentError",
    "StaleGraphError",
    "StaleOutputError",
    "State",
    "StateWriteError",
    "StepFailedError",
    "Stats",
    "TrainStep",
    "VerificationError",
    "__version__",
    "auto",
    "backend",
    "bench",
    "capture_stream",
    "cond",
    "ddp",
    "doctor",
    "eager",
    "graph",
    "graph_autograd",
    "graph_autograd_chain",
    "make_graph_safe",
    "powers_of_two",
    "profile",
    "server_sizes",
    "train_step",
    "while_loop",
]

"""One hierarchy for everything the library raises.

Every error is a ``RuntimeError`` (so code that already catches PyTorch's CUDA errors keeps
working) and every message has three parts: what went wrong, why it matters for a graph, and
how to fix it.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

__all__ = [
    "BadRequestError",
    "BatcherClosed",
    "BucketOverflowError",
    "CaptureError",
    "CollectiveMismatchError",
    "ConditionalNodesUnavailable",
    "ConfigError",
    "CudaGraphsError",
    "CudaRequiredError",
    "FrozenStateError",
    "GradientsNotRecordedError",
    "ModeMismatchError",
    "RandomInLoopError",
    "CudaGraphsWarning",
    "InputMismatchError",
    "Notices",
    "Overloaded",
    "RequestCancelled",
    "ReplayTimeoutError",
    "SegmentError",
    "DeadlineExceeded",
    "StaleGraphError",
    "StaleOutputError",
    "StateWriteError",
    "StepFailedError",
    "VerificationError",
    "explain",
    "install_extra",
    "require_cuda",
]


def explain(what: str, why: str, fix: str) -> str:
    """Format the three parts every message in this library carries."""
    return f"{what}\n  why: {why}\n  fix: {fix}"


def install_extra(extra: str) -> str:
    """How to install one of the package's extras: cudagraphs is installed from a clone (it is
    not on PyPI), so asking pip for it by name would find nothing."""
    return f"pip install -e '.[{extra}]' from a clone of cudagraphs (it is not on PyPI)"


def require_cuda(entry: str) -> None:
    """Raise :class:`CudaRequiredError` (one line) when this machine has no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise CudaRequiredError(
            f"{entry} needs a CUDA GPU, and this machine has none (torch.cuda.is_available() "
            "is False); on a CPU, cg.graph and cg.train_step run eagerly behind the same checks"
        )


class CudaGraphsError(RuntimeError):
    """Root of every error raised by cudagraphs."""


class ConfigError(CudaGraphsError):
    """An argument to ``cg.graph`` (or another entry point) is invalid before anything runs."""


class CudaRequiredError(ConfigError):
    """An entry point that only makes sense on a CUDA GPU was called on a machine without one
    (``cg.capture_stream``, ``cg.ddp``, ``cg.make_graph_safe``). ``cg.graph`` and
    ``cg.train_step`` instead run eagerly there, behind the same checks."""


class InputMismatchError(CudaGraphsError):
    """A call does not match the signature the graph was captured with.

    The graph reads its inputs from fixed buffers of a fixed shape, dtype and device, and every
    Python value it saw was frozen into the recording; a different value would be silently
    ignored (or broadcast, or cast) if it were not refused here.
    """


class BucketOverflowError(InputMismatchError):
    """A real size is above the largest rung of its bucket ladder (``overflow="raise"``)."""


class CaptureError(CudaGraphsError):
    """Capturing the function into a CUDA graph failed.

    ``kind`` names the failure in a word (``"host-sync"``, ``"cpu-tensor"``, ...), ``location``
    is the ``file:line`` in user code where it happened when it could be found, ``block`` the
    innermost ``nn.Module`` whose ``forward`` held the failing step (or None), ``findings``
    are ``cg.doctor``'s findings for the function (run automatically on the eager path), and
    the original CUDA/PyTorch error is chained as ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str = "unknown",
        location: str | None = None,
        block: Any = None,
    ):
        super().__init__(message)
        self.kind = kind
        self.location = location
        self.block = block
        #: ``cg.doctor``'s findings for the function, filled in when capture fails.
        self.findings: list[Any] = []


class SegmentError(CudaGraphsError):
    """An eager step between two graphs (``@cg.eager``, ``eager=[...]``) cannot be handed on:
    it returned something other than CUDA tensors, or tensors of another shape than at capture,
    or it was reached where one graph was asked for (``segments="refuse"``)."""


class ModeMismatchError(CudaGraphsError):
    """A call runs under other modes than the capture (autocast and its dtype, grad or
    inference mode, TF32, the default dtype): the recording holds the kernels those modes chose,
    so a replay would not give eager's answer. Call under the capture's modes, or capture one
    graph per mode."""


class GradientsNotRecordedError(ModeMismatchError):
    """A call needs gradients (grad mode on and an input or parameter requires grad), but a
    graph replay records no autograd history. Call under ``torch.no_grad()`` for inference, or
    use ``cg.graph_autograd`` / ``cg.train_step`` for training."""


class FrozenStateError(CudaGraphsError):
    """The function changes a plain Python value (an int, float, bool, str, enum or a tuple of
    these, held by a module, a cache or another object it reaches) from one run to the next,
    or draws from the host's random generators (Python's ``random``, NumPy's global one).

    A recording runs the Python code once, so every later replay would repeat the branch and
    the constants of that one run. ``names`` lists what changed (``object.attribute``). Declare
    a harmless one (a logging counter) with ``harmless_state=("attribute",)``.
    """

    def __init__(self, message: str, *, names: list[str] | None = None):
        super().__init__(message)
        self.names = names or []


class RandomInLoopError(CudaGraphsError):
    """A body of ``cg.while_loop`` (or a branch of ``cg.cond`` inside one) draws random numbers:
    a recorded body replays the draws of its one recording on every iteration, so each
    iteration would repeat the same noise. Draw the noise before the loop and pass it in the
    loop state."""


class ConditionalNodesUnavailable(CudaGraphsError):
    """This machine cannot run loops or branches on the device (CUDA conditional nodes need
    CUDA 12.4 in the driver and the runtime, and the cuda-bindings package)."""


class StaleOutputError(CudaGraphsError):
    """An output of an earlier replay was read after a later replay overwrote it.

    PyTorch itself raises the access error from C++ as a ``RuntimeError`` whose message starts
    with ``StaleOutputError``; the library raises this class where it sees the stale tensor
    itself (for instance when a stale output is passed back into a graphed call).
    """


class StaleGraphError(CudaGraphsError):
    """A tensor the graph reads by address moved since capture (``on_stale="raise"``).

    ``param.data = ...``, ``module.to(...)``, a reassigned buffer or a rebound global tensor: the
    recording would keep reading the old memory. The default, ``on_stale="recapture"``, captures
    again instead.
    """


class StateWriteError(CudaGraphsError):
    """``side_effects="raise"``: a run the library made on its own account (warm-up, a bucket
    probe) wrote state outside the call's inputs: module buffers, a cache, closure tensors.

    ``names`` lists what was written. The state was put back before this was raised.
    """

    def __init__(self, message: str, *, names: list[str] | None = None):
        super().__init__(message)
        self.names = names or []


class VerificationError(CudaGraphsError):
    """``verify=True``: a replay differed from eager on fresh random inputs."""


class CollectiveMismatchError(CudaGraphsError):
    """Ranks captured different collectives (kind, sizes, dtypes or order), so the first replay
    would wait forever; raised on every rank, saying what differs."""


class ReplayTimeoutError(CudaGraphsError):
    """A replay did not finish within ``replay_timeout_s`` (typically a collective waiting for
    a rank that never replayed)."""


class Overloaded(CudaGraphsError):
    """A batcher's or an engine's queue is full: the request is refused at once instead of
    waiting without bound (back-pressure), and nothing of it was queued. Retry later (after
    ``retry_after_s``), or raise ``max_queue``."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BadRequestError(InputMismatchError):
    """A request to an LLM engine cannot be served as given (a prompt too long for the cache,
    ids outside the vocabulary, a wrong dtype, settings out of range). It is refused alone,
    before it is queued: the requests already running are not touched."""


class RequestCancelled(CudaGraphsError):
    """The request was cancelled (by its caller, or its client went away) before it ended."""


class StepFailedError(CudaGraphsError):
    """A step of an LLM engine raised: the requests in that step failed with this error (its
    ``__cause__`` is the step's exception), and the engine went on serving the others."""


class DeadlineExceeded(CudaGraphsError):
    """A request waited in a batcher's queue past its deadline and was not run."""


class BatcherClosed(CudaGraphsError):
    """A batcher (or an LLM engine) was shut down: it takes no new requests, and without draining it fails the
    ones still queued with this error."""


class CudaGraphsWarning(UserWarning):
    """Warnings from cudagraphs (for example: running eagerly because CUDA is unavailable)."""


class Notices:
    """Warnings shown once per cause; every later occurrence is only counted.

    A loop that meets the same cause at every step (a scheduler that changes a value the
    recording froze, each rung of a decoder on a machine without CUDA) prints one line, and
    :attr:`counts` (cause -> occurrences) says how often it happened. Shared by the objects
    that make up one thing (the graphs of one pool).

    Right: ``notices.warn("recapture: opt.betas", message)`` with a cause that leaves out the
    values that change from one occurrence to the next.
    Wrong: a cause that carries those values (``"betas changed to 0.93"``): every step is a new
    cause, and every step prints.
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(
        self,
        cause: str,
        message: str,
        *,
        stacklevel: int = 2,
        logger: logging.Logger | None = None,
        count: bool = True,
    ) -> bool:
        """Show ``message`` (a :class:`CudaGraphsWarning`, or a warning on ``logger``) the
        first time ``cause`` occurs, and count it (``count=False``: a warning ahead of the
        occurrences, shown once and not counted); True when it was shown."""
        with self._lock:
            seen = cause in self.counts
            self.counts[cause] = self.counts.get(cause, 0) + count
        if seen:
            return False
        if logger is not None:
            logger.warning("%s", message)
        else:
            warnings.warn(message, CudaGraphsWarning, stacklevel=stacklevel + 1)
        return True

"""Splitting a recording at eager steps: what runs while the capture records.

``@cg.eager`` (:func:`eager`) and the ``eager=[...]`` option (:func:`module_gaps`, hooks on the
user's own modules for the capture's duration) hand an eager step to the capture's
:class:`Splitter`, which ends the graph being recorded, replays it so the step computes on real
values, runs the step, keeps its outputs in buffers of the pool and begins the next graph. The
result is a :class:`~.segments.Segments`. Outside a capture (and in other threads: the capture
in progress is per thread) a marked step is an ordinary call.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from ..errors import SegmentError, explain
from . import compat
from .active_capture import active_capture
from .frames import callable_name, user_frame
from .segments import Gap, Segments
from .tree import NAMESPACE

__all__ = [
    "KeptWrites",
    "NeedsSplitting",
    "Splitter",
    "current_eager_step",
    "eager",
    "is_eager",
    "module_gaps",
]

_EAGER_MARK = "__cudagraphs_eager__"
_current_step: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "cudagraphs_eager_step", default=None
)


def current_eager_step() -> str | None:
    """The ``@cg.eager`` step running in this thread outside a capture (its name), or None."""
    return _current_step.get()


def check_gap_outputs(fn: Callable[..., Any], location: str, out: Any, device: torch.device) -> Any:
    """The outputs of a gap at capture, flattened: CUDA tensors on the graph's device or
    ``None``; anything else would be frozen into the graph after it."""
    leaves, spec = optree.tree_flatten(out, namespace=NAMESPACE, none_is_leaf=True)
    for leaf in leaves:
        if leaf is None:
            continue
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda and leaf.device == device:
            continue
        what = f"a tensor on {leaf.device}" if isinstance(leaf, torch.Tensor) else repr(leaf)[:60]
        raise SegmentError(
            explain(
                f"the eager step {callable_name(fn)} at {location} returned {what}",
                "the graph after the step would freeze that value at capture: only tensors on "
                f"{device} can be handed on at stable addresses",
                "return a CUDA tensor instead (torch.tensor(value, device='cuda'), or keep the "
                "value on the GPU: t.sum() instead of t.sum().item())",
            )
        )
    return leaves, spec


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as a step that always runs eagerly: inside ``cg.graph`` it ends the graph
    being recorded and a new one begins after it (a *gap* between two *segments*).

    Right::

        @cg.eager
        def flip_if_positive(h):            # reads the GPU from the host: cannot be recorded
            if h.mean().item() > 0:
                h.neg_()

        def forward(x):
            h = first_half(x)
            flip_if_positive(h)             # runs at every replay, between the two graphs
            return second_half(h)

    Wrong: returning a Python value (``return h.mean().item() > 0``) and branching on it in the
    graphed code; that branch would be recorded once. Return tensors (or nothing) and keep the
    decision inside the eager step. Outside a capture the function is called as it is.
    """
    if not callable(fn):
        raise TypeError(f"cg.eager expects a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def run_eagerly(*args: Any, **kwargs: Any) -> Any:
        active = active_capture()
        splitter = active.splitter if active is not None else None
        if splitter is None or splitter.in_gap:
            token = _current_step.set(callable_name(fn))  # the doctor reads it: a split point
            try:
                return fn(*args, **kwargs)
            finally:
                _current_step.reset(token)
        splitter.open(fn, user_location(), "marked with @cg.eager")
        return splitter.close(fn, args, kwargs, fn(*args, **kwargs))

    # Under torch.compile the step is an eager step too: Dynamo does not trace into it.
    marked = torch.compiler.disable(run_eagerly)
    setattr(marked, _EAGER_MARK, True)
    return marked


class KeptWrites(contextlib.nullcontext):  # type: ignore[type-arg]
    """For ``side_effects="keep"``: the segmented capture's run counts, nothing is put back
    (a decoder owns its cache and resets it per request; copying it would double it)."""

    def flush(self) -> None:
        pass

    def restore(self) -> None:
        pass


class NeedsSplitting(BaseException):
    """Internal: a gap was reached in a capture not set up for segments; capture again, set up."""


class Splitter:
    """The segmented side of one capture in progress: ends the current graph at a gap, runs the
    gap for real, keeps its outputs in pool buffers and begins the next graph."""

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        pool: Any,
        device: torch.device,
        capture_error_mode: str,
        *,
        refuse: bool,
        writes: Any,
        active: Any,
    ) -> None:
        self.graph: torch.cuda.CUDAGraph | None = graph
        self.pool = pool
        self.device = device
        self.capture_error_mode = capture_error_mode
        self.refuse = refuse
        self.writes = writes  # state.DeferredWriteRecorder, or None before a gap was seen
        self.active = active
        self.pieces: list[Any] = []
        self.in_gap = False
        self.owner: Any = None
        self._where = ("", "")

    def open(self, owner: Any, location: str, why: str) -> None:
        """A gap begins: end the graph so far and run it, so the gap sees real values."""
        if self.refuse:
            raise SegmentError(
                explain(
                    f"{callable_name(owner)} at {location} is {why}, and segments='refuse' "
                    "asks for one graph",
                    "an eager step splits the recording into segments",
                    "pass segments='split' (the default), or remove the mark",
                )
            )
        if self.writes is None:
            raise NeedsSplitting
        self._end_segment(run=True)
        self.in_gap, self.owner, self._where = True, owner, (location, why)

    def close(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        """The gap ended with ``out``: keep it in pool buffers, begin the next graph on them."""
        location, why = self._where
        leaves, spec = check_gap_outputs(fn, location, out, self.device)
        index = self.device.index if self.device.index is not None else 0
        with compat.allocating_in_pool(index, self.pool):
            buffers = [None if x is None else torch.empty_like(x) for x in leaves]
        with torch.no_grad():
            for buf, x in zip(buffers, leaves):
                if buf is not None:
                    buf.copy_(x)
        self.pieces.append(Gap(fn, args, kwargs, location, why, spec, buffers))
        self.in_gap, self.owner = False, None
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(self.pool, capture_error_mode=self.capture_error_mode)
        self.graph = graph
        return optree.tree_unflatten(spec, buffers)

    def _end_segment(self, *, run: bool) -> None:
        graph, self.graph = self.graph, None
        if graph is None:
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graph.capture_end()
        self.active.finish()
        empty = False
        for w in caught:
            if "empty" in str(w.message).lower():
                empty = True  # a gap first or last: a segment with no work is dropped
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if empty:
            return
        self.pieces.append(graph)
        if run:
            self.writes.flush()  # the state it writes, copied before it runs
            graph.replay()

    def finish(self) -> Any:
        """End the capture: the one graph, or :class:`Segments` when there were gaps."""
        if not self.pieces:
            graph = self.graph
            assert graph is not None
            self.graph = None
            graph.capture_end()
            return graph
        self._end_segment(run=False)
        if self.in_gap:
            raise SegmentError("the capture ended inside an eager step")
        index = self.device.index
        return Segments(self.pieces, device=torch.cuda.current_device() if index is None else index)

    def abandon(self) -> None:
        """After a failure: end whatever is still being recorded."""
        graph, self.graph = self.graph, None
        if graph is not None:
            with contextlib.suppress(Exception), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph.capture_end()
        self.pieces.clear()


def is_eager(fn: Any) -> bool:
    """Whether ``fn`` was marked with :func:`eager`."""
    return bool(getattr(fn, _EAGER_MARK, False))


def user_location() -> str:
    filename, line = user_frame()
    return f"{filename}:{line}"


def module_gaps(modules: Sequence[torch.nn.Module]) -> list[Any]:
    """Hooks that make each module's forward an eager step while a capture in this thread
    records (removed when the capture ends; other threads' calls pass through them)."""
    handles = []
    for module in modules:
        handles.append(module.register_forward_pre_hook(_open_module_gap, with_kwargs=True))
        handles.append(module.register_forward_hook(_close_module_gap, with_kwargs=True))
    return handles


def _open_module_gap(module: Any, args: Any, kwargs: Any) -> None:
    active = active_capture()
    splitter = active.splitter if active is not None else None
    if splitter is not None and not splitter.in_gap:
        where = _forward_location(module)
        splitter.open(module, where, f"in eager=[{type(module).__name__}]")


def _close_module_gap(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
    active = active_capture()
    splitter = active.splitter if active is not None else None
    if splitter is not None and splitter.in_gap and splitter.owner is module:
        return splitter.close(module, args, kwargs, output)
    return None


def _forward_location(module: Any) -> str:
    """``file:line (Class.forward)`` of a module's forward, for the segment listing."""
    name = type(module).__name__
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    if code is None:
        return f"{name}.forward"
    return f"{code.co_filename}:{code.co_firstlineno} ({name}.forward)"

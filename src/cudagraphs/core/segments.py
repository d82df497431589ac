"""Segments: one recording made of several graphs, with eager steps between them.

A step that cannot be recorded (a host read such as ``.item()``, a CPU tensor, a data-dependent
shape) does not have to make the whole function eager. Marked as a gap (``@cg.eager`` on a
function, ``eager=[module or class]`` for modules), it ends the graph being recorded, runs
eagerly, and a new graph begins after it, in the same memory pool. A replay then launches the
first graph, runs the gap's code, launches the next graph, and so on: :class:`Segments` has the
``replay()`` of a graph, so the one call path (``replay.Replayer``) serves it unchanged, and
every check of a call (signature, addresses, modes, threads, outputs) holds across the gaps.

How a gap keeps addresses stable: its arguments are the tensors of the capture (static inputs,
the graph's intermediates, parameters), the same objects at every replay; what it returns is
copied into buffers allocated once in the pool, and the next graph reads those. A gap must
return tensors (or nothing): a Python value it returned would be frozen into the next graph.

The capture runs the function for real (each segment is replayed before the gap after it, so a
gap computes on real values, as its ``.item()`` or routing expects); what that run writes outside
its inputs is put back afterwards, as for warm-up (``writes.DeferredWriteRecorder``).

Splitting a recording at eager steps, while the capture records. ``@cg.eager`` (:func:`eager`) and the ``eager=[...]`` option (:func:`module_gaps`, hooks on the
user's own modules for the capture's duration) hand an eager step to the capture's
:class:`Splitter`, which ends the graph being recorded, replays it so the step computes on real
values, runs the step, keeps its outputs in buffers of the pool and begins the next graph. The
result is a :class:`Segments`. Outside a capture (and in other threads: the capture
in progress is per thread) a marked step is an ordinary call.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from ..errors import CudaGraphsWarning, SegmentError, explain
from . import compat
from .active_capture import active_capture
from .frames import callable_name, library_setting, user_frame, user_stacklevel
from .launch import Launcher
from .signature import NAMESPACE

__all__ = [
    "Gap",
    "KeptWrites",
    "NeedsSplitting",
    "Segments",
    "Splitter",
    "announce",
    "current_eager_step",
    "describe_segments",
    "eager",
    "is_eager",
    "module_gaps",
    "print_segments",
]


@dataclass
class Gap:
    """One eager step between two graphs: what it calls, with which arguments, and where its
    outputs are kept."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    location: str  # the user's file:line of the call
    why: str  # "marked with @cg.eager", "eager=[Experts]"
    spec: Any  # the tree of its outputs
    buffers: list[torch.Tensor | None]  # one per output leaf (None: not a tensor)
    calls: int = 0
    seconds: float = 0.0
    rows: tuple[int, int] | None = None  # (rows at capture, rows of this call): see cut_rows

    def __post_init__(self) -> None:
        self.returns_nothing = self.spec == _NOTHING

    def run(self) -> None:
        """Call the step eagerly on its captured arguments; copy its outputs into the buffers."""
        start = time.perf_counter()
        args, kwargs = self.args, self.kwargs
        if self.rows is not None:
            args, kwargs = _cut((args, kwargs), *self.rows)
        out = self.fn(*args, **kwargs)
        if not (self.returns_nothing and out is None):
            self._hand_on(out)
        self.calls += 1
        self.seconds += time.perf_counter() - start

    def _hand_on(self, out: Any) -> None:
        leaves, spec = optree.tree_flatten(out, namespace=NAMESPACE, none_is_leaf=True)
        if spec != self.spec:
            raise SegmentError(
                explain(
                    f"the eager step {callable_name(self.fn)} at {self.location} returned a "
                    f"different structure than at capture ({spec} instead of {self.spec})",
                    "the graph after it reads the step's outputs from buffers of the captured "
                    "structure",
                    "return the same structure every call (pad instead of dropping outputs)",
                )
            )
        dst, src = [], []
        for buf, value in zip(self.buffers, leaves):
            if buf is None:
                continue
            if self.rows is not None and value.shape[:1] != buf.shape[:1]:
                buf = buf[: value.shape[0]]
            if (
                value.shape != buf.shape
                or value.dtype is not buf.dtype
                or value.get_device() != buf.get_device()
            ):
                raise SegmentError(
                    explain(
                        f"the eager step {callable_name(self.fn)} at {self.location} returned a "
                        f"{value.dtype} tensor of shape {tuple(value.shape)} on {value.device}; "
                        f"at capture it was {buf.dtype} {tuple(buf.shape)} on {buf.device}",
                        "the graph after it reads a buffer of the captured shape, so an output "
                        "of another shape cannot be handed on (a data-dependent shape)",
                        "return fixed shapes from the step (pad to a maximum, or return a "
                        "mask), or run the function eagerly",
                    )
                )
            if value.data_ptr() != buf.data_ptr():
                dst.append(buf)
                src.append(value)
        if len(dst) > 1:
            compat.foreach_copy(dst, src)
        elif dst:  # one copy_: less host work than a multi-tensor kernel for one tensor
            dst[0].copy_(src[0])


_NOTHING = optree.tree_structure(None, namespace=NAMESPACE, none_is_leaf=True)


def _cut(tree: Any, rows: int, real: int) -> Any:
    """The tensors of ``tree`` whose first dimension is ``rows`` (a bucket's rung), cut to the
    call's ``real`` rows: a gap in a bucketed graph sees what eager would, not the padding."""
    if real == rows:
        return tree

    def cut(x: Any) -> Any:
        if (
            isinstance(x, torch.Tensor)
            and not isinstance(x, torch.nn.Parameter)
            and x.dim() > 0
            and x.shape[0] == rows
        ):
            return x[:real]
        return x

    return optree.tree_map(cut, tree, namespace=NAMESPACE, none_is_leaf=True)


@dataclass
class Segments:
    """Graphs and gaps in recorded order, replayed in that order: a graph's stand-in for the
    replay path (``replay()``, ``pool()``)."""

    pieces: list[Any] = field(default_factory=list)  # torch.cuda.CUDAGraph | Gap
    device: int = 0

    def __post_init__(self) -> None:
        self.graphs: list[torch.cuda.CUDAGraph] = [p for p in self.pieces if not isinstance(p, Gap)]
        self.gaps: list[Gap] = [p for p in self.pieces if isinstance(p, Gap)]
        self.launchers = {id(g): Launcher(g, self.device) for g in self.graphs}
        self._steps = [p.run if isinstance(p, Gap) else self.launchers[id(p)] for p in self.pieces]

    def replay(self) -> None:
        for step in self._steps:
            step()

    def pool(self) -> Any:
        return self.graphs[0].pool()

    def launcher(self, graph: torch.cuda.CUDAGraph) -> Launcher:
        """The launch of one of the graphs (``launch.Launcher``)."""
        return self.launchers[id(graph)]

    def cut_rows(self, rows: int | None, real: int | None) -> None:
        """In a bucketed graph: the rung's rows and this call's real rows (``None``: none)."""
        value = None if rows is None or real is None or rows == real else (rows, real)
        for gap in self.gaps:
            gap.rows = value


def describe_segments(recording: Any) -> list[dict[str, Any]]:
    """One entry per piece of a recording, in order: ``{"kind": "graph"}`` or
    ``{"kind": "eager", "step", "location", "why", "calls", "mean_us"}``; ``[]`` before capture."""
    if recording is None:
        return []
    if not isinstance(recording, Segments):
        return [{"kind": "graph"}]
    rows: list[dict[str, Any]] = []
    for piece in recording.pieces:
        if isinstance(piece, Gap):
            mean = piece.seconds / piece.calls * 1e6 if piece.calls else 0.0
            rows.append(
                {
                    "kind": "eager",
                    "step": callable_name(piece.fn),
                    "location": piece.location,
                    "why": piece.why,
                    "calls": piece.calls,
                    "mean_us": mean,
                }
            )
        else:
            rows.append({"kind": "graph"})
    return rows


def print_segments(recording: Any, name: str, stats: Any, console: Any = None) -> None:
    """A rich table of :func:`describe_segments`'s rows, with the replay count and the gaps' share."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"segments of {name}")
    for column in ("#", "piece", "where", "why", "calls", "mean µs (host)"):
        table.add_column(column, overflow="fold")
    for i, row in enumerate(describe_segments(recording)):
        if row["kind"] == "graph":
            table.add_row(str(i), "graph", "", "", "", "")
        else:
            table.add_row(
                str(i), f"eager {row['step']}", row["location"], row["why"],
                str(row["calls"]), f"{row['mean_us']:.1f}",
            )  # fmt: skip
    console.print(table)
    console.print(
        f"{stats.replays} replays, {stats.graphs} graphs, {stats.gaps} eager steps, "
        f"{stats.gap_s * 1e3:.2f} ms in eager steps (host time, waits for the GPU included)"
    )


_announced: set[str] = set()


def announce(recording: Any, name: str) -> None:
    """One warning per distinct split: where the recording was split and why, and a library
    setting that would remove a split where one is known."""
    if not isinstance(recording, Segments):
        return
    lines = [f"  {g.location}: {callable_name(g.fn)} {g.why}" for g in recording.gaps]
    settings = {s for g in recording.gaps if (s := library_setting(g.location))}
    message = (
        f"cudagraphs: {name} is recorded as {len(recording.graphs)} graphs with "
        f"{len(recording.gaps)} eager step(s) between them, run at every call:\n"
        + "\n".join(lines)
        + "".join(f"\n  to record it whole: {s}" for s in sorted(settings))
    )
    key = "\n".join(lines)  # once per set of break points (not per bucket or decode rung)
    if key in _announced:
        return
    _announced.add(key)
    warnings.warn(message, CudaGraphsWarning, stacklevel=user_stacklevel())


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
        splitter.open(fn, _user_line(), "marked with @cg.eager")
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


def _user_line() -> str:
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

"""Segments: one recording made of several graphs, with eager gaps between them.

A step that cannot be recorded (a host read such as ``.item()``, a CPU tensor, a data-dependent
shape) does not have to make the whole function eager. Marked as a gap (``@cg.eager`` on a
function, ``eager=[module or class]`` for modules), it ends the graph being recorded, runs
eagerly, and a new graph begins after it, in the same memory pool. A replay then launches the
first graph, runs the gap's code, launches the next graph, and so on: :class:`Segments` has the
``replay()`` of a graph, so the one call path (``replayer.Replayer``) serves it unchanged, and
every check of a call (signature, addresses, modes, threads, outputs) holds across the gaps.

How a gap keeps addresses stable: its arguments are the tensors of the capture (static inputs,
the graph's intermediates, parameters), the same objects at every replay; what it returns is
copied into buffers allocated once in the pool, and the next graph reads those. A gap must
return tensors (or nothing): a Python value it returned would be frozen into the next graph.

The capture runs the function for real (each segment is replayed before the gap after it, so a
gap computes on real values, as its ``.item()`` or routing expects); what that run writes outside
its inputs is put back afterwards, as for warm-up (``state.DeferredWriteRecorder``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from ..errors import CudaGraphsWarning, SegmentError, explain
from . import compat
from .failures import library_setting
from .frames import callable_name, user_stacklevel
from .launch import Launcher
from .tree import NAMESPACE

__all__ = ["Gap", "Segments", "announce", "describe", "print_segments"]


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


def describe(recording: Any) -> list[dict[str, Any]]:
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
    """A rich table of :func:`describe`'s rows, with the replay count and the gaps' share."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"segments of {name}")
    for column in ("#", "piece", "where", "why", "calls", "mean µs (host)"):
        table.add_column(column)
    for i, row in enumerate(describe(recording)):
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

"""Recording one call of a function into a CUDA graph (:func:`capture_call`), split at its
eager steps where it has any, and the error a failed recording raises.

A recording that fails is turned into a :class:`~cudagraphs.errors.CaptureError` that names the
kind of failure in plain words, points at the user's line, and chains the original error. The
stream, the allocator and Python's gc are always restored, so the process stays usable.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CaptureError, CudaGraphsError, explain
from . import compat
from .active_capture import capturing
from .frames import block_hint, callable_name, classify_failure, failing_module, user_location
from .launch import CopyNodes, CopyNodesUnavailable, sources_for
from .launch import record as record_copies
from .segments import KeptWrites, NeedsSplitting, Segments, Splitter, module_gaps
from .side_stream import uncached_autocast
from .writes import DeferredWriteRecorder

__all__ = ["Recording", "RecordingSetup", "capture_call"]

log = logging.getLogger("cudagraphs")


@dataclass
class Recording:
    """A captured graph, what the function returned while being recorded, and its costs."""

    graph: Any  # torch.cuda.CUDAGraph, or segments.Segments when the function has eager steps
    output: Any
    capture_s: float
    pool_bytes: int
    copies: CopyNodes | None = None  # the inputs' copy-in nodes (launch.py), if recorded


@dataclass(frozen=True)
class RecordingSetup:
    """Where and how a call is recorded.

    ``pool``: a pool handle to capture into (None: a private one). An eager step reached while
    recording (``@cg.eager``, a module of ``eager_modules``) splits the recording into
    :class:`~.segments.Segments` (``segments="refuse"``: an error instead). Such a recording
    runs the function for real, so what it writes outside ``exclude`` (the inputs) is put back
    afterwards, unless ``restore`` is False (``side_effects="keep"``)."""

    stream: Any  # torch.cuda.Stream
    pool: Any
    capture_error_mode: str
    segments: str = "split"
    eager_modules: Sequence[torch.nn.Module] = ()
    exclude: Sequence[torch.Tensor] = ()
    restore: bool = True


def capture_call(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    setup: RecordingSetup,
    copy_inputs: Sequence[torch.Tensor] = (),
) -> Recording:
    """Record one call of ``fn`` into a new CUDA graph, or raise :class:`CaptureError`.

    ``copy_inputs``: the static input buffers, whose copy-in the recording then holds as its
    first nodes (``copy_nodes``); recorded again without them if they cannot be kept. A
    function with eager steps is recorded again in segments.
    """
    recorder = _Recorder(fn, args, kwargs, setup)

    def split_where_needed(copies: Sequence[torch.Tensor]) -> Recording:
        try:
            return recorder.record(None, copies)
        except NeedsSplitting:
            writes = DeferredWriteRecorder(exclude=setup.exclude) if setup.restore else KeptWrites()
            return recorder.record(writes, copies)

    try:
        return split_where_needed(copy_inputs)
    except CopyNodesUnavailable as why:
        log.info("cudagraphs: inputs copied with copy_ before each replay (%s)", why)
        return split_where_needed(())


class _Recorder:
    """One function's recording attempts (whole, then split at eager steps, with or without
    the copy-in nodes). After each: its ``output`` and ``recorded`` graph, or the error the
    function raised (``failure``) and the one ending the capture raised (``end_failure``)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        setup: RecordingSetup,
    ) -> None:
        self.fn, self.args, self.kwargs, self.setup = fn, args, kwargs, setup
        self.output: Any = None
        self.recorded: Any = None
        self.failure: BaseException | None = None
        self.end_failure: BaseException | None = None

    def record(
        self, writes: DeferredWriteRecorder | KeptWrites | None, copy_inputs: Sequence[torch.Tensor]
    ) -> Recording:
        stream = self.setup.stream
        device = stream.device
        torch.cuda.synchronize(device)
        # cuBLAS keeps one workspace per (handle, stream), allocated on first use. Warm-up ran
        # on this stream, so the recording would point at a workspace that lives outside the
        # graph's pool, and anyone who clears the workspaces later (torch.compile's
        # reduce-overhead does, on every recording) would free memory the graph still uses: an
        # illegal memory access at the next replay. Clearing them now makes the capture allocate
        # its workspace inside its pool, which lives as long as the graph. (PyTorch's cudagraph
        # trees do the same.)
        compat.clear_cublas_workspaces()
        reserved_before = torch.cuda.memory_reserved(device)
        pending = sources_for(copy_inputs, range(len(copy_inputs)))  # outside the pool
        graph = compat.new_graph(keep=pending is not None)
        start = time.perf_counter()
        self._run_inside_capture(graph, writes, pending)
        if writes is not None:
            torch.cuda.synchronize(device)
            writes.restore()  # the segmented capture ran the function: put its writes back
        if isinstance(self.failure, NeedsSplitting):
            _recover(torch.cuda.CUDAGraph(), device, stream)
            raise self.failure
        if self.failure is None and self.end_failure is None:
            torch.cuda.synchronize(device)
            # Drop the workspace map's reference to the block in our pool, so eager matmuls on
            # this stream do not share memory with the graph.
            compat.clear_cublas_workspaces()
            copies = None
            if pending is not None:
                recorded = self.recorded
                copies = CopyNodes(
                    recorded.graphs[0] if isinstance(recorded, Segments) else recorded, pending
                )
            return Recording(
                graph=self.recorded,
                output=self.output,
                capture_s=time.perf_counter() - start,
                pool_bytes=torch.cuda.memory_reserved(device) - reserved_before,
                copies=copies,
            )
        _recover(graph, device, stream)
        raise _failed_capture(self.fn, self.failure, self.end_failure)

    def _run_inside_capture(
        self,
        graph: torch.cuda.CUDAGraph,
        writes: DeferredWriteRecorder | KeptWrites | None,
        pending: Any,
    ) -> None:
        """Run the function once inside a capture on the setup's stream; the capture always
        ends."""
        setup = self.setup
        self.output = self.recorded = self.failure = self.end_failure = None
        # A collection during capture could free a tensor whose memory the recording still uses
        # (or run __del__ code that syncs); keep the collector off for the duration.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        hooks = module_gaps(setup.eager_modules)
        try:
            with torch.cuda.stream(setup.stream), uncached_autocast():
                # A private pool of its own unless one is shared; named here, so that
                # conditional nodes recorded inside can route their bodies' allocations to it.
                pool = torch.cuda.graph_pool_handle() if setup.pool is None else setup.pool
                graph.capture_begin(pool, capture_error_mode=setup.capture_error_mode)
                if pending is not None:
                    record_copies(pending, setup.stream)
                with capturing(pool, setup.stream.device.index) as active:
                    splitter = active.splitter = Splitter(
                        graph, pool, setup.stream.device, setup.capture_error_mode,
                        refuse=setup.segments == "refuse", writes=writes, active=active,
                    )  # fmt: skip
                    try:
                        with writes if writes is not None else contextlib.nullcontext():
                            self.output = self.fn(*self.args, **self.kwargs)
                    except BaseException as error:  # KeyboardInterrupt too: capture must end
                        self.failure = error
                    finally:
                        # Always end the capture, or the stream stays in capture mode and every
                        # later CUDA call in the process fails.
                        try:
                            if self.failure is None:
                                self.recorded = splitter.finish()
                            else:
                                splitter.abandon()
                        except BaseException as error:
                            self.end_failure = error
                        active.finish()
        finally:
            for hook in hooks:
                hook.remove()
            if gc_was_enabled:
                gc.enable()


def _failed_capture(
    fn: Callable[..., Any], failure: BaseException | None, end_failure: BaseException | None
) -> BaseException:
    """The error to raise for a capture that failed: the user's interrupt or the library's own
    refusal as they are, anything else as a :class:`CaptureError` naming the kind of failure
    and the user's line."""
    if isinstance(failure, (KeyboardInterrupt, SystemExit)):
        return failure
    if isinstance(failure, CudaGraphsError) and not isinstance(failure, CaptureError):
        return failure  # the library's own refusal (a random draw in a loop body): it explains
    primary = failure if failure is not None else end_failure
    assert primary is not None
    kind, what, fix = classify_failure(primary, end_failure)
    block = failing_module(primary, top=fn)
    if kind in ("host-sync", "cpu-tensor"):
        fix += block_hint(block)
    location = user_location(primary)
    where = f" at {location}" if location else ""
    detail = f"{type(primary).__name__}: {str(primary).strip().splitlines()[0][:300]}"
    error = CaptureError(
        explain(
            f"capturing {callable_name(fn)} into a CUDA graph failed ({kind}){where}: {what}",
            f"the first error was {detail}",
            fix,
        ),
        kind=kind,
        location=location,
        block=block,
    )
    error.__cause__ = primary
    return error


def _recover(graph: torch.cuda.CUDAGraph, device: torch.device, stream: torch.cuda.Stream) -> None:
    """Leave CUDA usable after a failed capture.

    A capture that dies before ``capture_end`` completes leaves the device's default RNG
    generator in "capturing" mode, and the next random op outside a capture then fails with
    "Offset increment outside graph capture encountered unexpectedly". Recording one empty
    graph runs the generator's capture prologue and epilogue and so resets it.
    """
    with contextlib.suppress(Exception):
        graph.reset()
    del graph
    with contextlib.suppress(Exception):
        torch.cuda.synchronize(device)
    empty = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty": that is the point
        try:
            with torch.cuda.stream(stream):
                empty.capture_begin()
                empty.capture_end()
        except Exception:
            pass
    del empty
    with contextlib.suppress(Exception):
        torch.cuda.synchronize(device)

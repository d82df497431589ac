"""Warm-up and capture: the two steps before a graph can replay.

Warm-up runs the function a few times on a side stream so that everything lazy happens outside
the recording: the caching allocator grows its blocks, cuBLAS creates its handles and
workspaces, cuDNN and Triton autotune, torch.compile compiles. Capture then records one call.

A capture that fails is turned into a :class:`~cudagraphs.errors.CaptureError` that names the
kind of failure in plain words, points at the user's line, and chains the original error. The
stream, the allocator and Python's gc are always restored, so the process stays usable.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CaptureError, ConfigError, CudaGraphsError, explain
from . import compat
from .active_capture import capturing
from .copy_nodes import CopyNodes, CopyNodesUnavailable, sources_for
from .copy_nodes import record as record_copies
from .failures import block_hint, classify_failure
from .frames import callable_name, failing_module, user_location
from .segments import Segments
from .splitter import KeptWrites, NeedsSplitting, Splitter, module_gaps
from .written_state import DeferredWriteRecorder

__all__ = [
    "Recording",
    "capture",
    "default_stream",
    "graphable",
    "place",
    "run_on_side_stream",
    "uncached_autocast",
    "warm_up",
]

log = logging.getLogger("cudagraphs")

_streams: dict[int, torch.cuda.Stream] = {}


def graphable(tensor: torch.Tensor) -> bool:
    """Whether a tensor can be a graph input: it lives in CUDA memory."""
    return tensor.is_cuda


def place(paths: list[str], tensors: list[torch.Tensor]) -> torch.device | str:
    """The CUDA device a call with these tensor inputs is captured on, or why it cannot be
    (a reason to run eagerly). Refuses inputs split across devices."""
    cuda = [t.device for t in tensors if graphable(t)]
    other = [(p, t.device) for p, t in zip(paths, tensors) if not graphable(t)]
    if cuda and other:
        path, device = other[0]
        raise ConfigError(
            explain(
                f"{path} is on {device} while other inputs are on {cuda[0]}",
                "a CUDA graph can only read CUDA memory; a CPU input would be frozen at capture",
                f"move {path} to {cuda[0]} before calling",
            )
        )
    if len(set(cuda)) > 1:
        raise ConfigError(
            explain(
                f"the inputs are on several CUDA devices: {sorted(set(map(str, cuda)))}",
                "one graph is recorded on one device",
                "move the inputs to one device, or capture one graph per device",
            )
        )
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if other:
        return f"the inputs are on {other[0][1]}, not CUDA"
    return cuda[0] if cuda else torch.device("cuda", torch.cuda.current_device())


def default_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream captures on ``device`` use: one per device, shared by every capture,
    because graphs that share a pool should be captured on the same stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


@contextlib.contextmanager
def uncached_autocast() -> Any:
    """Turn off autocast's weight-cast cache around warm-up and capture.

    Inside an autocast region entered *around* the graphed call, warm-up fills the cache with
    bf16/fp16 copies of the weights and the recording then reads those copies instead of casting:
    replays would never see updated weights, and read freed memory once the region ends. With
    the cache off the casts are recorded and run on every replay. (An autocast region inside the
    function is unaffected: its cache lives and dies within each call.)
    """
    if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
        with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False):
            yield
    else:
        yield


def run_on_side_stream(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], stream: Any
) -> Any:
    """One eager call on the capture stream, ordered after the caller's work and before what
    follows (no host sync): a warm-up call whose result is the caller's answer."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream), uncached_autocast():
        output = fn(*args, **kwargs)
    current.wait_stream(stream)
    return output


def warm_up(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    n: int,
    stream: torch.cuda.Stream,
    *,
    checked: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    after_each: Callable[[], None] | None = None,
) -> float:
    """Run ``fn`` ``n`` times on ``stream``; return the seconds it took (synchronized).
    ``checked()`` is entered around the runs and left before the wait for the GPU: ranks
    compare the collectives the runs issued there, so a rank that issued more raises instead
    of waiting forever for peers that never match them. ``after_each()`` runs after each run
    (the Python-state snapshot)."""
    start = time.perf_counter()
    stream.wait_stream(torch.cuda.current_stream())
    with checked(), torch.cuda.stream(stream), uncached_autocast():
        for _ in range(n):
            fn(*args, **kwargs)
            if after_each is not None:
                after_each()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return time.perf_counter() - start


@dataclass
class Recording:
    """A captured graph, what the function returned while being recorded, and its costs."""

    graph: Any  # torch.cuda.CUDAGraph, or segments.Segments when the function has eager steps
    output: Any
    capture_s: float
    pool_bytes: int
    copies: CopyNodes | None = None  # the inputs' copy-in nodes (copy_nodes.py), if recorded


def capture(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    stream: torch.cuda.Stream,
    pool: Any,
    capture_error_mode: str,
    segments: str = "split",
    eager_modules: Sequence[torch.nn.Module] = (),
    exclude: Sequence[torch.Tensor] = (),
    restore: bool = True,
    copy_inputs: Sequence[torch.Tensor] = (),
) -> Recording:
    """Record one call of ``fn`` into a new CUDA graph, or raise :class:`CaptureError`.

    An eager step reached while recording (``@cg.eager``, a module of ``eager_modules``) splits
    the recording into :class:`~.segments.Segments` (``segments="refuse"``: an error instead).
    Such a capture runs the function for real, so what it writes outside ``exclude`` (the
    inputs) is put back afterwards (unless ``restore`` is False: ``side_effects="keep"``).
    ``copy_inputs``: the static input buffers, whose copy-in the recording then holds as its
    first nodes (``copy_nodes``); captured again without them if they cannot be kept.
    """
    attempt = functools.partial(
        _capture, fn, args, kwargs, stream=stream, pool=pool,
        capture_error_mode=capture_error_mode, segments=segments, eager_modules=eager_modules,
    )  # fmt: skip

    def split_where_needed(copies: Sequence[torch.Tensor]) -> Recording:
        try:
            return attempt(writes=None, copy_inputs=copies)
        except NeedsSplitting:
            writes = DeferredWriteRecorder(exclude=exclude) if restore else KeptWrites()
            return attempt(writes=writes, copy_inputs=copies)

    try:
        return split_where_needed(copy_inputs)
    except CopyNodesUnavailable as why:
        log.info("cudagraphs: inputs copied with copy_ before each replay (%s)", why)
        return split_where_needed(())


def _capture(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    stream: torch.cuda.Stream,
    pool: Any,
    capture_error_mode: str,
    segments: str,
    eager_modules: Sequence[torch.nn.Module],
    writes: DeferredWriteRecorder | KeptWrites | None,
    copy_inputs: Sequence[torch.Tensor],
) -> Recording:
    device = stream.device
    torch.cuda.synchronize(device)
    # cuBLAS keeps one workspace per (handle, stream), allocated on first use. Warm-up ran on
    # this stream, so the recording would point at a workspace that lives outside the graph's
    # pool, and anyone who clears the workspaces later (torch.compile's reduce-overhead does, on
    # every recording) would free memory the graph still uses: an illegal memory access at the
    # next replay. Clearing them now makes the capture allocate its workspace inside its pool,
    # which lives as long as the graph. (PyTorch's cudagraph trees do the same.)
    compat.clear_cublas_workspaces()
    reserved_before = torch.cuda.memory_reserved(device)
    pending = sources_for(copy_inputs, range(len(copy_inputs)))  # outside the pool
    graph = compat.new_graph(keep=pending is not None)
    start = time.perf_counter()
    run = _record(
        fn, args, kwargs, graph, stream, pool, capture_error_mode, segments, eager_modules,
        writes, pending,
    )  # fmt: skip
    if writes is not None:
        torch.cuda.synchronize(device)
        writes.restore()  # the segmented capture ran the function: put its writes back
    if isinstance(run.failure, NeedsSplitting):
        _recover(torch.cuda.CUDAGraph(), device, stream)
        raise run.failure
    if run.failure is None and run.end_failure is None:
        torch.cuda.synchronize(device)
        # Drop the workspace map's reference to the block in our pool, so eager matmuls on this
        # stream do not share memory with the graph.
        compat.clear_cublas_workspaces()
        copies = None
        if pending is not None:
            recorded = run.recorded
            copies = CopyNodes(
                recorded.graphs[0] if isinstance(recorded, Segments) else recorded, pending
            )
        return Recording(
            graph=run.recorded,
            output=run.output,
            capture_s=time.perf_counter() - start,
            pool_bytes=torch.cuda.memory_reserved(device) - reserved_before,
            copies=copies,
        )
    _recover(graph, device, stream)
    raise _failed_capture(fn, run.failure, run.end_failure)


@dataclass
class _Run:
    """What one recording of the function gave: its output and the recording, or the error
    the function raised (``failure``) and the one ending the capture raised (``end_failure``)."""

    output: Any = None
    recorded: Any = None
    failure: BaseException | None = None
    end_failure: BaseException | None = None


def _record(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    graph: torch.cuda.CUDAGraph,
    stream: torch.cuda.Stream,
    pool: Any,
    capture_error_mode: str,
    segments: str,
    eager_modules: Sequence[torch.nn.Module],
    writes: DeferredWriteRecorder | KeptWrites | None,
    pending: Any,
) -> _Run:
    """Run ``fn`` once inside a capture on ``stream``; the capture always ends."""
    run = _Run()
    # A collection during capture could free a tensor whose memory the recording still uses
    # (or run __del__ code that syncs); keep the collector off for the duration.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    hooks = module_gaps(eager_modules)
    try:
        with torch.cuda.stream(stream), uncached_autocast():
            # A private pool of its own unless one is shared; named here, so that conditional
            # nodes recorded inside can route their bodies' allocations to it.
            pool = torch.cuda.graph_pool_handle() if pool is None else pool
            graph.capture_begin(pool, capture_error_mode=capture_error_mode)
            if pending is not None:
                record_copies(pending, stream)
            with capturing(pool, stream.device.index) as active:
                splitter = active.splitter = Splitter(
                    graph, pool, stream.device, capture_error_mode,
                    refuse=segments == "refuse", writes=writes, active=active,
                )  # fmt: skip
                try:
                    with writes if writes is not None else contextlib.nullcontext():
                        run.output = fn(*args, **kwargs)
                except BaseException as error:  # KeyboardInterrupt too: capture must still end
                    run.failure = error
                finally:
                    # Always end the capture, or the stream stays in capture mode and every
                    # later CUDA call in the process fails.
                    try:
                        if run.failure is None:
                            run.recorded = splitter.finish()
                        else:
                            splitter.abandon()
                    except BaseException as error:
                        run.end_failure = error
                    active.finish()
    finally:
        for hook in hooks:
            hook.remove()
        if gc_was_enabled:
            gc.enable()
    return run


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
    if kind in ("host-sync", "cpu-tensor"):
        fix += block_hint(failing_module(primary, top=fn))
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

"""Warm-up and capture, the two steps before a graph can replay, and the assembly of a ready
replay path (:func:`capture_graph`).

Warm-up runs the function a few times on a side stream so that everything lazy happens outside
the recording: the caching allocator grows its blocks, cuBLAS creates its handles and
workspaces, cuDNN and Triton autotune, torch.compile compiles. Capture then records one call.

A capture that fails is turned into a :class:`~cudagraphs.errors.CaptureError` that names the
kind of failure in plain words, points at the user's line, and chains the original error. The
stream, the allocator and Python's gc are always restored, so the process stays usable.

Around the runs (:func:`warm_up_and_capture`): the writes to tensors outside the inputs (``writes.SideEffects``: restored
after a warm-up on the library's own account), the plain Python values the function changes from run
to run (``frozen_state``: refused;
the values it read are guarded, ``python_values``), the inputs the function writes in place (their version
counters), and the collectives each rank issued (``collectives``: compared across ranks, since
ranks whose graphs differ would hang at the first replay).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from ..errors import CaptureError, ConfigError, CudaGraphsError, explain
from ..options import Options
from . import collectives, compat, python_values, segments, writes
from .active_capture import capturing
from .frames import block_hint, callable_name, classify_failure, failing_module, user_location
from .frozen_state import HostDraws, PythonSnapshot
from .guards import modules_of
from .launch import CopyNodes, CopyNodesUnavailable, sources_for
from .launch import record as record_copies
from .modes import Modes, outputs_needing_gradients, refuse_gradients
from .outputs import detach_outputs
from .replay import Counters, Replayer
from .segments import KeptWrites, NeedsSplitting, Segments, Splitter, module_gaps
from .signature import Signature
from .writes import DeferredWriteRecorder, Written

__all__ = [
    "Captured",
    "capture_graph",
    "Recording",
    "Run",
    "capture_call",
    "default_stream",
    "eager_modules",
    "graphable",
    "place",
    "run_on_side_stream",
    "uncached_autocast",
    "warm_up",
    "warm_up_and_capture",
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
    copies: CopyNodes | None = None  # the inputs' copy-in nodes (launch.py), if recorded


def capture_call(
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
        _capture_call, fn, args, kwargs, stream=stream, pool=pool,
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


def _capture_call(
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


_capture_lock = threading.RLock()  # one capture at a time per process: captures share streams


@dataclass
class Run:
    recording: Recording
    written: Written  # what warm-up wrote outside the inputs (put back under "restore")
    mutated: list[int]  # leaf indices of the inputs the function writes in place
    warmup_s: float
    # The plain values the capture read, checked before every replay (python_values.py).
    values: list[tuple[str, Any, str, Any]] = field(default_factory=list)


def warm_up_and_capture(
    fn: Any,
    signature: Signature,
    static: list[Any],
    options: Options,
    *,
    warmup: int,
    stream: Any,
    settled: bool,
    copy_inputs: bool = True,
) -> Run:
    """``warmup`` eager runs of ``fn`` on the static input leaves ``static``, then the capture.

    ``settled``: the function already ran for real before (the lazy form's eager calls), so
    the state before the capture counts as a settled run for the Python-state check.
    ``copy_inputs``: the recording copies the inputs in itself (``copy_nodes``); off where a
    caller fills the static inputs itself before each replay (buckets).
    """
    name = callable_name(fn)
    args, kwargs = optree.tree_unflatten(signature.spec, static)
    inputs = [static[i] for i in signature.tensor_index]
    roots = [static[i] for i in signature.frozen_index]
    plain = PythonSnapshot(fn, roots, options.harmless_state)
    host = HostDraws(name, options.harmless_state)
    after_each = lambda: (plain.take(), host.take())  # noqa: E731
    if settled:
        after_each()
    with _capture_lock:
        effects = writes.SideEffects(fn, inputs, roots, options.side_effects if warmup else "keep")
        with effects.running():
            warmup_s = warm_up(
                fn, args, kwargs, warmup, stream,
                checked=functools.partial(collectives.compared_across_ranks, f"{name} (warm-up)"),
                after_each=after_each,
            )  # fmt: skip
        written = effects.finish()
        writes.report(effects, fn)
        versions = [compat.version(x) for x in inputs]
        shared = options.pool
        # Ranks whose graphs hold different collectives would hang at the first replay.
        reader = python_values.Reader(of=fn)
        with collectives.compared_across_ranks(name), reader:
            recording = capture_call(
                fn,
                args,
                kwargs,
                stream=stream,
                pool=shared.handle if hasattr(type(shared), "handle") else shared,
                capture_error_mode=options.capture_error_mode,
                segments=options.segments,
                eager_modules=eager_modules(fn, options),
                exclude=inputs,
                restore=options.side_effects != "keep",
                copy_inputs=inputs if copy_inputs else (),
            )
        after_each()
        values = python_values.read_values(
            reader, plain.runs[-1], options.harmless_state, plain.objects
        )
        segments.announce(recording.graph, name)
        if hasattr(type(shared), "record"):
            shared.record(recording.pool_bytes)
        # Values the runs changed go back only where the runs were the library's own.
        plain.check(restore=bool(warmup) and options.side_effects == "restore")
        host.check()
    mutated = [
        i
        for i, x, before in zip(signature.tensor_index, inputs, versions)
        if compat.version(x) != before
    ]
    return Run(recording, written, mutated, warmup_s, values)


def eager_modules(fn: Any, options: Options) -> list[torch.nn.Module]:
    """The modules the ``eager`` option names: instances as given, classes matched against
    every module ``fn`` uses. A class that matches nothing is a mistake worth an error."""
    if not options.eager:
        return []
    used = [m for root in modules_of(fn, options.modules) for m in root.modules()]
    found: list[torch.nn.Module] = []
    for entry in options.eager:
        if isinstance(entry, torch.nn.Module):
            matches = [entry]
        else:
            matches = [m for m in used if isinstance(m, entry)]
            if not matches:
                raise ConfigError(
                    explain(
                        f"eager=[{entry.__name__}] matches no module of {callable_name(fn)}",
                        "the option names the modules that run eagerly between two graphs",
                        "check the class (type(model.layers[0].mlp)), or pass the module itself",
                    )
                )
        found += [m for m in matches if all(m is not f for f in found)]
    # A module inside another eager module runs inside that one's gap already.
    inside = {id(sub) for m in found for sub in m.modules() if sub is not m}
    return [m for m in found if id(m) not in inside]


@dataclass
class Captured:
    """A graph ready to replay: its replay path, its static inputs arranged like the example
    call, and what the runs found."""

    replayer: Replayer
    inputs: tuple[Any, ...]
    input_kwargs: dict[str, Any]
    run: Run
    static_input_bytes: int


def capture_graph(
    fn: Any,
    signature: Signature,
    leaves: list[Any],
    options: Options,
    *,
    device: torch.device,
    warmup: int,
    settled: bool,
    adopt_inputs: bool,
    counters: Counters,
    grad_sources: list[torch.Tensor] | None,
) -> Captured:
    """Warm up, record and classify one call of ``fn`` on the example ``leaves``, and build its
    replay path. ``grad_sources`` is ``None`` for a recording that runs its own backward (a
    training step); otherwise the tensors whose ``requires_grad`` a replay must refuse."""
    name = callable_name(fn)
    # 1. The caller's modes: what every replay is checked against.
    modes = Modes(name)
    # 2. Static input buffers: clones of the examples, so that warm-up never touches the
    #    examples. Normal (not inference) tensors, so that in-place writes by the function show
    #    in their version counters. A layer above that owns its buffers (buckets) adopts them.
    static = list(leaves)
    if not adopt_inputs:
        with torch.inference_mode(False), torch.no_grad():
            for i in signature.tensor_index:
                static[i] = leaves[i].detach().clone()
    # 3. Warm-up on a side stream, then the recording, with what the runs changed put back.
    run = warm_up_and_capture(
        fn, signature, static, options, warmup=warmup,
        stream=options.stream or default_stream(device), settled=settled,
        copy_inputs=not adopt_inputs,
    )  # fmt: skip
    recording = run.recording
    # 4. Classify the outputs: eager's carry a gradient path where a replay's never would.
    why = None if grad_sources is None else outputs_needing_gradients(recording.output)
    if why is not None and modes.seen["grad mode"] == "on":
        refuse_gradients(name, why)
    # 5. The replay path; the graphs of one pool share memory, so they keep one stream order.
    shared = options.pool
    order = shared.stream_order(device.index) if hasattr(type(shared), "stream_order") else None
    replayer = Replayer(
        recording.graph, signature, static, run.mutated, detach_outputs(recording.output),
        options.outputs, counters, modes=modes, timeout_s=options.replay_timeout_s, name=name,
        copies=recording.copies, device=device.index, grad_sources=grad_sources, order=order,
    )  # fmt: skip
    args, kwargs = optree.tree_unflatten(signature.spec, static)
    input_bytes = sum(static[i].nbytes for i in signature.tensor_index)
    return Captured(replayer, args, kwargs, run, input_bytes)

"""``cg.bench``: the ways to run one function, measured side by side in one run.

Honest by construction: every mode is checked against eager on the same fresh inputs before it
is timed; each call is timed with a synchronize (a figure without one measures the launch
queue); modes are interleaved window by window so drift hits all alike; the inputs rotate over
several sets so no cache flatters a mode; and the set-up cost (warm-up, compile, capture) is
reported next to the per-call saving, as the number of calls it takes to pay for itself.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..core import NAMESPACE
from ..diagnose import random_like
from ..errors import ConfigError, explain
from .profiling import profile as run_profile
from .report import BenchReport, ModeResult, Spread
from .timing import sync

__all__ = ["MODES", "bench"]

MODES = ("eager", "compile", "reduce-overhead", "cudagraphs", "cudagraphs+compile")
_NEEDS_CUDA = {"reduce-overhead", "cudagraphs", "cudagraphs+compile"}
_FIRST_CALLS = 5  # set-up is measured over these; their steady-state share is subtracted


def bench(
    fn: Callable[..., Any],
    /,
    *args: Any,
    modes: Sequence[str] | None = None,
    extra_modes: Mapping[str, Callable[..., Any]] | None = None,
    compile_mode: str = "max-autotune-no-cudagraphs",
    input_sets: int = 4,
    calls: int = 50,
    windows: int = 5,
    check: bool = True,
    no_grad: bool = True,
    profile: bool = True,
    console: Console | None = None,
    name: str | None = None,
    **kwargs: Any,
) -> BenchReport:
    """Benchmark ``fn(*args, **kwargs)`` eagerly, compiled, and graphed, side by side.

    Modes: ``eager``; ``compile`` (``torch.compile``, default mode); ``reduce-overhead``
    (``torch.compile(mode="reduce-overhead")``); ``cudagraphs`` (``cg.graph``); and
    ``cudagraphs+compile`` (``cg.graph`` over ``torch.compile(mode=compile_mode)``: Inductor's
    fusion with our replay path). ``extra_modes`` adds callables you built (same signature).

    For each: max error against eager on fresh inputs (``check=False`` for functions whose output
    is random or that keep state), wall time per call (p10/median/p90, synchronized), GPU time per
    call from CUDA events, CPU time to issue a call, throughput, set-up seconds, extra GPU memory,
    and the break-even number of calls. With ``profile=True`` the kernel floor from
    :func:`cudagraphs.profile` is included. Inference by default (``no_grad=True``).

    Right::

        report = cg.bench(model, x, modes=["eager", "cudagraphs"])
        print(report.speedup("cudagraphs"))     # side by side, same run, same inputs
        report.to_json("bench.json"); report.plot("bench.png")

    Wrong: timing ``for _ in range(n): g(x)`` without ``torch.cuda.synchronize()``, or comparing a
    figure from today with one from yesterday (absolute times move; ratios in one run do not).
    """
    console = console or Console(stderr=True)
    selected = _modes(modes)
    cuda = torch.cuda.is_available()
    name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
    notes: list[str] = []
    if not cuda:
        notes.append("no CUDA: graph modes skipped, wall-clock timing only")
    grad = torch.no_grad() if no_grad else torch.enable_grad()
    with grad:
        sets = [(args, kwargs)] + [_fresh(args, kwargs) for _ in range(max(input_sets, 1) - 1)]
        results: dict[str, ModeResult] = {}
        calls_of: dict[str, Callable[[Any], Any]] = {}
        expected = [_snapshot(fn(*a, **k)) for a, k in sets] if check else None
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress:
            builders = [(m, None) for m in selected] + list((extra_modes or {}).items())
            for mode, custom in builders:
                task = progress.add_task(f"setting up {mode} (warm-up, compile, capture)")
                result, call = _set_up(mode, custom, fn, sets, cuda, compile_mode)
                progress.remove_task(task)
                results[mode] = result
                if call is not None:
                    calls_of[mode] = call
            if expected is not None:
                _check_all(calls_of, results, sets, expected)
            task = progress.add_task(f"timing {len(calls_of)} modes side by side")
            _time(calls_of, results, sets, calls, windows, cuda)
            progress.remove_task(task)
        floor = _kernel_floor(fn, args, kwargs, results, cuda, notes) if profile else None
    _break_even(results)
    if not check:
        notes.append("outputs not compared (check=False)")
    return BenchReport(
        name=name,
        device=torch.cuda.get_device_name() if cuda else "cpu",
        torch_version=torch.__version__,
        input_sets=len(sets),
        results=[results[m] for m in results],
        profile=floor,
        notes=notes,
    )


def _check_all(
    calls_of: dict[str, Callable[[Any], Any]],
    results: dict[str, ModeResult],
    sets: list[tuple[tuple[Any, ...], dict[str, Any]]],
    expected: list[Any],
) -> None:
    """Compare every mode with eager on every input set; a mode that disagrees (or fails) is
    reported with the reason and not timed."""
    for mode, call in list(calls_of.items()):
        error = _check(call, sets, expected)
        if isinstance(error, str):
            results[mode].error = error
            del calls_of[mode]
            continue
        results[mode].max_abs_error = error


def _kernel_floor(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: dict[str, ModeResult],
    cuda: bool,
    notes: list[str],
) -> Any:
    """The profile's kernel floor, or ``None`` with a note when profiling failed."""
    try:
        # With a graph mode in the run, also measure the replay's own GPU time, so the floor
        # can be read against it.
        replay = cuda and any(m.startswith("cudagraphs") for m in results)
        return run_profile(fn, *args, replay=replay, **kwargs)
    except Exception as failure:  # a profile must never lose the benchmark itself
        notes.append(f"profile failed: {type(failure).__name__}: {failure}")
        return None


def _modes(modes: Sequence[str] | None) -> list[str]:
    selected = list(MODES if modes is None else modes)
    unknown = [m for m in selected if m not in MODES]
    if unknown or isinstance(modes, str):
        raise ConfigError(
            explain(
                f"modes must be a list drawn from {list(MODES)}; got {modes!r}",
                "each mode is one way of running the function",
                "pass modes=['eager', 'cudagraphs'] (or leave it out for all five); add your own "
                "callables with extra_modes={'name': fn}",
            )
        )
    if "eager" not in selected:
        selected.insert(0, "eager")  # the baseline every ratio is taken against
    return selected


def _fresh(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Another input set of the same shapes: random values in the example's range."""
    return optree.tree_map(
        lambda x: random_like(x) if isinstance(x, torch.Tensor) else x,
        (args, kwargs),
        namespace=NAMESPACE,
    )


def _snapshot(output: Any) -> list[torch.Tensor]:
    leaves = optree.tree_leaves(output, namespace=NAMESPACE)
    return [t.detach().clone() for t in leaves if isinstance(t, torch.Tensor)]


def _set_up(
    mode: str,
    custom: Callable[..., Any] | None,
    fn: Callable[..., Any],
    sets: list[Any],
    cuda: bool,
    compile_mode: str,
) -> tuple[ModeResult, Callable[[Any], Any] | None]:
    result = ModeResult(mode)
    if custom is None and mode in _NEEDS_CUDA and not cuda:
        result.error = "needs CUDA"
        return result, None
    sync()
    if cuda:
        torch.cuda.empty_cache()  # a clean baseline: what this mode reserves, not what others freed
    before = torch.cuda.memory_reserved() if cuda else 0
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            target = custom if custom is not None else _build(mode, fn, sets[0], compile_mode)

            def call(inputs: Any, target: Callable[..., Any] = target) -> Any:
                return target(*inputs[0], **inputs[1])

            # Compiling, recording and capturing happen in the first calls for some modes
            # (reduce-overhead records on the third, cg.train_step captures on the fourth).
            for i in range(_FIRST_CALLS):
                call(sets[i % len(sets)])
            sync()
    except Exception as failure:
        result.error = f"{type(failure).__name__}: {str(failure).splitlines()[0][:160]}"
        return result, None
    result.setup_s = time.perf_counter() - start  # steady-state calls are subtracted later
    result.extra_memory_bytes = (torch.cuda.memory_reserved() - before) if cuda else None
    return result, call


def _build(
    mode: str, fn: Callable[..., Any], example: Any, compile_mode: str
) -> Callable[..., Any]:
    from ..api import graph

    args, kwargs = example
    if mode == "eager":
        return fn
    if mode == "compile":
        return torch.compile(fn)
    if mode == "reduce-overhead":
        return torch.compile(fn, mode="reduce-overhead")
    if mode == "cudagraphs":
        return graph(fn, *args, **kwargs)
    return graph(torch.compile(fn, mode=compile_mode), *args, **kwargs)


def _check(call: Callable[[Any], Any], sets: list[Any], expected: list[Any]) -> float | str:
    worst = 0.0
    for inputs, reference in zip(sets, expected):
        got = _snapshot(call(inputs))
        if len(got) != len(reference):
            return f"returned {len(got)} tensors, eager {len(reference)}"
        for g, e in zip(got, reference):
            if g.shape != e.shape:
                return f"output shape {tuple(g.shape)} differs from eager {tuple(e.shape)}"
            if g.is_floating_point():
                diff = (g.float() - e.float()).abs().max().item() if g.numel() else 0.0
                tol = 1e-2 if g.dtype in (torch.float16, torch.bfloat16) else 1e-3
                scale = e.float().abs().max().item() if e.numel() else 0.0
                if not diff <= tol * max(1.0, scale):
                    return f"differs from eager by {diff:.2e}"
            else:
                diff = float((g != e).sum().item())
                if diff:
                    return f"{diff:.0f} integer outputs differ from eager"
            worst = max(worst, diff)
    return worst


def _time(
    calls_of: dict[str, Callable[[Any], Any]],
    results: dict[str, ModeResult],
    sets: list[Any],
    calls: int,
    windows: int,
    cuda: bool,
) -> None:
    wall: dict[str, list[float]] = {m: [] for m in calls_of}
    gpu: dict[str, list[float]] = {m: [] for m in calls_of}
    cpu: dict[str, list[float]] = {m: [] for m in calls_of}
    thr: dict[str, list[float]] = {m: [] for m in calls_of}
    events = (
        [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(calls)
        ]
        if cuda
        else []
    )
    for window in range(windows + 1):  # window 0 warms every mode up and is discarded
        for mode, call in calls_of.items():
            w, c = [], []
            for i in range(calls):
                inputs = sets[i % len(sets)]
                sync()
                start = time.perf_counter()
                if cuda:
                    events[i][0].record()
                call(inputs)
                if cuda:
                    events[i][1].record()
                issued = time.perf_counter()
                sync()
                w.append((time.perf_counter() - start) * 1e6)
                c.append((issued - start) * 1e6)
            sync()
            start = time.perf_counter()
            for i in range(calls):
                call(sets[i % len(sets)])
            sync()
            if window == 0:
                continue
            thr[mode].append((time.perf_counter() - start) / calls * 1e6)
            wall[mode] += w
            cpu[mode] += c
            if cuda:
                gpu[mode] += [s.elapsed_time(e) * 1e3 for s, e in events]
    for mode in calls_of:
        r = results[mode]
        r.wall = Spread.of(wall[mode])
        r.latency = Spread.of(gpu[mode]) if cuda else None
        r.cpu_us = statistics.median(cpu[mode])
        r.throughput_us = statistics.median(thr[mode])
        if r.setup_s is not None:
            r.setup_s = max(0.0, r.setup_s - _FIRST_CALLS * r.wall.median * 1e-6)


def _break_even(results: dict[str, ModeResult]) -> None:
    eager = results.get("eager")
    if eager is None or eager.wall is None:
        return
    for r in results.values():
        if r.mode == "eager" or r.wall is None or r.setup_s is None:
            continue
        saving_s = (eager.wall.median - r.wall.median) * 1e-6
        extra_setup = max(0.0, r.setup_s - (eager.setup_s or 0.0))
        r.break_even_calls = extra_setup / saving_s if saving_s > 0 else math.inf

"""``cg.auto``: try the ways of graphing a function, verify each against eager, keep the fastest.

Right::

    fast = cg.auto(model, x)         # a callable with cg.graph's guarantees
    print(fast.report)               # one row per way tried: µs, speed-up, verified, build s
    y = fast(x_new)

Wrong: ``cg.auto`` inside a request loop. It times candidates (seconds, cold); build it once at
start-up. A second process finds the decision saved on disk and builds only the chosen way.

The candidates, where they apply:

- ``graph``: ``cg.graph(fn, *example)``, the plain graph;
- ``graph over compile``: ``cg.graph(fn, *example, compile=True)``, Inductor's fused kernels in
  one graph;
- ``segments``: where the plain graph cannot record a step (a host read such as ``.item()`` or
  ``.tolist()``), ``cg.graph(fn, *example, eager=[...])`` with the innermost module holding each
  such step run eagerly between graphs (the module named by the capture error's ``block``);
- ``backend``: ``torch.compile(fn, backend=cg.backend)``, each piece Dynamo traces fused and
  graphed, the Python between pieces eager (graph breaks at host reads);
- ``buckets``: ``cg.graph(fn, *example, buckets=...)`` when the caller declares varying sizes.

First the eager call is profiled (kernels per call, the share of time the GPU sits idle: is it
launch-bound?) and ``cg.doctor`` lists what in it a graph cannot record (its findings go in the
report). Then each candidate is built (its build seconds counted), compared with eager on fresh random inputs from the
same state (``verify`` rounds; a difference rejects it), and timed side by side with eager; the
fastest verified one is built once more after the others are released (as a second process
would build it) and checked against eager once, and eager is kept when none is faster. What the function can reach
(buffers, a cache, parameters) is copied before and put back after, so deciding does not move
the state the function advances (it costs that copy's memory while deciding). The decision is saved in
``saved_steps_folder()/auto``, keyed by the function's code, its model's config and parameter
layout, the example's shapes, the versions and the GPU (the folder follows the saved compiled
steps' ownership rule).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import inspect
import json
import platform
import sys
import time
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from ..api import graph
from ..core import (
    READS_LIKE,
    Reader,
    TensorSnapshot,
    ValueWatch,
    callable_name,
    compat,
    flatten,
    is_plain,
    math_settings,
    modules_of,
    reachable_tensors,
    read_values,
)
from ..decoding import compile_settings
from ..diagnose import compare_with_eager, doctor, random_like
from ..errors import CaptureError, ConfigError, CudaGraphsWarning, explain
from ..integrations import SavedCompile, backend, saved_steps_folder, untrusted, write_whole
from ..options import OPTION_NAMES, split_options
from .profiling import profile
from .timing import measure_side_by_side

__all__ = ["CANDIDATES", "Auto", "AutoReport", "Candidate", "auto"]

CANDIDATES = ("graph", "graph over compile", "segments", "backend", "buckets")


@dataclasses.dataclass
class Candidate:
    """One way tried: its latency (µs per call, synchronized), speed-up over eager, whether it
    matched eager, why it was rejected, and what building it cost."""

    name: str
    us: float | None = None
    speedup: float | None = None
    verified: bool = False
    rejected: str = ""
    build_s: float = 0.0


@dataclasses.dataclass
class AutoReport:
    """What ``cg.auto`` tried and chose; ``str()`` is a table, :meth:`to_json` the same data."""

    function: str
    chosen: str
    reason: str
    eager_us: float | None = None
    candidates: list[Candidate] = dataclasses.field(default_factory=list)
    #: The eager call profiled: kernels per call, and the share of its synchronized wall time
    #: in which no kernel ran (high: launch-bound, what a graph removes).
    kernels_per_call: float | None = None
    gpu_idle: float | None = None
    #: ``cg.doctor``'s findings on the eager call, one line each (host reads, syncs, ...).
    findings: list[str] = dataclasses.field(default_factory=list)
    decision_s: float = 0.0
    from_disk: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def __str__(self) -> str:
        rows = [f"cg.auto({self.function}): {self.chosen} ({self.reason})"]
        if self.eager_us is not None:
            rows.append(f"  eager: {self.eager_us:.1f} µs per call")
        if self.kernels_per_call is not None and self.gpu_idle is not None:
            rows.append(
                f"  eager profile: {self.kernels_per_call:.0f} kernels per call, GPU idle "
                f"{self.gpu_idle:.0%} of the wall time"
                + (" (launch-bound)" if self.gpu_idle >= 0.3 else "")
            )
        rows += [f"  doctor: {line}" for line in self.findings]
        rows.append(f"  {'candidate':<20} {'µs':>9} {'vs eager':>9} {'verified':>9} {'build s':>8}")
        for c in self.candidates:
            us = f"{c.us:.1f}" if c.us is not None else "-"
            ratio = f"{c.speedup:.2f}x" if c.speedup is not None else "-"
            state = "yes" if c.verified else ("no: " + c.rejected if c.rejected else "no")
            rows.append(f"  {c.name:<20} {us:>9} {ratio:>9} {state:>9} {c.build_s:>8.1f}")
        source = "saved decision" if self.from_disk else f"decided in {self.decision_s:.1f} s"
        rows.append(f"  ({source})")
        return "\n".join(rows)


class Auto:
    """The chosen way of running ``fn``; call it like ``fn``. ``report``: what was tried."""

    def __init__(self, call: Callable[..., Any], report: AutoReport) -> None:
        self.call = call
        self.report = report
        self.__wrapped__ = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<cudagraphs.Auto {self.report.function}: {self.report.chosen}>"


#: ``cg.auto``'s own keyword parameters (the rest are the example's keyword arguments).
_AUTO_PARAMETERS = ("candidates", "buckets", "verify", "budget_s", "reuse")


def auto(
    fn: Callable[..., Any],
    *example_args: Any,
    candidates: Sequence[str] = CANDIDATES,
    buckets: Any = None,
    verify: int = 3,
    budget_s: float = 120.0,
    reuse: bool = True,
    **example_kwargs: Any,
) -> Auto:
    """Build each applicable candidate, verify it against eager, time it, keep the fastest.

    ``candidates``: which of :data:`CANDIDATES` to try. ``buckets``: the varying sizes, as for
    ``cg.graph`` (the ``buckets`` candidate runs only with it). ``verify``: rounds of fresh
    random inputs each candidate must match eager on. ``budget_s``: candidates not started
    within this many seconds are skipped (and say so). ``reuse``: use a decision saved by an
    earlier process for the same function, model, example shapes, versions and GPU.

    Any other keyword is an example keyword argument of ``fn``: one ``fn`` does not take
    raises :class:`ConfigError` with "did you mean" (``cg.auto(model, x, verfy=5)``), and so
    does an option of ``cg.graph`` (``warmup=3``: ``cg.auto`` sets the options of what it
    builds itself).
    """
    _, example_kwargs = split_options(
        fn,
        example_kwargs,
        allowed=(),
        extra=_AUTO_PARAMETERS,
        entry="cg.auto",
        elsewhere={"cg.graph(...)": [o for o in OPTION_NAMES if o not in _AUTO_PARAMETERS]},
    )
    unknown = [c for c in candidates if c not in CANDIDATES]
    if unknown or not candidates:
        raise ConfigError(
            explain(
                f"cg.auto got candidates={list(candidates)!r}",
                f"the ways it knows are {', '.join(CANDIDATES)}",
                "pass a subset of cudagraphs.tools.choosing.CANDIDATES, or leave it out",
            )
        )
    name = callable_name(fn)
    start = time.perf_counter()
    tensors = [x for x in flatten((example_args, example_kwargs))[0] if isinstance(x, torch.Tensor)]
    if not torch.cuda.is_available() or not any(t.is_cuda for t in tensors):
        why = "no CUDA" if not torch.cuda.is_available() else "the inputs are on the CPU"
        report = AutoReport(name, "eager", f"{why}: graphs need CUDA tensors")
        report.findings = _findings(fn, example_args, example_kwargs)
        return Auto(fn, report)
    key = _decision_key(fn, example_args, example_kwargs, candidates, buckets)
    saved = _load(key) if reuse else None
    if saved is not None:
        call = _build(saved.chosen, fn, example_args, example_kwargs, buckets, key)
        return Auto(call, dataclasses.replace(saved, from_disk=True))
    # Profiling and timing run the function hundreds of times: what it can reach (buffers, a
    # cache, parameters a training step updates) is copied now and put back at the end.
    plain = [
        x for x in flatten((example_args, example_kwargs))[0] if not isinstance(x, torch.Tensor)
    ]
    state = TensorSnapshot(reachable_tensors(fn, plain, exclude=tensors))
    try:
        report, call = _decide(
            fn, example_args, example_kwargs, candidates, buckets, verify, budget_s, key
        )
    finally:
        state.restore()
    report.decision_s = time.perf_counter() - start
    _save(key, report)
    return Auto(call, report)


def _decide(
    fn: Callable[..., Any], example_args: tuple[Any, ...], example_kwargs: dict[str, Any],
    candidates: Sequence[str], buckets: Any, verify: int, budget_s: float, key: str,
) -> tuple[AutoReport, Callable[..., Any]]:  # fmt: skip
    """Profile the eager call, build, verify and time the candidates; the report and the
    fastest verified way (``fn`` itself when none beats eager)."""
    start = time.perf_counter()
    findings = _findings(fn, example_args, example_kwargs)
    measured = profile(fn, *_clones(example_args), calls=10, **_clones(example_kwargs))
    rows: list[Candidate] = []
    calls: dict[str, Callable[..., Any]] = {}
    for candidate in candidates:
        row = Candidate(candidate)
        rows.append(row)
        if candidate == "buckets" and buckets is None:
            row.rejected = "no buckets= given"
            continue
        if time.perf_counter() - start > budget_s:
            row.rejected = f"over the {budget_s:.0f} s budget"
            continue
        built = time.perf_counter()
        try:
            calls[candidate] = _built_and_checked(
                candidate, fn, example_args, example_kwargs, buckets, key, verify
            )
        except _NotApplicable as error:
            row.rejected = str(error)
            continue
        except Exception as error:  # a way that fails or differs is a rejected row, not an end
            row.rejected = _one_line(error)
            continue
        finally:
            row.build_s = time.perf_counter() - built
        row.verified = True
    eager_us, timed = _time(fn, calls, example_args, example_kwargs)
    for row in rows:
        if row.name in timed:
            row.us = timed[row.name]
            row.speedup = eager_us / row.us
    verified = [r for r in rows if r.verified and r.us is not None]
    best = min(verified, key=lambda r: r.us or 0.0, default=None)
    if best is None or (best.us or 0.0) >= eager_us:
        chosen, reason, call = "eager", "no verified candidate is faster than eager", fn
    else:
        chosen, reason = best.name, "the fastest verified candidate"
        calls.clear()  # the candidates' graphs and pools go before the chosen way is built again
        gc.collect()
        try:
            call = _built_and_checked(chosen, fn, example_args, example_kwargs, buckets, key, 1)
        except Exception as error:  # it matched eager when first built: say so, answer eagerly
            chosen, call = "eager", fn
            reason = f"{best.name} was fastest but failed when built again: {_one_line(error)}"
    report = AutoReport(
        callable_name(fn), chosen, reason, eager_us,
        kernels_per_call=measured.kernels_per_call, gpu_idle=measured.gpu_idle_fraction,
        findings=findings, candidates=rows,
    )  # fmt: skip
    return report, call


def _built_and_checked(
    candidate: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
    buckets: Any, key: str, rounds: int,
) -> Callable[..., Any]:  # fmt: skip
    """``candidate`` built, called twice (lazy pieces capture on early calls) and compared
    with eager on ``rounds`` fresh inputs.

    The chosen way goes through this twice: once among the candidates, and once more after
    they are released, as a second process builds it from the saved decision. Why not keep the
    one that was timed: it was built among the others, often first in the process, and a graph
    captured first in a process can replay slower than the same graph captured later
    (``benchmarks/experiments/first_graph.py``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CudaGraphsWarning)
        call = _build(candidate, fn, args, kwargs, buckets, key)
        call(*args, **kwargs)
        call(*args, **kwargs)
        compare_with_eager(call, fn, args, kwargs, rounds)
    return call


def _one_line(error: BaseException) -> str:
    """An exception as one line for the report: its type and its message's first line, whole
    (nothing after the colon when the message is empty)."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _clones(tree: Any) -> Any:
    leaves, spec = flatten(tree)
    return optree.tree_unflatten(
        spec, [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
    )


def _findings(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """``cg.doctor``'s findings, one line each; a doctor that cannot run says why in one line."""
    try:
        report = doctor(fn, *args, **kwargs)
    except Exception as error:  # the report is advice; the candidates still decide
        return [f"the doctor could not run: {_one_line(error)}"]
    # Whole lines: a report written to a file or read as JSON is never cut.
    return [f"{f.kind} at {f.location}: {' '.join(f.message.split())}" for f in report.findings]


def _build(
    candidate: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
    buckets: Any, key: str,
) -> Callable[..., Any]:  # fmt: skip
    if candidate == "eager":
        return fn
    if candidate == "graph":
        return graph(fn, *args, **kwargs)
    if candidate == "graph over compile":
        target = getattr(fn, "_orig_mod", fn)
        if not kwargs:
            return _graph_over_saved_compile(fn, target, args, key)
        return graph(fn, *args, compile=True, **kwargs)
    if candidate == "segments":
        return _graph_around_host_reads(fn, args, kwargs)
    if candidate == "backend":
        return torch.compile(fn, backend=backend, dynamic=False)
    return graph(fn, *args, buckets=buckets, **kwargs)


def _call_target(target: Callable[..., Any], *args: Any) -> Any:
    """What the saved compile traces: the model (a module, or any object with ``__call__``) as
    an argument, so that its parameters and plain values are the trace's inputs and guards
    (which a loaded entry checks), not constants."""
    return target(*args)


def _graph_over_saved_compile(
    fn: Callable[..., Any], target: Callable[..., Any], args: tuple[Any, ...], key: str
) -> Callable[..., Any]:
    """``cg.graph`` over ``torch.compile``, the compile saved to disk (``SavedCompile``, keyed
    by the decision): a later process loads it instead of tracing the model again.

    A loaded compile runs none of the model's Python, so the graph's value guard would see no
    value the model reads (``model.scale``): one eager run of ``fn`` notes the code the
    compile stands in for (``READS_LIKE``), its state put back after.

    A saved entry's own guards cannot name module globals, nor which function or class the
    model holds (``aot_compile`` drops those guards). So the plain globals that code read
    (``GAIN = 2.0`` in the model's module) and the model's :func:`_identities` are part of the
    file's key, and once either differs from this build's, the step is compiled by
    ``torch.compile``, whose guards check them, instead of running the saved entries: the
    graph's value guard captures again on a changed global, and the new capture must not
    replay the old value."""
    tensors = [x for x in args if isinstance(x, torch.Tensor)]
    plain = [x for x in args if not isinstance(x, torch.Tensor)]
    state = TensorSnapshot(reachable_tensors(fn, plain, exclude=tensors))
    try:
        with Reader() as reader:
            fn(*args)
    finally:
        state.restore()
    # Globals only (attributes are the entry's guards, closures the graph's own value guard's)
    read = [v for v in read_values(reader, {}) if v[0].startswith("global ")]
    globals_read = ValueWatch(read)
    identities = _identities(target)
    settings = compile_settings(True)
    try:
        inductor = compat.compile_cache()[1]  # Inductor's settings, which the kernels follow
    except (ImportError, AttributeError):
        inductor = ""
    step_key = hashlib.sha256(
        json.dumps(
            [key, repr(sorted((settings["options"] or {}).items())), settings["mode"], inductor,
             sorted(math_settings().items()), torch.are_deterministic_algorithms_enabled(),
             [(label, _key_text(value)) for label, _, _, value in read], identities]
        ).encode()
    ).hexdigest()[:32]  # fmt: skip
    traced = compat.with_builtins_in_globals(_call_target)
    # Any model, so no config names what its attributes hold: only a trace whose saved guards
    # check everything it read off the model is saved.
    unnamed = next((path for path, name in identities if not name), "")
    unnamed = unnamed or next((label for label, _, _, v in read if not _key_text(v)), "")
    saved = SavedCompile(
        traced, settings, dynamic=False, key=f"auto-{step_key}",
        keyed_identities={n for _, names in identities for n in names.split(" ") if n},
        unsaved=f"{unnamed} holds a function with no importable name" if unnamed else "",
    )  # fmt: skip
    # torch.compile, once a global read or an identity differs from this build's
    guarded: list[Callable[..., Any]] = []

    def compiled(*call_args: Any) -> Any:
        if not guarded and globals_read.stale() is None and _identities(target) == identities:
            return saved(target, *call_args)
        if not guarded:
            guarded.append(torch.compile(traced, dynamic=False, **settings))
        return guarded[0](target, *call_args)

    setattr(compiled, READS_LIKE, reader.codes)
    return graph(compiled, *args)


def _key_text(value: Any) -> str:
    """How a value the model read keys a saved file, the same in every process: a plain
    value's repr, a function's importable name ("" for one without: a lambda, a partial)."""
    return repr(value) if is_plain(value) else compat.qualified_name(value)


def _identities(model: Any) -> list[tuple[str, str]]:
    """What a saved compile's guards check only by identity, which they cannot write, so the
    saved file is keyed by it: ``(path, importable name)`` of every class, function and method
    the model holds (in attributes, containers, ``functools.partial``, ``__slots__``), and
    ``(path.__class__, names)`` of each object it is made of (its class and the classes that
    class derives from, separated by spaces). The name is "" for a function or class that
    another process could not find by name (a lambda); such a model's compile is not saved."""
    found: list[tuple[str, str]] = []
    seen: set[int] = set()
    stack: list[tuple[str, Any, int]] = [("model", model, 0)]
    while stack and len(found) < 20000:
        path, obj, depth = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, str, bytes, int, float, bool)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
            found.append((path, compat.qualified_name(obj)))
            continue
        if obj is None or depth > 12:
            continue
        kind = type(obj)  # named even where defined inside a function: only keys the file
        mro = " ".join(f"{c.__module__}.{c.__qualname__}" for c in kind.__mro__[:-1])
        found.append((f"{path}.__class__", mro))
        if isinstance(obj, dict):
            children = [(f"{path}[{k!r}]", v) for k, v in list(obj.items())[:1000]]
        elif isinstance(obj, (list, tuple)):
            children = [(f"{path}[{k}]", v) for k, v in enumerate(obj[:1000])]
        elif isinstance(obj, functools.partial):
            children = [(f"{path}.func", obj.func), (f"{path}.args", obj.args)]
            children += [(f"{path}.keywords", obj.keywords)]
        else:
            names = [n for c in kind.__mro__ for n in getattr(c, "__slots__", ())]
            children = [(f"{path}.{n}", getattr(obj, n)) for n in names if hasattr(obj, n)]
            if isinstance(getattr(obj, "__dict__", None), dict):
                children += [(f"{path}.{k}", v) for k, v in vars(obj).items()]
        stack.extend((child_path, v, depth + 1) for child_path, v in reversed(children))
    return found


class _NotApplicable(Exception):
    """A candidate that does not apply to this function (its row says why)."""


def _graph_around_host_reads(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[..., Any]:
    """``cg.graph`` with the innermost module of each step that cannot be recorded run eagerly:
    capture, and on a host read inside a module, add that module's class to ``eager`` and
    capture again."""
    blocks: list[type] = []
    while True:
        try:
            call = graph(fn, *args, eager=blocks, **kwargs)
            call(*args, **kwargs)
            call(*args, **kwargs)
        except CaptureError as error:
            block = type(error.block) if error.block is not None else None
            if error.kind not in _SPLITTABLE or block is None or block in blocks:
                raise
            blocks.append(block)
            continue
        if not blocks:
            raise _NotApplicable("every step records: the same as graph")
        return call


#: Capture failures a segment boundary around the failing module removes.
_SPLITTABLE = ("host-sync", "cpu-tensor")


def _time(
    fn: Callable[..., Any],
    calls: dict[str, Callable[..., Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[float, dict[str, float]]:
    """µs per synchronized call of eager and each candidate, interleaved window by window."""
    leaves, spec = flatten((args, kwargs))
    inputs = [
        optree.tree_unflatten(
            spec, [random_like(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        )
        for _ in range(4)
    ]
    modes = {"eager": fn, **calls}
    timed = measure_side_by_side(
        {name: (lambda c: lambda a: c(*a[0], **a[1]))(call) for name, call in modes.items()},
        inputs,
        calls=50,
        windows=5,
    )
    return timed["eager"].latency_us, {n: t.latency_us for n, t in timed.items() if n != "eager"}


def _decision_key(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    candidates: Sequence[str],
    buckets: Any,
) -> str:
    """What a decision depends on: the code and configuration of the function and its model,
    the parameters' layout, the example's shapes, the versions and the GPU."""
    target = getattr(fn, "_orig_mod", fn)
    code = type(target) if isinstance(target, torch.nn.Module) else target
    try:
        source = inspect.getsource(inspect.getmodule(code) or code)
    except (OSError, TypeError):
        source = repr(code)
    modules = modules_of(fn, ())
    config = [getattr(m, "config", None) for m in modules]
    layout = [(n, tuple(p.shape), str(p.dtype)) for m in modules for n, p in m.named_parameters()]
    example = [
        (tuple(x.shape), str(x.dtype), str(x.device)) if isinstance(x, torch.Tensor) else repr(x)
        for x in flatten((args, kwargs))[0]
    ]
    # transformers' version where the process uses it (a model of its own imports it):
    # importing it here only to ask would cost a second process seconds.
    transformers = sys.modules.get("transformers")
    versions = [torch.__version__, getattr(transformers, "__version__", None)]
    parts = [
        platform.python_version(), versions, _own_version(), _device_name(),
        hashlib.sha256(source.encode()).hexdigest(), callable_name(fn),
        [c.to_json_string() if hasattr(c, "to_json_string") else repr(c) for c in config],
        layout, example, list(candidates), repr(buckets),
        sorted(math_settings().items()), str(torch.get_default_dtype()),
    ]  # fmt: skip
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _own_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cudagraphs")
    except PackageNotFoundError:
        return "unknown"


def _folder() -> Any:
    return saved_steps_folder() / "auto"


def _load(key: str) -> AutoReport | None:
    folder = _folder()
    path = folder / f"{key}.json"
    if not path.exists() or untrusted(folder.parent) or untrusted(folder) or untrusted(path):
        return None
    try:
        data = json.loads(path.read_text())
        rows = [Candidate(**row) for row in data.pop("candidates")]
        return AutoReport(**data, candidates=rows)
    except (ValueError, TypeError, KeyError):
        return None  # written by another version: decided again


def _save(key: str, report: AutoReport) -> None:
    folder = _folder()
    folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)
    if untrusted(folder.parent) or untrusted(folder):
        return  # a folder others can write to holds no decision of ours
    write_whole(folder / f"{key}.json", report.to_json().encode())

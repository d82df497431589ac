"""``cg.graph``: the one entry point that turns a function into a graphed callable."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .core import Graphed, compat, install_diagnostics
from .diagnose import LibraryDiagnostics
from .errors import ConfigError, explain
from .options import Options, split_options
from .shapes import BUCKET_OPTIONS, Bucketed, Buckets, ExactShapes

__all__ = ["graph"]

# The core never imports the diagnostics; this layer hands them to it.
install_diagnostics(LibraryDiagnostics())


def graph(
    fn: Callable[..., Any] | None = None,
    /,
    *example_args: Any,
    buckets: Buckets | Mapping[str, Sequence[int]] | str | None = None,
    max_graphs: int = 8,
    compile: bool | str = False,
    **options_and_example_kwargs: Any,
) -> Any:
    """Capture ``fn`` into a CUDA graph and return a callable that replays it.

    ``fn`` may be a function, an ``nn.Module``, a bound method or a ``torch.compile``'d callable
    (warm-up compiles and autotunes it; the capture records the compiled kernels).
    ``compile=True`` does that for you: Inductor fuses the kernels, then one graph replays them
    (the way to get fusion and graphs together, with this library's guards).

    With example arguments, warm-up and capture happen now; without them (``cg.graph(fn)``,
    ``@cg.graph`` or ``@cg.graph(warmup=5)``) they happen on the first call, whose arguments
    become the examples. The examples are cloned into the graph's static input buffers and are
    never modified.

    Each call then checks that the arguments match the capture (same pytree structure; per
    tensor the same shape, dtype and device; plain values equal), copies the tensors into the
    static buffers with one fused copy (none for buffers passed back as ``g.inputs``), replays,
    and returns the outputs under the ``outputs`` policy.

    Right::

        model = MLP().cuda().eval()
        x = torch.randn(128, 256, device="cuda")
        with torch.no_grad():
            g = cg.graph(model, x)
            y = g(torch.randn(128, 256, device="cuda"))   # copy-in, replay
            y_kept = y.clone()                            # keep it past the next call

    Wrong::

        g(torch.randn(64, 256, device="cuda"))   # InputMismatchError: args[0] has shape (64, 256)
        a = g(x1); b = g(x2); a.sum()            # RuntimeError: StaleOutputError ... (guarded)

        @cg.graph
        def step(x, training):                   # `training` is frozen at capture; a call
            return x * 2 if training else x      # with another value raises, never replays
                                                 # the wrong branch

    Args:
        fn: the callable to capture.
        *example_args: example inputs (and, among the keywords, example keyword inputs):
            pytrees (tuples, lists, dicts,
            namedtuples, dataclasses) of tensors and plain values. Keywords named like an
            option below cannot be passed this way; capture lazily and call instead. A keyword
            close to an option's name that ``fn`` does not take (``warmpu=3``) raises
            :class:`ConfigError`.
        buckets: capture one graph per bucket of input sizes (:class:`cudagraphs.Buckets`, or
            the shorthand ``{"B": [1, 2, 4, 8]}`` for dimension 0 of every tensor input), or
            ``"exact"``: one graph per exact shape seen, at most ``max_graphs``, LRU evicted.
            Returns a :class:`cudagraphs.Bucketed` (or ``ExactShapes``) instead of a ``Graphed``.
        max_graphs: with ``buckets="exact"``, how many shapes keep a graph.
        compile: ``True`` or a ``torch.compile`` mode that leaves CUDA graphs to the caller
            (``"default"``, ``"max-autotune-no-cudagraphs"``): capture ``torch.compile(fn)``
            (``dynamic=False``: a graph fixes the sizes anyway). ``"reduce-overhead"`` and
            ``"max-autotune"`` are refused: Inductor would record its own graphs inside ours.

    Other Parameters:
        **options: every option of :class:`~cudagraphs.options.Options` (``warmup``,
            ``outputs``, ``pool``, ``guard``, ``on_stale``, ``verify``, ...), described in its
            one table there.

    Raises:
        CaptureError: capture failed (host sync, CPU tensor, ...), with the user's line.
        SegmentError: an eager step returned something other than CUDA tensors (a Python
            value would be frozen into the graph after it), or another shape than at capture.
        ConfigError: an option is invalid, or the inputs mix CPU and CUDA tensors.
        FrozenStateError: ``fn`` changes plain Python state from one run to the next.
        ModeMismatchError: a call runs under other modes (autocast, grad or inference mode,
            TF32, default dtype) than the capture did; capture one graph per mode.
        GradientsNotRecordedError: a call (or the capture) runs with grad mode on while an
            input or parameter requires grad: a replay records no autograd history. Call
            under ``torch.no_grad()``, or use ``cg.graph_autograd`` / ``cg.train_step``.

    Threads: calls are serialized by ``g.lock``. With the default outputs, once a second thread
    calls the graph every output is a copy made under the lock (one warning says so), so no
    thread ever reads another call's result; ``outputs="alias"`` with ``with g.lock:`` around
    each call and its reads is the zero-copy form.

    Without CUDA, or when every tensor input is on the CPU, returns a pass-through that runs
    ``fn`` eagerly behind the same signature checks, after one :class:`CudaGraphsWarning`.

    In-place mutation of an input (``x.add_(1)``) is supported: the replay mutates the graph's
    buffer and copies the result back into the tensor the caller passed, as eager would.
    """
    options_kwargs, example_kwargs = split_options(
        fn,
        options_and_example_kwargs,
        extra=("buckets", "max_graphs", "compile"),
        elsewhere={"cg.Buckets(...)": BUCKET_OPTIONS},
    )
    options = Options(**options_kwargs)
    if fn is None:
        if example_args or example_kwargs:
            raise ConfigError(
                explain(
                    "cg.graph(None, ...) got example inputs but no function",
                    "the first positional argument is the function to capture",
                    "call cg.graph(fn, *examples), or use @cg.graph(...) as a decorator",
                )
            )
        return lambda f: graph(
            f, buckets=buckets, max_graphs=max_graphs, compile=compile, **options_kwargs
        )
    if not callable(fn):
        raise ConfigError(
            explain(
                f"cg.graph expects a callable first, got {type(fn).__name__}",
                "the first argument is the function, module or method to capture",
                "call cg.graph(model, x) (examples after the callable)",
            )
        )
    fn = compiled(fn, compile)
    if buckets is not None:
        if example_args or example_kwargs:
            return make_bucketed(fn, options, buckets, max_graphs, example_args, example_kwargs)
        return LazyBucketed(fn, options, buckets, max_graphs)
    graphed: Graphed[Any] = Graphed(fn, options)
    if example_args or example_kwargs:
        graphed.initialize(example_args, example_kwargs)
    return graphed


def make_bucketed(
    fn: Callable[..., Any],
    options: Options,
    buckets: Any,
    max_graphs: int,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any],
) -> Any:
    """Build the bucketed callable for ``cg.graph(..., buckets=...)`` (examples given)."""
    if buckets == "exact":
        return ExactShapes(fn, options, max_graphs)
    if isinstance(buckets, Mapping):
        buckets = Buckets(sizes=buckets)
    if not isinstance(buckets, Buckets):
        raise ConfigError(
            explain(
                f"buckets must be a cg.Buckets, a {{symbol: sizes}} dict or 'exact'; got {buckets!r}",
                "buckets declare which input dimensions vary and over which sizes",
                "pass buckets=cg.Buckets({'B': cg.powers_of_two(128)})",
            )
        )
    return Bucketed(fn, options, buckets, example_args, example_kwargs)


class LazyBucketed:
    """``@cg.graph(buckets=...)`` without examples: built from the first call's arguments."""

    def __init__(self, fn: Callable[..., Any], options: Options, buckets: Any, max_graphs: int):
        self.fn = fn
        self._make = lambda args, kwargs: make_bucketed(
            fn, options, buckets, max_graphs, args, kwargs
        )
        self._inner: Any = None
        if buckets == "exact":
            self._inner = ExactShapes(fn, options, max_graphs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._inner is None:
            self._inner = self._make(args, kwargs)
        return self._inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(f"{name!r}: not built yet (builds on the first call)")
        return getattr(inner, name)


def compiled(fn: Callable[..., Any], compile: bool | str) -> Callable[..., Any]:
    """``fn`` under ``torch.compile`` for ``cg.graph(..., compile=...)``, or ``fn`` itself."""
    if compile is False:
        return fn
    modes = compat.graph_free_compile_modes()
    if compile is not True and compile not in modes:
        raise ConfigError(
            explain(
                f"compile must be True, False or a torch.compile mode name without CUDA "
                f"graphs ({', '.join(repr(m) for m in modes)}); got {compile!r}",
                "cg.graph records the one CUDA graph; a mode that records Inductor's own "
                "graphs (reduce-overhead, max-autotune) would nest two",
                "pass compile=True, or compile='max-autotune-no-cudagraphs' for autotuning",
            )
        )
    mode = None if compile is True else compile
    return torch.compile(fn, mode=mode, dynamic=False)

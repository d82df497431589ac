"""``cg.graph_autograd`` and ``cg.graph_autograd_chain``: capture stages' forwards in order and
their backwards in reverse, into one pool, the order autograd replays them in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core import RecordingSetup, SideEffects, StreamOrder, capture_call, default_stream, warm_up
from ..errors import ConfigError, explain
from ..options import Options, split_options
from .activations import ActivationOrder
from .autograd import GraphedAutograd
from .graphed_module import GraphedModule

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..options import OptionKwargs

__all__ = ["graph_autograd", "graph_autograd_chain"]

#: The options of ``cg.graph`` that graphed autograd takes.
AUTOGRAD_OPTIONS = ("warmup", "pool", "stream", "capture_error_mode", "modules")


def capture_chain(stages: list[GraphedAutograd], options: Options) -> None:
    device = stages[0].device
    stream = options.stream or default_stream(device)
    shared = options.pool
    pool = shared.handle if hasattr(type(shared), "handle") else shared
    if pool is None:
        pool = torch.cuda.graph_pool_handle()
    order = ActivationOrder(len(stages))
    # The stages share one pool's memory: one order of their replays across streams.
    streams = (
        shared.stream_order(device.index)
        if hasattr(type(shared), "stream_order")
        else StreamOrder(device.index)
    )
    for index, stage in enumerate(stages):
        stage.order, stage.index, stage.stream_order = order, index, streams

    def warm_up_all() -> None:
        for stage in stages:
            stage.warm_up_once()

    with torch.cuda.device(device), torch.enable_grad():
        # Warm-up must not move BatchNorm statistics or any other state: put it back.
        effects = SideEffects(warm_up_all, [], [], options.side_effects)
        with effects.running():
            warm_up(warm_up_all, (), {}, options.warmup, stream)
        effects.finish()
        for stage in stages:
            recording = _record(stage.run_forward, stream, pool, options)
            stage.forward_graph = recording.graph
            stage.record_outputs(recording.output)
        for stage in reversed(stages):
            recording = _record(stage.run_backward, stream, pool, options)
            stage.backward_graph = recording.graph
            stage.finish(recording.output)
    for stage in stages:
        stage.pool = pool


def _record(fn: Callable[[], Any], stream: torch.cuda.Stream, pool: Any, options: Options) -> Any:
    setup = RecordingSetup(stream=stream, pool=pool, capture_error_mode=options.capture_error_mode)
    recording = capture_call(fn, (), {}, setup)
    if hasattr(type(options.pool), "record"):
        options.pool.record(recording.pool_bytes)
    return recording


def graph_autograd(fn: Callable[..., Any], /, *example_args: Any, **kwargs: Any) -> Any:
    """Record ``fn``'s forward and backward as two graphs that autograd replays.

    ``fn`` is usually an ``nn.Module`` (its parameters get gradients) or a function of
    ``modules=``. Inputs and outputs are pytrees; tensor inputs that should receive gradients
    must require grad in the example. Returns a :class:`GraphedAutograd`; for a module, a
    :class:`~cudagraphs.training.graphed_module.GraphedModule` that shares the module's
    parameters, buffers and children (the same state dict) and replays the graphs, with the
    :class:`GraphedAutograd` at ``.graphed``; the module itself is left as it was. Assign the
    result where the module was used. Module hooks are not run by replays.

    Right (gradient accumulation; every micro-batch does forward then backward)::

        block = cg.graph_autograd(block, torch.randn(64, 512, device="cuda"))
        for micro in batch.chunk(4):
            loss = head(block(micro)).pow(2).mean() / 4
            loss.backward()                      # grads add up exactly as in eager
        opt.step(); opt.zero_grad()

    Wrong: ``a = block(x1); b = block(x2); (a + b).sum().backward()`` -- the second forward
    overwrote the first one's recorded activations: raises StaleGraphError. Calling it after
    ``model.eval()`` with gradients on raises; under ``torch.no_grad()`` it uses a forward-only
    graph of that mode.

    Options: ``warmup``, ``pool``, ``stream``, ``capture_error_mode`` and ``modules``, as for
    :func:`cudagraphs.graph`; other keywords are example inputs.
    """
    settings, example_kwargs = _split(fn, kwargs)
    return _build([(fn, example_args, example_kwargs)], settings)[0]


def graph_autograd_chain(
    stages: Sequence[tuple[Any, ...]], **options: Unpack[OptionKwargs]
) -> list[Any]:
    """Graph several callables into one shared pool; ``stages`` lists ``(fn, args)`` or
    ``(fn, args, kwargs)`` in the order the forward pass calls them.

    Forwards are captured in that order and backwards in reverse, the order autograd runs them,
    so the stages reuse each other's scratch memory. Calls must follow that order each
    iteration (forward 1..n, then backward); a call that would read overwritten activations
    raises :class:`~cudagraphs.errors.StaleGraphError`.

    Right::

        encoder, decoder = cg.graph_autograd_chain([(encoder, (x,)), (decoder, (h,))])
        loss = loss_fn(decoder(encoder(x)), y); loss.backward()
    """
    allowed = tuple(n for n in AUTOGRAD_OPTIONS if n != "modules")
    settings = Options.from_kwargs(dict(options), entry="graph_autograd_chain", allowed=allowed)
    return _build(stages, settings.replace(on_stale="raise"))


def _split(fn: Any, kwargs: dict[str, Any]) -> tuple[Options, dict[str, Any]]:
    options, examples = split_options(
        fn, kwargs, allowed=AUTOGRAD_OPTIONS, entry="cg.graph_autograd"
    )
    settings = Options.from_kwargs(options, entry="graph_autograd", allowed=AUTOGRAD_OPTIONS)
    return settings.replace(on_stale="raise"), examples


def _build(stages: Sequence[tuple[Any, ...]], options: Options) -> list[Any]:
    if not torch.cuda.is_available():
        raise ConfigError(
            explain(
                "graph_autograd needs CUDA, and this machine has none",
                "it records CUDA graphs of the forward and backward passes",
                "call the modules directly here; capture them on a CUDA machine",
            )
        )
    built = []
    for k, stage in enumerate(stages):
        if not isinstance(stage, tuple) or len(stage) not in (2, 3) or not callable(stage[0]):
            raise ConfigError(
                explain(
                    f"stages[{k}] must be (fn, args) or (fn, args, kwargs), got {stage!r}",
                    "each stage is a callable with example inputs to capture it on",
                    "pass [(encoder, (x,)), (decoder, (h,), {'mask': m})]",
                )
            )
        fn, args = stage[0], tuple(stage[1])
        kwargs = dict(stage[2]) if len(stage) == 3 else {}
        target = fn.forward if isinstance(fn, nn.Module) else fn
        built.append(GraphedAutograd(target, args, kwargs, options))
    capture_chain(built, options)
    result: list[Any] = []
    for g in built:
        module = getattr(g.fn, "__self__", None)
        if isinstance(module, nn.Module) and getattr(g.fn, "__name__", "") == "forward":
            result.append(GraphedModule(module, g))  # the user's module is left as it was
        else:
            result.append(g)
    return result

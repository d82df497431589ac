"""Graphed autograd callables: a forward graph and a backward graph wired into autograd.

A graphed part (a module, a block of layers) then lives inside an ordinary eager training loop:
its forward is one replay, and when autograd reaches it, its backward is another. This is what
``torch.cuda.make_graphed_callables`` does, with its traps removed:

- gradients are returned as fresh tensors, never as the graph's static gradient buffers, so
  autograd's accumulation into ``.grad`` over several backward passes is correct (with the static
  buffers, the first backward's ``.grad`` *is* the buffer and the next replay overwrites it:
  pytorch/pytorch#181723);
- outputs are returned as fresh tensors too, so holding them across calls is safe;
- a backward whose forward activations were overwritten by a later forward replay raises
  :class:`~cudagraphs.errors.StaleGraphError` instead of computing wrong gradients;
- train/eval is explicit: the graphs are recorded in the mode of the examples, and a call in the
  other mode either uses a separate forward-only graph (under ``torch.no_grad()``) or raises.

Several callables can share one memory pool: :func:`graph_autograd_chain` captures their
forwards in execution order and their backwards in reverse order, the order autograd replays
them in, which is what makes sharing the pool safe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch import nn

from ..core import recorder
from ..core.frames import callable_name
from ..core.graphed import Graphed
from ..core.guards import AddressGuard, modules_of
from ..core.pool import Pool
from ..core.tree import Signature, flatten, same_value
from ..errors import ConfigError, InputMismatchError, StaleGraphError, explain
from ..options import Options

__all__ = ["GraphedAutograd", "graph_autograd", "graph_autograd_chain"]

log = logging.getLogger("cudagraphs")


class _Order:
    """Which recorded activations are still intact, for the stages of one shared pool.

    A forward replay of stage ``i`` overwrites the activations its backward reads; in a shared
    pool it may also overwrite those of the stages captured after it. So the backward of a
    forward is valid only if, since that forward, no forward of it or of an earlier stage ran,
    and no later stage's backward is still due (its activations share memory with this backward).
    """

    def __init__(self, n: int):
        self.count = 0
        self.forwarded = [0] * n
        self.pending: dict[int, int] = {}

    def forward(self, stage: int, *, expects_backward: bool) -> int:
        self.count += 1
        self.forwarded[stage] = self.count
        if expects_backward:
            self.pending[stage] = self.count
        return self.count

    def backward(self, stage: int, token: int, name: str) -> None:
        later_forward = self.forwarded[stage] != token or any(
            self.forwarded[j] > token for j in range(stage)
        )
        later_backward_due = any(j > stage and t > token for j, t in self.pending.items())
        if later_forward or later_backward_due:
            raise StaleGraphError(
                explain(
                    f"backward through the graphed {name} after its activations were overwritten",
                    "the forward graph's recorded activations live at fixed addresses; another "
                    "forward replay (a second micro-batch, or an earlier stage of the chain) ran "
                    "since this output was computed"
                    + (", or a later stage's backward is still due" if later_backward_due else ""),
                    "call backward after each forward (forward, backward, forward, backward), "
                    "as gradient accumulation normally does",
                )
            )
        self.pending.pop(stage, None)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, stage: GraphedAutograd, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        stage._copy_in(tensors)
        stage._fwd.replay()  # type: ignore[union-attr]
        ctx.stage = stage
        ctx.token = stage._order.forward(stage._index, expects_backward=True)
        outputs = tuple(o.clone() for o in stage._static_outputs)
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, stage._output_grad) if not d))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        stage: GraphedAutograd = ctx.stage
        stage._order.backward(stage._index, ctx.token, stage.name)
        for buffer, grad in zip(stage._static_grad_outputs, grads):
            if buffer is None:
                continue
            if grad is None:
                buffer.zero_()
            elif grad.data_ptr() != buffer.data_ptr():
                buffer.copy_(grad)
        stage._bwd.replay()  # type: ignore[union-attr]
        stage._backwards += 1
        # Fresh tensors: autograd may keep the first gradient as .grad and add later ones into
        # it; the static buffers are overwritten by the next replay.
        result = [
            None if g is None or not needed else g.clone()
            for g, needed in zip(stage._static_grad_inputs, ctx.needs_input_grad[1:])
        ]
        return (None, *result)


class GraphedAutograd:
    """A callable whose forward and backward are CUDA graph replays; see :func:`graph_autograd`.

    Attributes: ``name``, ``forwards`` / ``backwards`` (replay counts), ``eval_graph`` (the
    forward-only graph used for calls in the other train/eval mode under ``torch.no_grad()``,
    captured on first use), ``pool``.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: Options,
    ):
        self.fn = fn
        self.name = callable_name(fn)
        self.options = options
        self.modules = modules_of(fn, options.modules)
        self._training = tuple(m.training for m in self.modules)
        self._signature, leaves = Signature.of_call(args, kwargs)
        tensors = [leaves[i] for i in self._signature.tensor_index]
        if not tensors or not all(t.is_cuda for t in tensors):
            raise ConfigError(
                explain(
                    f"graph_autograd({self.name}) needs CUDA tensor example inputs",
                    "the forward and backward graphs are recorded on a CUDA device from examples",
                    "pass example tensors on the GPU (x.cuda()); without CUDA call the module "
                    "directly",
                )
            )
        with torch.no_grad():
            static = list(leaves)
            for i, t in zip(self._signature.tensor_index, tensors):
                static[i] = t.detach().clone().requires_grad_(t.requires_grad)
        self._static_inputs = [static[i] for i in self._signature.tensor_index]
        self._static_args, self._static_kwargs = optree.tree_unflatten(self._signature.spec, static)
        self._params = [p for m in self.modules for p in m.parameters() if p.requires_grad]
        self._differentiable = [t for t in self._static_inputs if t.requires_grad] + self._params
        self._device = tensors[0].device
        self._fwd: torch.cuda.CUDAGraph | None = None
        self._bwd: torch.cuda.CUDAGraph | None = None
        self._static_outputs: list[torch.Tensor] = []
        self._output_grad: list[bool] = []
        self._out_spec: Any = None
        self._out_leaves: list[Any] = []
        self._out_tensor_index: list[int] = []
        self._static_grad_outputs: list[torch.Tensor | None] = []
        self._static_grad_inputs: list[torch.Tensor | None] = []
        self._order = _Order(1)
        self._index = 0
        # Train/eval is checked by __call__ itself (it routes to the eval graph), not the guard.
        self._guard = (
            AddressGuard(fn, options.modules, modes=False) if options.guard == "replay" else None
        )
        self.eval_graph: Graphed[Any] | None = None
        self.pool: Any = None
        self._lock = threading.RLock()
        self.forwards = 0
        self._backwards = 0

    @property
    def backwards(self) -> int:
        """How many backward replays ran."""
        return self._backwards

    # ------------------------------------------------------------------ capture

    def _run_forward(self) -> Any:
        return self.fn(*self._static_args, **self._static_kwargs)

    def _grads(self, outputs: list[torch.Tensor], grad_outputs: list[torch.Tensor]) -> Any:
        return torch.autograd.grad(
            outputs, self._differentiable, grad_outputs=grad_outputs, allow_unused=True
        )

    def _warm_up_once(self) -> None:
        tensors = [t for t in flatten(self._run_forward())[0] if isinstance(t, torch.Tensor)]
        needing = [t for t in tensors if t.requires_grad]
        if not needing:
            raise ConfigError(
                explain(
                    f"{self.name} returned no tensor that requires grad",
                    "graph_autograd records a backward graph, and there is nothing to "
                    "differentiate",
                    "for inference use cg.graph; check that the parameters or inputs require grad",
                )
            )
        self._grads(needing, [torch.ones_like(t) for t in needing])

    def _record_outputs(self, output: Any) -> None:
        leaves, self._out_spec = flatten(output)
        self._out_leaves = list(leaves)
        self._out_tensor_index = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        self._static_outputs = [leaves[i] for i in self._out_tensor_index]
        self._output_grad = [t.requires_grad for t in self._static_outputs]
        self._static_grad_outputs = [
            torch.empty_like(t) if t.requires_grad else None for t in self._static_outputs
        ]

    def _run_backward(self) -> Any:
        pairs = [
            (o, g) for o, g in zip(self._static_outputs, self._static_grad_outputs) if g is not None
        ]
        grads = self._grads([o for o, _ in pairs], [g for _, g in pairs])
        return grads

    def _finish(self, recorded_grads: Sequence[torch.Tensor | None]) -> None:
        """After both captures: map the recorded gradients (one per differentiable tensor)
        onto Function.apply's inputs (every tensor input, then the parameters)."""
        grads = iter(recorded_grads)
        per_input = [next(grads) if t.requires_grad else None for t in self._static_inputs]
        self._static_grad_inputs = per_input + [next(grads) for _ in self._params]
        # Static outputs keep their autograd graph alive otherwise; the recording is all we need.
        self._static_outputs = [o.detach() for o in self._static_outputs]
        for i in self._out_tensor_index:
            self._out_leaves[i] = None

    # ------------------------------------------------------------------ calling

    def _copy_in(self, tensors: Sequence[torch.Tensor]) -> None:
        dst = []
        src = []
        for buffer, given in zip(self._static_inputs, tensors):
            if given.data_ptr() != buffer.data_ptr():
                dst.append(buffer)
                src.append(given)
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:  # one call at a time: the static inputs and outputs are shared
            return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if tuple(m.training for m in self.modules) != self._training:
            return self._other_mode(args, kwargs)
        if self._guard is not None and (reason := self._guard.stale()) is not None:
            raise StaleGraphError(
                explain(
                    f"graph_autograd({self.name}): {reason} since capture",
                    "both graphs read the parameters at the addresses they had at capture",
                    "update parameters in place (load_state_dict, optimizer steps), or capture "
                    "again with cg.graph_autograd after moving the model",
                )
            )
        leaves = self._check(args, kwargs)
        tensors = [leaves[i] for i in self._signature.tensor_index]
        self.forwards += 1
        if torch.is_grad_enabled():
            outputs = _Replay.apply(self, *tensors, *self._params)
        else:
            self._copy_in(tensors)
            self._fwd.replay()  # type: ignore[union-attr]
            self._order.forward(self._index, expects_backward=False)
            outputs = tuple(o.clone() for o in self._static_outputs)
        out = list(self._out_leaves)
        for i, t in zip(self._out_tensor_index, outputs):
            out[i] = t
        return optree.tree_unflatten(self._out_spec, out)

    def _check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        leaves, spec = flatten((args, kwargs))
        signature = self._signature
        ok = spec == signature.spec
        if ok:
            for i, static in zip(signature.tensor_index, self._static_inputs):
                t = leaves[i]
                if (
                    not isinstance(t, torch.Tensor)
                    or t.shape != static.shape
                    or (t.dtype != static.dtype or t.device != static.device)
                ):
                    ok = False
                    break
                if t.requires_grad and not static.requires_grad:
                    raise InputMismatchError(
                        explain(
                            f"{signature.paths[i]} requires grad but its example did not",
                            "the backward graph was recorded without a gradient for this input, "
                            "so its gradient would silently be missing",
                            "capture with an example that requires grad "
                            "(x.requires_grad_()), or detach the input",
                        )
                    )
        if not ok:
            return signature.check(args, kwargs)  # raises the precise mismatch
        for i, frozen in zip(signature.frozen_index, signature.frozen_values):
            if not same_value(leaves[i], frozen):
                return signature.check(args, kwargs)
        return leaves

    def _other_mode(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mode = "train" if self.modules[0].training else "eval"
        captured = "eval" if mode == "train" else "train"
        if torch.is_grad_enabled():
            raise ConfigError(
                explain(
                    f"graph_autograd({self.name}) was captured in {captured} mode and is now "
                    f"called in {mode} mode with gradients enabled",
                    "the recorded graphs fixed dropout and normalization behaviour at capture; "
                    "replaying them in the other mode would be silently wrong",
                    "for evaluation call it under torch.no_grad() (a separate forward-only graph "
                    "is captured for that mode), or capture another graph_autograd in this mode",
                )
            )
        if self.eval_graph is None:
            log.info(
                "cudagraphs: capturing a forward-only graph of %s for %s mode", self.name, mode
            )
            self.eval_graph = Graphed(self.fn, self.options.replace(outputs="clone", pool=None))
        return self.eval_graph(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<cudagraphs.GraphedAutograd {self.name} forwards={self.forwards} backwards={self._backwards}>"


def _capture_chain(stages: list[GraphedAutograd], options: Options) -> None:
    device = stages[0]._device
    stream = options.stream or recorder.default_stream(device)
    shared = options.pool
    pool = shared.handle if isinstance(shared, Pool) else shared
    if pool is None:
        pool = torch.cuda.graph_pool_handle()
    order = _Order(len(stages))
    for index, stage in enumerate(stages):
        stage._order, stage._index = order, index
    buffers = [b for s in stages for m in s.modules for b in m.buffers()]
    saved = [b.clone() for b in buffers]

    def warm_up_all() -> None:
        for stage in stages:
            stage._warm_up_once()

    with torch.cuda.device(device), torch.enable_grad():
        recorder.warm_up(warm_up_all, (), {}, options.warmup, stream)
        with torch.no_grad():  # warm-up must not move BatchNorm statistics
            for b, s in zip(buffers, saved):
                b.copy_(s)
        for stage in stages:
            recording = _record(stage._run_forward, stream, pool, options)
            stage._fwd = recording.graph
            stage._record_outputs(recording.output)
        for stage in reversed(stages):
            recording = _record(stage._run_backward, stream, pool, options)
            stage._bwd = recording.graph
            stage._finish(recording.output)
    for stage in stages:
        stage.pool = pool


def _record(fn: Callable[[], Any], stream: torch.cuda.Stream, pool: Any, options: Options) -> Any:
    recording = recorder.capture(
        fn, (), {}, stream=stream, pool=pool, capture_error_mode=options.capture_error_mode
    )
    if isinstance(options.pool, Pool):
        options.pool.record(recording.pool_bytes)
    return recording


def _options(warmup: int, pool: Any, stream: Any, capture_error_mode: str, modules: Any) -> Options:
    return Options(
        warmup=warmup,
        pool=pool,
        stream=stream,
        capture_error_mode=capture_error_mode,
        modules=modules,
        on_stale="raise",
    )


def graph_autograd(
    fn: Callable[..., Any],
    /,
    *example_args: Any,
    warmup: int = 3,
    pool: Any = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "global",
    modules: Sequence[nn.Module] = (),
    **example_kwargs: Any,
) -> Any:
    """Record ``fn``'s forward and backward as two graphs that autograd replays.

    ``fn`` is usually an ``nn.Module`` (its parameters get gradients) or a function of
    ``modules=``. Inputs and outputs are pytrees; tensor inputs that should receive gradients
    must require grad in the example. Returns a :class:`GraphedAutograd`; for a module, the
    module itself with ``forward`` replaced (its state dict and parameters unchanged) and the
    :class:`GraphedAutograd` at ``module.graphed``. Module hooks are not run by replays.

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
    """
    options = _options(warmup, pool, stream, capture_error_mode, modules)
    return _build([(fn, example_args, example_kwargs)], options)[0]


def graph_autograd_chain(
    stages: Sequence[tuple[Any, ...]],
    *,
    warmup: int = 3,
    pool: Any = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "global",
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
    return _build(stages, _options(warmup, pool, stream, capture_error_mode, ()))


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
    _capture_chain(built, options)
    result: list[Any] = []
    for g in built:
        module = getattr(g.fn, "__self__", None)
        if isinstance(module, nn.Module) and getattr(g.fn, "__name__", "") == "forward":
            # Replace the module's forward so it stays in its parent, with the same state dict.
            module.forward = g  # type: ignore[method-assign]
            module.graphed = g  # type: ignore[assignment]
            result.append(module)
        else:
            result.append(g)
    return result

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

from ..core import (
    AddressGuard,
    Graphed,
    Signature,
    StreamOrder,
    callable_name,
    compat,
    flatten,
    modules_of,
    same_value,
)
from ..errors import ConfigError, InputMismatchError, StaleGraphError, explain
from ..options import Options
from .activations import ActivationOrder
from .optimizers import RequiresGradWatch

__all__ = ["GraphedAutograd"]

log = logging.getLogger("cudagraphs")


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, stage: GraphedAutograd, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        stage.follow_stream()
        stage._copy_in(tensors)
        stage.forward_graph.replay()  # type: ignore[union-attr]
        ctx.stage = stage
        ctx.token = stage.order.forward(stage.index, expects_backward=True)
        outputs = tuple(o.clone() for o in stage._static_outputs)
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, stage._output_grad) if not d))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        stage: GraphedAutograd = ctx.stage
        stage.order.backward(stage.index, ctx.token, stage.name)
        stage.follow_stream()
        for buffer, grad in zip(stage._static_grad_outputs, grads):
            if buffer is None:
                continue
            if grad is None:
                buffer.zero_()
            elif grad.data_ptr() != buffer.data_ptr():
                buffer.copy_(grad)
        stage.backward_graph.replay()  # type: ignore[union-attr]
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
        self.device = tensors[0].device
        self.forward_graph: torch.cuda.CUDAGraph | None = None
        self.backward_graph: torch.cuda.CUDAGraph | None = None
        self._static_outputs: list[torch.Tensor] = []
        self._output_grad: list[bool] = []
        self._out_spec: Any = None
        self._out_leaves: list[Any] = []
        self._out_tensor_index: list[int] = []
        self._static_grad_outputs: list[torch.Tensor | None] = []
        self._static_grad_inputs: list[torch.Tensor | None] = []
        self.order = ActivationOrder(1)
        self.index = 0
        #: Keeps replays in call order across streams (set with the chain; None: no CUDA).
        self.stream_order: StreamOrder | None = None
        # Train/eval is checked by __call__ itself (it routes to the eval graph), not the guard.
        self._guard = (
            AddressGuard(
                fn,
                options.modules,
                modes=False,
                backward=True,
                watches=[RequiresGradWatch(modules_of(fn, options.modules))],
            )
            if options.guard == "replay"
            else None
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

    def run_forward(self) -> Any:
        return self.fn(*self._static_args, **self._static_kwargs)

    def _grads(self, outputs: list[torch.Tensor], grad_outputs: list[torch.Tensor]) -> Any:
        return torch.autograd.grad(
            outputs, self._differentiable, grad_outputs=grad_outputs, allow_unused=True
        )

    def warm_up_once(self) -> None:
        tensors = [t for t in flatten(self.run_forward())[0] if isinstance(t, torch.Tensor)]
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

    def record_outputs(self, output: Any) -> None:
        leaves, self._out_spec = flatten(output)
        self._out_leaves = list(leaves)
        self._out_tensor_index = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        self._static_outputs = [leaves[i] for i in self._out_tensor_index]
        self._output_grad = [t.requires_grad for t in self._static_outputs]
        self._static_grad_outputs = [
            torch.empty_like(t) if t.requires_grad else None for t in self._static_outputs
        ]

    def run_backward(self) -> Any:
        pairs = [
            (o, g) for o, g in zip(self._static_outputs, self._static_grad_outputs) if g is not None
        ]
        grads = self._grads([o for o, _ in pairs], [g for _, g in pairs])
        return grads

    def finish(self, recorded_grads: Sequence[torch.Tensor | None]) -> None:
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

    def follow_stream(self) -> None:
        """Before a replay: on another stream than the last replay of this chain's graphs,
        wait for that stream first (its copy of an output, or its replay, may still be queued;
        ``core.StreamOrder``). Nothing is added while the stream stays the same."""
        order = self.stream_order
        if order is not None and order.read is not None and order.read() != order.last:
            order.follow()

    def _copy_in(self, tensors: Sequence[torch.Tensor]) -> None:
        dst = []
        src = []
        for buffer, given in zip(self._static_inputs, tensors):
            if given.data_ptr() != buffer.data_ptr():
                dst.append(buffer)
                src.append(given)
        if dst:
            with torch.no_grad():
                compat.foreach_copy(dst, src)

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
            self.follow_stream()
            self._copy_in(tensors)
            self.forward_graph.replay()  # type: ignore[union-attr]
            self.order.forward(self.index, expects_backward=False)
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

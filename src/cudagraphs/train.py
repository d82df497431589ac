"""Whole-step capture: forward, loss, backward, clipping and optimizer step as one graph.

Why a dedicated ``cg.train_step`` rather than ``cg.graph`` on the step function: a training step
needs things ``cg.graph`` must never do behind a user's back. It changes the optimizer (a
graph-safe mode, the learning rate as a device tensor), sets the gradients to ``None`` so that
backward allocates them inside the graph's pool, and it cannot warm up on the example batch the
way ``cg.graph`` does, because every warm-up call is a real optimizer step. So the first
``warmup`` calls are ordinary eager steps on the caller's batches (on the capture stream; they
count as training, so N calls are N steps, exactly as in eager), and the next call captures and
replays. From then on a call is: copy the batch into the static inputs, one graph launch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import optree
import torch

from .errors import ConfigError, explain
from .graphed import Graphed, _default_capture_stream, _name
from .guards import AddressGuard
from .optim import OptimizerWatch, make_graph_safe, optimizer_tensors
from .options import Options
from .outputs import OutputPolicy
from .tree import NAMESPACE

__all__ = ["TrainStep", "train_step"]

log = logging.getLogger("cudagraphs")
R = TypeVar("R")


class TrainStep(Graphed[R]):
    """A training step captured whole; create with :func:`cudagraphs.train_step`.

    Besides :class:`~cudagraphs.Graphed`'s attributes: ``optimizers`` and ``eager_steps_left``
    (warm-up steps still to run eagerly before the capture).
    """

    _warn_grad_outputs = False  # the loss has grad history at capture; replays return it detached

    def __init__(
        self,
        fn: Callable[..., R],
        optimizers: Sequence[torch.optim.Optimizer],
        options: Options,
        *,
        switch_optimizer: bool,
    ):
        super().__init__(fn, options.replace(warmup=0))
        self.optimizers = tuple(optimizers)
        self.eager_steps_left = options.warmup
        self.switch_optimizer = switch_optimizer
        self._prepared = False

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        if self._graph is None and self._on_cuda():
            if not self._prepared:
                for optimizer in self.optimizers:
                    make_graph_safe(optimizer, switch=self.switch_optimizer)
                self._prepared = True
            if self.eager_steps_left > 0:
                self.eager_steps_left -= 1
                return self._eager_step(args, kwargs)
        return super().__call__(*args, **kwargs)

    def _on_cuda(self) -> bool:
        if not torch.cuda.is_available():
            return False
        return all(
            p.is_cuda
            for optimizer in self.optimizers
            for g in optimizer.param_groups
            for p in g["params"]
        )

    def _eager_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        """One real training step, run eagerly on the capture stream (PyTorch's warm-up rule:
        lazily created state, cuBLAS handles and autotuning settle outside the recording)."""
        device = self.optimizers[0].param_groups[0]["params"][0].device
        stream = self.options.stream or _default_capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            output = self.fn(*args, **kwargs)
        torch.cuda.current_stream(device).wait_stream(stream)
        self._eager_calls += 1
        return optree.tree_map(
            lambda t: t.detach() if isinstance(t, torch.Tensor) else t, output, namespace=NAMESPACE
        )

    def _capture(self, signature: Any, leaves: list[Any], device: torch.device) -> None:
        for optimizer in self.optimizers:
            make_graph_safe(optimizer, switch=self.switch_optimizer)  # again: load_state_dict
            # Gradients set to None are allocated by the recorded backward inside the graph's
            # pool and refilled in place by every replay.
            optimizer.zero_grad(set_to_none=True)
        super()._capture(signature, leaves, device)

    def _make_guard(self) -> AddressGuard | None:
        extra = [named for optimizer in self.optimizers for named in optimizer_tensors(optimizer)]
        watches = [OptimizerWatch(optimizer) for optimizer in self.optimizers]
        return AddressGuard(self.fn, self.options.modules, extra=extra, watches=watches)

    def __repr__(self) -> str:
        opts = ", ".join(type(o).__name__ for o in self.optimizers)
        return f"<cudagraphs.TrainStep {_name(self.fn)} [{opts}] state={self.state.value}>"


@overload
def train_step(
    fn: Callable[..., R],
    /,
    *,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    warmup: int = 3,
    outputs: OutputPolicy = "guarded",
    pool: Any = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "global",
    on_stale: str = "recapture",
    modules: Sequence[torch.nn.Module] = (),
    switch_optimizer: bool = True,
) -> TrainStep[R]: ...


@overload
def train_step(
    fn: None = None,
    /,
    *,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    warmup: int = 3,
    outputs: OutputPolicy = "guarded",
    pool: Any = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "global",
    on_stale: str = "recapture",
    modules: Sequence[torch.nn.Module] = (),
    switch_optimizer: bool = True,
) -> Callable[[Callable[..., R]], TrainStep[R]]: ...


def train_step(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    warmup: int = 3,
    outputs: OutputPolicy = "guarded",
    pool: Any = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "global",
    on_stale: str = "recapture",
    modules: Sequence[torch.nn.Module] = (),
    switch_optimizer: bool = True,
) -> Any:
    """Capture a whole training step (forward, loss, backward, optimizer step) as one graph.

    ``fn(*batch)`` runs one step and returns the loss (and any metrics, as a pytree). The first
    ``warmup`` calls are real eager steps; the next one captures, and every call after it is a
    copy of the batch plus one graph launch. Training is step-for-step the same as eager.

    Before the first step each optimizer is made graph-safe (logged): ``fused=True`` where
    offered (Adam, AdamW, SGD), else ``capturable=True``; each learning rate becomes a 0-dim
    device tensor that ``torch.optim.lr_scheduler`` updates in place. ``switch_optimizer=False``
    refuses a non-graph-safe optimizer instead. Gradients are set to ``None`` before the capture,
    so the recorded backward allocates them in the graph's pool and each replay refills them.

    Right::

        model = MLP().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, 10, 0.5)

        @cg.train_step(optimizer=opt)
        def step(x, y):
            opt.zero_grad()                     # at capture: grads None, backward allocates them
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return loss

        for x, y in loader:                     # fixed shapes: drop_last=True
            loss = step(x, y)                   # device tensor; loss.item() syncs, so log rarely
            sched.step()                        # updates the device learning rate in place

    Wrong: ``opt.param_groups[0]["lr"] = 0.1`` (replaces the tensor the graph reads: caught,
    and the step is captured again), ``GradScaler`` with a non-fused optimizer (its ``step`` syncs
    on ``found_inf``: a CaptureError; use ``fused=True``), or a data-dependent ``if loss > x:``
    inside the step (frozen at capture; ``cg.doctor`` finds it).
    """
    optimizers = _optimizer_list(optimizer)
    options = Options(
        warmup=warmup,
        outputs=outputs,
        pool=pool,
        stream=stream,
        capture_error_mode=capture_error_mode,
        on_stale=on_stale,
        modules=modules,
    )
    if warmup < 1:
        raise ConfigError(
            explain(
                f"train_step needs warmup >= 1, got {warmup}",
                "the optimizer creates its state (moments, step counters) on its first step, "
                "which must happen before the capture records reads of that state",
                "pass warmup=3 (the default)",
            )
        )

    def wrap(f: Callable[..., Any]) -> TrainStep[Any]:
        if not callable(f):
            raise ConfigError(
                explain(
                    f"train_step expects a callable step function, got {type(f).__name__}",
                    "the step function is what gets captured",
                    "decorate the function: @cg.train_step(optimizer=opt)",
                )
            )
        return TrainStep(f, optimizers, options, switch_optimizer=switch_optimizer)

    return wrap if fn is None else wrap(fn)


def _optimizer_list(optimizer: Any) -> list[torch.optim.Optimizer]:
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    bad = [type(o).__name__ for o in optimizers if not isinstance(o, torch.optim.Optimizer)]
    if bad or not optimizers:
        raise ConfigError(
            explain(
                f"optimizer must be a torch.optim.Optimizer or a list of them, got {bad or optimizer!r}",
                "train_step makes each optimizer graph-safe and guards its state",
                "pass optimizer=opt (the optimizer the step function calls .step() on)",
            )
        )
    return optimizers

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
from typing import TYPE_CHECKING, Any, TypeVar, overload

import optree
import torch

from ..core import NAMESPACE, AddressGuard, Graphed, callable_name, modules_of
from ..errors import ConfigError, FrozenStateError, explain

if TYPE_CHECKING:
    from typing_extensions import Unpack

from ..options import OptionKwargs, Options
from .distributed import checked_sharding, checked_warmup
from .optimizers import (
    OptimizerWatch,
    RequiresGradWatch,
    carried_gradients,
    make_graph_safe,
    optimizer_tensors,
)
from .schedules import DeviceHyperparameters

__all__ = ["TRAIN_STEP_OPTIONS", "TrainStep", "train_step"]

#: The options of ``cg.graph`` that a training step takes (it never falls back, verifies or
#: guards without replay: each of those would run or skip real optimizer steps).
TRAIN_STEP_OPTIONS = (
    "warmup",
    "outputs",
    "pool",
    "stream",
    "capture_error_mode",
    "on_stale",
    "modules",
    "replay_timeout_s",
)

log = logging.getLogger("cudagraphs")
R = TypeVar("R")


class TrainStep(Graphed[R]):
    """A training step captured whole; create with :func:`cudagraphs.train_step`.

    Besides :class:`~cudagraphs.Graphed`'s attributes: ``optimizers``. Its ``warmup`` steps
    are the caller's first steps, run eagerly; a recapture runs none (they would be optimizer
    steps).
    """

    records_gradients = (
        True  # its backward is inside the recording; replays return the loss detached
    )
    recapture_warms_up = False

    def __init__(
        self,
        fn: Callable[..., R],
        optimizers: Sequence[torch.optim.Optimizer],
        options: Options,
        *,
        switch_optimizer: bool,
        warmup_given: bool = True,
    ):
        super().__init__(fn, options)
        self.warmup_given = warmup_given
        self.optimizers = tuple(optimizers)
        self.switch_optimizer = switch_optimizer
        self._prepared = False
        self._hyperparameters: list[DeviceHyperparameters] = []
        self._carried: list[str] = []  # parameters whose gradients one step leaves to the next
        self._stepped = False  # whether a warm-up step has run (and left gradients to watch)

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        if not self._prepared:
            if torch.cuda.is_available():
                checked_sharding(self.fn, self.options.modules)
            if self._on_cuda():
                # A DDP model needs more eager steps, and to have been built on our stream.
                self.warmup = self.warmups_left = checked_warmup(
                    self.fn, self.options.modules, warmup=self.warmups_left,
                    warmup_given=self.warmup_given, stream=self.options.stream,
                )  # fmt: skip
                for optimizer in self.optimizers:
                    make_graph_safe(optimizer, switch=self.switch_optimizer, notices=self.notices)
                self._hyperparameters = [DeviceHyperparameters(o) for o in self.optimizers]
            # CPU parameters: the step runs eagerly (its inputs are on the CPU), or, where it
            # is captured all the same (a stand-in graph), after the same warm-up steps.
            self._prepared = True
        with self.lock:
            # Values a scheduler wrote since the last step go to the tensors the graph reads.
            for hyperparameters in self._hyperparameters:
                hyperparameters.refresh()
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

    def prepare_eager_output(self, output: Any) -> Any:
        return optree.tree_map(
            lambda t: t.detach() if isinstance(t, torch.Tensor) else t, output, namespace=NAMESPACE
        )

    def eager_warmup_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        if self.warmups_left > 0:  # not the last warm-up step: nothing to compare with yet
            self._stepped = True
            return super().eager_warmup_call(args, kwargs)
        names = {
            id(p): f"{type(m).__name__}.{name}"
            for m in modules_of(self.fn, self.options.modules)
            for name, p in m.named_parameters()
        }  # fmt: skip
        with carried_gradients(self.optimizers, names) as watch:
            output = super().eager_warmup_call(args, kwargs)
        self._carried = watch.carried
        if watch.unseen and not self._stepped:
            # The only warm-up step began with no gradients (no step had run yet), so it could
            # not show whether the step adds to the last one's: one more eager step shows it.
            self.warmups_left = 1
        self._stepped = True
        return output

    def before_capture(self) -> None:
        if self._carried:
            listed = ", ".join(self._carried[:5]) + (" and more" if len(self._carried) > 5 else "")
            raise FrozenStateError(
                explain(
                    f"{callable_name(self.fn)} adds to the gradients the previous step left "
                    f"({listed}): its backward accumulates across calls",
                    "a recorded step starts from the gradients set to None at capture and writes "
                    "them afresh on every replay, so the carried part would silently be lost",
                    "zero the gradients in the step (opt.zero_grad() first, as eager training "
                    "does), or accumulate inside one step (several backward calls before "
                    "opt.step()); for gradients kept across calls use cg.graph_autograd on the "
                    "forward and step the optimizer yourself",
                ),
                names=self._carried,
            )
        for optimizer in self.optimizers:
            # Again (load_state_dict may have undone it); its warning counted, not repeated.
            make_graph_safe(optimizer, switch=self.switch_optimizer, notices=self.notices)
            # Gradients set to None are allocated by the recorded backward inside the graph's
            # pool and refilled in place by every replay.
            optimizer.zero_grad(set_to_none=True)

    def make_guard(self) -> AddressGuard | None:
        extra = [named for optimizer in self.optimizers for named in optimizer_tensors(optimizer)]
        watches: list[Any] = [OptimizerWatch(optimizer) for optimizer in self.optimizers]
        watches += [
            *self.value_watches(),
            RequiresGradWatch(modules_of(self.fn, self.options.modules)),
        ]
        return AddressGuard(
            self.fn, self.options.modules, extra=extra, watches=watches, backward=True
        )

    def __repr__(self) -> str:
        opts = ", ".join(type(o).__name__ for o in self.optimizers)
        return f"<cudagraphs.TrainStep {callable_name(self.fn)} [{opts}] state={self.state.value}>"


@overload
def train_step(
    fn: Callable[..., R],
    /,
    *,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    switch_optimizer: bool = True,
    **options: Unpack[OptionKwargs],
) -> TrainStep[R]: ...


@overload
def train_step(
    fn: None = None,
    /,
    *,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    switch_optimizer: bool = True,
    **options: Unpack[OptionKwargs],
) -> Callable[[Callable[..., R]], TrainStep[R]]: ...


def train_step(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    switch_optimizer: bool = True,
    **options: Unpack[OptionKwargs],
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

    A ``DistributedDataParallel`` model in the step must be built with :func:`cudagraphs.ddp`
    (on the stream the step is captured on; refused otherwise, with the fix), and gets at least
    11 eager steps before the capture, as PyTorch requires.

    Options: ``warmup`` (eager steps before the capture, default 3), ``outputs``, ``pool``,
    ``stream``, ``capture_error_mode``, ``on_stale``, ``modules``, ``replay_timeout_s``, as for
    :func:`cudagraphs.graph`.

    Wrong: ``opt.param_groups[0]["lr"] = 0.1`` (replaces the tensor the graph reads: caught,
    and the step is captured again), a step without ``opt.zero_grad()`` whose gradients carry
    over to the next call (refused at capture: a replay writes them afresh; with ``warmup=1``
    and no gradients yet, one more eager step runs to see it), ``GradScaler``
    with a non-fused optimizer (its ``step`` syncs
    on ``found_inf``: a CaptureError; use ``fused=True``), or a data-dependent ``if loss > x:``
    inside the step (frozen at capture; ``cg.doctor`` finds it).
    """
    optimizers = _optimizer_list(optimizer)
    settings = Options.from_kwargs(dict(options), entry="train_step", allowed=TRAIN_STEP_OPTIONS)
    warmup = settings.warmup
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
        return TrainStep(
            f, optimizers, settings, switch_optimizer=switch_optimizer,
            warmup_given="warmup" in options,
        )  # fmt: skip

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

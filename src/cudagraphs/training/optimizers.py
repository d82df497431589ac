"""Optimizers inside a CUDA graph: a graph-safe step, and the learning rate on the device.

An optimizer step can be recorded only if it never reads a value on the host: PyTorch's default
Adam keeps its step counter on the CPU and computes the bias correction in Python, and every
optimizer reads ``group["lr"]`` as a Python float, which a recording freezes (a scheduler would
then change nothing, silently). The graph-safe forms:

- ``fused=True`` (Adam, AdamW, SGD): one kernel per parameter group, counters on the device,
  a tensor learning rate, and the ``grad_scale``/``found_inf`` arguments GradScaler needs;
- ``capturable=True`` (Adam, AdamW, RMSprop, NAdam, RAdam, Adamax, ASGD, ...): counters on the
  device, a tensor learning rate.

:func:`make_graph_safe` switches an optimizer to one of these (fused where offered) and replaces
each float learning rate by a 0-dim device tensor, which ``LRScheduler`` then updates in place
(``fill_``), so a schedule keeps working without capturing again. :class:`OptimizerWatch` notices
what would still go stale: a hyperparameter changed after capture, ``group["lr"] = 0.1``
replacing the tensor, or ``load_state_dict`` replacing the state tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..core import compat
from ..errors import ConfigError, Notices, explain, require_cuda
from .schedules import GRAPH_SAFE, DeviceHyperparameters, device_keys

__all__ = [
    "OptimizerWatch",
    "RequiresGradWatch",
    "GradientWatch",
    "carried_gradients",
    "make_graph_safe",
    "optimizer_tensors",
    "warn_momentum_schedule",
]

log = logging.getLogger("cudagraphs")


def make_graph_safe(
    optimizer: torch.optim.Optimizer, *, switch: bool = True, notices: Notices | None = None
) -> list[str]:
    """Put ``optimizer`` in a form whose ``step()`` can be captured; return what was changed.

    With ``switch=False`` a configuration that is not graph-safe raises :class:`ConfigError`
    naming the setting to pass instead. ``notices``: where the warning about a momentum
    schedule goes (a training step's, which shows it once under the cause its recaptures count).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            explain(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}",
                "the training step's optimizer state is read and written by the graph",
                "pass optimizer=torch.optim.AdamW(model.parameters(), ...) (or a list of them)",
            )
        )
    name = type(optimizer).__name__
    # Check every group first, so that a refusal leaves the optimizer untouched.
    plan: list[tuple[dict[str, Any], str | None, torch.device]] = []
    for k, group in enumerate(optimizer.param_groups):
        params = list(group["params"])
        if not params:
            continue
        setting = _check_group(optimizer, k, group, params, switch)
        devices = {p.device for p in params}
        if len(devices) > 1 or next(iter(devices)).type != "cuda":
            require_cuda(f"cg.make_graph_safe({name})")  # none here: say that, not "move it"
            raise ConfigError(
                explain(
                    f"{name}.param_groups[{k}] holds parameters on {sorted(map(str, devices))}",
                    "a CUDA graph records work on one CUDA device",
                    "move the model to one CUDA device before creating the optimizer",
                )
            )
        plan.append((group, setting, params[0].device))
    changes: list[str] = []
    for k, (group, setting, device) in enumerate(plan):
        if setting is not None:
            group[setting] = True
            if "capturable" in group:
                # Adam's step refuses to be captured unless capturable=True, fused or not.
                group["capturable"] = True
            if setting == "fused":
                group["foreach"] = False  # fused and foreach are exclusive
                compat.declare_amp_scaling(optimizer)
            changes.append(f"param_groups[{k}]: {setting}=True")
        _move_counters(optimizer, group["params"], device)
    if plan and not isinstance(optimizer, GRAPH_SAFE):
        changes += DeviceHyperparameters(optimizer).install()
    warn_momentum_schedule(optimizer, notices or Notices())
    if changes:
        log.info("cudagraphs: %s made graph-safe: %s", name, "; ".join(changes))
    return changes


def warn_momentum_schedule(optimizer: torch.optim.Optimizer, notices: Notices) -> None:
    """Warn (once per cause in ``notices``) where a scheduler cycles a momentum that
    ``optimizer``'s step reads as a Python float: each change is a recapture."""
    name = type(optimizer).__name__
    for k, group in enumerate(optimizer.param_groups):
        if "max_momentum" not in group or isinstance(optimizer, GRAPH_SAFE):
            continue
        key = "betas" if "betas" in group else "momentum"
        notices.warn(
            f"capturing again: {name}.param_groups[{k}][{key!r}]",  # as OptimizerWatch says
            f"cudagraphs: a scheduler cycles {name}'s momentum, which its step reads as a "
            "Python float: each change captures the step again (correct, not faster; shown "
            "once, stats.notices counts them). cg.GraphSafeAdamW / cg.GraphSafeSGD read it "
            "from the device instead.",
            logger=log,
            count=False,  # a warning ahead: the recaptures themselves are counted
        )


def _check_group(
    optimizer: torch.optim.Optimizer,
    k: int,
    group: dict[str, Any],
    params: list[torch.Tensor],
    switch: bool,
) -> str | None:
    """The setting to switch on (``"fused"``/``"capturable"``), ``None`` if already safe."""
    name = type(optimizer).__name__
    if group.get("differentiable"):
        raise ConfigError(
            explain(
                f"{name} was created with differentiable=True",
                "a differentiable optimizer step builds an autograd graph through the update, "
                "which a replay cannot extend",
                "create the optimizer with differentiable=False for a captured training step",
            )
        )
    if isinstance(optimizer, GRAPH_SAFE):
        return None  # its step reads everything from device tensors
    if group.get("capturable") or (group.get("fused") and "capturable" not in group):
        return None
    setting = _graph_safe_setting(optimizer, group, params)
    if (
        setting == "fused"
        and isinstance(optimizer, torch.optim.SGD)
        and any(compat.tensor_shard(p) is not None for p in params)
    ):
        raise ConfigError(
            explain(
                f"{name}.param_groups[{k}] holds sharded parameters (DTensors: fully_shard "
                "or tensor parallelism), and SGD's graph-safe form is fused=True",
                "PyTorch's fused SGD step has no DTensor rule (NotImplementedError at the "
                "first step), and the unfused one reads the learning rate on the host",
                "use cg.GraphSafeSGD(model.parameters(), lr=..., momentum=...) (the same "
                "update, on the device), or torch.optim.AdamW(..., fused=True)",
            )
        )
    if setting is None:
        raise ConfigError(
            explain(
                f"{name} has no graph-safe mode (neither capturable= nor fused=)",
                "its step reads counters or hyperparameters on the host, which a recording "
                "freezes at their capture-time values",
                "use an optimizer with capturable or fused support (Adam, AdamW, SGD, RMSprop, "
                "NAdam, RAdam, Adamax, ASGD), or graph only the forward and backward "
                "(cg.graph_autograd) and step eagerly",
            )
        )
    if not switch:
        raise ConfigError(
            explain(
                f"{name}.param_groups[{k}] is neither fused nor capturable",
                "its default step keeps the step count on the CPU and reads the learning rate "
                "as a Python float, both frozen by a recording",
                f"create it with {setting}=True, or leave switch_optimizer=True to let "
                "cudagraphs switch it",
            )
        )
    return setting


# Optimizers whose fused step runs on CUDA (Adagrad's fused step is CPU-only).
_CUDA_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _graph_safe_setting(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor]
) -> str | None:
    if group.get("fused") and "capturable" in group:
        return "capturable"  # fused Adam still has to be told it is being captured
    if isinstance(optimizer, _CUDA_FUSED) and all(p.is_floating_point() for p in params):
        return "fused"
    if "capturable" in group:
        return "capturable"
    return None


def _move_counters(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], device: torch.device
) -> None:
    """State made by earlier eager steps keeps ``step`` on the CPU; graph-safe forms want it on
    the device (a host counter would be frozen by the recording)."""
    for p in params:
        state = optimizer.state.get(p)
        if not state:
            continue
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() == 0:
                state[key] = value.to(device=device, dtype=torch.float32)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """The tensors a recorded step reads by address: parameters, state, device hyperparameters."""
    name = type(optimizer).__name__
    found: list[tuple[str, torch.Tensor]] = []
    index = 0
    for k, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key != "params" and isinstance(value, torch.Tensor):
                found.append((f"{name}.param_groups[{k}][{key!r}]", value))
        for p in group["params"]:
            found.append((f"{name} parameter {index}", p))
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    found.append((f"{name}.state[parameter {index}][{key!r}]", value))
            index += 1
    return [(n, t) for n, t in found if t.device.type == "cuda"]


class OptimizerWatch:
    """Notices optimizer changes that a recorded step would silently ignore."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.name = type(optimizer).__name__
        self.loads = 0
        optimizer.register_load_state_dict_post_hook(self._loaded)
        self._record()

    def _loaded(self, _optimizer: Any) -> None:
        self.loads += 1

    def _record(self) -> None:
        self.seen_loads = self.loads
        # Hyperparameters the step reads from device tensors follow any schedule (refreshed
        # before each replay, schedules.DeviceHyperparameters): not stale when they change.
        self.groups = [
            [
                (key, value)
                for key, value in group.items()
                if key != "params" and key not in device_keys(self.optimizer, group)
            ]
            for group in self.optimizer.param_groups
        ]

    def stale(self) -> str | None:
        """``None`` if the recorded step still matches the optimizer; else what changed."""
        if self.loads != self.seen_loads:
            return f"{self.name}.load_state_dict replaced its state tensors"
        groups = self.optimizer.param_groups
        if len(groups) != len(self.groups):
            return f"{self.name} gained a parameter group (add_param_group)"
        for k, (group, recorded) in enumerate(zip(groups, self.groups)):
            for key, value in recorded:
                now = group.get(key)
                if now is value:
                    continue
                if isinstance(value, torch.Tensor) or isinstance(now, torch.Tensor) or now != value:
                    return (
                        f"{self.name}.param_groups[{k}][{key!r}] changed from {value!r} to {now!r} "
                        "(the recording froze it; hyperparameters kept on the device follow "
                        "schedules: see cudagraphs.training.schedules)"
                    )
        return None


class RequiresGradWatch:
    """A training graph computes and applies gradients for the parameters that required them
    at capture: one frozen since (``requires_grad_(False)``) would still be trained, one
    unfrozen never. Asked before each replay (a Python loop: training steps only)."""

    def __init__(self, modules: Iterable[torch.nn.Module]):
        self.params = [
            (f"{type(m).__name__}.{name}", p, p.requires_grad)
            for m in modules for name, p in m.named_parameters()
        ]  # fmt: skip

    def stale(self) -> str | None:
        for name, p, flag in self.params:
            if p.requires_grad is not flag:
                return f"{name}.requires_grad was set to {p.requires_grad} after the capture"
        return None


@dataclasses.dataclass
class GradientWatch:
    """What :func:`carried_gradients` saw in one eager step: ``carried``, the parameters whose
    backward added to a gradient the step before left in place; ``unseen``, those that had no
    gradient when the step began, for which the step could not show whether it would add to
    one (before any step ran, every parameter)."""

    carried: list[str] = dataclasses.field(default_factory=list)
    unseen: list[str] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def carried_gradients(
    optimizers: Sequence[torch.optim.Optimizer], names: Mapping[int, str]
) -> Iterator[GradientWatch]:
    """While active (one eager step): which of the optimizers' parameters have a backward that
    adds to a gradient the step before left in place (not set to ``None``, not zeroed).

    A recorded step starts from the gradients set to ``None`` at capture, so its backward
    writes each gradient afresh on every replay; a step that relies on adding to the last
    call's gradients would silently lose them. Each parameter is looked at once, before the
    first gradient of the step reaches it (a second backward in the same step may add to the
    first one's: that is the step's own accumulation). The value check syncs: warm-up only.
    ``names``: ``id(param) -> name`` for messages."""
    params = [
        p for o in optimizers for group in o.param_groups for p in group["params"]
        if p.requires_grad
    ]  # fmt: skip
    at_start = {id(p): p.grad for p in params}
    watch = GradientWatch()
    looked: set[int] = set()

    def watch_param(p: torch.Tensor) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if id(p) in looked:
                return
            looked.add(id(p))
            name = names.get(id(p), f"a parameter of shape {tuple(p.shape)}")
            now = p.grad
            if at_start[id(p)] is None:
                watch.unseen.append(name)
            elif now is not None and now is at_start[id(p)] and bool(now.ne(0).any()):
                watch.carried.append(name)

        return hook

    handles = [p.register_hook(watch_param(p)) for p in params]
    try:
        yield watch
    finally:
        for handle in handles:
            handle.remove()

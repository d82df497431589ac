"""Hyperparameters on the device, so that any schedule replays without capturing again.

A recorded optimizer step reads every hyperparameter the way it read it at capture: a Python
float becomes a constant inside a kernel. Schedulers change them between steps: every
``LRScheduler`` the learning rate, ``OneCycleLR``/``CyclicLR`` with ``cycle_momentum=True``
Adam's ``betas[0]`` or SGD's ``momentum``, a hand-written loop anything. So the graph-safe
forms keep them as 0-dim device tensors that the step reads from device memory, and
:meth:`DeviceHyperparameters.refresh` runs before every replay: a value a scheduler (or the
user) wrote into ``param_groups`` as a float is copied into its tensor, and the tensor is put
back in the group. Schedulers already update a tensor learning rate in place.

Which ones live on the device depends on what the step implementation can read from a tensor:

- torch's optimizers (fused or capturable): ``lr`` only. Their steps take ``betas``,
  ``momentum``, ``eps`` and ``weight_decay`` as Python numbers (SGD branches on
  ``momentum != 0``; capturable Adam's ``lerp`` with a tensor ``betas[0]`` syncs in torch 2.11);
- :class:`GraphSafeAdamW`: ``lr``, ``betas``, ``eps`` and ``weight_decay``;
- :class:`GraphSafeSGD`: ``lr``, ``momentum``, ``dampening`` and ``weight_decay``.

Anything else that changes after capture is still seen by ``OptimizerWatch`` (capture again).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["GRAPH_SAFE", "DeviceHyperparameters", "GraphSafeAdamW", "GraphSafeSGD", "device_keys"]


def device_keys(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> tuple[str, ...]:
    """The hyperparameters of ``group`` that this optimizer's step reads from device tensors."""
    if isinstance(optimizer, GRAPH_SAFE):
        return optimizer.DEVICE_KEYS
    return ("lr",)


def _scalar(value: Any, device: torch.device) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class DeviceHyperparameters:
    """The device tensors of one optimizer's hyperparameters; :meth:`refresh` before a replay.

    For torch's optimizers that is the learning rate (a 0-dim tensor in ``param_groups``, which
    schedulers fill in place; a float written over it is copied in and the tensor put back);
    the graph-safe optimizers below keep their own tensors and refresh them themselves.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.tensors: list[torch.Tensor | None] = []
        self.install()

    def install(self) -> list[str]:
        """Make each group's learning rate a device tensor; what was changed, in words."""
        changes = []
        self.tensors = []
        if isinstance(self.optimizer, GRAPH_SAFE):
            return changes
        for k, group in enumerate(self.optimizer.param_groups):
            if not group["params"]:
                self.tensors.append(None)
                continue
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = _scalar(group["lr"], group["params"][0].device)
                changes.append(f"param_groups[{k}]: lr as a device tensor")
            self.tensors.append(group["lr"])
        return changes

    def refresh(self) -> None:
        """Copy values written into ``param_groups`` since the last replay into the device
        tensors the recording reads (and put those tensors back into the groups)."""
        if isinstance(self.optimizer, GRAPH_SAFE):
            self.optimizer.refresh()
            return
        for group, tensor in zip(self.optimizer.param_groups, self.tensors):
            now = group["lr"]
            if tensor is None or now is tensor:
                continue
            tensor.fill_(float(now))
            group["lr"] = tensor


class _DeviceScalars:
    """Per group, 0-dim device tensors of the hyperparameters in ``DEVICE_KEYS`` (``betas`` is
    two), refreshed from the groups' plain floats outside captures."""

    DEVICE_KEYS: tuple[str, ...] = ()
    param_groups: list[dict[str, Any]]

    def _start_scalars(self) -> None:
        self._device: list[dict[str, torch.Tensor]] = []
        self._seen: list[dict[str, float]] = []

    def _flat(self, group: dict[str, Any]) -> dict[str, float]:
        values: dict[str, float] = {}
        for key in self.DEVICE_KEYS:
            value = group[key]
            if key == "betas":
                values["beta1"], values["beta2"] = (float(b) for b in value)
            else:
                values[key] = float(value)
        return values

    def refresh(self) -> None:
        """Copy the groups' current values into the device tensors (a kernel only for a value
        that changed). Never inside a capture: the copy would be recorded with today's value."""
        for k, group in enumerate(self.param_groups):
            values = self._flat(group)
            if k >= len(self._device):
                device = group["params"][0].device
                self._device.append({n: _scalar(v, device) for n, v in values.items()})
                self._seen.append(values)
                continue
            tensors, seen = self._device[k], self._seen[k]
            for name, value in values.items():
                if value != seen[name]:  # a float written by a scheduler or the user
                    tensors[name].fill_(value)
                    seen[name] = value

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One optimizer step (``closure`` as in torch), reading hyperparameters from the
        device tensors (refreshed first, outside captures)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not _capturing():
            self.refresh()
        for k, (group, hyper) in enumerate(zip(self.param_groups, self._device)):
            self._update_group(k, group, hyper)
        return loss

    def _update_group(self, k: int, group: dict[str, Any], hyper: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError


class GraphSafeSGD(_DeviceScalars, torch.optim.SGD):
    """``torch.optim.SGD`` whose ``lr``, ``momentum``, ``dampening`` and ``weight_decay`` are
    read from device tensors, so a recorded step follows any schedule of them.

    Right::

        opt = cg.GraphSafeSGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.CyclicLR(opt, 0.01, 0.1, cycle_momentum=True)
        step = cg.train_step(step_fn, optimizer=opt)   # every step replays: no recapture

    Wrong (correct results, but slow)::

        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        # CyclicLR changes momentum every step; torch's SGD reads it as a Python float, so
        # each change means capturing the step again

    ``param_groups`` keep plain floats (what schedulers read and write); the tensors are
    refreshed from them at every eager ``step()`` and, in a captured step, before each replay.
    The update is SGD's (momentum, dampening, Nesterov, weight decay, maximize), written with
    tensor scalars; momentum buffers start as the first gradient, as in torch's SGD.
    """

    DEVICE_KEYS = ("lr", "momentum", "dampening", "weight_decay")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, **kwargs: Any):
        kwargs.pop("foreach", None)
        kwargs.pop("fused", None)
        super().__init__(params, lr=lr, foreach=False, **kwargs)
        self._start_scalars()
        # Whether each group keeps momentum buffers: decided once (a schedule may pass 0).
        self._with_momentum = [float(g["momentum"]) != 0 for g in self.param_groups]

    def _update_group(self, k: int, group: dict[str, Any], hyper: dict[str, torch.Tensor]) -> None:
        lr, momentum = hyper["lr"], hyper["momentum"]
        dampening, decay = hyper["dampening"], hyper["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = -p.grad if group["maximize"] else p.grad
            grad = grad + decay * p
            if self._with_momentum[k]:
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    state["momentum_buffer"] = buf = grad.clone()
                else:
                    buf.mul_(momentum).add_((1 - dampening) * grad)
                grad = grad + momentum * buf if group["nesterov"] else buf
            p.sub_(lr * grad)


class GraphSafeAdamW(_DeviceScalars, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``lr``, ``betas``, ``eps`` and ``weight_decay`` are read
    from device tensors, so a recorded step follows any schedule of them (``OneCycleLR`` with
    ``cycle_momentum=True`` cycles ``betas[0]``).

    Right::

        opt = cg.GraphSafeAdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, 1e-2, total_steps=1000)
        step = cg.train_step(step_fn, optimizer=opt)   # no recapture as betas cycle

    Wrong (correct results, but slow): ``torch.optim.AdamW`` with the same scheduler; its
    step reads ``betas`` as Python floats, so every change captures the step again.

    The update is AdamW's (decoupled weight decay, bias correction, ``amsgrad``, ``maximize``),
    written with tensor scalars; ``param_groups`` keep plain floats.
    """

    DEVICE_KEYS = ("lr", "betas", "eps", "weight_decay")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, **kwargs: Any):
        for setting in ("foreach", "fused", "capturable", "differentiable"):
            kwargs.pop(setting, None)
        super().__init__(params, lr=lr, foreach=False, **kwargs)
        self._start_scalars()

    def _update_group(self, k: int, group: dict[str, Any], hyper: dict[str, torch.Tensor]) -> None:
        lr, beta1, beta2 = hyper["lr"], hyper["beta1"], hyper["beta2"]
        eps, decay = hyper["eps"], hyper["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = -p.grad if group["maximize"] else p.grad
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p)
            step, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
            step.add_(1)
            p.mul_(1 - lr * decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad * (1 - beta2))
            if group["amsgrad"]:
                torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
                second = state["max_exp_avg_sq"]
            else:
                second = exp_avg_sq
            bias1 = 1 - beta1**step
            bias2 = 1 - beta2**step
            denom = (second.sqrt() / bias2.sqrt()).add_(eps)
            p.sub_((lr / bias1) * exp_avg / denom)


#: The optimizers whose steps read every scheduled hyperparameter from the device.
GRAPH_SAFE = (GraphSafeSGD, GraphSafeAdamW)

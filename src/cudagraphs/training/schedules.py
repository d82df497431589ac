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

- torch's Adam/AdamW: ``lr`` (fused or capturable) and, in the capturable form, ``betas`` (the
  form :func:`~cudagraphs.training.optimizers.make_graph_safe` picks when a scheduler cycles
  momentum);
- :class:`GraphSafeSGD`: ``lr``, ``momentum``, ``dampening`` and ``weight_decay`` (torch's SGD
  branches on ``momentum != 0`` in Python, so it cannot take a tensor there);
- every other graph-safe optimizer: ``lr``.

Anything else that changes after capture is still seen by ``OptimizerWatch`` (capture again).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DeviceHyperparameters", "GraphSafeSGD", "device_keys"]


def device_keys(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> tuple[str, ...]:
    """The hyperparameters of ``group`` that this optimizer's step reads from device tensors."""
    if isinstance(optimizer, GraphSafeSGD):
        return ("lr", "momentum", "dampening", "weight_decay")
    betas = group.get("betas")
    if (
        isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
        and group.get("capturable")
        and not group.get("fused")
        and isinstance(betas, tuple)
    ):
        return ("lr", "betas")
    return ("lr",)


def _scalar(value: Any, device: torch.device) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float32, device=device)


class DeviceHyperparameters:
    """The device tensors of one optimizer's hyperparameters; :meth:`refresh` before a replay."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.tensors: list[dict[str, Any]] = []
        self.install()

    def install(self) -> list[str]:
        """Replace float hyperparameters by device tensors (where the step reads them so);
        what was changed, in words."""
        changes = []
        self.tensors = []
        for k, group in enumerate(self.optimizer.param_groups):
            params = group["params"]
            device = params[0].device if params else torch.device("cpu")
            mine: dict[str, Any] = {}
            for key in device_keys(self.optimizer, group):
                value = group.get(key)
                if key == "betas":
                    if not all(isinstance(b, torch.Tensor) for b in value):
                        value = tuple(
                            b if isinstance(b, torch.Tensor) else _scalar(b, device) for b in value
                        )
                        group[key] = value
                        changes.append(f"param_groups[{k}]: betas as device tensors")
                elif not isinstance(value, torch.Tensor) and not isinstance(
                    self.optimizer, GraphSafeSGD
                ):
                    value = _scalar(value, device)
                    group[key] = value
                    changes.append(f"param_groups[{k}]: {key} as a device tensor")
                mine[key] = value
            self.tensors.append(mine)
        return changes

    def refresh(self) -> None:
        """Copy values written into ``param_groups`` since the last replay into the device
        tensors the recording reads, and put those tensors back into the groups."""
        if isinstance(self.optimizer, GraphSafeSGD):
            self.optimizer.refresh()
            return
        for group, mine in zip(self.optimizer.param_groups, self.tensors):
            for key, tensor in mine.items():
                now = group.get(key)
                if now is tensor:
                    continue
                if key == "betas":
                    for held, value in zip(tensor, now):
                        if value is not held:
                            held.fill_(float(value))
                else:
                    tensor.fill_(float(now))
                group[key] = tensor


class GraphSafeSGD(torch.optim.SGD):
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
    The update is SGD's (with momentum, dampening, Nesterov, weight decay and maximize), written
    with tensor scalars; momentum buffers start as the first gradient, as in torch's SGD.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, **kwargs: Any):
        kwargs.pop("foreach", None)
        kwargs.pop("fused", None)
        super().__init__(params, lr=lr, foreach=False, **kwargs)
        self._device: list[dict[str, torch.Tensor]] = []
        self._seen: list[dict[str, float]] = []
        # Whether each group keeps momentum buffers: decided once (a schedule may pass 0).
        self._with_momentum = [float(g["momentum"]) != 0 for g in self.param_groups]

    def refresh(self) -> None:
        """Copy the groups' current values into the device tensors (kernels only for values
        that changed). Never inside a capture: the copy would be recorded with today's value."""
        for k, group in enumerate(self.param_groups):
            if k >= len(self._device):
                device = group["params"][0].device
                self._device.append({key: _scalar(group[key], device) for key in _SGD_KEYS})
                self._seen.append({key: float(group[key]) for key in _SGD_KEYS})
                continue
            tensors, seen = self._device[k], self._seen[k]
            for key in _SGD_KEYS:
                value = group[key]
                if isinstance(value, torch.Tensor):  # a tensor lr from make_graph_safe
                    if value is not tensors[key]:
                        tensors[key] = value
                    continue
                if float(value) != seen[key]:  # a float written by a scheduler or the user
                    tensors[key].fill_(float(value))
                    seen[key] = float(value)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            self.refresh()
        for k, (group, hyper) in enumerate(zip(self.param_groups, self._device)):
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
        return loss


_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay")

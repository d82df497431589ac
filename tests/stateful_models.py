"""Modules whose forward changes a plain Python attribute on every run: what a recording would
freeze (used by the CPU and GPU tests of the frozen-state check)."""

from __future__ import annotations

import torch
from torch import nn


class Counting(nn.Module):
    """``self.calls += 1``: a logging counter, harmless once declared."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.net(x)


class Flipping(nn.Module):
    """A flag the forward flips and branches on: every replay would take the recorded branch."""

    def __init__(self, net: nn.Module | None = None) -> None:
        super().__init__()
        self.net = net if net is not None else nn.Identity()
        self.flip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.flip = not self.flip
        y = self.net(x)
        return -y if self.flip else y

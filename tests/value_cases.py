"""A module whose forward reads plain values of every kind, and a module global through a
helper: the cases of the value guards' tests (CPU and GPU)."""

from __future__ import annotations

import enum

import torch
from torch import nn

GAIN = 1.0


def gained(x: torch.Tensor) -> torch.Tensor:  # a helper the graphed function calls
    return x * GAIN


class Kind(enum.Enum):
    DOUBLE = 2
    TRIPLE = 3


class Scaled(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width).requires_grad_(False)
        self.scale, self.shift, self.flip = 1.0, 0, False
        self.act, self.kind, self.offsets = "relu", Kind.DOUBLE, (0.0, 0.0)
        self.calls = 0  # a logging counter: declared harmless

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = gained(self.fc(x)) * self.scale + self.shift + self.offsets[1]
        y = y * self.kind.value
        y = torch.relu(y) if self.act == "relu" else torch.tanh(y)
        return -y if self.flip else y


#: case -> (attribute of Scaled, or "GAIN" of this module; the new value)
CHANGES = {
    "float": ("scale", 2.0),
    "int": ("shift", 3),
    "bool": ("flip", True),
    "str": ("act", "tanh"),
    "enum": ("kind", Kind.TRIPLE),
    "tuple": ("offsets", (0.0, 1.5)),
}

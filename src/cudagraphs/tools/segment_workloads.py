"""Workloads with a step that cannot be recorded: the segment tests, the benchmark and the example."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core import eager


@eager
def flip_if_above(h: torch.Tensor, threshold: torch.Tensor) -> None:
    """The host decision: flip the sign of the hidden state if its mean is above the
    threshold (one host read, ``.item()``, so it cannot be recorded)."""
    if (h.mean() > threshold).item():
        h.neg_()


class DecisionMLP(nn.Module):
    """``layers`` Linear+GELU blocks with the host decision after the middle block."""

    def __init__(
        self, width: int = 256, layers: int = 20, threshold: float = 0.0, decide: Any = None
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.register_buffer("threshold", torch.tensor(threshold))
        # Another library's mark for the same step (the peer comparison), or ours.
        self.decide = decide or flip_if_above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        middle = len(self.blocks) // 2
        h = x
        for block in self.blocks[:middle]:
            h = torch.nn.functional.gelu(block(h))
        self.decide(h, self.threshold)  # outside the loops: torch.compile can resume after it
        for block in self.blocks[middle:]:
            h = torch.nn.functional.gelu(block(h))
        return h


class CountingRouter(nn.Module):
    """Reads per-expert counts on the host (``.tolist()``), as mixture-of-experts fallbacks do,
    and runs one small matmul per expert on the rows routed to it."""

    def __init__(self, width: int = 64, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        choice = self.gate(h).argmax(-1)
        counts = torch.bincount(choice, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(h)
        order = torch.argsort(choice)
        start = 0
        for e, n in enumerate(counts):
            rows = order[start : start + n]
            out[rows] = self.experts[e](h[rows])
            start += n
        self.calls += 1
        return out


class RoutedModel(nn.Module):
    """Linear, a host-reading router, Linear: the router must run eagerly between two graphs."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.router = CountingRouter(width)
        self.out = nn.Linear(width, width)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.out(torch.relu(self.router(torch.relu(self.inp(x)))))

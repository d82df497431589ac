"""The brief's workloads, shared by the demo, the benchmarks and the tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def brief_mlp() -> nn.Module:
    """The brief's MLP: 256 -> 256 -> 16, used at batch 128."""
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16))


def transformer() -> nn.Module:
    """A 4-layer encoder, d=256, 4 heads, used at batch 8, sequence 64."""
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)


def deep_mlp() -> nn.Module:
    """A 20-layer, 512-wide GELU MLP, used at batch 64: many small launches."""
    layers: list[nn.Module] = []
    for _ in range(20):
        layers += [nn.Linear(512, 512), nn.GELU()]
    return nn.Sequential(*layers)


#: name -> (constructor, example input shape)
MODELS = {
    "brief_mlp": (brief_mlp, (128, 256)),
    "transformer": (transformer, (8, 64, 256)),
    "deep_mlp": (deep_mlp, (64, 512)),
}


def hand_written_graph(
    model: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The brief's pattern written by hand, the baseline cudagraphs is measured against:
    warm-up on a side stream, capture, then copy into the static input and replay."""
    static_x = example.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)

    def call(x: torch.Tensor) -> torch.Tensor:
        static_x.copy_(x)
        graph.replay()
        return static_y

    return call

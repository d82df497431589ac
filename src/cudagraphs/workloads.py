"""The brief's workloads, shared by the demo, the benchmarks and the tests."""

from __future__ import annotations

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

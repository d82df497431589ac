"""Small launch-bound workloads, shared by the demo, the benchmarks and the tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def mlp_256() -> nn.Module:
    """The 256-256-16 MLP: 256 -> 256 -> 16, used at batch 128."""
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
    "mlp_256": (mlp_256, (128, 256)),
    "transformer": (transformer, (8, 64, 256)),
    "deep_mlp": (deep_mlp, (64, 512)),
}


def hand_written_graph(
    model: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The usual pattern written by hand, the baseline cudagraphs is measured against:
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


def rl_rollout(
    n_envs: int = 256, steps: int = 128, device: str = "cuda"
) -> tuple[Callable[[dict[str, torch.Tensor]], torch.Tensor], dict[str, torch.Tensor]]:
    """An RL rollout: a small policy and a toy physics environment, ``steps`` steps per
    call, the state advanced in place. Returns ``(rollout, example_state)``."""
    policy = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 2)).to(device).eval()

    def rollout(state: dict[str, torch.Tensor]) -> torch.Tensor:
        pos, vel = state["pos"], state["vel"]
        total = torch.zeros(pos.shape[0], device=pos.device)
        for _ in range(steps):
            obs = torch.cat([pos, vel, pos * vel, torch.sin(pos)], dim=-1)
            action = torch.tanh(policy(obs) + 0.1 * torch.randn_like(vel))  # exploration noise
            vel.mul_(0.95).add_(0.05 * action)
            pos.add_(vel).clamp_(-10, 10)
            total += -(pos**2).sum(-1)
        return total

    state = {
        "pos": torch.randn(n_envs, 2, device=device),
        "vel": torch.zeros(n_envs, 2, device=device),
    }
    return rollout, state


def mlp_training_step(
    device: str = "cuda", batch: int = 256, model: nn.Module | None = None
) -> tuple[Callable[..., torch.Tensor], nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, ...]]:
    """The 256-256-16 MLP with cross-entropy and Adam: ``(step, model, optimizer, (x, y))``.
    Pass ``model`` (a copy of another step's) to train a twin from the same start."""
    model = (model if model is not None else mlp_256()).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    example = (
        torch.randn(batch, 256, device=device),
        torch.randint(0, 16, (batch,), device=device),
    )
    return step, model, opt, example


#: Llama shapes for the decoding example, benchmark and tests: name -> LlamaConfig arguments.
LLAMA_SHAPES: dict[str, dict[str, int]] = {
    "llama-tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
    "llama-512": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32000,
    ),
    "llama-2048": dict(  # the TinyLlama-1.1B shape: about 2.2 GB of bf16 weights
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
}


def random_llama(
    name: str, device: str = "cpu", dtype: torch.dtype = torch.float32, init: float = 0.3
) -> nn.Module:
    """A transformers Llama of one of :data:`LLAMA_SHAPES`, random weights (no download), in
    eval mode. ``init``: the weights' standard deviation; livelier than the default 0.02, so
    greedy decoding has clear winners instead of near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA_SHAPES[name], max_position_embeddings=4096, initializer_range=init)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: seconds, not minutes, for 1 B
        return LlamaForCausalLM(config).to(dtype=dtype).eval()

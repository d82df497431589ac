"""Tensor parallelism with the all-reduce inside the graph: a Megatron-style MLP and attention
block split across ranks, captured with cg.graph, checked against the same block on one device.

Each rank builds the full block from the same seed, keeps its shard of the weights (the MLP's
first layer and the attention's query/key/value by columns, their output layers by rows) and
sums the partial outputs with one all-reduce per block, inside the captured graph. Run with

    torchrun --nproc-per-node 2 examples/tensor_parallel.py

NCCL on GPUs (one per rank); gloo on the CPU, where the graph is the eager pass-through.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cudagraphs as cg

WIDTH, HEADS, SEQUENCE = 512, 8, 16


class Block(nn.Module):
    """Pre-norm attention then pre-norm GELU MLP, the single-device reference."""

    def __init__(self, width: int = WIDTH, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.out(attention(self.qkv(self.norm1(x)), self.heads))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    batch, length, width3 = qkv.shape
    q, k, v = qkv.view(batch, length, 3, heads, width3 // (3 * heads)).unbind(2)
    y = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    )
    return y.transpose(1, 2).reshape(batch, length, -1)


class ParallelBlock(nn.Module):
    """This rank's shard of a :class:`Block`: heads and MLP columns split ``world`` ways; the
    output layers' partial sums are all-reduced (their biases added once, after)."""

    def __init__(self, full: Block, rank: int, world: int, group: object = None):
        super().__init__()
        width = full.out.in_features
        self.heads, self.group = full.heads // world, group
        self.norm1, self.norm2 = full.norm1, full.norm2
        per_rank = width // world
        weights = [w[rank * per_rank : (rank + 1) * per_rank] for w in full.qkv.weight.chunk(3)]
        biases = [b[rank * per_rank : (rank + 1) * per_rank] for b in full.qkv.bias.chunk(3)]
        self.qkv = _linear(torch.cat(weights), torch.cat(biases))
        self.out = _linear(full.out.weight[:, rank * per_rank : (rank + 1) * per_rank], None)
        self.out_bias = nn.Parameter(full.out.bias.detach().clone())
        hidden = full.up.out_features // world
        self.up = _linear(
            full.up.weight[rank * hidden : (rank + 1) * hidden],
            full.up.bias[rank * hidden : (rank + 1) * hidden],
        )
        self.down = _linear(full.down.weight[:, rank * hidden : (rank + 1) * hidden], None)
        self.down_bias = nn.Parameter(full.down.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.out(attention(self.qkv(self.norm1(x)), self.heads))
        dist.all_reduce(partial, group=self.group)  # inside the graph when captured
        x = x + partial + self.out_bias
        partial = self.down(F.gelu(self.up(self.norm2(x))))
        dist.all_reduce(partial, group=self.group)
        return x + partial + self.down_bias


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def check(rank: int, world: int, device: torch.device) -> dict[str, float]:
    """Graphed tensor-parallel block against the single-device block; returns the figures."""
    torch.manual_seed(0)
    full = Block().to(device).eval()
    shard = ParallelBlock(full, rank, world).to(device).eval()
    x = torch.randn(1, SEQUENCE, WIDTH, device=device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudaGraphsWarning)  # CPU: the pass-through
        graphed = cg.graph(shard, x)
        errors = []
        for seed in range(3):  # fresh inputs, the same on every rank
            torch.manual_seed(100 + seed)
            fresh = torch.randn(1, SEQUENCE, WIDTH, device=device)
            errors.append(float((graphed(fresh) - full(fresh)).abs().max()))
        timings = {
            name: _time(fn, x, device) for name, fn in (("eager", shard), ("graphed", graphed))
        }
        timings["captured"] = graphed.state is cg.State.CAPTURED
    return {"max_abs_error": max(errors), **timings}


def _time(fn, x: torch.Tensor, device: torch.device, calls: int = 50) -> float:
    for _ in range(3):
        fn(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    from ddp_train import start_ranks  # beside this file: the process group and device set-up

    device = start_ranks("examples/tensor_parallel.py")
    rank, world = dist.get_rank(), dist.get_world_size()
    figures = check(rank, world, device)
    if rank == 0:
        label = "graphed" if figures["captured"] else "cg.graph, eager (no CUDA)"
        print(
            f"tensor-parallel block over {world} ranks on {device.type}: max |{label} - single| "
            f"{figures['max_abs_error']:.2e}; eager {figures['eager']:.0f} µs, {label} "
            f"{figures['graphed']:.0f} µs per call (batch 1, {SEQUENCE} tokens)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

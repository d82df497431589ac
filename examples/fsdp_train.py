"""Sharded training (FSDP2) with the whole step captured: cg.train_step over a model sharded
with ``torch.distributed.fsdp.fully_shard``.

A small transformer (8 layers, 512 wide, batch 8 per rank, sequence 128) is sharded layer by
layer and trained twice from the same initial weights, once with an ordinary eager loop and
once through ``cg.train_step``: forward (the all-gathers), backward (the reduce-scatters),
gradient clipping across shards and the optimizer step are one graph. The parameters must agree
after every run; the graphed step is timed against the eager one. Run with

    python examples/fsdp_train.py                            # one rank, no torchrun
    torchrun --nproc-per-node 1 examples/fsdp_train.py      # one GPU: NCCL with one rank
    torchrun --nproc-per-node 2 examples/fsdp_train.py      # two GPUs

Options: ``--reshard-after-forward {true,false}``, ``--bf16`` (``MixedPrecisionPolicy``:
bf16 parameters in forward and backward, fp32 gradients reduced), ``--steps N``. NCCL on GPUs;
gloo on the CPU, where both runs are eager and only the agreement is checked.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_train import start_ranks
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import cudagraphs as cg

LAYERS, WIDTH, HEADS, BATCH, SEQ, VOCAB = 8, 512, 8, 8, 128, 1024


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, -1).transpose(1, 3).unbind(2)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def sharded_model(device: torch.device, reshard: bool, bf16: bool) -> nn.Module:
    """The model with the same initial weights on every call, sharded block by block."""
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    settings = dict(
        reshard_after_forward=reshard, mp_policy=policy if bf16 else MixedPrecisionPolicy()
    )
    for block in model.blocks:
        fully_shard(block, **settings)
    fully_shard(model, **settings)
    return model


def train(
    graphed: bool, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
    reshard: bool, bf16: bool,
) -> tuple[list[torch.Tensor], float]:  # fmt: skip
    model = sharded_model(device, reshard, bf16)
    on_gpu = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=on_gpu)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the norm over every shard
        opt.step()
        return loss

    run = cg.train_step(step, optimizer=opt) if graphed else step
    warm = 4
    for tokens, targets in batches[:warm]:  # 3 eager steps, then the capture
        run(tokens, targets)
    if on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for tokens, targets in batches[warm:]:
        run(tokens, targets)
    if on_gpu:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / (len(batches) - warm)
    return [p.full_tensor().detach().float() for p in model.parameters()], seconds


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # On the CPU both runs are eager and only their agreement is checked: a few steps.
    p.add_argument("--steps", type=int, default=50 if torch.cuda.is_available() else 6)
    p.add_argument("--reshard-after-forward", choices=("true", "false"), default="true")
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args()
    device = start_ranks("examples/fsdp_train.py")
    rank = dist.get_rank()
    warnings.filterwarnings("ignore", category=cg.CudaGraphsWarning)
    data = torch.Generator(device=device).manual_seed(rank)
    batches = [
        (torch.randint(0, VOCAB, (BATCH, SEQ), device=device, generator=data),
         torch.randint(0, VOCAB, (BATCH, SEQ), device=device, generator=data))
        for _ in range(args.steps)
    ]  # fmt: skip
    reshard = args.reshard_after_forward == "true"
    eager, eager_s = train(False, batches, device, reshard, args.bf16)
    graphed, graphed_s = train(True, batches, device, reshard, args.bf16)
    worst = max(float(((a - b).abs() / (b.abs() + 1e-6)).max()) for a, b in zip(graphed, eager))
    if rank == 0:
        setting = (
            f"FSDP2 on {dist.get_world_size()} rank(s), reshard_after_forward={reshard}, "
            f"bf16={args.bf16}"
        )
        timing = (
            f"eager {1e3 * eager_s:.2f} ms/step, graphed {1e3 * graphed_s:.2f} ms/step "
            f"({eager_s / graphed_s:.2f}x)"
            if device.type == "cuda"
            else "no CUDA: both runs eager (cg.train_step is the pass-through), not timed"
        )
        print(
            f"{setting}: {timing}; parameters after {args.steps} steps: max relative "
            f"difference {worst:.1e}"
        )
    dist.destroy_process_group()
    if worst > 1e-5:
        raise SystemExit(
            f"the graphed run diverged from eager (max relative difference {worst:.1e})"
        )


if __name__ == "__main__":
    main()

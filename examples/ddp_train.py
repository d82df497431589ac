"""Data-parallel training with the whole step captured: cg.train_step over a DDP model.

Each rank trains the same MLP (DistributedDataParallel: gradients all-reduced in backward) on
its own batches, once with an ordinary eager loop and once through ``cg.train_step``, from the
same initial weights; the parameters must agree after every run, and the graphed step is timed
against the eager one. Run with

    torchrun --nproc-per-node 2 examples/ddp_train.py

NCCL on GPUs (one per rank); gloo on the CPU, where the step is the eager pass-through.
"""

from __future__ import annotations

import os
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cudagraphs as cg

# The 17-layer 512-wide GELU MLP, batch 256 per rank; 12 steps before timing (DDP's 11 eager
# steps, then the capture). On the CPU, where both runs are eager and only the agreement is
# checked, a 128-wide one at batch 32: the example finishes in seconds there.
STEPS, WARM, LAYERS = 50, 12, 17
BATCH, WIDTH = (256, 512) if torch.cuda.is_available() else (32, 128)


def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(LAYERS - 1):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def train(
    graphed: bool, optimizer: str, rank: int, device: torch.device
) -> tuple[list[torch.Tensor], float]:
    torch.manual_seed(0)
    model = mlp().to(device)
    ids = [device.index] if device.type == "cuda" else None
    # For a captured step DDP is built on the stream of the capture: cg.ddp does that.
    ddp = (
        cg.ddp(model, device_ids=ids)
        if graphed and device.type == "cuda"
        else DDP(model, device_ids=ids)
    )
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(
            ddp.parameters(), lr=1e-3, fused=device.type == "cuda"
        )
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-2, momentum=0.9, fused=device.type == "cuda")

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss

    run = cg.train_step(step, optimizer=opt) if graphed else step
    data = torch.Generator(device=device).manual_seed(rank)  # each rank its own batches
    batches = [
        (torch.randn(BATCH, WIDTH, device=device, generator=data),
         torch.randint(0, 10, (BATCH,), device=device, generator=data))
        for _ in range(STEPS)
    ]  # fmt: skip
    for x, y in batches[:WARM]:  # warm-up (graphed: DDP's 11 eager steps, then the capture)
        run(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for x, y in batches[WARM:]:
        run(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize()
    per_step = (time.perf_counter() - start) / (STEPS - WARM)
    return [p.detach().clone() for p in model.parameters()], per_step


def start_ranks(script: str) -> torch.device:
    """Join the process group (torchrun's, or one rank of its own under plain ``python``) and
    return this rank's device, made current: NCCL on GPUs, gloo on the CPU."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group(backend)
    else:  # plain `python`: one rank, no rendezvous to set up
        print(f"one rank; for several: torchrun --nproc-per-node 2 {script}")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not cuda:
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


def main() -> None:
    device = start_ranks("examples/ddp_train.py")
    cuda, rank = device.type == "cuda", dist.get_rank()
    worst = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudaGraphsWarning)  # CPU: the pass-through
        for optimizer in ("adam", "sgd"):
            eager, eager_s = train(False, optimizer, rank, device)
            graphed, graphed_s = train(True, optimizer, rank, device)
            worst[optimizer] = max(
                float(((a - b).abs() / (b.abs() + 1e-6)).max()) for a, b in zip(graphed, eager)
            )
            if rank == 0:
                label = "cg.train_step" if cuda else "cg.train_step, eager (no CUDA)"
                # Without CUDA both runs are eager: a ratio of their times would be noise.
                timing = (
                    f"eager {1e3 * eager_s:.2f} ms, {label} {1e3 * graphed_s:.2f} ms per step "
                    f"({eager_s / graphed_s:.1f}x)"
                    if cuda
                    else "no timing: without CUDA nothing is captured, both runs are eager"
                )
                print(
                    f"DDP over {dist.get_world_size()} ranks on {device.type}, {STEPS} {optimizer} "
                    f"steps: max relative difference {label} vs eager {worst[optimizer]:.1e}; "
                    f"{timing}"
                )
    dist.destroy_process_group()
    limit = 1e-5 if cuda else 1e-4
    assert all(w < limit for w in worst.values()), f"graphed DDP training must equal eager: {worst}"


if __name__ == "__main__":
    main()

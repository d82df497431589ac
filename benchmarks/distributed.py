"""Data-parallel training steps, side by side: eager DDP, torch.compile'd DDP, cg.train_step
over DDP, and cg.train_step over a step that all-reduces the flattened gradients by hand.

The model is the 17-layer 512-wide GELU MLP with Adam at batch 256 per rank. Each mode is
checked first (its parameters after the timed steps equal eager DDP's, relative 1e-5) and then
timed: milliseconds per step, steps/s, and the all-reduce's share of an eager step (one
all-reduce of all gradients, timed alone). Run with

    torchrun --nproc-per-node 2 benchmarks/distributed.py [--steps 100] [--json PATH]

NCCL on GPUs; on the CPU (gloo) the graphed modes are the eager pass-through: a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cudagraphs as cg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from ddp_train import BATCH, WIDTH, mlp

WARM = 12  # steps before timing: 11 eager DDP steps and the capturing one


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_step(mode: str, device: torch.device) -> tuple[Any, nn.Module]:
    torch.manual_seed(0)
    model = mlp().to(device)
    fused = device.type == "cuda"
    if mode == "hand all-reduce graphed":
        params = list(model.parameters())
        opt = torch.optim.Adam(params, lr=1e-3, fused=fused)
        world = dist.get_world_size()

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            flat = torch.cat([p.grad.flatten() for p in params])  # one all-reduce for all
            dist.all_reduce(flat)
            flat /= world
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(g.view_as(p))
            opt.step()
            return loss

        return cg.train_step(step, optimizer=opt), model
    ids = [device.index] if device.type == "cuda" else None
    # Graphed, DDP must be built on the stream the step is captured on (cg.ddp does it).
    graphed = mode == "graphed DDP" and device.type == "cuda"
    ddp = cg.ddp(model, device_ids=ids) if graphed else DDP(model, device_ids=ids)
    forward = torch.compile(ddp) if mode == "compile DDP" else ddp
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3, fused=fused)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        return loss

    return (cg.train_step(step, optimizer=opt) if mode == "graphed DDP" else step), model


def run_mode(mode: str, device: torch.device, steps: int) -> tuple[float, list[torch.Tensor]]:
    step, model = make_step(mode, device)
    data = torch.Generator(device=device).manual_seed(dist.get_rank())
    batches = [
        (torch.randn(BATCH, WIDTH, device=device, generator=data),
         torch.randint(0, 10, (BATCH,), device=device, generator=data))
        for _ in range(steps)
    ]  # fmt: skip
    for x, y in batches[:WARM]:  # DDP's 11 eager steps, then the capture, for every mode
        step(x, y)
    sync(device)
    start = time.perf_counter()
    for x, y in batches[WARM:]:
        step(x, y)
    sync(device)
    return (time.perf_counter() - start) / (steps - WARM), [
        p.detach().clone() for p in model.parameters()
    ]


def all_reduce_ms(device: torch.device, repeats: int = 20) -> float:
    numel = sum(p.numel() for p in mlp().parameters())
    flat = torch.randn(numel, device=device)
    dist.all_reduce(flat)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(flat)
    sync(device)
    return 1e3 * (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--modes", default="eager DDP,compile DDP,graphed DDP,hand all-reduce graphed")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    warnings.filterwarnings("ignore", category=cg.CudaGraphsWarning)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "CPU",
                               "world": dist.get_world_size(), "modes": {}}  # fmt: skip
    reference = None
    for mode in args.modes.split(","):
        seconds, params = run_mode(mode, device, args.steps)
        reference = params if reference is None else reference
        worst = max(
            float(((a - b).abs() / (b.abs() + 1e-6)).max()) for a, b in zip(params, reference)
        )
        results["modes"][mode] = {
            "ms_per_step": 1e3 * seconds,
            "steps_per_s": 1 / seconds,
            "max_rel_diff": worst,
        }
    results["all_reduce_ms"] = all_reduce_ms(device)
    eager = results["modes"].get("eager DDP", {}).get("ms_per_step")
    if eager:
        results["all_reduce_share_of_eager_step"] = results["all_reduce_ms"] / eager
    if dist.get_rank() == 0:
        for mode, r in results["modes"].items():
            speedup = f" ({eager / r['ms_per_step']:.1f}x eager)" if eager else ""
            print(
                f"{mode:26s} {r['ms_per_step']:8.2f} ms/step{speedup}  max rel diff {r['max_rel_diff']:.1e}"
            )
        print(f"all-reduce of all gradients alone: {results['all_reduce_ms']:.2f} ms")
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

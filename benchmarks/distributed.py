"""Data-parallel training steps, side by side: eager DDP, torch.compile'd DDP, cg.train_step
over DDP, cg.train_step over a step that all-reduces the flattened gradients by hand, and that
same step captured by hand with torch.cuda.CUDAGraph (the reference for the graphed modes);
then FSDP2 (``fully_shard``) eager against graphed on ``examples/fsdp_train.py``'s transformer.

The model is the 17-layer 512-wide GELU MLP with Adam at batch 256 per rank. Each mode runs 12
steps before timing (DDP's 11 eager steps, then the capture), is timed, and its parameters after
all steps are compared with eager DDP's (relative difference). Reported: milliseconds per step,
steps/s, speed against eager DDP and against the hand-captured step, and the all-reduce's share
of an eager step (one all-reduce of all gradients, timed alone). Run with

    torchrun --nproc-per-node 2 benchmarks/distributed.py [--steps 100] [--json PATH]

NCCL on GPUs; on the CPU (gloo) the graphed modes are the eager pass-through: a smoke run.
"""

from __future__ import annotations

import argparse
import json
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
import fsdp_train
from ddp_train import BATCH, WARM, WIDTH, mlp, start_ranks


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class HandCaptured:
    """The step captured by hand with torch.cuda.CUDAGraph, as one would without this library:
    eager warm-up steps on a side stream, one capture into static inputs, then copy and replay.
    The reference the graphed modes are measured against."""

    def __init__(self, step: Any, warmup: int):
        self.step, self.warmup, self.calls = step, warmup, 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls <= self.warmup:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self.step(x, y)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        if self.graph is None:
            self.static = (x.clone(), y.clone())
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.loss = self.step(*self.static)
        assert self.static is not None
        self.static[0].copy_(x)
        self.static[1].copy_(y)
        self.graph.replay()
        return self.loss


def make_step(mode: str, device: torch.device) -> tuple[Any, nn.Module]:
    torch.manual_seed(0)
    model = mlp().to(device)
    fused = device.type == "cuda"
    if mode in ("hand all-reduce graphed", "hand-captured"):
        params = list(model.parameters())
        hand = mode == "hand-captured" and device.type == "cuda"
        # capturable: the step count stays on the device, as a captured Adam needs
        opt = torch.optim.Adam(params, lr=1e-3, fused=fused, capturable=hand)
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

        if mode == "hand-captured":
            return (HandCaptured(step, WARM - 1) if hand else step), model
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


def fsdp_rows(device: torch.device, steps: int) -> dict[str, dict[str, float]]:
    """FSDP2 eager against FSDP2 graphed (``cg.train_step``) on the launch-bound transformer
    of ``examples/fsdp_train.py`` (8 layers, 512 wide, batch 8 per rank), from the same
    weights on the same batches, for each ``reshard_after_forward``."""
    rows = {}
    data = torch.Generator(device=device).manual_seed(dist.get_rank())
    batches = [
        (torch.randint(0, fsdp_train.VOCAB, (fsdp_train.BATCH, fsdp_train.SEQ), device=device, generator=data),
         torch.randint(0, fsdp_train.VOCAB, (fsdp_train.BATCH, fsdp_train.SEQ), device=device, generator=data))
        for _ in range(steps)
    ]  # fmt: skip
    for reshard in (True, False):
        eager, eager_s = fsdp_train.train(False, batches, device, reshard, False)
        graphed, graphed_s = fsdp_train.train(True, batches, device, reshard, False)
        worst = max(float(((a - b).abs() / (b.abs() + 1e-6)).max()) for a, b in zip(graphed, eager))
        rows[f"reshard_after_forward={reshard}"] = {
            "eager_ms_per_step": 1e3 * eager_s,
            "graphed_ms_per_step": 1e3 * graphed_s,
            "speedup": eager_s / graphed_s,
            "max_rel_diff": worst,
        }
    return rows


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
    p.add_argument(
        "--modes",
        default="eager DDP,compile DDP,graphed DDP,hand all-reduce graphed,hand-captured",
    )
    p.add_argument(
        "--fsdp-steps", type=int, default=50,
        help="steps of the FSDP2 rows (examples/fsdp_train.py's transformer); 0: none",
    )  # fmt: skip
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    device = start_ranks("benchmarks/distributed.py")
    cuda = device.type == "cuda"
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
    results["fsdp2"] = fsdp_rows(device, args.fsdp_steps) if args.fsdp_steps else {}
    results["all_reduce_ms"] = all_reduce_ms(device)
    eager = results["modes"].get("eager DDP", {}).get("ms_per_step")
    if eager:
        results["all_reduce_share_of_eager_step"] = results["all_reduce_ms"] / eager
    hand = results["modes"].get("hand-captured", {}).get("ms_per_step")
    for r in results["modes"].values():  # speed as a share of the step captured by hand
        if hand:
            r["speed_vs_hand_captured"] = hand / r["ms_per_step"]
    if dist.get_rank() == 0:
        for mode, r in results["modes"].items():
            speedup = f" ({eager / r['ms_per_step']:.1f}x eager)" if eager else ""
            if "speed_vs_hand_captured" in r:
                speedup += f" ({r['speed_vs_hand_captured']:.2f}x hand-captured)"
            print(
                f"{mode:26s} {r['ms_per_step']:8.2f} ms/step{speedup}  max rel diff {r['max_rel_diff']:.1e}"
            )
        for setting, r in results["fsdp2"].items():
            print(
                f"FSDP2 {setting}: eager {r['eager_ms_per_step']:.2f} ms/step, graphed "
                f"{r['graphed_ms_per_step']:.2f} ms/step ({r['speedup']:.2f}x), max rel diff "
                f"{r['max_rel_diff']:.1e}"
            )
        print(f"all-reduce of all gradients alone: {results['all_reduce_ms']:.2f} ms")
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

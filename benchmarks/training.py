"""Training steps per second: eager, torch.compile, reduce-overhead, and the two cudagraphs forms.

Workloads (fixed shapes, as a training loop with ``drop_last=True`` has):

- ``mlp_adam``: the 256-256-16 MLP (256 -> 256 -> 16) with cross-entropy and Adam, batch 256, fp32;
- ``transformer_lm_bf16``: a 4-layer causal transformer language model (d=256, 4 heads,
  vocabulary 2048) with AdamW under bf16 autocast, batch 8 x 128 tokens.

Modes, each on its own copy of the same initial model (every mode takes real optimizer steps):

- ``eager``: the step as written (default foreach optimizer);
- ``torch.compile``: the model compiled with the default mode, optimizer step eager;
- ``reduce-overhead``: the model compiled with ``mode="reduce-overhead"`` (cudagraph trees
  around forward and backward), optimizer step eager;
- ``cg graph_autograd``: the model's forward and backward as graphs, optimizer step eager;
- ``cg train_step``: the whole step (forward, backward, optimizer) as one graph.

Before timing, each mode's loss on the same batch is compared with eager (same start, same data).
Timing: interleaved windows (:func:`cudagraphs.tools.timing.measure_side_by_side`); throughput (one
synchronize per window) is the steps/s figure, latency (a synchronize per step) is also shown.

    python benchmarks/training.py [--workloads mlp_adam,transformer_lm_bf16] [--json P] [--markdown P]
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable
from typing import Any

import common
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import cudagraphs as cg
from cudagraphs.tools.timing import measure_side_by_side

MODES = ("eager", "torch.compile", "reduce-overhead", "cg graph_autograd", "cg train_step")


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 2048, d: int = 256, layers: int = 4, seq: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        return self.head(self.blocks(h, mask=self.causal, is_causal=True))


def mlp_workload() -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16))

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(256, 256, device="cuda"), torch.randint(0, 16, (256,), device="cuda")

    return dict(
        model=model,
        batch=batch,
        loss=lambda out, y: F.cross_entropy(out, y),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
        autocast=contextlib.nullcontext,
    )


def lm_workload() -> dict[str, Any]:
    model = TinyLM()

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 2048, (8, 129), device="cuda")
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return dict(
        model=model,
        batch=batch,
        loss=lambda out, y: F.cross_entropy(out.flatten(0, 1).float(), y.flatten()),
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4, weight_decay=0.1),
        autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16),
    )


WORKLOADS: dict[str, Callable[[], dict[str, Any]]] = {
    "mlp_adam": mlp_workload,
    "transformer_lm_bf16": lm_workload,
}


def build(mode: str, spec: dict[str, Any], base: nn.Module, example: Any) -> Callable[[Any], Any]:
    """One training step ``step((x, y)) -> loss`` in the given mode, on a fresh model copy."""
    model = copy.deepcopy(base).cuda().train()
    opt = spec["optimizer"](model.parameters())
    forward: Callable[..., Any] = model
    if mode == "torch.compile":
        forward = torch.compile(model)
    elif mode == "reduce-overhead":
        forward = torch.compile(model, mode="reduce-overhead")
    elif mode == "cg graph_autograd":
        with spec["autocast"]():
            forward = cg.graph_autograd(model, example[0])

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        with spec["autocast"]():
            loss = spec["loss"](forward(x), y)
        loss.backward()
        opt.step()
        return loss

    if mode == "cg train_step":
        return_step = cg.train_step(step, optimizer=opt)
        return lambda batch: return_step(*batch)
    return lambda batch: step(*batch)


def run(names: list[str], modes: tuple[str, ...], calls: int, windows: int) -> dict[str, Any]:
    results: dict[str, Any] = {**common.environment(calls, windows), "workloads": {}}
    for name in names:
        torch.manual_seed(0)
        spec = WORKLOADS[name]()
        base = spec["model"]
        batches = [spec["batch"]() for _ in range(4)]
        steps = {mode: build(mode, spec, base, batches[0]) for mode in modes}
        # Same start, same batches: after 5 steps every mode's loss should agree with eager's
        # (bf16 and compiled kernels differ in rounding, hence the loose tolerance).
        losses = {}
        for mode, step in steps.items():
            try:
                losses[mode] = [float(step(batches[i % 4])) for i in range(5)]
                torch.cuda.synchronize()
            except Exception as failure:
                raise RuntimeError(f"{name}: mode {mode!r} failed") from failure
        for mode, values in losses.items():
            if not abs(values[-1] - losses["eager"][-1]) <= 2e-2 * abs(losses["eager"][-1]) + 1e-3:
                raise AssertionError(
                    f"{name}: {mode} loss {values} differs from eager {losses['eager']}"
                )
        timings = measure_side_by_side(steps, batches, calls=calls, windows=windows)
        results["workloads"][name] = {
            "loss_after_5_steps": {m: v[-1] for m, v in losses.items()},
            "timings_us": {m: vars(t) for m, t in timings.items()},
        }
        del steps
        torch.compiler.reset()
    return results


def render(results: dict[str, Any], console: Console) -> str:
    md = [common.environment_line(results, "steps"), ""]
    header = [
        "mode",
        "steps/s",
        "throughput µs/step",
        "latency µs/step",
        "speed-up vs eager (thr / lat)",
        "loss after 5 steps",
    ]
    for name, data in results["workloads"].items():
        timings = data["timings_us"]
        eager = timings["eager"]
        rows = [
            [
                mode,
                f"{1e6 / t['throughput_us']:.0f}",
                f"{t['throughput_us']:.1f}",
                f"{t['latency_us']:.1f}",
                f"{eager['throughput_us'] / t['throughput_us']:.2f}× / {eager['latency_us'] / t['latency_us']:.2f}×",
                f"{data['loss_after_5_steps'][mode]:.4f}",
            ]
            for mode, t in timings.items()
        ]
        table, lines = common.table(name, header, rows)
        console.print(table)
        md += [f"**{name}**", "", *lines, ""]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, "training", calls=100, windows=7)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    console = Console()
    if not common.cuda_or_explain("training.py", console):
        return 0
    names = common.names(parser, "--workloads", args.workloads, list(WORKLOADS))
    common.names(parser, "--modes", args.modes, list(MODES))
    modes = tuple(args.modes.split(","))
    if "eager" not in modes:
        modes = ("eager", *modes)
    results = run(names, modes, args.calls, args.windows)
    common.write(results, render(results, console), args, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""four launch-bound uses, each run through ``cg.bench`` (side by side, checked, profiled).

1. inference serving: the 256-256-16 MLP and a 4-layer transformer, and two small convolutional
   networks at batch 1 (where Inductor's fusion matters, so ``cudagraphs+compile`` -- our replay
   over ``torch.compile(mode=...)`` -- is compared with ``reduce-overhead``);
2. RL rollout: 128 policy + environment steps captured whole (eager vs cudagraphs);
3. a fixed-shape training step: MLP + Adam, eager vs ``cg.train_step``;
4. small launch-bound models: the 20-layer MLP.

For every workload with a graph mode it also reads ``cg.profile``'s kernel floor (the sum of
kernel durations, eager) against the graph replay's measured GPU time.

    python benchmarks/suite.py [--only mlp,convnet] [--calls 30] [--windows 5] [--json P] [--markdown P]
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import common
import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import cudagraphs as cg
from cudagraphs.tools import workloads

ALL = ("eager", "compile", "reduce-overhead", "cudagraphs", "cudagraphs+compile")


def conv_bn(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]


def plain_convnet() -> nn.Module:
    """Eight conv-BN-ReLU layers, 32-64 channels, a pooled linear head."""
    layers = conv_bn(3, 32) + conv_bn(32, 32) + conv_bn(32, 64, 2) + conv_bn(64, 64)
    layers += conv_bn(64, 64) + conv_bn(64, 128, 2) + conv_bn(128, 128) + conv_bn(128, 128)
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))


class Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(
            *conv_bn(channels, channels),
            nn.Conv2d(channels, channels, 3, 1, 1, bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def residual_convnet() -> nn.Module:
    """A small ResNet: stem, four residual blocks at 32 and 64 channels, a linear head."""
    return nn.Sequential(
        *conv_bn(3, 32),
        Residual(32),
        Residual(32),
        *conv_bn(32, 64, 2),
        Residual(64),
        Residual(64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def inference(
    make: Callable[[], nn.Module], shape: tuple[int, ...]
) -> Callable[[], tuple[Any, tuple, dict]]:
    def build() -> tuple[Any, tuple, dict]:
        torch.manual_seed(0)
        return make().cuda().eval(), (torch.randn(*shape, device="cuda"),), {}

    return build


def training() -> tuple[Any, tuple, dict]:
    torch.manual_seed(0)
    eager_step, model, _, example = workloads.mlp_training_step()
    twin_step, _, twin_opt, _ = workloads.mlp_training_step(model=copy.deepcopy(model))
    graphed = cg.train_step(twin_step, optimizer=twin_opt)
    return eager_step, example, {"extra_modes": {"cg.train_step": graphed}}


def rollout() -> tuple[Any, tuple, dict]:
    torch.manual_seed(0)
    fn, state = workloads.rl_rollout(steps=128)
    return fn, (state,), {}


#: name -> (use, builder, modes, bench options)
WORKLOADS: dict[
    str, tuple[str, Callable[[], tuple[Any, tuple, dict]], tuple[str, ...], dict[str, Any]]
] = {
    "mlp": ("inference", inference(workloads.mlp_256, (128, 256)), ALL, {}),
    "transformer": ("inference", inference(workloads.transformer, (8, 64, 256)), ALL, {}),
    "convnet": ("inference, batch 1", inference(plain_convnet, (1, 3, 64, 64)), ALL, {}),
    "resnet": ("inference, batch 1", inference(residual_convnet, (1, 3, 64, 64)), ALL, {}),
    "rollout": ("RL rollout", rollout, ("eager", "cudagraphs"), {"check": False}),
    "train": ("training step", training, ("eager",), {"check": False, "no_grad": False}),
    "deep_mlp": (
        "small launch-bound model",
        inference(workloads.deep_mlp, (64, 512)),
        ("eager", "reduce-overhead", "cudagraphs"),
        {},
    ),
}


def run(
    names: list[str], calls: int, windows: int, compile_mode: str, console: Console
) -> dict[str, cg.BenchReport]:
    reports = {}
    for name in names:
        use, build, modes, options = WORKLOADS[name]
        fn, args, extra = build()
        options = {**options, **extra}
        console.print(f"[bold]{name}[/bold] ({use})")
        n = max(calls // 8, 4) if name == "rollout" else calls
        reports[name] = cg.bench(
            fn,
            *args,
            modes=list(modes),
            compile_mode=compile_mode,
            calls=n,
            windows=windows,
            name=f"{name} ({use})",
            **options,
        )
        console.print(reports[name])
        torch.compiler.reset()
    return reports


def summary(reports: dict[str, cg.BenchReport]) -> tuple[Table, list[str]]:
    header = [
        "workload",
        "eager µs",
        "cudagraphs",
        "reduce-overhead",
        "cudagraphs+compile",
        "cg+compile vs r-o",
        "kernel floor µs",
        "replay busy µs",
        "replay span µs",
        "floor / busy",
        "floor / span",
    ]
    rows = []
    for name, report in reports.items():
        modes = {r.mode: r for r in report.results if r.ok and r.wall is not None}

        def speed(mode: str, modes: dict = modes, report: cg.BenchReport = report) -> str:
            return f"{report.speedup(mode):.2f}×" if mode in modes else "-"

        graphed = "cudagraphs" if "cudagraphs" in modes else "cg.train_step"
        versus = "-"
        if "cudagraphs+compile" in modes and "reduce-overhead" in modes:
            ratio = modes["reduce-overhead"].wall.median / modes["cudagraphs+compile"].wall.median
            versus = f"{ratio:.2f}× faster" if ratio >= 1 else f"{1 / ratio:.2f}× slower"
        prof = report.profile
        floor = prof.gpu_busy_us if prof else None
        busy = prof.replay_busy_us if prof else None
        span = prof.replay_gpu_us if prof else None
        row = [
            name,
            f"{modes['eager'].wall.median:.0f}",
            speed(graphed),
            speed("reduce-overhead"),
            speed("cudagraphs+compile"),
            versus,
            _us(floor),
            _us(busy),
            _us(span),
            f"{floor / busy:.2f}" if floor is not None and busy else "-",
            f"{floor / span:.2f}" if floor is not None and span else "-",
        ]
        rows.append(row)
    return common.table(
        "suite summary: speed-up over eager (median synchronized wall time)", header, rows
    )


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, "suite", calls=30, windows=5)
    parser.add_argument(
        "--only", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS)
    )
    parser.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    args = parser.parse_args(argv)
    console = Console()
    if not common.cuda_or_explain("suite.py", console):
        return 0
    names = common.names(parser, "--only", args.only, list(WORKLOADS))
    reports = run(names, args.calls, args.windows, args.compile_mode, console)
    table, md_summary = summary(reports)
    console.print(table)
    md = [
        f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; `cudagraphs+compile` is "
        f"cg.graph over torch.compile(mode={args.compile_mode!r}). Speed-ups are median wall-time "
        "ratios against eager taken side by side in one run.",
        "",
        *md_summary,
        "",
        "<details><summary>Per-workload tables</summary>",
        "",
        cg.BenchReport.LEGEND + ".",
        "",
        *[report.markdown(legend=False) for report in reports.values()],
        "</details>",
        "",
    ]
    common.write({n: r.to_dict() for n, r in reports.items()}, "\n".join(md), args, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())

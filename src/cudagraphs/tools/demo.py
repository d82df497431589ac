"""``python -m cudagraphs demo``: four launch-bound uses, benchmarked and profiled, in one table.

On a CUDA machine: the 256-256-16 MLP and a transformer (inference; eager, a hand-written graph and
``cg.graph``), a training step (eager against ``cg.train_step``) and an RL rollout of 128 policy
and environment steps captured whole. Each is checked, timed side by side with
:func:`cudagraphs.bench` and profiled with :func:`cudagraphs.profile`; a summary table ends it,
followed by the safety net (a stale output, a wrong shape). Without CUDA it says so and shows
what still works: the pass-through, the signature checks, the benchmark and profile on the CPU.
"""

from __future__ import annotations

import copy
import time
import warnings
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from ..api import graph
from ..errors import CudaGraphsError, CudaGraphsWarning
from ..training import train_step
from . import workloads
from .benchmarking import bench
from .report import BenchReport

__all__ = ["run_demo"]


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0]}"


def _safety(console: Console, model: torch.nn.Module, shape: tuple[int, ...], device: str) -> None:
    console.print("\n[bold]Safety net[/bold] (what hand-rolled graphs get silently wrong)")
    example = torch.randn(*shape, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CudaGraphsWarning)
        g = graph(model, example)
    wrong = torch.randn(shape[0] // 2, *shape[1:], device=device)
    try:
        g(wrong)
    except CudaGraphsError as error:
        console.print(f"  wrong batch size   -> {_first_line(error)}")
    if device == "cuda":
        first = g(torch.randn(*shape, device=device))
        g(torch.randn(*shape, device=device))
        try:
            first.sum()
        except RuntimeError as error:
            console.print(f"  stale output read  -> {_first_line(error)}")
    if device == "cuda":
        console.print(f"  stats: {g.stats}")
    else:
        console.print(
            f"  stats: {g.stats.calls} call(s) answered eagerly (no CUDA: nothing captured, "
            "no replays); on a GPU the same line counts replays, copies and recaptures"
        )


#: The demo's four launch-bound uses, in the order the GPU path runs them.
USES = ("MLP 256-256-16", "transformer inference", "training step", "RL rollout (128 steps)")


def _cpu_demo(console: Console, calls: int, windows: int) -> int:
    console.print(
        "[yellow]CUDA is not available[/yellow]: CUDA graphs need an NVIDIA GPU, so nothing "
        "here gets faster. What still works: the pass-through (cg.graph runs the function "
        "eagerly behind the same signature checks, so code written for a GPU runs here too), "
        "cg.bench and cg.profile (eager only), and the safety checks."
    )
    torch.manual_seed(0)
    model = workloads.mlp_256().eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", CudaGraphsWarning)
        g = graph(model, torch.randn(128, 256))
        x = torch.randn(128, 256)
        same = torch.equal(g(x), model(x))
    console.print(f"  pass-through output equals eager: {same}; reason: {g.fallback_reason}")
    report = bench(
        model,
        x,
        modes=["eager", "cudagraphs"],
        calls=calls,
        windows=windows,
        console=console,
        name="MLP 256-256-16",
    )
    console.print(report)
    console.print(f"  cg.profile says: {report.profile.recommendation if report.profile else '-'}")
    _safety(console, model, (128, 256), "cpu")
    console.print(
        f"\nOf the demo's {len(USES)} uses, ran here: {USES[0]} (eagerly, through the "
        f"pass-through). Not run here: {', '.join(USES[1:])}: each one times eager against its "
        "graph, and without CUDA there is no graph to time. Run the demo on a machine with an "
        "NVIDIA GPU to see all of them."
    )
    return 0


def _inference(
    name: str, make: Any, shape: tuple[int, ...], calls: int, windows: int, console: Console
) -> BenchReport:
    torch.manual_seed(0)
    model = make().cuda().eval()
    with torch.no_grad():
        example = torch.randn(*shape, device="cuda")
        hand = workloads.hand_written_graph(model, example)
    return bench(
        model,
        example,
        modes=["eager", "cudagraphs"],
        extra_modes={"hand-written graph": hand},
        calls=calls,
        windows=windows,
        console=console,
        name=f"{name} {shape}",
    )


def _training(calls: int, windows: int, console: Console) -> BenchReport:
    torch.manual_seed(0)
    eager_step, model, _, example = workloads.mlp_training_step()
    # A twin trained by the graph, so both modes take real steps on their own weights.
    twin_step, _, twin_opt, _ = workloads.mlp_training_step(model=copy.deepcopy(model))

    return bench(
        eager_step,
        *example,
        modes=["eager"],
        extra_modes={"cg.train_step": train_step(twin_step, optimizer=twin_opt)},
        check=False,  # two models training on their own: their losses are not the same numbers
        no_grad=False,
        calls=calls,
        windows=windows,
        console=console,
        name="training step: MLP + Adam, batch 256",
    )


def _rollout(calls: int, windows: int, console: Console) -> BenchReport:
    torch.manual_seed(0)
    rollout, state = workloads.rl_rollout(steps=128)
    return bench(
        rollout,
        state,
        modes=["eager", "cudagraphs"],
        check=False,  # exploration noise: each call draws new numbers, eager and graph alike
        calls=max(calls // 5, 4),
        windows=windows,
        console=console,
        name="RL rollout: 128 policy+env steps, 256 envs",
    )


def run_demo(console: Console | None = None, *, calls: int = 30, windows: int = 3) -> int:
    console = console or Console()
    started = time.perf_counter()
    console.print(f"[bold]cudagraphs demo[/bold]: torch {torch.__version__}")
    if not torch.cuda.is_available():
        return _cpu_demo(console, calls, windows)
    console.print(f"GPU: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
    reports: list[tuple[str, str, BenchReport]] = []
    for title, graphed, build in (
        (
            USES[0],
            "cudagraphs",
            lambda: _inference(
                "MLP 256-256-16", workloads.mlp_256, (128, 256), calls, windows, console
            ),
        ),
        (
            USES[1],
            "cudagraphs",
            lambda: _inference(
                "4-layer transformer", workloads.transformer, (8, 64, 256), calls, windows, console
            ),
        ),
        (USES[2], "cg.train_step", lambda: _training(calls, windows, console)),
        (USES[3], "cudagraphs", lambda: _rollout(calls, windows, console)),
    ):
        report = build()
        console.print(report)
        reports.append((title, graphed, report))
    summary = Table(title="summary: wall time per call, synchronized (medians)")
    for column in (
        "workload",
        "eager µs",
        "graphed µs",
        "speed-up",
        "kernel floor µs",
        "kernels",
        "cg.profile says",
    ):
        summary.add_column(
            column,
            justify="left" if column in ("workload", "cg.profile says") else "right",
            overflow="fold",
        )
    for title, mode, report in reports:
        eager, fast = report["eager"], report[mode]
        speedup = report.speedup(mode)
        prof = report.profile
        summary.add_row(
            title,
            f"{eager.wall.median:.0f}" if eager.wall else "-",
            f"{fast.wall.median:.0f}" if fast.wall else f"failed: {fast.error}",
            f"{speedup:.1f}×" if speedup else "-",
            f"{prof.gpu_busy_us:.0f}" if prof else "-",
            f"{prof.kernels_per_call:.0f}" if prof else "-",
            prof.recommendation.split(":")[0] if prof else "-",
        )
    console.print(summary)
    with torch.no_grad():
        _safety(console, workloads.mlp_256().cuda().eval(), (128, 256), "cuda")
    console.print(f"\ndemo finished in {time.perf_counter() - started:.0f} s")
    return 0

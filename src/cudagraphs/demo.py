"""``python -m cudagraphs demo``: the brief's examples end to end, in one table.

On a CUDA machine: the brief's MLP and a small transformer, each run eagerly, as a hand-written
graph (copy+replay) and through ``cg.graph``; outputs are checked against eager on fresh random
inputs, then timed side by side; then the safety net is shown (a stale output, a wrong shape).
Without CUDA it says so and shows the pass-through: same API, same checks, eager execution.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from . import workloads
from .api import graph
from .errors import CudaGraphsError, CudaGraphsWarning
from .timing import measure_side_by_side

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
            console.print(f"  stale output read  -> {str(error)[:110]}...")
    console.print(f"  stats: {g.stats}")


def run_demo(console: Console | None = None, *, calls: int = 100, windows: int = 5) -> int:
    console = console or Console()
    console.print(f"[bold]cudagraphs demo[/bold]: torch {torch.__version__}")
    cases: list[tuple[str, Callable[[], torch.nn.Module], tuple[int, ...]]] = [
        ("brief MLP 256-256-16", workloads.brief_mlp, (128, 256)),
        ("4-layer transformer", workloads.transformer, (8, 64, 256)),
    ]
    if not torch.cuda.is_available():
        console.print(
            "[yellow]CUDA is not available[/yellow]: CUDA graphs need an NVIDIA GPU, so nothing "
            "here is faster. What still works is the pass-through: cg.graph runs the function "
            "eagerly behind the same signature checks, so code written for a GPU runs here too."
        )
        torch.manual_seed(0)
        model = workloads.brief_mlp().eval()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", CudaGraphsWarning)
            g = graph(model, torch.randn(128, 256))
            x = torch.randn(128, 256)
            same = torch.equal(g(x), model(x))
        console.print(f"  pass-through output equals eager: {same}; reason: {g.fallback_reason}")
        _safety(console, model, (128, 256), "cpu")
        return 0

    console.print(f"GPU: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
    table = Table(title="latency / throughput per call (µs, medians; lower is better)")
    for column in (
        "workload",
        "eager",
        "hand-written graph",
        "cg.graph",
        "cg vs eager",
        "cg vs hand-written",
        "max |err|",
    ):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for name, make, shape in cases:
        torch.manual_seed(0)
        model = make().cuda().eval()
        with torch.no_grad():
            example = torch.randn(*shape, device="cuda")
            modes: dict[str, Callable[[Any], Any]] = {
                "eager": model,
                "bare": workloads.hand_written_graph(model, example),
                "cg": graph(model, example),
            }
            error = 0.0
            for _ in range(3):
                x = torch.randn(*shape, device="cuda")
                expected = model(x)
                got = modes["cg"](x)
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
                error = max(error, (got - expected).abs().max().item())
            inputs = [torch.randn(*shape, device="cuda") for _ in range(4)]
            t = measure_side_by_side(modes, inputs, calls=calls, windows=windows)
        cg_t, eager, bare = t["cg"], t["eager"], t["bare"]
        table.add_row(
            f"{name} {shape}",
            f"{eager.latency_us:.0f} / {eager.throughput_us:.0f}",
            f"{bare.latency_us:.0f} / {bare.throughput_us:.0f}",
            f"{cg_t.latency_us:.0f} / {cg_t.throughput_us:.0f}",
            f"{eager.latency_us / cg_t.latency_us:.1f}× / {eager.throughput_us / cg_t.throughput_us:.1f}×",
            f"{cg_t.latency_us / bare.latency_us:.2f} / {cg_t.throughput_us / bare.throughput_us:.2f}",
            f"{error:.1e}",
        )
    console.print(table)
    with torch.no_grad():
        _safety(console, workloads.brief_mlp().cuda().eval(), (128, 256), "cuda")
    return 0

"""Shape buckets: latency per real batch size, overhead at exact rungs, shared-pool memory.

1. The 256-256-16 MLP at every real batch size 1..128: eager, ``torch.compile(mode="reduce-overhead")``
   (its own dynamic-shape handling: a dynamic kernel, one recorded graph per distinct size) and
   ``cg.graph(..., buckets=powers_of_two(128))``. Each mode is checked against eager first.
2. At each rung: a bucketed call against a single-shape ``cg.graph`` captured for that size.
3. Memory as a user sees it (growth of ``torch.cuda.memory_reserved()``): the 4-layer
   transformer, torchvision resnet18 and mobilenet_v3_small on batch buckets 1..32, against the
   largest bucket captured alone (``bucket_memory.py``, a fresh process per measurement).

    python benchmarks/buckets.py [--json PATH] [--plot PATH] [--markdown PATH]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import bucket_memory
import common
import torch
from rich.console import Console
from rich.progress import track

import cudagraphs as cg
from cudagraphs.tools.timing import measure_side_by_side
from cudagraphs.tools.workloads import mlp_256


def latency_sweep(calls: int, windows: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = mlp_256().cuda().eval()
    ladder = cg.powers_of_two(128)
    sweep: dict[str, Any] = {"sizes": [], "eager": [], "reduce-overhead": [], "cg buckets": []}
    with torch.no_grad():
        compiled = torch.compile(model, mode="reduce-overhead")
        bucketed = cg.graph(model, torch.randn(128, 256, device="cuda"), buckets={"B": ladder})
        for b in track(range(1, 129), description="sizes 1..128", transient=True):
            x = torch.randn(b, 256, device="cuda")
            expected = model(x)
            torch.testing.assert_close(bucketed(x), expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(compiled(x).clone(), expected, rtol=1e-4, atol=1e-4)
            inputs = [torch.randn(b, 256, device="cuda") for _ in range(2)]
            t = measure_side_by_side(
                {"eager": model, "reduce-overhead": compiled, "cg buckets": bucketed},
                inputs,
                calls=calls,
                windows=windows,
            )
            sweep["sizes"].append(b)
            for mode, timing in t.items():
                sweep[mode].append(timing.latency_us)
        sweep["padding_waste"] = bucketed.stats.padding_waste
        # Exact rungs: bucketed against a single-shape graph of that size, side by side.
        exact = {}
        for rung in ladder:
            single = cg.graph(model, torch.randn(rung, 256, device="cuda"))
            inputs = [torch.randn(rung, 256, device="cuda") for _ in range(2)]
            t = measure_side_by_side(
                {"single": single, "bucketed": bucketed},
                inputs,
                calls=calls * 4,  # a small difference: measure it longer than the sweep
                windows=windows + 2,
            )
            exact[rung] = {
                "single_latency_us": t["single"].latency_us,
                "bucketed_latency_us": t["bucketed"].latency_us,
                "single_throughput_us": t["single"].throughput_us,
                "bucketed_throughput_us": t["bucketed"].throughput_us,
            }
        sweep["exact_rungs"] = exact
    torch.compiler.reset()
    return sweep


def memory() -> dict[str, Any]:
    """Growth of memory_reserved() for all buckets against the largest alone, per model, each
    measured in a fresh process (bucket_memory.py)."""
    return bucket_memory.run_all()


def render(results: dict[str, Any], console: Console) -> str:
    sweep, mem = results["sweep"], results["memory"]
    lines = [
        f"Hardware: {results['hardware']}, torch {results['torch']}. Latency = synchronize after "
        "each call; medians of interleaved windows.",
        "",
        "**Latency per real batch size (MLP 256-256-16), µs** (every size checked against eager first)",
        "",
        "| batch | eager | reduce-overhead | cg buckets |",
        "|---|---|---|---|",
    ]
    for i, b in enumerate(sweep["sizes"]):
        if b in (1, 2, 3, 5, 8, 13, 17, 32, 33, 50, 64, 65, 100, 127, 128):
            lines.append(
                f"| {b} | {sweep['eager'][i]:.1f} | {sweep['reduce-overhead'][i]:.1f} | {sweep['cg buckets'][i]:.1f} |"
            )
    med = {m: statistics.median(sweep[m]) for m in ("eager", "reduce-overhead", "cg buckets")}
    lines += [
        f"| median 1..128 | {med['eager']:.1f} | {med['reduce-overhead']:.1f} | {med['cg buckets']:.1f} |",
        "",
        f"Padding waste over the sweep: {sweep['padding_waste']:.1%} of real elements.",
        "",
        "**Bucketed call at an exact rung vs a single-shape cg.graph (latency / throughput)**",
        "",
        "| batch | single µs | bucketed µs | ratio (lat / thr) |",
        "|---|---|---|---|",
    ]
    for rung, e in sweep["exact_rungs"].items():
        lines.append(
            f"| {rung} | {e['single_latency_us']:.1f} / {e['single_throughput_us']:.1f} | "
            f"{e['bucketed_latency_us']:.1f} / {e['bucketed_throughput_us']:.1f} | "
            f"{e['bucketed_latency_us'] / e['single_latency_us']:.2f}× / "
            f"{e['bucketed_throughput_us'] / e['single_throughput_us']:.2f}× |"
        )
    lines += [
        "",
        "**Memory as a user sees it: growth of torch.cuda.memory_reserved(), batch rungs 1..32 "
        "against the largest rung alone** (fresh process per measurement)",
        "",
        bucket_memory.render(mem),
        "",
    ]
    text = "\n".join(lines)
    console.print(text)
    return text


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = results["sweep"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode in ("eager", "reduce-overhead", "cg buckets"):
        ax.plot(sweep["sizes"], sweep[mode], label=mode, linewidth=1.5)
    ax.set_xlabel("real batch size")
    ax.set_ylabel("latency per call (µs, sync after each)")
    ax.set_title(f"MLP 256-256-16, {results['hardware']}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, "buckets", calls=30, windows=3)
    parser.add_argument("--plot", type=Path, default=common.RESULTS / "buckets.png")
    args = parser.parse_args(argv)
    console = Console()
    if not common.cuda_or_explain("buckets.py", console):
        return 0
    results = {
        "hardware": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "sweep": latency_sweep(args.calls, args.windows),
        "memory": memory(),
    }
    common.write(results, render(results, console), args, console)
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(results, args.plot)
    console.print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

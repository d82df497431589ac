"""One model, the ways of graphing over ``torch.compile`` side by side: are they the same on the GPU?

    python benchmarks/compile_paths.py [--model efficientnet_b0] [--json PATH]

Builds, in this order: the plain ``cg.graph(model, x)``; ``cg.graph(model, x, compile=True)``;
``cg.auto`` limited to its graph over a saved compile (``candidates=["graph over compile"]``);
``cg.graph(model, x, compile=True)`` again; and the plain ``cg.graph(model, x)`` again, so each
of the two ``cg.graph`` ways is captured once first and once last. Then, for each: the output against
eager on a fresh input; latency (a synchronize after each call) and throughput (calls back to
back), interleaved windows (``cudagraphs.tools.timing``); the host time of one call without
waiting for the GPU (median of 20); and the kernels one call runs and their GPU time
(``torch.profiler``), with the names of the costliest; and the Python functions with the
most host time per call (``cProfile``). Same kernels and GPU time with
different latency point at the host side of a call; the same way captured first and last
differs only in the order of capture (a library choosing another kernel for it shows in the
names). Models are
``benchmarks/fusion.py``'s, fp32 with TF32 off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks' shared helpers
from third_party_models import args_modes, build, fresh_like

import cudagraphs as cg
from cudagraphs.tools.timing import measure_side_by_side


def host_us(call: Any, args: tuple[Any, ...]) -> float:
    """Median host time of one call, the GPU idle before it: until the call returns."""
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def host_profile(call: Any, args: tuple[Any, ...], top: int = 6) -> list[str]:
    """Where one call's host time goes: the functions with the most own time over 50 calls
    (``cProfile``), µs per call each."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(50):
        call(*args)
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [f"{own / 50 * 1e6:.1f} {file.split('/')[-1]}:{line}({name})"
            for (file, line, name), (_, _, own, _, _) in rows]  # fmt: skip


def kernels(call: Any, args: tuple[Any, ...], calls: int = 5) -> tuple[float, float, list[str]]:
    """Kernels per call, their GPU µs per call, and the three costliest kernels' names with their
    µs per call, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call(*args)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, float] = {}
    for e in events:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time / calls
    costliest = sorted(by_name.items(), key=lambda item: -item[1])[:3]
    named = [f"{us:.1f} {name[:70]}" for name, us in costliest]
    return len(events) / calls, sum(e.device_time for e in events) / calls, named


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="efficientnet_b0")
    parser.add_argument("--json")
    parser.add_argument(
        "--auto-all", action="store_true",
        help="build cg.auto with all its candidates first, as benchmarks/fusion.py does",
    )  # fmt: skip
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, x = build(args.model)
    with torch.no_grad():
        builders = {}
        if args.auto_all:
            builders["cg.auto, all candidates, built first"] = lambda: cg.auto(
                model, *x, reuse=False
            )
        builders |= {
            "cg.graph, captured first": lambda: cg.graph(model, *x),
            "compile=True, captured first": lambda: cg.graph(model, *x, compile=True),
            "cg.auto, graph over a saved compile": lambda: cg.auto(
                model, *x, candidates=["graph over compile"], reuse=False
            ),
            "compile=True, captured last": lambda: cg.graph(model, *x, compile=True),
            "cg.graph, captured last": lambda: cg.graph(model, *x),
        }
        calls = {}
        for name, make in builders.items():
            calls[name] = make()
            for _ in range(4):
                calls[name](*fresh_like(x))
        probe = fresh_like(x)
        expected = model(*probe)
        inputs = [fresh_like(x) for _ in range(4)]
        timed = measure_side_by_side(args_modes(calls), inputs, calls=20, windows=7)
        rows = []
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model}")
        print(
            "| way | max error | latency µs | throughput µs | host µs per call | kernels | kernel µs |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, call in calls.items():
            error = (call(*probe) - expected).abs().max().item()
            count, gpu_us, costliest = kernels(call, inputs[0])
            row = {"way": name, "max_error": error, "latency_us": timed[name].latency_us,
                   "throughput_us": timed[name].throughput_us,
                   "host_us": host_us(call, inputs[0]), "kernels": count, "kernel_us": gpu_us,
                   "costliest": costliest,
                   "host_profile": host_profile(call, inputs[0])}  # fmt: skip
            rows.append(row)
            print(f"| {name} | {error:.1e} | {row['latency_us']:.1f} | {row['throughput_us']:.1f} "
                  f"| {row['host_us']:.1f} | {count:.0f} | {gpu_us:.1f} |")  # fmt: skip
    for row in rows:
        print(f"- {row['way']}: " + "; ".join(row["costliest"]))
        print("  host, µs per call: " + "; ".join(row["host_profile"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "model": args.model, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

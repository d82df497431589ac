"""The host's work in front of a small graph: cudagraphs' launch against the peer's, per window.

The workload is the 20-layer MLP with the ``.item()`` decision of ``benchmarks/segments.py``
(two graphs, the decision eager between them), where the GPU waits for the host before the
first graph and again after the decision, so every microsecond of host work shows in latency.
Modes, each checked against eager for both outcomes of the decision:

- ``piecewise-cuda-graphs``: installed from its wheel, the decision marked ``@no_graph``,
  static buffers by hand (``copy_`` in, ``CUDAGraphSequence.replay()``), as its README shows;
- ``cudagraphs``: ``cg.graph(model, x)`` as shipped (its graphs launched with one C call);
- ``cudagraphs, through replay()``: the same with every launch through ``CUDAGraph.replay()``,
  switched through the library's internals: a measurement of what the C launch gives, not a
  setting. Two regimes: 8 inputs in turn (a new source address at every call) and one
input. Each of ``--windows`` windows times every mode (``--calls`` calls, a synchronize after
each: latency; then ``--calls`` calls and one synchronize: throughput), in an order shuffled
per window; the ratio of the peer's latency to each mode's is taken per window (above 1: faster
than the peer) and reported as median and quartiles. Last, the host cost of one launch of a
one-kernel graph: ``CUDAGraph.replay()`` against the C call (500 launches, median of 5).

    python benchmarks/launch.py [--windows 40] [--calls 200] [--json PATH] [--markdown PATH]
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks' shared helpers
import common
import torch
from rich.console import Console
from segments import piecewise_peer

import cudagraphs as cg
from cudagraphs.core.launch import Launcher, direct_launches
from cudagraphs.tools.segment_workloads import DecisionMLP


def _through_replay(g: Any) -> Any:
    """``g`` with every graph launched through ``CUDAGraph.replay()``."""
    recording = g.replayer.recording
    for graph in recording.graphs:
        recording.launcher(graph)._watched = 3  # as if it drew random numbers
    return g


def _windows(
    modes: dict[str, Callable[[Any], Any]], inputs: list[Any], calls: int, windows: int
) -> dict[str, dict[str, float]]:
    n = len(inputs)

    def latency(call: Callable[[Any], Any]) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(calls):
            call(inputs[i % n])
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e6

    def throughput(call: Callable[[Any], Any]) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(calls):
            call(inputs[i % n])
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e6

    for call in modes.values():
        throughput(call)
        latency(call)
    lat: dict[str, list[float]] = {m: [] for m in modes}
    thr: dict[str, list[float]] = {m: [] for m in modes}
    rng = random.Random(0)
    for _ in range(windows):
        order = list(modes)
        rng.shuffle(order)
        for m in order:
            lat[m].append(latency(modes[m]))
            thr[m].append(throughput(modes[m]))
    peer = next(iter(modes))
    out = {}
    for m in modes:
        ratios = [p / o for p, o in zip(lat[peer], lat[m])]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        out[m] = {
            "latency_us": statistics.median(lat[m]),
            "throughput_us": statistics.median(thr[m]),
            "peer_over_mode": median,
            "q1": q1,
            "q3": q3,
        }
    return out


def _host_per_launch() -> dict[str, float]:
    x = torch.zeros(16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    launcher = Launcher(graph, torch.cuda.current_device())
    launcher()
    launcher()  # two launches watched: direct from now on
    samples: dict[str, list[float]] = {"CUDAGraph.replay()": [], "one C call": []}
    for _ in range(5):
        for name, fn in (("CUDAGraph.replay()", graph.replay), ("one C call", launcher)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(500):
                fn()
            samples[name].append((time.perf_counter() - start) / 500 * 1e6)
            torch.cuda.synchronize()
    assert x[0].item() == 1 + 2 + 5 * 2 * 500  # every launch ran
    return {name: statistics.median(v) for name, v in samples.items()}


@torch.no_grad()
def run(calls: int, windows: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DecisionMLP().cuda().eval()
    inputs = [torch.randn(8, 256, device="cuda") for _ in range(8)]
    peer_model = DecisionMLP().cuda().eval()
    peer_model.load_state_dict(model.state_dict())
    peer = piecewise_peer(peer_model, inputs[0])
    if peer is None:
        raise SystemExit("piecewise-cuda-graphs is not installed (see the module doc)")
    modes: dict[str, Any] = {
        "piecewise-cuda-graphs": peer,
        "cudagraphs": cg.graph(model, inputs[0]),
        "cudagraphs, through replay()": _through_replay(cg.graph(model, inputs[0])),
    }
    errors: dict[str, float] = {}
    for threshold in (-1e9, 1e9, 0.0):
        model.threshold.fill_(threshold)
        peer_model.threshold.fill_(threshold)
        for name, call in modes.items():
            for x in inputs * 2:
                err = (call(x).clone() - model(x)).abs().max().item()
                errors[name] = max(errors.get(name, 0.0), err)
    regimes = {
        "8 inputs in turn": _windows(modes, inputs, calls, windows),
        "one input": _windows(modes, inputs[:1], calls, windows),
    }
    return {
        "direct_launches": direct_launches(),
        "max_abs_error_vs_eager": errors,
        "regimes": regimes,
        "host_us_per_launch": _host_per_launch(),
    }


def main() -> int:
    p = common.parser(__doc__, "launch", calls=200, windows=40)
    args = p.parse_args()
    console = Console()
    if not common.cuda_or_explain("benchmarks/launch.py", console):
        return 0
    found = run(args.calls, args.windows)
    results = {**common.environment(args.calls, args.windows), **found}
    md = [common.environment_line(results, "calls") + " Modes shuffled in every window."]
    for regime, timings in found["regimes"].items():
        rows = [
            [mode, f"{t['latency_us']:.1f}", f"{t['throughput_us']:.1f}",
             f"{t['peer_over_mode']:.3f} [{t['q1']:.3f}, {t['q3']:.3f}]",
             f"{found['max_abs_error_vs_eager'][mode]:.1e}"]
            for mode, t in timings.items()
        ]  # fmt: skip
        header = ["mode", "latency µs", "throughput µs", "peer / mode [quartiles]", "max |err|"]
        rich_table, lines = common.table(f"MLP with the decision, {regime}", header, rows)
        console.print(rich_table)
        md += ["", f"**{regime}**", "", *lines]
    host = found["host_us_per_launch"]
    md += ["", "Host µs per launch of a one-kernel graph: "
           + ", ".join(f"{k} {v:.2f}" for k, v in host.items())]  # fmt: skip
    console.print(md[-1])
    common.write(results, "\n".join(md) + "\n", args, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())

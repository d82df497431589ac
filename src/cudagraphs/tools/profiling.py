"""``cg.profile``: is this workload launch-bound, and what would a graph save?

Profile first. If the GPU is busy most of the time, graphs won't save
you; if it sits idle between small kernels while the CPU launches the next one, they will.
:func:`profile` runs the function eagerly under ``torch.profiler`` and measures:

- **kernels per call** and **GPU busy time** (the sum of kernel, memcpy and memset durations):
  the *kernel floor*, which no launch scheme beats;
- **wall time** per call, synchronized (what a caller waits), and **CPU time** per call (how long
  issuing the work takes with an empty queue);
- the **GPU idle fraction** (1 - busy / wall) and a **predicted speed-up**: eager wall time over
  (kernel floor + what one graph call costs on this machine, measured with a one-kernel graph);
- optionally (``replay=True``) the **replay GPU time** of the captured graph: the span from the
  first to the last of its kernels on the GPU, as the profiler recorded them.

It ends in a recommendation in words.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.table import Table

from ..core import compat
from .timing import sync

__all__ = ["Profile", "profile"]

_graph_call_us: float | None = None  # measured once per process


@dataclass(frozen=True)
class Profile:
    """What :func:`profile` measured; ``recommendation`` says what to do about it."""

    name: str
    device: str
    calls: int
    kernels_per_call: float
    gpu_busy_us: float  # the kernel floor
    wall_us: float
    cpu_us: float
    graph_call_us: float  # what a one-kernel graph replay + synchronize costs here
    replay_gpu_us: float | None = None  # span of one replay on the GPU, first kernel to last
    replay_busy_us: float | None = None  # the replay's kernel durations summed: floor's like
    top_kernels: list[tuple[str, float, float]] = field(default_factory=list)  # name, per call, µs

    @property
    def gpu_idle_fraction(self) -> float:
        """Share of the synchronized wall time in which no kernel of this call ran."""
        if self.wall_us <= 0:
            return 0.0
        return max(0.0, 1.0 - self.gpu_busy_us / self.wall_us)

    @property
    def predicted_speedup(self) -> float:
        """Eager wall time over (kernel floor + the cost of one graph call on this machine)."""
        if self.kernels_per_call == 0:
            return 1.0
        return self.wall_us / (self.gpu_busy_us + self.graph_call_us)

    @property
    def recommendation(self) -> str:
        if self.device == "cpu":
            return "CUDA graphs need an NVIDIA GPU; on this machine there is nothing to graph."
        if self.kernels_per_call == 0:
            return "Nothing runs on the GPU in this function, so a graph cannot help."
        busy = 1.0 - self.gpu_idle_fraction
        speedup = self.predicted_speedup
        if busy >= 0.8 or speedup < 1.1:
            return (
                f"Not worth it: the GPU is busy {busy:.0%} of the wall time, so launches are "
                f"already hidden (predicted {speedup:.2f}×). Make the kernels cheaper instead: "
                "torch.compile for fusion, bf16/TF32, larger batches."
            )
        if speedup >= 1.5:
            return (
                f"Graph it: the GPU idles {self.gpu_idle_fraction:.0%} of the time between "
                f"{self.kernels_per_call:.0f} small kernels; predicted {speedup:.1f}× (cg.graph). "
                "If input shapes vary between calls, use buckets (cg.graph(..., buckets=...))."
            )
        return (
            f"Modest gain (predicted {speedup:.2f}×): graph it if it runs in a hot loop; fusion "
            "(torch.compile) may save as much."
        )

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            gpu_idle_fraction=self.gpu_idle_fraction,
            predicted_speedup=self.predicted_speedup,
            recommendation=self.recommendation,
        )
        return data

    def __rich__(self) -> Table:
        table = Table(title=f"cg.profile: {self.name} on {self.device}", show_header=False)
        table.add_column("measure", overflow="fold")
        table.add_column("value", justify="right", overflow="fold")
        for key, value in self.rows():
            table.add_row(key, value)
        table.caption = self.recommendation
        return table

    def rows(self) -> list[tuple[str, str]]:
        if self.device == "cpu":
            return [
                ("wall time per call", f"{self.wall_us:.1f} µs"),
                ("CPU time per call (issuing)", f"{self.cpu_us:.1f} µs"),
            ]
        rows = [
            ("kernels per call", f"{self.kernels_per_call:.1f}"),
            ("GPU busy per call (kernel floor)", f"{self.gpu_busy_us:.1f} µs"),
            ("wall time per call (synchronized)", f"{self.wall_us:.1f} µs"),
            ("CPU time per call (issuing)", f"{self.cpu_us:.1f} µs"),
            ("GPU idle fraction", f"{self.gpu_idle_fraction:.0%}"),
            ("one graph call costs here", f"{self.graph_call_us:.1f} µs"),
            ("predicted speed-up from a graph", f"{self.predicted_speedup:.2f}×"),
        ]
        if self.replay_gpu_us is not None:
            rows.append(("graph replay GPU span (measured)", f"{self.replay_gpu_us:.1f} µs"))
        if self.replay_busy_us is not None:
            rows.append(("graph replay kernels' busy time", f"{self.replay_busy_us:.1f} µs"))
        for name, count, us in self.top_kernels[:3]:
            rows.append((f"  kernel {name[:48]}", f"{count:.0f}× {us:.1f} µs"))
        return rows

    def __str__(self) -> str:
        lines = [f"cg.profile: {self.name} on {self.device}"]
        lines += [f"  {key}: {value}" for key, value in self.rows()]
        lines.append(f"  -> {self.recommendation}")
        return "\n".join(lines)


def profile(
    fn: Callable[..., Any], /, *args: Any, calls: int = 20, replay: bool = False, **kwargs: Any
) -> Profile:
    """Measure whether ``fn(*args, **kwargs)`` is launch-bound; see the module docstring.

    Right: ``print(cg.profile(model, x))`` before changing any code, on the real shapes.
    Wrong: judging from a timing without a synchronize (it measures the launch queue, not the
    work) or from one call (the first call pays for allocation and autotuning).
    """
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    cuda = torch.cuda.is_available()
    for _ in range(3):  # allocation, cuBLAS handles, autotuning: not what we measure
        fn(*args, **kwargs)
    sync()
    walls, cpus = [], []
    for _ in range(max(calls, 5)):
        sync()
        start = time.perf_counter()
        fn(*args, **kwargs)
        issued = time.perf_counter()
        sync()
        walls.append(time.perf_counter() - start)
        cpus.append(issued - start)
    kernels: Counter[str] = Counter()
    durations: Counter[str] = Counter()
    n = max(calls, 5)
    if cuda:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    fn(*args, **kwargs)
                sync()
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name] += 1
                durations[event.name] += event.time_range.elapsed_us()
    top = sorted(durations, key=lambda k: -durations[k])
    span, busy = replay_gpu_time_us(fn, args, kwargs) if cuda and replay else (None, None)
    return Profile(
        name=name,
        device=torch.cuda.get_device_name() if cuda else "cpu",
        calls=n,
        kernels_per_call=sum(kernels.values()) / n,
        gpu_busy_us=sum(durations.values()) / n,
        wall_us=statistics.median(walls) * 1e6,
        cpu_us=statistics.median(cpus) * 1e6,
        graph_call_us=graph_call_cost_us() if cuda else 0.0,
        replay_gpu_us=span,
        replay_busy_us=busy,
        top_kernels=[(k, kernels[k] / n, durations[k] / n) for k in top[:5]],
    )


def graph_call_cost_us() -> float:
    """Wall time of replaying a one-kernel graph and synchronizing: the least a graphed call
    costs on this machine (launch plus synchronize latency)."""
    global _graph_call_us
    if _graph_call_us is None:
        x = torch.zeros(1, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x.add_(1)
        samples = []
        for _ in range(200):
            torch.cuda.synchronize()
            start = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        _graph_call_us = statistics.median(samples) * 1e6
    return _graph_call_us


def replay_gpu_time_us(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], rounds: int = 20
) -> tuple[float | None, float | None]:
    """One replay of ``fn``'s graph on the GPU, as the profiler recorded it: its span (first
    kernel's start to last kernel's end, the gaps between the graph's kernels included, the
    CPU's launch latency not) and its busy time (the kernels' durations summed, as the floor
    is). ``(None, None)`` if ``fn`` cannot be captured."""
    from ..api import graph
    from ..errors import CudaGraphsError

    try:
        graphed = graph(fn, *args, **kwargs)
    except CudaGraphsError:
        return None, None
    recording = graphed.graph
    if recording is None:
        return None, None
    groups = _replay_kernels(recording.replay, rounds)
    if not groups:
        return gpu_time_us(recording.replay, rounds), None
    spans = [max(end for _, end in g) - g[0][0] for g in groups]
    busy = [sum(end - start for start, end in g) for g in groups]
    return statistics.median(spans), statistics.median(busy)


def _replay_kernels(launch: Callable[[], Any], rounds: int) -> list[list[tuple[float, float]]]:
    """Per call of ``launch``, its GPU activities as (start, end) in µs, from the profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(rounds):
                torch.cuda.synchronize()
                launch()
            torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not kernels or len(kernels) % rounds:
        return []  # the profiler did not see every replay's kernels: fall back to events
    per_call = len(kernels) // rounds
    return [kernels[i : i + per_call] for i in range(0, len(kernels), per_call)]


def gpu_time_us(launch: Callable[[], Any], rounds: int = 20) -> float:
    """Median GPU time of ``launch()``'s work: a spin kernel keeps the GPU busy while the work is
    queued behind it, so the events time the kernels, not the CPU that launched them."""
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        compat.sleep_cycles(2_000_000)  # ~1 ms of spinning: longer than issuing the work takes
        start.record()
        launch()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)

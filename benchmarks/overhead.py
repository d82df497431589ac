"""Per-call overhead of cudagraphs against eager, reduce-overhead and hand-rolled graphs.

For each model: eager, ``torch.compile(mode="reduce-overhead")``, a bare ``CUDAGraph`` with
copy+replay, the hand-rolled ``GraphModel`` class, and ``cg.graph`` under each output policy. Every
mode is first checked against eager on fresh random inputs; then all are timed side by side in
one run (interleaved windows, medians), in latency (sync after each call) and throughput (one
sync per window). Ratios are the figures to read; absolute times move between runs.

    python benchmarks/overhead.py [--models mlp_256,transformer] [--json PATH] [--markdown PATH]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import common
import torch
from rich.console import Console

import cudagraphs as cg
from cudagraphs.core.guards import AddressCheck
from cudagraphs.core.launch import native_edits
from cudagraphs.tools.timing import Timing, measure_side_by_side
from cudagraphs.tools.workloads import MODELS, hand_written_graph


class GraphModel:
    """The usual hand-rolled class, verbatim in spirit: warm up, capture, replay."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor):
        self.model = model.cuda().eval()
        self.x = x
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                self.out = self.model(self.x)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self.g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.g):
            self.out = self.model(self.x)

    def __call__(self) -> torch.Tensor:
        self.g.replay()
        return self.out


MODES = (
    "eager",
    "reduce-overhead",
    "bare copy+replay",
    "hand-rolled GraphModel",
    "cg alias",
    "cg guarded",
    "cg clone",
    # Where cg alias's time goes: its own recording replayed the bare way (copy+replay), and
    # its one-frame call path without the address guard.
    "cg recording (bare call)",
    "cg path (no guard)",
    "cg guarded (guard=capture)",
)


def build_modes(
    model: torch.nn.Module, example: torch.Tensor, selected: tuple[str, ...] = MODES
) -> dict[str, Callable[[Any], Any]]:
    modes: dict[str, Callable[[Any], Any]] = {"eager": model}
    if "reduce-overhead" in selected:
        modes["reduce-overhead"] = torch.compile(model, mode="reduce-overhead")
    modes["bare copy+replay"] = hand_written_graph(model, example)
    if "hand-rolled GraphModel" in selected:
        hand_rolled = GraphModel(model, example.clone())

        def hand_rolled_call(x: torch.Tensor) -> torch.Tensor:
            hand_rolled.x.copy_(x)
            return hand_rolled()

        modes["hand-rolled GraphModel"] = hand_rolled_call
    for policy in ("alias", "guarded", "clone"):
        if f"cg {policy}" in selected:
            modes[f"cg {policy}"] = cg.graph(model, example, outputs=policy)
    if "cg guarded (guard=capture)" in selected:  # the address guard's share of a call
        modes["cg guarded (guard=capture)"] = cg.graph(model, example, guard="capture")
    if {"cg recording (bare call)", "cg path (no guard)"} & set(selected):
        graphed = cg.graph(model, example, outputs="alias")
        replayer = graphed.replayer
        assert replayer is not None
        static_x, static_y, graph = replayer.slots[0][1], replayer.emit(), replayer.graph

        def recording_bare(x: torch.Tensor) -> torch.Tensor:
            static_x.copy_(x)
            graph.replay()
            return static_y

        modes["cg recording (bare call)"] = recording_bare
        # The library's call path with no address guard: the checks, copy, replay, outputs.
        modes["cg path (no guard)"] = cg.graph(model, example, outputs="alias", guard="capture")
    return modes


def check_against_eager(
    modes: dict[str, Callable[[Any], Any]], model: torch.nn.Module, shape: tuple[int, ...]
) -> dict[str, float]:
    """Max abs error of every mode against eager on fresh random inputs (3 draws)."""
    errors = {name: 0.0 for name in modes}
    for _ in range(3):
        x = torch.randn(*shape, device="cuda")
        expected = model(x)
        for name, call in modes.items():
            try:
                got = call(x).clone()
                torch.cuda.synchronize()
                error = (got - expected).abs().max().item()
            except Exception as failure:
                raise RuntimeError(f"mode {name!r} failed its check against eager") from failure
            if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
                raise AssertionError(f"{name} differs from eager: max abs error {error:.3e}")
            errors[name] = max(errors[name], error)
    return errors


def run(
    model_names: list[str], calls: int, windows: int, selected: tuple[str, ...] = MODES
) -> dict[str, Any]:
    results: dict[str, Any] = {**common.environment(calls, windows), "models": {}}
    for name in model_names:
        make, shape = MODELS[name.removesuffix("+tf32")]
        torch.manual_seed(0)
        model = make().cuda().eval()
        # "+tf32": the same model with TF32 matmuls (torch.set_float32_matmul_precision("high")),
        # where the GEMMs no longer dominate and launch overhead is what is left.
        tf32 = name.endswith("+tf32")
        torch.backends.cuda.matmul.allow_tf32 = tf32
        with torch.no_grad():
            example = torch.randn(*shape, device="cuda")
            modes = build_modes(model, example, selected)
            errors = check_against_eager(modes, model, shape)
            inputs = [torch.randn(*shape, device="cuda") for _ in range(4)]
            timings = measure_side_by_side(modes, inputs, calls=calls, windows=windows)
        results["models"][name] = {
            "shape": list(shape),
            "max_abs_error_vs_eager": errors,
            "timings_us": {m: vars(t) for m, t in timings.items()},
        }
        del modes
        torch.compiler.reset()
    torch.backends.cuda.matmul.allow_tf32 = False
    return results


def guard_cost(calls: int, windows: int) -> dict[str, Any]:
    """Address-guard cost on a 100-parameter model: guarded vs unguarded replays side by side,
    and the guard check alone, timed directly."""
    import time

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(50)]).cuda().eval()
    with torch.no_grad():
        example = torch.randn(8, 32, device="cuda")
        checked = cg.graph(model, example, guard="replay")
        unchecked = cg.graph(model, example, guard="capture")
        inputs = [torch.randn(8, 32, device="cuda") for _ in range(4)]
        t = measure_side_by_side(
            {"guard=replay": checked, "guard=capture": unchecked},
            inputs,
            calls=calls,
            windows=windows,
        )
        guard = checked.guard
        assert guard is not None
        n = 20000

        def per_call_us(fn: Any) -> float:
            samples = []
            for _ in range(windows):
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                samples.append((time.perf_counter() - start) / n)
            return sorted(samples)[len(samples) // 2] * 1e6

        check_us = per_call_us(guard.stale)
        # The lock that serializes calls from several threads, uncontended: acquire + release.
        lock = checked.lock

        def locked() -> None:
            with lock:
                pass

        lock_us = per_call_us(locked) - per_call_us(lambda: None)
        # For scale, the same comparison each other way, in the same run: torch's pybind helper
        # (what the guard falls back to without a compiler) and a plain Python loop.
        tensors, ptrs = guard.tensors, guard.ptrs
        helper = AddressCheck(tensors, native=False)
        helper_us = per_call_us(helper)
        loop_us = per_call_us(lambda: [t.data_ptr() for t in tensors] == ptrs)
        # The copy-in of a call's input, in front of every replay: Tensor.copy_ (what a
        # hand-written replay does) against pointing the recording's copy node at the tensor.
        static_x = checked.replayer.slots[0][1]
        given = [torch.randn_like(example) for _ in range(2)]
        copy_us = per_call_us(lambda: static_x.copy_(given[0]))
        copies = checked.replayer.copies
        node_us, edit_path = None, ""
        if copies is not None:
            a, b = (t.data_ptr() for t in given)
            node_us = per_call_us(lambda: (copies.point(0, a), copies.point(0, b))) / 2
            copies.all_off()
            edit_path = "one C call" if native_edits() else "cuda-bindings"
        # Zero silent wrong results: move parameters three ways, compare with eager each time.
        wrong = 0
        x = torch.randn(8, 32, device="cuda")
        model[0].weight.data = torch.randn(32, 32, device="cuda")
        wrong += not torch.allclose(checked(x), model(x), rtol=1e-5, atol=1e-5)
        model.cpu()
        model.cuda()
        wrong += not torch.allclose(checked(x), model(x), rtol=1e-5, atol=1e-5)
        model.register_buffer("unused", torch.zeros(1, device="cuda"))
        model[1].bias = torch.nn.Parameter(torch.randn(32, device="cuda"))
        wrong += not torch.allclose(checked(x), model(x), rtol=1e-5, atol=1e-5)
    return {
        "tensors": guard.count,
        "check_us": check_us,
        "lock_us": lock_us,
        "python_loop_us": loop_us,
        "backend": guard.addresses.backend,
        "helper_backend": helper.backend,
        "helper_us": helper_us,
        "copy_us": copy_us,
        "copy_node_us": node_us,
        "copy_node_edit": edit_path,
        "data_ptrs": len(guard.tensors),
        "latency_us": {k: v.latency_us for k, v in t.items()},
        "throughput_us": {k: v.throughput_us for k, v in t.items()},
        "recaptures": checked.stats.recaptures,
        "wrong_results_after_moves": wrong,
    }


def ratios(timings: dict[str, Timing], mode: str, base: str) -> tuple[float, float]:
    return (
        timings[mode].latency_us / timings[base].latency_us,
        timings[mode].throughput_us / timings[base].throughput_us,
    )


def render(results: dict[str, Any], console: Console) -> str:
    """Print a rich table per model; return the same content as markdown for reports."""
    md = [common.environment_line(results, "calls"), ""]
    header = [
        "mode",
        "latency µs",
        "throughput µs",
        "vs bare (lat / thr)",
        "speed-up vs eager (lat / thr)",
        "max |err| vs eager",
    ]
    for name, data in results["models"].items():
        timings = {m: Timing(**t) for m, t in data["timings_us"].items()}
        rows = []
        for mode, t in timings.items():
            vs_bare = ratios(timings, mode, "bare copy+replay")
            vs_eager = ratios(timings, "eager", mode)
            rows.append(
                [
                    mode,
                    f"{t.latency_us:.1f}",
                    f"{t.throughput_us:.1f}",
                    f"{vs_bare[0]:.2f}× / {vs_bare[1]:.2f}×",
                    f"{vs_eager[0]:.2f}× / {vs_eager[1]:.2f}×",
                    f"{data['max_abs_error_vs_eager'][mode]:.1e}",
                ]
            )
        table, lines = common.table(f"{name} {tuple(data['shape'])}", header, rows)
        console.print(table)
        md += [f"**{name}** input {tuple(data['shape'])}", "", *lines, ""]
    guard = results.get("guards")
    if guard:
        lat, thr = guard["latency_us"], guard["throughput_us"]
        lines = [
            f"**Address guards** on a 100-parameter model ({guard['tensors']} guarded tensors and flags):",
            "",
            f"- the check alone ({guard.get('backend', 'torch helper')} address loop): "
            f"{guard['check_us']:.2f} µs per call "
            f"({guard['check_us'] * 1000 / guard['tensors']:.0f} ns per guarded tensor)",
            f"- the call lock that serializes threads, uncontended: {guard['lock_us']:.3f} µs "
            "per call (acquire and release)",
            *(
                [
                    f"- the {guard['data_ptrs']} addresses alone, other ways, same run: "
                    f"{guard['helper_backend']} {guard['helper_us']:.2f} µs, "
                    f"plain Python loop {guard['python_loop_us']:.2f} µs"
                ]
                if "helper_us" in guard
                else [
                    f"- a plain Python loop comparing the {guard['data_ptrs']} data_ptr()s alone: "
                    f"{guard['python_loop_us']:.2f} µs"
                ]
            ),
            *(
                [
                    f"- copy-in of a call's {(8, 32)} input: "
                    f"`Tensor.copy_` before the replay {guard['copy_us']:.2f} µs of host time; "
                    "pointing the recording's copy node at the tensor instead "
                    + (
                        f"{guard['copy_node_us']:.2f} µs ({guard.get('copy_node_edit', '')})"
                        if guard.get("copy_node_us") is not None
                        else "(not recorded: cuda-bindings missing)"
                    )
                ]
                if "copy_us" in guard
                else []
            ),
            f"- replay with guard='replay' vs guard='capture': latency {lat['guard=replay']:.1f} vs "
            f"{lat['guard=capture']:.1f} µs, throughput {thr['guard=replay']:.1f} vs {thr['guard=capture']:.1f} µs",
            f"- after `param.data = ...`, `model.cpu().cuda()` and a reassigned parameter: "
            f"{guard['recaptures']} recaptures, {guard['wrong_results_after_moves']} wrong results",
            "",
        ]
        console.print("\n".join(lines))
        md += lines
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, "overhead", calls=200, windows=7)
    choices = [*MODELS, "mlp_256+tf32"]
    parser.add_argument(
        "--models",
        default="mlp_256,mlp_256+tf32,transformer,deep_mlp",
        help="comma-separated: " + ", ".join(choices),
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES)
    )
    args = parser.parse_args(argv)
    console = Console()
    if not common.cuda_or_explain("overhead.py", console):
        return 0
    names = common.names(parser, "--models", args.models, choices)
    results = run(names, args.calls, args.windows, tuple(args.modes.split(",")))
    results["guards"] = guard_cost(args.calls, args.windows)
    common.write(results, render(results, console), args, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())

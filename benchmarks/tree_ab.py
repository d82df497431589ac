"""Guarded call latency of this tree against an earlier tree of the library, in one process.

Two processes, one per tree, see different clocks, allocators and GPU states: on the overhead
models one tree's own runs moved by up to 20 % between processes. Here the earlier tree is
loaded beside this one under another package name (``cudagraphs_before``: a copy of its
``src/cudagraphs`` with its one absolute import renamed, its compiled extension included), and
both trees' ``cg.graph(model, x)`` (guarded outputs, the default) are timed side by side with
eager and the hand-written graph, window by window, in rounds that alternate which tree goes
first.

    python benchmarks/tree_ab.py --before PATH/TO/OLD/src [--models mlp_256,transformer,deep_mlp]
                                 [--rounds 4] [--windows 9] [--calls 100] [--first this|before|both]
                                 [--json F] [--markdown F]

``PATH/TO/OLD/src`` holds the earlier tree's ``cudagraphs`` package (built in place, so that its
``_before_replay`` extension is there; without it that tree runs its pure-Python fallback and
the comparison says so).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import cudagraphs as cg
from cudagraphs.tools.timing import measure_side_by_side
from cudagraphs.tools.workloads import MODELS, hand_written_graph

BEFORE = "cudagraphs_before"


def load_before(src: Path, into: Path) -> Any:
    """Copy the earlier tree's package under another name and import it."""
    target = into / BEFORE
    shutil.copytree(src / "cudagraphs", target, ignore=shutil.ignore_patterns("__pycache__"))
    for path in target.rglob("*.py"):
        text = path.read_text()
        renamed = text.replace("import cudagraphs as", f"import {BEFORE} as")
        renamed = renamed.replace("from cudagraphs.", f"from {BEFORE}.")
        if renamed != text:
            path.write_text(renamed)
    sys.path.insert(0, str(into))
    return importlib.import_module(BEFORE)


def has_extension(package: Any) -> bool:
    folder = Path(package.__file__).parent / "core"
    return any(folder.glob("_before_replay*.so"))


def run(
    before: Any, models: list[str], rounds: int, windows: int, calls: int, first: str = "this"
) -> dict[str, Any]:
    """``first``: whose graph is captured first, ``"this"`` tree's or the tree ``"before"``'s
    (the one captured second gets its memory after the first's pool)."""
    results: dict[str, Any] = {}
    for name in models:
        torch.manual_seed(0)
        make, shape = MODELS[name]
        model = make().cuda().eval()
        example = torch.randn(*shape, device="cuda")
        inputs = [torch.randn_like(example) for _ in range(4)]
        with torch.no_grad():
            if first == "this":
                this_tree = cg.graph(model, example)
                before_tree = before.graph(model, example)
            else:
                before_tree = before.graph(model, example)
                this_tree = cg.graph(model, example)
            for call in (this_tree, before_tree):
                for x in inputs:  # both answer as eager before anything is timed
                    torch.testing.assert_close(call(x), model(x), rtol=1e-4, atol=1e-4)
            modes = {
                "eager": model,
                "hand-written graph": hand_written_graph(model, example),
                "this tree": this_tree,
                "tree before": before_tree,
            }
            latency: dict[str, list[float]] = {m: [] for m in modes}
            throughput: dict[str, list[float]] = {m: [] for m in modes}
            for round_ in range(rounds):
                order = list(modes) if round_ % 2 == 0 else list(reversed(modes))
                timed = measure_side_by_side(
                    {m: modes[m] for m in order}, inputs, calls=calls, windows=windows
                )
                for m, timing in timed.items():
                    latency[m].append(timing.latency_us)
                    throughput[m].append(timing.throughput_us)
        results[name] = {
            "latency_us": {m: statistics.median(v) for m, v in latency.items()},
            "throughput_us": {m: statistics.median(v) for m, v in throughput.items()},
            "latency_rounds": latency,
        }
    return results


def markdown(
    results: dict[str, Any], rounds: int, windows: int, calls: int, extension: bool,
    first: str = "this",
) -> str:  # fmt: skip
    lines = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; one process, both trees "
        f"loaded; µs per call, median of {rounds} rounds (each the median of {windows} "
        f"interleaved windows of {calls} calls, the rounds alternating which mode goes first). "
        "Latency: a synchronize after each call; throughput: one per window. "
        + (
            "This tree's graph was captured first."
            if first == "this"
            else "The tree before's graph was captured first."
        )
        + ("" if extension else " The tree before ran WITHOUT its compiled extension."),
        "",
        "| model | eager | hand-written | tree before | this tree | this / before latency "
        "| this / before throughput | per-round latency ratios |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lat, thr = r["latency_us"], r["throughput_us"]
        per_round = [
            f"{a / b:.3f}"
            for a, b in zip(r["latency_rounds"]["this tree"], r["latency_rounds"]["tree before"])
        ]
        lines.append(
            f"| {name} | {lat['eager']:.1f} | {lat['hand-written graph']:.1f} "
            f"| {lat['tree before']:.1f} | {lat['this tree']:.1f} "
            f"| {lat['this tree'] / lat['tree before']:.3f}x "
            f"| {thr['this tree'] / thr['tree before']:.3f}x | {', '.join(per_round)} |"
        )
    return "\n".join(lines) + "\n"


def both_orders(runs: dict[str, Any]) -> str:
    """Per model, this tree's latency over the tree before's with each tree's graph captured
    first, and their geometric mean: what the order of the captures moves cancels out."""
    lines = [
        "| model | this / before, this captured first | this / before, before captured first "
        "| geometric mean |",
        "|---|---|---|---|",
    ]
    for name in runs["this"]:
        ratios = [
            runs[first][name]["latency_us"]["this tree"]
            / runs[first][name]["latency_us"]["tree before"]
            for first in ("this", "before")
        ]
        mean = (ratios[0] * ratios[1]) ** 0.5
        lines.append(f"| {name} | {ratios[0]:.3f}x | {ratios[1]:.3f}x | {mean:.3f}x |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", required=True, type=Path, help="the earlier tree's src/")
    parser.add_argument("--models", default="mlp_256,transformer,deep_mlp")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--windows", type=int, default=9)
    parser.add_argument("--calls", type=int, default=100, help="calls per window")
    parser.add_argument(
        "--first", choices=("this", "before", "both"), default="this",
        help="whose graph is captured first (default this tree's); both: a run of each order, "
        "and the geometric mean of their latency ratios",
    )  # fmt: skip
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    if not (args.before / "cudagraphs" / "__init__.py").is_file():
        parser.error(f"--before {args.before}: expected a src/ folder holding cudagraphs/")
    orders = ["this", "before"] if args.first == "both" else [args.first]
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        before = load_before(args.before, Path(folder))
        extension = has_extension(before)
        for first in orders:
            runs[first] = run(
                before, args.models.split(","), args.rounds, args.windows, args.calls, first
            )
    text = "\n".join(
        markdown(results, args.rounds, args.windows, args.calls, extension, first)
        for first, results in runs.items()
    )
    if len(runs) == 2:
        text += "\n" + both_orders(runs)
    if args.json:
        Path(args.json).write_text(
            json.dumps(runs if len(runs) == 2 else runs[orders[0]], indent=2)
        )
    if args.markdown:
        Path(args.markdown).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

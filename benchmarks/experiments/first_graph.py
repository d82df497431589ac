"""Is the first graph a process captures slower than the same graph captured later?

    python benchmarks/first_graph.py --model mlp_item --order graphs
    python benchmarks/first_graph.py --model efficientnet_b0 --order auto

``--order graphs``: ``cg.graph(model, x)`` twice, timed side by side; then
``cg.graph(model, x, compile=True)`` and a third plain graph, all four timed again.
``--order auto``: ``cg.auto`` cold (no saved decision), the same decision rebuilt from disk by a
second ``cg.auto`` call, then ``cg.graph`` and ``cg.graph(compile=True)``, all timed side by
side. Each cell: latency (a synchronize after each call) / throughput (calls back to back), µs,
nine interleaved windows of 50 calls (``cudagraphs.tools.timing``). Models are
``benchmarks/fusion.py``'s, fp32 with TF32 off.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks' shared helpers
from third_party_models import args_modes, build, fresh_like

import cudagraphs as cg
from cudagraphs.tools.timing import measure_side_by_side


def timed(name: str, order: str, x: tuple[Any, ...], ways: dict[str, Any]) -> None:
    for call in ways.values():
        for _ in range(4):
            call(*fresh_like(x))
    inputs = [fresh_like(x) for _ in range(4)]
    t = measure_side_by_side(args_modes(ways), inputs, calls=50, windows=9)
    cells = " | ".join(f"{n}: {t[n].latency_us:.1f}/{t[n].throughput_us:.1f}" for n in ways)
    print(name, order, cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="mlp_item")
    parser.add_argument("--order", choices=("graphs", "auto"), default="graphs")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, x = build(args.model)
    with torch.no_grad():
        ways: dict[str, Any] = {}
        if args.order == "graphs":
            ways["graph 1st"] = cg.graph(model, *x)
            ways["graph 2nd"] = cg.graph(model, *x)
            timed(args.model, args.order, x, ways)
            ways["compile=True"] = cg.graph(model, *x, compile=True)
            ways["graph after compile"] = cg.graph(model, *x)
            timed(args.model, args.order, x, ways)
        else:
            ways["auto cold"] = cg.auto(model, *x, reuse=False)
            print(ways["auto cold"].report.chosen)
            ways["auto from disk"] = cg.auto(model, *x)
            print("from disk:", ways["auto from disk"].report.from_disk)
            ways["graph"] = cg.graph(model, *x)
            ways["compile=True"] = cg.graph(model, *x, compile=True)
            timed(args.model, args.order, x, ways)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

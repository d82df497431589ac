"""What one replay does on the host's CUDA API and on the GPU, for this tree's graph and an
earlier tree's, in one process (``tree_ab.py`` loads the earlier tree): the runtime calls and
kernels per call from ``torch.profiler``, and the latency per call with a synchronize after
each (the best of 5 windows of 200 calls). Two trees whose replays launch the same kernels
through the same calls do the same work per call; a latency gap between them is then the
host's Python or the placement of their memory.

    python benchmarks/replay_calls.py --before PATH/TO/OLD/src [--models mlp_256,transformer]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from tree_ab import load_before

import cudagraphs as cg
from cudagraphs.tools.workloads import MODELS


def latency_us(call: object, x: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            call(x)  # type: ignore[operator]
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / 200 * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", required=True, type=Path, help="the earlier tree's src/")
    parser.add_argument("--models", default="mlp_256,transformer")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("replay_calls.py needs a CUDA GPU")
        return
    before = load_before(args.before, Path(tempfile.mkdtemp()))
    for name in args.models.split(","):
        torch.manual_seed(0)
        make, shape = MODELS[name]
        model = make().cuda().eval()
        x = torch.randn(*shape, device="cuda")
        with torch.no_grad():
            graphs = {"this": cg.graph(model, x), "before": before.graph(model, x)}
            for tree, g in graphs.items():
                for _ in range(50):
                    g(x)
                torch.cuda.synchronize()
                best = latency_us(g, x)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(20):
                        g(x)
                        torch.cuda.synchronize()
                print(f"===== {name} {tree}: {best:.2f} us per call (sync each)")
                rows = {
                    e.key: (e.count, e.device_time_total / max(e.count, 1),
                            e.cpu_time_total / max(e.count, 1))
                    for e in prof.key_averages()
                }  # fmt: skip
                for key, (count, dev, host) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
                    print(
                        f"  {count / 20:6.2f}/call  dev {dev:8.2f} us  host {host:8.2f} us  {key[:90]}"
                    )


if __name__ == "__main__":
    main()

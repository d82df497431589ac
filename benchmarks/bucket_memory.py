"""Bucket memory as a user sees it: the growth of ``torch.cuda.memory_reserved()``.

For each model, in fresh processes (one allocator each): ``cg.graph(model, x, buckets=...)``
with batch rungs 1, 2, 4, 8, 16, 32, against a single ``cg.graph`` at batch 32 (the largest rung
alone). Each is read right after it was created, and again after its outputs were checked
against eager and ``torch.cuda.empty_cache()`` returned the eager runs' cached blocks: what the
graphs themselves hold. The ratio compares those settled figures (the bucketed callable empties
the cache after its captures; a single graph leaves its warm-up's blocks cached, which would
flatter the ratio).

    python benchmarks/bucket_memory.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

LADDER = [1, 2, 4, 8, 16, 32]
MODELS = ("transformer", "resnet18", "mobilenet_v3_small")


def build(name: str) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    if name == "transformer":
        from cudagraphs.tools.workloads import transformer

        return transformer(), (64, 256)
    import torchvision

    return getattr(torchvision.models, name)(), (3, 224, 224)


def measure(name: str, mode: str) -> dict[str, Any]:
    """One measurement in this process: growth of memory_reserved() for one way of graphing."""
    import torch

    import cudagraphs as cg

    model, shape = build(name)
    model = model.cuda().eval()
    example = torch.randn(LADDER[-1], *shape, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    with torch.no_grad():
        if mode == "buckets":
            g = cg.graph(model, example, buckets={"B": LADDER})
        else:
            g = cg.graph(model, example)
        torch.cuda.synchronize()
        as_created = torch.cuda.memory_reserved() - before
        for b in LADDER if mode == "buckets" else LADDER[-1:]:  # every rung answers, and is right
            x = torch.randn(b, *shape, device="cuda")
            torch.testing.assert_close(g(x), model(x), rtol=1e-3, atol=1e-3)
    del x
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    settled = torch.cuda.memory_reserved() - before
    pool = g.stats.pool_total_bytes if mode == "buckets" else g.stats.pool_bytes
    return {"as_created": as_created, "settled": settled, "pool": pool}


def run_all() -> dict[str, Any]:
    """Every model and mode, each in its own process."""
    here = Path(__file__).resolve()
    env = dict(os.environ)
    results: dict[str, Any] = {}
    for name in MODELS:
        results[name] = {}
        for mode in ("buckets", "largest"):
            out = subprocess.run(
                [sys.executable, str(here), "--one", name, mode],
                capture_output=True,
                text=True,
                env=env,
                check=True,
                timeout=600,
            )
            results[name][mode] = json.loads(out.stdout.strip().splitlines()[-1])
        results[name]["ratio"] = (
            results[name]["buckets"]["settled"] / results[name]["largest"]["settled"]
        )
    return results


def render(results: dict[str, Any]) -> str:
    mib = 2**20
    lines = [
        "| model (batch rungs 1..32) | all buckets MiB (as created / settled) | largest alone MiB (as created / settled) | ratio (settled) |",
        "|---|---|---|---|",
    ]
    for name in MODELS:
        r = results[name]
        lines.append(
            f"| {name} | {r['buckets']['as_created'] / mib:.1f} / {r['buckets']['settled'] / mib:.1f} | "
            f"{r['largest']['as_created'] / mib:.1f} / {r['largest']['settled'] / mib:.1f} | "
            f"{r['ratio']:.2f}× |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one)))
        return 0
    results = run_all()
    print(render(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

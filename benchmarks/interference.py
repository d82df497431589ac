"""torch.compile beside cudagraphs: a reduce-overhead decode loop with and without cudagraphs
imported and a guard alive, in alternating fresh processes (a Llama shape of 512 hidden, 8
layers, random weights). Same tokens and the same number of compiled graphs are required;
tokens/s are reported side by side.

    python benchmarks/interference.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HELPER = Path(__file__).resolve().parents[1] / "tests" / "compile_decode.py"


def run(mode: str) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(HELPER.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    out = subprocess.run(
        [sys.executable, str(HELPER), mode, "512", "8", "128"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"without": [], "with": []}
    for _ in range(args.rounds):
        for mode in ("without", "with"):
            results[mode].append(run(mode))
    same_tokens = all(
        r["tokens"] == results["without"][0]["tokens"] for m in results for r in results[m]
    )
    frames = {m: sorted({r["frames"] for r in results[m]}) for m in results}
    speed = {m: statistics.median(r["tok_s"] for r in results[m]) for m in results}
    print(f"| cudagraphs in the process | tokens/s (median of {args.rounds}) | compiled graphs |")
    print("|---|---|---|")
    print(f"| not imported | {speed['without']:.0f} | {frames['without']} |")
    print(f"| imported, a guard alive | {speed['with']:.0f} | {frames['with']} |")
    print(
        f"\nratio with/without {speed['with'] / speed['without']:.3f}; same tokens: {same_tokens}"
    )
    return 0 if same_tokens and frames["with"] == frames["without"] else 1


if __name__ == "__main__":
    sys.exit(main())

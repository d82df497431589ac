"""Host cost of a graph's guard check before each replay, on the CPU: ``AddressGuard.check()``
for models of growing size, with the count of what it checks.

The guard runs before every replay, so its cost adds to each call's host time. It checks the
addresses of the parameters and buffers, each module's train/eval switch, the objects in each
module's parameter, buffer and child slots, the forward hooks of every module (and the global
ones), and the plain values a recording read. This script times that one call for a
transformers Llama of random weights at a few depths, and for a small MLP; run it on two trees
(a ``git worktree`` of each) to compare what a change to the guard costs.

    python benchmarks/guard_cost.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import timeit
from typing import Any

import torch
from torch import nn

from cudagraphs.core import AddressGuard


def models() -> dict[str, nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM

    found: dict[str, nn.Module] = {
        "MLP, 3 linear layers": nn.Sequential(
            nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)
        )
    }
    for layers in (2, 22):
        config = LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        )  # fmt: skip
        torch.manual_seed(0)
        found[f"transformers Llama, {layers} layers"] = LlamaForCausalLM(config).eval()
    return found


def time_check(guard: AddressGuard, number: int = 20000, rounds: int = 9) -> float:
    """ns per ``guard.check()``: the median of ``rounds`` rounds of ``number`` calls."""
    return (
        statistics.median(timeit.repeat(guard.check, number=number, repeat=rounds)) / number * 1e9
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    for name, model in models().items():
        guard = AddressGuard(model.forward, [model])
        assert guard.check(), "nothing changed: the check must hold"
        rows.append({
            "model": name, "modules": len(list(model.modules())), "checked": guard.count,
            "ns_per_check": time_check(guard),
        })  # fmt: skip
    print(f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}")
    for row in rows:
        print(f"{row['model']}: {row['modules']} modules, {row['checked']} checked, "
              f"{row['ns_per_check']:.0f} ns per check")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": platform.machine(), "python": platform.python_version(),
                       "torch": torch.__version__, "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Host cost of the checks every replay makes before its launch, timed on the CPU alone.

These checks are host work (no kernel), so they can be timed on any machine: the modes check
(``Modes.same``: PyTorch's global-state guard, the inference-mode flag and the backend settings
that guard leaves out, read in one call into the compiled extension), its parts, the thread
check, and
the whole pre-launch part of a call, with a stand-in graph whose replay does nothing, so that
no GPU is needed. Medians of repeated timings, ns per call.

    python benchmarks/mode_check.py [--markdown PATH]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

from cudagraphs.core.modes import Modes
from cudagraphs.core.replay import Counters, Replayer
from cudagraphs.core.signature import Signature


def per_call_ns(fn: Any, calls: int = 20000, rounds: int = 15) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    modes = Modes("bench")
    guard_check = modes.guard.check
    inference = torch.is_inference_mode_enabled
    want = inference()
    ident = threading.get_ident
    x = torch.randn(4, 4)
    signature, leaves = Signature.of_call((x,), {})
    replayer = Replayer(
        SimpleNamespace(replay=lambda: None), signature, leaves, [], x, "alias", Counters()
    )
    replayer.owner = ident()
    rows = {
        "empty call (the loop's own cost)": per_call_ns(lambda: None),
        "modes: global-state guard check (C)": per_call_ns(guard_check),
        "modes: inference-mode flag": per_call_ns(inference),
        "modes: guard check and inference flag, in Python (the check without backend settings)": (
            per_call_ns(lambda: guard_check() and inference() is want)
        ),
        f"modes: Modes.same, all {len(modes.calls)} reads": per_call_ns(modes.same),
        "thread: threading.get_ident()": per_call_ns(ident),
        "Replayer.call, one tensor, alias outputs, no-op replay": per_call_ns(
            lambda: replayer.call((x,), (x,), {})
        ),
    }
    lines = [
        "# Host cost of the pre-launch checks (CPU only)",
        "",
        f"Host: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"Python {platform.python_version()}, torch {torch.__version__}; `benchmarks/mode_check.py`.",
        "Medians of 15 rounds of 20000 calls, ns per call, in a tight loop (caches warm: a real "
        "call between synchronizations finds them colder and costs more).",
        "",
        "| what | ns per call |",
        "|---|---|",
        *(f"| {name} | {ns:.0f} |" for name, ns in rows.items()),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()

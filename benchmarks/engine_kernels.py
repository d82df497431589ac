"""Where an engine request's device time goes: the replay time of each recorded batch of
prompt chunks (rows by tokens, on the shortest cache-length rung), and the GPU kernels of
one 16-token request with one new token in steady state (``torch.profiler``: how many, and
their time). The model is the 1.1 B TinyLlama shape in bfloat16 with random weights.

    python benchmarks/engine_kernels.py [--compile]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def timed_ms(fn: Callable[[], object], n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--compile", action="store_true", help="Engine(compile=True)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("engine_kernels.py needs a CUDA GPU")
        return
    from cudagraphs.decoding import Engine
    from cudagraphs.tools.workloads import random_llama

    model = random_llama("llama-2048", "cuda", torch.bfloat16, init=0.02)
    model.set_attn_implementation("sdpa")
    engine = Engine(model, max_batch=64, max_length=768, max_queue=64, compile=args.compile)
    chunks = engine.prefills
    print(f"{torch.cuda.get_device_name()}; compile={args.compile}; chunk rungs {chunks.rungs}, "
          f"row rungs {chunks.row_rungs}, lengths {chunks.lengths}")  # fmt: skip
    with torch.no_grad():
        for rows, rung, length in sorted(chunks.graphs):
            if length != chunks.lengths[0]:
                continue
            recorded = chunks.graphs[rows, rung, length]
            ids = torch.randint(1, 32000, (rows, rung), device="cuda")
            last = torch.zeros(rows, dtype=torch.long, device="cuda")
            ms = timed_ms(lambda: recorded(ids, last))  # noqa: B023
            print(f"replay of {rows} x {rung} tokens (cache {length}): {ms:.3f} ms")
    prompt = list(range(1, 17))
    for _ in range(3):
        engine.generate(prompt, max_new_tokens=1, eos_token_id=None)
    start = time.perf_counter()
    for _ in range(10):
        engine.generate(prompt, max_new_tokens=1, eos_token_id=None)
    print(f"one 16-token request, 1 new token: {(time.perf_counter() - start) * 100:.3f} ms")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.generate(prompt, max_new_tokens=1, eos_token_id=None)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_ms = sum(e.device_time for e in kernels) / 1e3
    print(f"per request: {len(kernels) / 5:.0f} kernels, {device_ms / 5:.3f} ms of kernel time")
    print(
        prof.key_averages().table(
            sort_by="device_time_total", row_limit=25, max_name_column_width=70
        )
    )
    engine.close()


if __name__ == "__main__":
    main()

"""What a second process of ``Decoder(compile=True)`` finds in PyTorch's on-disk compile caches.

For each way the compiled step reads its rung (``cut``: the step cuts the rung out of the one
cache, as the Decoder does; ``marked``: the rung's cache views handed in with their sizes
marked dynamic, the Decoder's fallback), two fresh processes build the same Decoder on one
cache folder, each in turn. Each reports its compile seconds and the caches' counters:
AOTAutograd's (``hit``, ``miss``, ``bypass``: a graph it refuses to save, which a second process
must trace again) and Inductor's FX graph cache (``hit``, ``miss``). Dynamo traces again in every
process either way; the caches save what comes after.

Runs on the CPU (Inductor's CPU code) where no GPU is found, on a small Llama by default:

    python benchmarks/decode_cache.py [--model llama-tiny] [--max-length 512]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import torch
from common import RESULTS, fresh_process, parent_or_child, write
from rich.console import Console

WAYS = ("cut", "marked")


def child(args: argparse.Namespace) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    from cudagraphs.decoding.decoder import Decoder
    from cudagraphs.decoding.kv_cache import RungCaches
    from cudagraphs.tools.workloads import random_llama

    if args.which == "marked":
        RungCaches.cuttable = lambda self: False  # this child process only
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_llama(args.model, device, torch.float32)
    start = time.perf_counter()
    decoder = Decoder(
        model, max_batch=4, max_length=args.max_length, batch_sizes=[1, 2, 4], compile=True,
        cache_lengths=[args.max_length // 4],
    )  # fmt: skip
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (4, 16), device=device)
    decoder.generate(prompt, max_new_tokens=4, eos_token_id=None)
    aot, fx = counters["aot_autograd"], counters["inductor"]
    return {
        "setup_s": time.perf_counter() - start,
        "compile_s": decoder.stats.compile_s,
        "aot_hit": aot["autograd_cache_hit"],
        "aot_miss": aot["autograd_cache_miss"],
        "aot_bypass": aot["autograd_cache_bypass"],
        "fx_hit": fx["fxgraph_cache_hit"],
        "fx_miss": fx["fxgraph_cache_miss"],
    }


def markdown(results: dict[str, Any]) -> list[str]:
    lines = [
        f"Hardware: {results['hardware']}, torch {results['torch']}; {results['model']} "
        f"(float32), batch rungs [1, 2, 4], cache length {results['max_length']}; each row a "
        "fresh process, the second of each pair on the cache folder the first left.",
        "",
        "| step reads its rung | process | compile s | AOTAutograd hit / miss / bypass | "
        "FX graph hit / miss |",
        "|---|---|---|---|---|",
    ]
    for way in WAYS:
        for which, row in zip(("first", "second"), results["runs"][way]):
            lines.append(
                f"| {way} | {which} | {row['compile_s']:.1f} | {row['aot_hit']} / "
                f"{row['aot_miss']} / {row['aot_bypass']} | {row['fx_hit']} / {row['fx_miss']} |"
            )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--max-length", type=int, default=512)
    args = parent_or_child(p, child)
    if args is None:
        return
    hardware = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (Inductor)"
    runs: dict[str, list[dict[str, Any]]] = {}
    for way in WAYS:
        with tempfile.TemporaryDirectory() as cache:
            argv = [__file__, "--model", args.model, "--max-length", str(args.max_length),
                    "--_child", way]  # fmt: skip
            runs[way] = [fresh_process(argv, cache, way) for _ in range(2)]
            print(json.dumps({way: runs[way]}), flush=True)
    results = {"hardware": hardware, "torch": torch.__version__, "model": args.model,
               "max_length": args.max_length, "runs": runs}  # fmt: skip
    text = "\n".join(markdown(results))
    print(text, flush=True)
    args.json = (
        args.json or RESULTS / f"decode-cache-{args.model}-torch{torch.__version__[:4]}.json"
    )
    write(results, text + "\n", args, Console())


if __name__ == "__main__":
    main()

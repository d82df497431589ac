"""What marking the batch and the cache length dynamic costs ``torch.compile`` in tracing.

The Decoder's forward (one decode step of a Llama over a prefix view of the rung caches) is
compiled with the ``aot_eager`` backend, which runs Dynamo and AOTAutograd but no code
generation, so the figures are the tracing cost alone and the script runs on a CPU. Each
variant runs in a fresh process with an empty on-disk compile cache:

  static   every size a constant (one compile per (batch rung, length rung))
  length   the cache length a dynamic dimension
  batch    the batch a dynamic dimension
  both     both, as ``Decoder(compile=True)`` marks them

Two alternatives that the Decoder does not use, measured to decide (DESIGN.md):

  sliced   batch and length dynamic, but the step receives the one full-size cache and cuts
           each layer's keys and values to the token's batch and the rung's length itself:
           two symbols instead of two per cache tensor
  unbacked as ``sliced``, with the batch marked unbacked (no size-1 specialisation)

Reported per variant: Dynamo's bytecode tracing, AOTAutograd, and the whole compile, from
``torch._dynamo.utils.compile_times()``; then, for the variants with a dynamic batch, the traces
after one more call at batch 1 (batch 1 as a class of its own: 2), and the graph breaks.

    python benchmarks/decode_compile_cost.py --model llama-2048 --markdown reports/x.md
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from common import RESULTS, fresh_process, write
from rich.console import Console

VARIANTS = {
    "static": {}, "length": {"length": 2}, "batch": {"batch": 0}, "both": {"batch": 0, "length": 2},
    "sliced": {"batch": 0, "length": 2}, "unbacked": {"batch": 0, "length": 2},
}  # fmt: skip
CUT_INSIDE = ("sliced", "unbacked")
PHASES = {
    "bytecode_tracing": "Dynamo tracing s",
    "create_aot_dispatcher_function": "AOTAutograd s",
    "_compile.compile_inner": "whole compile s",
}


def child(args: argparse.Namespace) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    from cudagraphs.integrations.compiled import mark_rung_dims
    from cudagraphs.integrations.kv_cache import RungCaches
    from cudagraphs.tools.workloads import random_llama

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_llama(args.model, device, torch.bfloat16)
    caches = RungCaches(model, [1, args.batch], args.max_length, [256, args.max_length])
    marks = VARIANTS[args.which]

    def forward(token: torch.Tensor, position: torch.Tensor, cache: Any) -> torch.Tensor:
        out = model(input_ids=token, cache_position=position, use_cache=True, past_key_values=cache)
        return out.logits[:, -1, :]

    full = [(layer.keys, layer.values) for layer in caches.base.layers]

    def cut_inside(token: torch.Tensor, position: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
        rows, length = token.shape[0], span.shape[0]
        torch._check(rows >= 1)
        torch._check(rows <= args.batch)
        torch._check(length <= args.max_length)
        cache = caches[args.batch, 256]
        for layer, (keys, values) in zip(cache.layers, full):
            layer.keys, layer.values = keys[:rows, :, :length], values[:rows, :, :length]
        return forward(token, position, cache)

    cut = args.which in CUT_INSIDE
    if marks and not cut:
        mark_rung_dims(caches.tensors(), **marks)
    dynamic = False if not marks else None
    compiled = torch.compile(cut_inside if cut else forward, backend="aot_eager", dynamic=dynamic)

    def call(batch: int, position: int) -> None:
        token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        if args.which == "unbacked":
            torch._dynamo.decorators.mark_unbacked(token, 0)
        elif "batch" in marks:
            mark_rung_dims([token], batch=0)
        where = torch.tensor([position], device=device)
        if cut:
            span = torch.empty(256, device=device)
            mark_rung_dims([span], batch=0)  # its one dimension: the length
            compiled(token, where, span)
        else:
            compiled(token, where, caches[batch, 256])

    start = time.perf_counter()
    call(args.batch, 5)
    first = time.perf_counter() - start
    start = time.perf_counter()
    call(args.batch, 6)
    second = time.perf_counter() - start
    rows = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    times = dict(zip(rows[0], rows[1])) if isinstance(rows, tuple) else {}
    traces_at_batch_1 = None
    if "batch" in marks:
        call(1, 5)
        traces_at_batch_1 = counters["stats"]["unique_graphs"]
    return {
        "first_call_s": first,
        "second_call_s": second,
        **{key: float(times.get(key, "nan")) for key in PHASES},
        "traces_with_batch_1": traces_at_batch_1,
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama-2048")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--_child", dest="which", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    if args.which:
        with torch.no_grad():
            print(json.dumps(child(args)))
        return
    runs = {}
    for which in VARIANTS:
        with tempfile.TemporaryDirectory() as cache:
            runs[which] = fresh_process(
                [__file__, "--model", args.model, "--batch", str(args.batch), "--max-length",
                 str(args.max_length), "--_child", which],
                cache, which,
            )  # fmt: skip
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lines = [
        f"{device}, {os.cpu_count()} CPU cores, torch {torch.__version__}; {args.model} (bf16), "
        f"batch {args.batch}, a decode step on the 256-position view of a cache of "
        f"{args.max_length}; backend aot_eager (no code generation); each variant a fresh process.",
        "",
        "| dynamic dimensions | "
        + " | ".join(PHASES.values())
        + " | traces with batch 1 too | graph breaks |",
        "|---|" + "---|" * (len(PHASES) + 2),
    ]
    for which, r in runs.items():
        traces = r.get("traces_with_batch_1")
        lines.append(
            f"| {which} | "
            + " | ".join(f"{r[k]:.1f}" for k in PHASES)
            + f" | {'-' if traces is None else traces} | {r.get('graph_breaks', 0)} |"
        )
    text = "\n".join([*lines, ""])
    print(text)
    args.json = args.json or RESULTS / f"decode-compile-cost-{args.model}.json"
    write({"device": device, "torch": torch.__version__, "runs": runs}, text, args, Console())


if __name__ == "__main__":
    main()

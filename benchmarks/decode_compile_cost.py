"""What marking the batch and the cache length dynamic costs ``torch.compile`` in tracing.

The Decoder's forward (one decode step of a Llama over a prefix view of the rung caches) is
compiled with the ``aot_eager`` backend, which runs Dynamo and AOTAutograd but no code
generation, so the figures are the tracing cost alone and the script runs on a CPU. Each
variant runs in a fresh process with an empty on-disk compile cache:

  static   every size a constant (one compile per (batch rung, length rung))
  length   the cache length a dynamic dimension
  batch    the batch a dynamic dimension
  both     both, marked on the cache views (the Decoder where its cache cannot be cut)

Two more, measured to decide (DESIGN.md):

  sliced   batch and length dynamic, and the step cuts each layer's keys and values out of
           the one full-size cache itself, to the batch and length of a tensor of the
           rung's shape whose sizes are marked with their bounds (``RungCaches.cut``, what
           ``Decoder(compile=True)`` does where it can): two symbols instead of two per
           cache tensor
  unbacked as ``sliced``, with the batch marked unbacked (no size-1 specialisation)

Every variant compiles under ``torch.no_grad()``, as the Decoder does (with grad mode on,
AOTAutograd would also trace for a backward, since the weights require grad).

Reported per variant: Dynamo's bytecode tracing, AOTAutograd, and the whole compile, from
``torch._dynamo.utils.compile_times()``; then, for the variants with a dynamic batch, the traces
after one more call at batch 1 (batch 1 as a class of its own: 2), and the graph breaks.

    python benchmarks/decode_compile_cost.py --model llama-2048 --markdown reports/x.md
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch
from common import RESULTS, fresh_process, parent_or_child, write
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

    from cudagraphs.decoding.compiled import mark_cut_sizes, mark_rung_dims
    from cudagraphs.decoding.kv_cache import RungCaches, cache_keyword
    from cudagraphs.tools.workloads import random_llama

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_llama(args.model, device, torch.bfloat16)
    caches = RungCaches(model, [1, args.batch], args.max_length, [256, args.max_length])
    marks = VARIANTS[args.which]
    keyword = cache_keyword(model)  # `cache` in newer transformers

    def forward(token: torch.Tensor, position: torch.Tensor, cache: Any) -> torch.Tensor:
        out = model(input_ids=token, cache_position=position, use_cache=True, **{keyword: cache})
        return out.logits[:, -1, :]

    def cut_inside(
        token: torch.Tensor, position: torch.Tensor, cache: Any, span: torch.Tensor
    ) -> torch.Tensor:
        rows = span.shape[0]
        if args.which == "unbacked":
            # The token's batch, one unknown size for the whole step; with no range of its
            # own, the cut's slices need its bounds to simplify.
            rows = token.shape[0]
            torch._check(rows >= 1)
            torch._check(rows <= args.batch)
        caches.cut(cache, rows, span.shape[1])  # as Decoder(compile=True) does
        return forward(token, position, cache)

    cut = args.which in CUT_INSIDE
    if cut:
        caches.write_through()
    elif marks:
        mark_rung_dims(caches.tensors(), **marks)
    dynamic = False if not marks else None
    compiled = torch.compile(cut_inside if cut else forward, backend="aot_eager", dynamic=dynamic)

    def call(batch: int, position: int) -> None:
        token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        where = torch.tensor([position], device=device)
        if cut:
            span = caches.span(caches[batch, 256])
            if args.which == "unbacked":
                torch._dynamo.decorators.mark_unbacked(token, 0)
                torch._dynamo.decorators.mark_unbacked(span, 0)
                mark_rung_dims([span], length=1)
            else:
                mark_cut_sizes(span, caches)  # as Decoder(compile=True) does
                mark_rung_dims([token], batch=0)
            compiled(token, where, caches[batch, 256], span)
        else:
            if "batch" in marks:
                mark_rung_dims([token], batch=0)
            compiled(token, where, caches[batch, 256])

    # Under no_grad, as the Decoder compiles and captures: with grad mode on, AOTAutograd would
    # trace the forward for a backward too (the weights require grad), a different compile.
    torch.set_grad_enabled(False)
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
    p.add_argument("--repeats", type=int, default=1, help="fresh processes per variant (median)")
    args = parent_or_child(p, child)
    if args is None:
        return
    repeats: dict[str, list[dict[str, Any]]] = {which: [] for which in VARIANTS}
    for _ in range(args.repeats):  # interleaved: a drift in the machine's speed hits every variant
        for which in VARIANTS:
            argv = [__file__, "--model", args.model, "--batch", str(args.batch),
                    "--max-length", str(args.max_length), "--_child", which]  # fmt: skip
            with tempfile.TemporaryDirectory() as cache:
                repeats[which].append(fresh_process(argv, cache, which))
    runs = {which: _median_run(rs) for which, rs in repeats.items()}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lines = [
        f"{device}, {os.cpu_count()} CPU cores, torch {torch.__version__}; {args.model} (bf16), "
        f"batch {args.batch}, a decode step on the 256-position view of a cache of "
        f"{args.max_length}; backend aot_eager (no code generation); each variant a fresh "
        f"process, median of {args.repeats} (interleaved).",
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
    result = {"device": device, "torch": torch.__version__, "runs": runs, "repeats": repeats}
    write(result, text, args, Console())


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose whole compile is the median of ``runs`` (its phases stay one run's)."""
    ordered = sorted(runs, key=lambda r: r["_compile.compile_inner"])
    return ordered[(len(ordered) - 1) // 2]


if __name__ == "__main__":
    main()

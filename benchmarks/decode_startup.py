"""Start-up and graph memory of ``Decoder(compile=True)`` against one reduce-overhead compile.

Each measurement runs in a fresh process of its own:
  reduce-overhead cold  the reduce-overhead loop of ``decode.py`` at ``--batch`` (one batch size,
                        as a user compiles it), with an empty on-disk compile cache: the time
                        from building the loop to the end of its first request
  cudagraphs cold       ``Decoder(compile=True, max_batch=--batch)`` with its default batch rungs
                        (under compile, powers of two from 2 up to --batch: one compile serves
                        every rung) and cache-length rungs (powers of two from 256 up to
                        --max-length), an empty on-disk compile cache: construction (compile,
                        every capture) plus the first request
  cudagraphs warm       the same again in a second process, on the cache the cold one left
                        (it loads the compiled steps the cold one saved)
  unsaved               (--rows unsaved) cold again with ``save_compile=False``: plain
                        ``torch.compile``, what the saving costs a cold start
  largest rung alone    ``batch_sizes=[--batch]``, ``cache_lengths=[]``: the graph memory of the
                        largest (batch, length) rung's graph by itself; run last, and left
                        out with --without-largest
  with a batch-1 rung   cold again, with ``batch_sizes`` the powers of two from 1 up to --batch:
                        Dynamo specialises a size of 1, so batch 1 is a second compile; then
                        the same in a second process, on the cache that one left

Set-up times include whatever Python compiles to bytecode in each process. Where the
environment keeps no bytecode cache (``PYTHONDONTWRITEBYTECODE=1`` over a read-only
site-packages, as on the measurement machine), fill one first so every row starts as in an
installed environment: ``unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=DIR;
python -m compileall -q -j 16 <site-packages>/torch <site-packages>/transformers ...``.

Graph memory is the growth of ``torch.cuda.memory_reserved()`` over the captures, as
``DecodeStats.graph_bytes`` reports it; the KV cache is allocated once, before them.

    python benchmarks/decode_startup.py --model llama-2048 --batch 16 --max-length 4096
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


def child(args: argparse.Namespace) -> dict[str, Any]:
    from cudagraphs.tools.workloads import random_llama

    model = random_llama(args.model, "cuda", getattr(torch, args.dtype))
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    if args.which == "reduce-overhead":
        from decode import Loop, TokenClock

        loop = Loop(model, args.batch, args.max_length, "reduce-overhead", TokenClock())
        loop(prompt, args.new)
        torch.cuda.synchronize()
        return {"setup_s": time.perf_counter() - start}
    from cudagraphs import powers_of_two
    from cudagraphs.decoding.decoder import Decoder

    alone = args.which == "largest"
    save = args.which != "unsaved"
    batch_sizes = [args.batch] if alone else None
    if args.which == "batch-one":
        batch_sizes = powers_of_two(args.batch)
    decoder = Decoder(
        model,
        max_batch=args.batch,
        max_length=args.max_length,
        compile=True,
        batch_sizes=batch_sizes,
        cache_lengths=[] if alone else None,
        save_compile=save,
    )
    decoder.generate(prompt, max_new_tokens=args.new, eos_token_id=None)
    torch.cuda.synchronize()
    stats = decoder.stats
    return {
        "setup_s": time.perf_counter() - start,
        "construction_s": stats.setup_s,
        "compile_s": stats.compile_s,
        "capture_s": sum(stats.capture_s.values()),
        "graphs": len(decoder.graphs),
        "batch_rungs": decoder.rungs,
        "length_rungs": decoder.lengths,
        "graph_bytes": stats.graph_bytes,
        "cache_bytes": stats.cache_bytes,
        "compiles_loaded": stats.compiles_loaded,
        "compiles_saved": stats.compiles_saved,
        "compile_not_saved": stats.compile_not_saved,
        "compile_save_s": stats.compile_save_s,
    }


def run(args: argparse.Namespace, which: str, cache_dir: str) -> dict[str, Any]:
    # Each row is printed as it ends, so a run cut off by a time limit keeps what it measured.
    row = fresh_process(
        [__file__, "--model", args.model, "--dtype", args.dtype, "--batch", str(args.batch),
         "--max-length", str(args.max_length), "--prompt", str(args.prompt), "--new",
         str(args.new), "--_child", which],
        cache_dir, which,
    )  # fmt: skip
    print(json.dumps({which: row}), flush=True)
    return row


def markdown(results: dict[str, Any]) -> list[str]:
    rows, mib = results["runs"], 1 << 20
    ro = rows["reduce-overhead cold"]
    cold, alone = rows.get("cudagraphs cold"), rows.get("largest")
    lines = [
        f"Hardware: {results['hardware']}, torch {results['torch']}; {results['model']} "
        f"({results['dtype']}), batch {results['batch']}, cache length {results['max_length']}, "
        f"a request of {results['prompt']} + {results['new']} tokens; each row a fresh process.",
        "",
        "| run | set-up + first request s | compile s | captures s | graphs | graph memory MiB "
        "| compiled steps loaded / saved |",
        "|---|---|---|---|---|---|---|",
        f"| reduce-overhead loop, cold | {ro['setup_s']:.1f} | - | - | - | - | - |",
    ]
    labelled, notes = [], []
    if cold:
        labelled.append((f"cudagraphs, cold, batch rungs {cold['batch_rungs']}", cold))
    if warm := rows.get("cudagraphs warm"):
        labelled.append(("the same, warm (second process)", warm))
    if unsaved := rows.get("unsaved"):
        labelled.append(("the same cold, save_compile=False", unsaved))
    if alone:
        labelled.append(("cudagraphs, largest rung alone", alone))
    batch_one = rows.get("batch one")
    if batch_one:
        labelled.append((f"cudagraphs, cold, batch rungs {batch_one['batch_rungs']}", batch_one))
    if batch_one_warm := rows.get("batch one warm"):
        labelled.append(("the same, warm (second process)", batch_one_warm))
    for label, r in labelled:
        lines.append(
            f"| {label} | {r['setup_s']:.1f} | {r['compile_s']:.1f} | {r['capture_s']:.1f} | "
            f"{r['graphs']} | {r['graph_bytes'] / mib:.0f} | "
            f"{r.get('compiles_loaded', '-')} / {r.get('compiles_saved', '-')} |"
        )
        if r.get("compile_not_saved"):
            notes.append(f"{label}: a compiled step was not saved: {r['compile_not_saved']}")
    lines.extend(["", *notes, ""] if notes else [""])
    for r in (cold, unsaved, batch_one):
        if r is None:
            continue
        memory = (
            f" Graph memory of all rungs against the largest alone: "
            f"{r['graph_bytes'] / alone['graph_bytes']:.2f}x."
            if alone and r is cold
            else ""
        )
        lines.append(
            f"Batch rungs {r['batch_rungs']}, cache-length rungs {r['length_rungs']}: cold "
            f"set-up against one reduce-overhead compile {r['setup_s'] / ro['setup_s']:.2f}x; "
            f"the KV cache ({r['cache_bytes'] / mib:.0f} MiB) is allocated once, before the "
            f"captures.{memory}"
        )
    lines.append("")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama-2048")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument(
        "--without-largest",
        action="store_true",
        help="leave out the largest rung alone (only its graph memory is read from it)",
    )
    p.add_argument(
        "--rows",
        default="cudagraphs,batch-one,largest",
        help="which Decoder rows besides the reduce-overhead one: cudagraphs (default rungs, "
        "cold and warm), unsaved (cold, save_compile=False), batch-one (batch rungs from 1, "
        "cold and warm), largest",
    )
    args = parent_or_child(p, child)
    if args is None:
        return
    head = {"hardware": torch.cuda.get_device_name(), "torch": torch.__version__,
            **{k: getattr(args, k) for k in ("model", "dtype", "batch", "max_length", "prompt",
                                             "new")}}  # fmt: skip
    runs = {}
    with tempfile.TemporaryDirectory() as ro_cache, tempfile.TemporaryDirectory() as cg_cache:
        wanted = {row.strip() for row in args.rows.split(",")}
        runs["reduce-overhead cold"] = run(args, "reduce-overhead", ro_cache)
        if "unsaved" in wanted:  # the same cold start with save_compile=False
            with tempfile.TemporaryDirectory() as unsaved_cache:
                runs["unsaved"] = run(args, "unsaved", unsaved_cache)
        if "cudagraphs" in wanted:
            runs["cudagraphs cold"] = run(args, "cudagraphs", cg_cache)
            runs["cudagraphs warm"] = run(args, "cudagraphs", cg_cache)
        if "batch-one" in wanted:
            with tempfile.TemporaryDirectory() as batch_one_cache:
                runs["batch one"] = run(args, "batch-one", batch_one_cache)
                runs["batch one warm"] = run(args, "batch-one", batch_one_cache)
        # last: a run stopped at a time limit loses it first
        if "largest" in wanted and not args.without_largest:
            runs["largest"] = run(args, "largest", cg_cache)
    results = {**head, "runs": runs}
    text = "\n".join(markdown(results))
    print(text, flush=True)
    args.json = args.json or RESULTS / f"decode-startup-{args.model}.json"
    write(results, text + "\n", args, Console())


if __name__ == "__main__":
    main()

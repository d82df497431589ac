"""LLM decoding, side by side: what users would pick against cudagraphs' Decoder.

Modes, each greedy, ``--new`` tokens after a ``--prompt``-token prompt, random weights:
  hf eager              model.generate (dynamic cache)
  hf static             model.generate(cache_implementation="static") (transformers compiles it)
  eager loop            a decode loop over a StaticCache, one forward per token
  reduce-overhead loop  the same loop through torch.compile(mode="reduce-overhead"), written as
                        a user would: a static cache, an eager prefill, then per token the
                        compiled forward on a clone of one position tensor advanced in place
  cg                    cudagraphs.decoding.decoder.Decoder (graphs of eager kernels)
  cg K=16               the same, 16 decode steps per graph launch
  cg compile            Decoder(compile=True): graphs over torch.compile'd kernels
  cg compile K=4/K=16   the same, 4 or 16 steps per launch
  cg compile unsaved    Decoder(compile=True, save_compile=False): plain torch.compile, nothing
                        written to or read from disk
  cg compile expanded   Decoder(compile=True, grouped_attention=False): the model's own SDPA
                        attention, which copies each key/value head over its query heads
  cg compile unfused    Decoder(compile=True, fuse=False): q, k, v and gate, up as the model
                        holds them, each its own product and nothing copied into a new buffer
  cg compile autotune   Decoder(compile="max-autotune-no-cudagraphs"): kernels chosen by timing
                        candidates while compiling (fewer, fused kernels per token)
  cg compile coordinate-descent
                        Decoder(compile={"coordinate_descent_tuning": True}): Inductor's
                        option that turns a batch-1 projection into a reduction it tunes
                        (instead of cuBLAS's matrix-vector kernel)
  cg compile from 2     Decoder(compile=True) whose batch rungs start at 2 (batch_sizes=[2, 4]
                        at batch 1): a single request runs on the batch-2 graph with one
                        padding row, in the one compile every rung from 2 shares, instead of
                        a batch-1 compile of its own (Dynamo specialises a size of 1); other
                        batches as cg compile. "cg from 2" likewise over eager kernels
  cg until-eos          Decoder(until_eos=True): one launch per request, a loop on the device
  cg compile until-eos  the same over torch.compile'd kernels
  cg eos-check          per-step graphs that stop at end-of-sequence as a plain loop would: a
                        look at the device after every token (an id the model never emits, so
                        every request runs to --new tokens); "cg compile eos-check" likewise

Each mode runs in a fresh process of its own, all batches in it (``--no-isolate``: all modes in
one process, interleaved; there transformers' compiled ``generate`` and the reduce-overhead loop
slow each other down). Compiled modes specialise on each batch size (``dynamic=False``), as
transformers' static-cache ``generate`` does. For each:
tokens/s (median of --reps runs); ms per token p50 and p99 in steady state, over every token of
one more run with marks on the GPU's timeline after each launch (prefill and first launch
excluded; "one launch" where a request is one launch); ms per token of the median and the worst
run; the host's own ms per token (until the call returned, before waiting for the GPU: far
below the total, the GPU sets the pace);
set-up seconds (compile, capture, first call), growth of torch.cuda.memory_reserved() beyond
the weights (and in brackets of memory_allocated(): live tensors, without the blocks the
caching allocator keeps after their tensors are freed; the JSON also keeps the growth by the
end of construction, ``build_growth_mib``, and a Decoder's count of its graphs' memory,
``graph_mib``), share of the weight-streaming roofline
(every step reads every weight once), and agreement of the tokens with ``hf eager``.
``--rung-memory`` instead measures, in fresh processes, the graph memory of all batch rungs
against the largest alone, and runs a request mix of every batch size 1..max with no
recapture.

    python benchmarks/decode.py --model llama-512 --batches 1,4,16,64 [--dtype bfloat16]
    python benchmarks/decode.py --model llama-2048 --batches 1,16 --max-length 4096
    python benchmarks/decode.py --model llama-512 --rung-memory
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from common import RESULTS, memory_bandwidth, weight_bytes
from decode_modes import (
    ALL_MODES,
    CUDA,
    DEVICE,
    TokenClock,
    allocated,
    make_mode,
    percentile,
    reserved,
    timed,
)
from decode_tables import markdown, plot, rung_markdown


def cache_length(args: argparse.Namespace) -> int:
    """The static cache's length: ``--max-length`` (what users configure, e.g. 4096), or just
    what the requests need (prompt plus new tokens)."""
    need = args.prompt + args.new
    if args.max_length is None:
        return need
    if args.max_length < need:
        raise SystemExit(
            f"--max-length {args.max_length} is shorter than --prompt + --new ({need}): the "
            "cache must hold every token of a request"
        )
    return args.max_length


def run_batch(model: Any, modes: list[str], batch: int, args: argparse.Namespace) -> dict[str, Any]:
    length = cache_length(args)
    torch.manual_seed(batch)
    prompt = torch.randint(0, model.config.vocab_size, (batch, args.prompt), device=DEVICE)
    calls, rows = {}, {}
    for name in modes:  # set-up one mode at a time: its memory growth is its own
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        before, live_before = reserved(), allocated()
        start = time.perf_counter()
        clock = TokenClock()
        call = make_mode(name, model, batch, length, clock, args.max_length is not None)
        built = time.perf_counter() - start  # the Decoder's captures; transformers compiles later
        built_growth = reserved() - before  # the rest of the growth comes with the first call
        tokens, _, _ = timed(lambda call=call: call(prompt, args.new))
        setup = time.perf_counter() - start  # construction plus the first call
        calls[name] = (call, clock)
        rows[name] = {
            "setup_s": setup,
            "build_s": built,
            "memory_growth_mib": (reserved() - before) / 2**20,
            "live_growth_mib": (allocated() - live_before) / 2**20,
            "build_growth_mib": built_growth / 2**20,
            "tokens": tokens[:, args.prompt :],
            "seconds": [],
            "host_seconds": [],
        }
        print(f"  batch {batch:3d} {name:22s} set-up {setup:7.1f} s", flush=True)
    for _ in range(args.reps):  # interleaved: every mode once per round
        for name, (call, _) in calls.items():
            _, seconds, host = timed(lambda call=call: call(prompt, args.new))
            rows[name]["seconds"].append(seconds)
            rows[name]["host_seconds"].append(host)
    for name, (call, clock) in calls.items():  # one more run with marks, apart from the timing
        clock.on = True
        timed(lambda call=call: call(prompt, args.new))
        clock.on = False
        rows[name]["per_token_ms"] = clock.per_token_ms()
    reference = rows[modes[0]]["tokens"]
    roofline = batch * memory_bandwidth() / weight_bytes(model)
    out = {}
    for name, row in rows.items():
        median = statistics.median(row["seconds"])
        tokens_per_s = batch * args.new / median
        out[name] = {
            "tokens_per_s": tokens_per_s,
            "ms_per_token_median": 1e3 * median / args.new,
            "ms_per_token_worst": 1e3 * max(row["seconds"]) / args.new,
            "host_ms_per_token": 1e3 * statistics.median(row["host_seconds"]) / args.new,
            "token_ms_p50": percentile(row["per_token_ms"], 50),
            "token_ms_p99": percentile(row["per_token_ms"], 99),
            "setup_s": row["setup_s"],
            "build_s": row["build_s"],
            "memory_growth_mib": row["memory_growth_mib"],
            "live_growth_mib": row["live_growth_mib"],
            "build_growth_mib": row["build_growth_mib"],
            "graph_mib": _graph_mib(calls[name][0]),
            "roofline_share": tokens_per_s / roofline,
            "token_agreement": float((row["tokens"] == reference).float().mean()),
            "tokens_equal": bool(torch.equal(row["tokens"], reference)),
            "token_ids": row["tokens"].tolist() if args.isolate_child else None,
            "replays": _replays(calls[name][0]),
        }
    del calls
    torch.compiler.reset()
    return out


def _graph_mib(call: Any) -> float | None:
    """The Decoder's own count of its graphs' memory (``stats.graph_bytes``), where the mode
    is a Decoder: the part of the memory growth that its captures reserved."""
    decoder = getattr(call, "decoder", None)
    return None if decoder is None else decoder.stats.graph_bytes / 2**20


def _replays(call: Any) -> dict[str, int] | None:
    """The Decoder's launches per graph (``"greedy batch 2"``: 40), or None for other modes."""
    decoder = getattr(call, "decoder", None)
    return dict(decoder.stats.replays) if decoder is not None else None


def run_isolated(modes: list[str], batches: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Each mode in a fresh process of its own, all batches in it (set-up and timed runs), one
    mode after another. Modes that use torch.compile's CUDA graphs (hf static, reduce-overhead)
    slow each other down when they share a process, so for a fair comparison none shares one.
    Returns ``{batch: {mode: row}}``."""
    import tempfile

    out: dict[str, dict[str, Any]] = {str(b): {} for b in batches}
    for name in modes:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "mode.json"
            cmd = [sys.executable, __file__, "--model", args.model, "--dtype", args.dtype,
                   "--batches", ",".join(map(str, batches)), "--modes", name,
                   "--prompt", str(args.prompt), "--new", str(args.new), "--reps", str(args.reps),
                   "--json", str(path), "--_isolate-child"]  # fmt: skip
            if args.max_length is not None:
                cmd += ["--max-length", str(args.max_length)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            done = json.loads(path.read_text())["batches"]
        for batch in out:
            out[batch][name] = done[batch][name]
    for rows in out.values():
        reference = torch.tensor(rows[modes[0]]["token_ids"])
        for row in rows.values():
            tokens = torch.tensor(row.pop("token_ids"))
            row["token_agreement"] = float((tokens == reference).float().mean())
            row["tokens_equal"] = bool(torch.equal(tokens, reference))
    return out


def rung_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Fresh processes: graph memory of all rungs vs the largest alone; a 1..max request mix."""
    results = {}
    for label, only_largest in (("all rungs", False), ("largest alone", True)):
        cmd = [sys.executable, __file__, "--model", args.model, "--dtype", args.dtype,
               "--max-batch", str(args.max_batch), "--_rung-child", str(int(only_largest))]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    results["ratio"] = results["all rungs"]["graph_bytes"] / results["largest alone"]["graph_bytes"]
    return results


def rung_child(args: argparse.Namespace, only_largest: bool) -> None:
    from cudagraphs.decoding.decoder import Decoder
    from cudagraphs.tools.workloads import random_llama

    model = random_llama(args.model, "cuda", getattr(torch, args.dtype))
    sizes = [args.max_batch] if only_largest else None
    decoder = Decoder(model, max_batch=args.max_batch, max_length=64, batch_sizes=sizes)
    graphs = len(decoder.graphs)
    mix = {}
    if not only_largest:
        for batch in range(1, args.max_batch + 1):
            prompt = torch.randint(0, model.config.vocab_size, (batch, 8), device="cuda")
            decoder.generate(prompt, max_new_tokens=8, eos_token_id=None)
        mix = {"requests": args.max_batch, "graphs_after": len(decoder.graphs)}
    print(json.dumps({
        "graph_bytes": decoder.stats.graph_bytes, "graphs": graphs, "setup_s": decoder.stats.setup_s,
        "capture_s": decoder.stats.capture_s,  # per rung: warm-up, capture, instantiation
        # of which the eager warm-up runs and the recording itself, per rung
        "graph_warmup_s": {str(k): g.stats.warmup_s for k, g in decoder.graphs.items()},
        "graph_record_s": {str(k): g.stats.capture_s for k, g in decoder.graphs.items()},
        "recaptures": sum(g.stats.recaptures for g in decoder.graphs.values()), **mix,
    }))  # fmt: skip


def parameter_count(name: str) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    from cudagraphs.tools.workloads import LLAMA_SHAPES

    with torch.device("meta"):  # shapes only: nothing allocated
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPES[name]))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama-512", help="llama-tiny, llama-512 or llama-2048")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument(
        "--modes", default=",".join(ALL_MODES), help="comma-separated, first is the reference"
    )
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="the static cache's length, as users configure it (default: --prompt + --new)",
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--append", action="store_true", help="add to the batches already in --json")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each mode in a fresh process (default; --no-isolate: all in this one, interleaved, "
        "where the compiled baselines slow each other down)",
    )
    p.add_argument(
        "--_isolate-child", dest="isolate_child", action="store_true", help=argparse.SUPPRESS
    )
    p.add_argument("--rung-memory", action="store_true")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--_rung-child", dest="rung_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    args.isolate = args.isolate and not args.isolate_child
    if args.rung_child is not None:
        return rung_child(args, bool(int(args.rung_child)))
    import transformers

    from cudagraphs.tools.workloads import random_llama

    head = {"hardware": torch.cuda.get_device_name() if CUDA else "CPU", "torch": torch.__version__,
            "transformers": transformers.__version__, "model": args.model, "dtype": args.dtype,
            "memory_bandwidth": memory_bandwidth()}  # fmt: skip
    if args.rung_memory:
        results = {**head, "max_batch": args.max_batch, **rung_memory(args)}
        print(json.dumps(results, indent=1))
    else:
        model = (
            None if args.isolate else random_llama(args.model, DEVICE, getattr(torch, args.dtype))
        )
        modes = [m.strip() for m in args.modes.split(",")]
        results = {**head, "parameters": parameter_count(args.model), "prompt": args.prompt,
                   "new": args.new, "max_length": cache_length(args), "reps": args.reps,
                   "batches": {}}  # fmt: skip
        path = args.json or RESULTS / f"decode-{args.model}.json"
        if args.append and path.exists():  # more batches (or modes) into an earlier run's file
            results["batches"] = json.loads(path.read_text())["batches"]
        batches = [int(b) for b in args.batches.split(",")]
        with torch.no_grad():
            if args.isolate:
                results["batches"].update(run_isolated(modes, batches, args))
                print("\n".join(markdown(results)), flush=True)
                save(results, path, args)
                return
            for batch in batches:
                results["batches"][str(batch)] = run_batch(model, modes, batch, args)
                one = {**results, "batches": {str(batch): results["batches"][str(batch)]}}
                print("\n".join(markdown(one)), flush=True)
                save(results, path, args)  # after every batch: a cut-off run keeps what it did
        return
    path = args.json or RESULTS / f"decode-{args.model}-rungs.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text("\n".join(rung_markdown(results)) + "\n")


def save(results: dict[str, Any], path: Path, args: argparse.Namespace) -> None:
    path.write_text(json.dumps(results, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text("\n".join(markdown(results)) + "\n")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()

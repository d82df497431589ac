"""Where an LLM engine's time goes, one part at a time, beside the Decoder in one process on
one GPU: what ``benchmarks/serve_llm.py`` gives as a whole.

The model is the 1.1 B TinyLlama shape in bfloat16 with random weights (``llama-2048``, no
download). Three parts, each after one untimed run of the same work:

- **the decode step at mixed positions**: ``--batch`` requests of 16-512 prompt tokens, each
  asking for ``--new`` tokens, all prefilled first, then every row decoding at its own
  length. Reported: the engine's inter-token latency p50 over the tokens after the last
  first token (every row decoding), beside...
- **the unpadded step of the same batch**: ``Decoder(model, max_batch=--batch)`` generating
  ``--new`` tokens for ``--batch`` prompts of 16 tokens (one length: no padding), its time per
  token. Both run the model's kernels as recorded (no ``torch.compile``) with the grouped
  one-token attention, so the ratio is the cost of rows at their own positions.
- **one prompt alone**: a 16- and a 256-token prompt, one new token, one request at a time:
  the time per request (a chunk's fixed cost and its cost per token);
- **the prompts**: the same ``--batch`` prompts with ``max_new_tokens=1``, at each
  ``--prefill-chunks`` budget of prompt tokens per step boundary: prompt tokens per second.

    python benchmarks/engine_parts.py [--batch 64] [--new 128] [--prefill-chunks 256,1024]
                                      [--compile]

``--compile``: the mixed step again with ``Engine(compile=True)`` (its compile in the set-up),
and its prompts alone. ``--parts``: which of ``decoder,mixed,alone,prompts`` run (default all).
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from common import cuda_or_explain, environment, names, parser, table, write_rows

MAX_LENGTH = 768  # the longest prompt (512) and up to 256 new tokens
PARTS = ["decoder", "mixed", "alone", "prompts"]


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 32000) for _ in range(rng.randint(16, 512))] for _ in range(count)]


def engine_run(engine: Any, asked: list[list[int]], new: int) -> tuple[float, list[Any]]:
    start = time.perf_counter()
    completions = [engine.submit(p, max_new_tokens=new, eos_token_id=None) for p in asked]
    for completion in completions:
        completion.result(timeout=3600)
    return time.perf_counter() - start, completions


def step_ms_all_decoding(completions: list[Any]) -> float:
    """Inter-token p50 over the tokens after the last request's first token (every row is
    decoding then; the engine's reads give several rows' tokens the same arrival time)."""
    everyone = max(c.token_times[0] for c in completions)
    gaps = [
        b - a
        for c in completions
        for a, b in zip(c.token_times, c.token_times[1:])
        if a >= everyone and b > a
    ]
    return statistics.median(gaps) * 1e3


def main() -> None:
    p = parser(__doc__, "engine_parts", calls=1, windows=1)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--prefill-chunks", default="256,1024")
    p.add_argument("--compile", action="store_true", help="also the mixed step under compile=True")
    p.add_argument("--parts", default=",".join(PARTS), help="which of the parts to run")
    args = p.parse_args()
    parts = names(p, "--parts", args.parts, PARTS)
    console = Console()
    if not cuda_or_explain("engine_parts.py", console):
        return
    from cudagraphs.decoding import Decoder, Engine, fuse_projections
    from cudagraphs.tools.workloads import random_llama

    model = random_llama("llama-2048", "cuda", torch.bfloat16, init=0.02)
    model.set_attn_implementation("sdpa")
    results: dict[str, Any] = {**environment(1, 1), "model": "llama-2048 bf16", "batch": args.batch}
    rows: list[list[str]] = []

    # The Decoder first: it fuses the model's projections in place (the same for the engine).
    unpadded = None
    if "decoder" in parts:
        decoder = Decoder(model, max_batch=args.batch, max_length=MAX_LENGTH)
        ids = torch.randint(1, 32000, (args.batch, 16), device="cuda")
        for _ in range(2):  # the first records the rungs
            torch.cuda.synchronize()
            start = time.perf_counter()
            decoder.generate(ids, max_new_tokens=args.new, eos_token_id=None)
            torch.cuda.synchronize()
            unpadded = (time.perf_counter() - start) / args.new * 1e3
        results["decoder_unpadded_ms_per_step"] = unpadded
        rows.append([
            f"Decoder, batch {args.batch}, every row at one length",
            f"{unpadded:.2f} ms per step", "",
        ])  # fmt: skip
    else:  # the engine runs on the projections the Decoder would have fused
        fuse_projections(model, matvec=True)

    asked = prompts(args.batch, seed=1)

    def mixed_step(compiled: bool) -> None:
        start = time.perf_counter()
        engine = Engine(model, max_batch=args.batch, max_length=MAX_LENGTH, max_queue=4096,
                        compile=compiled)  # fmt: skip
        engine_run(engine, prompts(args.batch, seed=2), args.new)  # untimed: records the rungs
        setup = time.perf_counter() - start
        seconds, completions = engine_run(engine, asked, args.new)
        mixed = step_ms_all_decoding(completions)
        name = "compiled" if compiled else "mixed"
        results[f"engine_{name}_ms_per_step"] = mixed
        results[f"engine_{name}_tokens_per_s"] = args.batch * args.new / seconds
        results[f"engine_{name}_setup_s"] = setup
        rows.append([
            f"Engine{' compile=True' if compiled else ''}, batch {args.batch}, rows at 16-512 "
            "+ their tokens", f"{mixed:.2f} ms per step",
            (f"{mixed / unpadded:.2f}x the unpadded step; " if unpadded else "")
            + f"{args.batch * args.new / seconds:.0f} tokens/s over the run; set-up and first "
            f"run {setup:.0f} s",
        ])  # fmt: skip
        if compiled:  # its prompts alone too (1024 tokens per boundary, the default)
            tokens = sum(len(q) for q in asked)
            seconds, _ = engine_run(engine, asked, 1)
            results["prefill_compiled_tokens_per_s"] = tokens / seconds
            rows.append([
                "Engine compile=True prompts only, 1024 tokens per boundary",
                f"{tokens / seconds:.0f} prompt tokens/s",
                f"{tokens} tokens in {seconds:.2f} s; {engine.stats.eager_prefill_chunks} chunks eager",
            ])  # fmt: skip
        engine.close()

    if "mixed" in parts:
        mixed_step(False)

    # One request at a time, one new token: a prompt chunk's cost with nothing beside it,
    # at the shortest and the longest chunk rung (the difference is per token, the rest fixed:
    # the host's work per chunk and the first token's read).
    engine = Engine(model, max_batch=args.batch, max_length=MAX_LENGTH, max_queue=4096)
    for size in (16, 256) if "alone" in parts else ():
        alone = prompts(20, seed=4)
        alone = [q[:size] + [1] * (size - len(q)) for q in alone]
        engine_run(engine, alone[:2], 1)
        start = time.perf_counter()
        for q in alone:
            engine.submit(q, max_new_tokens=1, eos_token_id=None).result(timeout=600)
        each = (time.perf_counter() - start) / len(alone) * 1e3
        results[f"one_prompt_{size}_ms"] = each
        rows.append([f"Engine, one {size}-token prompt alone, 1 new token", f"{each:.2f} ms per request", ""])  # fmt: skip
    engine.close()

    tokens = sum(len(q) for q in asked)
    for chunk in [int(c) for c in args.prefill_chunks.split(",")] if "prompts" in parts else []:
        engine = Engine(model, max_batch=args.batch, max_length=MAX_LENGTH, max_queue=4096,
                        prefill_chunk=chunk)  # fmt: skip
        engine_run(engine, prompts(args.batch, seed=3), 1)
        seconds, _ = engine_run(engine, asked, 1)
        results[f"prefill_{chunk}_tokens_per_s"] = tokens / seconds
        rows.append([
            f"Engine prompts only, {chunk} tokens per boundary", f"{tokens / seconds:.0f} prompt tokens/s",
            f"{tokens} tokens in {seconds:.2f} s; {engine.stats.eager_prefill_chunks} chunks eager",
        ])  # fmt: skip
        engine.close()

    if args.compile:  # last: what was measured above stands if this fails
        mixed_step(True)

    shown, lines = table(f"Engine parts on {results['hardware']}", ["part", "figure", "note"], rows)
    console.print(shown)
    write_rows(
        results, lines, f"{results['model']}; {args.new} new tokens per request", args, console
    )


if __name__ == "__main__":
    main()

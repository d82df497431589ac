"""LLM serving under load: the engine's continuous batching against transformers' and against
the Decoder one request at a time, side by side in one process on one GPU.

The model is the 1.1 B TinyLlama shape in bfloat16 with random weights (``llama-2048``, no
download). A workload is ``--requests`` prompts of 16 to 512 random ids, each asking for 32 to
256 new tokens (greedy, no end-of-sequence id: every request decodes its full length), arriving
all at once or as a Poisson stream at each of ``--rates`` requests per second (one seeded
schedule per workload, the same for every path; each path first runs one untimed
workload, as transformers' ``warmup()`` does). Paths, each written as its documentation sets
it up:

- ``engine``: ``cudagraphs.decoding.Engine(model, max_batch=--slots, max_length=768)`` (it
  fuses q/k/v and gate/up into one product each, in place, as the Decoder does); each
  request is ``engine.submit(...)`` at its arrival time, its tokens timed as they stream;
  ``engine-read4``: the same with ``read_every=4`` (four steps per read of the tokens);
  ``engine-compiled``: the same with ``compile=True`` (each decode step recorded over
  ``torch.compile``'d kernels; its compile is part of the setup, outside the timing);
  ``engine-rungs``: the same with ``cache_lengths=[256, 384, 512, 640]`` (and 768), where
  the default is 256 and 768: a step attends to the rung above its longest row, so this
  tells how much of a mixed batch's step is attention over positions no row reached;
- ``transformers``: on an unfused copy of the model, as loaded,
  ``model.init_continuous_batching(generation_config)`` (paged attention,
  ``attn_implementation="paged|sdpa"``), ``manager.warmup()`` (its graphs, outside the timing),
  ``manager.start()``, ``manager.add_request(...,
  streaming=True, record_timestamps=True)`` at each arrival, results read from the manager;
- ``decoder``: ``Decoder(model, max_batch=1, max_length=768)``, one ``generate`` per request
  in arrival order (a request waits for the ones before it); workloads of up to
  ``--decoder-requests`` (64) requests.

Reported per path and workload: generated tokens per second (all tokens over the time from the
first arrival to the last token), time to first token and inter-token latency at p50 and p99
(the decoder streams nothing: its first token is its whole answer).

    python benchmarks/serve_llm.py [--requests 64,256] [--rates inf,8,32] [--paths ...]
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from common import cuda_or_explain, environment, names, parser, table, write_rows

PATHS = ["engine", "engine-compiled", "engine-read4", "engine-rungs", "transformers", "decoder"]
#: The engine paths: Engine's settings beyond the slots, the length and the queue.
ENGINES: dict[str, dict[str, Any]] = {
    "engine": {},
    "engine-compiled": {"compile": True},
    "engine-read4": {"read_every": 4},
    "engine-rungs": {"cache_lengths": [256, 384, 512, 640]},
}
MAX_LENGTH = 768  # the longest prompt (512) and output (256)


def workload(requests: int, rate: float, seed: int) -> list[tuple[float, list[int], int]]:
    """``(arrival seconds, prompt ids, new tokens)`` per request; ``rate`` inf: all at 0."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for _ in range(requests):
        if math.isfinite(rate):
            at += rng.expovariate(rate)
        prompt = [rng.randrange(1, 32000) for _ in range(rng.randint(16, 512))]
        out.append((at if math.isfinite(rate) else 0.0, prompt, rng.randint(32, 256)))
    return out


def summary(
    start: float, arrivals: list[float], times: list[list[float]], tokens: int
) -> dict[str, float]:
    """Tokens/s and latency percentiles from each request's token arrival times."""
    ttft = sorted(t[0] - (start + a) for t, a in zip(times, arrivals) if t)
    itl = sorted(b - a for t in times for a, b in itertools.pairwise(t))
    end = max(t[-1] for t in times if t)

    def pick(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1e3 if values else float("nan")

    return {
        "tokens": tokens,
        "seconds": end - start,
        "tokens_per_s": tokens / (end - start),
        "ttft_p50_ms": pick(ttft, 0.5),
        "ttft_p99_ms": pick(ttft, 0.99),
        "itl_p50_ms": pick(itl, 0.5),
        "itl_p99_ms": pick(itl, 0.99),
    }


def wait_until(moment: float) -> None:
    while (left := moment - time.perf_counter()) > 0:
        time.sleep(min(left, 0.002))


def run_engine(engine: Any, load: list[tuple[float, list[int], int]]) -> dict[str, float]:
    start = time.perf_counter()
    completions = []
    for at, prompt, new in load:
        wait_until(start + at)
        completions.append(engine.submit(prompt, max_new_tokens=new, eos_token_id=None))
    for completion in completions:
        completion.result(timeout=3600)
    times = [c.token_times for c in completions]
    return summary(start, [a for a, *_ in load], times, sum(len(c.tokens) for c in completions))


def run_transformers(model: Any, load: list[tuple[float, list[int], int]]) -> dict[str, float]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=256, do_sample=False, eos_token_id=-1)
    manager = model.init_continuous_batching(generation_config=config)
    if hasattr(manager, "warmup"):
        manager.warmup()
    manager.start()
    try:
        start = time.perf_counter()
        times: dict[str, list[float]] = {}
        counts: dict[str, int] = {}
        done = threading.Event()

        def collect() -> None:
            finished = 0
            while finished < len(load):
                result = manager.get_result(timeout=1)
                if result is None:
                    continue
                times.setdefault(result.request_id, [])
                if result.is_finished():
                    finished += 1
                    counts[result.request_id] = len(result.generated_tokens)
                    times[result.request_id] = list(result.timestamps or [])
            done.set()

        reader = threading.Thread(target=collect, daemon=True)
        reader.start()
        ids = []
        for k, (at, prompt, new) in enumerate(load):
            wait_until(start + at)
            ids.append(
                manager.add_request(prompt, request_id=f"r{k}", max_new_tokens=new,
                                    streaming=False, record_timestamps=True)
            )  # fmt: skip
        done.wait(3600)
    finally:
        manager.stop(block=True)
    return summary(
        start, [a for a, *_ in load], [times[i] for i in ids], sum(counts[i] for i in ids)
    )


def with_paged_attention(model: Any, run: Any, load: Any) -> dict[str, float]:
    """``run(model, load)`` with transformers' paged attention, the model's attention restored
    after (the engine's and the decoder's graphs were recorded with it)."""
    own = model.config._attn_implementation
    model.set_attn_implementation("paged|sdpa")
    try:
        return run(model, load)
    finally:
        model.set_attn_implementation(own)


def run_decoder(decoder: Any, load: list[tuple[float, list[int], int]]) -> dict[str, float]:
    start = time.perf_counter()
    times, tokens = [], 0
    for at, prompt, new in load:
        wait_until(start + at)
        ids = torch.tensor([prompt], device="cuda")
        out = decoder.generate(ids, max_new_tokens=new, eos_token_id=None)
        torch.cuda.synchronize()
        times.append([time.perf_counter()])
        tokens += out.shape[1] - len(prompt)
    return summary(start, [a for a, *_ in load], times, tokens)


def main() -> None:
    p = parser(__doc__, "serve_llm", calls=1, windows=1)
    p.add_argument("--requests", default="64,256")
    p.add_argument("--rates", default="inf,8,32", help="requests/s of the Poisson streams; inf: at once")  # fmt: skip
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--decoder-requests", type=int, default=64,
                   help="the largest workload the decoder path runs (default 64)")  # fmt: skip
    args = p.parse_args()
    console = Console()
    if not cuda_or_explain("serve_llm.py", console):
        return
    paths = names(p, "--paths", args.paths, PATHS)
    from cudagraphs.decoding import Decoder, Engine
    from cudagraphs.tools.workloads import random_llama

    model = random_llama("llama-2048", "cuda", torch.bfloat16, init=0.02)
    model.set_attn_implementation("sdpa")
    # transformers' manager runs the model as its user loads it: a copy made before the
    # Decoder and the engines fuse the projections of theirs in place.
    plain = copy.deepcopy(model) if "transformers" in paths else None
    results: dict[str, Any] = {**environment(1, 1), "model": "llama-2048 bf16", "runs": []}
    built: dict[str, Any] = {}
    # The Decoder first: it fuses the model's projections in place as the engines do (each
    # leaves a fused group as it is), and its graphs are captured after that.
    if "decoder" in paths:
        built["decoder"] = Decoder(model, max_batch=1, max_length=MAX_LENGTH)
    start = time.perf_counter()
    for path, settings in ENGINES.items():
        if path in paths:
            built[path] = Engine(model, max_batch=args.slots, max_length=MAX_LENGTH,
                                 max_queue=4096, **settings)  # fmt: skip
            results[f"{path}_setup_s"] = time.perf_counter() - start
            start = time.perf_counter()
    # Every path runs one untimed workload first, as transformers' warmup() does for its
    # own: the engine records its steps lazily, one per batch and cache-length rung.
    for path in paths:
        if path.startswith("engine"):
            run_engine(built[path], workload(args.slots, math.inf, seed=-1))
        elif path == "decoder":
            run_decoder(built["decoder"], workload(4, math.inf, seed=-1))
    rows = []
    for requests in [int(n) for n in args.requests.split(",")]:
        for rate in [float(r) for r in args.rates.split(",")]:
            load = workload(requests, rate, seed=requests)
            for path in paths:
                if path == "decoder" and requests > args.decoder_requests:
                    continue  # one at a time, a large workload takes minutes and says no more
                if path.startswith("engine"):
                    got = run_engine(built[path], load)
                elif path == "transformers":
                    got = with_paged_attention(plain, run_transformers, load)
                else:
                    got = run_decoder(built["decoder"], load)
                run = {"path": path, "requests": requests, "rate": rate, **got}
                results["runs"].append(run)
                rows.append([
                    path, str(requests), "at once" if math.isinf(rate) else f"{rate:g}/s",
                    f"{got['tokens_per_s']:.0f}", f"{got['ttft_p50_ms']:.0f}",
                    f"{got['ttft_p99_ms']:.0f}", f"{got['itl_p50_ms']:.1f}",
                    f"{got['itl_p99_ms']:.1f}",
                ])  # fmt: skip
                console.print(rows[-1])
    for path in ENGINES:
        if path in built:
            engine = built[path]
            results[f"{path}_occupancy"] = engine.metrics().occupancy
            # Every field, the steps per batch and cache-length rung among them: where a
            # mixed batch's steps went (the warm-up workload's included).
            results[f"{path}_stats"] = dataclasses.asdict(engine.stats)
            console.print(f"{path}: attention {engine.stats.attention}; steps per rung "
                          f"{engine.stats.replays}")  # fmt: skip
            engine.close()
    header = ["path", "requests", "arrivals", "tokens/s", "TTFT p50 ms", "TTFT p99 ms",
              "ITL p50 ms", "ITL p99 ms"]  # fmt: skip
    shown, lines = table(f"LLM serving on {results['hardware']}", header, rows)
    console.print(shown)
    medians = statistics.median([r["tokens_per_s"] for r in results["runs"]]) if rows else 0
    results["median_tokens_per_s"] = medians
    write_rows(results, lines, f"{results['model']}; engine slots {args.slots}", args, console)


if __name__ == "__main__":
    main()

"""LLM decoding with captured decode steps: a transformers Llama through the Decoder.

The Decoder prepares one static KV cache for the largest batch, prefills each prompt through a
recorded graph of its prompt-length rung (captured on the first request that needs it), and
decodes with CUDA graphs, one per batch rung, here 4 decode steps per graph launch with the
next token chosen and fed back on the GPU. Its greedy output is checked token for token against
``model.generate`` and timed against a plain decode loop. Then the same requests through a
Decoder whose cache is as long as chat models configure it (4096 positions): its cache-length
rungs keep these short requests on a prefix of the cache. Random weights from a config (no
download). On a CPU-only machine the decode steps run eagerly, with the same tokens.

    python examples/llm_decode.py
"""

import time
import warnings

import torch

import cudagraphs as cg
from cudagraphs.decoding.kv_cache import cache_keyword

try:
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    from cudagraphs.decoding import Decoder
except ImportError:
    raise SystemExit("this example needs transformers: pip install transformers") from None

device = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, LAYERS, PROMPT, NEW, BATCH = (512, 8, 32, 64, 4) if device == "cuda" else (128, 2, 8, 16, 2)
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' argument renames
warnings.filterwarnings("ignore", category=cg.CudaGraphsWarning)  # CPU: eager, said once

config = LlamaConfig(
    hidden_size=HIDDEN,
    intermediate_size=2 * HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=512,
    initializer_range=0.3,  # livelier random weights: varied tokens
)
torch.manual_seed(0)
model = LlamaForCausalLM(config).to(device).eval()
CACHE = cache_keyword(model)  # `cache=` in newer transformers, `past_key_values=` before
prompt = torch.randint(0, config.vocab_size, (BATCH, PROMPT), device=device)


def sync() -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def eager_loop() -> torch.Tensor:
    """What one writes by hand: prefill, then one forward per token over a static cache."""
    cache = StaticCache(config=config, max_cache_len=PROMPT + NEW)
    logits = model(prompt, **{CACHE: cache}).logits
    tokens = [prompt, logits[:, -1:].argmax(-1)]
    for i in range(NEW - 1):
        position = torch.tensor([PROMPT + i], device=device)
        out = model(tokens[-1], cache_position=position, **{CACHE: cache})
        tokens.append(out.logits[:, -1:].argmax(-1))
    return torch.cat(tokens, dim=1)


def timed(fn):
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, BATCH * NEW / (time.perf_counter() - start)


with torch.no_grad():
    expected = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
        min_new_tokens=NEW, do_sample=False, pad_token_id=0,
    )  # fmt: skip
    decoder = Decoder(model, max_batch=BATCH, max_length=PROMPT + NEW, steps_per_graph=4)
    eager_tokens, eager_speed = timed(eager_loop)
    graph_tokens, graph_speed = timed(
        lambda: decoder.generate(prompt, max_new_tokens=NEW, eos_token_id=None)
    )

print(f"Llama {HIDDEN} hidden, {LAYERS} layers, random weights, batch {BATCH}, on {device}")
captured = all(g.state is cg.State.CAPTURED for g in decoder.graphs.values())
what = (
    f"capture of {len(decoder.graphs)} rungs" if captured else "eager (no CUDA), nothing captured"
)
print(f"set-up ({what}): {decoder.stats.setup_s:.2f} s")
print(f"eager decode loop: {eager_speed:9.1f} tokens/s")
# Without CUDA the Decoder runs its steps eagerly too: a ratio of two eager runs would be noise.
ratio = f"{graph_speed / eager_speed:.2f}x" if captured else "no speed-up to show: both eager"
print(f"Decoder:           {graph_speed:9.1f} tokens/s ({ratio})")
print(
    f"tokens equal model.generate: eager loop {torch.equal(eager_tokens, expected)}, "
    f"Decoder {torch.equal(graph_tokens, expected)}"
)
assert torch.equal(graph_tokens, expected), "the Decoder must give generate's tokens"
print(
    f"prefills: recorded {decoder.stats.prefill_replays} (a {PROMPT}-token prompt, padded to the "
    f"shortest of the prompt-length rungs {decoder.prefills.lengths}), "
    f"eager {decoder.stats.eager_prefills}"
)

# A cache as long as users configure it: the default cache-length rungs are powers of two from
# 256 up to it, and a launch attends only to the shortest prefix that holds its positions.
with torch.no_grad():
    long = Decoder(model, max_batch=BATCH, max_length=4096, steps_per_graph=4)
    long_tokens, long_speed = timed(
        lambda: long.generate(prompt, max_new_tokens=NEW, eos_token_id=None)
    )
used = {key: n for key, n in long.stats.replays.items() if n}
print(f"Decoder, cache of 4096: {long_speed:9.1f} tokens/s; length rungs {long.lengths}")
print(
    f"  launches per rung: {used}; tokens equal model.generate {torch.equal(long_tokens, expected)}"
)
assert torch.equal(long_tokens, expected), "the rungs must not change the tokens"

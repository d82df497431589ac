"""Token-by-token decoding of a transformers Llama with a static KV cache, graphed as written.

The decode step writes state that is not among its inputs: the cache's keys and values and its
position counter (transformers 5 advances a device counter of its own on every call). cg.graph
warms up on the example and then puts every one of those writes back, so the loop below starts
from the prefill's state and gives exactly the tokens of ``model.generate``. Random weights from
a config (no download). On a CPU-only machine the graph is the eager pass-through.

    python examples/llm_decode.py
"""

import time
import warnings

import torch

import cudagraphs as cg

try:
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
except ImportError:
    raise SystemExit("this example needs transformers: pip install transformers") from None

device = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, LAYERS, PROMPT, NEW = (512, 8, 32, 64) if device == "cuda" else (128, 2, 8, 16)
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' argument renames

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
prompt = torch.randint(0, config.vocab_size, (1, PROMPT), device=device)


def decode_loop(graphed: bool) -> tuple[torch.Tensor, float]:
    """Prefill eagerly, then NEW - 1 decode steps, eagerly or through one captured graph."""
    cache = StaticCache(config=config, max_cache_len=PROMPT + NEW)
    with torch.no_grad():
        logits = model(prompt, past_key_values=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        position = torch.tensor([PROMPT], device=device)

        def decode(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
            out = model(input_ids=token, past_key_values=cache, cache_position=position)
            return out.logits[:, -1:].argmax(-1)

        step = cg.graph(decode, token, position) if graphed else decode
        tokens = [token]
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(NEW - 1):
            token = step(token, position).clone()  # a graph's output is overwritten next call
            position += 1
            tokens.append(token)
        if device == "cuda":
            torch.cuda.synchronize()
        return torch.cat(tokens, dim=1), (NEW - 1) / (time.perf_counter() - start)


with torch.no_grad():
    expected = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
    )[:, PROMPT:]
with warnings.catch_warnings():
    warnings.simplefilter("ignore", cg.CudaGraphsWarning)  # CPU: the pass-through says so once
    eager_tokens, eager_speed = decode_loop(graphed=False)
    graph_tokens, graph_speed = decode_loop(graphed=True)

print(f"Llama {HIDDEN} hidden, {LAYERS} layers, random weights, on {device}")
print(f"eager decode loop:    {eager_speed:8.1f} tokens/s")
print(f"cg.graph decode loop: {graph_speed:8.1f} tokens/s ({graph_speed / eager_speed:.2f}x)")
print(
    f"tokens equal model.generate: eager {torch.equal(eager_tokens, expected)}, "
    f"graph {torch.equal(graph_tokens, expected)}"
)
assert torch.equal(graph_tokens, expected), "the graphed loop must give generate's tokens"

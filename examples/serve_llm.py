"""An LLM server with continuous batching: requests join and leave one running batch of
captured decode steps, each streamed back as it is decoded (``cudagraphs.decoding.Engine``
behind ``cudagraphs.serve.completions_app``, an OpenAI-style ``/v1/completions``).

The model is a Llama with random weights from a config (no download): the 1.1 B TinyLlama
shape in bfloat16 on a GPU, a small one in float32 on a CPU (where the steps run eagerly).
Token ids in, token ids out; pass a tokenizer to ``completions_app`` for text.

    python -m cudagraphs serve examples/serve_llm.py:make --port 8000
    python examples/llm_client.py --port 8000            # streams a few requests at once
    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"prompt": [1, 450, 496, 173], "max_tokens": 16, "temperature": 0}'
    curl -s localhost:8000/metrics; curl -s localhost:8000/healthz

Needs the serve extra (``pip install -e '.[serve]'`` from a clone) and transformers.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

import cudagraphs as cg
from cudagraphs.decoding import Engine
from cudagraphs.serve import completions_app


def llama(device: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    if device == "cuda":  # TinyLlama-1.1B's shape
        shape = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                     num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)  # fmt: skip
        dtype = torch.bfloat16
    else:
        shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)  # fmt: skip
        dtype = torch.float32
    config = LlamaConfig(**shape, max_position_embeddings=2048, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def make() -> Any:
    """The app: one engine of 16 slots of 1024 positions (64 of 256 on a CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    warnings.filterwarnings("ignore", category=cg.CudaGraphsWarning)  # CPU: eager, said once
    slots, length = (16, 1024) if device == "cuda" else (4, 256)
    engine = Engine(llama(device), max_batch=slots, max_length=length, max_queue=256)
    return completions_app(engine, model_name="random-llama")


if __name__ == "__main__":
    # Started through the command line, which runs uvicorn on the app `make()` builds:
    print(
        "This file defines the app; start the server with\n"
        "    python -m cudagraphs serve examples/serve_llm.py:make --port 8000\n"
        "then: python examples/llm_client.py --port 8000"
    )

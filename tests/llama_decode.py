"""A transformers Llama decode loop with a static KV cache, for the CPU and GPU tests.

Random weights from a config (no download). transformers 5's static cache ignores the position
it is given and advances a device counter of its own (``cumulative_length``) on every call: the
state a graph's warm-up must not advance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

import cudagraphs as cg


def tiny_llama(
    device: str, dtype: torch.dtype = torch.float32, hidden: int = 256, layers: int = 4
) -> tuple[Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
        initializer_range=0.3,  # livelier random weights: varied tokens, so a wrong cache shows
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    return model, config


@contextlib.contextmanager
def transformers_attention(model: Any) -> Iterator[None]:
    """The model's attention as transformers gives it ("sdpa") for a reference run, then back
    to what it was: a Decoder switches its model to the grouped attention, and the reference
    must not be computed by the code under test."""
    before = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def generate_with_scores(
    model: Any, prompt: torch.Tensor, new: int, raw: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.generate``'s greedy output, exactly ``new`` tokens longer than the prompt, and
    the logits it chose them from, ``[batch, new, vocab]``: as its logits processors left them
    (the end-of-sequence token at ``-inf`` while ``min_new_tokens`` holds it back), or the
    model's own with ``raw``."""
    with torch.no_grad(), transformers_attention(model):
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            output_scores=not raw,
            output_logits=raw,
            return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits if raw else out.scores, dim=1)


def reference_tokens(model: Any, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``model.generate``'s greedy continuation, exactly ``new_tokens`` long."""
    return generate_with_scores(model, prompt, new_tokens)[0][:, prompt.shape[1] :]


def graph_decode(
    model: Any,
    config: Any,
    prompt: torch.Tensor,
    new_tokens: int,
    *,
    lazy: bool = False,
    wrap: Callable[[Any], Any] | None = None,
    forced: torch.Tensor | None = None,
    **options: Any,
) -> tuple[torch.Tensor, Any, Any]:
    """Prefill eagerly, then decode token by token through ``cg.graph`` (default options unless
    given). Returns the new tokens, the cache and the graphed step. ``forced``: ``[batch,
    new_tokens]`` tokens to feed instead of the step's own (teacher forcing), so that each
    returned token is the step's choice after the reference's previous tokens and one near tie
    does not change every later token."""
    from transformers import StaticCache

    from cudagraphs.decoding.kv_cache import cache_keyword

    cache = StaticCache(config=config, max_cache_len=prompt.shape[1] + new_tokens)
    keyword = cache_keyword(model)  # `cache` in newer transformers
    with torch.no_grad():
        logits = model(prompt, **{keyword: cache}, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)

        def decode(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
            out = model(
                input_ids=token, **{keyword: cache}, cache_position=position, use_cache=True
            )
            return out.logits[:, -1:].argmax(-1)

        step = wrap(decode) if wrap is not None else decode
        position = torch.tensor([prompt.shape[1]], device=prompt.device)
        graphed = cg.graph(step, **options) if lazy else cg.graph(step, token, position, **options)
        tokens = [token]
        for i in range(new_tokens - 1):
            fed = token if forced is None else forced[:, i : i + 1]
            token = graphed(fed, position).clone()
            position += 1
            tokens.append(token)
    return torch.cat(tokens, dim=1), cache, graphed

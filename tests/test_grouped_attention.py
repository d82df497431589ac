"""One token's attention over grouped key/value heads, without ``repeat_kv``: equal to
transformers' SDPA attention (which expands the heads) on fresh random inputs, with shared and
per-head masks; every other call is transformers' own; the Decoder switches to it and says so."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")

from llama_decode import tiny_llama, transformers_attention
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from cudagraphs.decoding.decoder import Decoder
from cudagraphs.decoding.grouped_attention import (
    GROUPED_KERNEL,
    GROUPED_SDPA,
    grouped_sdpa_attention,
    use_grouped_attention,
)


class Heads(torch.nn.Module):
    """What transformers' attention functions read off the module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def expanded_reference(query, key, value, mask, scaling=None):
    """The attention written the long way: every key/value head copied over its query heads."""
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask, scale=scaling
    )
    return out.transpose(1, 2)


def packed_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The query shapes of the grouped attention's own SDPA calls from now on (the packed
    path; calls handed to transformers are not counted): proof of which path ran."""
    from cudagraphs.decoding import grouped_attention

    shapes: list[tuple[int, ...]] = []

    def counting(query, *args, **kwargs):
        shapes.append(tuple(query.shape))
        return F.scaled_dot_product_attention(query, *args, **kwargs)

    monkeypatch.setattr(
        grouped_attention, "F", types.SimpleNamespace(scaled_dot_product_attention=counting)
    )
    return shapes


@pytest.mark.parametrize("per_head_mask", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (12, 4), (6, 1)])
def test_one_token_with_grouped_heads_equals_the_expanded_attention(
    heads: int, kv_heads: int, per_head_mask: bool
) -> None:
    torch.manual_seed(heads * 10 + kv_heads + per_head_mask)
    batch, positions, size = 3, 37, 16
    query = torch.randn(batch, heads, 1, size)
    key, value = torch.randn(2, batch, kv_heads, positions, size).unbind(0)
    # Each row attends to its own prefix, with a hole: a mask that matters.
    mask = torch.rand(batch, heads if per_head_mask else 1, 1, positions) > 0.3
    mask[..., 0] = True
    got, weights = grouped_sdpa_attention(
        Heads(heads // kv_heads), query, key, value, mask, scaling=0.3
    )
    assert weights is None
    torch.testing.assert_close(got, expanded_reference(query, key, value, mask, 0.3))


def test_other_calls_are_transformers_sdpa_attention() -> None:
    """A prompt (several tokens, causal), or one token with dropout, is not rewritten."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(1)
    module = Heads(4)
    query = torch.randn(2, 8, 5, 16)
    key, value = torch.randn(2, 2, 2, 5, 16).unbind(0)
    ours, _ = grouped_sdpa_attention(module, query, key, value, None)
    theirs, _ = sdpa_attention_forward(module, query, key, value, None)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    causal = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    torch.testing.assert_close(
        ours, expanded_reference(query, key, value, causal, None), rtol=1e-5, atol=1e-5
    )


def test_the_switch_refuses_other_attentions_and_leaves_them() -> None:
    model, _ = tiny_llama("cpu", hidden=32, layers=1)
    model.set_attn_implementation("eager")
    assert "'eager'" in (use_grouped_attention(model) or "")
    assert model.config._attn_implementation == "eager"
    model.set_attn_implementation("sdpa")
    assert use_grouped_attention(model) is None
    assert model.config._attn_implementation == GROUPED_KERNEL
    assert use_grouped_attention(model) is None  # again: nothing to do
    assert use_grouped_attention(model, kernel=False) is None  # another Decoder's choice
    assert model.config._attn_implementation == GROUPED_SDPA


@pytest.mark.parametrize("grouped", [True, False])
def test_the_decoder_decodes_generate_s_tokens_with_either_attention(
    grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    torch.manual_seed(5)
    prompt = torch.randint(1, 512, (3, 6))
    with torch.no_grad(), transformers_attention(model):
        expected = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
            min_new_tokens=16, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    shapes = packed_calls(monkeypatch)
    decoder = Decoder(model, max_batch=4, max_length=24, grouped_attention=grouped)
    got = decoder.generate(prompt, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(got, expected)
    if grouped:
        assert decoder.stats.attention.startswith("grouped")
        assert (4, 2, 2, 16) in shapes  # batch rung 4, 2 key/value heads, a group of 2, size 16
    else:
        assert decoder.stats.attention == "the model's own: grouped_attention=False"
        assert model.config._attn_implementation == "sdpa" and not shapes


def test_the_attention_switched_back_after_capture_is_caught(
    stand_in: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the captured path (the CPU stand-in, frozen like a graph): the model's attention
    set back to transformers' after the Decoder captured its steps is a changed value the
    graphs read, so the next request captures again, with the attention now named."""
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    decoder = Decoder(model, max_batch=1, max_length=32)
    torch.manual_seed(6)
    prompt = torch.randint(1, 512, (1, 6))
    first = decoder.generate(prompt, max_new_tokens=12, eos_token_id=None)
    assert decoder.stats.recaptures == 0 and decoder.stats.attention.startswith("grouped")
    model.set_attn_implementation("sdpa")
    shapes = packed_calls(monkeypatch)
    again = decoder.generate(prompt, max_new_tokens=12, eos_token_id=None)
    assert decoder.stats.recaptures >= 1
    assert not shapes  # the new capture ran transformers' attention, not the grouped one
    assert torch.equal(again, first)


FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),  # q/k norms
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # one qkv_proj
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_decode_token_of_each_family_answers_as_transformers_sdpa_does(family: str) -> None:
    """One token after a prompt longer than the sliding windows, through a static cache: the
    logits with the grouped attention equal those with transformers' SDPA attention, in every
    family the Decoder supports whose attention can be SDPA (masks, scaling, windows)."""
    import transformers
    from transformers import StaticCache

    from cudagraphs.decoding.kv_cache import cache_keyword

    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, pad_token_id=0, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    model.set_attn_implementation("sdpa")
    prompt = torch.randint(1, 256, (2, 12))
    token = torch.randint(1, 256, (2, 1))

    def next_logits() -> torch.Tensor:
        cache = {cache_keyword(model): StaticCache(config=model.config, max_cache_len=20)}
        with torch.no_grad():
            model(prompt, use_cache=True, **cache)
            return model(token, use_cache=True, **cache).logits[:, -1]

    expected = next_logits()
    assert use_grouped_attention(model) is None
    torch.testing.assert_close(next_logits(), expected, rtol=1e-5, atol=1e-5)

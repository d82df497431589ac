"""The grouped one-token attention on a GPU, in bf16, where SDPA picks a fused kernel (cuDNN's
or the memory-efficient one) for the packed query heads: its error against a float32
reference is no larger than that of the model's own attention (``repeat_kv``), eagerly and
under ``torch.compile``, per operator and in a whole model's decode step."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.cuda
pytest.importorskip("transformers")

from llama_decode import transformers_attention  # noqa: E402
from test_grouped_attention import Heads, expanded_reference, packed_calls  # noqa: E402
from transformers import StaticCache  # noqa: E402

from cudagraphs.decoding.grouped_attention import (  # noqa: E402
    grouped_sdpa_attention,
    use_grouped_attention,
)
from cudagraphs.decoding.kv_cache import cache_keyword  # noqa: E402
from cudagraphs.tools.workloads import random_llama  # noqa: E402


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("batch,positions", [(1, 168), (16, 168), (4, 1024)])
def test_bf16_error_is_no_larger_than_the_expanded_attention_s(
    batch: int, positions: int, compiled: bool
) -> None:
    torch.manual_seed(batch + positions)
    heads, kv_heads, size = 32, 4, 64
    query = torch.randn(batch, heads, 1, size, device="cuda", dtype=torch.bfloat16)
    key, value = torch.randn(
        2, batch, kv_heads, positions, size, device="cuda", dtype=torch.bfloat16
    ).unbind(0)
    mask = torch.rand(batch, 1, 1, positions, device="cuda") > 0.2
    mask[..., positions - 7 :] = False  # the cache's unfilled tail
    mask[..., 0] = True
    reference = expanded_reference(query.float(), key.float(), value.float(), mask)
    ours = grouped_call(Heads(heads // kv_heads), compiled)
    got = ours(query, key, value, mask)
    theirs = expanded_reference(query, key, value, mask)
    error = (got.float() - reference).abs().max().item()
    their_error = (theirs.float() - reference).abs().max().item()
    assert got.dtype == torch.bfloat16 and got.shape == theirs.shape
    assert error <= 2 * their_error + 1e-3, (error, their_error)


def grouped_call(module: torch.nn.Module, compiled: bool):
    def run(query, key, value, mask):
        return grouped_sdpa_attention(module, query, key, value, mask)[0]

    return torch.compile(run, fullgraph=True, dynamic=False) if compiled else run


@pytest.mark.parametrize("kernel", [False, True], ids=["sdpa", "one-kernel"])
def test_a_bf16_decode_step_s_logits_err_no_more_than_the_model_s_own_attention(
    monkeypatch: pytest.MonkeyPatch, kernel: bool
) -> None:
    """One decode token through a bf16 Llama with grouped heads, both attentions, against the
    same model in float32: the grouped step's logits (through SDPA or the one-kernel decode
    attention, over a 64-position cache) are as close to float32's as the model's own
    attention's."""
    model = random_llama("llama-512", "cuda", torch.bfloat16, init=0.02)
    exact = copy.deepcopy(model).float()
    torch.manual_seed(7)
    prompt = torch.randint(0, model.config.vocab_size, (2, 40), device="cuda")
    token = torch.randint(0, model.config.vocab_size, (2, 1), device="cuda")

    def next_logits(m: torch.nn.Module) -> torch.Tensor:
        cache = {cache_keyword(m): StaticCache(config=m.config, max_cache_len=64)}
        with torch.no_grad():
            m(prompt, use_cache=True, **cache)
            out = m(token, use_cache=True, **cache)
        return out.logits[:, -1].float()

    with transformers_attention(exact):
        reference = next_logits(exact)
    with transformers_attention(model):
        theirs = next_logits(model)
    assert use_grouped_attention(model, kernel=kernel) is None
    shapes = packed_calls(monkeypatch)
    ours = next_logits(model)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    packed = (2, kv_heads, heads // kv_heads, model.config.head_dim) in shapes
    assert packed is not kernel  # the kernel takes the decode token; SDPA only the prompt
    scale = reference.abs().max().item()
    error = (ours - reference).abs().max().item() / scale
    their_error = (theirs - reference).abs().max().item() / scale
    assert error <= 2 * their_error + 1e-3, (error, their_error)

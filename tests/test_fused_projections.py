"""Fused q/k/v and gate/up projections (``decoding/fused_projections.py``): the same answers
as the unfused model, the same parameter objects and state_dict, in-place updates seen,
replaced parameters never read through the old buffer, refusals that say why."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from llama_decode import tiny_llama  # noqa: E402

from cudagraphs.decoding.fused_projections import (  # noqa: E402
    FusedLinear,
    fuse_projections,
    rows_linear,
    unfuse_projections,
)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _random_weights(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(t.shape, generator=generator, dtype=t.dtype) * 0.3
        for name, t in model.state_dict().items()
    }


def test_a_fused_llama_answers_as_the_unfused_one_with_the_same_parameters() -> None:
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    unfused = copy.deepcopy(model)
    params = dict(model.named_parameters())
    report = fuse_projections(model)
    assert len(report.fused) == 4 and not report.refused  # 2 layers x (q/k/v, gate/up)
    assert dict(model.named_parameters()) == params  # the same objects under the same names
    assert list(model.state_dict()) == list(unfused.state_dict())
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.q_proj, nn.Linear) and type(attention.q_proj) is FusedLinear
    # The three weights are rows of one buffer, back to back.
    q, k, v = attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight
    assert q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.storage_offset() == q.numel() and v.storage_offset() == q.numel() + k.numel()
    ids = torch.randint(0, 512, (2, 12))
    torch.testing.assert_close(_logits(model, ids), _logits(unfused, ids), rtol=1e-5, atol=1e-5)


def test_in_place_updates_are_seen_and_replaced_parameters_are_never_read_from_the_buffer() -> None:
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    reference = copy.deepcopy(model)
    fuse_projections(model)
    ids = torch.randint(0, 512, (2, 10))
    weights = _random_weights(model, seed=1)
    address = model.model.layers[1].mlp.up_proj.weight.data_ptr()
    model.load_state_dict(weights)  # in place, into the shared buffers
    reference.load_state_dict(weights)
    assert model.model.layers[1].mlp.up_proj.weight.data_ptr() == address
    torch.testing.assert_close(_logits(model, ids), _logits(reference, ids), rtol=1e-5, atol=1e-5)
    # A new Parameter object for one projection: the group computes each product on its own.
    new = torch.randn_like(model.model.layers[0].self_attn.k_proj.weight)
    model.model.layers[0].self_attn.k_proj.weight = nn.Parameter(new.clone())
    reference.model.layers[0].self_attn.k_proj.weight = nn.Parameter(new.clone())
    torch.testing.assert_close(_logits(model, ids), _logits(reference, ids), rtol=1e-5, atol=1e-5)
    # New memory behind the same Parameter (param.data = t): the same.
    other = torch.randn_like(model.model.layers[1].mlp.gate_proj.weight)
    model.model.layers[1].mlp.gate_proj.weight.data = other.clone()
    reference.model.layers[1].mlp.gate_proj.weight.data = other.clone()
    torch.testing.assert_close(_logits(model, ids), _logits(reference, ids), rtol=1e-5, atol=1e-5)


def test_the_operator_multiplies_once_only_by_weights_that_lie_back_to_back() -> None:
    x = torch.randn(3, 8)
    buffer = torch.randn(12, 8)
    a, b = buffer[:4], buffer[4:]
    expected = torch.cat([x @ a.T, x @ b.T], dim=-1)
    torch.testing.assert_close(rows_linear(x, [a, b], []), expected)
    # Out of order, apart, or transposed: each product on its own, the same answer.
    torch.testing.assert_close(rows_linear(x, [b, a], []), torch.cat([x @ b.T, x @ a.T], -1))
    apart = [buffer[:4], buffer[8:]]
    torch.testing.assert_close(rows_linear(x, apart, []), torch.cat([x @ w.T for w in apart], -1))
    bias = torch.randn(12)
    with_bias = rows_linear(x, [a, b], [bias[:4], bias[4:]])
    torch.testing.assert_close(with_bias, expected + bias)


def test_a_projection_called_first_or_alone_gets_its_own_rows() -> None:
    model, _ = tiny_llama("cpu", hidden=64, layers=1)
    unfused = copy.deepcopy(model)
    fuse_projections(model)
    attention, reference = model.model.layers[0].self_attn, unfused.model.layers[0].self_attn
    x, y = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(attention.v_proj(x), reference.v_proj(x))  # v first
        torch.testing.assert_close(attention.q_proj(y), reference.q_proj(y))  # another input
        torch.testing.assert_close(attention.k_proj(x), reference.k_proj(x))
        torch.testing.assert_close(attention.k_proj(y), reference.k_proj(y))


def test_training_through_a_fused_model_gives_the_unfused_gradients() -> None:
    model, _ = tiny_llama("cpu", hidden=64, layers=1)
    unfused = copy.deepcopy(model)
    fuse_projections(model)
    ids = torch.randint(0, 512, (2, 6))
    for m in (model, unfused):
        m(ids).logits.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), unfused.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_groups_that_do_not_match_are_left_alone_with_the_reason() -> None:
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    unfused = copy.deepcopy(model)
    first = model.model.layers[0]
    first.self_attn.k_proj.to(torch.float64)
    first.self_attn.k_proj.to(torch.float32)  # back to fp32: fusable again
    first.mlp.up_proj = nn.Linear(64, 128, bias=True)  # a bias on up but not on gate
    unfused.model.layers[0].mlp.up_proj = copy.deepcopy(first.mlp.up_proj)
    report = fuse_projections(model)
    assert report.refused == [
        "model.layers.0.mlp: gate_proj+up_proj: a bias on some projections and not on others"
    ]
    assert "model.layers.0.self_attn: q_proj+k_proj+v_proj" in report.fused
    assert type(first.mlp.up_proj) is nn.Linear
    ids = torch.randint(0, 512, (1, 7))
    torch.testing.assert_close(_logits(model, ids), _logits(unfused, ids), rtol=1e-5, atol=1e-5)
    again = fuse_projections(model)  # a second Decoder of the same model: already fused
    assert again.fused == report.fused and again.refused == report.refused
    assert unfuse_projections(model) == 8
    assert type(model.model.layers[1].self_attn.q_proj) is nn.Linear


@pytest.mark.parametrize("family", ["qwen2", "mistral", "qwen3", "gemma", "phi3"])
def test_other_families_fuse_and_answer_as_before(family: str) -> None:
    configs = {
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),  # q/k/v with biases
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),  # q/k norms after the projections
        "gemma": ("GemmaConfig", "GemmaForCausalLM"),
        "phi3": ("Phi3Config", "Phi3ForCausalLM"),  # qkv_proj and gate_up_proj already one
    }
    config_class, model_class = (getattr(transformers, n) for n in configs[family])
    config = config_class(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = model_class(config).eval()
    unfused = copy.deepcopy(model)
    report = fuse_projections(model)
    assert len(report.fused) == (0 if family == "phi3" else 4) and not report.refused, report
    ids = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(_logits(model, ids), _logits(unfused, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_compiled_fused_model_sees_in_place_updates_and_replaced_parameters(
    fresh_compile_cache: object,
) -> None:
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    reference = copy.deepcopy(model)
    fuse_projections(model)
    compiled = torch.compile(model, dynamic=False)
    ids = torch.randint(0, 512, (1, 8))
    torch.testing.assert_close(
        _logits(compiled, ids), _logits(reference, ids), rtol=1e-4, atol=1e-4
    )
    weights = _random_weights(model, seed=2)
    model.load_state_dict(weights)
    reference.load_state_dict(weights)
    torch.testing.assert_close(
        _logits(compiled, ids), _logits(reference, ids), rtol=1e-4, atol=1e-4
    )
    new = torch.randn_like(model.model.layers[1].self_attn.v_proj.weight)
    model.model.layers[1].self_attn.v_proj.weight = nn.Parameter(new.clone())
    reference.model.layers[1].self_attn.v_proj.weight = nn.Parameter(new.clone())
    torch.testing.assert_close(
        _logits(compiled, ids), _logits(reference, ids), rtol=1e-4, atol=1e-4
    )


@pytest.mark.slow
def test_a_decoder_fuses_and_a_weight_update_between_requests_changes_the_next_tokens(
    stand_in: None,
) -> None:
    """Through the captured path (the CPU stand-in): the Decoder fuses by default, its tokens
    equal an unfused model's ``generate``, and ``load_state_dict`` with other weights between
    two requests gives the new weights' tokens, with no recapture (the update is in place)."""
    import cudagraphs as cg
    from cudagraphs.decoding.decoder import Decoder

    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    unfused = copy.deepcopy(model)
    unfused.generation_config.eos_token_id = None  # min_new_tokens would suppress it
    decoder = Decoder(model, max_batch=2, max_length=40)
    assert decoder.stats.fused_groups == 4 and decoder.stats.unfused == []
    assert all(g.state is cg.State.CAPTURED for g in decoder.graphs.values())

    def expected(prompt: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return unfused.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                min_new_tokens=12, do_sample=False, pad_token_id=0,
            )  # fmt: skip

    torch.manual_seed(3)
    prompt = torch.randint(0, 512, (2, 6))
    before = decoder.generate(prompt, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(before, expected(prompt))
    weights = _random_weights(model, seed=4)
    model.load_state_dict(weights)
    unfused.load_state_dict(weights)
    after = decoder.generate(prompt, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(after, expected(prompt)) and not torch.equal(after, before)
    assert decoder.stats.recaptures == 0
    # A new Parameter object for one projection: the guards capture again, and the product
    # reads the new parameter, not the old buffer.
    new = torch.randn_like(model.model.layers[1].self_attn.v_proj.weight)
    model.model.layers[1].self_attn.v_proj.weight = nn.Parameter(new.clone())
    unfused.model.layers[1].self_attn.v_proj.weight = nn.Parameter(new.clone())
    third = decoder.generate(prompt, max_new_tokens=12, eos_token_id=None)
    assert decoder.stats.recaptures >= 1
    assert torch.equal(third, expected(prompt))
    plain = Decoder(copy.deepcopy(unfused), max_batch=2, max_length=40, fuse=False)
    assert plain.stats.fused_groups == 0
    assert type(plain.model.model.layers[0].self_attn.q_proj) is nn.Linear

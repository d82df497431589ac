"""The one-row Triton product (``integrations/matvec.py``) on the CPU: where it does not apply
the product is ``F.linear``'s, a direct call says why and what to use, and a fused model asked
for it answers as before."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from cudagraphs.integrations.fused_projections import fuse_projections, rows_linear
from cudagraphs.integrations.matvec import applies, linear, matvec


def test_it_does_not_apply_off_the_gpu_and_the_product_is_f_linear_s() -> None:
    torch.manual_seed(0)
    x, w, b = torch.randn(1, 64).bfloat16(), torch.randn(32, 64).bfloat16(), torch.randn(32)
    assert not applies(x, w)
    torch.testing.assert_close(linear(x, w, b.bfloat16()), F.linear(x, w, b.bfloat16()))
    weights = [torch.randn(8, 64), torch.randn(8, 64)]
    torch.testing.assert_close(
        rows_linear(x.float(), weights, [], True),
        torch.cat([F.linear(x.float(), t) for t in weights], -1),
    )


def test_a_direct_call_where_it_does_not_apply_says_what_to_use() -> None:
    with pytest.raises(ValueError, match=r"one row of half or bfloat16.*use F\.linear"):
        matvec(torch.randn(4, 64), torch.randn(32, 64))


def test_fuse_projections_refuses_a_matvec_that_is_not_a_bool() -> None:
    from cudagraphs import ConfigError

    with pytest.raises(ConfigError, match="matvec"):
        fuse_projections(torch.nn.Linear(4, 4), matvec="yes")  # type: ignore[arg-type]


def test_matvec_also_routes_the_output_and_down_projections_without_copying_them() -> None:
    """``fuse_projections(matvec=True)``: the output and down projections, one product each,
    go through the same operator (the one-row kernel on a GPU), their weights left where they
    are; the model answers as before, and unfusing gives the modules back."""
    import copy

    from cudagraphs.integrations.fused_projections import FusedLinear, unfuse_projections
    from cudagraphs.tools.workloads import random_llama

    model = random_llama("llama-tiny")
    plain = copy.deepcopy(model)
    layer = model.model.layers[0]
    where = layer.self_attn.o_proj.weight.data_ptr(), layer.mlp.down_proj.weight.data_ptr()
    report = fuse_projections(model, matvec=True)
    layers = len(model.model.layers)
    assert len(report.fused) == 2 * layers and not report.refused
    assert sorted(report.one_row) == sorted(
        [f"model.layers.{i}.self_attn: o_proj" for i in range(layers)]
        + [f"model.layers.{i}.mlp: down_proj" for i in range(layers)]
    )
    assert "single projections on the one-row kernel" in str(report)
    assert type(layer.self_attn.o_proj) is FusedLinear and type(layer.mlp.down_proj) is FusedLinear
    assert (
        layer.self_attn.o_proj.weight.data_ptr(),
        layer.mlp.down_proj.weight.data_ptr(),
    ) == where
    ids = torch.randint(0, 512, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    again = fuse_projections(model, matvec=True)  # an earlier call's, reported as such
    assert len(again.one_row) == 2 * layers and len(again.fused) == 2 * layers
    assert not fuse_projections(model).one_row  # without matvec the singles are not looked at
    assert unfuse_projections(model) == 7 * layers
    assert type(layer.mlp.down_proj) is torch.nn.Linear


@pytest.mark.slow
def test_a_compiled_decoder_of_a_model_on_the_one_row_kernel_gives_generate_s_tokens(
    fresh_compile_cache: object,
) -> None:
    """Every projection of the model routed through the operator (the fused groups and the
    single ones): the compiled one-shape step traces the single groups too and decodes as
    ``generate`` does (on the CPU the operator's product is ``F.linear``'s)."""
    import copy

    pytest.importorskip("transformers")
    from llama_decode import reference_tokens, tiny_llama

    from cudagraphs.integrations.transformers import Decoder

    model, _ = tiny_llama("cpu")
    reference = copy.deepcopy(model)
    assert fuse_projections(model, matvec=True).one_row
    torch._dynamo.reset()
    decoder = Decoder(model, max_batch=1, max_length=40, batch_sizes=[1], compile=True)
    torch.manual_seed(12)
    prompt = torch.randint(0, 512, (1, 6))
    got = decoder.generate(prompt, max_new_tokens=10, eos_token_id=None)
    assert torch.equal(got[:, prompt.shape[1] :], reference_tokens(reference, prompt, 10))

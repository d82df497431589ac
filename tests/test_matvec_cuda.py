"""The one-row Triton product on a GPU: equal to ``F.linear`` within half-precision rounding on
the decode shapes' proportions, and a fused Llama asked for it decodes as the plain one does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

pytestmark = pytest.mark.cuda

from cudagraphs.integrations.fused_projections import fuse_projections  # noqa: E402
from cudagraphs.integrations.matvec import applies, applies_gated, gated_matvec, matvec  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(2560, 2048), (2048, 5632), (1000, 300)])
def test_matvec_equals_f_linear_within_rounding(n: int, k: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 1, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    b = torch.randn(n, device="cuda", dtype=dtype)
    assert applies(x, w)
    expected = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(matvec(x, w, b).float(), expected, rtol=2e-2, atol=2e-2)
    assert not applies(torch.randn(2, k, device="cuda", dtype=dtype), w)  # two rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(2048, 5632), (1000, 300)])
def test_gated_matvec_equals_the_mlp_s_three_operations_within_rounding(
    n: int, k: int, dtype: torch.dtype
) -> None:
    """``F.linear(F.silu(gate) * up, w)`` from ``[gate, up]`` in one kernel: against the same
    three operations in float32 from the same half-precision inputs."""
    torch.manual_seed(1)
    gate_up = torch.randn(1, 1, 2 * k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    assert applies_gated(gate_up, w) and not applies(gate_up, w)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = F.linear(F.silu(gate) * up, w.float())
    torch.testing.assert_close(gated_matvec(gate_up, w).float(), expected, rtol=2e-2, atol=2e-2)


def test_a_fused_llama_asked_for_matvec_is_as_close_to_float32_as_the_plain_one() -> None:
    """bf16 rounds each product differently in the two kernels, and a difference grows through
    the layers; so both answers are held against the same model in float32: the matvec one may
    not be further from it than twice the plain bf16 model's own distance."""
    from cudagraphs.tools.workloads import random_llama

    model = random_llama("llama-512", "cuda", torch.bfloat16)
    plain, reference = copy.deepcopy(model), copy.deepcopy(model).float()
    report = fuse_projections(model, matvec=True)
    assert report.fused and not report.refused
    ids = torch.randint(0, 32000, (1, 1), device="cuda")
    position = torch.tensor([[11]], device="cuda")
    with torch.no_grad():
        got, bf16, exact = (
            m(ids, position_ids=position).logits.float() for m in (model, plain, reference)
        )
    plain_error = (bf16 - exact).abs().max().item()
    assert 0 < (got - exact).abs().max().item() <= 2 * plain_error + 1e-2

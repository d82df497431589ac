"""The one-row Triton product on a GPU: equal to ``F.linear`` within half-precision rounding on
the decode shapes' proportions, and a fused Llama asked for it decodes as the plain one does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

pytestmark = pytest.mark.cuda

from cudagraphs.integrations.fused_projections import fuse_projections  # noqa: E402
from cudagraphs.integrations.matvec import applies, matvec  # noqa: E402


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


def test_a_fused_llama_asked_for_matvec_gives_the_plain_model_s_logits() -> None:
    from cudagraphs.tools.workloads import random_llama

    model = random_llama("llama-512", "cuda", torch.bfloat16)
    plain = copy.deepcopy(model)
    report = fuse_projections(model, matvec=True)
    assert report.fused and not report.refused
    ids = torch.randint(0, 32000, (1, 12), device="cuda")
    with torch.no_grad():
        got = model(ids[:, -1:], position_ids=torch.tensor([[11]], device="cuda")).logits
        expected = plain(ids[:, -1:], position_ids=torch.tensor([[11]], device="cuda")).logits
    torch.testing.assert_close(got.float(), expected.float(), rtol=5e-2, atol=5e-2)

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

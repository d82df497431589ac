"""The one-kernel decode attention on a GPU: against a float32 masked SDPA over ``repeat_kv``,
in bf16 (no larger error than SDPA's own bf16 kernel) and float32 (to 1e-5: full-precision
products, no TF32), eagerly, under ``torch.compile`` and replayed in a graph; and where it does
not apply (a cache longer than ``MAX_POSITIONS``, a prefill, a float mask) it says so. bf16 runs here only: Triton's CPU
interpreter multiplies bf16 blocks wrongly, so the CPU test covers float32 and float16."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import cudagraphs as cg
from cudagraphs.decoding.attention import MAX_POSITIONS, applies, decode_attention

pytestmark = pytest.mark.cuda


def reference(q, k, v, mask, scale):  # type: ignore[no-untyped-def]
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)
    values = v.float().repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=mask, scale=scale)


def inputs(batch: int, positions: int, dtype: torch.dtype, heads: int = 32, kv: int = 4):  # type: ignore[no-untyped-def]
    q = torch.randn(batch, 1, heads, 64, device="cuda", dtype=dtype).transpose(1, 2)
    k, v = torch.randn(2, batch, kv, positions, 64, device="cuda", dtype=dtype).unbind(0)
    mask = torch.rand(batch, 1, 1, positions, device="cuda") > 0.2
    mask[..., -7:] = False  # the cache's unfilled tail
    mask[..., 0] = True
    return q, k, v, mask


@pytest.mark.parametrize("batch,positions", [(1, 168), (16, 168), (3, MAX_POSITIONS), (2, 40)])
@pytest.mark.parametrize("how", ["eager", "compiled", "graphed"])
def test_bf16_error_is_no_larger_than_sdpas(batch: int, positions: int, how: str) -> None:
    torch.manual_seed(batch * positions)
    q, k, v, mask = inputs(batch, positions, torch.bfloat16)
    assert applies(q, k, v, mask)
    fn = lambda q, k, v, m: decode_attention(q, k, v, m)  # noqa: E731
    if how == "compiled":
        fn = torch.compile(fn, fullgraph=True)
    elif how == "graphed":
        fn = cg.graph(fn, q, k, v, mask)
    expected = reference(q, k, v, mask, None)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    for _ in range(2):  # a graph's second replay too
        got = fn(q, k, v, mask)
        assert got.shape == q.shape and got.dtype == torch.bfloat16
        ours = (got.float() - expected).abs().max().item()
        theirs = (sdpa.float() - expected).abs().max().item()
        assert ours <= max(2 * theirs, 4e-3), (ours, theirs)


@pytest.mark.parametrize("positions", [168, MAX_POSITIONS])
def test_float32_equals_the_reference(positions: int) -> None:
    """Float32 blocks are narrower (shared memory): 256 positions take two."""
    torch.manual_seed(positions)
    q, k, v, mask = inputs(2, positions, torch.float32, heads=8, kv=2)
    got = decode_attention(q, k, v, mask, 0.2)
    torch.testing.assert_close(got, reference(q, k, v, mask, 0.2), rtol=1e-5, atol=1e-5)
    got = decode_attention(q, k, v, None)
    torch.testing.assert_close(got, reference(q, k, v, None, None), rtol=1e-5, atol=1e-5)


def test_where_it_does_not_apply_it_says_so() -> None:
    q, k, v, mask = inputs(1, MAX_POSITIONS + 8, torch.bfloat16)
    assert not applies(q, k, v, mask)
    q, k, v, mask = inputs(1, 64, torch.bfloat16)
    assert not applies(q.expand(1, 32, 2, 64), k, v, mask)  # a prefill: two query tokens
    assert not applies(q, k, v, mask.float())
    with pytest.raises(ValueError, match="use SDPA here"):
        decode_attention(q, k, v, mask.float())

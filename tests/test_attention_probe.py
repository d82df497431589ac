"""The grouped decode-attention kernel of ``benchmarks/experiments/attention_probe.py``, on the CPU under
Triton's interpreter: the same answers as a float32 masked SDPA over ``repeat_kv``, for caches
partly filled (rows of different lengths) and whole, split over several position blocks. The
GPU timing is the benchmark's; this checks the arithmetic it times."""

from __future__ import annotations

import textwrap

from triton_interpreter import needs_triton, run_under_interpreter

pytestmark = needs_triton

CHECK = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "benchmarks/experiments")
    import torch
    import attention_probe as probe

    torch.manual_seed(0)
    cases = [  # rows, query heads, key/value heads, positions, filled per row, dtype, tolerance
        (1, 8, 2, 37, [30], torch.float32, 1e-5),
        (2, 8, 4, 130, [130, 5], torch.float32, 1e-5),
        (3, 4, 1, 70, [1, 64, 70], torch.float32, 1e-5),
        (1, 8, 2, 100, [77], torch.float16, 2e-3),
    ]
    for rows, heads, kv, positions, filled, dtype, tolerance in cases:
        q = torch.randn(rows, heads, 1, 16, dtype=dtype)
        k = torch.randn(rows, kv, positions, 16, dtype=dtype)
        v = torch.randn(rows, kv, positions, 16, dtype=dtype)
        valid = torch.tensor(filled, dtype=torch.int32)
        got = probe.decode_attention(q, k, v, valid, block=32)
        error = (got.float() - probe.reference(q, k, v, valid)).abs().max().item()
        assert got.dtype == dtype and got.shape == q.shape, (got.dtype, got.shape)
        assert error <= tolerance, (rows, heads, kv, positions, filled, dtype, error)
    try:
        probe.decode_attention(q, k, v, valid.long())
    except ValueError as error:
        assert "int32" in str(error)
    else:
        raise AssertionError("int64 lengths were taken")
    print("ok")
    """
)


def test_the_grouped_kernel_matches_a_float32_masked_sdpa_under_the_interpreter() -> None:
    run_under_interpreter(CHECK)

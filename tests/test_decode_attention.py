"""The one-kernel decode attention (``decoding/attention.py``) on the CPU under
Triton's interpreter: the same answers as a float32 masked SDPA over ``repeat_kv`` for masks
with a filled prefix, holes (left padding), one mask shared by the rows, none, a row that
allows nothing, and NaN where no row attends (never read); queries strided as transformers
makes them. float32 and float16 only: the interpreter multiplies bf16 blocks wrongly (the
GPU test covers bf16)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_interpreter import LOOPS_OVER_ARGUMENTS, needs_triton, run_under_interpreter

from cudagraphs.decoding.attention import applies, decode_attention

CHECK = textwrap.dedent(
    """
    import torch
    from torch.nn import functional as F
    from cudagraphs.decoding import attention as da

    torch.manual_seed(0)
    def reference(q, k, v, mask, scale):
        group = q.shape[1] // k.shape[1]
        keys = k.float().repeat_interleave(group, dim=1)
        values = v.float().repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=mask, scale=scale)

    cases = [  # batch, heads, kv heads, positions, head size, dtype, tolerance, mask kind
        (1, 8, 2, 37, 16, torch.float32, 1e-5, "prefix"),
        (2, 8, 4, 130, 32, torch.float32, 1e-5, "holes"),
        (3, 4, 1, 70, 16, torch.float32, 1e-5, "none"),
        (2, 4, 4, 20, 16, torch.float32, 1e-5, "shared"),
        (1, 8, 2, 300, 16, torch.float32, 1e-5, "holes"),  # past one block: the running softmax
        (1, 32, 4, 168, 64, torch.float32, 1e-5, "prefix"),
        (2, 12, 3, 90, 64, torch.float16, 3e-3, "holes"),
    ]
    for batch, heads, kv, positions, size, dtype, tolerance, kind in cases:
        # the query as transformers makes it: [batch, 1, heads, d] transposed (not contiguous)
        q = torch.randn(batch, 1, heads, size, dtype=dtype).transpose(1, 2)
        cache_k = torch.randn(batch, kv, positions, size, dtype=dtype)
        cache_v = torch.randn(batch, kv, positions, size, dtype=dtype)
        if kind == "none":
            mask = None
        elif kind == "shared":
            mask = (torch.arange(positions) < positions - 3)[None, None, None, :]
        else:
            filled = torch.randint(1, positions + 1, (batch,))
            mask = torch.arange(positions)[None, :] < filled[:, None]
            if kind == "holes":  # left padding: the first positions of a row masked out
                mask &= torch.arange(positions)[None, :] >= torch.randint(0, 3, (batch, 1))
                mask[:, positions - 1] = True
            mask = mask[:, None, None, :]
        scale = size ** -0.5 * 1.3
        got = torch.ops.cudagraphs.decode_attention(q, cache_k, cache_v, mask, scale)
        expected = reference(q, cache_k, cache_v, mask, scale)
        assert got.dtype == dtype and got.shape == q.shape, (got.dtype, got.shape)
        error = (got.float() - expected).abs().max().item()
        assert error <= tolerance, (batch, heads, kv, positions, size, dtype, kind, error)
    # a row whose mask allows nothing: zeros, as SDPA gives
    q = torch.randn(2, 4, 1, 16); k = torch.randn(2, 2, 10, 16); v = torch.randn(2, 2, 10, 16)
    mask = torch.ones(2, 1, 1, 10, dtype=torch.bool); mask[1] = False
    got = torch.ops.cudagraphs.decode_attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(got, reference(q, k, v, mask, 0.25))
    assert (got[1] == 0).all() and not torch.isnan(got).any()
    # positions a row does not attend to are not read: NaN there leaves the answer as it was
    # (an engine row attends to its own length of a longer rung, over old rows' leftovers)
    q = torch.randn(3, 8, 1, 16); k = torch.randn(3, 2, 300, 16); v = torch.randn(3, 2, 300, 16)
    ends = torch.tensor([4, 70, 299])
    mask = (torch.arange(300)[None, :] <= ends[:, None])[:, None, None, :]
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for row, end in enumerate(ends.tolist()):
        poisoned_k[row, :, end + 1 :] = float("nan")
        poisoned_v[row, :, end + 1 :] = float("nan")
    got = torch.ops.cudagraphs.decode_attention(q, poisoned_k, poisoned_v, mask, 0.25)
    torch.testing.assert_close(got, reference(q, k, v, mask, 0.25))
    print("ok")
    """
)


@needs_triton
def test_kernel_equals_masked_sdpa_under_the_interpreter() -> None:
    run_under_interpreter(LOOPS_OVER_ARGUMENTS + "\nsys.path.insert(0, 'src')\n" + CHECK)


DECODER = textwrap.dedent(
    """
    import warnings
    import torch
    sys.path.insert(0, "tests")
    from llama_decode import tiny_llama, transformers_attention
    from cudagraphs.decoding import attention as da, grouped_attention as ga
    from cudagraphs.decoding.decoder import Decoder

    def on_the_cpu(q, k, v, mask):  # the kernel's conditions, the device aside
        return (
            q.shape[2] == 1 and k.shape[2] <= da.MAX_POSITIONS
            and (mask is None or mask.dtype == torch.bool)
        )

    class Counted:  # counts the kernel's launches (the operator runs outside the trace)
        def __init__(self, kernel):
            self.kernel, self.launches = kernel, 0
        def __getitem__(self, grid):
            self.launches += 1
            return self.kernel[grid]

    counted = Counted(da._kernel())
    da._kernel = lambda: counted
    da.applies = ga.applies = on_the_cpu
    warnings.simplefilter("ignore")
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    decoder = Decoder(model, max_batch=1, max_length=40, batch_sizes=[1], compile=True)
    assert decoder.stats.attention.startswith("grouped, one kernel"), decoder.stats.attention
    torch.manual_seed(9)
    for _ in range(2):  # a second request: the counters and the cache start over
        prompt = torch.randint(0, 512, (1, 6))
        got = decoder.generate(prompt, max_new_tokens=14, eos_token_id=None)
        with torch.no_grad(), transformers_attention(model):
            expected = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=14,
                min_new_tokens=14, do_sample=False,
            )
        assert torch.equal(got, expected), (got, expected)
    assert counted.launches >= 2 * 13 * 2, counted.launches  # layers x steps x requests
    print("ok")
    """
)


@needs_triton
@pytest.mark.slow
def test_a_compiled_decoder_with_the_kernel_gives_generates_tokens_under_the_interpreter() -> None:
    """The Decoder's compiled step of one shape, the kernel reading the cache in place (a
    prefix view of the full-size cache), the mask computed once and the position counters
    advanced at the step's end: float32 tokens equal ``generate``, two requests in a row."""
    run_under_interpreter(LOOPS_OVER_ARGUMENTS + "\nsys.path.insert(0, 'src')\n" + DECODER)


def test_on_the_cpu_it_does_not_apply_and_says_to_use_sdpa() -> None:
    q = torch.randn(1, 8, 1, 16)
    k = v = torch.randn(1, 2, 10, 16)
    assert not applies(q, k, v, None)
    try:
        decode_attention(q, k, v, None)
    except ValueError as error:
        assert "use SDPA here" in str(error)
    else:
        raise AssertionError("decode_attention ran on the CPU")

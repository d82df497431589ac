"""The folded layer kernels of ``benchmarks/experiments/layer_kernels_probe.py``, on the CPU under Triton's
interpreter: each gives what transformers' modules written in torch ops give (the same
roundings), for both norms and both gated activations, output sizes that do not fill the last
block of rows, and a whole chain of layers. The GPU timing is the benchmark's; this checks the
arithmetic it times."""

from __future__ import annotations

import textwrap

from triton_interpreter import needs_triton, run_under_interpreter

pytestmark = needs_triton

CHECK = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "benchmarks/experiments")
    import torch
    from torch.nn import functional as F
    import layer_kernels_probe as probe

    def close(got, want, tolerance, label):
        assert got.dtype == want.dtype and got.shape == want.shape, (label, got.shape, want.shape)
        error = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        assert error <= tolerance * scale, (label, error, scale)

    torch.manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)):
        k, n = 96, 40  # 40 rows: the last block of 16 is half full; 96 inputs: blocks of 64
        x = torch.randn(1, 1, k).to(dtype)
        g = (1 + 0.1 * torch.randn(k)).to(dtype)
        w = (torch.randn(n, k) / k**0.5).to(dtype)
        for plus_one in (False, True):
            got = probe.norm_matvec(x, g, 1e-6, w, plus_one=plus_one, block_k=64)
            want = F.linear(probe.rms_norm(x, g, 1e-6, plus_one), w)
            close(got, want, tolerance, ("norm_matvec", dtype, plus_one))
        residual = torch.randn(1, 1, n).to(dtype)
        got = probe.matvec_add(x, w, residual, block_k=64)
        close(got, residual + F.linear(x, w), tolerance, ("matvec_add", dtype))
        gate_up = torch.randn(1, 1, 2 * k).to(dtype)
        for act in probe.ACTIVATIONS:
            gate, up = gate_up.chunk(2, dim=-1)
            want = residual + F.linear(probe.act_fn(act)(gate) * up, w)
            got = probe.act_mul_matvec_add(gate_up, w, residual, act=act, block_k=64)
            close(got, want, tolerance, ("act_mul_matvec_add", dtype, act))

    # A chain of layers, folded against written out: the probe's two ways agree.
    layers = probe.random_layers(2, "cpu", torch.float32, hidden=64, mlp=96, qkv=96)
    x = torch.randn(1, 64)
    folded = probe.layer_chain(x, layers, 1e-5, folded=True)
    written = probe.layer_chain(x, layers, 1e-5, folded=False)
    close(folded, written, 1e-5, "chain")
    assert not torch.allclose(folded, x)  # the chain does something

    for call in (
        lambda: probe.matvec_add(torch.randn(2, 96), w.float(), torch.randn(2, 40)),
        lambda: probe.act_mul_matvec_add(torch.randn(1, 96), w.float(), torch.randn(1, 40)),
    ):
        try:
            call()
        except ValueError as error:
            assert "one contiguous row" in str(error), error
        else:
            raise AssertionError("a wrong input size was taken")
    try:
        probe.act_mul_matvec_add(torch.randn(1, 192), w.float(), torch.randn(1, 40), act="relu")
    except ValueError as error:
        assert "act must be one of" in str(error), error
    else:
        raise AssertionError("an unknown activation was taken")
    print("ok")
    """
)


def test_the_folded_kernels_give_the_modules_answers_under_the_interpreter() -> None:
    run_under_interpreter(CHECK)

"""``benchmarks/experiments/gemv_probe.py``'s wider tuning runs the library's one-row kernel: the plain
product and the gated down product (``[gate, up]`` in) equal the library's at the library's
interpreted block sizes and the model's own operations at any block shape, masks included, so
its timings compare the same arithmetic. Under Triton's interpreter, on the CPU."""

from __future__ import annotations

from triton_interpreter import LOOPS_OVER_ARGUMENTS, needs_triton, run_under_interpreter

CHECK = """
sys.path.insert(0, "benchmarks/experiments")
import triton
from torch.nn import functional as F
import gemv_probe
from cudagraphs.decoding import matvec as library

wide = gemv_probe.wide_matvec().tuned.fn  # the kernel under the autotuner: no timer here
torch.manual_seed(0)
n, k = 40, 300  # neither a multiple of the blocks: the masks are read
w = torch.randn(n, k, dtype=torch.bfloat16) / k**0.5
for gated in (False, True):
    x = torch.randn(1, 2 * k if gated else k, dtype=torch.bfloat16)
    got = torch.empty(1, n, dtype=torch.bfloat16)
    wide[(triton.cdiv(n, 16),)](x, w, got, n, k, gated, False, BLOCK_N=16, BLOCK_K=256)
    mine = library.gated_matvec(x, w) if gated else library.matvec(x, w)
    assert torch.equal(got, mine), (gated, (got - mine).abs().max())
    act = (F.silu(x[:, :k].float()).bfloat16() * x[:, k:]).float() if gated else x.float()
    torch.testing.assert_close(got.float(), F.linear(act, w.float()), rtol=2e-2, atol=2e-2)
    for rows, inputs in gemv_probe.WIDE_BLOCKS[:3]:  # other shapes sum in other orders
        other = torch.empty_like(got)
        wide[(triton.cdiv(n, rows),)](x, w, other, n, k, gated, False, BLOCK_N=rows, BLOCK_K=inputs)
        torch.testing.assert_close(other, got, rtol=2e-2, atol=2e-2)
print("ok")
"""


@needs_triton
def test_the_probe_s_wider_tuning_computes_the_library_s_products() -> None:
    run_under_interpreter(LOOPS_OVER_ARGUMENTS + "\nsys.path.insert(0, 'src')\n" + CHECK)

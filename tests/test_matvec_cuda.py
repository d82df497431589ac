"""The one-row Triton product on a GPU: equal to ``F.linear`` within half-precision rounding on
the decode shapes' proportions, and a fused Llama asked for it decodes as the plain one does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

pytestmark = pytest.mark.cuda

from cudagraphs.decoding.fused_projections import fuse_projections  # noqa: E402
from cudagraphs.decoding.matvec import applies, applies_gated, gated_matvec, matvec  # noqa: E402


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


PDL_CHAIN = """
import torch
from torch.nn import functional as F
from cudagraphs.decoding import matvec as mv
from cudagraphs.decoding.attention import decode_attention

if not mv.pdl(torch.device("cuda")):
    print("skip: programmatic dependent launch needs compute capability 9 or later")
    raise SystemExit(0)
torch.manual_seed(0)
k = 2048
weights = [torch.randn(k, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(6)]
keys = torch.randn(1, 4, 168, 64, device="cuda", dtype=torch.bfloat16)
values = torch.randn_like(keys)

def chain(x):  # each kernel reads what the one before it wrote, PDL launches back to back
    for w in weights[:3]:
        x = mv.matvec(x, w)
    query = x.view(1, 32, 1, 64)
    x = decode_attention(query, keys, values, None).reshape(1, k)
    for w in weights[3:5]:
        x = mv.matvec(x, w)
    gate_up = torch.cat([x, x * 0.5], dim=-1)  # a kernel of torch's own between
    return mv.gated_matvec(gate_up, weights[5])

def reference(x):
    x = x.float()
    for w in weights[:3]:
        x = F.linear(x, w.float()).bfloat16().float()
    query = x.view(1, 32, 1, 64)
    x = F.scaled_dot_product_attention(
        query, keys.float(), values.float(), enable_gqa=True
    ).reshape(1, k).bfloat16().float()
    for w in weights[3:5]:
        x = F.linear(x, w.float()).bfloat16().float()
    gate, up = x, (x.bfloat16() * 0.5).float()
    act = (F.silu(gate).bfloat16().float() * up).bfloat16().float()
    return F.linear(act, weights[5].float())

static = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):  # tuning and compiling before the capture
        chain(static)
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = chain(static)
for _ in range(20):  # a read before the write would see the last replay's values
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    static.copy_(x)
    graph.replay()
    expected = reference(x)
    scale = expected.abs().max().item()
    error = (out.float() - expected).abs().max().item()
    assert error <= 3e-2 * scale, (error, scale)
    eager = chain(x)
    assert (eager.float() - expected).abs().max().item() <= 3e-2 * scale
print("ok")
"""


def test_products_and_attention_launched_with_pdl_read_what_the_kernel_before_wrote() -> None:
    """With ``CUDAGRAPHS_PDL=1`` every one-row product and the decode attention is launched
    with programmatic dependent launch and waits for the kernel before it ahead of any load: a
    chain of them, each reading the last one's output, equals the model's operations in float32
    on fresh inputs, eagerly and replayed from a CUDA graph."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", PDL_CHAIN], cwd=root, capture_output=True, text=True, timeout=600,
        env={**os.environ, "CUDAGRAPHS_PDL": "1", "PYTHONPATH": str(root / "src")
             + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )  # fmt: skip
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if last.startswith("skip: "):
        pytest.skip(last[len("skip: ") :])
    assert done.returncode == 0 and last == "ok", done.stderr[-3000:]

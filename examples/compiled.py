"""torch.compile (Inductor's fusion) under cudagraphs (the thin replay path).

Compile with mode="default" or "max-autotune-no-cudagraphs", never "reduce-overhead" (that
records its own graphs). cg.graph's warm-up triggers compilation and autotuning; the capture
records the compiled kernels. Needs a GPU with Triton; on a CPU-only machine it says so.

    python examples/compiled.py
"""

import torch
from torch import nn

import cudagraphs as cg

if not torch.cuda.is_available():
    print("examples/compiled.py needs a CUDA GPU (Inductor's GPU kernels); nothing to do here.")
    raise SystemExit(0)

model = (
    nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 16))
    .cuda()
    .eval()
)
compiled = torch.compile(model, mode="max-autotune-no-cudagraphs")

with torch.no_grad():
    g = cg.graph(compiled, torch.randn(128, 256, device="cuda"), warmup=3)
    x = torch.randn(128, 256, device="cuda")
    torch.testing.assert_close(g(x), model(x), rtol=1e-4, atol=1e-4)
    print("compiled + graphed output matches eager;", g.stats)

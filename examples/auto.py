"""cg.auto: try the ways of graphing a model, verify each against eager, keep the fastest.

The model here reads a routing count on the host (``.tolist()``) inside one block, as
mixture-of-experts layers do: a plain graph cannot record it, so ``cg.auto`` also tries
segments (that block eager between two graphs) and the fusing backend, and reports each way.
Without a GPU it returns the model itself and says why.

    python examples/auto.py
"""

import torch

import cudagraphs as cg
from cudagraphs.tools.segment_workloads import RoutedModel

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
model = RoutedModel(64).to(device).eval()
x = torch.randn(8, 64, device=device)

with torch.no_grad():
    fast = cg.auto(model, x, candidates=["graph", "segments", "backend"])
    print(fast.report)  # eager's profile, the doctor's findings, one row per way
    steps = int(model.steps)
    fresh = torch.randn(8, 64, device=device)
    got = fast(fresh)
    # The model counts its calls in a buffer: deciding put it back, so one call moved it by one.
    assert int(model.steps) == steps + 1
    print("chosen:", fast.report.chosen, "| output", tuple(got.shape))

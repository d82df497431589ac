"""Segments: a model with a host decision in the middle, graphed around it.

The decision (flip the hidden state's sign when its mean is above a threshold) reads the GPU
from the host, so the whole model cannot be one graph. Marked with ``@cg.eager`` it runs eagerly
between two graphs at every call; the answer equals eager for both outcomes. Runs on a GPU; on
a CPU-only machine the graph is an eager pass-through behind the same checks.

    python examples/segments.py
"""

import torch

import cudagraphs as cg
from cudagraphs.tools.segment_workloads import DecisionMLP

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = DecisionMLP(width=256, layers=20).to(device).eval()
x = torch.randn(8, 256, device=device)

with torch.no_grad():
    g = cg.graph(model, x)
    for threshold, outcome in ((-1e9, "always flips"), (1e9, "never flips")):
        model.threshold.fill_(threshold)
        x = torch.randn(8, 256, device=device)
        error = (g(x) - model(x)).abs().max().item()
        print(f"decision {outcome}: max |g(x) - eager| = {error:.1e}")
    if device == "cuda":
        g.report()  # graph | eager flip_if_above | graph, with calls and host time
    else:
        print("no CUDA: ran eagerly (no segments recorded)")

    # Wrong: an eager step that returns a Python value for the graphed code to branch on.
    @cg.eager
    def positive(h: torch.Tensor) -> bool:
        return bool((h.mean() > 0).item())

    def branchy(h: torch.Tensor) -> torch.Tensor:
        return h * 2 if positive(h) else h

    if device == "cuda":
        try:
            cg.graph(branchy, x)
        except cg.SegmentError as error:
            print("refused:", str(error).splitlines()[0])

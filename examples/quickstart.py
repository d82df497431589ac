"""Quickstart: the 256-256-16 MLP, graphed; the three output policies; the errors you get instead
of wrong answers. Runs on a GPU; on a CPU-only machine it runs the eager pass-through.

    python examples/quickstart.py
"""

import torch
from torch import nn

import cudagraphs as cg

device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16)).to(device).eval()
x = torch.randn(128, 256, device=device)

with torch.no_grad():
    # Warm-up on a side stream and capture, now, on this example. x itself is never modified.
    g = cg.graph(model, x)
    y = g(torch.randn(128, 256, device=device))  # copy-in, one graph launch
    print("output", tuple(y.shape), "state", g.state.value)

    # Right: clone what you keep across calls (or capture with outputs="clone").
    kept = [g(torch.randn(128, 256, device=device)).clone() for _ in range(3)]

    # Feeding the graph's own input buffer costs no copy at all.
    g.inputs[0].copy_(torch.randn(128, 256, device=device))
    g(*g.inputs)
    print("stats", g.stats)

    # Wrong shape: refused with the path, the reason and the fix (never a silent broadcast).
    try:
        g(torch.randn(64, 256, device=device))
    except cg.InputMismatchError as error:
        print("refused:", str(error).splitlines()[0])

    if device == "cuda":
        # Wrong: keeping an output across calls. outputs="guarded" (the default) raises.
        a = g(torch.randn(128, 256, device=device))
        g(torch.randn(128, 256, device=device))
        try:
            a.sum()
        except RuntimeError as error:
            print("refused:", str(error)[:60], "...")

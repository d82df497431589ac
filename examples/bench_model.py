"""Profile first, then benchmark honestly: cg.profile and cg.bench on a small convolutional net.

``cg.profile`` says whether the model is launch-bound (how long the GPU idles between kernels)
and predicts what a graph saves; ``cg.bench`` then runs eager, torch.compile, reduce-overhead,
cudagraphs and cudagraphs over torch.compile side by side, each checked against eager first.
Without CUDA only eager can run; the report says so.

    python examples/bench_model.py
    python -m cudagraphs bench examples/bench_model.py:make --modes eager,cudagraphs --json out.json
"""

import torch
from torch import nn

import cudagraphs as cg


def make():
    """The CLI's entry point: returns (callable, args)."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers = []
    for cin, cout in [(3, 32), (32, 32), (32, 64), (64, 64)]:
        layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    return model.to(device).eval(), (torch.randn(1, 3, 64, 64, device=device),)


if __name__ == "__main__":
    model, args = make()
    with torch.no_grad():
        print(cg.profile(model, *args))
    # On a GPU every mode; "default" compile keeps this example quick (the bench default is
    # max-autotune-no-cudagraphs, which autotunes for minutes).
    modes = None if torch.cuda.is_available() else ["eager", "cudagraphs"]
    report = cg.bench(model, *args, modes=modes, compile_mode="default", calls=20, windows=3)
    from rich import print as rprint

    rprint(report)
    print(f"cudagraphs speed-up over eager: {report.speedup('cudagraphs') or 'n/a (no CUDA)'}")

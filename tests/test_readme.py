"""README examples that must run as written, on any machine."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import cudagraphs as cg

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_buckets_example_runs_without_cuda() -> None:
    start = README.index('device = "cuda" if torch.cuda.is_available()')
    block = README[start : README.index("```", start)].split("\n# Two symbols")[0]
    scope: dict = {"torch": torch, "cg": cg}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudaGraphsWarning)
        exec(compile(block, "README.md", "exec"), scope)
    assert scope["y"].shape == (37, 256)
    assert scope["g"].stats.hits[(64,)] == 1

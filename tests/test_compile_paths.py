"""Fusion and graphs together: ``cg.graph(..., compile=...)`` and the fusing ``cg.backend``,
on the CPU (the checks, and eager's answers through the pass-through)."""

from __future__ import annotations

import warnings

import pytest
import torch

import cudagraphs as cg


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune", "fast", 1])
def test_a_compile_mode_that_records_its_own_graphs_or_does_not_exist_is_refused(mode) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(cg.ConfigError, match="max-autotune-no-cudagraphs"):
        cg.graph(_model(), torch.randn(2, 8), compile=mode)


def test_compile_true_captures_the_compiled_model_and_answers_as_eager() -> None:
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudaGraphsWarning)  # no CUDA: the pass-through
        g = cg.graph(model, torch.randn(2, 8), compile=True)
    assert type(g.fn).__name__ == "OptimizedModule" and g.fn._orig_mod is model
    with torch.no_grad():
        x = torch.randn(2, 8)
        torch.testing.assert_close(g(x), model(x))
    decorated = cg.graph(compile="max-autotune-no-cudagraphs", warmup=1)(model)
    assert type(decorated.fn).__name__ == "OptimizedModule"


@pytest.mark.parametrize("fuse", [True, False])
def test_the_backend_answers_as_eager_fused_or_not(fuse: bool) -> None:
    model = _model()
    torch.compiler.reset()
    compiled = torch.compile(model, backend=cg.backend(fuse=fuse))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", cg.CudaGraphsWarning)
        for _ in range(3):
            x = torch.randn(2, 8)
            torch.testing.assert_close(compiled(x), model(x))


def test_the_backend_refuses_a_fuse_that_is_not_a_bool() -> None:
    with pytest.raises(cg.ConfigError, match="fuse must be True or False"):
        cg.backend(fuse="yes")

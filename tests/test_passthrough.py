"""The eager pass-through: without CUDA (or with CPU tensors) cg.graph runs fn behind the same checks."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import cudagraphs as cg
from cudagraphs.tools.workloads import MODELS

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the no-CUDA path")


def test_cpu_inputs_run_eagerly_with_one_warning() -> None:
    model = MODELS["mlp_256"][0]().eval()
    with pytest.warns(cg.CudaGraphsWarning, match="runs eagerly") as record:
        g = cg.graph(model, torch.randn(128, 256))
    assert len(record) == 1
    assert g.state is cg.State.EAGER and g.fallback_reason
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")  # no further warnings on calls
        for _ in range(3):
            x = torch.randn(128, 256)
            torch.testing.assert_close(g(x), model(x))
    assert g.stats.eager_calls == 3 and g.stats.replays == 0 and g.stats.calls == 3


def test_a_call_that_needs_gradients_raises_on_cpu_as_on_a_gpu() -> None:
    """Grad mode on and a parameter that requires grad: eager's output would carry a
    gradient path, a replay's would not; the pass-through refuses as the graph does."""
    model = torch.nn.Linear(8, 4)
    with pytest.warns(cg.CudaGraphsWarning):
        g = cg.graph(model, torch.randn(2, 8))
    with pytest.raises(cg.GradientsNotRecordedError, match=r"cg\.graph_autograd"):
        g(torch.randn(2, 8))
    with torch.no_grad():
        x = torch.randn(2, 8)
        torch.testing.assert_close(g(x), model(x))
    frozen = torch.nn.Linear(8, 4).requires_grad_(False)
    with pytest.warns(cg.CudaGraphsWarning):
        h = cg.graph(frozen, torch.randn(2, 8))
    with pytest.raises(cg.GradientsNotRecordedError, match="requires grad"):
        h(torch.randn(2, 8, requires_grad=True))  # an input that requires grad
    x = torch.randn(2, 8)
    torch.testing.assert_close(h(x), frozen(x))  # nothing requires grad: eager's answer


def test_passthrough_keeps_the_signature_checks() -> None:
    with pytest.warns(cg.CudaGraphsWarning):
        g = cg.graph(lambda x, k: x * k, torch.randn(4), 2)
    with pytest.raises(cg.InputMismatchError, match=r"args\[0\] has shape \(5,\)"):
        g(torch.randn(5), 2)
    with pytest.raises(cg.InputMismatchError, match=r"args\[1\] is 3"):
        g(torch.randn(4), 3)


def test_decorator_forms_are_lazy_then_eager_on_cpu() -> None:
    @cg.graph
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @cg.graph(warmup=5, outputs="clone")
    def triple(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    assert double.state is cg.State.LAZY and triple.options.warmup == 5
    x = torch.randn(3)
    with pytest.warns(cg.CudaGraphsWarning):
        torch.testing.assert_close(double(x), x * 2)
    with pytest.warns(cg.CudaGraphsWarning):
        torch.testing.assert_close(triple(x), x * 3)
    assert double.state is cg.State.EAGER
    assert double.__wrapped__.__name__ == "double"


def test_decorated_method_binds_per_instance() -> None:
    class Scale:
        def __init__(self, k: float) -> None:
            self.k = k

        @cg.graph
        def apply(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.k

    a, b = Scale(2.0), Scale(3.0)
    x = torch.ones(2)
    with pytest.warns(cg.CudaGraphsWarning):
        torch.testing.assert_close(a.apply(x), x * 2)
    with pytest.warns(cg.CudaGraphsWarning):
        torch.testing.assert_close(b.apply(x), x * 3)
    assert a.apply is a.apply and a.apply is not b.apply


def test_mutation_and_pytree_outputs_behave_as_eager() -> None:
    def fn(state: dict, *, step: int) -> dict:
        state["h"].add_(step)
        return {"h": state["h"], "sum": state["h"].sum(), "step": step}

    with pytest.warns(cg.CudaGraphsWarning):
        g = cg.graph(fn, {"h": torch.zeros(3)}, step=1)
    h = torch.zeros(3)
    out = g({"h": h}, step=1)
    torch.testing.assert_close(h, torch.ones(3))
    assert out["step"] == 1 and out["sum"].item() == 3


@needs_cpu_only
def test_no_cuda_reason_is_exposed() -> None:
    with pytest.warns(cg.CudaGraphsWarning, match="CUDA is not available"):
        g = cg.graph(lambda: torch.ones(1))
        g()
    assert g.fallback_reason == "CUDA is not available"


def test_options_are_validated_with_named_errors() -> None:
    fn = lambda x: x  # noqa: E731
    for kwargs, message in [
        ({"outputs": "copy"}, "outputs must be one of 'guarded', 'alias', 'clone'; got 'copy'"),
        ({"fallback": "ignore"}, "fallback must be one of"),
        ({"capture_error_mode": "strict"}, "capture_error_mode must be one of"),
        ({"warmup": -1}, "warmup must be an int >= 0"),
        ({"warmup": 2.5}, "warmup must be an int >= 0"),
        ({"pool": 7}, "pool must be a cg.Pool, a graph pool handle"),
        ({"stream": "s"}, "stream must be a torch.cuda.Stream"),
    ]:
        with pytest.raises(cg.ConfigError, match=message):
            cg.graph(fn, **kwargs)
    with pytest.raises(cg.ConfigError, match="expects a callable"):
        cg.graph(torch.zeros(1))
    assert issubclass(cg.ConfigError, RuntimeError)


def test_errors_share_one_root() -> None:
    for error in (cg.CaptureError, cg.ConfigError, cg.InputMismatchError, cg.StaleOutputError):
        assert issubclass(error, cg.CudaGraphsError) and issubclass(error, RuntimeError)


def test_public_api_is_exported() -> None:
    assert set(cg.__all__) >= {
        "graph",
        "Graphed",
        "CaptureError",
        "InputMismatchError",
        "StaleOutputError",
    }
    for name in cg.__all__:
        assert hasattr(cg, name), name


def test_passthrough_logs_nothing_at_warning_level(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="cudagraphs"), pytest.warns(cg.CudaGraphsWarning):
        cg.graph(lambda x: x + 1, torch.ones(1))
    assert not [r for r in caplog.records if r.name == "cudagraphs"]

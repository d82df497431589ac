"""On a GPU: a graph over torch.compile (``compile=True``) and the fusing backend answer as
eager does, keep the library's guards, and record Inductor's kernels in one graph layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cudagraphs as cg

pytestmark = pytest.mark.cuda


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale


class Pointwise(nn.Module):
    """A product and a chain of elementwise operations: one kernel each unfused."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(nn.functional.gelu(self.fc(x)) * 0.5 + 1.0)


@pytest.mark.parametrize("compile", [True, "max-autotune-no-cudagraphs"])
def test_a_graph_over_compile_answers_as_eager_and_guards_a_changed_value(compile) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    torch.compiler.reset()
    model = Scaled().cuda().eval()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(8, 64, device="cuda"), compile=compile)
        assert g.state is cg.State.CAPTURED
        for _ in range(3):
            x = torch.randn(8, 64, device="cuda")
            torch.testing.assert_close(g(x), model(x))
        model.scale = 2.0  # read by the compiled code at capture: guarded
        x = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(g(x), model(x))
        assert g.stats.recaptures == 1
        with torch.no_grad():
            model.net[0].weight.mul_(0.5)  # in place: seen by the next replay, no recapture
        torch.testing.assert_close(g(x), model(x))
        assert g.stats.recaptures == 1


@pytest.mark.parametrize("kind", ["child value", "helper global"])
def test_a_value_read_by_an_inlined_child_changed_after_capture_gives_eager_s_answer(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch.compile`` inlines the child's forward and its helper: their frames never run
    during the capture, and a changed child value or helper global must still be seen."""
    import value_cases

    torch.manual_seed(0)
    torch.compiler.reset()
    model = value_cases.Outer(64).cuda().eval()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(8, 64, device="cuda"), compile=True)
        if kind == "helper global":
            monkeypatch.setattr(value_cases, "GAIN", 0.5)
        else:
            model.inner.gain = 2.0
        x = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(g(x), model(x))  # not the recorded value's answer
        assert g.stats.recaptures == 1


@pytest.mark.parametrize("fuse", [True, False])
def test_the_backend_answers_as_eager_and_sees_in_place_updates(fuse: bool) -> None:
    torch.manual_seed(0)
    torch.compiler.reset()
    model = Scaled().cuda().eval()
    compiled = torch.compile(model, backend=cg.backend(fuse=fuse, warmup=1))
    with torch.no_grad():
        for step in range(5):  # the first call warms up, the next captures, then replays
            x = torch.randn(8, 64, device="cuda")
            torch.testing.assert_close(compiled(x), model(x))
            if step == 3:
                model.net[2].bias.add_(1.0)


def test_the_fused_backend_launches_fewer_kernels_than_the_unfused_one() -> None:
    """Fusion is real: Inductor's pieces launch fewer kernels per call than the traced aten
    operations (counted by the profiler on the first, eager calls)."""
    from torch.profiler import ProfilerActivity, profile

    counts = {}
    for fuse in (True, False):
        torch.manual_seed(0)
        torch.compiler.reset()
        model = nn.Sequential(*[Pointwise() for _ in range(4)]).cuda().eval()
        compiled = torch.compile(model, backend=cg.backend(fuse=fuse, warmup=3))
        x = torch.randn(8, 64, device="cuda")
        with torch.no_grad():
            compiled(x)  # compiles
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                compiled(x)  # a warm-up call: eager, so its kernels are seen one by one
                torch.cuda.synchronize()
        counts[fuse] = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    assert 0 < counts[True] < counts[False], counts

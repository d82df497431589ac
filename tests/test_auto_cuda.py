"""On a GPU: ``cg.auto`` verifies each way against eager, keeps a verified one, answers as
eager does, and a second decision for the same model comes from disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import value_cases
from torch import nn

import cudagraphs as cg

pytestmark = pytest.mark.cuda


def test_auto_keeps_a_verified_way_and_the_next_decision_comes_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDAGRAPHS_SAVED_STEPS_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)])
    model = model.cuda().eval()
    x = torch.randn(4, 64, device="cuda")
    with torch.no_grad():
        chosen = cg.auto(model, x, verify=2)
        report = chosen.report
        rows = {row.name: row for row in report.candidates}
        assert set(rows) == {"graph", "graph over compile", "segments", "backend", "buckets"}
        assert rows["buckets"].rejected == "no buckets= given"
        assert rows["segments"].rejected == "every step records: the same as graph"
        assert report.kernels_per_call and report.kernels_per_call >= 16  # 8 Linear + 8 GELU
        assert report.gpu_idle is not None and 0.0 <= report.gpu_idle <= 1.0
        assert any(row.verified for row in rows.values()), str(report)
        # Eager is a legitimate choice when no way timed faster (timing on a shared GPU is
        # not a unit test's verdict); a chosen way must be a verified one.
        assert report.chosen == "eager" or rows[report.chosen].verified, str(report)
        for _ in range(3):
            fresh = torch.randn(4, 64, device="cuda")
            torch.testing.assert_close(chosen(fresh), model(fresh))
        again = cg.auto(model, x)
        assert again.report.from_disk and again.report.chosen == report.chosen
        fresh = torch.randn(4, 64, device="cuda")
        torch.testing.assert_close(again(fresh), model(fresh))


def test_a_candidate_that_differs_from_eager_is_rejected_not_chosen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A function whose graph would freeze a host read: the plain graph is refused (or
    differs) and the report says why; whatever is chosen answers as eager."""

    class HostRead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            return y * 2 if y.sum().item() > 0 else y - 1

    monkeypatch.setenv("CUDAGRAPHS_SAVED_STEPS_DIR", str(tmp_path))
    model = HostRead().cuda().eval()
    x = torch.randn(4, 16, device="cuda")
    with torch.no_grad():
        chosen = cg.auto(model, x, reuse=False, verify=3)
        rows = {row.name: row for row in chosen.report.candidates}
        assert not rows["graph"].verified and rows["graph"].rejected
        for _ in range(4):
            fresh = torch.randn(4, 16, device="cuda")
            torch.testing.assert_close(chosen(fresh), model(fresh))


def test_segments_run_the_block_that_reads_the_host_eagerly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router that reads its counts on the host (``.tolist()``): the plain graph cannot
    record it; the segments candidate runs that module eagerly between two graphs, matches
    eager, and the state it advances (a step counter) moves as eagerly."""
    from cudagraphs.tools.segment_workloads import RoutedModel

    monkeypatch.setenv("CUDAGRAPHS_SAVED_STEPS_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = RoutedModel(64).cuda().eval()
    twin = RoutedModel(64).cuda().eval()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        chosen = cg.auto(model, x, verify=2, candidates=["graph", "segments"])
        rows = {row.name: row for row in chosen.report.candidates}
        assert not rows["graph"].verified and rows["graph"].rejected, str(chosen.report)
        assert rows["segments"].verified, str(chosen.report)
        assert chosen.report.chosen in ("segments", "eager")
        assert any(line.startswith(("host-sync", "cpu-tensor")) for line in chosen.report.findings)
        twin.load_state_dict(model.state_dict())  # the same step count as the auto'd model
        for _ in range(3):
            fresh = torch.randn(8, 64, device="cuda")
            torch.testing.assert_close(chosen(fresh), twin(fresh))
        assert int(model.steps) == int(twin.steps)


def test_deciding_leaves_the_state_the_function_advances_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Profiling and timing call the function hundreds of times; a running statistic it
    updates in place is put back, so the first real call answers as eager from the same state."""

    class Running(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 32)
            self.register_buffer("mean", torch.zeros(32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
            return self.fc(x - self.mean)

    monkeypatch.setenv("CUDAGRAPHS_SAVED_STEPS_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = Running().cuda().eval()
    twin = Running().cuda().eval()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        chosen = cg.auto(model, x, verify=2, candidates=["graph", "backend"])
        torch.testing.assert_close(model.mean, twin.mean)
        for _ in range(3):
            fresh = torch.randn(8, 32, device="cuda")
            torch.testing.assert_close(chosen(fresh), twin(fresh))


def _built_twice(model: nn.Module, x: torch.Tensor, key: str) -> Any:
    """``cg.auto``'s graph over compile of ``model`` built as two processes build it (Dynamo
    reset): traced by the first, loaded from disk by the second, which is returned."""
    from torch._dynamo.utils import counters

    from cudagraphs.tools import choosing as auto_module

    for traces in (1, 0):
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        g = auto_module._build("graph over compile", model, (x,), {}, None, key)
        assert g.state is cg.State.CAPTURED
        assert counters["stats"]["unique_graphs"] - before == traces
        fresh = torch.randn_like(x)
        torch.testing.assert_close(g(fresh), model(fresh))
    return g


def test_a_loaded_graph_over_compile_guards_the_values_the_model_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graph over a compile loaded from disk (a second process: Dynamo reset) traces
    nothing, answers as eager, and still captures again when a value the model's forward reads
    changes (its code, noted from an eager run, stands in for the loaded compile's), and sees
    in-place weight updates without a new capture."""
    from test_compile_paths_cuda import Scaled

    monkeypatch.setenv("CUDAGRAPHS_SAVED_STEPS_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = Scaled().cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        g = _built_twice(model, x, "test-key")
        model.scale = 2.0
        fresh = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(g(fresh), model(fresh))
        assert g.stats.recaptures == 1
        model.net[0].weight.mul_(0.5)  # in place: the next replay reads it
        torch.testing.assert_close(g(fresh), model(fresh))
        assert g.stats.recaptures == 1


def test_a_module_global_changed_after_a_loaded_graph_over_compile_is_replayed_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graph over a compile loaded from disk, then ``GAIN`` changed: the value guard
    captures again, and the new capture runs under ``torch.compile``'s guards, not the saved
    entry traced under the old value (eager's answer, every element)."""
    monkeypatch.setenv("CUDAGRAPHS_SAVED_STEPS_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = value_cases.Gained(64).cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        g = _built_twice(model, x, "gain-key")
        monkeypatch.setattr(value_cases, "GAIN", 3.0)
        fresh = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(g(fresh), model(fresh))
        assert g.stats.recaptures == 1


def test_a_model_attribute_holding_another_function_is_not_answered_by_a_saved_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two builds of one model class, the activation attribute ``torch.relu`` in the first
    and ``torch.tanh`` in the second (two processes: Dynamo reset): the second does not load
    the first's saved compile, whose guards could not name the function, and answers as
    eager."""
    from cudagraphs.tools import choosing as auto_module

    monkeypatch.setenv("CUDAGRAPHS_SAVED_STEPS_DIR", str(tmp_path))
    x = torch.randn(8, 8, device="cuda")
    with torch.no_grad():
        for activation in (torch.relu, torch.tanh):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = value_cases.HeldActivation(activation).cuda().eval()
            g = auto_module._build("graph over compile", model, (x,), {}, None, "act-key")
            assert g.state is cg.State.CAPTURED
            fresh = torch.randn(8, 8, device="cuda")
            torch.testing.assert_close(g(fresh), model(fresh))

"""Segments without a GPU: the marks, the options, and what the pass-through does with them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cudagraphs as cg
from cudagraphs.core.segments import is_eager
from cudagraphs.tools.segment_workloads import DecisionMLP, RoutedModel, flip_if_above

cpu_quiet = pytest.mark.filterwarnings("ignore::cudagraphs.CudaGraphsWarning")


def test_eager_marks_and_keeps_the_function() -> None:
    assert is_eager(flip_if_above)
    assert flip_if_above.__name__ == "flip_if_above"
    h = torch.ones(2, 3)
    flip_if_above(h, torch.tensor(0.0))  # outside a capture: an ordinary call
    assert torch.equal(h, -torch.ones(2, 3))
    with pytest.raises(TypeError, match="expects a function"):
        cg.eager(3)  # type: ignore[arg-type]


@cpu_quiet
@torch.no_grad()
def test_pass_through_runs_the_eager_step_like_eager() -> None:
    torch.manual_seed(0)
    model = DecisionMLP(width=32, layers=4)
    x = torch.randn(4, 32)
    g = cg.graph(model, x)
    for threshold in (-1e9, 1e9):
        model.threshold.fill_(threshold)
        torch.testing.assert_close(g(x), model(x))
    assert g.segments == [] and g.stats.gaps == 0  # nothing was recorded on a CPU


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"segments": "auto"}, "segments must be one of"),
        ({"eager": [3]}, "eager must be a list of modules or module classes"),
        ({"eager": "router"}, "eager must be a list"),
        ({"segmnets": "split"}, "did you mean segments="),
    ],
)
def test_segment_options_are_checked(options: dict, match: str) -> None:
    with pytest.raises(cg.ConfigError, match=match):
        cg.graph(RoutedModel(), torch.randn(2, 64), **options)


@torch.no_grad()
def test_eager_class_that_matches_nothing_is_refused(stand_in: None) -> None:
    model = RoutedModel()
    with pytest.raises(cg.ConfigError, match=r"eager=\[Conv2d\] matches no module"):
        cg.graph(model, torch.randn(2, 64), eager=[torch.nn.Conv2d])


@cg.eager
def _decide(h: torch.Tensor) -> None:
    if h.mean().item() > 0:  # the line the doctor names
        h.neg_()


def _step(x: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ x.T)
    _decide(h)
    return h * 2


def test_doctor_lists_an_eager_step_as_a_split_point() -> None:
    report = cg.doctor(_step, torch.randn(4, 4))
    assert not report.blocking
    [finding] = report.findings
    assert finding.kind == "split-point" and finding.severity == "info"
    assert finding.filename == __file__ and "_decide()" in finding.message
    lines = Path(__file__).read_text().splitlines()
    line = next(i for i, t in enumerate(lines, 1) if "the line the doctor names" in t)
    assert finding.lineno == line


def test_doctor_still_blocks_an_unmarked_host_read() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum().item() > 0 else x

    report = cg.doctor(step, torch.randn(4))
    assert report.blocking and any(f.kind == "host-sync" for f in report.findings)

"""What a newcomer on a machine without CUDA sees: CUDA-only entry points say so in one line,
the doctor suggests what works here (one finding per cause, at the user's line), and no example
calls an eager CPU run a graph."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

import cudagraphs as cg

ROOT = Path(__file__).resolve().parents[1]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the machine-without-CUDA branch")


@no_cuda
def test_cuda_only_entry_points_raise_one_line_errors() -> None:
    model = nn.Linear(2, 2)
    calls = [
        lambda: cg.capture_stream(),
        lambda: cg.make_graph_safe(torch.optim.Adam(model.parameters())),
        lambda: cg.ddp(model),
    ]
    for call in calls:
        with pytest.raises(cg.CudaRequiredError) as info:
            call()
        assert isinstance(info.value, cg.CudaGraphsError)
        assert "\n" not in str(info.value) and "needs a CUDA GPU" in str(info.value)


@no_cuda
def test_the_doctor_on_a_plain_adam_step_gives_one_finding_whose_fix_works_here() -> None:
    model = nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    report = cg.doctor(step, torch.randn(2, 8))
    assert [f.kind for f in report.findings] == ["optimizer"], str(report)
    assert "capturable=True" not in report.findings[0].fix  # would crash on CPU parameters
    graphed = cg.train_step(step, optimizer=opt)  # what the fix says: it just runs here
    with pytest.warns(cg.CudaGraphsWarning):
        graphed(torch.randn(2, 8))
    assert graphed.stats.eager_calls == 1


def test_a_module_state_write_is_reported_at_the_users_line() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).train()
    line = sys._getframe().f_lineno + 1
    report = cg.doctor(model, torch.randn(4, 8))
    writes = [f for f in report.findings if f.kind == "state-write"]
    assert writes and all(f.filename == __file__ and f.lineno == line for f in writes)


@pytest.mark.slow
@no_cuda
def test_no_example_calls_an_eager_cpu_run_a_graph() -> None:
    """Every example runs without a GPU (two at a time), says so where it would graph, and
    prints no speed-up: without CUDA both sides of a ratio are eager runs."""
    graph_words = re.compile(r"graphed|one launch|capture of", re.IGNORECASE)
    speedup = re.compile(r"\(\d+(\.\d+)?\s*[x×]\)|\d(\.\d+)?\s*[x×] (faster|the)", re.IGNORECASE)

    def run(example: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(example)], capture_output=True, text=True, timeout=300, cwd=ROOT
        )

    examples = sorted((ROOT / "examples").glob("*.py"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(run, examples))
    assert examples
    for example, proc in zip(examples, runs):
        assert proc.returncode == 0, (example.name, proc.stderr[-2000:])
        for line in proc.stdout.splitlines():
            if graph_words.search(line) and "no cuda" not in line.lower():
                raise AssertionError(f"{example.name}: {line!r} calls an eager run a graph")
            if speedup.search(line):
                raise AssertionError(f"{example.name}: {line!r} shows an eager-eager speed-up")


@pytest.mark.slow
def test_the_http_example_says_how_to_start_it() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "serve_http.py")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0
    assert "python -m cudagraphs serve examples/serve_http.py:make" in proc.stdout

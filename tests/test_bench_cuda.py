"""cg.profile and cg.bench on a real GPU: every mode runs, matches eager and is measured."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

import cudagraphs as cg
from cudagraphs.tools.benchmarking import MODES
from cudagraphs.tools.workloads import mlp_256

pytestmark = pytest.mark.cuda


def test_profile_counts_kernels_and_measures_the_replay() -> None:
    torch.manual_seed(0)
    model = mlp_256().cuda().eval()
    with torch.no_grad():
        p = cg.profile(model, torch.randn(128, 256, device="cuda"), replay=True)
    assert p.kernels_per_call >= 2  # two GEMMs at least
    assert 0 < p.gpu_busy_us < p.wall_us and p.cpu_us > 0 and p.graph_call_us > 0
    assert p.replay_gpu_us is not None and p.replay_busy_us is not None
    assert 0 < p.replay_busy_us <= p.replay_gpu_us  # kernels' sum within the replay's span
    assert p.top_kernels and p.recommendation


def test_bench_runs_every_mode_and_checks_it_against_eager() -> None:
    torch.manual_seed(0)
    model = (
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
        .cuda()
        .eval()
    )
    report = cg.bench(
        model,
        torch.randn(16, 64, device="cuda"),
        compile_mode="default",  # max-autotune would spend minutes autotuning in a unit test
        calls=10,
        windows=2,
        console=Console(file=io.StringIO()),
    )
    assert [r.mode for r in report.results] == list(MODES)
    for result in report.results:
        assert result.ok, (result.mode, result.error)
        assert result.max_abs_error is not None and result.max_abs_error < 1e-3
        assert result.latency is not None and result.latency.median > 0
        assert result.setup_s is not None and result.extra_memory_bytes is not None
    assert report["cudagraphs"].break_even_calls is not None
    assert report.profile is not None and report.profile.replay_gpu_us is not None

"""cg.bench, cg.profile and `python -m cudagraphs bench` on the CPU: data, formatting, files, CLI."""

from __future__ import annotations

import io
import json
import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from rich.console import Console

import cudagraphs as cg
from cudagraphs.tools.benchmarking import _break_even
from cudagraphs.tools.cli import main
from cudagraphs.tools.profiling import Profile
from cudagraphs.tools.report import BenchReport, ModeResult, Spread

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only branch")


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


@cpu_only
def test_bench_on_cpu_times_eager_and_says_why_graph_modes_are_skipped() -> None:
    model = mlp()
    report = cg.bench(
        model, torch.randn(8, 16), modes=["cudagraphs"], calls=5, windows=2, console=quiet()
    )
    assert [r.mode for r in report.results] == ["eager", "cudagraphs"]  # eager is always the base
    eager = report["eager"]
    assert (
        eager.ok
        and eager.wall is not None
        and eager.wall.p10 <= eager.wall.median <= eager.wall.p90
    )
    assert eager.latency is None and eager.max_abs_error == 0.0 and eager.cpu_us > 0
    assert report["cudagraphs"].error == "needs CUDA"
    assert any("no CUDA" in note for note in report.notes)
    assert report.profile is not None and report.profile.device == "cpu"
    assert (
        report.profile.kernels_per_call == 0
        and "need an NVIDIA GPU" in report.profile.recommendation
    )
    assert report.speedup("eager") == pytest.approx(1.0)
    with pytest.raises(KeyError, match="no mode 'compile'"):
        report["compile"]


def test_extra_modes_are_checked_against_eager_before_timing() -> None:
    model = mlp()
    right = model.forward
    wrong = lambda x: model(x) + 1  # noqa: E731
    report = cg.bench(
        model,
        torch.randn(8, 16),
        modes=["eager"],
        extra_modes={"right": right, "wrong": wrong},
        calls=3,
        windows=1,
        profile=False,
        console=quiet(),
    )
    assert report["right"].ok and report["right"].max_abs_error == 0.0
    assert report["right"].break_even_calls is not None
    assert "differs from eager" in report["wrong"].error and report["wrong"].wall is None
    unchecked = cg.bench(
        model,
        torch.randn(8, 16),
        modes=["eager"],
        extra_modes={"wrong": wrong},
        check=False,
        calls=3,
        windows=1,
        profile=False,
        console=quiet(),
    )
    assert unchecked["wrong"].ok and "outputs not compared (check=False)" in unchecked.notes


def test_a_mode_that_raises_is_reported_not_fatal() -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("no good")

    report = cg.bench(
        mlp(),
        torch.randn(8, 16),
        modes=["eager"],
        extra_modes={"broken": broken},
        calls=2,
        windows=1,
        profile=False,
        console=quiet(),
    )
    assert report["broken"].error == "ValueError: no good"
    assert "failed: ValueError: no good" in report.markdown()


@pytest.mark.parametrize("modes", [["fast"], "eager", ["eager", "torch.compile"]])
def test_bad_modes_are_named(modes) -> None:
    with pytest.raises(cg.ConfigError, match="modes must be a list drawn from"):
        cg.bench(mlp(), torch.randn(2, 16), modes=modes)


def test_spread_percentiles() -> None:
    spread = Spread.of([float(v) for v in range(1, 12)])  # 1..11
    assert (spread.p10, spread.median, spread.p90) == (2.0, 6.0, 10.0)
    assert str(spread) == "6.0 (2.0-10.0)"
    assert all(math.isnan(v) for v in vars(Spread.of([])).values())


def synthetic() -> BenchReport:
    eager = ModeResult(
        "eager",
        max_abs_error=0.0,
        wall=Spread(90, 100, 120),
        latency=Spread(80, 95, 110),
        cpu_us=60,
        throughput_us=70,
        setup_s=0.0,
        extra_memory_bytes=0,
    )
    fast = ModeResult(
        "cudagraphs",
        max_abs_error=1e-6,
        wall=Spread(40, 50, 60),
        latency=Spread(30, 45, 50),
        cpu_us=8,
        throughput_us=20,
        setup_s=1.0,
        extra_memory_bytes=3 * 2**20,
    )
    slow = ModeResult(
        "compile",
        max_abs_error=2e-6,
        wall=Spread(100, 110, 130),
        latency=Spread(90, 105, 120),
        cpu_us=70,
        throughput_us=80,
        setup_s=20.0,
        extra_memory_bytes=0,
    )
    failed = ModeResult("reduce-overhead", error="RuntimeError: boom")
    results = {r.mode: r for r in (eager, fast, slow, failed)}
    _break_even(results)
    profile = Profile(
        name="mlp",
        device="GPU X",
        calls=10,
        kernels_per_call=5,
        gpu_busy_us=20.0,
        wall_us=100.0,
        cpu_us=60.0,
        graph_call_us=15.0,
        replay_gpu_us=21.0,
        top_kernels=[("gemm", 2.0, 15.0)],
    )
    return BenchReport(
        name="mlp",
        device="GPU X",
        torch_version="2.x",
        input_sets=4,
        results=list(results.values()),
        profile=profile,
    )


def test_break_even_is_setup_over_saving() -> None:
    report = synthetic()
    assert report["cudagraphs"].break_even_calls == pytest.approx(1.0 / 50e-6)
    assert math.isinf(report["compile"].break_even_calls)  # slower than eager: never pays back
    assert report.speedup("cudagraphs") == pytest.approx(2.0)


def test_report_formats_as_table_markdown_and_json(tmp_path: Path) -> None:
    report = synthetic()
    md = report.markdown()
    assert "| mode | wall µs [p10-p90] |" in md
    assert "| cudagraphs | 50.0 [40-60] | 45.0 | 8.0 | 20.0 | 2.00× | 1.00 | 3.0 | 20,000 |" in md
    assert "| compile |" in md and "| never |" in md and "failed: RuntimeError: boom" in md
    assert "kernel floor 20.0 µs/call (5 kernels)" in md and "Profile: Graph it" in md
    console = Console(record=True, width=250)
    console.print(report)
    text = console.export_text()
    assert "cg.bench: mlp on GPU X" in text and "20,000" in text
    data = json.loads(report.to_json(tmp_path / "sub" / "bench.json").read_text())
    assert data["kernel_floor_us"] == 20.0
    modes = {r["mode"]: r for r in data["results"]}
    assert modes["compile"]["break_even_calls"] == "inf"  # JSON has no infinity
    assert modes["cudagraphs"]["wall"] == {"p10": 40, "median": 50, "p90": 60}
    assert data["profile"]["predicted_speedup"] == pytest.approx(100 / 35)


@pytest.mark.parametrize("width", [60, 100])
def test_tables_are_never_cut_on_a_narrow_page(width: int) -> None:
    # A cell rich would end with "…" on a page narrower than the table wraps instead, so a
    # report read in a terminal, a pipe or a file keeps every figure whole.
    report = synthetic()
    console = Console(file=io.StringIO(), width=width)
    console.print(report)
    console.print(report.profile)
    text = console.file.getvalue()
    assert "…" not in text
    # Wrapped cells are split across lines inside their column: every character is still there.
    for whole in ("50.0 [40-60]", "20,000", "failed: RuntimeError: boom"):
        assert Counter(whole.replace(" ", "")) <= Counter(text), (whole, text)
    wide = Console(file=io.StringIO(), width=250)
    wide.print(report)
    assert "50.0 [40-60]" in wide.file.getvalue()


def test_plot_writes_a_png_and_explains_a_missing_matplotlib(tmp_path: Path, monkeypatch) -> None:
    path = synthetic().plot(tmp_path / "bench.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(cg.ConfigError, match=r"pip install -e '\.\[plot\]'"):
        synthetic().plot(tmp_path / "again.png")


@pytest.mark.parametrize(
    ("busy", "wall", "expected"),
    [
        (90.0, 100.0, "Not worth it: the GPU is busy 90%"),
        (20.0, 200.0, "Graph it: the GPU idles 90%"),
        (50.0, 80.0, "Modest gain"),
    ],
)
def test_profile_recommendation_follows_the_measurements(
    busy: float, wall: float, expected: str
) -> None:
    p = Profile(
        name="f",
        device="GPU",
        calls=5,
        kernels_per_call=10,
        gpu_busy_us=busy,
        wall_us=wall,
        cpu_us=wall / 2,
        graph_call_us=10.0,
    )
    assert p.recommendation.startswith(expected)
    assert p.gpu_idle_fraction == pytest.approx(1 - busy / wall)
    assert p.predicted_speedup == pytest.approx(wall / (busy + 10.0))
    assert "kernel floor" in str(p) and p.as_dict()["recommendation"] == p.recommendation
    none = Profile(
        name="f",
        device="GPU",
        calls=5,
        kernels_per_call=0,
        gpu_busy_us=0,
        wall_us=5,
        cpu_us=5,
        graph_call_us=10,
    )
    assert (
        none.recommendation.startswith("Nothing runs on the GPU") and none.predicted_speedup == 1.0
    )


@cpu_only
def test_profile_on_cpu_measures_wall_and_cpu_time() -> None:
    p = cg.profile(mlp(), torch.randn(8, 16), calls=5)
    assert p.device == "cpu" and p.calls == 5 and p.wall_us > 0 and p.cpu_us > 0
    assert p.kernels_per_call == 0 and p.replay_gpu_us is None


TARGET = """
import torch

def make():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    return model, (torch.randn(8, 16),)

def not_a_pair():
    return 42
"""


@cpu_only
def test_cli_bench_writes_json_and_plot(tmp_path: Path, capsys) -> None:
    target = tmp_path / "target.py"
    target.write_text(TARGET)
    code = main(
        [
            "bench",
            f"{target}:make",
            "--modes",
            "eager,cudagraphs",
            "--calls",
            "3",
            "--windows",
            "1",
            "--json",
            str(tmp_path / "r.json"),
            "--plot",
            str(tmp_path / "r.png"),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "cg.bench" in out and "skipped" in out and "wrote" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["name"] == f"{target}:make" and [r["mode"] for r in data["results"]] == [
        "eager",
        "cudagraphs",
    ]
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--modes", "eager,fastest"], "--modes: unknown ['fastest']"),
        (["--calls", "0"], "--calls and --windows must be at least 1"),
        (["--plot", "chart.svg"], "--plot writes a PNG"),
    ],
)
def test_cli_bench_refuses_bad_arguments(
    tmp_path: Path, capsys, extra: list[str], message: str
) -> None:
    target = tmp_path / "target.py"
    target.write_text(TARGET)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", f"{target}:make", *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nofile.py:make", "nofile.py: no such file"),
        ("{dir}/target.py:missing", "has no function 'missing'"),
        ("{dir}/target.py:not_a_pair", "must return (callable, args)"),
        ("justaname", "target must be FILE.py:FUNC"),
    ],
)
def test_cli_bench_target_errors(tmp_path: Path, capsys, target: str, message: str) -> None:
    (tmp_path / "target.py").write_text(TARGET)
    with pytest.raises(SystemExit):
        main(["bench", target.format(dir=tmp_path)])
    assert message in capsys.readouterr().err


def test_markdown_table_keeps_one_column_per_header() -> None:
    import re

    report = cg.bench(lambda x: x * 2, torch.randn(4), modes=["eager"], calls=2, windows=1)
    lines = [line for line in report.markdown().splitlines() if line.startswith("|")]
    columns = {len(re.split(r"(?<!\\)\|", line)) for line in lines}
    assert len(columns) == 1, lines[:3]  # max |err| is escaped, not a column break
    assert "max \\|err\\|" in lines[0]

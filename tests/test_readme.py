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


def _figures_script():  # type: ignore[no-untyped-def]
    import importlib.machinery
    import importlib.util

    path = str(Path(__file__).resolve().parents[1] / "scripts" / "readme-figures")
    loader = importlib.machinery.SourceFileLoader("readme_figures", path)
    spec = importlib.util.spec_from_loader("readme_figures", loader)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    loader.exec_module(module)
    return module


def test_the_figure_tables_match_the_gpu_report() -> None:
    figures = _figures_script()
    root = Path(__file__).resolve().parents[1]
    report = (root / "reports" / "gpu.md").read_text()
    for page in (root / "README.md", root / "docs" / "performance.md"):
        text = page.read_text()
        assert "<!-- figures:" in text
        assert figures.render(text, report) == text, f"{page.name}: run scripts/readme-figures"


def test_a_figure_that_drifts_from_its_report_is_caught() -> None:
    figures = _figures_script()
    report = (Path(__file__).resolve().parents[1] / "reports" / "gpu.md").read_text()
    start = README.index("<!-- figures:headline -->")
    row = README.index("| MLP 256-256-16", start)
    drifted = README.replace(README[row : README.index("\n", row)], "| MLP 256-256-16 | 1 | 2 |")
    assert figures.render(drifted, report) != drifted

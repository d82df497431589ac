"""scripts/gpu-check's report of a test run: each failure named, and where it stopped."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(ROOT / "scripts/gpu-check"))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_a_failure_is_named_with_where_it_stopped_and_its_message() -> None:
    """From pytest's ``-rfEs --tb=line`` output: the FAILED line, then the failure's last frame
    with its message; passing tests' output and warnings add nothing."""
    lines = [
        "..........F.....",
        "/work/main/tests/test_decoder_cuda.py:110: AssertionError: assert (7 == 4)",
        "tests/test_footguns.py::test_doctor",
        "  /opt/venv/lib/python3.12/site-packages/torch/x.py:12: UserWarning: something",
        "FAILED tests/test_decoder_cuda.py::test_steps_loaded_from_disk",
        "1 failed, 282 passed in 200.40s",
    ]
    got = _gpu_check().outcomes(lines, ("FAILED", "ERROR"))
    assert got == [
        "  - `FAILED tests/test_decoder_cuda.py::test_steps_loaded_from_disk`",
        "  - where: `/work/main/tests/test_decoder_cuda.py:110: AssertionError: assert (7 == 4)`",
    ]
    assert _gpu_check().outcomes(["1 passed in 1.0s"], ("FAILED",)) == []

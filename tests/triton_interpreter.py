"""Running a benchmark's Triton kernels on the CPU, under Triton's interpreter, in a fresh
process (the interpreter is chosen when Triton is imported): the shared part of the kernel
tests. Skipped where Triton is not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="needs triton (its interpreter runs on the CPU)",
)


def run_under_interpreter(code: str) -> None:
    """Run ``code`` from the repository root with ``TRITON_INTERPRET=1``; it must exit 0 and
    print ``ok`` last."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]

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
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode == 0 and last.startswith("skip: "):
        pytest.skip(last[len("skip: ") :])
    assert done.returncode == 0 and last == "ok", done.stderr[-3000:]


#: Code that ends the check with "skip: ..." where this Triton's interpreter cannot run a loop
#: whose bound is a kernel argument (Triton 3.6 with NumPy 2); compiled kernels on a GPU can.
LOOPS_OVER_ARGUMENTS = """
import sys
import torch
import triton
import triton.language as tl

@triton.jit
def _loop(out_ptr, n):
    total = 0.0
    for _ in range(0, n, 4):
        total += 1.0
    tl.store(out_ptr, total)

try:
    _loop[(1,)](torch.zeros(1), 10)
except Exception as error:
    print(f"skip: Triton {triton.__version__}'s interpreter cannot loop over a kernel "
          f"argument ({type(error).__name__}); the GPU tests run the compiled kernel")
    sys.exit(0)
"""

"""The command line, run as a new user would (in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="200")  # rich wraps at the terminal width
    return subprocess.run(
        [sys.executable, "-m", "cudagraphs", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only branch of the demo")
def test_demo_without_cuda_explains_and_exits_zero() -> None:
    proc = cli("demo")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "CUDA is not available" in out
    assert "pass-through output equals eager: True" in out
    assert "InputMismatchError: args[0] has shape (64, 256)" in out


@pytest.mark.cuda
def test_demo_on_gpu_prints_the_table() -> None:
    proc = cli("demo", "--calls", "20", "--windows", "2")
    assert proc.returncode == 0, proc.stderr
    assert "brief MLP" in proc.stdout and "transformer" in proc.stdout
    assert "StaleOutputError" in proc.stdout


def test_bad_arguments_are_refused_with_usage() -> None:
    proc = cli("demo", "--calls", "0")
    assert proc.returncode == 2 and "--calls and --windows must be at least 1" in proc.stderr
    proc = cli("nonsense")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr

"""The command line, run as a new user would (in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    assert "MLP 256-256-16" in proc.stdout and "transformer" in proc.stdout
    assert "StaleOutputError" in proc.stdout


def test_bad_arguments_are_refused_with_usage() -> None:
    proc = cli("demo", "--calls", "0")
    assert proc.returncode == 2 and "--calls and --windows must be at least 1" in proc.stderr
    proc = cli("nonsense")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


@pytest.mark.parametrize(
    ("source", "target", "message"),
    [
        ("def make(:\n", "make", "syntax error"),
        ("raise ValueError('no model here')\n", "make", "ValueError: no model here"),
        ("def step(x):\n    return x\n", "step", "it is the function itself, not a maker"),
        ("def make():\n    return 3, 4, 5, 6\n", "make", "must return (callable, args)"),
        ("def make():\n    raise KeyError('weights')\n", "make", "make() raised KeyError"),
        ("x = 1\n", "make", "has no function 'make'"),
    ],
)
def test_target_mistakes_are_one_line_with_exit_code_2(
    tmp_path: Path, source: str, target: str, message: str
) -> None:
    path = tmp_path / "target.py"
    path.write_text(source)
    for command in ("doctor", "bench"):
        proc = cli(command, f"{path}:{target}")
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
        assert f"usage: python -m cudagraphs {command}" in proc.stderr  # the subcommand's usage


def test_a_non_python_path_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.txt"
    path.write_text("")
    proc = cli("doctor", f"{path}:make")
    assert proc.returncode == 2 and "not a .py file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_version_and_help_on_every_option() -> None:
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("cudagraphs ")
    for command in ("demo", "bench", "doctor"):
        text = cli(command, "--help").stdout
        options = [w for w in text.split() if w.startswith("--") and w != "--help"]
        assert options or command == "doctor"
    bench_help = cli("bench", "--help").stdout
    for option in ("--modes", "--compile-mode", "--calls", "--windows", "--json", "--plot"):
        assert option in bench_help
    assert "torch.compile mode" in bench_help

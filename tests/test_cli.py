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
    # It says which of its four uses ran, and why the other three did not.
    assert "Of the demo's 4 uses, ran here: MLP 256-256-16" in out
    assert "Not run here: transformer inference, training step, RL rollout (128 steps)" in out
    assert "without CUDA there is no graph to time" in out


@pytest.mark.cuda
def test_demo_on_gpu_prints_the_table() -> None:
    proc = cli("demo", "--calls", "20", "--windows", "2")
    assert proc.returncode == 0, proc.stderr
    assert "MLP 256-256-16" in proc.stdout and "transformer" in proc.stdout
    assert "StaleOutputError" in proc.stdout


@pytest.mark.slow
def test_bad_arguments_are_refused_with_usage() -> None:
    proc = cli("demo", "--calls", "0")
    assert proc.returncode == 2 and "--calls and --windows must be at least 1" in proc.stderr
    proc = cli("nonsense")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "target", "message"),
    [
        ("def step(x):\n    return x\n", "step", "it is the function itself, not a maker"),
        ("def make():\n    return 3, 4, 5, 6\n", "make", "must return (callable, args)"),
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


@pytest.mark.parametrize(
    ("source", "message", "line"),
    [
        ("def make(:\n", "syntax error", 1),
        ("raise ValueError('no model here')\n", "ValueError: no model here", 1),
        ("def make():\n    raise KeyError('weights')\n", "make() raised KeyError", 2),
        (
            "def boom(x):\n    raise RuntimeError('inside the function')\n"
            "def make():\n    return boom, (1,)\n",
            "RuntimeError: inside the function",
            2,
        ),
    ],
)
@pytest.mark.slow
def test_the_users_own_code_raising_is_one_line_with_exit_code_3(
    tmp_path: Path, source: str, message: str, line: int
) -> None:
    path = tmp_path / "target.py"
    path.write_text(source)
    for command in ("doctor", "bench"):
        proc = cli(command, f"{path}:make")
        assert proc.returncode == 3, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        if "syntax error" not in message:
            assert f"{path}:{line}" in proc.stderr  # the user's frame
    # --traceback: the commands share the handler that prints it (tools/cli.py: main).
    full = cli("doctor", "--traceback", f"{path}:make")
    assert full.returncode == 3 and "Traceback" in full.stderr


@pytest.mark.slow
def test_piped_tables_keep_whole_column_names(tmp_path: Path) -> None:
    path = tmp_path / "target.py"
    path.write_text(
        "import torch\ndef make():\n    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # like `| cat`: no terminal
    proc = subprocess.run(
        [sys.executable, "-m", "cudagraphs", "bench", f"{path}:make", "--calls", "2", "--windows", "1"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "reduce-overhead" in proc.stdout and "cudagraphs+compile" in proc.stdout
    assert "…" not in proc.stdout


@pytest.mark.slow
def test_the_console_script_names_itself(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "cudagraphs"
    if not script.exists():
        pytest.skip("the console script is installed by pip install -e .")
    proc = subprocess.run([str(script), "nonsense"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "usage: cudagraphs" in proc.stderr


@pytest.mark.slow
def test_a_non_python_path_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.txt"
    path.write_text("")
    proc = cli("doctor", f"{path}:make")
    assert proc.returncode == 2 and "not a .py file" in proc.stderr
    assert "Traceback" not in proc.stderr


def help_text(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    """``cudagraphs COMMAND --help``, in this process (the parser is the one the console
    script runs; a subprocess per command would only import torch again)."""
    from cudagraphs.tools.cli import main

    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_version_and_help_on_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("cudagraphs ")
    for command in ("demo", "bench", "doctor"):
        text = help_text(command, capsys)
        options = {w.strip("[],") for w in text.split() if w.startswith(("--", "[--"))}
        options.discard("--help")
        assert options, command  # every subcommand documents its options
    assert "--traceback" in help_text("doctor", capsys)
    bench_help = help_text("bench", capsys)
    for option in ("--modes", "--compile-mode", "--calls", "--windows", "--json", "--plot"):
        assert option in bench_help
    assert "torch.compile mode" in bench_help

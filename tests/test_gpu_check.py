"""scripts/gpu-check's report of a test run: each failure named, and where it stopped."""

from __future__ import annotations

from script_modules import load_script


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
    gpu_check = load_script("gpu-check")
    got = gpu_check.outcomes(lines, ("FAILED", "ERROR"))
    assert got == [
        "  - `FAILED tests/test_decoder_cuda.py::test_steps_loaded_from_disk`",
        "  - where: `/work/main/tests/test_decoder_cuda.py:110: AssertionError: assert (7 == 4)`",
    ]
    assert gpu_check.outcomes(["1 passed in 1.0s"], ("FAILED",)) == []


def test_an_error_at_teardown_is_named_with_its_message_and_warnings_are_not_frames() -> None:
    """An error in a fixture's teardown prints ``E   Error: message`` under an ``ERROR at
    teardown`` header; a worker's start and the warnings summary below it hold
    ``path.py:LINE: SomeWarning`` lines, which are not where anything stopped."""
    lines = [
        "/opt/venv/lib/python3.12/site-packages/pytest_benchmark/logger.py:44: "
        "PytestBenchmarkWarning: Benchmarks are automatically disabled",  # a worker's start
        "....E....",
        "==================================== ERRORS ====================================",
        "___ ERROR at teardown of test_resnet18[True] ____",
        "[gw5] linux -- Python 3.12.3 /opt/torch/.venv/bin/python",
        "E   AttributeError: 'cuBLASModule' object has no attribute 'allow_tf32'",
        "=============================== warnings summary ===============================",
        "/opt/venv/lib/python3.12/site-packages/pytest_benchmark/logger.py:44: "
        "PytestBenchmarkWarning: Benchmarks are automatically disabled",
        "ERROR tests/test_segments_cuda.py::test_resnet18[True]",
        "280 passed, 1 error in 201.96s",
    ]
    got = load_script("gpu-check").outcomes(lines, ("FAILED", "ERROR"))
    assert got == [
        "  - `ERROR tests/test_segments_cuda.py::test_resnet18[True]`",
        "  - where: `E   AttributeError: 'cuBLASModule' object has no attribute 'allow_tf32'`",
    ]


def test_a_stopped_run_names_the_tests_that_did_not_report() -> None:
    """From ``pytest -v`` output, with and without xdist's worker prefix: the tests whose
    outcome came are reported; of the collected ones, the rest are named, in order."""
    lines = [
        "[gw0] [ 10%] PASSED tests/test_layers.py::test_one ",
        "[gw1] [ 20%] FAILED tests/test_layers.py::test_two[bf16] ",
        "tests/test_readme.py::test_three SKIPPED (no reason) [ 30%]",
        "tests/test_readme.py::test_four",  # a test's name as -v prints it before its outcome
    ]
    gpu_check = load_script("gpu-check")
    collected = [
        "tests/test_layers.py::test_one",
        "tests/test_layers.py::test_two[bf16]",
        "tests/test_readme.py::test_three",
        "tests/test_readme.py::test_four",
        "tests/test_cli.py::test_five",
    ]
    assert gpu_check.unreported(lines, collected) == [
        "  - stopped at the time limit: 3 of 5 tests reported; not:",
        "    - `tests/test_readme.py::test_four`",
        "    - `tests/test_cli.py::test_five`",
    ]
    assert gpu_check.unreported(lines, None) == [
        "  - stopped at the time limit with 3 tests reported"
    ]

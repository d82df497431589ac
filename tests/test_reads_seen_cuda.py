"""On a GPU, with real graphs, eager and over ``torch.compile``: the reads of
``test_reads_seen.py`` (names built at run time, keys held in attributes, closures of helpers,
long and nested lists, host settings) changed after the capture give eager's answer, never the
recorded one."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch
from reads_cases import (
    SCALE_VARIABLE,
    SEEN,
    SET_SCALE_FACTOR,
    MkldnnBranch,
    ThreadsBranch,
    answers_as_eager_after,
    defined_in_a_function,
)

import cudagraphs as cg

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def helper_factor_put_back() -> Iterator[None]:
    yield
    SET_SCALE_FACTOR(2.0)
    os.environ.pop(SCALE_VARIABLE, None)


def _answers_as_eager_after(
    model: torch.nn.Module, change: Callable[[torch.nn.Module], None], compile: bool
) -> None:
    answers_as_eager_after(model.cuda(), change, compile=compile, device="cuda")


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
@pytest.mark.parametrize("case", list(SEEN))
def test_a_value_read_under_no_name_of_the_code_changed_after_capture(
    case: str, compile: bool
) -> None:
    make, change, _ = SEEN[case]
    _answers_as_eager_after(make(), change, compile)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
def test_a_variable_of_the_function_that_defined_the_forward(compile: bool) -> None:
    model, set_factor = defined_in_a_function()
    _answers_as_eager_after(model, lambda m: set_factor(3.0), compile)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
def test_a_branch_on_the_thread_count(compile: bool) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _answers_as_eager_after(ThreadsBranch(), lambda m: torch.set_num_threads(1), compile)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
def test_a_branch_on_a_torch_backends_flag(compile: bool) -> None:
    with torch.backends.mkldnn.flags(enabled=True):
        model = MkldnnBranch().cuda()
        g = cg.graph(model, torch.randn(4, 8, device="cuda"), outputs="clone", compile=compile)
        fresh = torch.randn(4, 8, device="cuda")
        recorded = g(fresh)
        with torch.backends.mkldnn.flags(enabled=False):
            expected = model(fresh)
            assert not torch.allclose(expected, recorded)
            torch.testing.assert_close(g(fresh), expected)

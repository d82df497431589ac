"""The address check the guard runs before every replay: compiled loop and its fallbacks agree,
and every way of moving a tensor to new memory is seen. Addresses are device-independent, so
CPU tensors exercise the same code."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraphs.core import addresses
from cudagraphs.core.addresses import AddressCheck


def _tensors(n: int = 6) -> list[torch.Tensor]:
    return [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(n)]


@pytest.fixture(params=["native", "fallback"])
def make(request):
    native = request.param == "native"
    if native and addresses.compiled_module() is None:
        pytest.skip(f"no compiled check here: {addresses._failure}")
    return lambda tensors: AddressCheck(tensors, native=native)


def test_compiled_loop_builds_where_a_compiler_exists():
    # CI and the GPU machine both have g++ and Python.h; a silent fallback would hide a slow guard.
    assert addresses.compiled_module() is not None, addresses._failure
    assert AddressCheck(_tensors()).backend == "compiled"


def test_nothing_to_check_always_passes():
    check = AddressCheck([])
    assert check() and check.moved() == [] and check.backend == ""


def test_unchanged_tensors_pass(make):
    check = make(_tensors())
    assert check() and check.moved() == []


def _no_grad_set(t: torch.Tensor, source: torch.Tensor) -> None:
    with torch.no_grad():
        t.set_(source)


@pytest.mark.parametrize(
    "move",
    [
        lambda t: setattr(t, "data", torch.randn(4, 4)),
        lambda t: _no_grad_set(t, torch.randn(4, 4)),
        lambda t: torch.utils.swap_tensors(t, torch.nn.Parameter(torch.randn(4, 4))),
        lambda t: t.data.resize_(64, 64),
        lambda t: t.untyped_storage().resize_(0),
    ],
    ids=["data=", "set_", "swap_tensors", "resize_", "storage freed"],
)
def test_every_kind_of_move_is_seen(make, move):
    tensors = _tensors()
    check = make(tensors)
    move(tensors[3])
    assert not check()
    assert check.moved() == [3]


def test_in_place_updates_keep_the_check_passing(make):
    tensors = _tensors()
    check = make(tensors)
    with torch.no_grad():
        tensors[0].copy_(torch.randn(4, 4))
        tensors[1].mul_(2)
    assert check()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), data=st.data())
def test_moved_is_exactly_the_moved_set(n, data):
    tensors = _tensors(n)
    checks = [AddressCheck(tensors), AddressCheck(tensors, native=False)]
    chosen = data.draw(st.sets(st.integers(0, n - 1)))
    for i in chosen:
        tensors[i].data = torch.randn(4, 4)
    for check in checks:
        assert check() is (not chosen)
        assert check.moved() == sorted(chosen)


def test_compiled_loop_rejects_bad_arguments():
    module = addresses.compiled_module()
    if module is None:
        pytest.skip(f"no compiled check here: {addresses._failure}")
    assert module.same(("not a tensor",), bytes(8)) is False
    # A tensor without storage makes PyTorch's reader throw; the loop must answer, not crash.
    assert module.same((torch.randn(4, 4).to_sparse(),), bytes(8)) is False
    with pytest.raises(ValueError, match="one 8-byte address per tensor"):
        module.same((torch.randn(2),), b"")
    with pytest.raises(TypeError, match="same"):
        module.same([torch.randn(2)], bytes(8))


def _backend_in_fresh_process(**env: str) -> str:
    code = (
        "import torch; from cudagraphs.core.addresses import AddressCheck; "
        "print(AddressCheck([torch.zeros(1)]).backend)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()


@pytest.mark.parametrize(
    "env",
    [{"CUDAGRAPHS_NO_COMPILE": "1"}, {"CXX": "/nonexistent/c++"}],
    ids=["opted out", "no compiler"],
)
def test_falls_back_when_it_cannot_compile(env, tmp_path):
    backend = _backend_in_fresh_process(CUDAGRAPHS_CACHE_DIR=str(tmp_path), **env)
    has_helper = hasattr(torch._C, "_tensors_data_ptrs_at_indices_equal")  # CUDA builds only
    expected = "torch helper" if has_helper else "python loop"
    assert backend == expected

"""Guards and verification helpers that need no GPU: what is guarded, random inputs, tolerances."""

from __future__ import annotations

import torch
from torch import nn

from cudagraphs.core.guards import closure_tensors, modules_of
from cudagraphs.diagnose.verify import random_like, tolerance

OFFSET = torch.ones(2)
FLAG = True


def uses_globals(x: torch.Tensor) -> torch.Tensor:
    return x + OFFSET if FLAG else x


def test_closure_tensors_and_values_are_found() -> None:
    scale = torch.full((2,), 3.0)

    def closure(x: torch.Tensor) -> torch.Tensor:
        return x * scale

    assert [name for name, _, _ in closure_tensors(closure)] == ["closure variable 'scale'"]
    names = [name for name, _, _ in closure_tensors(uses_globals, values=True)]
    assert sorted(names) == ["global 'FLAG'", "global 'OFFSET'"]
    assert [name for name, _, _ in closure_tensors(uses_globals)] == ["global 'OFFSET'"]


def test_modules_of_finds_the_module_the_bound_method_extras_and_closure_modules() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    assert modules_of(a) == [a]
    assert modules_of(a.forward) == [a]
    assert modules_of(lambda x: x + 1, [b]) == [b]
    assert modules_of(lambda x: a(x), [b]) == [b, a]  # a closure module counts too
    assert modules_of(lambda x: a(x), [a]) == [a]


def test_random_like_keeps_shape_dtype_and_range() -> None:
    ints = torch.tensor([3, 7, 5])
    fresh = random_like(ints)
    assert fresh.dtype == torch.int64 and fresh.shape == (3,)
    assert int(fresh.min()) >= 3 and int(fresh.max()) <= 7
    assert random_like(torch.zeros(4, dtype=torch.bool)).dtype == torch.bool
    floats = random_like(torch.randn(1000) * 5 + 10)
    assert 8 < floats.mean().item() < 12


def test_tolerance_fits_the_dtype() -> None:
    assert (
        tolerance(torch.bfloat16)["rtol"]
        > tolerance(torch.float32)["rtol"]
        > tolerance(torch.float64)["rtol"]
    )
    assert tolerance(torch.int64) == {"rtol": 0.0, "atol": 0.0}


def test_another_librarys_apply_patch_made_after_import_survives_guards() -> None:
    import torch
    from torch import nn

    from cudagraphs.core.guards import AddressGuard

    original = nn.Module._apply
    calls: list[str] = []

    def theirs(self: nn.Module, *args: object, **kwargs: object) -> object:
        calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    nn.Module._apply = theirs  # another library, after cudagraphs was imported
    try:
        model = nn.BatchNorm1d(2)
        guard = AddressGuard(model)
        model.to(torch.float64)  # runs through their wrapper while the guard lives
        assert calls == ["BatchNorm1d"] and nn.Module._apply is theirs
        assert guard.stale() is not None  # and the guard still sees the new buffers
        del guard
        model.to(torch.float32)
        assert calls == ["BatchNorm1d", "BatchNorm1d"] and nn.Module._apply is theirs
    finally:
        nn.Module._apply = original


def test_compare_with_eager_looks_inside_a_transformers_model_output() -> None:
    """A ModelOutput is a dataclass: its tensors are compared, not the object (which raised)."""
    import pytest
    from transformers import GPT2Config, GPT2Model

    from cudagraphs.diagnose.verify import compare_with_eager
    from cudagraphs.errors import VerificationError

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, use_cache=False)
    config.bos_token_id = config.eos_token_id = 0
    model = GPT2Model(config).eval()
    ids = torch.randint(0, 64, (1, 8))

    def shifted(x: torch.Tensor) -> object:
        out = model(x)
        return type(out)(last_hidden_state=out.last_hidden_state + 1e-2)

    with torch.no_grad():
        compare_with_eager(model, model, (ids,), {}, rounds=2)
        with pytest.raises(VerificationError, match="last_hidden_state differs from eager"):
            compare_with_eager(shifted, model, (ids,), {}, rounds=1)

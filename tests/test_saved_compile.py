"""Compiled decode steps saved to disk and loaded by a later decoder without a trace
(``integrations/saved_compile.py``): the tokens stay ``generate``'s, a model of the same config
with other weights gets its own, a changed source or config is compiled afresh, and a step
that cannot be saved is compiled as before."""

from __future__ import annotations

import json

import pytest
import torch
from llama_decode import tiny_llama, transformers_attention

pytest.importorskip("transformers")

from cudagraphs.core import compat
from cudagraphs.decoding.compiled import compile_settings
from cudagraphs.decoding.decoder import Decoder
from cudagraphs.errors import ConfigError
from cudagraphs.integrations.saved_compile import SavedCompile, compile_key


def generate(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad(), transformers_attention(model):
        return model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )


def double_plus_one(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def other_weights(model) -> object:
    """``model``'s config, other random weights."""
    twin, _ = tiny_llama("cpu", hidden=64, layers=2)
    torch.manual_seed(11)
    with torch.no_grad():
        for p in twin.parameters():
            p.normal_(0, 0.3)
    assert not torch.equal(next(twin.parameters()), next(model.parameters()))
    return twin


def test_the_key_names_the_config_settings_and_dtype_but_not_the_weights() -> None:
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    settings = compile_settings(True)
    key = compile_key(model, double_plus_one, settings, 4)
    assert compile_key(other_weights(model), double_plus_one, settings, 4) == key
    changed, _ = tiny_llama("cpu", hidden=64, layers=2)
    changed.config.rms_norm_eps = 1e-3  # read by the trace as a constant
    assert compile_key(changed, double_plus_one, settings, 4) != key
    other_attention, _ = tiny_llama("cpu", hidden=64, layers=2)
    other_attention.config._attn_implementation = "eager"  # not in the config's JSON
    assert compile_key(other_attention, double_plus_one, settings, 4) != key
    assert compile_key(model, double_plus_one, compile_settings("max-autotune"), 4) != key
    assert compile_key(model, double_plus_one, settings, 8) != key  # the caller's bounds
    assert compile_key(model.to(torch.float64), double_plus_one, settings, 4) != key


def test_a_saved_step_is_loaded_and_a_changed_source_is_compiled_again(
    fresh_compile_cache,
) -> None:
    x = torch.randn(5, 3)
    first = SavedCompile(double_plus_one, compile_settings(True), dynamic=False, key="k")
    assert torch.equal(first(x), x * 2 + 1) and first.saved == 1 and not first.not_saved
    torch._dynamo.reset()
    second = SavedCompile(double_plus_one, compile_settings(True), dynamic=False, key="k")
    assert torch.equal(second(x), x * 2 + 1)
    assert (second.loaded, second.saved) == (1, 0)
    y = torch.randn(4, 3)  # another shape (compiled statically): a new entry, saved too
    assert torch.equal(second(y), y * 2 + 1) and second.saved == 1
    (meta,) = [m for m in fresh_compile_cache.glob("cudagraphs/k/*.json") if "-0-" in m.name]
    written = json.loads(meta.read_text())
    assert __name__ in written["sources"]  # this file's source was traced
    written["sources"][__name__] = "0" * 64  # as if this file had changed since
    meta.write_text(json.dumps(written))
    third = SavedCompile(double_plus_one, compile_settings(True), dynamic=False, key="k")
    assert torch.equal(third(x), x * 2 + 1)
    assert (third.loaded, third.saved) == (1, 1)  # the stale entry deleted and compiled again
    assert not meta.exists()


def test_a_step_that_cannot_be_saved_is_compiled_as_before(
    fresh_compile_cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat, "aot_compiler", lambda *args, **kwargs: None)
    step = SavedCompile(double_plus_one, compile_settings(True), dynamic=False, key="k")
    x = torch.randn(5, 3)
    assert torch.equal(step(x), x * 2 + 1)
    assert step.fallback is not None and "no aot_compile" in step.not_saved
    assert step.saved == 0 and not list(fresh_compile_cache.glob("cudagraphs/k/*"))


@pytest.mark.slow
def test_a_second_decoder_loads_its_steps_and_decodes_its_own_model(fresh_compile_cache) -> None:
    """A decoder of another model of the same config (other weights) loads the first one's
    compiled steps, traces nothing, and its tokens are its own model's ``generate``."""
    from torch._dynamo.utils import counters

    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    kwargs = dict(max_batch=4, max_length=24, compile=True, cache_lengths=[8])
    torch._dynamo.reset()
    first = Decoder(model, **kwargs)
    # The forward and the greedy tail; a step whose trace meets what aot_compile cannot
    # write (transformers 5.25 wraps its rotary function in a class made inside a function)
    # falls back to a plain compile, and the reason is in the stats.
    unsaved = [step for step in first.saved_compiles[::2] if step.not_saved]  # forward, tail
    assert first.stats.compiles_saved == 2 - len(unsaved) >= 1
    assert first.stats.compile_save_s > 0
    assert all(step.fallback is not None and step.failed_traces == 1 for step in unsaved)
    assert ("local scope" in first.stats.compile_not_saved) == bool(unsaved)
    torch._dynamo.reset()
    twin = other_weights(model)
    before = counters["stats"]["unique_graphs"]
    second = Decoder(twin, **kwargs)
    assert (second.stats.compiles_loaded, second.stats.compiles_saved) == (2 - len(unsaved), 0)
    # The saved steps trace nothing; one that could not be saved was remembered, so it traces
    # once (its plain compile, no second attempt to save), for its one shape class.
    assert counters["stats"]["unique_graphs"] - before == len(unsaved)
    again = [step for step in second.saved_compiles[::2] if step.not_saved]
    assert all(s.failed_traces == 0 and "earlier process" in s.not_saved for s in again)
    torch.manual_seed(3)
    for batch in (3, 1):
        prompt = torch.randint(0, 512, (batch, 5))
        got = second.generate(prompt, max_new_tokens=12, eos_token_id=None)
        assert torch.equal(got, generate(twin, prompt, 12))
        assert not torch.equal(got, generate(model, prompt, 12))


def test_save_compile_false_compiles_with_torch_compile_and_writes_nothing(
    fresh_compile_cache,
) -> None:
    step = SavedCompile(
        double_plus_one,
        compile_settings(True),
        dynamic=False,
        key="k",
        unsaved="save_compile=False",
    )
    x = torch.randn(5, 3)
    assert torch.equal(step(x), x * 2 + 1)
    assert step.not_saved == "save_compile=False" and step.saved == 0
    assert not list(fresh_compile_cache.glob("cudagraphs/*"))
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    with pytest.raises(ConfigError, match="save_compile must be True or False, got 'yes'"):
        Decoder(model, max_batch=2, max_length=16, compile=True, save_compile="yes")


@pytest.mark.parametrize(
    "how", ["another user's folder", "group-writable folder", "world-writable file", "a link"]
)
def test_a_saved_step_others_could_have_written_is_not_loaded(
    fresh_compile_cache, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A saved step is code that runs: one in a folder or file that belongs to another user,
    or that others can write, is compiled afresh instead of loaded, with a warning that names
    the path and why."""
    import os
    import warnings

    from cudagraphs.integrations import saved_compile

    monkeypatch.setattr(saved_compile, "_NOTICES", saved_compile.Notices())  # this test's own
    x = torch.randn(5, 3)
    first = SavedCompile(double_plus_one, compile_settings(True), dynamic=False, key="k")
    assert torch.equal(first(x), x * 2 + 1) and first.saved == 1
    folder = fresh_compile_cache / "cudagraphs" / "k"
    assert folder.stat().st_mode & 0o077 == 0  # written where only its owner can write
    (data,) = folder.glob("*.bin")
    if how == "another user's folder":
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 1)
        why, path = "belongs to user id", folder
    elif how == "group-writable folder":
        folder.chmod(0o770)
        why, path = "others can write to it", folder
    elif how == "world-writable file":
        data.chmod(0o606)
        why, path = "others can write to it", data
    else:
        moved = data.with_suffix(".elsewhere")
        data.rename(moved)
        data.symlink_to(moved)
        why, path = "symbolic link", data
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = SavedCompile(double_plus_one, compile_settings(True), dynamic=False, key="k")
        assert torch.equal(second(x), x * 2 + 1)
        assert torch.equal(second(x + 1), (x + 1) * 2 + 1)
    assert second.loaded == 0  # compiled afresh
    (warning,) = [w for w in caught if "is not loaded" in str(w.message)]
    assert str(path) in str(warning.message) and why in str(warning.message)


def test_the_saved_steps_folder_is_chosen_by_an_environment_variable(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cudagraphs.integrations.saved_compile import FOLDER_VARIABLE, saved_steps_folder

    chosen = tmp_path / "mine"
    monkeypatch.setenv(FOLDER_VARIABLE, str(chosen))
    assert saved_steps_folder() == chosen
    step = SavedCompile(double_plus_one, compile_settings(True), dynamic=False, key="k")
    x = torch.randn(2, 3)
    assert torch.equal(step(x), x * 2 + 1) and step.saved == 1
    assert len(list((chosen / "k").glob("*.bin"))) == 1

"""On a GPU, with real graphs: a plain value changed after the capture gives eager's answer
(the graph captures again) or the named error, never the recorded value's answer."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import value_cases
from torch import nn
from value_cases import (
    CALLABLE_CHANGES,
    CHANGES,
    NUMPY_CHANGES,
    SLOT_CHANGES,
    Activated,
    NumpyScaled,
    Scaled,
    SlottedModel,
)

import cudagraphs as cg

pytestmark = pytest.mark.cuda

CASES = {**CHANGES, "global": ("GAIN", 0.5)}


def _answers_as_eager_after_one_recapture(g: Any, model: nn.Module) -> None:
    """After the change: the next call answers as eager (not the recorded answer) by capturing
    once again, and the call after it replays that new capture."""
    x = torch.randn(8, 64, device="cuda")
    torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 1
    x = torch.randn(8, 64, device="cuda")
    torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 1 and g.stats.replays >= 2


@pytest.mark.parametrize("kind", list(CASES))
def test_a_value_changed_after_capture_gives_eager_s_answer(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = Scaled(64).cuda().eval()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(8, 64, device="cuda"), harmless_state=("calls",))
        name, value = CASES[kind]
        if kind == "global":
            monkeypatch.setattr(value_cases, name, value)
        else:
            setattr(model, name, value)
        _answers_as_eager_after_one_recapture(g, model)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("kind", list(CALLABLE_CHANGES))
def test_a_function_swapped_after_capture_gives_eager_s_answer(
    kind: str, compile: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model.activation = torch.tanh`` (or a swapped helper, partial or global function)
    after the capture: the replay must not run the recorded function's kernels."""
    torch.manual_seed(0)
    model = Activated(64).cuda().eval()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(8, 64, device="cuda"), compile=compile)
        name, value = CALLABLE_CHANGES[kind]
        monkeypatch.setattr(value_cases if name.isupper() else model, name, value)
        _answers_as_eager_after_one_recapture(g, model)


def test_on_stale_raise_names_the_value() -> None:
    model = Scaled(64).cuda().eval()
    with torch.no_grad():
        g = cg.graph(
            model, torch.randn(8, 64, device="cuda"), on_stale="raise", harmless_state=("calls",)
        )
        model.scale = 2.0
        with pytest.raises(cg.StaleGraphError, match=r"Scaled\.scale changed from 1\.0 to 2\.0"):
            g(torch.randn(8, 64, device="cuda"))


def test_a_closure_cell_and_an_hf_config_flag() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    model = transformers.GPT2Model(config).cuda().eval()
    ids = torch.randint(0, 128, (2, 16), device="cuda")

    def hidden(ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids, use_cache=False)
        return out.hidden_states[1] if out.hidden_states is not None else out.last_hidden_state

    factor = 1.0

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * factor

    with torch.no_grad():
        g = cg.graph(hidden, ids)
        model.config.output_hidden_states = True
        torch.testing.assert_close(g(ids), hidden(ids))
        assert g.stats.recaptures == 1
        x = torch.randn(4, device="cuda")
        s = cg.graph(scaled, x)
        factor = 3.0
        torch.testing.assert_close(s(x), x * 3.0)


def test_a_harmless_counter_replays_without_recapture() -> None:
    class Counted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(64, 64)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.fc(x)

    model = Counted().cuda().eval()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(8, 64, device="cuda"), harmless_state=("calls",))
        for _ in range(5):
            x = torch.randn(8, 64, device="cuda")
            torch.testing.assert_close(g(x), model.fc(x))
        assert g.stats.recaptures == 0 and g.stats.replays == 5


def _captured_changed_and_checked(model: nn.Module, change: Any, compile: bool) -> None:
    """Capture ``model`` on the GPU, apply ``change(model)``, and check the change matters and
    the graph answers as eager through one new capture."""
    with torch.no_grad():
        g = cg.graph(model, torch.randn(8, 64, device="cuda"), compile=compile)
        x = torch.randn(8, 64, device="cuda")
        recorded = model(x)
        change(model)
        assert not torch.allclose(model(x), recorded)  # the change matters to the answer
        _answers_as_eager_after_one_recapture(g, model)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("case", list(value_cases.BEYOND_ATTRIBUTES))
def test_a_value_read_from_the_class_or_a_list_changed_after_capture_gives_eager_s_answer(
    case: str, compile: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A class-level default, a method, a subclass's own value, a list item: changed after the
    capture, the replay must not give the recorded answer."""
    torch.manual_seed(0)
    change, _ = value_cases.BEYOND_ATTRIBUTES[case]
    model = value_cases.DefaultedChild(64).cuda().eval()
    _captured_changed_and_checked(model, lambda m: change(m, monkeypatch), compile)


def _held_on_gpu(model: value_cases.Holding) -> value_cases.Holding:
    """The Holding module with every tensor it holds outside its tree on the GPU too."""
    model = model.cuda().eval()
    model.offset, model.gain = model.offset.cuda(), model.gain.cuda()
    model.tables = {k: t.cuda() for k, t in model.tables.items()}
    model.steps = [t.cuda() for t in model.steps]
    model.heads = [h.cuda() for h in model.heads]
    return model


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("case", list(value_cases.HELD_TENSORS))
def test_a_tensor_or_module_held_outside_the_tree_changed_after_capture_gives_eager_s_answer(
    case: str, compile: bool
) -> None:
    """A tensor attribute, a dict or list item, a module in a list, a buffer registered later:
    changed after the capture (on the GPU, the change moved device memory), a replay must not
    read the recorded memory."""
    torch.manual_seed(0)
    change, _ = value_cases.HELD_TENSORS[case]
    _captured_changed_and_checked(_held_on_gpu(value_cases.Holding(64)), change, compile)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("case", list(value_cases.REBOUND_HOLDERS))
def test_an_object_the_forward_reads_through_rebound_after_capture_gives_eager_s_answer(
    case: str, compile: bool
) -> None:
    """A config dataclass, a namespace or a dict the forward reads values through, replaced by
    another after the capture: a replay must not repeat the old object's values."""
    torch.manual_seed(0)
    change, _ = value_cases.REBOUND_HOLDERS[case]
    _captured_changed_and_checked(value_cases.Configured(64).cuda().eval(), change, compile)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("change", list(SLOT_CHANGES))
def test_a_value_in_a_slotted_object_changed_after_capture_gives_eager_s_answer(
    change: str, compile: bool
) -> None:
    torch.manual_seed(0)
    model = SlottedModel("cuda")
    kept = model.settings.gain  # alive: a new tensor cannot take its address
    with torch.no_grad():
        g = cg.graph(model, torch.randn(16, 8, device="cuda"), compile=compile)
        SLOT_CHANGES[change](model.settings)
        for _ in range(2):
            x = torch.randn(16, 8, device="cuda")
            torch.testing.assert_close(g(x), model(x))  # not the recorded answer
        assert g.stats.recaptures == 1 and g.stats.replays >= 2
    del kept


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("kind", ["OrderedDict entry", "forward hook's closure"])
def test_a_dict_subclass_entry_or_a_hook_s_value_changed_gives_eager_s_answer(
    kind: str, compile: bool
) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(8, 8).cuda().requires_grad_(False)
    settings = collections.OrderedDict(gain=1.0)
    if kind == "OrderedDict entry":
        graphed: nn.Module = _MappedGain(layer, settings)
    else:
        layer.register_forward_hook(lambda module, args, out: out * settings["gain"])
        graphed = layer
    with torch.no_grad():
        g = cg.graph(graphed, torch.randn(16, 8, device="cuda"), compile=compile)
        settings["gain"] = 2.0
        for _ in range(2):
            x = torch.randn(16, 8, device="cuda")
            torch.testing.assert_close(g(x), graphed(x))  # not the recorded answer
        assert g.stats.recaptures == 1 and g.stats.replays >= 2


class _MappedGain(nn.Module):
    def __init__(self, layer: nn.Module, settings: dict[str, float]) -> None:
        super().__init__()
        self.layer, self.settings = layer, settings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * self.settings["gain"]


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("change", NUMPY_CHANGES)
def test_a_numpy_value_changed_after_capture_gives_eager_s_answer(
    change: str, compile: bool
) -> None:
    torch.manual_seed(0)
    model = NumpyScaled(8, "cuda")
    with torch.no_grad():
        g = cg.graph(model, torch.randn(16, 8, device="cuda"), compile=compile)
        value_cases._numpy_change(change)(model)
        for _ in range(2):
            x = torch.randn(16, 8, device="cuda")
            torch.testing.assert_close(g(x), model(x))  # not the recorded answer
        assert g.stats.recaptures == 1 and g.stats.replays >= 2

"""Plain Python values a recording read are checked before every replay
(``core/python_values.py``): a value changed after the capture gives eager's answer through a
new capture, or the named error with ``on_stale="raise"``, never the old answer. On the CPU the
stand-in (conftest.py) replays the logged operations without running the function, so a
missed change gives the old answer here as in a graph; the GPU tests check real replays."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import value_cases
from value_cases import (
    CALLABLE_CHANGES,
    CHANGES,
    NUMPY_CHANGES,
    SLOT_CHANGES,
    Activated,
    NumpyScaled,
    Scaled,
    SlottedModel,
    gained,
    labels_read_under_compile,
)

import cudagraphs as cg


@pytest.mark.parametrize("kind", list(CHANGES))
def test_an_attribute_changed_after_capture_captures_again_for_eager_s_answer(
    stand_in: None, kind: str
) -> None:
    torch.manual_seed(0)
    model = Scaled()
    x = torch.randn(4, 8)
    g = cg.graph(model, x, outputs="clone", harmless_state=("calls",))
    assert torch.allclose(g(x), model(x)) and g.stats.recaptures == 0
    name, value = CHANGES[kind]
    setattr(model, name, value)
    fresh = torch.randn(4, 8)
    assert torch.allclose(g(fresh), model(fresh))
    assert g.stats.recaptures == 1
    assert g(fresh) is not None and g.stats.recaptures == 1  # the new value is the recorded one
    assert any(f"Scaled.{name}" in cause for cause in g.stats.notices)


@pytest.mark.parametrize("kind", list(CALLABLE_CHANGES))
def test_a_function_swapped_after_capture_captures_again_for_eager_s_answer(
    stand_in: None, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A function held in an attribute or a module global (``model.activation = torch.tanh``
    after capture) is compared by identity before each replay, as a plain value is."""
    torch.manual_seed(0)
    model = Activated()
    x = torch.randn(4, 8)
    g = cg.graph(model, x, outputs="clone")
    torch.testing.assert_close(g(x), model(x))
    name, value = CALLABLE_CHANGES[kind]
    monkeypatch.setattr(value_cases if name.isupper() else model, name, value)
    fresh = torch.randn(4, 8)
    torch.testing.assert_close(g(fresh), model(fresh))
    assert g.stats.recaptures == 1
    assert any(name in cause for cause in g.stats.notices)


@pytest.mark.parametrize("kind", ["attribute", "global in a helper"])
def test_a_changed_value_raises_a_named_error_under_on_stale_raise(
    stand_in: None, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = Scaled()
    x = torch.randn(4, 8)
    g = cg.graph(model, x, outputs="clone", harmless_state=("calls",), on_stale="raise")
    g(x)
    if kind == "attribute":
        model.scale = 2.0
        expected = r"Scaled\.scale changed from 1\.0 to 2\.0"
    else:
        monkeypatch.setattr(value_cases, "GAIN", 0.5)
        expected = r"global value_cases\.GAIN changed from 1\.0 to 0\.5"
    with pytest.raises(cg.StaleGraphError, match=expected):
        g(x)


def test_a_global_read_by_a_helper_is_guarded(
    stand_in: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return gained(x) + 1

    x = torch.randn(3)
    g = cg.graph(fn, x, outputs="clone")
    g(x)
    monkeypatch.setattr(value_cases, "GAIN", 3.0)
    assert torch.allclose(g(x), x * 3.0 + 1) and g.stats.recaptures == 1


def test_a_closure_cell_changed_after_capture_captures_again(stand_in: None) -> None:
    factor = 2.0

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * factor

    x = torch.randn(3)
    g = cg.graph(fn, x, outputs="clone")
    g(x)
    factor = 5.0
    assert torch.allclose(g(x), x * 5.0) and g.stats.recaptures == 1


def test_a_harmless_counter_incremented_every_call_replays_without_recapture(
    stand_in: None,
) -> None:
    model = Scaled()
    x = torch.randn(4, 8)
    g = cg.graph(model, x, outputs="clone", harmless_state=("calls",))
    for _ in range(5):
        model.calls += 1  # changed outside the graph too: declared harmless, not guarded
        g(x)
    assert g.stats.recaptures == 0 and g.stats.replays == 5


def test_a_value_that_did_not_change_costs_no_recapture(stand_in: None) -> None:
    model = Scaled()
    x = torch.randn(4, 8)
    g = cg.graph(model, x, outputs="clone", harmless_state=("calls",))
    model.scale = 1.0  # another float object, the same value
    model.offsets = (0.0, 0.0)
    for _ in range(3):
        g(x)
    assert g.stats.recaptures == 0


def test_an_hf_config_flag_read_in_forward_is_guarded(stand_in: None) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2Model(config).eval()
    ids = torch.randint(0, 64, (1, 8))

    def hidden(ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids, use_cache=False)
        return out.hidden_states[0] if out.hidden_states is not None else out.last_hidden_state

    with torch.no_grad():
        g = cg.graph(hidden, ids, outputs="clone")
        assert torch.allclose(g(ids), hidden(ids))
        model.config.output_hidden_states = True  # read in forward: the output changes
        assert torch.allclose(g(ids), hidden(ids)) and g.stats.recaptures == 1


TICKS = 0.0


def test_code_that_runs_during_the_capture_without_being_called_is_not_guarded(
    stand_in: None,
) -> None:
    """A garbage collection's callback (a test tool's timestamp global) may run in the middle
    of any recording; its reads are not the graph's, and guarding them would capture again at
    every collection. No collection runs while a capture is recorded."""
    import gc

    def tick(phase: str, info: dict) -> None:
        global TICKS
        TICKS = TICKS + 1.0

    def fn(x: torch.Tensor) -> torch.Tensor:
        for _ in range(5000):  # cycles enough for an automatic collection mid-run
            cycle: list = []
            cycle.append(cycle)
        return x * 2

    gc.callbacks.append(tick)
    try:
        before = TICKS
        fn(torch.randn(3))
        assert before < TICKS  # outside a capture, the run does collect
        g = cg.graph(fn, torch.randn(3), outputs="clone")
        assert not any("TICKS" in label for label, *_ in g.read_values)
        for _ in range(3):
            gc.collect()
            g(torch.randn(3))
        assert g.stats.recaptures == 0
    finally:
        gc.callbacks.remove(tick)


def test_code_a_callable_stands_in_for_is_guarded_as_if_it_ran(stand_in: None) -> None:
    # A compile loaded from disk runs none of the model's Python during the capture. The
    # callable names the code it stands in for (READS_LIKE, noted from one eager run): a value
    # that code reads is guarded as if it had run.
    from cudagraphs.core import READS_LIKE, Reader

    torch.manual_seed(0)
    model = Scaled()
    x = torch.randn(4, 8)

    def loaded(inputs: torch.Tensor) -> torch.Tensor:
        return model.fc(inputs)  # reads none of the values Scaled.forward reads

    with Reader() as reader:
        model(x)
    setattr(loaded, READS_LIKE, reader.codes)
    g = cg.graph(loaded, x)
    assert g(x).shape == (4, 8) and g.stats.recaptures == 0
    model.scale = 2.0  # read by Scaled.forward, the code `loaded` stands in for
    g(x)
    assert g.stats.recaptures == 1
    delattr(loaded, READS_LIKE)
    plain = cg.graph(loaded, x)
    model.scale = 3.0
    plain(x)
    assert plain.stats.recaptures == 0  # without it, nothing it runs reads the value


@pytest.mark.parametrize("where", ["child's value", "helper's global"])
def test_the_reads_of_code_a_compiled_model_inlined_are_guarded(
    stand_in: None, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch.compile`` inlines a child module's forward and the helpers it calls, whose
    frames then never run during the capture: the reader counts their code as run, so a
    change of the child's plain value or of the helper's global captures again and gives
    eager's answer (the stand-in replays the compiled operations like a graph)."""
    torch.manual_seed(0)
    model = value_cases.Outer().eval()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(4, 8), compile=True, outputs="clone")
        fresh = torch.randn(4, 8)
        recorded = g(fresh)
        torch.testing.assert_close(recorded, model(fresh))
        if where == "child's value":
            model.inner.gain = -2.0
        else:
            monkeypatch.setattr(value_cases, "GAIN", -2.0)
        expected = model(fresh)
        assert not torch.allclose(expected, recorded)
        torch.testing.assert_close(g(fresh), expected)
        assert g.stats.recaptures == 1


def test_a_value_deep_in_a_compiled_model_is_reached_by_its_shortest_path() -> None:
    """A compiled module reaches its model through ``forward``'s closure two levels down
    before the model itself, a root: the walk must reach every object by its shortest path,
    else the deep end of the model (a block's child's value) falls past the depth limit."""
    torch.manual_seed(0)
    inner = value_cases.Inner()
    for _ in range(4):  # Inner nested in Sequentials: model[0][0][0][0] is the Inner
        inner = torch.nn.Sequential(inner)
    model = torch.nn.Sequential(inner, torch.nn.ReLU()).eval()
    labels = labels_read_under_compile(model, torch.randn(4, 8))
    assert any(label.endswith(".gain") for label in labels), labels


@pytest.mark.parametrize("change", list(SLOT_CHANGES))
def test_a_value_in_a_slotted_object_changed_after_capture_captures_again(
    stand_in: None, change: str
) -> None:
    """A ``@dataclass(slots=True)`` has no ``__dict__``: its values are read through the
    object, its tensors guarded at their addresses as an attribute's are."""
    torch.manual_seed(0)
    model = SlottedModel()
    x = torch.randn(4, 8)
    with torch.no_grad():
        g = cg.graph(model, x)
        SLOT_CHANGES[change](model.settings)
        fresh = torch.randn(4, 8)
        torch.testing.assert_close(g(fresh), model(fresh))  # not the recorded answer
        assert g.stats.recaptures == 1
        torch.testing.assert_close(g(x), model(x))
        assert g.stats.recaptures == 1


class _Mapped(torch.nn.Module):
    """Settings in a dict subclass (an ``OrderedDict``, a ``defaultdict``)."""

    def __init__(self, settings: dict[str, float]) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8).requires_grad_(False)
        self.settings = settings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.settings["scale"]


@pytest.mark.parametrize(
    "settings",
    [collections.OrderedDict(scale=1.0), collections.defaultdict(float, scale=1.0)],
    ids=["OrderedDict", "defaultdict"],
)
def test_an_entry_of_a_dict_subclass_changed_after_capture_captures_again(
    stand_in: None, settings: dict[str, float]
) -> None:
    torch.manual_seed(0)
    model = _Mapped(settings)
    x = torch.randn(4, 8)
    with torch.no_grad():
        g = cg.graph(model, x)
        settings["scale"] = 2.0
        torch.testing.assert_close(g(x), model(x))  # not the recorded answer
        assert g.stats.recaptures == 1


def _hooked(kind: str) -> tuple[torch.nn.Module, Any]:
    """A layer with a forward hook that reads a value from its closure (a list, or a dict),
    and the change a program makes to that value later."""
    layer = torch.nn.Linear(8, 8).requires_grad_(False)
    factor, state = [1.0], {"gain": 1.0}
    if kind == "list in a lambda's closure":
        layer.register_forward_hook(lambda module, args, out: out * factor[0])
        return layer, lambda: factor.__setitem__(0, 2.0)

    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * state["gain"]

    if kind == "dict in a hook's closure":
        layer.register_forward_hook(hook)
    else:  # every module's forward: torch.nn.modules.module.register_module_forward_hook
        handle = torch.nn.modules.module.register_module_forward_hook(hook)
        _GLOBAL_HOOKS.append(handle)
    return layer, lambda: state.__setitem__("gain", 2.0)


_GLOBAL_HOOKS: list[Any] = []


@pytest.mark.parametrize(
    "kind", ["list in a lambda's closure", "dict in a hook's closure", "global hook's closure"]
)
def test_a_value_a_forward_hook_reads_changed_after_capture_captures_again(
    stand_in: None, kind: str
) -> None:
    torch.manual_seed(0)
    try:
        layer, change = _hooked(kind)
        x = torch.randn(4, 8)
        with torch.no_grad():
            g = cg.graph(layer, x)
            change()
            torch.testing.assert_close(g(x), layer(x))  # not the recorded answer
            assert g.stats.recaptures == 1
    finally:
        while _GLOBAL_HOOKS:
            _GLOBAL_HOOKS.pop().remove()


def test_what_a_hook_reads_is_guarded_under_compile_too(stand_in: None) -> None:
    """Dynamo inlines a forward hook, whose frame then never runs during the capture: the
    hooks the walk reaches count as run, so a change of their closure's values captures
    again and gives eager's answer (the stand-in replays the compiled operations)."""
    torch.manual_seed(0)
    factor = [1.0]
    layer = torch.nn.Linear(8, 8).requires_grad_(False)
    layer.register_forward_hook(lambda module, args, out: out * factor[0])
    g = cg.graph(layer, torch.randn(4, 8), compile=True, outputs="clone")
    fresh = torch.randn(4, 8)
    recorded = g(fresh)
    torch.testing.assert_close(recorded, layer(fresh))
    factor[0] = -3.0
    expected = layer(fresh)
    assert not torch.allclose(expected, recorded)
    torch.testing.assert_close(g(fresh), expected)
    assert g.stats.recaptures == 1


@pytest.mark.parametrize("change", NUMPY_CHANGES)
def test_a_numpy_value_changed_after_capture_captures_again(stand_in: None, change: str) -> None:
    """A NumPy scalar is compared by value (an equal new one is no change), a small array by
    its memory (an item set in place is a change, one set to its own value is not)."""
    import numpy

    torch.manual_seed(0)
    model = NumpyScaled()
    x = torch.randn(4, 8)
    g = cg.graph(model, x)
    model.scale, model.table[0, 1] = numpy.float32(1.0), 2.0  # the same values: no change
    torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 0
    value_cases._numpy_change(change)(model)
    fresh = torch.randn(4, 8)
    torch.testing.assert_close(g(fresh), model(fresh))  # not the recorded answer
    assert g.stats.recaptures == 1
    torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 1


def test_a_numpy_array_changed_in_place_is_named_under_on_stale_raise(stand_in: None) -> None:
    model = NumpyScaled()
    g = cg.graph(model, torch.randn(4, 8), on_stale="raise")
    model.table[0, 1] = 5.0
    with pytest.raises(
        cg.StaleGraphError,
        match=r"NumpyScaled\.table changed from array\(\[\[1\., 2\.\]\]\) to array\(\[\[1\., 5\.\]\]\)",
    ):
        g(torch.randn(4, 8))

"""Reads the names of the forward's code do not show, on the CPU stand-in (conftest.py), which
replays the logged operations without running the function: a value the guard missed gives the
recorded answer here, as in a graph. Each change after the capture must give eager's answer
through one new capture, or the capture must be refused with a named error."""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator

import pytest
import torch
from reads_cases import (
    SCALE_VARIABLE,
    SEEN,
    SET_SCALE_FACTOR,
    MkldnnBranch,
    ReadsTheClock,
    SdpBranch,
    ThreadsBranch,
    answers_as_eager_after,
    defined_in_a_function,
)

import cudagraphs as cg


@pytest.fixture(autouse=True)
def helper_factor_put_back() -> Iterator[None]:
    yield
    SET_SCALE_FACTOR(2.0)
    os.environ.pop(SCALE_VARIABLE, None)


def _answers_as_eager_after(
    model: torch.nn.Module, change, name: str, compile: bool = False
) -> None:
    answers_as_eager_after(model, change, name, compile=compile)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
@pytest.mark.parametrize("case", list(SEEN))
def test_a_value_read_under_no_name_of_the_code_changed_after_capture_gives_eager_s_answer(
    stand_in: None, case: str, compile: bool
) -> None:
    make, change, name = SEEN[case]
    _answers_as_eager_after(make(), change, name, compile)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
def test_a_variable_of_the_function_that_defined_the_forward_is_seen(
    stand_in: None, compile: bool
) -> None:
    model, set_factor = defined_in_a_function()
    _answers_as_eager_after(model, lambda m: set_factor(3.0), "factor", compile)


@pytest.mark.parametrize("case", list(SEEN))
def test_on_stale_raise_names_the_value_read_under_no_name(stand_in: None, case: str) -> None:
    make, change, name = SEEN[case]
    model = make()
    g = cg.graph(model, torch.randn(4, 8), on_stale="raise")
    g(torch.randn(4, 8))
    change(model)
    with pytest.raises(cg.StaleGraphError, match=name):
        g(torch.randn(4, 8))


def test_a_change_of_an_attribute_the_forward_never_reads_keeps_the_graph(stand_in: None) -> None:
    # Whole objects are not guarded: a value the code cannot reach under any name (not
    # through getattr either) changes nothing.
    make, _, _ = SEEN["dict key held in an attribute"]
    model = make()
    g = cg.graph(model, torch.randn(4, 8), outputs="clone")
    g(torch.randn(4, 8))
    model.unrelated = 5.0
    model.steps_logged = 3
    x = torch.randn(4, 8)
    torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 0


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
def test_a_branch_on_the_thread_count_is_seen(stand_in: None, compile: bool) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _answers_as_eager_after(
            ThreadsBranch(), lambda m: torch.set_num_threads(1), "get_num_threads", compile
        )
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
def test_a_branch_on_a_setting_read_through_a_python_function_of_torch_is_seen(
    stand_in: None, compile: bool
) -> None:
    enabled = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(True)
    try:
        _answers_as_eager_after(
            SdpBranch(),
            lambda m: torch.backends.cuda.enable_flash_sdp(False),
            "flash_sdp_enabled",
            compile,
        )
    finally:
        torch.backends.cuda.enable_flash_sdp(enabled)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
def test_a_branch_on_a_torch_backends_flag_is_seen(stand_in: None, compile: bool) -> None:
    with torch.backends.mkldnn.flags(enabled=True):
        model = MkldnnBranch()
        g = cg.graph(model, torch.randn(4, 8), outputs="clone", compile=compile)
        fresh = torch.randn(4, 8)
        recorded = g(fresh)
        with torch.backends.mkldnn.flags(enabled=False):
            expected = model(fresh)
            assert not torch.allclose(expected, recorded)
            torch.testing.assert_close(g(fresh), expected)
        assert g.stats.recaptures == 1
        assert any("enabled" in notice for notice in g.stats.notices), g.stats.notices


@pytest.mark.parametrize("layout", ["large", "strided"])
def test_a_numpy_array_too_large_or_strided_to_compare_is_refused_at_capture(
    stand_in: None, layout: str
) -> None:
    np = pytest.importorskip("numpy")

    class Table(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8).requires_grad_(False)
            table = np.ones((200, 100)) if layout == "large" else np.ones((4, 8))[:, ::2]
            self.table = table

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * float(self.table[1, 1])

    model = Table()
    with pytest.raises(cg.FrozenStateError, match=r"table(.|\n)*test_reads_seen\.py:\d+"):
        cg.graph(model, torch.randn(4, 8))
    # Declared harmless (the user promises not to change it): captured, held by identity.
    g = cg.graph(model, torch.randn(4, 8), harmless_state=("table",))
    x = torch.randn(4, 8)
    torch.testing.assert_close(g(x), model(x))


def test_a_dict_too_large_to_compare_read_with_computed_keys_is_refused(stand_in: None) -> None:
    class Table(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8).requires_grad_(False)
            self.weights = {f"w{i}": 1.0 for i in range(1001)}
            self.index = 3

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * self.weights[f"w{self.index}"]

    with pytest.raises(
        cg.FrozenStateError, match=r"holds 1001 values(.|\n)*test_reads_seen\.py:\d+"
    ):
        cg.graph(Table(), torch.randn(4, 8))


def test_a_branch_on_the_clock_is_refused_at_capture_naming_the_line(stand_in: None) -> None:
    with pytest.raises(
        cg.FrozenStateError, match=r"time\.perf_counter\(\) at .*reads_cases\.py:\d+"
    ):
        cg.graph(ReadsTheClock(), torch.randn(4, 8))
    # Declared harmless (a reading that decides nothing on the GPU), it captures.
    g = cg.graph(ReadsTheClock(), torch.randn(4, 8), harmless_state=("time.perf_counter",))
    assert g.stats.state == "captured"


def test_an_environment_variable_transformers_reads_in_the_forward_is_guarded(
    stand_in: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # transformers' SDPA attention reads TRANSFORMERS_SDPA_FORCE_GQA on every call to pick
    # its grouped path: a change after the capture captures again. Older releases do not read
    # it (5.17, the floor, decides from the shapes alone), so there is nothing to guard there.
    import transformers
    from transformers import LlamaConfig, LlamaModel
    from transformers.integrations import sdpa_attention

    if "TRANSFORMERS_SDPA_FORCE_GQA" not in inspect.getsource(sdpa_attention):
        pytest.skip(f"transformers {transformers.__version__} reads no environment variable here")

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaModel(config).eval().requires_grad_(False)

    def hidden(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).last_hidden_state

    ids = torch.randint(0, 128, (1, 16))
    g = cg.graph(hidden, ids, outputs="clone")
    assert any("TRANSFORMERS_SDPA_FORCE_GQA" in label for label, *_ in g.read_values)
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    torch.testing.assert_close(g(ids), hidden(ids))
    assert g.stats.recaptures == 1


def test_the_environment_variables_compiled_code_names_are_guarded_unread() -> None:
    # Under torch.compile Dynamo reads a variable from its own frames while it traces (some
    # releases fold its value into the trace), so the profiler may see no model code read
    # it: the variables the compiled forward's bytecode names are guarded from the start.
    from reads_cases import ReadsTheEnvironment

    from cudagraphs.core.python_values import Reader

    compiled = torch.compile(ReadsTheEnvironment())
    assert SCALE_VARIABLE in Reader(of=compiled).environment
    assert SCALE_VARIABLE not in Reader(of=ReadsTheEnvironment()).environment  # seen as run


def test_a_changed_environment_variable_drops_compile_s_trace_before_capturing_again(
    stand_in: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A trace that folded the old value would be captured again unchanged: the frames the
    # compiled forward reaches are forgotten first, so the new capture traces the new value.
    from reads_cases import ReadsTheEnvironment

    from cudagraphs.core import compat

    forgotten: list[object] = []
    forget = compat.forget_compiled_frames
    monkeypatch.setattr(compat, "forget_compiled_frames", lambda codes: (forgotten.append(list(codes)), forget(codes)))  # fmt: skip
    make, change, name = SEEN["environment variable read in a branch"]
    _answers_as_eager_after(make(), change, name, compile=True)
    assert any(ReadsTheEnvironment.forward.__code__ in codes for codes in forgotten)

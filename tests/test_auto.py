"""``cg.auto`` on the CPU: it returns eager with the reason, keys its saved decision by what
the decision depends on, keeps decisions out of folders others can write to, and its command
exits 0, or 2 on a mistake."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import value_cases
from torch import nn

import cudagraphs as cg
from cudagraphs.tools import choosing as auto_module


def _model(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU())


def test_without_cuda_auto_returns_eager_and_says_why() -> None:
    model = _model()
    x = torch.randn(4, 8)
    chosen = cg.auto(model, x)
    assert chosen.report.chosen == "eager" and "no CUDA" in chosen.report.reason
    torch.testing.assert_close(chosen(x), model(x))
    assert '"chosen": "eager"' in chosen.report.to_json()
    assert "eager" in str(chosen.report)
    assert chosen.report.findings == []  # nothing the doctor objects to


def test_the_report_carries_the_doctors_findings() -> None:
    """The host read that keeps a plain graph from recording is named, with its line."""

    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            return y * 2 if y.sum().item() > 0 else y - 1

    report = cg.auto(Branches(), torch.randn(4, 8)).report
    assert any(
        line.startswith("host-sync at ") and "test_auto.py" in line for line in report.findings
    )
    assert "doctor: host-sync" in str(report) and "host-sync" in report.to_json()


def test_an_unknown_candidate_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(cg.ConfigError, match="graph over compile"):
        cg.auto(_model(), torch.randn(4, 8), candidates=["graph", "magic"])


@pytest.mark.parametrize(
    "keyword, message",
    [
        ({"warmpu": 3}, "did you mean warmup=, an option of cg.graph"),
        ({"verfy": True}, "did you mean verify="),
        ({"budget": 10.0}, "did you mean budget_s="),
        ({"warmup": 3}, "cg.auto does not take the option warmup="),
        ({"colour": "red"}, "unknown keyword argument colour="),
    ],
)
def test_a_keyword_cg_auto_and_the_model_do_not_take_is_refused(
    keyword: dict, message: str
) -> None:
    # Before, each was kept as an example keyword and the report said the doctor could not run.
    with pytest.raises(cg.ConfigError, match=message):
        cg.auto(_model(), torch.randn(4, 8), **keyword)


def test_an_example_keyword_the_function_takes_is_passed_to_it() -> None:
    def scaled(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x * scale

    x = torch.randn(4, 8)
    fast = cg.auto(scaled, x, scale=3.0)
    torch.testing.assert_close(fast(x, scale=3.0), x * 3.0)


def test_the_decision_key_changes_with_config_parameters_shapes_and_versions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = auto_module._decision_key
    x = torch.randn(4, 8)
    base = key(_model(), (x,), {}, auto_module.CANDIDATES, None)
    assert base == key(_model(), (x,), {}, auto_module.CANDIDATES, None)  # stable
    assert base != key(_model(16), (torch.randn(4, 16),), {}, auto_module.CANDIDATES, None)
    assert base != key(_model(), (torch.randn(2, 8),), {}, auto_module.CANDIDATES, None)
    assert base != key(_model(), (x,), {}, ("graph",), None)
    configured = _model()
    configured.config = type("Config", (), {"to_json_string": lambda self: '{"layers": 2}'})()
    other = _model()
    other.config = type("Config", (), {"to_json_string": lambda self: '{"layers": 3}'})()
    assert key(configured, (x,), {}, ("graph",), None) != key(other, (x,), {}, ("graph",), None)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert base != key(_model(), (x,), {}, auto_module.CANDIDATES, None)


def test_the_decision_key_follows_transformers_version_without_importing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A process that never imported transformers (a timm model) must not pay its import
    # (seconds) for the key; a process that uses it keys on its version.
    import sys
    import types

    key = auto_module._decision_key
    x = torch.randn(4, 8)
    monkeypatch.delitem(sys.modules, "transformers", raising=False)
    without = key(_model(), (x,), {}, ("graph",), None)
    assert "transformers" not in sys.modules
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="1.0"))
    first = key(_model(), (x,), {}, ("graph",), None)
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="2.0"))
    assert len({without, first, key(_model(), (x,), {}, ("graph",), None)}) == 3


def test_the_decision_key_changes_with_the_model_source(tmp_path: Path) -> None:
    keys = []
    for body in ("return self.fc(x)", "return self.fc(x) * 2"):
        path = tmp_path / f"model_{len(keys)}.py"
        path.write_text(
            textwrap.dedent(
                f"""
                import torch
                class Net(torch.nn.Module):
                    def __init__(self):
                        super().__init__()
                        self.fc = torch.nn.Linear(8, 8)
                    def forward(self, x):
                        {body}
                """
            )
        )
        namespace: dict = {}
        sys.path.insert(0, str(tmp_path))
        try:
            module = __import__(path.stem)
        finally:
            sys.path.remove(str(tmp_path))
        namespace["Net"] = module.Net
        keys.append(
            auto_module._decision_key(module.Net(), (torch.randn(2, 8),), {}, ("graph",), None)
        )
    assert keys[0] != keys[1]


def test_a_saved_decision_is_read_back_only_from_a_folder_of_ones_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDAGRAPHS_SAVED_STEPS_DIR", str(tmp_path / "steps"))
    report = auto_module.AutoReport(
        "Net", "graph", "the fastest verified candidate", 100.0,
        [auto_module.Candidate("graph", 20.0, 5.0, True, "", 1.5)],
    )  # fmt: skip
    auto_module._save("k1", report)
    loaded = auto_module._load("k1")
    assert loaded is not None and loaded.chosen == "graph" and loaded.candidates[0].us == 20.0
    assert auto_module._load("another key") is None
    (tmp_path / "steps" / "auto").chmod(0o777)  # others may write there now: not trusted
    assert auto_module._load("k1") is None


@pytest.mark.slow
def test_the_command_prints_the_table_and_exits_0_or_2_on_a_mistake(tmp_path: Path) -> None:
    target = tmp_path / "target.py"
    target.write_text(
        "import torch\ndef make():\n    return torch.nn.Linear(8, 8), (torch.randn(4, 8),)\n"
    )
    run = [sys.executable, "-m", "cudagraphs", "auto"]
    done = subprocess.run([*run, f"{target}:make"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "cg.auto(" in done.stdout and "eager" in done.stdout
    wrong = subprocess.run([*run, f"{target}:nope"], capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 2 and "has no function 'nope'" in wrong.stderr


def test_segments_add_the_failing_block_until_capture_succeeds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The segments candidate captures again with each host-reading block's class in
    ``eager``, and refuses (a row, not a choice) when every step records."""
    from cudagraphs.errors import CaptureError

    class Router(nn.Module):
        pass

    class Experts(nn.Module):
        pass

    blocks = {Router: Router(), Experts: Experts()}
    tried: list[tuple[type, ...]] = []

    def fake_graph(fn: object, *args: object, eager: list[type], **kwargs: object) -> object:
        tried.append(tuple(eager))
        missing = [cls for cls in (Router, Experts) if cls not in eager]

        def call(*a: object, **k: object) -> str:
            if missing:
                raise CaptureError("host read", kind="host-sync", block=blocks[missing[0]])
            return "graphed"

        return call

    monkeypatch.setattr(auto_module, "graph", fake_graph)
    call = auto_module._graph_around_host_reads(lambda x: x, (1,), {})
    assert call() == "graphed"
    assert tried == [(), (Router,), (Router, Experts)]

    monkeypatch.setattr(auto_module, "graph", lambda fn, *a, eager, **k: lambda *x, **y: 1)
    with pytest.raises(auto_module._NotApplicable, match="the same as graph"):
        auto_module._graph_around_host_reads(lambda x: x, (1,), {})

    def never_splits(fn: object, *a: object, eager: list[type], **k: object) -> object:
        def call(*x: object, **y: object) -> None:
            raise CaptureError("sync", kind="host-sync", block=None)

        return call

    monkeypatch.setattr(auto_module, "graph", never_splits)
    with pytest.raises(CaptureError):
        auto_module._graph_around_host_reads(lambda x: x, (1,), {})


def _build_anew(model: Any, args: tuple[Any, ...], key: str) -> tuple[Any, int]:
    """``cg.auto``'s graph over compile of ``model`` built as a new process builds it (Dynamo
    reset), and how many graphs Dynamo traced for it (0: loaded from disk)."""
    import warnings

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", cg.CudaGraphsWarning)
        call = auto_module._build("graph over compile", model, args, {}, None, key)
        call(*args)
    return call, counters["stats"]["unique_graphs"] - before


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * self.scale


@pytest.mark.slow
def test_the_graph_over_compile_is_saved_and_a_later_build_loads_it(
    fresh_compile_cache: object,
) -> None:
    """The chosen graph over compile of a module is built over a compile saved to disk, which
    a later build (a second process: Dynamo reset) loads with no trace, and names the model's
    code for the value guard (READS_LIKE). On the CPU the graph is the pass-through; the
    captured path and its guard run in test_auto_cuda.py."""
    from cudagraphs.core import READS_LIKE

    model = _Scaled().eval()
    x = torch.randn(4, 8)
    builds = []
    for _ in range(2):
        call, traces = _build_anew(model, (x,), "k")
        with torch.no_grad():
            torch.testing.assert_close(call(x), model(x))
        builds.append(traces)
        reads = getattr(call.fn, READS_LIKE)
        assert any(code is _Scaled.forward.__code__ for code in reads)
    assert builds == [1, 0]  # traced once, then loaded
    model.scale = 2.0  # the loaded entry's own guards refuse it: compiled again, eager's answer
    with torch.no_grad():
        torch.testing.assert_close(call(x), model(x))


@pytest.mark.slow
@pytest.mark.parametrize("held", ["attribute", "partial", "slots"])
def test_a_model_holding_another_function_is_never_answered_from_another_build(
    fresh_compile_cache: object, held: str
) -> None:
    """Two builds of one model class, one with ``torch.relu`` and one with ``torch.tanh``
    (as two processes would make them): the second must not load the first's compile, whose
    saved guards could not check which function it holds. Each answers as eager."""
    x = torch.randn(4, 8)
    for activation in (torch.relu, torch.tanh):
        torch.manual_seed(0)
        model = value_cases.HeldActivation(activation, held).eval()
        call, _ = _build_anew(model, (x,), f"act-{held}")
        with torch.no_grad():
            torch.testing.assert_close(call(x), model(x))


class _Policy:
    """A recurrent policy as a plain object with ``__call__`` (not an ``nn.Module``)."""

    def __init__(self) -> None:
        self.cell = nn.GRUCell(8, 16)
        self.head = nn.Linear(16, 4)
        self.scale = 1.0

    def __call__(self, observations: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        actions = []
        for t in range(observations.shape[0]):
            h = self.cell(observations[t], h)
            actions.append(torch.tanh(self.head(h)) * self.scale)
        return torch.stack(actions)


@pytest.mark.slow
def test_a_plain_callable_object_is_saved_and_a_later_build_loads_it(
    fresh_compile_cache: object,
) -> None:
    """Not only modules: a plain object with ``__call__`` is traced once and loaded by a
    later build, and a plain value it reads (``policy.scale``) changed after the build gives
    the new answer."""
    policy = _Policy()
    args = (torch.randn(5, 3, 8), torch.randn(3, 16))
    traces = []
    for _ in range(2):
        call, traced = _build_anew(policy, args, "policy")
        traces.append(traced)
        with torch.no_grad():
            torch.testing.assert_close(call(*args), policy(*args))
    assert traces == [1, 0]
    policy.scale = 2.0
    with torch.no_grad():
        torch.testing.assert_close(call(*args), policy(*args))


@pytest.mark.slow
def test_a_module_global_changed_after_a_saved_compile_gives_the_new_answer(
    fresh_compile_cache: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aot_compile`` drops the guards on module globals, so a saved entry would keep the
    ``GAIN`` it was traced under. After the global changes, the step runs under
    ``torch.compile``'s own guards (eager's answer), and a later build under the new value
    does not load the entry saved under the old one."""
    model = value_cases.Gained().eval()
    x = torch.randn(4, 8)
    traces = [_build_anew(model, (x,), "gain")[1] for _ in range(2)]
    call, _ = _build_anew(model, (x,), "gain")  # loaded from disk
    assert traces == [1, 0]
    monkeypatch.setattr(value_cases, "GAIN", 3.0)
    anew, _ = _build_anew(model, (x,), "gain")
    with torch.no_grad():
        torch.testing.assert_close(call(x), model(x))
        torch.testing.assert_close(anew(x), model(x))


@pytest.mark.slow
def test_a_global_function_keys_the_saved_compile_by_name_and_a_swap_gives_the_new_answer(
    fresh_compile_cache: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module global holding a function (``POSTPROCESS = halved``) keys the saved file by
    its importable name, the same in every process (not its repr, which holds an address);
    swapped after the build, the step gives the new function's answer. A global holding a
    lambda has no such name: that compile is not saved."""
    import value_cases

    model = value_cases.Activated().eval()
    x = torch.randn(4, 8)
    assert auto_module._key_text(value_cases.halved) == "value_cases.halved"
    traces = [_build_anew(model, (x,), "activated")[1] for _ in range(2)]
    call, _ = _build_anew(model, (x,), "activated")
    assert traces == [1, 0]
    monkeypatch.setattr(value_cases, "POSTPROCESS", value_cases.doubled)
    with torch.no_grad():
        torch.testing.assert_close(call(x), model(x))
    monkeypatch.setattr(value_cases, "POSTPROCESS", lambda y: y * 3.0)
    traces = [_build_anew(model, (x,), "activated")[1] for _ in range(2)]
    assert traces == [1, 1]


@pytest.mark.slow
def test_a_saved_compile_whose_trace_made_up_module_globals_loads_in_a_later_build(
    fresh_compile_cache: object,
) -> None:
    """transformers' outputs make the trace name a module by a global holding this process's
    object id (``___module_collections_<id>_c0``) and load builtins as globals (``type``): the
    saved entry records their names, and a later build (its traced function's globals new, as
    in a new process) hands them back, so the compile loads instead of being traced again."""
    transformers = pytest.importorskip("transformers")

    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2Model(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 8))
    traces = []
    for _ in range(2):
        call, traced = _build_anew(model, (ids,), "gpt2")
        with torch.no_grad():
            got, expected = call(ids), model(ids)
        torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state)
        traces.append(traced)
    saved = list(Path(str(fresh_compile_cache)).glob("cudagraphs/auto-*/*.bin"))
    assert saved and traces == [1, 0]


class _Built:
    """A stand-in for one built way: which candidate, and whether it is still alive."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: object) -> str:
        return self.name


def _deciding_with(monkeypatch: pytest.MonkeyPatch, fails_again: bool = False) -> list[Any]:
    """``auto_module._decide`` with building, timing and verifying replaced: ``graph`` is the
    fastest; returns the log of builds, each with the weak references alive at its time."""
    import types
    import weakref

    log: list[Any] = []
    alive: list[weakref.ref[_Built]] = []

    def build(candidate: str, *rest: object) -> _Built:
        if fails_again and candidate == "graph" and any(c == "graph" for c, _ in log):
            raise RuntimeError("capture failed")
        log.append((candidate, [r().name for r in alive if r() is not None]))
        built = _Built(candidate)
        alive.append(weakref.ref(built))
        return built

    def time_all(fn: object, calls: dict[str, Any], *rest: object) -> tuple[float, dict]:
        return 100.0, {name: (10.0 if name == "graph" else 50.0) for name in calls}

    profiled = types.SimpleNamespace(kernels_per_call=3.0, gpu_idle_fraction=0.5)
    monkeypatch.setattr(auto_module, "_build", build)
    monkeypatch.setattr(auto_module, "_time", time_all)
    monkeypatch.setattr(auto_module, "profile", lambda *a, **k: profiled)
    monkeypatch.setattr(auto_module, "compare_with_eager", lambda *a, **k: None)
    monkeypatch.setattr(auto_module, "_findings", lambda *a: [])
    return log


def test_the_chosen_way_is_built_again_after_the_other_candidates_are_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The callable handed back is not the one built among the candidates (often the first
    graph of the process) but the chosen way built once more with the others gone, as a
    later process builds it from the saved decision."""
    log = _deciding_with(monkeypatch)
    ways = ("graph", "graph over compile", "backend")
    report, call = auto_module._decide(lambda x: x, (torch.ones(2),), {}, ways, None, 1, 60.0, "k")
    assert report.chosen == "graph" and call() == "graph"
    assert [name for name, _ in log] == [*ways, "graph"]
    assert log[-1][1] == []  # none of the candidates built first is still alive
    assert call is not None and [name for name, _ in log].count("graph") == 2


def test_a_chosen_way_that_fails_when_built_again_answers_eagerly_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _deciding_with(monkeypatch, fails_again=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x

    report, call = auto_module._decide(fn, (torch.ones(2),), {}, ("graph",), None, 1, 60.0, "k")
    assert report.chosen == "eager" and call is fn
    assert "graph was fastest but failed when built again: RuntimeError" in report.reason


def test_a_candidate_failing_with_an_empty_message_is_a_rejected_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exception without a message is still one line of the report, not an error of the
    report's own."""
    _deciding_with(monkeypatch)
    real_build = auto_module._build

    def build(candidate: str, *rest: object) -> object:
        if candidate == "backend":
            raise ValueError()
        return real_build(candidate, *rest)

    monkeypatch.setattr(auto_module, "_build", build)
    ways = ("graph", "backend")
    report, _ = auto_module._decide(lambda x: x, (torch.ones(2),), {}, ways, None, 1, 60.0, "k")
    rows = {row.name: row for row in report.candidates}
    assert rows["backend"].rejected == "ValueError: " and not rows["backend"].verified
    assert report.chosen == "graph"

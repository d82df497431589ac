"""Nothing frozen silently, on the CPU: modes, gradients, plain Python state, threads, random
draws in device loops and sliding-window caches, through the captured call path (the CPU
stand-in of conftest.py) where the logic runs without a GPU. The GPU versions are in
test_footguns.py."""

from __future__ import annotations

import random
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from stateful_models import Counting, Flipping
from torch import nn

import cudagraphs as cg
from cudagraphs.core import PythonSnapshot as Snapshot
from cudagraphs.core import RandomDraws
from cudagraphs.core import modes as modes_module
from cudagraphs.core.replay import Counters, OutputsInUse, Replayer
from cudagraphs.core.signature import Signature


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).eval()


def test_autocast_at_call_differs_from_capture_raises(stand_in: None) -> None:
    model = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8), outputs="clone")
        x = torch.randn(2, 8)
        torch.testing.assert_close(g(x), model(x))
        with (
            torch.autocast("cpu", dtype=torch.bfloat16),
            pytest.raises(
                cg.ModeMismatchError, match=r"autocast\(cpu\) was off at capture, is bfloat16"
            ),
        ):
            g(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = cg.graph(model, torch.randn(2, 8), outputs="clone")
            out = amp(x)
            assert out.dtype == model(x).dtype == torch.bfloat16
        with pytest.raises(cg.ModeMismatchError, match=r"autocast\(cpu\) was bfloat16"):
            amp(x)  # the reverse: captured under autocast, called without


def test_grad_mode_on_at_call_raises_naming_graph_autograd(stand_in: None) -> None:
    model = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8), outputs="clone")
    with pytest.raises(cg.GradientsNotRecordedError, match=r"cg\.graph_autograd"):
        g(torch.randn(2, 8))  # parameters require grad: eager would record history
    model.requires_grad_(False)
    with pytest.raises(cg.ModeMismatchError, match="grad mode was off at capture, is on"):
        g(torch.randn(2, 8))  # nothing requires grad, but the modes still differ
    with torch.inference_mode(), pytest.raises(cg.ModeMismatchError, match="inference mode"):
        g(torch.randn(2, 8))


@pytest.fixture
def backend_flags() -> Iterator[None]:
    """Restores cuDNN's and cuBLAS's settings (global to the process) after a test."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    before = cg.core.math_settings()
    flags = (cudnn.enabled, cudnn.deterministic, matmul.allow_fp16_accumulation)
    tf32 = (cudnn.allow_tf32, matmul.allow_tf32)
    precisions = {b_o: torch._C._get_fp32_precision_getter(*b_o) for b_o in PRECISIONS}
    yield
    cudnn.enabled, cudnn.deterministic, matmul.allow_fp16_accumulation = flags
    cudnn.allow_tf32, matmul.allow_tf32 = tf32  # the legacy flags (they set some levels too)
    for (backend, op), value in precisions.items():  # then every level as it was
        torch._C._set_fp32_precision_setter(backend, op, value)
    assert cg.core.math_settings() == before, "the settings were not restored"


PRECISIONS = [
    ("generic", "all"),
    ("cuda", "all"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
    ("cuda", "matmul"),
]


def _set_tf32_convolutions_off() -> None:
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # the newer, per-operation flag


@pytest.mark.parametrize(
    ("flip", "named"),
    [
        (lambda: setattr(torch.backends.cudnn, "allow_tf32", False), "TF32 in cuDNN"),
        (_set_tf32_convolutions_off, "TF32 in cuDNN"),
        (lambda: setattr(torch.backends.cudnn, "enabled", False), "cuDNN enabled"),
        (lambda: setattr(torch.backends.cudnn, "deterministic", True), "cuDNN deterministic"),
        (
            lambda: setattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", True),
            "fp16 accumulation in cuBLAS matmuls",
        ),
    ],
    ids=["legacy-tf32", "conv-precision", "enabled", "deterministic", "fp16-accumulation"],
)
def test_backend_setting_changed_after_capture_is_refused(
    stand_in: None, backend_flags: None, flip: Callable[[], None], named: str
) -> None:
    """PyTorch's global-state guard leaves these out; a recording keeps the kernels (and their
    precision) chosen at capture, so a replay after the change would not be eager's answer."""
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.enabled, torch.backends.cudnn.deterministic = True, False
    torch.backends.cuda.matmul.allow_fp16_accumulation = False
    model = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8), outputs="clone")
        x = torch.randn(2, 8)
        torch.testing.assert_close(g(x), model(x))
        flip()
        with pytest.raises(cg.ModeMismatchError, match=re.escape(named)):
            g(x)


def test_mixed_tf32_flags_are_read_one_by_one(stand_in: None, backend_flags: None) -> None:
    """With the legacy and the per-operation flags mixed, the combined getter raises at
    capture: the check reads each precision instead, and still sees a change."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.fp32_precision = "tf32"  # the legacy getter now raises
    with pytest.raises(RuntimeError):
        torch._C._get_cudnn_allow_tf32()
    assert cg.core.math_settings()["TF32 in cuDNN"].startswith("mixed")  # keys still readable
    model = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8), outputs="clone")
        x = torch.randn(2, 8)
        torch.testing.assert_close(g(x), model(x))  # replays: nothing changed
        assert g.stats.replays >= 1
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        with pytest.raises(cg.ModeMismatchError, match=r"float32 precision \(cuda, conv\)"):
            g(x)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_modes_check_sees_each_setting_with_and_without_the_extension(
    backend_flags: None, monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    if compiled and modes_module.compiled_module() is None:
        pytest.skip("the compiled extension is not built here")
    if not compiled:
        monkeypatch.setattr(modes_module, "compiled_module", lambda: None)
    torch.backends.cudnn.deterministic = False
    modes = modes_module.Modes("probe")
    assert modes.same()
    torch.backends.cudnn.deterministic = True
    assert not modes.same()
    torch.backends.cudnn.deterministic = False
    assert modes.same()
    with torch.inference_mode():
        assert not modes.same()


def test_capture_whose_outputs_need_gradients_is_refused(stand_in: None) -> None:
    with pytest.raises(cg.GradientsNotRecordedError, match=r"output of shape \(2, 4\)"):
        cg.graph(mlp(), torch.randn(2, 8), outputs="clone")
    frozen = mlp().requires_grad_(False)
    g = cg.graph(
        frozen, torch.randn(2, 8), outputs="clone"
    )  # grad mode on, nothing requires grad: fine
    x = torch.randn(2, 8)
    torch.testing.assert_close(g(x), frozen(x))
    with pytest.raises(cg.GradientsNotRecordedError, match="did not at capture"):
        g(torch.randn(2, 8, requires_grad=True))
    frozen[0].weight.requires_grad_(True)
    with pytest.raises(cg.GradientsNotRecordedError, match="did not at capture"):
        g(x)


def test_a_thread_count_change_is_not_a_mode_change(stand_in: None) -> None:
    model = mlp()
    before = torch.get_num_threads()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8), outputs="clone")
        try:
            torch.set_num_threads(1 if before > 1 else 2)
            x = torch.randn(2, 8)
            torch.testing.assert_close(g(x), model(x))
        finally:
            torch.set_num_threads(before)


@torch.no_grad()
def test_a_counter_in_forward_is_refused_naming_it_unless_declared(stand_in: None) -> None:
    model = Counting(mlp())
    with pytest.raises(cg.FrozenStateError, match=r"Counting\.calls was \d+, became \d+") as info:
        cg.graph(model, torch.randn(2, 8), outputs="clone")
    assert info.value.names == ["Counting.calls"]
    assert "harmless_state=('calls',)" in str(info.value)
    assert model.calls == 0  # the library's own runs were put back
    g = cg.graph(model, torch.randn(2, 8), harmless_state=("calls",), outputs="clone")
    assert model.calls == 0 and g.state is cg.State.CAPTURED
    x = torch.randn(2, 8)
    torch.testing.assert_close(g(x), model.net(x))


@torch.no_grad()
def test_a_flag_the_forward_flips_is_refused(stand_in: None) -> None:
    with pytest.raises(cg.FrozenStateError, match=r"Flipping\.flip was (True|False)"):
        cg.graph(Flipping(), torch.randn(4), outputs="clone")
    with pytest.raises(cg.FrozenStateError, match="flip"):
        lazy = cg.graph(Flipping(), warmup=2, outputs="clone")
        for _ in range(3):
            lazy(torch.randn(4))


class _InPlace(nn.Module):
    """A flag kept in a list, or a NumPy array, that the forward changes in place and branches
    on: the attribute is the same object at every run, its contents are not."""

    def __init__(self, holder: str) -> None:
        import numpy

        super().__init__()
        self.net = nn.Linear(8, 8)
        self.state = [0] if holder == "list" else numpy.zeros(1)
        self.outputs: list[torch.Tensor] = []  # tensors only: not plain state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state[0] += 1
        self.outputs[:] = [x]
        y = self.net(x)
        return -y if self.state[0] % 2 else y


@pytest.mark.parametrize("holder", ["list", "numpy array"])
def test_a_list_or_array_the_forward_changes_in_place_is_refused_unless_declared(
    stand_in: None, holder: str
) -> None:
    """Every replay would take the recorded branch where eager alternates. The refusal names
    the attribute and shows its contents; the library's runs are put back either way."""
    model = _InPlace(holder).requires_grad_(False)
    with pytest.raises(cg.FrozenStateError, match=r"_InPlace\.state was .*1.*, became .*2") as info:
        cg.graph(model, torch.randn(2, 8))
    assert info.value.names == ["_InPlace.state"]
    assert model.state[0] == 0
    g = cg.graph(model, torch.randn(2, 8), harmless_state=("state",))
    assert g.state is cg.State.CAPTURED and model.state[0] == 0


class _LayerDrop(nn.Module):
    """Drops its second layer at random with Python's (or NumPy's) global generator, as a
    hand-written layer drop or stochastic depth does."""

    def __init__(self, draw: Callable[[], float]) -> None:
        super().__init__()
        self.first, self.second, self.draw = nn.Linear(8, 8), nn.Linear(8, 8), draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        return x if self.draw() < 0.5 else self.second(x)


def _numpy_draw() -> float:
    import numpy

    return float(numpy.random.random())


@pytest.mark.parametrize(
    ("draw", "generator"), [(random.random, "random"), (_numpy_draw, "numpy.random")]
)
def test_a_draw_from_the_hosts_random_generator_is_refused_naming_it(
    stand_in: None, draw: Callable[[], float], generator: str
) -> None:
    """Every replay would repeat the recorded run's draw (the layer always dropped, or always
    kept) where eager draws afresh. The refusal names the generator and the way to declare a
    draw that decides nothing on the GPU, and leaves the generator as it found it."""
    import numpy

    model = _LayerDrop(draw).requires_grad_(False)
    state = random.getstate(), numpy.random.get_state()[1].tobytes()
    with pytest.raises(cg.FrozenStateError, match=f"draws from {re.escape(generator)}") as info:
        cg.graph(model, torch.randn(4, 8))
    assert info.value.names == [generator]
    assert f"harmless_state=({generator!r},)" in str(info.value)
    assert (random.getstate(), numpy.random.get_state()[1].tobytes()) == state
    g = cg.graph(model, torch.randn(4, 8), harmless_state=(generator,))  # declared: allowed
    assert g.state is cg.State.CAPTURED


class _OtherThreadDraws:
    """At each call, another thread draws from Python's shared generator and the caller waits
    for it: as a server's other request handlers may while a graph is captured."""

    def __init__(self) -> None:
        self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            self.go.acquire()
            random.random()
            self.done.release()

    def __call__(self) -> float:
        self.go.release()
        self.done.acquire()
        return 0.0  # this thread draws nothing


def test_another_thread_s_draws_during_a_capture_are_not_the_function_s(stand_in: None) -> None:
    """The shared generator's state moves at every run, but from another thread: the function
    itself draws nothing, and is captured. One that draws as well is still refused."""
    other = _OtherThreadDraws()
    model = _LayerDrop(other).requires_grad_(False)
    state = random.getstate()
    g = cg.graph(model, torch.randn(4, 8))
    assert g.state is cg.State.CAPTURED
    assert random.getstate() != state  # the other thread did draw meanwhile
    x = torch.randn(4, 8)
    torch.testing.assert_close(g(x), model.first(x))

    def both() -> float:
        other()
        return random.random()

    with pytest.raises(cg.FrozenStateError, match="draws from random"):
        cg.graph(_LayerDrop(both).requires_grad_(False), torch.randn(4, 8))

    # The lazy form: its eager calls were the warm-up, the capture the one watched run.
    lazy = cg.graph(_LayerDrop(other).requires_grad_(False))
    for _ in range(lazy.warmup + 2):
        lazy(x)
    assert lazy.state is cg.State.CAPTURED
    drawing = cg.graph(_LayerDrop(both).requires_grad_(False))
    with pytest.raises(cg.FrozenStateError, match="draws from random"):
        for _ in range(drawing.warmup + 2):
            drawing(x)


def test_a_draw_in_the_first_run_only_is_not_a_draw_at_every_call(stand_in: None) -> None:
    """Set-up that draws once (a compile's nonce, a lazily built table) is not refused: only a
    run after the first that draws again is."""
    drawn: list[float] = []

    def once(x: torch.Tensor) -> torch.Tensor:
        if not drawn:
            drawn.append(random.random())
        return x * 2.0

    g = cg.graph(once, torch.randn(4))
    assert g.state is cg.State.CAPTURED and len(drawn) == 1


def test_the_snapshot_reaches_closures_caches_and_arguments() -> None:
    layer = SimpleNamespace(length=0, window=16, name="a")
    cache = SimpleNamespace(layers=[layer])
    state = {"steps": 0}

    def step(x: torch.Tensor, c: Any) -> torch.Tensor:
        c.layers[0].length += 1
        state["steps"] += 1  # a plain dict's entry is inspected as an attribute is
        return x

    snapshot = Snapshot(step, [cache])
    for _ in range(3):
        step(torch.ones(1), cache)
        snapshot.take()
    changes = snapshot.changes()
    assert sorted(name for name, _, _ in changes) == [
        "argument SimpleNamespace.layers[0].length",
        "state['steps']",
    ]
    with pytest.raises(cg.FrozenStateError, match="length was 1, became 2"):
        snapshot.check(restore=True)
    assert layer.length == 0  # put back
    assert state["steps"] == 0  # put back too
    steady = Snapshot(step, [cache], harmless=("length", "state['steps']"))
    for _ in range(3):
        step(torch.ones(1), cache)
        steady.take()
    steady.check(restore=False)
    assert layer.length == 3


def test_a_dict_the_librarys_own_object_holds_is_not_the_users_state() -> None:
    class Registry:  # stands for one of the library's objects (a graph's counters)
        pass

    Registry.__module__ = "cudagraphs.registry"
    registry = Registry()
    registry.counts = {"replays": 0}  # type: ignore[attr-defined]
    settings = {"scale": 1.0}

    def step(x: torch.Tensor) -> torch.Tensor:
        registry.counts["replays"] += 1  # type: ignore[attr-defined]
        return x * settings["scale"]

    snapshot = Snapshot(step)
    for _ in range(3):
        step(torch.ones(1))
        snapshot.take()
    assert snapshot.changes() == []
    labels = {label for label, _, _ in snapshot.runs[-1].values()}
    assert "settings['scale']" in labels
    assert not any("replays" in label for label in labels)


def replayer_with(in_use: list[bool]) -> Replayer:
    x = torch.randn(3)
    signature, leaves = Signature.of_call((x,), {})
    graph: Any = SimpleNamespace(replay=lambda: None)
    replayer = Replayer(graph, signature, leaves, [], x * 2, "clone", Counters())
    replayer.policy = "guarded"  # the guarded emitter needs CUDA; its in_use() is what matters
    replayer._emitter = SimpleNamespace(in_use=lambda: in_use[0])
    replayer.emit = lambda: "guarded output"
    return replayer


def call_from_thread(replayer: Replayer) -> Any:
    result: list[Any] = []

    def run() -> None:
        x = torch.randn(3)
        try:
            result.append(replayer.call([x], (x,), {}))
        except BaseException as error:
            result.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result[0]


def test_a_second_thread_switches_guarded_outputs_to_copies() -> None:
    in_use = [False]
    replayer = replayer_with(in_use)
    x = torch.randn(3)
    assert replayer.call([x], (x,), {}) == "guarded output"  # the first thread: zero-copy
    in_use[0] = True  # that output is still alive when another thread calls
    with pytest.warns(cg.CudaGraphsWarning, match="second thread"):
        assert isinstance(call_from_thread(replayer), OutputsInUse)  # answered eagerly
    assert replayer.shared
    in_use[0] = False
    out = call_from_thread(replayer)
    # A copy of the static output, owned by the caller: the same values, not the same memory.
    assert isinstance(out, torch.Tensor) and torch.equal(out, replayer.output)
    assert out.data_ptr() != replayer.output.data_ptr()
    again = replayer.call([x], (x,), {})
    assert isinstance(again, torch.Tensor) and again is not out  # the first thread: copies too
    assert torch.equal(again, replayer.output) and again.data_ptr() != out.data_ptr()


def test_random_draws_are_seen_by_the_loop_check() -> None:
    x = torch.ones(8)
    with RandomDraws() as draws:
        _ = x * 2
    assert draws.found == []
    with RandomDraws() as draws:
        _ = x + torch.randn_like(x)
        _ = nn.functional.dropout(x, 0.5)
    assert [op for op, _ in draws.found] == ["aten::randn_like", "aten::bernoulli_"]
    assert draws.found[0][1].endswith(".py:" + draws.found[0][1].rsplit(":", 1)[1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_sliding_window_models_decode_as_generate_does(stand_in: None, kind: str) -> None:
    """Sliding-window layers get full-length layers (the model's sliding mask windows them):
    through the captured path, past the window, tokens equal generate's."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

    from cudagraphs.decoding.decoder import Decoder

    torch.manual_seed(3)
    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=16, max_position_embeddings=128,
    )  # fmt: skip
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(num_hidden_layers=2, **common)).eval()
    else:
        model = Gemma2ForCausalLM(Gemma2Config(num_hidden_layers=4, head_dim=16, **common)).eval()
    prompt = torch.randint(1, 256, (3, 12))  # no pad id (0) inside: generate would mask it
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40,
            min_new_tokens=40, do_sample=False, cache_implementation="static", pad_token_id=0,
        )  # fmt: skip
    decoder = Decoder(model, max_batch=4, max_length=52)
    assert all(g.state is cg.State.CAPTURED for g in decoder.graphs.values())
    got = decoder.generate(prompt, max_new_tokens=40, eos_token_id=None)
    assert torch.equal(got, expected)


def test_a_batchers_worker_runs_under_the_modes_of_its_creator(stand_in: None) -> None:
    """Grad and inference mode are per thread: a graph captured under inference mode in one
    thread and replayed by a batcher's worker thread must see the same modes there."""
    model = mlp()
    with torch.inference_mode():
        g = cg.graph(model, torch.randn(4, 8), buckets={"B": [2, 4]}, outputs="clone")
        with cg.Batcher(g, torch.randn(1, 8), max_batch=4, max_wait_ms=1) as batcher:
            x = torch.randn(3, 8)
            got = batcher.run(x, timeout=30)
            torch.testing.assert_close(got, model(x))

"""Real models keep state: what the library's own runs write is put back, every call runs once.

On the CPU: the write recorder and snapshots directly, and the captured call path through the
stand-in graph (``stand_in`` in conftest), where warm-up really runs the function and a capture,
like a CUDA capture, records without changing state.
"""

from __future__ import annotations

import gc
import re
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

import cudagraphs as cg
from cudagraphs.core.guards import AddressGuard
from cudagraphs.core.writes import SideEffects, WriteRecorder, reachable_tensors
from cudagraphs.core.writes import TensorSnapshot as Snapshot


class ToyCache:
    """A static KV cache that, like transformers 5's StaticCache layers, ignores the position it
    is given and advances a device counter of its own on every write."""

    def __init__(self, batch: int, length: int, width: int) -> None:
        self.keys = torch.zeros(batch, length, width)
        self.cumulative_length = torch.zeros((), dtype=torch.long)

    def update(self, k: torch.Tensor) -> torch.Tensor:
        position = self.cumulative_length.view(1)
        self.keys.index_copy_(1, position, k.unsqueeze(1))
        self.cumulative_length.add_(1)
        return self.keys


@pytest.fixture(autouse=True)
def _inference() -> Iterator[None]:
    """Every graph here is an inference graph: a replay records no gradients."""
    with torch.no_grad():
        yield


def make_decode(batch: int = 2, length: int = 16, width: int = 8):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    proj = nn.Linear(width, width)
    cache = ToyCache(batch, length, width)

    @torch.no_grad()
    def decode(x: torch.Tensor) -> torch.Tensor:
        keys = cache.update(proj(x))
        return keys.sum(1) + x

    return decode, cache, proj


def test_recorder_restores_written_state_and_skips_inputs_and_temporaries() -> None:
    decode, cache, _ = make_decode()
    x = torch.randn(2, 8)
    keys, counter = cache.keys.clone(), cache.cumulative_length.clone()
    x_before = x.clone()
    recorder = WriteRecorder(exclude=[x])
    with recorder:
        for _ in range(3):
            decode(x)
            x.mul_(2)  # an input: written, never copied
            torch.zeros(3).add_(1)  # a temporary: never copied
    assert cache.cumulative_length.item() == 3
    written = recorder.written()
    assert written.nbytes == cache.keys.nbytes + cache.cumulative_length.nbytes
    recorder.restore()
    assert torch.equal(cache.keys, keys) and torch.equal(cache.cumulative_length, counter)
    assert torch.equal(x, x_before * 8)  # inputs are the caller's business


def test_recorder_restores_views_rng_and_batchnorm_statistics() -> None:
    bn = nn.BatchNorm1d(4).train()
    base = torch.randn(6, 4)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    rng = torch.get_rng_state()
    with WriteRecorder() as recorder:
        bn(torch.randn(8, 4))
        base[2:4].fill_(7.0)  # a write through a view restores the whole storage
    recorder.restore()
    assert all(torch.equal(v, before[k]) for k, v in bn.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert (base[2:4] != 7.0).all()


def test_recorder_restores_a_storage_the_run_resized_after_writing_it() -> None:
    """FSDP2 frees a layer's gathered parameters by resizing their storage to 0 after the
    forward wrote them: restoring the bytes into the old size wrote past the storage."""
    gathered = torch.randn(256)
    before = gathered.clone()
    with WriteRecorder() as recorder:
        gathered.mul_(3)
        gathered.untyped_storage().resize_(0)
    recorder.restore()
    assert gathered.untyped_storage().nbytes() == before.nbytes
    assert torch.equal(gathered, before)


def test_reachable_tensors_finds_state_inside_objects_and_snapshot_restores_it() -> None:
    decode, cache, proj = make_decode()
    names = dict((id(t), n) for n, t in reachable_tensors(decode))
    assert names[id(cache.keys)] == "cache.keys"
    assert names[id(cache.cumulative_length)] == "cache.cumulative_length"
    assert names[id(proj.weight)] == "proj.weight"
    snapshot = Snapshot([("cache.keys", cache.keys)])
    cache.keys.add_(1)
    assert snapshot.changed() == ["cache.keys"]
    snapshot.restore()
    assert cache.keys.abs().sum() == 0


def test_side_effects_policies() -> None:
    decode, cache, _ = make_decode()
    x = torch.randn(2, 8)
    for policy, expected in [("restore", 0), ("keep", 2)]:
        cache.cumulative_length.zero_()
        effects = SideEffects(decode, [x], [], policy)
        with effects.running():
            decode(x)
            decode(x)
        written = effects.finish()
        assert cache.cumulative_length.item() == expected
        assert (policy == "keep") or "cache.cumulative_length" in written.names


def test_graph_creation_leaves_a_cache_as_it_was_and_replays_advance_it(stand_in: None) -> None:
    decode, cache, _ = make_decode()
    eager_decode, eager_cache, _ = make_decode()
    x = torch.randn(2, 8)
    g = cg.graph(decode, x, outputs="clone")
    assert cache.cumulative_length.item() == 0 and cache.keys.abs().sum() == 0
    assert g.stats.state_writes == 2 and g.stats.restored_bytes > 0
    for _ in range(5):
        x = torch.randn(2, 8)
        torch.testing.assert_close(g(x), eager_decode(x))
    assert cache.cumulative_length.item() == eager_cache.cumulative_length.item() == 5
    torch.testing.assert_close(cache.keys, eager_cache.keys)


def test_side_effects_raise_and_keep(stand_in: None) -> None:
    decode, cache, _ = make_decode()
    with pytest.raises(cg.StateWriteError, match=r"cache\.cumulative_length") as error:
        cg.graph(decode, torch.randn(2, 8), side_effects="raise")
    assert "cache.keys" in error.value.names and cache.cumulative_length.item() == 0
    cg.graph(decode, torch.randn(2, 8), side_effects="keep", warmup=3, outputs="clone")
    assert cache.cumulative_length.item() == 3  # warm-up counted, as the user asked


def test_batchnorm_in_training_mode_graph_leaves_statistics_and_rng(stand_in: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.0)).train()
    twin = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.0)).train()
    twin.load_state_dict(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    example = torch.randn(8, 4)
    rng = torch.get_rng_state()
    with torch.no_grad():
        g = cg.graph(model, example, outputs="clone")
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        for _ in range(4):
            x = torch.randn(8, 4)
            torch.testing.assert_close(g(x), twin(x))
    for (k, v), w in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(v, w, msg=k)
    assert model[1].num_batches_tracked.item() == 4


def test_lazy_form_runs_each_call_once(stand_in: None) -> None:
    decode, cache, _ = make_decode()
    eager_decode, _, _ = make_decode()
    g = cg.graph(decode, warmup=2, outputs="clone")
    for call in range(6):
        x = torch.randn(2, 8)
        torch.testing.assert_close(g(x), eager_decode(x))
        assert cache.cumulative_length.item() == call + 1
    assert g.stats.eager_calls == 2 and g.stats.replays == 4


def test_verify_passes_a_stateful_step_and_leaves_its_state(stand_in: None) -> None:
    decode, cache, _ = make_decode()
    g = cg.graph(decode, torch.randn(2, 8), verify=True, outputs="clone")
    assert g.state is cg.State.CAPTURED
    assert cache.cumulative_length.item() == 0 and cache.keys.abs().sum() == 0


def test_a_python_counter_in_a_dict_is_refused_before_a_graph_freezes_it(stand_in: None) -> None:
    table = torch.randn(32, 4)
    step = {"count": 0}

    def read_next(x: torch.Tensor) -> torch.Tensor:
        step["count"] += 1  # a Python counter used as an index: frozen by a graph
        return x + table[step["count"]]

    with pytest.raises(cg.FrozenStateError, match=r"step\['count'\] was 1, became 2"):
        cg.graph(read_next, torch.randn(4), verify=True, outputs="clone")
    assert step["count"] == 0  # the library's warm-up runs left no trace


def test_verify_warns_and_compares_shapes_when_eager_itself_varies(stand_in: None) -> None:
    generator = torch.Generator().manual_seed(0)  # not a default generator: not restored

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(x.shape, generator=generator)

    with pytest.warns(cg.CudaGraphsWarning, match=r"out.*comparing shapes"):
        cg.graph(noisy, torch.randn(4), verify=1, outputs="clone")


def test_doctor_leaves_state_lists_writes_and_keeps_integer_inputs() -> None:
    decode, cache, _ = make_decode()
    table = torch.randn(16, 8)
    seen: list[torch.Tensor] = []

    def decode_at(x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        seen.append(position.clone())
        return decode(x) + table[position]

    position = torch.tensor([3, 5])
    report = cg.doctor(decode_at, torch.randn(2, 8), position)
    assert cache.cumulative_length.item() == 0 and cache.keys.abs().sum() == 0
    writes = [f for f in report.findings if f.kind == "state-write"]
    assert writes and "cumulative_length" in " ".join(f.message for f in writes)
    assert not report.blocking, str(report)
    assert len(seen) == 2 and all(torch.equal(p, position) for p in seen)


def test_doctor_judges_the_capture_path() -> None:
    def skips_sync_while_capturing(x: torch.Tensor) -> torch.Tensor:
        if not torch.cuda.is_current_stream_capturing() and x.sum().item() > 1e9:
            raise ValueError("huge")
        return x * 2

    report = cg.doctor(skips_sync_while_capturing, torch.randn(4))
    assert not report.blocking, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("outputs", ["clone", "alias"])  # guarded needs a CUDA build: GPU tests
def test_threads_never_get_another_calls_result(stand_in: None, outputs: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).eval()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(8, 16), outputs=outputs)
        bucketed = cg.graph(model, torch.randn(8, 16), buckets={"B": [2, 4, 8]}, outputs=outputs)
    wrong: list[int] = []

    def worker(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for i in range(100):
            rows = 8 if i % 2 else 2 + seed % 5
            x = torch.randn(rows, 16, generator=generator)
            with torch.no_grad():
                expected = model(x)
                callee = g if rows == 8 and i % 4 == 1 else bucketed
                if outputs == "clone":
                    got = callee(x)  # the caller's own tensor
                else:
                    with callee.lock:  # clone under the call's lock, as a server should
                        got = callee(x).clone()
            if not torch.allclose(got, expected, atol=1e-6):
                wrong.append(seed)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_guards_are_invisible_to_torch_compile() -> None:
    class Rotary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(4), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # Registers a buffer inside forward, as transformers' dynamic rotary embeddings do.
            self.register_buffer("scale", self.scale * 1.0, persistent=False)
            return x * self.scale

    def compiled_calls() -> int:
        torch._dynamo.reset()
        counter = CompileCounter()
        model = Rotary()
        compiled = torch.compile(model, backend=counter)
        for _ in range(6):
            compiled(torch.randn(4))
        return counter.frame_count

    without = compiled_calls()
    guard = AddressGuard(nn.Linear(2, 2))  # what every captured cg.graph holds
    with_guard = compiled_calls()
    assert with_guard == without
    del guard


def test_a_guard_registers_nothing_in_torch() -> None:
    """The guard reads the user's modules only: no global module hook, no patched method."""
    from torch.nn.modules import module as module_module

    hooks = [
        module_module._global_module_registration_hooks,
        module_module._global_buffer_registration_hooks,
        module_module._global_parameter_registration_hooks,
    ]
    before = [dict(h) for h in hooks]
    apply = nn.Module._apply
    model = nn.BatchNorm1d(3)
    guard = AddressGuard(model)
    assert [dict(h) for h in hooks] == before and nn.Module._apply is apply
    assert guard.stale() is None
    model.to(torch.float64)  # new buffer objects in model._buffers
    # Tensors are tracked by address (CPU ones too) and by slot: either names the move.
    assert re.search(
        r"(weight|running_mean) (was replaced|now lives at new memory)", guard.stale() or ""
    )


@pytest.mark.slow
@pytest.mark.parametrize("lazy", [False, True], ids=["examples", "lazy"])
def test_transformers_static_cache_decode_equals_generate(stand_in: None, lazy: bool) -> None:
    pytest.importorskip("transformers")
    from llama_decode import graph_decode, reference_tokens, tiny_llama

    model, config = tiny_llama("cpu", hidden=64, layers=2)
    prompt = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = reference_tokens(model, prompt, 12)
    got, cache, graphed = graph_decode(model, config, prompt, 12, lazy=lazy, outputs="clone")
    assert graphed.state is cg.State.CAPTURED
    assert torch.equal(got, expected)
    # prefill (8) + 11 decode steps: as eager, the warm-up's advances put back
    assert all(layer.cumulative_length.item() == 19 for layer in cache.layers)


def test_a_model_built_under_inference_mode_can_be_graphed(stand_in: None) -> None:
    """Its parameters are inference tensors, which keep no version counter: the state checks
    must skip them instead of failing (found serving a model built under inference_mode)."""
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        x = torch.randn(4, 8)
        g = cg.graph(model, x, outputs="alias")  # guarded outputs need CUDA, not the stand-in
        bucketed = cg.graph(model, x, buckets={"B": [2, 4]}, outputs="alias")
        torch.testing.assert_close(g(x), model(x))
        torch.testing.assert_close(bucketed(x[:3]), model(x[:3]))


def test_a_replaced_recording_is_freed_at_once(stand_in: None) -> None:
    """A recapture drops the old recording before making the new one: nothing on the replay
    path may refer back to it (a cycle would keep its graph memory until garbage collection)."""
    import weakref

    model = nn.Linear(8, 2)
    for example in (torch.randn(4, 8), (torch.randn(4, 8), torch.randn(4, 8))):
        args = example if isinstance(example, tuple) else (example,)
        fn = (lambda a, b: model(a) + model(b)) if len(args) == 2 else model
        g = cg.graph(fn, *args, outputs="alias")
        g(*args)
        old = weakref.ref(g.replayer)
        gc.disable()
        try:
            g.captured = g.replayer = None  # what the graphed callable holds of its capture
            assert old() is None
        finally:
            gc.enable()

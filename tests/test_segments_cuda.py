"""Segments on the GPU: graphs with eager steps between them, and every guarantee across them."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import cudagraphs as cg
from cudagraphs.tools.segment_workloads import DecisionMLP, RoutedModel

pytestmark = pytest.mark.cuda


def _tiny_mixtral(transformers: Any, *, positions: int, seed: int) -> Any:
    """A 2-layer Mixtral-style causal LM, fp32, random weights, on the GPU, in eval mode."""
    config = transformers.MixtralConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=positions,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(config).cuda().eval()


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_decision_mlp_equals_eager_for_both_outcomes() -> None:
    torch.manual_seed(0)
    model = DecisionMLP().cuda()
    x = torch.randn(8, 256, device="cuda")
    with pytest.warns(cg.CudaGraphsWarning, match="2 graphs with 1 eager step"):
        g = cg.graph(model, x)
    assert g.stats.graphs == 2 and g.stats.gaps == 1
    assert [row["kind"] for row in g.segments] == ["graph", "eager", "graph"]
    # The step's model lives in the library, so its location is the first frame of the
    # user's: this test's capture line.
    assert g.segments[1]["location"].startswith(__file__ + ":")
    for threshold in (-1e9, 1e9):  # always flip, never flip: both outcomes
        model.threshold.fill_(threshold)
        for _ in range(3):
            x = torch.randn(8, 256, device="cuda")
            _close(g(x).clone(), model(x))
    model.threshold.fill_(-1e9)
    flipped = g(x).clone()
    model.threshold.fill_(1e9)
    kept = g(x).clone()
    assert not torch.allclose(flipped, kept)  # the decision really changes what a replay returns
    assert g.stats.gap_s > 0 and g.segments[1]["calls"] >= 8


@torch.no_grad()
def test_eager_module_option_and_state_counts_once_per_call() -> None:
    torch.manual_seed(1)
    model = RoutedModel().cuda()
    twin = RoutedModel().cuda()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(16, 64, device="cuda")
    g = cg.graph(model, x, eager=[type(model.router)])
    assert g.stats.gaps == 1
    assert int(model.steps) == 0 and int(model.router.calls) == 0  # capture's run put back
    for _ in range(4):
        x = torch.randn(16, 64, device="cuda")
        _close(g(x).clone(), twin(x))
    assert int(model.steps) == 4 == int(twin.steps)  # N calls are N executions
    assert int(model.router.calls) == 4 == int(twin.router.calls)


@torch.no_grad()
def test_unmarked_host_read_names_the_fix() -> None:
    model = RoutedModel().cuda()
    with pytest.raises(cg.CaptureError, match="eager="):
        cg.graph(model, torch.randn(16, 64, device="cuda"))


@torch.no_grad()
def test_refuse_policy_and_python_value_from_a_gap() -> None:
    model = DecisionMLP(layers=4).cuda()
    x = torch.randn(8, 256, device="cuda")
    with pytest.raises(cg.SegmentError, match="segments='refuse'"):
        cg.graph(model, x, segments="refuse")

    @cg.eager
    def decide(h: torch.Tensor) -> bool:
        return bool(h.mean().item() > 0)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if decide(x) else x

    with pytest.raises(cg.SegmentError, match=r"returned (True|False)"):
        cg.graph(fn, x)


@torch.no_grad()
def test_gap_returning_tensors_and_buckets_every_batch_exact() -> None:
    torch.manual_seed(2)
    model = DecisionMLP(width=64, layers=6).cuda()
    g = cg.graph(model, torch.randn(32, 64, device="cuda"), buckets={"B": list(range(1, 33))})
    for threshold in (0.0, -1e9, 1e9):
        model.threshold.fill_(threshold)
        for n in range(1, 33):
            x = torch.randn(n, 64, device="cuda")
            _close(g(x).clone(), model(x))


@torch.no_grad()
def test_threads_modes_and_verify_across_segments() -> None:
    torch.manual_seed(3)
    model = DecisionMLP(width=64, layers=6).cuda()
    x = torch.randn(8, 64, device="cuda")
    g = cg.graph(model, x, verify=True)
    with torch.autocast("cuda", dtype=torch.bfloat16), pytest.raises(cg.ModeMismatchError):
        g(x)
    inputs = [torch.randn(8, 64, device="cuda") for _ in range(200)]
    expected = [model(i) for i in inputs]
    wrong = []
    done: list[int] = []  # calls each thread finished: a thread that raised counts none

    def worker(k: int) -> None:
        torch.set_grad_enabled(False)  # grad mode is per thread
        calls = 0
        for j in range(k, len(inputs), 4):
            if not torch.allclose(g(inputs[j]).clone(), expected[j], rtol=1e-5, atol=1e-5):
                wrong.append(j)
            calls += 1
        done.append(calls)

    with pytest.warns(cg.CudaGraphsWarning, match="second thread"):
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert wrong == []
    assert done == [50] * 4


@torch.no_grad()
def test_transformers_moe_with_eager_experts_equals_eager() -> None:
    transformers = pytest.importorskip("transformers")
    model = _tiny_mixtral(transformers, positions=64, seed=4)
    ids = torch.randint(0, 512, (4, 16), device="cuda")
    with pytest.raises(cg.CaptureError, match="eager="):
        cg.graph(lambda i: model(input_ids=i, use_cache=False).logits, ids)
    moe = next(type(m) for m in model.modules() if "SparseMoe" in type(m).__name__)
    with pytest.warns(cg.CudaGraphsWarning, match=r"(?s)3 graphs with 2 eager step.*batched_mm"):
        g = cg.graph(
            lambda i: model(input_ids=i, use_cache=False).logits, ids, eager=[moe], modules=[model]
        )
    assert g.stats.gaps == 2
    report = cg.doctor(lambda i: model(input_ids=i, use_cache=False).logits, ids)
    assert report.blocking and any("batched_mm" in f.fix for f in report.findings)
    for _ in range(3):
        ids = torch.randint(0, 512, (4, 16), device="cuda")
        _close(g(ids).clone(), model(input_ids=ids, use_cache=False).logits)


@torch.no_grad()
def test_dynamo_backend_splits_at_graph_breaks_and_equals_eager() -> None:
    torch.manual_seed(5)
    model = DecisionMLP(width=64, layers=6).cuda()

    def plain_decision(h: torch.Tensor, threshold: torch.Tensor) -> None:  # no mark
        if (h.mean() > threshold).item():
            h.neg_()

    model.decide = plain_decision
    compiled = torch.compile(model, backend=cg.backend, dynamic=False)
    for threshold in (-1e9, 1e9):
        model.threshold.fill_(threshold)
        for _ in range(6):  # past the pieces' warm-up calls: replays
            x = torch.randn(8, 64, device="cuda")
            _close(compiled(x).clone(), model(x))


@torch.no_grad()
@pytest.mark.parametrize("fuse", [True, False])
def test_dynamo_backend_on_resnet18_equals_eager(fuse: bool) -> None:
    """Unfused, the pieces run eager's own kernels: equal to 1e-4. Fused, Inductor picks other
    convolution kernels: compared in full fp32 (TF32 off, as in eager), to 1e-4 as well."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(6)
    torch.compiler.reset()
    model = torchvision.models.resnet18().cuda().eval()
    compiled = torch.compile(model, backend=cg.backend(warmup=2, fuse=fuse))
    precision = torch.get_float32_matmul_precision()
    # Through the public switches, put back afterwards (torch 2.11 refuses to restore the
    # legacy allow_tf32 attribute once set).
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=not fuse):
        try:
            if fuse:
                torch.set_float32_matmul_precision("highest")
            for _ in range(5):
                x = torch.randn(4, 3, 64, 64, device="cuda")
                torch.testing.assert_close(compiled(x).clone(), model(x), rtol=1e-4, atol=1e-4)
        finally:
            torch.set_float32_matmul_precision(precision)


@torch.no_grad()
def test_decoder_with_eager_moe_blocks_equals_generate() -> None:
    transformers = pytest.importorskip("transformers")
    from llama_decode import reference_tokens

    from cudagraphs.decoding.decoder import Decoder

    model = _tiny_mixtral(transformers, positions=128, seed=7)
    moe = next(type(m) for m in model.modules() if "SparseMoe" in type(m).__name__)
    decoder = Decoder(model, max_batch=4, max_length=64, eager=[moe])
    for batch in (1, 3, 4):  # rungs 1, 4 (padded) and 4
        prompt = torch.randint(0, 512, (batch, 8), device="cuda")
        out = decoder.generate(prompt, max_new_tokens=24)
        assert torch.equal(out[:, 8:], reference_tokens(model, prompt, 24))
    with pytest.raises(cg.ConfigError, match="cannot be combined with compile"):
        Decoder(model, max_batch=4, max_length=64, eager=[moe], compile=True)

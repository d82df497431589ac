"""Real models keep state, on the GPU: transformers decoding with a static KV cache, BatchNorm in
training mode, verification and the doctor on stateful steps, threads, torch.compile beside us."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import cudagraphs as cg

pytestmark = pytest.mark.cuda
transformers = pytest.importorskip("transformers")

from llama_decode import graph_decode, reference_tokens, tiny_llama  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def llama() -> tuple:
    return tiny_llama("cuda")


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("lazy", [False, True], ids=["examples", "lazy"])
def test_static_cache_decode_equals_generate(llama: tuple, batch: int, lazy: bool) -> None:
    model, config = llama
    prompt = torch.randint(0, 512, (batch, 8), device="cuda")
    expected = reference_tokens(model, prompt, 64)
    got, cache, graphed = graph_decode(model, config, prompt, 64, lazy=lazy)
    assert graphed.state is cg.State.CAPTURED
    assert torch.equal(got, expected), (got != expected).float().mean().item()
    # Eager's cache after prefill (8) and 63 decode steps; warm-up's advances were put back.
    assert all(layer.cumulative_length.item() == 8 + 63 for layer in cache.layers)
    if not lazy:
        assert graphed.stats.state_writes >= 3 and graphed.stats.restored_bytes > 0


def test_verify_passes_the_decode_step_and_leaves_the_cache(llama: tuple) -> None:
    model, config = llama
    prompt = torch.randint(0, 512, (2, 8), device="cuda")
    expected = reference_tokens(model, prompt, 16)
    got, _, _ = graph_decode(model, config, prompt, 16, verify=True)
    assert torch.equal(got, expected)


def test_verify_catches_a_frozen_counter_on_the_gpu() -> None:
    table = torch.randn(64, 8, device="cuda")
    count = [0]

    def step(x: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        return x + table[count[0]]

    with pytest.raises(cg.VerificationError, match=r"count\[0\]"):
        cg.graph(step, torch.randn(8, device="cuda"), verify=True)


def test_doctor_on_the_decode_step_leaves_the_cache_and_lists_its_writes(llama: tuple) -> None:
    from transformers import StaticCache

    model, config = llama
    cache = StaticCache(config=config, max_cache_len=24)
    prompt = torch.randint(0, 512, (2, 8), device="cuda")
    with torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True)

        def decode(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
            out = model(input_ids=token, past_key_values=cache, cache_position=position)
            return out.logits

        before = [(layer.keys.clone(), layer.cumulative_length.clone()) for layer in cache.layers]
        token, position = prompt[:, -1:], torch.tensor([8], device="cuda")
        for _ in range(20):  # would run off the end of the cache if runs advanced it
            report = cg.doctor(decode, token, position)
        torch.cuda.synchronize()
    for (keys, length), layer in zip(before, cache.layers):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.cumulative_length, length)
    assert not report.blocking, str(report)
    writes = " ".join(f.message for f in report.findings if f.kind == "state-write")
    assert "cumulative_length" in writes and "keys" in writes


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_doctor_finds_nothing_blocking_on_transformers_forwards(llama: tuple, family: str) -> None:
    if family == "llama":
        model = llama[0]
    else:
        config = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=512)
        model = transformers.GPT2LMHeadModel(config).cuda().eval()
    ids = torch.randint(0, 512, (2, 16), device="cuda")
    with torch.no_grad():
        report = cg.doctor(model, ids)
        graphed = cg.graph(model, ids)
        expected = model(ids).logits
        # fp32; the recorded matmuls may pick other cuBLAS kernels: tolerance scaled to the
        # logits' size (this random Llama's reach about 1e2)
        scale = expected.abs().max().item()
        torch.testing.assert_close(graphed(ids).logits, expected, rtol=1e-4, atol=1e-5 * scale)
    assert not report.blocking, str(report)


def test_batchnorm_training_graph_leaves_statistics_and_rng_then_counts_calls() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2))
    model = model.cuda().train()
    twin = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2))
    twin = twin.cuda().train()
    twin.load_state_dict(model.state_dict())
    example = torch.randn(4, 3, 16, 16, device="cuda")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state()
    with torch.no_grad():
        g = cg.graph(model, example)
        assert torch.equal(torch.get_rng_state(), cpu_rng)
        assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k
        for _ in range(5):
            x = torch.randn(4, 3, 16, 16, device="cuda")
            g(x)
            twin(x)
    for (k, v), w in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(v, w, msg=k)
    assert model[1].num_batches_tracked.item() == 5


@pytest.mark.parametrize("kind", ["plain", "bucketed"])
def test_eight_threads_share_one_graph_without_a_wrong_result(kind: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 32)).cuda().eval()
    with torch.no_grad():
        if kind == "plain":
            g = cg.graph(model, torch.randn(16, 64, device="cuda"), outputs="clone")
        else:
            g = cg.graph(model, torch.randn(16, 64, device="cuda"), buckets={"B": [4, 8, 16]})
    counts = {"wrong": 0, "right": 0}
    tally = threading.Lock()

    def worker(seed: int) -> None:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        wrong = right = 0
        for i in range(500):
            rows = 16 if kind == "plain" else 1 + (seed + i) % 16
            x = torch.randn(rows, 64, device="cuda", generator=generator)
            with torch.no_grad():
                expected = model(x)
                if kind == "plain":
                    got = g(x)  # outputs="clone": the caller's own tensor
                else:
                    with g.lock:  # guarded outputs: clone under the call's lock
                        got = g(x).clone()
            if torch.allclose(got, expected, atol=1e-5, rtol=1e-5):
                right += 1
            else:
                wrong += 1
        with tally:
            counts["wrong"] += wrong
            counts["right"] += right

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts == {"wrong": 0, "right": 4000}


def test_a_guarded_output_made_stale_by_another_thread_raises() -> None:
    model = nn.Linear(8, 8).cuda().eval()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(4, 8, device="cuda"))
        mine = g(torch.randn(4, 8, device="cuda"))
        other = threading.Thread(target=lambda: g(torch.randn(4, 8, device="cuda")))
        other.start()
        other.join()
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        mine.sum()


def test_torch_compile_decode_is_unchanged_by_cudagraphs_and_a_live_guard() -> None:
    script = HERE / "compile_decode.py"
    results = {}
    for mode in ("without", "with"):
        out = subprocess.run(
            [sys.executable, str(script), mode],
            capture_output=True,
            text=True,
            timeout=300,
            env={
                **os.environ,
                "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            },
        )
        assert out.returncode == 0, out.stderr[-3000:]
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["with"]["tokens"] == results["without"]["tokens"]
    assert results["with"]["frames"] == results["without"]["frames"]
    assert results["with"]["guard_alive"] and not results["without"]["guard_alive"]
    print("tokens/s without, with:", results["without"]["tok_s"], results["with"]["tok_s"])


def test_graph_over_torch_compile_of_the_decode_step(llama: tuple) -> None:
    model, config = llama
    prompt = torch.randint(0, 512, (1, 8), device="cuda")
    expected = reference_tokens(model, prompt, 24)
    torch._dynamo.reset()
    got, _, graphed = graph_decode(model, config, prompt, 24, wrap=torch.compile, warmup=3)
    assert graphed.state is cg.State.CAPTURED
    assert torch.equal(got, expected)

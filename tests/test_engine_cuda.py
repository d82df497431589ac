"""The LLM engine on a real GPU: captured steps with rows at their own lengths give each
request ``model.generate``'s float32 tokens whatever else is in the batch, seeded draws do not
depend on the neighbours, and 10,000 requests leave ``torch.cuda.memory_reserved()`` where the
first ones put it."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.cuda
transformers = pytest.importorskip("transformers")

from llama_decode import generate_with_scores  # noqa: E402
from test_decoder_cuda import assert_same_tokens  # noqa: E402

from cudagraphs.decoding import Engine  # noqa: E402
from cudagraphs.tools.workloads import random_llama  # noqa: E402


@pytest.fixture(scope="module")
def model():
    model = random_llama("llama-512", "cuda")
    model.set_attn_implementation("sdpa")
    return model


@pytest.mark.parametrize("compile", [False, True], ids=["model-kernels", "compiled"])
def test_requests_arriving_apart_get_generate_s_tokens_from_captured_steps(model, compile) -> None:
    # compiled: each decode step recorded over torch.compile'd kernels, one compile serving
    # every batch rung (2, 4, 8) and cache-length rung.
    generator = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(3, 120, (24,), generator=generator)]
    news = [int(n) for n in torch.randint(4, 40, (24,), generator=generator)]
    asked = [torch.randint(0, 32000, (n,), generator=generator).tolist() for n in lengths]
    with Engine(model, max_batch=8, max_length=192, prefill_chunk=64, compile=compile) as engine:
        assert engine.health()["graphs"] is True
        assert engine.stats.compiled is compile
        # q/k/v and gate/up of every layer as one product each, in the steps and the chunks
        layers = model.config.num_hidden_layers
        assert engine.stats.fused_groups == 2 * layers and engine.stats.unfused == []
        assert all(g.stats.state == "captured" for g in engine.graphs.values())
        completions = []
        for k, (prompt, new) in enumerate(zip(asked, news)):
            completions.append(engine.submit(prompt, max_new_tokens=new, eos_token_id=None))
            if k % 5 == 4:
                time.sleep(0.02)  # some arrive while others decode
        outputs = [completion.result(timeout=300) for completion in completions]
        assert engine.stats.attention.startswith("grouped")
        assert engine.stats.moves > 0 and engine.stats.recaptures == 0
        assert len({key.split(" length")[0] for key in engine.stats.replays}) > 1
    # After every request ended: the reference switches the model's attention back to
    # transformers' own for its run.
    for tokens, prompt, new in zip(outputs, asked, news):
        got = torch.tensor([prompt + tokens], device="cuda")
        expected = generate_with_scores(model, torch.tensor([prompt], device="cuda"), new)
        assert_same_tokens(got, *expected)


def test_the_model_s_own_attention_gives_generate_s_tokens_from_captured_steps() -> None:
    # transformers' SDPA attention over the slot cache (grouped_attention=False), recorded
    # per rung as the grouped one is: rows at their own lengths, prompts in chunks.
    own = random_llama("llama-512", "cuda")
    own.set_attn_implementation("sdpa")
    generator = torch.Generator().manual_seed(2)
    asked = [torch.randint(0, 32000, (int(n),), generator=generator).tolist()
             for n in torch.randint(3, 100, (8,), generator=generator)]  # fmt: skip
    with Engine(own, max_batch=4, max_length=160, prefill_chunk=32,
                grouped_attention=False) as engine:  # fmt: skip
        assert engine.stats.attention == "the model's own: grouped_attention=False"
        completions = [engine.submit(p, max_new_tokens=24, eos_token_id=None) for p in asked]
        outputs = [completion.result(timeout=300) for completion in completions]
        assert engine.stats.recaptures == 0 and engine.stats.replays
    for tokens, prompt in zip(outputs, asked):
        got = torch.tensor([prompt + tokens], device="cuda")
        expected = generate_with_scores(own, torch.tensor([prompt], device="cuda"), 24)
        assert_same_tokens(got, *expected)


def test_a_seeded_request_draws_the_same_tokens_beside_any_neighbours(model) -> None:
    prompt = list(range(100, 140))

    def draw(engine: Engine) -> list[int]:
        return engine.submit(
            prompt, max_new_tokens=24, do_sample=True, temperature=0.8, top_p=0.95, seed=3,
            eos_token_id=None,
        ).result(timeout=300)  # fmt: skip

    with Engine(model, max_batch=8, max_length=128, do_sample=True) as engine:
        alone = draw(engine)
        crowd = [
            engine.submit(list(range(5, 5 + n)), max_new_tokens=40, do_sample=n % 2 == 0,
                          seed=n, eos_token_id=None)
            for n in (7, 30, 3, 18)
        ]  # fmt: skip
        crowded = draw(engine)
        for completion in crowd:
            completion.result(timeout=300)
    assert crowded == alone


def test_ten_thousand_requests_leave_memory_where_the_first_put_it(model) -> None:
    with Engine(model, max_batch=16, max_length=64) as engine:

        def wave(count: int) -> None:
            pending = [
                engine.submit([1 + k % 997, 2, 3, 4], max_new_tokens=2, eos_token_id=None)
                for k in range(count)
            ]
            for completion in pending:
                completion.result(timeout=600)

        wave(500)  # every rung has run
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        for _ in range(19):
            wave(500)
        torch.cuda.synchronize()
        assert torch.cuda.memory_reserved() == before
        assert engine.metrics().requests == 10_000


@pytest.mark.parametrize("compile", [False, True], ids=["model-kernels", "compiled"])
def test_bfloat16_tokens_are_the_float32_model_s_choice_unless_within_bfloat16_noise(
    compile,
) -> None:
    # Each token the engine decodes in bfloat16, beside other requests, is checked against the
    # float32 model (the same weights) run over the engine's own tokens: it must be float32's
    # top choice, except where float32's top two logits are closer than bfloat16 can tell
    # apart (NOISE of the logits' scale). Teacher forcing along the engine's sequence checks
    # every token, not only those before a first difference.
    noise = 2e-2
    full = random_llama("llama-512", "cuda", init=0.02)
    half = random_llama("llama-512", "cuda", torch.bfloat16, init=0.02)
    half.set_attn_implementation("sdpa")
    generator = torch.Generator().manual_seed(1)
    asked = [torch.randint(0, 32000, (int(n),), generator=generator).tolist()
             for n in torch.randint(4, 90, (12,), generator=generator)]  # fmt: skip
    with Engine(half, max_batch=8, max_length=160, compile=compile) as engine:
        completions = [engine.submit(p, max_new_tokens=48, eos_token_id=None) for p in asked]
        outputs = [c.result(timeout=300) for c in completions]
    checked = near_ties = 0
    for prompt, tokens in zip(asked, outputs):
        ids = torch.tensor([prompt + tokens], device="cuda")
        with torch.no_grad():
            logits = full(ids).logits[0, len(prompt) - 1 : -1].float()
        top2 = logits.topk(2, dim=-1)
        for step, token in enumerate(tokens):
            checked += 1
            if token == int(top2.indices[step, 0]):
                continue
            scale = float(logits[step].abs().max())
            gap = float(top2.values[step, 0] - logits[step, token])
            assert gap <= noise * scale, (
                f"step {step}: the engine chose {token}, float32 {int(top2.indices[step, 0])} "
                f"by {gap:.3e} (scale {scale:.3e}): more than bfloat16 noise"
            )
            near_ties += 1
    assert checked == 12 * 48 and near_ties < checked // 10

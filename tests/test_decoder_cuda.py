"""The transformers decoding integration on a real GPU: captured decode steps (one per batch
rung, one pool, single- and multi-step) give ``model.generate``'s tokens in float32, logits
within bfloat16 rounding of eager under teacher forcing, and sampling that follows
transformers' filters."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import cudagraphs as cg

pytestmark = pytest.mark.cuda
transformers = pytest.importorskip("transformers")

from llama_decode import generate_with_scores, transformers_attention  # noqa: E402
from test_decoder import left_padded  # noqa: E402
from test_decoder import test_sampled_tokens_follow_transformers_filters as sampling_check  # noqa: E402

from cudagraphs.decoding.decoder import Decoder  # noqa: E402
from cudagraphs.decoding.kv_cache import cache_keyword  # noqa: E402
from cudagraphs.tools.workloads import random_llama  # noqa: E402

PROMPT, NEW = 16, 32


def greedy_generate(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    return generate_with_scores(model, prompt, new)[0]


def assert_same_tokens(got: torch.Tensor, expected: torch.Tensor, scores: torch.Tensor) -> int:
    """Every row equals generate's, or first differs where generate itself had a near-tie
    (its top two logits within 1e-4 of the logits' scale). Returns how many rows differ.

    Why the exception: a static cache attends over its full length, generate's default cache
    over the tokens so far, so the float32 sums run in another order (differences of about
    1e-6 of the scale). Where two candidates are that close, either is generate's answer up to
    rounding; after it the row continues from another token, so only the first step counts."""
    new = scores.shape[1]
    mine, theirs = got[:, -new:], expected[:, -new:]
    differing = 0
    for row in range(got.shape[0]):
        steps = (mine[row] != theirs[row]).nonzero()
        if len(steps) == 0:
            continue
        differing += 1
        step = int(steps[0])
        logits = scores[row, step].float()
        gap = float(logits[theirs[row, step]] - logits[mine[row, step]])
        scale = float(logits.abs().max())
        assert 0 <= gap <= 1e-4 * scale, (
            f"row {row} step {step}: generate chose {int(theirs[row, step])}, the graph "
            f"{int(mine[row, step])}; logit gap {gap:.3e} is no near-tie (scale {scale:.3e})"
        )
    return differing


@pytest.mark.parametrize(("shape", "steps"), [("llama-512", (1, 4, 16)), ("llama-2048", (1, 16))])
def test_float32_greedy_equals_generate_at_every_batch(shape: str, steps: tuple[int, ...]) -> None:
    model = random_llama(shape, "cuda")
    torch.manual_seed(0)
    prompts = {b: torch.randint(0, 32000, (b, PROMPT), device="cuda") for b in (1, 3, 16, 64)}
    expected = {b: generate_with_scores(model, p, NEW) for b, p in prompts.items()}
    differing = {}
    for k in steps:
        decoder = Decoder(model, max_batch=64, max_length=PROMPT + NEW, steps_per_graph=k)
        assert all(g.state is cg.State.CAPTURED for g in decoder.graphs.values())
        for b, prompt in prompts.items():
            got = decoder.generate(prompt, max_new_tokens=NEW, eos_token_id=None)
            assert got.shape == expected[b][0].shape
            differing[k, b] = assert_same_tokens(got, *expected[b])
        assert decoder.stats.recaptures == 0
        del decoder
    print(f"{shape}: rows that first differ at a near-tie, by (steps, batch): {differing}")
    # Near-ties are rare: a graph that differs from generate in many rows, each at a tie, is
    # still a graph that computes something else.
    assert all(n <= max(1, b // 8) for (_, b), n in differing.items()), differing


def test_compiled_decode_steps_give_generate_tokens() -> None:
    model = random_llama("llama-512", "cuda")
    torch.manual_seed(1)
    decoder = Decoder(
        model,
        max_batch=4,
        max_length=PROMPT + NEW,
        batch_sizes=[1, 4],
        steps_per_graph=4,
        compile=True,
    )
    for b in (1, 4):
        prompt = torch.randint(0, 32000, (b, PROMPT), device="cuda")
        got = decoder.generate(prompt, max_new_tokens=NEW, eos_token_id=None)
        assert torch.equal(got, greedy_generate(model, prompt, NEW))


def test_steps_loaded_from_disk_give_generate_tokens_at_every_rung(fresh_compile_cache) -> None:
    """A second decoder (after Dynamo forgot the first: as a second process) loads the
    compiled steps the first saved, batch 1 and larger batches, traces nothing, and its tokens
    on the GPU equal generate across batch and cache-length rungs."""
    from torch._dynamo.utils import counters

    model = random_llama("llama-512", "cuda")
    kwargs = dict(max_batch=4, max_length=PROMPT + NEW, batch_sizes=[1, 2, 4], compile=True,
                  cache_lengths=[PROMPT + 8])  # fmt: skip
    torch._dynamo.reset()
    first = Decoder(model, **kwargs)
    assert first.stats.compiles_saved == 4 and not first.stats.compile_not_saved
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    second = Decoder(model, **kwargs)
    assert (second.stats.compiles_loaded, second.stats.compiles_saved) == (4, 0)
    assert counters["stats"]["unique_graphs"] == before
    torch.manual_seed(4)
    for b in (1, 3):
        prompt = torch.randint(0, 32000, (b, PROMPT), device="cuda")
        got = second.generate(prompt, max_new_tokens=NEW, eos_token_id=None)
        assert torch.equal(got, greedy_generate(model, prompt, NEW))


@pytest.mark.parametrize(
    ("compile", "batch"),
    [(False, 4), (True, 4), ({"coordinate_descent_tuning": True}, 1)],
    ids=["eager-kernels", "compiled", "coordinate-descent-batch-1"],
)
def test_bfloat16_logits_match_eager_under_teacher_forcing(compile: Any, batch: int) -> None:
    """The same tokens fed to the captured step (the decoder's own forward and cache view) and
    to the same forward run without a graph: every step's logits agree within bfloat16
    rounding, and within bfloat16 tolerance of plain eager (compiled kernels round
    differently; with coordinate-descent tuning a batch-1 projection is a Triton reduction,
    not cuBLAS). Weights of the usual scale (0.02): with livelier ones the network is chaotic
    and any rounding difference grows along the cache."""
    model = random_llama("llama-512", "cuda", torch.bfloat16, init=0.02)
    decoder = Decoder(model, max_batch=batch, max_length=64, batch_sizes=[batch], compile=compile)
    torch.manual_seed(2)
    prompt = torch.randint(0, 32000, (batch, PROMPT), device="cuda")
    tokens = greedy_generate(model, prompt, NEW)[:, PROMPT:]
    cache = decoder.caches[batch]
    reference = transformers.StaticCache(config=model.config, max_cache_len=64)
    plain = transformers.StaticCache(config=model.config, max_cache_len=64)
    with torch.no_grad():
        start = torch.tensor([PROMPT], device="cuda")
        step = cg.graph(
            lambda t, p: decoder.forward(t, p, cache), tokens[:, :1], start, side_effects="keep"
        )
        cache.reset()
        keyword = cache_keyword(model)  # `cache` in newer transformers
        for c in (cache, reference, plain):
            model(prompt, **{keyword: c}, cache_position=torch.arange(PROMPT, device="cuda"))
        worst, worst_plain = 0.0, 0.0
        for i in range(NEW - 1):
            token, position = tokens[:, i : i + 1], start + i
            got = step(token, position).float()
            want = decoder.forward(token, position, reference).float()
            eager = model(token, **{keyword: plain}, cache_position=position).logits[:, -1]
            scale = want.abs().max()
            worst = max(worst, float((got - want).abs().max() / scale))
            worst_plain = max(worst_plain, float((got - eager.float()).abs().max() / scale))
    print(f"compile={compile}: graph vs same kernels {worst:.2e}, vs plain eager {worst_plain:.2e}")
    assert worst < 1e-2, f"graph vs same kernels: max difference {worst:.3e} of the logits' scale"
    assert worst_plain < 3e-2, f"vs plain eager: max difference {worst_plain:.3e} of the scale"


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, None, None), (0.7, 8, None), (0.9, 12, 0.7)]
)
def test_sampling_on_the_gpu_follows_transformers_filters(temperature, top_k, top_p) -> None:
    sampling_check(temperature, top_k, top_p, device="cuda")


def test_sampled_decoding_is_reproducible_and_varies_with_the_seed() -> None:
    model = random_llama("llama-512", "cuda")
    decoder = Decoder(model, max_batch=4, max_length=64, steps_per_graph=4, do_sample=True)
    prompt = torch.randint(0, 32000, (4, PROMPT), device="cuda")
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(
            decoder.generate(
                prompt, max_new_tokens=NEW, do_sample=True, temperature=0.8, top_p=0.95
            )
        )
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_left_padded_prompts_decode_as_generate_does_on_the_gpu() -> None:
    model = random_llama("llama-512", "cuda")
    torch.manual_seed(3)
    ids, mask = left_padded([16, 5, 11, 1], total=16, vocab=32000)
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad(), transformers_attention(model):
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
            pad_token_id=0, output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    for k in (1, 4):
        decoder = Decoder(model, max_batch=4, max_length=PROMPT + NEW, steps_per_graph=k)
        got = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        assert all(g.state is cg.State.CAPTURED for g in decoder.graphs.values())
        assert assert_same_tokens(got, out.sequences, torch.stack(out.scores, dim=1)) <= 1


def test_a_parameter_moved_to_new_memory_is_seen_and_recaptured() -> None:
    """The decode graphs read the weights by address: a parameter given new memory makes them
    capture again before the next replay (counted), and the tokens stay generate's."""
    model = random_llama("llama-512", "cuda")
    decoder = Decoder(model, max_batch=1, max_length=PROMPT + NEW)
    prompt = torch.randint(0, 32000, (1, PROMPT), device="cuda")
    decoder.generate(prompt, max_new_tokens=8, eos_token_id=None)
    assert decoder.stats.recaptures == 0
    layer = model.model.layers[0].mlp.up_proj
    layer.weight.data = layer.weight.data.clone()  # new memory, same values
    got = decoder.generate(prompt, max_new_tokens=8, eos_token_id=None)
    assert decoder.stats.recaptures == 1
    assert torch.equal(got, greedy_generate(model, prompt, 8))


def test_until_eos_in_one_launch_gives_the_per_step_tokens() -> None:
    """until_eos=True (a WHILE node: decode until every row ended): rows that end at different
    steps get exactly the tokens of one-step-per-launch decoding, in one launch per request."""
    model = random_llama("llama-512", "cuda")
    torch.manual_seed(3)
    prompt = torch.randint(0, 32000, (4, PROMPT), device="cuda")
    per_step = Decoder(model, max_batch=4, max_length=PROMPT + NEW)
    full = per_step.generate(prompt, max_new_tokens=NEW, eos_token_id=None)
    # The per-step graphs decode as eager generate does (up to its own near-ties).
    assert_same_tokens(full, *generate_with_scores(model, prompt, NEW))
    free = full[:, PROMPT:]
    eos = [int(free[0, 5]), int(free[2, 17])]  # rows end at different steps
    expected = per_step.generate(prompt, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    looping = Decoder(model, max_batch=4, max_length=PROMPT + NEW, until_eos=True)
    got = looping.generate(prompt, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, expected)
    assert looping.stats.replays == {"greedy batch 4": 1}
    assert torch.equal(looping.generate(prompt, max_new_tokens=NEW, eos_token_id=None), full)
    one = per_step.generate(prompt[:1], max_new_tokens=NEW, eos_token_id=None)
    assert torch.equal(looping.generate(prompt[:1], max_new_tokens=NEW, eos_token_id=None), one)


@pytest.mark.parametrize("compile", [False, True])
def test_float32_greedy_equals_generate_across_length_rungs(compile: bool) -> None:
    """Requests cross cache-length rungs (each a prefix view of the one cache) and still give
    generate's tokens; compiled, every rung runs on one compile (the default batch rungs start
    at 2, so a single request runs on the batch-2 graph)."""
    model = random_llama("llama-512", "cuda")
    torch.manual_seed(2)
    decoder = Decoder(
        model, max_batch=4, max_length=512, cache_lengths=[24, 32, 40], compile=compile
    )
    assert decoder.lengths == [24, 32, 40, 512]
    assert all(g.state is cg.State.CAPTURED for g in decoder.graphs.values())
    for b in (1, 3):
        prompt = torch.randint(0, 32000, (b, PROMPT), device="cuda")
        got = decoder.generate(prompt, max_new_tokens=NEW, eos_token_id=None)
        assert_same_tokens(got, *generate_with_scores(model, prompt, NEW))
    used = {key for key, n in decoder.stats.replays.items() if n}
    assert decoder.rungs == ([2, 4] if compile else [1, 2, 4])
    smallest = decoder.rungs[0]
    assert {
        f"greedy batch {smallest} length 24",
        "greedy batch 4 length 40",
        "greedy batch 4",
    } <= used
    assert decoder.stats.recaptures == 0


def test_recorded_prefills_give_generate_tokens_and_eager_logits() -> None:
    """Prompts below, at and past a prompt-length rung run on recorded prefills (right-padded
    to the rung): float32 tokens equal generate's; in bfloat16 the last position's logits are
    within rounding of an eager forward."""
    model = random_llama("llama-512", "cuda")
    decoder = Decoder(model, max_batch=4, max_length=160)
    torch.manual_seed(7)
    for batch, length in ((1, 5), (4, 16), (3, 17), (2, 100)):
        prompt = torch.randint(0, 32000, (batch, length), device="cuda")
        expected = generate_with_scores(model, prompt, NEW)
        got = decoder.generate(prompt, max_new_tokens=NEW, eos_token_id=None)
        assert_same_tokens(got, *expected)
    assert sorted(decoder.stats.prefill_replays) == [
        "prefill batch 1 length 16", "prefill batch 2 length 128",
        "prefill batch 4 length 16", "prefill batch 4 length 32",
    ]  # fmt: skip
    assert all(g.state is cg.State.CAPTURED for g in decoder.prefills.graphs.values())
    assert decoder.stats.eager_prefills == 0
    half = random_llama("llama-512", "cuda", torch.bfloat16)
    recorded = Decoder(half, max_batch=2, max_length=64)
    prompt = torch.randint(0, 32000, (2, 11), device="cuda")
    with torch.no_grad():
        eager = half(input_ids=prompt).logits[:, -1, :].float()
        got = recorded.prefills.logits(prompt).float()
    torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2 * float(eager.abs().max()))

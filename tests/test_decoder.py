"""The transformers decoding integration: tokens equal ``model.generate``, sampling follows
transformers' filters, refusals say why. On CPU the graphs are the eager pass-through, so
what is checked here is the decoding logic (multi-step feedback, rungs, stopping, sampling);
the same tests run on the GPU through real captures (``test_decoder_cuda.py``)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import cudagraphs as cg

transformers = pytest.importorskip("transformers")

from llama_decode import tiny_llama, transformers_attention  # noqa: E402

from cudagraphs.decoding import Decoder, default_batch_rungs  # noqa: E402
from cudagraphs.decoding.grouped_attention import takes_sdpa_mask  # noqa: E402
from cudagraphs.decoding.sampling import SamplingParams, sample  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::cudagraphs.CudaGraphsWarning")


@pytest.fixture(scope="module")
def llama() -> tuple[object, object]:
    return tiny_llama("cpu", hidden=64, layers=2)


def generate(
    model, prompt: torch.Tensor, new: int, mask: torch.Tensor | None = None, **kwargs: object
) -> torch.Tensor:
    with torch.no_grad(), transformers_attention(model):
        return model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt) if mask is None else mask,
            max_new_tokens=new,
            do_sample=False,
            **kwargs,
        )


@pytest.mark.slow
@pytest.mark.parametrize("steps", [1, 4, 16])
def test_greedy_tokens_equal_generate_at_every_rung(llama, steps: int) -> None:
    model, _ = llama
    decoder = Decoder(model, max_batch=8, max_length=64, steps_per_graph=steps)
    torch.manual_seed(1)
    for batch in (1, 3, 8):  # 3 pads up to the rung of 4
        prompt = torch.randint(0, 512, (batch, 7))
        expected = generate(model, prompt, 30, min_new_tokens=30)
        assert torch.equal(decoder.generate(prompt, max_new_tokens=30, eos_token_id=None), expected)
    assert decoder.stats.recaptures == 0


def rows_ending_apart(model) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """A batch of 4 prompts, two end-of-sequence ids taken from the free-running output (so
    rows end at different steps), and generate's 24 new tokens with them."""
    torch.manual_seed(2)
    prompt = torch.randint(0, 512, (4, 6))
    free = generate(model, prompt, 24, min_new_tokens=24)[:, 6:]
    eos = [int(free[0, 3]), int(free[2, 9])]
    return prompt, eos, generate(model, prompt, 24, eos_token_id=eos, pad_token_id=0)


@pytest.mark.parametrize("steps", [1, 4])
def test_rows_that_end_at_different_steps_stop_as_generate_does(llama, steps: int) -> None:
    model, _ = llama
    decoder = Decoder(model, max_batch=4, max_length=64, steps_per_graph=steps, check_every=4)
    prompt, eos, expected = rows_ending_apart(model)
    got = decoder.generate(prompt, max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, expected)
    assert (got[:, 6:] == 0).any(), "some row should have been padded after its end"


def test_a_mix_of_batch_sizes_reuses_the_captured_rungs(llama) -> None:
    model, _ = llama
    decoder = Decoder(model, max_batch=8, max_length=32)
    graphs = dict(decoder.graphs)
    for batch in (5, 1, 8, 2, 7, 3):
        decoder.generate(torch.randint(0, 512, (batch, 4)), max_new_tokens=5)
    assert decoder.graphs == graphs and decoder.stats.recaptures == 0
    assert set(decoder.stats.replays) == {
        "greedy batch 1",
        "greedy batch 2",
        "greedy batch 4",
        "greedy batch 8",
    }


def test_sampling_with_a_seed_is_reproducible(llama) -> None:
    model, _ = llama
    decoder = Decoder(model, max_batch=2, max_length=40, steps_per_graph=4, do_sample=True)
    prompt = torch.randint(0, 512, (2, 5))
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(
            decoder.generate(prompt, max_new_tokens=20, do_sample=True, top_k=40, top_p=0.9)
        )
    assert torch.equal(runs[0], runs[1])
    torch.manual_seed(8)
    assert not torch.equal(decoder.generate(prompt, max_new_tokens=20, do_sample=True), runs[0])


def chi_squared_critical(df: int, alpha_z: float = 3.09) -> float:
    """Wilson-Hilferty: the chi-squared quantile at the normal quantile ``alpha_z`` (0.999)."""
    return df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3


def sampled_counts(draw, vocab: int, n: int) -> torch.Tensor:
    return torch.bincount(draw(n).flatten(), minlength=vocab).double()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, None), (0.7, 8, None), (1.3, None, 0.8), (0.9, 12, 0.7)],
)
def test_sampled_tokens_follow_transformers_filters(
    temperature, top_k, top_p, device="cpu"
) -> None:
    """Two-sample chi-squared test: our graph-safe sampler against ``torch.multinomial`` on the
    distribution transformers' own warpers give, over 4000 draws each."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    vocab = 24
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(1, vocab, generator=gen) * 2).to(device)
    params = SamplingParams.make(vocab, device)
    params.set(temperature, top_k, top_p)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(None, scores)
    reference = scores.softmax(-1)[0]
    torch.manual_seed(11)
    ours = sampled_counts(lambda n: sample(logits.expand(n, vocab), params), vocab, 4000)
    theirs = sampled_counts(
        lambda n: torch.multinomial(reference, n, replacement=True), vocab, 4000
    )
    assert ours[reference == 0].sum() == 0, "a token the filters remove was drawn"
    seen = (ours + theirs) > 0
    o, t = ours[seen], theirs[seen]
    statistic = float((((o - t) ** 2) / (o + t)).sum())
    assert statistic < chi_squared_critical(int(seen.sum()) - 1), statistic


def test_sampling_parameters_are_checked() -> None:
    params = SamplingParams.make(10, "cpu")
    with pytest.raises(cg.ConfigError, match="temperature must be > 0"):
        params.set(0.0, None, None)
    with pytest.raises(cg.ConfigError, match="top_k must be a positive int"):
        params.set(1.0, 0, None)
    with pytest.raises(cg.ConfigError, match=r"top_p must be in \(0, 1\]"):
        params.set(1.0, None, 1.5)


def test_requests_it_cannot_serve_are_refused_with_the_reason(llama) -> None:
    model, _ = llama
    decoder = Decoder(model, max_batch=2, max_length=16)
    prompt = torch.randint(0, 512, (1, 4))
    with pytest.raises(cg.ConfigError, match="exceeds max_length=16"):
        decoder.generate(prompt, max_new_tokens=13)
    with pytest.raises(cg.ConfigError, match=r"batches of 1\.\.2"):
        decoder.generate(torch.randint(0, 512, (3, 4)), max_new_tokens=2)
    with pytest.raises(cg.ConfigError, match="2-D tensor"):
        decoder.generate(prompt[0], max_new_tokens=2)
    with pytest.raises(cg.ConfigError, match="int64"):
        decoder.generate(prompt.int(), max_new_tokens=2)
    with pytest.raises(cg.ConfigError, match="padding after a real token"):
        mask = torch.ones_like(prompt)
        mask[0, -1] = 0
        decoder.generate(prompt, max_new_tokens=2, attention_mask=mask)
    with pytest.raises(cg.ConfigError, match="max_new_tokens must be a positive int"):
        decoder.generate(prompt, max_new_tokens=0)
    with pytest.raises(cg.ConfigError, match="eos_token_id must be"):
        decoder.generate(prompt, max_new_tokens=2, eos_token_id=[-3])
    # A misspelt keyword names the one meant, not Python's "unexpected keyword".
    with pytest.raises(cg.ConfigError, match="did you mean max_new_tokens="):
        decoder.generate(prompt, max_new_token=2)
    with pytest.raises(cg.ConfigError, match="did you mean temperature="):
        decoder.generate(prompt, max_new_tokens=2, temprature=0.5)


def test_models_it_cannot_graph_are_refused(llama) -> None:
    model, _ = llama
    with pytest.raises(cg.ConfigError, match="needs a transformers causal LM"):
        Decoder(torch.nn.Linear(2, 2), max_batch=1, max_length=8)
    model.train()
    try:
        with pytest.raises(cg.ConfigError, match="training mode"):
            Decoder(model, max_batch=1, max_length=8)
    finally:
        model.eval()
    with pytest.raises(cg.ConfigError, match="batch_sizes must be positive and end at max_batch"):
        Decoder(model, max_batch=4, max_length=8, batch_sizes=[1, 2])
    with pytest.raises(cg.ConfigError, match="steps_per_graph must be a positive int"):
        Decoder(model, max_batch=1, max_length=8, steps_per_graph=0)
    with pytest.raises(cg.ConfigError, match=r"compile must be a bool, a torch\.compile mode"):
        Decoder(model, max_batch=1, max_length=8, compile=1)
    with pytest.raises(cg.ConfigError, match=r"mapping of Inductor options, got \{1: True\}"):
        Decoder(model, max_batch=1, max_length=8, compile={1: True})


def test_one_new_token_needs_no_graph_launch(llama) -> None:
    model, _ = llama
    decoder = Decoder(model, max_batch=1, max_length=16)
    prompt = torch.randint(0, 512, (1, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = generate(model, prompt, 1, min_new_tokens=1)
    assert torch.equal(decoder.generate(prompt, max_new_tokens=1, eos_token_id=None), expected)
    assert decoder.stats.replays == {"greedy batch 1": 0}


def left_padded(
    lengths: list[int], total: int, pad: int = 0, vocab: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of the given lengths, padded on the left to ``total`` (as tokenizers do)."""
    ids = torch.full((len(lengths), total), pad, dtype=torch.long)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, total - n :] = torch.randint(1, vocab, (n,))
        mask[row, total - n :] = 1
    return ids, mask


@pytest.mark.parametrize("steps", [1, 4])
def test_prompts_of_different_lengths_decode_as_generate_does(llama, steps: int) -> None:
    model, _ = llama
    assert takes_sdpa_mask(model)
    decoder = Decoder(model, max_batch=4, max_length=48, steps_per_graph=steps)
    torch.manual_seed(4)
    ids, mask = left_padded([9, 3, 6], total=9)
    expected = generate(model, ids, 20, mask, min_new_tokens=20, pad_token_id=0)
    got = decoder.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None)
    assert torch.equal(got, expected)
    # The same prompts one at a time, unpadded, give the same continuations.
    for row, n in enumerate([9, 3, 6]):
        alone = decoder.generate(ids[row : row + 1, 9 - n :], max_new_tokens=20, eos_token_id=None)
        assert torch.equal(alone[0, n:], got[row, 9:])
    assert any("greedy+padded" in k for k in decoder.stats.replays)


def test_prompts_are_prefilled_on_their_rung_as_generate_does(llama) -> None:
    """A prompt runs on the prefill of the shortest prompt-length rung that holds it,
    right-padded to it: at a rung's length, below it, past the longest rung (eager), and
    left-padded (eager), each gives generate's tokens."""
    model, _ = llama
    decoder = Decoder(model, max_batch=4, max_length=80)
    assert decoder.prefills.lengths == [16, 32, 64, 80]
    torch.manual_seed(11)
    for batch, length in ((1, 5), (3, 16), (2, 17), (1, 70)):
        prompt = torch.randint(0, 512, (batch, length))
        new = min(20, 80 - length)
        expected = generate(model, prompt, new, min_new_tokens=new)
        assert torch.equal(
            decoder.generate(prompt, max_new_tokens=new, eos_token_id=None), expected
        )
    assert decoder.stats.prefill_replays == {
        "prefill batch 1 length 16": 1, "prefill batch 4 length 16": 1,
        "prefill batch 2 length 32": 1, "prefill batch 1 length 80": 1,
    }  # fmt: skip
    assert decoder.stats.eager_prefills == 0
    ids, mask = left_padded([6, 2], total=6)
    padded = generate(model, ids, 12, mask, min_new_tokens=12, pad_token_id=0)
    got = decoder.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(got, padded)
    assert decoder.stats.eager_prefills == 1
    short = Decoder(model, max_batch=1, max_length=40, prefill_lengths=[8])
    prompt = torch.randint(0, 512, (1, 12))  # longer than the one rung: eager
    expected = generate(model, prompt, 20, min_new_tokens=20)
    assert torch.equal(short.generate(prompt, max_new_tokens=20, eos_token_id=None), expected)
    assert short.stats.eager_prefills == 1 and short.stats.prefill_replays == {}
    with pytest.raises(cg.ConfigError, match="prefill_lengths must be positive ints"):
        Decoder(model, max_batch=1, max_length=40, prefill_lengths=[0, 8])


def test_padding_that_is_not_on_the_left_is_refused(llama) -> None:
    model, _ = llama
    decoder = Decoder(model, max_batch=2, max_length=16)
    ids = torch.randint(1, 512, (2, 4))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(cg.ConfigError, match="pad on the left"):
        decoder.generate(ids, attention_mask=mask, max_new_tokens=2)
    with pytest.raises(
        cg.ConfigError, match="attention_mask must be a tensor of the prompts' shape"
    ):
        decoder.generate(ids, attention_mask=mask[:, :3], max_new_tokens=2)


@pytest.mark.slow
@pytest.mark.parametrize("steps", [1, 4])
def test_the_captured_path_gives_generate_tokens(stand_in: None, steps: int) -> None:
    """Through the captured path (the CPU stand-in: static input buffers, warm-up, capture
    that records, replays that rerun the recording), not the pass-through: equal prompts,
    left-padded prompts and seeded sampling behave as on the pass-through."""
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    decoder = Decoder(model, max_batch=4, max_length=48, steps_per_graph=steps)
    assert all(g.state is cg.State.CAPTURED for g in decoder.graphs.values())
    torch.manual_seed(6)
    prompt = torch.randint(0, 512, (3, 7))
    expected = generate(model, prompt, 17, min_new_tokens=17)
    assert torch.equal(decoder.generate(prompt, max_new_tokens=17, eos_token_id=None), expected)
    assert [g.state for g in decoder.prefills.graphs.values()] == [cg.State.CAPTURED]
    assert decoder.stats.prefill_replays == {"prefill batch 4 length 16": 1}
    ids, mask = left_padded([7, 2, 5], total=7)
    padded = generate(model, ids, 17, mask, min_new_tokens=17, pad_token_id=0)
    got = decoder.generate(ids, attention_mask=mask, max_new_tokens=17, eos_token_id=None)
    assert torch.equal(got, padded)
    runs = []
    for _ in range(2):
        torch.manual_seed(9)
        runs.append(decoder.generate(prompt, max_new_tokens=12, do_sample=True, top_p=0.9))
    assert torch.equal(runs[0], runs[1])


def test_until_eos_decodes_in_one_launch_as_generate_does(llama) -> None:
    """until_eos=True: one launch per request (a loop on the device; here its Python form),
    rows ending at different steps, padded prompts too; sampling is refused with the reason."""
    model, _ = llama
    decoder = Decoder(model, max_batch=4, max_length=64, until_eos=True)
    prompt, eos, expected = rows_ending_apart(model)
    got = decoder.generate(prompt, max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, expected)
    assert decoder.stats.replays == {"greedy batch 4": 1}
    assert torch.equal(
        decoder.generate(prompt[:3], max_new_tokens=20, eos_token_id=None),
        generate(model, prompt[:3], 20, min_new_tokens=20),
    )
    with pytest.raises(cg.ConfigError, match="until_eos=True decodes greedily"):
        decoder.generate(prompt, max_new_tokens=4, do_sample=True)
    with pytest.raises(cg.ConfigError, match="until_eos=True decodes greedily"):
        Decoder(model, max_batch=1, max_length=16, until_eos=True, steps_per_graph=4)


@pytest.mark.parametrize("steps", [1, 4])
def test_length_rungs_decode_as_generate_across_rung_changes(llama, steps: int) -> None:
    model, _ = llama
    decoder = Decoder(
        model, max_batch=4, max_length=64, steps_per_graph=steps, cache_lengths=[8, 16, 32]
    )
    assert decoder.lengths == [8, 16, 32, 64 + steps - 1]
    torch.manual_seed(3)
    for batch in (1, 3):
        prompt = torch.randint(0, 512, (batch, 5))
        expected = generate(model, prompt, 40, min_new_tokens=40)
        assert torch.equal(decoder.generate(prompt, max_new_tokens=40, eos_token_id=None), expected)
    ids, mask = left_padded([5, 2, 4], total=5)
    padded = generate(model, ids, 40, mask, min_new_tokens=40, pad_token_id=0)
    got = decoder.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=None)
    assert torch.equal(got, padded)
    used = {
        key for key, n in decoder.stats.replays.items() if key.startswith("greedy batch 4") and n
    }
    assert "greedy batch 4" in used and len(used) >= 3  # two rung changes or more per request


def test_length_rungs_through_the_captured_path(stand_in: None) -> None:
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    decoder = Decoder(model, max_batch=2, max_length=48, cache_lengths=[8, 16])
    assert len(decoder.graphs) == 2 * 3  # (batch rungs 1, 2) x (lengths 8, 16, 48)
    assert all(g.state is cg.State.CAPTURED for g in decoder.graphs.values())
    torch.manual_seed(4)
    prompt = torch.randint(0, 512, (2, 6))
    expected = generate(model, prompt, 30, min_new_tokens=30)
    assert torch.equal(decoder.generate(prompt, max_new_tokens=30, eos_token_id=None), expected)


def test_length_rung_views_share_the_one_cache(llama) -> None:
    from cudagraphs.decoding.kv_cache import length_rungs

    model, _ = llama
    decoder = Decoder(model, max_batch=4, max_length=40, cache_lengths=[16])
    full, short = decoder.caches[2].layers[0], decoder.caches[2, 16].layers[0]
    assert short.keys.shape[2] == 16 and short.max_cache_len == 16
    assert short.keys.data_ptr() == full.keys.data_ptr()  # a prefix view, nothing allocated
    shared = [n for n, v in vars(full).items() if isinstance(v, torch.Tensor) and n != "keys"]
    assert all(getattr(short, n) is getattr(full, n) for n in shared if n != "values")
    assert length_rungs(4096, None) == [256, 512, 1024, 2048, 4096]
    assert length_rungs(4099, None) == [256, 512, 1024, 2048, 4099]  # not 4096 and 4099
    assert length_rungs(600, None) == [256, 600]
    assert length_rungs(200, None) == [200] and length_rungs(500, None) == [500]
    with pytest.raises(cg.ConfigError, match="cache_lengths must be positive ints"):
        Decoder(model, max_batch=1, max_length=16, cache_lengths=[0, 8])


def test_a_cut_rung_writes_what_the_layers_own_update_writes(llama) -> None:
    """The compiled step cuts each rung out of the one cache and writes new keys through the
    full-size tensors (``RungCaches.cut``); that write must be transformers' own: the same
    positions (the layer's count), rows and values. The counters move once, all together, at
    the step's end (``RungCaches.advance``); a layer written twice in a step writes on."""
    from cudagraphs.decoding.kv_cache import RungCaches

    model, _ = llama
    own, cut = (RungCaches(model, [1, 2, 4], 48, [8, 16]) for _ in range(2))
    assert cut.cuttable()
    cut.write_through()
    torch.manual_seed(3)
    for rows, length, positions in ((4, 48, 5), (2, 16, 1), (2, 16, 1), (1, 8, 3)):
        mine, theirs = own[rows, length], cut[rows, length]
        cut.cut(theirs, rows, length)
        assert cut.span(theirs).shape == (rows, length)
        before = [layer.cumulative_length.clone() for layer in theirs.layers]
        for layer in [*range(len(mine.layers)), 0]:  # the first layer twice
            keys, values = torch.randn(2, rows, 2, positions, 16)  # heads 2, head_dim 16
            expected = mine.layers[layer].update(keys, values)
            got = theirs.layers[layer].update(keys, values)
            for a, b in zip(expected, got):
                assert a.shape == b.shape == (rows, 2, length, 16) and torch.equal(a, b)
        assert all(torch.equal(a, b.cumulative_length) for a, b in zip(before, theirs.layers))
        cut.advance(theirs)
        for a, b in zip(mine.layers, theirs.layers):
            assert torch.equal(a.cumulative_length, b.cumulative_length)
    for a, b in zip(own.base.layers, cut.base.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.cumulative_length, b.cumulative_length)


def test_a_cut_step_that_raises_still_counts_what_its_layers_wrote(llama) -> None:
    """A step that fails after some layers wrote (here: the model's last norm) leaves every
    counter where transformers' own layers would have: a counter left behind would make the
    next request overwrite positions it then attends to."""
    from cudagraphs.decoding.compiled import cut_step
    from cudagraphs.decoding.kv_cache import RungCaches, cache_keyword

    model, _ = llama
    caches = RungCaches(model, [1], 24)
    caches.write_through()
    cache = caches[1]
    written = [layer.cumulative_length.clone() for layer in cache.layers]
    token, position = torch.randint(0, 512, (1, 1)), written[0].reshape(1).clone()

    def fail(*args: object) -> None:
        raise RuntimeError("norm failed")

    handle = model.model.norm.register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="norm failed"), torch.no_grad():
            cut_step(
                model, cache_keyword(model), caches, token, position, cache, caches.span(cache)
            )
    finally:
        handle.remove()
    assert all(layer.written is None for layer in cache.layers)
    for layer, before in zip(cache.layers, written):
        assert int(layer.cumulative_length) == int(before) + 1
    with torch.no_grad():  # a later eager call advances as it writes again
        model(
            input_ids=token,
            cache_position=position + 1,
            use_cache=True,
            **{cache_keyword(model): cache},
        )
    assert all(int(layer.cumulative_length) == int(written[0]) + 2 for layer in cache.layers)


def traces(before: int, decoder: Decoder) -> int:
    """Dynamo's traces since ``before`` (its unique-graphs counter), less those that ended in
    no compiled step: a trace ``aot_compile`` could not save is traced again by the plain
    compile it falls back to, which is not one more shape class."""
    from torch._dynamo.utils import counters

    wasted = sum(step.failed_traces for step in decoder.saved_compiles)
    return counters["stats"]["unique_graphs"] - before - wasted


@pytest.mark.slow
@pytest.mark.parametrize("cut", [True, False], ids=["cut in the step", "views marked"])
def test_compiled_forward_compiles_per_shape_class_not_per_rung(
    llama, cut: bool, monkeypatch: pytest.MonkeyPatch, fresh_compile_cache: object
) -> None:
    """Batch and cache length are dynamic dimensions: two traces of the forward (batch 1,
    larger batches) serve every (batch rung, length rung), and two of the greedy step after it;
    the tokens equal generate across rung changes; so too where the cache cannot be cut in the
    step and its rung views are marked instead."""
    from torch._dynamo.utils import counters

    from cudagraphs.decoding.kv_cache import RungCaches

    model, _ = llama
    if not cut:
        monkeypatch.setattr(RungCaches, "cuttable", lambda self: False)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    bypassed = counters["aot_autograd"]["autograd_cache_bypass"]
    decoder = Decoder(
        model, max_batch=4, max_length=48, compile=True, batch_sizes=[1, 2, 4],
        cache_lengths=[8, 16],
    )  # fmt: skip
    assert decoder.stats.compile_s > 0
    # Every compiled graph can be saved for a second process: under torch 2.11 a torch._check
    # in the step made AOTAutograd bypass its cache, so a second start traced it again.
    assert counters["aot_autograd"]["autograd_cache_bypass"] == bypassed
    # Cut: every rung's layers write through the one cache; marked: each its own view.
    layers = [layer for cache in decoder.caches.caches.values() for layer in cache.layers]
    assert all((getattr(layer, "full", None) is not None) is cut for layer in layers)
    torch.manual_seed(5)
    for batch in (3, 1, 2):
        prompt = torch.randint(0, 512, (batch, 5))
        expected = generate(model, prompt, 30, min_new_tokens=30)
        assert torch.equal(decoder.generate(prompt, max_new_tokens=30, eos_token_id=None), expected)
    # A step whose trace cannot be saved (transformers 5.25's kernel wrappers are classes
    # defined inside a function) traced once more, for its plain compile.
    assert traces(before, decoder) == 2 + 2  # forward, greedy tail
    ids, mask = left_padded([5, 2], total=5)
    padded = generate(model, ids, 30, mask, min_new_tokens=30, pad_token_id=0)
    got = decoder.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=None)
    assert torch.equal(got, padded)
    assert traces(before, decoder) == 6  # the padded forward: its own two
    used = {key for key, n in decoder.stats.replays.items() if n}
    assert {"greedy batch 1 length 8", "greedy batch 4 length 16", "greedy batch 2"} <= used


@pytest.mark.slow
def test_batch_rungs_from_two_compile_one_class_and_serve_batch_one(
    llama, fresh_compile_cache: object
) -> None:
    """Without a batch-1 rung (the default under compile), Dynamo has no size 1 to
    specialise: one trace serves every (batch, length) rung, and a single request runs on the
    batch-2 graph with generate's tokens (the trade for half the compile: one padding row at
    batch 1)."""
    from torch._dynamo.utils import counters

    model, _ = llama
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    decoder = Decoder(model, max_batch=4, max_length=48, compile=True, cache_lengths=[8])
    assert decoder.rungs == [2, 4]
    # Eager kernels, or a decoder of batch 1 only: batch 1 stays a rung.
    assert default_batch_rungs(4, False) == [1, 2, 4] and default_batch_rungs(1, True) == [1]
    assert default_batch_rungs(12, True) == [2, 4, 8, 12]
    torch.manual_seed(7)
    for batch in (1, 3):
        prompt = torch.randint(0, 512, (batch, 5))
        expected = generate(model, prompt, 20, min_new_tokens=20)
        assert torch.equal(decoder.generate(prompt, max_new_tokens=20, eos_token_id=None), expected)
    # One trace of the forward, one of the greedy tail (its batch is marked, as the forward's).
    assert traces(before, decoder) == 1 + 1
    used = {key for key, n in decoder.stats.replays.items() if n}
    assert "greedy batch 2 length 8" in used and not any("batch 1" in key for key in used)


@pytest.mark.slow
def test_a_decoder_of_one_shape_compiles_it_statically(llama, fresh_compile_cache: object) -> None:
    """One batch rung and one length rung: every size is a constant (a faster trace and
    specialised kernels), and the tokens equal generate."""
    from torch._dynamo.utils import counters

    model, _ = llama
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    decoder = Decoder(model, max_batch=2, max_length=40, batch_sizes=[2], compile=True)
    assert decoder.lengths == [40]
    keys = decoder.caches[2].layers[0].keys
    assert not getattr(keys, "_dynamo_weak_dynamic_indices", None)  # nothing marked dynamic
    torch.manual_seed(6)
    prompt = torch.randint(0, 512, (2, 5))
    expected = generate(model, prompt, 20, min_new_tokens=20)
    assert torch.equal(decoder.generate(prompt, max_new_tokens=20, eos_token_id=None), expected)
    assert traces(before, decoder) == 1 + 1  # forward, greedy tail


@torch.library.custom_op("cudagraphs_test::opaque_attention", mutates_args=())
def opaque_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """A stand-in for the decode-attention kernel (an operator Inductor cannot see into)."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=True
    )


@opaque_attention.register_fake
def _(query, key, value, mask, scale):
    return torch.empty_like(query)


@pytest.mark.slow
def test_a_static_step_attends_to_the_cache_itself_not_a_copy_of_it(
    llama, monkeypatch: pytest.MonkeyPatch, fresh_compile_cache: object
) -> None:
    """One (batch, length) shape: the compiled step writes the new keys into the cache and an
    opaque attention operator reads the cache in place. Through cache views made outside the
    step, Inductor gave it a fresh copy of each layer's whole cache, per token. What every
    layer shares is computed once per step."""
    import re

    from torch._inductor.utils import run_and_get_code

    from cudagraphs.decoding import grouped_attention

    model, _ = llama
    monkeypatch.setattr(grouped_attention, "applies", lambda q, k, v, mask: q.shape[2] == 1)
    monkeypatch.setattr(grouped_attention, "decode_attention", opaque_attention)
    torch._dynamo.reset()
    torch.manual_seed(8)
    prompt = torch.randint(0, 512, (1, 5))

    def decode() -> tuple[Decoder, torch.Tensor]:
        decoder = Decoder(model, max_batch=1, max_length=40, batch_sizes=[1], compile=True)
        return decoder, decoder.generate(prompt, max_new_tokens=12, eos_token_id=None)

    (decoder, got), codes = run_and_get_code(decode)
    assert torch.equal(got, generate(model, prompt, 12, min_new_tokens=12))
    # Every compiled copy of the step (torch 2.13 hands over two, torch 2.11 one)
    steps = [code for code in codes if "opaque_attention" in code]
    assert steps
    cache_view = decoder.caches[1].layers[0].keys.numel()
    for step in steps:
        sizes = [
            math.prod(int(n) for n in re.findall(r"\d+", shape))
            for shape in re.findall(r"empty_strided_\w+\(\(([^)]*)\)", step)
        ]
        assert sizes and max(sizes) < cache_view, (cache_view, sorted(sizes))
        # The mask every layer reads is computed once, not inside each layer's kernels, and
        # the layers' position counters move in one multi-tensor operation.
        assert step.count("computed_once.default(") == 1
        assert "foreach_add" in step


@pytest.mark.slow
def test_a_step_whose_batch_alone_varies_attends_with_the_one_token_kernel(
    llama, monkeypatch: pytest.MonkeyPatch, fresh_compile_cache: object
) -> None:
    """Batch rungs 2 and 4 at one cache length: one compile with a dynamic batch, whose
    length is a constant, so the one-token attention (an opaque operator here) is chosen for
    it as for a step of one shape, and every rung decodes as ``generate`` does. A trace of the
    step does not split on the batch."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    from cudagraphs.decoding import attention as decode_attention
    from cudagraphs.decoding import grouped_attention

    model, _ = llama
    # The kernel's own checks on the inputs, on the CPU (its device check left out)
    monkeypatch.setattr(grouped_attention, "applies", decode_attention.fits)
    monkeypatch.setattr(grouped_attention, "decode_attention", opaque_attention)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    decoder, codes = run_and_get_code(
        Decoder, model, max_batch=4, max_length=40, batch_sizes=[2, 4], compile=True
    )
    assert decoder.lengths == [40] and decoder.stats.attention.startswith("grouped, one kernel")
    assert any("opaque_attention" in code for code in codes)  # the step calls the operator
    torch.manual_seed(9)
    for rows in (4, 2, 3):
        prompt = torch.randint(0, 512, (rows, 5))
        expected = generate(model, prompt, 8, min_new_tokens=8)
        assert torch.equal(decoder.generate(prompt, max_new_tokens=8, eos_token_id=None), expected)
    assert traces(before, decoder) == 1 + 1  # the forward (batch dynamic), the greedy tail


@pytest.mark.slow
def test_a_compiled_step_of_one_shape_reads_weights_loaded_in_place_between_requests(
    fresh_compile_cache: object,
) -> None:
    """The compiled step (one shape: it cuts its cache itself) reads the fused weights as
    inputs, never baked in: ``load_state_dict`` with other weights between two requests gives
    those weights' tokens."""
    import copy

    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    decoder = Decoder(model, max_batch=1, max_length=40, batch_sizes=[1], compile=True)
    assert decoder.stats.fused_groups == 4
    torch.manual_seed(11)
    prompt = torch.randint(0, 512, (1, 6))
    before = decoder.generate(prompt, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(before, generate(reference, prompt, 12, min_new_tokens=12))
    generator = torch.Generator().manual_seed(12)
    weights = {
        name: torch.randn(t.shape, generator=generator, dtype=t.dtype) * 0.3
        for name, t in reference.state_dict().items()
    }
    model.load_state_dict(weights)  # in place, into the fused buffers
    reference.load_state_dict(weights)
    after = decoder.generate(prompt, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(after, generate(reference, prompt, 12, min_new_tokens=12))
    assert not torch.equal(after, before)


def test_a_decoder_without_cuda_warns_once_for_all_its_graphs(llama) -> None:
    """Every rung's graph, prefills too, runs eagerly without CUDA: one warning for them all
    (the graphs of one pool share their notices), each graph counted in the stats."""
    model, _ = llama
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoder = Decoder(model, max_batch=4, max_length=24)
        prompt = torch.randint(0, 512, (3, 5))
        got = decoder.generate(prompt, max_new_tokens=6, eos_token_id=None)
    assert torch.equal(got, generate(model, prompt, 6, min_new_tokens=6))
    ours = [w for w in caught if issubclass(w.category, cg.CudaGraphsWarning)]
    assert len(ours) == 1 and "runs eagerly" in str(ours[0].message), ours
    (count,) = decoder.stats.notices.values()
    assert count == len(decoder.graphs) + len(decoder.prefills.graphs) >= 3


@pytest.mark.parametrize("steps", [1, 4])
def test_a_parameter_replaced_after_a_request_that_filled_the_cache_is_read_next(
    llama, stand_in: None, steps: int
) -> None:
    """Through the captured path (the CPU stand-in): a request runs to the cache's last
    position, then a projection gets a new Parameter. The next request captures again from
    position 0 on an empty cache (the warm-up's steps advance the position, which from the
    last request's end would write past the cache) and gives ``generate``'s tokens with the
    new weight."""
    import copy

    from torch import nn

    model = copy.deepcopy(llama[0])
    model.generation_config.eos_token_id = None  # min_new_tokens would suppress it
    decoder = Decoder(model, max_batch=2, max_length=40, steps_per_graph=steps, fuse=False)
    torch.manual_seed(3)
    prompt = torch.randint(0, 512, (2, 6))
    full = decoder.generate(prompt, max_new_tokens=34, eos_token_id=None)
    assert torch.equal(full, generate(model, prompt, 34, min_new_tokens=34))
    projection = model.model.layers[1].self_attn.v_proj
    projection.weight = nn.Parameter(torch.randn_like(projection.weight) * 0.3)
    got = decoder.generate(prompt, max_new_tokens=34, eos_token_id=None)
    assert decoder.stats.recaptures >= 1
    expected = generate(model, prompt, 34, min_new_tokens=34)
    assert torch.equal(got, expected) and not torch.equal(got, full)

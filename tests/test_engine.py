"""The LLM engine's scheduler on the CPU: requests join and leave a running batch, each one's
greedy tokens equal its own ``model.generate`` whatever else runs beside it, seeded draws do
not depend on the neighbours, and every failure stays with its request (bad input, overload,
cancel, a step that raises). With ``stand_in`` the steps are recordings replayed without
running Python, as graphs are (conftest.py); the same checks run on a GPU in
``test_engine_cuda.py``."""

from __future__ import annotations

import asyncio
import copy
import gc
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import cudagraphs as cg

transformers = pytest.importorskip("transformers")

from llama_decode import tiny_llama  # noqa: E402

from cudagraphs.decoding import Engine  # noqa: E402
from cudagraphs.decoding.row_sampling import RowSettings, choose, seeded_uniform  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::cudagraphs.CudaGraphsWarning")

VOCAB = 512


@pytest.fixture(scope="module")
def model() -> Any:
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    model.set_attn_implementation("sdpa")
    return model


@pytest.fixture
def engine(model: Any) -> Iterator[Engine]:
    engine = Engine(model, max_batch=4, max_length=64, prefill_chunk=8)
    yield engine
    engine.close(drain=False)


_TWINS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def reference(model: Any, prompt: list[int], new: int, eos: Any = None) -> list[int]:
    """``model.generate``'s greedy new tokens (all ``new`` of them where ``eos`` is None), from
    a copy of ``model`` with transformers' own attention: the engine switches the model's
    attention to the grouped one and may be decoding on another thread meanwhile."""
    twin = _TWINS.get(model)
    if twin is None:
        twin = _TWINS[model] = copy.deepcopy(model)
        twin.set_attn_implementation("sdpa")
        # No end-of-sequence id of its own: with ``eos`` None every token is the argmax, the
        # config's id (2) too, as the engine's ``eos_token_id=None``; ``min_new_tokens``
        # would instead forbid that id and choose the runner-up.
        twin.generation_config.eos_token_id = None
    return generated(twin, prompt, new, eos)


def generated(model: Any, prompt: list[int], new: int, eos: Any = None) -> list[int]:
    """``model.generate``'s greedy new tokens; ``model``'s generation config holds no
    end-of-sequence id, so with ``eos`` None all ``new`` of them, each the argmax."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
            pad_token_id=0, eos_token_id=eos,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


LENGTHS = [5, 11, 3, 17, 9, 2, 20]
NEW = [10, 20, 7, 15, 12, 30, 4]


def check_against_generate(model: Any, engine: Engine) -> None:
    asked = prompts(3, LENGTHS)
    completions = [
        engine.submit(p, max_new_tokens=n, eos_token_id=None) for p, n in zip(asked, NEW)
    ]
    for completion, prompt, new in zip(completions, asked, NEW):
        assert completion.result(timeout=120) == reference(model, prompt, new)
        assert completion.finish_reason == "length"


def test_requests_given_at_once_each_get_their_own_generate_tokens(model, engine) -> None:
    # Seven requests on four slots: rows join as others leave, prompts go in by chunks of 8
    # (the 17- and 20-token prompts take three), and the batch runs on rungs 4, 2 and 1.
    check_against_generate(model, engine)
    assert engine.stats.attention.startswith("grouped")  # on the CPU: SDPA over the groups
    assert engine.stats.moves > 0, "a row should have moved into a finished request's slot"
    rungs = {key.split(" length")[0] for key in engine.stats.replays}
    assert {"greedy batch 4", "greedy batch 1"} <= rungs
    assert engine.stats.prefill_chunks > len(LENGTHS)  # some prompts took several chunks


def test_rows_that_are_not_decoding_may_lie_past_the_step_s_cache_length(model) -> None:
    # Short rows decode on the 16-position rung while beside them, under the same batch
    # rung, a 40-token prompt goes in by chunks (its length past 16) and, once it has ended,
    # its freed slot keeps the length it had. A step writes a position for every row of its
    # rung: those rows must neither land outside the rung nor change what the slot holds.
    with Engine(model, max_batch=4, max_length=64, prefill_chunk=8,
                cache_lengths=[16, 32, 64]) as engine:  # fmt: skip
        short = prompts(9, [3, 4, 2])
        first = [engine.submit(p, max_new_tokens=12, eos_token_id=None) for p in short]
        long = prompts(10, [40])[0]  # the last to join: its chunks go in while the rest decode
        late = engine.submit(long, max_new_tokens=3, eos_token_id=None)
        assert late.result(timeout=120) == reference(model, long, 3)
        for completion, prompt in zip(first, short):
            assert completion.result(timeout=120) == reference(model, prompt, 12)
        again = prompts(11, [5, 6, 3])  # three rows on the 4-row rung, the freed slot under it
        outputs = [engine.submit(p, max_new_tokens=8, eos_token_id=None) for p in again]
        for completion, prompt in zip(outputs, again):
            assert completion.result(timeout=120) == reference(model, prompt, 8)
        assert engine.metrics().errors == {}
        assert any(key.endswith("length 16") for key in engine.stats.replays)


def test_several_steps_between_reads_give_the_same_tokens_and_stops(model) -> None:
    # Four steps per read: a row that ends at the second is read up to it, the steps after
    # its end neither advance it nor reach its stream.
    with Engine(model, max_batch=4, max_length=64, prefill_chunk=8, read_every=4) as engine:
        check_against_generate(model, engine)
        asked = prompts(5, [4, 7, 5])
        free = [reference(model, p, 16) for p in asked]
        eos = [[free[0][5]], [free[1][9]], None]
        completions = [
            engine.submit(p, max_new_tokens=16, eos_token_id=e) for p, e in zip(asked, eos)
        ]
        for completion, prompt, stop in zip(completions, asked, eos):
            assert completion.result(timeout=120) == reference(model, prompt, 16, eos=stop)
    assert engine.stats.replays and all(v % 4 == 0 for v in engine.stats.replays.values())


def test_the_model_s_own_attention_gives_the_same_tokens() -> None:
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    model.set_attn_implementation("sdpa")
    with Engine(
        model, max_batch=4, max_length=64, prefill_chunk=8, grouped_attention=False
    ) as engine:
        assert engine.stats.attention == "the model's own: grouped_attention=False"
        check_against_generate(model, engine)


@pytest.fixture
def recorded_steps(stand_in: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in, for an engine's steps. A step takes no tensor argument, so it is captured
    on the current device: here, device 0 of none."""
    if torch.version.cuda is not None:
        # A CUDA build without a GPU (CI's newest and floor runs): the current device would
        # be asked of the driver. The CPU build runs it.
        pytest.skip("a step with no tensor argument on the stand-in needs a CPU build of torch")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_an_engine_fuses_the_projections_and_a_weight_update_changes_the_next_tokens(
    recorded_steps,
) -> None:
    # Through the recorded steps and chunks: the engine computes each layer's q/k/v and
    # gate/up as one product over one buffer, the parameters still the same objects; each
    # request's tokens equal generate's on an unfused copy, and load_state_dict between two
    # requests is read by the next one without a capture again (the buffer is written in
    # place). fuse=False leaves every projection its own product.
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    model.set_attn_implementation("sdpa")
    unfused = copy.deepcopy(model)
    unfused.generation_config.eos_token_id = None
    before = {name: id(p) for name, p in model.named_parameters()}

    asked = prompts(21, [6, 13, 19])
    with Engine(model, max_batch=4, max_length=64, prefill_chunk=8) as engine:
        assert engine.stats.fused_groups == 4 and engine.stats.unfused == []
        assert {name: id(p) for name, p in model.named_parameters()} == before
        attention = model.model.layers[1].self_attn
        shared = attention.q_proj.weight.untyped_storage().data_ptr()
        assert attention.v_proj.weight.untyped_storage().data_ptr() == shared
        first = [engine.submit(p, max_new_tokens=9, eos_token_id=None) for p in asked]
        firsts = [c.result(timeout=120) for c in first]
        assert firsts == [generated(unfused, p, 9) for p in asked]
        generator = torch.Generator().manual_seed(22)
        weights = {
            name: torch.randn(t.shape, generator=generator, dtype=t.dtype) * 0.3
            for name, t in model.state_dict().items()
        }
        model.load_state_dict(weights)
        unfused.load_state_dict(weights)
        second = [engine.submit(p, max_new_tokens=9, eos_token_id=None) for p in asked]
        seconds = [c.result(timeout=120) for c in second]
        assert seconds == [generated(unfused, p, 9) for p in asked] and seconds != firsts
        assert engine.stats.recaptures == 0
    plain, _ = tiny_llama("cpu", hidden=64, layers=2)
    plain.set_attn_implementation("sdpa")
    with Engine(plain, max_batch=2, max_length=32, fuse=False) as engine:
        assert engine.stats.fused_groups == 0
        attention = plain.model.layers[0].self_attn
        assert type(attention.q_proj) is torch.nn.Linear
    with pytest.raises(cg.ConfigError, match="fuse"):
        Engine(plain, max_batch=2, max_length=32, fuse="yes")


def test_recorded_steps_replay_rows_at_their_own_lengths(recorded_steps, model) -> None:
    # The steps are recordings here: a length, token or mask read on the host at capture
    # would be replayed frozen, and some row's tokens would differ from generate's.
    with Engine(model, max_batch=4, max_length=64, prefill_chunk=8,
                cache_lengths=[16, 32, 64]) as engine:  # fmt: skip
        assert engine.graphed is False  # the model is on the CPU; the stand-in still records
        assert all(g.stats.state == "captured" for g in engine.graphs.values())
        # Every prompt chunk's rung is recorded before the first request: none waits for a
        # capture, and the recordings' writes into the spare slot change no request's tokens.
        rungs = {(k, r, n) for k in (1, 2, 4) for r in (16, 32, 64) for n in (16, 32, 64) if n >= r}
        assert set(engine.prefills.graphs) == rungs
        assert all(g.stats.state == "captured" for g in engine.prefills.graphs.values())
        check_against_generate(model, engine)
        # Prompt chunks replayed their recordings, right-padded to their rung, several
        # requests' chunks in one forward where they joined together.
        assert engine.prefills.recorded > engine.prefills.eager
        assert engine.prefills.forwards < engine.prefills.recorded
        assert set(engine.prefills.graphs) == rungs
        assert all(g.stats.recaptures == 0 for g in engine.prefills.graphs.values())


@pytest.fixture
def counted_compile(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[int]]:
    """``torch.compile`` as Dynamo with aten kernels (Inductor would compile C++ for
    minutes), counting its traces and every run of the traced code: ``(traces, [runs])``."""
    traces: list[Any] = []
    runs = [0]

    def backend(gm: Any, examples: Any) -> Any:
        traces.append(gm)
        compiled = torch._dynamo.backends.debugging.aot_eager(gm, examples)

        def run(*args: Any) -> Any:
            runs[0] += 1
            return compiled(*args)

        return run

    def compile_counted(fn: Any = None, *, dynamic: Any = None, **_: Any) -> Any:
        return torch._dynamo.optimize(backend, dynamic=dynamic)(fn)

    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", compile_counted)
    return traces, runs


def test_compiled_steps_trace_once_for_every_rung_and_give_generate_s_tokens(
    model, counted_compile
) -> None:
    # compile=True: the steps' logits and the batches of prompt chunks go through
    # torch.compile, their rungs as dynamic sizes. One trace serves the steps of all six
    # rungs (batch 2 and 4, lengths 16, 32 and 64), one the chunks of all twelve (2 and 4
    # rows; 16, 32 and 64 tokens; each cache length holding them): a rung a trace
    # specialised on would be traced again, and a forward that fell back to the model's own
    # kernels would run none.
    traces, runs = counted_compile
    # Chunks of up to 32 tokens: the 17- and 20-token prompts go in at the 32-token rung, the
    # others at 16.
    with Engine(model, max_batch=4, max_length=64, prefill_chunk=128, cache_lengths=[16, 32, 64],
                compile=True, warmup=1) as engine:  # fmt: skip
        prefills = engine.prefills
        assert engine.rungs == [2, 4] and prefills.row_rungs == [2, 4] and engine.stats.compiled
        assert engine.health()["compiled"] is True
        assert (len(engine.graphs), len(prefills.graphs)) == (6, 12)
        # Each step's warm-up and capture call ran (without CUDA a graph made on examples,
        # as the chunks' are, runs nothing until it is called).
        assert runs[0] == 6 * 2
        check_against_generate(model, engine)
        steps = sum(engine.stats.replays.values())
        assert len({key.split(" batch")[1] for key in engine.stats.replays}) > 1
        assert prefills.eager == 0 and prefills.forwards > 0
    assert len(traces) == 2
    assert runs[0] == 6 * 2 + steps + prefills.forwards


def test_compiled_steps_are_recorded_with_their_compiled_kernels(
    recorded_steps, model, counted_compile
) -> None:
    # The stand-in records each step and chunk batch as graphs are: every warm-up and every
    # capture runs the compiled code (a capture that ran the model's own kernels would record
    # them instead), and the replays give each request its generate tokens.
    traces, runs = counted_compile
    with Engine(model, max_batch=4, max_length=64, prefill_chunk=8, compile=True) as engine:
        recordings = len(engine.graphs) + len(engine.prefills.graphs)
        assert recordings == 2 + 6  # batch 2 and 4; 2 and 4 rows of 16, 32 and 64 tokens
        assert all(g.stats.state == "captured" for g in engine.graphs.values())
        assert runs[0] == recordings * 3  # two warm-up runs and the capture each
        check_against_generate(model, engine)
    assert len(traces) == 2


def test_requests_joining_together_go_in_as_rows_of_one_recorded_forward(
    recorded_steps, model
) -> None:
    # Four requests at once, chunks of at most 16 tokens each, up to four per forward: their
    # prompts (12 to 58 tokens, the longest past one chunk) go in as rows of recorded
    # batches, each row at its own slot and start, and each request's tokens are its own
    # generate's. The 58-token one's last chunk (10 tokens at 48, padded to 16: positions up
    # to 64) fits the cache: nothing runs eagerly.
    lengths, new = [12, 58, 30, 7], [6, 4, 5, 8]
    with Engine(model, max_batch=4, max_length=64, prefill_chunk=64, prefill_rows=4,
                cache_lengths=[16, 32, 64]) as engine:  # fmt: skip
        asked = prompts(5, lengths)
        completions = [
            engine.submit(p, max_new_tokens=n, eos_token_id=None) for p, n in zip(asked, new)
        ]
        for completion, prompt, n in zip(completions, asked, new):
            assert completion.result(timeout=120) == reference(model, prompt, n)
        prefills = engine.prefills
        assert prefills.eager == 0 and prefills.recorded == engine.stats.prefill_chunks
        assert prefills.forwards < prefills.recorded  # several chunks per forward
        assert {rows for rows, _, _ in prefills.graphs} == {1, 2, 4}


def test_a_chunk_past_the_cache_s_end_goes_in_eagerly_beside_a_recorded_batch(model) -> None:
    # Two prompts join together: the 58-token one's last chunk (10 tokens at 48) padded to
    # 16 would pass the 60-position cache, so it goes in eagerly; the other's chunk is
    # recorded. Both get their own generate's tokens.
    lengths, new = [58, 9], [2, 5]
    with Engine(model, max_batch=2, max_length=60, prefill_chunk=32, prefill_rows=2) as engine:
        asked = prompts(6, lengths)
        completions = [
            engine.submit(p, max_new_tokens=n, eos_token_id=None) for p, n in zip(asked, new)
        ]
        for completion, prompt, n in zip(completions, asked, new):
            assert completion.result(timeout=120) == reference(model, prompt, n)
        assert engine.prefills.eager == 1


def test_a_weight_given_new_memory_captures_again_with_the_rows_unharmed(recorded_steps) -> None:
    # The guard sees the parameter's new memory and captures the step again, with no warm-up
    # run (each would be a step of the live rows): the call that captures is one step.
    model, _ = tiny_llama("cpu", hidden=64, layers=2)
    model.set_attn_implementation("sdpa")
    asked = prompts(19, [6, 9])
    expected = [reference(model, p, 30) for p in asked]
    with Engine(model, max_batch=2, max_length=64) as engine:
        running = [engine.submit(p, max_new_tokens=30, eos_token_id=None) for p in asked]
        tokens = iter(running[0])
        early = [next(tokens) for _ in range(5)]
        layer = model.model.layers[0].mlp.up_proj
        layer.weight = torch.nn.Parameter(layer.weight.detach().clone())  # same values
        assert early + list(tokens) == expected[0]
        assert running[1].result(timeout=120) == expected[1]
        assert engine.stats.recaptures >= 1


def test_an_engine_no_one_holds_is_collected_once_idle_and_its_worker_ends(model) -> None:
    # Its worker holds it only while there is work: a request still running when the last
    # reference goes finishes first, then the engine, its cache and graphs are freed.
    engine = Engine(model, max_batch=2, max_length=64, name="dropped")
    running = engine.submit(prompts(12, [5])[0], max_new_tokens=20, eos_token_id=None)
    collected = weakref.ref(engine)
    cache = weakref.ref(engine.cache.base.layers[0].keys)
    del engine
    assert running.result(timeout=120) == reference(model, prompts(12, [5])[0], 20)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (collected() is not None or _worker("dropped")):
        gc.collect()
        time.sleep(0.05)
    gc.collect()  # the cache's views and layers refer to each other
    assert collected() is None and cache() is None
    assert not _worker("dropped")


def _worker(name: str) -> bool:
    return any(t.name == f"cudagraphs-{name}" and t.is_alive() for t in threading.enumerate())


def test_requests_that_arrive_apart_join_the_running_batch(model, engine) -> None:
    asked = prompts(4, [6, 9, 4, 13])
    first = engine.submit(asked[0], max_new_tokens=40, eos_token_id=None)
    iterator = iter(first)
    early = [next(iterator) for _ in range(5)]  # the first request is decoding
    later = [engine.submit(p, max_new_tokens=12, eos_token_id=None) for p in asked[1:]]
    assert early + list(iterator) == reference(model, asked[0], 40)
    for completion, prompt in zip(later, asked[1:]):
        assert completion.result(timeout=120) == reference(model, prompt, 12)
    assert any(key.startswith("greedy batch 4") for key in engine.stats.replays)


def test_a_long_prompt_goes_in_by_chunks_between_the_running_rows_steps(model) -> None:
    # A 56-token prompt in chunks of 8: the running request gets a step after each chunk,
    # not a wait for the whole prompt.
    with Engine(model, max_batch=4, max_length=64, prefill_chunk=8) as engine:
        running = engine.submit(prompts(30, [4])[0], max_new_tokens=50, eos_token_id=None)
        tokens = iter(running)
        next(tokens)
        long = engine.submit(prompts(31, [56])[0], max_new_tokens=4, eos_token_id=None)
        long.result(timeout=120)
        running.result(timeout=120)
    during = [t for t in running.token_times if long.submitted < t < long.token_times[0]]
    assert len(during) >= 5  # 7 chunks: a step after each of the first 6
    assert engine.stats.prefill_chunks >= 1 + 7


def test_a_chunk_that_would_pad_past_the_cache_s_end_goes_in_eagerly(model) -> None:
    # 58 tokens in chunks of 8: the last (2 tokens at position 56) padded to 16 would write
    # past position 63, so it runs at its own length; the others are recorded, padded.
    with Engine(model, max_batch=2, max_length=64, prefill_chunk=8) as engine:
        prompt = prompts(32, [58])[0]
        assert engine.generate(prompt, max_new_tokens=6, eos_token_id=None) == reference(
            model, prompt, 6
        )
        assert engine.stats.eager_prefill_chunks == 1
        assert engine.stats.prefill_chunks == 8


def test_each_request_stops_at_its_own_end_of_sequence_ids(model, engine) -> None:
    asked = prompts(5, [4, 7, 5])
    free = [reference(model, p, 16) for p in asked]
    # The second request's second id comes first in its output: each of a row's ids counts.
    first, second = free[1][9], free[1][5]
    assert second not in free[1][:5] and first not in free[1][:6]
    eos = [[free[0][3]], [first, second], None]  # the third runs to its length
    completions = [engine.submit(p, max_new_tokens=16, eos_token_id=e) for p, e in zip(asked, eos)]
    for completion, prompt, stop in zip(completions, asked, eos):
        tokens = completion.result(timeout=120)
        assert tokens == reference(model, prompt, 16, eos=stop)
        assert completion.finish_reason == ("length" if stop is None else "stop")
    assert completions[0].tokens[-1] == eos[0][0] and len(completions[0].tokens) == 4


def sampled(engine: Engine, prompt: list[int], seed: int | None) -> list[int]:
    return engine.submit(
        prompt, max_new_tokens=12, do_sample=True, temperature=1.3, top_k=40, top_p=0.95,
        seed=seed, eos_token_id=None,
    ).result(timeout=120)  # fmt: skip


def test_a_seeded_request_draws_the_same_tokens_whatever_its_neighbours(model) -> None:
    prompt = prompts(6, [8])[0]
    with Engine(model, max_batch=4, max_length=64, prefill_chunk=4) as engine:
        alone = sampled(engine, prompt, seed=77)
        # Beside a long greedy row, a sampled row of another seed and a request that joins
        # later, on another slot and another rung, with prompt chunks put in between steps.
        # The short greedy request ends first, and the seeded one moves into its slot.
        others = [
            engine.submit(prompts(7, [20])[0], max_new_tokens=30, eos_token_id=None),
            engine.submit(prompts(7, [3])[0], max_new_tokens=3, eos_token_id=None),
            engine.submit(
                prompts(8, [3])[0], max_new_tokens=25, do_sample=True, seed=5,
                eos_token_id=None,
            ),
        ]  # fmt: skip
        moves = engine.stats.moves
        crowded = sampled(engine, prompt, seed=77)
        assert engine.stats.moves > moves
        other_seed = sampled(engine, prompt, seed=78)
        for completion in others:
            completion.result(timeout=120)
    assert crowded == alone
    assert other_seed != alone  # the draws do come from the seed
    assert any(key.startswith("mixed") for key in engine.stats.replays)


def test_a_request_without_a_seed_leaves_the_random_module_alone(model) -> None:
    # The engine's thread records steps while callers submit: a seed drawn from the random
    # module on the caller's thread would change its state in the middle of a recording,
    # and the recording's check would fail the step as one that draws on the host.
    import random

    random.seed(11)
    state = random.getstate()
    with Engine(model, max_batch=4, max_length=64, prefill_chunk=8, do_sample=True) as engine:
        completions = [
            engine.submit(prompts(20 + k, [5])[0], max_new_tokens=6, eos_token_id=None)
            for k in range(12)
        ]
        outputs = [completion.result(timeout=120) for completion in completions]
        assert random.getstate() == state
        assert engine.metrics().errors == {}
        twice = [sampled(engine, prompts(40, [6])[0], seed=None) for _ in range(2)]
    assert len(outputs) == 12 and twice[0] != twice[1]  # unseeded draws still differ


def test_the_seeded_draw_follows_the_filtered_distribution() -> None:
    # Many rows of one logits vector, each its own seed: the draws' frequencies match the
    # probabilities after temperature, top-k and top-p.
    rows, vocab = 20_000, 6
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -3.0]).expand(rows, vocab)
    settings = RowSettings.make(rows, vocab, "cpu")
    settings.temperature.fill_(0.8)
    settings.top_k.fill_(4)
    settings.top_p.fill_(0.97)
    settings.seed.copy_(torch.arange(rows) * 7919 + 11)
    live = torch.ones(rows, dtype=torch.bool)
    drawn = choose(logits, settings, slice(0, rows), live)[:, 0]
    probs = (logits[0] / 0.8).softmax(-1)
    probs[4:] = 0  # top-k 4
    probs /= probs.sum()
    mass_above = probs.cumsum(-1) - probs
    probs[mass_above >= 0.97] = 0
    probs /= probs.sum()
    frequencies = torch.bincount(drawn, minlength=vocab).float() / rows
    torch.testing.assert_close(frequencies, probs, atol=0.012, rtol=0)
    assert settings.drawn.eq(1).all()
    uniforms = seeded_uniform(settings.seed, settings.drawn)
    assert float(uniforms.min()) >= 0 and float(uniforms.max()) < 1
    assert abs(float(uniforms.mean()) - 0.5) < 0.01


def test_a_row_that_is_not_live_draws_nothing() -> None:
    settings = RowSettings.make(2, 8, "cpu")
    settings.temperature.fill_(1.0)
    choose(torch.randn(2, 8), settings, slice(0, 2), torch.tensor([True, False]))
    assert settings.drawn.tolist() == [1, 0]


BAD = [
    (list(range(60)), {"max_new_tokens": 10}, "needs 70 cache positions"),
    ([3, VOCAB, 7], {"max_new_tokens": 4}, f"id {VOCAB}, outside the vocabulary"),
    ([3, -1], {"max_new_tokens": 4}, "outside the vocabulary"),
    (torch.tensor([1.0, 2.0]), {"max_new_tokens": 4}, "integer token ids"),
    (torch.ones(2, 3, dtype=torch.long), {"max_new_tokens": 4}, "one sequence of ids"),
    ([], {"max_new_tokens": 4}, "prompt is empty"),
    ("hello", {"max_new_tokens": 4}, "list of token ids"),
    ([1, 2], {"max_new_tokens": 0}, "max_new_tokens must be a positive int"),
    ([1, 2], {"max_new_tokens": 4, "do_sample": True, "temperature": 0.0}, "temperature"),
    ([1, 2], {"max_new_tokens": 4, "do_sample": True, "top_p": 1.5}, "top_p"),
    ([1, 2], {"max_new_tokens": 4, "do_sample": True, "top_k": 0}, "top_k"),
    ([1, 2], {"max_new_tokens": 4, "seed": -3}, "seed"),
    ([1, 2], {"max_new_tokens": 4, "eos_token_id": [VOCAB + 5]}, "eos_token_id"),
]


@pytest.mark.parametrize(("prompt", "settings", "message"), BAD)
def test_a_bad_request_is_refused_alone(model, engine, prompt, settings, message) -> None:
    asked = prompts(9, [6])[0]
    running = engine.submit(asked, max_new_tokens=20, eos_token_id=None)
    with pytest.raises(cg.BadRequestError, match=message):
        engine.submit(prompt, **settings)
    assert running.result(timeout=120) == reference(model, asked, 20)
    assert engine.metrics().queue_depth == 0


def test_a_misspelt_setting_gets_did_you_mean(engine) -> None:
    with pytest.raises(cg.ConfigError, match="did you mean max_new_tokens"):
        engine.submit([1, 2], max_new_token=4)


def test_a_full_queue_refuses_at_once_and_loses_nothing(model) -> None:
    with Engine(model, max_batch=1, max_length=64, max_queue=2) as engine:
        asked = prompts(10, [5, 6, 7, 8])
        first = engine.submit(asked[0], max_new_tokens=40, eos_token_id=None)
        next(iter(first))  # in its slot: the queue is empty
        queued = [engine.submit(p, max_new_tokens=5, eos_token_id=None) for p in asked[1:3]]
        with pytest.raises(cg.Overloaded, match="max_queue") as refused:
            engine.submit(asked[3], max_new_tokens=5)
        assert refused.value.retry_after_s > 0
        assert first.result(timeout=120) == reference(model, asked[0], 40)
        for completion, prompt in zip(queued, asked[1:3]):
            assert completion.result(timeout=120) == reference(model, prompt, 5)
        assert engine.metrics().errors == {"Overloaded": 1}


def test_a_cancelled_request_frees_its_slot_and_the_others_go_on(model, engine) -> None:
    asked = prompts(11, [5, 8])
    doomed = engine.submit(asked[0], max_new_tokens=50, eos_token_id=None)
    other = engine.submit(asked[1], max_new_tokens=30, eos_token_id=None)
    tokens = iter(doomed)
    next(tokens)
    doomed.cancel()
    with pytest.raises(cg.RequestCancelled):
        doomed.result(timeout=120)
    assert doomed.finish_reason == "cancelled" and len(doomed.tokens) < 50
    assert other.result(timeout=120) == reference(model, asked[1], 30)
    assert engine.metrics().running == 0


def test_an_async_reader_that_leaves_early_cancels_its_request(model, engine) -> None:
    asked = prompts(12, [4, 9, 6])

    async def main() -> tuple[list[int], list[list[int]]]:
        left_early = engine.submit(asked[0], max_new_tokens=50, eos_token_id=None)
        got = []
        async for token in left_early:  # a client that disconnects after three tokens
            got.append(token)
            if len(got) == 3:
                break
        # The generator is closed at once when it is left (as a server's is on disconnect).
        await asyncio.sleep(0)
        rest = [engine.submit(p, max_new_tokens=14, eos_token_id=None) for p in asked[1:]]
        return got, [await completion.wait() for completion in rest], left_early

    got, rest, left_early = asyncio.run(main())
    assert got == reference(model, asked[0], 3)
    deadline = time.monotonic() + 60
    while not left_early.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert left_early.finish_reason == "cancelled"
    for tokens, prompt in zip(rest, asked[1:]):
        assert tokens == reference(model, prompt, 14)


def test_async_iteration_streams_each_request_from_one_event_loop(model, engine) -> None:
    asked = prompts(13, [3, 12, 7, 5, 9, 4])

    async def stream(prompt: list[int]) -> list[int]:
        return [t async for t in engine.submit(prompt, max_new_tokens=9, eos_token_id=None)]

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(stream(p) for p in asked))

    for tokens, prompt in zip(asyncio.run(main()), asked):
        assert tokens == reference(model, prompt, 9)


def test_requests_from_many_threads(model, engine) -> None:
    asked = prompts(14, [3, 5, 8, 2, 6, 9, 4, 7])
    results: dict[int, list[int]] = {}

    def client(k: int) -> None:
        results[k] = list(engine.submit(asked[k], max_new_tokens=8, eos_token_id=None))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(len(asked))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for k, prompt in enumerate(asked):
        assert results[k] == reference(model, prompt, 8)


class Tripwire:
    """A forward hook on one layer that raises once armed, for inputs of ``tokens`` positions
    (1: a decode step; more: a prompt chunk)."""

    def __init__(self, layer: torch.nn.Module, tokens: int):
        self.armed, self.tokens = False, tokens
        self.handle = layer.register_forward_pre_hook(self)

    def __call__(self, module: Any, args: Any, kwargs: Any = None) -> None:
        hidden = args[0] if args else None
        if self.armed and hidden is not None and (hidden.shape[1] == 1) == (self.tokens == 1):
            self.armed = False
            raise RuntimeError("tripwire: a kernel failed")


def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(model) -> None:
    wire = Tripwire(model.model.layers[1].mlp, tokens=1)
    try:
        with Engine(model, max_batch=4, max_length=64) as engine:
            asked = prompts(15, [5, 7, 6])
            running = [engine.submit(p, max_new_tokens=30, eos_token_id=None) for p in asked[:2]]
            next(iter(running[0]))
            next(iter(running[1]))
            wire.armed = True
            for completion in running:
                with pytest.raises(cg.StepFailedError, match="tripwire") as failed:
                    completion.result(timeout=120)
                assert isinstance(failed.value.__cause__, RuntimeError)
                assert completion.finish_reason == "error"
            after = engine.submit(asked[2], max_new_tokens=12, eos_token_id=None)
            assert after.result(timeout=120) == reference(model, asked[2], 12)
            assert engine.health()["status"] == "ok"
    finally:
        wire.handle.remove()


def test_a_prompt_that_fails_to_prefill_fails_alone(model) -> None:
    wire = Tripwire(model.model.layers[0].mlp, tokens=2)
    try:
        with Engine(model, max_batch=4, max_length=64) as engine:
            asked = prompts(16, [5, 7])
            running = engine.submit(asked[0], max_new_tokens=30, eos_token_id=None)
            next(iter(running))
            wire.armed = True
            bad = engine.submit(asked[1], max_new_tokens=5)
            with pytest.raises(cg.StepFailedError, match="failed to prefill"):
                bad.result(timeout=120)
            assert running.result(timeout=120) == reference(model, asked[0], 30)
    finally:
        wire.handle.remove()


def test_close_drains_or_fails_and_then_refuses(model) -> None:
    asked = prompts(17, [4, 6, 5])
    engine = Engine(model, max_batch=1, max_length=64)
    drained = [engine.submit(p, max_new_tokens=6, eos_token_id=None) for p in asked]
    engine.close()  # drains
    for completion, prompt in zip(drained, asked):
        assert completion.result(timeout=1) == reference(model, prompt, 6)
    with pytest.raises(cg.BatcherClosed):
        engine.submit(asked[0], max_new_tokens=3)
    assert engine.health()["status"] == "stopped"

    engine = Engine(model, max_batch=1, max_length=64)
    running = engine.submit(asked[0], max_new_tokens=50, eos_token_id=None)
    next(iter(running))
    queued = engine.submit(asked[1], max_new_tokens=5)
    engine.close(drain=False)
    for completion in (running, queued):
        with pytest.raises(cg.BatcherClosed):
            completion.result(timeout=10)


def test_metrics_count_what_happened(model, engine) -> None:
    asked = prompts(18, [4, 6, 5])
    for completion in [engine.submit(p, max_new_tokens=8, eos_token_id=None) for p in asked]:
        completion.result(timeout=120)
    metrics = engine.metrics()
    assert metrics.requests == 3 and metrics.finished == {"length": 3}
    assert metrics.generated_tokens == 24
    assert metrics.steps >= 7 and 0 < metrics.occupancy <= 1
    assert 0 < metrics.ttft_p50_s <= metrics.ttft_p99_s
    assert 0 < metrics.itl_p50_s <= metrics.itl_p99_s
    text = engine.prometheus()
    assert 'cudagraphs_engine_generated_tokens_total{engine="engine"} 24' in text
    assert 'cudagraphs_engine_requests_total{engine="engine",reason="length"} 3' in text
    health = engine.health()
    assert health["status"] == "ok" and health["graphs"] is False and health["why_eager"]
    assert health["compiled"] is False


def test_ended_requests_are_not_kept(model, engine) -> None:
    # What a long-running server must not do: hold on to the requests it has answered.
    completions = [engine.submit([1 + k % 50, 2], max_new_tokens=2) for k in range(200)]
    for completion in completions:
        completion.result(timeout=120)
    kept = [weakref.ref(c) for c in completions]
    del completions, completion
    gc.collect()
    assert all(ref() is None for ref in kept)
    assert engine.rows == [] and engine.metrics().queue_depth == 0


def test_an_engine_refuses_what_it_cannot_serve(model) -> None:
    with pytest.raises(cg.ConfigError, match="max_batch must be a positive int"):
        Engine(model, max_batch=0, max_length=64)
    with pytest.raises(cg.ConfigError, match="did you mean max_length"):
        Engine(model, max_batch=2, max_lenght=64)
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with pytest.raises(cg.ConfigError, match="SDPA"):
            Engine(model, max_batch=2, max_length=64)
    finally:
        model.set_attn_implementation(before)


def test_chunk_rungs_reach_the_prefill_budget_within_the_cache() -> None:
    from cudagraphs.decoding.slot_prefill import CHUNK_RUNGS, chunk_rungs

    assert chunk_rungs(256, 4096) == list(CHUNK_RUNGS)
    assert chunk_rungs(8, 4096) == list(CHUNK_RUNGS)  # a small budget keeps the short rungs
    assert chunk_rungs(1024, 4096) == [*CHUNK_RUNGS, 512, 1024]
    assert chunk_rungs(600, 4096)[-1] == 1024  # the first rung that holds a full chunk
    assert chunk_rungs(1024, 300) == [16, 32, 64, 128, 256]  # none longer than the cache

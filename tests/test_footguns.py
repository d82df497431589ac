"""The silent traps of CUDA graphs, one test each, in the manner of tinygrad's test_jit_footguns.

Each test pins cudagraphs' behaviour on a trap that makes hand-rolled graphs (and other graph
wrappers) return plausible wrong answers: it is caught, with a clear error or the correct result.
GPU variants carry the `cuda` marker and run in scripts/gpu-check; CPU variants run where the
trap exists without a GPU (signatures are checked by the pass-through too).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from llama_decode import generate_with_scores, graph_decode, reference_tokens, tiny_llama
from stateful_models import Counting, Flipping
from torch import nn

import cudagraphs as cg

cuda = pytest.mark.cuda
cpu_quiet = pytest.mark.filterwarnings("ignore::cudagraphs.CudaGraphsWarning")


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- frozen Python values


@cpu_quiet
def test_frozen_python_constant_is_refused_when_changed() -> None:
    g = cg.graph(lambda x, scale: x * scale, torch.randn(4, device=device()), 2.0)
    x = torch.randn(4, device=device())
    torch.testing.assert_close(g(x, 2.0), x * 2)
    with pytest.raises(cg.InputMismatchError, match=r"args\[1\] is 3.0 .* captured with 2.0"):
        g(x, 3.0)


@cpu_quiet
def test_frozen_branch_on_a_python_flag_argument_is_refused() -> None:
    def fn(x: torch.Tensor, training: bool) -> torch.Tensor:
        return x * 2 if training else x

    g = cg.graph(fn, torch.randn(4, device=device()), True)
    with pytest.raises(cg.InputMismatchError, match=r"args\[1\] is False"):
        g(torch.randn(4, device=device()), False)


MODE = "double"


def by_global_mode(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if MODE == "double" else x * 3


@cuda
def test_frozen_branch_on_a_global_flag_recaptures(caplog: pytest.LogCaptureFixture) -> None:
    global MODE
    g = cg.graph(by_global_mode, torch.randn(4, device="cuda"))
    x = torch.randn(4, device="cuda")
    torch.testing.assert_close(g(x), x * 2)
    MODE = "triple"
    try:
        with caplog.at_level(logging.WARNING, logger="cudagraphs"):
            torch.testing.assert_close(g(x), x * 3)
        assert "global 'MODE' was rebound" in caplog.text
    finally:
        MODE = "double"


@cuda
def test_frozen_branch_on_a_tensor_value_fails_capture_with_the_line() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x

    with pytest.raises(cg.CaptureError) as info:
        cg.graph(fn, torch.randn(4, device="cuda"))
    assert info.value.kind == "host-sync"
    assert any(
        f.kind == "host-sync" and f.filename.endswith("test_footguns.py")
        for f in info.value.findings
    )


def test_frozen_branch_on_a_tensor_value_is_reported_by_the_doctor_on_cpu() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x

    report = cg.doctor(fn, torch.randn(4))
    assert report.blocking and any(f.kind == "host-sync" for f in report.findings)


# ---------------------------------------------------------------- containers and outputs


@cpu_quiet
def test_list_input_is_a_pytree_and_its_length_is_checked() -> None:
    g = cg.graph(lambda xs: sum(xs), [torch.randn(3, device=device()) for _ in range(3)])
    xs = [torch.randn(3, device=device()) for _ in range(3)]
    torch.testing.assert_close(g(xs), xs[0] + xs[1] + xs[2])
    with pytest.raises(cg.InputMismatchError, match=r"missing args\[0\]\[2\]"):
        g(xs[:2])


@cuda
def test_output_kept_in_a_list_across_calls_raises_instead_of_changing() -> None:
    g = cg.graph(lambda x: x + 1, torch.randn(3, device="cuda"))
    kept = [g(torch.full((3,), float(i), device="cuda")) for i in range(3)]
    torch.testing.assert_close(kept[-1], torch.full((3,), 3.0, device="cuda"))
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        kept[0].tolist()
    cloned = cg.graph(lambda x: x + 1, torch.randn(3, device="cuda"), outputs="clone")
    kept = [cloned(torch.full((3,), float(i), device="cuda")) for i in range(3)]
    assert [k[0].item() for k in kept] == [1.0, 2.0, 3.0]


@cuda
def test_output_aliasing_an_input_is_correct_then_stale() -> None:
    g = cg.graph(lambda x: x, torch.randn(3, device="cuda"))
    x = torch.randn(3, device="cuda")
    out = g(x)
    torch.testing.assert_close(out, x)
    g(torch.randn(3, device="cuda"))
    with pytest.raises(RuntimeError, match="StaleOutputError"):
        out.sum()


@cpu_quiet
def test_mutated_input_matches_eager() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x + 1

    g = cg.graph(fn, torch.randn(4, device=device()))
    x = torch.randn(4, device=device())
    expected = x * 2
    torch.testing.assert_close(g(x), expected + 1)
    torch.testing.assert_close(x, expected)


# ---------------------------------------------------------------- addresses that move


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).cuda().eval()


@cuda
def test_parameter_swapped_via_data_recaptures() -> None:
    model = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8, device="cuda"))
        model[0].weight.data = torch.randn(8, 8, device="cuda")
        x = torch.randn(2, 8, device="cuda")
        torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 1


@cuda
def test_parameter_swapped_via_data_raises_when_asked() -> None:
    model = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8, device="cuda"), on_stale="raise")
        model[2].bias.data = torch.zeros(4, device="cuda")
        with pytest.raises(cg.StaleGraphError, match=r"2\.bias now lives at new memory"):
            g(torch.randn(2, 8, device="cuda"))


@cuda
@pytest.mark.parametrize("how", ["set_", "storage resize"])
def test_parameter_moved_in_place_recaptures(how: str) -> None:
    # The Python object stays the same (no registration hook, no Module._apply): only the
    # address comparison before the replay can see these, and it must see them in its fast path.
    model = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8, device="cuda"))
        assert g.stats.guard_check == "compiled"
        weight = model[0].weight
        keep = weight.detach().clone()
        captured_at = weight.data_ptr()
        if how == "set_":
            weight.set_(torch.randn(8, 8, device="cuda"))
        else:
            weight.untyped_storage().resize_(0)  # frees the block, as FSDP does between uses
            # Blocks of this size are taken until one is the freed block (the graph's old
            # address): how many free blocks of that size the allocator hands out before it
            # depends on what ran earlier in the process, so take them until it comes.
            blockers = [torch.full_like(keep, float("nan"))]
            while blockers[-1].data_ptr() != captured_at and len(blockers) < 20_000:
                blockers.append(torch.full_like(keep, float("nan")))
            assert blockers[-1].data_ptr() == captured_at
            weight.untyped_storage().resize_(keep.nbytes)
            weight.copy_(keep * 3)
        assert weight.data_ptr() != captured_at  # what this test is about: the weight moved
        x = torch.randn(2, 8, device="cuda")
        torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 1


@cuda
def test_model_to_recaptures() -> None:
    model = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8, device="cuda"))
        # Keep the old GPU memory alive (as any other reference would), so the round trip
        # lands the parameters at new addresses while the graph's old ones still hold data.
        old = [p.detach() for p in model.parameters()]
        model.cpu()
        model.cuda()
        model[0].weight.add_(1.0)
        x = torch.randn(2, 8, device="cuda")
        torch.testing.assert_close(g(x), model(x))
    assert g.stats.recaptures == 1
    del old


@cuda
def test_reassigned_buffer_recaptures() -> None:
    bn = nn.BatchNorm1d(8).cuda().eval()
    with torch.no_grad():
        g = cg.graph(bn, torch.randn(4, 8, device="cuda"))
        bn.running_mean = torch.randn(8, device="cuda")
        x = torch.randn(4, 8, device="cuda")
        torch.testing.assert_close(g(x), bn(x))
    assert g.stats.recaptures == 1


@cuda
def test_buffers_replaced_by_module_to_recapture() -> None:
    # Module._apply puts new buffer objects straight into _buffers; the old ones stay alive
    # here, so a graph that kept reading them would silently use stale statistics.
    bn = nn.BatchNorm1d(8).cuda().eval()
    with torch.no_grad():
        g = cg.graph(bn, torch.randn(4, 8, device="cuda"))
        old = bn.running_mean
        bn.cpu()
        bn.cuda()
        bn.running_mean.add_(5.0)
        x = torch.randn(4, 8, device="cuda")
        torch.testing.assert_close(g(x), bn(x))
    assert g.stats.recaptures == 1
    del old


@cuda
def test_load_state_dict_keeps_the_graph_and_its_results_correct() -> None:
    model = mlp()
    other = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8, device="cuda"))
        model.load_state_dict(other.state_dict())
        x = torch.randn(2, 8, device="cuda")
        torch.testing.assert_close(g(x), other(x))
    assert g.stats.recaptures == 0


SHIFT = torch.zeros(4)


def shifted(x: torch.Tensor) -> torch.Tensor:
    return x + SHIFT


@cuda
def test_rebound_closure_tensor_recaptures() -> None:
    global SHIFT
    SHIFT = torch.zeros(4, device="cuda")
    g = cg.graph(shifted, torch.randn(4, device="cuda"))
    SHIFT = torch.ones(4, device="cuda")
    x = torch.randn(4, device="cuda")
    torch.testing.assert_close(g(x), x + 1)
    assert g.stats.recaptures == 1


@cuda
def test_train_eval_switch_recaptures() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).cuda().eval()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(64, 8, device="cuda"))
        model.train()
        out = g(torch.randn(64, 8, device="cuda"))
    assert (out == 0).float().mean().item() > 0.3  # dropout is active now
    assert g.stats.recaptures == 1


# ---------------------------------------------------------------- randomness and training


@cuda
def test_dropout_and_multinomial_draw_new_numbers_on_every_replay() -> None:
    def fn(x: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return nn.functional.dropout(x, 0.5), torch.multinomial(probs, 16, replacement=True)

    g = cg.graph(
        fn, torch.ones(1024, device="cuda"), torch.ones(8, 100, device="cuda"), outputs="clone"
    )
    ones, probs = torch.ones(1024, device="cuda"), torch.ones(8, 100, device="cuda")
    (m1, s1), (m2, s2) = g(ones, probs), g(ones, probs)
    assert not torch.equal(m1, m2) and not torch.equal(s1, s2)


@cuda
def test_grad_scaler_step_is_refused_at_capture_with_the_reason() -> None:
    model = nn.Linear(8, 8).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    with pytest.raises(cg.CaptureError) as info:
        cg.graph(step, torch.randn(4, 8, device="cuda"))
    assert any(f.kind == "grad-scaler" for f in info.value.findings), str(info.value)


def test_grad_scaler_step_is_reported_by_the_doctor_on_cpu() -> None:
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step(x: torch.Tensor) -> torch.Tensor:
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        return x

    report = cg.doctor(step, torch.randn(4, 8))
    assert any(f.kind == "grad-scaler" for f in report.findings)


@cuda
def test_verify_catches_code_that_behaves_differently_while_captured() -> None:
    # Some code paths check whether a capture is running and skip work then (libraries do
    # this for validation or caching); the graph then silently omits that work.
    def fn(x: torch.Tensor) -> torch.Tensor:
        if not torch.cuda.is_current_stream_capturing():
            x = x * 2
        return x + 1

    with pytest.raises(
        cg.VerificationError, match=r"out differs from eager on fresh random inputs"
    ):
        cg.graph(fn, torch.randn(4, device="cuda"), verify=True)


@cuda
def test_verify_passes_a_clean_model_and_compares_random_outputs_by_shape() -> None:
    model = mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(2, 8, device="cuda"), verify=True)
        assert g.state is cg.State.CAPTURED  # verified and kept
        x = torch.randn(2, 8, device="cuda")
        torch.testing.assert_close(g(x), model(x))
    drop = nn.Dropout(0.5).cuda().train()
    d = cg.graph(drop, torch.randn(64, device="cuda"), verify=True)  # random: shapes only
    assert d.state is cg.State.CAPTURED
    out = d(torch.ones(64, device="cuda"))
    # Dropout's own values: zeros and 1 / (1 - p), never the same mask at every replay.
    assert set(out.unique().tolist()) <= {0.0, 2.0} and out.shape == (64,)


# ---------------------------------------------------------------- real models keep state
# Warm-up, verification and the doctor run the function for real; a transformers static cache
# advances its own device counter on every call, BatchNorm its statistics, threads share one
# graph, torch.compile lives in the same process. (CPU variants: tests/test_written_state.py.)

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def llama() -> tuple:
    pytest.importorskip("transformers")
    return tiny_llama("cuda")


@cuda
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("lazy", [False, True], ids=["examples", "lazy"])
def test_static_cache_decode_equals_generate(llama: tuple, batch: int, lazy: bool) -> None:
    """Each graphed step, fed ``generate``'s previous token, chooses the token of
    ``generate``'s logits after that prefix (the model's own, before ``min_new_tokens`` holds
    the end-of-sequence token back). ``generate`` keeps a dynamic cache, whose attention sums
    in another order than the static cache's: where its two best logits are within float32
    rounding of each other (a near tie) either choice is right, and a few such steps (under
    5 %) may differ. A wrong cache (a position off, a stale key) changes nearly every token."""
    model, config = llama
    torch.manual_seed(batch + 10 * lazy)
    prompt = torch.randint(0, 512, (batch, 8), device="cuda")
    sequences, logits = generate_with_scores(model, prompt, 64, raw=True)
    fed = sequences[:, prompt.shape[1] :]
    got, cache, graphed = graph_decode(model, config, prompt, 64, lazy=lazy, forced=fed)
    assert graphed.state is cg.State.CAPTURED
    best = logits.float().topk(2, dim=-1).values
    near_tie = best[..., 0] - best[..., 1] < 1e-4 * best[..., 0].abs().max()
    differ = got != logits.argmax(-1)
    assert not (differ & ~near_tie).any() and differ.float().mean() < 0.05, (
        differ.float().mean().item(),
        (differ & ~near_tie).nonzero().tolist(),
    )
    # Eager's cache after prefill (8) and 63 decode steps; warm-up's advances were put back.
    assert all(layer.cumulative_length.item() == 8 + 63 for layer in cache.layers)
    if not lazy:
        assert graphed.stats.state_writes >= 3 and graphed.stats.restored_bytes > 0


@cuda
def test_verify_passes_the_decode_step_and_leaves_the_cache(llama: tuple) -> None:
    model, config = llama
    prompt = torch.randint(0, 512, (2, 8), device="cuda")
    expected = reference_tokens(model, prompt, 16)
    got, _, _ = graph_decode(model, config, prompt, 16, verify=True)
    assert torch.equal(got, expected)


@cuda
def test_verify_catches_a_frozen_counter_on_the_gpu() -> None:
    table = torch.randn(64, 8, device="cuda")
    count = [0]

    def step(x: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        return x + table[count[0]]

    with pytest.raises(cg.VerificationError, match=r"count\[0\]"):
        cg.graph(step, torch.randn(8, device="cuda"), verify=True)


@cuda
def test_doctor_on_the_decode_step_leaves_the_cache_and_lists_its_writes(llama: tuple) -> None:
    from transformers import StaticCache

    from cudagraphs.decoding.kv_cache import cache_keyword

    model, config = llama
    cache = StaticCache(config=config, max_cache_len=24)
    prompt = torch.randint(0, 512, (2, 8), device="cuda")
    keyword = cache_keyword(model)  # `cache` in newer transformers
    with torch.no_grad():
        model(prompt, **{keyword: cache}, use_cache=True)

        def decode(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
            out = model(input_ids=token, **{keyword: cache}, cache_position=position)
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


@cuda
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_doctor_finds_nothing_blocking_on_transformers_forwards(llama: tuple, family: str) -> None:
    transformers = pytest.importorskip("transformers")
    if family == "llama":
        model = llama[0]
    else:
        config = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=512)
        model = transformers.GPT2LMHeadModel(config).cuda().eval()
    # Seeded: the input is the same whatever ran before in this process.
    ids = torch.randint(
        0, 512, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(16)
    )
    with torch.no_grad():
        report = cg.doctor(model, ids)
        graphed = cg.graph(model, ids)
        expected = model(ids).logits
        # fp32; the recorded matmuls may pick other cuBLAS kernels: tolerance scaled to the
        # logits' size (this random Llama's reach about 1e2)
        scale = expected.abs().max().item()
        torch.testing.assert_close(graphed(ids).logits, expected, rtol=1e-4, atol=1e-5 * scale)
    assert not report.blocking, str(report)


@cuda
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


@cuda
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


@cuda
def test_an_output_one_thread_holds_is_never_overwritten_by_another_thread() -> None:
    model = nn.Linear(8, 8).cuda().eval()
    results: list[tuple[torch.Tensor, torch.Tensor]] = []

    def other() -> None:
        with torch.no_grad():  # grad mode is per thread
            b = torch.randn(4, 8, device="cuda")
            results.append((g(b), model(b)))

    with torch.no_grad():
        g = cg.graph(model, torch.randn(4, 8, device="cuda"))
        a = torch.randn(4, 8, device="cuda")
        mine = g(a)
        with pytest.warns(cg.CudaGraphsWarning, match="second thread"):
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
        theirs, expected = results[0]
        torch.testing.assert_close(theirs, expected)  # answered eagerly: `mine` is still held
        torch.testing.assert_close(mine, model(a))  # still readable, still this call's result
        assert g.stats.eager_calls == 1
        replays = g.stats.replays
        del mine  # nobody holds a zero-copy output now: every thread replays, and gets a copy
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        theirs, expected = results[1]
        torch.testing.assert_close(theirs, expected)
        assert g.stats.replays == replays + 1 and g.stats.eager_calls == 1


@cuda
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


@cuda
def test_graph_over_torch_compile_of_the_decode_step(llama: tuple) -> None:
    model, config = llama
    prompt = torch.randint(0, 512, (1, 8), device="cuda")
    expected = reference_tokens(model, prompt, 24)
    torch._dynamo.reset()
    got, _, graphed = graph_decode(model, config, prompt, 24, wrap=torch.compile, warmup=3)
    assert graphed.state is cg.State.CAPTURED
    assert torch.equal(got, expected)


# ---------------------------------------------------------------- what a graph freezes beyond tensors


def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).cuda().eval()


@cuda
def test_autocast_at_call_is_checked_against_the_capture() -> None:
    model = small_mlp()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        fp32 = cg.graph(model, x)
        with (
            torch.autocast("cuda", dtype=torch.bfloat16),
            pytest.raises(cg.ModeMismatchError, match=r"autocast\(cuda\) was off"),
        ):
            fp32(x)  # eager here returns bf16: the fp32 recording must not answer
        with torch.autocast("cuda", dtype=torch.bfloat16):
            amp = cg.graph(model, x)
            y = torch.randn(8, 64, device="cuda")
            got, expected = amp(y), model(y)
            assert got.dtype == expected.dtype == torch.bfloat16
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
        with pytest.raises(cg.ModeMismatchError, match=r"autocast\(cuda\) was bfloat16"):
            amp(y)  # the reverse


@cuda
def test_tf32_convolutions_switched_off_after_capture_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A recording holds the TF32 convolution kernels cuDNN chose at capture; with the flag off
    eager runs full fp32 ones, which PyTorch's global-state guard does not notice."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 8, 3))
    model = model.cuda().eval()
    x = torch.randn(4, 16, 32, 32, device="cuda")
    with torch.no_grad():
        g = cg.graph(model, x)
        y = torch.randn(4, 16, 32, 32, device="cuda")
        torch.testing.assert_close(g(y), model(y), rtol=1e-2, atol=1e-2)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        with pytest.raises(cg.ModeMismatchError, match="TF32 in cuDNN"):
            g(y)
        exact = cg.graph(model, x)  # captured with the flag off: full fp32 kernels
        torch.testing.assert_close(exact(y), model(y), rtol=1e-5, atol=1e-5)


@cuda
def test_a_call_that_needs_gradients_raises() -> None:
    model = small_mlp()
    with torch.no_grad():
        g = cg.graph(model, torch.randn(8, 64, device="cuda"))
    with pytest.raises(cg.GradientsNotRecordedError, match=r"cg\.graph_autograd"):
        g(torch.randn(8, 64, device="cuda"))
    with pytest.raises(cg.GradientsNotRecordedError):
        cg.graph(small_mlp(), torch.randn(8, 64, device="cuda"))  # captured with grad on


@cuda
@torch.no_grad()
def test_python_state_the_forward_changes_is_refused_at_capture() -> None:
    x = torch.randn(8, 64, device="cuda")
    with pytest.raises(cg.FrozenStateError, match=r"Counting\.calls"):
        cg.graph(Counting(small_mlp()), x)
    with pytest.raises(cg.FrozenStateError, match=r"Flipping\.flip"):
        cg.graph(Flipping(small_mlp()), x)
    counted = Counting(small_mlp())
    g = cg.graph(counted, x, harmless_state=("calls",))
    for _ in range(3):
        y = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(g(y), counted.net(y))


class InPlaceFlag(nn.Module):
    """A flag kept in a list (or a NumPy array) that the forward changes in place and
    branches on."""

    def __init__(self, net: nn.Module, holder: str) -> None:
        import numpy

        super().__init__()
        self.net = net
        self.state = [0] if holder == "list" else numpy.zeros(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state[0] += 1
        y = self.net(x)
        return -y if self.state[0] % 2 else y


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("holder", ["list", "numpy array"])
@cuda
@torch.no_grad()
def test_a_list_or_array_the_forward_changes_in_place_is_refused_at_capture(
    holder: str, compile: bool
) -> None:
    x = torch.randn(8, 64, device="cuda")
    model = InPlaceFlag(small_mlp(), holder)
    with pytest.raises(cg.FrozenStateError, match=r"InPlaceFlag\.state"):
        cg.graph(model, x, compile=compile)
    assert model.state[0] == 0  # the library's runs were put back


class LayerDrop(nn.Module):
    """A layer dropped at random with Python's global generator (hand-written layer drop)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        return self.net(x) if random.random() < 0.5 else x


@pytest.mark.parametrize("compile", [False, True])
@cuda
@torch.no_grad()
def test_a_draw_from_python_s_random_generator_is_refused_at_capture(compile: bool) -> None:
    """Every replay would repeat the recorded draw (the layer always run or always skipped):
    refused, under torch.compile too (Dynamo draws the numbers in Python before each call)."""
    x = torch.randn(8, 64, device="cuda")
    with pytest.raises(cg.FrozenStateError, match="draws from random"):
        cg.graph(LayerDrop(small_mlp()), x, compile=compile)


def hammer(
    call: Any, model: nn.Module, pattern: str, threads: int = 8, calls: int = 500
) -> list[int]:
    """``threads`` threads x ``calls`` calls, each result compared with eager: [wrong, raised]
    (raising is allowed by the contract, but none is expected here)."""
    counts = [0, 0]
    failures: list[str] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        torch.set_grad_enabled(False)  # per thread: inference in every worker
        for _ in range(calls):
            x = torch.randn(8, 64, device="cuda", generator=generator)
            try:
                if pattern == "clone":
                    y = call(x).clone()
                else:
                    y = call(x)
                    y = y + 0  # a read of the output
                expected = model(x)
                ok = torch.allclose(y, expected, rtol=1e-4, atol=1e-4)
                error = None
            except RuntimeError as failure:
                ok, error = True, failure
            with lock:
                if not ok:
                    counts[0] += 1
                if error is not None:
                    counts[1] += 1
                    failures.append(str(error).splitlines()[0])

    with torch.no_grad():
        pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    assert not failures, failures[:3]
    return counts


@cuda
@pytest.mark.parametrize("pattern", ["clone", "read"])
@pytest.mark.parametrize("kind", ["plain", "bucketed"])
def test_threads_never_see_another_calls_output(kind: str, pattern: str) -> None:
    model = small_mlp()
    with torch.no_grad(), pytest.warns(cg.CudaGraphsWarning, match="second thread"):
        example = torch.randn(8, 64, device="cuda")
        g = cg.graph(model, example, **({"buckets": {"B": [4, 8]}} if kind == "bucketed" else {}))
        g(example)  # the main thread calls first: the workers are the "second thread"
        wrong, raised = hammer(g, model, pattern)
    assert wrong == 0 and raised == 0


@cuda
def test_random_draws_in_a_device_loop_are_refused() -> None:
    def walk(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cg.while_loop(
            lambda x, i: i < 8, lambda x, i: (x + torch.randn_like(x), i + 1), (x, i),
            max_iterations=8,
        )  # fmt: skip

    start = (torch.zeros(4096, device="cuda"), torch.zeros((), dtype=torch.long, device="cuda"))
    with pytest.raises(cg.RandomInLoopError, match="randn_like") as info:
        cg.graph(walk, *start)
    assert "before the loop" in str(info.value)

    def branchy(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def body(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            step = cg.cond(i % 2 == 0, lambda v: v + torch.randn_like(v), lambda v: v, (x,))
            return step, i + 1

        return cg.while_loop(lambda x, i: i < 8, body, (x, i), max_iterations=8)

    with pytest.raises(cg.CaptureError, match="inside the body of another one"):
        cg.graph(branchy, *start)  # a branch inside a loop body: refused before any draw
    noise = torch.randn(8, 4096, device="cuda")

    def predrawn(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cg.while_loop(
            lambda x, i: i < 8,
            lambda x, i: (x + noise.index_select(0, i.view(1))[0], i + 1),
            (x, i),
            max_iterations=8,
        )

    g = cg.graph(predrawn, *start, outputs="clone")
    walks = []
    for _ in range(4):
        noise.normal_()
        walks.append(g(*start)[0])
    variance = torch.stack(walks).var().item()
    assert 8 * 0.9 < variance < 8 * 1.1


@cuda
@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_sliding_window_decoders_give_generate_tokens_past_the_window(kind: str) -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

    from cudagraphs.decoding.decoder import Decoder

    torch.manual_seed(3)
    common = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=16, max_position_embeddings=128,
    )  # fmt: skip
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(num_hidden_layers=2, **common))
    else:
        model = Gemma2ForCausalLM(Gemma2Config(num_hidden_layers=4, head_dim=16, **common))
    model = model.cuda().eval()
    prompt = torch.randint(1, 512, (3, 12), device="cuda")
    with torch.no_grad():
        expected = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40,
            min_new_tokens=40, do_sample=False, cache_implementation="static", pad_token_id=0,
        )  # fmt: skip
    decoder = Decoder(model, max_batch=4, max_length=52)
    assert all(g.state is cg.State.CAPTURED for g in decoder.graphs.values())
    got = decoder.generate(prompt, max_new_tokens=40, eos_token_id=None)
    assert torch.equal(got, expected)

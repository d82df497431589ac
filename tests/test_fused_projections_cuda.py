"""Fused projections on a real GPU: the compiled, captured Decoder with q/k/v and gate/up fused
gives an unfused model's ``generate`` tokens in float32, sees an in-place weight update between
two requests, and never reads a replaced parameter through the old buffer."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.cuda
transformers = pytest.importorskip("transformers")

from llama_decode import generate_with_scores  # noqa: E402
from test_decoder_cuda import assert_same_tokens  # noqa: E402

from cudagraphs.decoding.decoder import Decoder  # noqa: E402
from cudagraphs.tools.workloads import random_llama  # noqa: E402

PROMPT, NEW = 16, 24


def _check(got: torch.Tensor, model: nn.Module, prompt: torch.Tensor) -> None:
    """``got`` is ``generate``'s tokens, up to a near-tie of generate's own (see
    ``assert_same_tokens``: the fused product sums in another order)."""
    sequences, scores = generate_with_scores(model, prompt, NEW)
    assert assert_same_tokens(got, sequences, scores) <= 1  # a row at a near-tie at most


@pytest.mark.parametrize("compile", [False, True])
def test_fused_decoding_follows_in_place_updates_and_replaced_parameters(compile: bool) -> None:
    model = random_llama("llama-512", "cuda")
    unfused = copy.deepcopy(model)
    decoder = Decoder(model, max_batch=2, max_length=PROMPT + NEW, compile=compile)
    assert decoder.stats.fused_groups == 2 * len(model.model.layers), decoder.stats.unfused
    torch.manual_seed(2)
    prompt = torch.randint(0, 32000, (2, PROMPT), device="cuda")
    first = decoder.generate(prompt, max_new_tokens=NEW, eos_token_id=None)
    _check(first, unfused, prompt)
    # Another set of random weights, loaded in place between two requests: no recapture.
    generator = torch.Generator(device="cuda").manual_seed(7)
    weights = {
        name: torch.randn(t.shape, generator=generator, device="cuda", dtype=t.dtype) * 0.3
        for name, t in model.state_dict().items()
    }
    model.load_state_dict(weights)
    unfused.load_state_dict(weights)
    second = decoder.generate(prompt, max_new_tokens=NEW, eos_token_id=None)
    _check(second, unfused, prompt)
    assert not torch.equal(second, first)
    assert decoder.stats.recaptures == 0
    # A new Parameter object for one projection: the guards capture again, and the product
    # reads the new parameter, not the old buffer.
    attention = model.model.layers[1].self_attn
    new = torch.randn_like(attention.v_proj.weight) * 0.3
    attention.v_proj.weight = nn.Parameter(new.clone(), requires_grad=False)
    unfused.model.layers[1].self_attn.v_proj.weight = nn.Parameter(new.clone())
    third = decoder.generate(prompt, max_new_tokens=NEW, eos_token_id=None)
    assert decoder.stats.recaptures >= 1
    _check(third, unfused, prompt)


def test_fusing_gives_the_old_weights_memory_back() -> None:
    """The weights copied into fused buffers free their old storages, and fusing gives back
    every segment of the caching allocator that this leaves unused: ``memory_reserved()`` is
    what ``torch.cuda.empty_cache()`` would leave, and the live memory is the same weights.
    Without it, the old storages would stay reserved, unused. The 1.1 B Llama shape: its gate
    and up weights are large enough to hold segments of their own."""
    from cudagraphs.decoding.fused_projections import fuse_projections

    model = random_llama("llama-2048", "cuda", torch.bfloat16)
    # What earlier tests of this worker left for the collector would otherwise be freed in
    # the middle of the measurement (1.5 MiB once, after the FSDP tests' models).
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    allocated = torch.cuda.memory_allocated()
    report = fuse_projections(model)
    assert len(report.fused) == 2 * len(model.model.layers)
    assert abs(torch.cuda.memory_allocated() - allocated) <= 2**20  # the same weights, moved
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == reserved, (
        reserved - torch.cuda.memory_reserved()
    ) / 2**20
    del model
    torch.cuda.empty_cache()

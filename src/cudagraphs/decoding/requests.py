"""What the decoder accepts: models it can graph and requests it can serve, checked up front
with errors that say what, why and the fix; and ``generate``'s end-of-sequence rules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..core import LIBRARY_SETTING, compat
from ..errors import ConfigError, explain
from ..options import check_positive_int
from .grouped_attention import takes_sdpa_mask

__all__ = [
    "MAX_EOS",
    "check_attention",
    "check_compile",
    "check_eager",
    "check_left_padding",
    "check_model",
    "check_request",
    "check_until_eos",
    "describe",
    "stop_ids",
    "trim_finished",
]

MAX_EOS = 8  # end-of-sequence ids one graph can test against (unused slots hold -1)


def check_compile(compile: Any) -> bool:
    """``Decoder(compile=...)``: ``False``, ``True``, a ``torch.compile`` mode name, or a
    mapping of Inductor options. Returns whether the decoder compiles."""
    if isinstance(compile, Mapping):
        if all(isinstance(key, str) for key in compile):
            return True
    elif isinstance(compile, bool):
        return compile
    elif isinstance(compile, str) and compile in compat.compile_modes():
        return True
    raise ConfigError(
        explain(
            f"compile must be a bool, a torch.compile mode name ({', '.join(compat.compile_modes())}) "
            f"or a mapping of Inductor options, got {compile!r}",
            "it is handed to torch.compile as its mode= or its options=",
            "pass compile=True, compile='max-autotune-no-cudagraphs' or "
            "compile={'coordinate_descent_tuning': True}",
        )
    )


def check_eager(eager: tuple[Any, ...], compile: Any, until_eos: bool) -> None:
    """``Decoder(eager=[...])`` runs blocks on the host between graphs: not inside a compiled
    graph or a loop on the device."""
    if eager and (compile or until_eos):
        raise ConfigError(
            explain(
                "Decoder(eager=[...]) cannot be combined with "
                + ("compile" if compile else "until_eos=True"),
                "an eager step runs on the host between graphs, which neither a compiled graph "
                "nor a loop on the device can stop for",
                "pass compile=False and until_eos=False with eager=[...]; or, for a transformers "
                f"MoE model, {LIBRARY_SETTING}; then drop eager",
            )
        )


def check_model(model: Any) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate") or not hasattr(config, "vocab_size"):
        raise ConfigError(
            explain(
                f"Decoder needs a transformers causal LM, got {type(model).__name__}",
                "it decodes through the model's forward with a transformers StaticCache",
                "pass e.g. AutoModelForCausalLM.from_config(config) or .from_pretrained(...)",
            )
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(
            explain(
                f"{type(model).__name__} is an encoder-decoder model",
                "the decoder graphs one decoder-only forward per step over one StaticCache",
                "use a decoder-only causal LM (Llama, Mistral, Qwen2, GPT-2, ...)",
            )
        )
    if model.training:
        raise ConfigError(
            explain(
                f"{type(model).__name__} is in training mode",
                "dropout would be recorded with one fixed mask and replayed on every token",
                "call model.eval() before building the Decoder",
            )
        )


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def check_request(
    input_ids: Any,
    max_new_tokens: Any,
    attention_mask: torch.Tensor | None,
    *,
    device: torch.device,
    max_batch: int,
    max_length: int,
) -> tuple[int, int, torch.Tensor | None]:
    """``(batch, prompt length, padding)`` of a request the decoder can serve, ``padding`` the
    boolean mask of real tokens where some prompt is padded (else ``None``); else ConfigError."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ConfigError(
            explain(
                f"input_ids must be a 2-D tensor [batch, length], got {describe(input_ids)}",
                "each row is one prompt",
                "pass tokenizer(texts, return_tensors='pt').input_ids.to(device)",
            )
        )
    if input_ids.dtype != torch.long or input_ids.device != device:
        raise ConfigError(
            explain(
                f"input_ids must be int64 on {device}, got {input_ids.dtype} on {input_ids.device}",
                "the prompt is written into the decoder's buffers on the model's device",
                f"pass input_ids.to({str(device)!r}, torch.long)",
            )
        )
    batch, length = input_ids.shape
    check_positive_int("max_new_tokens", max_new_tokens, "it is how many tokens to generate")
    if not 1 <= batch <= max_batch or length < 1:
        raise ConfigError(
            explain(
                f"input_ids has batch {batch} and length {length}; this decoder takes "
                f"batches of 1..{max_batch} and non-empty prompts",
                "the largest batch rung bounds the batch (its cache is allocated once)",
                "split the request, or build the Decoder with a larger max_batch",
            )
        )
    if length + max_new_tokens > max_length:
        raise ConfigError(
            explain(
                f"prompt length {length} + max_new_tokens {max_new_tokens} exceeds "
                f"max_length={max_length}",
                "the KV cache was allocated for max_length positions",
                "ask for fewer new tokens, or build the Decoder with a larger max_length",
            )
        )
    padding = None if attention_mask is None else check_left_padding(attention_mask, input_ids)
    return batch, length, padding


def check_left_padding(mask: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
    """An attention mask the decoder can take: the prompts' shape, zeros only on the left (the
    padding of shorter prompts), at least one real token per row. Returns it as booleans on
    the prompts' device, or ``None`` when nothing is padded."""
    if not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape:
        raise ConfigError(
            explain(
                f"attention_mask must be a tensor of the prompts' shape {tuple(input_ids.shape)}, "
                f"got {describe(mask)}",
                "it marks which prompt tokens are real (1) and which are padding (0)",
                "pass tokenizer(..., padding=True, return_tensors='pt').attention_mask",
            )
        )
    real = mask.to(device=input_ids.device) != 0
    if bool((real[:, :-1] & ~real[:, 1:]).any()) or not bool(real[:, -1].all()):
        raise ConfigError(
            explain(
                "attention_mask has padding after a real token (right padding or holes)",
                "decoding appends to the end of every row, so padding must come first",
                "pad on the left: tokenizer.padding_side = 'left'",
            )
        )
    return None if bool(real.all()) else real


def check_attention(model: Any) -> None:
    """Left-padded decoding hands the model a prepared boolean 4-D mask, which the SDPA
    attention takes as given; refuse other attention implementations."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if not takes_sdpa_mask(model):
        raise ConfigError(
            explain(
                f"prompts with padding need the model's SDPA attention, it uses {implementation!r}",
                "each decode step passes which cache positions every row attends to as a boolean "
                "mask, as SDPA reads it",
                "load the model with attn_implementation='sdpa', or send prompts of equal length",
            )
        )


def stop_ids(model: Any, eos_token_id: Any, pad_token_id: int | None) -> tuple[list[int], int]:
    """End-of-sequence ids and the pad id: the caller's, else the model's generation config."""
    config = getattr(model, "generation_config", None)
    if eos_token_id == -1:
        eos_token_id = getattr(config, "eos_token_id", None)
    eos = (
        []
        if eos_token_id is None
        else [eos_token_id]
        if isinstance(eos_token_id, int)
        else list(eos_token_id)
    )
    if len(eos) > MAX_EOS or not all(isinstance(e, int) and e >= 0 for e in eos):
        raise ConfigError(
            explain(
                f"eos_token_id must be up to {MAX_EOS} non-negative ints, got {eos_token_id!r}",
                "the graph compares each new token with a fixed-size list of ids",
                "pass eos_token_id=tokenizer.eos_token_id, or None to never stop early",
            )
        )
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    return eos, int(pad_token_id)


def trim_finished(out: torch.Tensor, length: int, eos: list[int]) -> torch.Tensor:
    """Cut after the step at which every row had emitted an end-of-sequence id (as generate)."""
    new = out[:, length:]
    hit = torch.isin(new, torch.tensor(eos, device=out.device))
    ended = hit.any(dim=1)
    if not bool(ended.all()):
        return out
    last = int(hit.int().argmax(dim=1).max()) + 1
    return out[:, : length + last]


def check_until_eos(until_eos: bool, do_sample: bool, steps_per_graph: int) -> None:
    """``until_eos`` decodes greedily, one step per iteration of a loop on the device."""
    if until_eos and (do_sample or steps_per_graph != 1):
        raise ConfigError(
            explain(
                "until_eos=True decodes greedily, one step per loop iteration",
                "in a loop on the device the random numbers of sampling would repeat every "
                "step, and steps_per_graph counts launches, of which there is one",
                "leave do_sample and steps_per_graph out with until_eos=True",
            )
        )

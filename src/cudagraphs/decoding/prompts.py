"""What one request to an :class:`~.engine.Engine` must be, checked on the caller's thread
before it is queued: a bad request is refused alone (:class:`~cudagraphs.BadRequestError`,
saying what, why and the fix) and never reaches the running batch.

Right: ``engine.submit([1, 15, 27], max_new_tokens=32)`` (a list of ids, or a 1-D integer
tensor). Wrong: ``engine.submit(torch.tensor([[1.0, 15.0]]), ...)``: float ids are refused
(an id is an index, and a float one would be truncated silently), as are ids outside the
vocabulary and prompts that do not fit the cache with their new tokens.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import BadRequestError, ConfigError, explain
from .requests import stop_ids
from .sampling import check_sampling

__all__ = ["EngineRequest", "check_engine_request"]


@dataclass(frozen=True)
class EngineRequest:
    """A checked request: the prompt's ids and the settings of its decoding."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float  # 0: greedy
    top_k: int | None
    top_p: float | None
    seed: int
    eos: tuple[int, ...]


def _refuse(what: str, why: str, fix: str) -> BadRequestError:
    return BadRequestError(explain(what, why, fix))


def _prompt_ids(prompt: Any) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise _refuse(
                f"prompt must hold integer token ids, got a {prompt.dtype} tensor",
                "an id is an index into the vocabulary; another dtype would be cast silently",
                "pass tokenizer(text).input_ids, or the tensor .long()",
            )
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1:
            raise _refuse(
                f"prompt must be one sequence of ids, got a tensor of shape {tuple(prompt.shape)}",
                "each request is one prompt; the engine batches requests itself",
                "submit each row as its own request",
            )
        return [int(i) for i in prompt.tolist()]
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise _refuse(
            f"prompt must be a list of token ids or a 1-D integer tensor, got "
            f"{type(prompt).__name__}",
            "the engine decodes token ids; text needs a tokenizer",
            "pass tokenizer(text).input_ids (the HTTP server takes text where it has a tokenizer)",
        )
    bad = [i for i in prompt if not isinstance(i, int) or isinstance(i, bool)]
    if bad:
        raise _refuse(
            f"prompt must hold ints, got {bad[0]!r} among them",
            "an id is an index into the vocabulary",
            "pass a list of ints",
        )
    return list(prompt)


def check_engine_request(
    prompt: Any,
    *,
    max_new_tokens: Any,
    do_sample: Any,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    seed: Any,
    eos_token_id: Any,
    model: Any,
    max_length: int,
) -> EngineRequest:
    """The request, checked; see the module doc. ``eos_token_id=-1``: the model's."""
    ids = _prompt_ids(prompt)
    vocab = model.config.vocab_size
    if not ids:
        raise _refuse(
            "prompt is empty", "the first new token is chosen from the prompt's last position",
            "pass at least one id (a tokenizer's beginning-of-sequence id, say)",
        )  # fmt: skip
    outside = [i for i in ids if not 0 <= i < vocab]
    if outside:
        raise _refuse(
            f"prompt holds id {outside[0]}, outside the vocabulary [0, {vocab})",
            "an id indexes the model's embedding table",
            "tokenize with the model's own tokenizer",
        )
    if (
        not isinstance(max_new_tokens, int)
        or isinstance(max_new_tokens, bool)
        or max_new_tokens < 1
    ):
        raise _refuse(
            f"max_new_tokens must be a positive int, got {max_new_tokens!r}",
            "it bounds how many tokens the request decodes", "pass max_new_tokens=64, say",
        )  # fmt: skip
    if len(ids) + max_new_tokens > max_length:
        raise _refuse(
            f"a prompt of {len(ids)} ids with max_new_tokens={max_new_tokens} needs "
            f"{len(ids) + max_new_tokens} cache positions, and the engine has max_length="
            f"{max_length}",
            "every slot of the cache holds max_length positions",
            f"shorten the prompt or ask for at most {max(0, max_length - len(ids))} new tokens, "
            "or build the engine with a larger max_length",
        )
    if not isinstance(do_sample, bool):
        raise _refuse(
            f"do_sample must be True or False, got {do_sample!r}",
            "it chooses between greedy decoding and sampling", "pass do_sample=True or False",
        )  # fmt: skip
    if do_sample:
        check_sampling(temperature, top_k, top_p, BadRequestError)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise _refuse(
            f"seed must be a non-negative int or None, got {seed!r}",
            "it picks the request's own stream of random numbers",
            "pass seed=1234, or None for a fresh one",
        )
    try:
        eos, _ = stop_ids(model, eos_token_id, None)
    except ConfigError as error:  # a request's own setting: refused alone
        raise BadRequestError(str(error)) from None
    if any(e >= vocab for e in eos):
        raise _refuse(
            f"eos_token_id holds {max(eos)}, outside the vocabulary [0, {vocab})",
            "a request ends when it emits one of these ids", "pass the tokenizer's eos id",
        )  # fmt: skip
    return EngineRequest(
        prompt=ids,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature) if do_sample else 0.0,
        top_k=top_k if do_sample else None,
        top_p=top_p if do_sample else None,
        # The operating system's numbers, not the random module's: a draw from the shared
        # generator here, on the caller's thread, would change it while the engine's thread
        # records a step, and the recording's check would take the step for one that draws.
        seed=secrets.randbits(62) if seed is None else seed,
        eos=tuple(eos),
    )
